"""KV tensor allocation over the page pool, and publishing the result to the scheduler.

``allocate_kv_tensors`` does what vLLM's own allocators do (one int8 tensor of
``KVCacheTensor.size`` bytes per entry, shared by the layers in ``shared_by``;
one packed backing for entries with a ``block_stride``), except that the bytes
are virtual. ``publish_views`` runs after vLLM has reshaped them: it reads the
block layout off the views and hands the scheduler an :class:`ElasticKVCache`.
What is read off vLLM's objects is declared in ``patches/kv_cache_objects.py``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from kvelastic.scheduler.elastic_cache import ElasticKVCache
from kvelastic.pool.kv_layout import KVGroupLayout, merge_runs, runs_of_view
from kvelastic.startup.runtime import Runtime
from kvelastic.pool import PagePool
from kvelastic.units import format_size

log = logging.getLogger("vllm.kvelastic")


def allocate_kv_tensors(runtime: Runtime, kv_cache_config: Any, *, packed: bool) -> dict[str, Any]:
    """One pool-backed tensor per entry of ``kv_cache_config``, by layer name.

    ``packed``: the release has ``KVCacheTensor.block_stride`` (0.24+), so the
    entries with a positive one share one backing.
    """
    pool = runtime.new_pool()
    raw: dict[str, Any] = {}
    backing = None
    for entry in kv_cache_config.kv_cache_tensors:
        if packed and entry.block_stride > 0:
            if backing is None:
                backing = pool.add_tensor(entry.size)
            tensor = backing
        else:
            tensor = pool.add_tensor(entry.size)
        for layer_name in entry.shared_by:
            raw[layer_name] = tensor
    return raw


def _flatten(values: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for value in values:
        if isinstance(value, (list, tuple)):
            out.extend(_flatten(value))
        elif value is not None and hasattr(value, "data_ptr"):
            out.append(value)
    return out


def startup_blocks(runner: Any, kv_cache_config: Any) -> int:
    """Blocks that start-up warm-up may touch before the scheduler exists.

    vLLM's V2 runner warms up kernels with made-up requests whose blocks are
    numbered from 1 up to one batch's worth of tokens; those pages must be
    mapped before the scheduler (which normally maps them) is even built.
    """
    tokens = runner.scheduler_config.max_num_batched_tokens or 8192  # unset only before vLLM fills it in
    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups] or [16]
    return 2 * (-(-int(tokens) // min(sizes))) + 2 * len(sizes)


def publish_views(runtime: Runtime, pool: PagePool, views: Iterable[Any], num_blocks: int,
                  premap_blocks: int = 1, blocks_per_group: int | None = None,
                  block_dim: int | None = None) -> ElasticKVCache:
    """Derive the group layout from vLLM's views of the pool's tensors and publish the cache.

    The groups holding blocks ``0 .. premap_blocks - 1`` are mapped at once:
    block 0 is vLLM's null block, the rest serve start-up warm-up. ``blocks_per_group``
    overrides the layout's default group size (see :mod:`kvelastic.worker.page_alignment`);
    ``block_dim`` is the views' block dimension where the release fixes it.
    """
    per_view = []
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for view in _flatten(views):
        key = (view.data_ptr(), tuple(view.shape), tuple(view.stride()))
        if key in seen:
            continue
        seen.add(key)
        region = pool.region_of(view)
        stride, runs = runs_of_view(view.shape, view.stride(), view.element_size(),
                                    view.data_ptr() - region.address, num_blocks, block_dim)
        per_view.append((region.region_id, stride, runs))
    layout = KVGroupLayout(merge_runs(per_view), num_blocks, pool.page_bytes, blocks_per_group)
    cache = ElasticKVCache(pool, layout)
    cache.map_first_blocks(premap_blocks)
    runtime.publish(cache)
    stats = pool.stats()
    log.info("kvelastic: %d KV tensors, %s virtual, %d blocks in %d groups of %d (%s per group), "
             "%s mapped at start", len(pool.regions), format_size(stats.virtual_bytes), num_blocks,
             layout.num_groups, layout.blocks_per_group, format_size(cache.group_bytes),
             format_size(stats.mapped_bytes))
    return cache


def publish_after_initialize(runtime: Runtime, wrapped: Any, instance: Any, args: tuple, kwargs: dict, *,
                             outside_access: Callable[[Any], str | None],
                             group_blocks: Callable[[Any, int], int | None] | None = None,
                             block_dim: int | None = None) -> Any:
    """Wrapper body shared by both runners' ``initialize_kv_cache``: run it, then publish the views.

    A KV connector that reaches the KV cache from outside the process
    (``outside_access``, from ``patches/kv_connector_access.py``) is refused first,
    before vLLM allocates the cache or the connector registers it. Both runners
    bind their reshaped KV views to ``runner.kv_caches`` before returning; the
    allocation in progress (if it went to the pool) is published.
    ``group_blocks(kv_cache_config, page_bytes)`` chooses the blocks per page group
    (None: the layout's default); ``block_dim`` is passed on to :func:`publish_views`.
    """
    import inspect

    from kvelastic.worker.connector_access import refuse_outside_access

    refuse_outside_access(instance.vllm_config.kv_transfer_config, outside_access)
    result = wrapped(*args, **kwargs)
    pool = runtime.finish_allocation()
    if pool is not None:
        config = inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments["kv_cache_config"]
        blocks_per_group = group_blocks(config, pool.page_bytes) if group_blocks is not None else None
        cache = publish_views(runtime, pool, instance.kv_caches, config.num_blocks,
                              premap_blocks=startup_blocks(instance, config), blocks_per_group=blocks_per_group,
                              block_dim=block_dim)
        from kvelastic.tp.worker_side import scheduler_elsewhere, serve_as_rank

        if scheduler_elsewhere(instance):
            serve_as_rank(runtime, instance, cache)
    return result
