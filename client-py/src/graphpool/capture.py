"""Schedule-aware CUDA graph capture: one graph per (layer, slot), not per (layer, microbatch).

:func:`make_graphed_callables` is a drop-in for :func:`torch.cuda.make_graphed_callables` plus a
pipeline :class:`~graphpool.schedule.Schedule`. It returns a :class:`GraphedSchedule`: one callable
per (layer, microbatch) that the training loop calls in its usual order. Microbatches that share a
buffer slot replay the *same* two graphs, so the number of graphs is ``2 x layers x slots`` for any
number of microbatches.

Why this is safe (see ``docs/capture.md``). A graph replays at fixed addresses, and one graph now
serves many microbatches whose replays interleave differently from the captures. Memory is
therefore split by lifetime, one memory pool per lifetime class:

* **one forward pool per (chunk, slot)**: everything the forward graphs of that slot allocate —
  the slot's static input, every layer's static output (the next layer's static input), the
  tensors each forward keeps for its backward, and the forward temporaries. Only the graphs of
  that slot ever touch that pool, and a slot is held by one microbatch from its first forward to
  its last backward, so nothing can overwrite what a forward left for its backward;
* **one backward pool shared by every backward graph**: backward temporaries and the chained
  gradient buffers (layer l's input gradient is layer l-1's output gradient), which are dead as
  soon as the next backward graph of the same microbatch has read them. Backward graphs run one
  at a time on one stream, so sharing their temporaries is safe;
* **parameter gradients** are accumulated inside the backward graphs into ``param.grad``, which
  lives outside every pool (allocated before capture, as eager's first backward would).

The gradient with respect to a chunk's input (what a pipeline sends to the previous stage) is
copied out of the backward pool before it is handed to autograd, so a caller may keep it.

At run time each slot records which microbatch holds it; calling a microbatch out of an order
the schedule allows (its slot still held by another microbatch) raises instead of replaying.

Layers it supports (each checked; what it cannot graph is refused with :class:`UnsupportedLayer`,
naming the layer and what to change, before any graph is used):

* any number of tensor inputs and outputs: a layer returns a tensor or a tuple (or list) of
  tensors, which are the next layer's positional inputs, in order. Inputs and outputs of any
  dtype and shape, and any mix of them (integer token ids, boolean or float masks, bf16 and fp32,
  a width that changes from layer to layer, a scalar loss); an output may be the very tensor
  the layer received, or a view of it (identity, ``view``/``reshape``, ``transpose``);
* outputs that do not require grad (a mask passed through, integer outputs, statistics
  computed under ``detach``) come back from the replay not requiring grad, as in eager mode; at
  least one output of every layer must require grad (the backward of a chunk's first layer is
  what gives its slot back);
* inputs or parameters that no output depends on need ``allow_unused_input=True``; their
  gradients stay zero;
* dropout and other random ops of the default CUDA generator: every replay draws new numbers,
  the ones eager execution would draw at the same point of the generator's sequence (the
  capture's warm-up draws from the generator too: seed after capture to repeat an eager run);
* buffers updated in place by the forward (``BatchNorm``'s running statistics in train mode):
  updated by every forward replay, as eager updates them. The warm-up's updates are undone, so
  capture leaves the buffers as it found them. A buffer the forward replaces (``self.buf =
  ...``) instead of updating in place, and a ``BatchNorm`` with ``momentum=None`` (which reads
  its batch count on the host), are refused;
* the training mode a layer and each of its submodules were captured in: calling it with any
  of them in the other mode and gradients enabled raises
  :class:`~graphpool.errors.FailedPrecondition` (under ``torch.no_grad()`` the layer runs
  eagerly, in whatever mode it is in);
* mixed precision: capture under ``torch.autocast("cuda", ...)`` captures the casts (autocast's
  weight cache is switched off for the warm-up and the capture, so every cast is made at each
  replay, from the current weights); the callables must then be called under the same autocast
  dtype, and a callable captured without autocast must be called without it (otherwise, with
  gradients enabled, :class:`~graphpool.errors.FailedPrecondition`);
* activation checkpointing with ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
  inside a layer: the recomputation is captured into the layer's backward graph. Reentrant
  checkpointing (``use_reentrant=True``) is refused: its backward cannot run under
  ``torch.autograd.grad``.

Not supported: host synchronization in a forward or backward (``.item()``, ``.cpu()``,
data-dependent shapes such as ``nonzero()``, Python control flow on tensor values; refused when
the capture fails with it), keyword or non-tensor inputs, outputs that are not tensors (``None``,
dicts), hooks registered on a layer's module or its submodules, gradient hooks on its
parameters (their gradients are accumulated inside the backward graphs, never through
autograd), data-parallel wrappers (``DistributedDataParallel``, whose all-reduce hooks would
not run either: graph ``ddp.module``'s layers and all-reduce ``param.grad`` after the step's
last backward; ``FullyShardedDataParallel``), sparse gradients, and a
layer whose outputs depend on a tensor that requires grad and is neither its input nor its own
parameter (a function using a module's parameters, a weight shared with a module the layer
does not hold: only a layer's own parameters get gradients). Hooks registered for every
module are logged as a warning: the replays run none of them.

Nothing here touches CUDA at import time, and torch is imported only when a function runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, cast

from ._fork import park
from .errors import FailedPrecondition, InvalidArgument
from .schedule import Schedule, _index

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "CaptureStats",
    "GraphedSchedule",
    "LayerProfile",
    "UnsupportedLayer",
    "make_graphed_callables",
    "plan_description",
    "capture_plan_input",
    "request_plan",
]

log = logging.getLogger("graphpool.capture")

_GiB = float(1 << 30)


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


# ------------------------------------------------------------------------------- results


@dataclass
class LayerProfile:
    """What one layer's graphs keep, measured by one eager warm-up step (bytes)."""

    chunk: int
    layer: int
    input_bytes: int
    output_bytes: int
    #: Bytes the forward keeps for its backward beyond its inputs and parameters.
    saved_bytes: int
    #: Peak bytes the forward allocates above what it keeps (freed before it ends).
    forward_workspace_bytes: int = 0
    #: Peak bytes the backward allocates beyond its input gradients: temporaries and the
    #: parameter gradients it returns before they are accumulated into ``param.grad``.
    backward_workspace_bytes: int = 0
    #: Of ``saved_bytes`` + outputs (those that are not an input or a view of one), the bytes
    #: in tensors over 1 MiB (the caching allocator's large-block class, placed in a pool's
    #: arena), each rounded to 512 bytes.
    large_kept_bytes: int = 0
    input_shapes: list[tuple[list[int], str, bool]] = field(default_factory=list)
    output_shapes: list[tuple[list[int], str]] = field(default_factory=list)


@dataclass
class CaptureStats:
    """What a capture did and cost."""

    graphs: int = 0
    capture_seconds: float = 0.0
    warmup_seconds: float = 0.0
    #: ``"graphpool"`` (daemon-backed pools) or ``"torch"`` (plain ``torch.cuda.MemPool``).
    pool_kind: str = ""
    num_pools: int = 0
    slots_per_chunk: tuple[int, ...] = ()
    #: Rise of the caching allocator's reserved bytes over the capture.
    reserved_bytes: int = 0
    #: Bytes predicted from the warm-up profile (static buffers + saved tensors + workspaces,
    #: all slots).
    predicted_bytes: int = 0
    #: Bytes of the one segment each pool was given before capture (label -> bytes; empty when
    #: ``arena=False``).
    arena_bytes: dict[str, int] = field(default_factory=dict)
    #: Bytes the warm-up left reserved outside the pools once its tensors were freed: the
    #: libraries' workspaces for the capture stream (cuBLAS), which the graphs use.
    warmup_retained_bytes: int = 0
    #: Device memory the capture took beyond the rise of the allocator's reserve (graph objects
    #: and their instantiation), from ``torch.cuda.mem_get_info`` around the capture.
    graph_object_bytes: int = 0
    #: Of ``graph_object_bytes``: what the first graph took (a one-off cost of the first
    #: instantiation, plus one graph) and the mean of every later graph. The driver hands out
    #: device memory in 2 MiB pages, so both are exact only in sum.
    graph_first_bytes: int = 0
    graph_bytes_per_graph: int = 0
    #: Device memory outside the allocator that the warm-up took (library handles of the
    #: capture stream, kernels loaded on first use).
    warmup_outside_bytes: int = 0
    #: The dtype CUDA autocast cast to during capture (``"bfloat16"``, ``"float16"``), or
    #: ``None``: the callables replay that precision and must be called under the same
    #: autocast state.
    autocast: str | None = None
    #: CUDA device, free device memory and allocator reserve when the capture began (the
    #: baseline of :meth:`GraphedSchedule.capture_overhead`).
    device: int = 0
    free_at_start: int = 0
    reserved_at_start: int = 0
    #: Reserved bytes outside the capture's pools when the capture ended.
    reserved_outside_pools: int = 0
    #: The daemon's answer to the capture's ``PlanCapture``, when one was asked for and given (a
    #: ``graphpool.v1.PlanCaptureResponse``: the plan without its per-buffer list, and the bytes
    #: reserved).
    plan: Any = None
    profiles: list[LayerProfile] = field(default_factory=list)


