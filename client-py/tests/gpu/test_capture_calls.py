"""The callables of a schedule-aware capture (graphpool.capture.make_graphed_callables) at run
time: calls with gradients disabled, and inputs that do not match the capture (two small
Linear layers, 1F1B stage 0 of 2: two slots); and the warm-up's watch for backwards that draw
random numbers. Plain torch pools (no daemon needed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import graphpool  # noqa: E402
from graphpool.capture import GraphedSchedule, UnsupportedLayer, make_graphed_callables  # noqa: E402
from graphpool.schedule import Schedule  # noqa: E402

M = 4


@pytest.fixture
def captured() -> Iterator[tuple[GraphedSchedule, list[Any], list[Any]]]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64).cuda() for _ in range(2)]
    X = [torch.randn(8, 64, device="cuda") for _ in range(M)]
    sample = X[0].detach().clone().requires_grad_()
    gs = make_graphed_callables(
        layers, [(sample,)], schedule=Schedule.one_f_one_b(2, 0, M), pools="torch", num_warmup_iters=1
    )
    try:
        yield gs, layers, X
    finally:
        gs.close()


def test_no_grad_call_runs_eagerly_and_takes_no_slot(
    captured: tuple[GraphedSchedule, list[Any], list[Any]],
) -> None:
    """Under no_grad (evaluation) no backward will free a slot: the layers run eagerly, give
    eager's results, and every slot stays free, so training goes on afterwards."""
    gs, layers, X = captured
    with torch.no_grad():
        for m in range(M):  # more microbatches than slots: each would claim one for good
            y = gs[1, m](gs[0, m](X[m]))
            assert torch.allclose(y, layers[1](layers[0](X[m])))
    with torch.inference_mode():
        gs[1, 0](gs[0, 0](X[0]))
    assert gs.slots_in_use() == [[None, None]]
    y = gs[1, 0](gs[0, 0](X[0]))
    assert gs.slots_in_use() == [[0, None]]
    torch.autograd.backward(y, torch.ones_like(y))
    assert gs.slots_in_use() == [[None, None]]


def test_inputs_that_do_not_match_the_capture_are_refused(
    captured: tuple[GraphedSchedule, list[Any], list[Any]],
) -> None:
    """The graphs replay at the sample's shapes and dtypes: another number of inputs, shape or
    dtype is refused naming the input, before the slot is taken."""
    gs, _, X = captured
    with pytest.raises(TypeError, match="1 input.*got 2"):
        gs[0, 0](X[0], X[1])
    with pytest.raises(ValueError, match=r"input 0 .*expected shape \(8, 64\).*got shape \(4, 64\)"):
        gs[0, 0](X[0][:4])
    with pytest.raises(ValueError, match="input 0 .*dtype torch.float32.*dtype torch.float16"):
        gs[0, 0](X[0].half())
    assert gs.slots_in_use() == [[None, None]]
    y = gs[1, 0](gs[0, 0](X[0]))  # the matching input still replays
    torch.autograd.backward(y, torch.ones_like(y))
    assert gs.slots_in_use() == [[None, None]]


def test_a_later_layer_takes_only_the_previous_layers_outputs(
    captured: tuple[GraphedSchedule, list[Any], list[Any]],
) -> None:
    """Layer 1's static input is layer 0's static output (the same memory): called with
    anything but layer 0's output as returned (``norm(h)``, a copy), it is refused before it
    replays, and ``h`` keeps its value instead of becoming that input. Called with ``h``, a
    residual around it (``y = g[1, m](h) + h``) gives eager's outputs and gradients."""
    gs, layers, X = captured
    params = [p for lay in layers for p in lay.parameters()]
    for p in params:
        p.grad = None
    xe = X[0].detach().clone().requires_grad_()
    he = layers[0](xe)
    ye = layers[1](he) + he
    ye.backward(torch.ones_like(ye))
    want = [xe.grad.clone()] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    x = X[0].detach().clone().requires_grad_()
    h = gs[0, 0](x)
    before = h.detach().clone()
    for bad in (torch.nn.functional.layer_norm(h, (64,)), h.clone(), h.detach().clone()):
        with pytest.raises(graphpool.InvalidArgument, match="exactly as returned") as ei:
            gs[1, 0](bad)
        assert ei.value.field == "args"
    assert torch.equal(h, before), "layer 0's output was overwritten"
    assert gs.slots_in_use() == [[0, None]]
    y = gs[1, 0](h) + h
    assert torch.allclose(y, ye, rtol=1e-4, atol=1e-5)
    y.backward(torch.ones_like(y))
    got = [x.grad] + [p.grad for p in params]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-5), (g - w).abs().max()
    assert gs.slots_in_use() == [[None, None]]


class _AttentionWithDropout(torch.nn.Module):
    """Self-attention with dropout on its weights (``dropout_p``): the fused backward kernels
    replay the forward's mask from the seed and offset they saved, drawing nothing."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: Any) -> Any:
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, n, w))


class _DropoutRecomputed(torch.nn.Module):
    """Dropout inside a non-reentrant checkpoint: the backward recomputes it, drawing again."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(
            lambda t: torch.nn.functional.dropout(self.lin(t), 0.25, True), x, use_reentrant=False
        )


def test_a_backward_that_draws_is_refused_and_attention_dropout_is_not() -> None:
    """The warm-up watches each layer's backward for ops that draw random numbers: attention
    with dropout (whose backward replays the forward's mask) is captured and replays with
    gradients, dropout recomputed by activation checkpointing is refused naming the layer."""
    torch.manual_seed(0)
    width = 128
    x = torch.randn(2, 256, width, device="cuda", dtype=torch.float16)
    layers = [_AttentionWithDropout(width, 4).cuda().half(), torch.nn.Linear(width, width).cuda().half()]
    gs = make_graphed_callables(
        layers, [(x.clone().requires_grad_(),)], schedule=Schedule.one_f_one_b(2, 0, 2),
        pools="torch", num_warmup_iters=2,
    )
    try:
        xi = x.clone().requires_grad_()
        y = gs[1, 0](gs[0, 0](xi))
        y.backward(torch.ones_like(y))
        assert xi.grad is not None and torch.isfinite(xi.grad).all() and xi.grad.abs().sum() > 0
    finally:
        gs.close()

    layers = [torch.nn.Linear(width, width).cuda(), _DropoutRecomputed(width).cuda()]
    sample = torch.randn(8, width, device="cuda").requires_grad_()
    with pytest.raises(UnsupportedLayer, match="draws random numbers") as ei:
        make_graphed_callables(
            layers, [(sample,)], schedule=Schedule.one_f_one_b(2, 0, 2), pools="torch", num_warmup_iters=2
        )
    assert (ei.value.chunk, ei.value.layer) == (0, 1), str(ei.value)
