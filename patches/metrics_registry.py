"""API server: the kvelastic_* metrics also reach ``/metrics`` when vLLM serves multiprocess metrics.

With several API-server processes (``--api-server-count``), or with
``PROMETHEUS_MULTIPROC_DIR`` set by the user, vLLM builds ``/metrics`` from a
fresh registry over prometheus_client's multiprocess files instead of the
default registry, where kvelastic's collector lives. The patch adds the
collector to that registry too.
"""

from __future__ import annotations

from typing import Any

from kvelastic.patches._common import ALL
from kvelastic.patching.spec import Patch, Signature, Target

TARGET = Target(
    module="vllm.v1.metrics.prometheus",
    qualname="get_prometheus_registry",
    signatures=(Signature(ALL, ()),),
)


def _registry(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    registry = wrapped(*args, **kwargs)
    from kvelastic.integration.metrics import add_to_multiprocess_registry

    add_to_multiprocess_registry(registry)
    return registry


def apply(patcher: Any, runtime: Any) -> None:
    patcher.wrap(TARGET, _registry)


PATCH = Patch("metrics_registry", "API server: kvelastic_* metrics in vLLM's multiprocess /metrics registry",
              ALL, (TARGET,), apply)