# ------------------------------------------------------------------------------- helpers


def _alias(t: "torch.Tensor") -> "torch.Tensor":
    """A tensor over ``t``'s memory that does not keep that memory allocated.

    The caching allocator may hand the block to later allocations of the same pool; callers only
    use the alias where the schedule guarantees the memory holds what they expect.
    """
    import torch

    nbytes = t.untyped_storage().nbytes()
    base = t.untyped_storage().data_ptr()
    st = _storage_at(base, nbytes, t.device)
    out = torch.empty((0,), dtype=t.dtype, device=t.device)
    cast(Any, out).set_(st, t.storage_offset(), t.shape, t.stride())
    return out


def _storage_at(ptr: int, nbytes: int, device: "torch.device") -> Any:
    """An untyped storage over ``[ptr, ptr + nbytes)`` that owns nothing."""
    import torch

    ctor = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if ctor is not None:
        return ctor(ptr, device, nbytes)

    class _CAI:  # fallback through the CUDA array interface (the deleter drops this object)
        __cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }

    return torch.as_tensor(_CAI(), device=device).untyped_storage()


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _is_tensor(x: Any) -> bool:
    """Whether ``x`` is a tensor (duck-typed, so that the checks below need no torch)."""
    return all(hasattr(x, a) for a in ("shape", "dtype", "requires_grad", "detach"))


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


def _nbytes(t: "torch.Tensor") -> int:
    return int(t.numel() * t.element_size())


def _split_chunks(callables: Sequence[Any], v: int) -> list[list[Any]]:
    if v == 1:
        if callables and all(isinstance(c, (list, tuple)) for c in callables):
            if len(callables) != 1:
                raise ValueError("one model chunk expected: pass the layers as a flat sequence")
            return [list(callables[0])]
        return [list(callables)]
    if len(callables) == v and all(isinstance(c, (list, tuple)) for c in callables):
        return [list(c) for c in callables]
    if len(callables) % v:
        raise ValueError(
            f"{len(callables)} layers cannot be split evenly into {v} chunks: pass one "
            f"sequence of layers per chunk"
        )
    n = len(callables) // v
    return [list(callables[i * n : (i + 1) * n]) for i in range(v)]


def _chunk_samples(sample_args: Sequence[Any], chunks: list[list[Any]]) -> list[tuple[Any, ...]]:
    """The sample inputs of each chunk's first layer: a tuple per chunk, a tuple per layer (as
    torch's), or, for one chunk, a flat tuple of tensors (the first layer's inputs: ``(x,
    mask)`` for two layers is one sample of two inputs, not a sample per layer)."""
    total = sum(len(c) for c in chunks)
    v = len(chunks)
    if v == 1 and sample_args and not any(isinstance(a, (tuple, list)) for a in sample_args):
        return [tuple(sample_args)]  # the inputs of the one chunk's first layer, not one per layer
    if len(sample_args) == total and total != v:
        out, i = [], 0
        for c in chunks:
            out.append(_as_tuple(sample_args[i]))
            i += len(c)
        return out
    if len(sample_args) == v:
        return [_as_tuple(a) for a in sample_args]
    raise ValueError(
        f"sample_args: expected one tuple per layer ({total}) or per chunk ({v}), got "
        f"{len(sample_args)}"
    )


# ------------------------------------------------------------------------------- pools

#: The values of ``make_graphed_callables(pools=...)``.
POOL_KINDS = ("auto", "graphpool", "torch")


def _daemon_pool_factory(
    device: int, budget: int | None, client: Any, *, required: bool = False
) -> Callable[[str], Any] | None:
    """A factory of daemon-backed pools, or None when graphpool's MemPool, its native shim or a
    daemon is absent (``ImportError``, ``FileNotFoundError`` for the shim,
    ``DaemonUnavailable``). Any other failure of the probe (the daemon refusing this process,
    a malformed argument, a reserved budget that does not fit, ...) is raised: falling back to
    torch pools would bypass the daemon's refusal. With ``required`` (``pools="graphpool"``),
    absence is raised too."""
    try:
        from graphpool import torch as gp_torch  # the daemon-backed MemPool
        from graphpool.errors import DaemonUnavailable

        cls = getattr(gp_torch, "MemPool")
    except ImportError as e:
        if required:
            raise
        log.info("graphpool.torch.MemPool not available (%s); using torch.cuda.MemPool", e)
        return None

    def make(label: str) -> Any:
        # the session budget: the capture's, or none (MemPool's default of 8 GiB would refuse
        # captures larger than that although no budget was asked for)
        kwargs: dict[str, Any] = {"device": device, "budget": budget or None}
        if client is not None:  # a Client, or a Session: the socket of its Client
            kwargs["client"] = _session_client(client) or client
        try:
            return cls(label=label, **kwargs)
        except TypeError:
            return cls(**kwargs)

    try:  # one probe: is a daemon reachable?
        probe = make("graphpool-capture-probe")
    except (DaemonUnavailable, FileNotFoundError, ImportError) as e:
        if required:
            raise
        log.info("graphpoold or its shim not available (%s); using torch.cuda.MemPool", e)
        return None
    first = [probe]

    def factory(label: str) -> Any:
        if first:
            return first.pop()
        return make(label)

    return factory


def _pool_id(pool: Any) -> Any:
    return pool.id


# ------------------------------------------------------------------------------- planning


def request_plan(
    schedule: Schedule,
    profiles: Sequence[LayerProfile],
    *,
    budget: int | None,
    client: Any = None,
    device: int = 0,
    reserve: bool = True,
    overhead: dict[str, int] | None = None,
    session_id: int | None = None,
) -> Any:
    """Ask graphpoold for a plan of this capture; raise ``CapacityExceeded`` if it cannot fit.

    ``client`` is a ``graphpool.Session`` (the plan is made for that session) or a
    ``graphpool.Client`` with ``session_id``, a session of this process (e.g. the one of the
    ``graphpool.torch`` pools that will hold the capture). With ``reserve`` the plan's bytes
    are reserved for that session, so that its later segment requests are admitted against
    them: plan for the session that allocates the capture's memory, or the capture is
    charged twice (the reservation, and the segments of another session).

    ``overhead`` (:meth:`GraphedSchedule.capture_overhead` of an earlier capture of the model)
    is added to the plan's predicted bytes, which the daemon checks against quota and capacity.

    Returns the ``graphpool.v1.PlanCaptureResponse``, its ``plan`` without the per-buffer list
    (``summary_only``), or ``None`` when there is no daemon or client to ask (then only the
    local checks of :func:`_check_capacity` apply).

    Raises:
        TypeError: ``client`` is a ``graphpool.Client`` and no ``session_id`` was given.
    """
    if client is None:
        return None
    if getattr(client, "plan_capture", None) is None:
        log.debug("client has no plan_capture(); skipping the daemon plan")
        return None
    # The footprint and the prediction are what capture checks; the per-buffer list of a
    # schedule of many microbatches would not fit in one message.
    plan_input = capture_plan_input(schedule, profiles, overhead)
    session_client = _session_client(client)
    if session_id is None:
        if session_client is None:
            raise TypeError(
                "request_plan: a graphpool.Client plans for a session: pass session_id= (a "
                "session of this process), or pass the graphpool.Session as client"
            )
        return client.plan_capture(plan_input, reserve=reserve, summary_only=True)
    by_id = session_client if session_client is not None else client
    return by_id.plan_capture(session_id, plan_input, reserve=reserve, summary_only=True)


def _session_client(client: Any) -> Any:
    """The ``graphpool.Client`` of ``client`` when it is a ``graphpool.Session``, else None."""
    if hasattr(client, "session_id") and hasattr(client, "client"):
        return client.client
    return None


