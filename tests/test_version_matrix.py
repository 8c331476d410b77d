"""The version matrix: every supported vLLM release against every patch that claims it.

Each release's Python source is fetched from PyPI once (all in parallel, the
first time) and cached between runs (``KVELASTIC_VLLM_SRC_CACHE``). The check
is static, so no release has to be installed. A patch claims a range of
releases; a release in that range whose target is missing or has other
parameters fails here, so "no patch claims a release where its target is
missing" is the same test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvelastic.errors import PatchError
from kvelastic.scheduler.free_queue import PageAwareFreeQueue
from kvelastic.patches import ALL_PATCHES, single_backing
from kvelastic.scheduler.free_order import ListEnd
from kvelastic.patches.block_pool_queue import FREE_QUEUE_MEMBERS, free_queue_members
from kvelastic.patches.offload_connectors import lazy_walk_members
from kvelastic.patching import gate, source
from kvelastic.patching.spec import Target
from kvelastic.patching.versions import BANDS, FIRST_UNSUPPORTED, OLDEST_SUPPORTED, SUPPORTED, Version, \
    installed_vllm_version
from kvelastic_dev import static_check, vllm_source
from kvelastic_dev.releases import (NEWEST_OLDER_UNSUPPORTED, OLDEST_NEWER_UNSUPPORTED, RELEASES,
                                    release_band)
from kvelastic_dev.remote_zip import SourceFetchError

#: Each runner's KV path: per-layer tensors up to 0.28 (bands A and B), one backing from 0.29 (bands C and D).
V1_PATCHES = {"uniform_kv_cache", "v1_allocate_kv_cache", "v1_initialize_kv_cache"}
V2_PATCHES = {"v2_allocate_kv_cache", "v2_initialize_kv_cache"}
ONE_BACKING_BY_RUNNER = {"V1": "v1_single_backing", "V2": "v2_single_backing"}
ONE_BACKING = {*ONE_BACKING_BY_RUNNER.values(), "kv_layout_preference", "whole_page_num_blocks"}
EVERY_RELEASE = {"worker_capacity", "worker_execute_model", "executor_step_report", "executor_handover",
                 "scheduler_block_pool", "sleep_mode"}
#: What only some releases need: 0.19.0-0.20.1's admission check (tested on its own below), the refusal of
#: what arrived later (HiSparse in 0.30), vLLM's logging set up at activation (0.31+ configures it only when
#: an engine starts), the engine loop's wake-up (0.18+), vLLM's own extensible KV cache turned off and its
#: warm-up's blocks mapped (0.34+).
SOME_RELEASES = {"admission_check", "hisparse_refusal", "vllm_logging",
                 "engine_core_wake", "extensible_kv_cache", "warmup_blocks"}
BY_NAME = {patch.name: patch for patch in ALL_PATCHES}


def _claimed_names(version: Version) -> list[str]:
    return [patch.name for patch in ALL_PATCHES if patch.claims(version)]


def _claimed_by(name: str) -> tuple[str, ...]:
    return tuple(r for r in RELEASES if BY_NAME[name].claims(Version.parse(r)))


@pytest.fixture(scope="session")
def sources() -> dict[str, Path | SourceFetchError]:
    """Every listed release, fetched in parallel threads."""
    return vllm_source.fetch_all(RELEASES)


def _source(sources: dict[str, Path | SourceFetchError], release: str) -> Path:
    result = sources[release]
    if isinstance(result, SourceFetchError):
        pytest.fail(f"vLLM {release}'s source could not be fetched: {result}")
    return result


def test_releases_are_the_supported_final_releases_in_order() -> None:
    versions = [Version.parse(r) for r in RELEASES]
    assert versions == sorted(set(versions)), "listed twice or out of order"
    assert all(str(v) == r for v, r in zip(versions, RELEASES)), "only plain X.Y.Z releases"
    assert all(v in SUPPORTED for v in versions)
    assert RELEASES[0] == str(SUPPORTED.low)
    assert {release_band(r) for r in RELEASES} == {band.name for band in BANDS}
    with pytest.raises(ValueError):
        release_band(OLDEST_NEWER_UNSUPPORTED)


def test_readme_support_table_lists_every_release_with_its_band() -> None:
    """The README's table is what users read: it must not miss a release or name a wrong band."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("## vLLM support"):].split("\n\n")[2]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1]
    listed = {r: b for r, b in rows.items() if r[0].isdigit() and "later" not in r}
    assert listed == {r: release_band(r) for r in RELEASES}


