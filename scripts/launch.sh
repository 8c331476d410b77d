#!/usr/bin/env bash
# A thin wrapper around `kvelastic launch` (see kvelastic/launcher/command.py), for a Python whose scripts are
# not on PATH. Paths are the caller's: nothing here changes directory.
#   scripts/launch.sh                       # two dummy-weight llama-1b servers on 8001/8002
#   scripts/launch.sh --config fleet.yaml   # instances from a YAML file
#   scripts/launch.sh --model M --port 8001 --limit 8GiB --and --model M2 --port 8002 --min 2GiB
# PYTHON selects the interpreter (default: python3 on PATH); kvelastic must be installed in it.
exec "${PYTHON:-python3}" -m kvelastic launch "$@"
