"""Which of kvelastic's vLLM contacts a new release moved, read from its source alone.

    python -m kvelastic_dev.contacts_moved 0.35.0              # against the newest listed release
    python -m kvelastic_dev.contacts_moved 0.35.0 --against 0.33.0

The first step of adding a release (``docs/version-matrix.md``, "Adding a vLLM
release"), before anything is declared: both releases' sources are fetched
(``kvelastic_dev.vllm_source``, cached), and every contact of every patch that
claims the older release is judged in the newer one *as if its declaration
reached it*, with the gate's own rules and words. Each contact gets one verdict:

- ``moved``: missing, reshaped, or present though declared absent; the matrix
  will fail on it once the release is listed. Declare a range or a new shape.
- ``body``: same shape, but its ``def``/``class`` changed (docstrings left out).
  Nothing fails; read what changed before trusting what kvelastic does with it.
- ``same``: unchanged.

Then what vLLM uses of the objects kvelastic replaces (the block pool's free
queue, the free queue SimpleCPUOffloadConnector's lazy mode walks) against what
is declared for the older release, and how the one KV backing is made (one
``torch.zeros``, or the ``allocate`` hook). Exit status 0 when nothing moved, 1
when something did, 2 when a source could not be had.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kvelastic.patching.spec import Target
from kvelastic.patching.versions import Version


@dataclass(frozen=True)
class Verdict:
    """One contact in the newer release: ``moved``, ``body`` or ``same``, the patches holding it, and why."""

    target: Target
    patches: tuple[str, ...]
    kind: str
    detail: str = ""


def _normalized(node: ast.AST) -> str:
    """The statement without docstrings or positions: what a change of behaviour would change."""
    node = ast.parse(ast.unparse(node))  # a copy, positions dropped
    for each in ast.walk(node):
        body = getattr(each, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            each.body = body[1:] or [ast.Pass()]
    return ast.dump(node, annotate_fields=False)


def _body(root: Path, target: Target) -> str | None:
    from kvelastic.patching import source

    try:
        return _normalized(source.definition(root, target))
    except source.StaticLookupError:
        return None


def contacts(baseline: Version) -> dict[Target, tuple[str, ...]]:
    """Every contact of every patch claiming ``baseline``, with the names of the patches that list it."""
    from kvelastic.patches import ALL_PATCHES

    held: dict[Target, list[str]] = {}
    for patch in ALL_PATCHES:
        if patch.claims(baseline):
            for target in patch.targets:
                held.setdefault(target, []).append(patch.name)
    return {target: tuple(names) for target, names in held.items()}


def judge(old_root: Path, new_root: Path, baseline: Version,
          held: dict[Target, tuple[str, ...]] | None = None) -> list[Verdict]:
    """Each contact of ``baseline`` (or of ``held``) judged in ``new_root`` by ``baseline``'s declaration, then
    by its body."""
    from kvelastic.patching import source

    verdicts = []
    for target, patches in (contacts(baseline) if held is None else held).items():
        problem = source.check_target(new_root, target, baseline)
        if problem:
            verdicts.append(Verdict(target, patches, "moved", problem))
            continue
        before, after = _body(old_root, target), _body(new_root, target)
        verdicts.append(Verdict(target, patches, "body" if before != after else "same"))
    return sorted(verdicts, key=lambda v: ({"moved": 0, "body": 1, "same": 2}[v.kind], v.target.path))


def replaced_objects(new_root: Path, baseline: Version) -> list[str]:
    """What vLLM uses of the objects kvelastic replaces, where it differs from ``baseline``'s declarations."""
    from kvelastic.patches.block_pool_queue import free_queue_members
    from kvelastic.patches.offload_connectors import lazy_walk_members
    from kvelastic_dev import static_check

    lines = []
    used = static_check.attributes_used_on(new_root, "vllm.v1.core", "free_block_queue")
    declared = set(free_queue_members(baseline))
    if used != declared:
        lines.append(f"free_block_queue members used {sorted(used)}, declared {sorted(declared)} "
                     "(patches/block_pool_queue.py)")
    walked = static_check.attributes_used_on_name(new_root, "vllm.v1.simple_kv_offload", "free_queue")
    if walked != set(lazy_walk_members(baseline)):
        lines.append(f"lazy offload walks {sorted(walked)}, declared {sorted(lazy_walk_members(baseline))} "
                     "(patches/offload_connectors.py)")
    return lines


def backing(new_root: Path) -> str:
    """How vLLM's ``allocate_kv_cache`` makes the one backing in ``new_root`` (what kvelastic serves)."""
    from kvelastic.patches import single_backing
    from kvelastic_dev import static_check

    allocator = single_backing.ALLOCATOR
    try:
        zeros = static_check.torch_calls(new_root, allocator.module, allocator.qualname)
        hooks = static_check.calls_of_name(new_root, allocator.module, allocator.qualname,
                                           single_backing.ALLOCATE_HOOK)
    except (OSError, ValueError):
        return "allocate_kv_cache: not found where band C and D have it"
    return f"allocate_kv_cache: {len(zeros)} torch call(s), {len(hooks)} call(s) of its allocate hook"


def report(release: str, against: str) -> tuple[list[str], bool]:
    """The lines to print and whether any contact moved."""
    from kvelastic_dev import vllm_source

    new_root, old_root = vllm_source.fetch_source(release), vllm_source.fetch_source(against)
    baseline = Version.parse(against)
    verdicts = judge(old_root, new_root, baseline)
    counts = {kind: sum(v.kind == kind for v in verdicts) for kind in ("moved", "body", "same")}
    lines = [f"vLLM {release} against {against}: {len(verdicts)} contacts, {counts['moved']} moved, "
             f"{counts['body']} with changed bodies, {counts['same']} the same"]
    for verdict in verdicts:
        if verdict.kind != "same":
            where = ", ".join(verdict.patches)
            lines.append(f"{verdict.kind:5} {verdict.target.path} [{where}]"
                         + (f": {verdict.detail}" if verdict.detail else ""))
    extra = replaced_objects(new_root, baseline)
    lines += [f"moved {line}" for line in extra]
    lines.append(backing(new_root))
    return lines, bool(counts["moved"] or extra)


def main(argv: Sequence[str] | None = None) -> int:
    from kvelastic_dev.releases import RELEASES
    from kvelastic_dev.remote_zip import SourceFetchError

    parser = argparse.ArgumentParser(description="the contacts a vLLM release moved, from its source alone")
    parser.add_argument("release", help="the new release, e.g. 0.35.0")
    parser.add_argument("--against", default=RELEASES[-1], help="a listed release (default: the newest)")
    args = parser.parse_args(argv)
    if args.against not in RELEASES:
        parser.error(f"--against must be a listed release (kvelastic_dev/releases.py), not {args.against}")
    try:
        lines, moved = report(args.release, args.against)
    except SourceFetchError as error:
        print(f"contacts_moved: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 1 if moved else 0


if __name__ == "__main__":
    raise SystemExit(main())
