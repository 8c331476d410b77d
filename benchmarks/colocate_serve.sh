#!/usr/bin/env bash
# Two plain `vllm serve` of vLLM 0.34+ on one GPU, started one after the other with no
# --gpu-memory-utilization, then loaded in turns (co-location by default).
#   bash benchmarks/colocate_serve.sh kvelastic   # KVELASTIC=1: both start, both serve, memory moves between them
#   bash benchmarks/colocate_serve.sh vanilla     # plain 0.34 (its extensible cache takes the GPU): the second is
#                                                 # expected to fail (docs/vllm-0.34.md)
#   bash benchmarks/colocate_serve.sh split       # plain 0.34 with a hand split: --gpu-memory-utilization 0.45 each
#   bash benchmarks/colocate_serve.sh sleep       # KVELASTIC=1 with --enable-sleep-mode: before each turn the idle
#                                                 # server sleeps (level 1) and the busy one wakes
# Dummy-weight 1B servers (scripts/models/llama-1b, config only). Each turn sends CO_REQUESTS (24)
# prompts of about 1.5k tokens to one server, CO_TURNS (6) turns alternating a, b, a, b, ...; greedy,
# 64 tokens; a server's completions must be the same on each of its turns. Output: $OUT/colocate-CONFIG.tgz
# with steps.log (each start's outcome, each turn's completions, each sleep and wake), memory.csv (nvidia-smi every second: used MiB per process), status.jsonl (`kvelastic
# status --json` every second, kvelastic only) and the servers' logs. Exit 0 when both servers
# started and every request of every turn completed, 1 otherwise (what `vanilla` is expected to give).
# Knobs: CO_MODEL, CO_TURNS, CO_REQUESTS, CO_EAGER=1 (no CUDA graphs: faster starts), CO_SETTLE_S (20:
# seconds between the first server's /health and the second's start, so the first has given back its
# warm-up groups: vLLM's profiling asserts that no other process frees memory while it profiles).
set -uo pipefail
export PYTHONUNBUFFERED=1
config=${1:?usage: bash benchmarks/colocate_serve.sh kvelastic|vanilla|split}
OUT=${OUT:-./gpu-out}
W=$OUT/w-colocate-$config
mkdir -p "$W/servers"
MODEL=$(realpath "${CO_MODEL:-scripts/models/llama-1b}")
NAMES=(a b)
PORTS=(8201 8202)
ARGS=(--load-format dummy --max-model-len 4096 --seed 0)
[ "${CO_EAGER:-0}" = 1 ] && ARGS+=(--enforce-eager)
began=$(date +%s)
PIDS=()
SAMPLER=
step() { echo "[$(($(date +%s) - began))s] $*" | tee -a "$W/steps.log"; }

case $config in
kvelastic) ENV=(KVELASTIC=1) ;;
vanilla) ENV=(KVELASTIC=0) ;;
split) ENV=(KVELASTIC=0); ARGS+=(--gpu-memory-utilization 0.45) ;;
sleep) ENV=(KVELASTIC=1 VLLM_SERVER_DEV_MODE=1); ARGS+=(--enable-sleep-mode) ;;  # dev mode: /sleep, /wake_up
*) echo "unknown config $config" >&2; exit 2 ;;
esac

start() {  # start INDEX: one server in its own process group; true once /health answers
    local i=$1 deadline=$(($(date +%s) + 600))
    env "${ENV[@]}" KVELASTIC_NAME="${NAMES[i]}" KVELASTIC_PORT="${PORTS[i]}" setsid \
        python3 -m vllm.entrypoints.cli.main serve "$MODEL" --port "${PORTS[i]}" \
        --served-model-name "${NAMES[i]}" "${ARGS[@]}" >"$W/servers/${NAMES[i]}.log" 2>&1 </dev/null &
    PIDS+=($!)
    while [ "$(date +%s)" -lt "$deadline" ]; do
        curl -sf "localhost:${PORTS[i]}/health" >/dev/null && { step "server ${NAMES[i]} started"; return 0; }
        kill -0 "${PIDS[-1]}" 2>/dev/null || break
        sleep 2
    done
    step "server ${NAMES[i]} did not start: $(grep -hE 'Error|error' "$W/servers/${NAMES[i]}.log" | tail -2)"
    return 1
}

