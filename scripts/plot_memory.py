"""Plot GPU memory over time for vanilla vLLM and kvelastic runs (JSON from vllm_run.py).

    python scripts/plot_memory.py RUN1.json RUN2.json --png memory.png --md memory.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    start = next(t for t, label in data["marks"] if label == "engine ready")
    data["series"] = [(t - start, m / 2**30) for t, m in data["memory"] if t >= start - 1]
    data["label"] = "kvelastic" if data["kvelastic"] == "1" else "vanilla vLLM"
    data["phases"] = [(t - start, label) for t, label in data["marks"]]
    return data


def table(runs: list[dict], step: float) -> str:
    horizon = min(r["series"][-1][0] for r in runs)
    lines = ["| t (s) after engine ready | " + " | ".join(f"{r['label']} GiB" for r in runs) + " |",
             "|---:|" + "---:|" * len(runs)]
    t = 0.0
    while t <= horizon:
        values = [min(r["series"], key=lambda s, t=t: abs(s[0] - t))[1] for r in runs]
        lines.append(f"| {t:.0f} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
        t += step
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("runs", nargs="+")
    p.add_argument("--png", required=True)
    p.add_argument("--md", required=True)
    p.add_argument("--step", type=float, default=2.0)
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load(path) for path in args.runs]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in runs:
        ax.plot([t for t, _ in r["series"]], [m for _, m in r["series"]], label=r["label"])
    for t, label in runs[-1]["phases"]:
        if label != "engine ready":
            ax.axvline(t, color="grey", linestyle=":", linewidth=0.8)
            ax.annotate(label, (t, ax.get_ylim()[1] * 0.5), rotation=90, fontsize=7, color="grey")
    ax.set_xlabel("seconds after the engine is ready")
    ax.set_ylabel("GPU memory used (GiB, nvidia-smi)")
    ax.set_title("GPU memory of one vLLM engine: load, then idle")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    Path(args.md).write_text(table(runs, args.step) + "\n")
    print(table(runs, args.step))


if __name__ == "__main__":
    main()
