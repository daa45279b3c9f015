"""A session survives a daemon restart: SIGKILL graphpoold while the session holds segments,
start a new one on the same socket, and the session re-attaches by itself, declaring its
grants; the new daemon's usage equals the old one's."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import graphpool
from gp_helpers import Daemon, RestartableDaemon, run_python
from graphpool.session import Reattached, ReconnectPolicy

MiB = 1 << 20


def _wait(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_session_reattaches_after_daemon_restart(daemon_bin: Path, job_id: str) -> None:
    d = RestartableDaemon(daemon_bin)
    client = graphpool.Client(d.socket, timeout=5.0)
    try:
        s = client.attach(job_id, rank=3, local_rank=1, budget="256MiB")
        events: list[tuple[str, object]] = []
        reattached = threading.Event()
        reattached_at: list[float] = []

        def on_event(kind: str, value: object) -> None:
            events.append((kind, value))
            if kind == "reattached":
                reattached_at.append(time.monotonic())
                reattached.set()

        s.add_listener(on_event)
        segs = [s.allocate("4MiB", label=f"pool-{i}") for i in range(3)]
        buf = segs[0].map()
        buf[0:4] = b"gpok"
        before = client.usage()
        assert before.granted == 12 * MiB
        old_instance, old_sid = s.daemon_instance, s.session_id
        ids = [g.grant_id for g in segs]

        d.kill()
        # The mapping outlives the daemon.
        buf[4:8] = b"live"
        assert bytes(buf[0:8]) == b"gpoklive"
        _wait(lambda: s.reconnecting, 5.0, "the session to notice the daemon went away")
        assert not s.alive
        assert ("disconnected" in [k for k, _ in events])

        # Calls during the outage wait for the re-attach, then fail cleanly.
        client.timeout = 0.3
        with pytest.raises(graphpool.DaemonUnavailable, match="re-attaching"):
            s.allocate("2MiB")
        client.timeout = 5.0

        t_start = time.monotonic()
        d.start()
        t_ready = time.monotonic()
        assert reattached.wait(10.0), f"no re-attach; events: {events}\n{d.log()}"
        recovery = reattached_at[0] - t_start
        print(
            f"\nrestart recovery: daemon start -> session re-attached {recovery * 1000:.0f} ms "
            f"(daemon ready after {(t_ready - t_start) * 1000:.0f} ms)"
        )
        assert recovery < 5.0

        info = next(v for k, v in events if k == "reattached")
        assert isinstance(info, Reattached)
        assert sorted(info.adopted) == sorted(ids) and info.unadopted == ()
        assert info.previous_session_id == old_sid
        assert s.alive and not s.reconnecting and s.reattaches == 1
        assert s.daemon_instance != old_instance and s.session_id == info.session_id != old_sid
        assert sorted(g.grant_id for g in s.adopted) == sorted(ids)

        # The new daemon's ledger equals the old one's.
        after = client.usage()
        assert after == before, f"{after} != {before}"
        job = after.job(job_id)
        assert job is not None and (job.granted, job.grants, job.sessions) == (12 * MiB, 3, 1)
        rank = next(r for r in after.ranks if r.job_id == job_id)
        assert (rank.rank, rank.granted, rank.grants) == (3, 12 * MiB, 3)
        listed = s.grants()
        assert sorted(g.grant_id for g in listed) == sorted(ids)
        assert all(g.adopted and g.session_id == s.session_id for g in listed)
        assert {g.label for g in listed} == {"pool-0", "pool-1", "pool-2"}

        # Releasing an adopted grant works after the restart; the mapping keeps working.
        segs[1].release()
        u = client.usage()
        assert u.granted == 8 * MiB and u.job(job_id) is not None
        assert bytes(buf[0:8]) == b"gpoklive"
        # New segments come from the new daemon, with fds.
        extra = s.allocate("2MiB", label="after")
        extra.map()[0:1] = b"x"
        assert client.usage().granted == 10 * MiB
        extra.release()

        res = s.close()
        assert res.grants_released == 2 and res.bytes_released == 8 * MiB
        assert client.usage().granted == 0
        assert client.usage().job(job_id) is None
        assert segs[0].released  # close unmaps the local segments
    finally:
        client.close()
        d.stop()


def test_releases_during_the_outage_are_not_declared(daemon_bin: Path, job_id: str) -> None:
    d = RestartableDaemon(daemon_bin)
    client = graphpool.Client(d.socket, timeout=5.0)
    try:
        s = client.attach(job_id, rank=0)
        a, b = s.allocate("2MiB"), s.allocate("6MiB")
        d.kill()
        _wait(lambda: s.reconnecting, 5.0, "the disconnect")
        b.release()  # local only: the new daemon never hears of it
        assert [g.grant_id for g in s.held] == [a.grant_id]
        d.start()
        _wait(lambda: s.alive, 10.0, "the re-attach")
        assert client.usage().granted == 2 * MiB
        a.release()
        assert client.usage().granted == 0
        s.close()
    finally:
        client.close()
        d.stop()


def test_close_while_reconnecting_and_no_reconnect_policy(daemon_bin: Path, job_id: str) -> None:
    d = RestartableDaemon(daemon_bin)
    client = graphpool.Client(d.socket, timeout=5.0)
    try:
        s = client.attach(job_id, rank=0, reconnect=ReconnectPolicy(max_backoff=0.1))
        plain = client.attach(job_id, rank=1, reconnect=None)
        s.allocate("2MiB")
        d.kill()
        _wait(lambda: s.reconnecting, 5.0, "the disconnect")
        _wait(lambda: "ended" in repr(plain), 5.0, "the session without reconnect to end")
        with pytest.raises(graphpool.FailedPrecondition):
            plain.allocate("2MiB")
        t = time.monotonic()
        assert s.close() == graphpool.DetachResult(0, 0)
        assert time.monotonic() - t < 2.5
        assert not s._thread.is_alive()
        d.start()
        time.sleep(0.3)
        assert client.usage().granted == 0 and client.status().sessions == ()
    finally:
        client.close()
        d.stop()


def test_gives_up_after_the_deadline(daemon_bin: Path, job_id: str) -> None:
    d = RestartableDaemon(daemon_bin)
    client = graphpool.Client(d.socket, timeout=2.0)
    try:
        s = client.attach(job_id, rank=0, reconnect=ReconnectPolicy(max_backoff=0.05, deadline=0.5))
        ended = threading.Event()
        s.add_listener(lambda k, v: ended.set() if k == "ended" else None)
        d.kill()
        assert ended.wait(5.0)
        with pytest.raises(graphpool.FailedPrecondition, match="did not come back"):
            s.allocate("2MiB")
        s.close()
    finally:
        client.close()
        d.stop()


def test_forked_child_does_not_reattach_the_parents_session(daemon_bin: Path, job_id: str) -> None:
    """The child of a process whose session re-attached never touches the parent's channel
    or session; the parent keeps its re-attached session."""
    d = RestartableDaemon(daemon_bin)
    try:
        code = f"""
