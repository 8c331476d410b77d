"""Runs from ``kvelastic-autopatch.pth`` at every interpreter start.

It must be nearly free when kvelastic is off: it reads one environment
variable and returns. When ``KVELASTIC`` is on, it registers a ``wrapt``
post-import hook so the patches are applied the moment vLLM is imported,
in the front end, the engine core and every worker process alike.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Mapping

from kvelastic import switch


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``KVELASTIC`` asks for the patches; garbage is an error, not a guess."""
    return switch.enabled(environ)


def install_if_enabled() -> None:
    """Register the vLLM import hook when ``KVELASTIC`` is on; never raise at site import.

    A value that is no switch (``KVELASTIC=maybe``) registers a hook too: it
    stops a process that imports vLLM with one line and exit status 1, as a bad
    setting does, and leaves every other interpreter alone.
    """
    try:
        hook = _on_vllm_import if enabled() else None
    except Exception as exc:  # noqa: BLE001 - a .pth must not kill the interpreter
        hook = _refusing(exc)
    if hook is None:
        return
    try:
        import wrapt
    except ImportError:
        print("kvelastic: KVELASTIC is set but wrapt is not installed; vLLM stays unpatched",
              file=sys.stderr)
        return
    wrapt.register_post_import_hook(hook, "vllm")


def _refusing(error: Exception) -> Callable[[object], None]:
    def refuse(module: object) -> None:
        from kvelastic.errors import ConfigError
        from kvelastic.startup.reporting import StartupRefused

        raise StartupRefused(error if isinstance(error, ConfigError) else ConfigError(str(error)))

    return refuse


def _on_vllm_import(module: object) -> None:
    from kvelastic.startup.activate import activate_from_hook

    activate_from_hook()
