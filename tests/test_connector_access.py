"""KV connectors that reach the KV cache from outside the process are refused before it is allocated.

Every release: vLLM's real ``KVTransferConfig`` for each connector the
installed release registers, asked the way the release can answer (0.34+:
vLLM's own ``kv_cache_access()``; before: kvelastic's list), and the refusal
taken through the runner's real, patched ``initialize_kv_cache`` before vLLM's
method runs. In 0.34+ the list used before 0.34 is checked against vLLM's
declarations, connector by connector.
"""

from __future__ import annotations

import copy
import types

import pytest

pytest.importorskip("vllm", reason="needs vllm installed")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402

from kvelastic.errors import ConnectorUnsupported  # noqa: E402
from kvelastic.patches import kv_connector_access  # noqa: E402
from kvelastic.patching.apply import Patcher  # noqa: E402
from kvelastic.patching.versions import installed_vllm_version  # noqa: E402
from kvelastic.worker.connector_access import (OUTSIDE_ACCESS, listed_outside_access,  # noqa: E402
                                               refuse_outside_access)

VERSION = installed_vllm_version()
REGISTERED = sorted(KVConnectorFactory._registry)
#: In every supported release, copying the KV cache inside the engine's process.
IN_PROCESS = ("LMCacheConnectorV1", "OffloadingConnector", "MultiConnector")
#: In every supported release, registering or sharing it outside.
OUTSIDE = ("NixlConnector", "LMCacheMPConnector")


def config_of(name: str | None, **fields) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=name, kv_role="kv_both", **fields)


def patcher() -> Patcher:
    return Patcher(VERSION, kv_connector_access.TARGETS)


def outside_access(config: KVTransferConfig) -> str | None:
    return kv_connector_access.outside_access_test(patcher())(config)


def test_the_release_registers_the_connectors_checked_here():
    assert set(IN_PROCESS + OUTSIDE) <= set(REGISTERED)


@pytest.mark.parametrize("name", IN_PROCESS)
def test_connectors_that_copy_in_the_engines_process_are_served(name):
    config = config_of(name)
    assert outside_access(config) is None
    refuse_outside_access(config, outside_access)  # nothing raised
    refuse_outside_access(None, outside_access)  # no connector configured


def test_nixl_staging_through_host_buffers_is_served_and_between_gpus_refused():
    assert outside_access(config_of("NixlConnector", kv_buffer_device="cpu")) is None
    with pytest.raises(ConnectorUnsupported, match=r'NixlConnector .* KVELASTIC=0 \(NIXL with kv_buffer_device "cpu"'):
        refuse_outside_access(config_of("NixlConnector"), outside_access)


def test_lmcaches_multi_process_connector_is_refused_by_name_and_reason():
    """Its worker hands the KV cache to the LMCache server process; asked through vLLM where vLLM
    declares it (the class needs the lmcache package to import: the list answers for it here)."""
    config = config_of("LMCacheMPConnector")
    how = outside_access(config) if _imports(config) else listed_outside_access(config)
    assert how is not None and how.startswith("LMCacheMPConnector")
    with pytest.raises(ConnectorUnsupported, match="LMCacheMPConnector .* Run this connector with KVELASTIC=0"):
        refuse_outside_access(config, lambda _: how)


def test_a_multi_connector_is_refused_when_one_child_reaches_outside():
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    both = config_of("MultiConnector", kv_connector_extra_config={"connectors": [offload, nixl]})
    alone = config_of("MultiConnector", kv_connector_extra_config={"connectors": [offload]})
    assert outside_access(alone) is None
    assert outside_access(both) is not None
    with pytest.raises(ConnectorUnsupported, match="MultiConnector|NixlConnector"):
        refuse_outside_access(both, outside_access)


def test_the_list_agrees_with_vllms_declarations_where_vllm_declares_them():
    """0.34+: for every registered connector whose class imports here, kvelastic's list (what releases before
    0.34 read) says what vLLM's ``kv_cache_access()`` says, for GPU and host buffers."""
    if not patcher().declares(kv_connector_access.KV_CACHE_ACCESS):  # before 0.34 the list is the only answer
        assert kv_connector_access.outside_access_test(patcher()) is listed_outside_access
        return
    compared = set()
    for name in REGISTERED:
        for device in ("cuda", "cpu"):
            config = config_of(name, kv_buffer_device=device)
            if not _imports(config):
                continue
            assert (listed_outside_access(config) is None) == (not config.kv_cache_access()), (name, device)
            compared.add(name)
    assert {"NixlConnector", "MooncakeConnector", "UMBPStoreConnector", "OffloadingConnector"} <= compared
    assert set(OUTSIDE_ACCESS) - compared <= {"LMCacheMPConnector", "MoRIIOConnector"}  # need lmcache, msgpack


def test_refused_in_the_runners_initialize_kv_cache_before_vllms_method_runs():
    """The runner's ``initialize_kv_cache`` as kvelastic patches it in this release (the one-backing patch from
    0.29, the publishing patch before): refused with vLLM's method not entered, and nothing allocated."""
    from kvelastic.patches import v2_initialize_kv_cache, v2_single_backing
    from kvelastic.pool import HostBackend
    from kvelastic.settings import Settings
    from kvelastic.startup.runtime import Runtime
    from tests.scheduler_harness import vllm_config

    patch = next(p for p in (v2_single_backing.PATCH, v2_initialize_kv_cache.PATCH) if p.claims(VERSION))
    runtime = Runtime(Settings(enabled=True), backend_factory=HostBackend)
    applied = Patcher(VERSION, patch.targets)
    patch.apply(applied, runtime)
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        config = copy.deepcopy(vllm_config(64))
        config.kv_transfer_config = config_of("NixlConnector")
        runner = types.SimpleNamespace(vllm_config=config, scheduler_config=config.scheduler_config, kv_caches=[])
        initialize = vars(GPUModelRunner)["initialize_kv_cache"].__get__(runner, GPUModelRunner)  # as the patch
        with pytest.raises(ConnectorUnsupported, match="NixlConnector"):
            initialize(None)
        assert runtime.allocation_pool() is None and runtime.cache is None and runner.kv_caches == []
        config.kv_transfer_config = config_of("NixlConnector", kv_buffer_device="cpu")
        with pytest.raises(Exception) as entered:  # vLLM's own method, entered with a stand-in runner
            initialize(None)
        last = entered.traceback[-1]  # raised in vLLM's method itself, past kvelastic's refusals
        assert last.name == "initialize_kv_cache" and "/vllm/" in str(last.path), entered.value
    finally:
        applied.revert()


def _imports(config: KVTransferConfig) -> bool:
    """Whether the connector's class imports here (some need packages CI does not install)."""
    try:
        KVConnectorFactory.get_connector_class(config)
    except ImportError:
        return False
    return True
