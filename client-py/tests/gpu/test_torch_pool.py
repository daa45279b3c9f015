"""graphpool.torch.MemPool on a real GPU, against a cuda-backend graphpoold."""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import graphpool
import graphpool.torch as gpt

DEV = 0
GpuDaemon = Any  # the gpu_daemon fixture's object (conftest.py): .socket, .client()


def record(name: str, value: object) -> None:
    """Adds a figure to $GRAPHPOOL_BENCH_OUT (a JSON file), for the bench's table."""
    path = os.environ.get("GRAPHPOOL_BENCH_OUT")
    if not path:
        return
    data = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    data[name] = value
    Path(path).write_text(json.dumps(data, indent=2))


# One job and rank for every pool of this process: all graphpool pools of a device in one
# process share one daemon session (torch's allocator hook does not say which pool asks).
JOB = f"gpu-{uuid.uuid4().hex[:10]}"


def _job() -> str:
    return JOB


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda(DEV)


def _warmup(fn, n: int = 3) -> None:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def _job_granted(d: GpuDaemon, job: str) -> int:
    with d.client() as c:
        u = c.usage().job(job)
        return u.granted if u else 0


def test_capture_replay_bitwise_equal_and_ledger_matches(gpu_daemon: GpuDaemon) -> None:
    job = _job()
    model = _mlp()
    x_default = torch.zeros(512, 1024, device=DEV)
    x_gp = torch.zeros(512, 1024, device=DEV)
    with torch.no_grad():
        _warmup(lambda: model(x_default))
        g_default = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_default):
            y_default = model(x_default)

        pool = gpt.MemPool(DEV, budget="4GiB", job_id=job, rank=0, socket=gpu_daemon.socket)
        g_gp = torch.cuda.CUDAGraph()
        with pool.capture(g_gp):
            y_gp = model(x_gp)

    # The output lives in a segment the daemon granted.
    segs = pool.torch_pool.snapshot()
    assert any(s["address"] <= y_gp.data_ptr() < s["address"] + s["total_size"] for s in segs)

    gen = torch.Generator(device=DEV).manual_seed(1)
    for _ in range(5):
        inp = torch.randn(512, 1024, device=DEV, generator=gen)
        x_default.copy_(inp)
        x_gp.copy_(inp)
        g_default.replay()
        g_gp.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_default, y_gp)

    # Daemon ledger == granted by the shim == the pool's reserved bytes (torch's count).
    reserved = pool.reserved_bytes()
    assert reserved > 0
    assert pool.granted_bytes() == reserved
    assert _job_granted(gpu_daemon, job) == reserved
    st = pool.stats()
    record("ledger_check", {"pool_reserved_bytes": reserved, "daemon_job_granted_bytes": reserved,
                            "session_segments": st["session_segments"]})

    # Dropping the graph and the pool gives everything back.
    del g_gp, y_gp
    pool.release()
    deadline = time.monotonic() + 2
    while _job_granted(gpu_daemon, job) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _job_granted(gpu_daemon, job) == 0


def test_make_graphed_callables_bitwise_equal(gpu_daemon: GpuDaemon) -> None:
    job = _job()
    base = _mlp(3)
    m_default, m_gp = copy.deepcopy(base), copy.deepcopy(base)
    x = torch.randn(256, 1024, device=DEV, requires_grad=True)
    pool = gpt.MemPool(DEV, budget="4GiB", job_id=job, rank=0, socket=gpu_daemon.socket)
    f_default = torch.cuda.make_graphed_callables(m_default, (x,))
    with gpt.translate_errors():
        f_gp = torch.cuda.make_graphed_callables(m_gp, (x,), pool=pool.id)
    before = _job_granted(gpu_daemon, job)
    assert _job_granted(gpu_daemon, job) == pool.granted_bytes() >= pool.reserved_bytes() > 0
    gen = torch.Generator(device=DEV).manual_seed(2)
    for _ in range(3):
        inp = torch.randn(256, 1024, device=DEV, generator=gen)
        a = inp.clone().requires_grad_(True)
        b = inp.clone().requires_grad_(True)
        ya, yb = f_default(a), f_gp(b)
        ya.square().sum().backward()
        yb.square().sum().backward()
        torch.cuda.synchronize()
        assert torch.equal(ya, yb)
        assert torch.equal(a.grad, b.grad)
        for pa, pb in zip(m_default.parameters(), m_gp.parameters()):
            assert torch.equal(pa.grad, pb.grad)
    del f_gp, f_default, ya, yb, a, b
    pool.release()
    assert before >= 0


