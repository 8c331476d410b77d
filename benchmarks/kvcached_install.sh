#!/usr/bin/env bash
# Build and install kvcached on the GPU machine from its published source (the baseline of
# multi_model.sh's `kvcached` config; nothing of it is in this repository). The machine has no
# network, so its sdist and its one missing dependency travel in the ignored `.whl/` folder:
#   here, once:  pip download (see benchmarks/README.md, "kvcached") into .whl/
#   device call: carry [".gpu/meta", ".whl"]  bash .gpu/meta/stage.sh && . .gpu/meta/env.sh &&
#                bash benchmarks/kvcached_install.sh && bash benchmarks/multi_model.sh kvcached
# The C++ extension is compiled against the machine's torch (2.11, CUDA 13) with its g++ and
# CUDA headers; the build log goes to $OUT/kvcached-build.log.
set -euo pipefail
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
sdist=$(ls .whl/kvcached-*.tar.gz | tail -1)
{
    python3 -m pip install --no-index --no-deps .whl/posix_ipc-*.whl
    time python3 -m pip install -v --no-index --no-deps --no-build-isolation "$sdist"
    cd /tmp && python3 -c 'import kvcached, kvcached.vmm_ops; print("kvcached", kvcached.__file__)'
} >"$OUT/kvcached-build.log" 2>&1 || { tail -40 "$OUT/kvcached-build.log"; exit 1; }
tail -3 "$OUT/kvcached-build.log"
