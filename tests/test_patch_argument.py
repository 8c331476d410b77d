"""``argument``: what a wrapper reads from the call it wraps, on every scheduler step.

The answer must be the one binding the whole signature gives, whichever way the
caller passed it, through wrapt's wrappers as the patcher installs them.
"""

from __future__ import annotations

import inspect

import pytest
import wrapt

from kvelastic.patches._common import argument


class Scheduler:
    def update_from_output(self, scheduler_output, model_runner_output):
        return model_runner_output

    @classmethod
    def build(cls, config, *, extra=None):
        return config

    @staticmethod
    def plain(first, second=None, *rest, flag=False):
        return first


def free(a, /, b, *args, c=None, **kwargs):
    return a


CALLS = [
    (Scheduler().update_from_output, (1, 2), {}),
    (Scheduler().update_from_output, (1,), {"model_runner_output": 3}),
    (Scheduler().update_from_output, (), {"scheduler_output": 4, "model_runner_output": 5}),
    (Scheduler.update_from_output, (Scheduler(), 6, 7), {}),
    (Scheduler.build, (8,), {"extra": 9}),
    (Scheduler().plain, (10, 11, 12, 13), {"flag": True}),
    (free, (14, 15, 16), {"c": 17, "d": 18}),
]


@pytest.mark.parametrize("function, args, kwargs", CALLS)
def test_every_passed_parameter_reads_as_a_full_binding_reads_it(function, args, kwargs):
    expected = inspect.signature(function).bind_partial(*args, **kwargs).arguments
    for name, value in expected.items():
        assert argument(function, args, kwargs, name) == value, name


def test_a_parameter_not_passed_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="without 'model_runner_output'"):
        argument(Scheduler().update_from_output, (1,), {}, "model_runner_output")
    with pytest.raises(TypeError, match="without 'extra'"):
        argument(Scheduler.build, (1,), {}, "extra")


def test_wrappers_stacked_on_an_instance_read_the_callers_arguments():
    scheduler, seen = Scheduler(), []

    def reader(name):
        def wrapper(wrapped, instance, args, kwargs):
            seen.append((name, argument(wrapped, args, kwargs, name)))
            return wrapped(*args, **kwargs)
        return wrapper

    wrapt.wrap_function_wrapper(scheduler, "update_from_output", reader("model_runner_output"))
    wrapt.wrap_function_wrapper(scheduler, "update_from_output", reader("scheduler_output"))
    assert scheduler.update_from_output("out", "reply") == "reply"
    assert scheduler.update_from_output("out", model_runner_output="kw") == "kw"
    assert seen == [("scheduler_output", "out"), ("model_runner_output", "reply"),
                    ("scheduler_output", "out"), ("model_runner_output", "kw")]


def test_reading_an_argument_keeps_no_scheduler_alive():
    import gc
    import weakref

    scheduler = Scheduler()
    assert argument(scheduler.update_from_output, (1, 2), {}, "model_runner_output") == 2
    gone = weakref.ref(scheduler)
    del scheduler
    gc.collect()
    assert gone() is None  # positions are cached per function, not per bound method
