"""How a patch describes itself: the releases it claims and the targets it expects.

A patch is data plus one ``apply`` function. The gate reads the data to check,
before anything changes, that every target exists in the running vLLM with
the parameters the patch was written against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from kvelastic.patching.versions import Version, VersionRange

if TYPE_CHECKING:
    from kvelastic.integration.runtime import Runtime
    from kvelastic.patching.apply import Patcher


@dataclass(frozen=True)
class Signature:
    """Parameter names (``self`` included for methods) a target has in ``versions``."""

    versions: VersionRange
    params: tuple[str, ...]


@dataclass(frozen=True)
class Target:
    """A function or method the patch wraps, as ``module`` + ``qualname``."""

    module: str
    qualname: str
    signatures: tuple[Signature, ...]
    kind: str = "function"  # "function", "method" or "staticmethod"
    #: False where the patch only reads the target or wraps it on one instance at run time:
    #: the gate checks it all the same, but the class (or module) keeps vLLM's function.
    wrapped: bool = True

    def expected_params(self, version: Version) -> tuple[str, ...] | None:
        for signature in self.signatures:
            if version in signature.versions:
                return signature.params
        return None

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
