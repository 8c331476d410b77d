"""What a new user meets on the CPU: a bad ``KVELASTIC`` and an unsupported vLLM.

Each case is a fresh interpreter with the installed vLLM, in a clean
environment; they start together and each test waits for its own. An
unsupported release is the installed vLLM reporting another version
(:mod:`tests.fake_vllm_version`), which is all kvelastic reads to decide.
``vllm --version`` and ``vllm --help`` run vLLM's own CLI entry point with its
CPU platform chosen, as ``vllm bench`` does on a machine without a GPU (vLLM
cannot tell the device otherwise, with or without kvelastic).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvelastic.patching.versions import FIRST_UNSUPPORTED, OLDEST_SUPPORTED
from tests.fake_vllm_version import shadow_vllm_version

pytest.importorskip("vllm", reason="needs vllm installed")

TIMEOUT_S = 300
INSTALL = f'pip install "vllm>={OLDEST_SUPPORTED},<{FIRST_UNSUPPORTED}"'
NEWER = "0.99.0"
CLI = """
import sys
from vllm import platforms
from vllm.platforms.cpu import CpuPlatform
platforms.current_platform = CpuPlatform()
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""
IMPORT = "import vllm; print('imported', flush=True)"
ENGINE = "import vllm; print('imported', flush=True); from vllm import LLM; print('engine API', flush=True)"
CASES = {  # name: (code, arguments, extra environment, vLLM release reported)
    "maybe_import": (IMPORT, [], {"KVELASTIC": "maybe"}, None),
    "newer_import": (IMPORT, [], {}, NEWER),
    "newer_version": (CLI, ["--version"], {}, NEWER),
    "newer_help": (CLI, ["--help"], {}, NEWER),
    "newer_engine": (ENGINE, [], {}, NEWER),
    "older_engine": (ENGINE, [], {}, "0.11.0"),
    "newer_lenient": (ENGINE, [], {"KVELASTIC_STRICT": "0"}, NEWER),
}


def _env(tmp: Path, extra: dict[str, str], release: str | None) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp), "TMPDIR": str(tmp),
           "LANG": "C.UTF-8", "KVELASTIC": "1", **extra}
    if release is not None:
        env["PYTHONPATH"] = str(shadow_vllm_version(tmp / f"vllm-{release}", release))
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("new-user")
    started = {}
    for name, (code, arguments, extra, release) in CASES.items():
        out, err = open(tmp / f"{name}.out", "wb"), open(tmp / f"{name}.err", "wb")
        process = subprocess.Popen([sys.executable, "-c", code, *arguments], env=_env(tmp, extra, release), cwd=tmp,
                                   stdout=out, stderr=err)
        started[name] = (process, out, err)
    results = {}
    try:
        for name, (process, out, err) in started.items():
            process.wait(timeout=TIMEOUT_S)
            out.close()
            err.close()
            results[name] = (process.returncode, (tmp / f"{name}.out").read_text(), (tmp / f"{name}.err").read_text())
    finally:
        for process, _, _ in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def _one_line(err: str) -> str:
    """The one line on stderr besides torch's own start-up warnings (glog's ``W1207 18:27:26...`` lines)."""
    lines = [line for line in err.splitlines() if line.strip() and not re.match(r"[IWE]\d{4} \d", line)]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err
    return lines[0]


def test_kvelastic_maybe_is_one_line_and_exit_1_not_a_traceback(runs):
    code, out, err = runs["maybe_import"]
    assert code == 1 and "imported" not in out
    line = _one_line(err)
    assert line.startswith("kvelastic: KVELASTIC='maybe' is not a switch: use 1 or 0"), line


def test_with_an_unsupported_vllm_importing_it_and_its_cli_still_work(runs):
    for case in ("newer_import", "newer_version", "newer_help"):
        code, out, err = runs[case]
        assert code == 0, (case, out[-2000:], err[-3000:])
        assert "not supported" not in out + err, case
    assert runs["newer_import"][1].splitlines()[-1] == "imported"
    assert runs["newer_version"][1].splitlines()[-1] == NEWER  # vLLM's CLI reads its version as kvelastic does
    assert "usage: vllm" in runs["newer_help"][1]


@pytest.mark.parametrize("case, release", [("newer_engine", NEWER), ("older_engine", "0.11.0")])
def test_an_engine_of_an_unsupported_vllm_is_refused_naming_the_range_and_the_fix(runs, case, release):
    code, out, err = runs[case]
    assert code == 1 and "imported" in out and "engine API" not in out, err[-3000:]
    line = _one_line(err)
    assert line.startswith(f"kvelastic: vLLM {release} is not supported"), line
    assert INSTALL in line and "KVELASTIC=0" in line
    assert "README" in line and "docs/" not in line  # a document the wheel carries, named without a link


def test_kvelastic_strict_0_lets_an_unsupported_vllm_run_vanilla_with_a_warning(runs):
    code, out, err = runs["newer_lenient"]
    assert code == 0 and "engine API" in out, err[-3000:]
    assert "not supported" in out + err and "KVELASTIC_STRICT=0" in out + err
