"""GPU: schedule-aware capture of layers that are not a stack of identical one-tensor blocks.

Each case captures a small model of one kind and replays it in schedule order, overwriting every
pool that holds nothing live before each step (``GraphedSchedule.poison``), for 1F1B with three
microbatches in flight (stage 0 of 3, 5 microbatches: slots reused) and for interleaved 1F1B (two
chunks, stage 0 of 2, 6 microbatches). The graphed outputs, chunk-input gradients, parameter
gradients and buffers must match eager execution of the same schedule, each tensor within
max(1.5 x eager's own run-to-run difference, a floor per dtype); integer tensors exactly.
Whether each output requires grad, and whether a layer returns one tensor or a tuple, must be as
in eager mode. Cases:

* ``multi-io``: several tensor inputs and tuple outputs: an input passed on as an output (a
  residual), a float mask that does not require grad passed through every layer, a statistic
  computed under ``detach``, an input and a parameter that no output uses
  (``allow_unused_input=True``);
* ``tokens-loss``: integer token ids embedded by the first layer, integer labels passed through
  to a last layer that returns a scalar cross-entropy loss;
* ``aliasing``: layers whose output is their input itself (``x``, ``x.to(x.dtype)``) or a view of
  it (``view``, ``transpose``, ``reshape``), the chunk's first and last layers among them (the
  last returns a tuple of one tensor);
* ``widths-dtypes``: the hidden size changes from layer to layer (32, 64, 48, 16, 32) and the
  dtype too (bf16 and fp32 layers in one chunk);
* ``dropout``: dropout layers (CUDA RNG inside the graphs). With the generator seeded alike,
  every replay draws the mask eager execution draws at the same point of the schedule, so the
  results match eager; replays of one graph (microbatches sharing a slot, same input) get
  different masks. Also: a dropout layer switched to eval mode is refused with gradients
  enabled and runs eagerly under ``torch.no_grad()``, and so is a layer one of whose
  submodules alone was switched;
* ``batchnorm``: ``BatchNorm1d`` in train mode: its running statistics and batch count, updated
  in place by every forward replay, match eager's after the schedule, and capture leaves them as
  it found them;
* ``checkpointed``: activation checkpointing inside layers
  (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``) of deterministic MLPs, with
  dropout after the checkpointed part (drawn by the forward graph only);
* ``autocast``: the whole schedule, eager and graphed, and the capture under one
  ``torch.autocast("cuda", dtype=torch.bfloat16)`` region whose weight cache is on and already
  filled by the eager runs (bf16 linear outputs, fp32 layer norms). Also: a callable called
  without autocast, or under another dtype, is refused with gradients enabled and runs eagerly
  under ``torch.no_grad()``; the capture leaves the region's cache on;
* ``refusals``: what capture refuses, each with ``UnsupportedLayer`` (or ``InvalidArgument``)
  naming the layer: a layer returning ``None``, a layer whose outputs need no grad, an input no
  output uses without ``allow_unused_input``, a buffer replaced by the forward, ``BatchNorm``
  with ``momentum=None``, a hook on a submodule, a gradient hook on a parameter, a parameter
  the layer uses but does not own, reentrant activation checkpointing, dropout inside a
  checkpointed region (its backward recomputes it: a random op in the backward), sparse
  gradients, a sample on the CPU, and (last: it fails a capture midway) a forward that reads a
  value on the host; then a capture and replay in the same process still work.

Each (pool kind, case) runs in a process of its own, as in ``test_poison.py``; the child prints
one ``RESULT`` line per schedule (``refusals``: per check) with the largest differences, and
the name and difference of each tensor that is off. Pool kinds: ``torch`` and ``graphpool``
(needs ``$GRAPHPOOL_SOCKET`` and ``$GRAPHPOOL_SHIM``; skipped otherwise). Skipped without torch
or CUDA.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

try:
    from . import replay_check as rc  # collected by pytest
except ImportError:  # run as the child's program: this directory is on the path
    import replay_check as rc  # type: ignore[no-redef]

#: Where the models and data live (a CUDA device; only the child uses it).
DEVICE = "cuda"
B, S, H = 4, 8, 32  # batch, sequence, hidden
VOCAB = 64
SEED = 1234  # of the CUDA generator, before every run of the dropout case

SCHEDULES = {
    "1f1b": ("one_f_one_b", (3, 0, 5)),  # three microbatches in flight, slots reused
    "interleaved": ("interleaved", (2, 0, 6, 2)),  # two chunks, slots [4, 2], reused
}
CASES = [
    "multi-io", "tokens-loss", "aliasing", "widths-dtypes", "dropout", "batchnorm", "checkpointed",
    "autocast", "refusals",
]
#: Cases run whole under ``torch.autocast("cuda", dtype=...)``, by case.
AUTOCAST = {"autocast": "bfloat16"}
KINDS = ["torch", "graphpool"]
#: The smallest threshold of a relative difference, per dtype (eager's own noise may raise it).
FLOOR = {"float32": 1e-3, "float64": 1e-3, "float16": 1e-2, "bfloat16": 2e-2}


@dataclass
class Model:
    """A case's model for one number of chunks, with what its runs need."""

    #: The layers of each chunk.
    chunks: list[list[Any]]
    #: The inputs of a chunk's first layer for (chunk, microbatch); the ones that require grad
    #: are the ones whose gradient is checked.
    inputs: Callable[[int, int], tuple[Any, ...]]
    allow_unused: bool = False
    #: Seed the CUDA generator with ``SEED`` before every run (eager or graphed).
    seeded: bool = False
    #: Checks of a finished capture beyond the common ones: ``(gs, model, eager outputs,
    #: graphed outputs) -> failures``.
    extra: list[Callable[..., list[str]]] = field(default_factory=list)


