"""``--variant NAME:KVELASTIC_VAR=VALUE[,...]``: one more kvelastic configuration in a benchmark's run.

One parser for every benchmark that runs configurations side by side, so that an A/B of a
setting (``--variant noreserve:KVELASTIC_RESERVE=0``) reads the same everywhere.

``PYTHONPATH=TREE`` runs the configuration on another kvelastic tree (an older commit unpacked by
``benchmarks/old_tree.sh``), so two trees can run side by side, rounds interleaved, in one call: the
engine imports ``kvelastic`` from ``TREE`` ahead of the installed checkout.
"""

from __future__ import annotations


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``("kvelastic-NAME", {VAR: VALUE, ...})``; SystemExit naming the flag on anything else."""
    name, _, settings = text.partition(":")
    env = dict(pair.split("=", 1) for pair in settings.split(",") if "=" in pair)
    malformed = [pair for pair in settings.split(",") if pair and "=" not in pair]
    if not name or malformed or not all(k.startswith("KVELASTIC_") or k == "PYTHONPATH" for k in env):
        raise SystemExit(f"--variant {text!r}: expected NAME:KVELASTIC_VAR=VALUE[,...] (or PYTHONPATH=TREE)")
    return f"kvelastic-{name}", env
