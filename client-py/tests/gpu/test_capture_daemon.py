"""Schedule-aware capture (graphpool.capture.make_graphed_callables) with daemon-backed pools:
the daemon's plan through the ``client`` argument, and what a capture the daemon refuses
leaves behind.

Each case runs in a fresh process: the shim keeps one daemon session per device and process,
and other tests' pools may hold theirs in the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

GpuDaemon = Any  # the gpu_daemon fixture's object (conftest.py): .socket, .client()

CHILD = """
import json, sys, time, torch, graphpool
from graphpool.capture import make_graphed_callables
from graphpool.schedule import Schedule

sock, job, case = sys.argv[1:4]
client = graphpool.Client(sock)
torch.manual_seed(0)
layers = [torch.nn.Linear(1024, 1024).cuda() for _ in range(2)]
x = torch.randn(2048, 1024, device="cuda", requires_grad=True)  # 8 MiB activations
sched = Schedule.one_f_one_b(pp_size=2, pp_rank=0, num_microbatches=4)

def capture(**kw):
    return make_graphed_callables(layers, [(x,)], schedule=sched, pools="graphpool",
                                  num_warmup_iters=1, **kw)

def job_usage():
    u = client.usage().job(job)
    return (u.granted, u.sessions) if u else (0, 0)

def planned():
    return sum(d.planned for d in client.usage().devices)

def wait_released():
    deadline = time.monotonic() + 5
    while job_usage() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)

out = {}
if case == "client":
    gs = capture(client=client)
    plan = gs.stats.plan
    out["reserved"] = plan.reserved_bytes if plan is not None else None
    out["usage"] = job_usage()
    gs.close()
elif case == "session":
    with client.attach(job, rank=0) as s:
        before = planned()
        gs = capture(client=s)
        out["reserved"] = gs.stats.plan.reserved_bytes
        out["planned_rise"] = planned() - before
        out["granted"] = job_usage()[0]
        gs.close()
elif case == "refused":
    gs = capture(plan=False)
    whole = job_usage()[0]
    gs.close()
    wait_released()
    # Room for some of the capture's segments, not for all of them.
    quota = (whole // 2 + (4 << 20)) // (2 << 20) * (2 << 20)
    client.set_limits(jobs={job: quota})
    try:
        capture(plan=False)
        out["raised"] = None
    except Exception as e:
        out["raised"] = type(e).__name__
        out["limit"] = getattr(e, "limit", "")
        # before the exception is dropped: nothing of the failed capture may still be held
        out["after"] = job_usage()
    finally:
        client.set_limits(jobs={job: 0})
    out["whole"], out["quota"] = whole, quota
print(json.dumps(out), flush=True)
"""


def _run(gpu_daemon: GpuDaemon, case: str) -> dict[str, Any]:
    job = f"gpu-capture-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "GRAPHPOOL_JOB_ID": job, "GRAPHPOOL_SOCKET": gpu_daemon.socket}
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), gpu_daemon.socket, job, case],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    with gpu_daemon.client() as c:  # (a process's sessions are reclaimed within 1 s of its exit)
        deadline = time.monotonic() + 2
        while c.usage().job(job) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.usage().job(job) is None, "the child's pools outlived it"
    return out


def test_plan_through_a_client_reserves_for_the_pools_session(gpu_daemon: GpuDaemon) -> None:
    """``client=graphpool.Client(...)`` as documented: the plan is made for the pools' session
    (it used to call ``Client.plan_capture`` without a session id: TypeError)."""
    r = _run(gpu_daemon, "client")
    assert r["reserved"] and r["reserved"] > 0
    granted, sessions = r["usage"]
    assert granted > 0 and sessions == 1  # the plan needed no session of its own


def test_plan_through_a_session_is_not_charged_twice(gpu_daemon: GpuDaemon) -> None:
    """With a Session as ``client``, the reservation goes to the pools' session, which the
    capture's segments then draw down, instead of sitting on the given session beside them."""
    r = _run(gpu_daemon, "session")
    assert r["reserved"] > 0 and r["granted"] > 0
    assert r["planned_rise"] < r["reserved"], r


def test_capture_refused_by_the_daemon_raises_capacity_and_gives_everything_back(
    gpu_daemon: GpuDaemon,
) -> None:
    r = _run(gpu_daemon, "refused")
    assert r["raised"] == "CapacityExceeded", r
    assert r["limit"] == "job-quota"
    assert r["after"] == [0, 0], r
