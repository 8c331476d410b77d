#!/usr/bin/env bash
# The README's quick start on a GPU machine, as written where it can be: a device has no network,
# so vLLM comes from a staged bundle instead of `pip install vllm==0.25.0`, and the `vllm serve`
# example serves the shipped 1B config with dummy weights instead of downloading
# meta-llama/Llama-3.1-8B-Instruct. Everything else is the README's commands, pasted.
# Run from the repo root after staging a bundle and `. .gpu/meta/env.sh`; writes $OUT/quickstart.tgz.
set -uo pipefail
OUT=${OUT:-./gpu-out}
W=$OUT/quickstart
mkdir -p "$W"
exec > >(tee "$W/transcript.txt") 2>&1
vllm() { python3 -m vllm.entrypoints.cli.main "$@"; }  # the bundle installs no `vllm` script
say() { echo; echo "\$ $*"; }
health() { curl -sf --max-time 5 "http://127.0.0.1:$1/health" >/dev/null; }
wait_health() {  # wait_health PORT SECONDS
    local t=0
    until health "$1"; do sleep 2; t=$((t + 2)); [ "$t" -ge "$2" ] && return 1; done
    return 0  # an until loop's status is its body's last command's, here the failed deadline test
}
complete() {  # complete PORT MODEL: one greedy completion, its text printed
    curl -s "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"$2\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0}" |
        python3 -c 'import json,sys; r=json.load(sys.stdin); print("completion:", r["choices"][0]["text"][:60].encode())'
}

say "pip install . (offline: python3 -m pip install --no-deps --no-build-isolation -e .)"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
say "kvelastic --version"; kvelastic --version

MODEL=kvelastic/models/llama-1b
say "KVELASTIC=1 vllm serve $MODEL --load-format dummy --port 8000"
start=$(date +%s)
KVELASTIC=1 vllm serve "$MODEL" --load-format dummy --port 8000 >"$W/vllm-serve.log" 2>&1 &
pid=$!
if wait_health 8000 240; then
    echo "ready after $(($(date +%s) - start)) s"
    grep -h "kvelastic" "$W/vllm-serve.log" | cut -c1-240 | head -8
    complete 8000 "$MODEL"
else
    echo "not ready after 240 s"; tail -20 "$W/vllm-serve.log"
fi
kill -INT "$pid"; wait "$pid"; echo "vllm serve exited with $?"

say "kvelastic launch --dry-run"; kvelastic launch --dry-run; echo "exit $?"
say "kvelastic launch"
kvelastic launch >"$W/launch.log" 2>&1 &
launcher=$!
if wait_health 8001 300 && wait_health 8002 300; then
    cat "$W/launch.log" | grep -v "^(" | head -20
    names=$(curl -s http://127.0.0.1:8001/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
    complete 8001 "$names"
    say "kvelastic status"; kvelastic status
    first=$(kvelastic status --json | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["accounts"][0]["members"][0]["name"])' 2>/dev/null)
    if [ -n "$first" ]; then say "kvelastic limit $first 1GiB"; kvelastic limit "$first" 1GiB; echo "exit $?"; fi
    sleep 2
    say "kvelastic status --json"; kvelastic status --json | head -40
else
    echo "launcher's servers not ready"; tail -30 "$W/launch.log"
fi
kill -INT "$launcher"; wait "$launcher"; echo "kvelastic launch exited with $? after Ctrl-C"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
tar czf "$OUT/quickstart.tgz" -C "$OUT" quickstart
