"""GPU: schedule-aware capture replays a whole schedule with slot reuse and gets eager's gradients,
even when every pool that holds nothing live is overwritten with NaN between schedule steps.

Each case runs in a process of its own (this file is also the child's program): the test process
never initialises CUDA, every child closes its captures explicitly (graphs before pools) and
leaves with ``os._exit``, so no result depends on the order in which a garbage collector or the
interpreter's shutdown destroys graphs and pools; a crash is reported with the case that caused
it.

Pool kinds: ``torch`` (``torch.cuda.MemPool`` with default segments and an arena per pool),
``torch-xs`` (the same with expandable segments, the default for torch pools) and ``graphpool`` (pools backed by a graphpoold: needs ``$GRAPHPOOL_SOCKET`` naming
a running daemon with the cuda backend and ``$GRAPHPOOL_SHIM``; skipped otherwise).
``$GRAPHPOOL_POISON_OUT`` names a JSON-lines file that gets one record per case.
``replay_check.py`` has what this and the other capture tests share.

Skipped without torch or CUDA.
"""

from __future__ import annotations

from typing import Any

try:
    from . import replay_check as rc  # collected by pytest
except ImportError:  # run as the child's program: this directory is on the path
    import replay_check as rc  # type: ignore[no-redef]

HID, HEADS, FFN, SEQ = 256, 4, 1024, 256
FLOOR = 1e-3

CASES = {
    "1f1b-s0": ("one_f_one_b", (4, 0, 10), [3]),
    "1f1b-last": ("one_f_one_b", (4, 3, 5), [3]),
    "interleaved": ("interleaved", (2, 0, 6, 2), [2, 2]),
    "explicit": ("explicit", ([1, 1, 2, -2, 1, -1, 2, 1, -2, -1, 2, -1, -2, -1, 2, -2], 4, 2), [2, 1]),
}
KINDS = ["torch", "torch-xs", "graphpool"]


def _block_class() -> Any:
    """The transformer block both the child and the in-process tests capture (torch is imported
    here, not at module import, so that the test process can skip without torch)."""
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(HID), nn.LayerNorm(HID)
            self.qkv, self.proj = nn.Linear(HID, 3 * HID), nn.Linear(HID, HID)
            self.fc1, self.fc2 = nn.Linear(HID, FFN), nn.Linear(FFN, HID)

        def forward(self, x: Any) -> Any:
            b, s, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, h // HEADS).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    return Block


# ------------------------------------------------------------------------- the child's program


def _child_main(argv: list[str]) -> int:  # pragma: no cover - runs on a GPU machine
    import torch

    from graphpool.capture import make_graphed_callables
    from graphpool.schedule import Schedule

    Block = _block_class()

    def build(chunk_sizes: list[int], dtype: Any) -> list[list[Block]]:
        torch.manual_seed(0)
        return [[Block().to("cuda", dtype) for _ in range(n)] for n in chunk_sizes]

    def data(sched: Any, dtype: Any) -> tuple[Any, Any]:
        g = torch.Generator(device="cuda").manual_seed(1)
        shape = (2, SEQ, HID)
        v, m = sched.virtual_chunks, sched.num_microbatches
        X = [[torch.randn(shape, device="cuda", dtype=dtype, generator=g) for _ in range(m)] for _ in range(v)]
        G = [[torch.randn(shape, device="cuda", dtype=dtype, generator=g) for _ in range(m)] for _ in range(v)]
        return X, G

    def params(chunks: list[list[Block]]) -> list[Any]:
        return [p for ch in chunks for lay in ch for p in lay.parameters()]

    def run(sched: Any, fwd: Any, X: Any, G: Any, between: Any = None, input_grad: bool = True) -> list[Any]:
        live: dict[tuple[int, int], Any] = {}
        in_grads = []
        for st in sched.steps:
            if between is not None:
                between()
            if st.kind == "F":
                x = X[st.chunk][st.microbatch].detach().requires_grad_(input_grad)
                live[(st.chunk, st.microbatch)] = (x, fwd(st.chunk, st.microbatch, x))
            else:
                x, y = live.pop((st.chunk, st.microbatch))
                torch.autograd.backward(y, G[st.chunk][st.microbatch])
                if input_grad:
                    in_grads.append(x.grad)
        return in_grads

    rel, capture_kw, granted = rc.rel, rc.capture_kw, rc.granted

    def poisoned_replay(kind: str, case: str, dtype: Any) -> dict[str, Any]:
        ctor, args, sizes = CASES[case]
        sched = getattr(Schedule, ctor)(*args)
        chunks = build(sizes, dtype)
        ps = params(chunks)
        X, G = data(sched, dtype)

        def eager_fwd(c: int, m: int, x: Any) -> Any:
            for lay in chunks[c]:
                x = lay(x)
            return x

        ref = []
        for _ in range(3):
            for p in ps:
                p.grad = None
            ig = run(sched, eager_fwd, X, G)
            ref.append(([p.grad.clone() for p in ps], [g.clone() for g in ig]))
        noise = max(rel(a, b) for a, b in zip(ref[1][0] + ref[2][0], ref[0][0] + ref[0][0]))
        thr = 1.5 * max(noise, FLOOR)  # one noise sample: a margin, as the benchmark uses

        samples = [(X[c][0].detach().requires_grad_(),) for c in range(len(chunks))]
        gs = make_graphed_callables(chunks, samples, schedule=sched, num_warmup_iters=1,
                                    **capture_kw(kind))
        rec: dict[str, Any] = {"graphs": gs.num_graphs, "pool_kind": gs.stats.pool_kind,
                               "threshold": thr, "passes": []}
        try:
            want = 2 * sum(n * s for n, s in zip(sizes, sched.slots_per_chunk))
            assert gs.num_graphs == want, (gs.num_graphs, want)
            assert gs.stats.pool_kind == ("graphpool" if kind == "graphpool" else "torch")
            rec["granted_bytes"] = granted()
            rec["reserved_bytes"] = sum(size for _, _, size in gs.pool_segments())

            def graph_fwd(c: int, m: int, x: Any) -> Any:
                for call in gs.chunk(c, m):
                    x = call(x)
                return x

            for it in range(2):
                poisoned: list[int] = []
                # set_to_none on one pass, zero on the other: both must accumulate like eager
                for p in ps:
                    if it == 0:
                        p.grad = None
                    else:
                        p.grad.zero_()
                ig = run(sched, graph_fwd, X, G, between=lambda: poisoned.append(gs.poison()))
                assert sum(poisoned) > 0, "nothing was poisoned"
                diffs = [rel(p.grad, r) for p, r in zip(ps, ref[0][0])]
                bad = [(i, d) for i, d in enumerate(diffs) if not d <= thr]
                # the chunk-input gradients leave the pools: still right after later poisoning
                bad_in = [i for i, (a, b) in enumerate(zip(ig, ref[0][1])) if not rel(a, b) <= thr]
                rec["passes"].append({"poisoned_bytes": sum(poisoned), "max_rel": max(diffs),
                                      "bad": len(bad), "tensors": len(diffs), "bad_input_grads": len(bad_in)})
                assert not bad, f"{len(bad)}/{len(ps)} parameter gradients off (thr {thr:.2e}): {bad[:5]}"
                assert not bad_in, f"{len(bad_in)} chunk-input gradients off"
        finally:
            gs.close()
        rec["granted_after_close_bytes"] = granted()
        return rec

    kind, case = argv[0], argv[1]
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        rec: dict[str, Any] = {"kind": kind, "case": case, "dtype": str(dtype).replace("torch.", "")}
        try:
            rec.update(poisoned_replay(kind, case, dtype))
            rec["ok"] = True
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            rc.failed(rec, e)
            ok = False
        torch.cuda.synchronize()
        rc.report(rec)
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    rc.child_entry(_child_main)


