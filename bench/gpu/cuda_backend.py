#!/usr/bin/env python3
"""The cuda backend on a real GPU: correctness of a grant in another process, end-to-end grant
latency, and the daemon's own device memory.

1. This process creates its CUDA context (torch), reads free device memory, then starts
   graphpoold (--backend cuda) and reads it again: the drop is the daemon's own device memory
   with nothing granted (it must be 0: the daemon never creates a context). NVML's per-process
   list is read for the daemon's pid too.
2. It grants 1 GiB to this process and reads free memory again: the drop must be the grant.
3. It imports a grant (RPC + fd + cuMemImportFromShareableHandle + reserve + map + access),
   writes a random pattern (cuMemcpyHtoD) and a memset on the device, reads back and compares.
4. End-to-end grant latency, 64 MiB and 1 GiB, p50/p99 over --iterations.

    PYTHONPATH=client-py/src GRAPHPOOL_SHIM=.carry/libgraphpool_shim.so \
        python3 bench/gpu/cuda_backend.py --graphpoold .carry/graphpoold --out result.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import graphpool
from graphpool import _shim

MIB = 1 << 20


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0]


def nvml_process(pid: int) -> dict:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        listed = [p for p in procs if p.pid == pid]
        return {
            "nvml": True,
            "daemon_listed": bool(listed),
            "daemon_used_bytes": sum(int(p.usedGpuMemory or 0) for p in listed),
            "pids_listed": [int(p.pid) for p in procs],
        }
    except Exception as e:  # noqa: BLE001 - report, do not fail the bench
        return {"nvml": False, "error": repr(e)}


def driver_calls(cu: ctypes.CDLL, iterations: int = 50) -> dict:
    """What the daemon's driver calls cost here: cuMemCreate + cuMemExportToShareableHandle
    (+ close + cuMemRelease), timed through ctypes in this process."""

    class Prop(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("loc_type", ctypes.c_int),
                    ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("flags", ctypes.c_uint64)]

    prop = Prop(1, 1, 1, 0, None, 0)  # PINNED, POSIX_FD, DEVICE 0
    res = {}
    for size in (64 * MIB, 1 << 30):
        create, export, release = [], [], []
        for _ in range(iterations):
            h = ctypes.c_uint64(0)
            fd = ctypes.c_int(-1)
            t0 = time.perf_counter_ns()
            r1 = cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0))
            t1 = time.perf_counter_ns()
            r2 = cu.cuMemExportToShareableHandle(ctypes.byref(fd), h, ctypes.c_int(1), ctypes.c_uint64(0))
            t2 = time.perf_counter_ns()
            os.close(fd.value) if r2 == 0 else None
            r3 = cu.cuMemRelease(h)
            t3 = time.perf_counter_ns()
            if r1 or r2 or r3:
                return {"error": [r1, r2, r3]}
            create.append((t1 - t0) / 1e3)
            export.append((t2 - t1) / 1e3)
            release.append((t3 - t2) / 1e3)
        res[f"{size // MIB}MiB"] = {"cuMemCreate_p50_us": pct(create, 0.5), "export_p50_us": pct(export, 0.5),
                                    "close_release_p50_us": pct(release, 0.5)}
    return res


def start_daemon(binary: str, d: str, name: str, warm_stock: str, log) -> tuple:
    """Starts graphpoold (cuda backend) with `warm_stock` and metrics on a free port."""
    import socket as _s

    with _s.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = os.path.join(d, f"{name}.sock")
    cfg = os.path.join(d, f"{name}.toml")
    with open(cfg, "w") as f:
        f.write(
            f'socket = "{sock}"\nfd_socket = "{sock}.fd"\nbackend = "cuda"\n'
            f'metrics_listen = "127.0.0.1:{port}"\n[cuda]\nwarm_stock = "{warm_stock}"\n'
        )
    daemon = subprocess.Popen([binary, "--config", cfg], stdout=log, stderr=log)
    c = graphpool.Client(sock, timeout=2.0)
    deadline = time.monotonic() + 30
    while not (os.path.exists(sock) and c.health()):
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"graphpoold did not start (rc {daemon.poll()})")
        time.sleep(0.05)
    return daemon, sock, port


def metric(port: int, name: str) -> float:
    """Sum of a metric's samples from the daemon's /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name + "{"))


