"""Quota refusal with details, from a daemon configured with a 64 MiB rank quota."""

from __future__ import annotations

import os

import pytest

import graphpool
from gp_helpers import Daemon

MiB = 1 << 20


def test_rank_quota_refusal(quota_daemon: Daemon, job_id: str) -> None:
    c = quota_daemon.client()
    assert c.limits().default_rank_quota == 64 * MiB
    with c.attach(job_id, rank=5) as s:
        held = s.allocate("48MiB", label="capture-pool")
        with pytest.raises(graphpool.CapacityExceeded) as ei:
            s.allocate("32MiB")
        e = ei.value
        assert e.code is not None and e.code.name == "RESOURCE_EXHAUSTED"
        assert e.limit == "rank-quota"
        assert e.requested == 32 * MiB
        assert e.free == 16 * MiB
        assert e.limit_bytes == 64 * MiB
        assert e.device_uuid == s.device.uuid
        assert e.top_holders and e.top_holders[0] == graphpool.Holder(
            job_id=job_id, rank=5, pid=os.getpid(), granted_bytes=48 * MiB
        )
        text = str(e)
        for part in ("32 MiB", "16 MiB", "64 MiB", "rank-quota", f"job {job_id} rank 5", "48 MiB"):
            assert part in text, text
        # Nothing was granted by the refused request; what fits still does.
        assert [g.size for g in s.grants()] == [48 * MiB]
        s.allocate("16MiB").release()
        held.release()
    # Another rank of the same job has its own quota.
    with c.attach(job_id, rank=6) as s6:
        s6.allocate("64MiB").release()
