"""``graphpool.torch.MemPool``'s own logic, with stand-ins for torch and for the native shim, so
that it runs without torch or a GPU (the real thing is tested in ``tests/gpu``).

Each test runs in a fresh interpreter (the stand-in ``torch`` module must not leak into other
tests). The stand-in's CUDA calls fail in a forked child, as real CUDA calls do there.
"""

from __future__ import annotations

import textwrap

import pytest

from gp_helpers import Daemon, run_python
from graphpool._native import native_path

#: The stand-in torch (its CUDA calls recorded in ``calls``), then graphpool imported.
TORCH = '''
import contextlib, gc, os, signal, sys, threading, types

PARENT = os.getpid()
calls = []  # (what, pid): every CUDA call, torch pool destruction and shim call

def _cuda(what):
    def call(*args, **kwargs):
        if os.getpid() != PARENT:
            raise RuntimeError(f"Cannot re-initialize CUDA in forked subprocess ({what})")
        calls.append((what, os.getpid()))
    return call

class _TorchPool:
    def __init__(self, allocator):
        self.id = (0, id(self))
    def __del__(self):
        calls.append(("pool destroyed", os.getpid()))

class _PluggableAllocator:
    def __init__(self, path, alloc, free):
        pass
    def allocator(self):
        return object()

torch = types.ModuleType("torch")
torch.device = type("device", (), {})
torch.OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {})
cuda = types.ModuleType("torch.cuda")
cuda.init = _cuda("init")
cuda.synchronize = _cuda("synchronize")
cuda.empty_cache = _cuda("empty_cache")
cuda.current_device = lambda: 0
cuda.device = lambda index: contextlib.nullcontext()
cuda.MemPool = _TorchPool
cuda.memory = types.SimpleNamespace(CUDAPluggableAllocator=_PluggableAllocator)
torch.cuda = cuda
sys.modules["torch"] = torch
sys.modules["torch.cuda"] = cuda

import graphpool
from graphpool import _shim
'''

#: The stand-in shim: its device sessions in ``sessions``, its configure calls in ``configured``.
SHIM = '''
sessions = {}  # device -> session info, as the shim keeps them
ended = set()  # devices whose session ended (the daemon did not come back)
configured = []  # keyword arguments of each configure

def _configure(**kw):
    _cuda("shim configure")()
    configured.append(kw)
    sessions[kw["device"]] = (len(configured), 0, "GPU-standin")
    ended.discard(kw["device"])

def _release_device(device):
    _cuda("shim release_device")()
    sessions.pop(device, None)
    return True

_shim.configure = _configure
_shim.release_device = _release_device
_shim.session_info = lambda device: sessions.get(device)
_shim.keep_device = lambda device: device in sessions and device not in ended
_shim.alloc_failures = lambda: 0
_shim.last_alloc_error = lambda: None
_shim.loaded_path = lambda: "libgraphpool_shim.so"
'''

#: graphpool.torch imported as ``gpt``, and ``in_child``.
POOLS = '''
import graphpool.torch as gpt

def in_child(fn):
    """Runs fn in a forked child; returns "ok", the exception's repr, or "" when the child
    died (SIGALRM ends one that hangs)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        msg = "ok"
        try:
            signal.alarm(10)
            fn()
        except BaseException as e:
            msg = repr(e)
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    out = os.read(r, 4096).decode()
    os.close(r)
    return out
'''

#: Stand-ins for torch and the shim.
STANDIN = TORCH + SHIM + POOLS


def _run(code: str, *args: str, standin: str = STANDIN) -> str:
    r = run_python(standin + textwrap.dedent(code), *args)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_mempool_release_in_forked_child_only_drops_it_locally() -> None:
    out = _run(
        """
        pool = gpt.MemPool(0, budget=None, job_id="j", rank=0)

        def child():
            pool.release()
            gc.collect()
            pool.release()  # idempotent
            mine = [c for c in calls if c[1] == os.getpid()]
            assert mine == [], mine  # no CUDA call, no shim call, the torch pool not destroyed

        print("child:", in_child(child))
        # The parent's pool and the device's daemon session are untouched by the child.
        assert sessions and not pool._released
        pool.release()
        gc.collect()
        whats = [c[0] for c in calls]
        assert "synchronize" in whats and "shim release_device" in whats and "pool destroyed" in whats
        assert not sessions
        print("parent: ok")
        """
    )
    assert out.splitlines() == ["child: ok", "parent: ok"]