# ------------------------------------------------------------------------------- the tests

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs a CUDA device", allow_module_level=True)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_poisoned_replay_matches_eager(kind: str, case: str) -> None:
    if kind == "graphpool" and not rc.daemon_ready():
        pytest.skip(rc.GRAPHPOOL_SKIP)
    r = rc.run_child(__file__, kind, case)
    results = rc.results(r)
    detail = rc.detail(r)
    assert r.returncode == 0, detail
    assert len(results) == 2 and all(x["ok"] for x in results), detail


# In-process tests below: each closes its capture in a finally block.

from graphpool.capture import make_graphed_callables  # noqa: E402
from graphpool.schedule import Schedule  # noqa: E402


_Block = _block_class()


def _build(n: int) -> list[_Block]:
    torch.manual_seed(0)
    return [_Block().to("cuda") for _ in range(n)]


def _data(m: int) -> tuple[list[Any], list[Any]]:
    g = torch.Generator(device="cuda").manual_seed(1)
    X = [torch.randn((2, SEQ, HID), device="cuda", generator=g) for _ in range(m)]
    G = [torch.randn((2, SEQ, HID), device="cuda", generator=g) for _ in range(m)]
    return X, G


def test_out_of_order_call_is_refused() -> None:
    sched = Schedule.one_f_one_b(2, 0, 4)  # 2 slots
    layers = _build(2)
    X, G = _data(4)
    gs = make_graphed_callables(layers, [(X[0].detach().requires_grad_(),)], schedule=sched,
                                pools="torch", num_warmup_iters=1)
    try:
        ys = [gs[1, m](gs[0, m](X[m])) for m in range(2)]
        with pytest.raises(RuntimeError, match="still held by microbatch 0"):
            gs[0, 2](X[2])  # microbatch 2 reuses slot 0 before microbatch 0's backward
        torch.autograd.backward(ys[0], G[0])
        gs[0, 2](X[2])  # now it may
        del ys
    finally:
        gs.close()


def test_input_without_grad_still_accumulates_params() -> None:
    sched = Schedule.one_f_one_b(2, 1, 3)
    layers = _build(2)
    ps = [p for lay in layers for p in lay.parameters()]
    X, G = _data(3)
    for m in range(3):
        torch.autograd.backward(layers[1](layers[0](X[m])), G[m])
    ref = [p.grad.clone() for p in ps]
    gs = make_graphed_callables(layers, [(X[0],)], schedule=sched, pools="torch", num_warmup_iters=1)
    try:
        for p in ps:
            p.grad = None
        for st in sched.steps:  # last stage: F then B of each microbatch
            if st.kind == "F":
                y = gs[1, st.microbatch](gs[0, st.microbatch](X[st.microbatch]))
            else:
                torch.autograd.backward(y, G[st.microbatch])
        for p, r in zip(ps, ref):
            d = torch.linalg.vector_norm(p.grad - r) / torch.linalg.vector_norm(r)
            assert d.item() <= 1e-2  # nondeterministic attention backward: loose
    finally:
        gs.close()