def _band_has(release: str, runner: str) -> bool:
    return runner in next(band for band in BANDS if band.name == release_band(release)).runners


def test_runner_paths_are_patched_whole_or_not_at_all() -> None:
    """A release never gets half of the V1 (or V2) runner patched, each release gets exactly one way of
    allocating per runner it has (the V1 runner is gone from band D), and the shared patches claim all."""
    assert set(BY_NAME) == V1_PATCHES | V2_PATCHES | ONE_BACKING | EVERY_RELEASE | SOME_RELEASES
    per_layer = {_claimed_by(name) for name in V1_PATCHES | V2_PATCHES}
    assert len(per_layer) == 1, per_layer
    (per_layer_releases,) = per_layer
    assert [r for r in RELEASES if release_band(r) in "AB"] == list(per_layer_releases)
    one_backing = {name: _claimed_by(name) for name in ONE_BACKING}
    assert one_backing["kv_layout_preference"] == one_backing["whole_page_num_blocks"] \
        == tuple(r for r in RELEASES if release_band(r) in "CD")
    for runner, name in ONE_BACKING_BY_RUNNER.items():
        assert one_backing[name] == tuple(r for r in RELEASES if release_band(r) in "CD" and _band_has(r, runner))
    for name in EVERY_RELEASE:
        assert _claimed_by(name) == RELEASES, f"{name} does not claim every supported release"


def test_a_band_without_the_v1_runner_declares_it_absent() -> None:
    """Band D has the V2 runner alone: its runner class, method and allocator name are declared gone."""
    from kvelastic.patches import v1_initialize_kv_cache, v1_single_backing
    from kvelastic.patches.kv_cache_objects import V1_RUNNER, V2_RUNNER

    assert {runner for band in BANDS for runner in band.runners} == {"V1", "V2"}
    assert all("V2" in band.runners for band in BANDS)
    for release in RELEASES:
        version = Version.parse(release)
        has_v1 = _band_has(release, "V1")
        for target in (V1_RUNNER, v1_initialize_kv_cache.TARGET):
            assert target.exists_in(version) == has_v1, (target.path, release)
        assert V2_RUNNER.exists_in(version)
        one_backing_v1 = has_v1 and release_band(release) == "C"
        assert BY_NAME["v1_single_backing"].claims(version) == one_backing_v1
        if release_band(release) in "CD":
            assert v1_single_backing.ALLOCATE.exists_in(version) == one_backing_v1


def test_every_contact_declares_its_shape_in_every_release_its_patch_claims() -> None:
    missing = [f"{patch.name} {target.path} {release}" for release in RELEASES for patch in ALL_PATCHES
               if patch.claims(Version.parse(release)) for target in patch.targets
               if target.shape(Version.parse(release)) is None]
    assert missing == []


def test_the_supported_range_is_written_once_and_pyproject_agrees() -> None:
    """pyproject cannot import the constant: its vllm extra must match it, and nothing else spells it."""
    root = Path(__file__).resolve().parents[1]
    assert f'"vllm>={OLDEST_SUPPORTED},<{FIRST_UNSUPPORTED}"' in (root / "pyproject.toml").read_text()
    spelled = [str(path.relative_to(root)) for folder in ("kvelastic", "patches")
               for path in sorted((root / folder).rglob("*.py"))
               if f'"{FIRST_UNSUPPORTED}"' in path.read_text() and path.name != "versions.py"]
    assert spelled == []


@pytest.mark.matrix
@pytest.mark.parametrize("release", RELEASES)
def test_release_source_matches_every_patch_claiming_it(sources: dict, release: str) -> None:
    problems = source.check_release(_source(sources, release), Version.parse(release), ALL_PATCHES)
    assert problems == [], f"vLLM {release} (band {release_band(release)}):\n" + "\n".join(problems)


