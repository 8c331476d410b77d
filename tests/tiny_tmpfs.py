"""A 64 KiB tmpfs mounted for one test: a shared folder that fills up as a small ``/dev/shm`` does."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def mounted_tiny_tmpfs(prefix: str, without: str = "") -> Iterator[Path]:
    """A fresh 64 KiB tmpfs (mode 1777), unmounted and removed afterwards; the test is skipped where this
    machine cannot mount one, saying so (and ``without``: what covers the case there)."""
    where = Path(tempfile.mkdtemp(prefix=prefix))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=1777", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}){without}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
        where.rmdir()
