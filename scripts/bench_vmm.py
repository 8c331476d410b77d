#!/usr/bin/env python3
"""Micro-benchmark of CUDA virtual memory management through kvelastic's CudaBackend.

Answers three questions the page pool's design depends on:

(a) what each driver step costs per page (create, map, access, unmap, release),
    and how much a call over a whole run saves against one call per page;
(b) whether memory behind VMM mappings is slower for kernels than cudaMalloc
    memory, as a function of the physical handle size;
(c) how fast pinned host memory copies to and from VMM-backed device memory.

It uses the backend alone (no pool). Every step is guarded: a failure is
printed with its step name, recorded in the JSON, and the rest still runs.
Usage: ``python scripts/bench_vmm.py [--json PATH]`` (about a minute on an H100).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvelastic.pool.backend import MapRun  # noqa: E402
from kvelastic.pool.cuda import CudaBackend  # noqa: E402
from kvelastic.pool.cuda_driver import check, error_name  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30


class Bench:
    """Collects results and failures; each step runs under :meth:`step`."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {"errors": []}

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        print(f"\n== {name}", flush=True)
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:  # report and carry on with the next step
            print(f"!! step '{name}' failed: {exc!r}", flush=True)
            traceback.print_exc()
            self.results["errors"].append({"step": name, "error": repr(exc)})
        finally:
            print(f"   ({time.perf_counter() - start:.1f} s)", flush=True)


def table(headers: list[str], rows: list[list[Any]]) -> None:
    """Print rows under headers, columns padded to their widest cell."""
    cells = [headers] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


def median_us(samples_ns: list[float]) -> float:
    return statistics.median(samples_ns) / 1000.0


# ---------------------------------------------------------------- (a) driver steps


def _timed(samples: list[float], call: Callable[[], Any]) -> Any:
    """Run ``call`` once, appending its wall time (ns) to ``samples``; returns its result."""
    t0 = time.perf_counter_ns()
    result = call()
    samples.append(time.perf_counter_ns() - t0)
    return result


def _one_round(backend: CudaBackend, base: int, npages: int, page: int, s: dict[str, list[float]],
               handles: list[int]) -> None:
    """One create/map/access/unmap/release cycle over ``npages`` pages, per page and per run.

    ``handles`` is the caller's list so that it can clean up after a failure.
    """
    d, acc = backend._driver, backend._access
    total = npages * page
    for _ in range(npages):
        handle = check("cuMemCreate", _timed(s["cuMemCreate"], lambda: d.cuMemCreate(page, backend._prop, 0)))
        handles.append(int(handle))
    addrs = [base + i * page for i in range(npages)]
    for a, h in zip(addrs, handles):
        check("cuMemMap", _timed(s["cuMemMap"], lambda: d.cuMemMap(a, page, 0, h, 0)))
    for a in addrs:
        check("cuMemSetAccess", _timed(s["cuMemSetAccess per page"], lambda: d.cuMemSetAccess(a, page, acc, 1)))
    for a in addrs:
        check("cuMemUnmap", _timed(s["cuMemUnmap per page"], lambda: d.cuMemUnmap(a, page)))
    for a, h in zip(addrs, handles):
        check("cuMemMap", d.cuMemMap(a, page, 0, h, 0))
    check("cuMemSetAccess", _timed(s["cuMemSetAccess one call/run"], lambda: d.cuMemSetAccess(base, total, acc, 1)))
    err = _timed(s["cuMemUnmap one ranged call"], lambda: d.cuMemUnmap(base, total))[0]
    if int(err):
        s["cuMemUnmap one ranged call"].pop()
        s.setdefault("ranged unmap refused", []).append(error_name(err))
        for a in addrs:
            check("cuMemUnmap", d.cuMemUnmap(a, page))
    run = [MapRun(base, tuple(handles))]
    _timed(s["backend.map_runs zero=False"], lambda: backend.map_runs(run, page, zero=False))
    _timed(s["backend.unmap (range)"], lambda: backend.unmap(base, total))
    _timed(s["backend.map_runs zero=True"], lambda: backend.map_runs(run, page, zero=True))
    backend.unmap(base, total)
    while handles:
        h = handles.pop()
        check("cuMemRelease", _timed(s["cuMemRelease"], lambda: d.cuMemRelease(h)))


def _cleanup(backend: CudaBackend, base: int, npages: int, page: int, handles: list[int]) -> None:
    """Best effort after a failed round: unmap every page, release handles, free the range.

    Driver errors are ignored here: some pages are not mapped, and the original
    failure is the one worth reporting.
    """
    d = backend._driver
    with contextlib.suppress(Exception):
        backend.synchronize()
    for i in range(npages):
        with contextlib.suppress(Exception):
            d.cuMemUnmap(base + i * page, page)
    for h in handles:
        with contextlib.suppress(Exception):
            d.cuMemRelease(h)
    handles.clear()
    with contextlib.suppress(Exception):
        backend.free_address(base, npages * page)