sample() {  # memory per process and (kvelastic) the account, once a second
    while :; do
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits \
            | sed "s/^/$(date +%s.%N | cut -c1-14),/" >>"$W/memory.csv"
        [ "$config" != vanilla ] && [ "$config" != split ] && python3 -m kvelastic status --json 2>/dev/null | tr -d '\n' >>"$W/status.jsonl" \
            && echo >>"$W/status.jsonl"
        sleep 1
    done
}

turn() {  # turn T INDEX N: N concurrent requests to one server; prints how many completed
    local t=$1 i=$2 n=$3 k ok=0 words
    words=$(printf 'the quick brown fox jumps over the lazy dog %.0s' $(seq 1 160))
    for k in $(seq 1 "$n"); do
        curl -sf -m 300 "localhost:${PORTS[i]}/v1/completions" -H 'Content-Type: application/json' \
            -d "{\"model\": \"${NAMES[i]}\", \"prompt\": \"$k $words\", \"max_tokens\": 64, \"temperature\": 0}" \
            -o "$W/turn-$t-$k.json" &
    done
    wait  # runs in $(...): its only children are these requests
    for k in $(seq 1 "$n"); do grep -q '"finish_reason"' "$W/turn-$t-$k.json" 2>/dev/null && ok=$((ok + 1)); done
    echo "$ok"
}

same_as_first() {  # same_as_first T INDEX N: this turn's completions are the server's first turn's (greedy)
    local t=$1 i=$2 n=$3 k
    for k in $(seq 1 "$n"); do
        python3 -c 'import json, sys; a, b = (json.load(open(f))["choices"][0]["text"] for f in sys.argv[1:]); sys.exit(a != b)' \
            "$W/turn-$i-$k.json" "$W/turn-$t-$k.json" 2>/dev/null || return 1
    done
}

dev() {  # dev INDEX POST|GET PATH: one of vLLM's dev-mode endpoints, its answer in steps.log
    step "server ${NAMES[$1]} $3: $(curl -s -m 120 -X "$2" "localhost:${PORTS[$1]}$3")"
}

stop() {
    local pid
    [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null
    for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    sleep 10
    for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
}

sample & SAMPLER=$!
rc=0
if start 0; then
    sleep "${CO_SETTLE_S:-20}"
    start 1 || rc=1
else
    rc=1
fi
if [ "$rc" = 0 ]; then
    for t in $(seq 0 $((${CO_TURNS:-6} - 1))); do
        i=$((t % 2)) n=${CO_REQUESTS:-24}
        if [ "$config" = sleep ]; then  # the idle server sleeps, the busy one wakes
            dev $((1 - i)) POST "/sleep?level=1"
            [ "$t" -ge 1 ] && dev "$i" POST /wake_up  # asleep since the turn before
            sleep 3  # the sleeper's pages are back in the account; memory.csv shows its process
        fi
        done_n=$(turn "$t" "$i" "$n")
        same=first
        [ "$t" -ge 2 ] && { same_as_first "$t" "$i" "$n" && same=yes || { same=NO; rc=1; }; }
        step "turn $t: server ${NAMES[i]} completed $done_n/$n, completions as its first turn's: $same"
        [ "$done_n" = "$n" ] || rc=1
        sleep 5  # the idle server's cached groups expire (KVELASTIC_CACHE_TTL) and go to the busy one
    done
fi
grep -hE "kvelastic: KV cache virtual|Disabling the extensible KV cache|Available KV cache memory|GPU KV cache size|Free memory on device|CUDA out of memory" \
    "$W"/servers/*.log >"$W/kv_sizes.txt" 2>/dev/null
stop
step "done (exit $rc)"
tar czf "$OUT/colocate-$config.tgz" -C "$W" . && rm -rf "$W"
exit "$rc"
