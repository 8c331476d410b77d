"""The folders are the architecture: the core below the vLLM-facing layers, never the reverse.

``docs/architecture.md`` promises that the scheduler-side core, the pool, the
host tier and the shared account work on block ids, hashes and page groups, and
import neither vLLM nor the layers that adapt vLLM to them. Every import
statement counts, including those inside functions and ``TYPE_CHECKING``
blocks: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvelastic"
CORE = ("scheduler", "pool", "offload", "cluster", "shared", "metrics")
ABOVE_THE_CORE = ("vllm", "kvelastic.hooks", "kvelastic.worker", "kvelastic.startup", "kvelastic.tp",
                  "kvelastic.patches", "kvelastic.patching")


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def core_modules() -> list[Path]:
    return sorted(p for folder in CORE for p in (PACKAGE / folder).glob("*.py"))


def test_the_core_folders_exist_and_hold_modules():
    assert all((PACKAGE / folder / "__init__.py").is_file() for folder in CORE)
    assert len(core_modules()) > 20
    assert not list((PACKAGE / "integration").glob("*.py")), "the old mixed folder came back"


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_core_module_imports_nothing_above_the_core(path):
    bad = [name for name in imported_modules(path)
           if any(name == top or name.startswith(top + ".") for top in ABOVE_THE_CORE)]
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {bad}: move the code or invert the dependency"