def capture_plan_input(
    schedule: Schedule, profiles: Sequence[LayerProfile], overhead: dict[str, int] | None = None
) -> Any:
    """The ``graphpool.v1.PlanInput`` of a capture: the schedule, each layer's static inputs
    and outputs and its profiled saved and workspace bytes, and the capture overhead when
    given (what :func:`request_plan` sends)."""
    from graphpool._proto.graphpool.v1 import plan_pb2

    layers = []
    for p in profiles:
        layers.append(
            plan_pb2.LayerSpec(
                chunk=p.chunk,
                layer=p.layer,
                inputs=[
                    plan_pb2.TensorSpec(
                        name=f"in{i}", shape=shape, dtype=dt, kept_for_backward=kept
                    )
                    for i, (shape, dt, kept) in enumerate(p.input_shapes)
                ],
                outputs=[
                    plan_pb2.TensorSpec(name=f"out{i}", shape=shape, dtype=dt)
                    for i, (shape, dt) in enumerate(p.output_shapes)
                ],
                saved_bytes=p.saved_bytes,
                forward_workspace_bytes=p.forward_workspace_bytes,
                backward_workspace_bytes=p.backward_workspace_bytes,
            )
        )
    sched = plan_pb2.SchedulePlanInput(schedule=schedule.to_proto(), layers=layers)
    if overhead is not None:
        sched.overhead.CopyFrom(plan_pb2.CaptureOverhead(**_checked_overhead(overhead)))
    return plan_pb2.PlanInput(schedule=sched)


#: The keys of a capture overhead (``graphpool.v1.CaptureOverhead``).
OVERHEAD_KEYS = ("fixed_bytes", "per_graph_bytes", "per_pool_bytes", "backward_pool_extra_bytes")


def _checked_overhead(overhead: dict[str, int]) -> dict[str, int]:
    unknown = set(overhead) - set(OVERHEAD_KEYS)
    if unknown:
        raise ValueError(f"overhead: unknown keys {sorted(unknown)}; expected some of {list(OVERHEAD_KEYS)}")
    for k, v in overhead.items():
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"overhead[{k!r}] must be a non-negative int of bytes, got {v!r}")
    return dict(overhead)


def overhead_bytes(overhead: dict[str, int], graphs: int, pools: int) -> int:
    """Bytes of a capture overhead for ``graphs`` graphs in ``pools`` pools (what
    ``graphpool plan`` adds to the planned buffers)."""
    o = _checked_overhead(overhead)
    return (
        o.get("fixed_bytes", 0)
        + o.get("per_graph_bytes", 0) * graphs
        + o.get("per_pool_bytes", 0) * pools
        + o.get("backward_pool_extra_bytes", 0)
    )


def plan_description(
    schedule: Schedule, profiles: Sequence[LayerProfile], overhead: dict[str, int] | None = None
) -> dict[str, Any]:
    """The input of ``graphpool plan --schedule FILE.json`` for this capture.

    ``profiles`` come from :attr:`CaptureStats.profiles` (one eager warm-up step), so a job can
    be planned offline from a profile recorded once: ``json.dump(plan_description(...), f)``.
    Per layer it carries the static input/output shapes, ``saved_bytes`` (what the forward keeps
    for its backward, from saved-tensor hooks) and the forward/backward workspace bytes (peak
    temporaries of each, from the allocator's peak counter around each layer). ``overhead``
    (:meth:`GraphedSchedule.capture_overhead` of a capture of the same model, under any
    schedule) adds what capture costs beyond the planned buffers; without it the prediction
    is the static buffers alone.

    Raises:
        ValueError: ``overhead`` has a key that is not one of :data:`OVERHEAD_KEYS`, or a value
            that is not a non-negative int.
    """
    desc = _description(schedule, profiles)
    if overhead is not None:
        desc["overhead"] = _checked_overhead(overhead)
    return desc


def _description(schedule: Schedule, profiles: Sequence[LayerProfile]) -> dict[str, Any]:
    return {
        "schedule": schedule.to_dict(),
        "layers": [
            {
                "chunk": p.chunk,
                "layer": p.layer,
                "saved_bytes": p.saved_bytes,
                "forward_workspace_bytes": p.forward_workspace_bytes,
                "backward_workspace_bytes": p.backward_workspace_bytes,
                "inputs": [
                    {"name": f"in{i}", "shape": shape, "dtype": dt, "kept_for_backward": kept}
                    for i, (shape, dt, kept) in enumerate(p.input_shapes)
                ],
                "outputs": [
                    {"name": f"out{i}", "shape": shape, "dtype": dt}
                    for i, (shape, dt) in enumerate(p.output_shapes)
                ],
            }
            for p in profiles
        ],
    }


def _capacity_error(message: str, requested: int, free: int, limit: str, limit_bytes: int) -> Exception:
    try:
        from graphpool.errors import CapacityExceeded

        return CapacityExceeded(
            message, requested=requested, free=free, limit=limit, limit_bytes=limit_bytes
        )
    except Exception:  # noqa: BLE001 - errors.py needs grpc; fall back to a MemoryError
        return MemoryError(message)


def _check_capacity(predicted: int, budget: int | None, device: int) -> None:
    """Fail before capture if the predicted bytes exceed the budget or the device's free memory."""
    import torch

    if budget is not None and predicted > budget:
        raise _capacity_error(
            f"capture needs about {predicted / _GiB:.2f} GiB, over the budget of "
            f"{budget / _GiB:.2f} GiB",
            predicted, budget, "capture-budget", budget,
        )
    free, _ = torch.cuda.mem_get_info(device)
    if predicted > free:
        raise _capacity_error(
            f"capture needs about {predicted / _GiB:.2f} GiB, but the device has only "
            f"{free / _GiB:.2f} GiB free",
            predicted, free, "device-free", free,
        )


# ------------------------------------------------------------------------------- runtime


class _Layer:
    """The graphs and static buffers of one (chunk, layer), per slot."""

    def __init__(self, chunk: int, index: int, module: Any, nslots: int, first: bool, last: bool):
        self.chunk = chunk
        self.index = index
        self.module = module
        self.first = first
        self.last = last
        params = module.parameters() if hasattr(module, "parameters") else ()
        self.params: tuple[Any, ...] = tuple(p for p in params if p.requires_grad)
        self.fwd: list[Any] = [None] * nslots
        self.bwd: list[Any] = [None] * nslots
        self.static_in: list[tuple[Any, ...]] = [()] * nslots
        self.static_out: list[tuple[Any, ...]] = [()] * nslots
        self.static_gout: list[tuple[Any, ...]] = [()] * nslots  # aliases (weak)
        self.static_gin: list[tuple[Any, ...]] = [()] * nslots  # aliases (weak); None = no grad
        self.in_requires_grad: tuple[bool, ...] = ()
        self.out_requires_grad: tuple[bool, ...] = ()
        #: The layer returned one tensor, not a tuple or list (its callable returns the same).
        self.single_output = True
        #: Every output is an input or a view of one: the layer's graphs launch nothing.
        self.launches_nothing = False
        #: The module and its submodules, and ``training`` of each at capture (empty for a
        #: callable that is not a module): the graphs replay what the layer did in those modes
        #: (dropout, batch statistics).
        self.modes: tuple[tuple[Any, ...], tuple[bool, ...]] = _modes(module)
        self.grad_bufs: tuple[Any, ...] = ()
        #: A scalar that requires grad, passed to the replay Function so that autograd runs its
        #: backward even when no input requires grad (parameters are not Function inputs: their
        #: gradients are accumulated inside the backward graph).
        self.anchor: Any = None


def _modes(module: Any) -> tuple[tuple[Any, ...], tuple[bool, ...]]:
    """The module and its submodules, and the training mode of each."""
    modules = getattr(module, "modules", None)
    every = tuple(modules()) if callable(modules) else (module,)
    mods = tuple(m for m in every if isinstance(getattr(m, "training", None), bool))
    return mods, tuple(m.training for m in mods)


def _autocast_dtype() -> Any:
    """The dtype CUDA autocast casts to in this thread (a ``torch.dtype``), or None where it
    is off."""
    import torch

    try:
        return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    except (TypeError, AttributeError):  # torch before 2.4: no per-device-type forms
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def _autocast_name(dtype: Any) -> str:
    return "without autocast" if dtype is None else (
        f"under torch.autocast(dtype={str(dtype).replace('torch.', '')})"
    )


