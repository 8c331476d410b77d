"""vLLM versions: parsing, ranges, and the bands kvelastic knows.

A band is a stretch of releases in which the functions kvelastic patches keep
one shape. The table lives here, once; patches name ranges, the gate and the
version matrix read them.
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

    def __contains__(self, version: object) -> bool:
        return isinstance(version, Version) and self.low <= version < self.high

    def __str__(self) -> str:
        return f">={self.low},<{self.high}"


@dataclass(frozen=True)
class Band:
    name: str
    versions: VersionRange
    note: str


BANDS: tuple[Band, ...] = (
    Band("A", VersionRange.of("0.12", "0.24"), "use_uniform_kv_cache(attn_groups, cache_dtype)"),
    Band("B", VersionRange.of("0.24", "0.29"), "use_uniform_kv_cache(attn_groups)"),
)
SUPPORTED = VersionRange.of("0.12", "0.29")
UNSUPPORTED_NEWER_NOTE = (
    "vLLM 0.29 and later allocate every layer's KV cache in one backing "
    "(v1/worker/utils.py:allocate_kv_cache) and no longer have use_uniform_kv_cache; "
    "kvelastic does not support that layout yet (see docs/vllm-0.29.md)"
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
