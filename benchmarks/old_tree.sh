#!/usr/bin/env bash
# Unpack another commit's kvelastic beside this checkout, for `--variant NAME:PYTHONPATH=DIR`:
#   bash benchmarks/old_tree.sh .ab/old.tar.gz /root/kvelastic-old
# OLD.tar.gz: `git archive --format=tar.gz -o .ab/old.tar.gz COMMIT -- kvelastic patches` (an ignored folder
# named in the device call's carry). The package's `kvelastic.patches` lives in `patches/` (setup.py maps it);
# here it is linked into the package, so that the old tree imports whole from DIR and never from this checkout.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 OLD.tar.gz DIR" >&2; exit 2; }
rm -rf "$2"; mkdir -p "$2"; tar xzf "$1" -C "$2"
[ -e "$2/kvelastic/patches" ] || ln -s ../patches "$2/kvelastic/patches"
python3 - "$2" <<'PY'
import os, subprocess, sys
out = subprocess.run([sys.executable, "-c", "import kvelastic, kvelastic.patches as p; print(kvelastic.__file__, p.__file__)"],
                     env=dict(os.environ, PYTHONPATH=sys.argv[1]), capture_output=True, text=True, check=True, cwd="/")
assert all(path.startswith(sys.argv[1]) for path in out.stdout.split()), out.stdout
print("old tree imports from", sys.argv[1])
PY