def test_replay_time_equal(gpu_daemon: GpuDaemon) -> None:
    job = _job()
    n = 4096
    torch.manual_seed(0)
    ws = [torch.randn(n, n, device=DEV, dtype=torch.bfloat16) / n**0.5 for _ in range(4)]
    x1 = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    x2 = x1.clone()

    def fwd(x):
        for w in ws:
            x = torch.nn.functional.gelu(x @ w)
        return x

    _warmup(lambda: fwd(x1))
    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        fwd(x1)
    pool = gpt.MemPool(DEV, budget="4GiB", job_id=job, rank=0, socket=gpu_daemon.socket)
    g2 = torch.cuda.CUDAGraph()
    with pool.capture(g2):
        fwd(x2)
    for _ in range(20):
        g1.replay()
        g2.replay()
    torch.cuda.synchronize()
    t1, t2 = [], []
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    for i in range(200):  # interleaved, order alternating, so drift and position affect both alike
        first, second = (g1, g2) if i % 2 == 0 else (g2, g1)
        ev[0].record()
        first.replay()
        ev[1].record()
        second.replay()
        ev[2].record()
        ev[2].synchronize()
        a, b = ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])
        t1.append(a if i % 2 == 0 else b)
        t2.append(b if i % 2 == 0 else a)
    m1, m2 = statistics.median(t1), statistics.median(t2)
    diff = (m2 - m1) / m1
    record("replay_time", {"replays": 200, "torch_pool_median_ms": m1, "graphpool_median_ms": m2,
                           "relative_difference": diff,
                           "graph": "4 x (4096x4096 bf16 matmul + gelu)"})
    del g2
    pool.release()
    assert abs(diff) <= 0.01, (m1, m2)


RESERVE = """
import json, sys, graphpool
import graphpool.torch as gpt
try:
    gpt.MemPool(0, budget="100TiB", job_id="gpu-reserve", rank=0, reserve_budget=True, socket=sys.argv[1])
except graphpool.CapacityExceeded as e:
    print(json.dumps({"refused": True, "requested": e.requested, "limit": e.limit}), flush=True)
    sys.exit(0)
print(json.dumps({"refused": False}), flush=True)
"""


def test_reserve_budget_that_does_not_fit_fails_at_once(gpu_daemon: GpuDaemon) -> None:
    # A fresh process: the shim keeps one session per device per process, and earlier tests'
    # pools may still hold theirs here.
    p = _py(RESERVE, gpu_daemon.socket)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    assert r["refused"], r
    assert r["requested"] == 100 << 40
    assert r["limit"]


def _py(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )


TRAINER = """
import json, os, sys, torch
import graphpool.torch as gpt
sock, job, flag = sys.argv[1:4]
pool = gpt.MemPool(0, budget=None, job_id=job, rank=0, socket=sock)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(512, 1024, device="cuda")
target = x[:, :1].clone()
graphed = torch.cuda.make_graphed_callables(model, (x.clone().requires_grad_(False),), pool=pool.id)
def step():
    loss = torch.nn.functional.mse_loss(graphed(x), target)
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
    return loss.item()
first = step()
print("READY", flush=True)
steps, after_flag = 1, 0
while after_flag < 50:
    last = step()
    steps += 1
    if os.path.exists(flag):
        after_flag += 1
print(json.dumps({"steps": steps, "first_loss": first, "last_loss": last,
                  "granted": pool.granted_bytes()}), flush=True)
"""

