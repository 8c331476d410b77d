#!/usr/bin/env bash
# The GPU runs of one device session, by stage; everything lands under $OUT (tarred at the end,
# since only a few files come back). Run from the repo root after staging the vLLM bundle:
#   bash benchmarks/gpu_session.sh tp       # TP=2 8B: identical outputs, both GPUs' KV memory rises and falls
#   bash benchmarks/gpu_session.sh tp-spill # TP=1 through the multiprocess executor (1B), TP=2 with spills (8B)
#   bash benchmarks/gpu_session.sh tp-step  # issue 19: `tp` with KVELASTIC_TP_CONFIRM=step (confirmations on replies)
#   bash benchmarks/gpu_session.sh tp-step-spill  # issue 16: TP=2 spills with async host loads (needs step)
#   bash benchmarks/gpu_session.sh step-ab  # issue 19: TP=2 and PP=2, default (auto) vs board against one vanilla run each
#   bash benchmarks/gpu_session.sh pp       # issue 19: PP=2: identical outputs, memory on both GPUs
#   bash benchmarks/gpu_session.sh ray      # issue 19: `tp` through Ray's V2 executor (a bundle with ray)
#   bash benchmarks/gpu_session.sh tp4      # issue 19: TP=4 8B on a 4-GPU machine: identical outputs, memory
#   bash benchmarks/gpu_session.sh tp-accounts  # issue 19: a TP=2 engine is a member of both GPUs' accounts
#   bash benchmarks/gpu_session.sh tp-sharing   # issue 19: a TP=2 engine and a 1-GPU engine share GPU 0's account
#   bash benchmarks/gpu_session.sh dp       # issue 19: vllm serve --data-parallel-size 2 (8B) against vanilla DP
#   bash benchmarks/gpu_session.sh demo     # issue 5: two 1B servers on one GPU via the launcher
#   bash benchmarks/gpu_session.sh startup  # issue 16: start-up with a 48 GiB host tier vs vanilla and the connector (1B)
#   bash benchmarks/gpu_session.sh reload   # issue 4: 16k-token prefix TTFT, host tier vs recompute (8B)
#   bash benchmarks/gpu_session.sh reload-idle-busy  # issue 16: the same reload of an idle and of a busy engine
#   bash benchmarks/gpu_session.sh matrix   # issue 6: e2e check (1B, default and V1 runner) on the staged vLLM
#   bash benchmarks/gpu_session.sh spill    # 1B, default runner: 384 MiB of GPU KV + 4 GiB host tier, 3 passes, the defaults
#   bash benchmarks/gpu_session.sh spill-sync    # the same with KVELASTIC_CPU_LOAD=sync KVELASTIC_CPU_STORE=eviction (before 2026-11-28)
#   bash benchmarks/gpu_session.sh spill-async   # the same with KVELASTIC_CPU_LOAD=async: identical outputs
#   bash benchmarks/gpu_session.sh offload-async # multi-turn: connector LRU and ARC, kvelastic sync and async
#   bash benchmarks/gpu_session.sh overhead # 8B: vanilla against kvelastic at 8 MiB chunks, 150 long prompts
#   bash benchmarks/gpu_session.sh copy     # no vLLM needed: the GPU tests, then copier bandwidth per copy path
#   bash benchmarks/gpu_session.sh growth   # no vLLM needed: does regrowing 2 GiB of warm reserve hold up a map or the kernels?
#   bash benchmarks/gpu_session.sh gil      # no vLLM needed: the pool's driver calls beside a thread running Python, per switch interval
#   bash benchmarks/gpu_session.sh copy-beside  # no vLLM needed: what stores and async loads cost the compute beside them, per path
#   bash benchmarks/gpu_session.sh offload  # issue 4: multi-turn (vanilla, connector LRU and ARC, kvelastic)
#   bash benchmarks/gpu_session.sh offload-paired  # issue 16: multi-turn, all engines up at once, rounds in turn (paired ratios)
#   bash benchmarks/gpu_session.sh offload-paired-8b  # the same on the 8B shape (32 conversations, 4 GiB GPU, 24 GiB host)
#   bash benchmarks/gpu_session.sh offload-beside     # issue 16: interleaved 1B, copies beside compute through staging or not (6 engines)
#   bash benchmarks/gpu_session.sh offload-beside-8b  # the same on the 8B shape: write-through on its own stream, staged or not
#   bash benchmarks/gpu_session.sh offload-bound      # issue 16: interleaved 1B with `ideal` (everything on the GPU): how far +15 % is possible
#   bash benchmarks/gpu_session.sh offload-bound-8b   # the same on the 8B shape: is there room for +15 % at all?
#   bash benchmarks/gpu_session.sh serve    # vllm serve --api-server-count 2: kvelastic_* on /metrics (1B)
#   bash benchmarks/gpu_session.sh connectors-simple   # issue 17: SimpleCPUOffloadConnector eager, lazy (1B)
#   bash benchmarks/gpu_session.sh connectors-offload  # issue 17: OffloadingConnector lru, arc (1B)
# One stage per device call: a call stops at 10 minutes, and the tarball is written at the end.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
OUT=${OUT:-./gpu-out}
stage=$1
W=$OUT/w-$stage  # everything goes here, then into one tarball: only a few files come back
mkdir -p "$W"
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv >"$W/gpus-$stage.txt"
date -u >>"$W/gpus-$stage.txt"
# kvelastic must be installed (its .pth hook and vLLM plugin entry point), not only importable from
# here: `python3 -c 'import kvelastic'` in the repo root passes without it and the engines run vanilla
# (and this checkout's: an A/B leaves another tree installed on a warm machine)
(cd / && python3 -c 'import sys, kvelastic, pathlib; sys.exit(pathlib.Path(kvelastic.__file__).parents[1] != pathlib.Path(sys.argv[1]))' "$(pwd -P)") 2>/dev/null \
    || python3 -m pip install -q --no-deps --no-build-isolation -e . >"$W/install.log" 2>&1 \
    || { echo "kvelastic could not be installed: $W/install.log"; exit 1; }
