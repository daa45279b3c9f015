"""make_graphed_callables: profile, plan, warm up and capture every layer of a schedule."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from ..errors import InvalidArgument
from .layers import (
    _Layer,
    _chunk_samples,
    _layer_buffers,
    _restore_buffers,
    _snapshot_buffers,
    _split_chunks,
)
from .memory import (
    POOL_KINDS,
    _daemon_pool_factory,
    _give_arena,
    _outside,
    _pool_id,
    _release_pools,
)
from .modes import _autocast_dtype, _uncached_autocast
from .planning import _GiB, _arena_sizes, _check_capacity, _plan_for_pools, _predict, overhead_bytes
from .record import _capture_backward, _capture_forward, _warm_chunk
from .refusals import _check_buffers_kept, _check_modules, _check_rng_generators, _check_samples
from .replay import CaptureStats, GraphedSchedule

if TYPE_CHECKING:  # pragma: no cover
    from ..schedule import Schedule

log = logging.getLogger("graphpool.capture")


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
    rng_generators: Iterable[Any] = (),
    _unsafe_single_pool: bool = False,
) -> GraphedSchedule:
    """Capture ``callables`` (the layers of this pipeline rank) for a pipeline schedule.

    Args:
        callables: the layers, in forward order: a flat sequence (split evenly into
            ``schedule.virtual_chunks`` chunks), or one sequence per chunk. Layer ``l``'s outputs
            are layer ``l + 1``'s positional inputs (a tensor or a tuple of tensors). The
            module's documentation lists the kinds of layers supported and refused.

            The layers of a chunk are captured as a chain: layer ``l + 1``'s static input is
            layer ``l``'s static output, the same memory, so nothing is copied between them. At
            run time, ``graphed[l + 1, m]`` must therefore be called with the outputs of
            ``graphed[l, m]`` exactly as they were returned: a copy, a view in another layout or
            the result of an op on them (``g[l + 1, m](norm(h)) + h``) would be copied over
            layer ``l``'s output, which the caller may still hold and layer ``l``'s backward may
            read, and is refused with ``graphpool.InvalidArgument`` (``field="args"``) before
            anything runs. Work between two layers (a norm, a residual add) belongs inside a
            layer: wrap it with the layer in one module, or capture the layers after it as a
            chunk of their own or in another capture. A chunk's first layer takes any input of
            the captured shapes and dtypes (it is copied into the slot's static input).
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
        rng_generators: CUDA generators the layers draw random numbers from besides the
            device's default one: those an RNG state tracker swaps in around dropout
            (TransformerEngine's and Megatron-LM's graph-safe trackers; with them,
            ``get_all_rng_states().values()``), or ones passed to random ops. Every graph is
            registered with each, so that each replay draws from its current offset and moves
            it on, as eager execution would; the warm-up's watch for backwards that draw
            random numbers reads them too. A layer that draws from a generator not listed is
            refused naming the layer.
        _unsafe_single_pool: for tests and benchmarks only: put every graph in one pool, which
            breaks the lifetime split and lets slot reuse corrupt results (the failure this
            module exists to prevent). Never use it for training.

    Returns:
        A :class:`GraphedSchedule`.

    Raises:
        graphpool.CapacityExceeded: the capture would not fit (budget, daemon plan, free memory),
            or the daemon refused one of the pools' segments during capture. On any failure
            the graphs captured so far are destroyed and the pools given back.
        graphpool.InvalidArgument: ``pools`` is not one of its values, a sample is not a
            tensor on a CUDA device (``field="sample_args"``), or an entry of
            ``rng_generators`` is not a ``torch.Generator`` of the capture's device
            (``field="rng_generators"``).
        UnsupportedLayer: a layer capture cannot graph correctly (an ``InvalidArgument``,
            ``field="callables"``): see the module's documentation for what is supported. The
            message names the layer and says what to change.
        graphpool.DaemonUnavailable: ``pools="graphpool"`` and no daemon answers.

    Parameter gradients are accumulated inside the backward graphs into ``param.grad`` (allocated
    here when ``None``). ``optimizer.zero_grad(set_to_none=True)`` is fine: the next backward
    re-installs and zeroes the buffer.
    """
    import torch

    from ..units import parse_size

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
    generators = _check_rng_generators(rng_generators, device)
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
                    profs = _warm_chunk(
                        ch, samples[c], allow_unused_input, profile=profile, device=device,
                        generators=generators,
                    )
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
        from ..torch import translate_errors

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
                                 stream, allow_unused_input, progress_every_s, device, reserved0,
                                 generators)
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
    device: int, reserved0: int, generators: tuple[Any, ...],
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
                    x = _capture_forward(
                        lay, s, x, samples[step.chunk], _pool_id(fwd_pools[step.chunk][s]), generators
                    )
                    done += 1
                    if done == 1:
                        first_outside = _outside(free_before, reserved_before, device)
            else:
                gout: tuple[Any, ...] | None = None
                for lay in reversed(ch):
                    gout = _capture_backward(lay, s, gout, _pool_id(bwd_pool), allow_unused_input, generators)
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
