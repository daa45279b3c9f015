#!/usr/bin/env python3
"""Seed reproduction: CUDA graphs of a pipeline stage at 8..128 microbatches, four ways.

A pipeline stage (bench/gpu/seed/model.py: 9 transformer layers, hidden 1024, FFN 4096, 16 heads,
sequence 4096, micro-batch 1, bf16, SDPA attention), under 1F1B stage 0 of 8, 1F1B stage 7 of 8
and interleaved 1F1B stage 0 of 8 with 2 virtual chunks (chunks of 5 and 4 layers), for
M in {8, 32, 128}. Variants, each in a process of its own (forked from a parent that imported
torch but never initialised CUDA):

* ``eager``      - no graphs; the reference gradients and their run-to-run noise;
* ``torch``      - ``torch.cuda.make_graphed_callables`` with one graph per (layer, microbatch),
                   replayed in schedule order (out-of-memory recorded as such);
* ``ordered``    - the schedule-ordered baseline from torch primitives (seed/ordered.py): one
                   graph per (layer, microbatch) captured in schedule order into one pool;
* ``graphpool``  - ``graphpool.capture.make_graphed_callables``: one graph per (layer, slot),
                   memory split by lifetime;
* ``unsafe-onepool`` (opt-in) - graphpool's slot reuse with every graph in ONE pool: the
                   configuration that is silently wrong (a replay overwrites what another
                   microbatch's forward kept for its backward); shows the check catches it.

Per variant: device footprint (rise in used device memory per ``torch.cuda.mem_get_info``: pool
reserve + graph objects), allocator peaks (reserved / allocated), graphs, capture time, median
step time of a full schedule, and a per-parameter-tensor gradient check against eager.

With ``--plan-eager-step`` (and ``--graphpool-cli``), one more eager step per (schedule, M) runs
with the allocator's history on; its allocations (``graphpool.snapshot``: the whole device, the
weights and inputs held throughout) are planned by ``graphpool plan --buffers`` with 1 s, beside
the bytes torch reserved for that step.

    PYTHONPATH=client-py/src python3 bench/gpu/seed_repro.py --out seed.json
    PYTHONPATH=client-py/src python3 bench/gpu/seed_repro.py --quick
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "client-py", "src"))

GiB = float(1 << 30)
SCHEDULES = {
    "1f1b-s0": dict(kind="1f1b", pp_size=8, pp_rank=0, chunks=[9]),
    "1f1b-s7": dict(kind="1f1b", pp_size=8, pp_rank=7, chunks=[9]),
    "il2-s0": dict(kind="interleaved", pp_size=8, pp_rank=0, chunks=[5, 4]),
}
VARIANTS = ["eager", "torch", "ordered", "graphpool"]
GRAD_FLOOR = 1e-3
#: threshold = GRAD_MARGIN x the largest eager-vs-eager relative difference of any parameter
#: tensor (at least GRAD_FLOOR): the noise is estimated from few runs, so a new sample of the same
#: noise may exceed it slightly; a slot-reuse overwrite gives NaN or errors of 10-100%.
GRAD_MARGIN = 1.5
EXTRAS = ["graphpool-noarena", "graphpool-torch", "graphpool-torch-arena",
          "graphpool-torch-noarena", "unsafe-onepool"]
#: graphpool variants: pools (None = --pools), capture keyword arguments
GP_VARIANTS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "graphpool": (None, {}),
    "graphpool-noarena": (None, {"arena": False}),
    "graphpool-torch": ("torch", {}),  # torch pools: expandable segments by default
    "graphpool-torch-arena": ("torch", {"expandable_segments": False}),
    "graphpool-torch-noarena": ("torch", {"expandable_segments": False, "arena": False}),
    "unsafe-onepool": (None, {"_unsafe_single_pool": True}),
}


def make_schedule(name: str, m: int) -> Any:
    from graphpool.schedule import Schedule

    d = SCHEDULES[name]
    if d["kind"] == "1f1b":
        return Schedule.one_f_one_b(d["pp_size"], d["pp_rank"], m)
    return Schedule.interleaved(d["pp_size"], d["pp_rank"], m, len(d["chunks"]))


# ------------------------------------------------------------------------------------ child


def _alias_module(lay: Any) -> Any:
    import torch

    class Alias(torch.nn.Module):
        """A distinct module over a shared layer: torch.cuda.make_graphed_callables replaces a
        module's forward with its graphed version, so a layer passed M times would keep only
        the last microbatch's graphs; one Alias per (layer, microbatch) keeps all of them."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Any) -> Any:
            return self.inner(x)

    return Alias(lay)