@contextlib.contextmanager
def _uncached_autocast(dtype: Any) -> Any:
    """Autocast's weight cache off for the warm-up and the capture, under a caller's
    ``torch.autocast``: a cached cast would be captured as a constant (the graphs would read
    the weight of the step that filled the cache, never an updated one), its memory would be
    given back to the pools when the autocast region ends while the graphs still use it, and a
    cast cached by an eager forward holds that forward's gradient accumulators, whose stream
    breaks the backward's capture. Every cast is then made inside the graph, at each replay.
    """
    import torch

    if dtype is None:
        yield
        return
    torch.clear_autocast_cache()
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


def _mode_changed(lay: "_Layer") -> Any:
    """The first of the layer's modules whose training mode differs from the capture's, or
    None."""
    mods, flags = lay.modes
    return next((m for m, f in zip(mods, flags) if m.training != f), None)


class GraphedSchedule:
    """Per-(layer, microbatch) callables over ``2 x layers x slots`` CUDA graphs.

    ``graphed[layer, microbatch]`` is the callable of a layer (index into the flat list of layers,
    chunk after chunk) for a microbatch of its chunk; ``graphed.layer(l)`` lists them over
    microbatches and ``graphed.chunk(c, m)`` gives the layers of chunk ``c`` for microbatch ``m``.

    Each callable takes the layer's inputs positionally and returns its outputs (a tensor, or a
    tuple when the layer returned a tuple or list), which are the static buffers of the
    microbatch's slot: valid until the microbatch's backward is done. Outputs that did not
    require grad when captured do not require grad. Every callable checks its inputs against
    the captured ones (their number: ``TypeError``; each one's shape and dtype: ``ValueError``)
    before anything runs; a chunk's first layer does so before it takes the slot.

    With gradients disabled (``torch.no_grad()``, ``torch.inference_mode()``: evaluation), a
    callable runs its layer eagerly instead, outside the pools, and takes no slot: no backward
    would ever run to free it. With gradients enabled, a module called in another training
    mode than the one it was captured in, or under another ``torch.autocast`` state, raises
    ``graphpool.FailedPrecondition``.
    """

    def __init__(self, schedule: Schedule, layers: list[list[_Layer]], pools: list[Any], stats: CaptureStats):
        self._pid = os.getpid()
        self.schedule = schedule
        self.stats = stats
        self._layers = layers
        self._pools = pools  # kept alive with the graphs
        self._flat = [lay for chunk in layers for lay in chunk]
        #: What CUDA autocast cast to at capture (a ``torch.dtype``), or None.
        self._autocast: Any = None
        if stats.autocast is not None:
            import torch

            self._autocast = getattr(torch, stats.autocast)
        self._owner: list[list[int | None]] = [
            [None] * n for n in schedule.slots_per_chunk
        ]
        self._calls = [
            [_GraphedCall(self, lay, m) for m in range(schedule.num_microbatches)]
            for lay in self._flat
        ]

    # --- indexing

    def __getitem__(self, key: tuple[int, int]) -> Callable[..., Any]:
        layer, microbatch = key
        layer = _index("layer", layer, len(self._calls))
        return self._calls[layer][_index("microbatch", microbatch, self.schedule.num_microbatches)]

    def __len__(self) -> int:
        return len(self._flat) * self.schedule.num_microbatches

    def layer(self, layer: int) -> list[Callable[..., Any]]:
        """The callables of ``layer`` (index into the flat list of layers), one per
        microbatch. Raises ``IndexError`` for an index out of range (negative included)."""
        return list(self._calls[_index("layer", layer, len(self._calls))])

    def chunk(self, chunk: int, microbatch: int) -> list[Callable[..., Any]]:
        """The callables of every layer of ``chunk`` (0-based) for ``microbatch``, in forward
        order. Raises ``IndexError`` for an index out of range (negative included)."""
        chunk = _index("chunk", chunk, len(self._layers))
        microbatch = _index("microbatch", microbatch, self.schedule.num_microbatches)
        start = sum(len(c) for c in self._layers[:chunk])
        return [self._calls[start + i][microbatch] for i in range(len(self._layers[chunk]))]

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured: ``2 x layers x slots``, whatever the number of microbatches."""
        return self.stats.graphs

    # --- memory

    def pool_reserved(self) -> dict[str, int]:
        """Bytes of device memory each of the capture's pools holds (its segments), by label
        (``fwd/c<chunk>/s<slot>``, ``bwd``)."""
        import torch

        ids = {tuple(_pool_id(pool)): label for label, pool in self._pools}
        out = {label: 0 for label, _ in self._pools}
        for seg in torch.cuda.memory_snapshot():
            pid = seg.get("segment_pool_id")
            label = ids.get(tuple(pid)) if pid is not None else None
            if label is not None:
                out[label] += int(seg["total_size"])
        return out

    def capture_overhead(self) -> dict[str, int]:
        """What this capture costs beyond the buffers ``graphpool plan`` places, measured now:
        the ``overhead`` of :func:`plan_description`, so that ``graphpool plan`` predicts this
        model's whole capture under any schedule and number of microbatches.

        Call it after the first full step of the schedule (the CUDA runtime takes part of its
        graph memory at the first replay) and before other libraries take device memory outside
        the caching allocator (e.g. NCCL's first collective), which would be counted as fixed.

        Returns ``fixed_bytes`` (outside the pools: the warm-up's library workspaces and the
        runtime's graph state), ``per_graph_bytes``, ``per_pool_bytes`` (what a forward pool
        holds beyond its arena, the median over pools) and ``backward_pool_extra_bytes`` (what
        the backward pool holds beyond its arena and that). Pools are measured only when they
        were given arenas (the default for daemon-backed pools); otherwise both pool figures
        are 0.
        """
        import torch

        st = self.stats
        torch.cuda.synchronize(st.device)
        outside = _outside(st.free_at_start, st.reserved_at_start, st.device)
        per_graph = st.graph_bytes_per_graph
        fixed = st.reserved_outside_pools + max(0, outside - per_graph * st.graphs)
        held = self.pool_reserved()
        # A pool's overhead is what it holds beyond its arena; a pool without an arena
        # (arena=False, expandable segments) holds its tensors and its overhead mixed, so only
        # pools with one are measured.
        fwd = sorted(
            max(0, n - st.arena_bytes[label])
            for label, n in held.items()
            if label != "bwd" and label in st.arena_bytes
        )
        if len(fwd) < sum(1 for label in held if label != "bwd"):
            log.warning("capture_overhead: per-pool overhead measured on the %d pools with an arena only", len(fwd))
        per_pool = fwd[len(fwd) // 2] if fwd else 0
        bwd_extra = 0
        if "bwd" in st.arena_bytes:
            bwd_extra = max(0, held.get("bwd", 0) - st.arena_bytes["bwd"] - per_pool)
        return {
            "fixed_bytes": fixed,
            "per_graph_bytes": per_graph,
            "per_pool_bytes": per_pool,
            "backward_pool_extra_bytes": bwd_extra,
        }

    # --- testing and diagnostics

    def pool_segments(self) -> list[tuple[str, int, int]]:
        """``(pool label, address, bytes)`` of every block (free or not) of the capture's pools.

        Blocks, not segments: an expandable segment reserves address space that is not all
        mapped, while every block lies in mapped memory.
        """
        import torch

        ids = {}
        for label, pool in self._pools:
            ids[tuple(_pool_id(pool))] = label
        out = []
        for seg in torch.cuda.memory_snapshot():
            pid = seg.get("segment_pool_id")
            if pid is None or tuple(pid) not in ids:
                continue
            addr = int(seg["address"])
            for blk in seg.get("blocks", ()):
                size = int(blk["size"])
                start = int(blk.get("address", addr))
                out.append((ids[tuple(pid)], start, size))
                addr = start + size
        return out

    def close(self) -> None:
        """Destroy the graphs, then let go of the pools (a pool must outlive its graphs).

        Explicit and idempotent: call it before dropping the last reference, so that nothing
        depends on the order in which the garbage collector finds graphs and pools. Tensors
        returned by the callables that the caller still holds keep their blocks (and, for
        daemon-backed pools, the daemon session) until they are dropped.

        In a process forked from the one that captured it, this only drops the schedule's
        references: the graphs and pools belong to the parent, so nothing calls CUDA or the
        daemon, and they are kept referenced (never destroyed there).

        Every pool is released even when releasing one fails; the first such error is raised
        afterwards.
        """
        import gc

        flat = getattr(self, "_flat", ())
        if not flat and not getattr(self, "_pools", ()):
            return
        if getattr(self, "_pid", os.getpid()) != os.getpid():
            # Destroying graphs, static buffers or pools would call CUDA in the child.
            park((self._layers, flat, getattr(self, "_calls", []), self._pools))
            self._flat = []
            self._layers = []
            self._calls = []
            self._pools = []
            return
        try:
            import torch

            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
        for lay in flat:
            for graphs in (lay.fwd, lay.bwd):
                for i, g in enumerate(graphs):
                    if g is not None:
                        g.reset()
                        graphs[i] = None
            lay.static_in = lay.static_out = lay.static_gin = lay.static_gout = []
        self._flat = []
        self._layers = []
        self._calls = []
        gc.collect()  # autograd nodes of replays still referenced by cycles
        pools, self._pools = self._pools, []
        errors = _release_pools(pool for _, pool in pools)
        del pools
        gc.collect()
        if errors:
            raise errors[0]

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def poison(self, byte: int = 0xFF) -> int:
        """Overwrite every pool that holds nothing live now; returns the bytes overwritten.

        Between two schedule steps that is the backward pool and the forward pools of every free
        slot (0xFF bytes read as NaN in bf16/f16/f32). A test of the memory split: if any graph
        read memory it does not own, results change.
        """
        import torch

        free_labels = {"bwd"}
        for c, owners in enumerate(self._owner):
            for s, m in enumerate(owners):
                if m is None:
                    free_labels.add(f"fwd/c{c}/s{s}")
        done = 0
        for label, addr, size in self.pool_segments():
            if label in free_labels:
                st = _storage_at(addr, size, torch.device("cuda", torch.cuda.current_device()))
                torch.empty((0,), dtype=torch.uint8, device="cuda").set_(st).fill_(byte)
                done += size
        return done

    def slots_in_use(self) -> list[list[int | None]]:
        """Per chunk, per slot: the microbatch that holds the slot now (its forward ran, its
        backward has not), or ``None`` for a free slot."""
        return [list(x) for x in self._owner]


class _GraphedCall:
    __slots__ = ("owner", "lay", "mb", "slot")

    def __init__(self, owner: GraphedSchedule, lay: _Layer, mb: int):
        self.owner = owner
        self.lay = lay
        self.mb = mb
        self.slot = owner.schedule.slot_of(lay.chunk, mb)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        if kwargs:
            raise TypeError("graphed layers take their inputs positionally")
        lay, s = self.lay, self.slot
        if not torch.is_grad_enabled():
            # No backward will run to free the slot (under torch.no_grad(), inference_mode,
            # e.g. evaluation): run the layer eagerly, as torch.cuda.make_graphed_callables
            # does when the training mode differs from the capture's; no slot is claimed.
            return lay.module(*args)
        changed = _mode_changed(lay)
        if changed is not None:
            mode = "eval" if changed.training else "training"
            which = "" if changed is lay.module else f" ({type(changed).__name__}, a submodule)"
            raise FailedPrecondition(
                f"layer {lay.index} of chunk {lay.chunk} was captured with a module{which} in "
                f"{mode} mode and is called with it in the other one, gradients enabled; its "
                f"graphs replay the captured mode (dropout, batch statistics): switch the module "
                f"back, evaluate under torch.no_grad() (the layers then run eagerly), or capture "
                f"again"
            )
        amp = _autocast_dtype()
        if amp != self.owner._autocast:
            raise FailedPrecondition(
                f"layer {lay.index} of chunk {lay.chunk} was captured "
                f"{_autocast_name(self.owner._autocast)} and is called {_autocast_name(amp)}, "
                f"gradients enabled; its graphs replay the captured precision: call it as it was "
                f"captured, evaluate under torch.no_grad() (the layers then run eagerly), or "
                f"capture again"
            )
        owners = self.owner._owner[lay.chunk]
        holder = owners[s]
        if lay.first:
            if holder is not None and holder != self.mb:
                raise RuntimeError(
                    f"microbatch {self.mb} of chunk {lay.chunk} needs slot {s}, still held by "
                    f"microbatch {holder} whose backward has not run: call the layers in the "
                    f"order of the schedule ({self.owner.schedule.describe()})"
                )
            _check_inputs(lay, s, args)
            for a, r in zip(args, lay.in_requires_grad):
                if a.requires_grad and not r:
                    raise RuntimeError(
                        f"chunk {lay.chunk}'s input requires grad but its sample did not: pass "
                        f"sample_args that require grad to compute the input gradient"
                    )
            owners[s] = self.mb
        elif holder != self.mb:
            raise RuntimeError(
                f"layer {lay.index} of chunk {lay.chunk} called for microbatch {self.mb}, but "
                f"slot {s} holds microbatch {holder}: run layer 0 of the chunk first"
            )
        else:
            _check_inputs(lay, s, args)
        out = _replay_fn().apply(self, lay.anchor, *args)
        return out[0] if lay.single_output else out


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


def _release_pools(pools: Iterable[Any]) -> list[Exception]:
    """Releases each distinct daemon-backed pool (``graphpool.torch.MemPool``; torch's own have
    no ``release``), every one even when one fails; returns the failures in order."""
    seen: set[int] = set()
    errors: list[Exception] = []
    for pool in pools:
        if id(pool) in seen:
            continue
        seen.add(id(pool))
        release = getattr(pool, "release", None)
        if release is not None:
            try:
                release()
            except Exception as e:  # noqa: BLE001 - the other pools must be given back all the same
                errors.append(e)
    return errors


def _same_memory(a: Any, b: Any) -> bool:
    """Whether tensor ``a`` is ``b``'s memory in ``b``'s layout (then there is nothing to copy:
    the previous layer's static output, or the next layer's static input gradient, as the
    capture chained them)."""
    return bool(a.data_ptr() == b.data_ptr() and a.stride() == b.stride())


_FN: Any = None


def _replay_fn() -> Any:
    """The autograd Function that replays a (layer, slot)'s graphs (built on first use)."""
    global _FN
    if _FN is not None:
        return _FN
    import torch

    class _Replay(torch.autograd.Function):  # type: ignore[misc, unused-ignore]
        @staticmethod
        def forward(  # type: ignore[override, unused-ignore]
            ctx: Any, call: _GraphedCall, anchor: Any, *inputs: Any
        ) -> Any:
            lay, s = call.lay, call.slot
            for src, dst in zip(inputs, lay.static_in[s]):
                if not _same_memory(src, dst):
                    dst.copy_(src)
            lay.fwd[s].replay()
            ctx.call = call
            outs = tuple(o.detach() for o in lay.static_out[s])
            # as in eager mode, what did not require grad at capture does not now (without
            # this every float output would, since the anchor does)
            ctx.mark_non_differentiable(*(o for o, r in zip(outs, lay.out_requires_grad) if not r))
            return outs

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override, unused-ignore]
            call: _GraphedCall = ctx.call
            lay, s = call.lay, call.slot
            for g, dst in zip(
                (g for g, r in zip(grads, lay.out_requires_grad) if r), lay.static_gout[s]
            ):
                if g is None:
                    dst.zero_()
                elif not _same_memory(g, dst):
                    dst.copy_(g)
            for p, buf in zip(lay.params, lay.grad_bufs):
                g = p.grad
                if g is not buf:  # optimizer.zero_grad(set_to_none=True), or a new .grad
                    if g is None:
                        buf.zero_()
                    else:
                        buf.copy_(g)
                    p.grad = buf
            lay.bwd[s].replay()
            gin = lay.static_gin[s]
            if lay.first:
                # the chunk's input gradient leaves the pool: the caller may keep it
                gin = tuple(None if g is None else g.clone() for g in gin)
                call.owner._owner[lay.chunk][s] = None
            return (None, None) + tuple(gin)

    _FN = _Replay
    return _FN


