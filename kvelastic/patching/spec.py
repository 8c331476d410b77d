"""How a patch describes itself: the releases it claims and every vLLM contact it has.

A patch is data plus one ``apply`` function. A *contact* (a :class:`Target`) is
anything of vLLM's that kvelastic wraps, replaces or merely reads, on a class
or on live objects. For each range of releases the target declares its shape:

- :class:`Signature`: a function, method, staticmethod or property setter with
  exactly these parameters;
- :class:`Attributes`: a class whose objects carry at least these attributes
  (kvelastic reads them, or replaces some on live objects);
- :class:`Absent`: nothing by this name; kvelastic must not use it there.

The gate checks every contact of every claimed patch before anything changes,
and the :class:`~kvelastic.patching.apply.Patcher` refuses to touch a target
the gate did not check or one declared absent in the running release. So a
feature that exists only in some releases is a declared range, read with
``Target.exists_in(version)``, never a ``hasattr`` on a vLLM object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence, Union

from kvelastic.patching.versions import Version, VersionRange

if TYPE_CHECKING:
    from kvelastic.startup.runtime import Runtime
    from kvelastic.patching.apply import Patcher


@dataclass(frozen=True)
class Signature:
    """A callable with these parameter names (``self`` included for methods) in ``versions``."""

    versions: VersionRange
    params: tuple[str, ...]


@dataclass(frozen=True)
class Attributes:
    """A class whose objects carry at least these attribute names in ``versions``.

    A name counts when the class body defines it (a method, property, class
    attribute or dataclass field) or one of the class's own methods in
    ``set_in`` assigns it to ``self``: ``__init__``, or a method kvelastic wraps
    and reads the attribute right after (the V2 runner binds ``kv_caches`` in
    ``initialize_kv_cache``). Both are read from source, before any object exists.
    """

    versions: VersionRange
    names: tuple[str, ...]
    set_in: tuple[str, ...] = ("__init__",)


@dataclass(frozen=True)
class Absent:
    """No such name in ``versions``: kvelastic does without it there, and the gate checks it is gone."""

    versions: VersionRange


Shape = Union[Signature, Attributes, Absent]

#: What a target is: a module-level function, a method (instance or class-level), a staticmethod,
#: a property's setter (its parameters are the setter's), or a class (its objects' attributes).
KINDS = ("function", "method", "staticmethod", "setter", "class")
#: How kvelastic uses it: wraps it on its class or module (``Patcher.wrap``), wraps or replaces it
#: on live objects (``Patcher.wrap_instance``, ``Patcher.replace_attribute``), or only reads it.
USES = ("wrap", "instance", "read")


@dataclass(frozen=True)
class Target:
    """One vLLM contact, as ``module`` + ``qualname``, with its shape in each range of releases."""

    module: str
    qualname: str
    shapes: tuple[Shape, ...]
    kind: str = "function"
    use: str = "wrap"

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.use not in USES:
            raise ValueError(f"{self.path}: kind must be one of {KINDS} and use one of {USES}")
        present = Attributes if self.kind == "class" else Signature
        wrong = [s for s in self.shapes if not isinstance(s, (present, Absent))]
        if wrong:
            raise ValueError(f"{self.path}: a {self.kind} target declares {present.__name__} or Absent, not {wrong}")
        ranges = [s.versions for s in self.shapes]
        if any(a.overlaps(b) for i, a in enumerate(ranges) for b in ranges[i + 1:]):
            raise ValueError(f"{self.path}: its declared ranges overlap")

    def shape(self, version: Version) -> Shape | None:
        """What this target is in ``version``; None where nothing is declared for it."""
        for shape in self.shapes:
            if version in shape.versions:
                return shape
        return None

    def exists_in(self, version: Version) -> bool:
        """Declared present (not :class:`Absent`, not undeclared) in ``version``."""
        return isinstance(self.shape(version), (Signature, Attributes))

    @property
    def name(self) -> str:
        """The attribute name this target has on its class or module."""
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def path(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class Patch:
    """One patch point: what it changes, where, in which releases, and how."""

    name: str
    summary: str
    versions: VersionRange
    targets: tuple[Target, ...]
    apply: Callable[["Patcher", "Runtime"], None] = field(compare=False)

    def claims(self, version: Version) -> bool:
        return version in self.versions


def claimed(patches: Sequence[Patch], version: Version) -> list[Patch]:
    return [patch for patch in patches if patch.claims(version)]
