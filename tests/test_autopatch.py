"""How kvelastic switches itself on: the .pth hook and vLLM's plugin entry point (the wheel: test_packaging).

The hook tests run fresh interpreters with a clean environment, because the
``.pth`` line runs at interpreter start. The interpreters are started together
(they spend most of their time importing vLLM) and each test waits for its own.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import site
import subprocess
import sys
from pathlib import Path

from kvelastic.patches import ALL_PATCHES
from kvelastic.patching.on_import import trigger_modules
from kvelastic.patching.versions import band_of, installed_vllm_version

import pytest

pytest.importorskip("vllm", reason="needs vllm installed")

from kvelastic.startup import activate as activation  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PTH = "kvelastic-autopatch.pth"
TIMEOUT_S = 300
MARK = "KVELASTIC-TEST-RESULT:"


def _wrapped_targets() -> int:
    """Functions the patches claiming the installed release wrap (instance-level and read-only targets aside)."""
    version = installed_vllm_version()
    return sum(t.use == "wrap" and t.exists_in(version) for p in ALL_PATCHES if p.claims(version) for t in p.targets)


def pth_line() -> str:
    """The hook line, from its one definition (``kvelastic/switch.py``, which setup.py writes out)."""
    from kvelastic.switch import pth_line as line

    return line()


#: The modules whose import applies a patch claimed by the installed release.
TRIGGERS = sorted({m for p in ALL_PATCHES if p.claims(installed_vllm_version()) for m in trigger_modules(p)})
#: The runner whose ``initialize_kv_cache`` these tests watch: the V1 runner where the installed release has it
#: (the V2 runner's module imports more of vLLM), else the V2 runner (band D).
RUNNER = ("vllm.v1.worker.gpu_model_runner" if "V1" in band_of(installed_vllm_version()).runners
          else "vllm.v1.worker.gpu.model_runner")

PROBE = f"""
import importlib, json, sys, types
import vllm
loaded_after_vllm = sorted(m for m in sys.modules if m == "kvelastic" or m.startswith("kvelastic."))
vllm_after_import = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
import wrapt
v1 = importlib.import_module({RUNNER!r})
import vllm.v1.worker.gpu.model_runner as v2
for module in {TRIGGERS!r}:
    importlib.import_module(module)
result = {{
    "loaded_after_vllm": loaded_after_vllm,
    "vllm_after_import": vllm_after_import,
    "v1_type": type(vars(v1.GPUModelRunner)["initialize_kv_cache"]).__name__,
    "v1_wrapped": isinstance(vars(v1.GPUModelRunner)["initialize_kv_cache"], wrapt.FunctionWrapper),
    "v1_plain": type(vars(v1.GPUModelRunner)["initialize_kv_cache"]) is types.FunctionType,
    "v2_wrapped": isinstance(vars(v2.GPUModelRunner)["initialize_kv_cache"], wrapt.FunctionWrapper),
    "loaded_at_end": "kvelastic" in sys.modules,
}}
if "kvelastic" in sys.modules:
    from kvelastic.startup.activate import current
    active = current()
    result["active"] = active is not None
    result["patches"] = list(active.patcher.wrapped) if active else []
print("{MARK}" + json.dumps(result), flush=True)
"""

# KVELASTIC=0 takes the same path through the .pth as no KVELASTIC at all; importing vLLM is enough.
PROBE_IMPORT_ONLY = f"""
import json, sys
import vllm
loaded = sorted(m for m in sys.modules if m == "kvelastic" or m.startswith("kvelastic."))
print("{MARK}" + json.dumps({{"loaded_after_vllm": loaded}}), flush=True)
"""


def clean_env(tmp: Path, **extra: str) -> dict[str, str]:
    """No inherited KVELASTIC_*, VLLM_* or PYTHON* variables: only what a fresh shell would have."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp), "TMPDIR": str(tmp),
           "LANG": "C.UTF-8"}
    env.update(extra)
    return env


