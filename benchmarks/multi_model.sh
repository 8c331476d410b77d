#!/usr/bin/env bash
# Many models on one GPU: three Llama-3.1-8B-shaped dummy-weight servers on one GPU, one
# configuration per device call (staging the vLLM bundle first: benchmarks/README.md).
#   bash benchmarks/multi_model.sh static          # vanilla vLLM: a fixed KV share each (MM_KV_GIB)
#   bash benchmarks/multi_model.sh kvelastic       # `kvelastic launch`: one budget of 3 x MM_KV_GIB
#   bash benchmarks/multi_model.sh kvelastic-host  # the same, plus a host tier of MM_CPU_BYTES each
#   bash benchmarks/multi_model.sh kvcached        # runs only where the kvcached package imports
# Arguments after CONFIG go to `multi_model.py run` (e.g. --busy-rate 6 --duration 120).
# Output: $OUT/multi-model-CONFIG.tgz: CONFIG.json (every request, memory and /metrics samples,
# summary), CONFIG.png (if matplotlib imports), server logs, KV sizes and reclaim episode lines
# from the logs, steps.log.
# Environment knobs: MM_KV_GIB (6), MM_CPU_BYTES (8GiB), MM_EAGER=1 (no CUDA graphs: faster start),
# MM_BUDGET_S (540: the client is stopped so that servers are down and the tarball written by then;
# MM_STOP_S, 60, of it kept for that),
# MM_MODEL, MM_TOKENIZER, MM_KVCACHED_ENV ("VAR=VALUE ..." added for kvcached), MM_KVELASTIC_ENV (the same
# for the kvelastic configurations, e.g. "KVELASTIC_CACHE_TTL=5"), MM_VLLM_ARGS (more
# arguments for every server of every configuration: give all the same), MM_API_SERVERS (4) and
# MM_STREAM_INTERVAL (8): vLLM's --api-server-count and --stream-interval for every server. With one
# API server streaming every token, that process was the bottleneck of this workload (H100,
# static: TTFT p50 1.8 s with one, 0.11 s with two and tokens streamed 8 at a time);
# with two, 50 of kvelastic's 57 requests over the TTFT objective still waited while their model's
# two API servers ran at >= 85 % of a core each, so four.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
config=${1:?usage: bash benchmarks/multi_model.sh static|kvelastic|kvelastic-host|kvcached [client args...]}
shift
OUT=${OUT:-./gpu-out}
W=$OUT/w-mm-$config
mkdir -p "$W/servers"
MODEL=$(realpath "${MM_MODEL:-scripts/models/llama-8b}")          # config.json only: --load-format dummy
TOKENIZER=$(realpath "${MM_TOKENIZER:-scripts/models/llama-1b}")  # the 8B config's vocabulary size, bos and eos
KV_GIB=${MM_KV_GIB:-6}       # ~ what --gpu-memory-utilization 0.3 leaves an 8B for KV on an 80 GB H100
BUDGET_S=${MM_BUDGET_S:-540}
NAMES=(model-a model-b model-c)
PORTS=(8101 8102 8103)
VLLM_ARGS=(--load-format dummy --tokenizer "$TOKENIZER" --max-model-len 8192 --seed 0
           --enable-prompt-tokens-details --api-server-count "${MM_API_SERVERS:-4}"
           --stream-interval "${MM_STREAM_INTERVAL:-8}")
[ "${MM_EAGER:-0}" = 1 ] && VLLM_ARGS+=(--enforce-eager)
# shellcheck disable=SC2206 # MM_VLLM_ARGS is a list of words
[ -n "${MM_VLLM_ARGS:-}" ] && VLLM_ARGS+=(${MM_VLLM_ARGS})
began=$(date +%s)
PIDS=()
LAUNCHER=
step() { echo "[$(($(date +%s) - began))s] $*" | tee -a "$W/steps.log"; }

start_plain() {  # vanilla `vllm serve` x3 in parallel, each its own process group; $@: extra env
    local i
    for i in 0 1 2; do
        env "$@" setsid python3 -m vllm.entrypoints.cli.main serve "$MODEL" --port "${PORTS[i]}" \
            --served-model-name "${NAMES[i]}" "${PLAIN_ARGS[@]}" "${VLLM_ARGS[@]}" \
            >"$W/servers/${NAMES[i]}.log" 2>&1 </dev/null &
        PIDS+=($!)
    done
    step "started ${NAMES[*]} (pids ${PIDS[*]}): ${PLAIN_ARGS[*]} $*"
}

start_kvelastic() {  # kvelastic launch, servers started together; every server may grow to the budget
    local i setting args=(--parallel --budget "$((3 * KV_GIB))GiB" --log-dir "$W/servers" --startup-timeout 600
                  --stop-timeout 30)
    for i in 0 1 2; do
        [ "$i" -gt 0 ] && args+=(--and)
        args+=(--model "$MODEL" --port "${PORTS[i]}" --name "${NAMES[i]}" --limit "$((3 * KV_GIB))GiB")
        [ "$config" = kvelastic-host ] && args+=(--env "KVELASTIC_CPU_BYTES=${MM_CPU_BYTES:-8GiB}")
        for setting in ${MM_KVELASTIC_ENV:-}; do args+=(--env "$setting"); done
        args+=(-- --served-model-name "${NAMES[i]}" "${VLLM_ARGS[@]}")
    done
    python3 -m kvelastic launch "${args[@]}" >"$W/launch.log" 2>&1 </dev/null &
    LAUNCHER=$!
    PIDS=("$LAUNCHER")
    step "kvelastic launch (pid $LAUNCHER): ${args[*]}"
}

