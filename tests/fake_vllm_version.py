"""The installed vLLM, reporting another release number: a real vLLM kvelastic does not support.

``importlib.metadata`` answers with the first ``vllm-*.dist-info`` on
``sys.path``; a folder holding one, put in front with ``PYTHONPATH``, makes the
real installed vLLM report ``version`` while every module still comes from it.
That is how kvelastic reads the version (``installed_vllm_version``), so its
refusal, and everything vLLM does before it, run as with that release.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def shadow_vllm_version(folder: Path, version: str) -> Path:
    """``folder`` with a ``vllm-<version>.dist-info`` in it (created); put it first on ``PYTHONPATH``."""
    info = folder / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return folder


def python_seeing_vllm(folder: Path, version: str) -> Path:
    """An executable that runs this Python with the installed vLLM reporting ``version``."""
    shadow = shadow_vllm_version(folder / "shadow", version)
    wrapper = folder / f"python-vllm-{version}"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{shadow}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def env_seeing_vllm(folder: Path, version: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which this Python's installed vLLM reports ``version``."""
    env = dict(os.environ if base is None else base)
    shadow = shadow_vllm_version(folder / "shadow", version)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shadow), env.get("PYTHONPATH", "")) if p)
    return env