_Alias = _alias_module


def _rel(a: Any, b: Any) -> float:
    import torch

    a32, b32 = a.float(), b.float()
    den = torch.linalg.vector_norm(b32).item()
    num = torch.linalg.vector_norm(a32 - b32).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def child(case: dict[str, Any], conn: Any) -> None:
    try:
        res = _child(case)
    except BaseException as e:  # noqa: BLE001
        res = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    conn.send(res)
    conn.close()


def _child(case: dict[str, Any]) -> dict[str, Any]:
    import torch

    from seed.model import StageConfig, build_stage

    torch.backends.cuda.matmul.allow_tf32 = False
    variant, m, sname = case["variant"], case["m"], case["schedule"]
    cfg = StageConfig(seq=case.get("seq", 4096))
    sched = make_schedule(sname, m)
    chunk_sizes = SCHEDULES[sname]["chunks"]
    torch.cuda.init()
    chunks = build_stage(cfg, chunk_sizes)
    params = [(f"c{c}.l{i}.{n}", p) for c, ch in enumerate(chunks) for i, lay in enumerate(ch)
              for n, p in lay.named_parameters()]
    for _, p in params:
        p.grad = torch.zeros_like(p)
    shape = (cfg.micro_batch, cfg.seq, cfg.hidden)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(99)
    X = [[torch.randn(shape, dtype=cfg.dtype, device="cuda", generator=gen) for _ in range(m)]
         for _ in chunk_sizes]
    G = [[torch.randn(shape, dtype=cfg.dtype, device="cuda", generator=gen) for _ in range(m)]
         for _ in chunk_sizes]
    # warm-up outside the measurement: handles, workspaces, lazily loaded kernels
    for ch in chunks:
        x = X[0][0].detach().requires_grad_()
        y = ch[0](x)
        torch.autograd.grad(y, [x] + list(ch[0].parameters()), G[0][0])
    del x, y
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free0 = torch.cuda.mem_get_info()[0]
    res0 = torch.cuda.memory_reserved()
    alloc0 = torch.cuda.memory_allocated()
    out: dict[str, Any] = {"graphs": 0, "capture_s": 0.0}
    steps = list(sched.steps)

    def chain_run(fwd: Any) -> None:
        live: dict[tuple[int, int], Any] = {}
        for st in steps:
            if st.kind == "F":
                x = X[st.chunk][st.microbatch].detach().requires_grad_()
                y = fwd(st.chunk, st.microbatch, x)
                live[(st.chunk, st.microbatch)] = y
            else:
                y = live.pop((st.chunk, st.microbatch))
                torch.autograd.backward(y, G[st.chunk][st.microbatch])

    t0 = time.perf_counter()
    if variant == "eager":
        def fwd(c: int, mb: int, x: Any) -> Any:
            for lay in chunks[c]:
                x = lay(x)
            return x

        def step() -> None:
            chain_run(fwd)

    elif variant == "torch":
        callables, samples, index = [], [], {}
        for c, ch in enumerate(chunks):
            for mb in range(m):
                for li, lay in enumerate(ch):
                    index[(c, mb, li)] = len(callables)
                    callables.append(_Alias(lay))
                    samples.append((torch.randn(shape, dtype=cfg.dtype, device="cuda",
                                                requires_grad=True),))
        try:
            graphed = torch.cuda.make_graphed_callables(tuple(callables), tuple(samples),
                                                        num_warmup_iters=1)
        except torch.OutOfMemoryError as e:
            torch.cuda.synchronize()
            return {"oom": True, "error": f"out of memory in make_graphed_callables: "
                    f"{str(e).splitlines()[0][:160]}",
                    "capture_s": time.perf_counter() - t0,
                    "footprint_at_oom_gib": (free0 - torch.cuda.mem_get_info()[0]) / GiB,
                    "graphs_attempted": 2 * len(callables)}
        out["graphs"] = 2 * len(callables)

        def fwd(c: int, mb: int, x: Any) -> Any:
            for li in range(len(chunks[c])):
                x = graphed[index[(c, mb, li)]](x)
            return x

        def step() -> None:
            chain_run(fwd)

    elif variant == "ordered":
        from seed.ordered import OrderedGraphs

        og = OrderedGraphs(chunks, steps, shape, cfg.dtype)
        out["graphs"] = og.graphs

        def step() -> None:
            og.run_step(X, G)

    elif variant in GP_VARIANTS:
        import logging

        from graphpool import capture

        logging.basicConfig(level=logging.WARNING)
        pools, kw = GP_VARIANTS[variant]
        samples = [(X[c][0].detach().requires_grad_(),) for c in range(len(chunks))]
        if case.get("pool_report"):
            torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        gs = capture.make_graphed_callables(chunks, samples, num_warmup_iters=1, schedule=sched,
                                            pools=pools or case.get("pools", "auto"), **kw)
        if case.get("pool_report"):
            out["pool_report"] = pool_report(gs)
            torch.cuda.memory._record_memory_history(enabled=None)
        out["graphs"] = gs.stats.graphs
        out["pool_kind"] = gs.stats.pool_kind
        out["num_pools"] = gs.stats.num_pools
        out["slots"] = list(sched.slots_per_chunk)
        out["predicted_gib"] = gs.stats.predicted_bytes / GiB
        out["capture_only_s"] = gs.stats.capture_seconds
        out["arena_gib"] = sum(gs.stats.arena_bytes.values()) / GiB
        out["arena_mib"] = {k: v / 2**20 for k, v in gs.stats.arena_bytes.items()}
        out["warmup_retained_mib"] = gs.stats.warmup_retained_bytes / 2**20
        out["graph_object_mib"] = gs.stats.graph_object_bytes / 2**20
        out["graph_first_mib"] = gs.stats.graph_first_bytes / 2**20
        out["graph_per_graph_kib"] = gs.stats.graph_bytes_per_graph / 2**10
        out["plan_description"] = capture.plan_description(sched, gs.stats.profiles)  # no overhead
        out["workspace_mib"] = {
            "forward_max": max(p.forward_workspace_bytes for p in gs.stats.profiles) / 2**20,
            "backward_max": max(p.backward_workspace_bytes for p in gs.stats.profiles) / 2**20,
        }

        def fwd(c: int, mb: int, x: Any) -> Any:
            for call in gs.chunk(c, mb):
                x = call(x)
            return x

        def step() -> None:
            chain_run(fwd)
    else:
        raise ValueError(variant)
    torch.cuda.synchronize()
    out["capture_s"] = time.perf_counter() - t0 if variant != "eager" else 0.0
    out["held_after_capture_gib"] = (free0 - torch.cuda.mem_get_info()[0]) / GiB

    # full schedules: 1 warm-up, then timed ones; gradients of each timed one kept for the check
    times, grads_seen = [], []
    nsteps = case["steps"]
    for i in range(nsteps + 1):
        for _, p in params:
            p.grad.zero_()
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i > 0:
            times.append(time.perf_counter() - t)
            if variant == "eager" and i <= 3 or i == nsteps:
                # to the host, so that the copies take no device memory from the measurement
                grads_seen.append([p.grad.detach().to("cpu") for _, p in params])
    free1 = torch.cuda.mem_get_info()[0]
    out.update(
        footprint_gib=(free0 - free1) / GiB,
        peak_reserved_gib=(torch.cuda.max_memory_reserved() - res0) / GiB,
        peak_allocated_gib=(torch.cuda.max_memory_allocated() - alloc0) / GiB,
        reserved_now_gib=(torch.cuda.memory_reserved() - res0) / GiB,
        step_ms=sorted(times)[len(times) // 2] * 1e3,
        step_ms_all=[t * 1e3 for t in times],
    )
    out["outside_allocator_gib"] = out["footprint_gib"] - out["reserved_now_gib"]
    if variant == "eager" and case.get("eager_trace"):
        for _, p in params:
            p.grad.zero_()
        out.update(record_step(step, case["eager_trace"]))
    if variant in GP_VARIANTS:
        out["capture_overhead"] = gs.capture_overhead()
        out["warmup_outside_mib"] = gs.stats.warmup_outside_bytes / 2**20
        out["reserved_outside_pools_mib"] = gs.stats.reserved_outside_pools / 2**20
    if out.get("pool_kind") == "graphpool":
        out.update(_daemon_ledger())
    ref_path = case["ref_path"]
    names = [n for n, _ in params]
    if variant == "eager":
        ref = grads_seen[0]
        noise = [0.0] * len(ref)
        for other in grads_seen[1:]:
            noise = [max(a, _rel(o.cuda(), r.cuda())) for a, o, r in zip(noise, other, ref)]
        torch.save({"names": names, "grads": ref, "noise": noise}, ref_path)
        worst = max(range(len(noise)), key=lambda i: noise[i])
        out.update(grad_noise_max=noise[worst], grad_noise_worst=names[worst],
                   grad_runs=len(grads_seen))
    elif os.path.exists(ref_path):
        ref = torch.load(ref_path)
        thr = GRAD_MARGIN * max(max(ref["noise"]), GRAD_FLOOR)
        got = grads_seen[-1]
        diffs = [_rel(g.cuda(), r.cuda()) for g, r in zip(got, ref["grads"])]
        worst = max(range(len(diffs)), key=lambda i: diffs[i])
        bad = [names[i] for i, d in enumerate(diffs) if not d <= thr]
        per_t = max(d / max(n, GRAD_FLOOR) for d, n in zip(diffs, ref["noise"]))
        out.update(grad_max_rel=diffs[worst], grad_worst=names[worst], grad_threshold=thr,
                   grad_tensors=len(diffs), grad_bad_tensors=len(bad), grad_bad=bad[:8],
                   grad_ok=not bad, grad_max_over_own_noise=per_t,
                   grad_max_over_eager_noise=diffs[worst] / max(max(ref["noise"]), GRAD_FLOOR))
    return out


def record_step(step: Any, path: str) -> dict[str, Any]:
    """Runs `step` once with the allocator's history on and writes its allocations to `path`
    as a buffer list (``graphpool.snapshot``); returns what the record says (whole device)."""
    import torch

    from graphpool.snapshot import buffers_from_snapshot, write_csv

    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=10_000_000)
        try:
            step()
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        found = buffers_from_snapshot(snap, device=torch.cuda.current_device())
        with open(path, "w") as f:
            write_csv(found.buffers, f)
        return {"trace_path": path, "trace_buffers": len(found.buffers),
                "trace_events": found.events,
                "trace_live_gib": found.peak_live_bytes / GiB,
                "trace_reserved_gib": (found.peak_reserved_bytes or 0) / GiB,
                "trace_torch_max_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
                "trace_torch_max_allocated_gib": torch.cuda.max_memory_allocated() / GiB}
    except Exception as e:  # noqa: BLE001 - reported in the row, the other figures stand
        return {"trace_error": f"{type(e).__name__}: {e}"[:300]}


