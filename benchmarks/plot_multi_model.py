"""Plot runs of ``benchmarks/multi_model.py``: each server's GPU memory stacked, busy periods marked.

One row per result file: above, the GPU memory of every server stacked (NVML's
per-process numbers, put to servers by their ``--port``), what no server owns
in grey, and each model's busy periods as a coloured bar along the top; below,
every request's TTFT at its send time (log scale) with the SLO line. Where the
processes could not be matched to servers (a container that sees host pids),
the kvelastic account's mapped KV bytes per member are stacked instead, and
failing those the GPU's total. Runs where matplotlib is installed (not needed
on the GPU machine: plot the JSON afterwards)::

    python3 benchmarks/plot_multi_model.py static.json kvelastic.json --png multi_model.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.mmbench.summary import memory_by_server, workload_of  # noqa: E402

GIB = 1 << 30


def stacked_memory(result: dict[str, Any]) -> tuple[list[float], dict[str, list[float]], str]:
    """(times since load start, GiB per layer, what the layers are), the best source the run has."""
    models, start = result["workload"]["models"], result["load_start_s"]
    memory = memory_by_server(result.get("memory", {}), {s["port"]: s["model"] for s in result["servers"]})
    series = memory["series"]
    if memory["per_server"]:
        layers = {m: [s["servers"][m] / GIB for s in series] for m in models}
        layers["other processes"] = [max(0, s["other"]) / GIB for s in series]
        return [s["t"] - start for s in series], layers, "GPU memory per server (NVML, by process)"
    account = [s for s in result.get("account", {}).get("samples", []) if s["accounts"]]
    if account:
        members = [s["accounts"][0]["members"] for s in account]
        layers = {m: [ms.get(m, {}).get("mapped_bytes", 0) / GIB for ms in members] for m in models}
        return [s["t"] - start for s in account], layers, "KV bytes mapped per instance (kvelastic account)"
    return [s["t"] - start for s in series], {"GPU total": [s["used"] / GIB for s in series]}, "GPU memory used"


def draw_memory(ax: Any, result: dict[str, Any], colors: dict[str, str]) -> None:
    times, layers, what = stacked_memory(result)
    w = workload_of(result)
    band = 0.05
    if times:
        ax.stackplot(times, *layers.values(), labels=list(layers),
                     colors=[colors.get(name, "lightgrey") for name in layers], alpha=0.8)
        top = max(map(sum, zip(*layers.values())), default=0.0)
        ax.set_ylim(0, max(top, 1e-3) / (1 - band * (len(w.models) + 1)))  # room for the busy bars
    for m, model in enumerate(w.models):  # one bar per model along the top, in the axes' height fraction
        spans = [(a, b - a) for a, b in w.busy_windows(m)]
        ax.broken_barh(spans, (1 - band * (m + 1), band * 0.8), transform=ax.get_xaxis_transform(),
                       color=colors[model], alpha=0.9)
        for a, width in spans:
            ax.axvspan(a, a + width, color=colors[model], alpha=0.06)
    ax.set(ylabel="GiB", title=f"{result['config']}: {what if times else 'no memory samples'}; "
                              f"bars on top: busy periods")
    if times:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def draw_ttft(ax: Any, result: dict[str, Any], colors: dict[str, str]) -> None:
    timed = [r for r in result["requests"] if not r["probe"] and r["ttft_s"] is not None]
    for model in result["workload"]["models"]:
        mine = [r for r in timed if r["model"] == model]
        ax.scatter([r["send_s"] for r in mine], [r["ttft_s"] for r in mine], s=3, color=colors[model], label=model)
    failed = [r for r in result["requests"] if not r["probe"] and r["status"] != "ok"]
    if failed:
        ax.scatter([r["send_s"] for r in failed], [result["slo"]["ttft_s"]] * len(failed), marker="x", s=12,
                   color="red", label=f"not ok ({len(failed)})")
    ax.axhline(result["slo"]["ttft_s"], color="black", lw=0.8, ls="--", label="TTFT SLO")
    ax.set(yscale="log", ylabel="TTFT (s)", xlabel="seconds since the load started")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot(results: list[dict[str, Any]], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results[0]["workload"]["models"]
    colors = {model: f"C{i}" for i, model in enumerate(models)}
    fig, axes = plt.subplots(2 * len(results), 1, figsize=(12, 4.2 * len(results)), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2] * len(results)})
    for i, result in enumerate(results):
        draw_memory(axes[2 * i][0], result, colors)
        draw_ttft(axes[2 * i + 1][0], result, colors)
    horizon = max(r["load_end_s"] - r["load_start_s"] for r in results)
    for ax in axes[:, 0]:
        ax.set_xlim(-5, horizon + 5)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="JSON files written by multi_model.py run")
    p.add_argument("--png", required=True)
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_multi_model: matplotlib is not installed here; plot the JSON where it is", file=sys.stderr)
        return 2
    results = [json.loads(Path(path).read_text()) for path in args.results]
    missing = [path for path, r in zip(args.results, results) if "requests" not in r]
    if missing:
        print(f"plot_multi_model: no requests in {', '.join(missing)} (the run never started)", file=sys.stderr)
        return 2
    plot(results, args.png)
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
