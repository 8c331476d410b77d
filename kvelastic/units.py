"""Byte sizes written the way people write them: ``512MiB``, ``32GiB``, ``1.5 GB``."""

from __future__ import annotations

import re
from decimal import Decimal

from kvelastic.errors import ConfigError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000, "KIB": 1024,
    "MB": 1000**2, "MIB": 1024**2,
    "GB": 1000**3, "GIB": 1024**3,
    "TB": 1000**4, "TIB": 1024**4,
}
UNITS_TEXT = "B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)"
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")  # ASCII digits: \d takes other scripts' too

SIZE_FORM = "a byte count such as 4096, 512MiB, 32GiB or 1.5GB (KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB of 1000)"
#: The largest byte count kvelastic accepts anywhere: the readers of a shared account refuse any field above
#: it (a corrupt or forged file), so no writer may store more, and every size parsed is held to it too.
MAX_BYTES = 1 << 62
MAX_BYTES_TEXT = "2^62 bytes (4194304 TiB)"


def parse_size(text: str, *, name: str = "size") -> int:
    """Parse ``text`` into bytes; raise :class:`ConfigError` naming ``name`` on garbage.

    A bare ``K``, ``M``, ``G`` or ``T`` is refused: some tools read ``4G`` as 4 GiB, others as 4 GB, and a
    limit off by 7 % must not pass silently. Fractions are allowed (``1.5GiB``) but the result must be a whole number of bytes, at most
    :data:`MAX_BYTES`.
    """
    match = _SIZE.match(str(text))
    if not match:
        what = "is a negative size" if str(text).strip().startswith("-") else "is not a size"
        raise ConfigError(f"{name}={text!r} {what}: expected {SIZE_FORM}")
    number, unit = match.groups()
    scale = _UNITS.get(unit.upper())
    if scale is None and unit.upper() in ("K", "M", "G", "T"):
        letter = unit.upper()
        raise ConfigError(f"{name}={text!r}: the unit {unit!r} is ambiguous (powers of 1024 or of 1000?): write "
                          f"{number}{letter}iB or {number}{letter}B; accepted units: {UNITS_TEXT}")
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