SECOND = """
import json, sys, torch, graphpool
import graphpool.torch as gpt
sock, job = sys.argv[1:3]
pool = gpt.MemPool(0, budget=None, job_id=job, rank=1, socket=sock)
x = torch.randn(8192, 8192, device="cuda")
g = torch.cuda.CUDAGraph()
try:
    with pool.capture(g):
        y = x @ x
except graphpool.CapacityExceeded as e:
    ok = torch.ones(4, device="cuda").sum().item() == 4.0   # the process is still usable
    print(json.dumps({"refused": True, "limit": e.limit, "requested": e.requested, "free": e.free,
                      "limit_bytes": e.limit_bytes,
                      "holders": [[h.rank, h.granted_bytes] for h in e.top_holders],
                      "still_usable": ok, "message": str(e)}), flush=True)
    sys.exit(0)
print(json.dumps({"refused": False}), flush=True)
sys.exit(3)
"""


def test_two_processes_shared_budget(gpu_daemon: GpuDaemon, tmp_path: Path) -> None:
    job = _job()
    flag = tmp_path / "second-done"
    trainer = _py(TRAINER, gpu_daemon.socket, job, str(flag))
    try:
        assert trainer.stdout is not None
        line = trainer.stdout.readline()
        assert line.strip() == "READY", (line, trainer.stderr.read() if trainer.poll() is not None else "")
        held = _job_granted(gpu_daemon, job)
        assert held > 0
        # The job's shared budget: what the trainer holds plus 16 MiB.
        with gpu_daemon.client() as c:
            c.set_limits(jobs={job: held + (16 << 20)})
        second = _py(SECOND, gpu_daemon.socket, job)
        out, err = second.communicate(timeout=120)
        flag.write_text("done")
        assert second.returncode == 0, (out, err)
        r = json.loads(out.strip().splitlines()[-1])
        assert r["refused"] and r["limit"] == "job-quota" and r["still_usable"], r
        assert r["limit_bytes"] == held + (16 << 20)
        tout, terr = trainer.communicate(timeout=120)
        assert trainer.returncode == 0, terr
        t = json.loads(tout.strip().splitlines()[-1])
        assert t["steps"] > 50 and t["last_loss"] < t["first_loss"], t
        record("two_processes", {"second": r, "trainer": t, "job_quota_bytes": held + (16 << 20)})
    finally:
        if trainer.poll() is None:
            trainer.kill()
        with gpu_daemon.client() as c:
            c.set_limits(jobs={job: 0})


FORKED_RELEASE = """
import os, sys, traceback, torch, graphpool
import graphpool.torch as gpt
sock, job = sys.argv[1:3]
client = graphpool.Client(sock)
with client.attach(job, rank=7) as session:
    # A Session as client: the pool uses its client's socket.
    pool = gpt.MemPool(0, budget=None, job_id=job, rank=0, client=session)
    assert pool.socket == client.socket_path, pool.socket
    x = torch.ones(1 << 20, device="cuda")
    g = torch.cuda.CUDAGraph()
    with pool.capture(g):
        y = x * 2
    g.replay()
    torch.cuda.synchronize()
    granted = pool.granted_bytes()
    assert granted > 0
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            pool.release()  # the parent's pool: only dropped here, no CUDA call
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    # The parent's memory, graph and daemon session are untouched.
    assert pool.granted_bytes() == granted
    g.replay()
    torch.cuda.synchronize()
    assert y.sum().item() == 2 * (1 << 20)
    del g, y
    pool.release()
print("ok", flush=True)
"""


def test_release_in_forked_child_leaves_the_parents_pool(gpu_daemon: GpuDaemon) -> None:
    # A fresh process: the shim keeps one session per device per process.
    p = _py(FORKED_RELEASE, gpu_daemon.socket, _job())
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out.strip().splitlines()[-1] == "ok", (out, err)


def test_graph_context_is_typed_as_what_it_yields() -> None:
    """``torch.cuda.graph`` gives nothing to ``as``; neither do ``graph``/``MemPool.capture``,
    and their annotation says so (it claimed a ``torch.cuda.graph``)."""
    import typing
    from collections.abc import Iterator

    hints = typing.get_type_hints(gpt.graph.__wrapped__)  # type: ignore[attr-defined]
    assert hints["return"] == Iterator[None]
