"""CPU tests of the pipeline schedule model and slot assignment (no torch needed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

import pytest

from graphpool.schedule import Schedule, ScheduleError


def replay_ok(s: Schedule) -> None:
    """No slot is taken by two microbatches of a chunk at once, and every slot is released."""
    owner: dict[tuple[int, int], int] = {}
    for st in s.steps:
        key = (st.chunk, st.slot)
        if st.kind == "F":
            assert key not in owner, f"slot {key} busy with mb {owner.get(key)} at {st}"
            owner[key] = st.microbatch
        else:
            assert owner.pop(key) == st.microbatch
    assert not owner


def test_1f1b_stage0_of_8_m8_has_8_in_flight() -> None:
    s = Schedule.one_f_one_b(pp_size=8, pp_rank=0, num_microbatches=8)
    assert s.max_in_flight() == 8
    assert s.slots_per_chunk == (8,)
    assert s.order == (1,) * 7 + (1, -1) + (-1,) * 7
    replay_ok(s)


def test_1f1b_last_stage_has_1_in_flight() -> None:
    s = Schedule.one_f_one_b(pp_size=8, pp_rank=7, num_microbatches=8)
    assert s.max_in_flight() == 1
    assert s.slots_per_chunk == (1,)
    assert s.microbatch_slots() == [0] * 8
    assert s.order == (1, -1) * 8


@pytest.mark.parametrize("m", [1, 3, 8, 32, 128])
@pytest.mark.parametrize("rank", range(8))
def test_1f1b_counts(m: int, rank: int) -> None:
    s = Schedule.one_f_one_b(8, rank, m)
    assert len(s) == 2 * m
    assert s.max_in_flight() == min(8 - rank, m)
    assert s.num_slots == min(8 - rank, m)
    replay_ok(s)
    # slots cycle: microbatch i uses slot i mod slots under 1F1B
    assert s.microbatch_slots() == [i % s.num_slots for i in range(m)]


def test_1f1b_slot_count_independent_of_m() -> None:
    assert Schedule.one_f_one_b(8, 0, 8).num_slots == Schedule.one_f_one_b(8, 0, 128).num_slots


def test_first_use_steps_cover_every_slot_once() -> None:
    s = Schedule.one_f_one_b(8, 0, 128)
    f = s.first_use_steps()
    assert len(f) == 16
    assert {(x.kind, x.slot) for x in f} == {(k, i) for k in "FB" for i in range(8)}


def test_interleaved_stage0_counts() -> None:
    s = Schedule.interleaved(pp_size=8, pp_rank=0, num_microbatches=8, virtual_chunks=2)
    # warm-up 2*(8-0-1) + (2-1)*8 = 22 > 16 = M*V: all forwards first
    assert s.order[:16] == (1,) * 8 + (2,) * 8
    assert s.order[16:] == (-2,) * 8 + (-1,) * 8
    assert s.slots_per_chunk == (8, 8)
    assert s.max_in_flight() == 16
    replay_ok(s)


def test_interleaved_steady_state() -> None:
    s = Schedule.interleaved(8, 0, 32, 2)
    assert len(s) == 2 * 32 * 2
    # warm-up 22 forwards: chunk 1 mb 0..7, chunk 2 mb 0..7, chunk 1 mb 8..13
    assert s.order[:22] == (1,) * 8 + (2,) * 8 + (1,) * 6
    assert s.order[22:24] == (1, -2)
    # chunk 1 runs mb 14 and 15 before its first backward (backward step 8)
    assert s.slots_per_chunk == (16, 8)
    assert s.max_in_flight() == 23
    replay_ok(s)
    assert Schedule.interleaved(8, 0, 128, 2).slots_per_chunk == (16, 8)


def test_interleaved_last_stage() -> None:
    s = Schedule.interleaved(8, 7, 16, 2)
    assert s.max_in_flight() == 9
    assert s.slots_per_chunk == (9, 1)
    replay_ok(s)


def test_interleaved_needs_pp_size_microbatches() -> None:
    with pytest.raises(ScheduleError, match="at least pp_size = 8"):
        Schedule.interleaved(8, 0, 6, 2)


def test_interleaved_partial_last_group() -> None:
    # M = 10 with pp_size 4: groups of 4, 4, 2 microbatches, each through both chunks
    s = Schedule.interleaved(4, 3, 10, 2)
    fwd = [x for x in s.order if x > 0]
    assert fwd == [1] * 4 + [2] * 4 + [1] * 4 + [2] * 4 + [1] * 2 + [2] * 2
    replay_ok(s)


def test_interleaved_one_chunk_is_1f1b() -> None:
    assert Schedule.interleaved(4, 1, 6, 1).order == Schedule.one_f_one_b(4, 1, 6).order


def test_explicit_te_order() -> None:
    # TransformerEngine's example: 2 chunks, 2 microbatches
    s = Schedule.explicit([1, 2, 1, 2, -2, -1, -2, -1], num_microbatches=2, virtual_chunks=2)
    assert [(x.kind, x.chunk, x.microbatch, x.slot) for x in s.steps] == [
        ("F", 0, 0, 0), ("F", 1, 0, 0), ("F", 0, 1, 1), ("F", 1, 1, 1),
        ("B", 1, 0, 0), ("B", 0, 0, 0), ("B", 1, 1, 1), ("B", 0, 1, 1),
    ]
    assert s.slots_per_chunk == (2, 2)


def test_explicit_reuses_lowest_free_slot() -> None:
    s = Schedule.explicit([1, 1, 1, -1, -1, 1, -1, -1], 4)
    assert s.microbatch_slots() == [0, 1, 2, 0]
    assert s.num_slots == 3


@pytest.mark.parametrize(
    "order,m,v,msg",
    [
        ([1, -1, 1], 2, 1, "2 forwards and 1 backward;"),
        ([-1, 1], 1, 1, "before its forward"),
        ([1, 1, -1, -1], 1, 1, "already has 1 forward "),
        ([1, 3, -3, -1], 1, 2, "chunk 3 out of range"),
        ([1, 0, -1], 1, 1, "non-zero integers"),
        ([1, 2, -1, -2], 1, 1, "chunk 2 out of range"),
    ],
)
def test_explicit_rejects_bad_orders(order: list[int], m: int, v: int, msg: str) -> None:
    with pytest.raises(ScheduleError, match=msg):
        Schedule.explicit(order, m, v)


@pytest.mark.parametrize(
    "args,msg",
    [((0, 0, 4), "pp_size must be >= 1"), ((4, 4, 4), "pp_rank must be < pp_size"),
     ((4, 0, 0), "num_microbatches must be >= 1")],
)
def test_bad_sizes(args: tuple[int, int, int], msg: str) -> None:
    with pytest.raises(ScheduleError, match=msg):
        Schedule.one_f_one_b(*args)


def test_explicit_matches_generated() -> None:
    for s in (Schedule.one_f_one_b(4, 1, 9), Schedule.interleaved(4, 2, 8, 3)):
        e = Schedule.explicit(list(s.order), s.num_microbatches, s.virtual_chunks)
        assert e.steps == s.steps


def test_proto_round_trip() -> None:
    pytest.importorskip("google.protobuf")
    for s in (
        Schedule.one_f_one_b(8, 3, 16),
        Schedule.interleaved(8, 0, 16, 2),
        Schedule.explicit([1, 2, -2, -1], 1, 2),
    ):
        msg = s.to_proto()
        back = Schedule.from_proto(type(msg).FromString(msg.SerializeToString()))
        assert back.steps == s.steps


def _graphpool_bin() -> str | None:
    env = os.environ.get("GRAPHPOOL_BIN")
    if env:
        return env
    here = os.path.dirname(__file__)
    for rel in ("../../target/debug/graphpool", "../../target/release/graphpool"):
        p = os.path.abspath(os.path.join(here, rel))
        if os.path.exists(p):
            return p
    return shutil.which("graphpool")


@pytest.mark.parametrize(
    "s",
    [Schedule.one_f_one_b(8, 0, 32), Schedule.one_f_one_b(8, 7, 8),
     Schedule.interleaved(8, 0, 32, 2), Schedule.interleaved(4, 1, 10, 3),
     Schedule.explicit([1, 2, 1, -2, -1, 2, -2, -1], 2, 2)],
    ids=["1f1b-0", "1f1b-7", "il-0", "il-4-1-partial", "explicit"],
)
def test_agrees_with_rust_planner(s: Schedule, tmp_path: Any) -> None:
    """The daemon's planner and this module produce the same step order and slots."""
    exe = _graphpool_bin()
    if exe is None:
        pytest.skip("graphpool binary not built")
    layers = [
        {"chunk": c, "layer": 0, "saved_bytes": 1 << 20,
         "inputs": [{"name": "h", "shape": [16, 1, 64], "dtype": "bf16", "kept_for_backward": True}],
         "outputs": [{"name": "h", "shape": [16, 1, 64], "dtype": "bf16"}]}
        for c in range(s.virtual_chunks)
    ]
    f = tmp_path / "sched.json"
    f.write_text(json.dumps({"schedule": s.to_dict(), "layers": layers}))
    r = subprocess.run([exe, "plan", "--schedule", str(f), "--json"], capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"graphpool plan --schedule failed (binary older than the CLI?): {r.stderr[:200]}")
    try:
        plan = json.loads(r.stdout)
    except ValueError:
        pytest.skip("graphpool plan --json printed no JSON")
    plan = plan.get("plan", plan)
    if "steps" not in plan:
        pytest.skip("graphpool plan --json has no steps field")
    assert [int(x) for x in plan["steps"]] == list(s.order)
    if "slots" in plan and s.virtual_chunks == 1:
        assert int(plan["slots"]) == s.num_slots
    if "microbatch_slot" in plan and s.virtual_chunks == 1:
        assert [int(x) for x in plan["microbatch_slot"]] == s.microbatch_slots()


def test_indices_do_not_wrap_around() -> None:
    """Negative or too large chunk and microbatch indices raise, naming the argument, instead
    of answering for another chunk or microbatch."""
    s = Schedule.interleaved(pp_size=2, pp_rank=0, num_microbatches=4, virtual_chunks=2)
    assert s.slot_of(1, 3) == s.microbatch_slots(1)[3]
    for call, name in (
        (lambda: s.slot_of(0, -1), "microbatch"),
        (lambda: s.slot_of(0, 4), "microbatch"),
        (lambda: s.slot_of(-1, 0), "chunk"),
        (lambda: s.slot_of(2, 0), "chunk"),
        (lambda: s.microbatch_slots(-1), "chunk"),
        (lambda: s.max_in_flight(-1), "chunk"),
    ):
        with pytest.raises(IndexError, match=name):
            call()
    with pytest.raises(TypeError, match="microbatch"):
        s.slot_of(0, 1.0)  # type: ignore[arg-type]
