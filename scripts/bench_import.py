"""What kvelastic adds to ``import vllm``: fresh interpreters with and without ``KVELASTIC=1``.

Each round starts one interpreter per mode, alternating, and times ``import
vllm`` inside it (the ``.pth`` hook and kvelastic's activation run within that
import when ``KVELASTIC=1``). A third mode times what start-up cost before
patches were applied on import: activation with every patched module imported
up front (the gate then checks them imported). Prints the median and spread
of each mode's wall and CPU time (the CPU time of the interpreter itself, a
steadier figure on a shared machine), and the medians' differences. Nothing is asserted: timings
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
started, cpu = time.perf_counter(), time.process_time()
import vllm
imported = time.perf_counter()
if {eager}:
    import importlib
    from kvelastic.patches import ALL_PATCHES
    from kvelastic.patching.versions import installed_vllm_version
    version = installed_vllm_version()
    for module in sorted({{t.module for p in ALL_PATCHES if p.claims(version) for t in p.targets}}):
        importlib.import_module(module)
print(json.dumps({{"wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}}))
"""

MODES = {
    "vanilla": ({}, False),
    "kvelastic": ({"KVELASTIC": "1"}, False),
    "eager-modules": ({"KVELASTIC": "1"}, True),
}


def one_run(extra_env: dict[str, str], eager: bool) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVELASTIC")}
    env.update(extra_env)
    done = subprocess.run([sys.executable, "-c", CHILD.format(eager=eager)], env=env, capture_output=True,
                          text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    for _ in range(args.rounds):
        for mode in args.modes:
            runs[mode].append(one_run(*MODES[mode]))
    for clock in ("wall_s", "cpu_s"):
        medians = {mode: statistics.median(r[clock] for r in values) for mode, values in runs.items()}
        for mode, values in runs.items():
            spread = [r[clock] for r in values]
            print(f"{clock[:-2]:4s} {mode:14s} median {medians[mode]:6.2f} s  (min {min(spread):.2f}, "
                  f"max {max(spread):.2f}, {len(spread)} runs)")
        for mode in (m for m in medians if m != "vanilla" and "vanilla" in medians):
            print(f"{clock[:-2]:4s} {mode} adds {medians[mode] - medians['vanilla']:+.2f} s to import vllm")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
