"""The callables of a schedule-aware capture (graphpool.capture.make_graphed_callables) at run
time: calls with gradients disabled, and inputs that do not match the capture (two small
Linear layers, 1F1B stage 0 of 2: two slots); the warm-up's watch for backwards that draw
random numbers; dropout drawn inside an RNG state tracker (``rng_generators``). Plain torch
pools (no daemon needed)."""

from __future__ import annotations

import contextlib
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


class _GraphSafeTracker:
    """An RNG state tracker built as TransformerEngine's and Megatron-LM's graph-safe ones are:
    a CUDA generator of its own, whose state is swapped in as the device generator's around the
    ops that draw (``graphsafe_set_state``) and swapped out after."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator(device="cuda")
        self.generator.manual_seed(seed)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        default = torch.cuda.default_generators[torch.cuda.current_device()]
        outer = default.graphsafe_get_state()
        default.graphsafe_set_state(self.generator)
        try:
            yield
        finally:
            default.graphsafe_set_state(outer)


class _CopyingTracker:
    """An RNG state tracker that copies state tensors in and out of the device generator
    (``torch.cuda.get_rng_state``/``set_rng_state``), as trackers that are not graph-safe do."""

    def __init__(self, seed: int) -> None:
        outer = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        self.state = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(outer)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        outer = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(outer)


class _TrackedDropout(torch.nn.Module):
    """A linear map and dropout drawn inside a tracker's fork (as tensor-parallel dropout is),
    optionally under a non-reentrant activation checkpoint (the backward then draws again)."""

    def __init__(self, width: int, tracker: Any, checkpointed: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.tracker = tracker
        self.checkpointed = checkpointed

    def _body(self, x: Any) -> Any:
        h = self.lin(x)
        with self.tracker.fork():
            return torch.nn.functional.dropout(h, 0.5, True)

    def forward(self, x: Any) -> Any:
        if self.checkpointed:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


def _tracked_layers(tracker: Any, checkpointed: bool = False) -> list[Any]:
    torch.manual_seed(0)
    return [torch.nn.Linear(128, 128).cuda(), _TrackedDropout(128, tracker, checkpointed).cuda()]


def test_dropout_of_a_graph_safe_rng_tracker_replays_what_eager_draws() -> None:
    """Dropout drawn from an RNG state tracker's generator, passed in ``rng_generators``: every
    replay draws a new mask, the one eager execution draws from the same generator state, and
    the backward graphs give eager's input gradients for it."""
    tracker = _GraphSafeTracker(1234)
    layers = _tracked_layers(tracker)
    x = torch.randn(8, 128, device="cuda")
    gs = make_graphed_callables(
        layers, [(x.clone().requires_grad_(),)], schedule=Schedule.one_f_one_b(2, 0, 2),
        pools="torch", num_warmup_iters=2, rng_generators=[tracker.generator],
    )
    try:
        state = tracker.generator.get_state()
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ys = [gs[1, m](gs[0, m](xs[m])) for m in range(2)]
        got = [y.detach().clone() for y in ys]
        for y in ys:
            y.backward(torch.ones_like(y))
        assert not torch.equal(got[0] == 0, got[1] == 0), "two replays drew the same mask"
        assert all(0.3 < (g == 0).float().mean().item() < 0.7 for g in got)

        tracker.generator.set_state(state)
        for m in range(2):
            xe = x.clone().requires_grad_()
            ye = layers[1](layers[0](xe))
            ye.backward(torch.ones_like(ye))
            assert torch.equal(got[m] == 0, ye.detach() == 0), f"microbatch {m}: another mask"
            assert torch.allclose(got[m], ye.detach(), rtol=1e-4, atol=1e-5)
            assert xs[m].grad is not None and xe.grad is not None
            assert torch.allclose(xs[m].grad, xe.grad, rtol=1e-4, atol=1e-5)
    finally:
        gs.close()