# ------------------------------------------------------------------------------- capture


def make_graphed_callables(
    callables: Sequence[Any],
    sample_args: Sequence[Any],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
    *,
    schedule: Schedule,
    budget: int | str | None = None,
    pools: str = "auto",
    client: Any = None,
    plan: bool = True,
    progress_every_s: float = 2.0,
    expandable_segments: bool | None = None,
    arena: bool = True,
    overhead: dict[str, int] | None = None,
    _unsafe_single_pool: bool = False,
) -> GraphedSchedule:
    """Capture ``callables`` (the layers of this pipeline rank) for a pipeline schedule.

    Args:
        callables: the layers, in forward order: a flat sequence (split evenly into
            ``schedule.virtual_chunks`` chunks), or one sequence per chunk. Layer ``l``'s outputs
            are layer ``l + 1``'s positional inputs (a tensor or a tuple of tensors). The
            module's documentation lists the kinds of layers supported and refused.
        sample_args: inputs of the first layer of each chunk (a tuple per chunk), or, as with
            ``torch.cuda.make_graphed_callables``, a tuple per layer (only each chunk's first
            is used; later layers' inputs are the earlier layers' static outputs).
        num_warmup_iters: eager forward+backward iterations per chunk before capture (at
            least 2). Buffers the forwards update in place are put back afterwards; random ops
            draw from the CUDA generator.
        allow_unused_input: as in torch: parameters or inputs that require grad may be used by
            no output; their gradients stay zero.
        pool: not supported (pools are made per lifetime class); must be ``None``.
        schedule: the pipeline schedule this rank runs.
        budget: most bytes the capture may take (``"40GiB"`` or bytes); checked before capture.
        pools: ``"graphpool"`` (daemon-backed ``graphpool.torch.MemPool``; raises what keeps
            them from being made), ``"torch"`` (plain ``torch.cuda.MemPool``), or ``"auto"``
            (graphpool when the native shim is installed and a daemon is reachable, else torch;
            a daemon's refusal, such as ``PermissionDenied`` or ``CapacityExceeded``, is
            raised, not bypassed).
        client: a ``graphpool.Client`` (or ``graphpool.Session``) for the plan and the pools
            (default: none / the pool's): the pools use its socket, and the plan is made and
            reserved for the daemon session of the pools, which is the one charged for the
            capture; with ``torch`` pools only a ``Session`` can be planned for.
        plan: ask the daemon for a plan before capture (when a client is given); its
            ``CapacityExceeded`` stops the capture before any segment is taken.
        progress_every_s: log capture progress at most this often.
        expandable_segments: create the pools' segments as torch's expandable segments (the
            allocator setting is switched on for the capture only, then switched off): one
            growing mapping per pool instead of 20 MiB segments, so a pool wastes less than a
            segment page of its reserve. ``None`` (default): on for plain ``torch.cuda.MemPool``
            pools (the GPU poison test passes with it on 1F1B, interleaved and explicit
            schedules), off for daemon-backed pools, to which torch does not apply it (their
            segments come from the pluggable allocator; ``arena`` removes the rounding there).
        arena: before capture, give each pool one segment sized from the warm-up profile (its
            slot's large static and saved tensors plus the largest workspace), so that capture
            splits tensors out of it instead of rounding each 1-10 MiB tensor into a 20 MiB
            segment; what does not fit takes ordinary segments. Not used with
            ``expandable_segments``, which removes the same rounding another way.
        overhead: what an earlier capture of the same model cost beyond its planned buffers
            (:meth:`GraphedSchedule.capture_overhead`); counted in the prediction that is
            checked against ``budget``, free memory and the daemon's plan before capture.
        _unsafe_single_pool: for tests and benchmarks only: put every graph in one pool, which
            breaks the lifetime split and lets slot reuse corrupt results (the failure this
            module exists to prevent). Never use it for training.

    Returns:
        A :class:`GraphedSchedule`.

    Raises:
        graphpool.CapacityExceeded: the capture would not fit (budget, daemon plan, free memory),
            or the daemon refused one of the pools' segments during capture. On any failure
            the graphs captured so far are destroyed and the pools given back.
        graphpool.InvalidArgument: ``pools`` is not one of its values, or a sample is not a
            tensor on a CUDA device (``field="sample_args"``).
        UnsupportedLayer: a layer capture cannot graph correctly (an ``InvalidArgument``,
            ``field="callables"``): see the module's documentation for what is supported. The
            message names the layer and says what to change.
        graphpool.DaemonUnavailable: ``pools="graphpool"`` and no daemon answers.

    Parameter gradients are accumulated inside the backward graphs into ``param.grad`` (allocated
    here when ``None``). ``optimizer.zero_grad(set_to_none=True)`` is fine: the next backward
    re-installs and zeroes the buffer.
    """
    import torch

    from .units import parse_size

    if pools not in POOL_KINDS:
        raise InvalidArgument(
            f"pools must be one of {', '.join(repr(k) for k in POOL_KINDS)}, not {pools!r}", field="pools"
        )
    if pool is not None:
        raise ValueError("pool=: schedule-aware capture makes its own pools, one per lifetime class")
    budget_bytes = parse_size(budget) if budget is not None else None
    amp = _autocast_dtype()
    v = schedule.virtual_chunks
    chunks = _split_chunks(callables, v)
    samples = _chunk_samples(sample_args, chunks)
    # what can be refused without running anything, before any CUDA call
    _check_samples(samples)
    _check_modules(chunks)
    device = torch.cuda.current_device()
    stats = CaptureStats(
        slots_per_chunk=schedule.slots_per_chunk,
        autocast=None if amp is None else str(amp).replace("torch.", ""),
    )
    layers = [
        [_Layer(c, i, mod, schedule.slots_per_chunk[c], i == 0, i == len(ch) - 1) for i, mod in enumerate(ch)]
        for c, ch in enumerate(chunks)
    ]
    torch.cuda.synchronize()
    stats.device = device
    stats.free_at_start = torch.cuda.mem_get_info(device)[0]
    reserved0 = stats.reserved_at_start = torch.cuda.memory_reserved(device)
    stream = torch.cuda.Stream()

    # 1. warm up each chunk eagerly on the capture stream; profile what each layer keeps
    t0 = time.perf_counter()
    torch.cuda.synchronize()
    buffers = _snapshot_buffers(layers)  # what the warm-up's forwards change, put back after
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), _uncached_autocast(amp):
        try:
            for c, ch in enumerate(layers):
                # profiled on the last iteration (at least the second: the first on a new stream
                # also allocates library workspaces that are not the layer's)
                iters = max(2, num_warmup_iters)
                for it in range(iters):
                    profile = it == iters - 1
                    bound = [_layer_buffers(lay) for lay in ch] if profile else []
                    profs = _warm_chunk(ch, samples[c], allow_unused_input, profile=profile, device=device)
                    for lay, before in zip(ch, bound):
                        _check_buffers_kept(lay, before)
                    if profile:
                        stats.profiles.extend(profs)
        finally:
            _restore_buffers(buffers)
            stream.synchronize()  # the copies read the snapshot, freed on the way out
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    del buffers
    # the profile's saved-tensor hooks return the tensor itself, so an output saved by its own
    # node is a reference cycle: collect it before giving the warm-up's memory back
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    stats.warmup_seconds = time.perf_counter() - t0
    stats.warmup_retained_bytes = max(0, torch.cuda.memory_reserved(device) - reserved0)
    stats.warmup_outside_bytes = _outside(stats.free_at_start, reserved0, device)

    # 2. plan and capacity check, before any capture
    stats.predicted_bytes = _predict(schedule, stats.profiles)
    if overhead is not None:
        graphs = 2 * sum(len(ch) * n for ch, n in zip(layers, schedule.slots_per_chunk))
        stats.predicted_bytes += overhead_bytes(overhead, graphs, sum(schedule.slots_per_chunk) + 1)
    _check_capacity(stats.predicted_bytes, budget_bytes, device)

    # 3. parameter gradient buffers, outside every pool
    for ch in layers:
        for lay in ch:
            bufs = []
            for p in lay.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                bufs.append(p.grad)
            lay.grad_bufs = tuple(bufs)
            lay.anchor = torch.zeros((), device=torch.device("cuda", device), requires_grad=True)

    # 4. pools: one per (chunk, slot) for forwards, one for every backward
    factory = None
    if pools in ("auto", "graphpool"):
        factory = _daemon_pool_factory(device, budget_bytes, client, required=pools == "graphpool")
    if factory is None:
        stats.pool_kind = "torch"

        def factory(label: str) -> Any:  # noqa: ARG001
            return torch.cuda.MemPool()
    else:
        stats.pool_kind = "graphpool"
    if expandable_segments is None:
        expandable_segments = stats.pool_kind == "torch"
    elif expandable_segments and stats.pool_kind == "graphpool":
        log.warning("expandable_segments does not apply to daemon-backed pools; ignored")
        expandable_segments = False
    # Every pool made from here on: given back at once if the capture fails (for daemon-backed
    # pools, their segments), not whenever the exception and its frames are collected.
    created: list[Any] = []
    make_pool = factory

    def recorded(label: str) -> Any:
        pool = make_pool(label)
        created.append(pool)
        return pool

    new_pool: Callable[[str], Any] = recorded

    settings: Any = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None
    )
    if expandable_segments and settings is None:
        raise RuntimeError("expandable_segments: this torch cannot switch allocator settings")
    # A segment the daemon refuses surfaces in torch as OutOfMemoryError: raise the daemon's
    # CapacityExceeded (what was asked, what is free, which limit, who holds it) instead.
    if stats.pool_kind == "graphpool":
        from .torch import translate_errors

        refusals: contextlib.AbstractContextManager[Any] = translate_errors()
    else:
        refusals = contextlib.nullcontext()
    try:
        with refusals:
            if _unsafe_single_pool:
                log.warning("_unsafe_single_pool: every graph in one pool; results may be wrong")
                shared = new_pool("all")
                new_pool = lambda label: shared  # noqa: E731
            pool_list: list[tuple[str, Any]] = []
            fwd_pools = []
            for c, n in enumerate(schedule.slots_per_chunk):
                row = []
                for s in range(n):
                    p = new_pool(f"fwd/c{c}/s{s}")
                    pool_list.append((f"fwd/c{c}/s{s}", p))
                    row.append(p)
                fwd_pools.append(row)
            bwd_pool = new_pool("bwd")
            pool_list.append(("bwd", bwd_pool))
            stats.num_pools = len({id(p) for _, p in pool_list})
            if plan and client is not None:
                # Planned (and reserved) for the session that allocates the capture's memory:
                # the daemon session of the pools, once they opened it.
                stats.plan = _plan_for_pools(schedule, stats, budget_bytes, client, device, overhead)
            if arena and not expandable_segments and not _unsafe_single_pool:
                sizes = _arena_sizes(schedule, stats.profiles)
                torch.cuda.synchronize()
                for label, p in pool_list:
                    n = sizes.get(label, 0)
                    if n > 20 << 20:
                        _give_arena(p, n, stream, device)
                        stats.arena_bytes[label] = n
                torch.cuda.synchronize()

            if expandable_segments:
                settings("expandable_segments:True")
            try:
                with _uncached_autocast(amp):
                    _capture_all(schedule, layers, samples, fwd_pools, bwd_pool, pool_list, stats,
                                 stream, allow_unused_input, progress_every_s, device, reserved0)
            finally:
                if expandable_segments:
                    settings("expandable_segments:False")
    except BaseException as e:
        _discard_capture(layers, created, e)
        raise
    gs = GraphedSchedule(schedule, layers, pool_list, stats)
    stats.reserved_outside_pools = max(
        0, torch.cuda.memory_reserved(device) - reserved0 - sum(gs.pool_reserved().values())
    )
    return gs