def cli_plan(cli: str, args: list[str], timeout: float) -> tuple[dict[str, Any] | None, str]:
    """``graphpool plan ARGS --json``: the plan, or None and the end of what the CLI said."""
    import subprocess

    p = subprocess.run([cli, "plan", *args, "--json"], capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        return None, (p.stderr or p.stdout)[-300:]
    return json.loads(p.stdout), ""


def plan_recorded_step(r: dict[str, Any], cli: str, keep_dir: str) -> None:
    """``graphpool plan --buffers`` on the eager step's recorded allocations (1 s); the list is
    kept gzipped in `keep_dir` when one is given."""
    import gzip
    import shutil

    path = r.get("trace_path")
    if not path or not cli:
        return
    try:
        plan, error = cli_plan(cli, ["--buffers", path, "--time-budget-ms", "1000"], 120)
        if plan is None:
            r["trace_error"] = error
            return
        r.update(trace_planned_gib=plan["footprint_bytes"] / GiB,
                 trace_lower_bound_gib=plan["lower_bound_bytes"] / GiB,
                 trace_planning_s=plan["planning_seconds"])
        if keep_dir:
            os.makedirs(keep_dir, exist_ok=True)
            kept = os.path.join(keep_dir, os.path.basename(path) + ".gz")
            with open(path, "rb") as src, gzip.open(kept, "wb") as dst:
                shutil.copyfileobj(src, dst)
            r["trace_path"] = kept
    except Exception as e:  # noqa: BLE001
        r["trace_error"] = f"{type(e).__name__}: {e}"[:300]


def fmt_trace(r: dict[str, Any]) -> str:
    """One line on an eager row's recorded step, where one was recorded."""
    if "trace_error" in r:
        return f"  recorded step: error: {r['trace_error']}"
    if "trace_planned_gib" not in r:
        return ""
    return (f"  recorded step ({r['schedule']} M={r['m']}, whole device): {r['trace_buffers']} "
            f"buffers; torch reserved {r['trace_reserved_gib']:.2f} GiB at most "
            f"(max_memory_reserved {r['trace_torch_max_reserved_gib']:.2f}); most live at once "
            f"{r['trace_live_gib']:.2f} GiB; graphpool plan {r['trace_planned_gib']:.2f} GiB "
            f"({r['trace_planned_gib'] / r['trace_lower_bound_gib']:.4f} x its bound, "
            f"{r['trace_planning_s'] * 1e3:.0f} ms), "
            + (f"{r['trace_planned_gib'] / r['trace_reserved_gib']:.3f} x torch's reserved"
               if r["trace_reserved_gib"] else "torch's reserved unknown"))


def pool_report(gs: Any) -> dict[str, Any]:
    """Where a capture's memory went, per pool: every segment (size, bytes allocated in it) and,
    for the segments after each pool's first (the arena), the blocks with the Python frame that
    allocated each; plus what the capture left reserved outside its pools."""
    import torch

    snap = torch.cuda.memory._snapshot()
    labels = {tuple(pid): label for label, pid in
              ((lb, capture_pool_id(p)) for lb, p in gs._pools)}
    pools: dict[str, Any] = {}
    outside = []
    for seg in snap["segments"]:
        pid = tuple(seg.get("segment_pool_id") or (0, 0))
        entry = {"size_mib": seg["total_size"] / 2**20,
                 "allocated_mib": seg["allocated_size"] / 2**20,
                 "stream": seg.get("stream")}
        label = labels.get(pid)
        if label is None:
            outside.append(entry)
            continue
        segs = pools.setdefault(label, [])
        if segs and seg["total_size"] < (1 << 30):
            blocks = []
            for b in seg.get("blocks", ()):
                frames = [f for f in b.get("frames", ()) if "graphpool" in f.get("filename", "")
                          or "seed" in f.get("filename", "") or "torch/nn" in f.get("filename", "")]
                where = "; ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
                                  for f in frames[:3])
                blocks.append({"mib": b["size"] / 2**20, "state": b["state"], "where": where})
            entry["blocks"] = blocks[:24]
        segs.append(entry)
    return {"pools": pools, "outside_pools": outside}


