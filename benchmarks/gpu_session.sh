#!/usr/bin/env bash
# The GPU benchmarks, one stage per device call (a call stops at 10 minutes). Run from the repo root
# after staging the vLLM bundle; everything lands under $OUT/w-STAGE and then in $OUT/STAGE.tgz (only
# a few files come back from a call). What each stage measures and how to read it: benchmarks/README.md.
#   bash benchmarks/gpu_session.sh matrix             # 1B, default and V1 runner: outputs identical to vanilla on the staged vLLM
#   bash benchmarks/gpu_session.sh spill              # 1B, 384 MiB of GPU KV and a 4 GiB host tier, 3 passes: identical outputs
#   bash benchmarks/gpu_session.sh overhead           # 8B: vanilla against kvelastic, 150 long prompts (OVERHEAD_CHUNKS=8)
#   bash benchmarks/gpu_session.sh connectors-simple  # SimpleCPUOffloadConnector eager, lazy on the elastic pool (1B)
#   bash benchmarks/gpu_session.sh connectors-offload # OffloadingConnector lru, arc on the elastic pool (1B)
#   bash benchmarks/gpu_session.sh connectors-lmcache # LMCache's in-process connector on the elastic pool (a bundle with lmcache)
#   bash benchmarks/gpu_session.sh offload            # 1B multi-turn, engines one after another (MULTITURN_ARGS)
#   bash benchmarks/gpu_session.sh offload-paired     # 1B multi-turn, LRU, ARC, kvelastic interleaved (PAIRED_ROUNDS, default 9)
#   bash benchmarks/gpu_session.sh offload-paired-8b  # the same on the 8B shape (32 conversations, 4 GiB GPU, 24 GiB host)
#   bash benchmarks/gpu_session.sh offload-bound      # 1B interleaved with `ideal` (both budgets on the GPU): how far a host tier can lead
#   bash benchmarks/gpu_session.sh offload-bound-8b   # the same on the 8B shape
#   bash benchmarks/gpu_session.sh reload-idle-busy   # 8B, a 16k-token prefix from the host tier, idle engine then busy (RELOAD_MODES, RELOAD_REPS)
#   bash benchmarks/gpu_session.sh startup            # 1B start-up with a 48 GiB host tier against vanilla and the connector
#   bash benchmarks/gpu_session.sh serve              # vllm serve --api-server-count 2: kvelastic_* on /metrics (1B)
#   bash benchmarks/gpu_session.sh demo               # two 1B servers on one GPU through the launcher
#   bash benchmarks/gpu_session.sh sleep              # 1B sleep mode, levels 1 and 2: generate, sleep, wake, generate
#   bash benchmarks/gpu_session.sh families           # MLA, Mamba-2 hybrid, interleaved sliding window, fp8 KV, n-gram drafts
#   bash benchmarks/gpu_session.sh colocate           # vLLM 0.34+: two plain `vllm serve`, no utilization set, loaded in turns
#   bash benchmarks/gpu_session.sh colocate-vanilla   # the same without kvelastic
#   bash benchmarks/gpu_session.sh colocate-split     # the same without kvelastic, a hand split of 0.45 each
#   bash benchmarks/gpu_session.sh colocate-sleep     # `colocate` with sleep mode: the idle server sleeps each turn
#   bash benchmarks/gpu_session.sh tp                 # 8B TP=2: identical outputs, both GPUs' KV memory rising and falling
#   bash benchmarks/gpu_session.sh tp-spill           # `tp`, then TP=2 with a 1 GiB limit and an 8 GiB host tier
#   bash benchmarks/gpu_session.sh pp                 # 8B PP=2: identical outputs, memory on both GPUs
#   bash benchmarks/gpu_session.sh ray                # `tp` through Ray's V2 executor (a bundle with ray)
#   bash benchmarks/gpu_session.sh tp4                # 8B TP=4 on a 4-GPU machine (TP4_KVE_ENV, TP4_VARIANTS)
#   bash benchmarks/gpu_session.sh tp-accounts        # a TP=2 engine is a member of both GPUs' shared accounts
#   bash benchmarks/gpu_session.sh tp-sharing         # a TP=2 engine and a 1-GPU engine share GPU 0's account
#   bash benchmarks/gpu_session.sh dp                 # vllm serve --data-parallel-size 2 (8B) against vanilla DP
#   bash benchmarks/gpu_session.sh gil                # no vLLM: the pool's maps beside a Python-busy thread, per switch interval
#   bash benchmarks/gpu_session.sh gpu-tests          # no vLLM: tests/gpu
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
# a no-op for vLLM 0.34's MiniMax-M3 warm-up where the bundle lacks NVIDIA's CuTe DSL (bundle_env/sitecustomize.py)
export PYTHONPATH="$(pwd -P)/benchmarks/bundle_env${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-./gpu-out}
stage=$1
W=$OUT/w-$stage
mkdir -p "$W"
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv >"$W/gpus-$stage.txt"
date -u >>"$W/gpus-$stage.txt"
# kvelastic must be installed (its .pth hook and vLLM plugin entry point), not only importable from
# here: `python3 -c 'import kvelastic'` in the repo root passes without it and the engines run vanilla
# (and this checkout's: an A/B leaves another tree installed on a warm machine)
(cd / && python3 -c 'import sys, kvelastic, pathlib; sys.exit(pathlib.Path(kvelastic.__file__).parents[1] != pathlib.Path(sys.argv[1]))' "$(pwd -P)") 2>/dev/null \
    || python3 -m pip install -q --no-deps --no-build-isolation -e . >"$W/install.log" 2>&1 \
    || { echo "kvelastic could not be installed: $W/install.log"; exit 1; }
