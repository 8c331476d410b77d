#!/usr/bin/env bash
# Install kvelastic and a real vLLM (0.28.0, which runs on a CPU build of torch) into a
# virtual environment, then run the test suite. GPU tests skip cleanly without CUDA.
#   bash scripts/run_tests.sh            # all tests
#   bash scripts/run_tests.sh -k pool    # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVELASTIC_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q "vllm==0.28.0"
# vLLM pulls a CUDA torchvision that cannot load beside CPU torch; kvelastic needs none of them.
python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
python -m pip install -q -e ".[test]"
KVELASTIC_REQUIRE_VLLM=1 python -m pytest -q "$@"
