"""Warm-up and capture of one layer's forward and backward graphs into its pools."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from .layers import _as_tuple, _nbytes
from .memory import _LARGE, _alias, _round512
from .planning import LayerProfile
from .refusals import (
    UnsupportedLayer,
    _capture_refusal,
    _foreign_leaf,
    _layer_outputs,
    _random_op_watch,
    _reentrant_checkpoint,
)

if TYPE_CHECKING:  # pragma: no cover
    from .layers import _Layer


def _warm_chunk(
    ch: list[_Layer], sample: tuple[Any, ...], allow_unused: bool, profile: bool, device: int = 0,
    generators: tuple[Any, ...] = (),
) -> list[LayerProfile]:
    """One eager forward+backward of a chunk, layer by layer; with ``profile``, what each layer
    keeps for its backward (saved-tensor hooks) and its peak temporaries (the allocator's peak
    counter, reset around each forward and backward: this resets the process's peak memory
    statistics), and whether its backward draws random numbers from the device's generator or
    from ``generators``."""
    import torch

    x = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in sample)
    profs: list[LayerProfile] = []
    for lay in ch:
        ins = x
        saved: dict[int, int] = {}
        keep: list[Any] = []
        param_ptrs = {p.data_ptr() for p in lay.params}
        in_ptrs = {t.untyped_storage().data_ptr() for t in ins}

        def pack(t: Any) -> Any:
            if profile:
                keep.append(t)
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr not in param_ptrs and ptr not in in_ptrs:
                    saved[ptr] = st.nbytes()
            return t

        if profile:
            torch.cuda.synchronize(device)
            a0 = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _layer_outputs(lay, lay.module(*ins))
        fws = 0
        if profile:
            torch.cuda.synchronize(device)
            a1 = torch.cuda.memory_allocated(device)
            fws = max(0, torch.cuda.max_memory_allocated(device) - a1)
            del a0
        diff_in = [t for t in ins if t.requires_grad]
        outs = [o for o in out if o.requires_grad]
        if profile:
            foreign = _foreign_leaf(outs, [*ins, *lay.params])
            if foreign is not None:
                raise UnsupportedLayer(
                    lay.chunk, lay.index, lay.module,
                    f"its outputs depend on a tensor that requires grad (shape "
                    f"{tuple(foreign.shape)}) and is neither one of its inputs nor one of its own "
                    f"parameters (module.parameters()): the backward graphs would give it no "
                    f"gradient. Make the layer a torch.nn.Module that owns it (e.g. holds the "
                    f"module whose weight it shares), or pass it as an input",
                )
        gouts = [torch.ones_like(o) for o in outs]
        if profile:
            torch.cuda.synchronize(device)
            b0 = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        # while profiling, ``keep`` holds every saved tensor so that none is freed mid-backward:
        # the peak counts only what the backward allocates (in capture, saved tensors live in
        # the forward pools and their release makes no room in the backward pool). Not
        # retain_graph: a saved output packed as itself is a cycle through autograd's C++ nodes
        # that only the backward's release of saved tensors breaks (measured: with
        # retain_graph=True, 0.69 GiB of warm-up tensors of the seed stage stayed allocated).
        # Every layer is watched, not only those whose forward moved the generator's offset: an
        # RNG state tracker (TransformerEngine's, Megatron's) draws its dropout inside a swap of
        # the generator's state and puts the state back, so the offset around the forward says
        # nothing, while the ops inside the swap still move it one by one.
        seeded: Any = _random_op_watch(device, generators) if profile else contextlib.nullcontext()
        with seeded:
            grads = _layer_grads(lay, outs, diff_in, gouts, allow_unused)
        if profile and seeded.ops:
            raise UnsupportedLayer(
                lay.chunk, lay.index, lay.module,
                f"its backward draws random numbers ({', '.join(sorted(seeded.ops))}), as "
                f"dropout inside an activation-checkpointed region does when the backward "
                f"recomputes it: the recomputation restores the random state its forward drew "
                f"from, which a backward graph cannot find once other microbatches' forwards "
                f"replayed in between, so it would draw another mask and give wrong gradients. "
                f"Keep random ops out of checkpointed regions (checkpoint the deterministic part "
                f"only), or set their probability to 0",
            )
        bws = 0
        if profile:
            torch.cuda.synchronize(device)
            din = sum(_nbytes(g) for g in grads[: len(diff_in)] if g is not None)
            bws = max(0, torch.cuda.max_memory_allocated(device) - b0 - din)
        del grads, gouts
        keep.clear()
        if profile:
            out_ptrs = {o.untyped_storage().data_ptr() for o in out}
            # an output that is an input or a view of one (a residual or mask passed on) takes
            # no memory of its own in the slot's pool
            new_out = {o.untyped_storage().data_ptr(): _nbytes(o) for o in out}
            kept = [b for p, b in saved.items() if p not in out_ptrs]
            kept += [b for p, b in new_out.items() if p not in in_ptrs]
            profs.append(
                LayerProfile(
                    chunk=lay.chunk, layer=lay.index,
                    input_bytes=sum(_nbytes(t) for t in ins),
                    output_bytes=sum(_nbytes(o) for o in out),
                    saved_bytes=sum(b for p, b in saved.items() if p not in out_ptrs),
                    forward_workspace_bytes=fws,
                    backward_workspace_bytes=bws,
                    large_kept_bytes=sum(_round512(b) for b in kept if b > _LARGE),
                    input_shapes=[(list(t.shape), str(t.dtype).replace("torch.", ""), True) for t in ins],
                    output_shapes=[(list(o.shape), str(o.dtype).replace("torch.", "")) for o in out],
                )
            )
        x = tuple(o.detach().requires_grad_(o.requires_grad) for o in out)
        del out, outs
    return profs


def _layer_grads(
    lay: _Layer, outs: list[Any], diff_in: list[Any], gouts: list[Any], allow_unused: bool
) -> tuple[Any, ...]:
    """The warm-up's backward of one layer: the gradients of its inputs that require grad, then
    of its parameters. Refuses what the backward graphs could not do: an input or parameter no
    output depends on (unless ``allow_unused``), and sparse gradients (a graph accumulates each
    parameter's gradient into the dense ``param.grad``)."""
    import torch

    try:
        grads = torch.autograd.grad(outs, diff_in + list(lay.params), gouts, allow_unused=allow_unused)
    except RuntimeError as e:
        if _reentrant_checkpoint(e):
            raise UnsupportedLayer(
                lay.chunk, lay.index, lay.module,
                "it uses reentrant activation checkpointing (torch.utils.checkpoint with "
                "use_reentrant=True, or a checkpoint function of that kind), whose backward "
                "cannot run under torch.autograd.grad, with which each backward graph is "
                "captured: pass use_reentrant=False (non-reentrant checkpointing is supported: "
                "the recomputation is captured into the layer's backward graph)",
            ) from e
        if "not have been used in the graph" not in str(e):
            raise
        raise UnsupportedLayer(
            lay.chunk, lay.index, lay.module,
            "an input that requires grad, or one of its parameters, is used by none of its "
            "outputs that require grad: pass allow_unused_input=True (their gradients then stay "
            "zero), or leave them out of the layer",
        ) from e
    if any(g is not None and getattr(g, "is_sparse", False) for g in grads):
        raise UnsupportedLayer(
            lay.chunk, lay.index, lay.module,
            "its backward gives sparse gradients (e.g. nn.Embedding(sparse=True)), which the "
            "backward graphs cannot accumulate into param.grad: use dense gradients "
            "(sparse=False)",
        )
    return tuple(grads)


def _capture_forward(
    lay: _Layer, s: int, x: tuple[Any, ...] | None, sample: tuple[Any, ...], pool_id: Any,
    generators: tuple[Any, ...] = (),
) -> tuple[Any, ...]:
    """Captures the forward graph of (layer, slot) ``s`` on its input ``x`` (the previous
    layer's static outputs; for a chunk's first layer a new static input like ``sample``).
    Returns the layer's outputs, detached, as the next layer's static inputs: the same
    memory, so that nothing is copied between the layers of a chunk."""
    import torch

    with _capturing(pool_id, lay, "forward", generators) as g:
        if x is None:  # the chunk's input: a static buffer in the slot's pool
            x = tuple(torch.empty_like(a).requires_grad_(a.requires_grad) for a in sample)
        with torch.enable_grad():
            raw = lay.module(*x)
    out = _as_tuple(raw)
    # a layer that only returns its inputs or views of them launches no kernel
    in_storage = {t.untyped_storage().data_ptr() for t in x}
    lay.launches_nothing = all(o.untyped_storage().data_ptr() in in_storage for o in out)
    _end_capture(g, empty=lay.launches_nothing)
    lay.fwd[s] = g
    lay.static_in[s] = x
    lay.static_out[s] = out
    lay.single_output = not isinstance(raw, (tuple, list))
    lay.in_requires_grad = tuple(t.requires_grad for t in x)
    lay.out_requires_grad = tuple(o.requires_grad for o in out)
    return tuple(o.detach().requires_grad_(o.requires_grad) for o in out)


def _capture_backward(
    lay: _Layer, s: int, gout: tuple[Any, ...] | None, pool_id: Any, allow_unused: bool,
    generators: tuple[Any, ...] = (),
) -> tuple[Any, ...]:
    """Captures the backward graph of (layer, slot) ``s``.

    ``gout`` holds the gradient of each of the layer's outputs as the next layer's backward
    graph leaves it (its input gradients, aligned with this layer's outputs), ``None`` where
    it leaves none (an output that does not require grad, or one the next layer does not use),
    or is ``None`` for a chunk's last layer. An output gradient no graph writes gets a static
    buffer of the backward pool, which the replay fills with what autograd passes.

    Returns the layer's input gradients aligned with its inputs (``None`` where an input does
    not require grad or is not used), the ``gout`` of the previous layer.
    """
    import torch

    static_out = lay.static_out[s]
    want = [i for i, o in enumerate(static_out) if o.requires_grad]
    outs = [static_out[i] for i in want]
    given = gout if gout is not None else (None,) * len(static_out)
    ins = lay.static_in[s]
    diff_in = [t for t in ins if t.requires_grad]
    with _capturing(pool_id, lay, "backward", generators) as g:
        # the output gradients the graph reads: the next layer's input gradients, else static
        # buffers of this pool (the chunk's last layer, or outputs the next layer does not use)
        bufs = tuple(given[i] if given[i] is not None else torch.empty_like(static_out[i]) for i in want)
        grads = torch.autograd.grad(
            outs, diff_in + list(lay.params), list(bufs), allow_unused=allow_unused
        )
        gin = grads[: len(diff_in)]
        pg = [(b, gr) for b, gr in zip(lay.grad_bufs, grads[len(diff_in):]) if gr is not None]
        if pg:
            torch._foreach_add_([b for b, _ in pg], [gr for _, gr in pg])
        del grads, pg
    _end_capture(g, empty=lay.launches_nothing and not lay.params)
    lay.bwd[s] = g
    # weak aliases: the blocks go back to the backward pool once the next graph has read them
    lay.static_gout[s] = tuple(_alias(t) for t in bufs)
    it = iter(gin)
    full = tuple(next(it) if r else None for r in lay.in_requires_grad)
    lay.static_gin[s] = tuple(None if t is None else _alias(t) for t in full)
    # the forward outputs' autograd graph (and its saved tensors) was freed by autograd.grad
    lay.static_out[s] = tuple(o.detach() for o in static_out)
    return full


def _end_capture(g: Any, empty: bool) -> None:
    """Ends a capture. With ``empty`` (a layer that returns its inputs or views of them, whose
    graphs rightly launch nothing), torch's warning that an empty capture usually means the
    wrong device or stream is not shown."""
    import warnings

    with warnings.catch_warnings():
        if empty:
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        g.capture_end()


def _new_graph(generators: tuple[Any, ...]) -> Any:
    """A CUDA graph that advances ``generators`` on every replay, as it does the device's
    default generator: each replay then draws the numbers an eager run would draw at the
    generators' current offsets, and moves the offsets past them."""
    import torch

    g = torch.cuda.CUDAGraph()
    for gen in generators:
        g.register_generator_state(gen)
    return g


@contextlib.contextmanager
def _capturing(pool_id: Any, lay: _Layer, kind: str, generators: tuple[Any, ...]) -> Any:
    """A new graph (:func:`_new_graph`, registered with ``generators``), capturing into the
    pool ``pool_id`` for the body (not ended: the caller ends it, once it knows whether the
    graph is empty). A body that fails abandons the capture; its error is raised as
    :class:`UnsupportedLayer` where it is work a graph cannot replay (:func:`_capture_refusal`;
    ``kind``: ``"forward"`` or ``"backward"``), as it is otherwise."""
    g = _new_graph(generators)
    g.capture_begin(pool=pool_id)
    try:
        yield g
    except BaseException as e:
        _abandon_capture(g, pool_id, generators)
        refusal = _capture_refusal(lay, kind, e)
        if refusal is None:
            raise
        raise refusal from e


def _abandon_capture(g: Any, pool_id: Any, generators: tuple[Any, ...] = ()) -> None:
    """Ends a capture whose body failed; the body's error is the one that matters.

    Ending a capture that a forbidden call invalidated fails too, and it fails before torch
    stops sending the capture stream's allocations to ``pool_id``: that is stopped here, or
    torch's allocator would count the capture as still underway for the rest of the process
    (every later ``torch.cuda.empty_cache()`` failing its assertion that none is, a pool's
    destruction among them, and the pool refused to later captures). The reference the
    capture took on the pool, which only a capture that ended gives back, is given back too.
    Last, the device's random number generator and ``generators`` are taken out of capture
    mode (see :func:`_end_generator_capture`).
    """
    import torch

    try:
        g.capture_end()
    except Exception:  # noqa: BLE001 - the body's error is raised
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        release = getattr(torch._C, "_cuda_releasePool", None)
        if end is not None and release is not None:
            device = torch.cuda.current_device()
            try:
                end(device, pool_id)
            except Exception:  # noqa: BLE001 - capture_end got past it: releasing the pool here
                pass  # could release it twice, once more when the graph is destroyed
            else:
                with contextlib.suppress(Exception):
                    release(device, pool_id)
        _end_generator_capture(generators)


def _end_generator_capture(generators: tuple[Any, ...] = ()) -> None:
    """Takes the current device's CUDA random number generator, and ``generators``, out of
    capture mode.

    A capture that fails to end leaves the generator's state marked as capturing (only a
    capture that ends clears the mark), and every later random op outside a capture, eager
    dropout or ``torch.randn`` included, then fails with "Offset increment outside graph
    capture encountered unexpectedly". An empty capture that ends clears it; the generator's
    seed and offset are untouched (an empty graph draws no numbers). ``generators``
    registered with the empty graph are cleared the same way.
    """
    import warnings

    import torch

    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with torch.cuda.stream(torch.cuda.Stream()):
            g = _new_graph(generators)
            g.capture_begin()
            g.capture_end()
        del g
