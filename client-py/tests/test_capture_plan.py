"""The daemon's plan of a capture with a measured capture overhead (no torch needed: the layer
profiles are written by hand, as a profile recorded elsewhere would be)."""

from __future__ import annotations

from typing import Any

import pytest

import graphpool
from graphpool.capture import (
    LayerProfile,
    OVERHEAD_KEYS,
    capture_plan_input,
    overhead_bytes,
    plan_description,
    request_plan,
)
from graphpool.schedule import Schedule

MiB = 1 << 20


def _profiles(layers: int) -> list[LayerProfile]:
    hidden = 2048 * 1024 * 2  # [2048, 1, 1024] bf16
    return [
        LayerProfile(
            chunk=0,
            layer=layer,
            input_bytes=hidden,
            output_bytes=hidden,
            saved_bytes=6 * hidden,
            forward_workspace_bytes=2 * hidden,
            backward_workspace_bytes=4 * hidden,
            input_shapes=[([2048, 1, 1024], "bfloat16", True)],
            output_shapes=[([2048, 1, 1024], "bfloat16")],
        )
        for layer in range(layers)
    ]


OVERHEAD = {
    "fixed_bytes": 136 * MiB,
    "per_graph_bytes": 172 * 1024,
    "per_pool_bytes": 4 * MiB,
    "backward_pool_extra_bytes": 126 * MiB,
}


def test_overhead_is_added_to_the_daemon_plan(daemon: object, client: graphpool.Client, job_id: str) -> None:
    schedule = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=16)
    with client.attach(job_id, rank=0) as s:
        bare = request_plan(schedule, _profiles(3), budget=None, client=s, reserve=False).plan
        full = request_plan(schedule, _profiles(3), budget=None, client=s, reserve=False, overhead=OVERHEAD).plan
    # 4 slots: 4 forward pools + 1 backward pool; 4 slots x 3 layers x 2 graphs
    assert (full.graphs, full.pools) == (24, 5)
    assert bare.overhead_bytes == 0 and bare.predicted_capture_bytes == bare.footprint_bytes
    assert full.overhead_bytes == overhead_bytes(OVERHEAD, graphs=24, pools=5)
    assert full.overhead_bytes == 136 * MiB + 24 * 172 * 1024 + 5 * 4 * MiB + 126 * MiB
    assert full.predicted_capture_bytes == full.footprint_bytes + full.overhead_bytes
    assert full.footprint_bytes == bare.footprint_bytes
    # the overhead does not grow with the number of microbatches (slots stay at 4)
    more = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=64)
    with client.attach(job_id, rank=0) as s:
        plan64 = request_plan(more, _profiles(3), budget=None, client=s, reserve=False, overhead=OVERHEAD).plan
    assert plan64.overhead_bytes == full.overhead_bytes


def test_bad_overhead_is_refused_with_the_key_named() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        overhead_bytes({"fixed": 1}, 1, 1)
    with pytest.raises(ValueError, match="per_pool_bytes"):
        overhead_bytes({"per_pool_bytes": -1}, 1, 1)
    assert set(OVERHEAD) == set(OVERHEAD_KEYS)
    # plan_description checks it as the daemon plan does, instead of writing it to the file
    schedule = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=16)
    with pytest.raises(ValueError, match="unknown keys"):
        plan_description(schedule, _profiles(2), {"fixed": 1})
    with pytest.raises(ValueError, match="fixed_bytes"):
        plan_description(schedule, _profiles(2), {"fixed_bytes": 1.5})  # type: ignore[dict-item]


def test_description_carries_the_overhead() -> None:
    schedule = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=16)
    assert "overhead" not in plan_description(schedule, _profiles(2))
    desc = plan_description(schedule, _profiles(2), OVERHEAD)
    assert desc["overhead"] == OVERHEAD
    assert [layer["layer"] for layer in desc["layers"]] == [0, 1]


