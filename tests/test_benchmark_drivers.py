"""The GPU benchmarks stay runnable as far as a CPU can tell.

Their runs happen on lent GPU machines, one stage of ``benchmarks/gpu_session.sh`` per call: a driver that
no longer parses its arguments, a stage that names a file that moved, or a setting kvelastic no longer
reads (the engine would run its defaults under the variant's name) costs a GPU call to find. These checks
cost none.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvelastic.settings import known_variables

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SESSION = BENCHMARKS / "gpu_session.sh"
DRIVERS = sorted(p.name for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())
#: The stages the GPU checks of a release rest on: outputs against vanilla, the host tier against vLLM's
#: OffloadingConnector (1B and 8B, interleaved), the 16k-token reload, the overhead.
REQUIRED_STAGES = {"matrix", "spill", "overhead", "offload-paired", "offload-paired-8b", "reload-idle-busy"}


def stages_listed() -> set[str]:
    return set(re.findall(r"^#\s+bash benchmarks/gpu_session\.sh (\S+)", SESSION.read_text(), re.M))


def stages_handled() -> set[str]:
    body = SESSION.read_text().split("\ncase $stage in\n", 1)[1].split("\nesac\n", 1)[0]
    labels = re.findall(r"^([a-z0-9|-]+)\)", body, re.M)
    return {stage for label in labels for stage in label.split("|")}


@pytest.mark.parametrize("driver", DRIVERS)
def test_every_driver_parses_its_arguments(driver: str) -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / driver), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_the_session_script_parses_and_handles_exactly_the_stages_it_lists() -> None:
    assert subprocess.run(["bash", "-n", str(SESSION)], capture_output=True).returncode == 0
    assert REQUIRED_STAGES <= stages_listed()
    assert stages_listed() == stages_handled()


def test_the_session_script_runs_only_files_that_exist() -> None:
    text = SESSION.read_text()
    named = {path.rstrip(".") for path in re.findall(r"\b(?:benchmarks|scripts)/[\w./-]+", text)}
    named |= set(re.findall(r"\btests/\w+", text))
    assert named, "the session script names no file: this test reads the wrong file"
    assert [path for path in sorted(named) if not (ROOT / path).exists()] == []


def test_the_benchmarks_name_only_variables_kvelastic_reads() -> None:
    """A retired or misspelt variable in a stage or a driver would run the defaults under another name."""
    text = "".join(p.read_text() for p in [*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("*.sh"),
                                           *BENCHMARKS.glob("mmbench/*.py")])
    named = set(re.findall(r"(?<![A-Z_])KVELASTIC_[A-Z][A-Z_]*[A-Z]", text)) - {"KVELASTIC_VAR", "KVELASTIC_PREFIX"}
    assert {"KVELASTIC_LIMIT", "KVELASTIC_CPU_BYTES"} <= named, "this test reads the wrong files"
    assert sorted(named - set(known_variables())) == []