e2e() { python3 scripts/e2e_check.py "$@"; }
# The multi-turn stages' write-through variants, spelt out (whatever the defaults are): on its own stream with
# asynchronous loads, and the same with both copies beside compute staged (the defaults since 2026-11-28)
WTOWN=KVELASTIC_CPU_STORE=write-through,KVELASTIC_CPU_STORE_STREAM=own,KVELASTIC_CPU_LOAD=async
WTOWNST=$WTOWN,KVELASTIC_CPU_STORE_PATH=staged,KVELASTIC_CPU_LOAD_PATH=staged
tp2() {  # 8B TP=2: identical outputs, and both GPUs' KV memory rising and falling together
    e2e --model scripts/models/llama-8b --outdir "$W/tp" --matrix tp2 --kve-env KVELASTIC_CACHE_TTL=2 \
        --summary "$W/tp/summary.json" --extra --idle-after 8 --prompts 256 --max-tokens 128 2>&1 | tee "$W/tp.log"
}
case $stage in
tp)
    tp2 ;;
tp-step)  # the ranks confirm mapped groups on their step replies, not on boards: same outputs and memory curve
    e2e --model scripts/models/llama-8b --outdir "$W/tp-step" --matrix tp2 --label=-step \
        --kve-env KVELASTIC_CACHE_TTL=2 KVELASTIC_TP_CONFIRM=step --summary "$W/tp-step/summary.json" \
        --extra --idle-after 8 --prompts 256 --max-tokens 128 2>&1 | tee "$W/tp-step.log" ;;
tp-step-spill)  # `tp-spill`'s TP=2 run, host hits loaded beside compute: the ranks report loads on their replies
    e2e --model scripts/models/llama-8b --outdir "$W/tp-step-spill" --matrix tp2 --label=-step-spill \
        --kve-env KVELASTIC_LIMIT=1GiB KVELASTIC_CPU_BYTES=8GiB KVELASTIC_CACHE_TTL=1 KVELASTIC_TP_CONFIRM=step \
        KVELASTIC_CPU_LOAD=async --summary "$W/tp-step-spill/summary.json" --extra --passes 3 --prompts 48 \
        2>&1 | tee "$W/tp-step-spill.log" ;;
