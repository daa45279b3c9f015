"""Buffer lists from PyTorch memory snapshots, for ``graphpool plan --buffers``.

PyTorch's caching allocator records every allocation and free once memory history is on;
this module turns one device's record into the buffer list ``graphpool plan`` reads, so that
the planner's footprint for the very allocations a step made can be set beside the bytes
torch reserved for them::

    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    train_step()
    torch.cuda.memory._dump_snapshot("step.pickle")

    $ python -m graphpool.snapshot step.pickle -o step.csv
    $ graphpool plan --buffers step.csv

Each block the allocator handed out is one buffer, live from its ``alloc`` event to its
``free_completed`` event (when the allocator may reuse it; ``--end requested`` takes the
``free_requested`` event, when the program let go of it). The clock counts allocations and
frees: a block freed before another is allocated may share its bytes. Blocks allocated before
the recording began are live from its start, blocks still held when it ended are live to its
end, and blocks the record never mentions but the snapshot holds (weights allocated before
the recording) are live throughout. The summary gives the most bytes live at once (the
list's lower bound, which ``graphpool plan`` reports too) and the most bytes torch reserved
while the record ran, worked back from the segments held at the snapshot.

Neither this module nor its command imports torch. Snapshots are pickles; they are read with
an unpickler that builds only plain values (dicts, lists, strings, numbers) and refuses
anything else, so a file from elsewhere cannot run code.
"""

from __future__ import annotations

import argparse
import csv
import os
import pickle
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from .units import format_size

__all__ = [
    "Buffer",
    "SnapshotBuffers",
    "SnapshotError",
    "buffers_from_snapshot",
    "load_snapshot",
    "main",
    "write_csv",
]

FreeEvent = Literal["completed", "requested"]

# The states of a snapshot block that the program holds (the others are free in the cache).
_HELD_STATES = frozenset({"active_allocated", "active_pending_free"})
# Trace actions that change the bytes reserved from the driver, and by how much.
_RESERVE_SIGN = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


class SnapshotError(ValueError):
    """A snapshot that cannot be read as PyTorch's allocator records it; the message names
    the entry at fault and what to do."""


@dataclass(frozen=True)
class Buffer:
    """One block of the allocator, live over ``[start, end)`` on the list's clock."""

    name: str
    """``b<index>@<address in hex>``: unique within the list."""
    start: int
    end: int
    size: int
    """Bytes of the block (the allocator's rounded size)."""


@dataclass(frozen=True)
class SnapshotBuffers:
    """One device's buffer list and what the record said about it."""

    device: int
    buffers: list[Buffer]
    events: int
    """Allocations and frees read from the device's record."""
    before_recording: int
    """Blocks freed in the record but allocated before it began (live from its start)."""
    held_at_end: int
    """Blocks allocated in the record and still held when it ended (live to its end)."""
    outside_recording: int
    """Blocks the snapshot holds that the record never mentions (live throughout)."""
    peak_live_bytes: int
    """The most bytes live at once: the list's lower bound."""
    peak_reserved_bytes: int | None
    """The most bytes torch reserved on the device while the record ran, or None where the
    snapshot's segments do not account for the record (none given, or fewer bytes than its
    blocks)."""

    def summary(self) -> str:
        """Two lines for a person: what was read, and the two peaks."""
        reserved = (
            "an unknown amount (the snapshot's segments do not hold the record's blocks)"
            if self.peak_reserved_bytes is None
            else format_size(self.peak_reserved_bytes)
        )
        return (
            f"device {self.device}: {self.events} allocations and frees, "
            f"{len(self.buffers)} buffers ({self.before_recording} allocated before the "
            f"recording, {self.held_at_end} held at its end, {self.outside_recording} "
            f"never in it)\n"
            f"most bytes live at once {format_size(self.peak_live_bytes)} (the lower bound); "
            f"torch reserved at most {reserved} meanwhile"
        )


