"""The numbers of one run: latency percentiles, SLO attainment, goodput, server counters, reclaim.

Reclaim latency comes from the engines' own clocks (:mod:`benchmarks.mmbench.reclaim`: their
``/metrics`` histograms and, where the server logs were read, their exact log lines), with the
client's sampling of the account as a cross-check.

A request meets the SLO when it finished (status ``ok``) with TTFT and TPOT
under the thresholds; failed and unfinished requests count as misses, so
attainment is over every timed request sent. Goodput is SLO-meeting requests
per second of the schedule. Percentiles are over finished requests
(nearest rank below, ``benchmarks/percentiles.py``).
Probes are left out of every latency number: they only check tokens.
"""

from __future__ import annotations

from typing import Any

from benchmarks.percentiles import percentile

from benchmarks.mmbench import reclaim
from benchmarks.mmbench.client import FAILED, UNFINISHED
from benchmarks.mmbench.cpu import cpu_rates, front_end_bound
from benchmarks.mmbench.workload import Workload

COUNTERS = {"preemptions": "vllm:num_preemptions_total", "prefix_queries": "vllm:prefix_cache_queries_total",
            "prefix_hits": "vllm:prefix_cache_hits_total", "host_hits": "kvelastic_host_hits_total",
            "host_misses": "kvelastic_host_misses_total", "spilled_bytes": "kvelastic_spilled_bytes_total",
            "reloaded_bytes": "kvelastic_reloaded_bytes_total"}


def meets_slo(record: dict[str, Any], slo: dict[str, float]) -> bool:
    return (record["status"] == "ok" and record["ttft_s"] is not None and record["ttft_s"] < slo["ttft_s"]
            and (record["tpot_s"] is None or record["tpot_s"] < slo["tpot_s"]))