e2e() { python3 benchmarks/e2e_check.py "$@"; }
vllm_version() { python3 -c 'import vllm; print(vllm.__version__)'; }
multiturn() { python3 benchmarks/bench_multiturn.py --outdir "$W/multiturn" --json "$W/multiturn/multiturn.json" "$@" \
    ${MULTITURN_ARGS:-} 2>&1 | tee "$W/multiturn.log"; }
SHAPE_8B=(--model scripts/models/llama-8b --gpu-kv-bytes $((4 << 30)) --cpu-bytes $((24 << 30)) --conversations 32)
tp2() {  # 8B TP=2: identical outputs, and both GPUs' KV memory rising and falling together
    e2e --model scripts/models/llama-8b --outdir "$W/tp" --matrix tp2 --kve-env KVELASTIC_CACHE_TTL=2 \
        --summary "$W/tp/summary.json" --extra --idle-after 8 --prompts 256 --max-tokens 128 2>&1 | tee "$W/tp.log"
}
case $stage in
matrix)
    ver=$(vllm_version)
    runners=$(python3 -c 'from kvelastic.patching.versions import band_of, installed_vllm_version as v
print(" ".join(r.lower() for r in band_of(v()).runners))')  # band D (0.34+) has the V2 runner alone
    e2e --model scripts/models/llama-1b --outdir "$W/matrix-$ver" --matrix $runners --label="-vllm$ver" \
        --kve-env KVELASTIC_CACHE_TTL=2 --summary "$W/matrix-$ver/summary.json" --extra --idle-after 6 \
        2>&1 | tee "$W/matrix-$ver.log"
    r=$?
    grep -h "kvelastic .* (band \|kvelastic: .*KV tensors" "$W/matrix-$ver"/*-kve-*.log  # band, patches, groups
    (exit $r) ;;
spill)  # the GPU holds about a quarter of the 45k-token working set: passes 2 and 3 live on host reloads
    ver=$(vllm_version)
    e2e --model scripts/models/llama-1b --outdir "$W/spill-$ver" --matrix ${SPILL_RUNNERS:-v2} --label="-spill-vllm$ver" \
        --kve-env KVELASTIC_LIMIT=384MiB KVELASTIC_CPU_BYTES=4GiB KVELASTIC_CACHE_TTL=1 \
        --summary "$W/spill-$ver/summary.json" --extra --passes 3 --prompts 48 2>&1 | tee "$W/spill-$ver.log"
    r=$?
    grep -h "kvelastic: .*host tier" "$W/spill-$ver"/*-kve-*.log | tail -5  # the host tier's hits and misses
    (exit $r) ;;
overhead)
    ver=$(vllm_version)
    python3 benchmarks/bench_overhead.py --model scripts/models/llama-8b --chunks ${OVERHEAD_CHUNKS:-8} \
        --outdir "$W/overhead-$ver" --json "$W/overhead-$ver/overhead.json" 2>&1 | tee "$W/overhead-$ver.log" ;;
connectors-simple|connectors-offload|connectors-lmcache)  # each about 4-6 min on an H100 (4 engines, enforce-eager)
    # 256 MiB of GPU KV (vanilla: --kv-cache-memory-bytes, kvelastic: KVELASTIC_LIMIT) under 48 prompts of up
    # to ~2.5k tokens, twice: the second pass loads from the connector's CPU copies. Outputs token-identical
    # to the same connector on vanilla; memory after 8 idle seconds (TTL 2 s).
    # connectors-lmcache needs lmcache in the staged bundle, its kernels built for the bundle's torch:
    # ../shared/gpu/make-vllm-bundle 0.32.0 lmcache==0.5.6 (0.5.6 is built for torch 2.13, vLLM 0.29-0.32's)
    case $stage in
    connectors-simple) modes="simple-eager simple-lazy" ;;
    connectors-offload) modes="offload-lru offload-arc" ;;
    *) python3 -c 'import lmcache' 2>/dev/null || { echo "no lmcache in the staged vLLM bundle" >&2; exit 2; }
       modes="lmcache" ;;
    esac
    ver=$(vllm_version)
    e2e --model scripts/models/llama-1b --outdir "$W/$stage-$ver" --matrix $modes --label="-vllm$ver" \
        --kve-env KVELASTIC_LIMIT=256MiB KVELASTIC_CACHE_TTL=2 --summary "$W/$stage-$ver/summary.json" \
        --extra --eager --vanilla-kv-bytes $((256 << 20)) --cpu-bytes $((4 << 30)) --prompts 48 \
        --min-len 1000 --max-len 1800 --max-tokens 32 --idle-after 8 2>&1 | tee "$W/$stage-$ver.log" ;;
offload)  # about 7 min on an H100 for 4 engines (start-up, 16 GiB pinned, 1 warm-up + 3 measured rounds)
    multiturn ;;
offload-paired)  # about 6 min on an H200 for 3 engines x 9 rounds; partial rounds survive a cut (--collect-only)
    multiturn --interleave --configs offload-lru offload-arc kvelastic --rounds ${PAIRED_ROUNDS:-9} ;;
offload-paired-8b)  # about 4 min on an H200: 3 engines x (1 warm-up + 5) rounds of about 9 s; 3 x 24 GiB pinned
    multiturn --interleave "${SHAPE_8B[@]}" --configs offload-lru offload-arc kvelastic --rounds ${PAIRED_ROUNDS:-5} ;;
offload-bound)  # about 5 min on an H200; `ideal` holds 18 GiB of KV in its 0.2 share
    multiturn --interleave --configs offload-lru ideal kvelastic --rounds ${PAIRED_ROUNDS:-8} ;;
offload-bound-8b)  # about 5 min on an H200; a share of 0.3 each (ideal needs about 46 GiB; the KV is set in bytes)
    multiturn --interleave "${SHAPE_8B[@]}" --gpu-memory-utilization 0.3 --configs offload-lru ideal kvelastic \
        --rounds ${PAIRED_ROUNDS:-3} ;;
reload-idle-busy)  # about 8 min: the 16k reload of an idle engine, then of a busy one, each against the connector
    for mode in ${RELOAD_MODES:-idle busy}; do
        busy=""; [ $mode = busy ] && busy="--busy-before 0.6"
        python3 benchmarks/bench_reload.py --outdir "$W/reload-$mode" --json "$W/reload-$mode/reload.json" \
            --reps ${RELOAD_REPS:-3} --configs kvelastic offload-arc $busy ${RELOAD_ARGS:-} 2>&1 \
            | tee "$W/reload-$mode.log" || break
    done ;;
startup)  # about 5 min: engine starts with vanilla between the others
    python3 benchmarks/bench_startup.py --outdir "$W/startup" --json "$W/startup/startup.json" ${STARTUP_ARGS:-} \
        2>&1 | tee "$W/startup.log" ;;
serve)
    python3 benchmarks/check_serve_metrics.py --outdir "$W/serve" 2>&1 | tee "$W/serve.log" ;;
colocate|colocate-vanilla|colocate-split|colocate-sleep)  # two plain `vllm serve` (0.34+) on one GPU, no utilization set
    bash benchmarks/colocate_serve.sh "$(case $stage in colocate) echo kvelastic;; *) echo "${stage#colocate-}";; esac)" \
        2>&1 | tee "$W/$stage.log" ;;
sleep)  # about 5 min: 4 engines (vanilla, kvelastic at levels 1 and 2); SLEEP_MODEL for the 8B shape
    python3 benchmarks/check_sleep.py --model ${SLEEP_MODEL:-scripts/models/llama-1b} --outdir "$W/sleep" 2>&1 \
        | tee "$W/sleep.log" ;;
families)  # about 6 min eager: each 1B shape of benchmarks/models (and llama-1b with fp8 KV, n-gram drafts) against vanilla
    ver=$(vllm_version)
    family() {  # NAME MODEL [vllm_run.py arguments]: prefix caching on (vllm_run's default) in every one
        local name=$1 model=$2; shift 2
        e2e --model "$model" --outdir "$W/$name" --matrix v2 --label="-$name-vllm$ver" --kve-env KVELASTIC_CACHE_TTL=2 \
            --summary "$W/$name/summary.json" --extra --eager --idle-after 6 "$@" 2>&1 | tee "$W/$name.log"
        grep -h "kvelastic: .*KV tensors" "$W/$name"/*-kve-*.log | head -2  # the groups the pool made
    }
    r=0
    for entry in ${FAMILIES:-mla hybrid swa fp8 ngram}; do
        case $entry in
        mla) family mla benchmarks/models/mla-1b ;;
        hybrid) family hybrid benchmarks/models/hybrid-1b ;;
        swa) family swa benchmarks/models/swa-1b ;;
        fp8) family fp8 scripts/models/llama-1b --engine-arg kv_cache_dtype=fp8 ;;
        ngram) family ngram scripts/models/llama-1b --engine-arg \
            'speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}' ;;
        *) echo "unknown family $entry" >&2; false ;;
        esac || r=1
    done
    (exit $r) ;;
demo)
    python3 benchmarks/demo_two_instances.py --outdir "$W/demo" --enforce-eager 2>&1 | tee "$W/demo.log" ;;
tp)
    tp2 ;;
tp-spill)
    tp2
    e2e --model scripts/models/llama-8b --outdir "$W/tp-spill" --matrix tp2 --label=-spill \
        --kve-env KVELASTIC_LIMIT=1GiB KVELASTIC_CPU_BYTES=8GiB KVELASTIC_CACHE_TTL=1 \
        --summary "$W/tp-spill/summary.json" --extra --passes 3 --prompts 48 2>&1 | tee "$W/tp-spill.log" ;;
pp)  # each stage maps its own layers: identical outputs, both GPUs' memory rising and falling
    e2e --model scripts/models/llama-8b --outdir "$W/pp" --matrix pp2 --kve-env KVELASTIC_CACHE_TTL=2 \
        --summary "$W/pp/summary.json" --extra --idle-after 8 --prompts 256 --max-tokens 128 2>&1 | tee "$W/pp.log" ;;
ray)  # `tp` through Ray's V2 executor against vanilla Ray TP=2; RAY_KVE_ENV adds kvelastic settings
    # needs ray in the staged bundle: ../shared/gpu/make-vllm-bundle 0.25.0 ray==X
    python3 -c 'import ray' 2>/dev/null || { echo "no ray in the staged vLLM bundle: build one with ray" >&2; exit 2; }
    e2e --model scripts/models/llama-8b --outdir "$W/ray" --matrix ray-tp2 --label=-ray \
        --kve-env KVELASTIC_CACHE_TTL=2 ${RAY_KVE_ENV:-} --summary "$W/ray/summary.json" \
        --extra --idle-after 8 --prompts 256 --max-tokens 128 2>&1 | tee "$W/ray.log" ;;
tp4)  # TP4_KVE_ENV="KVELASTIC_RESERVE=0" adds settings to kvelastic's run; TP4_VARIANTS="--kve-variant
    # noreserve:KVELASTIC_RESERVE=0" adds kvelastic runs against the same vanilla run
    e2e --model scripts/models/llama-8b --outdir "$W/tp4" --matrix tp4 --kve-env KVELASTIC_CACHE_TTL=2 ${TP4_KVE_ENV:-} \
        ${TP4_VARIANTS:-} --summary "$W/tp4/summary.json" --extra --idle-after 8 --prompts 256 --max-tokens 128 \
        2>&1 | tee "$W/tp4.log" ;;
tp-accounts)  # `kvelastic status` each second while a TP=2 8B engine serves (kvelastic only)
    (for i in $(seq -w 150); do python3 -m kvelastic.cli status --json >"$W/status-$i.json" 2>/dev/null; sleep 1; done) &
    sampler=$!
    KVELASTIC=1 KVELASTIC_CACHE_TTL=2 python3 benchmarks/vllm_run.py --model scripts/models/llama-8b --tp 2 \
        --out "$W/tp2-kve.json" --prompts 128 --max-tokens 32 --idle-after 4 >"$W/tp2-kve.log" 2>&1
    r=$?
    kill $sampler 2>/dev/null
    grep -h "joined the shared KV account" "$W/tp2-kve.log"
    python3 benchmarks/accounts_seen.py "$W" && (exit $r) ;;
tp-sharing)  # `tp` (8B, TP=2) and `small` (1B, GPU 0) under one 4 GiB budget per GPU, in turns and together
    python3 benchmarks/check_tp_sharing.py --outdir "$W/tp-sharing" 2>&1 | tee "$W/tp-sharing.log" ;;
dp)  # two engine cores, one GPU each: identical to vanilla DP, both GPUs' memory, their accounts
    python3 benchmarks/check_data_parallel.py --outdir "$W/dp" 2>&1 | tee "$W/dp.log" ;;
gil)  # no vLLM, about 2 min: the driver's maps and growth beside a thread running Python, per switch interval,
    # and the shared account's cost to the reserve's growth, a page a call against batches
    mkdir -p "$W/gil"
    python3 benchmarks/bench_gil_convoy.py --backend cuda --page-mib 8 --json "$W/gil/gil_convoy.json" 2>&1 | tee "$W/gil.log"
    python3 benchmarks/bench_account_pages.py --backend cuda --page-mib 8 --json "$W/gil/account_pages.json" 2>&1 \
        | tee -a "$W/gil.log" ;;
gpu-tests)  # no vLLM: CudaBackend, PagePool and the host tier's copier on the device
    python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$W/gpu_tests.log" ;;
*) echo "unknown stage $stage (the list is at the top of benchmarks/gpu_session.sh)" >&2; exit 2 ;;
esac
rc=$?
tar czf "$OUT/$stage.tgz" -C "$W" . && rm -rf "$W"
exit $rc
