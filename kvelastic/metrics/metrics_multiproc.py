"""kvelastic_* in prometheus_client's multiprocess files, for a ``/metrics`` built from them.

With several API-server processes (``--api-server-count``), or with
``PROMETHEUS_MULTIPROC_DIR`` set by the user, the handler behind vLLM's
``/metrics`` builds a fresh registry over the files in that directory on every
scrape (prometheus-fastapi-instrumentator's ``expose``): no collector registered
in any process is consulted, so the snapshot collector of ``metrics.py`` cannot
be seen there. The engine therefore also writes its numbers as prometheus_client
metrics of its own, which in multiprocess mode live in that directory and are
merged into every scrape like vLLM's own.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Mapping, Sequence

log = logging.getLogger("vllm.kvelastic")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_values() -> bool:
    """Whether prometheus_client in this process writes metric values to the multiprocess directory."""
    if not os.environ.get(MULTIPROC_ENV):
        return False
    try:
        from prometheus_client import values
    except ImportError:
        return False
    if values.ValueClass.__name__ == "MutexValue":  # chosen when prometheus_client was first imported
        log.warning("kvelastic: %s is set but prometheus_client was imported before it was; kvelastic_* "
                    "metrics cannot reach the multiprocess /metrics of this process", MULTIPROC_ENV)
        return False
    return True


class MultiprocessMirror:
    """One engine's gauges, counters and histograms as prometheus_client metrics, labelled with its model and name.

    Gauges use the ``mostrecent`` mode, so a scrape shows the last value any
    process wrote for this engine. The engine's counters are running totals;
    the mirror adds what each total grew by since the last update. A histogram
    cannot be rebuilt from totals, so it observes each new duration itself.
    """

    def __init__(self, labels: tuple[str, str], gauges: Mapping[str, tuple[str, str]],
                 counters: Mapping[str, tuple[str, str]], histograms: Mapping[str, tuple[str, str]]):
        from prometheus_client import Counter, Gauge, Histogram

        from kvelastic.metrics.metrics import BUCKETS_S, LABELS

        self.labels = labels  # values of LABELS: (model name, instance name)
        self._gauges = {key: Gauge(metric, text, LABELS, registry=None, multiprocess_mode="mostrecent")
                        for key, (metric, text) in gauges.items()}
        self._counters = {key: Counter(metric, text, LABELS, registry=None)
                          for key, (metric, text) in counters.items()}
        self._histograms = {key: Histogram(metric, text, LABELS, registry=None, buckets=BUCKETS_S)
                            for key, (metric, text) in histograms.items()}
        self._totals: dict[str, float] = {}
        self._lock = threading.Lock()  # the reclaimer thread and a caller may publish at once

    @classmethod
    def for_environment(cls, labels: tuple[str, str], gauges: Mapping[str, tuple[str, str]],
                        counters: Mapping[str, tuple[str, str]],
                        histograms: Mapping[str, tuple[str, str]]) -> "MultiprocessMirror | None":
        """A mirror when this process writes multiprocess metric files, else None."""
        return cls(labels, gauges, counters, histograms) if multiprocess_values() else None

    def update(self, values: Mapping[str, Any], observations: Mapping[str, Sequence[float]]) -> None:
        """Gauges and counters from ``values``; each histogram observes its new durations in ``observations``."""
        with self._lock:
            self._update(values)
            for key, histogram in self._histograms.items():
                for seconds in observations.get(key, ()):
                    histogram.labels(*self.labels).observe(seconds)

    def _update(self, values: Mapping[str, Any]) -> None:
        for key, gauge in self._gauges.items():
            if values.get(key) is not None:
                gauge.labels(*self.labels).set(float(values[key]))
        for key, counter in self._counters.items():
            if values.get(key) is None:
                continue
            total = float(values[key])
            grown = total - self._totals.get(key, 0.0)
            if grown > 0:
                counter.labels(*self.labels).inc(grown)
            self._totals[key] = total