@pytest.mark.matrix
@pytest.mark.parametrize("release", RELEASES)
def test_page_aware_queue_offers_what_the_block_pool_uses(sources: dict, release: str) -> None:
    """The scheduler patch swaps BlockPool.free_block_queue; vLLM must find every member it uses."""
    used = static_check.attributes_used_on(_source(sources, release), "vllm.v1.core", "free_block_queue")
    assert {"popleft_n", "append_n"} <= used, "the scan found no use of the free queue"
    assert used == set(free_queue_members(Version.parse(release))), "patches/block_pool_queue.py is out of date"


@pytest.mark.matrix
@pytest.mark.parametrize("release", RELEASES)
def test_page_aware_queue_offers_what_lazy_offload_walks(sources: dict, release: str) -> None:
    """SimpleCPUOffloadConnector's lazy mode walks the GPU free queue itself; kvelastic replaced that queue."""
    root = _source(sources, release)
    used = static_check.attributes_used_on_name(root, "vllm.v1.simple_kv_offload", "free_queue")
    assert used == set(lazy_walk_members(Version.parse(release))), "patches/offload_connectors.py is out of date"
    on_nodes = static_check.attributes_used_on_name(root, "vllm.v1.simple_kv_offload", "node")
    assert on_nodes <= {name for name in dir(ListEnd) if not name.startswith("_")} | {"next_free_block"}


def test_page_aware_queue_offers_every_declared_free_queue_member() -> None:
    for _, members in FREE_QUEUE_MEMBERS:
        assert sorted(name for name in members if not hasattr(PageAwareFreeQueue, name)) == []


