"""The native allocator shim through ``graphpool._shim``, against a real daemon (host backend).

Each test runs in a fresh interpreter: the shim's sessions belong to the process.
"""

from __future__ import annotations

import textwrap

import pytest

from gp_helpers import Daemon, run_python
from graphpool._native import native_path

pytestmark = pytest.mark.skipif(native_path() is None, reason="the native shim is not installed")


def _run(code: str, *args: str) -> str:
    r = run_python(textwrap.dedent(code), *args)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_last_error_is_per_thread_and_failures_are_counted(daemon: Daemon, job_id: str) -> None:
    """A refusal on one thread is that thread's last error, not another's; the process's
    failure count and latest allocation error see it from any thread (autograd's device
    threads make the backward pass's requests)."""
    out = _run(
        """
        import sys, threading
        import graphpool
        from graphpool import _shim

        MIB = 1 << 20
        _shim.configure(socket=sys.argv[1], job_id=sys.argv[2], rank=0, local_rank=0, device=0,
                        daemon_device="0", budget_bytes=8 * MIB, reserve_budget=False)
        p = _shim.alloc(6 * MIB, 0)
        failures = _shim.alloc_failures()
        seen = []

        def refused():
            try:
                _shim.alloc(4 * MIB, 0)
            except graphpool.CapacityExceeded:
                seen.append(_shim.last_error()["kind"])

        t = threading.Thread(target=refused)
        t.start()
        t.join()
        assert seen == ["capacity"], seen
        assert _shim.last_error() is None, _shim.last_error()
        assert _shim.alloc_failures() == failures + 1
        assert _shim.last_alloc_error()["kind"] == "capacity"
        _shim.free(p, 6 * MIB, 0)
        assert _shim.release_device(0)
        print("ok")
        """,
        daemon.socket,
        job_id,
    )
    assert out == "ok"


def test_a_released_session_ends_with_its_last_segment(daemon: Daemon, job_id: str) -> None:
    """release_device with a segment mapped leaves the session open until that segment is
    freed; keep_device cancels the end."""
    out = _run(
        """
        import sys
        from graphpool import _shim

        MIB = 1 << 20
        def configure():
            _shim.configure(socket=sys.argv[1], job_id=sys.argv[2], rank=0, local_rank=0,
                            device=0, daemon_device="0", budget_bytes=0, reserve_budget=False)

        configure()
        p = _shim.alloc(2 * MIB, 0)
        assert not _shim.release_device(0)
        assert _shim.session_info(0) is not None
        _shim.free(p, 2 * MIB, 0)
        assert _shim.session_info(0) is None, "the last free ends it"

        configure()
        p = _shim.alloc(2 * MIB, 0)
        assert not _shim.release_device(0)
        assert _shim.keep_device(0)
        _shim.free(p, 2 * MIB, 0)
        assert _shim.session_info(0) is not None, "kept"
        assert _shim.release_device(0)
        assert not _shim.keep_device(0)
        print("ok")
        """,
        daemon.socket,
        job_id,
    )
    assert out == "ok"


def test_unreachable_daemon_names_the_socket_the_shim_tried(tmp_path: object) -> None:
    """configure() without a socket connects where GRAPHPOOL_SOCKET says: its refusal, and
    the shim's later errors, name that socket, not an empty path."""
    out = _run(
        """
        import os, sys
        os.environ["GRAPHPOOL_SOCKET"] = sys.argv[1]
        import graphpool
        from graphpool import _shim

        try:
            _shim.configure(socket=None, job_id="j", rank=0, local_rank=0, device=0,
                            daemon_device="0", budget_bytes=0, reserve_budget=False)
        except graphpool.DaemonUnavailable as e:
            print(e.socket_path == sys.argv[1], f"not reachable at {sys.argv[1]} (" in str(e))
        e = _shim.error_from_shim({"kind": "unavailable", "message": "graphpool shim: restarting"})
        print(type(e).__name__, e.socket_path == sys.argv[1])
        """,
        f"{tmp_path}/missing/g.sock",
    )
    assert out.splitlines() == ["True True", "DaemonUnavailable True"]
