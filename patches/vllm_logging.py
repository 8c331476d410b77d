"""vLLM 0.31+: vLLM's logging set up from the environment when kvelastic switches on, as ``import vllm`` did.

Up to 0.30, ``import vllm`` configured the ``vllm`` logger from
``VLLM_CONFIGURE_LOGGING``, ``VLLM_LOGGING_LEVEL`` and the rest
(``vllm/logger.py`` ran ``_configure_vllm_root_logger()`` at import), so
kvelastic's start-up lines, logged as ``vllm.kvelastic`` right after that
import, went through vLLM's handler and format. From 0.31 vLLM configures
logging only when an engine, server or worker starts
(``configure_logging(LoggingConfig)``): at import those lines would find no
handler, their warnings would reach Python's last resort bare and the rest
would be lost. With kvelastic on, this patch runs vLLM's own environment-based
configuration once at activation, which is what 0.30 did at import. The engine's
or server's ``LoggingConfig`` still applies when vLLM gets to it:
``configure_logging_if_needed`` compares with the config vLLM last applied,
which this call leaves unset.
"""

from __future__ import annotations

from typing import Any

from kvelastic.patching.spec import Patch, Signature, Target
from kvelastic.patches._common import since

DEFERRED_LOGGING = since("0.31")

TARGET = Target(
    module="vllm.logger",
    qualname="_configure_vllm_root_logger",
    kind="function",
    use="read",
    shapes=(Signature(DEFERRED_LOGGING, ("config",)),),
)


def apply(patcher: Any, runtime: Any) -> None:
    from vllm import logger

    logger._configure_vllm_root_logger()


PATCH = Patch("vllm_logging", "vLLM's logging configured from the environment at activation (0.31+)",
              DEFERRED_LOGGING, (TARGET,), apply)