def bench_driver_steps(bench: Bench, backend: CudaBackend, npages: int, rounds: int) -> None:
    page = max(2 * MIB, backend.granularity)
    per_call = ["cuMemCreate", "cuMemMap", "cuMemSetAccess per page", "cuMemUnmap per page", "cuMemRelease"]
    per_run = ["cuMemSetAccess one call/run", "cuMemUnmap one ranged call",
               "backend.map_runs zero=False", "backend.unmap (range)", "backend.map_runs zero=True"]
    samples: dict[str, list[float]] = {k: [] for k in per_call + per_run}
    backend.page_bytes = page
    base = backend.reserve_address(npages * page)
    handles: list[int] = []
    try:
        for _ in range(rounds):
            _one_round(backend, base, npages, page, samples, handles)
    except BaseException:
        _cleanup(backend, base, npages, page, handles)
        raise
    backend.free_address(base, npages * page)
    rows, out = [], {"page_bytes": page, "pages_per_run": npages, "rounds": rounds}
    for key in per_call + per_run:
        if not samples[key]:
            continue
        whole = key in per_run
        per_page = median_us(samples[key]) / (npages if whole else 1)
        run_us = median_us(samples[key]) if whole else per_page * npages
        rows.append([key, per_page, run_us, len(samples[key])])
        out[key] = {"us_per_page": per_page, "us_per_run": run_us, "samples": len(samples[key])}
    if "ranged unmap refused" in samples:
        out["ranged_unmap_refused"] = samples["ranged unmap refused"][0]
        print(f"   cuMemUnmap refused a {npages}-mapping range: {out['ranged_unmap_refused']}")
    table(["step", "us/page (median)", f"us per {npages}-page run", "samples"], rows)
    bench.results["driver_steps"] = out


# ---------------------------------------------------------------- (b) bandwidth


