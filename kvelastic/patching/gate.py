"""The version gate: check every target before anything is changed.

A patch claims a range of vLLM releases and names the functions it wraps with
the parameters it was written against. The gate imports each target, compares
its parameters, and reports every mismatch at once, so a vLLM release that
moved a function fails start-up with one precise message instead of running a
half-patched engine.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Sequence

from kvelastic.errors import PatchError
from kvelastic.patching.spec import Patch, Target, claimed
from kvelastic.patching.versions import SUPPORTED, UNSUPPORTED_NEWER_NOTE, Version, band_of


@dataclass(frozen=True)
class GateResult:
    version: Version
    band: str
    patches: tuple[Patch, ...]


def resolve(target: Target) -> tuple[Any, Any]:
    """Import ``target`` and return (owner, raw attribute); raise LookupError if absent."""
    try:
        owner: Any = importlib.import_module(target.module)
    except ImportError as exc:
        raise LookupError(f"module {target.module} cannot be imported ({exc})") from exc
    parts = target.qualname.split(".")
    for part in parts[:-1]:
        if not hasattr(owner, part):
            raise LookupError(f"{target.module} has no {part}")
        owner = getattr(owner, part)
    name = parts[-1]
    raw = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if raw is None:
        raise LookupError(f"{target.path} does not exist")
    return owner, raw


def check_target(target: Target, version: Version) -> str | None:
    """None if ``target`` is as expected in ``version``, else what is wrong."""
    expected = target.expected_params(version)
    if expected is None:
        return f"{target.path}: the patch declares no signature for vLLM {version}"
    try:
        _, raw = resolve(target)
    except LookupError as exc:
        return f"{target.path}: {exc}"
    if target.kind == "staticmethod" and not isinstance(raw, staticmethod):
        return f"{target.path}: expected a staticmethod, found {type(raw).__name__}"
    function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if not callable(function):
        return f"{target.path}: expected a function, found {type(raw).__name__}"
    params = tuple(inspect.signature(function).parameters)
    if params != expected:
        return f"{target.path}: expected parameters {expected}, found {params}"
    return None


def check(patches: Sequence[Patch], version: Version) -> GateResult:
    """Validate ``version`` and every target of every patch claiming it; raise PatchError if any fails."""
    if version not in SUPPORTED:
        newer = version >= SUPPORTED.high
        reason = UNSUPPORTED_NEWER_NOTE if newer else f"kvelastic supports vLLM {SUPPORTED}"
        raise PatchError(f"kvelastic: vLLM {version} is not supported: {reason}. "
                         f"Set KVELASTIC=0 to run vLLM without kvelastic, or KVELASTIC_STRICT=0 to warn only.")
    band = band_of(version)
    chosen = claimed(patches, version)
    problems = [p for patch in chosen for t in patch.targets if (p := check_target(t, version))]
    if problems:
        lines = "\n  - ".join(problems)
        raise PatchError(f"kvelastic: vLLM {version} (band {band.name if band else '?'}) does not match "
                         f"what kvelastic expects; nothing was patched:\n  - {lines}")
    return GateResult(version, band.name if band else "?", tuple(chosen))
