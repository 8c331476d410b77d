"""Source checks only the version matrix needs: what vLLM uses of an object, and the gate's refusal.

The target lookup itself lives in ``kvelastic.patching.source``, which start-up
uses too; these helpers scan more of a release's source than any declaration
names, and are used by the tests alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

from kvelastic.errors import PatchError
from kvelastic.patching import gate
from kvelastic.patching.source import parse
from kvelastic.patching.versions import Version


def attributes_used_on(root: Path, package: str, holder: str) -> set[str]:
    """Names read or called on any ``<expr>.<holder>`` in ``package``'s modules (``x.holder.name``).

    The integration replaces some vLLM objects (the block pool's free queue) with
    its own; this lists what vLLM uses of them, so the replacement can be checked
    against each release.
    """
    base = root.joinpath(*package.split("."))
    used: set[str] = set()
    for path in sorted(base.rglob("*.py")):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == holder:
                used.add(node.attr)
    return used


def attributes_used_on_name(root: Path, package: str, name: str) -> set[str]:
    """Names read or called on a variable called ``name`` in ``package``'s modules (``name.attr``).

    SimpleCPUOffloadConnector's lazy mode reads the GPU free queue through a
    local (``free_queue = gpu_pool.free_block_queue``), which the scan above
    does not see.
    """
    base = root.joinpath(*package.split("."))
    if not base.is_dir():
        return set()
    return {node.attr for path in sorted(base.rglob("*.py")) for node in ast.walk(parse(path))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name}


def refusal(version: Version) -> str | None:
    """What the gate says for a release no patch set may claim (outside SUPPORTED); None if supported.

    This calls the gate itself with no patches: its version test runs before
    anything is imported, so this imports no vLLM either.
    """
    try:
        gate.check((), version)
    except PatchError as exc:
        return str(exc)
    return None


def calls_of_name(root: Path, module: str, function: str, name: str) -> list[ast.Call]:
    """Every call of the plain name ``name`` (``name(...)``) in the module-level ``function`` of ``module``.

    From 0.34 vLLM's ``allocate_kv_cache`` takes its backing from an ``allocate``
    parameter; the version matrix checks that it calls it once, with the size alone.
    """
    tree = parse(root.joinpath(*module.split(".")).with_suffix(".py"))
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == name]
    return sorted(calls, key=lambda call: (call.lineno, call.col_offset))


def torch_calls(root: Path, module: str, function: str) -> list[ast.Call]:
    """Every ``torch.<name>(...)`` call in the module-level ``function`` of ``module``, in source order.

    vLLM 0.29+'s ``allocate_kv_cache`` is run by kvelastic with a stand-in for
    ``torch`` that serves one ``zeros`` backing from the page pool; this is how
    the version matrix checks that each release's function asks for nothing else.
    """
    tree = parse(root.joinpath(*module.split(".")).with_suffix(".py"))
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"]
    return sorted(calls, key=lambda call: (call.lineno, call.col_offset))
