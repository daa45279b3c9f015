"""graphpool.snapshot on a real record of PyTorch's caching allocator: the pickle
`torch.cuda.memory._dump_snapshot` writes loads without running code, and the buffer list it
gives has torch's own peaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from graphpool.snapshot import buffers_from_snapshot, load_snapshot

MiB = 1 << 20


@pytest.fixture
def recording() -> Iterator[None]:
    """Memory history on for the test, off after it whatever happens."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_a_recorded_step_has_torchs_peaks(recording: None, tmp_path: Path) -> None:
    """The reserved peak worked back from the segments is torch's max_memory_reserved over the
    record, and the list's most bytes live at once is its max_memory_allocated, up to what
    the allocator adds to a block it does not split (under 1 MiB a block; the tensors are
    whole 2 MiB multiples, so only blocks left by earlier tests can add any)."""
    device = torch.cuda.current_device()
    keep = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # held through the record
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    made = 0
    live = []
    for i in range(40):
        live.append(torch.empty((2 + i % 5) * 2 * MiB, dtype=torch.uint8, device="cuda"))
        made += 1
        if i % 3 == 2:
            del live[: len(live) // 2]
    big = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")  # a new segment, likely
    made += 1
    del big
    torch.cuda.synchronize()
    max_allocated = torch.cuda.max_memory_allocated()
    max_reserved = torch.cuda.max_memory_reserved()
    path = tmp_path / "step.pickle"
    torch.cuda.memory._dump_snapshot(str(path))

    result = buffers_from_snapshot(load_snapshot(path), device=device)
    started = [b for b in result.buffers if b.start > 0]
    assert len(started) >= made
    assert max_allocated - 32 * MiB <= result.peak_live_bytes <= max_allocated
    assert result.peak_reserved_bytes == max_reserved
    assert keep.numel() == 64 * MiB


def test_a_model_steps_record_is_planned(recording: None, tmp_path: Path) -> None:
    """A forward and backward of a small MLP, recorded, converted by the command and planned
    by `graphpool plan` (where the binary is given): the plan's lower bound is the list's."""
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    x = torch.randn(512, 1024, device="cuda", requires_grad=True)
    for _ in range(2):
        model(x).square().mean().backward()
    torch.cuda.synchronize()
    path = tmp_path / "mlp.pickle"
    torch.cuda.memory._dump_snapshot(str(path))

    result = buffers_from_snapshot(load_snapshot(path))
    assert len(result.buffers) > 10
    assert result.peak_reserved_bytes is not None
    assert result.peak_live_bytes <= result.peak_reserved_bytes

    cli = os.environ.get("GRAPHPOOL_CLI_BIN")
    if not cli:
        daemon = os.environ.get("GRAPHPOOL_DAEMON_BIN")
        cli = str(Path(daemon).parent / "graphpool") if daemon else ""
    if not cli or not Path(cli).is_file():
        pytest.skip("set GRAPHPOOL_CLI_BIN to plan the list with `graphpool plan`")
    csv_path = tmp_path / "mlp.csv"
    done = subprocess.run(
        [sys.executable, "-m", "graphpool.snapshot", str(path), "-o", str(csv_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    report = subprocess.run(
        [cli, "plan", "--buffers", str(csv_path), "--json"], capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    plan = json.loads(report.stdout)
    assert plan["lower_bound_bytes"] == result.peak_live_bytes
    assert plan["footprint_bytes"] >= result.peak_live_bytes
