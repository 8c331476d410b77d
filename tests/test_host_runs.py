"""HostRuns: the run of host hits being looked up, and the longest of the last minute (a monotonic queue)."""

from __future__ import annotations

from kvelastic.offload.host_runs import HostRuns


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run(runs: HostRuns, blocks: int) -> None:
    for _ in range(blocks):
        runs.hit()
    runs.end()


def test_the_longest_run_of_the_window_counts_until_it_ages_out_then_the_next_longest():
    clock = _Clock()
    runs = HostRuns(window_s=60.0, clock=clock)
    assert runs.longest() == 0
    _run(runs, 100)
    clock.now += 30
    _run(runs, 40)  # shorter and later: shown once the longer one has aged out
    _run(runs, 10)
    assert runs.longest() == 100
    clock.now += 31  # the 100-block run is 61 s old
    assert runs.longest() == 40
    clock.now += 30
    assert runs.longest() == 0


def test_an_empty_run_is_not_recorded_and_the_current_run_restarts_at_each_end():
    clock = _Clock()
    runs = HostRuns(clock=clock)
    runs.end()
    assert runs.longest() == 0 and runs.ended == 0
    runs.hit()
    runs.hit()
    assert runs.current == 2
    runs.end()
    assert runs.current == 0 and runs.longest() == 2 and runs.ended == 1
    runs.record(5)  # a run planned whole (an asynchronous load) was not looked up to its end here
    assert runs.ended == 1


def test_many_runs_keep_only_a_few_entries():
    """A multi-turn step ends a run per request: the queue keeps only runs longer than every later one."""
    clock = _Clock()
    runs = HostRuns(clock=clock)
    for i in range(1000):
        clock.now += 0.01
        _run(runs, 1 + i % 7)
    assert runs.longest() == 7
    assert len(runs._longest) <= 7
