"""Runs from ``kvelastic-autopatch.pth`` at every interpreter start.

It must be nearly free when kvelastic is off: it reads one environment
variable and returns. When ``KVELASTIC`` is on, it registers a ``wrapt``
post-import hook so the patches are applied the moment vLLM is imported,
in the front end, the engine core and every worker process alike.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

from kvelastic import switch


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``KVELASTIC`` asks for the patches; garbage is an error, not a guess."""
    return switch.enabled(environ)


def install_if_enabled() -> None:
    """Register the vLLM import hook when ``KVELASTIC`` is on; never raise at site import."""
    try:
        if not enabled():
            return
    except Exception as exc:  # noqa: BLE001 - a .pth must not kill the interpreter
        print(f"kvelastic: {exc}", file=sys.stderr)
        return
    try:
        import wrapt
    except ImportError:
        print("kvelastic: KVELASTIC is set but wrapt is not installed; vLLM stays unpatched",
              file=sys.stderr)
        return
    wrapt.register_post_import_hook(_on_vllm_import, "vllm")


def _on_vllm_import(module: object) -> None:
    from kvelastic.startup.activate import activate_from_hook

    activate_from_hook()
