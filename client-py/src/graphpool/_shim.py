"""ctypes access to the native allocator shim, ``libgraphpool_shim.so``.

The shim is what torch calls (``graphpool_alloc`` / ``graphpool_free``) through
``torch.cuda.CUDAPluggableAllocator``; this module configures it (one daemon session per CUDA
device of the process), reads its counters and turns its errors (JSON from
``graphpool_shim_last_error``) into the package's exceptions. No torch here.

The shim's last error is per thread: :func:`last_error` reads the calling thread's (the
thread's last failed call; a successful allocation or configure, or :func:`clear_error`,
clears it). torch makes a segment request on the thread that asks for memory, except in the
backward pass, which autograd runs on its device threads: :func:`alloc_failures` and
:func:`last_alloc_error` see those.

The library is found with :func:`graphpool._native.native_path` (``$GRAPHPOOL_SHIM``, then the
copy shipped in the package).
"""

from __future__ import annotations

import ctypes
import json
import os
from typing import Any

from ._fork import ForkSafeLock
from ._native import SHIM_ENV, native_path
from ._proto.graphpool.v1 import graphpool_pb2 as pb
from .client import default_socket_path
from .errors import (
    CapacityExceeded,
    DaemonUnavailable,
    GraphpoolError,
    Holder,
    InvalidArgument,
    error_from_code,
)

__all__ = [
    "ShimError",
    "alloc",
    "alloc_failures",
    "clear_error",
    "configure",
    "error_from_shim",
    "free",
    "keep_device",
    "last_alloc_error",
    "last_error",
    "last_timing",
    "load",
    "release_device",
    "session_info",
    "shim_path",
    "stats",
]

_lock = ForkSafeLock()
_lib: ctypes.CDLL | None = None
_path: str | None = None
# The daemon socket of the latest configure (None: none yet): what the shim's errors name.
_socket: str | None = None