@contextlib.contextmanager
def vmm_buffer(backend: CudaBackend, nbytes: int, handle_bytes: int) -> Iterator[torch.Tensor]:
    """A zeroed int8 tensor of ``nbytes`` over VMM pages of ``handle_bytes``; freed on exit."""
    npages = -(-nbytes // handle_bytes)
    backend.page_bytes = handle_bytes  # reservation aligned to the handle size
    base = backend.reserve_address(npages * handle_bytes)
    handles: list[int] = []
    mapped = False
    try:
        for _ in range(npages):
            handles.append(backend.create_page(handle_bytes))
        backend.map_runs([MapRun(base, tuple(handles))], handle_bytes, zero=True)
        mapped = True
        yield backend.tensor_view(base, nbytes, None)
    finally:
        backend.synchronize()
        if mapped:
            backend.unmap(base, npages * handle_bytes)
        for h in handles:
            backend.release_page(h)
        backend.free_address(base, npages * handle_bytes)


def time_op(op: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median milliseconds of ``op`` on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        op()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _write_read(dst: torch.Tensor, src: torch.Tensor, reps: int) -> tuple[float, float]:
    """(copy GB/s counting bytes read + written, sum GB/s counting bytes read) for ``dst``."""
    n = dst.numel()
    write_ms = time_op(lambda: dst.copy_(src), reps)
    as_float = dst.view(torch.float32)
    read_ms = time_op(lambda: as_float.sum(), reps)
    return 2 * n / write_ms / 1e6, n / read_ms / 1e6


def bench_bandwidth(bench: Bench, backend: CudaBackend, size: int, handle_mibs: list[int], reps: int) -> None:
    free = torch.cuda.mem_get_info()[0]
    if 3 * size + GIB > free:
        size = max(GIB, (free - GIB) // 3 // (128 * MIB) * (128 * MIB))
        print(f"   not enough free memory for 3 buffers; using {size / GIB:.2f} GiB")
    src = torch.ones(size, dtype=torch.int8, device="cuda")
    bw_w = bw_r = float("nan")  # ratios read as nan if the baseline itself fails
    with bench.step("(b) cudaMalloc baseline"):
        base = torch.empty(size, dtype=torch.int8, device="cuda")
        bw_w, bw_r = _write_read(base, src, reps)
        del base
        torch.cuda.empty_cache()  # give the bytes back to the driver for the VMM buffers
    out: dict[str, Any] = {"buffer_bytes": size, "reps": reps, "cudaMalloc": {"copy_GBps": bw_w, "sum_GBps": bw_r}}
    rows = [["cudaMalloc", bw_w, 1.0, bw_r, 1.0]]
    for mib in handle_mibs:
        handle = -(-mib * MIB // backend.granularity) * backend.granularity
        with bench.step(f"(b) VMM, {mib} MiB handles"):
            with vmm_buffer(backend, size, handle) as view:
                w, r = _write_read(view, src, reps)
            rows.append([f"VMM {mib} MiB", w, w / bw_w, r, r / bw_r])
            out[f"vmm_{mib}MiB"] = {"copy_GBps": w, "copy_ratio": w / bw_w, "sum_GBps": r, "sum_ratio": r / bw_r}
    del src
    print(f"\n   {size / GIB:.2f} GiB buffer, medians of {reps}; copy counts bytes read + written")
    table(["memory", "copy GB/s", "vs cudaMalloc", "sum GB/s", "vs cudaMalloc"], rows)
    bench.results["bandwidth"] = out


# ---------------------------------------------------------------- (c) host copies


def _chunked_copy(dst: torch.Tensor, src: torch.Tensor, chunk: int) -> None:
    for off in range(0, dst.numel(), chunk):
        dst[off:off + chunk].copy_(src[off:off + chunk], non_blocking=True)


def _host_rows(label: str, dev: torch.Tensor, host: torch.Tensor, chunks: list[int], reps: int,
               out: dict[str, Any]) -> list[list[Any]]:
    rows = []
    n = dev.numel()
    for chunk in chunks:
        h2d = n / time_op(lambda: _chunked_copy(dev, host, chunk), reps, warmup=1) / 1e6
        d2h = n / time_op(lambda: _chunked_copy(host, dev, chunk), reps, warmup=1) / 1e6
        rows.append([label, f"{chunk // MIB} MiB", h2d, d2h])
        out[f"{label}_{chunk // MIB}MiB"] = {"h2d_GBps": h2d, "d2h_GBps": d2h}
    return rows


def bench_host_copies(bench: Bench, backend: CudaBackend, size: int, chunks: list[int], reps: int) -> None:
    host = torch.empty(size, dtype=torch.int8, pin_memory=True)
    host.fill_(1)
    out: dict[str, Any] = {"bytes": size, "reps": reps}
    rows: list[list[Any]] = []
    with bench.step("(c) host <-> VMM"):
        with vmm_buffer(backend, size, max(2 * MIB, backend.granularity)) as dev:
            rows += _host_rows("VMM", dev, host, chunks, reps, out)
    with bench.step("(c) host <-> cudaMalloc"):
        dev = torch.empty(size, dtype=torch.int8, device="cuda")
        rows += _host_rows("cudaMalloc", dev, host, chunks, reps, out)
        del dev
    print(f"\n   {size / MIB:.0f} MiB pinned host buffer, one stream, medians of {reps}")
    table(["device memory", "chunk", "H2D GB/s", "D2H GB/s"], rows)
    bench.results["host_copies"] = out


# ---------------------------------------------------------------- main


def describe(bench: Bench, backend: CudaBackend) -> None:
    import cuda.bindings

    d = backend._driver
    info = {
        "device": torch.cuda.get_device_name(backend.device),
        "torch": torch.__version__,
        "cuda_python": getattr(cuda.bindings, "__version__", "?"),
        "driver_version": int(check("cuDriverGetVersion", d.cuDriverGetVersion())),
        "granularity": backend.granularity,
    }
    print("   " + ", ".join(f"{k}={v}" for k, v in info.items()))
    bench.results["environment"] = info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    out_dir = os.environ.get("OUT")
    default_json = str(Path(out_dir) / "bench_vmm.json") if out_dir else "bench_vmm.json"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=default_json, help="where to write results (default %(default)s)")
    p.add_argument("--pages", type=int, default=512, help="pages per run in (a)")
    p.add_argument("--rounds", type=int, default=10, help="rounds of (a); each gives pages samples per step")
    p.add_argument("--size-gib", type=float, default=4.0, help="buffer size for (b)")
    p.add_argument("--handle-mib", default="2,8,32,128", help="physical handle sizes for (b)")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per measurement in (b)")
    p.add_argument("--host-mib", type=int, default=1024, help="bytes copied per measurement in (c)")
    p.add_argument("--host-chunks-mib", default="2,64", help="chunk sizes for (c)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench()
    start = time.perf_counter()
    backend = None
    with bench.step("setup"):
        backend = CudaBackend()
        describe(bench, backend)
    if backend is not None:
        with bench.step("(a) driver steps per page"):
            bench_driver_steps(bench, backend, args.pages, args.rounds)
        with bench.step("(b) bandwidth over VMM vs cudaMalloc"):
            handle_mibs = [int(x) for x in args.handle_mib.split(",") if x]
            bench_bandwidth(bench, backend, int(args.size_gib * GIB), handle_mibs, args.reps)
        with bench.step("(c) pinned host copies"):
            chunks = [int(x) * MIB for x in args.host_chunks_mib.split(",") if x]
            bench_host_copies(bench, backend, args.host_mib * MIB, chunks, max(3, args.reps // 2))
        with bench.step("close"):
            backend.close()
    bench.results["total_seconds"] = time.perf_counter() - start
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(bench.results, indent=2))
    print(f"\nwrote {path} ({len(bench.results['errors'])} failed step(s), "
          f"{bench.results['total_seconds']:.1f} s in all)")
    return 1 if bench.results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
