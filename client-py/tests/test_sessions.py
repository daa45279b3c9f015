"""Sessions, segments and errors against a real graphpoold (host backend)."""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import graphpool
import graphpool.client
from gp_helpers import Daemon, run_python

MiB = 1 << 20


def test_status(client: graphpool.Client) -> None:
    st = client.status()
    assert st.backend == "host"
    assert len(st.devices) >= 1
    d = st.devices[0]
    assert d.capacity == 1 << 30 and d.granularity == 2 * MiB
    assert st.fd_socket.endswith(".sock")


def test_attach_allocate_map(client: graphpool.Client, job_id: str) -> None:
    with client.attach(job_id, rank=3, local_rank=1, budget="128MiB") as s:
        assert s.alive and s.session_id > 0 and s.budget == 128 * MiB
        assert s.device.index == 0
        assert any(x.session_id == s.session_id and x.rank == 3 for x in client.status().sessions)
        with s.allocate(3 * MiB, label="capture-pool") as seg:
            assert seg.size == 4 * MiB and seg.requested == 3 * MiB  # rounded up to 2 MiB
            assert seg.handle_kind == "memfd" and seg.fd >= 0
            m = seg.map()
            assert len(m) == seg.size
            m[:5] = b"hello"
            m[-3:] = b"end"
            # A second mapping of the same fd sees the writes.
            fd2 = s.fetch_fd(seg.grant_id)
            try:
                import mmap

                m2 = mmap.mmap(fd2, seg.size)
                assert m2[:5] == b"hello" and m2[-3:] == b"end"
                m2.close()
            finally:
                os.close(fd2)
            grants = s.grants()
            assert [g.grant_id for g in grants] == [seg.grant_id]
            assert grants[0].label == "capture-pool" and grants[0].pid == os.getpid()
            job = client.usage().job(job_id)
            assert job is not None and job.granted == 4 * MiB and job.grants == 1
        assert seg.released and seg.fd == -1
        assert s.grants() == []
        with pytest.raises(graphpool.FailedPrecondition):
            seg.map()
    assert not s.alive
    assert client.usage().job(job_id) is None


def test_close_releases_everything(client: graphpool.Client, job_id: str) -> None:
    s = client.attach(job_id, rank=0)
    segs = [s.allocate("2MiB") for _ in range(3)]
    assert client.usage().job(job_id) is not None
    res = s.close()
    assert res.grants_released == 3 and res.bytes_released == 6 * MiB
    assert all(x.released for x in segs)
    assert client.usage().job(job_id) is None
    assert s.close() == graphpool.DetachResult(0, 0)
    with pytest.raises(graphpool.FailedPrecondition, match="closed"):
        s.allocate("2MiB")


def test_device_by_uuid(client: graphpool.Client, job_id: str) -> None:
    dev = client.status().devices[-1]
    with client.attach(job_id, rank=0, device=dev.uuid) as s:
        assert s.device.uuid == dev.uuid
        with s.allocate("2MiB") as seg:
            assert seg.device_uuid == dev.uuid


def test_invalid_arguments_name_fields(client: graphpool.Client, job_id: str) -> None:
    with pytest.raises(graphpool.InvalidArgument) as ei:
        client.attach("bad job id!", rank=0)
    assert ei.value.field == "job_id"
    with pytest.raises(graphpool.NotFound) as ei:
        client.attach(job_id, rank=0, device="99")
    assert ei.value.field == "device"
    with client.attach(job_id, rank=0) as s:
        with pytest.raises(graphpool.InvalidArgument) as ei:
            s.allocate(0)
        assert ei.value.field == "size_bytes"
        with pytest.raises(graphpool.InvalidArgument) as ei:
            s.allocate("2MiB", label="no spaces allowed")
        assert ei.value.field == "label"
        with pytest.raises(graphpool.InvalidArgument) as ei:
            s.allocate("lots")
        assert ei.value.field == "size_bytes"
    with pytest.raises(graphpool.InvalidArgument) as ei:
        client.attach(job_id, rank=0, budget="12 parsecs")
    assert ei.value.field == "budget_bytes"


