#!/usr/bin/env bash
# Build one test venv: a torch release, a vLLM release on top of it, kvelastic (editable) and its
# test tools. The same steps as scripts/run_tests.sh's suite(), as a script of their own so that a
# band's venv can be installed (and timed) by hand without running the suite.
#   bash scripts/install_band.sh VENV TORCH VLLM
#   bash scripts/install_band.sh .venv-band-c 2.14.0 0.33.0     # band C: 0.33.0 pins torch 2.14.0
#   bash scripts/install_band.sh .venv-band-d 2.14.0 0.34.0     # band D: 0.34.0 pins torch 2.14.0 too
#
# torch 2.14.0 has no CPU build on PyPI (CPU wheels live on an index this machine cannot reach), so
# pip takes PyPI's CUDA build (555 MB, plus the NVIDIA libraries, which lie on this machine's disk).
# It imports and runs on a machine without a GPU: torch.cuda.is_available() is False, and vLLM's
# scheduler, block pool, model runner modules and KV cache views all import and run on the CPU.
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 VENV TORCH VLLM" >&2; exit 2; }
venv=$1 torch=$2 vllm=$3
cd "$(dirname "$0")/.."

[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# --no-compile: byte-compiling every file of torch, vLLM and their dependencies costs about 100 s of
# CPU a band; Python compiles the modules the tests import, on their first import, instead.
"$venv/bin/python" -m pip install -q --no-compile "torch==$torch"
# A pin the package index here cannot serve and nothing on the CPU imports (vLLM 0.34.0's
# flashinfer-python==0.7.3, a GPU kernel library): the wheel's other requirements first, then the
# wheel itself without its dependencies (scripts/wheel_requirements.py says why, and fails when a
# release no longer has the pin, so the list here stays current).
case $vllm in
    0.34.*) unservable=(flashinfer-python) ;;
    *) unservable=() ;;
esac
if [ ${#unservable[@]} -eq 0 ]; then
    "$venv/bin/python" -m pip install -q --no-compile "vllm==$vllm"
else
    wheels=$(mktemp -d) && trap 'rm -rf "$wheels"' EXIT
    "$venv/bin/python" -m pip download -q --no-deps "vllm==$vllm" -d "$wheels"
    "$venv/bin/python" scripts/wheel_requirements.py "$wheels"/vllm-*.whl "${unservable[@]/#/--skip=}" \
        > "$wheels/requirements.txt"
    "$venv/bin/python" -m pip install -q --no-compile -r "$wheels/requirements.txt"
    "$venv/bin/python" -m pip install -q --no-compile --no-deps "$wheels"/vllm-*.whl
fi
# vLLM pulls a CUDA torchvision that cannot load beside a CPU torch; kvelastic needs none of them.
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# kvelastic without its dependencies, then those but vLLM: vLLM is a dependency of kvelastic, and pip
# would otherwise resolve vLLM's own pins again (0.34.0's flashinfer pin would move it back to 0.33.0).
"$venv/bin/python" -m pip install -q --no-deps -e .
"$venv/bin/python" - <<'PY' > "$venv/kvelastic-requirements.txt"
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    if not requirement.replace(" ", "").lower().startswith("vllm"):
        print(requirement)
PY
"$venv/bin/python" -m pip install -q --no-compile -r "$venv/kvelastic-requirements.txt"
# torch reports its build as a local version (2.14.0+cu130, 2.13.0+cpu): compare the release only.
installed=$("$venv/bin/python" -c "import torch, vllm; print(torch.__version__.split('+')[0], vllm.__version__)" 2>/dev/null | tail -1)
[ "$installed" = "$torch $vllm" ] || { echo "$venv has torch/vllm '$installed', not '$torch $vllm'" >&2; exit 1; }
echo "$venv: torch $torch, vllm $vllm"
