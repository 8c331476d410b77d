"""Worker: the KV cache's size is its virtual capacity; what vLLM profiled becomes the physical limit.

The profile is read as if the other engines kvelastic serves on the GPU had
stood still while this one started (``kvelastic/worker/profile_neighbours.py``):
``init_device`` is wrapped to note their bytes once vLLM took its start snapshot
(``Worker.init_snapshot``, a ``MemorySnapshot``), and a copy corrected by their
change stands in for it (a change the Patcher records and undoes) for the length
of vLLM's ``determine_available_memory``.
"""

from __future__ import annotations

import functools
from typing import Any

from kvelastic.patching.spec import Attributes, Patch, Signature, Target
from kvelastic.patches._common import ALL

_WORKER = "vllm.v1.worker.gpu_worker"
TARGET = Target(
    module=_WORKER,
    qualname="Worker.determine_available_memory",
    kind="method",
    shapes=(Signature(ALL, ("self",)),),
)
INIT_DEVICE = Target(module=_WORKER, qualname="Worker.init_device", kind="method", shapes=(Signature(ALL, ("self",)),))
WORKER = Target(  # the start snapshot init_device takes, replaced by a corrected copy while vLLM profiles
    module=_WORKER,
    qualname="Worker",
    kind="class",
    use="instance",
    shapes=(Attributes(ALL, ("init_snapshot",), set_in=("init_device",)),),
)
MEMORY_SNAPSHOT = Target(  # the fields that count other processes' memory (profile_neighbours.RISES, FALLS)
    module="vllm.utils.mem_utils",
    qualname="MemorySnapshot",
    kind="class",
    use="read",
    shapes=(Attributes(ALL, ("free_memory", "cuda_memory", "non_torch_memory", "auto_measure")),),
)
TARGETS = (TARGET, INIT_DEVICE, WORKER, MEMORY_SNAPSHOT)


def _init_device(correction: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    correction.snapshot_taken()
    return result


def _determine(runtime: Any, patcher: Any, correction: Any, wrapped: Any, instance: Any, args: tuple,
               kwargs: dict) -> int:
    import torch

    measured = vars(instance).get("init_snapshot")  # taken by init_device on a CUDA device only
    corrected = None if measured is None else correction.corrected(measured)
    change = None if corrected is None else patcher.replace_attribute(instance, WORKER, "init_snapshot", corrected)
    try:
        profiled = int(wrapped(*args, **kwargs))
    finally:
        if change is not None:
            patcher.undo(change)  # vLLM's own snapshot back
    total = torch.cuda.mem_get_info()[1]
    return runtime.plan_capacity(profiled_bytes=profiled, device_total_bytes=total).virtual_bytes


def apply(patcher: Any, runtime: Any) -> None:
    from kvelastic.worker.profile_neighbours import NeighbourCorrection, neighbours_on_this_device

    correction = NeighbourCorrection(functools.partial(neighbours_on_this_device, runtime.settings.shared_dir))
    patcher.wrap(TARGET, functools.partial(_determine, runtime, patcher, correction))
    patcher.wrap(INIT_DEVICE, functools.partial(_init_device, correction))


PATCH = Patch("worker_capacity", "Worker: virtual KV capacity, profiled bytes become the physical limit, the "
              "profile read as if neighbours had stood still", ALL, TARGETS, apply)
