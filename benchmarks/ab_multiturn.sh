#!/usr/bin/env bash
# The multi-turn offload benchmark, this checkout's kvelastic beside an older commit's, alternated in one
# device call (machines differ by ~10 % from call to call, and a call drifts as it goes, so an A/B must
# share one call, in an order that is the same read both ways).
#   AB_ORDER="old new new old" bash benchmarks/ab_multiturn.sh OLD_TREE.tar.gz [bench_multiturn args...]
# OLD_TREE.tar.gz: `git archive --format=tar.gz -o .ab/old.tar.gz <commit> -- . ':!benchmarks/results'`
# (an untracked file travels with the working tree). AB_ORDER's words are old, new and vanilla (vLLM
# without kvelastic), each optionally with a variant, new.NAME, run with the settings AB_ENV_NAME holds
# (AB_ORDER="old new new.si1ms old" AB_ENV_si1ms="KVELASTIC_SWITCH_INTERVAL=0.001"); each is one bench_multiturn.py run of about 2 minutes with the default workload,
# so four fit a call. Each run's JSON is $W/multiturn/TAG-N.json; benchmarks/ab_table.py tabulates them
# (per run, the median of each tree's rounds, new/old, tokens against the first run). Output: $OUT/ab.tgz
set -uo pipefail
old_tar=$1; shift
OUT=${OUT:-./gpu-out}
W=$OUT/w-ab; mkdir -p "$W/multiturn" "$W/scratch"
here=$(pwd); old=/root/kvelastic-old
rm -rf "$old"; mkdir -p "$old"; tar xzf "$old_tar" -C "$old"
installed=
install() {
    [ "$installed" = "$1" ] && return 0
    python3 -m pip install -q --no-deps --no-build-isolation -e "$1" >>"$W/install.log" 2>&1 && installed=$1
}
run() {  # TAG N [bench args]: one run of the tree TAG names (with TAG's variant settings), kept as TAG-N
    local tag=$1 n=$2 tree=$here config=kvelastic settings=
    shift 2
    case "$tag" in
        old|old.*) tree=$old ;;
        vanilla|vanilla.*) config=vanilla ;;
    esac
    if [ "${tag#*.}" != "$tag" ]; then
        local var="AB_ENV_${tag#*.}"
        settings=${!var:-}
        [ -n "$settings" ] || { echo "$tag-$n: $var is empty"; return 1; }
    fi
    install "$tree" || { echo "$tag-$n: install of $tree failed (install.log)"; return 1; }
    env ${settings//,/ } python3 benchmarks/bench_multiturn.py --outdir "$W/scratch" --json "$W/scratch/last.json" --configs "$config" "$@" \
        && mv "$W/scratch/$config.json" "$W/multiturn/$tag-$n.json" \
        && mv "$W/scratch/$config.log" "$W/multiturn/$tag-$n.log" \
        || { mv "$W/scratch/$config.log" "$W/multiturn/$tag-$n.failed.log" 2>/dev/null; return 1; }
}
{
  n=0
  for tag in ${AB_ORDER:-old new new old}; do
      n=$((n + 1))
      echo "== $tag-$n ($(date +%T))"
      run "$tag" "$n" "$@" || echo "$tag-$n failed"
  done
  python3 benchmarks/ab_table.py "$W/multiturn" --json "$W/ab.json"
} 2>&1 | tee "$W/ab.log"
tar czf "$OUT/ab.tgz" -C "$W" ab.log ab.json install.log multiturn