def test_double_release_is_not_found(client: graphpool.Client, job_id: str) -> None:
    with client.attach(job_id, rank=0) as s:
        seg = s.allocate("2MiB")
        assert s.release(seg.grant_id) == 2 * MiB
        assert seg.released
        with pytest.raises(graphpool.NotFound) as ei:
            s.release(seg.grant_id)
        assert str(seg.grant_id) in str(ei.value)
        seg.release()  # idempotent locally


def test_grant_of_another_session_is_denied(client: graphpool.Client, job_id: str) -> None:
    with client.attach(job_id, rank=0) as a, client.attach(job_id, rank=1) as b:
        seg = a.allocate("2MiB")
        with pytest.raises(graphpool.PermissionDenied):
            b.release(seg.grant_id)
        seg.release()


def test_session_budget(client: graphpool.Client, job_id: str) -> None:
    with client.attach(job_id, rank=0, budget="8MiB") as s:
        keep = s.allocate("6MiB")
        with pytest.raises(graphpool.CapacityExceeded) as ei:
            s.allocate("4MiB")
        e = ei.value
        assert e.limit == "session-budget"
        assert (e.requested, e.free, e.limit_bytes) == (4 * MiB, 2 * MiB, 8 * MiB)
        assert "session-budget" in str(e) and "4 MiB" in str(e) and "2 MiB" in str(e)
        keep.release()


def test_reserve_budget_that_does_not_fit(client: graphpool.Client, job_id: str) -> None:
    with pytest.raises(graphpool.CapacityExceeded) as ei:
        client.attach(job_id, rank=0, budget="2GiB", reserve_budget=True)
    assert ei.value.limit == "device-budget"
    with client.attach(job_id, rank=0, budget="64MiB", reserve_budget=True) as s:
        assert s.reserved == 64 * MiB


def test_foreign_session_from_another_process(daemon: Daemon, client: graphpool.Client, job_id: str) -> None:
    with client.attach(job_id, rank=0) as s:
        seg = s.allocate("2MiB")
        code = """
import sys, graphpool
c = graphpool.Client(sys.argv[1])
sid, gid = int(sys.argv[2]), int(sys.argv[3])
for name, fn in [("allocate", lambda: c.allocate_segment(sid, "2MiB")),
                 ("release", lambda: c.release_segment(sid, gid))]:
    try:
        fn()
        print(name, "allowed")
    except graphpool.PermissionDenied as e:
        print(name, "denied")
"""
        r = run_python(code, daemon.socket, str(s.session_id), str(seg.grant_id))
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\n")[:2] == ["allocate denied", "release denied"]
        # The fd socket refuses another process too.
        code_fd = """
import sys, graphpool
from graphpool.segments import FdChannel
ch = FdChannel(sys.argv[1])
sid, gid = int(sys.argv[2]), int(sys.argv[3])
for name, fn in [("fetch", lambda: ch.fetch(sid, gid)),
                 ("allocate", lambda: ch.allocate(sid, 2 << 20)),
                 ("release", lambda: ch.release(sid, gid))]:
    try:
        fn()
        print(name, "allowed")
    except graphpool.PermissionDenied:
        print(name, "denied")
"""
        r = run_python(code_fd, s.fd_socket, str(s.session_id), str(seg.grant_id))
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\n")[:3] == ["fetch denied", "allocate denied", "release denied"]
        assert [g.grant_id for g in s.grants()] == [seg.grant_id]