def test_a_tracker_generator_not_passed_is_refused_and_both_generators_still_draw() -> None:
    """A tracker's generator left out of ``rng_generators`` is refused naming the layer and the
    argument; a tracker that copies state tensors, naming graph-safe trackers. After either
    refusal the device's generator and the tracker's draw eagerly as before."""
    tracker = _GraphSafeTracker(7)
    sample = torch.randn(8, 128, device="cuda").requires_grad_()
    with pytest.raises(UnsupportedLayer, match="rng_generators") as ei:
        make_graphed_callables(
            _tracked_layers(tracker), [(sample,)], schedule=Schedule.one_f_one_b(2, 0, 2),
            pools="torch", num_warmup_iters=2,
        )
    assert (ei.value.chunk, ei.value.layer) == (0, 1), str(ei.value)
    with pytest.raises(UnsupportedLayer, match="graph-safe tracker") as ei:
        make_graphed_callables(
            _tracked_layers(_CopyingTracker(7)), [(sample,)], schedule=Schedule.one_f_one_b(2, 0, 2),
            pools="torch", num_warmup_iters=2,
        )
    assert (ei.value.chunk, ei.value.layer) == (0, 1), str(ei.value)
    torch.rand(16, device="cuda", generator=tracker.generator)
    torch.nn.functional.dropout(torch.ones(16, device="cuda"), 0.5, True)
    with tracker.fork():
        torch.nn.functional.dropout(torch.ones(16, device="cuda"), 0.5, True)


class _DropoutThenSync(_TrackedDropout):
    """Tracker dropout, then a read on the host (refused mid-capture as host work)."""

    def forward(self, x: Any) -> Any:
        y = self._body(x)
        if y.sum().item() > float("inf"):
            return y * 2
        return y


def test_a_capture_that_fails_with_tracker_generators_leaves_them_drawing() -> None:
    """A capture that fails after the tracker's generator was registered with its graph (and
    put in capture mode): the generator is taken out of capture mode again, so it and the
    device's generator draw eagerly afterwards (otherwise every later draw fails with "Offset
    increment outside graph capture")."""
    tracker = _GraphSafeTracker(5)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(128, 128).cuda(), _DropoutThenSync(128, tracker).cuda()]
    sample = torch.randn(8, 128, device="cuda").requires_grad_()
    with pytest.raises(UnsupportedLayer, match="cannot be captured") as ei:
        make_graphed_callables(
            layers, [(sample,)], schedule=Schedule.one_f_one_b(2, 0, 2), pools="torch",
            num_warmup_iters=2, rng_generators=[tracker.generator],
        )
    assert (ei.value.chunk, ei.value.layer) == (0, 1), str(ei.value)
    torch.rand(16, device="cuda", generator=tracker.generator)
    with tracker.fork():
        torch.nn.functional.dropout(torch.ones(16, device="cuda"), 0.5, True)
    torch.nn.functional.dropout(torch.ones(16, device="cuda"), 0.5, True)


def test_a_checkpointed_tracker_dropout_is_refused() -> None:
    """Tracker dropout inside an activation checkpoint: the backward's recomputation draws from
    the tracker's generator again (swapped in, it is what the device generator reads), which
    the warm-up's watch sees; refused naming the layer."""
    tracker = _GraphSafeTracker(11)
    sample = torch.randn(8, 128, device="cuda").requires_grad_()
    with pytest.raises(UnsupportedLayer, match="draws random numbers") as ei:
        make_graphed_callables(
            _tracked_layers(tracker, checkpointed=True), [(sample,)],
            schedule=Schedule.one_f_one_b(2, 0, 2), pools="torch", num_warmup_iters=2,
            rng_generators=[tracker.generator],
        )
    assert (ei.value.chunk, ei.value.layer) == (0, 1), str(ei.value)


def test_rng_generators_that_are_not_generators_of_the_device_are_refused() -> None:
    """``rng_generators`` takes CUDA generators of the capture's device: a CPU generator, a
    dict (of named tracker states) or something else is refused before the warm-up."""
    layers = [torch.nn.Linear(16, 16).cuda()]
    sample = torch.randn(4, 16, device="cuda").requires_grad_()
    cuda_gen = torch.Generator(device="cuda")
    for bad, says in [
        ([torch.Generator()], "generator of cpu"),
        ({"model-parallel-rng": cuda_gen}, "a dict"),
        (cuda_gen, "a torch.Generator;"),
        ([cuda_gen, "seed"], r"rng_generators\[1\] is a str"),
    ]:
        with pytest.raises(graphpool.InvalidArgument, match=says) as ei:
            make_graphed_callables(
                layers, [(sample,)], schedule=Schedule.one_f_one_b(1, 0, 1), pools="torch",
                rng_generators=bad,
            )
        assert ei.value.field == "rng_generators"