# --------------------------------------------------------------------------------- the models


def _models() -> dict[str, Callable[[int], Model]]:
    """Each case's model builder, by case name (takes the number of chunks). torch is imported
    here, so that the test process can skip without it."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    dev = DEVICE

    def gen(seed: int) -> Any:
        return torch.Generator(device=dev).manual_seed(seed)

    def seeded_inputs(
        make: Callable[[Any], tuple[Any, ...]], same: bool = False
    ) -> Callable[[int, int], tuple[Any, ...]]:
        """(chunk, microbatch) -> inputs, drawn once per key from its own generator."""
        cache: dict[tuple[int, int], tuple[Any, ...]] = {}

        def inputs(c: int, m: int) -> tuple[Any, ...]:
            key = (c, 0 if same else m)
            if key not in cache:
                cache[key] = make(gen(1000 + 97 * key[0] + key[1]))
            return cache[key]

        return inputs

    # a) several tensor inputs, tuple outputs, outputs without grad, unused input and parameter
    class Split(nn.Module):
        """(x, mask) -> (lin(x), x, mask): its input passed on as a residual, the mask through."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)

        def forward(self, x: Any, mask: Any) -> Any:
            return self.lin(x), x, mask

    class Gate(nn.Module):
        """(h, res, mask) -> (lin(h) * mask + res, h, mask, |h| without grad)."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)

        def forward(self, h: Any, res: Any, mask: Any) -> Any:
            y = self.lin(h) * mask.unsqueeze(-1) + res
            return y, h, mask, h.detach().norm(dim=-1)

    class Merge(nn.Module):
        """(y, h, mask, stat) -> (lin(y) + stat / 100, mask): ``h`` and ``spare`` unused."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)
            self.spare = nn.Parameter(torch.zeros(H))

        def forward(self, y: Any, h: Any, mask: Any, stat: Any) -> Any:
            return self.lin(y) + stat.unsqueeze(-1) / 100, mask

    def multi_io(v: int) -> Model:
        def make(g: Any) -> tuple[Any, ...]:
            x = torch.randn(B, S, H, device=dev, generator=g).requires_grad_()
            mask = (torch.rand(B, S, device=dev, generator=g) > 0.3).float()
            return x, mask

        return Model([[Split().to(dev), Gate().to(dev), Merge().to(dev)] for _ in range(v)],
                     seeded_inputs(make), allow_unused=True)

    # b) token ids in, scalar loss out
    class Embed(nn.Module):
        """(ids, labels) -> (embedding of ids, labels)."""

        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, H)

        def forward(self, ids: Any, labels: Any) -> Any:
            return self.emb(ids), labels

    class Mlp(nn.Module):
        """(h, labels) -> (h + mlp(h), labels)."""

        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc1, self.fc2 = nn.LayerNorm(H), nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

        def forward(self, h: Any, labels: Any) -> Any:
            return h + self.fc2(F.gelu(self.fc1(self.ln(h)))), labels

    class Head(nn.Module):
        """(h, labels) -> the mean cross-entropy of the logits against the labels (a scalar)."""

        def __init__(self) -> None:
            super().__init__()
            self.ln, self.out = nn.LayerNorm(H), nn.Linear(H, VOCAB)

        def forward(self, h: Any, labels: Any) -> Any:
            return F.cross_entropy(self.out(self.ln(h)).flatten(0, 1), labels.flatten())

    def tokens_loss(v: int) -> Model:
        if v == 1:
            chunks = [[Embed(), Mlp(), Head()]]
        else:  # the first chunk embeds, the last one ends in the loss
            chunks = [[Embed(), Mlp()]] + [[Mlp(), Mlp()] for _ in range(v - 2)] + [[Mlp(), Head()]]

        def make_for(c: int) -> Callable[[Any], tuple[Any, ...]]:
            def make(g: Any) -> tuple[Any, ...]:
                labels = torch.randint(0, VOCAB, (B, S), device=dev, generator=g)
                if c == 0:
                    return torch.randint(0, VOCAB, (B, S), device=dev, generator=g), labels
                return torch.randn(B, S, H, device=dev, generator=g).requires_grad_(), labels

            return make

        per_chunk = [seeded_inputs(make_for(c)) for c in range(v)]
        return Model([[lay.to(dev) for lay in ch] for ch in chunks], lambda c, m: per_chunk[c](c, m))

    # c) outputs that are the input itself, or a view of it
    class Same(nn.Module):
        """Returns its input, the very tensor."""

        def forward(self, x: Any) -> Any:
            return x

    class AsDtype(nn.Module):
        """``x.to(x.dtype)``: the very tensor again."""

        def forward(self, x: Any) -> Any:
            return x.to(x.dtype)

    class SplitHeads(nn.Module):
        """A view: (B, S, H) -> (B, S, 2, H/2)."""

        def forward(self, x: Any) -> Any:
            return x.view(B, S, 2, H // 2)

    class Transpose(nn.Module):
        """A non-contiguous view: (B, S, 2, H/2) -> (B, 2, S, H/2)."""

        def forward(self, x: Any) -> Any:
            return x.transpose(1, 2)

    class MergeLinear(nn.Module):
        """(B, 2, S, H/2), non-contiguous -> a linear map of (B, S, H)."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)

        def forward(self, x: Any) -> Any:
            return self.lin(x.transpose(1, 2).reshape(B, S, H))

    class Reshape(nn.Module):
        """A view that keeps the shape, ``x.reshape(B, S, H)`` of a contiguous input, returned as
        a tuple of one tensor (which the graphed callable returns as such)."""

        def forward(self, x: Any) -> Any:
            return (x.reshape(B, S, H),)

    def aliasing(v: int) -> Model:
        def make(g: Any) -> tuple[Any, ...]:
            return (torch.randn(B, S, H, device=dev, generator=g).requires_grad_(),)

        chunks = [
            [Same(), nn.Linear(H, H), SplitHeads(), Transpose(), MergeLinear(), AsDtype(), Reshape()]
            for _ in range(v)
        ]
        return Model([[lay.to(dev) for lay in ch] for ch in chunks], seeded_inputs(make))

    # d) widths and dtypes that change within a chunk
    class Cast(nn.Module):
        """Casts to ``dtype``, then a linear map ``n_in -> n_out`` in ``dtype``."""

        def __init__(self, n_in: int, n_out: int, dtype: Any) -> None:
            super().__init__()
            self.dtype = dtype
            self.lin = nn.Linear(n_in, n_out).to(dtype=dtype)

        def forward(self, x: Any) -> Any:
            return self.lin(x.to(self.dtype))

    class NormLinear(nn.Module):
        """LayerNorm then a linear map, fp32."""

        def __init__(self, n_in: int, n_out: int) -> None:
            super().__init__()
            self.ln, self.lin = nn.LayerNorm(n_in), nn.Linear(n_in, n_out)

        def forward(self, x: Any) -> Any:
            return self.lin(self.ln(x))

    def widths_dtypes(v: int) -> Model:
        bf16, f32 = torch.bfloat16, torch.float32

        def make(g: Any) -> tuple[Any, ...]:
            return (torch.randn(B, S, 32, device=dev, generator=g).to(bf16).requires_grad_(),)

        chunks = [
            [Cast(32, 64, bf16), Cast(64, 48, f32), NormLinear(48, 16), Cast(16, 32, bf16)]
            for _ in range(v)
        ]
        return Model([[lay.to(dev) for lay in ch] for ch in chunks], seeded_inputs(make))

    # e) dropout
    def distinct_masks(gs: Any, model: Model, eager: Any, graphed: Any) -> list[str]:
        """Two microbatches of one slot replay one graph on the same input: their masks (the
        zeros of the chunk's last dropout) must differ."""
        bad = []
        sched = gs.schedule
        for c in range(sched.virtual_chunks):
            slots = sched.microbatch_slots(c)
            m2 = next((m for m in range(1, len(slots)) if slots[m] == slots[0]), None)
            if m2 is None:
                continue
            a, b = graphed[(c, 0)][0], graphed[(c, m2)][0]
            same = float(((a == 0) == (b == 0)).float().mean().item())
            if same > 0.9:
                bad.append(f"chunk {c}: microbatches 0 and {m2} (slot {slots[0]}) got the same "
                           f"dropout mask ({same:.0%} of the zeros alike)")
        return bad

    def eval_mode(gs: Any, model: Model, eager: Any, graphed: Any) -> list[str]:
        """A layer called in eval mode with gradients enabled is refused; under no_grad it runs
        eagerly (no dropout) and takes no slot."""
        from graphpool.errors import FailedPrecondition

        bad = []
        ch = model.chunks[0]
        x = model.inputs(0, 0)[0].detach()
        for lay in ch:
            lay.eval()
        try:
            try:
                gs.chunk(0, 0)[0](x)
                bad.append("a layer captured in training mode replayed in eval mode")
            except FailedPrecondition as e:
                if "training mode" not in str(e) or "no_grad" not in str(e):
                    bad.append(f"eval mode refused without saying what to do: {e}")
            with torch.no_grad():
                y = x
                for call in gs.chunk(0, 0):
                    y = call(y)
                want = x
                for lay in ch:
                    want = lay(want)
            if not torch.equal(y, want):
                bad.append("under no_grad in eval mode the layers did not run as eager")
            if any(o is not None for row in gs.slots_in_use() for o in row):
                bad.append(f"slots taken under no_grad: {gs.slots_in_use()}")
            for lay in ch:
                lay.train()
            # a submodule switched on its own (the GELU inside a Sequential layer)
            c, i, sub = next((c, i, m) for c, layers in enumerate(model.chunks)
                             for i, lay in enumerate(layers) for name, m in lay.named_modules() if name)
            sub.eval()
            try:
                gs.chunk(c, 0)[i](*model.inputs(c, 0))
                bad.append("a submodule switched to eval mode was not noticed")
            except FailedPrecondition as e:
                if "submodule" not in str(e):
                    bad.append(f"a submodule's mode change refused without naming it: {e}")
            finally:
                sub.train()
        finally:
            for layers in model.chunks:
                for lay in layers:
                    lay.train()
        return bad

    def dropout(v: int) -> Model:
        def make(g: Any) -> tuple[Any, ...]:
            return (torch.randn(B, S, H, device=dev, generator=g).requires_grad_(),)

        chunks = [
            [nn.Linear(H, H), nn.Dropout(0.25), nn.Sequential(nn.Linear(H, H), nn.GELU()), nn.Dropout(0.5)]
            for _ in range(v)
        ]
        return Model([[lay.to(dev) for lay in ch] for ch in chunks], seeded_inputs(make, same=True),
                     seeded=True, extra=[distinct_masks, eval_mode])

    # f) buffers updated in place by the forward
    def batchnorm(v: int) -> Model:
        def make(g: Any) -> tuple[Any, ...]:
            return (torch.randn(4 * B, H, device=dev, generator=g).mul(3).add(1).requires_grad_(),)

        chunks = [
            [nn.Linear(H, H), nn.BatchNorm1d(H), nn.Sequential(nn.ReLU(), nn.Linear(H, H))]
            for _ in range(v)
        ]
        return Model([[lay.to(dev) for lay in ch] for ch in chunks], seeded_inputs(make))

    # g) activation checkpointing, non-reentrant, of a deterministic part
    class Checkpointed(nn.Module):
        """x -> dropout(x + mlp(x)), the MLP recomputed in the backward, the dropout (``p``)
        outside it."""

        def __init__(self, p: float) -> None:
            super().__init__()
            self.ln, self.fc1, self.fc2 = nn.LayerNorm(H), nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
            self.drop = nn.Dropout(p)

        def mlp(self, x: Any) -> Any:
            return self.fc2(F.gelu(self.fc1(self.ln(x))))

        def forward(self, x: Any) -> Any:
            return self.drop(x + torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=False))

    def checkpointed(v: int) -> Model:
        def make(g: Any) -> tuple[Any, ...]:
            return (torch.randn(B, S, H, device=dev, generator=g).requires_grad_(),)

        chunks = [[Checkpointed(0.0), Checkpointed(0.25), nn.Linear(H, H)] for _ in range(v)]
        return Model([[lay.to(dev) for lay in ch] for ch in chunks], seeded_inputs(make), seeded=True)

    # h) autocast
    def autocast_state(gs: Any, model: Model, eager: Any, graphed: Any) -> list[str]:
        """Under the case's autocast region: the capture left its cache on; a call without
        autocast or under another dtype is refused; under no_grad it runs eagerly."""
        from graphpool.errors import FailedPrecondition

        bad = []
        if not torch.is_autocast_cache_enabled():
            bad.append("autocast's weight cache is off after capture")
        if gs.stats.autocast != "bfloat16":
            bad.append(f"stats.autocast is {gs.stats.autocast!r}")
        x = model.inputs(0, 0)[0].detach()
        lay = model.chunks[0][0]
        for other in (torch.autocast("cuda", enabled=False),
                      torch.autocast("cuda", dtype=torch.float16)):
            with other:
                try:
                    gs.chunk(0, 0)[0](x)
                    bad.append("a callable captured under bf16 autocast replayed under another "
                               "autocast state")
                except FailedPrecondition as e:
                    if "autocast" not in str(e) or "no_grad" not in str(e):
                        bad.append(f"another autocast state refused without saying what to do: {e}")
                with torch.no_grad():
                    y, want = gs.chunk(0, 0)[0](x), lay(x)
                if y.dtype != want.dtype or not torch.equal(y, want):
                    bad.append(f"under no_grad the layer did not run eagerly: {y.dtype}, eager "
                               f"{want.dtype}")
        if any(o is not None for row in gs.slots_in_use() for o in row):
            bad.append(f"slots taken by refused or no_grad calls: {gs.slots_in_use()}")
        return bad

    def autocast(v: int) -> Model:
        def make(g: Any) -> tuple[Any, ...]:
            return (torch.randn(B, S, H, device=dev, generator=g).requires_grad_(),)

        chunks = [
            [nn.Sequential(nn.Linear(H, 2 * H), nn.GELU()), nn.LayerNorm(2 * H), nn.Linear(2 * H, H)]
            for _ in range(v)
        ]
        return Model([[lay.to(dev) for lay in ch] for ch in chunks], seeded_inputs(make),
                     extra=[autocast_state])

    return {
        "multi-io": multi_io,
        "tokens-loss": tokens_loss,
        "aliasing": aliasing,
        "widths-dtypes": widths_dtypes,
        "dropout": dropout,
        "batchnorm": batchnorm,
        "checkpointed": checkpointed,
        "autocast": autocast,
    }


# ------------------------------------------------------------------------- the child's program


def _as_outputs(y: Any) -> tuple[Any, ...]:
    return tuple(y) if isinstance(y, (tuple, list)) else (y,)


def _matches_eager(kind: str, case: str, sched_name: str) -> dict[str, Any]:  # pragma: no cover
    """Eager twice (its own noise), then capture and two poisoned graphed passes of the
    schedule; returns the record, with ``bad`` naming every tensor that is off and every other
    difference from eager."""
    import torch

    from graphpool.capture import make_graphed_callables
    from graphpool.schedule import Schedule

    ctor, args = SCHEDULES[sched_name]
    sched = getattr(Schedule, ctor)(*args)
    v = sched.virtual_chunks
    torch.manual_seed(0)
    model = _models()[case](v)
    chunks = model.chunks
    named_params: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for c, ch in enumerate(chunks):
        for i, lay in enumerate(ch):
            for n, p in lay.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    named_params.append((f"chunk {c} layer {i} {n}", p))
    named_buffers = [
        (f"chunk {c} layer {i} {n}", b) for c, ch in enumerate(chunks) for i, lay in enumerate(ch)
        for n, b in lay.named_buffers()
    ]
    initial = [b.clone() for _, b in named_buffers]
    G: dict[tuple[int, int], tuple[Any, ...]] = {}  # output gradients, drawn at the first run
    multi: dict[tuple[int, int], bool] = {}  # (chunk, layer): the layer returned a tuple

    def eager_fwd(c: int, m: int, xs: tuple[Any, ...]) -> tuple[Any, ...]:
        for i, lay in enumerate(chunks[c]):
            y = lay(*xs)
            multi[(c, i)] = isinstance(y, (tuple, list))
            xs = _as_outputs(y)
        return xs

    shape_bad: list[str] = []

    def graph_fwd(gs: Any) -> Callable[[int, int, tuple[Any, ...]], tuple[Any, ...]]:
        def fwd(c: int, m: int, xs: tuple[Any, ...]) -> tuple[Any, ...]:
            for i, call in enumerate(gs.chunk(c, m)):
                y = call(*xs)
                if isinstance(y, (tuple, list)) != multi[(c, i)]:
                    shape_bad.append(f"layer {i} of chunk {c} returned a {type(y).__name__}, eager "
                                     f"{'a tuple' if multi[(c, i)] else 'a tensor'}")
                xs = _as_outputs(y)
            return xs

        return fwd

    def run(fwd: Callable[..., tuple[Any, ...]], between: Callable[[], None] | None = None) -> dict[str, Any]:
        """One pass of the schedule: outputs (copied at once), whether each requires grad, the
        chunk-input gradients, then the parameter gradients and buffers."""
        for t, init in zip((b for _, b in named_buffers), initial):
            t.copy_(init)
        if model.seeded:
            torch.cuda.manual_seed(SEED)
        live: dict[tuple[int, int], Any] = {}
        outs: dict[tuple[int, int], tuple[Any, ...]] = {}
        flags: dict[tuple[int, int], tuple[bool, ...]] = {}
        in_grads: dict[tuple[int, int], tuple[Any, ...]] = {}
        for st in sched.steps:
            if between is not None:
                between()
            key = (st.chunk, st.microbatch)
            if st.kind == "F":
                xs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in model.inputs(*key))
                ys = fwd(st.chunk, st.microbatch, xs)
                outs[key] = tuple(y.detach().clone() for y in ys)
                flags[key] = tuple(bool(y.requires_grad) for y in ys)
                if key not in G:
                    g = torch.Generator(device=DEVICE).manual_seed(5000 + 97 * st.chunk + st.microbatch)
                    G[key] = tuple(
                        torch.randn(y.shape, dtype=y.dtype, device=DEVICE, generator=g)
                        if y.requires_grad else None
                        for y in ys
                    )
                live[key] = (xs, ys)
            else:
                xs, ys = live.pop(key)
                pairs = [(y, g) for y, g in zip(ys, G[key]) if g is not None]
                torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
                in_grads[key] = tuple(None if x.grad is None else x.grad.clone() for x in xs)
        return {
            "outs": outs, "flags": flags, "in_grads": in_grads,
            "params": [None if p.grad is None else p.grad.clone() for _, p in named_params],
            "buffers": [b.clone() for _, b in named_buffers],
        }

    def pairs_of(r: dict[str, Any]) -> list[tuple[str, Any]]:
        """Every checked tensor of a run, by name."""
        out: list[tuple[str, Any]] = []
        for (c, m), ys in sorted(r["outs"].items()):
            out += [(f"output {i} of chunk {c} microbatch {m}", y) for i, y in enumerate(ys)]
        for (c, m), gs_ in sorted(r["in_grads"].items()):
            out += [(f"gradient of input {i} of chunk {c} microbatch {m}", g) for i, g in enumerate(gs_)]
        out += [(f"gradient of {n}", g) for (n, _), g in zip(named_params, r["params"])]
        out += [(f"buffer {n}", b) for (n, _), b in zip(named_buffers, r["buffers"])]
        return out

    def diff(a: Any, b: Any) -> float:
        """Relative difference; a missing gradient counts as zeros; integers must be equal."""
        if a is None and b is None:
            return 0.0
        if a is None or b is None:
            t = a if a is not None else b
            return 0.0 if not bool(t.ne(0).any()) else float("inf")
        if a.shape != b.shape or a.dtype != b.dtype:
            return float("inf")
        if not (a.is_floating_point() or a.is_complex()):
            return 0.0 if torch.equal(a, b) else float("inf")
        return rc.rel(a, b)

    def dtype_of(a: Any, b: Any) -> str:
        t = a if a is not None else b
        return "float32" if t is None else str(t.dtype).replace("torch.", "")

    # eager, twice: the reference and its noise
    for _, p in named_params:
        p.grad = None
    ref = run(eager_fwd)
    for _, p in named_params:
        p.grad = None
    again = run(eager_fwd)
    diffs = [diff(a, b) for (_, a), (_, b) in zip(pairs_of(again), pairs_of(ref))]
    noise = max((d for d in diffs if d == d and d != float("inf")), default=0.0)
    rec: dict[str, Any] = {"noise": noise, "passes": []}
    bad: list[str] = [f"eager differs from itself: {n}" for (n, _), d in zip(pairs_of(ref), diffs)
                      if not d == d or d == float("inf")]

    before_capture = [b.clone() for _, b in named_buffers]
    gs = make_graphed_callables(chunks, [model.inputs(c, 0) for c in range(v)], schedule=sched,
                                num_warmup_iters=1, allow_unused_input=model.allow_unused,
                                **rc.capture_kw(kind))
    try:
        rec.update(graphs=gs.num_graphs, pool_kind=gs.stats.pool_kind)
        want_graphs = 2 * sum(len(ch) * n for ch, n in zip(chunks, sched.slots_per_chunk))
        if gs.num_graphs != want_graphs:
            bad.append(f"{gs.num_graphs} graphs, expected {want_graphs}")
        if gs.stats.pool_kind != ("graphpool" if kind == "graphpool" else "torch"):
            bad.append(f"pools of kind {gs.stats.pool_kind}")
        # capture (its warm-up included) leaves the buffers as it found them
        for (n, b), was in zip(named_buffers, before_capture):
            if not torch.equal(b, was):
                bad.append(f"capture changed buffer {n}")
        graphed: dict[tuple[int, int], tuple[Any, ...]] = {}
        for it in range(2):
            for _, p in named_params:  # set_to_none on one pass, zero on the other
                if it == 0 or p.grad is None:
                    p.grad = None
                else:
                    p.grad.zero_()
            poisoned: list[int] = []
            got = run(graph_fwd(gs), between=lambda: poisoned.append(gs.poison()))
            graphed = got["outs"]
            if sum(poisoned) <= 0:
                bad.append("nothing was poisoned")
            for key, f in sorted(ref["flags"].items()):
                if got["flags"][key] != f:
                    bad.append(f"requires_grad of the outputs of chunk {key[0]} microbatch {key[1]}: "
                               f"{list(got['flags'][key])}, eager {list(f)}")
            worst = 0.0
            for (name, a), (_, b) in zip(pairs_of(got), pairs_of(ref)):
                d = diff(a, b)
                thr = max(1.5 * noise, FLOOR.get(dtype_of(a, b), 1e-3))
                worst = max(worst, d) if d == d else float("nan")
                if not d <= thr:
                    bad.append(f"pass {it}: {name}: relative difference {d:.3g} (threshold {thr:.3g})")
            rec["passes"].append({"poisoned_bytes": sum(poisoned), "max_rel": worst})
        for check in model.extra:
            bad += check(gs, model, ref["outs"], graphed)
    finally:
        gs.close()
    bad += sorted(set(shape_bad))
    rec["bad"] = bad[:20]
    rec["bad_count"] = len(bad)
    rec["granted_after_close_bytes"] = rc.granted() if kind == "graphpool" else None
    return rec


