#!/usr/bin/env bash
# Start several kvelastic-enabled vLLM servers on one GPU (see kvelastic/launch.py):
#   scripts/launch.sh                       # two dummy-weight llama-1b servers on 8001/8002
#   scripts/launch.sh --config fleet.yaml   # instances from a YAML file
#   scripts/launch.sh --model M --port 8001 --limit 8GiB --and --model M2 --port 8002 --min 2GiB
# PYTHON selects the interpreter (default: python3 on PATH).
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-python3}" -m kvelastic.launch "$@"
