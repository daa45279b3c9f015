"""Segments: memory granted by graphpoold, and how this process imports it.

A grant's memory travels as a file descriptor over the daemon's fd socket (``SCM_RIGHTS``),
to the process that owns the grant's session only. What the fd is depends on the daemon's
backend (``Segment.handle_kind``):

* ``"memfd"`` (host backend, machines without a GPU): :meth:`Segment.map` maps it with
  ``mmap(MAP_SHARED)``.
* ``"cuda-vmm-posix-fd"`` (cuda backend): :meth:`Segment.map_device` imports it with the CUDA
  driver's virtual memory management API (``cuMemImportFromShareableHandle``,
  ``cuMemAddressReserve``, ``cuMemMap``, ``cuMemSetAccess``) through ``libcuda.so.1``.
"""

from __future__ import annotations

import array
import ctypes
import mmap
import os
import socket
import struct
import weakref
from typing import TYPE_CHECKING, Any, Callable

from ._fork import ForkSafeLock
from ._native import native_path
from ._proto.graphpool.v1 import graphpool_pb2 as pb
from .errors import FailedPrecondition, GraphpoolError, DaemonUnavailable, error_from_code
from .units import format_size

if TYPE_CHECKING:
    from .info import GrantInfo

__all__ = [
    "HANDLE_CUDA",
    "HANDLE_MEMFD",
    "CudaError",
    "DeviceMapping",
    "FdChannel",
    "Segment",
    "native_path",
]

HANDLE_MEMFD = "memfd"
HANDLE_CUDA = "cuda-vmm-posix-fd"

_LEN = struct.Struct("<I")
_MAX_FRAME = 16 << 20


