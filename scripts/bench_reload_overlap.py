"""On a GPU: a 16k-token 8B reload with its page groups mapped first, or loaded a group at a time as mapped.

The host tier's reload of a prefix whose groups were given back maps each
group (``cuMemCreate``/``cuMemMap``/``cuMemSetAccess`` for 32 pages of 8 MiB)
while vLLM looks its blocks up; since the loads were issued in pieces
(``OffloadManager.load_on_miss``), the copy of one group runs while the next
is mapped. This times the two orders on kvelastic's own pool and copier, no
vLLM: 32 tensors of blocks of 64 KiB (blocks first, 128 blocks per group, as
the 8B engine's), ``--groups`` groups released to the device before each round
(as after the idle unmap), a host tier buffer pinned as the engine pins it.

* ``copy only``: groups already mapped, one load of every block (the copy's floor);
* ``map, then load``: map the groups one by one, then one load (before the change);
* ``map all, then load``: one map call for every group, then one load;
* ``map+load per group``: map a group, issue its blocks' load, next group (after).

Wall time from the first map to the copy done (the host waits on the last
event). Every round's data is checked against the host rows.

    python scripts/bench_reload_overlap.py --rounds 7 --json $OUT/overlap.json

Measured on an H200 (2026-11-27, 7 rounds, medians, the ``tier`` host): copy only 44.1 ms,
map then load 61.4, map all then load 57.9, map+load per group 54.2-54.8. Two host kinds in
one process failed ("resource already mapped") before the buffer was freed between kinds;
the fix (``memory.free()``) has not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

MIB = 1 << 20
BLOCK_PER_LAYER = 64 * 1024  # 16 tokens x 8 KV heads x 128 x bf16 x (K, V)
LAYERS = 32


def setup(groups: int, page: int, host_kind: str):
    from kvelastic.offload.copier import BlockCopier
    from kvelastic.offload.host_tier import allocate_slots
    from kvelastic.pool import PagePool
    from kvelastic.pool.cuda import CudaBackend

    per_group = page // BLOCK_PER_LAYER
    blocks = (groups + 1) * per_group
    pool = PagePool.standard(CudaBackend(), page_bytes=page, park=False, zero_on_map="fresh")
    raws = [pool.add_tensor(blocks * BLOCK_PER_LAYER) for _ in range(LAYERS)]
    views = [raw.view(blocks, BLOCK_PER_LAYER) for raw in raws]
    slots = groups * per_group * (8 if host_kind == "tier16" else 1)  # tier16: a 16 GiB tier, as the engine's
    memory = allocate_slots(slots, LAYERS * BLOCK_PER_LAYER, pin=True, at_start=host_kind == "torch")
    memory.wait()
    rows = memory.buffer
    rows.copy_(torch.randint(-128, 127, (1, rows.shape[1]), dtype=torch.int8).expand_as(rows))
    rows[:, ::4096] = torch.randint(-128, 127, (rows.shape[0], rows.shape[1] // 4096), dtype=torch.int8)  # per row
    copier = BlockCopier(views, memory.buffer, path="direct", breaks=memory.breaks)
    return pool, views, memory, copier, per_group


def one_round(mode: str, pool, views, memory, copier, groups: int, per_group: int) -> float:
    group_ids = list(range(1, groups + 1))
    if mode == "copy only":
        pool.map_groups(group_ids)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if mode == "map+load per group":
        for g in group_ids:
            pool.map_groups([g])
            ids = list(range(g * per_group, (g + 1) * per_group))
            copier.load(ids, [b - per_group for b in ids], block_compute=False)
        copier.fence_compute()
    else:
        if mode == "map, then load":
            for g in group_ids:
                pool.map_groups([g])
        elif mode == "map all, then load":
            pool.map_groups(group_ids)
        ids = list(range(per_group, (groups + 1) * per_group))
        copier.load(ids, [b - per_group for b in ids])
    done = torch.cuda.Event()
    done.record(torch.cuda.default_stream())
    done.synchronize()
    wall = time.perf_counter() - start
    check = [per_group, (groups + 1) * per_group - 1, per_group * (groups // 2) + 7]
    for b in check:
        row = torch.cat([v[b].cpu() for v in views])
        assert torch.equal(row, memory.buffer[b - per_group]), f"{mode}: block {b} differs from its host row"
    pool.unmap_groups(group_ids)
    pool.collect(wait=True)
    pool.trim_reserve(0)  # pages go back to the device, as after the engine's idle unmap
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--page-mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--hosts", nargs="+", default=["tier", "torch"], help="tier: pinned as the engine does; tier16: the same, 16 GiB; torch")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "reload_overlap.json"))
    args = ap.parse_args()
    modes = ("copy only", "map, then load", "map all, then load", "map+load per group")
    report = {"device": torch.cuda.get_device_name(), "args": vars(args), "rows": []}
    print(f"{'host':6s} {'mode':22s} {'median ms':>10s} {'min ms':>8s} {'GB/s':>6s}")
    for host in args.hosts:
        pool, views, memory, copier, per_group = setup(args.groups, args.page_mib * MIB, host)
        nbytes = args.groups * per_group * LAYERS * BLOCK_PER_LAYER
        times: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds + 1):
            for mode in modes:  # interleaved, so drift hits each alike
                t = one_round(mode, pool, views, memory, copier, args.groups, per_group)
                if r:
                    times[mode].append(t)
        for mode in modes:
            med = statistics.median(times[mode])
            report["rows"].append({"host": host, "mode": mode, "median_ms": med * 1e3, "all_ms":
                                   [t * 1e3 for t in times[mode]]})
            print(f"{host:6s} {mode:22s} {med * 1e3:10.2f} {min(times[mode]) * 1e3:8.2f} {nbytes / med / 1e9:6.1f}")
        torch.cuda.synchronize()
        del views, copier  # the copier's device view of the host rows goes before they are unpinned
        memory.free()  # the next kind's buffer must not meet this one's registrations
        pool.close()
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
