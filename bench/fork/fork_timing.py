#!/usr/bin/env python3
"""How long os.fork() takes in a process with an open graphpool session, with gRPC's fork
support off (graphpool's default) and on (GRPC_ENABLE_FORK_SUPPORT=1).

A training rank forks its DataLoader workers while its session is open, so this is paid per
worker. Starts a host-backend graphpoold (no GPU needed), then for each mode a fresh
interpreter (gRPC reads the variable when it is imported) attaches, allocates a segment and
forks N children that exit at once, timing each fork.

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

CHILD = """
import os, sys, time, graphpool
s = graphpool.Client(sys.argv[1]).attach("fork-timing", rank=0)
seg = s.allocate("2MiB")
times = []
for _ in range(int(sys.argv[2])):
    s.grants()  # the channel is in use, as a rank's is
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    times.append(time.perf_counter() - t)
    os.waitpid(pid, 0)
times.sort()
ms = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1e3
print(f"{len(times)} forks: median {ms(0.5):.1f} ms, p90 {ms(0.9):.1f} ms, max {times[-1] * 1e3:.1f} ms")
seg.release()
s.close()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphpoold", required=True, type=Path, help="the daemon binary")
    ap.add_argument("--forks", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mode")
    ap.add_argument("--modes", default="0,1", help="GRPC_ENABLE_FORK_SUPPORT values to time (default 0,1)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="graphpool-fork-") as d:
        sock = os.path.join(d, "g.sock")
        daemon = subprocess.Popen(
            [str(args.graphpoold), "--backend", "host", "--socket", sock, "--metrics-listen", "off"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while not os.path.exists(sock):
                if time.monotonic() > deadline or daemon.poll() is not None:
                    print("graphpoold did not start", file=sys.stderr)
                    return 1
                time.sleep(0.02)
            for mode in args.modes.split(","):
                env = {**os.environ, "PYTHONPATH": str(ROOT / "client-py" / "src"), "GRPC_ENABLE_FORK_SUPPORT": mode}
                try:
                    r = subprocess.run(
                        [sys.executable, "-c", CHILD, sock, str(args.forks)],
                        env=env, capture_output=True, text=True, timeout=args.timeout,
                    )
                    out = r.stdout.strip() or r.stderr.strip().splitlines()[-1]
                except subprocess.TimeoutExpired:
                    out = f"no answer within {args.timeout:g} s (a fork hung)"
                print(f"GRPC_ENABLE_FORK_SUPPORT={mode}: {out}")
        finally:
            daemon.terminate()
            daemon.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
