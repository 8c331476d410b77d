#!/usr/bin/env bash
# The multi-turn offload benchmark, this checkout's kvelastic beside an older commit's, in one device
# call (the machines differ by ~10 % from call to call, so an A/B must share one).
#   bash benchmarks/ab_multiturn.sh OLD_TREE.tar.gz [bench_multiturn args...]
# OLD_TREE.tar.gz: `git archive --format=tar.gz -o .ab/old.tar.gz <commit> -- . ':!benchmarks/results'`
# (an untracked file travels with the working tree). It first installs kvelastic from the old tree for one kvelastic run (kvelastic-old), then this checkout for
# vanilla and kvelastic, and tabulates the three side by side (outputs compared with vanilla's). Output: $OUT/ab.tgz
set -uo pipefail
old_tar=$1; shift
OUT=${OUT:-./gpu-out}
W=$OUT/w-ab; mkdir -p "$W/multiturn"
here=$(pwd); old=/root/kvelastic-old
rm -rf "$old"; mkdir -p "$old"; tar xzf "$old_tar" -C "$old"
install() { python3 -m pip install -q --no-deps --no-build-isolation -e "$1" >"$W/install-$(basename "$1").log" 2>&1; }
bench() { python3 scripts/bench_multiturn.py --outdir "$W/multiturn" --json "$W/multiturn/$1.json" "${@:2}"; }
{
  install "$old" && bench old --configs kvelastic "$@" \
      && mv "$W/multiturn/kvelastic.json" "$W/multiturn/kvelastic-old.json" \
      && mv "$W/multiturn/kvelastic.log" "$W/multiturn/kvelastic-old.log"
  install "$here" && bench new --configs vanilla kvelastic "$@"
  bench ab --configs vanilla kvelastic --variant old: --collect-only "$@"
} 2>&1 | tee "$W/ab.log"
tar czf "$OUT/ab.tgz" -C "$W" .
