"""kvelastic_* metrics on vLLM's Prometheus ``/metrics``.

The numbers live in the engine-core process (pool, host tier), but ``/metrics``
is served by the API-server process. The engine therefore publishes a small
JSON snapshot under ``/dev/shm`` on every reclaimer tick, and a collector
registered in the API server's default registry reads the snapshots of its own
engine processes (those whose parent it is) when Prometheus scrapes. The
snapshots are shared files, so they live in the scope's folder and are read
as untrusted input: bounded, schema-checked JSON (:mod:`kvelastic.shared`). With
``PROMETHEUS_MULTIPROC_DIR`` set (several API servers) ``/metrics`` is built
from prometheus_client's multiprocess files alone; there the publisher also
writes the numbers as metrics of its own (``metrics_multiproc``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

from kvelastic.cluster.liveness import own_pid_namespace, provably_dead
from kvelastic.errors import KvelasticError
from kvelastic.shared import bounded_json
from kvelastic.shared.errors import BadSharedData, SharedFileError
from kvelastic.shared.files import SafeDir
from kvelastic.shared.names import STATS_PREFIX, STATS_SUFFIX, Owner, own_owner, owner_of, stats_name
from kvelastic.shared.scope import current_scope
from kvelastic.shared.sweep import sweep

log = logging.getLogger("kvelastic")
#: Snapshot key -> (metric name, help). Prometheus conventions: the unit ends the name (``_bytes``,
#: ``_blocks``), and prometheus_client exports a counter with ``_total`` after it.
GAUGES = {
    "mapped_bytes": ("kvelastic_mapped_bytes", "Physical KV bytes mapped on the GPU"),
    "held_bytes": ("kvelastic_held_bytes", "Physical KV bytes held (mapped, waiting for a fence, or warm)"),
    "limit_bytes": ("kvelastic_limit_bytes", "Physical KV byte limit of this engine (0: none)"),
    "cached_bytes": ("kvelastic_cached_bytes", "GPU bytes in groups holding only cached prefix blocks"),
    "host_bytes_used": ("kvelastic_host_used_bytes", "Host-tier bytes holding spilled blocks"),
    "host_pinned_bytes": ("kvelastic_host_pinned_bytes",
                          "Host-tier bytes pinned and usable (grows while the tier pins in the background after "
                          "start-up)"),
    "arc_p": ("kvelastic_host_arc_target_blocks",
              "ARC's adaptive target size of its recency list (its p), as a count of KV blocks"),
}
COUNTERS = {
    "spilled_bytes": ("kvelastic_spilled_bytes", "KV bytes copied from the GPU to the host tier"),
    "reloaded_bytes": ("kvelastic_reloaded_bytes", "KV bytes copied back from the host tier on a prefix hit"),
    "store_seconds": ("kvelastic_spill_gpu_seconds",
                      "GPU time of the copies to the host tier (CUDA events around each batch on the copy stream)"),
    "load_seconds": ("kvelastic_reload_gpu_seconds",
                     "GPU time of the copies back from the host tier (CUDA events around each batch on the copy "
                     "stream)"),
    "host_async_loaded_blocks": ("kvelastic_host_async_loaded_blocks",
                                 "Host-tier blocks loaded while their request waited, as a count of KV blocks"),
    "host_hits": ("kvelastic_host_hits", "Prefix lookups served by the host tier"),
    "host_misses": ("kvelastic_host_misses", "Prefix lookups the host tier could not serve"),
    "reclaim_released_bytes": ("kvelastic_reclaim_released_bytes",
                               "Physical KV bytes this engine gave back to the GPU's shared account while other "
                               "engines waited for memory"),
    "reclaim_lapsed_waits": ("kvelastic_reclaim_lapsed_waits",
                             "Waits for the shared budget that ended without a grant: no refusal renewed the want "
                             "for its lifetime (5 s), the demand went away"),
    "pool_lock_waits": ("kvelastic_pool_lock_waits",
                        "Times a thread of the engine waited 1 ms or more for its page pool's lock"),
    "pool_lock_wait_seconds": ("kvelastic_pool_lock_wait_seconds",
                               "Seconds the engine's threads waited for its page pool's lock, in waits of 1 ms or "
                               "more"),
    "reclaim_unserved_asks": ("kvelastic_reclaim_unserved_asks",
                              "Times other engines wanted memory back from this one and stopped wanting it before "
                              "any was released"),
}
#: Snapshot key -> (metric name, help) of histograms; the snapshot holds :meth:`Histogram.values`.
HISTOGRAMS = {
    "reclaim_wait_seconds": ("kvelastic_reclaim_wait_seconds",
                             "Seconds this engine waited for memory of the GPU's shared budget: from the refusal "
                             "that began a wait to the first grant after it whose pages were created"),
    "reclaim_release_seconds": ("kvelastic_reclaim_release_seconds",
                                "Seconds from the upkeep tick that read other engines' want to the release of "
                                "destroyed pages that covered it"),
}
#: Upper bounds of the histograms' buckets (+Inf is implied); reclaim targets 1 s at the 95th percentile.
BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
#: ``model_name`` is vLLM's served model name, as on vLLM's own metrics; ``instance_name`` is the
#: engine's kvelastic name (KVELASTIC_NAME, as ``kvelastic status`` lists it).
LABELS = ("model_name", "instance_name")


class Histogram:
    """Durations counted in the buckets of ``BUCKETS_S``, kept as a snapshot can carry them.

    The snapshot's values are flat numbers, so a histogram ``key`` travels as
    ``key_bucket_<i>`` (observations up to ``BUCKETS_S[i]``, cumulative as
    Prometheus exports them), ``key_sum`` and ``key_count``. Not thread-safe: its
    owner serializes the calls.
    """

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_S) + 1)  # per bucket, the last one past every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def values(self, key: str) -> dict[str, float]:
        cumulative = itertools.accumulate(self.counts[:-1])
        return {**{f"{key}_bucket_{i}": float(n) for i, n in enumerate(cumulative)},
                f"{key}_sum": self.sum, f"{key}_count": float(self.count)}


def histogram_keys(key: str) -> list[str]:
    """The snapshot keys of histogram ``key`` (see :class:`Histogram`)."""
    return [f"{key}_bucket_{i}" for i in range(len(BUCKETS_S))] + [f"{key}_sum", f"{key}_count"]


def histogram_buckets(values: dict[str, Any], key: str) -> list[tuple[str, float]] | None:
    """Histogram ``key`` of a snapshot as prometheus_client's (le, cumulative count) pairs, or None.

    None where the snapshot lacks it or its counts are not cumulative (the file is untrusted).
    """
    from prometheus_client.utils import floatToGoString

    if any(k not in values for k in histogram_keys(key)):
        return None
    counts = [values[f"{key}_bucket_{i}"] for i in range(len(BUCKETS_S))] + [values[f"{key}_count"]]
    if counts[0] < 0 or any(b < a for a, b in zip(counts, counts[1:])) or values[f"{key}_sum"] < 0:
        return None
    return [(floatToGoString(b), float(n)) for b, n in zip((*BUCKETS_S, math.inf), counts)]


MAX_SNAPSHOT_BYTES = 64 * 1024
_ENGINE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_SNAPSHOT = {"name": str, "model_name": str, "pid": int, "ppid": int, "time": (int, float), "values": dict}
MAX_MODEL_NAME = 512


def stats_dir() -> Path:
    """Where engines publish their snapshots: this user's (or group's) shared folder, beside the accounts."""
    from kvelastic.cluster.storage import shared_dir

    return shared_dir()


def open_stats_dir(directory: Path | None, *, create: bool) -> SafeDir | None:
    """The checked folder of snapshots (``directory``, or this scope's folder); None if it does not exist."""
    scope = current_scope(None if directory is None else directory.parent)
    return SafeDir.open(directory if directory is not None else scope.path, scope, create=create)


class StatsPublisher:
    """Writes this engine's snapshot atomically (write, then rename) for the collector.

    Each publisher has a file of its own (several engines may share a process),
    and each write its own temporary file (the reclaimer thread and a caller may
    publish at the same moment). Where ``/metrics`` is built from multiprocess
    files, it also writes the values there. Publishing never raises: a problem
    with the shared folder (full, unsafe) is logged once. A new publisher first
    removes the snapshots of engines that died.
    """

    _numbers = itertools.count()

    def __init__(self, name: str, directory: Path | None = None, model_name: str = ""):
        from kvelastic.metrics.metrics_multiproc import MultiprocessMirror

        self.name = name
        self.model_name = model_name
        self.directory = directory
        self.file_name = stats_name(own_owner(), next(self._numbers))
        self._mirror = MultiprocessMirror.for_environment((model_name, name), GAUGES, COUNTERS, HISTOGRAMS)
        self._problem = ""
        self._with_folder(sweep, create=True)

    @property
    def path(self) -> Path:
        return (self.directory if self.directory is not None else stats_dir()) / self.file_name

    def publish(self, values: dict[str, Any], observations: dict[str, list[float]] | None = None) -> None:
        """Write ``values``; ``observations`` (new durations per histogram key) feed the multiprocess files."""
        finite = {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        record = {"name": self.name, "model_name": self.model_name, "pid": os.getpid(), "ppid": os.getppid(),
                  "time": time.time(), "values": finite}
        self._with_folder(lambda folder: folder.write_atomic(self.file_name, bounded_json.dumps(record)),
                          create=True)
        if self._mirror is not None:
            self._mirror.update(finite, observations or {})

    def remove(self) -> None:
        self._with_folder(lambda folder: folder.unlink_owned(self.file_name), create=False)

    def _with_folder(self, action: Callable[[SafeDir], object], *, create: bool) -> None:
        try:
            folder = open_stats_dir(self.directory, create=create)
            if folder is None:
                return
            with folder:
                action(folder)
        except (KvelasticError, OSError) as error:
            problem = f"{type(error).__name__}: {error}"
            if problem != self._problem:
                self._problem = problem
                log.warning("kvelastic: the metrics snapshot of %s cannot be written: %s", self.name, problem)


def parse_snapshot(data: bytes, what: str) -> dict[str, Any]:
    """A snapshot as :class:`StatsPublisher` writes it, with only the known numbers; BadSharedData otherwise."""
    record = bounded_json.expect(bounded_json.loads(data, what), _SNAPSHOT, what)
    if not _ENGINE_NAME.fullmatch(record["name"]) or len(record["model_name"]) > MAX_MODEL_NAME:
        raise BadSharedData(f"{what}: engine name {record['name'][:80]!r} or its model name is not one "
                            f"kvelastic writes")
    known = GAUGES.keys() | COUNTERS.keys() | {k for key in HISTOGRAMS for k in histogram_keys(key)}
    record["values"] = {k: v for k, v in record["values"].items()
                        if k in known and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return record


def _records(folder: SafeDir, owned_by: Callable[[Owner], bool]) -> Iterator[tuple[Owner, dict[str, Any]]]:
    """The well-formed snapshots whose file names say they belong to a process ``owned_by`` accepts."""
    for name in folder.names(STATS_PREFIX):
        owner = owner_of(name)
        if owner is None or not name.endswith(STATS_SUFFIX) or not owned_by(owner):
            continue
        try:
            record = parse_snapshot(folder.read_bytes(name, MAX_SNAPSHOT_BYTES), str(folder.path / name))
        except (SharedFileError, OSError):
            continue
        if record["pid"] == owner.pid:
            yield owner, record


def find_snapshot(directory: Path, pid: int, name: str, pid_ns: int | None = None) -> dict[str, Any] | None:
    """The snapshot engine ``name`` in process ``pid`` wrote, or None (another process's file never counts)."""
    ns = own_pid_namespace() if pid_ns is None else pid_ns
    folder = open_stats_dir(directory, create=False)
    if folder is None:
        return None
    with folder:
        for _, record in _records(folder, lambda owner: owner.pid == pid and owner.pid_ns == ns):
            if record["name"] == name:
                return record
    return None


def read_snapshots(directory: Path, parents: Collection[int]) -> list[dict[str, Any]]:
    """Snapshots written by children of ``parents`` (or by ``parents`` themselves), skipping dead ones."""
    ns = own_pid_namespace()
    folder = open_stats_dir(directory, create=False)
    if folder is None:
        return []
    with folder:
        return [record for owner, record in _records(folder, lambda owner: owner.pid_ns == ns)
                if (record["ppid"] in parents or record["pid"] in parents) and not provably_dead(*owner)]


class KvelasticCollector:
    """A prometheus_client collector over the snapshots of this process's engines.

    It runs in the API server's event loop on every scrape, so it never
    raises and never waits: a folder it cannot read yields no samples (logged
    once), and files are opened without blocking (:mod:`kvelastic.shared.files`).
    """

    def __init__(self, directory: Path | None = None, parents: tuple[int, ...] | None = None):
        self.directory = directory
        self.parents = parents or (os.getpid(),)
        self._problem = ""

    def describe(self) -> list:
        return []  # values are read at scrape time; nothing to pre-declare

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snapshots = self._snapshots()
        for table, kind in ((GAUGES, GaugeMetricFamily), (COUNTERS, CounterMetricFamily)):
            for key, (metric, help_text) in table.items():
                family = kind(metric, help_text, labels=LABELS)
                for s in snapshots:
                    if s["values"].get(key) is not None:
                        family.add_metric([s["model_name"], s["name"]], float(s["values"][key]))
                yield family
        for key, (metric, help_text) in HISTOGRAMS.items():
            family = HistogramMetricFamily(metric, help_text, labels=LABELS)
            for s in snapshots:
                buckets = histogram_buckets(s["values"], key)
                if buckets is not None:
                    family.add_metric([s["model_name"], s["name"]], buckets, float(s["values"][f"{key}_sum"]))
            yield family

    def _snapshots(self) -> list[dict[str, Any]]:
        try:
            return read_snapshots(self.directory if self.directory is not None else stats_dir(), self.parents)
        except Exception as error:  # noqa: BLE001 - a scrape must never fail because of a shared file
            problem = f"{type(error).__name__}: {error}"
            if problem != self._problem:
                self._problem = problem
                log.warning("kvelastic: /metrics shows no kvelastic_* values: %s", problem)
            return []


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
