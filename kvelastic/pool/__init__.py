"""Elastic page pool: virtual tensors backed by physical pages mapped on demand.

``PagePool`` is backend-agnostic and takes its pages from a stack of page
sources its caller builds (``PagePool.standard`` builds the usual one);
``HostBackend`` (process memory) runs anywhere, ``CudaBackend`` (CUDA virtual
memory management) needs a GPU and is imported only when asked for, so
importing this package never touches CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvelastic.pool.backend import DoneFence, Fence, MapRun, PhysicalBackend
from kvelastic.pool.host import HostBackend
from kvelastic.pool.layout import GroupLayout, PageRef, UniformLayout
from kvelastic.pool.page_pool import DEFAULT_PAGE_BYTES, PagePool
from kvelastic.pool.sources import DeviceSource, LimitedSource, PageAdaptor, PageSource, ReserveSource
from kvelastic.pool.stats import PoolStats, StatisticsSource

if TYPE_CHECKING:
    from kvelastic.pool.cuda import CudaBackend

__all__ = [
    "CudaBackend", "DEFAULT_PAGE_BYTES", "DeviceSource", "DoneFence", "Fence", "GroupLayout", "HostBackend",
    "LimitedSource", "MapRun", "PageAdaptor", "PagePool", "PageRef", "PageSource", "PhysicalBackend",
    "PoolStats", "ReserveSource", "StatisticsSource", "UniformLayout",
]


def __getattr__(name: str) -> Any:
    if name == "CudaBackend":
        from kvelastic.pool.cuda import CudaBackend

        return CudaBackend
    raise AttributeError(name)
