#!/usr/bin/env python3
"""A training rank, reduced to what the deploy e2e test needs: one session with graphpoold.

Started by e2e_prometheus.py with PYTHONPATH pointing at stubs generated from
proto/graphpool/v1. Every call that names a session must come from the process that attached
it, so each rank is a process of its own.

Usage: client_worker.py SOCKET JOB RANK DEVICE MODE [ALLOC_MIB ...]
MODE: hold     attach, allocate, plan (with a reservation), print READY, then keep calling
               GetUsage every 0.5 s until stdin closes, then detach.
      exit     like hold, but exit without detaching once READY is printed (the daemon sees
               the process exit).
      detach   attach, allocate, detach, print READY, wait for stdin to close.
      refuse   attach, allocate ALLOC_MIB (expected to be refused), print READY with the gRPC
               code of each refusal, wait for stdin to close.
Prints one line "READY key=value ..." on stdout, or "ERROR ..." and exits 1.
"""
import os
import sys
import threading
import time

import grpc

from graphpool.v1 import graphpool_pb2 as pb
from graphpool.v1 import graphpool_pb2_grpc as rpc
from graphpool.v1 import plan_pb2

MiB = 1 << 20


def main():
    sock, job, rank, device, mode = sys.argv[1:6]
    sizes = [int(s) for s in sys.argv[6:]]
    channel = grpc.insecure_channel(f"unix://{sock}", options=[("grpc.default_authority", "localhost")])
    stub = rpc.GraphpoolStub(channel)
    stream = stub.Attach(pb.AttachRequest(job_id=job, rank=int(rank), local_rank=int(rank),
                                          device=device, client="deploy-e2e/1"), timeout=600)
    first = next(stream)
    if first.WhichOneof("event") != "attached":
        print(f"ERROR first event is {first.WhichOneof('event')}", flush=True)
        return 1
    sid = first.attached.session_id
    # Keep reading the stream so that it stays open (and draining events are consumed).
    threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()

    info = [f"session={sid}"]
    if mode == "refuse":
        for size in sizes:
            try:
                stub.AllocateSegment(pb.AllocateSegmentRequest(session_id=sid, size_bytes=size * MiB,
                                                               label="capture-pool"), timeout=10)
                info.append(f"alloc{size}=OK")
            except grpc.RpcError as e:
                info.append(f"alloc{size}={e.code().name}")
    else:
        for i, size in enumerate(sizes):
            g = stub.AllocateSegment(pb.AllocateSegmentRequest(session_id=sid, size_bytes=size * MiB,
                                                               label=f"capture-pool/{i}"), timeout=10)
            info.append(f"grant={g.grant_id}")
    if mode in ("hold", "exit"):
        # Four buffers; two pairs with disjoint lifetimes share memory.
        buffers = [plan_pb2.BufferSpec(name=f"b{i}", start=s, end=e, size_bytes=4 * MiB)
                   for i, (s, e) in enumerate([(0, 2), (2, 4), (1, 3), (3, 5)])]
        try:
            resp = stub.PlanCapture(pb.PlanCaptureRequest(
                session_id=sid, reserve=True,
                input=plan_pb2.PlanInput(buffers=plan_pb2.BufferList(buffers=buffers))), timeout=30)
            info.append(f"footprint={resp.plan.footprint_bytes} saved={resp.plan.saved_by_aliasing_bytes}")
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            # A daemon built without the planner: the test reports plan panels as skipped.
            info.append("plan=UNIMPLEMENTED")
    if mode == "detach":
        stub.Detach(pb.DetachRequest(session_id=sid), timeout=10)
    print("READY " + " ".join(info), flush=True)
    if mode == "exit":
        os._exit(0)

    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    deadline = time.monotonic() + 600
    while not done.is_set() and time.monotonic() < deadline:
        if mode == "hold":
            stub.GetUsage(pb.GetUsageRequest(), timeout=10)
        done.wait(0.5)
    if mode == "hold":
        stub.Detach(pb.DetachRequest(session_id=sid), timeout=10)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except grpc.RpcError as e:
        print(f"ERROR {e.code().name}: {e.details()}", flush=True)
        sys.exit(1)