def _estimates(root: Path) -> list[tuple[str, bool]]:
    """(enclosing function, passes ``apply_admission_cap=True``) of every ``coordinator.get_num_blocks_to_allocate``
    call in ``vllm/v1/core``."""
    import ast

    found = []
    for path in sorted((root / "vllm" / "v1" / "core").rglob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr == "get_num_blocks_to_allocate" \
                        and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "coordinator":
                    flagged = any(k.arg == "apply_admission_cap" and isinstance(k.value, ast.Constant)
                                  and k.value.value is True for k in node.keywords)
                    found.append((function.name, flagged))
    return found


@pytest.mark.matrix
@pytest.mark.parametrize("release", RELEASES)
def test_only_the_allocations_estimate_maps_and_admission_checks_are_told_apart(sources: dict, release: str) -> None:
    """The commit guard maps on every unflagged estimate: each must be the one allocate_slots acts on.

    Admission checks (whole sequence, nothing allocated) pass apply_admission_cap=True, or are
    0.19.0-0.20.1's can_fit_full_sequence, which the admission_check patch claims exactly there.
    """
    calls = _estimates(_source(sources, release))
    unflagged = [name for name, flagged in calls if not flagged]
    assert unflagged.count("allocate_slots") == 1, calls
    assert set(unflagged) <= {"allocate_slots", "can_fit_full_sequence"}, calls
    assert BY_NAME["admission_check"].claims(Version.parse(release)) == ("can_fit_full_sequence" in unflagged)


def _takes_hook(release: str) -> bool:
    return single_backing.ALLOCATE_HOOK in single_backing.ALLOCATOR.shape(Version.parse(release)).params


@pytest.mark.matrix
@pytest.mark.parametrize("release", [r for r in RELEASES if BY_NAME["v2_single_backing"].claims(Version.parse(r))
                                     and not _takes_hook(r)])
def test_the_one_backing_is_a_single_int8_torch_zeros(sources: dict, release: str) -> None:
    """What the band-C stand-in for ``torch`` serves (``patches/single_backing.py``): vLLM's allocator makes
    exactly one ``torch.zeros(size, dtype=torch.int8, device=...)`` and calls nothing else of torch."""
    import ast

    allocator = single_backing.ALLOCATOR
    (zeros,) = static_check.torch_calls(_source(sources, release), allocator.module, allocator.qualname)
    assert zeros.func.attr == "zeros" and len(zeros.args) == 1
    assert {k.arg: ast.unparse(k.value) for k in zeros.keywords if k.arg == "dtype"} == {"dtype": "torch.int8"}
    assert {k.arg for k in zeros.keywords} == {"dtype", "device"}


@pytest.mark.matrix
@pytest.mark.parametrize("release", [r for r in RELEASES if BY_NAME["v2_single_backing"].claims(Version.parse(r))
                                     and _takes_hook(r)])
def test_the_one_backing_comes_from_the_allocate_hook_alone(sources: dict, release: str) -> None:
    """Band D: what kvelastic's ``allocate`` hook serves. With a hook given, vLLM's allocator calls it once, with
    the one size, and calls nothing of torch itself (its ``torch.zeros`` moved to another function)."""
    allocator = single_backing.ALLOCATOR
    root = _source(sources, release)
    assert static_check.torch_calls(root, allocator.module, allocator.qualname) == []
    (call,) = static_check.calls_of_name(root, allocator.module, allocator.qualname, single_backing.ALLOCATE_HOOK)
    assert len(call.args) == 1 and not call.keywords


@pytest.mark.parametrize("release", [NEWEST_OLDER_UNSUPPORTED, OLDEST_NEWER_UNSUPPORTED, "0.35.1", "1.0.0"])
def test_releases_outside_supported_are_refused(release: str) -> None:
    version = Version.parse(release)
    with pytest.raises(PatchError) as refused:
        gate.check(ALL_PATCHES, version)
    message = str(refused.value)
    assert f"vLLM {version} is not supported" in message and "KVELASTIC=0" in message
    assert f'pip install "vllm>={OLDEST_SUPPORTED},<{FIRST_UNSUPPORTED}"' in message and "README" in message
    assert "docs/" not in message  # the docs folder is not in the wheel
    if version >= SUPPORTED.high:
        assert f"every vLLM release before {FIRST_UNSUPPORTED}" in message
    else:
        assert str(SUPPORTED) in message
    assert static_check.refusal(version) == message
    assert static_check.refusal(Version.parse(RELEASES[-1])) is None


def test_the_newest_listed_release_is_the_last_one_supported() -> None:
    """Raising FIRST_UNSUPPORTED without listing (and so checking) the releases below it is caught here."""
    newest = Version.parse(RELEASES[-1])
    assert (newest.major, newest.minor + 1) == (SUPPORTED.high.major, SUPPORTED.high.minor)


@pytest.mark.matrix
def test_band_c_starts_where_every_layer_moved_into_one_backing(sources: dict) -> None:
    """Band C's first release has no use_uniform_kv_cache and one allocator; the release before has both ways."""
    first_c = next(r for r in RELEASES if release_band(r) == "C")
    last_b = RELEASES[RELEASES.index(first_c) - 1]
    uniform = BY_NAME["uniform_kv_cache"].targets[0]
    allocator = Target("vllm.v1.worker.utils", "allocate_kv_cache", ())
    with pytest.raises(source.StaticLookupError):
        source.find(_source(sources, first_c), uniform)
    assert source.find(_source(sources, first_c), allocator).params[:2] == ("kv_cache_config", "device")
    source.find(_source(sources, last_b), uniform)
    with pytest.raises(source.StaticLookupError):
        source.find(_source(sources, last_b), allocator)


@pytest.mark.vllm
def test_static_check_agrees_with_the_import_gate_on_installed_vllm() -> None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    root = Path(next(iter(spec.submodule_search_locations))).parent
    version = installed_vllm_version()
    for patch in ALL_PATCHES:
        for target in patch.targets:
            if not patch.claims(version):  # another band's contact: both ways of looking agree it is (not) there
                try:
                    present = bool(source.find(root, target))
                except source.StaticLookupError:
                    present = False
                assert present == (not isinstance(gate.found(target), LookupError)), target.path
                continue
            assert source.check_target(root, target, version) == gate.check_target(target, version)
            if not target.exists_in(version):
                continue
            set_in = getattr(target.shape(version), "set_in", ("__init__",))
            found, live = source.find(root, target, set_in), gate.found(target, set_in)
            if target.kind == "class":  # the live class also has dunders the source does not spell
                assert set(target.shape(version).names) <= found.attributes & live.attributes
                assert found.attributes <= live.attributes
            else:
                assert found == live
    if version in SUPPORTED:
        assert source.check_release(root, version, ALL_PATCHES) == []
        assert {p.name for p in gate.check(ALL_PATCHES, version).patches} == set(_claimed_names(version))
