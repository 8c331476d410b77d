"""Each declared scheduler-side contact, broken in the real installed vLLM, refuses start-up by name.

``tests/contact_probe.py`` runs in a fresh interpreter (the breakage must not
leak into this one). For every contact the scheduler side declares it removes
or reshapes it (or adds it, where it is declared absent), activates kvelastic,
and reports; each test here reads one case. A control run with nothing broken
shows activation then does wrap vLLM, so the checks of "nothing changed" can
fail.

``--contact-cases=one-per-kind`` (what CI gives the bands older than the newest)
runs the first case of each kind of breakage only: the gate's every refusal path
against that release, at a tenth of the cost; the newest band runs every case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm installed")

from kvelastic.patching.versions import band_of, installed_vllm_version  # noqa: E402
from tests.contact_probe import MARK, Case, cases, kind_of_breakage, one_per_kind  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VERSION = installed_vllm_version()
CASES = cases(VERSION)
TIMEOUT_S = 900
#: The expectation each kind of breakage must be refused with, as the gate words it.
EXPECTED = {"remove": "does not exist", "reshape": "expected parameters", "add": "declared absent",
            "drop": "expected its objects to carry"}


def chosen_cases(config: pytest.Config) -> list[Case]:
    """Every case, or (``--contact-cases=one-per-kind``) the first of each kind of breakage."""
    return one_per_kind(CASES) if config.getoption("contact_cases") == "one-per-kind" else CASES


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", chosen_cases(metafunc.config), ids=lambda case: case.id)


@pytest.fixture(scope="module")
def probe(request, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("contacts") / "probe.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVELASTIC", "VLLM_PLUGINS"))}
    chosen = chosen_cases(request.config)
    wanted = [] if chosen == CASES else [case.id for case in chosen]
    with open(out, "wb") as sink:
        done = subprocess.run([sys.executable, "-m", "tests.contact_probe", *wanted], cwd=REPO, env=env,
                              stdout=sink, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
    text = out.read_text()
    assert done.returncode == 0, text[-4000:]
    results = [json.loads(line[len(MARK):]) for line in text.splitlines() if line.startswith(MARK)]
    return {result["case"]: result for result in results}


def test_the_control_activates_and_deactivating_restores_vllm(probe):
    control = probe["control"]
    assert "error" not in control, control
    assert control["activated"] is True and control["wrapped_while_active"] > 0
    assert control["not_restored"] == [] and control["instance_changes"] == []


def test_every_scheduler_side_contact_has_cases():
    targets = {case.target for case in CASES}
    assert len(targets) >= 25 and all(case.how in EXPECTED for case in CASES)


def test_one_case_per_kind_keeps_every_kind_of_breakage_once():
    kinds = {kind_of_breakage(case) for case in CASES}
    chosen = one_per_kind(CASES)
    assert {kind_of_breakage(case) for case in chosen} == kinds and len(chosen) == len(kinds)
    assert len(kinds) >= 6 and {case.how for case in chosen} == {case.how for case in CASES}


def test_a_broken_contact_refuses_start_up_naming_it_and_leaves_vllm_as_it_was(probe, case: Case):
    result = probe[case.id]
    assert "error" not in result, result
    assert result["effective"], "the probe did not manage to break the contact"
    assert result["activated"] is False
    message = result["message"]
    assert f"vLLM {VERSION}" in message and "nothing was patched" in message
    lines = [line for line in message.splitlines() if line.startswith(f"  - {case.target.path}: ")]
    assert lines, message
    expected = EXPECTED[case.how]
    if case.target.kind == "setter" and case.how == "remove":
        expected = "expected a property with a setter"
    assert any(expected in line and case.attribute in line for line in lines), message
    assert result["changed_by_refusal"] == []  # nothing wrapped or replaced by the refused start-up
    assert result["not_restored"] == []  # the breakage undone, every class and module is as it was
    assert result["instance_changes"] == []  # a scheduler built afterwards is vLLM's own


#: A runner module of the installed release: the V1 runner's where it has one, else the V2 runner's (band D).
RUNNER = ("vllm.v1.worker.gpu_model_runner" if "V1" in band_of(installed_vllm_version()).runners
          else "vllm.v1.worker.gpu.model_runner")


# A module imported after start-up whose live shape differs from its source (another plugin
# patched it): kvelastic undoes what it had applied and the import fails, naming the contact.
LATE = f"""
import json, sys
from kvelastic.startup import activate as activation
from kvelastic.settings import Settings
assert activation.activate(Settings(enabled=True)) is not None
before = sorted(m for m in {{{RUNNER!r}, "vllm.v1.core.sched.scheduler"}} if m in sys.modules)
import importlib, wrapt
runner = importlib.import_module({RUNNER!r})  # imports no scheduler in any release (gpu_worker does from 0.33)
patcher = activation.current().patcher
applied = list(patcher.wrapped)
import vllm.v1.core.block_pool as block_pool
def get_usage(self, window):
    return 0.0
block_pool.BlockPool.get_usage = get_usage
try:
    import vllm.v1.core.sched.scheduler
    outcome = "imported"
except Exception as exc:
    outcome = type(exc).__name__ + ": " + str(exc)
print("{MARK}" + json.dumps({{
    "imported_before": before, "applied": applied, "outcome": outcome,
    "runner_wrapped_after": isinstance(vars(runner.GPUModelRunner)["initialize_kv_cache"], wrapt.FunctionWrapper),
    "wrapped_after": list(patcher.wrapped), "active_after": activation.current() is not None,
}}), flush=True)
"""


def test_a_module_that_differs_from_its_source_when_imported_later_undoes_everything_and_fails_its_import(
        tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVELASTIC", "VLLM_PLUGINS"))}
    done = subprocess.run([sys.executable, "-c", LATE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[-1][len(MARK):])
    assert result["imported_before"] == []  # start-up imported neither module: the late path ran
    assert f"{RUNNER}:GPUModelRunner.initialize_kv_cache" in result["applied"]  # on its import
    outcome = result["outcome"]
    assert outcome.startswith("PatchError") and "vllm.v1.core.block_pool:BlockPool.get_usage" in outcome
    assert "expected parameters ('self',)" in outcome and "differ from their source" in outcome
    assert "every patch was undone" in outcome
    assert result["runner_wrapped_after"] is False and result["wrapped_after"] == []
    assert result["active_after"] is False
