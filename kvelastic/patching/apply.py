"""Apply patches all or nothing, with wrapt, and undo them on failure."""

from __future__ import annotations

from typing import Any, Callable

from kvelastic.errors import PatchError
from kvelastic.patching.spec import Target


class Patcher:
    """Wraps targets through wrapt and remembers how to put the originals back."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []
        self.wrapped: list[str] = []

    def wrap(self, target: Target, wrapper: Callable[..., Any]) -> None:
        """``wrapper(wrapped, instance, args, kwargs)`` replaces ``target``."""
        import wrapt

        parent, attribute, _ = wrapt.resolve_path(target.module, target.qualname)
        original = vars(parent)[attribute] if isinstance(parent, type) else getattr(parent, attribute)
        wrapt.wrap_function_wrapper(target.module, target.qualname, wrapper)
        self._undo.append((parent, attribute, original))
        self.wrapped.append(target.path)

    def revert(self) -> None:
        """Restore every original, newest first."""
        while self._undo:
            parent, attribute, original = self._undo.pop()
            setattr(parent, attribute, original)
        self.wrapped.clear()


def apply_all(patches: list[Any], runtime: Any) -> Patcher:
    """Run every patch's ``apply``; if any fails, undo all of them and raise PatchError."""
    patcher = Patcher()
    for patch in patches:
        try:
            patch.apply(patcher, runtime)
        except Exception as exc:
            patcher.revert()
            raise PatchError(f"kvelastic: applying patch {patch.name!r} failed ({exc}); "
                             f"every patch was undone and vLLM is unchanged") from exc
    return patcher
