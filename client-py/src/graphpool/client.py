"""The client of graphpoold: :class:`Client`, the connection a process opens to the daemon.

A :class:`Client` talks to graphpoold over its gRPC Unix socket. The channel is created on
first use and again in a child process after ``fork`` (gRPC channels must not be shared
across ``fork``). A :class:`Session` is what a training rank holds: the daemon accounts every
grant to it and releases them all when it closes or the process exits (``session.py``); what
the daemon reports comes back as the typed results of ``info.py``.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import grpc

from ._fields import _flag, _size_bytes, _text, _uint
from ._fork import park
from ._proto.graphpool.v1 import graphpool_pb2 as pb
from ._proto.graphpool.v1 import graphpool_pb2_grpc as pb_grpc
from ._proto.graphpool.v1 import plan_pb2 as plan_pb
from .errors import (
    DaemonUnavailable,
    FailedPrecondition,
    InvalidArgument,
    error_from_rpc,
)
from .info import DeviceInfo, GrantInfo, Limits, Status, Usage
from .session import _SESSIONS, DetachResult, ReconnectPolicy, Session, _read_events
from .units import parse_size

__all__ = ["Client", "default_socket_path"]

__version__ = "0.1.0"
CLIENT_NAME = f"graphpool-py/{__version__}"
SOCKET_ENV = "GRAPHPOOL_SOCKET"
SYSTEM_SOCKET = "/run/graphpool/graphpool.sock"

# Whether gRPC's fork support is on, as the environment said when graphpool (and so grpc)
# was imported: GRPC_ENABLE_FORK_SUPPORT (off by default).
_GRPC_FORK_SUPPORT = os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "").strip().lower() in ("1", "true", "yes", "on")
# The process that first opened a gRPC channel through graphpool (0: none yet).
_grpc_pid = 0


def _check_grpc_usable_after_fork() -> None:
    """Refuses a new gRPC channel in a process forked from one that had opened one, when gRPC's
    fork support is off: gRPC's inherited state makes 40-70% of such children abort."""
    global _grpc_pid
    pid = os.getpid()
    if _grpc_pid and _grpc_pid != pid and not _GRPC_FORK_SUPPORT:
        raise FailedPrecondition(
            f"this process was forked from process {_grpc_pid}, which used gRPC, and gRPC's fork "
            f"support is off, so a gRPC channel here may abort the process; start processes that "
            f"talk to graphpoold with the 'spawn' method (multiprocessing.get_context('spawn')), "
            f"or set GRPC_ENABLE_FORK_SUPPORT=1 before importing graphpool in the parent (each "
            f"fork then waits about 1 s while a session is open)"
        )
    if not _grpc_pid:
        _grpc_pid = pid