def _plan_for_pools(
    schedule: Schedule, stats: CaptureStats, budget: int | None, client: Any, device: int,
    overhead: dict[str, int] | None,
) -> Any:
    """The daemon's plan of the capture, for the session whose segments will hold it: the
    pools' session (daemon-backed pools), else the ``graphpool.Session`` given as ``client``."""
    session_id = None
    if stats.pool_kind == "graphpool":
        from . import _shim

        info = _shim.session_info(device)
        session_id = info[0] if info else None
    if session_id is None and _session_client(client) is None:
        log.warning(
            "plan: the capture's %s pools have no daemon session to plan for; pass a "
            "graphpool.Session as client to plan them", stats.pool_kind,
        )
        return None
    return request_plan(
        schedule, stats.profiles, budget=budget, client=client, device=device, overhead=overhead,
        session_id=session_id,
    )


def _discard_capture(layers: list[list[_Layer]], pools: list[Any], exc: BaseException) -> None:
    """After a failed capture: destroys the graphs captured so far and the static buffers they
    left in the pools, then gives the pools back (``release()``: a daemon-backed pool's
    segments go back to the daemon, and its session ends with the last pool)."""
    import gc
    import traceback

    import torch

    # The frames of the calls that failed hold tensors allocated from the pools: drop their
    # locals, or those blocks (and the segments under them) live as long as the exception.
    seen_errors: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen_errors:
        seen_errors.add(id(err))
        if err.__traceback__ is not None:
            traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the failure may have been the device's
        pass
    for ch in layers:
        for lay in ch:
            for graphs in (lay.fwd, lay.bwd):
                for i, g in enumerate(graphs):
                    if g is not None:
                        try:
                            g.reset()
                        except Exception:  # noqa: BLE001
                            pass
                        graphs[i] = None
            lay.static_in = lay.static_out = lay.static_gin = lay.static_gout = []
    gc.collect()
    # The capture's own error is the one raised.
    for e in _release_pools(pools):
        log.warning("releasing a pool after a failed capture: %s", e)
    pools.clear()
    gc.collect()
    try:
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def _capture_all(
    schedule: Schedule, layers: list[list[_Layer]], samples: list[tuple[Any, ...]],
    fwd_pools: list[list[Any]], bwd_pool: Any, pool_list: list[tuple[str, Any]],
    stats: CaptureStats, stream: Any, allow_unused_input: bool, progress_every_s: float,
    device: int, reserved0: int,
) -> None:
    import torch

    # 5. capture in schedule order: the first step that uses each (kind, chunk, slot)
    total = 2 * sum(len(ch) * n for ch, n in zip(layers, schedule.slots_per_chunk))
    log.info(
        "capturing %d graphs for %s (%d pools, %s)", total, schedule.describe(), len(pool_list),
        stats.pool_kind,
    )
    t0 = time.perf_counter()
    last_log = t0
    done = 0
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(device)[0]
    reserved_before = torch.cuda.memory_reserved(device)
    first_outside = 0
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in schedule.first_use_steps():
            ch = layers[step.chunk]
            s = step.slot
            if step.kind == "F":
                x: tuple[Any, ...] | None = None
                for lay in ch:
                    x = _capture_forward(lay, s, x, samples[step.chunk], _pool_id(fwd_pools[step.chunk][s]), stream)
                    done += 1
                    if done == 1:
                        first_outside = _outside(free_before, reserved_before, device)
            else:
                gout: tuple[Any, ...] | None = None
                for lay in reversed(ch):
                    gout = _capture_backward(lay, s, gout, _pool_id(bwd_pool), stream, allow_unused_input)
                    done += 1
            now = time.perf_counter()
            if now - last_log >= progress_every_s:
                last_log = now
                log.info(
                    "captured %d/%d graphs, %.2f GiB reserved", done, total,
                    (torch.cuda.memory_reserved(device) - reserved0) / _GiB,
                )
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    stats.capture_seconds = time.perf_counter() - t0
    stats.graphs = done
    stats.reserved_bytes = torch.cuda.memory_reserved(device) - reserved0
    stats.graph_object_bytes = _outside(free_before, reserved_before, device)
    stats.graph_first_bytes = first_outside
    if done > 1:
        stats.graph_bytes_per_graph = max(0, stats.graph_object_bytes - first_outside) // (done - 1)
    log.info(
        "captured %d graphs in %.2f s, %.2f GiB reserved (predicted %.2f GiB)", done,
        stats.capture_seconds, stats.reserved_bytes / _GiB, stats.predicted_bytes / _GiB,
    )


