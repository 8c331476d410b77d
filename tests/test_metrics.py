"""kvelastic_* metrics: the engine's snapshot file, read by a collector at scrape time."""

from __future__ import annotations

import os

import pytest

from kvelastic.cluster.liveness import own_pid_namespace
from kvelastic.metrics.metrics import KvelasticCollector, StatsPublisher, read_snapshots
from kvelastic.shared.names import Owner, stats_name

prometheus_client = pytest.importorskip("prometheus_client")


def test_collector_exports_an_engines_snapshot(tmp_path):
    publisher = StatsPublisher("llama-8001", tmp_path, model_name="llama")
    publisher.publish({"mapped_bytes": 1 << 30, "held_bytes": 3 << 29, "limit_bytes": 0, "cached_bytes": 5,
                       "host_bytes_used": 7, "arc_p": 2.5, "spilled_bytes": 11, "reloaded_bytes": 13,
                       "host_hits": 17, "host_misses": 19})
    registry = prometheus_client.CollectorRegistry()
    registry.register(KvelasticCollector(tmp_path, parents=(os.getppid(),)))
    text = prometheus_client.generate_latest(registry).decode()
    labels = '{instance_name="llama-8001",model_name="llama"}'
    assert f"kvelastic_mapped_bytes{labels} 1.073741824e+09" in text
    assert f"kvelastic_reloaded_bytes_total{labels} 13.0" in text
    assert f"kvelastic_host_used_bytes{labels} 7.0" in text
    assert f"kvelastic_host_arc_target_blocks{labels} 2.5" in text
    assert "# HELP kvelastic_host_arc_target_blocks ARC's adaptive target size of its recency list (its p), " \
           "as a count of KV blocks" in text
    publisher.remove()
    assert "llama-8001" not in prometheus_client.generate_latest(registry).decode()


def _planted(folder, pid: int, text: str, start: int = 0) -> str:
    """A snapshot file named as the engine ``pid`` of this pid namespace would name it."""
    name = stats_name(Owner(own_pid_namespace(), pid, start), 0)
    (folder / name).write_text(text)
    return name


def test_snapshots_of_other_parents_and_dead_engines_are_ignored_then_swept(tmp_path):
    mine = StatsPublisher("mine", tmp_path)
    mine.publish({"mapped_bytes": 1})
    ghost = _planted(tmp_path, 999999999, '{"name": "ghost", "pid": 999999999, "ppid": %d, "time": 0, '
                                          '"values": {}}' % os.getppid())
    _planted(tmp_path, 1, '{"name": "other", "pid": 1, "ppid": 0, "time": 0, "values": {}}')
    _planted(tmp_path, 2, "not json")
    names = [s["name"] for s in read_snapshots(tmp_path, [os.getppid()])]
    assert names == ["mine"]
    assert (tmp_path / ghost).exists()  # a reader never deletes
    StatsPublisher("next", tmp_path)  # the next engine removes what dead engines left
    assert not (tmp_path / ghost).exists() and (tmp_path / mine.file_name).exists()


def test_an_engine_in_this_process_is_counted_once(tmp_path):
    StatsPublisher("here", tmp_path).publish({"mapped_bytes": 1})
    assert [s["name"] for s in read_snapshots(tmp_path, [os.getpid(), os.getppid()])] == ["here"]


ENGINE = """\
import sys, time
from kvelastic.metrics.metrics import Histogram, StatsPublisher
publisher = StatsPublisher("engine-a", model_name="m")
publisher.publish({"mapped_bytes": 4096, "spilled_bytes": 8192, "host_hits": 3})
waits = Histogram()
for seconds in (0.3, 0.7, 4.0):
    waits.observe(seconds)
publisher.publish({"mapped_bytes": 2048, "spilled_bytes": 12288, "host_hits": 3,
                   **waits.values("reclaim_wait_seconds")}, {"reclaim_wait_seconds": [0.3, 0.7, 4.0]})
print("published", flush=True)
time.sleep(float(sys.argv[1]))
"""

API_SERVER = """\
import subprocess, sys
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kvelastic.metrics.metrics import register_collector
from vllm.entrypoints.serve.instrumentator.metrics import attach_router
register_collector()  # what activation does in every vLLM process
engine = subprocess.Popen([sys.executable, "-c", sys.argv[1], "60"], stdout=subprocess.PIPE, text=True)
try:
    assert engine.stdout.readline().strip() == "published"
    app = FastAPI()
    attach_router(app)
    print(TestClient(app).get("/metrics").text)
finally:
    engine.kill()
"""


