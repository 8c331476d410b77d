"""Token-exact comparison of two runs of the same workload (the static-partition run as reference).

Only requests that finished in both runs are compared. Greedy decoding on
dummy weights is deterministic for a given batch, but the batches differ from
one configuration to another (different memory, different concurrency), and
bf16 kernels give slightly different logits for different batch shapes: a
timed request may therefore differ without any bug. The probes are sent one
at a time per model after the load, the same batch shape in every run, and
read the prefix cache (or the host tier) the load left behind: they must be
identical, and they decide the exit code.
"""

from __future__ import annotations

from typing import Any


class NotComparable(ValueError):
    """The two runs did not send the same prompts."""


def _by_index(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["index"]: r for r in result["requests"]}


def compare_runs(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Per model and kind (timed, probe): compared, identical, differing, skipped; first differences."""
    if reference["digest"] != other["digest"]:
        raise NotComparable(f"different workloads: {reference['config']} ran {reference['digest']}, "
                            f"{other['config']} ran {other['digest']}")
    ref, oth = _by_index(reference), _by_index(other)
    counts: dict[str, dict[str, dict[str, int]]] = {}
    differing: list[dict[str, Any]] = []
    for index, a in sorted(ref.items()):
        b = oth.get(index)
        kind = "probe" if a["probe"] else "timed"
        row = counts.setdefault(a["model"], {}).setdefault(
            kind, {"compared": 0, "identical": 0, "differing": 0, "skipped": 0})
        if b is None or a["status"] != "ok" or b["status"] != "ok":
            row["skipped"] += 1
            continue
        row["compared"] += 1
        if a["tokens"] == b["tokens"]:
            row["identical"] += 1
            continue
        row["differing"] += 1
        first = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                     min(len(a["tokens"]), len(b["tokens"])))
        differing.append({"index": index, "model": a["model"], "kind": kind, "first_differing_token": first})
    totals = {kind: {key: sum(c.get(kind, {}).get(key, 0) for c in counts.values())
                     for key in ("compared", "identical", "differing", "skipped")} for kind in ("timed", "probe")}
    return {"reference": reference["config"], "other": other["config"], "digest": reference["digest"],
            "models": counts, "totals": totals, "differing": differing}


def render(comparison: dict[str, Any], limit: int = 10) -> str:
    lines = [f"== tokens of {comparison['other']} against {comparison['reference']} "
             f"(workload {comparison['digest']})"]
    for model, kinds in comparison["models"].items():
        for kind, c in sorted(kinds.items()):
            lines.append(f"  {model:<12} {kind:<5} compared {c['compared']:>5}, identical {c['identical']:>5}, "
                         f"differing {c['differing']:>4}, skipped {c['skipped']:>4} (not ok in one run)")
    for kind, c in comparison["totals"].items():
        lines.append(f"  {'all':<12} {kind:<5} compared {c['compared']:>5}, identical {c['identical']:>5}, "
                     f"differing {c['differing']:>4}, skipped {c['skipped']:>4}")
    lines += [f"  differs: #{d['index']} {d['model']} ({d['kind']}) from token {d['first_differing_token']}"
              for d in comparison["differing"][:limit]]
    return "\n".join(lines)


def probes_identical(comparison: dict[str, Any]) -> bool:
    """Every probe finished in both runs and gave the same tokens."""
    probe = comparison["totals"]["probe"]
    return probe["differing"] == 0 and probe["skipped"] == 0 and probe["compared"] > 0
