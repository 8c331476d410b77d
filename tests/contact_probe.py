"""Break one declared vLLM contact at a time in this interpreter, try to start kvelastic, report.

Run by ``tests/test_contact_refusal.py`` in a fresh interpreter (``python -m
tests.contact_probe``), so the real installed vLLM is changed only there. For
every contact the scheduler side (and the executor, for tensor parallelism's
replies) declares, each case removes or reshapes it
(or, where it is declared absent, adds it), then:

1. activates kvelastic strictly, which must refuse, naming the contact;
2. compares every class and module that owns a declared target with its state
   just before activating: nothing may have been wrapped or replaced;
3. undoes the breakage and compares again with the state before it: vLLM is
   exactly as it was;
4. builds a real ``Scheduler`` and checks that none of its objects carries a
   kvelastic wrapper or attribute.

Each case prints one ``MARK`` line of JSON. The cases come from the
declarations, so a newly declared contact is covered without a new test.
Case ids given on the command line run only those cases (and the control).
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable

from kvelastic.patches import (admission_check, engine_core_wake, executor_handover, executor_step_report,
                               scheduler_block_pool)
from kvelastic.patching.spec import Absent, Attributes, Target
from kvelastic.patching.versions import Version

MARK = "KVELASTIC-CONTACT:"
PROBE_PARAM = "kvelastic_probe"
_GONE = object()


@dataclass(frozen=True)
class Case:
    """One way of breaking one contact: ``remove``, ``reshape``, ``add`` or ``drop`` (one attribute)."""

    target: Target
    how: str
    attribute: str = ""

    @property
    def id(self) -> str:
        return f"{self.target.path}|{self.how}{':' + self.attribute if self.attribute else ''}"


def scheduler_side_targets(version: Version) -> list[Target]:
    patches = [p for p in (scheduler_block_pool.PATCH, admission_check.PATCH, executor_step_report.PATCH,
                           executor_handover.PATCH, engine_core_wake.PATCH)
               if p.claims(version)]
    return list(dict.fromkeys(target for patch in patches for target in patch.targets))


def cases(version: Version) -> list[Case]:
    """Every case for every scheduler-side contact declared for ``version``."""
    found: list[Case] = []
    for target in scheduler_side_targets(version):
        shape = target.shape(version)
        if isinstance(shape, Absent):
            found.append(Case(target, "add"))
        elif isinstance(shape, Attributes):
            found += [Case(target, "drop", name) for name in shape.names]
        else:
            found += [Case(target, "remove"), Case(target, "reshape")]
    return found


def kind_of_breakage(case: Case) -> tuple[str, str, str]:
    """What the gate tells apart when it refuses ``case``: the target's kind (its shape is read as a
    signature, a setter or a class's attributes), its use (a wrapped target's module is patched when
    it is imported; the others are read, or changed on live objects) and how it is broken."""
    return case.target.kind, case.target.use, case.how


def one_per_kind(all_cases: list[Case]) -> list[Case]:
    """The first declared case of each kind of breakage: every path of the gate's refusal, each once."""
    first: dict[tuple[str, str, str], Case] = {}
    for case in all_cases:
        first.setdefault(kind_of_breakage(case), case)
    return list(first.values())


