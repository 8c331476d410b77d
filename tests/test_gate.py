"""The version gate and all-or-nothing patching, against the real installed vLLM."""

from __future__ import annotations

import inspect
import logging

import pytest

pytest.importorskip("vllm", reason="needs vllm installed")
wrapt = pytest.importorskip("wrapt")

from kvelastic.errors import PatchError  # noqa: E402
from kvelastic.startup import activate as activation  # noqa: E402
from kvelastic.startup.runtime import Runtime  # noqa: E402
from kvelastic.patches import ALL_PATCHES, uniform_kv_cache, worker_capacity, worker_execute_model  # noqa: E402
from kvelastic.patches._common import ALL  # noqa: E402
from kvelastic.patching import gate  # noqa: E402
from kvelastic.patching.apply import Patcher  # noqa: E402
from kvelastic.patching.on_import import ImportApplier  # noqa: E402
from kvelastic.patching.spec import Patch, Signature, Target  # noqa: E402
from kvelastic.patching.versions import SUPPORTED, Version, VersionRange, band_of, installed_vllm_version  # noqa: E402
from kvelastic.settings import Settings  # noqa: E402

#: A contact every supported release has with the same parameters: the subject of the refusal tests.
EXECUTE_MODEL = "vllm.v1.worker.gpu_worker:Worker.execute_model"
REAL_PARAMS = ("self", "scheduler_output")
#: The patches the installed release claims (each band has its own KV path; some patches claim a few releases).
CLAIMED = tuple(patch for patch in ALL_PATCHES if patch.claims(installed_vllm_version()))


@pytest.fixture(autouse=True)
def no_leaked_patches():
    activation.deactivate()
    yield
    activation.deactivate()



def all_targets(patches=CLAIMED):
    return list(dict.fromkeys(target for patch in patches for target in patch.targets))


def present_targets(patches=CLAIMED):
    """The targets the installed release has (those declared absent in it cannot be resolved)."""
    return [target for target in all_targets(patches) if target.exists_in(installed_vllm_version())]


def raw(target: Target):
    return gate.resolve(target)[1]


def originals(patches=CLAIMED):
    return {target.path: raw(target) for target in present_targets(patches)}


def assert_untouched(before: dict) -> None:
    for path, original in before.items():
        module, qualname = path.split(":")
        now = gate.resolve(Target(module, qualname, ()))[1]
        assert now is original, f"{path} was changed"
        assert not isinstance(now, wrapt.FunctionWrapper), f"{path} is still wrapped"


