"""What the GPU capture tests of this directory share: each runs its cases in a child process of
its own (the test module is also the child's program), and the child reports one ``RESULT``
line of JSON per result.

Imported by the test modules both when pytest collects them (as ``capture.replay_check``) and
when a child runs one as a script (as ``replay_check``, from the script's directory). Nothing
here imports torch at import time, so the test process can skip without it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any, Callable

#: The prefix of a child's result lines.
RESULT = "RESULT "

#: ``$GRAPHPOOL_POISON_OUT``: a JSON-lines file that gets one record per result, if set.
OUT_ENV = "GRAPHPOOL_POISON_OUT"

GRAPHPOOL_SKIP = "needs $GRAPHPOOL_SOCKET (a cuda-backend graphpoold) and $GRAPHPOOL_SHIM"


def daemon_ready() -> bool:
    """Whether daemon-backed pools can be made: a socket and the native shim are named."""
    sock = os.environ.get("GRAPHPOOL_SOCKET", "")
    shim = os.environ.get("GRAPHPOOL_SHIM", "")
    return bool(sock) and os.path.exists(sock) and bool(shim) and os.path.exists(shim)


def run_child(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` (a test module) as the child's program with ``args``, the package's
    sources first on the path."""
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src")
    env["PYTHONPATH"] = os.path.abspath(src) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def results(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    """The records a child reported."""
    return [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]


def detail(proc: subprocess.CompletedProcess[str]) -> str:
    """The end of a child's output, for a failed test's message."""
    return f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def failed(rec: dict[str, Any], e: BaseException, trace_chars: int = 2000) -> None:
    """Marks ``rec`` failed with ``e``: its type and message, and the end of its traceback."""
    import traceback

    rec.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-trace_chars:])


def child_entry(main: Callable[[list[str]], int]) -> None:
    """Runs a child's ``main`` on the command line's arguments and exits with its code, without
    the interpreter's shutdown: nothing is left to the garbage collector's order."""
    sys.stdout.flush()
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def report(rec: dict[str, Any]) -> None:
    """Prints one result line (and appends it to ``$GRAPHPOOL_POISON_OUT``)."""
    line = json.dumps(rec)
    print(RESULT + line, flush=True)
    out = os.environ.get(OUT_ENV)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def capture_kw(kind: str) -> dict[str, Any]:
    """``make_graphed_callables`` arguments of a pool kind: ``torch`` (default segments and an
    arena per pool), ``torch-xs`` (expandable segments) or ``graphpool`` (daemon-backed)."""
    if kind == "torch":
        return {"pools": "torch", "expandable_segments": False}
    if kind == "torch-xs":
        return {"pools": "torch", "expandable_segments": True}
    return {"pools": "graphpool"}


def rel(a: Any, b: Any) -> float:
    """``|a - b| / |b|`` over all elements (NaN when either holds a NaN)."""
    import torch

    d = torch.linalg.vector_norm(a.float() - b.float()).item()
    n = torch.linalg.vector_norm(b.float()).item()
    return d / n if n else (0.0 if d == 0 else math.inf)


def granted() -> int | None:
    """Bytes the shim holds from the daemon on the current device (None without the shim)."""
    import torch

    try:
        from graphpool import _shim

        st = _shim.stats(torch.cuda.current_device())
        return st[0] if st else 0
    except Exception:  # noqa: BLE001 - no shim: torch pools
        return None