def default_socket_path() -> str:
    """The daemon's socket path, as the ``graphpool`` CLI finds it: ``$GRAPHPOOL_SOCKET``; else
    ``/run/graphpool/graphpool.sock`` when that socket exists (a system daemon is running);
    else ``$XDG_RUNTIME_DIR/graphpool/graphpool.sock`` when ``XDG_RUNTIME_DIR`` is set; else
    ``/run/graphpool/graphpool.sock``."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return os.path.abspath(env)
    if os.path.exists(SYSTEM_SOCKET):
        return SYSTEM_SOCKET
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "graphpool", "graphpool.sock")
    return SYSTEM_SOCKET


# ---------------------------------------------------------------------------------------------
# Fork handling: a child never touches a channel it inherited.

_CLIENTS: weakref.WeakSet[Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for c in list(_CLIENTS):
        c._abandon_channel()
    for s in list(_SESSIONS):
        s._abandon_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Client:
    """A connection to graphpoold.

    Args:
        socket: path of the daemon's gRPC socket; default :func:`default_socket_path`
            (``$GRAPHPOOL_SOCKET`` or the system location).
        timeout: seconds to wait for each unary call (and for the first event of ``attach``);
            a positive number (``ValueError`` otherwise).

    The channel is created on first use. After ``os.fork()`` the child creates its own channel
    the first time it uses the client; the parent's channel is left alone. Sessions are bound
    to the process that attached them: a child must attach its own.

    Example::

        client = graphpool.Client()
        with client.attach("job-42", rank=0, budget="8GiB") as session:
            with session.allocate("256MiB", label="capture-pool") as seg:
                ...
    """

    def __init__(self, socket: str | os.PathLike[str] | None = None, *, timeout: float = 10.0) -> None:
        self.socket_path = os.path.abspath(os.fspath(socket)) if socket is not None else default_socket_path()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            # None would fail later, in every call, as a TypeError about NoneType + float.
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        self.timeout = timeout
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._admin: Any = None
        self._pid = 0
        # The sessions this client attached (ended by close() in the process that made them).
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        _CLIENTS.add(self)

    def __repr__(self) -> str:
        return f"Client(socket={self.socket_path!r})"

    @property
    def target(self) -> str:
        """The gRPC target (``unix:///path``)."""
        return "unix://" + self.socket_path

    # -- channel management ------------------------------------------------------------------

    def _abandon_channel(self) -> None:
        """Forgets a channel created by another process without closing it."""
        if self._channel is not None and self._pid != os.getpid():
            park(self._channel)
            self._channel = None
            self._stub = self._admin = None
        # The lock may have been held by another thread at fork time.
        self._lock = threading.Lock()

    def _stubs(self) -> tuple[Any, Any]:
        if self._channel is not None and self._pid == os.getpid():
            return self._stub, self._admin
        with self._lock:
            if self._channel is not None and self._pid != os.getpid():
                self._abandon_channel()
            if self._channel is None:
                if not os.path.exists(self.socket_path):
                    raise DaemonUnavailable(self.socket_path, "no such socket")
                _check_grpc_usable_after_fork()
                ch = grpc.insecure_channel(
                    self.target,
                    options=[
                        ("grpc.default_authority", "localhost"),
                        ("grpc.max_receive_message_length", 64 << 20),
                        ("grpc.max_send_message_length", 64 << 20),
                        ("grpc.enable_http_proxy", 0),
                        # A Unix socket on the same node: retry connecting quickly (the
                        # default first backoff is 1 s, which a child after fork always pays).
                        ("grpc.initial_reconnect_backoff_ms", 20),
                        ("grpc.min_reconnect_backoff_ms", 20),
                        # Also bounds how long a session waits to see a restarted daemon.
                        ("grpc.max_reconnect_backoff_ms", 250),
                    ],
                )
                self._stub = pb_grpc.GraphpoolStub(ch)  # type: ignore[no-untyped-call]
                self._admin = pb_grpc.AdminStub(ch)  # type: ignore[no-untyped-call]
                self._channel, self._pid = ch, os.getpid()
            return self._stub, self._admin

    def _call(self, name: str, request: Any, *, admin: bool = False, extra_time: float = 0.0) -> Any:
        stub, admin_stub = self._stubs()
        fn = getattr(admin_stub if admin else stub, name)
        timeout = self.timeout + extra_time
        try:
            return fn(request, timeout=timeout)
        except grpc.RpcError as e:
            if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # A daemon that accepts connections but does not answer (hung, stopped,
                # overloaded) is as unreachable as one that is not running.
                raise DaemonUnavailable(
                    self.socket_path,
                    f"no answer to {name} within {timeout:g} s",
                    code=grpc.StatusCode.DEADLINE_EXCEEDED,
                ) from None
            raise error_from_rpc(e, self.socket_path) from None

    def close(self) -> None:
        """Ends the sessions this client attached in this process (each as
        :meth:`Session.close`: the daemon releases their grants, their segments are unmapped),
        then closes the channel (in the process that created it). A session's event stream
        runs on the client's channel, so a session cannot outlive it: close the client only
        when its sessions are done. Sessions inherited through ``fork`` are left to their
        process. The client reconnects if used again (for new sessions).

        Raises:
            CudaError: unmapping a session's segment failed; every session is ended and the
                channel closed all the same, then the first such error is raised.
        """
        first: Exception | None = None
        for s in list(self._sessions):
            if s._pid != os.getpid():
                continue
            try:
                s.close()
            except Exception as e:  # the other sessions and the channel must end all the same
                first = first or e
        with self._lock:
            if self._channel is not None:
                if self._pid == os.getpid():
                    self._channel.close()
                else:
                    park(self._channel)
            self._channel = None
            self._stub = self._admin = None
        if first is not None:
            raise first

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sessions ------------------------------------------------------------------------------

    def attach(
        self,
        job_id: str,
        rank: int,
        local_rank: int = 0,
        device: int | str = 0,
        budget: int | str | None = None,
        reserve_budget: bool = False,
        *,
        resume: Iterable[GrantInfo] = (),
        client_name: str = CLIENT_NAME,
        reconnect: ReconnectPolicy | None = ReconnectPolicy(),
    ) -> Session:
        """Opens a session for (``job_id``, ``rank``) on ``device`` and returns it.

        Args:
            job_id: the training job (1..=128 characters of ``[A-Za-z0-9._:-]``).
            rank: global rank in the job.
            local_rank: rank on this node.
            device: device index as the daemon lists it, or a UUID (``"GPU-..."``).
            budget: most bytes the session may hold at once (``int`` or ``"8GiB"``); ``None``
                means only the job/rank quotas and the device budget apply.
            reserve_budget: admit the whole budget now, so later allocations up to it cannot be
                refused for lack of capacity.
            resume: grants this process still maps from an earlier daemon instance.
            client_name: identifies the client program in the daemon's logs and in session
                listings (``SessionInfo.client``); printable ASCII, at most 128 bytes (default
                ``"graphpool-py/<version>"``).
            reconnect: a :class:`ReconnectPolicy`: how the session re-attaches on its own
                after the daemon went away (default: keep trying for 10 minutes, backoff capped
                at 2 s); ``None``: the session ends with the stream. See README "Daemon
                restarts".

        Raises:
            CapacityExceeded: ``reserve_budget`` and the budget does not fit.
            InvalidArgument: a field is malformed (``.field`` says which).
            DaemonUnavailable: the daemon cannot be reached.
        """
        _text("job_id", job_id)
        _uint("rank", rank, 32)
        _uint("local_rank", local_rank, 32)
        _text("client", client_name)
        if reconnect is not None and not isinstance(reconnect, ReconnectPolicy):
            raise InvalidArgument(
                f"reconnect must be a graphpool.ReconnectPolicy (or None to end the session "
                f"with its stream), not {reconnect!r}",
                field="reconnect",
            )
        if isinstance(device, bool) or not isinstance(device, (int, str)):
            raise InvalidArgument(f"device must be an index or a UUID, not {device!r}", field="device")
        budget_bytes = 0
        if budget is not None:
            try:
                budget_bytes = parse_size(budget)
            except (ValueError, TypeError) as e:
                raise InvalidArgument(str(e), field="budget_bytes") from None
        resume = list(resume)
        req = pb.AttachRequest(
            job_id=job_id,
            rank=rank,
            local_rank=local_rank,
            device=str(device),
            client=client_name,
            budget_bytes=budget_bytes,
            reserve_budget=reserve_budget,
            resume=[
                pb.HeldGrant(grant_id=g.grant_id, device_uuid=g.device_uuid, size_bytes=g.size, label=g.label)
                for g in resume
            ],
        )
        stub, _ = self._stubs()
        call = stub.Attach(req)
        first: queue.Queue[pb.SessionEvent | BaseException] = queue.Queue(maxsize=1)
        holder: list[Session] = []
        ready = threading.Event()
        thread = threading.Thread(
            target=_read_events,
            args=(call, first, holder, ready, self.socket_path),
            name=f"graphpool-session-{job_id}-{rank}",
            daemon=True,
        )
        thread.start()
        session: Session | None = None
        try:
            try:
                ev = first.get(timeout=self.timeout)
            except queue.Empty:
                raise DaemonUnavailable(
                    self.socket_path, f"no answer to Attach within {self.timeout:g} s"
                ) from None
            if isinstance(ev, BaseException):
                raise ev
            a = ev.attached
            session = Session(
                client=self,
                call=call,
                thread=thread,
                session_id=a.session_id,
                job_id=job_id,
                rank=rank,
                local_rank=local_rank,
                device=DeviceInfo._from(a.device),
                daemon_instance=a.daemon_instance,
                fd_socket=a.fd_socket,
                reserved=a.reserved_bytes,
                budget=budget_bytes,
                adopted=tuple(GrantInfo._from(g) for g in a.adopted),
                request=req,
                reconnect=reconnect,
            )
            holder.append(session)
            self._sessions.add(session)
            ready.set()
        except BaseException:
            # No session comes out of this (no answer in time, a refusal, or an interruption
            # such as KeyboardInterrupt while waiting): cancelling the stream ends the daemon's
            # side, if it attached, and the thread is let go instead of waiting for a session
            # forever (or, having seen the session, sees it closed and ends it).
            holder.clear()
            if session is not None:
                session._closed = True
                self._sessions.discard(session)
                _SESSIONS.discard(session)
            call.cancel()
            ready.set()
            raise
        return session

    # -- low-level calls naming a session ------------------------------------------------------

    def allocate_segment(self, session_id: int, size: int | str, label: str = "") -> GrantInfo:
        """Low level: ``AllocateSegment`` for any session id, without fetching the fd. Prefer
        :meth:`Session.allocate`.

        Raises:
            InvalidArgument: a field is malformed (``.field`` says which), before any call.
        """
        req = pb.AllocateSegmentRequest(
            session_id=_uint("session_id", session_id, 64), size_bytes=_size_bytes(size), label=_text("label", label)
        )
        grant: pb.Grant = self._call("AllocateSegment", req)
        return GrantInfo._from(grant)

    def release_segment(self, session_id: int, grant_id: int) -> int:
        """Low level: ``ReleaseSegment``; returns the bytes released. Prefer
        :meth:`Segment.release` or :meth:`Session.release`. A malformed id is
        ``InvalidArgument`` naming it, before any call."""
        req = pb.ReleaseSegmentRequest(
            session_id=_uint("session_id", session_id, 64), grant_id=_uint("grant_id", grant_id, 64)
        )
        resp: pb.ReleaseSegmentResponse = self._call("ReleaseSegment", req)
        return resp.bytes_released

    def detach(self, session_id: int) -> DetachResult:
        """Low level: ends a session by id (``Detach``). Prefer :meth:`Session.close`. A
        malformed id is ``InvalidArgument`` naming it, before any call."""
        req = pb.DetachRequest(session_id=_uint("session_id", session_id, 64))
        resp: pb.DetachResponse = self._call("Detach", req)
        return DetachResult(grants_released=resp.grants_released, bytes_released=resp.bytes_released)

    def plan_capture(
        self, session_id: int, plan_input: Any, reserve: bool = False, summary_only: bool = False
    ) -> pb.PlanCaptureResponse:
        """Low level: ``PlanCapture`` with a ``graphpool.v1.PlanInput`` message; returns the raw
        ``PlanCaptureResponse``. The call may take the client's timeout plus the input's
        ``time_budget_ms`` (a schedule that does not reach its bound is searched that long).
        ``summary_only`` leaves ``Plan.buffers`` out of the response.

        Raises:
            InvalidArgument: ``plan_input`` is not a ``PlanInput`` message, or another argument
                is malformed (``.field`` says which), before any call.
        """
        if not isinstance(plan_input, plan_pb.PlanInput):
            raise InvalidArgument(
                f"plan_input must be a graphpool.v1.PlanInput message (graphpool.capture."
                f"capture_plan_input builds one), not {type(plan_input).__name__}",
                field="input",
            )
        req = pb.PlanCaptureRequest(
            session_id=_uint("session_id", session_id, 64),
            input=plan_input,
            reserve=_flag("reserve", reserve),
            summary_only=_flag("summary_only", summary_only),
        )
        budget = plan_input.time_budget_ms / 1000.0
        resp: pb.PlanCaptureResponse = self._call("PlanCapture", req, extra_time=budget)
        return resp

    # -- node-wide queries -----------------------------------------------------------------------

    def status(self) -> Status:
        """Devices, capacity, sessions and daemon identity."""
        return Status._from(self._call("GetStatus", pb.GetStatusRequest()))

    def usage(self) -> Usage:
        """Usage per device, per job and per rank."""
        return Usage._from(self._call("GetUsage", pb.GetUsageRequest()))

    def grants(self, job_id: str | None = None) -> list[GrantInfo]:
        """Every grant on the node (needs a uid on the daemon's allow-list), or those of
        ``job_id``."""
        req = pb.ListGrantsRequest(session_id=0, job_id=_text("job_id", job_id) if job_id is not None else "")
        resp: pb.ListGrantsResponse = self._call("ListGrants", req)
        return [GrantInfo._from(g) for g in resp.grants]

    def health(self) -> bool:
        """True when the daemon answers ``GetStatus``; False when it cannot be reached or does
        not answer within the client's timeout."""
        try:
            self.status()
        except DaemonUnavailable:
            return False
        return True

    def limits(self) -> Limits:
        """The limits in force."""
        return Limits._from(self._call("GetLimits", pb.GetLimitsRequest(), admin=True))

    def set_limits(
        self,
        *,
        default_rank_quota: int | str | None = None,
        default_job_quota: int | str | None = None,
        jobs: Mapping[str, int | str] | None = None,
        ranks: Mapping[tuple[str, int], int | str] | None = None,
        devices: Mapping[int | str, int | str] | None = None,
    ) -> Limits:
        """Changes limits (admin uids only); arguments left ``None`` keep their value.

        Args:
            default_rank_quota: quota of every rank without a rank-specific one (0 = unlimited).
            default_job_quota: quota of every job without a job-specific one (0 = unlimited).
            jobs: ``{job_id: quota}``; a quota of 0 removes the job's quota.
            ranks: ``{(job_id, rank): quota}``; 0 removes it.
            devices: ``{index or "GPU-uuid": budget}``.

        Returns the limits now in force.

        Raises:
            InvalidArgument: a key or size is malformed (``.field`` names it as the daemon
                would, e.g. ``"ranks[0].rank"``), before any call; or the daemon refused one.
            PermissionDenied: this uid is not an admin.
        """

        def size(name: str, v: int | str) -> int:
            try:
                return parse_size(v)
            except (ValueError, TypeError) as e:
                raise InvalidArgument(str(e), field=name) from None

        req = pb.SetLimitsRequest()
        if default_rank_quota is not None:
            req.default_rank_quota_bytes = size("default_rank_quota_bytes", default_rank_quota)
        if default_job_quota is not None:
            req.default_job_quota_bytes = size("default_job_quota_bytes", default_job_quota)
        for i, (job, q) in enumerate((jobs or {}).items()):
            req.jobs.append(
                pb.JobLimit(job_id=_text(f"jobs[{i}].job_id", job), quota_bytes=size("jobs.quota_bytes", q))
            )
        for i, (key, q) in enumerate((ranks or {}).items()):
            if not isinstance(key, tuple) or len(key) != 2:
                raise InvalidArgument(
                    f"ranks keys must be (job_id, rank) pairs, not {key!r}", field=f"ranks[{i}]"
                )
            job, rank = key
            req.ranks.append(
                pb.RankLimit(
                    job_id=_text(f"ranks[{i}].job_id", job),
                    rank=_uint(f"ranks[{i}].rank", rank, 32),
                    quota_bytes=size("ranks.quota_bytes", q),
                )
            )
        for i, (dev, b) in enumerate((devices or {}).items()):
            d = pb.DeviceLimit(budget_bytes=size("devices.budget_bytes", b))
            if isinstance(dev, str):
                d.device_uuid = dev
            else:
                try:
                    d.device_index = _uint(f"devices[{i}].device_index", dev, 32)
                except InvalidArgument:
                    raise InvalidArgument(
                        f"devices keys must be a device index or a UUID (\"GPU-...\"), not {dev!r}",
                        field=f"devices[{i}].device_index",
                    ) from None
            req.devices.append(d)
        return Limits._from(self._call("SetLimits", req, admin=True))