# ------------------------------------------------------------------------------------ breaking
def _owner(target: Target) -> tuple[Any, str]:
    owner: Any = importlib.import_module(target.module)
    *path, name = target.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _reshaped(original: Any) -> Callable[..., Any]:
    def reshaped(*args: Any, kvelastic_probe: Any = None, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    return reshaped


def _init_without(original: Any, name: str) -> Callable[..., None]:
    """An ``__init__`` that sets ``name`` under another name: a rename, as a release might make."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        setattr(self, PROBE_PARAM, vars(self).pop(name, None))

    return __init__


def _set(owner: Any, name: str, value: Any) -> Callable[[], None]:
    """``owner.name = value`` (None: deleted); returns what puts the original back. An enum's members
    refuse both through the enum's own type, so a class is changed as a plain type is."""
    before = vars(owner).get(name, _GONE)
    put, remove = (type.__setattr__, type.__delattr__) if isinstance(owner, type) else (setattr, delattr)
    if value is None:
        remove(owner, name)
    else:
        put(owner, name, value)
    return lambda: remove(owner, name) if before is _GONE else put(owner, name, before)


def break_contact(case: Case) -> Callable[[], None]:
    """Apply ``case`` to the live vLLM; returns the undo, newest change first."""
    owner, name = _owner(case.target)
    if case.how == "drop":
        return _drop(getattr(owner, name), case.attribute)
    raw = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if case.target.kind == "setter":
        # A slot (a dataclass field of a slotted class: KVCacheBlock.block_hash from 0.34) reads through its
        # descriptor and has no setter to reshape; adding one makes it a property like any other.
        is_property = isinstance(raw, property)
        getter = raw.fget if is_property else raw.__get__
        setter = {"remove": None, "reshape": _reshaped(raw.fset) if is_property and raw.fset else None,
                  "add": lambda self, value: None}[case.how]
        return _set(owner, name, property(getter, setter))
    if case.how == "remove":
        return _set(owner, name, None)
    if case.how == "add":
        return _set(owner, name, lambda self, *args: None)
    replacement = _reshaped(raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw)
    return _set(owner, name, staticmethod(replacement) if isinstance(raw, staticmethod) else replacement)


def _drop(cls: type, attribute: str) -> Callable[[], None]:
    """Make ``cls``'s objects no longer carry ``attribute``, wherever the class declares it."""
    from kvelastic.patching.gate import class_attributes

    undo: list[Callable[[], None]] = []
    annotations = vars(cls).get("__annotations__")
    if annotations and attribute in annotations:
        undo.append(_set(cls, "__annotations__", {k: v for k, v in annotations.items() if k != attribute}))
    if attribute in vars(cls):
        undo.append(_set(cls, attribute, None))
    init = vars(cls).get("__init__")
    if init is not None and attribute in class_attributes(cls):  # set by __init__: rename it there
        undo.append(_set(cls, "__init__", _init_without(init, attribute)))

    def put_back() -> None:
        for step in reversed(undo):
            step()

    return put_back


# ---------------------------------------------------------------------------------- observing
def owners() -> list[Any]:
    """Every class or module that holds a target of any patch, and every declared class."""
    from kvelastic.patches import ALL_PATCHES

    seen: dict[int, Any] = {}
    for target in {t for patch in ALL_PATCHES for t in patch.targets}:
        try:
            owner, name = _owner(target)
        except (ImportError, AttributeError):
            continue
        seen[id(owner)] = owner
        if target.kind == "class" and isinstance(getattr(owner, name, None), type):
            seen[id(getattr(owner, name))] = getattr(owner, name)
    return list(seen.values())


def snapshot(held: list[Any]) -> list[dict[str, Any]]:
    return [dict(vars(owner)) for owner in held]


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    """Where two snapshots differ (a key added, removed, or bound to another object)."""
    differ = []
    for one, two in zip(a, b):
        for key in one.keys() | two.keys():
            if one.get(key, _GONE) is not two.get(key, _GONE):
                differ.append(f"{one.get('__qualname__', one.get('__name__'))}.{key}")
    return differ


def instance_changes(scheduler: Any) -> list[str]:
    """kvelastic attributes or wrappers on any object of ``scheduler`` that kvelastic may change."""
    import wrapt

    manager = scheduler.kv_cache_manager
    objects = {"scheduler": scheduler, "manager": manager, "coordinator": manager.coordinator,
               "block_pool": manager.block_pool, "prefix_map": manager.block_pool.cached_block_hash_to_block}
    found = [f"{label}.{key}" for label, obj in objects.items() for key, value in vars(obj).items()
             if key.startswith("kvelastic_") or isinstance(value, wrapt.FunctionWrapper)]
    if type(manager.block_pool.free_block_queue).__name__ != "FreeKVCacheBlockQueue":
        found.append("block_pool.free_block_queue")
    return found


def run_case(case: Case | None, held: list[Any]) -> dict[str, Any]:
    """One case (None: the control, nothing broken); what happened at each step."""
    from kvelastic.errors import PatchError
    from kvelastic.startup import activate as activation
    from kvelastic.settings import Settings
    from tests.scheduler_harness import make_scheduler

    original = snapshot(held)
    undo = break_contact(case) if case is not None else (lambda: None)
    broken = snapshot(held)
    result: dict[str, Any] = {"case": case.id if case else "control", "effective": bool(same(original, broken))}
    try:
        result["activated"] = activation.activate(Settings(enabled=True, strict=True)) is not None
        result["message"] = ""
        result["wrapped_while_active"] = len(same(broken, snapshot(held)))
    except PatchError as exc:
        result["activated"], result["message"] = False, str(exc)
    finally:
        if not result.get("activated"):
            result["changed_by_refusal"] = same(broken, snapshot(held))
        activation.deactivate()
        undo()
    result["not_restored"] = same(original, snapshot(held))
    result["instance_changes"] = instance_changes(make_scheduler())
    return result


def main(wanted: list[str]) -> int:
    """Runs the control, then every case, or only the cases whose ids are in ``wanted``."""
    from kvelastic.patching.versions import installed_vllm_version

    declared = cases(installed_vllm_version())
    unknown = set(wanted) - {case.id for case in declared}
    if unknown:
        print(f"no such case: {sorted(unknown)}", file=sys.stderr)
        return 2
    held = owners()
    for case in [None, *(case for case in declared if not wanted or case.id in wanted)]:
        try:
            result = run_case(case, held)
        except Exception as exc:  # noqa: BLE001 - reported per case, the others still run
            result = {"case": case.id if case else "control", "error": f"{type(exc).__name__}: {exc}"}
        print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
