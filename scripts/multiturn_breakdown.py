"""Per-config breakdown of a ``bench_multiturn.py`` run, from its tarball or folder.

For each configuration (``<config>.json`` and ``<config>.log`` beside each other,
as ``bench_multiturn.py`` writes them under its ``--outdir``):

- every round: seconds, tok/s, cached tokens of the later turns, TTFT p50/p99,
  and each turn's seconds (``*``: the warm-up round);
- per turn, medians over the measured rounds: seconds, TTFT p50 and max, and the waves in
  which the turn's requests started (TTFTs more than 0.1 s apart split them): the first
  wave's TTFT (what admission costs: loads and spills in front of the prefill) and the
  period to the next (mostly the first wave's decode steps);
- per turn, each configuration's seconds over ``--reference``'s (default the connector with LRU)
  in the same round, the median of the rounds' ratios (turn 0 loads nothing: the compute's own cost);
- from the engine log: start-up, whether torch.compile's cache was hit, and
  - kvelastic: its last periodic line (hits, misses, spilled, reloaded, the
    copies' GPU seconds and GB/s), with the span of the run it covers and
    the bytes reloaded set against the turns' cached tokens over the same span;
  - the OffloadingConnector: its "KV Transfer metrics" lines summed (each
    line holds one logging interval), with GB/s = bytes / transfer time.

    python scripts/multiturn_breakdown.py benchmarks/results/2026-11-27-session15/multiturn-1b-call5.tgz
    python scripts/multiturn_breakdown.py path/to/multiturn --token-bytes 131072   # 8B shape

``--token-bytes``: KV bytes per token (1B shape 32768, 8B shape 131072); 0
reads it from kvelastic's host tier line where there is one. Times in the log
are aligned with the rounds by taking the first round to start at the log's
first "Using None for EOS token id" warning, which the first ``generate``
prints (second resolution, so spans are approximate). The connector's load
counter has summed to about half of its cached tokens' bytes in every run read
so far (docs/offload.md, "What the multi-turn runs say"): read it as a rate.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
import sys
import tarfile
import tempfile
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from percentiles import percentile  # noqa: E402  (beside this file)

_STAMP = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d)")
_SIZE = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _time(line: str) -> datetime | None:
    m = _STAMP.search(line)
    return datetime.strptime(m.group(1), "%m-%d %H:%M:%S") if m else None


def _bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * _SIZE[unit]


def kvelastic_line(line: str) -> dict[str, float]:
    """The numbers of one ``kvelastic: mapped ...`` periodic line."""
    out: dict[str, float] = {}
    for key, pattern in (("hits", r"hits (\d+)"), ("misses", r"misses (\d+)")):
        if m := re.search(pattern, line):
            out[key] = float(m.group(1))
    for key in ("spilled", "reloaded", "mapped", "held"):
        if m := re.search(rf"{key} ([\d.]+ [KMG]?i?B)", line):
            out[key] = _bytes(m.group(1))
    for key in ("spill", "reload"):
        if m := re.search(rf"{key} ([\d.]+) s \(([\d.]+|-)", line):
            out[f"{key}_s"] = float(m.group(1))
    if m := re.search(r"loads beside compute (\d+), in front of the step (\d+)", line):
        out["async_loads"], out["sync_loads"] = float(m.group(1)), float(m.group(2))
    return out


def connector_lines(lines: list[str]) -> dict[str, float]:
    """The connector's per-interval transfer metrics, summed over the log's lines."""
    total: dict[str, float] = {"intervals": 0}
    for line in lines:
        if "KV Transfer metrics" not in line:
            continue
        total["intervals"] += 1
        for key, value in re.findall(r"vllm:kv_offload_(\w+)=([\d.e+-]+)", line):
            if key != "cpu_cache_usage_perc":
                total[key] = total.get(key, 0.0) + float(value)
    return total


def log_summary(path: Path) -> dict[str, Any]:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    out: dict[str, Any] = {"compiled": any("Compiling a graph" in x for x in lines)}
    for line in lines:
        if m := re.search(r"init engine .* took ([\d.]+) s", line):
            out["init_s"] = float(m.group(1))
        if "Using None for EOS" in line and "start" not in out:
            out["start"] = _time(line)
        if m := re.search(r"host tier of .* blocks of ([\d.]+ [KMG]iB)", line):
            out["block_bytes"] = _bytes(m.group(1))
    reports = [x for x in lines if "kvelastic: mapped" in x]
    if reports:
        out["kvelastic"] = kvelastic_line(reports[-1])
        out["kvelastic_at"] = _time(reports[-1])
    if any("KV Transfer metrics" in x for x in lines):
        out["connector"] = connector_lines(lines)
        stamps = [_time(x) for x in lines if "KV Transfer metrics" in x]
        out["connector_at"] = stamps[-1]
    return out


def waves(ttft: list[float], gap: float = 0.1) -> list[list[float]]:
    """A turn's TTFTs split where sorted neighbours are more than ``gap`` s apart: the requests vLLM
    admitted together (a turn's 64 requests do not fit the GPU budget at once, so they start in waves)."""
    out: list[list[float]] = []
    for x in sorted(ttft):
        if out and x - out[-1][-1] <= gap:
            out[-1].append(x)
        else:
            out.append([x])
    return out


def first_waves(measured: list[dict]) -> str:
    """How many of the later turns' requests each turn's first wave admitted, and where the pooled TTFT p50
    falls among theirs: later-turn TTFTs form two clusters (the first wave, and those waiting for its
    decode steps), so p50 moves with the first wave's size more than with its speed. Where the run
    recorded them (bench_multiturn.py since session 19), also the first waves' TTFT split at the first
    scheduling: ``queued`` (waiting for room or loads) and ``scheduled`` (prefill)."""
    first: list[float] = []
    pooled: list[float] = []
    parts: dict[str, list[float]] | None = {"queued": [], "scheduled": []}
    for r in measured:
        for turn in r["turns"][1:]:
            cut = waves(turn["ttft"])[0][-1]  # the first wave's last TTFT
            pooled += turn["ttft"]
            first += [x for x in turn["ttft"] if x <= cut]
            if parts is None or "queued" not in turn:
                parts = None
                continue
            for ttft, queued, scheduled in zip(turn["ttft"], turn["queued"], turn["scheduled"]):
                if ttft <= cut:
                    parts["queued"].append(queued)
                    parts["scheduled"].append(scheduled)
    first.sort()
    p50 = statistics.median(pooled)
    rank = bisect.bisect_right(first, p50) / len(first)
    text = (f"first waves of the later turns: {len(first)} of {len(pooled)} requests ({len(first) / len(pooled):.1%}),"
            f" their median TTFT {statistics.median(first):.3f} s; the pooled p50 ({p50:.3f} s) is their"
            f" {rank:.0%} percentile")
    if parts:
        text += "\n  their TTFT split at the first scheduling (median / p90, s): " + ", ".join(
            f"{key} {statistics.median(v):.3f} / {percentile(sorted(v), 90):.3f}" for key, v in parts.items())
    return text


def cached_until(rounds: list[dict], seconds: float) -> tuple[float, float]:
    """Cached tokens of the turns finished within ``seconds`` of the first round's start, and with the
    turn then under way added (turns in order)."""
    elapsed, cached = 0.0, 0.0
    for rnd in rounds:
        for turn in rnd["turns"]:
            elapsed += turn["seconds"]
            if elapsed > seconds:
                return cached, cached + turn["cached_tokens"]
            cached += turn["cached_tokens"]
        elapsed += rnd["seconds"] - sum(t["seconds"] for t in rnd["turns"])
    return cached, cached


def spans(rounds: list[dict], start: datetime | None, at: datetime) -> tuple[float, float]:
    """Seconds from the log's first round to ``at`` (a report's line), and this engine's own running
    time within them (:func:`busy_within`); NaN both when the log has no start."""
    if start is None:
        return float("nan"), float("nan")
    span = (at - start).total_seconds()
    return span, busy_within(rounds, start, span)


def busy_within(rounds: list[dict], start: datetime, span: float) -> float:
    """Seconds of this engine's own rounds within ``span`` seconds of ``start`` (the log's first round).

    With ``bench_multiturn.py --interleave`` the span also holds the other engines' rounds, so the
    copies' share and the cached tokens by then are set against this engine's running time. Rounds
    without a wall-clock stamp (runs before 2026-11-28's twentieth session) ran back to back: the span.
    """
    if not rounds or not all("started" in r for r in rounds):
        return span
    end = start + timedelta(seconds=span)
    total = 0.0
    for rnd in rounds:
        began = datetime.fromtimestamp(rnd["started"]).replace(year=start.year)
        finished = began + timedelta(seconds=rnd["seconds"])
        total += max(0.0, (min(finished, end) - max(began, start)).total_seconds())
    return total


def describe(name: str, data: dict, log: dict[str, Any], out_len: int, token_bytes: float) -> None:
    rounds = data["rounds"]
    tokens = sum(t["prompt_tokens"] for t in rounds[0]["turns"]) + sum(len(t["outputs"]) for t in rounds[0]["turns"]) * out_len
    print(f"\n== {name}: start-up {log.get('init_s', float('nan')):.1f} s"
          f" (torch.compile {'compiled' if log['compiled'] else 'from cache'})")
    for rnd in rounds:
        later = [x for t in rnd["turns"][1:] for x in t["ttft"]]
        cached = sum(t["cached_tokens"] for t in rnd["turns"][1:])
        print(f"  round {rnd['round']}{'*' if rnd['warmup'] else ' '} {rnd['seconds']:6.3f} s {tokens / rnd['seconds']:9,.0f} tok/s"
              f"  cached {cached:8,}  TTFT p50 {statistics.median(later):.3f} p99 {percentile(sorted(later), 99):.3f}"
              f"  turns " + " ".join(f"{t['seconds']:.3f}" for t in rnd["turns"]))
    measured = [r for r in rounds if not r["warmup"]]
    n_turns = len(measured[0]["turns"])
    cols = []
    for i in range(n_turns):
        secs = statistics.median(r["turns"][i]["seconds"] for r in measured)
        p50 = statistics.median(statistics.median(r["turns"][i]["ttft"]) for r in measured)
        top = statistics.median(max(r["turns"][i]["ttft"]) for r in measured)
        cols.append(f"t{i} {secs:.3f}/{p50:.3f}/{top:.3f}")
    print("  per turn, medians of measured rounds (s / TTFT p50 / TTFT max): " + "  ".join(cols))
    cols = []
    for i in range(n_turns):
        split = [waves(r["turns"][i]["ttft"]) for r in measured]
        first = statistics.median(statistics.median(w[0]) for w in split)
        gaps = [statistics.median(w[1]) - statistics.median(w[0]) for w in split if len(w) > 1]
        sizes = "/".join(str(len(w)) for w in split[0])
        cols.append(f"t{i} {sizes} {first:.2f}" + (f"+{statistics.median(gaps):.2f}" if gaps else ""))
    print("  waves (sizes in the first measured round; medians: first wave's TTFT + period to the second): "
          + "  ".join(cols))
    print("  " + first_waves(measured))
    start = log.get("start")
    if "kvelastic" in log:
        k = log["kvelastic"]
        span, busy = spans(rounds, start, log["kvelastic_at"])
        block = log.get("block_bytes") or token_bytes * 16
        low, high = (x * (token_bytes or block / 16) for x in cached_until(rounds, busy))
        copy = k.get("spill_s", 0) + k.get("reload_s", 0)
        if "reload_s" not in k:  # lines written before the copy clock
            print(f"  kvelastic, first {span:.0f} s: hits {k.get('hits', 0):,.0f} misses {k.get('misses', 0):,.0f};"
                  f" reloaded {k.get('reloaded', 0) / 2**30:.2f} GiB, spilled {k.get('spilled', 0) / 2**30:.2f} GiB")
        else:
            print(f"  kvelastic, first {span:.0f} s: hits {k.get('hits', 0):,.0f} misses {k.get('misses', 0):,.0f};"
                  f" reloaded {k.get('reloaded', 0) / 2**30:.2f} GiB in {k.get('reload_s', 0):.2f} s"
                  f" ({k.get('reloaded', 0) / max(k.get('reload_s', 0), 1e-9) / 1e9:.1f} GB/s),"
                  f" spilled {k.get('spilled', 0) / 2**30:.2f} GiB in {k.get('spill_s', 0):.2f} s"
                  f" ({k.get('spilled', 0) / max(k.get('spill_s', 0), 1e-9) / 1e9:.1f} GB/s);"
                  f" copy-stream {copy:.2f} s = {copy / busy:.1%} of its rounds' time"
                  + (f" ({busy:.0f} s of the {span:.0f})" if busy < span - 1 else ""))
        if "async_loads" in k:
            print(f"    loads beside compute {k['async_loads']:.0f}, in front of the step {k['sync_loads']:.0f}")
        if low:
            print(f"    reloaded / the cached tokens' bytes by then: {k.get('reloaded', 0) / high:.2f}"
                  f"-{k.get('reloaded', 0) / low:.2f} (with / without the turn under way)")
    if "connector" in log:
        c = log["connector"]
        span, busy = spans(rounds, start, log["connector_at"])
        low, high = (x * token_bytes for x in cached_until(rounds, busy))
        lb, lt, sb, st = (c.get(x, 0.0) for x in ("load_bytes", "load_time", "store_bytes", "store_time"))
        print(f"  connector, {c['intervals']:.0f} intervals to {span:.0f} s: loads {lb / 2**30:.2f} GiB in {lt:.2f} s"
              f" ({lb / max(lt, 1e-9) / 1e9:.1f} GB/s, {c.get('load_size_count', 0):.0f} jobs),"
              f" stores {sb / 2**30:.2f} GiB in {st:.2f} s ({sb / max(st, 1e-9) / 1e9:.1f} GB/s,"
              f" {c.get('store_size_count', 0):.0f} jobs)")
        if low:
            print(f"    loads / the cached tokens' bytes by then: {lb / high:.2f}-{lb / low:.2f}"
                  " (with / without the turn under way)")


def turn_ratios(runs: dict[str, dict], reference: str) -> None:
    """Each configuration's turn seconds over ``reference``'s in the same round (the same conversations;
    with ``--interleave`` also the same stretch of the machine): the median of the rounds' ratios, per turn.
    Turn 0 loads nothing, so it shows what a configuration costs the compute itself."""
    if reference not in runs:
        return
    ref = {r["round"]: r for r in runs[reference]["rounds"] if not r["warmup"]}
    print(f"\nper turn, seconds over {reference}'s in the same round (median of the rounds' ratios):")
    for name, data in runs.items():
        rounds = [r for r in data["rounds"] if not r["warmup"] and r["round"] in ref]
        if name == reference or not rounds:
            continue
        cols = []
        for i in range(len(rounds[0]["turns"])):
            ratio = statistics.median(r["turns"][i]["seconds"] / ref[r["round"]]["turns"][i]["seconds"]
                                      for r in rounds)
            cols.append(f"t{i} {ratio:.3f}")
        print(f"  {name:20} " + "  ".join(cols) + f"  ({len(rounds)} rounds)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a tarball holding multiturn/<config>.json, or such a folder")
    p.add_argument("--out-len", type=int, default=64, help="bench_multiturn.py's --out-len")
    p.add_argument("--token-bytes", type=float, default=0,
                   help="KV bytes per token (1B 32768, 8B 131072); 0: from kvelastic's log, else 32768")
    p.add_argument("--reference", default="offload-lru", help="the configuration the per-turn ratios divide by")
    args = p.parse_args()
    src = Path(args.source)
    with tempfile.TemporaryDirectory() as tmp:
        if src.is_file():
            with tarfile.open(src) as tar:
                tar.extractall(tmp, filter="data")
            src = Path(tmp)
        found = sorted(x for x in src.rglob("*.json") if x.with_suffix(".log").exists())
        if not found:
            print(f"no <config>.json beside a <config>.log under {args.source}")
            return 1
        logs = {x: log_summary(x.with_suffix(".log")) for x in found}
        token_bytes = args.token_bytes or next((lg["block_bytes"] / 16 for lg in logs.values() if "block_bytes" in lg),
                                               32768.0)
        runs = {}
        for path in found:
            data = json.loads(path.read_text())
            if isinstance(data, dict) and "rounds" in data:  # one engine's run, not a summary
                describe(path.stem, data, logs[path], args.out_len, token_bytes)
                runs[path.stem] = data
        turn_ratios(runs, args.reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
