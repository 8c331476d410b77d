"""The vLLM releases kvelastic supports, listed once.

Read off PyPI (``pip index versions vllm``, November 2026): every final
release in ``SUPPORTED`` (``kvelastic/patching/versions.py``). Pre-releases
and post releases are left out; there were none in this stretch. The version
matrix checks each of them against every patch that claims it, so a new
release is supported by adding it here and making that matrix pass
(``docs/version-matrix.md``, "Adding a vLLM release"). Only the tests and CI
read this list; the running plugin knows the supported range, not the releases.
"""

from __future__ import annotations

from kvelastic.patching.versions import SUPPORTED, Version, band_of

RELEASES: tuple[str, ...] = (
    "0.12.0",
    "0.13.0",
    "0.14.0", "0.14.1",
    "0.15.0", "0.15.1",
    "0.16.0",
    "0.17.0", "0.17.1",
    "0.18.0", "0.18.1",
    "0.19.0", "0.19.1",
    "0.20.0", "0.20.1", "0.20.2",
    "0.21.0",
    "0.22.0", "0.22.1",
    "0.23.0",
    "0.24.0",
    "0.25.0", "0.25.1",
    "0.26.0",
    "0.27.0", "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
    "0.34.0",
)

# Just outside SUPPORTED on each side: the gate must refuse these.
NEWEST_OLDER_UNSUPPORTED = "0.11.2"
OLDEST_NEWER_UNSUPPORTED = str(SUPPORTED.high)


def release_band(release: str) -> str:
    """The band name (``"A"``, ``"B"``) of a listed release; ValueError if it is not supported."""
    band = band_of(Version.parse(release))
    if release not in RELEASES or band is None or Version.parse(release) not in SUPPORTED:
        raise ValueError(f"vLLM {release} is not a supported release")
    return band.name


def releases_by_band() -> dict[str, tuple[str, ...]]:
    """``{band name: releases}`` in release order."""
    grouped: dict[str, list[str]] = {}
    for release in RELEASES:
        grouped.setdefault(release_band(release), []).append(release)
    return {name: tuple(members) for name, members in grouped.items()}
