"""``pip install kvelastic`` from a built wheel: what the wheel holds, and that a fresh venv gets the
CLI, the launcher (with its default model) and the autopatch, used from another working directory.

One wheel is built per run (``pip wheel``, with build isolation: the build
requirements of pyproject.toml are what it resolves), and installed with
``--no-deps`` into a new venv that has no kvelastic of its own. The
dependencies (vLLM, torch, wrapt) come from the environment running the
tests, appended to the venv's ``sys.path`` after its own site-packages, so
every ``kvelastic`` module the checks use is the wheel's, never the checkout's.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvelastic.patching.versions import FIRST_UNSUPPORTED, OLDEST_SUPPORTED
from tests.fake_vllm_version import shadow_vllm_version

REPO = Path(__file__).resolve().parents[1]
PTH = "kvelastic-autopatch.pth"
TIMEOUT_S = 300


def _copy_source(destination: Path) -> Path:
    """The repository without build outputs, environments or VCS data, so the wheel is built fresh."""
    ignore = shutil.ignore_patterns(".git", ".venv*", ".ci-venv", "venv", "build", "dist", "*.egg-info",
                                    "__pycache__", ".hypothesis", ".pytest_cache", ".gpu*", ".whl",
                                    "benchmarks", "*.pyc")  # .venv*: run_tests.sh keeps one venv per band
    shutil.copytree(REPO, destination, ignore=ignore)
    return destination


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVELASTIC", "VLLM_", "PYTHON"))}
    return {**env, **extra}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the checkout, as a user has it after cloning."""
    return _copy_source(tmp_path_factory.mktemp("wheel") / "src")


@pytest.fixture(scope="module")
def wheel(source) -> Path:
    """Slow-ish (a pip build, with build isolation fetching setuptools): the wheel users install."""
    tmp = source.parent
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "out"), "."],
                          cwd=source, env=_clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = (tmp / "out").glob("kvelastic-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A new venv with the wheel installed (no deps); this environment's packages come after its own."""
    root = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=TIMEOUT_S)
    python = root / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-index", str(wheel)], env=_clean_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    # Plain path lines append the directories; their own .pth files (our editable install's) are not run.
    # "00-" sorts before kvelastic-autopatch.pth, whose hook needs wrapt from there. Every site-packages on
    # this interpreter's path: a venv layered on another (by a .pth line) has its packages in the lower one.
    here = [entry for entry in sys.path if entry.endswith("site-packages") and Path(entry).is_dir()]
    (purelib / "00-test-dependencies.pth").write_text("".join(f"{entry}\n" for entry in here))
    return root