@pytest.mark.parametrize("multiprocess", [False, True], ids=["one-api-server", "multiprocess-dir"])
def test_vllm_metrics_route_serves_the_engines_numbers(tmp_path, multiprocess):
    """Through vLLM's real ``/metrics`` route: the default registry, or (several API servers,
    ``PROMETHEUS_MULTIPROC_DIR``) a registry rebuilt from multiprocess files on every scrape."""
    import subprocess
    import sys

    pytest.importorskip("vllm.entrypoints.serve.instrumentator.metrics", reason="needs vllm's /metrics router")
    env = {**os.environ, "KVELASTIC_SHARED_DIR": str(tmp_path)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if multiprocess:
        (tmp_path / "prom").mkdir()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path / "prom")
    server = subprocess.run([sys.executable, "-c", API_SERVER, ENGINE], env=env, capture_output=True, text=True,
                            timeout=300)
    assert server.returncode == 0, server.stderr[-3000:]
    labels = '{instance_name="engine-a",model_name="m"}'
    assert f"kvelastic_mapped_bytes{labels} 2048.0" in server.stdout
    assert f"kvelastic_spilled_bytes_total{labels} 12288.0" in server.stdout
    assert f"kvelastic_host_hits_total{labels} 3.0" in server.stdout
    assert server.stdout.count("# TYPE kvelastic_mapped_bytes ") == 1
    for le, count in (("0.25", 0.0), ("0.5", 1.0), ("1.0", 2.0), ("5.0", 3.0), ("+Inf", 3.0)):
        assert f'kvelastic_reclaim_wait_seconds_bucket{{instance_name="engine-a",le="{le}",model_name="m"}} ' \
               f"{count}" in server.stdout
    assert f"kvelastic_reclaim_wait_seconds_sum{labels} 5.0" in server.stdout
    assert server.stdout.count("# TYPE kvelastic_reclaim_wait_seconds histogram") == 1


def test_a_histogram_a_snapshot_garbles_is_left_out(tmp_path):
    from kvelastic.metrics.metrics import Histogram

    waits = Histogram()
    waits.observe(0.3)
    values = waits.values("reclaim_wait_seconds")
    good, bad = StatsPublisher("good", tmp_path), StatsPublisher("bad", tmp_path)
    good.publish(values)
    bad.publish({**values, "reclaim_wait_seconds_bucket_3": 5.0})  # counts that are not cumulative
    registry = prometheus_client.CollectorRegistry()
    registry.register(KvelasticCollector(tmp_path, parents=(os.getpid(),)))
    text = prometheus_client.generate_latest(registry).decode()
    assert 'kvelastic_reclaim_wait_seconds_count{instance_name="good",model_name=""} 1.0' in text
    assert 'instance_name="bad"' not in text.split("# HELP kvelastic_reclaim_wait_seconds ")[1]


def test_multiprocess_files_are_written_only_where_they_are_read(tmp_path, monkeypatch):
    from kvelastic.metrics.metrics_multiproc import multiprocess_values

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert multiprocess_values() is False
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # too late: prometheus_client is imported
    assert multiprocess_values() is False
    assert StatsPublisher("late", tmp_path)._mirror is None


def test_two_engines_in_one_process_keep_their_own_snapshots(tmp_path):
    first, second = StatsPublisher("one", tmp_path), StatsPublisher("two", tmp_path)
    first.publish({"mapped_bytes": 1})
    second.publish({"mapped_bytes": 2})
    found = {s["name"]: s["values"]["mapped_bytes"] for s in read_snapshots(tmp_path, [os.getpid()])}
    assert found == {"one": 1, "two": 2}


def test_concurrent_publishes_never_fail(tmp_path):
    """The reclaimer thread and a caller may publish at the same moment."""
    import threading

    publisher = StatsPublisher("busy", tmp_path)
    errors = []

    def spin(k: int) -> None:
        try:
            for i in range(300):
                publisher.publish({"mapped_bytes": k * 1000 + i})
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=spin, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [s["name"] for s in read_snapshots(tmp_path, [os.getpid()])] == ["busy"]


def test_metric_names_follow_prometheus_conventions():
    """A unit ends every name (bytes, seconds, or blocks where the help says so), or the events a counter counts;
    counters get _total on export."""
    from kvelastic.metrics.metrics import COUNTERS, GAUGES, HISTOGRAMS, LABELS

    for metric, help_text in [*GAUGES.values(), *COUNTERS.values()]:
        assert metric.startswith("kvelastic_") and not metric.endswith("_total")
        assert metric.endswith(("_bytes", "_blocks", "_seconds", "_hits", "_misses", "_waits", "_asks")), metric
        assert not metric.endswith("_blocks") or "count of KV blocks" in help_text
    for metric, _ in HISTOGRAMS.values():
        assert metric.startswith("kvelastic_") and metric.endswith("_seconds"), metric
    assert "model_name" in LABELS  # as on vLLM's own metrics
