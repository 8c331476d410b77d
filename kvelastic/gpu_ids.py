"""Which GPU an operator means: an account id, an nvidia-smi UUID, or an nvidia-smi index.

kvelastic names a GPU's shared account ``gpu-<uuid>``, after the UUID torch
reports, which is nvidia-smi's without its ``GPU-`` prefix. People know their
GPUs by index (``nvidia-smi``, ``CUDA_VISIBLE_DEVICES``) or by the UUID
``nvidia-smi -L`` prints; both are mapped to the account id here. An index is
looked up with ``nvidia-smi``, so it means what nvidia-smi shows, whatever
``CUDA_VISIBLE_DEVICES`` says in the caller's shell.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from kvelastic.errors import KvelasticError

SMI_UUID_PREFIX = "GPU-"
ACCOUNT_PREFIX = "gpu-"


class UnknownGpu(KvelasticError):
    """A GPU index that nvidia-smi does not list, or that cannot be looked up."""


def account_gpu_id(text: str) -> str:
    """The account id of the GPU ``text`` names (see the module docstring); UnknownGpu for a bad index."""
    text = text.strip()
    if text.startswith(SMI_UUID_PREFIX):
        return ACCOUNT_PREFIX + text[len(SMI_UUID_PREFIX):]
    if not re.fullmatch(r"[0-9]+", text):
        return text
    uuids = nvidia_smi_uuids()
    if isinstance(uuids, str):
        raise UnknownGpu(f"GPU index {text} cannot be mapped to its UUID: {uuids}; give the id that "
                         f"'kvelastic status' shows")
    if text not in uuids:
        known = ", ".join(sorted(uuids, key=int)) or "none"
        raise UnknownGpu(f"nvidia-smi lists no GPU with index {text} (indexes: {known})")
    return account_gpu_id(uuids[text])


def nvidia_smi_uuids() -> dict[str, str] | str:
    """nvidia-smi's index -> UUID of every GPU, or why nvidia-smi could not say."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "nvidia-smi is not on PATH"
    try:
        done = subprocess.run([smi, "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi could not run ({error})"
    if done.returncode != 0:
        return f"nvidia-smi failed (exit {done.returncode})"
    pairs = (line.split(",", 1) for line in done.stdout.splitlines() if "," in line)
    return {index.strip(): uuid.strip() for index, uuid in pairs}
