"""GPU tests: a graphpoold with the cuda backend, torch and the native shim.

Skipped where torch, a CUDA device or the shim is missing. The daemon is the one at
``$GRAPHPOOL_GPU_SOCKET`` (bench/gpu/run.sh starts one), else one started from
``$GRAPHPOOL_DAEMON_BIN`` with ``--backend cuda``.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import graphpool
from graphpool import _native

try:
    import torch

    _reason = "" if torch.cuda.is_available() else "no CUDA device"
except ImportError:
    _reason = "torch is not installed"
if not _reason and _native.native_path() is None:
    _reason = "libgraphpool_shim.so not found (set GRAPHPOOL_SHIM)"
if _reason:
    # Collected nowhere: the test modules import torch at the top.
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header() -> list[str]:
    return [f"gpu tests: skipped ({_reason})"] if _reason else []


class GpuDaemon:
    def __init__(self, socket: str, proc: subprocess.Popen[bytes] | None, log: Path | None) -> None:
        self.socket = socket
        self.proc = proc
        self.log = log

    def client(self) -> graphpool.Client:
        return graphpool.Client(self.socket)


@pytest.fixture(scope="session")
def gpu_daemon() -> Iterator[GpuDaemon]:
    sock = os.environ.get("GRAPHPOOL_GPU_SOCKET")
    if sock:
        yield GpuDaemon(sock, None, None)
        return
    binary = os.environ.get("GRAPHPOOL_DAEMON_BIN")
    if not binary:
        pytest.skip("set GRAPHPOOL_GPU_SOCKET or GRAPHPOOL_DAEMON_BIN for the GPU tests")
    d = Path(tempfile.mkdtemp(prefix="graphpool-gpu-"))
    sock = str(d / "g.sock")
    log = d / "graphpoold.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [binary, "--backend", "cuda", "--socket", sock, "--metrics-listen", "off"], stdout=f, stderr=f
        )
    c = graphpool.Client(sock, timeout=2.0)
    deadline = time.monotonic() + 30
    while not (os.path.exists(sock) and c.health()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"graphpoold (cuda) did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)
    yield GpuDaemon(sock, proc, log)
    proc.terminate()
    proc.wait(timeout=10)
