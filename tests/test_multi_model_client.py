"""The multi-model benchmark's client (benchmarks/multi_model.py) against fake OpenAI servers on a CPU.

The servers are real HTTP servers on local ports (tests/fake_openai_server.py):
streamed token ids, injected failures, a ``/metrics`` counter. What is checked:
the schedule is fixed by its seed and keeps to its busy periods; TTFT/TPOT come
from the chunks' arrival; the SLO, failed and unfinished requests are counted
as the summary says; counters are read as deltas; the engines' reclaim
histograms and log lines reach the summary; a watched process that dies ends
the wait for readiness; and the compare mode finds a changed token.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("aiohttp", reason="needs aiohttp (vllm's dependency: installed with it)")
prometheus_client = pytest.importorskip("prometheus_client", reason="needs prometheus_client (vllm's dependency: installed with it)")

from benchmarks import multi_model  # noqa: E402
from benchmarks.mmbench.client import SseBuffer, finish_timing  # noqa: E402
from benchmarks.mmbench.compare import compare_runs, probes_identical  # noqa: E402
from benchmarks.mmbench.cpu import (CpuReader, children_of, cpu_rates, descendants, front_end_bound,  # noqa: E402
                                   process_table)
from benchmarks.mmbench.reclaim import (bucket_quantile, engine_histograms, log_summary,  # noqa: E402
                                        read_logs)
from benchmarks.mmbench.sampling import AccountReader, Sampler, metric_values, owner_port  # noqa: E402
from benchmarks.mmbench.summary import reclaim_episodes, short_of_memory  # noqa: E402
from benchmarks.mmbench.workload import (Workload, WorkloadError, digest, max_busy_at_once,  # noqa: E402
                                         prompt_ids, schedule)
from tests.fake_openai_server import Behaviour, FakeServers, cached_tokens, failure_of, tokens_for  # noqa: E402

OUTPUT = 6
SMALL = ["--duration", "3", "--period", "3", "--busy", "1.5", "--busy-rate", "8", "--prefix-tokens", "64",
         "--suffix-min", "4", "--suffix-max", "12", "--output-tokens", str(OUTPUT), "--probes", "2"]


def small_workload(models: tuple[str, ...]) -> Workload:
    return Workload(models=models, duration_s=3, period_s=3, busy_s=1.5, busy_rate=8, prefix_tokens=64,
                    suffix_min=4, suffix_max=12, output_tokens=OUTPUT, probes=2)


def run_against(servers: FakeServers, out, *extra: str) -> tuple[int, dict]:
    models = list(servers.models)
    code = multi_model.main(["run", "--config", "fake", "--out", str(out), "--models", *models,
                             "--ports", *[str(servers.ports[m]) for m in models], "--memory", "none",
                             "--ready-timeout", "20", "--timeout", "20", *extra])
    return code, json.loads(out.read_text())


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """One run over three fake models: fast, slow to the first token, and failing on some prompts."""
    behaviours = {"fast": Behaviour(first_delay_s=0.02, token_delay_s=0.01, counted_max_tokens=OUTPUT),
                  "slow": Behaviour(first_delay_s=0.5, token_delay_s=0.1, counted_max_tokens=OUTPUT),
                  "flaky": Behaviour(first_delay_s=0.02, token_delay_s=0.01, fail_mod=3, counted_max_tokens=OUTPUT)}
    out = tmp_path_factory.mktemp("mm") / "fake.json"
    with FakeServers(behaviours) as servers:
        code, result = run_against(servers, out, *SMALL, "--slo-ttft", "0.3", "--slo-tpot", "0.05")
    return code, result, behaviours


# ------------------------------------------------------------------ the schedule
def test_the_schedule_is_fixed_by_its_seed():
    w = Workload()
    first, again = schedule(w), schedule(Workload())
    assert first == again and digest(first) == digest(again)
    other = schedule(Workload(seed=w.seed + 1))
    assert digest(other) != digest(first)
    assert [r.send_s for r in other[:20]] != [r.send_s for r in first[:20]]
    assert prompt_ids(w, first[5]) == prompt_ids(Workload(), again[5])


def test_requests_keep_to_busy_periods_and_at_most_two_models_are_busy():
    w = Workload()
    requests = schedule(w)
    assert max_busy_at_once(w) == 2
    for r in requests:
        if not r.probe:
            assert w.is_busy(w.models.index(r.model), r.send_s), r
    sends = [r.send_s for r in requests if not r.probe]
    assert sends == sorted(sends) and [r.index for r in requests] == list(range(len(requests)))
    assert [r.model for r in requests if r.probe] == [m for m in w.models for _ in range(w.probes)]
    # the busy rate is the rate asked for: 8/s over each model's 70 busy seconds, within 4 sigma
    for m, model in enumerate(w.models):
        busy = sum(b - a for a, b in w.busy_windows(m))
        count = sum(r.model == model and not r.probe for r in requests)
        assert abs(count - w.busy_rate * busy) < 4 * (w.busy_rate * busy) ** 0.5


def test_prompts_share_their_family_prefix_only():
    w = Workload(prefix_tokens=100, suffix_min=20, suffix_max=20)
    requests = [r for r in schedule(w) if not r.probe]
    a, b = next((x, y) for x in requests for y in requests
                if x.index < y.index and x.model == y.model and x.family == y.family)
    c = next(r for r in requests if r.model == a.model and r.family != a.family)
    pa, pb, pc = (prompt_ids(w, r) for r in (a, b, c))
    assert pa[:100] == pb[:100] and pa[100:] != pb[100:] and pa[:100] != pc[:100]
    assert len(pa) == 120


def test_a_bad_workload_is_refused_naming_the_parameter():
    with pytest.raises(WorkloadError, match="busy_s"):
        Workload(busy_s=100, period_s=90)
    assert multi_model.main(["schedule", "--families", "0"]) == multi_model.EXIT_USAGE


# ------------------------------------------------------------------ timing and accounting
def test_sse_buffer_keeps_a_line_until_its_newline():
    buffer = SseBuffer()
    assert buffer.feed(b'data: {"a": ') == []
    assert buffer.feed(b'1}\n\nda') == ['{"a": 1}']
    assert buffer.feed(b"ta: [DONE]\n\n") == ["[DONE]"]


def test_ttft_and_tpot_come_from_the_chunks():
    blank = {"ttft_s": None, "tpot_s": None, "error": None}
    record = {**blank, "chunks": [[0.5, 1], [0.6, 2], [0.9, 1]], "tokens": [1, 2, 3, 4], "finish_reason": "length"}
    finish_timing(record, 4)
    assert record["status"] == "ok" and record["ttft_s"] == 0.5
    assert record["tpot_s"] == pytest.approx((0.9 - 0.5) / 3)
    short = {**blank, "chunks": [[0.2, 1]], "tokens": [7], "finish_reason": "stop"}
    finish_timing(short, 4)
    assert short["status"] == "short" and short["tpot_s"] is None and "1 of 4" in short["error"]


def test_a_run_times_every_token_and_keeps_the_ids(fake_run):
    code, result, _ = fake_run
    assert code == 0 and not result["interrupted"]
    w = small_workload(("fast", "slow", "flaky"))
    requests = {r.index: r for r in schedule(w)}
    assert result["digest"] == digest(list(requests.values()))
    ok = [r for r in result["requests"] if r["status"] == "ok"]
    assert ok and all(r["tokens"] == tokens_for(prompt_ids(w, requests[r["index"]]), OUTPUT) for r in ok)
    slow = [r for r in ok if r["model"] == "slow" and not r["probe"]]
    assert slow and all(r["ttft_s"] >= 0.5 for r in slow)  # the server sleeps 0.5 s before its first token
    assert all(0.05 < r["tpot_s"] < 0.4 for r in slow)  # 0.1 s between tokens, loose for a loaded CI machine
    fast = [r for r in ok if r["model"] == "fast"]
    assert all(r["ttft_s"] >= 0.02 for r in fast)
    prompts = {i: prompt_ids(w, r) for i, r in requests.items()}
    assert all(r["prompt_tokens"] == len(prompts[r["index"]]) for r in ok)  # from the final usage chunk
    assert all(r["cached_tokens"] == cached_tokens(prompts[r["index"]]) for r in ok)
    cpu = result["cpu"]["samples"]  # sampled every second: the fake servers are no 'serve' processes
    assert len(cpu) >= 2 and all(s["servers"] == {} and s["host_total"] > 0 for s in cpu)
    assert cpu[-1]["client_s"] >= cpu[0]["client_s"] > 0
    fast_timed = [r for r in fast if not r["probe"]]
    assert result["summary"]["models"]["fast"]["cached_token_ratio"] == pytest.approx(
        sum(r["cached_tokens"] for r in fast_timed) / sum(r["prompt_tokens"] for r in fast_timed))


def test_slo_attainment_goodput_and_failures_are_counted(fake_run):
    _, result, _ = fake_run
    summary, slo = result["summary"], result["slo"]
    w = small_workload(("fast", "slow", "flaky"))
    for model in w.models:
        mine = [r for r in result["requests"] if r["model"] == model and not r["probe"]]
        met = [r for r in mine if r["status"] == "ok" and r["ttft_s"] < slo["ttft_s"]
               and r["tpot_s"] < slo["tpot_s"]]
        s = summary["models"][model]
        assert s["requests"] == len(mine) > 0
        assert s["slo_met"] == len(met) and s["slo_attainment"] == pytest.approx(len(met) / len(mine))
        assert s["goodput_rps"] == pytest.approx(len(met) / w.duration_s)
    assert summary["models"]["slow"]["slo_met"] == 0  # TTFT >= 0.5 s against an SLO of 0.3 s
    flaky = [r for r in schedule(w) if r.model == "flaky" and not r.probe]
    doomed = {r.index for r in flaky if failure_of(prompt_ids(w, r), 3)}
    assert doomed, "the seed should make some flaky requests fail"
    got = {r["index"] for r in result["requests"] if r["model"] == "flaky" and not r["probe"]
           and r["status"] == "error"}
    assert got == doomed
    assert summary["models"]["flaky"]["failed"] == len(doomed)
    assert summary["models"]["all"]["failed"] == len(doomed)
    assert summary["models"]["all"]["requests"] == sum(summary["models"][m]["requests"] for m in w.models)


def test_server_counters_are_read_as_deltas(fake_run):
    _, result, behaviours = fake_run
    for model, behaviour in behaviours.items():
        ok = sum(r["status"] == "ok" for r in result["requests"] if r["model"] == model)
        assert behaviour.completed == ok  # the fake counts each full-length reply it finished
        assert result["summary"]["servers"][model]["preemptions"] == ok


def test_requests_still_running_at_the_end_are_unfinished_not_failed(tmp_path):
    with FakeServers({"a": Behaviour(first_delay_s=0.02, token_delay_s=0.4)}) as servers:
        code, result = run_against(servers, tmp_path / "u.json", "--duration", "1", "--period", "1", "--busy", "1",
                                   "--busy-rate", "6", "--prefix-tokens", "8", "--suffix-min", "2",
                                   "--suffix-max", "4", "--output-tokens", "6", "--probes", "0", "--drain", "0.3")
    assert code == 0
    s = result["summary"]["models"]["a"]
    assert s["requests"] > 0 and s["unfinished"] == s["requests"] and s["failed"] == 0
    assert s["slo_met"] == 0 and s["slo_attainment"] == 0


def test_a_dead_server_process_ends_the_wait_for_readiness(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    began = time.monotonic()
    code = multi_model.main(["run", "--config", "dead", "--out", str(tmp_path / "d.json"), "--models", "m",
                             "--ports", "9", "--memory", "none", "--ready-timeout", "60",
                             "--watch-pid", str(gone.pid)])
    assert code == multi_model.EXIT_FAILED and time.monotonic() - began < 30
    result = json.loads((tmp_path / "d.json").read_text())
    assert f"process {gone.pid} exited" in result["not_ready"] and "requests" not in result


# ------------------------------------------------------------------ compare, samplers
def test_compare_counts_responses_whose_tokens_differ(fake_run, tmp_path):
    _, result, _ = fake_run
    flaky_probes = [r for r in result["requests"] if r["probe"] and r["model"] == "flaky"]
    assert probes_identical(compare_runs(result, result)) == all(r["status"] == "ok" for r in flaky_probes)
    clean = copy.deepcopy(result)  # the same workload without the model whose failures skip comparisons
    clean["requests"] = [r for r in clean["requests"] if r["model"] != "flaky"]
    same = compare_runs(clean, copy.deepcopy(clean))
    assert same["totals"]["timed"]["differing"] == 0 and same["totals"]["timed"]["compared"] > 0
    assert probes_identical(same)
    changed = copy.deepcopy(clean)
    timed = next(r for r in changed["requests"] if r["status"] == "ok" and not r["probe"])
    probe = next(r for r in changed["requests"] if r["status"] == "ok" and r["probe"])
    timed["tokens"][3] += 1
    probe["tokens"][0] += 1
    diff = compare_runs(clean, changed)
    assert diff["totals"]["timed"]["differing"] == 1 and diff["totals"]["probe"]["differing"] == 1
    assert {(d["index"], d["first_differing_token"]) for d in diff["differing"]} == {
        (timed["index"], 3), (probe["index"], 0)}
    assert not probes_identical(diff)
    paths = {name: tmp_path / f"{name}.json" for name in ("ref", "changed", "other")}
    other = copy.deepcopy(clean)
    other["digest"] = "0" * 16
    for name, data in zip(paths, (clean, changed, other)):
        paths[name].write_text(json.dumps(data))
    assert multi_model.main(["compare", str(paths["ref"]), str(paths["ref"])]) == 0
    assert multi_model.main(["compare", str(paths["ref"]), str(paths["changed"])]) == 1
    assert multi_model.main(["compare", str(paths["ref"]), str(paths["other"])]) == multi_model.EXIT_USAGE


def test_metric_values_sum_the_watched_series_over_labels():
    text = ("# HELP vllm:num_preemptions Preemptions\n# TYPE vllm:num_preemptions counter\n"
            'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n'
            'vllm:num_preemptions_total{engine="1",model_name="m"} 2.0\n'
            'vllm:e2e_request_latency_seconds_bucket{le="1.0"} 9.0\n'
            'kvelastic_host_hits_total{model_name="m",instance_name="a"} 4.0\n')
    assert metric_values(text) == {"vllm:num_preemptions_total": 5.0, "kvelastic_host_hits_total": 4.0}


def test_metric_values_keep_each_bucket_of_a_kvelastic_histogram():
    text = ("# HELP kvelastic_reclaim_wait_seconds Waits\n# TYPE kvelastic_reclaim_wait_seconds histogram\n"
            'kvelastic_reclaim_wait_seconds_bucket{instance_name="a",le="0.5",model_name="m"} 1.0\n'
            'kvelastic_reclaim_wait_seconds_bucket{instance_name="a",le="+Inf",model_name="m"} 2.0\n'
            'kvelastic_reclaim_wait_seconds_count{instance_name="a",model_name="m"} 2.0\n'
            'kvelastic_reclaim_wait_seconds_sum{instance_name="a",model_name="m"} 1.5\n')
    assert metric_values(text) == {'kvelastic_reclaim_wait_seconds_bucket{le="0.5"}': 1.0,
                                   'kvelastic_reclaim_wait_seconds_bucket{le="+Inf"}': 2.0,
                                   "kvelastic_reclaim_wait_seconds_count": 2.0,
                                   "kvelastic_reclaim_wait_seconds_sum": 1.5}


def test_bucket_quantiles_interpolate_as_prometheus_does():
    buckets = [(0.1, 0.0), (0.5, 2.0), (1.0, 4.0), (float("inf"), 5.0)]
    assert bucket_quantile(buckets, 0.4) == pytest.approx(0.5)  # rank 2: the top of the 0.1-0.5 bucket
    assert bucket_quantile(buckets, 0.6) == pytest.approx(0.75)  # rank 3: half way through 0.5-1.0
    assert bucket_quantile(buckets, 0.95) == 1.0  # in +Inf: the highest finite bound
    assert bucket_quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None


def test_engine_reclaim_numbers_reach_the_summary_from_metrics_and_logs(tmp_path):
    """A real ReclaimTiming, published and scraped as the servers would be; its log lines in a server log."""
    import logging

    from kvelastic.metrics.metrics import KvelasticCollector, StatsPublisher
    from kvelastic.scheduler.reclaim_timing import ReclaimTiming

    now = [0.0]
    timing = ReclaimTiming("model-a", clock=lambda: now[0])
    publisher = StatsPublisher("model-a", tmp_path / "stats", model_name="model-a")
    registry = prometheus_client.CollectorRegistry()
    registry.register(KvelasticCollector(tmp_path / "stats", parents=(os.getpid(),)))
    (tmp_path / "servers").mkdir()
    handler = logging.FileHandler(tmp_path / "servers" / "model-a.log")
    logger = logging.getLogger("vllm.kvelastic")
    level = logger.level
    logger.setLevel(logging.INFO)  # as vLLM's logging configuration sets it
    logger.addHandler(handler)
    samples = []

    def scrape(t: float) -> None:
        publisher.publish(timing.values(), timing.take_observations())
        text = prometheus_client.generate_latest(registry).decode()
        samples.append({"t": t, "servers": {"model-a": metric_values(text)}})
    try:
        timing.refused(1 << 20)
        timing.created(1 << 20)  # before the load: not counted
        timing.tick(0)
        scrape(0.0)
        for seconds in (0.2, 0.4, 0.6, 0.8, 3.0):
            timing.refused(1 << 20)
            now[0] += seconds
            timing.created(1 << 20)
            now[0] += 1.0
        timing.refused(1 << 20)
        now[0] += 10.0
        timing.tick(0)  # the last wait lapsed
        scrape(1.0)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()
    found = engine_histograms(samples, ["model-a"])
    waits = found["model-a"]["waits"]
    assert waits["count"] == 5 and waits["mean_s"] == pytest.approx(1.0)
    assert waits["p50_s"] == pytest.approx(0.625)  # rank 2.5 of 5, in the 0.5-0.75 bucket
    assert found["model-a"]["lapsed_waits"] == 1 and found["all"]["waits"]["count"] == 5
    logs = log_summary(read_logs(tmp_path / "servers"))
    assert logs["waits"]["count"] == 6 and logs["lapsed_waits"] == 1  # the one before the load is logged too
    assert logs["waits"]["p50_s"] == pytest.approx(0.4) and logs["waits"]["max_s"] == pytest.approx(3.0)
    assert engine_histograms([{"t": 0, "servers": {"m": {"vllm:num_preemptions_total": 1.0}}}], ["m"]) is None


def test_summarize_reads_the_reclaim_lines_of_a_log_folder(fake_run, tmp_path, capsys):
    from kvelastic.scheduler.reclaim_timing import Episode, format_line

    _, result, _ = fake_run
    (tmp_path / "servers").mkdir()
    (tmp_path / "servers" / "fast.log").write_text(
        "INFO starting\n" + "".join(f"(EngineCore pid=1) INFO [x.py:1] {format_line(e)}\n" for e in (
            Episode("wait", "granted", "fast", 0.25, 1.0, 10, 10, 2),
            Episode("release", "released", "fast", 0.125, 2.0, 10, 20, 1))))
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    assert multi_model.main(["summarize", str(path), "--server-logs", str(tmp_path / "servers")]) == 0
    out = capsys.readouterr().out
    assert "engines' logs (exact, 1 files, 0 lines left out): waits 1 p50 250 ms" in out
    assert "releases 1 p50 125 ms" in out
    assert "no kvelastic_reclaim_* histograms" in out  # the fake servers export none
    assert multi_model.main(["summarize", str(path), str(path), "--server-logs", str(tmp_path)]) == \
        multi_model.EXIT_USAGE


def test_a_gpu_process_is_put_to_the_server_it_descends_from():
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)")
    with subprocess.Popen([sys.executable, "-c", code, "serve", "--port", "8123"], stdout=subprocess.PIPE,
                          text=True) as server:
        child = int(server.stdout.readline())
        try:
            assert owner_port(child, [8122, 8123]) == 8123
            assert owner_port(server.pid, [8123]) == 8123
            assert owner_port(child, [9999]) is None
        finally:
            os.kill(child, signal.SIGKILL)
            server.kill()


def test_reclaim_episodes_run_from_a_refusal_to_the_next_grant():
    def sample(t, wanted_a, mapped_b):
        return {"t": t, "accounts": [{"gpu": "g", "budget": 10, "members": {
            "a": {"mapped_bytes": 1, "wanted_bytes": wanted_a}, "b": {"mapped_bytes": mapped_b, "wanted_bytes": 0}}}]}
    found = reclaim_episodes([sample(0.0, 0, 8), sample(0.2, 4, 8), sample(0.4, 4, 6), sample(0.6, 0, 4),
                              sample(1.0, 2, 4)])
    assert found["count"] == 1 and found["unresolved"] == 1
    episode = found["episodes"][0]
    assert episode["member"] == "a" and episode["seconds"] == pytest.approx(0.4)
    assert episode["wanted_bytes"] == 4 and episode["others_released_bytes"] == 4


def test_a_budget_refusal_in_a_real_account_is_one_reclaim_episode(tmp_path, monkeypatch):
    """The account sampler reads the account file engines write; a refusal lasts until the next grant."""
    from kvelastic.cluster import SharedAccount

    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    gib = 1 << 30
    clock = iter(range(100)).__next__  # one sample per "second", in order
    account = SharedAccount.open("GPU-mm", 10 * gib)
    try:
        busy, idle = account.join("busy", model="m", port=1), account.join("idle", model="m", port=2)
        assert idle.acquire(8 * gib) and busy.acquire(gib)
        reader = AccountReader()
        sampler = Sampler("account", reader, 1.0, clock, close=reader.close)
        sampler.sample()
        assert not busy.acquire(4 * gib)  # over the budget: refused, a want the idle one sees
        sampler.sample()
        idle.release(6 * gib)
        sampler.sample()
        assert busy.acquire(4 * gib)  # granted: the want is cleared
        sampler.sample()
    finally:
        account.close()
    samples = sampler.stop()["samples"]
    members = [s["accounts"][0]["members"] for s in samples]
    assert [m["busy"]["wanted_bytes"] for m in members] == [0, 4 * gib, 4 * gib, 0, 0]
    assert samples[0]["accounts"][0]["budget"] == 10 * gib
    found = reclaim_episodes(samples)
    assert found["count"] == 1 and found["unresolved"] == 0
    assert found["episodes"][0] == {"member": "busy", "start": 1, "seconds": 2, "wanted_bytes": 4 * gib,
                                    "others_released_bytes": 6 * gib}


def test_a_busy_period_says_how_much_of_it_the_engine_waited_for_memory(tmp_path, monkeypatch):
    """From a real account's samples: the share of a window in which a member wanted memory."""
    from kvelastic.cluster import SharedAccount

    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    gib = 1 << 30
    clock = iter(range(100)).__next__
    account = SharedAccount.open("GPU-short", 4 * gib)
    try:
        model = account.join("model-a", model="m", port=1)
        reader = AccountReader()
        sampler = Sampler("account", reader, 1.0, clock, close=reader.close)
        assert model.acquire(3 * gib)
        sampler.sample()  # t=0: has what it asked for
        assert not model.acquire(2 * gib)  # the budget refuses: a want
        sampler.sample()  # t=1
        sampler.sample()  # t=2: still wanting
        model.release(gib)
        assert model.acquire(2 * gib)  # granted: the want is gone
        sampler.sample()  # t=3
    finally:
        account.close()
    result = {"account": {"samples": sampler.stop()["samples"]}}
    assert short_of_memory(result, "model-a", 0, 4) == pytest.approx(0.5)
    assert short_of_memory(result, "model-a", 1, 3) == 1.0
    assert short_of_memory(result, "model-a", 3, 10) == 0.0
    assert short_of_memory(result, "model-b", 0, 4) is None  # not a member: nothing to say
    assert short_of_memory({}, "model-a", 0, 4) is None  # a run without kvelastic


