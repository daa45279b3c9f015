"""``graphpool.torch.MemPool``'s own logic, with stand-ins for torch and for the native shim, so
that it runs without torch or a GPU (the real thing is tested in ``tests/gpu``).

Each test runs in a fresh interpreter (the stand-in ``torch`` module must not leak into other
tests). The stand-in's CUDA calls fail in a forked child, as real CUDA calls do there.
"""

from __future__ import annotations

import textwrap

from gp_helpers import Daemon, run_python

STANDIN = '''
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

sessions = {}  # device -> session info, as the shim keeps them
configured = []  # keyword arguments of each configure

def _configure(**kw):
    _cuda("shim configure")()
    configured.append(kw)
    sessions[kw["device"]] = (1, 0, "GPU-standin")

def _release_device(device):
    _cuda("shim release_device")()
    sessions.pop(device, None)
    return True

_shim.configure = _configure
_shim.release_device = _release_device
_shim.session_info = lambda device: sessions.get(device)
_shim.loaded_path = lambda: "libgraphpool_shim.so"

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


def _run(code: str, *args: str) -> str:
    r = run_python(STANDIN + textwrap.dedent(code), *args)
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