wait_gone() {  # wait_gone SECONDS PID...: true once none of them runs
    local deadline=$(($(date +%s) + $1)) pid alive
    shift
    while :; do
        alive=0
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && return 0
        [ "$(date +%s)" -ge "$deadline" ] && return 1
        sleep 1
    done
}

stop_servers() {  # TERM each server's process group (the launcher stops its own), then KILL what is left
    local pid groups=()
    if [ -n "$LAUNCHER" ]; then
        groups=($(grep -o 'starting pid [0-9]*' "$W/launch.log" 2>/dev/null | grep -o '[0-9]*$'))
        kill -TERM "$LAUNCHER" 2>/dev/null
        wait_gone 60 "$LAUNCHER" || kill -KILL "$LAUNCHER" 2>/dev/null
    else
        groups=("${PIDS[@]}")
        for pid in "${groups[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    fi
    wait_gone 40 "${groups[@]}" || for pid in "${groups[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
    step "servers stopped; GPU processes left: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs)"
}

finish() {
    local rc=$1
    local facts='GPU KV cache size|Available KV cache memory|Maximum concurrency|kvelastic: KV cache virtual'
    grep -hE "$facts|kvelastic: joined|Traceback|Error" "$W"/servers/*.log >"$W/kv_sizes.txt" 2>/dev/null
    grep -hE "reclaim-episode|fair share" "$W"/servers/*.log >"$W/reclaim_episodes.txt" 2>/dev/null
    if [ -f "$W/$config.json" ] && python3 -c 'import matplotlib' 2>/dev/null; then
        python3 benchmarks/plot_multi_model.py "$W/$config.json" --png "$W/$config.png" >>"$W/steps.log" 2>&1
    fi
    step "done (exit $rc); tarball $OUT/multi-model-$config.tgz"
    tar czf "$OUT/multi-model-$config.tgz" -C "$W" . && rm -rf "$W"
    exit "$rc"
}

{
    nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv
    python3 -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
    python3 -m pip install -q --no-deps --no-build-isolation -e . && python3 -m kvelastic --version
} >"$W/env.txt" 2>&1
step "config $config; $(tail -1 "$W/env.txt")"
busy=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs)
for port in "${PORTS[@]}"; do (: </dev/tcp/127.0.0.1/"$port") 2>/dev/null && busy="$busy port:$port"; done
if [ -n "$busy" ]; then  # servers of an earlier call would be measured instead, or squeeze these out
    groups=$(for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do
                 ps -o pgid= -p "$pid"; done | sort -u | xargs)
    step "GPU processes or ports already in use ($busy): nothing started (left by an earlier call? process" \
         "groups: ${groups:-none}; stop them with kill -TERM -- -PGID, or start a fresh machine)"
    finish 4
fi
case $config in
static)
    PLAIN_ARGS=(--gpu-memory-utilization 0.3 --kv-cache-memory-bytes "$((KV_GIB << 30))")
    start_plain KVELASTIC=0 ;;
kvelastic|kvelastic-host)
    start_kvelastic ;;
kvcached)
    if ! python3 -c 'import kvcached' 2>>"$W/steps.log"; then
        step "kvcached is not importable by python3: nothing started (install it first: benchmarks/README.md)"
        finish 3
    fi
    # Its README: "no need to set memory utilization limit"; its physical total is capped by
    # KVCACHED_GPU_UTILIZATION (0.95 unless MM_KVCACHED_ENV sets it), vLLM's 0.9 bounds each engine.
    # kvcached 0.1.6 refuses vLLM 0.25's default model runner (V2) at start-up and names the way
    # out, VLLM_USE_V2_MODEL_RUNNER=0: set here, so its servers run vLLM's V1 runner
    # while the other configurations run the default one (say so beside any comparison).
    PLAIN_ARGS=()
    # shellcheck disable=SC2086 # MM_KVCACHED_ENV is a list of VAR=VALUE words
    start_plain KVELASTIC=0 ENABLE_KVCACHED=true KVCACHED_AUTOPATCH=1 VLLM_USE_V2_MODEL_RUNNER=0 ${MM_KVCACHED_ENV:-} ;;
*)
    echo "unknown config $config (static, kvelastic, kvelastic-host, kvcached)" >&2
    exit 2 ;;
esac
trap 'stop_servers; finish 130' INT TERM
limit=$((BUDGET_S - ($(date +%s) - began) - ${MM_STOP_S:-60}))  # kept for stopping the servers and the tarball
client=(python3 benchmarks/multi_model.py run --config "$config" --out "$W/$config.json"
        --models "${NAMES[@]}" --ports "${PORTS[@]}" --ready-timeout 420 --deadline "$((limit - 15))")
for pid in "${PIDS[@]}"; do client+=(--watch-pid "$pid"); done
[ "$config" != static ] && [ "$config" != kvcached ] && client+=(--account --server-logs "$W/servers")
step "client (stopped after $limit s at the latest): ${client[*]} $*"
timeout -s TERM -k 20 "$limit" "${client[@]}" "$@" 2>&1 | tee "$W/client.log"
rc=${PIPESTATUS[0]}
nvidia-smi >"$W/nvidia-smi-end.txt" 2>&1
stop_servers
finish "$rc"