def _wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_cpu_is_put_to_the_api_server_and_the_engine_below_it():
    """Real processes: a 'serve --port N' process that supervises two spinning children, one titled as vLLM
    titles its API servers; the reader puts that one's CPU to the API server, the other's to the engine."""
    spin = "import time\nend = time.time() + 10\nwhile time.time() < end: pass\n"
    server_code = ("import os, subprocess, sys, time\n"
                   f"child = subprocess.Popen([sys.executable, '-c', {spin!r}])\n"
                   # the title spelt in two pieces: this code is the command line of the forked child below
                   f"api = subprocess.Popen([sys.executable, '-c', {spin!r}, 'VLLM:' + ':APIServer_0'])\n"
                   "if os.fork() == 0:\n"  # a forked child keeps the 'serve --port' command line
                   "    time.sleep(10)\n"
                   "    os._exit(0)\n"
                   "time.sleep(10)\n")
    server = subprocess.Popen([sys.executable, "-c", server_code, "serve", "--port", "18931"],
                              start_new_session=True)
    try:
        children_up = lambda: len(descendants(children_of(process_table()), server.pid)) >= 3  # noqa: E731
        _wait_for(children_up, timeout=8)
        reader = CpuReader({18931: "model-x"})
        _wait_for(lambda: reader()["servers"].get("model-x", {}).get("engine_s", 0) > 0, timeout=8)
        first = {"t": 0.0, **reader()}
        time.sleep(1.5)
        last = {"t": 1.5, **reader()}
        assert list(reader.roots) == [server.pid]  # the forked child is part of the engine, not a server
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # the server and everything it started
        server.wait()
    rates = cpu_rates([first, last], 0.0, 2.0, ["model-x", "model-y"])
    assert 0.2 < rates["servers"]["model-x"]["api_s"] < 1.3  # the titled child (the server itself sleeps)
    assert 0.2 < rates["servers"]["model-x"]["engine_s"] < 1.3  # the other child, counted apart
    assert rates["servers"]["model-y"] == {"api_s": None, "engine_s": None}  # no such server
    assert 0.0 < rates["host_busy"] <= 1.0
    assert rates["client"] is not None and rates["client"] < 0.5  # this test process sleeps
    assert cpu_rates([first], 0.0, 2.0, ["model-x"]) is None  # one sample gives no rate
    assert last["servers"]["model-x"]["api_n"] == 1  # one titled API server process


