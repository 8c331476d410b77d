"""Values kvelastic hands along on vLLM's per-step objects, each declared with the class that carries it.

Under tensor parallelism a step's commands must reach every rank with the step
(vLLM broadcasts its ``SchedulerOutput``), and the ranks' reports must come back
with the step's reply (``ModelRunnerOutput``). Those objects live for one step,
so the values ride on them as ``kvelastic_*`` attributes rather than as the
Patcher's recorded changes (which are for objects that outlive a patch and are
undone with it). Each such attribute is a :class:`Carried`, declared in the
patch module whose target carries it, beside a class :class:`~kvelastic.patching.spec.Target`
the gate checks in every claimed release; kvelastic sets and reads it only
through that declaration, never with a bare ``setattr``
(``tests/test_layers.py`` scans for one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvelastic.errors import PatchError
from kvelastic.patching.spec import Target

PREFIX = "kvelastic_"


@dataclass(frozen=True)
class Carried:
    """``name`` on the objects of ``carrier`` (a class target): set by kvelastic, read by kvelastic."""

    name: str
    carrier: Target

    def __post_init__(self) -> None:
        if not self.name.startswith(PREFIX) or self.carrier.kind != "class":
            raise PatchError(f"kvelastic: a carried attribute is a new {PREFIX}* name on a class target's "
                             f"objects, not {self.name!r} on {self.carrier.path}")

    def put(self, obj: Any, value: Any) -> None:
        """``obj`` carries ``value`` from now on; an attribute vLLM itself defines is never overwritten."""
        if hasattr(type(obj), self.name):
            raise PatchError(f"kvelastic: {type(obj).__name__} defines {self.name!r} itself; kvelastic will "
                             f"not overwrite it (declared on {self.carrier.path})")
        setattr(obj, self.name, value)

    def get(self, obj: Any, default: Any = None) -> Any:
        """What ``obj`` carries (``default`` where nothing was put on it, or ``obj`` is None)."""
        return getattr(obj, self.name, default)