class FdChannel:
    """A connection to the daemon's fd socket (``Attached.fd_socket``).

    Frames are a 4-byte little-endian length followed by a protobuf message. The client sends
    ``FdRequest``; the daemon answers ``FdResponse`` and, for a fetch or an allocation that
    succeeded, attaches exactly one fd (``SCM_RIGHTS``) to the same ``sendmsg``. Besides fd
    fetches the socket carries the fast path of ``AllocateSegment`` (grant and fd in one
    exchange) and ``ReleaseSegment``, answered exactly as the gRPC calls would be. Thread-safe;
    reconnects after a failure and after ``fork``.

    Args:
        path: the fd socket.
        timeout: seconds to wait for each exchange.
        daemon_socket: the gRPC socket of the daemon that named ``path`` (for the messages of
            its errors), ``""`` if not known.
    """

    def __init__(self, path: str, *, timeout: float = 10.0, daemon_socket: str = "") -> None:
        self.path = path
        self.timeout = timeout
        self.daemon_socket = daemon_socket
        self._sock: socket.socket | None = None
        self._pid = 0
        self._lock = ForkSafeLock()

    def _connect(self) -> socket.socket:
        if self._sock is not None and self._pid == os.getpid():
            return self._sock
        self._sock = None  # a socket inherited through fork stays with the parent
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.path)
        except OSError as e:
            s.close()
            raise self._unreachable(f"fd socket: {e.strerror or e}") from e
        self._sock, self._pid = s, os.getpid()
        return s

    def _unreachable(self, reason: str) -> DaemonUnavailable:
        return DaemonUnavailable(self.path, reason, fd_socket=True, daemon_socket=self.daemon_socket)

    def close(self) -> None:
        """Closes the connection (only in the process that opened it)."""
        with self._lock:
            if self._sock is not None and self._pid == os.getpid():
                self._sock.close()
            self._sock = None

    def fetch(self, session_id: int, grant_id: int) -> tuple[int, pb.FdResponse]:
        """Fetches the fd of a grant. Returns ``(fd, response)``; the caller owns the fd.

        Raises:
            GraphpoolError: the daemon refused (``PermissionDenied`` for a grant of another
                process, ``NotFound`` for an unknown grant), or the socket failed.
        """
        what = f"the fd of grant {grant_id}"
        resp, fds = self._call(pb.FdRequest(session_id=session_id, grant_id=grant_id), what)
        return self._one_fd(fds, what), resp

    def allocate(self, session_id: int, size_bytes: int, label: str = "") -> tuple[pb.Grant, int, pb.FdResponse]:
        """``AllocateSegment`` on the fd socket: returns ``(grant, fd, response)``; the caller
        owns the fd. Refusals raise what the gRPC call raises (``CapacityExceeded`` with its
        details, ``InvalidArgument`` naming the field, ...)."""
        what = f"a segment of {format_size(size_bytes)}"
        call = pb.AllocateSegmentRequest(session_id=session_id, size_bytes=size_bytes, label=label)
        resp, fds = self._call(pb.FdRequest(allocate=call), what)
        if resp.HasField("grant") and len(fds) == 1:
            return resp.grant, fds[0], resp
        _close_all(fds)
        if not resp.HasField("grant"):
            raise GraphpoolError(f"fd socket {self.path}: an allocation answered without its grant")
        try:  # granted but unusable here: give it back
            self.release(session_id, resp.grant.grant_id)
        except GraphpoolError:
            pass
        raise GraphpoolError(f"fd socket {self.path}: expected one fd with {what}, got {len(fds)}")

    def release(self, session_id: int, grant_id: int) -> int:
        """``ReleaseSegment`` on the fd socket; returns the bytes released."""
        call = pb.ReleaseSegmentRequest(session_id=session_id, grant_id=grant_id)
        resp, fds = self._call(pb.FdRequest(release=call), f"the release of grant {grant_id}")
        _close_all(fds)
        return int(resp.released.bytes_released)

    def _one_fd(self, fds: list[int], what: str) -> int:
        if len(fds) != 1:
            _close_all(fds)
            raise GraphpoolError(f"fd socket {self.path}: expected one fd with {what}, got {len(fds)}")
        return fds[0]

    def _call(self, req: pb.FdRequest, what: str) -> tuple[pb.FdResponse, list[int]]:
        """One request/response exchange: the response (raising the daemon's refusal as the
        matching :class:`GraphpoolError`) and the fds that came with it, which the caller owns."""
        body_out = req.SerializeToString()
        with self._lock:
            sock = self._connect()
            try:
                sock.sendall(_LEN.pack(len(body_out)) + body_out)
                body, fds = _recv_frame(sock)
            except (OSError, ValueError) as e:
                sock.close()
                self._sock = None
                if isinstance(e, OSError):
                    raise self._unreachable(f"fd socket: {e}") from e
                raise GraphpoolError(f"fd socket {self.path}: {e}") from e
        resp = pb.FdResponse()
        try:
            resp.ParseFromString(body)
        except Exception as e:
            _close_all(fds)
            raise GraphpoolError(f"fd socket {self.path}: malformed FdResponse: {e}") from e
        if not resp.ok:
            _close_all(fds)
            detail = resp.error if resp.HasField("error") else None
            # A refusal comes from the daemon itself: one it sends as UNAVAILABLE (shutting down)
            # names its gRPC socket, the one to start a daemon on.
            raise error_from_code(
                resp.code, resp.message or f"the daemon refused {what}", self.daemon_socket or self.path, detail
            )
        return resp, fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _recv_frame(sock: socket.socket) -> tuple[bytes, list[int]]:
    """Reads one length-prefixed frame, collecting every fd that arrives with its pieces."""
    fds: list[int] = []
    buf = bytearray()
    want = _LEN.size
    have_len = False
    cmsg_space = socket.CMSG_SPACE(4 * 4)  # room for a few ints; we expect one
    # Received fds are close-on-exec from the start, as every fd Python opens: a grant's fd
    # must not leak into a program this process (or another thread of it) executes.
    cloexec = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    try:
        while True:
            while len(buf) < want:
                data, ancdata, flags, _ = sock.recvmsg(want - len(buf), cmsg_space, cloexec)
                for level, ctype, cdata in ancdata:
                    if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                        n = len(cdata) // 4
                        a = array.array("i")
                        a.frombytes(cdata[: n * 4])
                        fds.extend(a)
                if flags & getattr(socket, "MSG_CTRUNC", 0):
                    raise ValueError("control message truncated (more fds than expected)")
                if not data:
                    raise ConnectionResetError("the daemon closed the fd socket")
                buf += data
            if have_len:
                return bytes(buf[_LEN.size :]), fds
            (length,) = _LEN.unpack(bytes(buf[: _LEN.size]))
            if length > _MAX_FRAME:
                raise ValueError(f"frame of {length} bytes is too large")
            want = _LEN.size + length
            have_len = True
            if length == 0:
                return b"", fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class Segment:
    """Memory granted by graphpoold to a session, with its file descriptor.

    Obtained from :meth:`graphpool.Session.allocate`. Use as a context manager, or call
    :meth:`release`; the daemon also releases it when the session ends or the process exits.

    Attributes:
        grant_id: the daemon's id of the grant.
        size: granted bytes (the request rounded up to the device granularity).
        requested: bytes asked for.
        label: the label given at allocation.
        device_uuid: device the memory is on.
        device_index: the device's index as the daemon lists it.
        handle_kind: ``"memfd"`` or ``"cuda-vmm-posix-fd"``.
    """

    def __init__(
        self,
        grant: GrantInfo,
        fd: int,
        handle_kind: str,
        release_cb: Callable[[int], object] | None,
    ) -> None:
        self.grant = grant
        self.grant_id = grant.grant_id
        self.size = grant.size
        self.requested = grant.requested
        self.label = grant.label
        self.device_uuid = grant.device_uuid
        self.device_index = grant.device_index
        self.handle_kind = handle_kind or grant.handle_kind
        self._fd = fd
        self._pid = os.getpid()
        self._release_cb = release_cb
        self._mmap: mmap.mmap | None = None
        self._device: DeviceMapping | None = None
        self._released = False
        self._lock = ForkSafeLock()
        # A segment dropped without release() must not leak its fd (and, for a memfd, the
        # memory it keeps alive after the daemon let go of it): close it when collected. Not
        # at exit, where the sessions' exit handler still closes the segments it tracks.
        self._fd_finalizer = weakref.finalize(self, _close_quietly, fd)
        self._fd_finalizer.atexit = False

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return (
            f"Segment(grant_id={self.grant_id}, size={format_size(self.size)}, "
            f"label={self.label!r}, handle_kind={self.handle_kind!r}, {state})"
        )

    @property
    def fd(self) -> int:
        """The segment's file descriptor (owned by the segment: closed by :meth:`release`, or
        when the segment is garbage collected; ``os.dup`` it to keep it longer). ``-1`` once
        released or imported to CUDA."""
        return self._fd

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran (or the session that granted it was closed)."""
        return self._released

    def map(self) -> mmap.mmap:
        """Maps a ``memfd`` segment into this process (``MAP_SHARED``, read-write) and returns
        the mapping; later calls return the same mapping. Every process that maps the same fd
        sees the same bytes. ``memoryview(segment.map())`` gives a buffer view.

        Raises:
            FailedPrecondition: the segment was released, or it is device memory (use
                :meth:`map_device`).
        """
        with self._lock:
            self._check_live()
            if self.handle_kind != HANDLE_MEMFD:
                raise FailedPrecondition(
                    f"grant {self.grant_id} is {self.handle_kind!r} memory, not host memory: "
                    f"use Segment.map_device() to map it into a CUDA address space"
                )
            if self._mmap is None:
                self._mmap = mmap.mmap(
                    self._fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
                )
            return self._mmap

    def map_device(self, device: int | None = None) -> DeviceMapping:
        """Imports a ``cuda-vmm-posix-fd`` segment into this process's CUDA address space and
        returns the mapping (its ``ptr`` is a device pointer valid in every context of the
        process). The fd is closed after the import. Later calls return the same mapping.

        Args:
            device: CUDA ordinal in this process to grant access on; by default the device
                whose UUID is the grant's ``device_uuid`` (so ``CUDA_VISIBLE_DEVICES`` is honoured).

        Raises:
            FailedPrecondition: the segment was released, it is host memory (use :meth:`map`),
                or this is a process forked from the one that allocated it (CUDA mappings are
                not inherited through fork, and the driver must not be called there on the
                parent's behalf).
            CudaError: a CUDA driver call failed.
        """
        with self._lock:
            self._check_live()
            if self.handle_kind != HANDLE_CUDA:
                raise FailedPrecondition(
                    f"grant {self.grant_id} is {self.handle_kind!r} memory, not CUDA memory: use Segment.map()"
                )
            if self._pid != os.getpid():
                raise FailedPrecondition(
                    f"grant {self.grant_id} was allocated by process {self._pid}, and CUDA mappings are "
                    f"not inherited through fork: map_device() works only there. In this process "
                    f"({os.getpid()}), attach a session of its own and allocate from it"
                )
            if self._device is None:
                self._device = DeviceMapping.import_fd(
                    self._fd, self.size, device_uuid=self.device_uuid, device=device
                )
                self._close_fd()
            return self._device

    def release(self) -> None:
        """Unmaps the segment, closes its fd and returns the grant to the daemon.

        Idempotent. In a process other than the one that allocated it (after ``fork``), only
        the local mapping and fd are dropped: the grant belongs to the parent's session.
        If a ``memoryview`` of :meth:`map` is still alive, the mapping stays until it is
        dropped (the memory stays valid until then). When unmapping fails (a ``CudaError``),
        the fd is closed and the grant released all the same, then the error is raised.

        While the daemon is away (the session re-attaches after a restart), the release is
        local: the re-attach does not declare the grant. When the fd socket fails while the
        daemon is there, the release goes again at once over gRPC.

        Raises:
            DaemonUnavailable: the daemon answered on none of its sockets while the session's
                stream stayed open (a daemon that does not answer): the grant was not released;
                the session's next ``allocate()`` releases it, ``close()`` with the session.
        """
        unmap_error: Exception | None = None
        with self._lock:
            if self._released:
                return
            self._released = True
            cb = self._release_cb if self._pid == os.getpid() else None
            try:
                self._drop_local()
            except Exception as e:  # the grant must not outlive a failed unmap
                unmap_error = e
        if cb is not None:
            cb(self.grant_id)
        if unmap_error is not None:
            raise unmap_error

    def _forget(self) -> None:
        """Marks the segment released without telling the daemon (its session ended)."""
        with self._lock:
            if not self._released:
                self._released = True
                self._drop_local()

    def _drop_local(self) -> None:
        """Unmaps and closes the fd; the fd is closed even when unmapping raises."""
        try:
            if self._mmap is not None:
                try:
                    self._mmap.close()
                except BufferError:
                    pass  # views still exported: the mapping lives until they are dropped
                self._mmap = None
            if self._device is not None:
                device, self._device = self._device, None
                device.close()
        finally:
            self._close_fd()

    def _close_fd(self) -> None:
        if self._fd >= 0:
            self._fd_finalizer.detach()  # the number may be reused once closed
            _close_quietly(self._fd)
            self._fd = -1

    def _check_live(self) -> None:
        if self._released:
            raise FailedPrecondition(f"grant {self.grant_id} was released; allocate a new segment")

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# ---------------------------------------------------------------------------------------------
# CUDA driver API, through ctypes (libcuda.so.1 is loaded only when a device segment is mapped)

CUresult = ctypes.c_int
CUdevice = ctypes.c_int
CUdeviceptr = ctypes.c_ulonglong
CUmemGenericAllocationHandle = ctypes.c_ulonglong

CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _CUmemAllocFlags),
    ]


class _CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _CUmemLocation), ("flags", ctypes.c_int)]


class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CudaError(GraphpoolError):
    """A CUDA driver call failed while importing or unmapping a device segment.

    Attributes:
        function: the driver function (e.g. ``"cuMemMap"``).
        result: its ``CUresult``.
    """

    def __init__(self, function: str, result: int, name: str, text: str) -> None:
        super().__init__(f"{function} failed: {name} ({result}): {text}")
        self.function = function
        self.result = result


class _Driver:
    """The few driver entry points a device segment needs, each result checked."""

    _instance: _Driver | None = None
    _lock = ForkSafeLock()

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise FailedPrecondition(
                f"cannot load the CUDA driver (libcuda.so.1): {e}. Device segments need an NVIDIA "
                f"driver on this machine; is the process running inside a GPU container?"
            ) from e
        sig: dict[str, list[Any]] = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
            "cuDeviceGet": [ctypes.POINTER(CUdevice), ctypes.c_int],
            "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
            "cuCtxSetCurrent": [ctypes.c_void_p],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), CUdevice],
            "cuDevicePrimaryCtxRelease_v2": [CUdevice],
            "cuMemGetAllocationGranularity": [
                ctypes.POINTER(ctypes.c_size_t),
                ctypes.POINTER(_CUmemAllocationProp),
                ctypes.c_int,
            ],
            "cuMemImportFromShareableHandle": [
                ctypes.POINTER(CUmemGenericAllocationHandle),
                ctypes.c_void_p,
                ctypes.c_int,
            ],
            "cuMemAddressReserve": [
                ctypes.POINTER(CUdeviceptr),
                ctypes.c_size_t,
                ctypes.c_size_t,
                CUdeviceptr,
                ctypes.c_ulonglong,
            ],
            "cuMemMap": [CUdeviceptr, ctypes.c_size_t, ctypes.c_size_t, CUmemGenericAllocationHandle, ctypes.c_ulonglong],
            "cuMemSetAccess": [CUdeviceptr, ctypes.c_size_t, ctypes.POINTER(_CUmemAccessDesc), ctypes.c_size_t],
            "cuMemUnmap": [CUdeviceptr, ctypes.c_size_t],
            "cuMemAddressFree": [CUdeviceptr, ctypes.c_size_t],
            "cuMemRelease": [CUmemGenericAllocationHandle],
            "cuGetErrorName": [CUresult, ctypes.POINTER(ctypes.c_char_p)],
            "cuGetErrorString": [CUresult, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, args in sig.items():
            try:
                fn = getattr(self.lib, name)
            except AttributeError as e:
                raise FailedPrecondition(
                    f"the CUDA driver lacks {name}: device segments need driver ≥ 470 (CUDA 11.4)"
                ) from e
            fn.argtypes = args
            fn.restype = CUresult
        # cuDeviceGetUuid_v2 (CUDA 11.4+) reports MIG instances; fall back to the v1 symbol.
        uuid_fn = getattr(self.lib, "cuDeviceGetUuid_v2", None) or getattr(self.lib, "cuDeviceGetUuid")
        uuid_fn.argtypes = [ctypes.POINTER(_CUuuid), CUdevice]
        uuid_fn.restype = CUresult
        self.cuDeviceGetUuid = uuid_fn
        self.check("cuInit", self.lib.cuInit(0))

    @classmethod
    def get(cls) -> _Driver:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Driver()
            return cls._instance

    def check(self, function: str, result: int) -> None:
        if result == 0:
            return
        name = ctypes.c_char_p()
        text = ctypes.c_char_p()
        n = "CUDA_ERROR_UNKNOWN"
        t = "unknown error"
        if self.lib.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value:
            n = name.value.decode(errors="replace")
        if self.lib.cuGetErrorString(result, ctypes.byref(text)) == 0 and text.value:
            t = text.value.decode(errors="replace")
        raise CudaError(function, result, n, t)

    def device_uuid(self, ordinal: int) -> str:
        u = _CUuuid()
        self.check("cuDeviceGetUuid", self.cuDeviceGetUuid(ctypes.byref(u), ordinal))
        h = bytes(u.bytes).hex()
        return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def ordinal_for(self, device_uuid: str) -> int:
        count = ctypes.c_int()
        self.check("cuDeviceGetCount", self.lib.cuDeviceGetCount(ctypes.byref(count)))
        seen = []
        for i in range(count.value):
            dev = CUdevice()
            self.check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(dev), i))
            u = self.device_uuid(dev.value)
            if u.lower() == device_uuid.lower():
                return dev.value
            seen.append(u)
        raise FailedPrecondition(
            f"device {device_uuid} of the grant is not visible to this process (visible: "
            f"{', '.join(seen) or 'none'}); check CUDA_VISIBLE_DEVICES"
        )


class DeviceMapping:
    """A device segment imported into this process: ``ptr`` (a ``CUdeviceptr``) to
    ``ptr + size`` is readable and writable from ``device``. :meth:`close` unmaps it, frees the
    address range and drops the imported handle."""

    def __init__(self, ptr: int, size: int, device: int, handle: int, ctx_retained: bool) -> None:
        self.ptr = ptr
        self.size = size
        self.device = device
        self._handle = handle
        self._ctx_retained = ctx_retained
        self._closed = False
        # CUDA mappings and contexts are not inherited through fork: only this process may
        # unmap it (the driver must not be called in a forked child).
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"DeviceMapping(ptr=0x{self.ptr:x}, size={format_size(self.size)}, device={self.device})"

    @classmethod
    def import_fd(cls, fd: int, size: int, *, device_uuid: str = "", device: int | None = None) -> DeviceMapping:
        """Imports a ``cuda-vmm-posix-fd`` fd of ``size`` bytes. The caller keeps the fd (the
        driver holds its own reference once imported; close it afterwards)."""
        drv = _Driver.get()
        if device is None:
            device = drv.ordinal_for(device_uuid) if device_uuid else 0
        dev = CUdevice()
        drv.check("cuDeviceGet", drv.lib.cuDeviceGet(ctypes.byref(dev), device))

        # VMM calls need a current context; use the primary one of the device if there is none
        # (torch makes the same primary context current, so nothing extra is created then).
        ctx_retained = False
        cur = ctypes.c_void_p()
        drv.check("cuCtxGetCurrent", drv.lib.cuCtxGetCurrent(ctypes.byref(cur)))
        if not cur.value:
            pctx = ctypes.c_void_p()
            drv.check("cuDevicePrimaryCtxRetain", drv.lib.cuDevicePrimaryCtxRetain(ctypes.byref(pctx), dev))
            ctx_retained = True
            try:
                drv.check("cuCtxSetCurrent", drv.lib.cuCtxSetCurrent(pctx))
            except BaseException:
                drv.lib.cuDevicePrimaryCtxRelease_v2(dev)
                raise

        prop = _CUmemAllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = dev.value
        gran = ctypes.c_size_t()
        handle = CUmemGenericAllocationHandle()
        ptr = CUdeviceptr()
        mapped = reserved = imported = False
        try:
            drv.check(
                "cuMemGetAllocationGranularity",
                drv.lib.cuMemGetAllocationGranularity(
                    ctypes.byref(gran), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
            )
            if gran.value == 0 or size % gran.value != 0:
                raise FailedPrecondition(
                    f"segment size {size} is not a multiple of the device granularity {gran.value}"
                )
            drv.check(
                "cuMemImportFromShareableHandle",
                drv.lib.cuMemImportFromShareableHandle(
                    ctypes.byref(handle), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                ),
            )
            imported = True
            drv.check(
                "cuMemAddressReserve",
                drv.lib.cuMemAddressReserve(ctypes.byref(ptr), size, gran.value, CUdeviceptr(0), 0),
            )
            reserved = True
            drv.check("cuMemMap", drv.lib.cuMemMap(ptr, size, 0, handle, 0))
            mapped = True
            access = _CUmemAccessDesc()
            access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = dev.value
            access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            drv.check("cuMemSetAccess", drv.lib.cuMemSetAccess(ptr, size, ctypes.byref(access), 1))
        except BaseException:
            # Undo in reverse order; the first error is the one reported.
            if mapped:
                drv.lib.cuMemUnmap(ptr, size)
            if reserved:
                drv.lib.cuMemAddressFree(ptr, size)
            if imported:
                drv.lib.cuMemRelease(handle)
            if ctx_retained:
                drv.lib.cuDevicePrimaryCtxRelease_v2(dev)
            raise
        return cls(ptr.value, size, dev.value, handle.value, ctx_retained)

    def close(self) -> None:
        """Unmaps and releases the imported memory. Idempotent. Every step runs even if an
        earlier one fails; the first failure is raised afterwards. In a process forked from
        the one that imported it, this only marks it closed: the child has no such mapping and
        must not call the CUDA driver on the parent's behalf."""
        if self._closed:
            return
        self._closed = True
        if self._pid != os.getpid():
            return
        drv = _Driver.get()
        first: CudaError | None = None
        steps: list[tuple[str, Callable[[], int]]] = [
            ("cuMemUnmap", lambda: int(drv.lib.cuMemUnmap(CUdeviceptr(self.ptr), self.size))),
            ("cuMemAddressFree", lambda: int(drv.lib.cuMemAddressFree(CUdeviceptr(self.ptr), self.size))),
            ("cuMemRelease", lambda: int(drv.lib.cuMemRelease(CUmemGenericAllocationHandle(self._handle)))),
        ]
        if self._ctx_retained:
            steps.append(("cuDevicePrimaryCtxRelease", lambda: int(drv.lib.cuDevicePrimaryCtxRelease_v2(self.device))))
        for name, step in steps:
            try:
                drv.check(name, step())
            except CudaError as e:
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> DeviceMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