class ShimError(GraphpoolError):
    """A shim failure that is not a capacity refusal, an unreachable daemon or a daemon
    refusal with an exception of its own (``InvalidArgument``, ``NotFound``,
    ``PermissionDenied``, ``FailedPrecondition``): a CUDA driver error, an fd error, a fork,
    a misuse. ``kind`` and ``details`` come from the shim's JSON error."""

    def __init__(self, message: str, *, kind: str = "", details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.details = dict(details or {})


def shim_path() -> str:
    """The path of ``libgraphpool_shim.so``; raises ``FileNotFoundError`` saying how to get one
    (or, when ``$GRAPHPOOL_SHIM`` is set but names no file, naming the variable and its path)."""
    p = native_path()
    if p is None:
        raise FileNotFoundError(
            "graphpool: the native allocator shim libgraphpool_shim.so is not installed "
            f"({SHIM_ENV} is not set, and the package was installed without it). Install graphpool "
            "from a checkout with cargo on PATH (`pip install ./client-py`), install a wheel built "
            f"elsewhere, or set {SHIM_ENV}=/path/to/libgraphpool_shim.so "
            "(`cargo build --release -p graphpool-shim` builds target/release/libgraphpool_shim.so)."
        )
    return p


def load() -> ctypes.CDLL:
    """Loads the shim once and declares its functions' signatures."""
    global _lib, _path
    with _lock:
        if _lib is not None:
            return _lib
        path = shim_path()
        lib = ctypes.CDLL(path)
        u64, c_int, c_char_p, vp = ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p
        pu64 = ctypes.POINTER(u64)
        lib.graphpool_shim_configure.argtypes = [
            c_char_p,
            c_char_p,
            ctypes.c_uint32,
            ctypes.c_uint32,
            c_int,
            c_char_p,
            u64,
            c_int,
        ]
        lib.graphpool_shim_configure.restype = c_int
        lib.graphpool_alloc.argtypes = [ctypes.c_size_t, c_int, vp]
        lib.graphpool_alloc.restype = vp
        lib.graphpool_free.argtypes = [vp, ctypes.c_size_t, c_int, vp]
        lib.graphpool_free.restype = None
        lib.graphpool_shim_stats.argtypes = [c_int, pu64, pu64]
        lib.graphpool_shim_stats.restype = c_int
        lib.graphpool_shim_session_info.argtypes = [c_int, pu64, pu64, ctypes.c_char_p, ctypes.c_size_t]
        lib.graphpool_shim_session_info.restype = c_int
        lib.graphpool_shim_last_timing.argtypes = [pu64]
        lib.graphpool_shim_last_timing.restype = c_int
        lib.graphpool_shim_last_error.argtypes = []
        lib.graphpool_shim_last_error.restype = c_char_p
        lib.graphpool_shim_clear_error.argtypes = []
        lib.graphpool_shim_clear_error.restype = None
        lib.graphpool_shim_alloc_failures.argtypes = []
        lib.graphpool_shim_alloc_failures.restype = u64
        lib.graphpool_shim_last_alloc_error.argtypes = []
        lib.graphpool_shim_last_alloc_error.restype = c_char_p
        lib.graphpool_shim_release_device.argtypes = [c_int]
        lib.graphpool_shim_release_device.restype = c_int
        lib.graphpool_shim_keep_device.argtypes = [c_int]
        lib.graphpool_shim_keep_device.restype = c_int
        lib.graphpool_shim_shutdown.argtypes = []
        lib.graphpool_shim_shutdown.restype = c_int
        _lib, _path = lib, path
        return lib


def loaded_path() -> str:
    """The path the shim was loaded from (loads it if needed)."""
    load()
    assert _path is not None
    return _path


def _error_dict(raw: bytes | None) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        d = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        return {"kind": "unknown", "message": raw.decode("utf-8", "replace")}
    return d if isinstance(d, dict) else {"kind": "unknown", "message": str(d)}


def last_error() -> dict[str, Any] | None:
    """This thread's last shim error as a dict (``kind``, ``message``, and for capacity
    refusals ``requested``, ``free``, ``limit``, ``limit_bytes``, ``device_uuid``,
    ``holders``), or None."""
    raw: bytes | None = load().graphpool_shim_last_error()
    return _error_dict(raw)


def clear_error() -> None:
    """Forgets this thread's last shim error (before an operation whose failure is then
    attributed)."""
    load().graphpool_shim_clear_error()


def alloc_failures() -> int:
    """How many segment requests of this process failed so far, on any thread."""
    return int(load().graphpool_shim_alloc_failures())


def last_alloc_error() -> dict[str, Any] | None:
    """The error of this process's latest failed segment request, on any thread (a dict like
    :func:`last_error`'s), or None."""
    raw: bytes | None = load().graphpool_shim_last_alloc_error()
    return _error_dict(raw)


def error_from_shim(d: dict[str, Any] | None, *, socket: str | None = None) -> GraphpoolError:
    """The package exception for a shim error dict. ``socket`` is the daemon socket a
    ``DaemonUnavailable`` names: by default the one the shim was last configured with, else
    :func:`graphpool.client.default_socket_path` (where the shim connects when configured
    without one)."""
    if socket is None:
        socket = _socket or default_socket_path()
    if not d:
        return ShimError("graphpool shim: the operation failed without an error message")
    kind = str(d.get("kind", ""))
    message = str(d.get("message", "graphpool shim error"))
    if kind == "capacity":
        holders = [
            Holder(
                job_id=str(h.get("job_id", "")),
                rank=int(h.get("rank", 0)),
                pid=int(h.get("pid", 0)),
                granted_bytes=int(h.get("granted_bytes", 0)),
            )
            for h in d.get("holders", []) or []
        ]
        return CapacityExceeded(
            message,
            requested=int(d.get("requested", 0)),
            free=int(d.get("free", 0)),
            limit=str(d.get("limit", "")),
            limit_bytes=int(d.get("limit_bytes", 0)),
            device_uuid=str(d.get("device_uuid", "")),
            top_holders=holders,
        )
    if kind == "unavailable":
        return DaemonUnavailable(socket, message)
    if kind == "invalid-argument" or d.get("code") == "INVALID_ARGUMENT":
        return InvalidArgument(message, field=str(d.get("field", "")), description=str(d.get("description", "")))
    code = d.get("code_number")
    if kind == "daemon" and isinstance(code, int) and not isinstance(code, bool):
        # A daemon refusal: the exception the same refusal raises on a Session (NotFound for
        # an unknown device, PermissionDenied for a uid not allowed, ...).
        detail = None
        if d.get("field"):
            detail = pb.ErrorDetail(
                field=pb.FieldViolation(field=str(d["field"]), description=str(d.get("description", "")))
            )
        err = error_from_code(code, message, socket, detail)
        if type(err) is not GraphpoolError:
            return err
    return ShimError(message, kind=kind, details=d)


def configure(
    *,
    socket: str | None,
    job_id: str,
    rank: int,
    local_rank: int,
    device: int,
    daemon_device: str | None,
    budget_bytes: int,
    reserve_budget: bool,
) -> None:
    """Opens the daemon session of CUDA device ``device`` in the shim; raises the package's
    exception (``CapacityExceeded`` when a reserved budget does not fit, ``InvalidArgument``
    for a rank, device or budget out of range)."""
    # ctypes would silently wrap a negative or oversized value (rank -1 becomes 4294967295).
    for name, value, lo, hi in (
        ("rank", rank, 0, (1 << 32) - 1),
        ("local_rank", local_rank, 0, (1 << 32) - 1),
        ("device", device, 0, (1 << 31) - 1),
        ("budget_bytes", budget_bytes, 0, (1 << 64) - 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise InvalidArgument(f"{name} must be an int between {lo} and {hi}, not {value!r}", field=name)
    if not isinstance(job_id, str):
        raise InvalidArgument(f"job_id must be a str, not {job_id!r}", field="job_id")
    global _socket
    # Where the shim connects: the socket given, else the default, found as the shim finds it.
    _socket = os.path.abspath(socket) if socket else default_socket_path()
    lib = load()
    rc = lib.graphpool_shim_configure(
        socket.encode() if socket else None,
        job_id.encode(),
        rank,
        local_rank,
        device,
        daemon_device.encode() if daemon_device else None,
        budget_bytes,
        1 if reserve_budget else 0,
    )
    if rc != 0:
        raise error_from_shim(last_error(), socket=_socket)


def stats(device: int) -> tuple[int, int] | None:
    """``(granted_bytes, segments)`` of the device's session, or None without one."""
    g, n = ctypes.c_uint64(0), ctypes.c_uint64(0)
    if load().graphpool_shim_stats(device, ctypes.byref(g), ctypes.byref(n)) != 0:
        return None
    return g.value, n.value


def session_info(device: int) -> tuple[int, int, str] | None:
    """``(session_id, reserved_bytes, device_uuid)`` of the device's session, or None."""
    sid, res = ctypes.c_uint64(0), ctypes.c_uint64(0)
    buf = ctypes.create_string_buffer(128)
    if load().graphpool_shim_session_info(device, ctypes.byref(sid), ctypes.byref(res), buf, len(buf)) != 0:
        return None
    return sid.value, res.value, buf.value.decode()


def release_device(device: int) -> bool:
    """Ends the device's session; True when it ended (or there was none). False when segments
    of it are still mapped (torch still holds them, e.g. for CUDA graphs that are alive): the
    session then stays as it is, and ends when the last of them is freed or the process
    exits, unless :func:`keep_device` keeps it."""
    return bool(load().graphpool_shim_release_device(device) == 0)


def keep_device(device: int) -> bool:
    """Keeps the device's session for a new user: cancels the end that :func:`release_device`
    left for its last segment's free. False when the device has no session, or its session
    ended (the daemon did not come back within the reconnect deadline): :func:`configure`
    then opens a new one."""
    return bool(load().graphpool_shim_keep_device(device) == 0)


def alloc(size: int, device: int) -> int:
    """One segment request through the shim, as torch makes it; returns the address.
    Raises the package's exception when refused."""
    lib = load()
    p = lib.graphpool_alloc(size, device, None)
    if not p:
        raise error_from_shim(last_error())
    return int(p)


def free(ptr: int, size: int, device: int) -> None:
    """Frees a segment returned by :func:`alloc` (unmap, release the grant)."""
    load().graphpool_free(ptr, size, device, None)


def last_timing() -> dict[str, float]:
    """Phases of this thread's last segment request, in microseconds: ``rpc``, ``fd``,
    ``map`` (import+map or mmap), ``total``."""
    arr = (ctypes.c_uint64 * 4)()
    load().graphpool_shim_last_timing(arr)
    return {"rpc": arr[0] / 1e3, "fd": arr[1] / 1e3, "map": arr[2] / 1e3, "total": arr[3] / 1e3}
