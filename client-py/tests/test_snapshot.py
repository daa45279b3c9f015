"""graphpool.snapshot: PyTorch memory snapshots (as the allocator records them) turned into the
buffer lists `graphpool plan --buffers` reads, and planned by the real binary."""

from __future__ import annotations

import csv
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gp_helpers import CLIENT, daemon_binary
from graphpool.snapshot import (
    SnapshotError,
    buffers_from_snapshot,
    load_snapshot,
    main,
    write_csv,
)

MiB = 1 << 20


def alloc(addr: int, size: int) -> dict[str, Any]:
    return {"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": []}


def free(addr: int, size: int, *, completed: bool = True) -> list[dict[str, Any]]:
    """A free as the allocator records it: requested, then completed (unless pending)."""
    entries = [{"action": "free_requested", "addr": addr, "size": size, "stream": 0, "frames": []}]
    if completed:
        entries.append({**entries[0], "action": "free_completed"})
    return entries


def segment(device: int, address: int, blocks: list[tuple[int, str]]) -> dict[str, Any]:
    return {
        "device": device,
        "address": address,
        "total_size": sum(size for size, _ in blocks),
        "stream": 0,
        "segment_type": "large",
        "blocks": [{"size": size, "state": state} for size, state in blocks],
    }


def step_snapshot() -> dict[str, Any]:
    """A small step on device 0: a weight allocated before the record and never in it (held
    throughout), an activation allocated before the record and freed in it, three
    temporaries of which one is still held at the end, and one segment reserved during the
    record (4 MiB) beside the 8 MiB one that was there before."""
    base, extra = 0x7F00_0000_0000, 0x7F00_1000_0000
    trace = [
        *free(base + 2 * MiB, 1 * MiB),  # the activation from before the record
        {"action": "segment_alloc", "addr": extra, "size": 4 * MiB, "stream": 0, "frames": []},
        alloc(extra, 3 * MiB),
        alloc(base + 2 * MiB, 1 * MiB),
        *free(extra, 3 * MiB),
        alloc(extra, 2 * MiB + 100),  # rounded up to 512 B
        {"action": "oom", "addr": 0, "size": 0, "stream": 0, "device_free": 0, "frames": []},
        *free(base + 2 * MiB, 1 * MiB),
    ]
    segments = [
        segment(0, base, [(2 * MiB, "active_allocated"), (6 * MiB, "inactive")]),
        segment(0, extra, [(2 * MiB + 512, "active_allocated"), (2 * MiB - 512, "inactive")]),
    ]
    return {"segments": segments, "device_traces": [trace, []]}


def test_a_step_becomes_one_buffer_per_block_on_a_clock_of_allocations_and_frees() -> None:
    result = buffers_from_snapshot(step_snapshot())
    assert result.device == 0
    spans = sorted((b.start, b.end, b.size) for b in result.buffers)
    # Step 0 is before the record; then 1 free(act), 2 alloc(t1), 3 alloc(t2), 4 free(t1),
    # 5 alloc(t3), 6 free(t2); the record ends at 7.
    assert spans == [
        (0, 1, 1 * MiB),  # the activation, allocated before the record
        (0, 7, 2 * MiB),  # the weight: held throughout, never in the record
        (2, 4, 3 * MiB),
        (3, 6, 1 * MiB),
        (5, 7, 2 * MiB + 512),  # held at the end, rounded up to 512 B
    ]
    counts = (result.events, result.before_recording, result.held_at_end, result.outside_recording)
    assert counts == (6, 1, 1, 1)
    # Most live at step 3: the weight, t1 and t2.
    assert result.peak_live_bytes == 2 * MiB + 3 * MiB + 1 * MiB
    # 12 MiB reserved at the snapshot; before the segment_alloc, 8 MiB: the peak is 12 MiB.
    assert result.peak_reserved_bytes == 12 * MiB
    assert len({b.name for b in result.buffers}) == len(result.buffers)