def latency(sizes: list[int], iterations: int) -> dict:
    """Grant (RPC + fd + import + map) and free (unmap + release) through the shim."""
    lat = {}
    for size in sizes:
        al, fr, ph = [], [], []
        for i in range(iterations + 5):
            t0 = time.perf_counter_ns()
            q = _shim.alloc(size, 0)
            t1 = time.perf_counter_ns()
            phase = _shim.last_timing()
            _shim.free(q, size, 0)
            t2 = time.perf_counter_ns()
            if i >= 5:
                al.append((t1 - t0) / 1e3)
                fr.append((t2 - t1) / 1e3)
                ph.append(phase)
        lat[f"{size // MIB}MiB"] = {
            "iterations": iterations,
            "grant_p50_us": pct(al, 0.5),
            "grant_p99_us": pct(al, 0.99),
            "free_p50_us": pct(fr, 0.5),
            "free_p99_us": pct(fr, 0.99),
            "rpc_p50_us": pct([x["rpc"] for x in ph], 0.5),
            "fd_p50_us": pct([x["fd"] for x in ph], 0.5),
            "import_map_p50_us": pct([x["map"] for x in ph], 0.5),
        }
    return lat


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--graphpoold", required=True)
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--out", default=None)
    ap.add_argument("--log", default=None, help="daemon log file")
    a = ap.parse_args()

    out: dict = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(0)}
    torch.zeros(1, device="cuda:0")  # this process's context, before the daemon starts
    time.sleep(0.5)
    free_before = free_bytes()

    d = tempfile.mkdtemp(prefix="gp-bench-")
    log = open(a.log or os.path.join(d, "graphpoold.log"), "ab")
    daemon, sock, metrics_port = start_daemon(a.graphpoold, d, "cold", "0", log)
    try:
        c = graphpool.Client(sock, timeout=2.0)
        st = c.status()
        out["daemon_status"] = {
            "backend": st.backend,
            "devices": [
                {k: getattr(dv, k, None) for k in ("index", "uuid", "name", "total", "capacity", "granularity", "driver_used", "driver_free")}
                for dv in st.devices
            ],
        }
        time.sleep(1.0)
        free_idle = free_bytes()
        out["daemon_idle_device_bytes"] = free_before - free_idle
        out["nvml_idle"] = nvml_process(daemon.pid)

        _shim.configure(
            socket=sock, job_id="bench-cuda", rank=0, local_rank=0, device=0, daemon_device=None,
            budget_bytes=0, reserve_budget=False,
        )
        # 2. a held 1 GiB grant: the device's free memory drops by exactly the grant.
        p = _shim.alloc(1 << 30, 0)
        free_held = free_bytes()
        out["held_grant_bytes"] = 1 << 30
        out["drop_with_1GiB_granted_bytes"] = free_idle - free_held
        out["nvml_holding"] = nvml_process(daemon.pid)

        # 3. write and read back through the mapping.
        cu = ctypes.CDLL("libcuda.so.1")
        n = 64 * MIB
        pattern = os.urandom(n)
        src = ctypes.create_string_buffer(pattern, n)
        dst = ctypes.create_string_buffer(n)
        r1 = cu.cuMemcpyHtoD_v2(ctypes.c_uint64(p + 256 * MIB), src, ctypes.c_size_t(n))
        r2 = cu.cuMemcpyDtoH_v2(dst, ctypes.c_uint64(p + 256 * MIB), ctypes.c_size_t(n))
        r3 = cu.cuMemsetD32_v2(ctypes.c_uint64(p), ctypes.c_uint(0xA5A5A5A5), ctypes.c_size_t(n // 4))
        small = ctypes.create_string_buffer(n)
        r4 = cu.cuMemcpyDtoH_v2(small, ctypes.c_uint64(p), ctypes.c_size_t(n))
        out["readback"] = {
            "cuda_results": [r1, r2, r3, r4],
            "random_64MiB_equal": dst.raw == pattern,
            "memset_64MiB_equal": small.raw == b"\xa5" * n,
        }
        # A torch kernel on the mapped memory too (torch wraps the pointer via DLPack-free
        # __cuda_array_interface__).
        class Arr:
            __cuda_array_interface__ = {"shape": (n // 4,), "typestr": "<f4", "data": (p, False), "version": 3}

        t = torch.as_tensor(Arr(), device="cuda:0")
        t.fill_(1.5)
        out["readback"]["torch_kernel_sum_ok"] = float(t.sum().item()) == 1.5 * (n // 4)
        del t
        torch.cuda.synchronize()
        _shim.free(p, 1 << 30, 0)
        free_after = free_bytes()
        out["free_returns_bytes"] = free_after - free_held

        # 4. latency with no warm stock: every grant creates and exports, every free releases.
        out["grant_latency_cold"] = latency([64 * MIB, 1 << 30], a.iterations)
        out["driver_calls"] = driver_calls(cu)
        _shim.release_device(0)
        time.sleep(0.5)
        out["daemon_after_device_bytes"] = free_before - free_bytes()
        daemon.terminate()
        daemon.wait(timeout=10)

        # 5. the default configuration: a warm stock of exported segments.
        daemon, sock, port = start_daemon(a.graphpoold, d, "warm", "2GiB", log)
        _shim.configure(
            socket=sock, job_id="bench-cuda", rank=0, local_rank=0, device=0, daemon_device=None,
            budget_bytes=0, reserve_budget=False,
        )
        out["grant_latency"] = latency([64 * MIB, 1 << 30], a.iterations)
        # Exact accounting with a stock: the device's free memory drops by granted + warm.
        base = free_bytes() + int(metric(port, "graphpool_device_warm_bytes"))
        q = _shim.alloc(1 << 30, 0)
        time.sleep(0.5)
        warm = int(metric(port, "graphpool_device_warm_bytes"))
        granted = int(metric(port, "graphpool_device_granted_bytes"))
        out["warm_accounting"] = {
            "granted_bytes": granted,
            "warm_bytes": warm,
            "device_drop_bytes": base - free_bytes(),
        }
        _shim.free(q, 1 << 30, 0)
        _shim.release_device(0)
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
    print(json.dumps(out, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    ok = out["readback"]["random_64MiB_equal"] and out["readback"]["memset_64MiB_equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