def _outside(free_before: int, reserved_before: int, device: int) -> int:
    """Device memory taken since ``free_before`` beyond the allocator's reserve growth."""
    import torch

    took = free_before - torch.cuda.mem_get_info(device)[0]
    return max(0, int(took - (torch.cuda.memory_reserved(device) - reserved_before)))


_LARGE = 1 << 20  # the caching allocator's small/large block boundary


def _round512(n: int) -> int:
    return (n + 511) // 512 * 512


def _warm_chunk(
    ch: list[_Layer], sample: tuple[Any, ...], allow_unused: bool, profile: bool, device: int = 0
) -> list[LayerProfile]:
    """One eager forward+backward of a chunk, layer by layer; with ``profile``, what each layer
    keeps for its backward (saved-tensor hooks) and its peak temporaries (the allocator's peak
    counter, reset around each forward and backward: this resets the process's peak memory
    statistics)."""
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
        seeded: Any = _random_op_watch(device) if profile else contextlib.nullcontext()
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


def _random_op_watch(device: int) -> Any:
    """A context that records, in its ``ops``, the names of the ops that drew from ``device``'s
    CUDA generator while it was entered, in autograd's backward threads too: ops tagged
    ``nondeterministic_seeded`` that moved the generator's offset. Not the ones that carry the
    tag but draw nothing, such as the attention backward kernels, which replay their forward's
    dropout from the seed and offset it saved, or dropout with probability 0."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    # A torch without the tag or the offset cannot tell: nothing is refused.
    seeded = getattr(getattr(torch, "Tag", None), "nondeterministic_seeded", None)
    offset = getattr(torch.cuda.default_generators[device], "get_offset", None)
    if seeded is None:
        offset = None

    def read() -> Any:
        try:
            return offset() if offset is not None else None
        except RuntimeError:
            return None

    class Watch(TorchDispatchMode):  # type: ignore[misc, unused-ignore]
        def __init__(self) -> None:
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            # (higher-order operators carry no tags)
            if offset is None or seeded not in getattr(func, "tags", ()):
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


def _layer_buffers(lay: _Layer) -> list[tuple[str, Any]]:
    """The buffers of a layer's module by qualified name (none for a plain function)."""
    named = getattr(lay.module, "named_buffers", None)
    return list(named()) if callable(named) else []


