"""Byte sizes written the way people write them: ``512MiB``, ``32GiB``, ``1.5 GB``."""

from __future__ import annotations

import re
from decimal import Decimal

from kvelastic.errors import ConfigError

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024, "KB": 1000, "KIB": 1024,
    "M": 1024**2, "MB": 1000**2, "MIB": 1024**2,
    "G": 1024**3, "GB": 1000**3, "GIB": 1024**3,
    "T": 1024**4, "TB": 1000**4, "TIB": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

SIZE_FORM = "a byte count such as 4096, 512MiB, 32GiB or 1.5GB (KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB of 1000)"
#: The largest byte count kvelastic accepts anywhere: the readers of a shared account refuse any field above
#: it (a corrupt or forged file), so no writer may store more, and every size parsed is held to it too.
MAX_BYTES = 1 << 62
MAX_BYTES_TEXT = "2^62 bytes (4194304 TiB)"


def parse_size(text: str, *, name: str = "size") -> int:
    """Parse ``text`` into bytes; raise :class:`ConfigError` naming ``name`` on garbage.

    Bare letters ``K``, ``M``, ``G``, ``T`` mean powers of 1024, as in most serving flags.
    Fractions are allowed (``1.5GiB``) but the result must be a whole number of bytes, at most
    :data:`MAX_BYTES`.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ConfigError(f"{name}={text!r} is not a size: expected {SIZE_FORM}")
    number, unit = match.groups()
    scale = _UNITS.get(unit.upper())
    if scale is None:
        raise ConfigError(f"{name}={text!r} has an unknown unit {unit!r}: expected {SIZE_FORM}")
    value = Decimal(number) * scale  # exact: 4.1MB is 4100000 bytes, not 4099999.99...
    if value != value.to_integral_value():
        raise ConfigError(f"{name}={text!r} is not a whole number of bytes: expected {SIZE_FORM}")
    if value > MAX_BYTES:
        raise ConfigError(f"{name}={text!r} is larger than any size kvelastic can hold ({MAX_BYTES_TEXT})")
    return int(value)


def format_size(nbytes: int | float) -> str:
    """Render bytes with the largest binary unit that keeps the number at least 1."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def align_up(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment``."""
    return -(-value // alignment) * alignment
