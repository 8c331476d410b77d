"""What an operator sees when kvelastic switches on in a vLLM process.

kvelastic logs through ``vllm.kvelastic``, a child of vLLM's own ``vllm``
logger, and never adds a handler or sets a level of its own. Where vLLM
configures logging (the default), kvelastic's lines therefore go through vLLM's
handler, format and stream, at vLLM's level (``VLLM_LOGGING_LEVEL``,
``VLLM_LOGGING_CONFIG_PATH``, ``--log-level`` where vLLM has it); with
``VLLM_CONFIGURE_LOGGING=0`` they reach whatever the application set up on the
root logger, exactly like vLLM's own lines.

A refusal at start-up (a bad ``KVELASTIC_*`` value, a vLLM release kvelastic
cannot patch) is one line on stderr and exit status 1, not a traceback through
the import machinery: :class:`StartupRefused` is a ``SystemExit``.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

from kvelastic.errors import KvelasticError
from kvelastic.settings import Settings, describe, unknown_variables

LOGGER_NAME = "vllm.kvelastic"
log = logging.getLogger(LOGGER_NAME)


class StartupRefused(SystemExit):
    """kvelastic refused to switch on; uncaught, Python prints the message alone and exits with 1."""

    def __init__(self, error: KvelasticError):
        text = str(error)
        super().__init__(text if text.startswith("kvelastic:") else f"kvelastic: {text}")
        self.error = error


def use_vllm_logging() -> None:
    """Make sure vLLM has configured its ``vllm`` logger, whose handler and level ours inherit.

    Up to 0.30 vLLM configures it when ``vllm.logger`` is first imported, which
    ``import vllm`` does; importing it here covers an activation that comes first.
    From 0.31 vLLM configures it only when an engine or server starts; the
    ``vllm_logging`` patch, applied at activation, does it then.
    """
    try:
        import vllm.logger  # noqa: F401
    except ImportError:
        pass  # no vLLM: records go to the root logger, as any library's do


def report_start(settings: Settings, environ: Mapping[str, str] | None = None) -> None:
    """Warn about ``KVELASTIC_*`` names nothing reads, then log the settings in effect, once per process."""
    env = os.environ if environ is None else environ
    for warning in unknown_variables(env):
        log.warning("kvelastic: %s", warning)
    log.info("kvelastic: settings in effect (* = set in the environment; the rest at their defaults): %s",
             describe(settings, env))