class _PlainUnpickler(pickle.Unpickler):
    """Builds plain values only: any class or function in the stream is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotError(
            f"the pickle refers to {module}.{name}: a PyTorch memory snapshot holds only "
            f"dicts, lists, strings and numbers; refusing to load it"
        )


def load_snapshot(source: str | Path | IO[bytes]) -> dict[str, Any]:
    """Reads a snapshot written by ``torch.cuda.memory._dump_snapshot`` (a pickle) without
    running code from it."""
    try:
        if isinstance(source, (str, Path)):
            with open(source, "rb") as f:
                value = _PlainUnpickler(f).load()
        else:
            value = _PlainUnpickler(source).load()
    except (pickle.UnpicklingError, EOFError) as e:
        raise SnapshotError(f"not a pickled memory snapshot: {e}") from e
    if not isinstance(value, dict) or "device_traces" not in value:
        raise SnapshotError(
            "the pickle holds no `device_traces`: write the snapshot with "
            "torch.cuda.memory._dump_snapshot() after _record_memory_history()"
        )
    return value


def _int_field(entry: Mapping[str, Any], key: str, where: str) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SnapshotError(f"{where}: `{key}` is {value!r}, not a non-negative integer")
    return value


def _pick_device(traces: Sequence[Any], device: int | None) -> int:
    if device is not None:
        if not 0 <= device < len(traces):
            raise SnapshotError(
                f"device {device} is not in the snapshot: it records devices 0..{len(traces) - 1}"
            )
        return device
    busy = [d for d, t in enumerate(traces) if isinstance(t, list) and t]
    if len(busy) == 1:
        return busy[0]
    if not busy:
        raise SnapshotError(
            "the snapshot records no allocations on any device: turn memory history on with "
            "torch.cuda.memory._record_memory_history() before the code to record"
        )
    counts = ", ".join(f"{d} ({len(traces[d])} entries)" for d in busy)
    raise SnapshotError(f"the snapshot records several devices: {counts}; choose one with --device")


def _held_blocks(segments: Iterable[Any], device: int) -> dict[int, int]:
    """Address → size of every block the snapshot's segments of `device` hold."""
    held: dict[int, int] = {}
    for s, segment in enumerate(segments):
        if not isinstance(segment, Mapping) or segment.get("device") != device:
            continue
        address = _int_field(segment, "address", f"segments[{s}]")
        for b, block in enumerate(segment.get("blocks", [])):
            if not isinstance(block, Mapping):
                raise SnapshotError(f"segments[{s}].blocks[{b}] is not a dict")
            size = _int_field(block, "size", f"segments[{s}].blocks[{b}]")
            if block.get("state") in _HELD_STATES:
                held[address] = size
            address += size
    return held


