#!/usr/bin/env python3
"""Latency of one segment request through the native shim, end to end: AllocateSegment RPC,
fd fetch over the fd socket, import+map (CUDA) or mmap (host backend); and of the free that
undoes it (unmap, ReleaseSegment). Sizes 20 MiB to 1 GiB, as torch's caching allocator asks.

    GRAPHPOOL_SHIM=.../libgraphpool_shim.so PYTHONPATH=client-py/src \
        python3 bench/gpu/shim_latency.py --socket /tmp/g.sock [--device-name 0] [--out x.json]

On a GPU the shim maps into this process's CUDA context (torch creates it); with a host-backend
daemon (no GPU) pass --host (memfd, mmap).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from graphpool import _shim

MIB = 1 << 20


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--host", action="store_true", help="host-backend daemon: no CUDA")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--device-name", default=None, help="device as the daemon names it (default: UUID)")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--sizes-mib", default="20,64,256,1024")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    gpu = ""
    if not a.host:
        import torch

        torch.cuda.init()
        torch.zeros(1, device=f"cuda:{a.device}")  # primary context current on this thread
        gpu = torch.cuda.get_device_name(a.device)
    _shim.configure(
        socket=a.socket,
        job_id=f"bench-shim-{os.getpid()}",
        rank=0,
        local_rank=0,
        device=a.device,
        daemon_device=a.device_name or ("0" if a.host else None),
        budget_bytes=0,
        reserve_budget=False,
    )
    results = []
    for mib in [int(x) for x in a.sizes_mib.split(",")]:
        size = mib * MIB
        alloc_us, free_us, phases = [], [], []
        for i in range(a.iterations + 5):
            t0 = time.perf_counter_ns()
            p = _shim.alloc(size, a.device)
            t1 = time.perf_counter_ns()
            ph = _shim.last_timing()
            _shim.free(p, size, a.device)
            t2 = time.perf_counter_ns()
            if i >= 5:  # warm-up excluded
                alloc_us.append((t1 - t0) / 1e3)
                free_us.append((t2 - t1) / 1e3)
                phases.append(ph)
        row = {
            "size_mib": mib,
            "iterations": a.iterations,
            "alloc_p50_us": pct(alloc_us, 0.5),
            "alloc_p99_us": pct(alloc_us, 0.99),
            "free_p50_us": pct(free_us, 0.5),
            "free_p99_us": pct(free_us, 0.99),
            "rpc_p50_us": statistics.median(p["rpc"] for p in phases),
            "fd_p50_us": statistics.median(p["fd"] for p in phases),
            "map_p50_us": statistics.median(p["map"] for p in phases),
        }
        results.append(row)
        print(
            f"{mib:>5} MiB  alloc p50 {row['alloc_p50_us']:8.1f} us  p99 {row['alloc_p99_us']:8.1f} us  "
            f"(rpc {row['rpc_p50_us']:.1f}, fd {row['fd_p50_us']:.1f}, map {row['map_p50_us']:.1f})  "
            f"free p50 {row['free_p50_us']:8.1f} us",
            flush=True,
        )
    _shim.release_device(a.device)
    out = {
        "what": "one segment request through libgraphpool_shim (RPC + fd + import/map), and its free",
        "backend": "host" if a.host else "cuda",
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "command": " ".join(sys.argv),
        "results": results,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