ray)  # issue 19: `tp` through Ray's V2 executor (KVELASTIC_RAY=allow) against vanilla Ray TP=2: identical outputs; RAY_KVE_ENV="KVELASTIC_TP_CONFIRM=step" adds settings
    # needs ray in the staged bundle: ../shared/gpu/make-vllm-bundle 0.25.0 ray==X (docs/tp-step-protocol.md, "Ray")
    python3 -c 'import ray' 2>/dev/null || { echo "no ray in the staged vLLM bundle: build one with ray" >&2; exit 2; }
    e2e --model scripts/models/llama-8b --outdir "$W/ray" --matrix ray-tp2 --label=-ray \
        --kve-env KVELASTIC_CACHE_TTL=2 KVELASTIC_RAY=allow ${RAY_KVE_ENV:-} --summary "$W/ray/summary.json" \
        --extra --idle-after 8 --prompts 256 --max-tokens 128 2>&1 | tee "$W/ray.log" ;;
step-ab)  # issue 19: TP=2 and PP=2, each with the default confirmations (auto: step under mp) and with board, against
    # one vanilla run each (about 10 min on 2 x H200: 6 engines; session 18 ran TP=2 board/step and PP=2 step in 7)
    e2e --model scripts/models/llama-8b --outdir "$W/tp-ab" --matrix tp2 --kve-env KVELASTIC_CACHE_TTL=2 \
        --variant board:KVELASTIC_TP_CONFIRM=board --summary "$W/tp-ab/summary.json" --extra --idle-after 8 \
        --prompts 256 --max-tokens 128 2>&1 | tee "$W/tp-ab.log"
    e2e --model scripts/models/llama-8b --outdir "$W/pp-ab" --matrix pp2 --kve-env KVELASTIC_CACHE_TTL=2 \
        KVELASTIC_PIPELINE=allow --variant board:KVELASTIC_TP_CONFIRM=board --summary "$W/pp-ab/summary.json" \
        --extra --idle-after 8 --prompts 256 --max-tokens 128 2>&1 | tee "$W/pp-ab.log" ;;
pp)  # issue 19: PP=2 8B, each stage maps its own layers: identical outputs, both GPUs' memory rising and falling
    e2e --model scripts/models/llama-8b --outdir "$W/pp" --matrix pp2 --kve-env KVELASTIC_CACHE_TTL=2 \
        KVELASTIC_PIPELINE=allow --summary "$W/pp/summary.json" --extra --idle-after 8 --prompts 256 \
        --max-tokens 128 2>&1 | tee "$W/pp.log" ;;
tp4)  # issue 19: `tp` at TP=4 (a 4-GPU machine); TP4_KVE_ENV="KVELASTIC_RESERVE=0" adds settings to kvelastic's run,
    # TP4_VARIANTS="--variant noreserve:KVELASTIC_RESERVE=0" adds kvelastic runs against the same vanilla run
    e2e --model scripts/models/llama-8b --outdir "$W/tp4" --matrix tp4 --kve-env KVELASTIC_CACHE_TTL=2 ${TP4_KVE_ENV:-} ${TP4_VARIANTS:-} \
        --summary "$W/tp4/summary.json" --extra --idle-after 8 --prompts 256 --max-tokens 128 2>&1 | tee "$W/tp4.log" ;;
tp-accounts)  # issue 19: `kvelastic status` each second while a TP=2 8B engine serves (kvelastic only)
    (for i in $(seq -w 150); do python3 -m kvelastic.cli status --json >"$W/status-$i.json" 2>/dev/null; sleep 1; done) &
    sampler=$!
    KVELASTIC=1 KVELASTIC_CACHE_TTL=2 python3 scripts/vllm_run.py --model scripts/models/llama-8b --tp 2 \
        --out "$W/tp2-kve.json" --prompts 128 --max-tokens 32 --idle-after 4 >"$W/tp2-kve.log" 2>&1
    r=$?
    kill $sampler 2>/dev/null
    grep -h "joined the shared KV account" "$W/tp2-kve.log"
    python3 scripts/accounts_seen.py "$W" && (exit $r) ;;
tp-sharing)  # issue 19: `tp` (8B, TP=2) and `small` (1B, GPU 0) under one 4 GiB budget per GPU, in turns and together
    python3 scripts/check_tp_sharing.py --outdir "$W/tp-sharing" 2>&1 | tee "$W/tp-sharing.log" ;;
dp)  # issue 19: two engine cores, one GPU each: identical to vanilla DP, both GPUs' memory, their accounts
    python3 scripts/check_data_parallel.py --outdir "$W/dp" 2>&1 | tee "$W/dp.log" ;;