def buffers_from_snapshot(
    snapshot: Mapping[str, Any],
    *,
    device: int | None = None,
    end: FreeEvent = "completed",
    align: int = 512,
) -> SnapshotBuffers:
    """One device's buffer list from a snapshot (``torch.cuda.memory._snapshot()``, or a
    pickle read by `load_snapshot`).

    `device` may be left out when one device has a record. `end` picks the event that ends a
    buffer: ``completed`` (the allocator may reuse the block) or ``requested`` (the program
    let go of it; the allocator may still wait on streams that use it). Sizes are rounded up
    to `align` bytes (the caching allocator's 512-byte granule by default; 1 keeps them as
    requested).
    """
    if end not in ("completed", "requested"):
        raise SnapshotError(f"end must be 'completed' or 'requested', not {end!r}")
    if align < 1:
        raise SnapshotError(f"align must be at least 1 byte, not {align}")
    traces = snapshot.get("device_traces")
    if not isinstance(traces, list):
        raise SnapshotError("the snapshot has no `device_traces` list")
    device = _pick_device(traces, device)
    trace = traces[device]
    if not isinstance(trace, list):
        raise SnapshotError(f"device_traces[{device}] is not a list")
    free_action = f"free_{end}"

    def rounded(size: int) -> int:
        return -(-size // align) * align

    open_blocks: dict[int, tuple[int, int]] = {}  # address → (start, size)
    spans: list[tuple[int, int, int, int]] = []  # (start, end, size, address)
    seen: set[int] = set()  # addresses with an allocation or an ending free in the record
    reserve_deltas: list[int] = []
    before_recording = 0
    step = 1  # step 0 is before the record: blocks allocated earlier are live there
    for i, entry in enumerate(trace):
        where = f"device_traces[{device}][{i}]"
        if not isinstance(entry, Mapping):
            raise SnapshotError(f"{where} is not a dict")
        action = entry.get("action")
        if action in _RESERVE_SIGN:
            reserve_deltas.append(_RESERVE_SIGN[action] * _int_field(entry, "size", where))
            continue
        if action != "alloc" and action != free_action:
            continue  # the other free event, oom, snapshot markers, later releases' actions
        address = _int_field(entry, "addr", where)
        size = rounded(_int_field(entry, "size", where))
        seen.add(address)
        if action == "alloc":
            if address in open_blocks:
                raise SnapshotError(
                    f"{where}: block {address:#x} allocated again before it was freed; "
                    f"the record is not one device's allocator history"
                )
            open_blocks[address] = (step, size)
        else:
            opened = open_blocks.pop(address, None)
            if opened is None:  # allocated before the record begins
                before_recording += 1
                opened = (0, size)
            start, size = opened
            spans.append((start, step, size, address))
        step += 1

    held_at_end = len(open_blocks)
    clock_end = step
    for address, (start, size) in open_blocks.items():
        spans.append((start, clock_end, size, address))
    segments = snapshot.get("segments")
    outside_recording = 0
    if isinstance(segments, list):
        for address, size in _held_blocks(segments, device).items():
            if address not in seen:
                spans.append((0, clock_end, rounded(size), address))
                outside_recording += 1
    spans.sort()
    peak_reserved = _peak_reserved(segments, device, reserve_deltas)
    buffers = [
        Buffer(f"b{k}@{address:x}", start, stop, size)
        for k, (start, stop, size, address) in enumerate(spans)
    ]
    peak_live = _peak_live(buffers)
    if peak_reserved is not None and peak_reserved < peak_live:
        peak_reserved = None  # segments of another pool or moment: they do not hold the blocks
    return SnapshotBuffers(
        device=device,
        buffers=buffers,
        events=step - 1,
        before_recording=before_recording,
        held_at_end=held_at_end,
        outside_recording=outside_recording,
        peak_live_bytes=peak_live,
        peak_reserved_bytes=peak_reserved,
    )


def _peak_live(buffers: Sequence[Buffer]) -> int:
    """The most bytes live at one step (ends before starts at a step: ``[start, end)``)."""
    events = sorted([(b.start, b.size) for b in buffers] + [(b.end, -b.size) for b in buffers])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _peak_reserved(segments: Any, device: int, deltas: Sequence[int]) -> int | None:
    """The most bytes reserved while the record ran: the segments held at the snapshot, with
    the record's segment events undone from the last back to the first."""
    if not isinstance(segments, list):
        return None
    reserved = 0
    for s, segment in enumerate(segments):
        if isinstance(segment, Mapping) and segment.get("device") == device:
            reserved += _int_field(segment, "total_size", f"segments[{s}]")
    peak = reserved
    for delta in reversed(deltas):
        reserved -= delta
        if reserved < 0:
            raise SnapshotError(
                "the record reserves more segment bytes than the snapshot's segments hold: "
                "the segments and the record are of different moments; take both from one "
                "torch.cuda.memory._snapshot()"
            )
        peak = max(peak, reserved)
    return peak


def write_csv(buffers: Iterable[Buffer], out: IO[str]) -> None:
    """Writes the list as ``graphpool plan --buffers`` reads it: ``buffer,start,end,size``."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["buffer", "start", "end", "size"])
    for b in buffers:
        writer.writerow([b.name, b.start, b.end, b.size])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m graphpool.snapshot``: a snapshot in, a buffer list out (stdout or ``-o``),
    the summary on stderr."""
    parser = argparse.ArgumentParser(
        prog="python -m graphpool.snapshot",
        description="Turn a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot) into the "
        "buffer list `graphpool plan --buffers` reads.",
    )
    parser.add_argument("snapshot", type=Path, help="the pickled snapshot")
    parser.add_argument(
        "-o", "--output", type=Path, help="the CSV to write (default: standard output)"
    )
    parser.add_argument(
        "--device", type=int, help="the device whose record to read (needed when several have one)"
    )
    parser.add_argument(
        "--end",
        choices=["completed", "requested"],
        default="completed",
        help="the event that ends a buffer: the allocator's free_completed (default: the block "
        "may be reused) or free_requested (the program let go of it)",
    )
    parser.add_argument(
        "--align",
        type=int,
        default=512,
        help="round sizes up to this many bytes (default 512, the allocator's granule)",
    )
    args = parser.parse_args(argv)
    try:
        snapshot = load_snapshot(args.snapshot)
        result = buffers_from_snapshot(snapshot, device=args.device, end=args.end, align=args.align)
    except (SnapshotError, OSError) as e:
        print(f"graphpool.snapshot: {args.snapshot}: {e}", file=sys.stderr)
        return 2
    if args.output is None:
        try:
            write_csv(result.buffers, sys.stdout)
            sys.stdout.flush()
        except BrokenPipeError:  # the reader stopped early (`| head`): not an error of ours
            sys.stdout = open(os.devnull, "w")  # so that the flush at exit does not fail again
            return 1
    else:
        try:
            with open(args.output, "w", encoding="utf-8", newline="") as out:
                write_csv(result.buffers, out)
        except OSError as e:
            print(f"graphpool.snapshot: cannot write {args.output}: {e}", file=sys.stderr)
            return 2
    print(f"graphpool.snapshot: {result.summary()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
