"""Which device a pool's pages live on, as the name of that device's shared account.

Both an engine's own pool and a worker rank's (which describes its GPU to the
scheduler, so the scheduler can join that GPU's account for it) name their
device the same way: ``gpu-<uuid>`` after the UUID torch reports, or the
backend and host name where the pages are not on a GPU (the host-memory
backend of the CPU tests).
"""

from __future__ import annotations

import re
import socket
from typing import Any

#: What an account id may look like when it comes from another process's file (matched whole with
#: ``fullmatch``: ``$`` alone would let a trailing newline into a file name).
ACCOUNT_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def device_identity(backend: Any) -> tuple[str, int | None]:
    """A name for the device's account file, and its total memory when known."""
    if backend.name != "cuda":
        return f"{backend.name}-{socket.gethostname()}", None
    return current_cuda_identity()


def current_cuda_identity() -> tuple[str, int]:
    """The account id and total memory of this process's current CUDA device."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = str(getattr(props, "uuid", "")) or f"index{torch.cuda.current_device()}"
    return f"gpu-{uuid}", int(props.total_memory)