class Launched:
    """One interpreter started in the background; output goes to files so no pipe can fill up."""

    def __init__(self, tmp: Path, name: str, code: str, env: dict[str, str]):
        self.stdout_path = tmp / f"{name}.out"
        self.stderr_path = tmp / f"{name}.err"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp,
                                            stdout=out, stderr=err)

    def finish(self) -> tuple[int, str, str]:
        try:
            code = self.process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        return code, self.stdout_path.read_text(), self.stderr_path.read_text()

    def result(self) -> dict:
        code, out, err = self.finish()
        assert code == 0, f"interpreter failed ({code}):\n{out[-3000:]}\n{err[-3000:]}"
        lines = [line for line in out.splitlines() if line.startswith(MARK)]
        assert lines, f"no result printed:\n{out[-3000:]}\n{err[-3000:]}"
        return json.loads(lines[-1][len(MARK):])


@pytest.fixture(scope="module", autouse=True)
def interpreters(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("autopatch")
    launched = {
        "on": Launched(tmp, "on", PROBE, clean_env(tmp, KVELASTIC="1")),
        "unset": Launched(tmp, "unset", PROBE, clean_env(tmp)),
        "zero": Launched(tmp, "zero", PROBE_IMPORT_ONLY, clean_env(tmp, KVELASTIC="0")),
        "banana": Launched(tmp, "banana", "print('still alive')", clean_env(tmp, KVELASTIC="banana")),
    }
    yield launched
    for one in launched.values():
        if one.process.poll() is None:
            one.process.kill()
            one.process.wait()


@pytest.fixture
def no_leaked_patches():
    activation.deactivate()
    yield
    activation.deactivate()


# ------------------------------------------------------------ installed hook
def test_the_pth_hook_is_installed_in_site_packages():
    dirs = [Path(d) for d in site.getsitepackages()]
    found = [d / PTH for d in dirs if (d / PTH).is_file()]
    assert found, f"{PTH} is in none of {dirs}: reinstall kvelastic (pip install -e .)"
    installed = found[0].read_text().strip()
    assert installed == pth_line().strip(), "the installed hook is stale: reinstall kvelastic"
    assert installed.count("\n") == 0, "a .pth runs only single lines that start with 'import'"
    assert installed.startswith("import ")


@pytest.mark.parametrize("value, calls", [
    ("1", 1), ("true", 1), ("TRUE", 1), (" yes ", 1), ("on", 1), ("banana", 1),
    (None, 0), ("", 0), ("0", 0), ("false", 0), ("no", 0), (" OFF ", 0),
])
def test_the_pth_line_hands_every_value_but_off_to_the_autopatch(monkeypatch, value, calls):
    """The cheap pre-check in the .pth must never skip a value that is on (or garbage worth reporting)."""
    import kvelastic._autopatch as autopatch

    seen: list[bool] = []
    monkeypatch.setattr(autopatch, "install_if_enabled", lambda: seen.append(True))
    if value is None:
        monkeypatch.delenv("KVELASTIC", raising=False)
    else:
        monkeypatch.setenv("KVELASTIC", value)
    exec(pth_line(), {})  # noqa: S102 - our own one-line hook, run as site.py would
    assert len(seen) == calls
    if calls and value != "banana":
        assert autopatch.enabled() is True
    elif not calls:
        assert autopatch.enabled() is False


# ------------------------------------------------------------------- plugin
def test_vllm_general_plugins_entry_point_names_register():
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [point for point in points if point.name == "kvelastic"]
    assert len(ours) == 1
    assert ours[0].value == "kvelastic.plugin:register"
    from kvelastic.plugin import register

    assert ours[0].load() is register


def test_vllm_discovers_the_plugin(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    from vllm.plugins import load_plugins_by_group

    from kvelastic.plugin import register

    assert load_plugins_by_group("vllm.general_plugins").get("kvelastic") is register


@pytest.mark.parametrize("value", [None, "0", "off"])
def test_register_does_nothing_when_kvelastic_is_off(monkeypatch, no_leaked_patches, value):
    import wrapt

    gpu_model_runner = importlib.import_module(RUNNER)
    if value is None:
        monkeypatch.delenv("KVELASTIC", raising=False)
    else:
        monkeypatch.setenv("KVELASTIC", value)
    before = vars(gpu_model_runner.GPUModelRunner)["initialize_kv_cache"]
    from kvelastic.plugin import register

    assert register() is None
    assert activation.current() is None
    after = vars(gpu_model_runner.GPUModelRunner)["initialize_kv_cache"]
    assert after is before and not isinstance(after, wrapt.ObjectProxy)


def test_register_activates_when_kvelastic_is_on(monkeypatch, no_leaked_patches):
    import wrapt

    gpu_model_runner = importlib.import_module(RUNNER)
    for variable in [v for v in os.environ if v.startswith("KVELASTIC_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("KVELASTIC", "1")
    from kvelastic.plugin import register

    register()
    assert activation.current() is not None
    assert isinstance(vars(gpu_model_runner.GPUModelRunner)["initialize_kv_cache"], wrapt.FunctionWrapper)
    register()  # vLLM loads plugins once per process, but twice must be harmless
    for module in TRIGGERS:  # the rest is patched as vLLM imports it
        importlib.import_module(module)
    assert len(activation.current().patcher.wrapped) == _wrapped_targets()


def test_register_with_a_bad_switch_stops_start_up_with_one_line(monkeypatch, no_leaked_patches):
    """vLLM's plugin loader shows any exception as a traceback: the refusal is a SystemExit with one line."""
    import vllm.plugins

    from kvelastic.plugin import register
    from kvelastic.startup.reporting import StartupRefused

    monkeypatch.setenv("KVELASTIC", "banana")
    with pytest.raises(StartupRefused, match="^kvelastic: KVELASTIC='banana' is not a switch"):
        register()
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    with pytest.raises(SystemExit, match="^kvelastic: KVELASTIC='banana' is not a switch"):
        vllm.plugins.load_general_plugins()  # as vLLM calls it when an engine's arguments are built
    assert activation.current() is None


# ------------------------------------------- .pth hook, in fresh interpreters
# Last in the file: the interpreters start with the module's first test and run meanwhile.
def test_kvelastic_1_patches_vllm_on_import(interpreters):
    result = interpreters["on"].result()
    assert "kvelastic.startup.activate" in result["loaded_after_vllm"]
    assert result["active"] is True
    assert result["v1_wrapped"] is True, result["v1_type"]
    assert result["v2_wrapped"] is True
    assert f"{RUNNER}:GPUModelRunner.initialize_kv_cache" in result["patches"]
    assert len(result["patches"]) == _wrapped_targets()
    _, out, err = interpreters["on"].finish()
    assert "patches applied" in out + err  # through vLLM's logging, whose default stream is stdout


def test_import_vllm_with_kvelastic_imports_no_more_of_vllm_than_without(interpreters):
    """Start-up checks the patched modules from their source; each is patched when vLLM imports it."""
    on, unset = interpreters["on"].result(), interpreters["unset"].result()
    assert on["vllm_after_import"] == unset["vllm_after_import"]
    assert not set(TRIGGERS) & set(on["vllm_after_import"])  # so the hooks, not activation, applied them


def test_without_kvelastic_the_hook_imports_nothing_and_patches_nothing(interpreters):
    result = interpreters["unset"].result()
    assert result["loaded_after_vllm"] == []
    assert result["loaded_at_end"] is False
    assert result["v1_plain"] is True, result["v1_type"]
    assert result["v1_wrapped"] is False and result["v2_wrapped"] is False


def test_kvelastic_0_imports_nothing_either(interpreters):
    assert interpreters["zero"].result()["loaded_after_vllm"] == []


def test_a_bad_switch_leaves_an_interpreter_that_never_imports_vllm_alone(interpreters):
    """KVELASTIC is vLLM's business: `pip`, `python script.py` without vLLM run as if it were unset (a process
    that imports vLLM stops with one line: tests/test_new_user.py)."""
    code, out, err = interpreters["banana"].finish()
    assert code == 0
    assert out.strip() == "still alive"
    assert "kvelastic" not in err and "Traceback" not in err
