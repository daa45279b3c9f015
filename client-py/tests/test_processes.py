"""Processes: fork safety, reclaim after SIGKILL, two processes mapping one grant."""

from __future__ import annotations

import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import graphpool
from gp_helpers import CLIENT, Daemon, run_in_fork

MiB = 1 << 20


def _wait_child(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _python(code: str, *args: str, fork_support: bool) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter (gRPC's fork support is fixed when it is imported).
    An interpreter still running after 100 s prints every thread's stack and exits, so a hang
    fails the test with where it hung, before the 120 s timeout."""
    env = {**os.environ, "PYTHONPATH": str(CLIENT / "src")}
    env["GRPC_ENABLE_FORK_SUPPORT"] = "1" if fork_support else "0"
    code = "import faulthandler; faulthandler.dump_traceback_later(100, exit=True)\n" + code
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120
    )


# A parent with an open session forks a child that attaches a session of its own.
_CHILD_ATTACHES = """
import os, sys, time, graphpool
client = graphpool.Client(sys.argv[1])
job_id = sys.argv[2]
parent = client.attach(job_id, rank=0)
pseg = parent.allocate("2MiB")
pseg.map()[:6] = b"parent"
r, w = os.pipe()
t = time.monotonic()
pid = os.fork()
if pid == 0:  # child
    code = 1
    try:
        os.close(r)
        # The parent's session is not usable here, and says why.
        try:
            parent.allocate("2MiB")
            msg = "parent session usable in child"
        except graphpool.FailedPrecondition as e:
            assert "after fork" in str(e)
            with client.attach(job_id, rank=1) as child:
                assert child.session_id != parent.session_id
                with child.allocate("4MiB") as seg:
                    seg.map()[:5] = b"child"
                    assert seg.map()[:5] == b"child"
                    assert len(child.grants()) == 1
            msg = "ok"
            code = 0
        os.write(w, msg.encode())
    except BaseException as e:  # report anything to the parent
        os.write(w, repr(e).encode())
    finally:
        os._exit(code)
forked = time.monotonic() - t
os.close(w)
out = b""
while chunk := os.read(r, 4096):
    out += chunk
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0 and out == b"ok", out.decode()
# The parent's channel and session still work.
assert parent.alive
seg2 = parent.allocate("2MiB")
assert pseg.map()[:6] == b"parent"
assert {g.grant_id for g in parent.grants()} == {pseg.grant_id, seg2.grant_id}
# Twice more, each child with its own session on the inherited client.
pids = []
for rank in (10, 11):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with client.attach(job_id, rank=rank) as s:
                s.allocate("2MiB")
                code = 0 if len(s.grants()) == 1 else 2
        finally:
            os._exit(code)
    pids.append(pid)
assert [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids] == [0, 0]
parent.close()
print(f"ok fork {forked * 1e3:.0f} ms")
"""


def test_with_grpc_fork_support_a_forked_child_attaches_its_own_session(daemon: Daemon, job_id: str) -> None:
    r = _python(_CHILD_ATTACHES, daemon.socket, job_id, fork_support=True)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr


def test_by_default_a_fork_is_fast_and_a_child_cannot_open_grpc(
    daemon: Daemon, daemon_bin: Path, job_id: str
) -> None:
    """gRPC's fork support is off unless asked for: forking a rank with an open session (its
    DataLoader workers) takes milliseconds, not gRPC's pre-fork wait of ~1 s, and a child that
    tries to reach the daemon over gRPC is told how to, instead of risking an abort."""
    timing = subprocess.run(
        [sys.executable, str(CLIENT.parent / "bench/fork/fork_timing.py"), "--graphpoold", str(daemon_bin),
         "--forks", "5", "--modes", "0", "--timeout", "60"],
        capture_output=True, text=True, timeout=120,
    )
    # Every wait of the benchmark is bounded (60 s, 10 s per forked child, 15 s for its
    # daemon to stop), so a hang fails here with what hung (every thread's stack) instead of
    # the outer timeout.
    # "GRPC_ENABLE_FORK_SUPPORT=0: 5 forks: median 0.9 ms, p90 1.0 ms, max 2.2 ms"
    assert timing.returncode == 0 and "median" in timing.stdout, timing.stdout + timing.stderr
    median_ms = float(timing.stdout.split("median ")[1].split()[0])
    assert median_ms < 500, f"gRPC's pre-fork wait is back: {timing.stdout}"
    code = """
import os, sys, graphpool
client = graphpool.Client(sys.argv[1])
s = client.attach(sys.argv[2], rank=0)
seg = s.allocate("2MiB")
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    msg = "attached"
    try:
        graphpool.Client(sys.argv[1]).attach(sys.argv[2], rank=1)
    except graphpool.FailedPrecondition as e:
        msg = str(e)
    os.write(w, msg.encode())
    os._exit(0)
os.close(w)
said = os.read(r, 4096).decode()
os.waitpid(pid, 0)
assert "GRPC_ENABLE_FORK_SUPPORT=1" in said and "spawn" in said, said
assert s.alive and len(s.grants()) == 1
print("ok")
"""
    r = _python(code, daemon.socket, job_id, fork_support=False)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr


def test_grants_reclaimed_after_sigkill(daemon: Daemon, client: graphpool.Client, job_id: str) -> None:
    code = """
import sys, time, graphpool
c = graphpool.Client(sys.argv[1])
s = c.attach(sys.argv[2], rank=0)
segs = [s.allocate("8MiB") for _ in range(3)]
for seg in segs:
    seg.map()[0] = 1
print("ready", flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, daemon.socket, job_id],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(CLIENT / "src")},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        job = client.usage().job(job_id)
        assert job is not None and job.granted == 24 * MiB and job.grants == 3
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        while client.usage().job(job_id) is not None:
            assert time.monotonic() - killed < 1.0, "grants of a killed process not reclaimed within 1 s"
            time.sleep(0.01)
        assert not any(s.job_id == job_id for s in client.status().sessions)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_processes_map_one_grant_fork(client: graphpool.Client, job_id: str) -> None:
    with client.attach(job_id, rank=0) as s, s.allocate("4MiB") as seg:
        m = seg.map()
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                # The inherited fd is the same memory; map it anew in this process.
                mc = mmap.mmap(seg.fd, seg.size)
                mc[100:105] = b"child"
                os.write(to_parent_w, b"w")
                assert os.read(to_child_r, 1) == b"w"
                code = 0 if mc[200:206] == b"parent" else 2
                mc.close()
            finally:
                os._exit(code)
        assert os.read(to_parent_r, 1) == b"w"
        assert m[100:105] == b"child"
        m[200:206] = b"parent"
        os.write(to_child_w, b"w")
        assert _wait_child(pid) == 0
        for fd in (to_child_r, to_child_w, to_parent_r, to_parent_w):
            os.close(fd)