def capture_pool_id(pool: Any) -> Any:
    from graphpool.capture.memory import _pool_id

    return _pool_id(pool)


# ------------------------------------------------------------------------------------ parent


def _daemon_ledger() -> dict[str, Any]:
    """What graphpoold granted this process: the shim's session counter and the daemon's own
    ledger (ListGrants of this pid)."""
    import torch

    res: dict[str, Any] = {}
    try:
        from graphpool import _shim

        st = _shim.stats(torch.cuda.current_device())
        if st:
            res["granted_gib"] = st[0] / GiB
            res["granted_segments"] = st[1]
    except Exception as e:  # noqa: BLE001
        res["granted_error"] = f"{type(e).__name__}: {e}"
    try:
        import graphpool

        grants = [g for g in graphpool.Client().grants() if g.pid == os.getpid()]
        res["ledger_gib"] = sum(g.size for g in grants) / GiB
        res["ledger_grants"] = len(grants)
    except Exception as e:  # noqa: BLE001
        res["ledger_error"] = f"{type(e).__name__}: {e}"
    return res


def predict_with_cli(r: dict[str, Any], cli: str, tmp: str,
                     calibration: dict[str, Any] | None = None) -> None:
    """``graphpool plan --schedule <description> --json``: the planner's predicted capture bytes
    for the measured case's profile."""
    desc = r.get("plan_description")
    if not desc or not cli:
        return

    def plan(d: dict[str, Any], tag: str) -> dict[str, Any] | None:
        path = os.path.join(tmp, f"plan_{r['schedule']}_{r['m']}_{r['variant']}_{tag}.json")
        with open(path, "w") as f:
            json.dump(d, f)
        plan, error = cli_plan(cli, ["--schedule", path], 60)
        if plan is None:
            r["plan_error"] = error
        return plan

    try:
        # the planned buffers alone (the profile of one eager step)
        static = plan(desc, "static")
        if static is None:
            return
        r["plan_static_gib"] = static["predicted_capture_bytes"] / GiB
        r["plan_lower_bound_gib"] = static.get("lower_bound_bytes", 0) / GiB
        r["plan_predicted_gib"] = r["plan_static_gib"]
        # plus the capture overhead measured by the calibration row (another capture)
        if calibration and calibration.get("capture_overhead"):
            full = plan(dict(desc, overhead=calibration["capture_overhead"]), "overhead")
            if full is not None:
                r["plan_predicted_gib"] = full["predicted_capture_bytes"] / GiB
                r["plan_overhead_gib"] = full.get("overhead_bytes", 0) / GiB
                r["plan_overhead_from"] = f"{calibration['schedule']} M={calibration['m']}"
        if r.get("footprint_gib"):
            r["plan_vs_footprint"] = r["plan_predicted_gib"] / r["footprint_gib"] - 1.0
    except Exception as e:  # noqa: BLE001
        r["plan_error"] = f"{type(e).__name__}: {e}"


