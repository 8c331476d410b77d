#!/usr/bin/env bash
# Install kvelastic and a real vLLM into a virtual environment, then run the test suite; then
# again against a band-A and a band-C release, so every patch band is tested against real vLLM code.
# GPU tests skip cleanly without CUDA.
#   bash scripts/run_tests.sh            # all tests, vLLM 0.28.0 (band B), 0.23.0 (band A), 0.33.0 (band C)
#   bash scripts/run_tests.sh -k pool    # extra arguments go to pytest
#   KVELASTIC_BAND_A=0 KVELASTIC_BAND_C=0 bash scripts/run_tests.sh   # band B only
#   KVELASTIC_DROP_VENVS=1 ...                     # remove each venv after its run (CI: less disk)
#
# Band C's vLLM 0.33.0 pins torch 2.14.0, which has no CPU build on PyPI: pip takes PyPI's CUDA
# build, which imports and runs on a machine without a GPU (torch.cuda.is_available() is False).
set -euo pipefail
cd "$(dirname "$0")/.."

# suite VENV TORCH VLLM [pytest args...]: a venv with that torch and vLLM, kvelastic, and pytest.
suite() {
    local venv=$1 torch=$2 vllm=$3
    shift 3
    bash scripts/install_band.sh "$venv" "$torch" "$vllm"  # checks the versions it got, too
    echo "== kvelastic tests against vLLM $vllm (torch $torch)"
    # --durations: CI's log names the slowest tests of each band (CI has 90 minutes for all three).
    KVELASTIC_REQUIRE_VLLM=1 "$venv/bin/python" -m pytest -q --durations=12 "$@"
    # CI keeps one venv (5-9 GB) on disk at a time.
    if [ "${KVELASTIC_DROP_VENVS:-0}" = 1 ]; then rm -rf "$venv"; fi
}

suite "${KVELASTIC_VENV:-.venv}" 2.13.0 0.28.0 "$@"
if [ "${KVELASTIC_BAND_A:-1}" != 0 ]; then
    suite "${KVELASTIC_VENV_BAND_A:-.venv-band-a}" 2.11.0 0.23.0 "$@"
fi
if [ "${KVELASTIC_BAND_C:-1}" != 0 ]; then
    suite "${KVELASTIC_VENV_BAND_C:-.venv-band-c}" 2.14.0 0.33.0 "$@"
fi
