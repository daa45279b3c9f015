"""Daemon-backed pools on a node with several GPUs: memory comes from, and is charged to, the
GPU the rank runs on, whether the rank picks it with ``torch.cuda.set_device`` (every GPU
visible, as torchrun leaves them) or sees only it through ``CUDA_VISIBLE_DEVICES`` (its torch
device 0 is then another GPU of the daemon's).

Every GPU of the host is tried; with one GPU the cases still run (the rank's GPU is then the
daemon's only one). Each case runs in a fresh process (the shim keeps one daemon session per
device and process).
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

GPUS = torch.cuda.device_count()

GpuDaemon = Any  # the gpu_daemon fixture's object (conftest.py): .socket, .client()

CHILD = """
import json, sys, torch, graphpool
import graphpool.torch as gpt
from graphpool.capture import make_graphed_callables
from graphpool.schedule import Schedule

sock, job, dev = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.cuda.set_device(dev)
out = {"uuid": str(torch.cuda.get_device_properties(dev).uuid), "device": dev}
client = graphpool.Client(sock)

# 1. a graph captured into a daemon-backed pool of this GPU
pool = gpt.MemPool(dev, budget=None, job_id=job, rank=0, client=client)
x = torch.ones(1 << 20, device=dev)
g = torch.cuda.CUDAGraph()
with pool.capture(g):
    y = x * 3
x.fill_(2)
g.replay()
torch.cuda.synchronize()
out["pool_value_ok"] = y.sum().item() == 6 * (1 << 20)
out["pool_granted"] = pool.granted_bytes()
out["grants"] = [[gr.device_uuid, gr.device_index, gr.size] for gr in client.grants(job)]
del g, y
pool.release()

# 2. schedule-aware capture on this GPU, against eager
torch.manual_seed(0)
layers = [torch.nn.Linear(256, 256).cuda(dev) for _ in range(2)]
ref = [torch.nn.Linear(256, 256).cuda(dev) for _ in range(2)]
for a, b in zip(ref, layers):
    b.load_state_dict(a.state_dict())
sched = Schedule.one_f_one_b(pp_size=2, pp_rank=0, num_microbatches=3)
def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()

sample = torch.randn(64, 256, device=dev, requires_grad=True)
gs = make_graphed_callables(layers, [(sample,)], schedule=sched, pools="graphpool",
                            num_warmup_iters=1, client=client)
out["capture_grants"] = sorted({gr.device_uuid for gr in client.grants(job)})
inputs = [torch.randn(64, 256, device=dev, requires_grad=True) for _ in range(3)]
outs, eager_outs, worst = {}, {}, 0.0
for step in sched:
    m = step.microbatch
    if step.is_forward:
        outs[m] = gs[1, m](gs[0, m](inputs[m]))
        eager_outs[m] = ref[1](ref[0](inputs[m].detach().clone().requires_grad_()))
        worst = max(worst, rel(outs[m], eager_outs[m]))
    else:
        outs.pop(m).sum().backward()
        eager_outs.pop(m).sum().backward()
for a, b in zip(ref, layers):
    for pa, pb in zip(a.parameters(), b.parameters()):
        worst = max(worst, rel(pb.grad, pa.grad))
out["capture_worst_difference"] = worst  # relative to the eager tensor's largest entry
gs.close()
print(json.dumps(out), flush=True)
"""


def _norm(device_uuid: Any) -> str:
    """A GPU's UUID as torch or the daemon writes it, without the ``GPU-`` prefix, lower case."""
    return str(device_uuid).lower().removeprefix("gpu-")


def _daemon_devices(gpu_daemon: GpuDaemon) -> dict[str, int]:
    """The daemon's devices: UUID -> daemon index."""
    with gpu_daemon.client() as c:
        return {_norm(d.uuid): d.index for d in c.status().devices}


def _run(gpu_daemon: GpuDaemon, device: int, visible: str | None) -> dict[str, Any]:
    job = f"gpu-multi-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "GRAPHPOOL_JOB_ID": job, "GRAPHPOOL_SOCKET": gpu_daemon.socket}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), gpu_daemon.socket, job, str(device)],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    with gpu_daemon.client() as c:  # a process's sessions are reclaimed within 1 s of its exit
        deadline = time.monotonic() + 2
        while c.usage().job(job) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.usage().job(job) is None, "the child's pools outlived it"
    return out


def _check(gpu_daemon: GpuDaemon, out: dict[str, Any], physical: int) -> None:
    devices = _daemon_devices(gpu_daemon)
    want = _norm(torch.cuda.get_device_properties(physical).uuid)
    assert _norm(out["uuid"]) == want, f"the child's device is not GPU {physical}: {out}"
    assert devices.get(want) == physical, (devices, want)
    assert out["pool_value_ok"], out
    assert out["pool_granted"] > 0 and out["grants"], out
    for grant_uuid, grant_index, _ in out["grants"]:
        assert _norm(grant_uuid) == want and grant_index == physical, out
    assert [_norm(u) for u in out["capture_grants"]] == [want], out
    assert out["capture_worst_difference"] < 1e-4, out


@pytest.mark.parametrize("device", range(GPUS))
def test_a_rank_gets_memory_of_the_gpu_it_runs_on(gpu_daemon: GpuDaemon, device: int) -> None:
    _check(gpu_daemon, _run(gpu_daemon, device=device, visible=None), physical=device)


def test_cuda_visible_devices_maps_device_0_to_the_gpu_it_names(gpu_daemon: GpuDaemon) -> None:
    last = GPUS - 1  # with two GPUs or more, torch's device 0 in the rank is not the daemon's
    _check(gpu_daemon, _run(gpu_daemon, device=0, visible=str(last)), physical=last)