def _cpu_sample(t: float, api_s: float, api_n: int = 2) -> dict:
    return {"t": t, "servers": {"model-a": {"api_s": api_s, "engine_s": 0.0, "api_n": api_n}}}


def test_slow_requests_are_put_to_a_saturated_front_end_only_while_it_was_saturated():
    # two API servers: 0-1 s at 0.5 core in all, 1-2 s at 1.9 cores (saturated), 2-3 s at 1.0
    samples = [_cpu_sample(0.0, 0.0), _cpu_sample(1.0, 0.5), _cpu_sample(2.0, 2.4), _cpu_sample(3.0, 3.4)]
    request = lambda sent, ttft: {"model": "model-a", "sent_s": sent, "ttft_s": ttft}  # noqa: E731
    requests = [request(0.1, 0.2),   # fast: not slow at all
                request(0.2, 1.5),   # slow, its wait (0.2-1.7 s) overlaps the saturated second
                request(2.1, 1.2),   # slow, waited 2.1-3.3 s: the front end had spare cores
                request(0.0, None)]  # no first token: not counted here
    assert front_end_bound(samples, requests, ttft_slo_s=1.0) == {"slow": 2, "front_end_saturated": 1,
                                                                   "share": 0.85}
    one_server = [_cpu_sample(t, a, api_n=1) for t, a in ((0.0, 0.0), (1.0, 0.5), (2.0, 2.4), (3.0, 3.4))]
    assert front_end_bound(one_server, requests, 1.0)["front_end_saturated"] == 2  # 1 core is all one has
    old = [{"t": x["t"], "servers": {"model-a": {"api_s": x["servers"]["model-a"]["api_s"], "engine_s": 0.0}}}
           for x in samples]
    assert front_end_bound(old, requests, 1.0) is None  # samples without the process count say nothing
