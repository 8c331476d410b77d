"""Version ranges and small helpers shared by the patch modules."""

from __future__ import annotations

import inspect
from typing import Any

from kvelastic.patching.versions import BANDS, SUPPORTED

BAND_A = BANDS[0].versions
BAND_B = BANDS[1].versions
ALL = SUPPORTED


def argument(wrapped: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The value the caller passed for parameter ``name``, positionally or by keyword."""
    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs)
    if name in bound.arguments:
        return bound.arguments[name]
    raise TypeError(f"{getattr(wrapped, '__qualname__', wrapped)} was called without {name!r}")