import os, sys, time
import graphpool
c = graphpool.Client({d.socket!r}, timeout=5.0)
s = c.attach({job_id!r}, rank=0)
seg = s.allocate("2MiB")
print("ready", flush=True)
sys.stdin.readline()  # the test restarts the daemon meanwhile
deadline = time.monotonic() + 10
while not s.alive and time.monotonic() < deadline:
    time.sleep(0.01)
assert s.alive, s
pid = os.fork()
if pid == 0:
    try:
        s.allocate("2MiB")
        os._exit(3)
    except graphpool.FailedPrecondition:
        os._exit(0)
_, st = os.waitpid(pid, 0)
assert os.WEXITSTATUS(st) == 0, st
assert c.usage().granted == 2 * 1024 * 1024
seg.release()
s.close()
print("ok", flush=True)
"""
        import subprocess
        import sys

        from gp_helpers import CLIENT

        p = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"PYTHONPATH": str(CLIENT / "src"), "PATH": "/usr/bin:/bin"},
        )
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline().strip() == "ready"
        d.kill()
        d.start()
        p.stdin.write("\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=20)
        assert p.returncode == 0 and "ok" in out, err
        assert run_python("print(1)").returncode == 0
    finally:
        d.stop()


def test_a_reattach_attempt_that_raises_anything_is_a_failed_attempt(
    daemon: Daemon, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attempt that fails with something else than a GraphpoolError (a closed channel's
    ``ValueError: Channel closed!``) is one more failed attempt: the session keeps trying until
    its deadline and then ends, instead of its thread dying with the session re-attaching."""
    client = daemon.client()
    try:
        s = client.attach(
            job_id, rank=0, reconnect=ReconnectPolicy(initial_backoff=0.02, max_backoff=0.05, deadline=0.5)
        )
        attempts: list[object] = []

        def closed_channel(req: object) -> None:
            attempts.append(req)
            raise ValueError("Channel closed!")

        monkeypatch.setattr(s, "_attach_once", closed_channel)
        ended = threading.Event()
        s.add_listener(lambda k, v: ended.set() if k == "ended" else None)
        s._call_obj.cancel()  # the stream ends (CANCELLED) as when the daemon goes away
        assert ended.wait(5.0)
        s._thread.join(2.0)
        assert len(attempts) >= 2 and not s.reconnecting and not s._thread.is_alive()
        with pytest.raises(graphpool.FailedPrecondition, match="Channel closed"):
            s.allocate("2MiB")
        s.close()
    finally:
        client.close()


def test_a_failing_session_thread_ends_the_session(
    daemon: Daemon, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception in the session's thread ends the session (``"ended"``, calls
    raise FailedPrecondition) and its stream, so the daemon releases its grants too."""
    client = daemon.client()
    try:
        s = client.attach(job_id, rank=0)
        s.allocate("2MiB")

        def broken(ev: object) -> None:
            raise RuntimeError("a bug in the event handler")

        monkeypatch.setattr(s, "_on_event", broken)
        ended = threading.Event()
        s.add_listener(lambda k, v: ended.set() if k == "ended" else None)
        client.set_limits(jobs={job_id: 0})  # broadcasts limits_changed to every session
        assert ended.wait(5.0)
        assert not s.alive and not s.reconnecting
        with pytest.raises(graphpool.FailedPrecondition, match="thread failed.*a bug in the event handler"):
            s.allocate("2MiB")
        _wait(lambda: client.usage().job(job_id) is None, 5.0, "the daemon to end the session")
        assert s.close() == graphpool.DetachResult(0, 0)
    finally:
        client.close()
