"""Version ranges and small helpers shared by the patch modules.

Ranges that reach the newest supported release are written ``since("0.22")``
and those that start at the oldest ``before("0.20")``, so the supported bounds
stay written once (``kvelastic/patching/versions.py``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from kvelastic.patching.versions import BANDS, SUPPORTED, VersionRange, before, since

BAND_A = BANDS[0].versions
BAND_B = BANDS[1].versions
BAND_C = BANDS[2].versions
BAND_D = BANDS[3].versions
#: Bands A and B: a KV tensor per entry of the config, allocated by each runner itself.
BEFORE_BAND_C = VersionRange(SUPPORTED.low, BAND_C.low)
#: Bands C and D: every layer in one backing, made by ``vllm/v1/worker/utils.py:allocate_kv_cache``.
FROM_BAND_C = VersionRange(BAND_C.low, SUPPORTED.high)
ALL = SUPPORTED

__all__ = ["ALL", "BAND_A", "BAND_B", "BAND_C", "BAND_D", "BEFORE_BAND_C", "FROM_BAND_C", "argument", "before",
           "since"]


def argument(wrapped: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The value the caller passed for parameter ``name``, positionally or by keyword.

    Wrappers call this on every scheduler step, so a positional argument is
    found by its cached position; anything else binds the whole signature.
    """
    index = _position(wrapped, name)
    if index is not None and index < len(args):
        return args[index]
    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs)
    if name in bound.arguments:
        return bound.arguments[name]
    raise TypeError(f"{getattr(wrapped, '__qualname__', wrapped)} was called without {name!r}")


def _position(wrapped: Any, name: str) -> int | None:
    """Where ``name`` sits among the positional arguments a call of ``wrapped`` gets (a bound method's
    ``self`` not counted); None where that is not known for sure."""
    function = getattr(wrapped, "__func__", None)
    skip = 1 if function is not None and getattr(wrapped, "__self__", None) is not None else 0
    try:
        position = _leading_positions(function if skip else wrapped).get(name)
    except (TypeError, ValueError):  # unhashable, or no signature to read
        return None
    return None if position is None or position < skip else position - skip


@functools.lru_cache(maxsize=None)
def _leading_positions(function: Any) -> dict[str, int]:
    """Each parameter's position, up to the first that cannot be passed by position."""
    positions: dict[str, int] = {}
    for index, parameter in enumerate(inspect.signature(function).parameters.values()):
        if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            break
        positions[parameter.name] = index
    return positions
