"""Apply each cleared patch when vLLM imports the module it patches, checked again there.

Importing the modules kvelastic patches (the model runners, the scheduler)
costs about as much as ``import vllm`` itself, and a process that only runs
``vllm --help`` or the API server never needs them. So start-up decides from
the installed source files (``gate.check_source``: every contact of every
claimed patch, the same rules as the import-based gate, no vLLM module
imported), and each patch is applied by a post-import hook on its module.

What all-or-nothing means here:

- The decision is made once, at ``import vllm``, for every patch and every
  contact, before any patched function can run. A mismatch refuses start-up
  (or, with ``KVELASTIC_STRICT=0``, leaves vLLM unpatched) exactly as before.
- Patches whose modules are already imported when kvelastic activates (a test
  process, a plugin loaded late) are checked live together, then applied
  together; a live mismatch among them still patches nothing.
- When a module is imported later, its patch's contacts are checked again as
  imported. A live mismatch there means the running vLLM differs from its own
  source (another plugin patched it, stale bytecode): kvelastic then undoes
  every change it made in the process and raises from that import, so vLLM
  stops with the reason. It cannot fall back to unpatched vLLM at that point,
  because a patched function may already have run; ``KVELASTIC_STRICT=0`` does
  not soften this case.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable, Sequence

from kvelastic.errors import PatchError
from kvelastic.patching import gate
from kvelastic.patching.apply import Patcher
from kvelastic.patching.spec import Patch


def trigger_modules(patch: Patch) -> tuple[str, ...]:
    """The modules a patch changes on import: those of its class- and module-level wraps."""
    return tuple(dict.fromkeys(target.module for target in patch.targets if target.use == "wrap"))


def _imported(module: str) -> bool:
    """Imported and done executing (a module still being imported is in sys.modules already)."""
    loaded = sys.modules.get(module)
    return loaded is not None and not getattr(getattr(loaded, "__spec__", None), "_initializing", False)


class ImportApplier:
    """Applies the gate's cleared patches through one Patcher as their modules are imported."""

    def __init__(self, result: gate.GateResult, runtime: Any, patcher: Patcher,
                 on_refusal: Callable[[], None] = lambda: None):
        self.result = result
        self.runtime = runtime
        self.patcher = patcher
        self.on_refusal = on_refusal
        self.active = True
        self._pending = {patch.name: patch for patch in result.patches}
        self._lock = threading.RLock()  # a patch applied in a hook may import the next patch's module

    @property
    def applied(self) -> list[str]:
        return [patch.name for patch in self.result.patches if patch.name not in self._pending]

    def start(self) -> None:
        """Apply, together, the patches whose modules are imported already; hook the others."""
        import wrapt

        with self._lock:
            ready = [p for p in self.result.patches if all(map(_imported, trigger_modules(p)))]
            problems = gate.problems_of(ready, self.result.version)
            if problems:
                self.active = False
                raise PatchError(gate.refusal_message(self.result.version, problems, "nothing was patched"))
            self._apply(ready)
        for patch in self.result.patches:
            for module in trigger_modules(patch):
                if patch.name in self._pending:
                    wrapt.register_post_import_hook(functools.partial(self._on_import, patch), module)

    def stop(self) -> None:
        """Later imports apply nothing (hooks cannot be unregistered; they become no-ops)."""
        self.active = False

    def _on_import(self, patch: Patch, module: Any) -> None:
        with self._lock:
            if not self.active or patch.name not in self._pending:
                return
            just = module.__name__  # its hook runs before the import machinery marks it done
            if not all(name == just or _imported(name) for name in trigger_modules(patch)):
                return  # another of its modules is still to come
            problems = gate.problems_of([patch], self.result.version)
            if problems:
                self._refuse(gate.refusal_message(
                    self.result.version, problems, f"{patch.name}'s modules as imported differ from their "
                    f"source; every patch was undone and vLLM is unchanged"))
            self._apply([patch])

    def _apply(self, patches: Sequence[Patch]) -> None:
        for patch in patches:
            del self._pending[patch.name]
            try:
                patch.apply(self.patcher, self.runtime)
            except Exception as exc:
                self._refuse(f"kvelastic: applying patch {patch.name!r} failed ({exc}); every patch was "
                             f"undone and vLLM is unchanged", cause=exc)

    def _refuse(self, message: str, cause: BaseException | None = None) -> None:
        """Undo every change kvelastic made in this process, then raise ``message``."""
        self.active = False
        self.patcher.revert()
        self.on_refusal()
        raise PatchError(message) from cause
