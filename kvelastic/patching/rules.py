"""The one rule set for "is this target what its patch declares?", whoever looked it up.

Two lookups describe a target as a :class:`Found`: one imports it from the
running vLLM (``gate.describe``), the other parses a vLLM source tree without
importing anything (``kvelastic.patching.source``: start-up on the installed
vLLM, the version matrix on every release). :func:`problem` compares either
description with the declaration, so both give the same verdict in the same
words, and a rule changed here changes for both.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass, field

from kvelastic.patching.spec import Absent, Attributes, Signature, Target
from kvelastic.patching.versions import Version

_CALLABLE = ("function", "staticmethod", "classmethod")


@dataclass(frozen=True)
class Found:
    """What a target turned out to be.

    ``kind`` is ``function``, ``staticmethod``, ``classmethod``, ``property``,
    ``class``, or the type name of anything else. ``params`` are a callable's
    (or a property setter's); ``attributes`` are the names a class's objects
    carry (see :class:`~kvelastic.patching.spec.Attributes`).
    """

    kind: str
    params: tuple[str, ...] = ()
    attributes: frozenset[str] = field(default_factory=frozenset)
    settable: bool = False


def problem(target: Target, version: Version, found: Found | LookupError) -> str | None:
    """None if ``found`` is what ``target`` declares for ``version``; else what is wrong, naming the target."""
    shape = target.shape(version)
    if shape is None:
        return f"{target.path}: kvelastic declares nothing for vLLM {version}"
    if isinstance(shape, Absent):
        if isinstance(found, LookupError) or (target.kind == "setter" and not found.settable):
            return None  # gone (for a setter: the property may stay, read-only)
        return (f"{target.path}: declared absent in vLLM {version} (kvelastic does without it there), "
                f"but it exists")
    if isinstance(found, LookupError):
        return f"{target.path}: {found}"
    wrong = _wrong_kind(target, found)
    if wrong:
        return f"{target.path}: {wrong}"
    if isinstance(shape, Attributes):
        missing = tuple(name for name in shape.names if name not in found.attributes)
        if missing:
            return (f"{target.path}: expected its objects to carry {shape.names}; {missing} are neither "
                    f"defined on the class nor set in its {' or '.join(shape.set_in)}")
        return None
    assert isinstance(shape, Signature)
    if found.params != shape.params:
        return f"{target.path}: expected parameters {shape.params}, found {found.params}"
    return None


def _wrong_kind(target: Target, found: Found) -> str | None:
    expected = {"class": ("class",), "staticmethod": ("staticmethod",), "setter": ("property",)}
    wanted = expected.get(target.kind, _CALLABLE)
    if found.kind not in wanted:
        noun = {"class": "a class", "staticmethod": "a staticmethod", "setter": "a property with a setter"}
        return f"expected {noun.get(target.kind, 'a function')}, found a {found.kind}"
    if target.kind == "setter" and not found.settable:
        return "expected a property with a setter, found a read-only property"
    return None


def self_attributes(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names ``function`` assigns on its first parameter (``self.x = ...``, ``self.x: T = ...``, tuples)."""
    if not function.args.args:
        return set()
    receiver = function.args.args[0].arg
    names: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) \
                        and part.value.id == receiver:
                    names.add(part.attr)
    return names


def init_attributes(source: str) -> set[str]:
    """:func:`self_attributes` of the one function defined in ``source`` (``inspect.getsource`` of a method)."""
    for node in ast.parse(textwrap.dedent(source)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return self_attributes(node)
    return set()
