"""Every change kvelastic makes to vLLM, on classes or on live objects, made and undone in one place.

A :class:`Patcher` is built from the gate's result and touches only the
targets the gate checked, in the shape declared for the running release. Each
change is a :class:`Change` that knows how to put back what it replaced:
class-level wraps (through wrapt), wraps of one object's method, replaced
attributes of one object, and ``kvelastic_*`` attributes added to one.
:meth:`Patcher.revert` undoes them all, newest first; :meth:`Patcher.all_or_nothing`
undoes those made inside it if it fails.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from kvelastic.errors import PatchError
from kvelastic.patching.spec import Attributes, Signature, Target
from kvelastic.patching.versions import Version

ADDED_PREFIX = "kvelastic_"
_MISSING = object()


@dataclass(eq=False)
class Change:
    """``owner.name`` was ``before`` (or absent) and is now ``after``; :meth:`undo` puts it back."""

    owner: Any
    name: str
    before: Any
    after: Any
    label: str
    on_class: bool = False  # a class- or module-level wrap (what ``Patcher.wrapped`` lists)

    def undo(self) -> None:
        if self.before is _MISSING:
            vars(self.owner).pop(self.name, None)
        else:
            setattr(self.owner, self.name, self.before)


@dataclass
class _Scope:
    changes: list[Change] = field(default_factory=list)


class Patcher:
    """Makes the changes the gate cleared, for one vLLM release, and remembers how to undo each."""

    def __init__(self, version: Version, checked: Iterable[Target]) -> None:
        self.version = version
        self._checked = frozenset(checked)
        self._changes: list[Change] = []
        self._lock = threading.Lock()
        self._scopes = threading.local()

    @classmethod
    def for_gate(cls, result: Any) -> "Patcher":
        """A patcher for what ``gate.check`` returned: its release, and only the targets it checked."""
        return cls(result.version, result.targets)

    # ------------------------------------------------------------------ what may be touched
    @property
    def wrapped(self) -> list[str]:
        """Paths of the class- and module-level wraps in force, oldest first."""
        with self._lock:
            return [change.label for change in self._changes if change.on_class]

    @property
    def changes(self) -> tuple[Change, ...]:
        """Every change in force, oldest first."""
        with self._lock:
            return tuple(self._changes)

    def declares(self, target: Target) -> bool:
        """Whether ``target`` was checked and exists in this release (a version range, never a probe)."""
        return target in self._checked and target.exists_in(self.version)

    def params(self, target: Target) -> tuple[str, ...]:
        """The parameters ``target`` has in this release, as declared and checked."""
        shape = self._cleared(target, target.use)
        if not isinstance(shape, Signature):
            raise PatchError(f"kvelastic: {target.path} is a {target.kind}, it has no parameters")
        return shape.params

    def attributes(self, target: Target) -> tuple[str, ...]:
        """The attributes a class target's objects carry in this release, as declared and checked."""
        shape = self._cleared(target, target.use)
        if not isinstance(shape, Attributes):
            raise PatchError(f"kvelastic: {target.path} is a {target.kind}, not a class")
        return shape.names

    def _cleared(self, target: Target, use: str) -> Signature | Attributes:
        if target not in self._checked:
            raise PatchError(f"kvelastic: {target.path} was not checked by the gate; declare it in the "
                             f"targets of the patch that uses it")
        if target.use != use:
            raise PatchError(f"kvelastic: {target.path} is declared for use {target.use!r}, not {use!r}")
        shape = target.shape(self.version)
        if not isinstance(shape, (Signature, Attributes)):
            raise PatchError(f"kvelastic: {target.path} is declared absent in vLLM {self.version}")
        return shape

    # --------------------------------------------------------------------------- changes
    def wrap(self, target: Target, wrapper: Callable[..., Any]) -> Change:
        """``wrapper(wrapped, instance, args, kwargs)`` replaces ``target`` on its class or module."""
        import wrapt

        self._cleared(target, "wrap")
        parent, attribute, _ = wrapt.resolve_path(target.module, target.qualname)
        original = vars(parent)[attribute] if isinstance(parent, type) else getattr(parent, attribute)
        wrapt.wrap_function_wrapper(target.module, target.qualname, wrapper)
        after = vars(parent)[attribute] if isinstance(parent, type) else getattr(parent, attribute)
        return self._record(Change(parent, attribute, original, after, target.path, on_class=True))

    def wrap_instance(self, obj: Any, target: Target, wrapper: Callable[..., Any]) -> Change:
        """``wrapper(wrapped, instance, args, kwargs)`` replaces ``target``'s method on ``obj`` only."""
        import wrapt

        self._cleared(target, "instance")
        name = target.name
        after = wrapt.FunctionWrapper(getattr(obj, name), wrapper)
        return self._set(obj, name, after, f"{target.path} on {type(obj).__name__}@{id(obj):#x}")

    def replace_attribute(self, obj: Any, target: Target, name: str, value: Any) -> Change:
        """``obj.name`` (an attribute ``target``, a class, declares its objects carry) becomes ``value``."""
        shape = self._cleared(target, "instance")
        if not isinstance(shape, Attributes) or name not in shape.names:
            raise PatchError(f"kvelastic: {name!r} is not among the attributes {target.path} declares")
        if name not in vars(obj):
            raise PatchError(f"kvelastic: this {type(obj).__name__} has no attribute {name!r} of its own")
        return self._set(obj, name, value, f"{target.path}.{name} on {type(obj).__name__}@{id(obj):#x}")

    def add_attribute(self, obj: Any, name: str, value: Any) -> Change:
        """A new ``kvelastic_*`` attribute on ``obj``; never one vLLM could have."""
        if not name.startswith(ADDED_PREFIX) or hasattr(obj, name):
            raise PatchError(f"kvelastic: may add only new {ADDED_PREFIX}* attributes, not {name!r} "
                             f"to this {type(obj).__name__}")
        return self._set(obj, name, value, f"{type(obj).__name__}@{id(obj):#x}.{name}")

    def _set(self, obj: Any, name: str, value: Any, label: str) -> Change:
        change = Change(obj, name, vars(obj).get(name, _MISSING), value, label)
        setattr(obj, name, value)
        return self._record(change)

    def _record(self, change: Change) -> Change:
        with self._lock:
            self._changes.append(change)
        for scope in getattr(self._scopes, "open", ()):
            scope.changes.append(change)
        return change

    # ----------------------------------------------------------------------------- undo
    def undo(self, change: Change) -> None:
        """Undo one change; refused if a later change sits on the same attribute of the same owner."""
        with self._lock:
            index = next((i for i, c in enumerate(self._changes) if c is change), None)
            if index is None:
                return
            if any(c.owner is change.owner and c.name == change.name for c in self._changes[index + 1:]):
                raise PatchError(f"kvelastic: {change.label} has a later change stacked on it; undo that first")
            del self._changes[index]
        change.undo()

    def revert(self) -> None:
        """Restore every original, newest first."""
        while True:
            with self._lock:
                if not self._changes:
                    return
                change = self._changes.pop()
            change.undo()

    @contextlib.contextmanager
    def all_or_nothing(self) -> Iterator[None]:
        """Changes this thread makes inside the block are all undone if the block raises."""
        scope = _Scope()
        open_scopes = getattr(self._scopes, "open", None)
        if open_scopes is None:
            open_scopes = self._scopes.open = []
        open_scopes.append(scope)
        try:
            yield
        except BaseException:
            for change in reversed(scope.changes):
                self.undo(change)
            raise
        finally:
            open_scopes.remove(scope)