def _run(venv: Path, *command: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    binary = venv / "bin" / command[0]
    return subprocess.run([str(binary), *command[1:]], cwd=cwd, env=_clean_env(**env), capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def test_the_wheel_carries_the_hook_entry_points_model_and_license(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert PTH in names, "the .pth must sit at the root of the wheel (site-packages)"
        installed = [Path(d) / PTH for d in site.getsitepackages() if (Path(d) / PTH).is_file()]
        assert installed and archive.read(PTH).decode() == installed[0].read_text()  # as the editable install's
        assert "kvelastic/patches/__init__.py" in names and "kvelastic/patches/v2_allocate_kv_cache.py" in names
        assert "kvelastic/_autopatch.py" in names and "kvelastic/plugin.py" in names
        for package in ("pool", "worker", "scheduler", "hooks", "startup", "metrics", "offload", "patching", "cluster", "tp"):
            assert f"kvelastic/{package}/__init__.py" in names
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            assert f"kvelastic/models/llama-1b/{name}" in names
        assert not any(name.startswith(("patches/", "tests/", "scripts/", "kvelastic_dev/")) for name in names)
        assert not any(name.startswith("kvelastic/patching/") and name.endswith(
            ("vllm_source.py", "static_check.py", "remote_zip.py", "releases.py")) for name in names)
        meta = {Path(n).name: archive.read(n).decode() for n in names if ".dist-info/" in n}
        assert "[vllm.general_plugins]\nkvelastic = kvelastic.plugin:register" in meta["entry_points.txt"]
        assert "[console_scripts]\nkvelastic = kvelastic.cli:main" in meta["entry_points.txt"]
        metadata = meta["METADATA"]
        assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata  # SPDX
        assert f"Requires-Dist: vllm<{FIRST_UNSUPPORTED},>={OLDEST_SUPPORTED}" in metadata  # not only an extra
        assert "Requires-Dist: cuda-bindings" in metadata and "Requires-Dist: cuda-python" not in metadata
        assert "Classifier: Environment :: GPU :: NVIDIA CUDA" in metadata
        assert "Requires-Python: >=3.10" in metadata
        assert "Apache License" in meta["LICENSE"] and "Version 2.0, January 2004" in meta["LICENSE"]
        assert any(line.startswith(PTH + ",") for line in meta["RECORD"].splitlines())


def test_the_installed_cli_and_launcher_work_from_another_directory(venv, tmp_path):
    import kvelastic

    version = _run(venv, "kvelastic", "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"kvelastic {kvelastic.__version__}"
    status = _run(venv, "kvelastic", "status", "--json", cwd=tmp_path, KVELASTIC_SHARED_DIR=str(tmp_path))
    assert status.returncode == 4 and json.loads(status.stdout) == {"accounts": []}
    plan = _run(venv, "kvelastic", "launch", "--dry-run", "--json", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    purelib = _run(venv, "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path)
    model = Path(purelib.stdout.strip()) / "kvelastic" / "models" / "llama-1b"
    instances = json.loads(plan.stdout)["instances"]
    assert [i["port"] for i in instances] == [8001, 8002]
    for instance in instances:
        assert instance["model"] == str(model) and (model / "config.json").is_file()
        assert instance["command"][0] == str(venv / "bin" / "python")


PROBE = """
import json, kvelastic, vllm
from kvelastic.startup.activate import current
from kvelastic.launcher.command import kvelastic_problem
import os, sys
print(json.dumps({"kvelastic": kvelastic.__file__, "active": current() is not None,
                  "launcher_probe": kvelastic_problem(sys.executable, dict(os.environ))}))
"""


def test_the_autopatch_of_the_installed_wheel_patches_vllm(venv, tmp_path):
    pytest.importorskip("vllm", reason="the autopatch needs vLLM")
    result = _run(venv, "python", "-c", PROBE, cwd=tmp_path, KVELASTIC="1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["kvelastic"].startswith(str(venv)), found  # the wheel's kvelastic, not the checkout's
    assert found["active"] is True
    assert found["launcher_probe"] is None  # `kvelastic launch` would accept this Python
    assert "patches applied" in result.stdout + result.stderr


def test_pip_install_then_pytest_tests_the_installed_package(venv, source):
    """`pip install .` then the test command in the checkout: the checkout's kvelastic folder (without
    kvelastic.patches) must not hide the installed package, while tests.* and kvelastic_dev still import."""
    chosen = "test_the_supported_range_is_written_once_and_pyproject_agrees or test_releases_outside_supported"
    result = _run(venv, "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_version_matrix.py",
                  "-k", chosen, cwd=source)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "No module named 'kvelastic.patches'" not in result.stdout + result.stderr
    assert " passed" in result.stdout


def test_pip_reports_a_vllm_outside_the_supported_range(venv, tmp_path):
    """The range is a real dependency: pip says so when vLLM moves past it (what `pip install -U vllm` prints)."""
    shadow = shadow_vllm_version(tmp_path / "shadow", "0.99.0")
    env = {"PYTHONPATH": str(shadow)}
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "check"],
                          env=_clean_env(**env), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert f"has requirement vllm<{FIRST_UNSUPPORTED},>={OLDEST_SUPPORTED}, but you have vllm 0.99.0" in done.stdout, \
        done.stdout[-3000:] + done.stderr[-3000:]
