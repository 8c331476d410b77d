"""Describe patch targets from a vLLM source tree, without importing vLLM.

Importing a target needs that release installed with its torch, and costs
seconds: vLLM's model runners pull in most of vLLM. This module describes the
same target from the source files alone, by parsing its module with ``ast``.
Start-up uses it on the installed vLLM, so ``import vllm`` decides whether
kvelastic applies without importing the modules it patches
(``kvelastic.patching.on_import``); the version matrix uses it on every
supported release's source. Both descriptions and the live one are judged by
the one rule set, ``kvelastic.patching.rules.problem``. The lookup
mirrors the gate's: a module-level name may be imported from another module, a
method must be defined in the class body itself (the gate reads the class
``__dict__``), parameters are the ``def``'s, ``self`` included, as
``inspect.signature`` lists them, and a class's attributes are what its body
defines and its ``__init__`` assigns to ``self``.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from kvelastic.patching.rules import Found, problem, self_attributes
from kvelastic.patching.spec import Patch, Target, claimed
from kvelastic.patching.versions import Version

_Def = (ast.FunctionDef, ast.AsyncFunctionDef)
_MAX_IMPORT_HOPS = 4


class StaticLookupError(LookupError):
    """A target's module, class or function is not in the source tree."""


def installed_root() -> Path:
    """The directory holding the installed ``vllm/`` package (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise StaticLookupError("vllm is not installed")
    return Path(next(iter(spec.submodule_search_locations))).parent


def module_file(root: Path, module: str) -> Path | None:
    """``root/a/b.py`` or ``root/a/b/__init__.py`` for module ``a.b``; None if neither exists."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=32)  # one release's target modules; more would only slow the GC down
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_bytes(), filename=str(path))


def _branches(statement: ast.If) -> list[ast.stmt]:
    """The branch an ``if`` takes when that is known without running it, else both.

    A constant test picks its branch; ``if TYPE_CHECKING:`` never runs at import.
    """
    test = statement.test
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    if name == "TYPE_CHECKING":
        return _body(statement.orelse)
    if isinstance(test, ast.Constant):
        return _body(statement.body if test.value else statement.orelse)
    return _body(statement.body) + _body(statement.orelse)


def _body(statements: Sequence[ast.stmt]) -> list[ast.stmt]:
    """Statements of a module or class body as an import runs them, looking inside blocks.

    ``try`` contributes its normal path (body, else, finally), not its handlers.
    """
    flat: list[ast.stmt] = []
    for statement in statements:
        if isinstance(statement, ast.If):
            flat += _branches(statement)
        elif isinstance(statement, ast.Try):
            flat += _body(statement.body) + _body(statement.orelse) + _body(statement.finalbody)
        elif isinstance(statement, (ast.With, ast.AsyncWith)):
            flat += _body(statement.body)
        else:
            flat.append(statement)
    return flat


def _defined(statements: Sequence[ast.stmt], name: str) -> ast.stmt | None:
    """The last ``def``/``class``/``from ... import`` that binds ``name`` (the one that wins at import)."""
    found: ast.stmt | None = None
    for statement in _body(statements):
        if isinstance(statement, (*_Def, ast.ClassDef)) and statement.name == name:
            found = statement
        elif isinstance(statement, ast.ImportFrom):
            if any((alias.asname or alias.name) == name for alias in statement.names):
                found = statement
    return found


def _import_source(module: str, is_package: bool, node: ast.ImportFrom, name: str) -> tuple[str, str]:
    """(absolute module, original name) that ``from ... import`` binds to ``name``."""
    original = next(alias.name for alias in node.names if (alias.asname or alias.name) == name)
    if not node.level:
        return node.module or "", original
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else [])), original