def _pcts(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {"p50": percentile(ordered, 50) if ordered else None, "p99": percentile(ordered, 99) if ordered else None}


def latency_stats(records: list[dict[str, Any]], slo: dict[str, float], duration_s: float) -> dict[str, Any]:
    """Counts, TTFT/TPOT p50/p99, SLO attainment and goodput of ``records`` (timed requests)."""
    ok = [r for r in records if r["status"] == "ok"]
    met = sum(meets_slo(r, slo) for r in records)
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    return {"requests": len(records), "ok": len(ok), "failed": sum(r["status"] in FAILED for r in records),
            "cached_token_ratio": sum(r["cached_tokens"] or 0 for r in ok) / prompt if prompt else None,
            "unfinished": sum(r["status"] == UNFINISHED for r in records),
            "ttft_s": _pcts([r["ttft_s"] for r in ok]),
            "tpot_s": _pcts([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
            "slo_met": met, "slo_attainment": met / len(records) if records else None,
            "goodput_rps": met / duration_s}


def _failures(records: list[dict[str, Any]], limit: int = 5) -> list[str]:
    return [f"#{r['index']} {r['model']} {r['status']}: {r['error']}" for r in records
            if r["status"] in FAILED][:limit]


def counter_deltas(samples: list[dict[str, Any]], model: str, start: float, end: float) -> dict[str, float]:
    """How much each counter of ``COUNTERS`` grew on ``model``'s server between ``start`` and ``end``.

    Uses the last sample at or before ``start`` (else the first) and the first at or
    after ``end`` (else the last); counters a server does not export are left out.
    """
    mine = [(s["t"], s["servers"].get(model)) for s in samples if s["servers"].get(model) is not None]
    if not mine:
        return {}
    before = [v for t, v in mine if t <= start] or [mine[0][1]]
    after = [v for t, v in mine if t >= end] or [mine[-1][1]]
    first, last = before[-1], after[0]
    return {key: last[name] - first.get(name, 0.0) for key, name in COUNTERS.items() if name in last}


def ratios(delta: dict[str, float]) -> dict[str, float | None]:
    """Prefix-cache and host-tier hit ratios of a counter delta (None where nothing was looked up)."""
    def ratio(hits: str, total: float) -> float | None:
        return delta[hits] / total if hits in delta and total > 0 else None
    return {"prefix_hit_ratio": ratio("prefix_hits", delta.get("prefix_queries", 0.0)),
            "host_hit_ratio": ratio("host_hits", delta.get("host_hits", 0.0) + delta.get("host_misses", 0.0))}


def memory_by_server(memory: dict[str, Any], ports: dict[int, str]) -> dict[str, Any]:
    """Per server GPU bytes over time (its processes summed), and what no server owns."""
    owners = {int(pid): port for pid, port in memory.get("owners", {}).items()}
    series: list[dict[str, Any]] = []
    for sample in memory.get("samples", []):
        per = dict.fromkeys(ports.values(), 0)
        for pid, nbytes in sample["procs"].items():
            port = owners.get(int(pid))
            if port in ports:
                per[ports[port]] += nbytes
        series.append({"t": sample["t"], "used": sample["used"], "servers": per,
                       "other": sample["used"] - sum(per.values())})
    mapped = any(any(s["servers"].values()) for s in series)
    return {"series": series, "per_server": mapped}


def reclaim_episodes(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Budget refusals seen in the account, from the first sample showing one to the first without.

    An engine's refusal (``wanted_bytes``) is cleared by its next grant, so an episode
    is how long it waited for memory others held. Sampled on this client's clock:
    each end is late by up to one period, and a grant followed by a new refusal
    between two samples merges two episodes into one. A cross-check of what the
    engines time themselves (:mod:`benchmarks.mmbench.reclaim`).
    """
    episodes, open_since = [], {}
    for sample in samples:
        for acct in sample["accounts"]:
            members = acct["members"]
            for name, member in members.items():
                key = (acct["gpu"], name)
                if member["wanted_bytes"] > 0 and key not in open_since:
                    open_since[key] = (sample["t"], member["wanted_bytes"], _mapped_others(members, name))
                elif member["wanted_bytes"] == 0 and key in open_since:
                    began, wanted, others = open_since.pop(key)
                    episodes.append({"member": name, "start": began, "seconds": round(sample["t"] - began, 4),
                                     "wanted_bytes": wanted,
                                     "others_released_bytes": others - _mapped_others(members, name)})
    durations = sorted(e["seconds"] for e in episodes)
    return {"samples": len(samples), "episodes": episodes, "count": len(episodes), "unresolved": len(open_since),
            "p50_s": percentile(durations, 50) if durations else None,
            "p95_s": percentile(durations, 95) if durations else None, "max_s": max(durations, default=None)}


def _mapped_others(members: dict[str, dict[str, int]], name: str) -> int:
    return sum(m["mapped_bytes"] for other, m in members.items() if other != name)


def window_rows(result: dict[str, Any], slo: dict[str, float]) -> list[dict[str, Any]]:
    """Each busy period of each model: its requests' numbers and its server's counter deltas."""
    w, start0, rows = workload_of(result), result["load_start_s"], []
    timed = [r for r in result["requests"] if not r["probe"]]
    for m, model in enumerate(w.models):
        for k, (begin, end) in enumerate(w.busy_windows(m)):
            inside = [r for r in timed if r["model"] == model and begin <= r["send_s"] < end]
            delta = counter_deltas(result["metrics"]["samples"], model, start0 + begin, start0 + end)
            rows.append({"model": model, "window": k, "start": begin, "end": end,
                         **latency_stats(inside, slo, end - begin), **ratios(delta),
                         "preemptions": delta.get("preemptions"),
                         "short_of_memory": short_of_memory(result, model, start0 + begin, start0 + end),
                         "queued_on_full_kv": queued_on_full_kv(result, model, start0 + begin, start0 + end),
                         "cpu": window_cpu(result, model, start0 + begin, start0 + end)})
    return rows


def window_cpu(result: dict[str, Any], model: str, begin: float, end: float) -> dict[str, Any] | None:
    """Cores used in the window by ``model``'s API server and engine, the client, and how busy the host was."""
    rates = cpu_rates(result.get("cpu", {}).get("samples", []), begin, end, [model])
    if rates is None:
        return None
    return {**rates["servers"][model], "client": rates["client"], "host_busy": rates["host_busy"]}


def short_of_memory(result: dict[str, Any], model: str, begin: float, end: float) -> float | None:
    """The share of the account's samples in ``[begin, end)`` that show ``model`` wanting memory.

    Tells a busy period bound by memory (the engine waits for the budget) from one
    bound by compute (its requests queue while it asks for nothing). None without
    account samples (configurations without kvelastic).
    """
    seen = wanting = 0
    for sample in result.get("account", {}).get("samples", []):
        if not begin <= sample["t"] < end:
            continue
        for account in sample["accounts"]:
            member = account["members"].get(model)
            if member is not None:
                seen += 1
                wanting += member["wanted_bytes"] > 0
    return wanting / seen if seen else None


#: A KV cache this full (vLLM's ``kv_cache_usage_perc``) with requests waiting: they wait for KV memory.
FULL_KV = 0.97


def queued_on_full_kv(result: dict[str, Any], model: str, begin: float, end: float) -> float | None:
    """The share of ``model``'s ``/metrics`` samples in ``[begin, end)`` with requests waiting while its KV
    cache was full: a period bound by KV memory, in any configuration (static too, where the account's
    wants do not exist). None without samples of it."""
    seen = full = 0
    for sample in result["metrics"]["samples"]:
        values = sample["servers"].get(model) if begin <= sample["t"] < end else None
        if not values or "vllm:kv_cache_usage_perc" not in values:
            continue
        seen += 1
        full += values["vllm:kv_cache_usage_perc"] >= FULL_KV and values.get("vllm:num_requests_waiting", 0) > 0
    return full / seen if seen else None


def workload_of(result: dict[str, Any]) -> Workload:
    """The run's :class:`Workload`, rebuilt from its JSON."""
    return Workload(**{**result["workload"], "models": tuple(result["workload"]["models"])})


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Everything the report prints, from a run's result dict."""
    slo, w = result["slo"], result["workload"]
    timed = [r for r in result["requests"] if not r["probe"]]
    models = {model: latency_stats([r for r in timed if r["model"] == model], slo, w["duration_s"])
              for model in w["models"]}
    models["all"] = latency_stats(timed, slo, w["duration_s"])
    servers = {}
    for model in w["models"]:
        delta = counter_deltas(result["metrics"]["samples"], model, float("-inf"), float("inf"))
        servers[model] = {**delta, **ratios(delta)}
    probes = [r for r in result["requests"] if r["probe"]]
    late = sorted(r["sent_s"] - result["load_start_s"] - r["send_s"] for r in timed if r["sent_s"] is not None)
    memory = memory_by_server(result["memory"], {s["port"]: s["model"] for s in result["servers"]})
    for model in w["models"]:
        values = [s["servers"][model] for s in memory["series"]]
        servers[model]["gpu_bytes_peak"] = max(values, default=None)
    return {"slo": slo, "duration_s": w["duration_s"], "models": models, "windows": window_rows(result, slo),
            "servers": servers, "gpu_memory_per_server": memory["per_server"],
            "gpu_memory_source": result["memory"].get("source"),
            "probes": {"requests": len(probes), "ok": sum(r["status"] == "ok" for r in probes)},
            "failures": _failures(timed + probes),
            "send_lateness_s": {"p99": percentile(late, 99) if late else None, "max": max(late, default=None)},
            "front_end": front_end_bound(result.get("cpu", {}).get("samples", []), timed, slo["ttft_s"]),
            "reclaim": reclaim_episodes(result.get("account", {}).get("samples", [])),
            "reclaim_engines": reclaim.engine_histograms(result["metrics"]["samples"], list(w["models"])),
            "reclaim_logs": reclaim.log_summary(result.get("reclaim_log")),
            "reclaim_wait_sources": reclaim.wait_sources(result.get("reclaim_log"),
                                                         result.get("account", {}).get("samples", []),
                                                         result.get("clock_epoch"))}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _gib(value: float | None) -> str:
    return "-" if not value else f"{value / 2**30:.1f} GiB"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def render(summary: dict[str, Any], label: str) -> str:
    """The summary as a text table."""
    slo = summary["slo"]
    lines = [f"== {label}: SLO = TTFT < {slo['ttft_s'] * 1000:.0f} ms and TPOT < {slo['tpot_s'] * 1000:.0f} ms "
             f"(failed and unfinished requests miss it); goodput = SLO-meeting requests / "
             f"{summary['duration_s']:g} s",
             f"{'model':<12} {'sent':>5} {'ok':>5} {'fail':>4} {'unfin':>5} {'TTFT p50':>9} {'p99 ms':>7} "
             f"{'TPOT p50':>9} {'p99 ms':>7} {'SLO':>6} {'goodput/s':>9} {'preempt':>7} {'prefix hit':>10} "
             f"{'host hit':>8}"]
    for model, s in summary["models"].items():
        server = summary["servers"].get(model, {})
        preempt = server.get("preemptions")
        if model == "all":
            preempt = sum(v.get("preemptions", 0) for v in summary["servers"].values())
        lines.append(f"{model:<12} {s['requests']:>5} {s['ok']:>5} {s['failed']:>4} {s['unfinished']:>5} "
                     f"{_ms(s['ttft_s']['p50']):>9} {_ms(s['ttft_s']['p99']):>7} {_ms(s['tpot_s']['p50']):>9} "
                     f"{_ms(s['tpot_s']['p99']):>7} {_ratio(s['slo_attainment']):>6} {s['goodput_rps']:>9.2f} "
                     f"{'-' if preempt is None else f'{preempt:.0f}':>7} "
                     f"{_ratio(server.get('prefix_hit_ratio')):>10} {_ratio(server.get('host_hit_ratio')):>8}")
    lines.append("busy periods (model/window: sent, TTFT p50/p99 ms, SLO, cached prompt tokens, host-tier hits, "
                 "share of account samples wanting memory, share of samples queued on a full KV cache):")
    lines += [f"  {r['model']}/{r['window']} {r['start']:g}-{r['end']:g} s: {r['requests']}, "
              f"{_ms(r['ttft_s']['p50'])}/{_ms(r['ttft_s']['p99'])}, {_ratio(r['slo_attainment'])}, "
              f"{_ratio(r['cached_token_ratio'])}, {_ratio(r['host_hit_ratio'])}, "
              f"{_ratio(r.get('short_of_memory'))}, {_ratio(r.get('queued_on_full_kv'))}" for r in summary["windows"]]
    cpu = [r for r in summary["windows"] if r.get("cpu")]
    if cpu:
        lines.append("CPU per busy period (cores: the model's API server / its engine; the client; host busy):")
        lines += [f"  {r['model']}/{r['window']}: {_ratio(r['cpu']['api_s'])} / {_ratio(r['cpu']['engine_s'])}; "
                  f"{_ratio(r['cpu']['client'])}; {_percent(r['cpu']['host_busy'])}" for r in cpu]
    if front := summary.get("front_end"):
        lines.append(f"requests over the TTFT objective: {front['slow']}; {front['front_end_saturated']} of them "
                     f"waited while their model's API servers ran at >= {front['share']:.0%} of a core each "
                     "(the front end, not KV memory, held those)")
    lines += reclaim.render(summary.get("reclaim_engines"), summary.get("reclaim_logs"),
                            summary.get("reclaim_wait_sources"))
    rec = summary["reclaim"]
    if rec["samples"]:
        lines.append(f"reclaim cross-check (account sampled, a refusal until its grant): {rec['count']} "
                     f"episodes, p50 {_ms(rec['p50_s'])} ms, p95 {_ms(rec['p95_s'])} ms, max {_ms(rec['max_s'])} ms, "
                     f"{rec['unresolved']} unresolved")
    else:
        lines.append("reclaim: no kvelastic account sampled")
    probes = summary["probes"]
    per_server = "per server" if summary["gpu_memory_per_server"] else "no process matched to a server"
    lines.append(f"probes: {probes['ok']}/{probes['requests']} ok; GPU memory: {summary['gpu_memory_source']}, "
                 f"{per_server}; peak per server: " + ", ".join(
                     f"{m} {_gib(v.get('gpu_bytes_peak'))}" for m, v in summary["servers"].items()))
    late = summary["send_lateness_s"]
    lines.append(f"open loop: requests left the client late by p99 {_ms(late['p99'])} ms, max {_ms(late['max'])} ms")
    lines += [f"failure: {text}" for text in summary["failures"]]
    return "\n".join(lines)