tp-spill)
    tp2
    e2e --model scripts/models/llama-8b --outdir "$W/tp-spill" --matrix tp2 --label=-spill \
        --kve-env KVELASTIC_LIMIT=1GiB KVELASTIC_CPU_BYTES=8GiB KVELASTIC_CACHE_TTL=1 \
        --summary "$W/tp-spill/summary.json" --extra --passes 3 --prompts 48 2>&1 | tee "$W/tp-spill.log" ;;
matrix)  # the end-to-end check on whichever vLLM bundle is staged (issue 6's GPU matrix)
    ver=$(python3 -c 'import vllm; print(vllm.__version__)')
    runners=$(python3 -c 'from kvelastic.patching.versions import band_of, installed_vllm_version as v
print(" ".join(r.lower() for r in band_of(v()).runners))')  # band D (0.34+) has the V2 runner alone
    e2e --model scripts/models/llama-1b --outdir "$W/matrix-$ver" --matrix $runners --label="-vllm$ver" \
        --kve-env KVELASTIC_CACHE_TTL=2 --summary "$W/matrix-$ver/summary.json" --extra --idle-after 6 \
        2>&1 | tee "$W/matrix-$ver.log"
    r=$?
    grep -h "kvelastic .* (band \|kvelastic: .*KV tensors" "$W/matrix-$ver"/*-kve-*.log  # band, patches, groups
    (exit $r) ;;
spill|spill-sync|spill-async)  # the GPU holds about a quarter of the 45k-token working set: passes 2 and 3 live on host reloads
    ver=$(python3 -c 'import vllm; print(vllm.__version__)')
    case $stage in  # `spill` names no copy mode: it runs whatever the defaults are
    spill) modes=""; label=defaults ;;
    spill-sync) modes="KVELASTIC_CPU_LOAD=sync KVELASTIC_CPU_STORE=eviction"; label=sync ;;
    spill-async) modes="KVELASTIC_CPU_LOAD=async"; label=async ;;
    esac
    e2e --model scripts/models/llama-1b --outdir "$W/spill-$ver" --matrix ${SPILL_RUNNERS:-v2} --label="-spill-$label-vllm$ver" \
        --kve-env KVELASTIC_LIMIT=384MiB KVELASTIC_CPU_BYTES=4GiB KVELASTIC_CACHE_TTL=1 $modes \
        --summary "$W/spill-$ver/summary.json" --extra --passes 3 --prompts 48 2>&1 | tee "$W/spill-$ver.log"
    r=$?
    grep -h "kvelastic: .*host tier" "$W/spill-$ver"/*-kve-*.log | tail -5  # the host tier's hits and misses
    (exit $r) ;;
overhead)
    ver=$(python3 -c 'import vllm; print(vllm.__version__)')
    python3 scripts/bench_overhead.py --model scripts/models/llama-8b --chunks ${OVERHEAD_CHUNKS:-8} \
        --outdir "$W/overhead-$ver" --json "$W/overhead-$ver/overhead.json" 2>&1 | tee "$W/overhead-$ver.log" ;;
colocate|colocate-vanilla|colocate-split)  # issue 45: two plain `vllm serve` (0.34+) on one GPU, no utilization set
    bash benchmarks/colocate_serve.sh "$(case $stage in colocate) echo kvelastic;; *) echo "${stage#colocate-}";; esac)" \
        2>&1 | tee "$W/$stage.log" ;;
demo)
    python3 scripts/demo_two_instances.py --outdir "$W/demo" --enforce-eager 2>&1 | tee "$W/demo.log" ;;
copy)
    mkdir -p "$W/copy"
    python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$W/copy/gpu_tests.log"
    python3 scripts/bench_copy.py --host torch tier --json "$W/copy/bench_copy.json" 2>&1 | tee "$W/copy/bench_copy.log" ;;
copy-beside)  # issue 16: session 21's write-through slowed turn 0 by 4-13 %: SM store kernels vs the copy engines (about 1 min)
    mkdir -p "$W/copy-beside"
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_copier_cuda.py tests/gpu/test_fused_copy_cuda.py 2>&1 | tee "$W/copy-beside/gpu_tests.log"
    python3 scripts/bench_copy_beside.py --json "$W/copy-beside/copy_beside.json" 2>&1 | tee "$W/copy-beside.log" ;;
growth)  # issue 16: session 19's slow GPU hits after a busy reload; one call vs chunks (about 1 min)
    mkdir -p "$W/growth"
    python3 scripts/bench_reserve_growth.py --json "$W/growth/reserve_growth.json" 2>&1 | tee "$W/growth.log" ;;
gil)  # issue 16, session 26's CPU lead (docs/pool.md): the driver's maps and growth beside a thread running Python,
    # per switch interval, and the shared account's cost to growth, a page a call against batches (no vLLM; about 2 min)
    mkdir -p "$W/gil"
    python3 scripts/bench_gil_convoy.py --backend cuda --page-mib 8 --json "$W/gil/gil_convoy.json" 2>&1 | tee "$W/gil.log"
    python3 scripts/bench_account_pages.py --backend cuda --page-mib 8 --json "$W/gil/account_pages.json" 2>&1 \
        | tee -a "$W/gil.log" ;;
offload)  # about 7 min on an H100 (4 engines: start-up, 16 GiB pinned, 1 warm-up + 3 measured rounds)
    python3 scripts/bench_multiturn.py --outdir "$W/multiturn" --json "$W/multiturn/multiturn.json" \
        ${MULTITURN_ARGS:-} 2>&1 | tee "$W/multiturn.log" ;;
offload-paired)  # issue 16: about 6 min on an H200 for 4 engines x 9 measured rounds (start-up about 60 s, a round about 6.5 s)
    # PAIRED_ROUNDS fewer when device time is short; partial rounds survive a cut (bench_multiturn.py --collect-only)
    python3 scripts/bench_multiturn.py --outdir "$W/multiturn" --json "$W/multiturn/multiturn.json" --interleave \
        --configs offload-lru offload-arc kvelastic --rounds ${PAIRED_ROUNDS:-9} ${MULTITURN_ARGS:-} 2>&1 | tee "$W/multiturn.log" ;;
offload-paired-8b)  # issue 16: about 4 min on an H200: 3 engines x (1 warm-up + PAIRED_ROUNDS, default 5) rounds of about 9 s; 3 x 24 GiB pinned
    python3 scripts/bench_multiturn.py --outdir "$W/multiturn" --json "$W/multiturn/multiturn.json" --interleave \
        --model scripts/models/llama-8b --gpu-kv-bytes $((4 << 30)) --cpu-bytes $((24 << 30)) --conversations 32 \
        --configs offload-lru offload-arc kvelastic --rounds ${PAIRED_ROUNDS:-5} ${MULTITURN_ARGS:-} 2>&1 | tee "$W/multiturn.log" ;;
offload-beside)  # issue 16: about 8 min on an H200 (6 engines x (1 + PAIRED_ROUNDS, default 8) rounds; 6 x 16 GiB pinned)
    python3 scripts/bench_multiturn.py --outdir "$W/multiturn" --json "$W/multiturn/multiturn.json" --interleave \
        --configs offload-lru offload-arc --rounds ${PAIRED_ROUNDS:-8} --variant async:KVELASTIC_CPU_LOAD=async \
        --variant asyncst:KVELASTIC_CPU_LOAD=async,KVELASTIC_CPU_LOAD_PATH=staged --variant wtown:$WTOWN \
        --variant wtownst:$WTOWNST \
        ${MULTITURN_ARGS:-} 2>&1 | tee "$W/multiturn.log" ;;
offload-beside-8b)  # issue 16: about 6 min on an H200 (4 engines x 6 rounds of about 9 s; 4 x 24 GiB pinned)
    python3 scripts/bench_multiturn.py --outdir "$W/multiturn" --json "$W/multiturn/multiturn.json" --interleave \
        --model scripts/models/llama-8b --gpu-kv-bytes $((4 << 30)) --cpu-bytes $((24 << 30)) --conversations 32 \
        --configs offload-lru offload-arc --rounds ${PAIRED_ROUNDS:-5} --variant wtown:$WTOWN \
        --variant wtownst:$WTOWNST \
        ${MULTITURN_ARGS:-} 2>&1 | tee "$W/multiturn.log" ;;
offload-bound)  # issue 16: about 5 min on an H200 (4 engines x 9 rounds); `ideal` holds 18 GiB of KV in its 0.2 share
    python3 scripts/bench_multiturn.py --outdir "$W/multiturn" --json "$W/multiturn/multiturn.json" --interleave \
        --configs offload-lru offload-arc ideal --rounds ${PAIRED_ROUNDS:-8} \
        --variant async:KVELASTIC_CPU_LOAD=async ${MULTITURN_ARGS:-} 2>&1 | tee "$W/multiturn.log" ;;
offload-bound-8b)  # issue 16: about 5 min on an H200: LRU, `ideal` (28 GiB of KV on the GPU) and write-through staged,
    # 3 engines x (1 + PAIRED_ROUNDS, default 3) rounds; a share of 0.3 each (ideal needs about 46 GiB; the KV is set in bytes)
    python3 scripts/bench_multiturn.py --outdir "$W/multiturn" --json "$W/multiturn/multiturn.json" --interleave \
        --model scripts/models/llama-8b --gpu-kv-bytes $((4 << 30)) --cpu-bytes $((24 << 30)) --conversations 32 \
        --gpu-memory-utilization 0.3 --configs offload-lru ideal --rounds ${PAIRED_ROUNDS:-3} \
        --variant wtownst:$WTOWNST \
        ${MULTITURN_ARGS:-} 2>&1 | tee "$W/multiturn.log" ;;
offload-async)  # issue 16: about 7 min (4 engines); outputs of every config against the first's
    python3 scripts/bench_multiturn.py --outdir "$W/multiturn" --json "$W/multiturn/multiturn.json" \
        --configs offload-lru offload-arc kvelastic --variant async:KVELASTIC_CPU_LOAD=async \
        ${MULTITURN_ARGS:-} 2>&1 | tee "$W/multiturn.log" ;;
connectors-simple|connectors-offload)  # issue 17: each about 4-6 min on an H100 (4 engines, enforce-eager)
    # 256 MiB of GPU KV (8k tokens; vanilla: --kv-cache-memory-bytes, kvelastic: KVELASTIC_LIMIT) under
    # 48 prompts of up to ~2.5k tokens, twice: the second pass must load from the connector's CPU copies.
    # Outputs token-identical to the same connector on vanilla; memory after 8 idle seconds (TTL 2 s).
    if [ "$stage" = connectors-simple ]; then modes="simple-eager simple-lazy"; else modes="offload-lru offload-arc"; fi
    ver=$(python3 -c 'import vllm; print(vllm.__version__)')
    e2e --model scripts/models/llama-1b --outdir "$W/$stage-$ver" --matrix $modes --label="-vllm$ver" \
        --kve-env KVELASTIC_LIMIT=256MiB KVELASTIC_CACHE_TTL=2 --summary "$W/$stage-$ver/summary.json" \
        --extra --eager --vanilla-kv-bytes $((256 << 20)) --cpu-bytes $((4 << 30)) --prompts 48 \
        --min-len 1000 --max-len 1800 --max-tokens 32 --idle-after 8 2>&1 | tee "$W/$stage-$ver.log" ;;
serve)
    python3 scripts/check_serve_metrics.py --outdir "$W/serve" 2>&1 | tee "$W/serve.log" ;;
startup)  # about 5 min: 7 engine starts, vanilla between the others
    python3 scripts/bench_startup.py --outdir "$W/startup" --json "$W/startup/startup.json" ${STARTUP_ARGS:-} \
        2>&1 | tee "$W/startup.log" ;;
reload)
    python3 scripts/bench_reload.py --outdir "$W/reload" --json "$W/reload/reload.json" --reps 3 ${RELOAD_ARGS:-} \
        2>&1 | tee "$W/reload.log" ;;
reload-idle-busy)  # issue 16: about 8 min: the 16k reload of an idle engine, then of a busy one, each against the connector
    # RELOAD_MODES="idle" RELOAD_REPS=9: one mode, more reps (3 reps spread 67-168 ms on an H100, 2026-11-28)
    for mode in ${RELOAD_MODES:-idle busy}; do
        busy=""; [ $mode = busy ] && busy="--busy-before 0.6"
        python3 scripts/bench_reload.py --outdir "$W/reload-$mode" --json "$W/reload-$mode/reload.json" --reps ${RELOAD_REPS:-3} \
            --configs kvelastic offload-arc $busy ${RELOAD_ARGS:-} 2>&1 | tee "$W/reload-$mode.log" || break
    done ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
rc=$?
tar czf "$OUT/$stage.tgz" -C "$W" . && rm -rf "$W"
exit $rc