def _top_level(root: Path, module: str, name: str) -> tuple[ast.stmt, Path]:
    """The ``def``/``class`` that module-level ``name`` of ``module`` is, following imports."""
    for _ in range(_MAX_IMPORT_HOPS):
        path = module_file(root, module)
        if path is None:
            raise StaticLookupError(f"module {module} is not in the source")
        node = _defined(parse(path).body, name)
        if node is None:
            raise StaticLookupError(f"{module} has no {name}")
        if not isinstance(node, ast.ImportFrom):
            return node, path
        module, name = _import_source(module, path.name == "__init__.py", node, name)
    raise StaticLookupError(f"{module}.{name}: too many re-exports to follow")


def _params(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    """Parameter names in ``inspect.signature`` order.

    That is positional-only, positional, ``*args``, keyword-only, ``**kwargs``.
    """
    arguments = function.args
    names = [a.arg for a in arguments.posonlyargs + arguments.args]
    if arguments.vararg:
        names.append(arguments.vararg.arg)
    names += [a.arg for a in arguments.kwonlyargs]
    if arguments.kwarg:
        names.append(arguments.kwarg.arg)
    return tuple(names)


def _decorator_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ast.dump(node)


def definition(root: Path, target: Target) -> ast.stmt:
    """The ``def`` or ``class`` statement ``target`` is in ``root``'s source; StaticLookupError if absent."""
    first, *rest = target.qualname.split(".")
    node, _ = _top_level(root, target.module, first)
    for part in rest:
        if not isinstance(node, ast.ClassDef):
            name = getattr(node, "name", first)
            raise StaticLookupError(f"{target.module}: {name} is not a class, has no {part}")
        inner = _defined(node.body, part)
        if inner is None or isinstance(inner, ast.ImportFrom):
            raise StaticLookupError(f"{target.path} does not exist")
        node = inner
    return node


def find(root: Path, target: Target, set_in: tuple[str, ...] = ("__init__",)) -> Found:
    """Describe ``target`` as ``root`` (the directory holding ``vllm/``) defines it; StaticLookupError if absent.

    A class's attributes count what its methods ``set_in`` assign to ``self``.
    """
    node = definition(root, target)
    if isinstance(node, ast.ClassDef):
        return Found("class", attributes=frozenset(_class_attributes(node, set_in)))
    assert isinstance(node, _Def)
    decorators = {_decorator_name(d) for d in node.decorator_list}
    if "setter" in decorators:  # the last def of a name wins: a property's setter, if it has one
        return Found("property", _params(node), settable=True)
    if "property" in decorators:
        return Found("property")
    kind = next((k for k in ("staticmethod", "classmethod") if k in decorators), "function")
    return Found(kind, _params(node))


def _class_attributes(node: ast.ClassDef, set_in: tuple[str, ...]) -> set[str]:
    """What the gate's ``class_attributes`` counts, read off the class body and its methods ``set_in``."""
    names: set[str] = set()
    for statement in _body(node.body):
        if isinstance(statement, (*_Def, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, ast.Assign):
            names |= {t.id for t in statement.targets if isinstance(t, ast.Name)}
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            names.add(statement.target.id)
    for method in set_in:
        function = _defined(node.body, method)
        if isinstance(function, _Def):
            names |= self_attributes(function)
    return names


def check_target(root: Path, target: Target, version: Version) -> str | None:
    """None if ``target`` is as declared for ``version`` in ``root``'s source, else what is wrong (the gate's words)."""
    shape = target.shape(version)
    if shape is None:
        return problem(target, version, StaticLookupError())
    try:
        described: Found | LookupError = find(root, target, getattr(shape, "set_in", ("__init__",)))
    except StaticLookupError as exc:
        described = exc
    return problem(target, version, described)


def check_release(root: Path, version: Version, patches: Sequence[Patch]) -> list[str]:
    """Every problem with the targets of the patches that claim ``version``, checked in ``root``."""
    if not (root / "vllm").is_dir():
        raise FileNotFoundError(f"{root} holds no vllm/ source tree")
    return [f"{patch.name}: {issue}" for patch in claimed(patches, version) for target in patch.targets
            if (issue := check_target(root, target, version))]