def _refusals(kind: str) -> list[dict[str, Any]]:  # pragma: no cover
    """Each refusal: what is raised, and that its message names the layer and what to do."""
    import torch
    from torch import nn

    from graphpool.capture import UnsupportedLayer, make_graphed_callables
    from graphpool.errors import InvalidArgument
    from graphpool.schedule import Schedule

    sched = Schedule.one_f_one_b(2, 0, 3)

    class ReturnsNone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)

        def forward(self, x: Any) -> Any:
            return self.lin(x), None

    class IdsOnly(nn.Module):
        def forward(self, ids: Any) -> Any:
            return ids + 1

    class UsesFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)

        def forward(self, x: Any, y: Any) -> Any:
            return self.lin(x)

    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)
            self.register_buffer("count", torch.zeros((), dtype=torch.long))

        def forward(self, x: Any) -> Any:
            self.count = self.count + 1
            return self.lin(x)

    class Syncs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)

        def forward(self, x: Any) -> Any:
            y = self.lin(x)
            return y * 2 if y.sum().item() > 0 else y

    class Tied(nn.Module):
        """Uses another module's weight without owning it (weight tying done wrong)."""

        def __init__(self, other: Any) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)
            self.other = [other]  # a list: not registered as a submodule

        def forward(self, x: Any) -> Any:
            return self.lin(x) @ self.other[0].weight

    class Reentrant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)

        def forward(self, x: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=True)

    class DropoutRecomputed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(H, H)

        def part(self, x: Any) -> Any:
            return torch.nn.functional.dropout(self.lin(x), 0.25, True)

        def forward(self, x: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(self.part, x, use_reentrant=False)

    def grad_hooked() -> Any:
        lin = nn.Linear(H, H).to(DEVICE)
        lin.weight.register_hook(lambda g: g * 2)
        return lin

    def hooked() -> Any:
        block = nn.Sequential(nn.Linear(H, H), nn.GELU()).to(DEVICE)
        block[1].register_forward_hook(lambda mod, args, out: None)
        return block

    def x() -> Any:
        return torch.randn(B, S, H, device=DEVICE).requires_grad_()

    ids = torch.randint(0, VOCAB, (B, S), device=DEVICE)
    checks: list[tuple[str, Callable[[], tuple[list[Any], tuple[Any, ...]]], type, int, list[str]]] = [
        ("output is None", lambda: ([nn.Linear(H, H).to(DEVICE), ReturnsNone().to(DEVICE)], (x(),)),
         UnsupportedLayer, 1, ["output 1 is a NoneType", "tensor"]),
        ("no output needs grad", lambda: ([IdsOnly(), nn.Embedding(VOCAB, H).to(DEVICE)], (ids,)),
         UnsupportedLayer, 0, ["no tensor that requires grad"]),
        ("unused input", lambda: ([UsesFirst().to(DEVICE)], (x(), x())),
         UnsupportedLayer, 0, ["allow_unused_input=True"]),
        ("buffer replaced", lambda: ([nn.Linear(H, H).to(DEVICE), Counter().to(DEVICE)], (x(),)),
         UnsupportedLayer, 1, ["'count'", "in place"]),
        ("batchnorm momentum=None",
         lambda: ([nn.Linear(H, H).to(DEVICE), nn.BatchNorm1d(H, momentum=None).to(DEVICE)],
                  (torch.randn(B, H, device=DEVICE),)),
         UnsupportedLayer, 1, ["momentum=None", "float momentum"]),
        ("hook on a submodule", lambda: ([nn.Linear(H, H).to(DEVICE), hooked()], (x(),)),
         UnsupportedLayer, 1, ["submodule '1' (GELU)", "hooks"]),
        ("gradient hook on a parameter", lambda: ([nn.Linear(H, H).to(DEVICE), grad_hooked()], (x(),)),
         UnsupportedLayer, 1, ["parameter 'weight'", "register_hook"]),
        ("parameter not owned",
         lambda: ([nn.Linear(H, H).to(DEVICE), Tied(nn.Linear(H, H).to(DEVICE)).to(DEVICE)], (x(),)),
         UnsupportedLayer, 1, ["neither one of its inputs nor one of its own parameters"]),
        ("reentrant checkpointing", lambda: ([nn.Linear(H, H).to(DEVICE), Reentrant().to(DEVICE)], (x(),)),
         UnsupportedLayer, 1, ["use_reentrant=False"]),
        ("dropout recomputed by checkpointing",
         lambda: ([nn.Linear(H, H).to(DEVICE), DropoutRecomputed().to(DEVICE)], (x(),)),
         UnsupportedLayer, 1, ["draws random numbers", "checkpointed"]),
        ("sparse gradients",
         lambda: ([nn.Embedding(VOCAB, H, sparse=True).to(DEVICE), nn.Linear(H, H).to(DEVICE)], (ids,)),
         UnsupportedLayer, 0, ["sparse=False"]),
        ("sample on the cpu", lambda: ([nn.Linear(H, H).to(DEVICE)], (torch.randn(B, H),)),
         InvalidArgument, -1, ["sample_args", "cpu"]),
        # last: the capture fails midway, which leaves torch's allocator as a failed capture does
        ("host synchronization", lambda: ([nn.Linear(H, H).to(DEVICE), Syncs().to(DEVICE)], (x(),)),
         UnsupportedLayer, 1, ["cannot be captured", ".item()"]),
    ]
    records = []
    for name, build, exc, layer, words in checks:
        rec: dict[str, Any] = {"kind": kind, "case": "refusals", "check": name}
        try:
            layers, sample = build()
            try:
                gs = make_graphed_callables(layers, [sample], schedule=sched, num_warmup_iters=1,
                                            **rc.capture_kw(kind))
            except exc as e:
                msg = str(e)
                rec["message"] = msg
                missing = [w for w in words if w not in msg]
                named = getattr(e, "layer", None) == layer and f"layer {layer} of chunk 0" in msg
                if layer >= 0 and not named:
                    missing.append(f"layer {layer} of chunk 0")
                rec["ok"] = not missing
                if missing:
                    rec["error"] = f"{type(e).__name__} does not say {missing}: {msg}"
            else:
                gs.close()
                rec.update(ok=False, error=f"captured; expected {exc.__name__}")
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            rc.failed(rec, e)
        records.append(rec)
        rc.report(rec)
    # a refused capture leaves torch's allocator and the process fit for the next capture
    rec = {"kind": kind, "case": "refusals", "check": "capture after a refused one"}
    try:
        torch.cuda.empty_cache()
        layers = [nn.Linear(H, H).to(DEVICE), nn.Linear(H, H).to(DEVICE)]
        gs = make_graphed_callables(layers, [(x(),)], schedule=sched, num_warmup_iters=1,
                                    **rc.capture_kw(kind))
        try:
            xs = x()
            y = gs[1, 0](gs[0, 0](xs))
            want = layers[1](layers[0](xs))
            d = rc.rel(y, want)
            y.sum().backward()
            rec.update(ok=d <= 1e-3 and gs.slots_in_use() == [[None, None]], rel=d)
            if not rec["ok"]:
                rec["error"] = f"replay differs from eager by {d:.3g}, slots {gs.slots_in_use()}"
        finally:
            gs.close()
        torch.cuda.empty_cache()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        rc.failed(rec, e)
    records.append(rec)
    rc.report(rec)
    return records


def _child_main(argv: list[str]) -> int:  # pragma: no cover - runs on a GPU machine
    import torch

    kind, case = argv[0], argv[1]
    if case == "refusals":
        return 0 if all(r["ok"] for r in _refusals(kind)) else 1
    ok = True
    for sched_name in SCHEDULES:
        rec: dict[str, Any] = {"kind": kind, "case": case, "schedule": sched_name}
        amp = (torch.autocast("cuda", dtype=getattr(torch, AUTOCAST[case])) if case in AUTOCAST
               else contextlib.nullcontext())
        try:
            with amp:
                rec.update(_matches_eager(kind, case, sched_name))
            rec["ok"] = not rec["bad"]
            if rec["bad"]:
                rec["error"] = f"{rec['bad_count']} differences from eager"
                ok = False
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


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_layers_match_eager(kind: str, case: str) -> None:
    if kind == "graphpool" and not rc.daemon_ready():
        pytest.skip(rc.GRAPHPOOL_SKIP)
    r = rc.run_child(__file__, kind, case, timeout=240)
    results = rc.results(r)
    failed = [
        f"{case}/{x.get('schedule') or x.get('check')}: {x.get('error')}"
        + "".join(f"\n    {b}" for b in x.get("bad", []))
        for x in results if not x.get("ok")
    ]
    assert not failed, "\n".join(failed) + "\n" + rc.detail(r)
    want = 14 if case == "refusals" else len(SCHEDULES)
    assert r.returncode == 0 and len(results) == want, rc.detail(r)
