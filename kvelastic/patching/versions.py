"""vLLM versions: parsing, ranges, and the bands kvelastic knows.

A band is a stretch of releases in which the functions kvelastic patches keep
one shape. The table lives here, once; patches name ranges, the gate and the
version matrix read them.

The supported stretch is written once, as :data:`OLDEST_SUPPORTED` and
:data:`FIRST_UNSUPPORTED`. Ranges that run to the newest supported release are
written ``since("0.22")``, not with a second copy of the upper bound, so raising
it extends them all; the version matrix then shows which declarations the new
releases break (``docs/version-matrix.md``, "Adding a vLLM release").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import total_ordering


@total_ordering
@dataclass(frozen=True)
class Version:
    """A release number reduced to (major, minor, patch); suffixes are ignored."""

    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> "Version":
        match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
        if not match:
            raise ValueError(f"not a version: {text!r}")
        major, minor, patch = match.groups()
        return cls(int(major), int(minor), int(patch or 0))

    def __lt__(self, other: "Version") -> bool:
        return (self.major, self.minor, self.patch) < (other.major, other.minor, other.patch)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


@dataclass(frozen=True)
class VersionRange:
    """Releases ``low <= v < high``."""

    low: Version
    high: Version

    @classmethod
    def of(cls, low: str, high: str) -> "VersionRange":
        return cls(Version.parse(low), Version.parse(high))

    def overlaps(self, other: "VersionRange") -> bool:
        return self.low < other.high and other.low < self.high

    def __contains__(self, version: object) -> bool:
        return isinstance(version, Version) and self.low <= version < self.high

    def __str__(self) -> str:
        return f">={self.low},<{self.high}"


@dataclass(frozen=True)
class Band:
    """``runners``: the model runners vLLM has in these releases (the V1 runner is gone from 0.34)."""

    name: str
    versions: VersionRange
    note: str
    runners: tuple[str, ...] = ("V1", "V2")


#: The oldest supported release and the first unsupported newer one: the only copy of either.
OLDEST_SUPPORTED = "0.12"
FIRST_UNSUPPORTED = "0.35"
SUPPORTED = VersionRange.of(OLDEST_SUPPORTED, FIRST_UNSUPPORTED)


def since(low: str) -> VersionRange:
    """``low`` up to the newest supported release."""
    return VersionRange(Version.parse(low), SUPPORTED.high)


def before(high: str) -> VersionRange:
    """The oldest supported release up to, not including, ``high``."""
    return VersionRange(SUPPORTED.low, Version.parse(high))


BANDS: tuple[Band, ...] = (
    Band("A", before("0.24"), "use_uniform_kv_cache(attn_groups, cache_dtype)"),
    Band("B", VersionRange.of("0.24", "0.29"), "use_uniform_kv_cache(attn_groups)"),
    Band("C", VersionRange.of("0.29", "0.34"), "one KV backing for every layer: allocate_kv_cache(kv_cache_config, "
                                               "device, layout, kernel_block_sizes)"),
    Band("D", since("0.34"), "the V2 runner alone; allocate_kv_cache(..., allocate) takes the backing from a hook; "
                             "vLLM's own extensible KV cache, turned off by kvelastic", runners=("V2",)),
)
UNSUPPORTED_NEWER_NOTE = (
    f"kvelastic is checked against every vLLM release before {FIRST_UNSUPPORTED}; a newer release may have "
    "moved or reshaped what kvelastic patches, and is refused until its version matrix passes "
    "(docs/version-matrix.md, \"Adding a vLLM release\")"
)


def band_of(version: Version) -> Band | None:
    for band in BANDS:
        if version in band.versions:
            return band
    return None


def installed_vllm_version() -> Version:
    """The vLLM version installed in this interpreter, without importing vLLM."""
    from importlib.metadata import version

    return Version.parse(version("vllm"))