def _snapshot_buffers(layers: list[list[_Layer]]) -> list[tuple[Any, Any]]:
    """``(buffer, copy of its value)`` of every buffer of the layers, each tensor once: what
    :func:`_restore_buffers` puts back after the warm-up."""
    import torch

    seen: set[int] = set()
    out = []
    with torch.no_grad():
        for ch in layers:
            for lay in ch:
                for _, t in _layer_buffers(lay):
                    if id(t) not in seen:
                        seen.add(id(t))
                        out.append((t, t.clone()))
    return out


def _restore_buffers(snapshot: list[tuple[Any, Any]]) -> None:
    """Undoes what the warm-up's forwards did to buffers updated in place (``BatchNorm``'s
    running statistics and batch count), so that capture leaves them as it found them and
    the replays update them as eager execution would."""
    import torch

    with torch.no_grad():
        for t, value in snapshot:
            t.copy_(value)


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


def _predict(schedule: Schedule, profiles: Sequence[LayerProfile]) -> int:
    """Bytes the capture keeps: per slot, the chunk's input, outputs, saved tensors and the
    largest forward workspace; plus the backward pool (the largest backward workspace and two
    gradient buffers of a layer's output: the one read and the one written)."""
    total = 0
    for c, n in enumerate(schedule.slots_per_chunk):
        per_slot = 0
        fws = 0
        for p in profiles:
            if p.chunk == c:
                per_slot += p.output_bytes + p.saved_bytes + (p.input_bytes if p.layer == 0 else 0)
                fws = max(fws, p.forward_workspace_bytes)
        total += n * (per_slot + fws)
    total += _backward_pool_bytes(profiles)
    return total


def _backward_pool_bytes(profiles: Sequence[LayerProfile]) -> int:
    if not profiles:
        return 0
    return max(p.backward_workspace_bytes + 2 * p.output_bytes for p in profiles)


def _arena_sizes(schedule: Schedule, profiles: Sequence[LayerProfile]) -> dict[str, int]:
    """The one segment to give each pool before capture, from the warm-up profile: a forward
    pool gets its slot's large tensors (static input, outputs, saved) plus the largest forward
    workspace; the backward pool its largest workspace plus two output gradients. 2 MiB
    multiples (the segment granularity). Tensors of 1 MiB or less go to the allocator's small
    blocks and are not counted."""
    g = 2 << 20
    out: dict[str, int] = {}
    for c, n in enumerate(schedule.slots_per_chunk):
        kept = 0
        fws = 0
        for p in profiles:
            if p.chunk == c:
                kept += p.large_kept_bytes
                if p.layer == 0 and p.input_bytes > _LARGE:
                    kept += _round512(p.input_bytes)
                fws = max(fws, p.forward_workspace_bytes)
        size = (kept + fws) // g * g  # rounded down: a short arena costs one more segment,
        for s in range(n):            # an oversized one stays unused
            out[f"fwd/c{c}/s{s}"] = size
    out["bwd"] = _backward_pool_bytes(profiles) // g * g
    return out


def _give_arena(pool: Any, nbytes: int, stream: Any, device: int) -> None:
    """Makes the caching allocator take one segment of ``nbytes`` for ``pool`` (on the capture
    stream, whose blocks capture allocations may use) and leaves it free in the pool: capture
    then splits its large tensors out of it instead of rounding each 1-10 MiB tensor into a
    20 MiB segment of its own."""
    import torch

    if nbytes <= 20 << 20:
        return
    tp = getattr(pool, "torch_pool", pool)
    with torch.cuda.stream(stream), torch.cuda.use_mem_pool(tp, device=device):
        t = torch.empty((nbytes,), dtype=torch.uint8, device=torch.device("cuda", device))
        del t


def _capture_forward(
    lay: _Layer, s: int, x: tuple[Any, ...] | None, sample: tuple[Any, ...], pool_id: Any, stream: Any
) -> tuple[Any, ...]:
    """Captures the forward graph of (layer, slot) ``s`` on its input ``x`` (the previous
    layer's static outputs; for a chunk's first layer a new static input like ``sample``).
    Returns the layer's outputs, detached, as the next layer's static inputs: the same
    memory, so that nothing is copied between the layers of a chunk."""
    import torch

    g = torch.cuda.CUDAGraph()
    with _capturing(g, pool_id, lay, "forward"):
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
    lay: _Layer, s: int, gout: tuple[Any, ...] | None, pool_id: Any, stream: Any, allow_unused: bool
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
    g = torch.cuda.CUDAGraph()
    with _capturing(g, pool_id, lay, "backward"):
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


@contextlib.contextmanager
def _capturing(g: Any, pool_id: Any, lay: _Layer, kind: str) -> Any:
    """Begins capturing ``g`` into the pool ``pool_id`` for the body (not ending it: the caller
    does, once it knows whether the graph is empty). A body that fails abandons the capture;
    its error is raised as :class:`UnsupportedLayer` where it is work a graph cannot replay
    (:func:`_capture_refusal`; ``kind``: ``"forward"`` or ``"backward"``), as it is otherwise."""
    g.capture_begin(pool=pool_id)
    try:
        yield
    except BaseException as e:
        _abandon_capture(g, pool_id)
        refusal = _capture_refusal(lay, kind, e)
        if refusal is None:
            raise
        raise refusal from e


def _abandon_capture(g: Any, pool_id: Any) -> None:
    """Ends a capture whose body failed; the body's error is the one that matters.

    Ending a capture that a forbidden call invalidated fails too, and it fails before torch
    stops sending the capture stream's allocations to ``pool_id``: that is stopped here, or
    torch's allocator would count the capture as still underway for the rest of the process
    (every later ``torch.cuda.empty_cache()`` failing its assertion that none is, a pool's
    destruction among them, and the pool refused to later captures). The reference the
    capture took on the pool, which only a capture that ended gives back, is given back too.
    Last, the device's random number generator is taken out of capture mode (see
    :func:`_end_generator_capture`).
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
        _end_generator_capture()


def _end_generator_capture() -> None:
    """Takes the current device's CUDA random number generator out of capture mode.

    A capture that fails to end leaves the generator's state marked as capturing (only a
    capture that ends clears the mark), and every later random op outside a capture, eager
    dropout or ``torch.randn`` included, then fails with "Offset increment outside graph
    capture encountered unexpectedly". An empty capture that ends clears it; the generator's
    seed and offset are untouched (an empty graph draws no numbers).
    """
    import warnings

    import torch

    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with torch.cuda.stream(torch.cuda.Stream()):
            g = torch.cuda.CUDAGraph()
            g.capture_begin()
            g.capture_end()
        del g


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
    CUDA graph cannot replay (host synchronization, data-dependent shapes), or None for any
    other failure (out of memory, a refused segment, an error of the layer itself), which is
    raised as it is."""
    if not isinstance(e, RuntimeError) or "out of memory" in str(e).lower():
        return None
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if not any(p in text.lower() for p in _HOST_WORK_IN_CAPTURE):
        return None
    return UnsupportedLayer(
        lay.chunk, lay.index, lay.module,
        f"its {kind} cannot be captured in a CUDA graph ({text}); a graph replays kernels "
        f"only, so the layer must not synchronize with the host: no .item(), .cpu(), .tolist() "
        f"or Python branching on tensor values, no ops whose output shape depends on values "
        f"(nonzero, boolean-mask indexing, unique); move that work out of the graphed layers",
    )
