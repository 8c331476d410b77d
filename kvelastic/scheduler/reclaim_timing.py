"""How long KV memory takes to change hands between engines on one GPU, timed inside each engine.

Issue 20 asks for the reclaim latency "from the engines' own timestamps". A
reclaim has two sides, each timed by the engine it happens in, on its own
monotonic clock:

* **A wait** (the engine that wants memory) begins at a refusal by the GPU's
  shared budget while no wait is open, and ends at the first grant after it
  whose pages were created: memory flows to the engine again (outcome
  ``granted``, observed in ``kvelastic_reclaim_wait_seconds``). If no refusal
  renewed the want for ``want_ttl_s`` (the account stops counting a want
  then: :func:`kvelastic.cluster.policy.wanting`), the demand went away without
  a grant (its requests finished or were aborted, or it made room itself):
  outcome ``lapsed``, timed to its last refusal and only counted
  (``kvelastic_reclaim_lapsed_waits_total``). Refusals by the engine's own
  cap and by a lock held past the deadline neither begin nor end a wait: the
  others never hear of them, so no other engine can end them; nor do pages
  forced past the budget to honour a decision made on a stale estimate.
* **A release** (an engine giving memory back) begins at the upkeep tick that
  first reads pressure from the account and ends at the first tick that reads
  none. It is timed to the release that covered the bytes first asked for (or
  the last release, if none did): the moment those pages were destroyed and
  their bytes returned to the account (``kvelastic_reclaim_release_seconds``).
  One that ended with nothing released is ``unserved`` (the want went first).

The page source calls :meth:`ReclaimTiming.refused`, :meth:`~ReclaimTiming.created`
and :meth:`~ReclaimTiming.released` with its own lock held; :meth:`~ReclaimTiming.tick`
takes that same lock, so no new lock is added where pages are mapped. No method
raises: an error is logged once and the event dropped. Each ended episode is one
INFO line (the human part, then ``reclaim-episode`` and key=value pairs that
:func:`parse_line` reads back), written by the upkeep thread, never by the
thread that maps pages: at most ``LOG_BURST`` lines at once and ``LOG_PER_S``
a second after that. Up to ``MAX_PENDING`` episodes wait for their turn; what
overflows is counted in a line of its own (at most every ``LEFT_OUT_EVERY_S``).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, ContextManager, TypeVar

from kvelastic.cluster.policy import DEFAULT_WANT_TTL_S
from kvelastic.metrics.metrics import Histogram
from kvelastic.units import format_size

log = logging.getLogger("vllm.kvelastic")

LOG_BURST = 10  # lines logged at once before the rate applies
LOG_PER_S = 1.0  # sustained lines per second
MAX_PENDING = 256  # ended episodes waiting for their log line; beyond that they are counted as left out
LEFT_OUT_EVERY_S = 10.0  # the line counting what was left out, at most this often
MAX_OBSERVATIONS = 4096  # per histogram, between two metrics publishes
MARK = "reclaim-episode"
LEFT_OUT = "reclaim-episodes-left-out"
_PAIRS = re.compile(r"(\w+)=(\S+)")
_Method = TypeVar("_Method", bound=Callable[..., Any])


@dataclass(frozen=True)
class Episode:
    """One ended wait or release, as logged and as :func:`parse_line` returns it."""

    kind: str  # "wait" or "release"
    outcome: str  # wait: "granted" or "lapsed"; release: "released" or "unserved"
    instance: str
    seconds: float
    began: float  # Unix time of its first refusal, or of the tick that read the pressure
    asked_bytes: int  # wait: the largest refused request; release: the largest pressure read
    moved_bytes: int  # wait: the grant that ended it; release: the bytes given back
    events: int  # wait: refusals; release: releases


@dataclass
class _OpenWait:
    began: float
    began_wall: float
    last_refusal: float
    asked_bytes: int
    refusals: int = 1


@dataclass
class _OpenRelease:
    asked: float
    asked_wall: float
    first_asked_bytes: int
    asked_bytes: int
    released_bytes: int = 0
    releases: int = 0
    covered_at: float | None = None
    last_release: float | None = None


def _contained(method: _Method) -> _Method:
    """The hook never raises into its caller (vLLM's scheduler, the mapper, the upkeep thread)."""
    @functools.wraps(method)
    def guarded(self: "ReclaimTiming", *args: Any) -> Any:
        try:
            return method(self, *args)
        except Exception as error:  # noqa: BLE001 - timing must never cost an allocation
            self._report_error(method.__name__, error)
            return None
    return guarded  # type: ignore[return-value]


class ReclaimTiming:
    """This engine's waits for memory and releases for others: histograms, counters and log lines."""

    def __init__(self, instance: str, lock: ContextManager | None = None, *,
                 want_ttl_s: float = DEFAULT_WANT_TTL_S, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        """``lock``: the page source's lock, held by its calls and taken here by :meth:`tick`."""
        self.instance = instance
        self.want_ttl_s = want_ttl_s
        self._lock = lock if lock is not None else threading.RLock()
        self._clock, self._wall = clock, wall
        self.waits, self.releases = Histogram(), Histogram()
        self.lapsed_waits = 0
        self.unserved_asks = 0
        self.released_bytes = 0  # given back while others waited
        self._wait: _OpenWait | None = None
        self._release: _OpenRelease | None = None
        self._ended: deque[Episode] = deque()
        self._observed: dict[str, deque[float]] = {
            key: deque(maxlen=MAX_OBSERVATIONS) for key in ("reclaim_wait_seconds", "reclaim_release_seconds")}
        self._tokens, self._refilled = float(LOG_BURST), clock()
        self._left_out, self._left_out_said = 0, float("-inf")
        self._errors: set[str] = set()

    # ---------------------------------------------------- the engine that waits
    @_contained
    def refused(self, nbytes: int) -> None:
        """The shared budget refused ``nbytes``: a wait begins, or goes on."""
        with self._lock:
            now = self._clock()
            self._lapse_wait(now)
            wait = self._wait
            if wait is None:
                self._wait = _OpenWait(began=now, began_wall=self._wall(), last_refusal=now, asked_bytes=nbytes)
                return
            wait.last_refusal = now
            wait.refusals += 1
            wait.asked_bytes = max(wait.asked_bytes, nbytes)

    @_contained
    def created(self, nbytes: int) -> None:
        """The pages of a granted request of ``nbytes`` exist: an open wait ends, granted."""
        with self._lock:
            now = self._clock()
            self._lapse_wait(now)
            wait, self._wait = self._wait, None
            if wait is None:
                return
            seconds = now - wait.began
            self.waits.observe(seconds)
            self._observed["reclaim_wait_seconds"].append(seconds)
            self._end(Episode("wait", "granted", self.instance, seconds, wait.began_wall, wait.asked_bytes,
                              nbytes, wait.refusals))

    def _lapse_wait(self, now: float) -> None:
        wait = self._wait
        if wait is None or now - wait.last_refusal <= self.want_ttl_s:
            return
        self._wait = None
        self.lapsed_waits += 1
        self._end(Episode("wait", "lapsed", self.instance, wait.last_refusal - wait.began, wait.began_wall,
                          wait.asked_bytes, 0, wait.refusals))

    # ---------------------------------------------------- the engine that gives
    @_contained
    def released(self, nbytes: int) -> None:
        """``nbytes`` of destroyed pages went back to the account."""
        with self._lock:
            release = self._release
            if release is None or nbytes <= 0:
                return
            now = self._clock()
            release.released_bytes += nbytes
            release.releases += 1
            release.last_release = now
            self.released_bytes += nbytes
            if release.covered_at is None and release.released_bytes >= release.first_asked_bytes:
                release.covered_at = now

    @_contained
    def tick(self, pressure_bytes: int) -> None:
        """The account's answer on an upkeep tick: the bytes others want back from this engine now."""
        with self._lock:
            now = self._clock()
            self._lapse_wait(now)
            release = self._release
            if pressure_bytes > 0 and release is None:
                self._release = _OpenRelease(asked=now, asked_wall=self._wall(), first_asked_bytes=pressure_bytes,
                                             asked_bytes=pressure_bytes)
            elif pressure_bytes > 0 and release is not None:
                release.asked_bytes = max(release.asked_bytes, pressure_bytes)
            elif release is not None:
                self._release = None
                self._end_release(release)
        self._log_ended()

    def _end_release(self, release: _OpenRelease) -> None:
        done = release.covered_at if release.covered_at is not None else release.last_release
        if done is None:
            self.unserved_asks += 1
            self._end(Episode("release", "unserved", self.instance, 0.0, release.asked_wall, release.asked_bytes,
                              0, 0))
            return
        seconds = done - release.asked
        self.releases.observe(seconds)
        self._observed["reclaim_release_seconds"].append(seconds)
        self._end(Episode("release", "released", self.instance, seconds, release.asked_wall, release.asked_bytes,
                          release.released_bytes, release.releases))

    # ------------------------------------------------------------- what goes out
    def values(self) -> dict[str, float]:
        """The numbers for the metrics snapshot (histograms flattened as :class:`Histogram` does)."""
        with self._lock:
            return {**self.waits.values("reclaim_wait_seconds"), **self.releases.values("reclaim_release_seconds"),
                    "reclaim_lapsed_waits": self.lapsed_waits, "reclaim_unserved_asks": self.unserved_asks,
                    "reclaim_released_bytes": self.released_bytes}

    def take_observations(self) -> dict[str, list[float]]:
        """Durations observed since the last call, per histogram key (for prometheus_client histograms)."""
        with self._lock:
            taken = {key: list(values) for key, values in self._observed.items()}
            for values in self._observed.values():
                values.clear()
            return taken

    def _end(self, episode: Episode) -> None:
        if len(self._ended) >= MAX_PENDING:
            self._left_out += 1
        else:
            self._ended.append(episode)

    @_contained
    def _log_ended(self) -> None:
        """Log what ended, as far as the rate allows (called outside the lock); the rest waits its turn."""
        with self._lock:
            now = self._clock()
            self._tokens = min(float(LOG_BURST), self._tokens + (now - self._refilled) * LOG_PER_S)
            self._refilled = now
            lines = []
            while self._ended and self._tokens >= 1.0:
                lines.append(self._ended.popleft())
                self._tokens -= 1.0
            left_out = 0
            if self._left_out and now - self._left_out_said >= LEFT_OUT_EVERY_S:
                left_out, self._left_out, self._left_out_said = self._left_out, 0, now
        for episode in lines:
            log.info("%s", format_line(episode))
        if left_out:
            log.info("kvelastic: %d reclaim episode lines of %s left out to keep the log short (the "
                     "kvelastic_reclaim_* metrics count every episode) %s count=%d", left_out, self.instance,
                     LEFT_OUT, left_out)

    def _report_error(self, where: str, error: Exception) -> None:
        key = f"{where}: {type(error).__name__}"
        if key not in self._errors:
            self._errors.add(key)
            log.warning("kvelastic: reclaim timing of %s failed in %s and dropped the event (logged once): %s",
                        self.instance, where, error, exc_info=True)


def format_line(episode: Episode) -> str:
    """The log line of one episode: a sentence, then ``reclaim-episode`` and its fields as key=value."""
    if episode.kind == "wait":
        what = (f"waited {episode.seconds:.3f} s for the shared budget: {episode.outcome}"
                f" ({format_size(episode.asked_bytes)} refused {episode.events} time(s)")
        what += f", then {format_size(episode.moved_bytes)} granted)" if episode.outcome == "granted" else \
            ", then no refusal for the want's lifetime: the demand went away)"
    elif episode.outcome == "released":
        what = (f"gave back {format_size(episode.moved_bytes)} in {episode.seconds:.3f} s for others' wants"
                f" ({format_size(episode.asked_bytes)} asked: released)")
    else:
        what = f"was asked for {format_size(episode.asked_bytes)} but the want went away first: unserved"
    fields = " ".join(f"{key}={_field(value)}" for key, value in asdict(episode).items())
    return f"kvelastic: {episode.instance} {what} {MARK} {fields}"


def _field(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6f}"
    return re.sub(r"\s", "_", str(value))


def parse_line(line: str) -> Episode | None:
    """The episode a :func:`format_line` line carries (anywhere in ``line``), or None."""
    _, mark, tail = line.partition(f" {MARK} ")
    if not mark:
        return None
    pairs = dict(_PAIRS.findall(tail))
    try:
        return Episode(kind=pairs["kind"], outcome=pairs["outcome"], instance=pairs["instance"],
                       seconds=float(pairs["seconds"]), began=float(pairs["began"]),
                       asked_bytes=int(pairs["asked_bytes"]), moved_bytes=int(pairs["moved_bytes"]),
                       events=int(pairs["events"]))
    except (KeyError, ValueError):
        return None


def parse_left_out(line: str) -> int:
    """How many episode lines a "left out" line says were not logged (0 for any other line)."""
    _, mark, tail = line.partition(f" {LEFT_OUT} count=")
    return int(tail.split()[0]) if mark and tail.split() and tail.split()[0].isdigit() else 0
