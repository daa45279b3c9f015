"""What a layer may not do under capture, found before any graph is used, and the error that
says so."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import InvalidArgument
from .layers import _as_tuple, _is_tensor, _layer_buffers
from .memory import _same_memory

if TYPE_CHECKING:  # pragma: no cover
    from .layers import _Layer

log = logging.getLogger("graphpool.capture")


class UnsupportedLayer(InvalidArgument):
    """A layer that schedule-aware capture cannot graph correctly; raised before any of its
    graphs is used. The message names the layer (its index within its chunk, the chunk and the
    module's class) and says what to change.

    Attributes:
        chunk: the model chunk of the layer (0-based).
        layer: the layer's index within its chunk (0-based).
        field: ``"callables"``.
        description: what is wrong and what to change, without the layer's name.
    """

    def __init__(self, chunk: int, layer: int, module: Any, what: str) -> None:
        super().__init__(
            f"layer {layer} of chunk {chunk} ({type(module).__name__}): {what}",
            field="callables",
            description=what,
        )
        self.chunk = chunk
        self.layer = layer


def _check_samples(samples: Sequence[tuple[Any, ...]]) -> None:
    """Refuses, before any CUDA call, chunk inputs that no graph can take: something other than
    a tensor (a graph reads its inputs from static tensors), or a tensor that is not on a CUDA
    device (the static input is made like the sample, and the layers run on the GPU).

    Raises:
        graphpool.InvalidArgument: ``field="sample_args"``, naming the chunk and the input.
    """
    for c, sample in enumerate(samples):
        for i, a in enumerate(sample):
            if not _is_tensor(a):
                raise InvalidArgument(
                    f"sample_args of chunk {c}: input {i} is a {type(a).__name__}, not a tensor; "
                    f"graphed layers take tensors only: pass it as a tensor, or make it part of "
                    f"the layer (an attribute of the module, or functools.partial)",
                    field="sample_args",
                )
            device = getattr(getattr(a, "device", None), "type", None)
            if device != "cuda":
                raise InvalidArgument(
                    f"sample_args of chunk {c}: input {i} is on {getattr(a, 'device', None)}, "
                    f"not on a CUDA device: pass samples on the GPU the layers run on",
                    field="sample_args",
                )


def _check_rng_generators(generators: Any, device: int) -> tuple[Any, ...]:
    """The ``rng_generators`` of a capture as a tuple, refused unless each is a
    ``torch.Generator`` of the capture's CUDA device.

    Raises:
        graphpool.InvalidArgument: ``field="rng_generators"``, naming the entry.
    """
    import torch

    if isinstance(generators, torch.Generator) or isinstance(generators, dict):
        kind = "a torch.Generator" if isinstance(generators, torch.Generator) else "a dict"
        raise InvalidArgument(
            f"rng_generators is {kind}; pass a sequence of generators "
            f"(for a dict of named tracker states, its .values())",
            field="rng_generators",
        )
    try:
        gens = tuple(generators)
    except TypeError:
        raise InvalidArgument(
            f"rng_generators must be a sequence of torch.Generator, not "
            f"{type(generators).__name__}",
            field="rng_generators",
        ) from None
    for i, g in enumerate(gens):
        if not isinstance(g, torch.Generator):
            raise InvalidArgument(
                f"rng_generators[{i}] is a {type(g).__name__}, not a torch.Generator: pass the "
                f"generators an RNG state tracker swaps in (graph-safe trackers hold "
                f"torch.Generator objects; one that holds state tensors cannot be captured)",
                field="rng_generators",
            )
        if g.device.type != "cuda" or (g.device.index if g.device.index is not None else device) != device:
            raise InvalidArgument(
                f"rng_generators[{i}] is a generator of {g.device}, not of the capture's device "
                f"cuda:{device}: pass the generators of the device the layers run on",
                field="rng_generators",
            )
    return gens


#: A module's hook tables: a graph replays none of them.
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


#: Tensor attributes holding a parameter's gradient hooks, by the method that registers them.
_GRAD_HOOKS = (
    ("register_hook", "_backward_hooks"),
    ("register_post_accumulate_grad_hook", "_post_accumulate_grad_hooks"),
)


#: Data-parallel wrappers whose work runs in Python or autograd hooks around the forward and
#: backward, which replays skip: why each cannot be a graphed layer, and what to do instead.
_WRAPPERS = {
    "DistributedDataParallel": (
        "its gradient all-reduce runs from hooks on the parameters' gradient accumulators, "
        "which never run for graphed layers (their backward graphs accumulate into param.grad "
        "inside the graph): pass the layers of the module it wraps (.module) and all-reduce "
        "param.grad once the last microbatch's backward has run"
    ),
    "FullyShardedDataParallel": (
        "it gathers and frees its parameters in Python around every forward and backward, "
        "which a replay does not run: graph layers whose parameters stay whole on each rank "
        "(replicated, with param.grad all-reduced once the last microbatch's backward has run)"
    ),
}


def _global_hooks() -> list[str]:
    """The kinds of module hooks registered for every module (``register_module_forward_hook``
    and its kin)."""
    try:
        from torch.nn.modules import module as torch_module
    except ImportError:
        return []
    return [
        name.strip("_")
        for name in (
            "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
            "_global_backward_hooks",
        )
        if getattr(torch_module, name, None)
    ]


def _check_modules(chunks: Sequence[Sequence[Any]]) -> None:
    """Refuses, before any CUDA call, layers whose graphs could not replay what eager execution
    does: a layer that is not callable, a module or submodule with registered hooks (a graph
    replays the kernels, not the hooks' Python code), a parameter with gradient hooks (its
    gradient is accumulated inside the backward graph, never through autograd), a
    data-parallel wrapper (DDP, FSDP), and a ``BatchNorm`` in train mode with
    ``momentum=None`` (its cumulative average reads the batch count on the host in every
    forward, which a capture cannot do). Hooks registered for every module are logged as a
    warning: the replays skip them too, but they are often a profiler's or a debugger's.

    Raises:
        UnsupportedLayer: naming the layer and what to change.
    """
    hooks = _global_hooks()
    if hooks:
        log.warning(
            "module hooks are registered for every module (%s): the graphs' replays will not run "
            "them", ", ".join(hooks),
        )
    for c, ch in enumerate(chunks):
        for i, mod in enumerate(ch):
            if not callable(mod):
                raise UnsupportedLayer(c, i, mod, "is not callable: pass modules or functions")
            named = getattr(mod, "named_modules", None)
            for sub_name, sub in named() if callable(named) else ():
                where = f"its submodule {sub_name!r} ({type(sub).__name__})" if sub_name else "it"
                wrapper = _WRAPPERS.get(type(sub).__name__)
                if wrapper is not None:
                    raise UnsupportedLayer(c, i, mod, f"{where} is a {type(sub).__name__}: {wrapper}")
                hooks = [h.strip("_") for h in _HOOKS if getattr(sub, h, None)]
                if hooks:
                    raise UnsupportedLayer(
                        c, i, mod,
                        f"{where} has registered hooks ({', '.join(hooks)}); a graph replays the "
                        f"layer's kernels, never the hooks' Python code: remove the hooks before "
                        f"capture",
                    )
                params = getattr(sub, "named_parameters", None)
                for p_name, p in params(recurse=False) if callable(params) else ():
                    kinds = [how for how, attr in _GRAD_HOOKS if getattr(p, attr, None)]
                    if kinds:
                        name = f"{sub_name}.{p_name}" if sub_name else p_name
                        raise UnsupportedLayer(
                            c, i, mod,
                            f"its parameter {name!r} has gradient hooks ({', '.join(kinds)}), "
                            f"which would never run: the backward graphs accumulate its gradient "
                            f"into param.grad inside the graph, not through autograd. Remove "
                            f"them, and act on param.grad once the last microbatch's backward "
                            f"has run (a data-parallel all-reduce, gradient clipping)",
                        )
                if (
                    getattr(sub, "training", False)
                    and getattr(sub, "track_running_stats", False)
                    and getattr(sub, "running_mean", None) is not None
                    and hasattr(sub, "momentum")
                    and sub.momentum is None
                ):
                    raise UnsupportedLayer(
                        c, i, mod,
                        f"{where} has momentum=None: its cumulative "
                        f"average divides by the batch count on the host in every forward, which "
                        f"a CUDA graph cannot replay; give it a float momentum (e.g. 0.1), or "
                        f"capture it in eval mode",
                    )


def _layer_outputs(lay: "_Layer", raw: Any) -> tuple[Any, ...]:
    """A layer's return value as the tuple of its outputs, checked: every output a tensor, and
    at least one that requires grad (the replay's backward, which gives the chunk's slot back,
    runs only through those).

    Raises:
        UnsupportedLayer: naming the layer and what to change.
    """
    outs = _as_tuple(raw)
    if not outs:
        raise UnsupportedLayer(
            lay.chunk, lay.index, lay.module,
            "returns an empty sequence: return a tensor or a tuple of tensors",
        )
    for i, o in enumerate(outs):
        if not _is_tensor(o):
            raise UnsupportedLayer(
                lay.chunk, lay.index, lay.module,
                f"output {i} is a {type(o).__name__}, not a tensor: a graphed layer returns a "
                f"tensor or a tuple of tensors (the next layer's positional inputs); return "
                f"tensors only, and leave other values out",
            )
    if not any(o.requires_grad for o in outs):
        raise UnsupportedLayer(
            lay.chunk, lay.index, lay.module,
            "returns no tensor that requires grad, so no backward would ever run through it "
            "(nor through the layers before it, and a chunk's slot is given back by its first "
            "layer's backward): merge it into the next layer, or make its inputs require grad",
        )
    return outs


def _check_inputs(lay: _Layer, slot: int, args: tuple[Any, ...]) -> None:
    """Checks a layer's inputs against the static inputs its graphs were captured with (for a
    chunk's first layer the sample's, for the others the previous layer's outputs): the graphs
    replay at those shapes and dtypes, and a copy into the static buffer would broadcast or
    convert silently instead of failing."""
    static = lay.static_in[slot]
    if lay.first:
        where, source = f"chunk {lay.chunk} (layer {lay.index})", "the sample_args of the chunk"
    else:
        where = f"layer {lay.index} of chunk {lay.chunk}"
        source = f"the outputs of layer {lay.index - 1}"
    if len(args) != len(static):
        raise TypeError(
            f"{where} was captured with {len(static)} input(s) ({source}), got {len(args)}"
        )
    for i, (a, st) in enumerate(zip(args, static)):
        shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
        if shape is None or dtype is None:
            raise TypeError(f"input {i} of {where} must be a tensor, not {type(a).__name__}")
        if shape != st.shape or dtype != st.dtype:
            raise ValueError(
                f"input {i} of {where}: expected shape {tuple(st.shape)} and dtype {st.dtype} "
                f"(as captured from {source}), got shape {tuple(shape)} and dtype {dtype}; the "
                f"graphs replay at the captured shapes: capture again for other shapes"
            )


def _check_chained(lay: _Layer, slot: int, microbatch: int, args: tuple[Any, ...]) -> None:
    """Refuses inputs of a chunk's later layer that are not the previous layer's outputs as
    its callable returned them for this microbatch.

    The layers of a chunk are captured as a chain: layer ``l``'s static input *is* layer
    ``l - 1``'s static output (the same memory: nothing is copied between the layers). Any
    other tensor would have to be copied into that memory, overwriting the output of layer
    ``l - 1`` that the caller may still hold (``h`` in ``y = g[l, m](norm(h)) + h`` would
    become ``norm(h)``) and that the backward of layer ``l - 1`` may read. Gradients need no
    such rule: a layer's output gradient buffer is the next layer's input gradient, which is
    dead once autograd has read it, so the replay copies whatever autograd passes into it.

    Raises:
        graphpool.InvalidArgument: ``field="args"``, naming the input and saying what to do.
    """
    for i, (a, st) in enumerate(zip(args, lay.static_in[slot])):
        if not _same_memory(a, st):
            prev = lay.index - 1
            raise InvalidArgument(
                f"input {i} of layer {lay.index} of chunk {lay.chunk} (microbatch {microbatch}) "
                f"is not output {i} of layer {prev} as its callable returned it for this "
                f"microbatch. The layers of a chunk are captured as a chain: layer "
                f"{lay.index}'s static input is layer {prev}'s static output, the same memory, "
                f"so another tensor would be copied over that output, which you may still hold "
                f"and layer {prev}'s backward may read. Call layer {lay.index} with layer "
                f"{prev}'s outputs exactly as returned (not a copy, a view in another layout, or "
                f"the result of an op on them). To run an op between two layers (a norm, a "
                f"residual add), make it part of a layer (a module that does both), or capture "
                f"the layers after it as a chunk of their own or in another capture",
                field="args",
            )


def _random_op_watch(device: int, generators: Sequence[Any] = ()) -> Any:
    """A context that records, in its ``ops``, the names of the ops that drew from ``device``'s
    CUDA generator or from one of ``generators`` while it was entered, in autograd's backward
    threads too: ops tagged ``nondeterministic_seeded`` that moved a generator's offset (the
    default generator's offset is that of whatever state an RNG state tracker swapped in). Not
    the ones that carry the tag but draw nothing, such as the attention backward kernels, which
    replay their forward's dropout from the seed and offset it saved, or dropout with
    probability 0. (Per op: an activation checkpoint puts the generator back after its
    recomputation.) Its first dispatch in a process imports ``torch._dynamo`` where nothing has
    yet (dispatch modes do): 0.85 s on the H200 host, 2.2 s where Python keeps no bytecode
    cache."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    # A torch without the tag or the offset cannot tell: nothing is refused.
    seeded = getattr(getattr(torch, "Tag", None), "nondeterministic_seeded", None)
    offsets = [
        getattr(g, "get_offset", None) for g in (torch.cuda.default_generators[device], *generators)
    ]
    if seeded is None or offsets[0] is None:
        offsets = []

    def read() -> tuple[Any, ...] | None:
        try:
            return tuple(offset() for offset in offsets if offset is not None)
        except RuntimeError:
            return None

    class Watch(TorchDispatchMode):  # type: ignore[misc, unused-ignore]
        def __init__(self) -> None:
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            # (higher-order operators carry no tags)
            if not offsets or seeded not in getattr(func, "tags", ()):
                return func(*args, **(kwargs or {}))
            before = read()
            out = func(*args, **(kwargs or {}))
            if before is not None and read() != before:
                self.ops.add(func.overloadpacket.__name__)
            return out

    return Watch()


def _foreign_leaf(outs: list[Any], own: list[Any]) -> Any:
    """A tensor that requires grad, that ``outs`` depend on, and that is not in ``own`` (the
    layer's inputs and parameters), or None: found by walking the outputs' autograd graph to
    its leaves (the gradient accumulators)."""
    known = {id(t) for t in own}
    seen: set[int] = set()
    # Python objects of autograd nodes are made on access: every one visited is kept alive
    # here, or another could be made at its freed address and wrongly count as seen
    visited: list[Any] = []
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        visited.append(fn)
        leaf = getattr(fn, "variable", None)  # a gradient accumulator's tensor
        if leaf is not None and id(leaf) not in known:
            return leaf
        stack.extend(nxt for nxt, _ in getattr(fn, "next_functions", ()) if nxt is not None)
    return None


def _reentrant_checkpoint(e: BaseException) -> bool:
    """Whether ``e`` is a reentrant activation checkpoint refusing ``torch.autograd.grad``
    (torch's ``use_reentrant=True`` checkpoint, and checkpoint functions built like it)."""
    text = str(e).lower()
    return "checkpoint" in text and ".grad()" in text


def _check_buffers_kept(lay: _Layer, before: list[tuple[str, Any]]) -> None:
    """Refuses a layer whose forward binds a new tensor to a buffer (``self.buf = ...``) rather
    than updating it in place: the graph writes the tensor it was captured with, and the module
    would not see what a replay computed (checked over one warm-up forward, so that a cache
    built once by the first forward is fine)."""
    now = dict(_layer_buffers(lay))
    for name, t in before:
        if now.get(name) is not t:
            raise UnsupportedLayer(
                lay.chunk, lay.index, lay.module,
                f"its forward assigns a new tensor to the buffer {name!r} instead of updating it "
                f"in place; a graph writes the tensor it was captured with, so the module would "
                f"never see the replays' values: update the buffer in place (copy_, add_, mul_)",
            )


#: What CUDA and torch say when a capture meets work it cannot record: a synchronization with
#: the host (cudaErrorStreamCaptureUnsupported), a call torch refuses during capture, a wait
#: on the legacy stream or on uncaptured work. Not the invalidated capture that follows any
#: failure (a refused segment too), which would be misnamed here.
_HOST_WORK_IN_CAPTURE = (
    "not permitted when stream is capturing",
    "graph capture",
    "depend on a capturing blocking stream",
    "uncaptured work",
)


def _capture_refusal(lay: _Layer, kind: str, e: BaseException) -> UnsupportedLayer | None:
    """An :class:`UnsupportedLayer` for a layer whose capture failed because it does work a
    CUDA graph cannot replay (host synchronization, data-dependent shapes, random numbers
    from a generator not registered with the graph, the generator's state read or set on the
    host), or None for any other failure (out of memory, a refused segment, an error of the
    layer itself), which is raised as it is."""
    if not isinstance(e, RuntimeError) or "out of memory" in str(e).lower():
        return None
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    low = text.lower()
    if "generator not in capture mode" in low:
        what = (
            f"its {kind} draws random numbers from a CUDA generator the capture does not know "
            f"({text}): an RNG state tracker swapped in a generator state of its own (as "
            f"TransformerEngine's and Megatron-LM's graph-safe trackers do for dropout). Pass "
            f"the tracker's generators to make_graphed_callables(rng_generators=...) (with "
            f"those trackers, get_all_rng_states().values()), so that every graph advances "
            f"them on replay"
        )
    elif "cudageneratorimpl" in low:
        # torch's first sentence says what was called; the rest asks for an issue to be filed
        called = text.split(". ")[0].rstrip(".")
        what = (
            f"its {kind} reads or sets the CUDA generator's seed and offset on the host "
            f"({called}), as torch.cuda.get_rng_state/set_rng_state and RNG state trackers "
            f"that copy state tensors do; a graph replays kernels only. Use a graph-safe "
            f"tracker (TransformerEngine's; Megatron-LM's with use_cudagraphable_rng=True), "
            f"which swaps generator states instead, and pass its generators in rng_generators"
        )
    elif any(p in low for p in _HOST_WORK_IN_CAPTURE):
        what = (
            f"its {kind} cannot be captured in a CUDA graph ({text}); a graph replays kernels "
            f"only, so the layer must not synchronize with the host: no .item(), .cpu(), "
            f".tolist() or Python branching on tensor values, no ops whose output shape depends "
            f"on values (nonzero, boolean-mask indexing, unique); move that work out of the "
            f"graphed layers"
        )
    else:
        return None
    return UnsupportedLayer(lay.chunk, lay.index, lay.module, what)
