"""JSON read from shared files, with bounds: nesting depth, finite numbers, 64-bit integers, a schema.

The standard parser would accept ``NaN`` and ``Infinity`` (which later crash
arithmetic and ``int()``), numbers with thousands of digits, and nesting deep
enough to exhaust the stack. Here the depth is measured before parsing, the
constants are refused, and :func:`expect` checks each field's type and range, so
what a caller gets back is exactly what kvelastic itself writes.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from kvelastic.shared.errors import BadSharedData

MAX_DEPTH = 8
INT_LIMIT = 1 << 63


def _refuse_constant(name: str) -> Any:
    raise BadSharedData(f"{name} is not a number kvelastic accepts")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadSharedData(f"{text[:20]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > 20:
        raise BadSharedData(f"integer {text[:20]}... is out of range")
    value = int(text)
    if not -INT_LIMIT <= value < INT_LIMIT:
        raise BadSharedData(f"integer {value} is out of range")
    return value


def nesting_depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` outside strings (linear, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def loads(data: bytes, what: str, max_depth: int = MAX_DEPTH) -> Any:
    """The value of JSON ``data`` read from ``what``; BadSharedData for anything kvelastic would not write."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadSharedData(f"{what} is not UTF-8 text") from None
    if nesting_depth(text) > max_depth:
        raise BadSharedData(f"{what} nests deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                          parse_int=_bounded_int)
    except BadSharedData as error:
        raise BadSharedData(f"{what}: {error}") from None
    except (ValueError, RecursionError) as error:
        raise BadSharedData(f"{what} is not valid JSON ({error})") from None


def dumps(value: Any) -> bytes:
    """Compact JSON that :func:`loads` reads back (ValueError for NaN or infinity: never written)."""
    return json.dumps(value, allow_nan=False, separators=(",", ":")).encode("utf-8")


def expect(record: Any, fields: Mapping[str, type | tuple[type, ...]], what: str) -> dict[str, Any]:
    """``record`` if it is an object whose listed fields have the listed types (bool is not an int)."""
    if not isinstance(record, dict):
        raise BadSharedData(f"{what} is not a JSON object")
    for key, kind in fields.items():
        value = record.get(key)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise BadSharedData(f"{what}: {key} must be {_names(kinds)}, not a boolean")
        if not isinstance(value, kinds):
            raise BadSharedData(f"{what}: {key} must be {_names(kinds)}, not {type(value).__name__}")
    return record


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def int_list(value: Any, what: str, *, low: int = 0, high: int = INT_LIMIT, max_len: int = 1 << 22) -> list[int]:
    """``value`` if it is a list of at most ``max_len`` integers in ``[low, high)``."""
    if not isinstance(value, list) or len(value) > max_len:
        raise BadSharedData(f"{what} must be a list of at most {max_len} integers")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not low <= item < high:
            raise BadSharedData(f"{what} holds {item!r}, not an integer in [{low}, {high})")
    return value