@pytest.mark.parametrize("seed", range(20))
def test_random_histories_keep_every_block_and_the_live_peak(seed: int) -> None:
    """A random allocator history (addresses reused, frees pending on streams): one buffer per
    allocation, the buffers of one address never live together, and the list's most bytes
    live at once is the history's own, counted event by event."""
    import random

    rng = random.Random(seed)
    trace: list[dict[str, Any]] = []
    held: dict[int, int] = {}
    pending: dict[int, int] = {}  # free requested, not completed
    free_addresses = [0x1000 * (k + 1) for k in range(40)]
    live = peak = allocations = 0
    for _ in range(400):
        r = rng.random()
        if r < 0.45 and free_addresses:
            addr = free_addresses.pop(rng.randrange(len(free_addresses)))
            size = rng.randrange(1, 64) * 512
            trace.append(alloc(addr, size))
            held[addr] = size
            allocations += 1
            live += size
            peak = max(peak, live)
        elif r < 0.8 and held:
            addr = rng.choice(sorted(held))
            size = held.pop(addr)
            completed = rng.random() < 0.7
            trace += free(addr, size, completed=completed)
            if completed:
                live -= size
                free_addresses.append(addr)
            else:
                pending[addr] = size
        elif pending:
            addr = rng.choice(sorted(pending))
            size = pending.pop(addr)
            trace.append({"action": "free_completed", "addr": addr, "size": size})
            live -= size  # a pending free holds its bytes until it completes
            free_addresses.append(addr)
    result = buffers_from_snapshot({"device_traces": [trace]})
    assert len(result.buffers) == allocations
    assert result.held_at_end == len(held) + len(pending)
    by_address: dict[str, list[tuple[int, int]]] = {}
    for b in result.buffers:
        assert b.start < b.end
        by_address.setdefault(b.name.split("@")[1], []).append((b.start, b.end))
    for spans in by_address.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert result.peak_live_bytes == peak


def test_buffers_end_at_the_free_the_caller_picks() -> None:
    """With ``end="requested"`` a block ends where the program let go of it, even when the
    allocator completes the free later (or, pending on a stream, not within the record)."""
    trace = [alloc(0x1000, 512), alloc(0x2000, 512), *free(0x1000, 512, completed=False)]
    trace += [alloc(0x3000, 512), {"action": "free_completed", "addr": 0x1000, "size": 512}]
    snap = {"device_traces": [trace]}
    completed = sorted((b.start, b.end) for b in buffers_from_snapshot(snap).buffers)
    by_request = buffers_from_snapshot(snap, end="requested").buffers
    requested = sorted((b.start, b.end) for b in by_request)
    # completed: 1 a, 2 b, 3 c, 4 free a; requested: 1 a, 2 b, 3 free a, 4 c.
    assert completed == [(1, 4), (2, 5), (3, 5)]
    assert requested == [(1, 3), (2, 5), (4, 5)]
    assert buffers_from_snapshot(snap).peak_reserved_bytes is None  # no segments to work from


def test_sizes_are_rounded_to_the_granule_asked_for() -> None:
    snap = {"device_traces": [[alloc(0x1000, 1000), *free(0x1000, 1000)]]}
    assert [b.size for b in buffers_from_snapshot(snap).buffers] == [1024]
    assert [b.size for b in buffers_from_snapshot(snap, align=1).buffers] == [1000]
    assert [b.size for b in buffers_from_snapshot(snap, align=4096).buffers] == [4096]
    with pytest.raises(SnapshotError, match="at least 1 byte"):
        buffers_from_snapshot(snap, align=0)


def test_a_device_is_chosen_or_asked_for() -> None:
    one = [alloc(0x1000, 512)]
    two = [alloc(0x2000, 512), alloc(0x3000, 512)]
    assert buffers_from_snapshot({"device_traces": [[], one]}).device == 1
    snap = {"device_traces": [one, two]}
    several = r"several devices: 0 \(1 entries\), 1 \(2 entries\); choose one with --device"
    with pytest.raises(SnapshotError, match=several):
        buffers_from_snapshot(snap)
    assert len(buffers_from_snapshot(snap, device=1).buffers) == 2
    with pytest.raises(SnapshotError, match="device 2 is not in the snapshot"):
        buffers_from_snapshot(snap, device=2)
    with pytest.raises(SnapshotError, match="_record_memory_history"):
        buffers_from_snapshot({"device_traces": [[], []]})


