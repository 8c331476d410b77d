#!/usr/bin/env bash
# Install kvelastic and a real vLLM into one virtual environment per band (the table below), and
# run the test suite in each, so every patch band is tested against real vLLM code. GPU tests skip
# cleanly without CUDA.
#   bash scripts/run_tests.sh            # every band of the table below
#   bash scripts/run_tests.sh -k pool    # extra arguments go to every pytest pass
#   KVELASTIC_BAND_A=0 KVELASTIC_BAND_C=0 bash scripts/run_tests.sh   # band B only (it then runs everything)
#   KVELASTIC_DROP_VENVS=1 ...                     # remove each venv after its run (CI: less disk)
#
# What runs where (tests/suite_parts.py lists the files and says why):
# - The newest band (by vLLM release, of those that run) runs every test. The version-free files,
#   whose tests import no package that differs between bands (not vLLM, torch or transformers), run
#   there only, with those imports made to fail (conftest.py), so a file that starts to depend on a
#   band fails rather than silently leaving the other bands. Files that use torch without vLLM
#   (the host-backed pool, the copiers) run in every band: torch differs per band.
# - The older bands run every file that depends on the band, and tests/test_contact_refusal.py
#   breaks one contact per kind of breakage there instead of every contact.
# - In each band, pytest-xdist runs the files two at a time (the CI machine has two cores; a file
#   stays on one worker, so its module fixtures are built once); the wall-clock-sensitive files
#   (suite_parts.WALL_CLOCK) then run one at a time.
# - While a band's tests run, the next band's venv is built beside them (installs are mostly
#   downloads and unpacking): at most two venvs are on disk with KVELASTIC_DROP_VENVS=1.
# Each pass prints its wall and CPU time; each band its counts (-rfEs: the reason of every skip).
#
# Band C's vLLM 0.33.0 pins torch 2.14.0, which has no CPU build on PyPI: pip takes PyPI's CUDA
# build, which imports and runs on a machine without a GPU (torch.cuda.is_available() is False).
set -euo pipefail
cd "$(dirname "$0")/.."

# One band a line: name, torch, vLLM, venv, and whether it runs (1) or not (0). The bands run in
# this order, each one's venv built while the one before it runs its tests, so only the first
# install is waited for (an install takes 2.5 to 4.5 minutes on two cores; a band's tests take longer).
BANDS=(
    "B 2.13.0 0.28.0 ${KVELASTIC_VENV:-.venv} 1"
    "C 2.14.0 0.33.0 ${KVELASTIC_VENV_BAND_C:-.venv-band-c} ${KVELASTIC_BAND_C:-1}"
    "A 2.11.0 0.23.0 ${KVELASTIC_VENV_BAND_A:-.venv-band-a} ${KVELASTIC_BAND_A:-1}"
    "D 2.14.0 0.34.0 ${KVELASTIC_VENV_BAND_D:-.venv-band-d} ${KVELASTIC_BAND_D:-1}"
)

running=()
for band in "${BANDS[@]}"; do
    read -r _ _ _ _ runs <<< "$band"
    if [ "$runs" != 0 ]; then running+=("$band"); fi
done
[ ${#running[@]} -gt 0 ] || { echo "every band is switched off" >&2; exit 2; }
newest=$(for band in "${running[@]}"; do read -r _ _ vllm _ <<< "$band"; echo "$vllm"; done | sort -V | tail -1)
logs=$(mktemp -d)
installing=""  # the process group of the install running in the background, if any

stop_install() {
    if [ -n "$installing" ]; then kill -- "-$installing" 2>/dev/null || true; wait "$installing" 2>/dev/null || true; fi
    rm -rf "$logs"
}
trap stop_install EXIT

# start_install NAME TORCH VLLM VENV: build the venv in the background, in a process group of its own.
start_install() {
    setsid bash -c 'TIMEFORMAT="== band $0 installed: %R s wall, %U s user + %S s sys CPU"
                    time bash scripts/install_band.sh "$@"' "$1" "$4" "$2" "$3" > "$logs/install-$1.log" 2>&1 &
    installing=$!
}

finish_install() {
    local name=$1 rc=0
    wait "$installing" || rc=$?
    installing=""
    cat "$logs/install-$name.log"
    [ "$rc" = 0 ] || { echo "== band $name: the install failed ($rc)" >&2; exit "$rc"; }
}

# run_pass VENV NAME LABEL PYTEST_ARGS...: one pytest run; exit 5 (nothing selected, say by -k) passes.
run_pass() {
    local venv=$1 name=$2 label=$3 rc=0
    shift 3
    echo "== band $name, $label"
    # --durations: CI's log names the slowest tests of each pass. The subshell's CPU times count
    # pytest and what it starts, not the install that this shell reaps meanwhile.
    (TIMEFORMAT="== band $name, $label: %R s wall, %U s user + %S s sys CPU"
     time KVELASTIC_REQUIRE_VLLM=1 "$venv/bin/python" -m pytest -q -rfEs --durations=8 \
        --junitxml="$logs/$name-$label.xml" "$@") || rc=$?
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"
}

# counts PATTERN: passed, failed and skipped over the passes whose JUnit files match.
counts() {
    python3 - "$logs"/$1.xml <<'EOF'
import sys
import xml.etree.ElementTree as ET

total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in sys.argv[1:]:
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in total:
            total[key] += int(suite.get(key, 0))
failed = total["failures"] + total["errors"]
print(f"{total['tests'] - failed - total['skipped']} passed, {failed} failed, {total['skipped']} skipped")
EOF
}

# run_band NAME TORCH VLLM VENV [pytest args...]
run_band() {
    local name=$1 torch=$2 vllm=$3 venv=$4 start=$SECONDS
    shift 4
    local scope=(--files=per-band --contact-cases=one-per-kind)
    if [ "$vllm" = "$newest" ]; then scope=(--files=per-band); fi
    echo "== kvelastic tests against vLLM $vllm (torch $torch), band $name"
    if [ "$vllm" = "$newest" ]; then
        run_pass "$venv" "$name" version-free-parallel --files=version-free --pace=parallel -n 2 --dist loadfile "$@"
        run_pass "$venv" "$name" version-free-serial --files=version-free --pace=serial "$@"
    fi
    run_pass "$venv" "$name" parallel "${scope[@]}" --pace=parallel -n 2 --dist loadfile "$@"
    run_pass "$venv" "$name" serial "${scope[@]}" --pace=serial "$@"
    echo "== band $name (vLLM $vllm, torch $torch): $(counts "$name-*") in $((SECONDS - start)) s"
}

read -r name torch vllm venv _ <<< "${running[0]}"
start_install "$name" "$torch" "$vllm" "$venv"
for i in "${!running[@]}"; do
    read -r name torch vllm venv _ <<< "${running[$i]}"
    finish_install "$name"
    if [ $((i + 1)) -lt ${#running[@]} ]; then
        read -r next_name next_torch next_vllm next_venv _ <<< "${running[$((i + 1))]}"
        start_install "$next_name" "$next_torch" "$next_vllm" "$next_venv"
    fi
    run_band "$name" "$torch" "$vllm" "$venv" "$@"
    # CI keeps at most two venvs (5-9 GB each) on disk: this one goes before the one after next is built.
    if [ "${KVELASTIC_DROP_VENVS:-0}" = 1 ]; then rm -rf "$venv"; fi
done
echo "== every band, in $SECONDS s:"
echo "total: $(counts "*")"
