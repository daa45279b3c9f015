"""Helpers shared by the CPU tests: a real graphpoold process (host backend) on a temporary
socket, and a way to run Python code in a fresh interpreter.

(A module of its own, not conftest.py, so that test modules can import it by a name no other
conftest shadows.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import graphpool

REPO = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).resolve().parents[1]


def daemon_binary() -> Path:
    env = os.environ.get("GRAPHPOOL_DAEMON_BIN")
    if env:
        p = Path(env)
        if not p.is_file():
            pytest.exit(f"GRAPHPOOL_DAEMON_BIN={env} does not exist", returncode=3)
        return p
    p = REPO / "target" / "debug" / "graphpoold"
    if not p.is_file():
        if shutil.which("cargo") is None:
            pytest.exit(
                f"{p} is missing and cargo is not installed: build graphpoold "
                f"(`cargo build --bins`) or set GRAPHPOOL_DAEMON_BIN",
                returncode=3,
            )
        env = {k: v for k, v in os.environ.items() if k != "CARGO_TARGET_DIR"}
        subprocess.run(["cargo", "build", "--bins"], cwd=REPO, check=True, env=env)
    return p


class Daemon:
    """A graphpoold process on a socket in its own temporary directory."""

    def __init__(self, binary: Path, *, config: str | None = None, capacity: str = "1GiB") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="graphpool-test-"))
        self.socket = str(self.dir / "g.sock")
        self.log_path = self.dir / "graphpoold.log"
        args = [
            str(binary),
            "--backend",
            "host",
            "--socket",
            self.socket,
            "--metrics-listen",
            "off",
            "--host-capacity",
            capacity,
        ]
        if config is not None:
            cfg = self.dir / "graphpoold.toml"
            cfg.write_text(config)
            args += ["--config", str(cfg)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHPOOL_")}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 20.0) -> None:
        client = graphpool.Client(self.socket, timeout=2.0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"graphpoold exited with {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(self.socket) and client.health():
                client.close()
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"graphpoold did not become ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self) -> graphpool.Client:
        return graphpool.Client(self.socket)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_in_fork(fn: Callable[[], object], *, timeout: float = 10.0) -> str:
    """Runs ``fn`` in a child forked from this process and returns what it reported: ``"ok"``
    when it returned, else the exception's ``repr``. A child still running after ``timeout``
    seconds (hung on a lock, say) is killed and the test fails."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report, and leave without running any of the parent's cleanup
        msg = "ok"
        try:
            os.close(r)
            fn()
        except BaseException as e:  # noqa: BLE001 - everything goes to the parent
            msg = repr(e) or type(e).__name__
        finally:
            try:
                os.write(w, msg.encode()[:4096])
            finally:
                os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the forked child did not finish within {timeout} s (hung)")
            time.sleep(0.01)
        out = b""
        while chunk := os.read(r, 4096):
            out += chunk
    finally:
        os.close(r)
    return out.decode(errors="replace")


def run_python(code: str, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter with this package importable."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(CLIENT / "src")},
    )


class RestartableDaemon:
    """A host-backend graphpoold that a test can SIGKILL and start again on the same socket
    (for the daemon-restart tests)."""

    def __init__(self, binary: Path, *, capacity: str = "1GiB") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="graphpool-restart-"))
        self.socket = str(self.dir / "g.sock")
        self.args = [
            str(binary),
            "--backend",
            "host",
            "--socket",
            self.socket,
            "--metrics-listen",
            "off",
            "--host-capacity",
            capacity,
        ]
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def log(self) -> str:
        return "".join(
            p.read_text(errors="replace") for p in sorted(self.dir.glob("graphpoold-*.log"))
        )

    def start(self, timeout: float = 20.0) -> None:
        """Spawns the daemon and waits until it answers ``GetStatus``."""
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHPOOL_")}
        with open(self.dir / f"graphpoold-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env)
        client = graphpool.Client(self.socket, timeout=2.0)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"graphpoold exited with {self.proc.returncode}:\n{self.log()}")
                if os.path.exists(self.socket) and client.health():
                    return
                time.sleep(0.02)
        finally:
            client.close()
        raise RuntimeError(f"graphpoold did not become ready in {timeout} s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILLs the daemon (its socket files stay behind, as after a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
