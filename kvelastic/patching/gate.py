"""The version gate: check every contact before anything is changed.

A patch claims a range of vLLM releases and declares every target it wraps,
replaces or reads, with the shape it was written against (see
:mod:`kvelastic.patching.spec`). The gate imports each target, describes what
it finds, and judges it by the rules it shares with the version matrix
(:mod:`kvelastic.patching.rules`). Every mismatch is reported at once, so a vLLM
release that moved or reshaped anything fails start-up with one precise
message instead of running a half-patched engine.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from kvelastic.errors import PatchError
from kvelastic.patching.rules import Found, init_attributes, problem
from kvelastic.patching.spec import Patch, Target, claimed
from kvelastic.patching.versions import (INSTALL_SUPPORTED, SUPPORT_DOC, SUPPORTED, UNSUPPORTED_NEWER_NOTE, Version,
                                         band_of)


@dataclass(frozen=True)
class GateResult:
    version: Version
    band: str
    patches: tuple[Patch, ...]

    @property
    def targets(self) -> tuple[Target, ...]:
        """Every contact the gate checked: the only ones a Patcher built from this result may touch."""
        return tuple(target for patch in self.patches for target in patch.targets)


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


def describe(raw: Any, set_in: tuple[str, ...] = ("__init__",)) -> Found:
    """What the live object ``raw`` (as a class ``__dict__`` holds it) is, in the rules' terms.

    A class's attributes count what its methods ``set_in`` assign to ``self``.
    """
    if isinstance(raw, staticmethod):
        return Found("staticmethod", _params(raw.__func__))
    if isinstance(raw, classmethod):
        return Found("classmethod", _params(raw.__func__))
    if isinstance(raw, property):
        return Found("property", _params(raw.fset) if raw.fset else (), settable=raw.fset is not None)
    if isinstance(raw, type):
        return Found("class", attributes=frozenset(class_attributes(raw, set_in)))
    if callable(raw):
        return Found("function", _params(raw))
    return Found(type(raw).__name__)


def _params(function: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


def class_attributes(cls: type, set_in: tuple[str, ...] = ("__init__",)) -> set[str]:
    """Names ``cls``'s objects carry: its own ``__dict__`` and annotations, and what its methods
    ``set_in`` assign to ``self``.

    Those methods are read from source (unwrapped, should kvelastic's own
    wrapper sit on one): an attribute cannot be seen before an object exists.
    A generated ``__init__`` (a dataclass's) has no source; its fields are
    annotations, counted already.
    """
    names = set(vars(cls)) | set(inspect.get_annotations(cls))
    for method in set_in:
        function = vars(cls).get(method)
        if function is not None and inspect.isfunction(function := inspect.unwrap(function)):
            try:
                names |= init_attributes(inspect.getsource(function))
            except (OSError, TypeError):
                pass  # generated (dataclass) or source not shipped: annotations and __dict__ stand
    return names


def found(target: Target, set_in: tuple[str, ...] = ("__init__",)) -> Found | LookupError:
    """The running vLLM's ``target``, described; the LookupError where it is missing."""
    try:
        return describe(resolve(target)[1], set_in)
    except LookupError as exc:
        return exc


def check_target(target: Target, version: Version) -> str | None:
    """None if ``target`` is as declared for ``version`` in the running vLLM, else what is wrong."""
    shape = target.shape(version)
    if shape is None:  # nothing to look up
        return problem(target, version, LookupError())
    return problem(target, version, found(target, getattr(shape, "set_in", ("__init__",))))


def check(patches: Sequence[Patch], version: Version) -> GateResult:
    """Validate ``version`` and every target of every patch claiming it, imported; PatchError if any fails."""
    return _judge(patches, version, check_target)


def check_source(patches: Sequence[Patch], version: Version, root: Path | None = None) -> GateResult:
    """:func:`check`, judged from the installed vLLM's source files (or ``root``'s): imports no vLLM module.

    Start-up decides this way (``kvelastic.patching.on_import``); each patch is
    checked again, imported, when vLLM imports its module.
    """
    import gc

    from kvelastic.patching import source

    tree = root or source.installed_root()
    collecting = gc.isenabled()
    gc.disable()  # parsing allocates many nodes; each collection would walk vLLM's whole heap (5x slower)
    try:
        return _judge(patches, version, lambda target, at: source.check_target(tree, target, at))
    finally:
        source.parse.cache_clear()  # the trees are not needed again in this process
        if collecting:
            gc.enable()


def problems_of(patches: Sequence[Patch], version: Version,
                check_one: Callable[[Target, Version], str | None] = check_target) -> list[str]:
    """What is wrong with the targets of ``patches`` in ``version``, one line each (each contact once)."""
    targets = dict.fromkeys(target for patch in patches for target in patch.targets)
    return [p for target in targets if (p := check_one(target, version))]


def _judge(patches: Sequence[Patch], version: Version,
           check_one: Callable[[Target, Version], str | None]) -> GateResult:
    if version not in SUPPORTED:
        newer = version >= SUPPORTED.high
        reason = UNSUPPORTED_NEWER_NOTE if newer else f"kvelastic supports vLLM {SUPPORTED}"
        raise PatchError(f"kvelastic: vLLM {version} is not supported: {reason}. Install a supported release "
                         f"({SUPPORT_DOC} lists them): {INSTALL_SUPPORTED}; or set KVELASTIC=0 to run vLLM "
                         f"without kvelastic, or KVELASTIC_STRICT=0 to warn only.")
    band = band_of(version)
    chosen = claimed(patches, version)
    problems = problems_of(chosen, version, check_one)
    if problems:
        raise PatchError(refusal_message(version, problems, "nothing was patched"))
    return GateResult(version, band.name if band else "?", tuple(chosen))


def refusal_message(version: Version, problems: Sequence[str], outcome: str) -> str:
    """The one wording of a refusal: the release, what kvelastic did about it, each problem on a line."""
    band = band_of(version)
    lines = "\n  - ".join(problems)
    return (f"kvelastic: vLLM {version} (band {band.name if band else '?'}) does not match what kvelastic "
            f"expects; {outcome}:\n  - {lines}")