def test_a_long_plan_outlives_the_client_timeout(daemon: object, job_id: str) -> None:
    """A schedule whose plan stays above its lower bound is searched for the whole time
    budget; the call waits for it beyond the client's own timeout instead of failing."""
    from graphpool._proto.graphpool.v1 import plan_pb2

    def tensor(name: str, shape: list[int], dtype: str, kept: bool = False) -> Any:
        return plan_pb2.TensorSpec(name=name, shape=shape, dtype=dtype, kept_for_backward=kept)

    # Six layers, attention with 32 MiB workspaces (4 hidden states saved) alternating with
    # MLP (8 saved), 2 MiB hidden states, four slots: the plan stays 0.5% above its bound
    # through the budget (a release build on 2 cores needs ~6 s of search to reach it).
    hidden = [1024, 1, 1024]
    hidden_bytes = 2 * MiB
    layers = [
        plan_pb2.LayerSpec(
            chunk=0,
            layer=layer,
            inputs=[tensor("hidden", hidden, "bf16", True)],
            outputs=[tensor("hidden", hidden, "bf16")],
            saved_bytes=(4 if layer % 2 == 0 else 8) * hidden_bytes,
            forward_workspace_bytes=32 * MiB if layer % 2 == 0 else 0,
            backward_workspace_bytes=32 * MiB if layer % 2 == 0 else 0,
        )
        for layer in range(6)
    ]
    schedule = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=16)
    plan_input = plan_pb2.PlanInput(
        schedule=plan_pb2.SchedulePlanInput(schedule=schedule.to_proto(), layers=layers), time_budget_ms=1500
    )
    client = graphpool.Client(daemon.socket, timeout=0.5)  # type: ignore[attr-defined]
    try:
        with client.attach(job_id, rank=0) as s:
            plan = s.plan_capture(plan_input, reserve=False).plan
    finally:
        client.close()
    assert plan.footprint_bytes > plan.lower_bound_bytes
    assert plan.planning_seconds >= 1.0


def test_capture_asks_for_the_plan_without_its_buffers(
    daemon: object, client: graphpool.Client, job_id: str
) -> None:
    """Capture checks the footprint and the prediction: its plan comes without the per-buffer
    list, which a schedule of thousands of microbatches could not send in one message."""
    schedule = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=16)
    with client.attach(job_id, rank=0) as s:
        summary = request_plan(schedule, _profiles(3), budget=None, client=s, reserve=False).plan
        full = s.plan_capture(capture_plan_input(schedule, _profiles(3)), reserve=False).plan
    assert len(summary.buffers) == 0 and len(full.buffers) > 0
    assert summary.lower_bound_bytes == full.lower_bound_bytes
    assert list(summary.microbatch_slot) == list(full.microbatch_slot)
    assert summary.footprint_bytes >= summary.lower_bound_bytes > 0


def test_plan_through_a_client_names_the_session(daemon: object, client: graphpool.Client, job_id: str) -> None:
    """``make_graphed_callables(client=graphpool.Client(...))`` is documented; the plan goes
    through the Client for a session of this process (the capture's pools' session), and is
    reserved for that session. Without a session id it says what is missing."""
    schedule = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=16)
    with client.attach(job_id, rank=0) as s:
        resp = request_plan(schedule, _profiles(3), budget=None, client=client, session_id=s.session_id)
        assert resp.reserved_bytes >= resp.plan.footprint_bytes > 0
        job = client.usage().job(job_id)
        assert job is not None and job.sessions == 1
        # A Session as client plans for a session named by id through its Client, too.
        again = request_plan(
            schedule, _profiles(3), budget=None, client=s, session_id=s.session_id, reserve=False
        )
        assert again.plan.footprint_bytes == resp.plan.footprint_bytes and again.reserved_bytes == 0
    with pytest.raises(TypeError, match="session_id"):
        request_plan(schedule, _profiles(3), budget=None, client=client)


