"""From layer profiles to the daemon's plan: predicted bytes, capacity checks, arena sizes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from .memory import _LARGE, _round512, _session_client

if TYPE_CHECKING:  # pragma: no cover
    from ..schedule import Schedule
    from .replay import CaptureStats

log = logging.getLogger("graphpool.capture")


_GiB = float(1 << 30)


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


def _plan_for_pools(
    schedule: Schedule, stats: CaptureStats, budget: int | None, client: Any, device: int,
    overhead: dict[str, int] | None,
) -> Any:
    """The daemon's plan of the capture, for the session whose segments will hold it: the
    pools' session (daemon-backed pools), else the ``graphpool.Session`` given as ``client``."""
    session_id = None
    if stats.pool_kind == "graphpool":
        from .. import _shim

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