@pytest.mark.parametrize(
    ("trace", "message"),
    [
        (
            [alloc(0x1000, 512), alloc(0x1000, 512)],
            r"device_traces\[0\]\[1\]: block 0x1000 allocated again",
        ),
        ([alloc(0x1000, -5)], r"device_traces\[0\]\[0\]: `size` is -5"),
        ([{"action": "alloc", "addr": "0x10", "size": 512}], r"`addr` is '0x10'"),
        ([alloc(0x1000, 512), "alloc"], r"device_traces\[0\]\[1\] is not a dict"),
    ],
)
def test_a_malformed_record_names_the_entry_at_fault(trace: list[Any], message: str) -> None:
    with pytest.raises(SnapshotError, match=message):
        buffers_from_snapshot({"device_traces": [trace]})


def test_a_record_that_reserves_more_than_the_snapshot_holds_is_refused() -> None:
    """8 MiB reserved in the record, none held at the snapshot and none freed: the two are
    not of one history."""
    trace = [{"action": "segment_alloc", "addr": 0x1000, "size": 8 * MiB}, alloc(0x9000, 512)]
    snap = {"device_traces": [trace], "segments": []}
    with pytest.raises(SnapshotError, match="different moments"):
        buffers_from_snapshot(snap)


def test_segments_that_do_not_hold_the_blocks_give_no_reserved_figure() -> None:
    """A snapshot whose segments hold less than its record's blocks (another pool's, or of
    another moment) says nothing about what torch reserved for them."""
    segments = [segment(0, 0x1000, [(MiB, "inactive")])]
    snap = {"device_traces": [[alloc(0x1000, 4 * MiB)]], "segments": segments}
    result = buffers_from_snapshot(snap)
    assert result.peak_live_bytes == 4 * MiB
    assert result.peak_reserved_bytes is None
    assert "an unknown amount" in result.summary()


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


def test_a_pickle_that_would_run_code_is_refused_without_running_it() -> None:
    payload = pickle.dumps({"device_traces": [[]], "x": _Boom()})
    with pytest.raises(SnapshotError, match="refers to (posix|os).system"):
        load_snapshot(io.BytesIO(payload))
    with pytest.raises(SnapshotError, match="no `device_traces`"):
        load_snapshot(io.BytesIO(pickle.dumps({"segments": []})))
    with pytest.raises(SnapshotError, match="not a pickled memory snapshot"):
        load_snapshot(io.BytesIO(b"buffer,start,end,size\n"))


def test_the_csv_is_what_graphpool_plan_reads(tmp_path: Path) -> None:
    """The command writes the list; the real `graphpool plan` plans it, and its lower bound is
    the summary's most bytes live at once."""
    snap_path = tmp_path / "step.pickle"
    snap_path.write_bytes(pickle.dumps(step_snapshot()))
    out = tmp_path / "step.csv"
    done = subprocess.run(
        [sys.executable, "-m", "graphpool.snapshot", str(snap_path), "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=CLIENT,
    )
    assert done.returncode == 0, done.stderr
    read = "5 buffers (1 allocated before the recording, 1 held at its end, 1 never in it)"
    assert read in done.stderr
    assert "most bytes live at once 6 MiB" in done.stderr
    assert "torch reserved at most 12 MiB" in done.stderr
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 5 and set(rows[0]) == {"buffer", "start", "end", "size"}

    graphpool = daemon_binary().parent / "graphpool"
    if not graphpool.is_file():
        pytest.skip(f"{graphpool} is not built")
    report = subprocess.run(
        [str(graphpool), "plan", "--buffers", str(out)], capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    assert f"lower bound         6 MiB ({6 * MiB} bytes)" in report.stdout


def test_the_command_reports_a_bad_file_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "not-a-snapshot.pickle"
    bad.write_bytes(pickle.dumps([1, 2, 3]))
    assert main([str(bad)]) == 2
    assert "no `device_traces`" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.pickle")]) == 2
    assert "No such file" in capsys.readouterr().err
    good = tmp_path / "s.pickle"
    good.write_bytes(pickle.dumps(step_snapshot()))
    assert main([str(good), "-o", str(tmp_path / "no-such-dir" / "s.csv")]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert main([str(good), "--align", "0"]) == 2
    assert "at least 1 byte" in capsys.readouterr().err


def test_the_list_streams_to_standard_output(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(step_snapshot()))
    assert main([str(path), "--end", "requested", "--align", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == "buffer,start,end,size"
    assert len(captured.out.splitlines()) == 6
    written = io.StringIO()
    write_csv(buffers_from_snapshot(step_snapshot(), end="requested", align=1).buffers, written)
    assert written.getvalue() == captured.out