def test_mempool_lock_is_fresh_in_a_forked_child() -> None:
    """A pool created in a child does not hang when a thread of the parent held the module's
    lock at fork time (e.g. while another pool attached to the daemon)."""
    out = _run(
        """
        taken, done = threading.Event(), threading.Event()

        def hold():
            with gpt._lock:
                taken.set()
                done.wait(30)

        threading.Thread(target=hold, daemon=True).start()
        assert taken.wait(10)

        def child():
            global PARENT
            PARENT = os.getpid()  # CUDA is the child's own from here on
            pool = gpt.MemPool(0, budget=None, job_id="j", rank=1)
            pool.release()

        print("child:", in_child(child))
        done.set()
        """
    )
    assert out == "child: ok"


def test_mempool_client_may_be_a_session(daemon: Daemon) -> None:
    """``client=`` takes a ``graphpool.Session`` (its client's socket), as capture does, instead
    of falling back to the default socket; something else is a TypeError."""
    out = _run(
        """
        os.environ["GRAPHPOOL_SOCKET"] = "/nonexistent/default.sock"
        client = graphpool.Client(sys.argv[1])
        with client.attach("standin", rank=0) as session:
            pool = gpt.MemPool(0, budget=None, job_id="j", rank=0, client=session)
            assert pool.socket == client.socket_path, pool.socket
            assert configured[-1]["socket"] == client.socket_path, configured
            pool.release()
        pool = gpt.MemPool(0, budget=None, job_id="j", rank=0, client=client)
        assert pool.socket == client.socket_path
        pool.release()
        try:
            gpt.MemPool(0, budget=None, job_id="j", rank=0, client="/some/g.sock")
        except TypeError as e:
            assert "graphpool.Session" in str(e), e
        else:
            raise AssertionError("a client that is neither a Client nor a Session was accepted")
        print("ok")
        """,
        daemon.socket,
    )
    assert out == "ok"


def test_mempool_collected_in_forked_child_is_not_destroyed_there() -> None:
    """A pool the child drops without ``release()`` is collected there: neither its torch pool
    nor the daemon session may be touched (both belong to the parent)."""
    out = _run(
        """
        pool = gpt.MemPool(0, budget=None, job_id="j", rank=0)

        def child():
            global pool
            pool = None
            gc.collect()
            mine = [c for c in calls if c[1] == os.getpid()]
            assert mine == [], mine  # the torch pool not destroyed, no shim call

        print("child:", in_child(child))
        assert sessions
        pool = None
        gc.collect()
        whats = [c[0] for c in calls]
        assert "pool destroyed" in whats and "shim release_device" in whats, whats
        print("parent: ok")
        """
    )
    assert out.splitlines() == ["child: ok", "parent: ok"]


def test_translate_errors_translates_only_the_refusal() -> None:
    """A capacity refusal recorded in the block becomes CapacityExceeded for the errors it
    causes (OutOfMemoryError, or a RuntimeError from capture_end), not for an unrelated
    exception after torch recovered from it (it frees its cache and retries), and never for
    a KeyboardInterrupt."""
    out = _run(
        """
        state = {"err": None}
        _shim.clear_error = lambda: state.update(err=None)
        _shim.last_error = lambda: state["err"]
        refused = {"kind": "capacity", "message": "refused", "limit": "rank-quota"}

        def outcome(exc):
            try:
                with gpt.translate_errors():
                    state["err"] = dict(refused)
                    raise exc
            except BaseException as e:
                return type(e).__name__

        print(outcome(KeyboardInterrupt()))
        print(outcome(ValueError("an unrelated bug")))
        print(outcome(torch.OutOfMemoryError("CUDA out of memory")))
        print(outcome(RuntimeError("CUDA error: operation failed due to a previous error during capture")))

        # Refused on another thread (autograd's device threads make the backward pass's
        # requests): this thread's error is empty, the process counted the failure.
        failures = [0]
        _shim.alloc_failures = lambda: failures[0]
        _shim.last_alloc_error = lambda: dict(refused)

        def elsewhere(exc, failed):
            try:
                with gpt.translate_errors():
                    failures[0] += failed
                    raise exc
            except BaseException as e:
                return type(e).__name__

        print(elsewhere(torch.OutOfMemoryError("CUDA out of memory"), 1))
        print(elsewhere(torch.OutOfMemoryError("CUDA out of memory"), 0))
        """
    )
    assert out.splitlines() == [
        "KeyboardInterrupt", "ValueError", "CapacityExceeded", "CapacityExceeded",
        "CapacityExceeded", "OutOfMemoryError",
    ]


