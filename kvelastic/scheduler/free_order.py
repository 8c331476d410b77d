"""The free blocks of mapped groups in the order vLLM's own free queue would keep them.

vLLM's ``FreeKVCacheBlockQueue`` is a doubly linked list through the blocks'
own ``prev_free_block`` / ``next_free_block`` fields, least recently freed
first. The page-aware queue hands blocks out in another order (lowest group
first), but a connector that walks the free queue itself (SimpleCPUOffload's
lazy mode, from ``fake_free_list_head`` up to 0.25 and ``iter_blocks_after``
from 0.26) expects that list. This keeps it, with two differences that follow
from pages: only blocks of mapped groups are in it (a walker must never be
offered memory that is not there), and the blocks of a group mapped anew join
the list where vLLM keeps blocks it never used: after the blocks free at start
and those of earlier new groups, ahead of every block freed since. A group
mapped a moment later (the mapper runs on its own thread) therefore lands where
it would have landed a moment earlier, and a walker that covers a fixed number
of blocks from the front (the lazy offload's) reaches the cached blocks no
sooner than on vanilla vLLM.

A block leaving the list because its group is released keeps a forward link to
the head end: a walker whose saved position was that block starts over from the
head, as vLLM's walker does when its position is taken.

Only a connector walks the list, and keeping it costs a few pointer updates on
every block taken or freed, dozens a scheduling step. An engine without a
connector gets :class:`UntrackedOrder`, which keeps nothing and says so if it
is ever read.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Protocol

from kvelastic.errors import KvelasticError


class FreeOrderNotKept(KvelasticError):
    """The free queue's order was read on an engine that keeps none (it has no KV connector)."""


class BlockOrder(Protocol):
    """What the free-block ledger tells the order as blocks come and go, and what a walker reads."""

    def append(self, block: Any) -> None: ...

    def add_fresh(self, blocks: Iterable[Any]) -> None: ...

    def mark_fresh(self) -> None: ...

    def move_to_head(self, blocks: list[Any]) -> None: ...

    def unlink(self, block: Any, *, restart: bool = False) -> None: ...

    def unlink_all(self, blocks: Iterable[Any], *, restart: bool = False) -> None: ...

    @property
    def head(self) -> Any: ...

    @property
    def tail(self) -> Any: ...

    def after(self, cursor: Any | None) -> Iterator[Any]: ...


class ListEnd:
    """One end of the list: looks like an empty free block to a walker that reads one."""

    block_id = -1
    block_hash = None
    is_null = False
    ref_cnt = 0

    def __init__(self) -> None:
        self.prev_free_block: Any = None
        self.next_free_block: Any = None


class FreeOrder:
    """A doubly linked list through the blocks' own free-list fields, with two end markers."""

    def __init__(self) -> None:
        self.head = ListEnd()
        self.tail = ListEnd()
        self.head.next_free_block = self.tail
        self.tail.prev_free_block = self.head
        self.fresh_last: Any = self.head  # the last block of the never-used part at the front

    def append(self, block: Any) -> None:
        """A freed block: last."""
        self._insert_after(self.tail.prev_free_block, block)

    def add_fresh(self, blocks: Iterable[Any]) -> None:
        """Blocks of a group mapped anew: after the never-used ones, ahead of every freed block."""
        for block in blocks:
            self._insert_after(self.fresh_last, block)
            self.fresh_last = block

    def mark_fresh(self) -> None:
        """Every block in the list now counts as never used (the free blocks at start)."""
        self.fresh_last = self.tail.prev_free_block

    @staticmethod
    def _insert_after(before: Any, block: Any) -> None:
        after = before.next_free_block
        block.prev_free_block = before
        block.next_free_block = after
        before.next_free_block = block
        after.prev_free_block = block

    def move_to_head(self, blocks: list[Any]) -> None:
        """Put ``blocks`` (already in the list) first, ``blocks[0]`` at the very front."""
        for block in reversed(blocks):
            self.unlink(block)
            self._insert_after(self.head, block)
        if blocks and self.fresh_last is self.head:  # blocks to evict first stay ahead of new groups' too
            self.fresh_last = blocks[-1]

    def unlink(self, block: Any, *, restart: bool = False) -> None:
        """Take ``block`` out; with ``restart`` its forward link leads a walker back to the head."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if block is self.fresh_last:
            self.fresh_last = prev
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = None
        block.next_free_block = self.head if restart else None

    def unlink_all(self, blocks: Iterable[Any], *, restart: bool = False) -> None:
        for block in blocks:
            self.unlink(block, restart=restart)

    def after(self, cursor: Any | None) -> Iterator[Any]:
        """The blocks after ``cursor`` (from the front if None, or if it is no longer in the list)."""
        node = self.head.next_free_block if cursor is None else cursor.next_free_block
        if node is None or node is self.head:
            node = self.head.next_free_block
        while node is not self.tail and node is not None:
            yield node
            node = node.next_free_block

    def __iter__(self) -> Iterator[Any]:
        return self.after(None)


class UntrackedOrder:
    """The order of an engine no connector walks: every update is free, and reading it is an error."""

    def append(self, block: Any) -> None:
        return None

    def add_fresh(self, blocks: Iterable[Any]) -> None:
        return None

    def mark_fresh(self) -> None:
        return None

    def move_to_head(self, blocks: list[Any]) -> None:
        return None

    def unlink(self, block: Any, *, restart: bool = False) -> None:
        return None

    def unlink_all(self, blocks: Iterable[Any], *, restart: bool = False) -> None:
        return None

    @property
    def head(self) -> Any:
        raise self._not_kept()

    @property
    def tail(self) -> Any:
        raise self._not_kept()

    def after(self, cursor: Any | None) -> Iterator[Any]:
        raise self._not_kept()

    @staticmethod
    def _not_kept() -> FreeOrderNotKept:
        return FreeOrderNotKept("kvelastic keeps the GPU free queue's order only for an engine with a KV connector "
                                "(the only walker of it); this engine was attached without one")
