#!/usr/bin/env python3
"""How long os.fork() takes in a process with an open graphpool session, with gRPC's fork
support off (graphpool's default) and on (GRPC_ENABLE_FORK_SUPPORT=1).

A training rank forks its DataLoader workers while its session is open, so this is paid per
worker. Starts a host-backend graphpoold (no GPU needed), then for each mode a fresh
interpreter (gRPC reads the variable when it is imported) attaches, allocates a segment and
forks N children that exit at once, timing each fork.

Every wait is bounded: a forked child that does not exit within --child-timeout seconds is
killed and reported (it hung before reaching Python, on a lock another thread held at fork
time); an interpreter that does not finish within --timeout prints every thread's stack; a
daemon that does not stop within 15 s of SIGTERM is killed and reported. Exit status 0 when
every mode answered, 1 otherwise.

    python3 bench/fork/fork_timing.py --graphpoold target/debug/graphpoold [--forks 100]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Seconds the daemon has to stop after SIGTERM (it drains sessions for up to 10 s).
DAEMON_STOP_S = 15.0

CHILD = """
import faulthandler, os, signal, sys, time, graphpool
forks, child_timeout, timeout = int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
# A hang anywhere in this interpreter prints every thread's stack and exits.
faulthandler.dump_traceback_later(timeout, exit=True)
s = graphpool.Client(sys.argv[1]).attach("fork-timing", rank=0)
seg = s.allocate("2MiB")
times = []
for i in range(forks):
    s.grants()  # the channel is in use, as a rank's is
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    times.append(time.perf_counter() - t)
    deadline = time.monotonic() + child_timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            sys.exit(f"fork {i + 1}: the child did not exit within {child_timeout:g} s (it hung "
                     f"before reaching Python: a lock held by another thread at fork time)")
        time.sleep(0.0005)
times.sort()
ms = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1e3
print(f"{len(times)} forks: median {ms(0.5):.1f} ms, p90 {ms(0.9):.1f} ms, max {times[-1] * 1e3:.1f} ms")
seg.release()
s.close()
faulthandler.cancel_dump_traceback_later()
"""


def _start_daemon(binary: Path, sock: str) -> subprocess.Popen[bytes] | None:
    daemon = subprocess.Popen(
        [str(binary), "--backend", "host", "--socket", sock, "--metrics-listen", "off"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not os.path.exists(sock):
        if time.monotonic() > deadline or daemon.poll() is not None:
            _stop_daemon(daemon)
            return None
        time.sleep(0.02)
    return daemon


def _stop_daemon(daemon: subprocess.Popen[bytes]) -> bool:
    """Stops the daemon; False when it had to be killed."""
    daemon.terminate()
    try:
        daemon.wait(timeout=DAEMON_STOP_S)
        return True
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
        return False


def _time_mode(mode: str, sock: str, args: argparse.Namespace) -> tuple[bool, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "client-py" / "src"), "GRPC_ENABLE_FORK_SUPPORT": mode}
    cmd = [sys.executable, "-c", CHILD, sock, str(args.forks), str(args.child_timeout), str(args.timeout)]
    try:
        # The interpreter dumps its stacks and exits at --timeout; the margin is for that.
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout + 10)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return False, f"no answer within {args.timeout + 10:g} s\n{err.strip()}"
    if r.returncode == 0:
        return True, r.stdout.strip()
    return False, f"exit status {r.returncode}\n{(r.stdout + r.stderr).strip()}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphpoold", required=True, type=Path, help="the daemon binary")
    ap.add_argument("--forks", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mode")
    ap.add_argument("--child-timeout", type=float, default=10, help="seconds a forked child has to exit")
    ap.add_argument("--modes", default="0,1", help="GRPC_ENABLE_FORK_SUPPORT values to time (default 0,1)")
    args = ap.parse_args()
    ok = True
    with tempfile.TemporaryDirectory(prefix="graphpool-fork-") as d:
        sock = os.path.join(d, "g.sock")
        daemon = _start_daemon(args.graphpoold, sock)
        if daemon is None:
            print("graphpoold did not start within 10 s", file=sys.stderr)
            return 1
        try:
            for mode in args.modes.split(","):
                answered, out = _time_mode(mode, sock, args)
                ok &= answered
                print(f"GRPC_ENABLE_FORK_SUPPORT={mode}: {out}", flush=True)
        finally:
            if not _stop_daemon(daemon):
                print(f"graphpoold did not stop within {DAEMON_STOP_S:g} s of SIGTERM: killed", flush=True)
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
