"""The fused gather's one Triton kernel (imported only when a staged mover is built: ``fused_copy``).

It lives apart from ``fused_copy`` because it imports triton at module level
(a jitted function resolves ``tl`` from its module's globals), and kvelastic
must import on machines without triton or CUDA.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Columns of the piece table, one int64 row per piece, all in bytes (constexpr: the kernel reads them).
VIEW_ADDRESS, VIEW_STRIDE, HOST_COLUMN, WIDTH = (tl.constexpr(i) for i in range(4))
TABLE_COLUMNS = tl.constexpr(4)


def copy_pieces(table, blocks, rows, host, host_stride,
                TO_HOST: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """Copy chunk ``program_id(2)`` of piece ``program_id(1)`` of batch entry ``program_id(0)``.

    Addresses come in as integers (a device view's address, or a pinned host
    row's, which unified addressing makes valid on the device too) and are cast
    to byte pointers. ``ALIGN`` (bytes, at most 16) divides every address,
    stride, column and width (the caller checks); the ``multiple_of`` hints
    tell the compiler so, since it cannot know it of loaded integers, and with
    them it moves ``ALIGN`` bytes per access instead of one. The hints sit on
    the pointers: Triton 3.9 drops a hint on an integer at the cast.
    ``EVEN``: every piece is a whole number of ``BLOCK`` chunks, so no masks.
    """
    entry = table + tl.program_id(1) * TABLE_COLUMNS
    view_row = tl.load(entry + VIEW_ADDRESS) + tl.load(blocks + tl.program_id(0)) * tl.load(entry + VIEW_STRIDE)
    host_row = host + tl.load(rows + tl.program_id(0)) * host_stride + tl.load(entry + HOST_COLUMN)
    offsets = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    view_bytes = tl.multiple_of(view_row.to(tl.pointer_type(tl.int8)), ALIGN) + offsets
    host_bytes = tl.multiple_of(host_row.to(tl.pointer_type(tl.int8)), ALIGN) + offsets
    if TO_HOST:
        source, target = view_bytes, host_bytes
    else:
        source, target = host_bytes, view_bytes
    if EVEN:
        tl.store(target, tl.load(source))
    else:
        inside = offsets < tl.multiple_of(tl.load(entry + WIDTH), ALIGN)
        tl.store(target, tl.load(source, mask=inside), mask=inside)


def jitted():
    """The kernel compiled for the device, or run by the interpreter when ``TRITON_INTERPRET=1``.

    ``triton.jit`` picks between the two when it is applied, so it is applied
    here, on each call, not once at import: a test can switch modes.
    """
    return triton.jit(copy_pieces)
