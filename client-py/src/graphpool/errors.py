"""The exceptions of the graphpool package, and the translation of gRPC errors into them.

Every failed call of the daemon carries a gRPC status code and a message; most also carry an
``ErrorDetail`` message in the binary trailing metadata key ``graphpool-error-bin``. This module
turns both into one exception class per code, with the structured details as attributes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from ._proto.graphpool.v1 import graphpool_pb2 as pb
from .units import format_size

__all__ = [
    "ERROR_DETAIL_METADATA_KEY",
    "CapacityExceeded",
    "DaemonUnavailable",
    "FailedPrecondition",
    "GraphpoolError",
    "Holder",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "error_from_code",
    "error_from_rpc",
]

#: Binary trailing metadata key that carries a serialized ``graphpool.v1.ErrorDetail``.
ERROR_DETAIL_METADATA_KEY = "graphpool-error-bin"


@dataclass(frozen=True)
class Holder:
    """One of the largest holders under the limit that refused a request."""

    job_id: str
    rank: int
    pid: int
    granted_bytes: int

    def __str__(self) -> str:
        return f"job {self.job_id} rank {self.rank} (pid {self.pid}): {format_size(self.granted_bytes)}"


class GraphpoolError(Exception):
    """Base class of every error the graphpool package raises.

    Attributes:
        message: the daemon's (or the client's) explanation.
        code: the gRPC status code of the failed call, ``None`` for errors raised locally.
    """

    #: gRPC status code this class stands for (None: any other).
    grpc_code: grpc.StatusCode | None = None

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else type(self).grpc_code

    def __str__(self) -> str:
        return self.message


class InvalidArgument(GraphpoolError, ValueError):
    """A request field was wrong (``INVALID_ARGUMENT``).

    Attributes:
        field: the request field the daemon names (e.g. ``"size_bytes"``), ``""`` if none.
        description: what is wrong with it.
    """

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(
        self,
        message: str,
        *,
        field: str = "",
        description: str = "",
        code: grpc.StatusCode | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.field = field
        self.description = description


class NotFound(GraphpoolError, LookupError):
    """What the request names does not exist (``NOT_FOUND``), e.g. a grant already released.

    Attributes:
        field: the request field that named it (e.g. ``"grant_id"``), ``""`` if not known.
    """

    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, message: str, *, field: str = "", code: grpc.StatusCode | None = None) -> None:
        super().__init__(message, code=code)
        self.field = field


class PermissionDenied(GraphpoolError, PermissionError):
    """The daemon refused this process (``PERMISSION_DENIED`` / ``UNAUTHENTICATED``): a session
    of another process, a grant of another session, a uid not on the allow-list, or an admin
    call from a non-admin uid."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(GraphpoolError):
    """The request cannot be served in the current state (``FAILED_PRECONDITION``), or a
    session/segment was used after it was closed or from another process."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class DaemonUnavailable(GraphpoolError, ConnectionError):
    """graphpoold cannot be reached: the socket is missing, nobody listens on it, the daemon
    closed the connection (its log says why: the uid is not on its allow-list, or already holds
    as many connections as it may), or it did not answer within the client's timeout.

    The socket is the daemon's gRPC socket, or (``fd_socket``) the fd socket a session was
    told to fetch segment fds on (``Session.fd_socket``): a socket the daemon opens next to
    its gRPC socket, which the message does not tell to start a daemon on.

    Attributes:
        socket_path: the socket path that was tried.
        reason: why it failed (``""`` if not known).
        fd_socket: whether ``socket_path`` is the daemon's fd socket, not its gRPC socket.
        daemon_socket: the daemon's gRPC socket: ``socket_path`` itself unless ``fd_socket``;
            for an fd socket, the gRPC socket of the daemon that named it (``""`` if not
            known).
    """

    grpc_code = grpc.StatusCode.UNAVAILABLE

    def __init__(
        self,
        socket_path: str,
        reason: str = "",
        *,
        code: grpc.StatusCode | None = None,
        fd_socket: bool = False,
        daemon_socket: str = "",
    ) -> None:
        why = f" ({reason})" if reason else ""
        if fd_socket:
            of = f" of the daemon at {daemon_socket}" if daemon_socket else ""
            health = f"graphpool --socket {daemon_socket} health" if daemon_socket else "graphpool health"
            message = (
                f"graphpoold's fd socket {socket_path}{of} is not reachable{why}. The daemon opens "
                f"this socket itself and named it when the session attached, to hand out segment "
                f"fds on it. Check that the daemon is still running (`{health}`, or "
                f"`systemctl status graphpoold`) and that this process may connect to the fd "
                "socket (its permissions and group; the same filesystem as the daemon's, e.g. "
                "the directory mounted into the container). If the daemon is running, its log "
                "says why it closed the connection: this uid is not on its allow-list, or holds "
                "too many connections."
            )
        else:
            daemon_socket = socket_path
            message = (
                f"graphpoold is not reachable at {socket_path}{why}. Start the daemon "
                f"(`systemctl start graphpoold`, or `graphpoold --socket {socket_path}`), or point "
                "GRAPHPOOL_SOCKET (or graphpool.Client(socket=...)) at the socket it listens on. If it "
                "is running, its log says why it closed the connection: this uid is not on its "
                "allow-list (access.allowed_uids / allowed_gids), or holds too many connections."
            )
        super().__init__(message, code=code)
        self.socket_path = socket_path
        self.reason = reason
        self.fd_socket = fd_socket
        self.daemon_socket = daemon_socket


class CapacityExceeded(GraphpoolError, MemoryError):
    """A request does not fit under a limit (``RESOURCE_EXHAUSTED``); nothing was allocated.

    Attributes:
        requested: bytes asked for.
        free: bytes the limit that bit still allows.
        limit: which limit bit: ``"device-budget"``, ``"job-quota"``, ``"rank-quota"``,
            ``"session-budget"``, ``"session-grants"`` (its figures count grants, not bytes)
            or ``"device-memory"`` (the device has no physical memory left for the request:
            memory that no grant accounts for fills it); ``""`` if the daemon did not say.
        limit_bytes: the size of that limit.
        device_uuid: the device of the request.
        top_holders: the largest holders under that limit, largest first.
    """

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(
        self,
        message: str,
        *,
        requested: int = 0,
        free: int = 0,
        limit: str = "",
        limit_bytes: int = 0,
        device_uuid: str = "",
        top_holders: Iterable[Holder] = (),
        code: grpc.StatusCode | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.requested = requested
        self.free = free
        self.limit = limit
        self.limit_bytes = limit_bytes
        self.device_uuid = device_uuid
        self.top_holders: tuple[Holder, ...] = tuple(top_holders)

    def __str__(self) -> str:
        if not self.limit:
            return self.message
        where = f" on {self.device_uuid}" if self.device_uuid else ""
        text = (
            f"cannot grant {format_size(self.requested)}{where}: the {self.limit} limit of "
            f"{format_size(self.limit_bytes)} leaves {format_size(self.free)} free"
        )
        holders = [h for h in self.top_holders if h.granted_bytes > 0]
        if holders:
            text += "; largest holders: " + ", ".join(str(h) for h in holders)
        else:
            text += "; nobody else holds memory under it"
        hint = _HINTS.get(self.limit)
        if hint:
            text += f". {hint}"
        return text


_HINTS = {
    "session-budget": "Attach with a larger budget, or release segments of this session first",
    "rank-quota": "Ask an admin to raise the rank quota (graphpool limits), or release segments",
    "job-quota": "Ask an admin to raise the job quota (graphpool limits), or free memory in other ranks of the job",
    "device-budget": "The GPU's graphpool budget is used up by the holders above; wait for them or lower the request",
    "session-grants": "This session holds too many grants; ask for fewer, larger segments",
    "device-memory": (
        "The GPU has no physical memory left for it: memory that no grant accounts for (other "
        "processes, or allocations outside graphpool) fills it; free some, or lower the device's "
        "graphpool budget to what is really free"
    ),
}

_BY_CODE: dict[grpc.StatusCode, type[GraphpoolError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDenied,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExceeded,
}

_CODE_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def _parse_detail(metadata: Iterable[Any] | None) -> pb.ErrorDetail | None:
    for item in metadata or ():
        key, value = item[0], item[1]
        if key == ERROR_DETAIL_METADATA_KEY and isinstance(value, bytes):
            detail = pb.ErrorDetail()
            try:
                detail.ParseFromString(value)
            except Exception:  # a malformed detail must not hide the error itself
                return None
            return detail
    return None


def _build(
    code: grpc.StatusCode, message: str, detail: pb.ErrorDetail | None, socket_path: str
) -> GraphpoolError:
    kind = detail.WhichOneof("detail") if detail is not None else None
    if code == grpc.StatusCode.UNAVAILABLE:
        return DaemonUnavailable(socket_path, message, code=code)
    cls = _BY_CODE.get(code, GraphpoolError)
    if cls is CapacityExceeded:
        if detail is not None and kind == "capacity":
            c = detail.capacity
            return CapacityExceeded(
                message,
                requested=c.requested_bytes,
                free=c.free_bytes,
                limit=c.limit,
                limit_bytes=c.limit_bytes,
                device_uuid=c.device_uuid,
                top_holders=[
                    Holder(job_id=h.job_id, rank=h.rank, pid=h.pid, granted_bytes=h.granted_bytes)
                    for h in c.top_holders
                ],
                code=code,
            )
        return CapacityExceeded(message, code=code)
    field = detail.field.field if detail is not None and kind == "field" else ""
    if cls is InvalidArgument:
        description = detail.field.description if detail is not None and kind == "field" else ""
        return InvalidArgument(message, field=field, description=description, code=code)
    if cls is NotFound:
        return NotFound(message, field=field, code=code)
    if cls is GraphpoolError:
        return GraphpoolError(f"{message} (gRPC status {code.name})", code=code)
    return cls(message, code=code)


def error_from_rpc(err: grpc.RpcError, socket_path: str = "") -> GraphpoolError:
    """Translates a failed gRPC call into the matching :class:`GraphpoolError` subclass,
    with the ``graphpool-error-bin`` details parsed into attributes."""
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    message = str(err)
    metadata: Iterable[Any] | None = None
    if isinstance(err, grpc.Call):
        code = err.code()
        message = err.details() or code.name
        metadata = err.trailing_metadata()
    return _build(code, message, _parse_detail(metadata), socket_path)


def error_from_code(
    code: int, message: str, socket_path: str = "", detail: pb.ErrorDetail | None = None
) -> GraphpoolError:
    """Translates a numeric gRPC status code (as carried by ``FdResponse.code``), a message and
    the structured detail (``FdResponse.error``) into the matching :class:`GraphpoolError`
    subclass."""
    status = _CODE_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    return _build(status, message, detail, socket_path)
