"""Helpers of ``demo_two_instances.py``: prompts, HTTP, status and metrics parsing, the plot.

Kept apart so the demo script reads as the scenario it runs.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

GIB = 1 << 30
NAMES = ["demo-a", "demo-b"]
PROBES, FAMILIES, PREFIX_WORDS, SUFFIX_WORDS = 16, 8, 360, 150  # ~4.4 tokens a word: ~2.3k-token prompts
FIELDS = ("mapped_bytes", "cached_bytes", "host_bytes", "min_bytes", "max_bytes", "wanted_bytes")
SYLLABLES = "ka lo mi ren tas vo qui dra nel por sun fey gal bri tor zen ash mur pel oth".split()
METRIC = re.compile(r"^(kvelastic_\w+)(?:\{([^}]*)\})?\s+(\S+)")


def words(seed: str, count: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count))


def prompt(index: int) -> str:
    """Prompts share one of FAMILIES long prefixes; prompt i < PROBES is a probe."""
    family = index % FAMILIES
    return (f"Briefing {family}: {words(f'family-{family}', PREFIX_WORDS)}\n"
            f"Request {index}: {words(f'request-{index}', SUFFIX_WORDS)}\nAnswer:")


def http(url: str, body: dict | None = None, timeout: float = 180.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return reply.read()


def healthy(url: str) -> bool:
    try:
        http(url + "/health", timeout=2)
    except Exception:  # noqa: BLE001 - any failure means not (yet) healthy
        return False
    return True


def run_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.daemon = True  # an interrupted demo must not wait for its load to run out
        thread.start()
    for thread in threads:
        thread.join()


def complete(url: str, model: str, text: str, max_tokens: int) -> dict[str, Any]:
    """One greedy completion; ``key`` is its token ids (its text if the server sends no ids)."""
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    reply = json.loads(http(url + "/v1/completions", body))
    choice, usage = reply["choices"][0], reply.get("usage") or {}
    ids = choice.get("token_ids")
    return {"key": choice.get("text", "") if ids is None else ids, "by": "text" if ids is None else "ids",
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """``kvelastic_*`` samples of a Prometheus text page: name -> instance_name label -> value."""
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if match := METRIC.match(line):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            found.setdefault(match.group(1), {})[labels.get("instance_name", "")] = float(match.group(3))
    return found


def metric(snapshot: dict, name: str, engine: str) -> float | None:
    """A gauge, or a counter (exported with ``_total``)."""
    values = snapshot.get(name) or snapshot.get(name + "_total") or {}
    return values.get(engine)


def to_sample(status: dict | None, t: float) -> dict | None:
    """``kvelastic status --json`` reduced to the account that holds our instances."""
    for acct in (status or {}).get("accounts", []):
        members = {m["name"]: {k: m[k] for k in FIELDS} for m in acct["members"] if m["name"] in NAMES}
        if members:
            return {"t": round(t, 3), "budget": acct["budget_bytes"], "total_mapped": acct["mapped_bytes"],
                    "charged": acct["charged_bytes"], "members": members}
    return None


def read_status(t: float = 0.0) -> dict | None:
    try:
        done = subprocess.run([sys.executable, "-m", "kvelastic.cli", "status", "--json"],
                              capture_output=True, text=True, timeout=15, check=False)
        return to_sample(json.loads(done.stdout) if done.stdout.lstrip().startswith("{") else None, t)
    except Exception:  # noqa: BLE001 - a missed sample, never a dead sampler
        return None


def mapped(sample: dict | None, name: str, field: str = "mapped_bytes") -> float:
    member = (sample or {}).get("members", {}).get(name)
    return float("nan") if member is None else member[field]


def budget_excess(samples: list[dict]) -> tuple[int, int]:
    """(largest excess of all members' mapped bytes over the budget, samples over it)."""
    excess = [s["total_mapped"] - s["budget"] for s in samples]
    return max(excess, default=0), sum(e > 0 for e in excess)


def summarize_phases(phases: list[dict], samples: list[dict]) -> None:
    """Add each instance's mapped bytes at the start, peak and end of every phase."""
    for phase in phases:
        inside = [s for s in samples if phase["start"] <= s["t"] <= phase["end"]]
        before = [s for s in samples if s["t"] <= phase["start"]] or inside[:1]
        phase["mapped"] = {n: {"start": mapped(before[-1] if before else None, n),
                               "peak": max((mapped(s, n) for s in inside), default=float("nan")),
                               "end": mapped(inside[-1] if inside else None, n)} for n in NAMES}


def same(a: list[dict], b: list[dict]) -> tuple[int, int]:
    return sum(x["key"] == y["key"] for x, y in zip(a, b)), max(len(a), len(b))


# ------------------------------------------------------------------ the demo
def plot(demo: Any, path: Path) -> str:
    """Both instances' mapped KV and host-tier bytes over time, phases shaded, cap changes marked."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: no matplotlib"
    ts, samples = [s["t"] for s in demo.samples], demo.samples
    fig, ax = plt.subplots(figsize=(11, 5))
    for i, name in enumerate(NAMES):
        ax.plot(ts, [mapped(s, name) / GIB for s in samples], color=f"C{i}", label=f"{name} mapped KV")
        ax.plot(ts, [mapped(s, name, "host_bytes") / GIB for s in samples], color=f"C{i}", ls="--",
                label=f"{name} host tier")
    ax.plot(ts, [s["budget"] / GIB for s in samples], color="black", ls=":", label="shared budget")
    axis_x = ax.get_xaxis_transform()
    for phase in (p for p in demo.phases if p["kind"] == "load"):
        ax.axvspan(phase["start"], phase["end"], color="grey", alpha=0.15)
        ax.text(phase["start"] + 0.5, 0.01, f"phase {phase['name']}", transform=axis_x, va="bottom")
    for t, label in (e for e in demo.events if e[1].startswith("cap ")):
        ax.axvline(t, color="red", lw=0.8, ls=":")
        ax.text(t, 0.5, label, rotation=90, fontsize=7, transform=axis_x)
    ax.set(xlabel="seconds since launch", ylabel="GiB", title="Two kvelastic vLLM servers on one GPU")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