def test_an_ended_session_is_not_reused() -> None:
    """A device session that ended (the daemon did not come back within the reconnect
    deadline) is not reused by a new pool: it opens a new one, with its own budget."""
    out = _run(
        """
        _shim.stats = lambda device: (0, 0)
        first = gpt.MemPool(0, budget="8GiB", job_id="j", rank=0)
        ended.add(0)
        second = gpt.MemPool(0, budget="16GiB", job_id="j", rank=0)
        assert len(configured) == 2 and configured[-1]["budget_bytes"] == 16 << 30, configured
        assert second.stats()["budget_bytes"] == 16 << 30
        first.release()
        second.release()
        print("ok")
        """
    )
    assert out == "ok"


def test_auto_pools_fall_back_only_when_no_daemon_or_shim() -> None:
    """``pools="auto"`` uses torch pools when no daemon answers or the shim is missing, and
    raises any other refusal of the probe (a daemon that refuses this process must not be
    bypassed); ``pools="graphpool"`` raises the absence too."""
    out = _run(
        """
        from graphpool import errors
        from graphpool.capture.memory import _daemon_pool_factory

        def probe(exc, required=False):
            def refuse(**kw):
                raise exc
            _shim.configure = refuse
            try:
                f = _daemon_pool_factory(0, None, None, required=required)
                return "torch pools" if f is None else "factory"
            except Exception as e:
                return type(e).__name__

        print(probe(errors.DaemonUnavailable("/run/g.sock", "no such socket")))
        print(probe(FileNotFoundError("libgraphpool_shim.so is not installed")))
        print(probe(errors.PermissionDenied("uid 1000 is not on the allow-list")))
        print(probe(errors.InvalidArgument("bad job id", field="job_id")))
        print(probe(errors.CapacityExceeded("the reserved budget does not fit")))
        print(probe(errors.DaemonUnavailable("/run/g.sock", "no such socket"), required=True))
        """
    )
    assert out.splitlines() == [
        "torch pools", "torch pools", "PermissionDenied", "InvalidArgument", "CapacityExceeded",
        "DaemonUnavailable",
    ]


def test_make_graphed_callables_checks_pools_first() -> None:
    out = _run(
        """
        from graphpool import capture, errors
        from graphpool.schedule import Schedule
        try:
            capture.make_graphed_callables([], [], schedule=Schedule.one_f_one_b(2, 0, 4), pools="graphpol")
        except errors.InvalidArgument as e:
            print(e.field, "auto" in str(e) and "graphpol'" in str(e))
        """
    )
    assert out == "pools True"


def test_pools_of_a_device_share_one_budget() -> None:
    """All pools of a device share the shim's one daemon session: a later pool that asks
    another budget or reserve_budget is refused, naming the pool that opened the session,
    instead of silently not getting them; one asking the same shares it, and stats() reports
    the session's budget."""
    out = _run(
        """
        _shim.stats = lambda device: (0, 0)
        first = gpt.MemPool(0, budget="8GiB", job_id="j", rank=0, label="first")
        for kwargs, field in (({"budget": "16GiB"}, "budget"), ({"budget": None}, "budget"),
                              ({"budget": "8GiB", "reserve_budget": True}, "reserve_budget")):
            try:
                gpt.MemPool(0, job_id="j", rank=0, label="later", **kwargs)
            except graphpool.InvalidArgument as e:
                assert e.field == field, (e.field, field)
                assert "'first'" in str(e) and "8 GiB" in str(e) and "same" in str(e), str(e)
            else:
                raise AssertionError(f"a pool asking {kwargs} was given the session of 8 GiB")
        same = gpt.MemPool(0, budget=8 << 30, job_id="j", rank=0)
        assert len(configured) == 1
        assert same.stats()["budget_bytes"] == first.stats()["budget_bytes"] == 8 << 30
        same.release()
        first.release()
        # The session ended with its last pool: the next pool opens one with its own budget.
        other = gpt.MemPool(0, budget="16GiB", job_id="j", rank=0)
        assert configured[-1]["budget_bytes"] == 16 << 30 and other.stats()["budget_bytes"] == 16 << 30
        other.release()
        print("ok")
        """
    )
    assert out == "ok"


