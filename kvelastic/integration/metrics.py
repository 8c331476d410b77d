"""kvelastic_* metrics on vLLM's Prometheus ``/metrics``.

The numbers live in the engine-core process (pool, host tier), but ``/metrics``
is served by the API-server process. The engine therefore publishes a small
JSON snapshot under ``/dev/shm`` on every reclaimer tick, and a collector
registered in the API server's default registry reads the snapshots of its own
engine processes (those whose parent it is) when Prometheus scrapes. With
``PROMETHEUS_MULTIPROC_DIR`` set (several API servers) ``/metrics`` is built
from prometheus_client's multiprocess files alone; there the publisher also
writes the numbers as metrics of its own (``metrics_multiproc``).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Collection, Iterator

PREFIX = "kvelastic-stats-"
#: Snapshot key -> (metric name, help). Prometheus conventions: the unit ends the name (``_bytes``,
#: ``_blocks``), and prometheus_client exports a counter with ``_total`` after it.
GAUGES = {
    "mapped_bytes": ("kvelastic_mapped_bytes", "Physical KV bytes mapped on the GPU"),
    "held_bytes": ("kvelastic_held_bytes", "Physical KV bytes held (mapped, waiting for a fence, or warm)"),
    "limit_bytes": ("kvelastic_limit_bytes", "Physical KV byte limit of this engine (0: none)"),
    "cached_bytes": ("kvelastic_cached_bytes", "GPU bytes in groups holding only cached prefix blocks"),
    "host_bytes_used": ("kvelastic_host_used_bytes", "Host-tier bytes holding spilled blocks"),
    "arc_p": ("kvelastic_host_arc_target_blocks",
              "ARC's adaptive target size of its recency list (its p), as a count of KV blocks"),
}
COUNTERS = {
    "spilled_bytes": ("kvelastic_spilled_bytes", "KV bytes copied from the GPU to the host tier"),
    "reloaded_bytes": ("kvelastic_reloaded_bytes", "KV bytes copied back from the host tier on a prefix hit"),
    "host_hits": ("kvelastic_host_hits", "Prefix lookups served by the host tier"),
    "host_misses": ("kvelastic_host_misses", "Prefix lookups the host tier could not serve"),
}
#: ``model_name`` is vLLM's served model name, as on vLLM's own metrics; ``instance_name`` is the
#: engine's kvelastic name (KVELASTIC_NAME, as ``kvelastic status`` lists it).
LABELS = ("model_name", "instance_name")


def stats_dir() -> Path:
    """Where engines publish their snapshots: beside the GPUs' shared accounts."""
    from kvelastic.cluster.storage import shared_dir

    return shared_dir()


class StatsPublisher:
    """Writes this engine's snapshot atomically (write, then rename) for the collector.

    Each publisher has a file of its own (several engines may share a process),
    and each write its own temporary file (the reclaimer thread and a caller may
    publish at the same moment). Where ``/metrics`` is built from multiprocess
    files, it also writes the values there.
    """

    _numbers = itertools.count()

    def __init__(self, name: str, directory: Path | None = None, model_name: str = ""):
        from kvelastic.integration.metrics_multiproc import MultiprocessMirror

        self.name = name
        self.model_name = model_name
        self.path = (directory or stats_dir()) / f"{PREFIX}{os.getpid()}-{next(self._numbers)}.json"
        self._mirror = MultiprocessMirror.for_environment((model_name, name), GAUGES, COUNTERS)

    def publish(self, values: dict[str, Any]) -> None:
        record = {"name": self.name, "model_name": self.model_name, "pid": os.getpid(), "ppid": os.getppid(),
                  "time": time.time(), "values": values}
        tmp = self.path.with_name(f".{self.path.name}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)
        if self._mirror is not None:
            self._mirror.update(values)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _records(directory: Path, pattern: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The snapshot files matching ``pattern`` that parse, with their records."""
    for path in directory.glob(pattern):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            yield path, record


def find_snapshot(directory: Path, pid: int, name: str) -> dict[str, Any] | None:
    """The snapshot engine ``name`` in process ``pid`` wrote, or None (another process's file never counts)."""
    for _, record in _records(directory, f"{PREFIX}{pid}-*.json"):
        if record.get("name") == name and record.get("pid") == pid:
            return record
    return None


def read_snapshots(directory: Path, parents: Collection[int]) -> list[dict[str, Any]]:
    """Snapshots written by children of ``parents`` (or by ``parents`` themselves), skipping dead ones."""
    found = []
    for path, record in _records(directory, f"{PREFIX}*.json"):
        if record.get("ppid") not in parents and record.get("pid") not in parents:
            continue
        if not Path(f"/proc/{record['pid']}").exists():
            path.unlink(missing_ok=True)
            continue
        found.append(record)
    return found


class KvelasticCollector:
    """A prometheus_client collector over the snapshots of this process's engines."""

    def __init__(self, directory: Path | None = None, parents: tuple[int, ...] | None = None):
        self.directory = directory or stats_dir()
        self.parents = parents or (os.getpid(),)

    def describe(self) -> list:
        return []  # values are read at scrape time; nothing to pre-declare

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshots = read_snapshots(self.directory, self.parents)
        for table, kind in ((GAUGES, GaugeMetricFamily), (COUNTERS, CounterMetricFamily)):
            for key, (metric, help_text) in table.items():
                family = kind(metric, help_text, labels=LABELS)
                for s in snapshots:
                    if s["values"].get(key) is not None:
                        family.add_metric([str(s.get("model_name", "")), s["name"]], float(s["values"][key]))
                yield family


class _Registered:
    lock = threading.Lock()
    done = False


def register_collector() -> bool:
    """Register the collector in prometheus_client's default registry, once per process."""
    with _Registered.lock:
        if _Registered.done:
            return True
        try:
            from prometheus_client import REGISTRY
        except ImportError:
            return False
        REGISTRY.register(KvelasticCollector())
        _Registered.done = True
        return True
