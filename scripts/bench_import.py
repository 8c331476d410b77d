"""What kvelastic adds to ``import vllm``: fresh interpreters with and without ``KVELASTIC=1``.

Each round starts one interpreter per mode, alternating, and times ``import
vllm`` inside it (the ``.pth`` hook and kvelastic's activation run within that
import when ``KVELASTIC=1``). A third mode times what start-up cost before
patches were applied on import: activation with every patched module imported
up front (the gate then checks them imported). Prints the median and spread
of each mode, and the medians' differences. Nothing is asserted: timings
depend on the machine (``docs/version-matrix.md`` records runs).

    python scripts/bench_import.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, time
started = time.perf_counter()
import vllm
imported = time.perf_counter()
if {eager}:
    import importlib
    from kvelastic.patches import ALL_PATCHES
    from kvelastic.patching.versions import installed_vllm_version
    version = installed_vllm_version()
    for module in sorted({{t.module for p in ALL_PATCHES if p.claims(version) for t in p.targets}}):
        importlib.import_module(module)
print(json.dumps({{"import_s": imported - started, "total_s": time.perf_counter() - started}}))
"""

MODES = {
    "vanilla": ({}, False),
    "kvelastic": ({"KVELASTIC": "1"}, False),
    "eager-modules": ({"KVELASTIC": "1"}, True),
}


def one_run(extra_env: dict[str, str], eager: bool) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVELASTIC")}
    env.update(extra_env)
    done = subprocess.run([sys.executable, "-c", CHILD.format(eager=eager)], env=env, capture_output=True,
                          text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["total_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {mode: [] for mode in args.modes}
    for _ in range(args.rounds):
        for mode in args.modes:
            times[mode].append(one_run(*MODES[mode]))
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    for mode, values in times.items():
        print(f"{mode:14s} median {medians[mode]:6.2f} s  (min {min(values):.2f}, max {max(values):.2f}, "
              f"{len(values)} runs)")
    if "vanilla" in medians:
        for mode in medians:
            if mode != "vanilla":
                print(f"{mode} adds {medians[mode] - medians['vanilla']:+.2f} s to import vllm (medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
