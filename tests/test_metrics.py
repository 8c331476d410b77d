"""kvelastic_* metrics: the engine's snapshot file, read by a collector at scrape time."""

from __future__ import annotations

import os

import pytest

from kvelastic.integration.metrics import KvelasticCollector, StatsPublisher, read_snapshots

prometheus_client = pytest.importorskip("prometheus_client")


def test_collector_exports_an_engines_snapshot(tmp_path):
    publisher = StatsPublisher("llama-8001", tmp_path)
    publisher.publish({"mapped_bytes": 1 << 30, "held_bytes": 3 << 29, "limit_bytes": 0, "cached_bytes": 5,
                       "host_bytes_used": 7, "arc_p": 2.5, "spilled_bytes": 11, "reloaded_bytes": 13,
                       "host_hits": 17, "host_misses": 19})
    registry = prometheus_client.CollectorRegistry()
    registry.register(KvelasticCollector(tmp_path, parent=os.getppid()))
    text = prometheus_client.generate_latest(registry).decode()
    assert 'kvelastic_mapped_bytes{engine="llama-8001"} 1.073741824e+09' in text
    assert 'kvelastic_reloaded_bytes_total{engine="llama-8001"} 13.0' in text
    assert 'kvelastic_arc_p{engine="llama-8001"} 2.5' in text
    publisher.remove()
    assert "llama-8001" not in prometheus_client.generate_latest(registry).decode()


def test_snapshots_of_other_parents_and_dead_engines_are_ignored(tmp_path):
    mine = StatsPublisher("mine", tmp_path)
    mine.publish({"mapped_bytes": 1})
    (tmp_path / "kvelastic-stats-999999999.json").write_text(
        '{"name": "ghost", "pid": 999999999, "ppid": %d, "time": 0, "values": {}}' % os.getppid())
    (tmp_path / "kvelastic-stats-1.json").write_text('{"name": "other", "pid": 1, "ppid": 0, "values": {}}')
    (tmp_path / "kvelastic-stats-2.json").write_text("not json")
    names = [s["name"] for s in read_snapshots(tmp_path, os.getppid())]
    assert names == ["mine"]
    assert not (tmp_path / "kvelastic-stats-999999999.json").exists()  # a dead engine's file is removed