class Recorder:
    """A patch ``apply`` that only notes it was called."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, patcher, runtime) -> None:
        self.calls += 1


def wrong_patch(apply=None) -> Patch:
    target = Target("vllm.v1.worker.gpu_worker", "Worker.execute_model", (Signature(ALL, ("self",)),), kind="method")
    return Patch("stale_execute_model", "written against another vLLM", ALL, (target,), apply or Recorder())


# ----------------------------------------------------------------------- gate
def test_installed_version_is_read_without_importing_vllm_and_is_supported():
    import vllm

    version = installed_vllm_version()
    assert version == Version.parse(vllm.__version__)
    assert version in SUPPORTED
    assert band_of(version) is not None


def test_installed_vllm_passes_the_gate_and_claims_every_patch_written_for_it():
    version = installed_vllm_version()
    result = gate.check(ALL_PATCHES, version)
    assert len(ALL_PATCHES) == 21
    assert result.patches == CLAIMED
    names = {p.name for p in CLAIMED}
    one_backing = version >= Version(0, 29)
    assert {"worker_capacity", "worker_execute_model", "executor_step_report", "executor_handover",
            "scheduler_block_pool"} <= names
    runners = ("v2",) if version >= Version(0, 34) else ("v1", "v2")  # 0.34 removed the V1 runner
    for runner in runners:  # each runner's KV path exactly once: per-layer tensors, or the one backing
        assert (f"{runner}_allocate_kv_cache" in names, f"{runner}_single_backing" in names) == \
            (not one_backing, one_backing)
    assert not {n for n in names if n.startswith("v1_")} or "v1" in runners
    assert result.version == version
    assert result.band == band_of(version).name
    newest = "D" if version >= Version(0, 34) else "C"
    assert result.band == (newest if one_backing else "B" if version >= Version(0, 24) else "A")


def test_patch_names_are_unique():
    names = [patch.name for patch in ALL_PATCHES]
    assert len(set(names)) == len(names) == 21


def _named(function, name: str) -> bool:
    """``function`` is ``name``: by its own name, or (a decorator that did not copy it over, as vLLM 0.27+'s
    ``fault_tolerant_wrapper`` on ``EngineCoreProc.run_busy_loop``) the function its closure holds."""
    if function.__name__ == name:
        return True
    return any(inspect.isfunction(cell.cell_contents) and cell.cell_contents.__name__ == name
               for cell in function.__closure__ or ())


@pytest.mark.parametrize("target", present_targets(), ids=lambda t: t.path)
def test_every_present_target_resolves_to_what_it_declares(target):
    owner, value = gate.resolve(target)
    version = installed_vllm_version()
    assert gate.check_target(target, version) is None
    if target.kind == "class":
        assert inspect.isclass(value) and value.__name__ == target.qualname.split(".")[-1]
        shape = target.shape(version)
        assert set(shape.names) <= gate.class_attributes(value, shape.set_in)
        return
    if target.kind == "setter":
        assert isinstance(value, property) and value.fset is not None
        function = value.fset
    else:
        function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    assert inspect.isfunction(function), f"{target.path} is a {type(value).__name__}"
    assert _named(function, target.qualname.split(".")[-1])
    if target.kind == "staticmethod":
        assert isinstance(value, staticmethod)
    if target.kind in ("method", "staticmethod", "setter"):
        assert inspect.isclass(owner)
        assert owner.__name__ == target.qualname.split(".")[0]
    else:
        assert inspect.ismodule(owner) and owner.__name__ == target.module
    assert tuple(inspect.signature(function).parameters) == target.shape(version).params


@pytest.mark.parametrize("target", [t for t in all_targets() if not t.exists_in(installed_vllm_version())],
                         ids=lambda t: t.path)
def test_targets_declared_absent_are_checked_absent(target):
    assert gate.check_target(target, installed_vllm_version()) is None
    assert not target.exists_in(installed_vllm_version())


@pytest.mark.parametrize("text", ["0.11.0", "0.11.9", "0.1.0"])
def test_older_versions_are_refused(text):
    with pytest.raises(PatchError) as info:
        gate.check(ALL_PATCHES, Version.parse(text))
    message = str(info.value)
    assert f"vLLM {text} is not supported" in message
    assert str(SUPPORTED) in message
    assert "KVELASTIC=0" in message


_FIRST_OUT = SUPPORTED.high  # the first release kvelastic has not checked
_NEWER = [f"{_FIRST_OUT.major}.{_FIRST_OUT.minor}.0", f"{_FIRST_OUT.major}.{_FIRST_OUT.minor}.1",
          f"{_FIRST_OUT.major}.{_FIRST_OUT.minor + 1}.0", "1.0.0"]


@pytest.mark.parametrize("text", _NEWER)
def test_newer_versions_are_refused_until_checked(text):
    with pytest.raises(PatchError) as info:
        gate.check(ALL_PATCHES, Version.parse(text))
    message = str(info.value)
    assert f"vLLM {text} is not supported" in message
    assert f"release before {SUPPORTED.high.major}.{SUPPORTED.high.minor}" in message
    assert 'pip install "vllm>=' in message and "README" in message  # the fix, and a document the wheel carries
    assert "KVELASTIC=0" in message


def test_wrong_parameters_are_reported_with_path_and_both_signatures_and_nothing_applies():
    good = Recorder()
    stale = Recorder()
    before = originals()
    patches = [Patch("fine", "real target", ALL, worker_capacity.PATCH.targets, good), wrong_patch(stale)]
    with pytest.raises(PatchError) as info:
        gate.check(patches, installed_vllm_version())
    message = str(info.value)
    assert EXECUTE_MODEL in message
    assert "expected parameters ('self',)" in message
    assert f"found {REAL_PARAMS}" in message
    assert "nothing was patched" in message
    assert good.calls == 0 and stale.calls == 0
    assert_untouched(before)


def test_every_problem_is_reported_at_once():
    version = installed_vllm_version()
    missing_method = Target("vllm.v1.worker.gpu_worker", "Worker._no_such_method",
                            (Signature(ALL, ("self",)),), kind="method")
    missing_module = Target("vllm.v1.no_such_module", "anything", (Signature(ALL, ()),))
    unsigned = Target("vllm.v1.worker.gpu_worker", "Worker.execute_model",
                      (Signature(VersionRange.of("0.12", "0.13"), REAL_PARAMS),), kind="method")
    not_static = Target("vllm.v1.worker.gpu_worker", "Worker.determine_available_memory",
                        (Signature(ALL, ("self",)),), kind="staticmethod")
    patch = Patch("many", "four problems", ALL, (missing_method, missing_module, unsigned, not_static), Recorder())
    with pytest.raises(PatchError) as info:
        gate.check([patch], version)
    message = str(info.value)
    assert "Worker._no_such_method does not exist" in message
    assert "vllm.v1.no_such_module cannot be imported" in message
    assert f"kvelastic declares nothing for vLLM {version}" in message
    assert "expected a staticmethod, found a function" in message
    assert message.count("\n  - ") == 4


def test_patches_that_do_not_claim_the_version_are_neither_checked_nor_chosen():
    version = installed_vllm_version()
    old_only = Patch("old", "older releases only", VersionRange.of("0.12", "0.13"),
                     (Target("vllm.v1.no_such_module", "gone", (Signature(ALL, ()),)),), Recorder())
    result = gate.check([*ALL_PATCHES, old_only], version)
    assert old_only not in result.patches
    assert result.patches == CLAIMED


# ------------------------------------------------------------------ apply_all
def apply_all(result, runtime) -> Patcher:
    """Every cleared patch applied at once, as activation does when their modules are imported already."""
    patcher = Patcher.for_gate(result)
    ImportApplier(result, runtime, patcher).start()
    return patcher


#: Patches that wrap on classes or modules, among them a staticmethod where the release has one.
SUBJECTS = [p for p in (uniform_kv_cache.PATCH, worker_capacity.PATCH, worker_execute_model.PATCH) if p in CLAIMED]


def test_apply_all_undoes_earlier_patches_when_a_later_one_fails():
    runtime = Runtime(Settings(enabled=True))
    first = SUBJECTS
    before = originals(first)
    seen_during_apply: dict = {}

    def explode(patcher, runtime_):
        seen_during_apply.update({t.path: raw(t) for t in all_targets(first) if t.use == "wrap"})
        raise RuntimeError("target moved")

    boom = Patch("boom", "fails while applying", ALL, (), explode)
    with pytest.raises(PatchError) as info:
        apply_all(gate.check([*first, boom], installed_vllm_version()), runtime)
    message = str(info.value)
    assert "'boom'" in message and "target moved" in message and "undone" in message
    assert isinstance(info.value.__cause__, RuntimeError)
    # the earlier patches really were applied before the failure ...
    assert all(isinstance(value, wrapt.FunctionWrapper) for value in seen_during_apply.values())
    assert set(seen_during_apply) == {t.path for t in all_targets(first) if t.use == "wrap"}
    # ... and afterwards every target is the very object it was before
    assert_untouched(before)
    if uniform_kv_cache.PATCH in first:
        assert isinstance(raw(uniform_kv_cache.TARGET), staticmethod)


def test_apply_all_wraps_and_revert_restores_identity():
    runtime = Runtime(Settings(enabled=True))
    before = originals(SUBJECTS)
    patcher = apply_all(gate.check(SUBJECTS, installed_vllm_version()), runtime)
    assert patcher.wrapped == [t.path for p in SUBJECTS for t in p.targets if t.use == "wrap"]
    from vllm.v1.worker.gpu_worker import Worker

    assert isinstance(vars(Worker)["execute_model"], wrapt.FunctionWrapper)
    if uniform_kv_cache.PATCH in SUBJECTS:  # per-layer KV tensors (up to 0.28): a wrapped staticmethod
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        assert KVConnectorModelRunnerMixin.use_uniform_kv_cache(object()) is False
    patcher.revert()
    assert patcher.wrapped == []
    assert_untouched(before)


# ------------------------------------------------------------------- activate
def test_activate_with_everything_real_wraps_every_target_and_deactivate_restores_them():
    before = originals()
    result = activation.activate(Settings(enabled=True))
    assert result is not None and activation.current() is result
    assert result.version == installed_vllm_version()
    assert result.band == band_of(result.version).name
    wrapped = {t.path for p in CLAIMED for t in p.targets if t.use == "wrap" and t.exists_in(result.version)}
    assert set(result.patcher.wrapped) == wrapped
    for path in wrapped:
        module, qualname = path.split(":")
        assert isinstance(gate.resolve(Target(module, qualname, ()))[1], wrapt.FunctionWrapper), path
    assert raw(Target("vllm.v1.core.block_pool", "BlockPool._maybe_evict_cached_block", ())) is \
        before["vllm.v1.core.block_pool:BlockPool._maybe_evict_cached_block"]
    assert activation.activate(Settings(enabled=True)) is result  # the second entry point finds it done
    activation.deactivate()
    assert activation.current() is None
    assert_untouched(before)


def test_activate_when_disabled_does_nothing():
    before = originals()
    assert activation.activate(Settings(enabled=False)) is None
    assert activation.current() is None
    assert_untouched(before)


def test_non_strict_activation_with_a_bad_patch_warns_and_leaves_vllm_untouched(kv_log):
    before = originals()
    good = Recorder()
    patches = [Patch("fine", "real target", ALL, worker_capacity.PATCH.targets, good), wrong_patch()]
    assert activation.activate(Settings(enabled=True, strict=False), patches=patches) is None
    assert activation.current() is None
    assert good.calls == 0
    assert_untouched(before)
    warnings = [r for r in kv_log.records if r.levelno == logging.WARNING and r.name == "vllm.kvelastic"]
    assert warnings, "no warning was logged"
    text = warnings[0].getMessage()
    assert EXECUTE_MODEL in text and "KVELASTIC_STRICT=0" in text and "without kvelastic" in text
    # a failed activation is not retried by the other entry point
    assert activation.activate(Settings(enabled=True, strict=False)) is None
    assert_untouched(before)


def test_strict_activation_with_a_bad_patch_raises_and_leaves_vllm_untouched():
    before = originals()
    with pytest.raises(PatchError, match="expected parameters"):
        activation.activate(Settings(enabled=True, strict=True), patches=[*ALL_PATCHES, wrong_patch()])
    assert activation.current() is None
    assert_untouched(before)


@pytest.mark.parametrize("text", ["0.11.0", _NEWER[0]])
def test_unsupported_version_strict_raises_and_lenient_warns(text, kv_log):
    before = originals()
    with pytest.raises(PatchError, match="not supported"):
        activation.activate(Settings(enabled=True), version=Version.parse(text))
    activation.deactivate()
    assert activation.activate(Settings(enabled=True, strict=False), version=Version.parse(text)) is None
    assert any("not supported" in r.getMessage() for r in kv_log.records if r.levelno == logging.WARNING)
    assert_untouched(before)


def test_failure_while_applying_during_activation_is_all_or_nothing():
    before = originals()

    def explode(patcher, runtime):
        raise RuntimeError("target moved")

    boom = Patch("boom", "fails while applying", ALL, (), explode)
    with pytest.raises(PatchError, match="boom"):
        activation.activate(Settings(enabled=True), patches=[*ALL_PATCHES, boom])
    assert activation.current() is None
    assert_untouched(before)