def test_graphed_schedule_indices_do_not_wrap_around() -> None:
    """``gs[layer, microbatch]``, ``layer()`` and ``chunk()`` refuse negative and too-large
    indices, naming the argument, instead of picking another layer or microbatch."""
    from graphpool.capture import CaptureStats, GraphedSchedule, _Layer
    from graphpool.schedule import Schedule

    schedule = Schedule.one_f_one_b(pp_size=2, pp_rank=0, num_microbatches=4)
    nslots = schedule.slots_per_chunk[0]
    lay = _Layer(0, 0, object(), nslots, True, True)
    gs = GraphedSchedule(schedule, [[lay]], [], CaptureStats())
    assert callable(gs[0, 3]) and len(gs.layer(0)) == 4 and len(gs.chunk(0, 3)) == 1
    for bad in [lambda: gs[0, -1], lambda: gs[-1, 0], lambda: gs[0, 4], lambda: gs[1, 0]]:
        with pytest.raises(IndexError, match="layer|microbatch"):
            bad()
    with pytest.raises(IndexError, match="layer"):
        gs.layer(-1)
    with pytest.raises(IndexError, match="chunk"):
        gs.chunk(-1, 0)
    with pytest.raises(IndexError, match="microbatch"):
        gs.chunk(0, -1)


class _Pool:
    def __init__(self, released: list[str], name: str, error: Exception | None = None) -> None:
        self.released, self.name, self.error = released, name, error

    def release(self) -> None:
        self.released.append(self.name)
        if self.error is not None:
            raise self.error


def test_graphed_schedule_close_releases_every_pool_when_one_fails() -> None:
    """A pool whose release fails (the daemon gone, say) does not keep the others: every pool
    is released, then the first error is raised."""
    from graphpool.capture import CaptureStats, GraphedSchedule, _Layer

    schedule = Schedule.one_f_one_b(pp_size=2, pp_rank=0, num_microbatches=4)
    released: list[str] = []
    pools = [
        ("fwd/c0/s0", _Pool(released, "s0", graphpool.DaemonUnavailable("/g.sock", "gone"))),
        ("fwd/c0/s1", _Pool(released, "s1", RuntimeError("second"))),
        ("bwd", _Pool(released, "bwd")),
    ]
    lay = _Layer(0, 0, object(), schedule.slots_per_chunk[0], True, True)
    gs = GraphedSchedule(schedule, [[lay]], pools, CaptureStats())
    with pytest.raises(graphpool.DaemonUnavailable, match="gone"):
        gs.close()
    assert released == ["s0", "s1", "bwd"]
    gs.close()  # idempotent: nothing is released twice
    assert released == ["s0", "s1", "bwd"]


def test_graphed_call_inputs_are_checked_against_the_capture() -> None:
    """The message names the input, the captured and the given shape and dtype (the GPU test
    tests/gpu/test_capture_calls.py checks the same on real graphs)."""
    from types import SimpleNamespace

    from graphpool.capture import _check_inputs, _Layer

    def t(shape: tuple[int, ...], dtype: str = "torch.float32") -> Any:
        return SimpleNamespace(shape=shape, dtype=dtype)

    lay = _Layer(0, 0, object(), 1, True, True)
    lay.static_in[0] = (t((2, 8)), t((2,), "torch.int64"))
    _check_inputs(lay, 0, (t((2, 8)), t((2,), "torch.int64")))
    with pytest.raises(TypeError, match="2 input.*got 1"):
        _check_inputs(lay, 0, (t((2, 8)),))
    with pytest.raises(TypeError, match="input 1 .* must be a tensor, not int"):
        _check_inputs(lay, 0, (t((2, 8)), 3))
    with pytest.raises(ValueError, match=r"input 0 .*expected shape \(2, 8\).*got shape \(4, 8\)"):
        _check_inputs(lay, 0, (t((4, 8)), t((2,), "torch.int64")))
    with pytest.raises(ValueError, match="input 1 .*dtype torch.int64.*dtype torch.int32"):
        _check_inputs(lay, 0, (t((2, 8)), t((2,), "torch.int32")))