def test_segments_take_the_fd_socket_fast_path(
    client: graphpool.Client, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session.allocate and release go over the fd socket (grant and fd in one exchange), not
    over gRPC AllocateSegment/ReleaseSegment; refusals keep their details."""

    def no_grpc(*args: object, **kwargs: object) -> None:
        raise AssertionError("gRPC AllocateSegment/ReleaseSegment used")

    with client.attach(job_id, rank=0, budget="8MiB") as s:
        monkeypatch.setattr(client, "allocate_segment", no_grpc)
        monkeypatch.setattr(client, "release_segment", no_grpc)
        seg = s.allocate("4MiB", label="fast")
        assert (seg.size, seg.handle_kind) == (4 * MiB, "memfd")
        seg.map()[0] = 7
        with pytest.raises(graphpool.CapacityExceeded) as ei:
            s.allocate("6MiB")
        assert ei.value.limit == "session-budget"
        assert (ei.value.requested, ei.value.free) == (6 * MiB, 4 * MiB)
        with pytest.raises(graphpool.InvalidArgument) as e2:
            s.allocate("2MiB", label="no spaces allowed")
        assert e2.value.field == "label"
        assert s.release(seg.grant_id) == 4 * MiB
        with pytest.raises(graphpool.NotFound):
            s.release(seg.grant_id)


def test_many_segments_one_fd_connection(client: graphpool.Client, job_id: str) -> None:
    with client.attach(job_id, rank=0) as s:
        segs = [s.allocate("2MiB", label=f"seg-{i}") for i in range(20)]
        for i, seg in enumerate(segs):
            seg.map()[0] = i
        assert [seg.map()[0] for seg in segs] == list(range(20))
        assert len({seg.grant_id for seg in segs}) == 20
    assert client.usage().job(job_id) is None


def test_node_grants_listing(client: graphpool.Client, job_id: str) -> None:
    with client.attach(job_id, rank=2) as s, s.allocate("2MiB", label="listed") as seg:
        mine = client.grants(job_id=job_id)
        assert [(g.grant_id, g.label, g.rank) for g in mine] == [(seg.grant_id, "listed", 2)]
        assert any(g.grant_id == seg.grant_id for g in client.grants())


def test_job_quota_set_by_admin(client: graphpool.Client, job_id: str) -> None:
    limits = client.set_limits(jobs={job_id: "4MiB"})
    assert graphpool.JobLimit(job_id=job_id, quota=4 * MiB) in limits.jobs
    try:
        with client.attach(job_id, rank=0) as s:
            with pytest.raises(graphpool.CapacityExceeded) as ei:
                s.allocate("6MiB")
            assert ei.value.limit == "job-quota" and ei.value.limit_bytes == 4 * MiB
            s.allocate("4MiB").release()
    finally:
        limits = client.set_limits(jobs={job_id: 0})
    assert all(j.job_id != job_id for j in limits.jobs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank": -1}, "rank"),
        ({"rank": 1 << 32}, "rank"),
        ({"rank": "3"}, "rank"),
        ({"rank": None}, "rank"),  # protobuf would send it as rank 0
        ({"rank": 0, "local_rank": -2}, "local_rank"),
        ({"job_id": 42, "rank": 0}, "job_id"),
    ],
)
def test_attach_checks_its_arguments(
    client: graphpool.Client, job_id: str, kwargs: dict[str, object], field: str
) -> None:
    """Malformed arguments are InvalidArgument naming the field, not protobuf's bare
    ValueError/TypeError, and nothing is attached."""
    args: dict[str, object] = {"job_id": job_id, **kwargs}
    with pytest.raises(graphpool.InvalidArgument) as ei:
        client.attach(**args)  # type: ignore[arg-type]
    assert ei.value.field == field
    assert not any(s.job_id == job_id for s in client.status().sessions)


def test_session_calls_check_their_arguments(client: graphpool.Client, job_id: str) -> None:
    with client.attach(job_id, rank=0) as s:
        with pytest.raises(graphpool.InvalidArgument) as ei:
            s.allocate("2MiB", label=3)  # type: ignore[arg-type]
        assert ei.value.field == "label"
        for bad in (-1, 1 << 64, "1"):
            with pytest.raises(graphpool.InvalidArgument) as ei:
                s.release(bad)  # type: ignore[arg-type]
            assert ei.value.field == "grant_id"
            with pytest.raises(graphpool.InvalidArgument) as ei:
                s.fetch_fd(bad)  # type: ignore[arg-type]
            assert ei.value.field == "grant_id"
        assert s.grants() == []


def _segment_fds() -> int:
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:graphpool"):
                n += 1
        except OSError:
            pass
    return n


def test_dropped_segment_closes_its_fd(client: graphpool.Client, job_id: str) -> None:
    """A Segment dropped without release() closes its fd when collected: otherwise the fd
    (and the memfd's memory) outlived even the session, which cannot reach it any more."""
    import gc

    before = _segment_fds()
    with client.attach(job_id, rank=0) as s:
        seg = s.allocate("2MiB")
        assert _segment_fds() == before + 1
        seg.map()[0] = 1  # (mmap keeps a descriptor of its own while mapped)
        del seg
        gc.collect()
        assert _segment_fds() == before
        assert len(s.grants()) == 1  # the grant stays the session's until released or closed
    assert client.usage().job(job_id) is None


class _FailingDriver:
    """Stands in for libcuda: cuMemUnmap fails, the other calls succeed."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        ok = lambda *a: 0  # noqa: E731
        self.lib = SimpleNamespace(
            cuMemUnmap=lambda *a: 700, cuMemAddressFree=ok, cuMemRelease=ok, cuDevicePrimaryCtxRelease_v2=ok
        )

    def check(self, function: str, result: int) -> None:
        if result:
            raise graphpool.CudaError(function, result, "CUDA_ERROR_ILLEGAL_ADDRESS", "illegal address")


def _failing_unmap(seg: graphpool.Segment, monkeypatch: pytest.MonkeyPatch) -> None:
    from graphpool import segments

    drv = _FailingDriver()
    monkeypatch.setattr(segments._Driver, "get", lambda: drv)
    seg._device = segments.DeviceMapping(ptr=1 << 40, size=seg.size, device=0, handle=1, ctx_retained=False)


def test_failed_unmap_still_releases_the_grant(
    client: graphpool.Client, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with client.attach(job_id, rank=0) as s:
        seg = s.allocate("2MiB")
        _failing_unmap(seg, monkeypatch)
        with pytest.raises(graphpool.CudaError, match="cuMemUnmap"):
            seg.release()
        assert seg.released and seg.fd == -1
        assert s.grants() == []
        # The same through Session.release(grant_id).
        seg = s.allocate("2MiB")
        _failing_unmap(seg, monkeypatch)
        with pytest.raises(graphpool.CudaError, match="cuMemUnmap"):
            s.release(seg.grant_id)
        assert seg.released and seg.fd == -1
        assert s.grants() == []


def test_failed_unmap_still_ends_the_session(
    client: graphpool.Client, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = client.attach(job_id, rank=0)
    seg = s.allocate("2MiB")
    other = s.allocate("2MiB")
    _failing_unmap(seg, monkeypatch)
    with pytest.raises(graphpool.CudaError, match="cuMemUnmap"):
        s.close()
    assert seg.released and other.released and other.fd == -1
    assert client.usage().job(job_id) is None
    assert not any(x.job_id == job_id for x in client.status().sessions)
    assert s.close() == graphpool.DetachResult(0, 0)


def test_attach_that_times_out_leaves_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``attached`` event that arrives after attach() gave up must not leave the session
    thread waiting forever for a session that will never exist."""
    import threading
    import time

    from graphpool._proto.graphpool.v1 import graphpool_pb2 as pb

    class LateCall:
        def __init__(self) -> None:
            self.cancelled = threading.Event()

        def __iter__(self) -> object:
            time.sleep(0.3)
            yield pb.SessionEvent(attached=pb.Attached(session_id=7))
            self.cancelled.wait(10)

        def cancel(self) -> bool:
            self.cancelled.set()
            return True

    class Stub:
        def Attach(self, req: object, **kwargs: object) -> LateCall:
            return LateCall()

    c = graphpool.Client("/nonexistent/g.sock", timeout=0.1)
    monkeypatch.setattr(c, "_stubs", lambda: (Stub(), None))
    with pytest.raises(graphpool.DaemonUnavailable, match="no answer to Attach"):
        c.attach("late-job", rank=0)
    deadline = time.monotonic() + 3.0
    while any(t.name == "graphpool-session-late-job-0" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the session thread of a failed attach is still waiting"
        time.sleep(0.02)


def test_fd_socket_failure_is_not_reported_as_a_restart(
    client: graphpool.Client, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the fd socket fails while the daemon and the session's stream are fine, the error
    is the fd socket's, not "the daemon went away ... session is re-attaching"."""
    with client.attach(job_id, rank=0) as s:

        def broken(*args: object, **kwargs: object) -> None:
            raise graphpool.DaemonUnavailable(s.fd_socket, "fd socket: [Errno 13] Permission denied")

        monkeypatch.setattr(s._fds, "allocate", broken)
        with pytest.raises(graphpool.DaemonUnavailable) as ei:
            s.allocate("2MiB")
        assert "Permission denied" in str(ei.value) and "re-attaching" not in str(ei.value)
        assert ei.value.socket_path == s.fd_socket
        assert s.alive and not s.reconnecting
        monkeypatch.undo()
        s.allocate("2MiB").release()


@pytest.mark.parametrize("bad", [False, True, 0, {"deadline": 5.0}])
def test_attach_refuses_a_reconnect_that_is_not_a_policy(
    client: graphpool.Client, job_id: str, bad: object
) -> None:
    """``reconnect=`` is a ReconnectPolicy or None; anything else (a bool meant as "on/off",
    a dict of its fields) is InvalidArgument naming it, before anything is attached."""
    with pytest.raises(graphpool.InvalidArgument, match="ReconnectPolicy") as ei:
        client.attach(job_id, rank=0, reconnect=bad)  # type: ignore[arg-type]
    assert ei.value.field == "reconnect"
    assert not any(s.job_id == job_id for s in client.status().sessions)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"initial_backoff": -0.1}, "initial_backoff"),
        ({"initial_backoff": 0}, "initial_backoff"),  # would retry in a tight loop
        ({"max_backoff": 0.0}, "max_backoff"),
        ({"max_backoff": float("inf")}, "max_backoff"),
        ({"multiplier": float("nan")}, "multiplier"),
        ({"multiplier": 0.5}, "multiplier"),
        ({"deadline": -1.0}, "deadline"),
        ({"deadline": float("inf")}, "deadline"),
        ({"deadline": "600"}, "deadline"),
        ({"deadline": True}, "deadline"),
    ],
)
def test_reconnect_policy_checks_its_numbers(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(graphpool.InvalidArgument, match=f"ReconnectPolicy.{field}") as ei:
        graphpool.ReconnectPolicy(**kwargs)  # type: ignore[arg-type]
    assert ei.value.field == field
    assert graphpool.ReconnectPolicy(deadline=0, multiplier=1) is not None  # the edges are fine


def test_client_close_ends_its_sessions(daemon: Daemon, job_id: str) -> None:
    """A session's stream runs on its client's channel: closing the client ends (detaches)
    its sessions, instead of leaving them re-attaching forever with a dead thread."""
    import time

    for rank in range(3):  # the stream's end races with the channel's close: more than once
        c = daemon.client()
        s = c.attach(job_id, rank=rank)
        seg = s.allocate("2MiB")
        c.close()
        assert not s.alive and not s.reconnecting and not s._thread.is_alive()
        assert seg.released
        with pytest.raises(graphpool.FailedPrecondition, match="closed"):
            s.allocate("2MiB")
        assert s.close() == graphpool.DetachResult(0, 0)
        # The client reconnects when used again; the daemon no longer has the session.
        deadline = time.monotonic() + 5.0
        while c.usage().job(job_id) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.usage().job(job_id) is None
        assert not any(x.job_id == job_id for x in c.status().sessions)
        c.close()


def test_health_is_false_when_the_daemon_does_not_answer(daemon_bin: Path) -> None:
    """A daemon that accepts connections but does not answer (stopped, as a hung one is) is
    unreachable: DaemonUnavailable naming the socket and the timeout, and health() False."""
    import signal
    import time

    d = Daemon(daemon_bin)
    c = graphpool.Client(d.socket, timeout=0.5)
    try:
        assert c.health() is True
        os.kill(d.proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        try:
            assert c.health() is False
            with pytest.raises(graphpool.DaemonUnavailable, match=r"no answer to GetStatus within 0\.5 s") as ei:
                c.status()
            assert ei.value.socket_path == d.socket
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert c.health() is True
    finally:
        c.close()
        d.stop()


def _until(cond: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_release_goes_over_grpc_when_only_the_fd_socket_fails(
    client: graphpool.Client, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release whose fd socket fails while the daemon and the session's stream are fine is
    sent again at once over gRPC: the grant is released when release() returns, not left
    charged until some later call."""
    with client.attach(job_id, rank=0) as s:
        seg, other = s.allocate("2MiB"), s.allocate("4MiB")

        def broken(*args: object, **kwargs: object) -> int:
            raise graphpool.DaemonUnavailable(s.fd_socket, "fd socket: [Errno 13] Permission denied")

        monkeypatch.setattr(s._fds, "release", broken)
        seg.release()
        assert [g.grant_id for g in s.grants()] == [other.grant_id]
        assert s.release(other.grant_id) == 4 * MiB
        assert s.grants() == [] and s.held == ()
        assert s.alive and not s.reconnecting


def test_release_that_no_socket_answers_raises_and_is_retried(
    client: graphpool.Client, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When neither the fd socket nor the gRPC socket answers the release while the session's
    stream stays open (a daemon that accepts connections but does not answer), release()
    raises instead of reporting a release that did not happen; the session's next
    allocate() releases the grant."""
    with client.attach(job_id, rank=0) as s:
        seg = s.allocate("2MiB")

        def broken(*args: object, **kwargs: object) -> int:
            raise graphpool.DaemonUnavailable(s.fd_socket, "fd socket: timed out")

        def silent(*args: object, **kwargs: object) -> int:
            raise graphpool.DaemonUnavailable(client.socket_path, "no answer to ReleaseSegment within 10 s")

        monkeypatch.setattr(s._fds, "release", broken)
        monkeypatch.setattr(client, "release_segment", silent)
        with pytest.raises(graphpool.DaemonUnavailable, match=f"grant {seg.grant_id} .*was not released") as ei:
            seg.release()
        assert "timed out" in str(ei.value) and "no answer to ReleaseSegment" in str(ei.value)
        assert seg.released and s.held == ()
        monkeypatch.undo()
        assert [g.grant_id for g in s.grants()] == [seg.grant_id]  # still charged
        s.allocate("2MiB").release()  # releases it first
        assert s.grants() == []


def test_an_interrupted_attach_leaves_no_session(
    client: graphpool.Client, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt in attach() after the daemon attached (between the first event and
    the session's construction) cancels the stream, so the daemon ends its side, and lets the
    session's thread go instead of leaving it waiting forever."""

    class InterruptedQueue(queue.Queue[Any]):
        def get(self, block: bool = True, timeout: float | None = None) -> Any:
            super().get(block, timeout)  # the attached event has arrived
            raise KeyboardInterrupt

    monkeypatch.setattr(graphpool.client, "queue", SimpleNamespace(Queue=InterruptedQueue, Empty=queue.Empty))
    with pytest.raises(KeyboardInterrupt):
        client.attach(job_id, rank=0)
    monkeypatch.undo()
    name = f"graphpool-session-{job_id}-0"
    assert _until(lambda: not any(t.name == name for t in threading.enumerate())), "the thread is still waiting"
    assert _until(lambda: not any(x.job_id == job_id for x in client.status().sessions)), "the daemon kept it"
    with client.attach(job_id, rank=0) as s:  # the client works as before
        assert s.alive


def test_close_while_another_thread_allocates(client: graphpool.Client, job_id: str) -> None:
    """close() racing an allocate() of another thread: the session still ends (it is not left
    attached by an error about the segments changing under it), and the allocation that lost
    the race raises FailedPrecondition, its grant gone with the session."""
    s = client.attach(job_id, rank=0)
    held = s.allocate("2MiB")
    go, done = threading.Event(), threading.Event()
    real = s._fds.allocate
    result: list[object] = []

    def slow(*args: Any) -> Any:
        go.wait(10)  # until close() is under way
        return real(*args)

    def other() -> None:
        try:
            result.append(s.allocate("2MiB"))
        except Exception as e:  # noqa: BLE001 - reported to the test
            result.append(e)
        done.set()

    s._fds.allocate = slow  # type: ignore[method-assign]
    t = threading.Thread(target=other)
    t.start()

    class Racing(weakref.WeakValueDictionary[int, Any]):
        """Lets the other thread's allocation land while close() goes over the segments."""

        def values(self) -> Iterator[Any]:  # type: ignore[override]
            for v in super().values():
                go.set()
                done.wait(0.5)  # it lands now, unless close() keeps it out meanwhile
                yield v

    racing = Racing()
    racing.update(s._segments)
    s._segments = racing
    s.close()
    t.join(10)
    assert len(result) == 1 and isinstance(result[0], graphpool.FailedPrecondition), result
    assert not s.alive and held.released
    assert _until(lambda: not any(x.job_id == job_id for x in client.status().sessions)), "still attached"
    assert client.usage().job(job_id) is None


def test_low_level_calls_check_their_fields(client: graphpool.Client, job_id: str) -> None:
    """The low-level calls refuse malformed arguments with InvalidArgument naming the field,
    not protobuf's bare ValueError/TypeError/AttributeError."""
    from graphpool._proto.graphpool.v1 import plan_pb2

    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: client.allocate_segment(-1, "2MiB"), "session_id"),
        (lambda: client.allocate_segment(1, "2MiB", label=3), "label"),  # type: ignore[arg-type]
        (lambda: client.release_segment(1, "7"), "grant_id"),  # type: ignore[arg-type]
        (lambda: client.release_segment(None, 7), "session_id"),  # type: ignore[arg-type]
        (lambda: client.detach(1 << 64), "session_id"),
        (lambda: client.plan_capture(1, {"time_budget_ms": 5}), "input"),
        (lambda: client.plan_capture(1, plan_pb2.PlanInput(), reserve="yes"), "reserve"),  # type: ignore[arg-type]
        (lambda: client.grants(job_id=5), "job_id"),  # type: ignore[arg-type]
        (lambda: client.set_limits(jobs={7: "1GiB"}), "jobs[0].job_id"),  # type: ignore[dict-item]
        (lambda: client.set_limits(ranks={"job": "1GiB"}), "ranks[0]"),  # type: ignore[dict-item]
        (lambda: client.set_limits(ranks={("job", -1): "1GiB"}), "ranks[0].rank"),
        (lambda: client.set_limits(devices={0: "1GiB", 1.5: "1GiB"}), "devices[1].device_index"),  # type: ignore[dict-item]
    ]
    for call, field in cases:
        with pytest.raises(graphpool.InvalidArgument) as ei:
            call()
        assert ei.value.field == field, (field, ei.value)
    with client.attach(job_id, rank=0) as s:
        with pytest.raises(graphpool.InvalidArgument) as ei:
            s.plan_capture("not a plan")
        assert ei.value.field == "input" and s.alive


def test_fd_socket_errors_name_the_fd_socket_and_its_daemon(
    client: graphpool.Client, job_id: str, tmp_path: Path
) -> None:
    """An unreachable fd socket is reported as the daemon's fd socket, with the gRPC socket of
    its daemon and how to check it, not as a socket to start graphpoold on."""
    with client.attach(job_id, rank=0) as s:
        missing = str(tmp_path / "fd.sock")
        s._fds.close()
        s._fds.path = missing
        with pytest.raises(graphpool.DaemonUnavailable) as ei:
            s.allocate("2MiB")
        e = ei.value
        assert e.socket_path == missing and e.fd_socket and e.daemon_socket == client.socket_path
        msg = str(e)
        assert f"fd socket {missing} of the daemon at {client.socket_path}" in msg, msg
        assert f"graphpool --socket {client.socket_path} health" in msg, msg
        assert "graphpoold --socket" not in msg and "GRAPHPOOL_SOCKET" not in msg, msg
