"""Switching kvelastic on in a vLLM process: settings, gate, patches, one log line.

Both entry points (the ``.pth`` import hook and vLLM's ``general_plugins``
entry point) end here; whichever comes first activates, the other finds it
done. Activation is all or nothing: every contact of every patch is checked
from the installed source before anything changes, and a failed check or patch
leaves vLLM as it was and, unless ``KVELASTIC_STRICT=0``, stops start-up with
the reason. Each patch is then applied when vLLM imports its module, checked
again as imported (``kvelastic.patching.on_import`` says what all-or-nothing
means for modules imported later); ``import vllm`` itself imports nothing more.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from kvelastic import __version__
from kvelastic.errors import KvelasticError, PatchError
from kvelastic.startup.runtime import Runtime, default_backend
from kvelastic.patching.apply import Patcher
from kvelastic.patching.gate import check_source
from kvelastic.patching.on_import import ImportApplier
from kvelastic.patching.spec import Patch
from kvelastic.patching.versions import Version, installed_vllm_version
from kvelastic.settings import Settings
from kvelastic.startup.reporting import StartupRefused, report_start, use_vllm_logging

log = logging.getLogger("vllm.kvelastic")


@dataclass
class Activation:
    """What activation did in this process."""

    runtime: Runtime
    patcher: Patcher
    applier: ImportApplier
    version: Version
    band: str


class _Once:
    """Holds this process's activation; the lock makes the two entry points race-free."""

    lock = threading.RLock()  # a refusal from a later import hook clears the activation under it
    current: Activation | None = None
    failed: bool = False


def current() -> Activation | None:
    return _Once.current


def activate(settings: Settings | None = None, *, patches: Sequence[Patch] | None = None,
             version: Version | None = None,
             backend_factory: Callable = default_backend) -> Activation | None:
    """Check every patch for the running vLLM and apply each as vLLM imports its module; None when off."""
    settings = settings or Settings.from_env()
    if not settings.enabled:
        return None
    with _Once.lock:
        if _Once.current is not None or _Once.failed:
            return _Once.current
        use_vllm_logging()
        if patches is None:
            from kvelastic.patches import ALL_PATCHES

            patches = ALL_PATCHES
        version = version or installed_vllm_version()
        try:
            result = check_source(patches, version)
            runtime = Runtime(settings, backend_factory)
            patcher = Patcher.for_gate(result)
            applier = ImportApplier(result, runtime, patcher, on_refusal=_refused_later)
            applier.start()
            _Once.current = Activation(runtime, patcher, applier, version, result.band)
        except PatchError as exc:
            _Once.current = None
            _Once.failed = True
            report_start(settings)
            if settings.strict:
                raise
            log.warning("%s\nkvelastic: KVELASTIC_STRICT=0, so vLLM runs without kvelastic", exc)
            return None
        report_start(settings)  # after the patches present now: from 0.31 one sets up vLLM's logging (vllm_logging)
        from kvelastic.metrics.metrics import register_collector

        register_collector()  # serves kvelastic_* on /metrics in the API-server process
        log.info("kvelastic %s on vLLM %s (band %s): patches applied as vLLM imports their modules: %s",
                 __version__, version, result.band, ", ".join(p.name for p in result.patches))
        return _Once.current


def _refused_later() -> None:
    """A patch failed its check when its module was imported: this process runs without kvelastic."""
    with _Once.lock:
        _Once.current = None
        _Once.failed = True


def deactivate() -> None:
    """Undo the patches (tests, or a process that wants vanilla vLLM back)."""
    with _Once.lock:
        if _Once.current is not None:
            _Once.current.applier.stop()
            _Once.current.patcher.revert()
        _Once.current = None
        _Once.failed = False


#: Imported as a vLLM engine starts (``LLM(...)``, the API server's engine client, each engine-core process),
#: and not by ``vllm --version`` or ``vllm --help``: where a refusal of vLLM itself takes effect.
ENGINE_MODULE = "vllm.v1.engine.core"


def activate_from_hook() -> None:
    """Entry for the import hook and the vLLM plugin: activate from the environment; a refusal is one line.

    A bad setting stops the process now. A vLLM that kvelastic cannot patch (a
    release outside the supported range, a build whose contacts moved) stops
    only the engine, when one starts: ``vllm --version`` and ``vllm --help``
    still answer, which is how a user finds out what is installed.
    """
    try:
        activate()
    except PatchError as error:
        if type(error) is not PatchError:  # a narrower refusal (a rank without its engine core): now
            raise StartupRefused(error) from None
        refuse_at_engine_start(error)  # the gate's: this vLLM cannot be patched
    except KvelasticError as error:
        raise StartupRefused(error) from None


def refuse_at_engine_start(error: KvelasticError) -> None:
    """Stop with ``error`` (one line, exit 1) when an engine starts: at once if one is starting already."""
    import wrapt

    def refuse(module: object) -> None:
        raise StartupRefused(error)

    wrapt.register_post_import_hook(refuse, ENGINE_MODULE)
