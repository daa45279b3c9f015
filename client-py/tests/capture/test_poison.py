"""GPU: schedule-aware capture replays a whole schedule with slot reuse and gets eager's gradients,
even when every pool that holds nothing live is overwritten with NaN between schedule steps.

Skipped without torch or CUDA.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs a CUDA device", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from graphpool.capture import make_graphed_callables  # noqa: E402
from graphpool.schedule import Schedule  # noqa: E402

HID, HEADS, FFN, SEQ = 256, 4, 1024, 256
FLOOR = 1e-3


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


def build(chunk_sizes: list[int], dtype: Any) -> list[list[Block]]:
    torch.manual_seed(0)
    out = []
    for n in chunk_sizes:
        out.append([Block().to("cuda", dtype) for _ in range(n)])
    return out


def data(sched: Schedule, dtype: Any) -> tuple[list[list[Any]], list[list[Any]]]:
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = (2, SEQ, HID)
    v, m = sched.virtual_chunks, sched.num_microbatches
    X = [[torch.randn(shape, device="cuda", dtype=dtype, generator=g) for _ in range(m)] for _ in range(v)]
    G = [[torch.randn(shape, device="cuda", dtype=dtype, generator=g) for _ in range(m)] for _ in range(v)]
    return X, G


def params(chunks: list[list[Block]]) -> list[Any]:
    return [p for ch in chunks for lay in ch for p in lay.parameters()]


def run(sched: Schedule, fwd: Any, X: Any, G: Any, between: Any = None, input_grad: bool = True) -> list[Any]:
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


def rel(a: Any, b: Any) -> float:
    d = torch.linalg.vector_norm((a.float() - b.float())).item()
    n = torch.linalg.vector_norm(b.float()).item()
    return d / n if n else (0.0 if d == 0 else math.inf)


CASES = {
    "1f1b-s0": (lambda: Schedule.one_f_one_b(4, 0, 10), [3]),
    "1f1b-last": (lambda: Schedule.one_f_one_b(4, 3, 5), [3]),
    "interleaved": (lambda: Schedule.interleaved(2, 0, 6, 2), [2, 2]),
    "explicit": (lambda: Schedule.explicit([1, 1, 2, -2, 1, -1, 2, 1, -2, -1, 2, -1, -2, -1, 2, -2], 4, 2), [2, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_poisoned_replay_matches_eager(case: str, dtype: Any) -> None:
    mk, sizes = CASES[case]
    sched = mk()
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
    gs = make_graphed_callables(chunks, samples, schedule=sched,
                                pools="torch", num_warmup_iters=1)
    assert gs.num_graphs == 2 * sum(n * s for n, s in zip(sizes, sched.slots_per_chunk))

    def graph_fwd(c: int, m: int, x: Any) -> Any:
        for call in gs.chunk(c, m):
            x = call(x)
        return x

    poisoned = []
    for it in range(2):
        # set_to_none on one pass, zero on the other: both must accumulate like eager
        for p in ps:
            if it == 0:
                p.grad = None
            else:
                p.grad.zero_()
        ig = run(sched, graph_fwd, X, G, between=lambda: poisoned.append(gs.poison()))
        assert sum(poisoned) > 0
        bad = [(i, rel(p.grad, r)) for i, (p, r) in enumerate(zip(ps, ref[0][0]))
               if not rel(p.grad, r) <= thr]
        assert not bad, f"{len(bad)}/{len(ps)} parameter gradients off (thr {thr:.2e}): {bad[:5]}"
        # the chunk-input gradients leave the pools: still right after later poisoning
        for a, b in zip(ig, ref[0][1]):
            assert rel(a, b) <= thr
    gs.close()


def test_out_of_order_call_is_refused() -> None:
    sched = Schedule.one_f_one_b(2, 0, 4)  # 2 slots
    chunks = build([2], torch.float32)
    X, G = data(sched, torch.float32)
    gs = make_graphed_callables(chunks[0], [(X[0][0].detach().requires_grad_(),)], schedule=sched,
                                pools="torch", num_warmup_iters=1)
    ys = [gs[1, m](gs[0, m](X[0][m])) for m in range(2)]
    with pytest.raises(RuntimeError, match="still held by microbatch 0"):
        gs[0, 2](X[0][2])  # microbatch 2 reuses slot 0 before microbatch 0's backward
    torch.autograd.backward(ys[0], G[0][0])
    gs[0, 2](X[0][2])  # now it may
    gs.close()


def test_input_without_grad_still_accumulates_params() -> None:
    sched = Schedule.one_f_one_b(2, 1, 3)
    chunks = build([2], torch.float32)
    ps = params(chunks)
    X, G = data(sched, torch.float32)

    def eager_fwd(c: int, m: int, x: Any) -> Any:
        for lay in chunks[c]:
            x = lay(x)
        return x

    run(sched, eager_fwd, X, G, input_grad=False)
    ref = [p.grad.clone() for p in ps]
    gs = make_graphed_callables(chunks[0], [(X[0][0],)], schedule=sched, pools="torch",
                                num_warmup_iters=1)
    for p in ps:
        p.grad = None
    run(sched, lambda c, m, x: gs[1, m](gs[0, m](x)), X, G, input_grad=False)
    for p, r in zip(ps, ref):
        assert rel(p.grad, r) <= 1e-2  # nondeterministic attention backward: loose
    gs.close()


def test_expandable_segments_pools_match_eager() -> None:
    sched = Schedule.one_f_one_b(3, 0, 7)
    chunks = build([2], torch.float32)
    ps = params(chunks)
    X, G = data(sched, torch.float32)
    run(sched, lambda c, m, x: chunks[0][1](chunks[0][0](x)), X, G)
    ref = [p.grad.clone() for p in ps]
    gs = make_graphed_callables(chunks[0], [(X[0][0].detach().requires_grad_(),)], schedule=sched,
                                pools="torch", num_warmup_iters=1, expandable_segments=True)
    for p in ps:
        p.grad = None
    run(sched, lambda c, m, x: gs[1, m](gs[0, m](x)), X, G, between=gs.poison)
    for p, r in zip(ps, ref):
        assert rel(p.grad, r) <= 1e-2
    gs.close()
