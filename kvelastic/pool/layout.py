"""Which physical pages make up a page group.

A page group is the unit the pool maps and unmaps. In the plain case group g is
page g of every tensor. vLLM's KV tensors are not always that plain: a layer
laid out as (2, num_blocks, ...) keeps a block's K half and V half far apart,
so one group of blocks covers two page ranges of the same tensor, and those
ranges need not be page aligned. A layout answers "which pages does group g
need", and the pool reference-counts pages so two groups may share one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping, NamedTuple, Sequence


class PageRef(NamedTuple):
    """Page ``page`` (0-based, in pages of the pool's page size) of region ``region``."""

    region: int
    page: int


class GroupLayout(ABC):
    """Maps group numbers to the pages they occupy."""

    @property
    @abstractmethod
    def num_groups(self) -> int:
        """Groups 0 .. num_groups - 1 exist."""

    @abstractmethod
    def pages(self, group: int) -> Sequence[PageRef]:
        """The pages group ``group`` needs mapped (any order, no duplicates)."""


class UniformLayout(GroupLayout):
    """Group g is page g of every region that is long enough to have one."""

    def __init__(self, region_pages: Mapping[int, int]):
        """``region_pages`` maps each region id to its length in pages."""
        self._region_pages = dict(region_pages)

    @property
    def num_groups(self) -> int:
        return max(self._region_pages.values(), default=0)

    def pages(self, group: int) -> Sequence[PageRef]:
        if not 0 <= group < self.num_groups:
            raise IndexError(f"group {group} outside 0..{self.num_groups - 1}")
        return [PageRef(r, group) for r, n in self._region_pages.items() if group < n]
