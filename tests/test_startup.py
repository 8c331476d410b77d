"""What kvelastic prints when it switches on in a real vLLM process: through vLLM's logging.

Each case is a fresh interpreter that imports the installed vLLM with
``KVELASTIC=1`` (the ``.pth`` hook activates kvelastic), in a clean
environment; they start together, as in test_autopatch, and each test waits
for its own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm installed")

TIMEOUT_S = 300
TYPO = {"KVELASTIC_LIMT": "8GiB"}  # misspelt: kvelastic must say so, not silently run without a limit
CASES = {
    "default": {**TYPO, "KVELASTIC_CPU_PIN": "at-start"},  # and a retired variable: a warning, no more
    "warning_level": {**TYPO, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_LOGGING_STREAM": "ext://sys.stderr"},
    "unconfigured": {**TYPO, "VLLM_CONFIGURE_LOGGING": "0"},
    "bad_limit": {"KVELASTIC_LIMIT": "lots"},
    "bad_port": {"KVELASTIC_PORT": "²"},
}


def _env(tmp: Path, extra: dict[str, str]) -> dict[str, str]:
    import os

    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp), "TMPDIR": str(tmp),
            "LANG": "C.UTF-8", "KVELASTIC": "1", **extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("startup")
    started = {}
    for name, extra in CASES.items():
        out, err = open(tmp / f"{name}.out", "wb"), open(tmp / f"{name}.err", "wb")
        started[name] = (subprocess.Popen([sys.executable, "-c", "import vllm; print('imported')"],
                                          env=_env(tmp, extra), cwd=tmp, stdout=out, stderr=err), out, err)
    results = {}
    try:
        for name, (process, out, err) in started.items():
            process.wait(timeout=TIMEOUT_S)
            out.close()
            err.close()
            results[name] = (process.returncode, (tmp / f"{name}.out").read_text(),
                             (tmp / f"{name}.err").read_text())
    finally:
        for process, _, _ in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def _kvelastic_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "kvelastic" in line]


def test_by_default_kvelastic_logs_through_vllms_handler_and_format(runs):
    code, out, err = runs["default"]
    assert code == 0 and "imported" in out, err[-2000:]
    lines = _kvelastic_lines(out)  # vLLM's default stream is stdout; kvelastic's own handler wrote stderr
    assert any("patches applied" in line for line in lines), out[-2000:] + err[-2000:]
    settings = next(line for line in lines if "settings in effect" in line)
    assert "KVELASTIC_CHUNK_SIZE=8.00MiB" in settings and "KVELASTIC_LIMIT=none" in settings
    warning = next(line for line in lines if "KVELASTIC_LIMT" in line)
    prefix = warning.split("kvelastic:")[0]  # vLLM's own: "WARNING <time> [file:line]", from 0.33 after the process
    assert " WARNING " in f" {prefix}" and "did you mean KVELASTIC_LIMIT?" in warning
    assert "[reporting.py:" in warning  # vLLM's format, with its [file:line] field
    (retired,) = [line for line in lines if "KVELASTIC_CPU_PIN" in line]
    assert " WARNING " in f" {retired.split('kvelastic:')[0]}"
    assert retired.endswith("kvelastic: KVELASTIC_CPU_PIN is retired and ignored: the host tier is pinned in the "
                            "background while the engine serves")
    assert not _kvelastic_lines(err)


def test_vllm_logging_level_and_stream_apply_to_kvelastic(runs):
    code, out, err = runs["warning_level"]
    assert code == 0, err[-2000:]
    lines = _kvelastic_lines(err)
    assert [line for line in lines if "did you mean KVELASTIC_LIMIT?" in line]
    assert not [line for line in lines if "patches applied" in line or "settings in effect" in line]
    assert _kvelastic_lines(out) == []


def test_without_vllm_logging_only_warnings_reach_pythons_last_resort(runs):
    code, out, err = runs["unconfigured"]
    assert code == 0, err[-2000:]
    assert _kvelastic_lines(err) == ["kvelastic: KVELASTIC_LIMT is not a kvelastic setting and is ignored; "
                                     "did you mean KVELASTIC_LIMIT?"]
    assert _kvelastic_lines(out) == []


@pytest.mark.parametrize("case, message", [
    ("bad_limit", "kvelastic: KVELASTIC_LIMIT='lots' is not a size: expected a byte count"),
    ("bad_port", "kvelastic: KVELASTIC_PORT='²' is not a TCP port: expected a number from 1 to 65535"),
])
def test_a_bad_setting_stops_start_up_with_one_line(runs, case, message):
    code, out, err = runs[case]
    assert code == 1 and "imported" not in out
    assert len(err.strip().splitlines()) == 1 and err.startswith(message), err[-3000:]


def test_a_refusal_is_prefixed_once():
    from kvelastic.errors import ConfigError, PatchError
    from kvelastic.startup.reporting import StartupRefused

    assert str(StartupRefused(ConfigError("KVELASTIC_LIMIT='x' is bad"))) == "kvelastic: KVELASTIC_LIMIT='x' is bad"
    assert str(StartupRefused(PatchError("kvelastic: vLLM 9.0 is not supported"))) == \
        "kvelastic: vLLM 9.0 is not supported"
    assert isinstance(StartupRefused(ConfigError("x")), SystemExit)
