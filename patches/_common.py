"""Version ranges and small helpers shared by the patch modules.

Ranges that reach the newest supported release are written ``since("0.22")``
and those that start at the oldest ``before("0.20")``, so the supported bounds
stay written once (``kvelastic/patching/versions.py``).
"""

from __future__ import annotations

import inspect
from typing import Any

from kvelastic.patching.versions import BANDS, SUPPORTED, VersionRange, before, since

BAND_A = BANDS[0].versions
BAND_B = BANDS[1].versions
BAND_C = BANDS[2].versions
#: Bands A and B: a KV tensor per entry of the config, allocated by each runner itself.
BEFORE_BAND_C = VersionRange(SUPPORTED.low, BAND_C.low)
ALL = SUPPORTED

__all__ = ["ALL", "BAND_A", "BAND_B", "BAND_C", "BEFORE_BAND_C", "argument", "before", "since"]


def argument(wrapped: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The value the caller passed for parameter ``name``, positionally or by keyword."""
    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs)
    if name in bound.arguments:
        return bound.arguments[name]
    raise TypeError(f"{getattr(wrapped, '__qualname__', wrapped)} was called without {name!r}")