@pytest.mark.skipif(native_path() is None, reason="the native shim is not installed")
def test_a_refused_pool_leaves_the_device_session_to_end(daemon: Daemon, job_id: str) -> None:
    """A pool refused because it asks the device's open session for another budget does not
    keep that session: when the last pool was released while torch still held a segment (a
    graph alive), the session still ends with that segment's free. Stand-in torch, the real
    shim (host backend)."""
    out = _run(
        """
        MIB = 1 << 20
        sock, job = sys.argv[1], sys.argv[2]
        first = gpt.MemPool(0, budget="64MiB", job_id=job, rank=0, socket=sock, daemon_device="0")
        p = _shim.alloc(2 * MIB, 0)  # a segment torch still holds (a graph is alive)
        first.release()  # the last pool: the session ends with that segment's free
        for kwargs in ({"budget": "128MiB"}, {"budget": "64MiB", "rank": 1}):
            try:
                gpt.MemPool(0, **{"job_id": job, "rank": 0, **kwargs}, socket=sock, daemon_device="0")
            except graphpool.GraphpoolError as e:
                print("refused:", type(e).__name__)
        assert _shim.session_info(0) is not None, "ended before its last segment's free"
        _shim.free(p, 2 * MIB, 0)
        print("after the free:", _shim.session_info(0))
        import time
        client = graphpool.Client(sock)
        deadline = time.monotonic() + 3.0
        while True:  # the daemon sees the session's stream end
            left = [s.session_id for s in client.status().sessions if s.job_id == job]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        print("daemon sessions:", left)
        # A pool asking the same values keeps the session, as before.
        again = gpt.MemPool(0, budget="64MiB", job_id=job, rank=0, socket=sock, daemon_device="0")
        p = _shim.alloc(2 * MIB, 0)
        second = gpt.MemPool(0, budget="64MiB", job_id=job, rank=0, socket=sock, daemon_device="0")
        again.release()
        _shim.free(p, 2 * MIB, 0)
        assert _shim.session_info(0) is not None, "second still uses it"
        second.release()
        print("released:", _shim.session_info(0))
        """,
        daemon.socket,
        job_id,
        standin=TORCH + POOLS,
    )
    assert out.splitlines() == [
        "refused: InvalidArgument",
        "refused: GraphpoolError",
        "after the free: None",
        "daemon sessions: []",
        "released: None",
    ]


def test_release_drops_the_session_reference_when_cuda_fails() -> None:
    """A pool whose release() fails in CUDA (a sticky error of an earlier kernel, say) still
    gives up its reference to the device's session: it is the last pool, so the session
    ends; the error is raised."""
    out = _run(
        """
        pool = gpt.MemPool(0, budget=None, job_id="j", rank=0)

        def broken(*args):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        cuda.synchronize = broken
        try:
            pool.release()
        except RuntimeError as e:
            print("raised:", "illegal memory access" in str(e))
        print("sessions:", sessions)
        pool.release()  # idempotent
        """
    )
    assert out.splitlines() == ["raised: True", "sessions: {}"]


def test_rank_and_local_rank_from_the_environment() -> None:
    """``$RANK`` and ``$LOCAL_RANK`` are the defaults when set to integers, 0 included
    (``LOCAL_RANK=0`` on device 1 is local rank 0, not the device index)."""
    out = _run(
        """
        def made(env, device=1):
            for k in ("RANK", "LOCAL_RANK"):
                os.environ.pop(k, None)
            os.environ.update(env)
            pool = gpt.MemPool(device, budget=None, job_id="j")
            pool.release()
            return (configured[-1]["rank"], configured[-1]["local_rank"])

        print(made({"RANK": "3", "LOCAL_RANK": "0"}))
        print(made({"RANK": " 5 ", "LOCAL_RANK": "2"}))
        print(made({"RANK": "x", "LOCAL_RANK": ""}))
        print(made({}))
        """
    )
    assert out.splitlines() == ["(3, 0)", "(5, 2)", "(0, 1)", "(0, 1)"]
