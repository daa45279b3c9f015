"""The captured schedule at run time: one callable per (layer, microbatch) that replays its
slot's graphs."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .._fork import park
from ..errors import FailedPrecondition
from ..schedule import _index
from .memory import _outside, _pool_id, _release_pools, _same_memory, _storage_at
from .modes import _autocast_dtype, _autocast_name, _mode_changed
from .refusals import _check_chained, _check_inputs

if TYPE_CHECKING:  # pragma: no cover
    from ..schedule import Schedule
    from .layers import _Layer
    from .planning import LayerProfile

log = logging.getLogger("graphpool.capture")


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

    The layers of a chunk are captured as a chain: a later layer's static input is the previous
    layer's static output, the same memory. So ``graphed[l, m]`` for a layer that is not its
    chunk's first must be called with the outputs of ``graphed[l - 1, m]`` exactly as they were
    returned; anything else (a copy, a transposed view, ``norm(h)``) would be copied over the previous
    layer's output and is refused with ``graphpool.InvalidArgument`` (``field="args"``) before
    anything runs. Work between two layers belongs inside a layer. A chunk's first layer
    copies whatever it is given into its slot's static input.

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
            _check_chained(lay, s, self.mb, args)
        out = _replay_fn().apply(self, lay.anchor, *args)
        return out[0] if lay.single_output else out


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
            # Only a chunk's first layer copies: a later layer's inputs are its static inputs
            # (the previous layer's static outputs), as _check_chained made sure.
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