def run_case(case: dict[str, Any], timeout: float) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    p = ctx.Process(target=child, args=(case, b))
    p.start()
    b.close()
    res: dict[str, Any]
    if a.poll(timeout):
        try:
            res = a.recv()
        except EOFError:
            res = {"error": "child exited without a result"}
    else:
        res = {"error": f"timeout after {timeout:.0f} s"}
    p.join(5)
    if p.is_alive():
        p.kill()
        p.join()
    if p.exitcode not in (0, None) and "error" not in res:
        res["error"] = f"exit code {p.exitcode}"
    res["wall_s"] = time.perf_counter() - t0
    return res


def fmt_row(r: dict[str, Any], eager: dict[str, Any] | None) -> str:
    def f(x: Any, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    if r.get("oom"):
        return (f"| {r['schedule']} | {r['m']} | {r['variant']} | OOM ({f(r.get('footprint_at_oom_gib'))} GiB "
                f"at failure) | | | | {r.get('graphs_attempted', '')} (attempted) | {f(r.get('capture_s'))} | | | |")
    if "error" in r:
        return f"| {r['schedule']} | {r['m']} | {r['variant']} | error: {r['error'][:80]} | | | | | | | | |"
    ratio = None
    if eager and "peak_reserved_gib" in eager and eager["peak_reserved_gib"]:
        ratio = r["footprint_gib"] / eager["peak_reserved_gib"]
    extra = []
    if "granted_gib" in r:
        extra.append(f"daemon {r['granted_gib']:.2f}")
    if "plan_predicted_gib" in r:
        extra.append(f"plan {r['plan_predicted_gib']:.2f} ({100 * r['plan_vs_footprint']:+.1f}%; "
                     f"buffers alone {r['plan_static_gib']:.2f})")
    if r["variant"] == "eager":
        check = f"noise {r.get('grad_noise_max', 0) * 100:.3f}%"
    elif "grad_ok" in r:
        check = (f"{'ok' if r['grad_ok'] else 'FAIL'} {r['grad_max_rel'] * 100:.3f}% "
                 f"= {r['grad_max_over_eager_noise']:.2f}x noise ({r['grad_bad_tensors']}/{r['grad_tensors']} over)")
    else:
        check = "-"
    return (f"| {r['schedule']} | {r['m']} | {r['variant']}{'*' if r.get('pool_kind') == 'torch' else ''} "
            f"| {f(r['footprint_gib'])} | {f(ratio, '.3f')} | {f(r['peak_reserved_gib'])} "
            f"| {f(r['peak_allocated_gib'])} | {r['graphs']} | {f(r['capture_s'])} | {f(r['step_ms'], '.1f')} "
            f"| {check} | {'; '.join(extra)} |")


HEADER = ("| schedule | M | variant | footprint GiB | / eager peak reserved | peak reserved GiB "
          "| peak allocated GiB | graphs | capture s | step ms (median) | gradient check "
          "| daemon granted GiB; planner prediction |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="8,32,128", help="microbatch counts, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {VARIANTS + ['unsafe-onepool']} (eager always runs first)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"of {list(SCHEDULES)}")
    ap.add_argument("--steps", type=int, default=3, help="timed full schedules per variant")
    ap.add_argument("--quick", action="store_true", help="M=8 only, 2 timed steps")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (4096 = the seed stage)")
    ap.add_argument("--pools", default="auto", choices=["auto", "graphpool", "torch"],
                    help="graphpool variant: daemon-backed pools, plain torch pools, or auto")
    ap.add_argument("--graphpool-cli", default=os.environ.get("GRAPHPOOL_CLI", ""),
                    help="the graphpool CLI: when given, `graphpool plan` predicts each "
                         "graphpool case's footprint from its profile")
    ap.add_argument("--order", default="variant-major",
                    choices=["variant-major", "schedule-major"],
                    help="schedule-major: every variant of a (schedule, M) before the next; "
                         "variant-major: extras after all the four columns")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per variant process")
    ap.add_argument("--out", default="", help="JSON output path")
    ap.add_argument("--pool-report", default="",
                    help="comma-separated M values: graphpool variants at these M record "
                         "allocation history during "
                         "capture and report every pool's segments and what its overflow "
                         "segments hold (slower capture; for diagnosis)")
    ap.add_argument("--plan-eager-step", action="store_true",
                    help="record one more eager step per (schedule, M) and plan its allocations "
                         "with `graphpool plan --buffers` (needs --graphpool-cli)")
    ap.add_argument("--trace-dir", default="",
                    help="with --plan-eager-step: keep each recorded step's buffer list here "
                         "(eager_<schedule>_<M>.csv.gz)")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds after which remaining cases are skipped (0 = none)")
    args = ap.parse_args()
    ms = [8] if args.quick else [int(x) for x in args.m.split(",") if x]
    steps = 2 if args.quick else args.steps
    variants = [v for v in args.variants.split(",") if v]
    report_ms = {int(x) for x in args.pool_report.split(",") if x}
    if "eager" in variants:
        variants.remove("eager")
    extras = [v for v in variants if v in EXTRAS]
    variants = ["eager"] + [v for v in variants if v not in EXTRAS]  # the reference first
    import torch  # imported here, CUDA initialised only in the children

    meta = {"torch": torch.__version__, "argv": sys.argv, "grad_floor": GRAD_FLOOR,
            "stage": "9 layers, hidden 1024, FFN 4096, 16 heads, seq %d, mb 1, bf16" % args.seq}
    results: list[dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="seed_repro_")
    t_all = time.perf_counter()
    print(HEADER, flush=True)
    # the four columns for every (schedule, M) first, the opt-in extras after them
    if args.order == "schedule-major":
        plan = [(s_, m, v) for s_ in args.schedules.split(",") for m in ms for v in variants + extras]
    else:
        plan = [(s_, m, v) for s_ in args.schedules.split(",") for m in ms for v in variants]
        plan += [(s_, m, v) for s_ in args.schedules.split(",") for m in ms for v in extras]
    eagers: dict[tuple[str, int], dict[str, Any]] = {}
    calibration: dict[str, Any] | None = None
    for sname, m, v in plan:
        ref_path = os.path.join(tmp, f"ref_{sname}_{m}.pt")
        if args.deadline and time.perf_counter() - t_all > args.deadline:
            r = {"error": "skipped: --deadline reached", "skipped": True}
        else:
            case = dict(variant=v, m=m, schedule=sname, steps=steps, ref_path=ref_path,
                        seq=args.seq, pools=args.pools,
                        pool_report=m in report_ms and v in GP_VARIANTS)
            if v == "eager" and args.plan_eager_step and args.graphpool_cli:
                case["eager_trace"] = os.path.join(tmp, f"eager_{sname}_{m}.csv")
            r = run_case(case, args.timeout)
        r.update(variant=v, m=m, schedule=sname)
        if calibration is None and v == "graphpool" and r.get("capture_overhead"):
            calibration = r  # the first graphpool capture calibrates every prediction
        predict_with_cli(r, args.graphpool_cli, tmp, calibration)
        plan_recorded_step(r, args.graphpool_cli, args.trace_dir)
        results.append(r)
        if v == "eager":
            eagers[(sname, m)] = r
        print(fmt_row(r, eagers.get((sname, m))), flush=True)
        if fmt_trace(r):
            print(fmt_trace(r), flush=True)
        if "trace" in r:
            print(r["trace"], file=sys.stderr)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    if "device" not in meta:
        meta["device"] = _device_name()
    meta["total_s"] = time.perf_counter() - t_all
    print(f"\n{meta['device']}, torch {meta['torch']}; total {meta['total_s']:.0f} s; "
          f"* = graphpool variant with plain torch.cuda.MemPool pools split as graphpool does")
    print("\n" + HEADER)
    by = {(r["schedule"], r["m"]): r for r in results if r["variant"] == "eager"}
    for r in results:
        print(fmt_row(r, by.get((r["schedule"], r["m"]))))
    for r in results:
        if fmt_trace(r):
            print(fmt_trace(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    return 0


def _device_name() -> str:
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe(duplex=False)

    def q(conn: Any) -> None:
        import torch

        conn.send(f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / GiB:.0f} GiB)")

    p = ctx.Process(target=q, args=(b,))
    p.start()
    name = a.recv() if a.poll(60) else "unknown"
    p.join()
    return name


if __name__ == "__main__":
    raise SystemExit(main())