def test_two_processes_map_one_grant_scm_rights(client: graphpool.Client, job_id: str) -> None:
    code = """
import mmap, socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
size = int(msg)
m = mmap.mmap(fds[0], size)
m[0:5] = b"child"
sock.sendall(b"w")
assert sock.recv(1) == b"w"
print(m[size - 6:size].decode(), flush=True)
"""
    with client.attach(job_id, rank=0) as s, s.allocate("2MiB") as seg:
        m = seg.map()
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdout=subprocess.PIPE,
            text=True,
        )
        theirs.close()
        socket.send_fds(ours, [str(seg.size).encode()], [seg.fd])
        assert ours.recv(1) == b"w"
        assert m[0:5] == b"child"
        m[seg.size - 6 : seg.size] = b"parent"
        ours.sendall(b"w")
        out, _ = proc.communicate(timeout=20)
        ours.close()
        assert proc.returncode == 0
        assert out.strip() == "parent"


def test_forked_child_does_not_unmap_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA mappings and contexts are not inherited through fork: releasing an inherited
    device segment in the child drops its fd only, without calling the CUDA driver (which
    would act on the parent's behalf, or fail) and without releasing the parent's grant."""
    from graphpool import segments
    from graphpool.info import GrantInfo

    def no_driver() -> object:
        raise AssertionError("the CUDA driver was called in a forked child")

    released: list[int] = []
    grant = GrantInfo(
        grant_id=9, session_id=1, size=2 * MiB, requested=2 * MiB, device_uuid="GPU-test",
        device_index=0, label="", job_id="j", rank=0, pid=os.getpid(), created_unix_seconds=0.0,
        adopted=False, handle_kind=segments.HANDLE_CUDA,
    )
    r, w = os.pipe()
    seg = segments.Segment(grant, os.dup(r), segments.HANDLE_CUDA, released.append)
    seg._device = segments.DeviceMapping(ptr=1 << 40, size=2 * MiB, device=0, handle=1, ctx_retained=False)
    monkeypatch.setattr(segments._Driver, "get", no_driver)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            seg.release()
            code = 0 if seg.released and seg.fd == -1 and not released else 2
        except BaseException as e:  # report it to the parent
            os.write(w, repr(e).encode())
        finally:
            os._exit(code)
    os.close(w)
    assert _wait_child(pid) == 0, os.read(r, 4096).decode()
    os.close(r)
    # In the parent the mapping is still there, and the grant still held.
    assert not seg.released and seg._device is not None and released == []
    seg._device = None
    seg.release()
    assert released == [9]


def test_map_device_in_a_forked_child_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child can use neither the parent's device mapping (its pointer means nothing there)
    nor the CUDA driver on an inherited segment: ``map_device()`` is FailedPrecondition saying
    why, whether the parent had mapped the segment or not, and the driver is never called."""
    from graphpool import segments
    from graphpool.info import GrantInfo

    def no_driver() -> object:
        raise AssertionError("the CUDA driver was called in a forked child")

    grant = GrantInfo(
        grant_id=9, session_id=1, size=2 * MiB, requested=2 * MiB, device_uuid="GPU-test",
        device_index=0, label="", job_id="j", rank=0, pid=os.getpid(), created_unix_seconds=0.0,
        adopted=False, handle_kind=segments.HANDLE_CUDA,
    )
    r, w = os.pipe()
    mapped = segments.Segment(grant, os.dup(r), segments.HANDLE_CUDA, None)
    mapped._device = segments.DeviceMapping(ptr=1 << 40, size=2 * MiB, device=0, handle=1, ctx_retained=False)
    unmapped = segments.Segment(grant, os.dup(r), segments.HANDLE_CUDA, None)
    monkeypatch.setattr(segments._Driver, "get", no_driver)

    def in_child() -> None:
        for seg in (mapped, unmapped):
            with pytest.raises(graphpool.FailedPrecondition, match="not inherited through fork"):
                seg.map_device()

    try:
        assert run_in_fork(in_child) == "ok"
        assert mapped.map_device() is mapped._device  # the parent's own mapping, as before
    finally:
        mapped._device = None
        for fd in (r, w):
            os.close(fd)


def test_received_fds_are_close_on_exec(client: graphpool.Client, job_id: str) -> None:
    """Fds that come from the daemon (a segment's, a fetched one) do not leak into programs
    this process executes."""
    with client.attach(job_id, rank=0) as s, s.allocate("2MiB") as seg:
        assert not os.get_inheritable(seg.fd)
        fd = s.fetch_fd(seg.grant_id)
        try:
            assert not os.get_inheritable(fd)
        finally:
            os.close(fd)


@contextmanager
def _held_by_another_thread(lock: Any) -> Iterator[None]:
    """Holds ``lock`` in another thread for the duration of the block (as a thread of the
    parent may be holding it when some other thread forks)."""
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            done.wait(30)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        done.set()
        t.join(10)


def test_segment_release_in_child_while_a_parent_thread_holds_its_lock(
    client: graphpool.Client, job_id: str
) -> None:
    with client.attach(job_id, rank=0) as s:
        seg = s.allocate("2MiB")
        seg.map()[:6] = b"parent"
        with _held_by_another_thread(seg._lock):
            out = run_in_fork(seg.release, timeout=5)
        assert out == "ok"
        # The parent's segment and grant are untouched.
        assert not seg.released and seg.map()[:6] == b"parent"
        assert [g.grant_id for g in s.grants()] == [seg.grant_id]
        seg.release()
        assert s.grants() == []


def test_session_close_in_child_while_a_parent_thread_holds_its_events(
    client: graphpool.Client, job_id: str
) -> None:
    """A session's events hold locks, which a thread of the parent may hold at fork time (the
    session's thread waits on them): close() in the child does not touch them (the session is
    the parent's), and the child's copies are new, so nothing there hangs on them."""
    s = client.attach(job_id, rank=0)
    try:

        def in_child() -> None:
            assert s.close() == graphpool.DetachResult(0, 0)
            s._stop.set()
            s._attached.wait(0.1)

        with _held_by_another_thread(s._stop._cond), _held_by_another_thread(s._attached._cond):
            out = run_in_fork(in_child, timeout=5)
        assert out == "ok"
        assert s.alive and any(x.session_id == s.session_id for x in client.status().sessions)
    finally:
        s.close()


def test_fd_channel_in_child_while_a_parent_thread_holds_its_lock(
    client: graphpool.Client, job_id: str
) -> None:
    from graphpool.segments import FdChannel

    with client.attach(job_id, rank=0) as s, s.allocate("2MiB") as seg:
        ch = FdChannel(s.fd_socket, timeout=5.0)
        fd, _ = ch.fetch(s.session_id, seg.grant_id)  # connected in the parent
        os.close(fd)

        def in_child() -> None:
            # A connection of its own, which the daemon refuses: the grant is the parent's.
            with pytest.raises(graphpool.PermissionDenied):
                ch.fetch(s.session_id, seg.grant_id)
            ch.close()

        with _held_by_another_thread(ch._lock):
            out = run_in_fork(in_child, timeout=5)
        assert out == "ok"
        fd, _ = ch.fetch(s.session_id, seg.grant_id)  # the parent's channel still works
        os.close(fd)
        ch.close()


def test_shim_loader_in_child_while_a_parent_thread_holds_its_lock(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from graphpool import _shim

    monkeypatch.setattr(_shim, "_lib", None)
    monkeypatch.setenv("GRAPHPOOL_SHIM", str(tmp_path / "missing.so"))

    def in_child() -> None:
        with pytest.raises(FileNotFoundError, match="GRAPHPOOL_SHIM"):
            _shim.load()

    with _held_by_another_thread(_shim._lock):
        out = run_in_fork(in_child, timeout=5)
    assert out == "ok"


class _ParentOnly:
    """Stands in for a CUDA graph or a graphpool pool: using it in a forked child fails, as
    CUDA calls do there."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.pid = os.getpid()
        self.log = log

    def _call(self, what: str) -> None:
        if os.getpid() != self.pid:
            raise RuntimeError(f"{what} called in a forked child")
        self.log.append((what, os.getpid()))

    def reset(self) -> None:
        self._call("reset")

    def release(self) -> None:
        self._call("release")


def test_graphed_schedule_close_in_child_only_drops_references() -> None:
    """``GraphedSchedule.close()`` in a forked child leaves the parent's graphs and pools
    alone (no graph reset, no pool release); the parent closes them as usual."""
    from graphpool.capture import CaptureStats, GraphedSchedule
    from graphpool.capture.layers import _Layer
    from graphpool.schedule import Schedule

    schedule = Schedule.one_f_one_b(pp_size=2, pp_rank=0, num_microbatches=4)
    nslots = schedule.slots_per_chunk[0]
    log: list[tuple[str, int]] = []
    lay = _Layer(0, 0, object(), nslots, True, True)
    lay.fwd = [_ParentOnly(log) for _ in range(nslots)]
    lay.bwd = [_ParentOnly(log) for _ in range(nslots)]
    pool = _ParentOnly(log)
    gs = GraphedSchedule(schedule, [[lay]], [("fwd/c0/s0", pool), ("bwd", pool)], CaptureStats())

    def in_child() -> None:
        gs.close()
        assert gs._pools == [] and gs._flat == [] and len(gs) == 0
        gs.close()  # idempotent
        assert log == []

    assert run_in_fork(in_child) == "ok"
    assert log == []
    gs.close()
    assert sorted(what for what, _ in log) == ["release"] + ["reset"] * (2 * nslots)
