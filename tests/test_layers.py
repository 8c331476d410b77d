"""The folders are the architecture: the core below the vLLM-facing layers, never the reverse.

``docs/architecture.md`` promises that the scheduler-side core, the pool, the
host tier and the shared account work on block ids, hashes and page groups, and
import neither vLLM nor the layers that adapt vLLM to them. Every import
statement counts, including those inside functions and ``TYPE_CHECKING``
blocks: a lazy import is still a dependency.

Above the core, the adapters (``hooks/``, ``tp/``, ``worker/``, ``startup/``,
``patches/``) touch vLLM's objects only through declared contacts: every
attribute they read on a vLLM object (by the names they give those objects)
is declared by a patch's target, which the gate checks in every claimed
release, and nothing is put on one except through the Patcher or a declared
carried attribute.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvelastic"
CORE = ("scheduler", "pool", "offload", "cluster", "shared", "metrics")
ABOVE_THE_CORE = ("vllm", "kvelastic.hooks", "kvelastic.worker", "kvelastic.startup", "kvelastic.tp",
                  "kvelastic.patches", "kvelastic.patching", "kvelastic.settings", "kvelastic.launcher",
                  "kvelastic.cli", "kvelastic.plugin", "kvelastic._autopatch")


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def core_modules() -> list[Path]:
    """Every module of the core folders, and the roles they are written against."""
    return sorted([*(p for folder in CORE for p in (PACKAGE / folder).glob("*.py")), PACKAGE / "roles.py"])


def test_the_core_folders_exist_and_hold_modules():
    assert all((PACKAGE / folder / "__init__.py").is_file() for folder in CORE)
    assert len(core_modules()) > 20
    assert not list((PACKAGE / "integration").glob("*.py")), "the old mixed folder came back"


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_core_module_imports_nothing_above_the_core(path):
    bad = [name for name in imported_modules(path)
           if any(name == top or name.startswith(top + ".") for top in ABOVE_THE_CORE)]
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {bad}: move the code or invert the dependency"


# ------------------------------------------------------------------ vLLM's objects
ADAPTERS = ("hooks", "tp", "worker", "startup")
#: Where attributes are set on objects kvelastic does not own: the Patcher (recorded, undone with the patch)
#: and the carried attributes (declared per vLLM class).
SETTERS = ("patching/apply.py", "patching/carried.py")


def adapter_modules() -> list[Path]:
    folders = [*(PACKAGE / folder for folder in ADAPTERS), PACKAGE / "patches"]
    return sorted(p for folder in folders for p in folder.glob("*.py"))


def _bare_attribute_writes(path: Path) -> list[str]:
    """``setattr(...)`` and ``x.kvelastic_* = ...``: ways of putting something on an object of vLLM's."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            found.append(f"line {node.lineno}: setattr")
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr.startswith("kvelastic_"):
                found.append(f"line {node.lineno}: .{target.attr} =")
    return sorted(found)


@pytest.mark.parametrize("path", adapter_modules(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_nothing_is_put_on_vllms_objects_outside_the_patcher_and_the_declared_carriers(path):
    found = _bare_attribute_writes(path)
    assert not found, (f"{path.name}: {found}; add a kvelastic_* attribute with Patcher.add_attribute, or declare "
                       f"it as a Carried on its vLLM class (kvelastic/patching/carried.py)")


def test_the_scan_for_bare_writes_finds_each_kind(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("setattr(out, 'x', 1)\nout.kvelastic_plan = 2\nout.kvelastic_steps += 1\nself.plan = 3\n")
    assert [f.split(":")[0] for f in _bare_attribute_writes(planted)] == ["line 1", "line 2", "line 3"]


#: The names the adapters give vLLM's objects, and the classes those objects are (a name used for
#: kvelastic's own objects too, such as ``worker`` or ``output``, is left out: the scan could not tell).
RECEIVERS = {
    "scheduler": ("Scheduler", "SchedulerInterface"),
    "block_pool": ("BlockPool",),
    "kv_cache_manager": ("KVCacheManager",),
    "kv_cache_config": ("KVCacheConfig",),
    "model_runner_output": ("ModelRunnerOutput",),
    "request": ("Request",),
    "executor": ("Executor", "MultiprocExecutor"),
    "runner": ("GPUModelRunner",),
    "vllm_config": ("VllmConfig",),
}


def _reads_on(path: Path, receiver: str) -> set[str]:
    """Attributes read or called on a name ``receiver`` in ``path``."""
    return {node.attr for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == receiver}


def _declared_members() -> dict[str, set[str]]:
    """Per vLLM class name: the attributes its class targets declare and the members targeted on it."""
    from kvelastic.patches import ALL_PATCHES
    from kvelastic.patching.spec import Attributes

    declared: dict[str, set[str]] = {}
    for patch in ALL_PATCHES:
        for target in patch.targets:
            owner, _, member = target.qualname.rpartition(".")
            names = {n for shape in target.shapes if isinstance(shape, Attributes) for n in shape.names}
            declared.setdefault(target.qualname, set()).update(names)
            if owner:
                declared.setdefault(owner, set()).add(member)
    return declared


@pytest.mark.parametrize("receiver", RECEIVERS)
def test_every_attribute_read_on_vllms_objects_is_a_declared_contact(receiver):
    declared = _declared_members()
    allowed = set().union(*(declared.get(cls, set()) for cls in RECEIVERS[receiver]))
    undeclared = {}
    for path in adapter_modules():
        names = {n for n in _reads_on(path, receiver) - allowed if not n.startswith("kvelastic_")}
        if names:
            undeclared[str(path.relative_to(PACKAGE.parent))] = sorted(names)
    assert not undeclared, f"reads of vLLM's {'/'.join(RECEIVERS[receiver])} that no patch declares: {undeclared}"
