"""A training rank's session with graphpoold: its grants, its event stream, and re-attaching
after a daemon restart."""

from __future__ import annotations

import atexit
import math
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from ._proto.graphpool.v1 import graphpool_pb2 as pb
from ._fields import _size_bytes, _text, _uint
from ._fork import park
from .errors import (
    DaemonUnavailable,
    FailedPrecondition,
    GraphpoolError,
    InvalidArgument,
    NotFound,
    error_from_rpc,
)
from .info import DeviceInfo, GrantInfo, Limits
from .segments import FdChannel, Segment

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client


@dataclass(frozen=True)
class ReconnectPolicy:
    """How a :class:`Session` re-attaches after its daemon went away (see README, "Daemon
    restarts").

    Attributes:
        initial_backoff: seconds before the second attempt (the first is immediate); > 0.
        max_backoff: cap of the exponential backoff between attempts, seconds; > 0.
        multiplier: growth of the backoff per failed attempt; >= 1.
        deadline: seconds after the stream ended at which the session gives up and ends
            (``"ended"`` event); calls then raise ``FailedPrecondition``; >= 0.

    Raises:
        InvalidArgument: a value is not a finite number in its range (``.field`` names it).
    """

    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0
    deadline: float = 600.0

    def __post_init__(self) -> None:
        # A zero or negative backoff would retry in a tight loop; NaN or infinity would make
        # the waits or the deadline meaningless.
        for name, lowest, strict in (
            ("initial_backoff", 0.0, True),
            ("max_backoff", 0.0, True),
            ("multiplier", 1.0, False),
            ("deadline", 0.0, False),
        ):
            v = getattr(self, name)
            ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            if not ok or v < lowest or (strict and v == lowest):
                bound = f"greater than {lowest:g}" if strict else f"at least {lowest:g}"
                unit = "" if name == "multiplier" else " of seconds"
                raise InvalidArgument(
                    f"ReconnectPolicy.{name} must be a finite number{unit} {bound}, not {v!r}", field=name
                )

    def delays(self) -> Iterator[float]:
        """The waits between attempts: 0, then ``initial_backoff`` growing by ``multiplier``
        up to ``max_backoff``."""
        yield 0.0
        d = max(self.initial_backoff, 0.0)
        while True:
            yield min(d, self.max_backoff)
            d = min(d * max(self.multiplier, 1.0), self.max_backoff)


@dataclass(frozen=True)
class Reattached:
    """The value of a session's ``"reattached"`` event.

    Attributes:
        session_id: the new session id (grants keep their ids).
        previous_session_id: the id before the daemon went away.
        daemon_instance: the new daemon's instance.
        adopted: grant ids the new daemon adopted (every grant the session still held).
        unadopted: declared grant ids the daemon did not adopt (no longer accounted; their
            local mappings stay valid).
        outage_seconds: from the end of the old stream to the new ``attached`` event.
        attempts: attach attempts it took.
    """

    session_id: int
    previous_session_id: int
    daemon_instance: str
    adopted: tuple[int, ...]
    unadopted: tuple[int, ...]
    outage_seconds: float
    attempts: int


@dataclass(frozen=True)
class DetachResult:
    """What ending a session released."""

    grants_released: int
    bytes_released: int


_SESSIONS: weakref.WeakSet[Session] = weakref.WeakSet()


# Status codes after which a session's stream ending means "the daemon went away" (killed,
# restarting, or draining): the session re-attaches. Any other code ends it for good.
_RECONNECT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


# Attach failures that retrying cannot fix.
_FATAL_ATTACH_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


def _listening(path: str) -> bool:
    """Whether something accepts connections on the Unix socket ``path`` (a cheap probe)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(0.2)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _renewed(event: threading.Event) -> threading.Event:
    """A new event in the state of ``event`` (for a forked child: see
    :meth:`Session._abandon_in_child`)."""
    fresh = threading.Event()
    if event.is_set():
        fresh.set()
    return fresh


def _read_events(
    call: Any,
    first: queue.Queue[pb.SessionEvent | BaseException],
    holder: list[Session],
    ready: threading.Event,
    socket_path: str,
) -> None:
    """The session's thread: reads the first event of the stream for :meth:`Client.attach`,
    then the rest of the stream, re-attaching after a daemon restart (see :meth:`Session._serve`)."""
    it: Iterator[pb.SessionEvent] = iter(call)
    try:
        ev = next(it)
    except grpc.RpcError as e:
        first.put(error_from_rpc(e, socket_path))
        return
    except StopIteration:
        first.put(DaemonUnavailable(socket_path, "the daemon closed the session stream before attaching"))
        return
    except BaseException as e:  # pragma: no cover - defensive
        first.put(e)
        return
    if ev.WhichOneof("event") != "attached":
        first.put(GraphpoolError(f"the daemon's first session event was {ev.WhichOneof('event')!r}, not 'attached'"))
        call.cancel()
        return
    first.put(ev)
    ready.wait()
    if holder:
        holder[0]._serve(it)


class Session:
    """A session with graphpoold, bound to this process. Obtained from :meth:`Client.attach`.

    The daemon keeps the session for as long as its event stream is open (a background thread
    reads it, on the client's channel). :meth:`close` (or leaving the ``with`` block) ends it
    and releases every grant; so do :meth:`Client.close` of its client and the exit of the
    process, within a second.

    **Daemon restarts.** When the stream ends because the daemon went away (killed, crashed,
    or shut down after ``draining``), the session's thread re-attaches on its own with the
    same job, rank, device and budget, declaring every grant the session still holds
    (``AttachRequest.resume``); the new daemon adopts them, so its usage equals what it was.
    Mappings stay valid throughout; segments keep their grant ids and release normally; only
    ``session_id`` and ``daemon_instance`` change. Calls made meanwhile wait for the
    re-attach (up to the client's timeout) and then raise ``DaemonUnavailable``. Grants whose
    fd was never fetched cannot be fetched after a restart (the new daemon has no fd for an
    adopted grant). See :class:`ReconnectPolicy` and README "Daemon restarts".

    Attributes:
        session_id: the daemon's id of the session (changes when it re-attaches).
        job_id, rank, local_rank: as given to :meth:`Client.attach`.
        device: the device the session allocates on.
        daemon_instance: changes when the daemon restarts.
        fd_socket: path of the socket on which grant fds are fetched.
        reserved: bytes reserved for the session (its budget, with ``reserve_budget``).
        budget: the session's budget in bytes (0: none).
        adopted: grants adopted from ``resume`` (at attach, or at the last re-attach).
        reattaches: how many times the session re-attached.
    """

    def __init__(
        self,
        *,
        client: Client,
        call: Any,
        thread: threading.Thread,
        session_id: int,
        job_id: str,
        rank: int,
        local_rank: int,
        device: DeviceInfo,
        daemon_instance: str,
        fd_socket: str,
        reserved: int,
        budget: int,
        adopted: tuple[GrantInfo, ...],
        request: pb.AttachRequest | None = None,
        reconnect: ReconnectPolicy | None = None,
    ) -> None:
        self.client = client
        self.session_id = session_id
        self.job_id = job_id
        self.rank = rank
        self.local_rank = local_rank
        self.device = device
        self.daemon_instance = daemon_instance
        self.fd_socket = fd_socket
        self.reserved = reserved
        self.budget = budget
        self.adopted = adopted
        self.reattaches = 0
        self._call_obj = call
        self._thread = thread
        self._pid = os.getpid()
        self._fds = FdChannel(fd_socket, timeout=client.timeout, daemon_socket=client.socket_path)
        # Guarded by `_state`: close() snapshots it while another thread may allocate.
        self._segments: weakref.WeakValueDictionary[int, Segment] = weakref.WeakValueDictionary()
        self._closed = False
        self._end_reason: str | None = None
        self._lock = threading.Lock()
        self._draining: float | None = None
        self._limits: Limits | None = None
        self._listeners: list[Callable[[str, object], None]] = []
        # Re-attach state. `_state` guards everything below and `session_id`/`_call_obj`;
        # `_attached` is set while the session is open in a daemon.
        self._request = request
        self._policy = reconnect
        self._state = threading.Lock()
        self._attached = threading.Event()
        self._attached.set()
        self._stop = threading.Event()
        self._generation = 0
        self._reconnecting_since: float | None = None
        self._last_attempt_error = ""
        self._attempt: Any = None
        # Every grant the session holds and has not released: what it declares on re-attach.
        self._held: dict[int, GrantInfo] = {g.grant_id: g for g in adopted}
        # Grants the last re-attach declared but the daemon did not adopt.
        self._unadopted: set[int] = set()
        # Grants whose release failed with the daemon unreachable: retried later.
        self._pending_release: set[int] = set()
        _SESSIONS.add(self)

    def __repr__(self) -> str:
        if self._closed:
            state = "closed"
        elif self._end_reason:
            state = f"ended: {self._end_reason}"
        elif self._reconnecting_since is not None:
            state = "reconnecting"
        else:
            state = "open"
        return (
            f"Session(session_id={self.session_id}, job_id={self.job_id!r}, rank={self.rank}, "
            f"device={self.device.uuid!r}, {state})"
        )

    # -- state -----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """True while the session is open in the daemon as far as this process knows (False
        while it re-attaches after a daemon restart)."""
        return (
            not self._closed
            and self._end_reason is None
            and self._pid == os.getpid()
            and self._reconnecting_since is None
        )

    @property
    def reconnecting(self) -> bool:
        """True while the daemon is gone and the session tries to re-attach."""
        return self._reconnecting_since is not None and not self._closed and self._end_reason is None

    @property
    def draining(self) -> float | None:
        """Seconds the daemon announced before it shuts down, or ``None``."""
        return self._draining

    @property
    def limits_changed(self) -> Limits | None:
        """The limits the daemon last announced for this session, or ``None``."""
        return self._limits

    @property
    def held(self) -> tuple[GrantInfo, ...]:
        """The grants this session holds as this process tracks them (what it declares when it
        re-attaches)."""
        with self._state:
            return tuple(self._held.values())

    def add_listener(self, fn: Callable[[str, object], None]) -> None:
        """Calls ``fn(kind, value)`` from the session's thread on ``"draining"`` (seconds),
        ``"limits_changed"`` (:class:`Limits`), ``"disconnected"`` (reason: the daemon went
        away, re-attaching starts), ``"reattached"`` (:class:`Reattached`) and ``"ended"``
        (reason) events."""
        self._listeners.append(fn)

    def _emit(self, kind: str, value: object) -> None:
        for fn in list(self._listeners):
            try:
                fn(kind, value)
            except Exception:  # a listener must not kill the session thread
                pass

    def _on_event(self, ev: pb.SessionEvent) -> None:
        kind = ev.WhichOneof("event")
        if kind == "draining":
            self._draining = ev.draining.drain_seconds
            self._emit("draining", self._draining)
        elif kind == "limits_changed":
            self._limits = Limits._from(ev.limits_changed)
            self._emit("limits_changed", self._limits)

    def _on_stream_end(self, reason: str) -> None:
        if self._end_reason is None:
            self._end_reason = reason
        self._attached.set()  # wake waiters: they see the end
        self._emit("ended", reason)

    # -- the session's thread ----------------------------------------------------------------

    def _serve(self, it: Iterator[pb.SessionEvent]) -> None:
        """Reads the stream; when it ends because the daemon went away, re-attaches and reads
        the new stream, until the session is closed, ends, or re-attaching gives up. A failure
        of the thread itself ends the session (``"ended"``) rather than leaving it
        re-attaching with no thread to do it."""
        try:
            self._serve_streams(it)
        except Exception as e:
            self._fail(e)

    def _fail(self, e: Exception) -> None:
        """Ends the session after its thread failed: the daemon's side goes too (the streams
        are cancelled, so it releases the grants), and calls raise ``FailedPrecondition``."""
        with self._state:
            calls = (self._call_obj, self._attempt)
            self._attempt = None
        for c in calls:
            try:
                if c is not None:
                    c.cancel()
            except Exception:
                pass
        self._on_stream_end("closed" if self._closed else f"the session's thread failed: {e!r}")
        self._abandon_local_grants()

    def _serve_streams(self, it: Iterator[pb.SessionEvent]) -> None:
        while True:
            reason, code = self._read_until_end(it)
            if self._closed or self._pid != os.getpid():
                self._on_stream_end("closed")
                return
            went_away = code is None or code in _RECONNECT_CODES or self._draining is not None
            if self._policy is None or self._request is None or not went_away:
                self._on_stream_end(reason)
                return
            nxt = self._reattach(reason)
            if nxt is None:
                return
            it = nxt

    def _read_until_end(self, it: Iterator[pb.SessionEvent]) -> tuple[str, grpc.StatusCode | None]:
        socket_path = self.client.socket_path
        try:
            for ev in it:
                self._on_event(ev)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
            return str(error_from_rpc(e, socket_path)), code
        # Anything else is a failure of this thread, not the daemon going away: _serve ends
        # the session (re-attaching would leave this stream, and its session, open).
        return "the daemon ended the session stream", None

    def _reattach(self, reason: str) -> Iterator[pb.SessionEvent] | None:
        """Re-attaches with backoff; returns the new stream's iterator, or ``None`` when the
        session ended (closed meanwhile, a fatal refusal, or the policy's deadline)."""
        assert self._policy is not None and self._request is not None
        policy = self._policy
        t0 = time.monotonic()
        with self._state:
            self._reconnecting_since = t0
            self._attached.clear()
            previous = self.session_id
        self._emit("disconnected", reason)
        attempts = 0
        unreachable = False
        for delay in policy.delays():
            left = t0 + policy.deadline - time.monotonic()
            if delay > 0:
                if left <= 0 or self._pause(min(delay, left), probe=unreachable):
                    break
            if self._closed:
                break
            if time.monotonic() - t0 > policy.deadline:
                break
            attempts += 1
            with self._state:
                declared = dict(self._held)
            req = pb.AttachRequest()
            req.CopyFrom(self._request)
            del req.resume[:]
            if self.device.uuid:
                req.device = self.device.uuid  # the stable name, whatever index it has now
            req.resume.extend(
                pb.HeldGrant(grant_id=g.grant_id, device_uuid=g.device_uuid, size_bytes=g.size, label=g.label)
                for g in declared.values()
            )
            try:
                call, it, attached = self._attach_once(req)
            except GraphpoolError as e:
                self._last_attempt_error = str(e)
                unreachable = isinstance(e, DaemonUnavailable)
                if e.code in _FATAL_ATTACH_CODES:
                    self._on_stream_end(f"re-attaching after a daemon restart was refused: {e}")
                    self._abandon_local_grants()
                    return None
                continue
            except Exception as e:  # e.g. ValueError("Channel closed!"): a failed attempt too
                self._last_attempt_error = repr(e)
                unreachable = False
                continue
            self._install(call, attached, declared, previous, t0, attempts)
            return it
        if not self._closed:
            self._on_stream_end(
                f"the daemon did not come back within {policy.deadline:g} s ({reason}; "
                f"last attempt: {self._last_attempt_error or 'none'})"
            )
            self._abandon_local_grants()
        else:
            self._on_stream_end("closed")
        return None

    def _pause(self, seconds: float, *, probe: bool) -> bool:
        """Sleeps ``seconds`` between attempts; returns True when the session was closed.
        With ``probe`` (the daemon was unreachable), ends the wait early as soon as something
        accepts connections on the socket again: a new daemon is attached to at once instead
        of after the rest of the backoff."""
        end = time.monotonic() + seconds
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return False
            if self._stop.wait(min(left, 0.02) if probe else left):
                return True
            if probe and _listening(self.client.socket_path):
                return False

    def _attach_once(self, req: pb.AttachRequest) -> tuple[Any, Iterator[pb.SessionEvent], pb.Attached]:
        """One Attach; waits for the ``attached`` event up to the client's timeout."""
        socket_path = self.client.socket_path
        stub, _ = self.client._stubs()
        # When a daemon listens again, wait_for_ready lets a channel still backing off from the
        # dead daemon connect instead of failing at once (the timer below bounds the wait).
        call = stub.Attach(req, wait_for_ready=_listening(socket_path))
        with self._state:
            self._attempt = call  # close() cancels it
        if self._closed:
            call.cancel()
        timer = threading.Timer(self.client.timeout, call.cancel)
        timer.daemon = True
        timer.start()
        it: Iterator[pb.SessionEvent] = iter(call)
        try:
            ev = next(it)
        except grpc.RpcError as e:
            raise error_from_rpc(e, socket_path) from None
        except StopIteration:
            raise DaemonUnavailable(socket_path, "the daemon closed the session stream before attaching") from None
        except BaseException:
            call.cancel()
            raise
        finally:
            timer.cancel()
        if ev.WhichOneof("event") != "attached":
            call.cancel()
            raise DaemonUnavailable(socket_path, f"the first session event was {ev.WhichOneof('event')!r}")
        if self._closed:
            call.cancel()
            raise DaemonUnavailable(socket_path, "the session was closed while re-attaching")
        return call, it, ev.attached

    def _install(
        self,
        call: Any,
        a: pb.Attached,
        declared: dict[int, GrantInfo],
        previous: int,
        t0: float,
        attempts: int,
    ) -> None:
        """Swaps the new session in and checks what the daemon adopted."""
        adopted = tuple(GrantInfo._from(g) for g in a.adopted)
        ok = {g.grant_id for g in adopted if g.grant_id in declared and g.size == declared[g.grant_id].size}
        unadopted = tuple(sorted(set(declared) - ok))
        old_fds = self._fds
        with self._state:
            self._call_obj = call
            self.session_id = a.session_id
            self.daemon_instance = a.daemon_instance
            self.fd_socket = a.fd_socket
            self.reserved = a.reserved_bytes
            self.device = DeviceInfo._from(a.device)
            self.adopted = adopted
            self._fds = FdChannel(a.fd_socket, timeout=self.client.timeout, daemon_socket=self.client.socket_path)
            self._draining = None
            for gid in unadopted:
                if self._held.pop(gid, None) is not None:
                    self._unadopted.add(gid)
            # Released while the attach was in flight: declared, so adopted; release now.
            late = [gid for gid in ok if gid not in self._held]
            self._pending_release = set(late)
            self._generation += 1
            self._reconnecting_since = None
            self.reattaches += 1
        old_fds.close()
        self._attached.set()
        self._flush_pending()
        info = Reattached(
            session_id=a.session_id,
            previous_session_id=previous,
            daemon_instance=a.daemon_instance,
            adopted=tuple(sorted(ok)),
            unadopted=unadopted,
            outage_seconds=time.monotonic() - t0,
            attempts=attempts,
        )
        self._emit("reattached", info)

    def _abandon_local_grants(self) -> None:
        with self._state:
            self._held.clear()
            self._pending_release.clear()

    def _flush_pending(self) -> None:
        """Retries releases that failed while the daemon was unreachable."""
        with self._state:
            todo, self._pending_release = self._pending_release, set()
            sid = self.session_id
        for gid in todo:
            try:
                self.client.release_segment(sid, gid)
            except DaemonUnavailable:
                with self._state:
                    if self.session_id == sid and self._reconnecting_since is None:
                        self._pending_release.add(gid)
            except GraphpoolError:
                pass  # released already

    def _abandon_in_child(self) -> None:
        # The thread and the stream stayed in the parent; forget them here without closing.
        # Every lock is renewed, the events' too (an Event holds a lock, which a thread of
        # the parent may have held at fork time: the session's thread waits on both events);
        # is_set() reads a flag without taking it.
        if self._pid != os.getpid():
            park(self._call_obj)
            self._lock = threading.Lock()
            self._state = threading.Lock()
            self._attached = _renewed(self._attached)
            self._stop = _renewed(self._stop)

    def _check(self) -> None:
        if self._pid != os.getpid():
            raise FailedPrecondition(
                f"session {self.session_id} belongs to process {self._pid}, not to this process "
                f"({os.getpid()}): after fork, attach a new session in the child "
                f"(graphpool.Client().attach(...))"
            )
        if self._closed:
            raise FailedPrecondition(f"session {self.session_id} is closed; attach a new one")
        if self._end_reason is not None:
            raise FailedPrecondition(
                f"session {self.session_id} ended ({self._end_reason}); attach a new one"
            )

    def _unavailable(self) -> DaemonUnavailable:
        since = self._reconnecting_since
        outage = f" for {time.monotonic() - since:.1f} s" if since is not None else ""
        last = f"; last attempt: {self._last_attempt_error}" if self._last_attempt_error else ""
        return DaemonUnavailable(
            self.client.socket_path,
            f"the daemon went away{outage} and session {self.session_id} of {self.job_id}/{self.rank} "
            f"is re-attaching (it keeps trying for {self._policy.deadline if self._policy else 0:g} s; "
            f"mapped segments stay valid){last}",
        )

    def _wait_attached(self, deadline: float) -> tuple[int, int]:
        """Waits until the session is open in a daemon; returns (session id, generation)."""
        self._check()
        while True:
            if self._attached.wait(max(0.0, deadline - time.monotonic())):
                self._check()
                with self._state:
                    if self._reconnecting_since is None:
                        return self.session_id, self._generation
            if time.monotonic() >= deadline:
                self._check()
                raise self._unavailable()

    def _moved(self, gen: int) -> bool:
        """Whether the session is no longer the attachment of generation ``gen``: it
        re-attaches (or did), ended, or was closed."""
        return (
            gen != self._generation
            or self._reconnecting_since is not None
            or self._end_reason is not None
            or self._closed
        )

    def _wait_moved(self, gen: int, seconds: float) -> bool:
        """Waits up to ``seconds`` for the session's thread to see its stream end (after a
        call found the daemon unreachable); returns :meth:`_moved`."""
        until = time.monotonic() + seconds
        while not self._moved(gen) and time.monotonic() < until:
            time.sleep(0.01)
        return self._moved(gen)

    def _with_session(self, op: Callable[[int], Any]) -> Any:
        """Runs ``op(session_id)``; when it fails because the daemon went away (or the call
        reached a new daemon before this session re-attached), waits for the re-attach and
        runs it again with the new id, within the client's timeout."""
        deadline = time.monotonic() + self.client.timeout
        while True:
            sid, gen = self._wait_attached(deadline)
            try:
                return op(sid)
            except GraphpoolError as e:
                if self._policy is None:
                    raise
                if isinstance(e, DaemonUnavailable) and gen == self._generation:
                    # The stream's end may not have been seen yet: give the thread a moment.
                    self._wait_moved(gen, min(1.0, max(0.0, deadline - time.monotonic())))
                moved = gen != self._generation or self._reconnecting_since is not None
                if not moved:
                    # The session is not re-attaching: it ended meanwhile (say so), or the
                    # daemon is there and this is its answer (or the fd socket's own failure).
                    self._check()
                    raise
                if time.monotonic() >= deadline:
                    raise self._unavailable() from e

    # -- segments --------------------------------------------------------------------------

    def allocate(self, size: int | str, label: str = "") -> Segment:
        """Asks the daemon for a segment of at least ``size`` bytes (``int`` or ``"256MiB"``);
        the grant and its fd come back in one exchange on the fd socket (the fast path of
        ``AllocateSegment``). The size is rounded up to the device granularity.

        Raises:
            CapacityExceeded: it does not fit under a budget, quota or the device's capacity.
            InvalidArgument: ``size`` or ``label`` is malformed (``.field`` says which).
            FailedPrecondition: the session is closed or belongs to another process.
            DaemonUnavailable: the daemon is gone and the session did not re-attach within
                the client's timeout.
        """
        self._check()
        if self._pending_release:
            self._flush_pending()

        size_bytes = _size_bytes(size)
        _text("label", label)

        def grant_with_fd(sid: int) -> tuple[GrantInfo, int, pb.FdResponse]:
            grant, fd, resp = self._fds.allocate(sid, size_bytes, label)
            return GrantInfo._from(grant), fd, resp

        grant, fd, resp = self._with_session(grant_with_fd)
        seg = Segment(grant, fd, resp.handle_kind or grant.handle_kind, self._release_segment)
        with self._state:
            closed = self._closed
            if not closed:
                self._held[grant.grant_id] = grant
                self._segments[grant.grant_id] = seg
        if closed:
            # close() ran meanwhile: the daemon released the grant with the session.
            seg._forget()
            self._check()
        return seg

    def _release_grant(self, grant_id: int) -> int:
        """Releases a grant in the daemon, across a daemon restart; returns the bytes.

        The release goes on the fd socket. When that socket is unreachable while the session's
        stream is up (the daemon is there; its fd socket failed), it goes again at once over
        gRPC. A release while the daemon is away is local: the grant leaves the grants the
        session holds, so its re-attach does not declare it (or, declared already, releases
        it right after). When neither socket answers and the session does not see its stream
        end within a second (a daemon that accepts connections but does not answer), the
        release is kept for the session's next ``allocate()`` (``close()`` ends the session,
        and the grant with it) and ``DaemonUnavailable`` is raised: nothing was released."""
        with self._state:
            info = self._held.pop(grant_id, None)
            unadopted = grant_id in self._unadopted
            self._unadopted.discard(grant_id)
            away = self._reconnecting_since is not None
            sid, gen = self.session_id, self._generation
        if unadopted:
            return 0  # the daemon does not account for it
        if info is not None and away:
            # Not declared on re-attach (or released right after it, see _install).
            return info.size
        try:
            return self._fds.release(sid, grant_id)
        except DaemonUnavailable as e:
            if info is None:
                raise
            fd_error = e
        except GraphpoolError:
            if info is None or self._policy is None:
                raise
            # A refusal of a grant this session holds: a new daemon answered (the old one's
            # session is unknown there) before the session saw the old one go?
            if self._wait_moved(gen, min(1.0, self.client.timeout)):
                return info.size  # the new daemon never gets it declared, or _install releases it
            raise
        if self._moved(gen):
            return info.size  # the daemon went away meanwhile: local, as above
        # The session's stream is up, so the daemon may well be there: only its fd socket
        # failed. Nothing will retry soon, so the release goes again now, over gRPC.
        try:
            return self.client.release_segment(sid, grant_id)
        except NotFound:
            # Gone from the daemon: the fd socket's exchange released it before failing (or a
            # new daemon, which never heard of the session, answered: local, as above).
            return info.size
        except GraphpoolError as e:
            if self._wait_moved(gen, min(1.0, self.client.timeout)):
                return info.size  # the daemon went away: local, as above
            if not isinstance(e, DaemonUnavailable):
                raise
            grpc_error = e
        with self._state:
            if self.session_id == sid and self._reconnecting_since is None:
                self._pending_release.add(grant_id)
        raise DaemonUnavailable(
            self.client.socket_path,
            f"grant {grant_id} of session {sid} was not released: the daemon answered neither on "
            f"its fd socket ({fd_error.reason or fd_error}) nor on its gRPC socket "
            f"({grpc_error.reason or grpc_error}), while the session's stream stayed open; the "
            f"session's next allocate() releases it (close() releases it with the session)",
            code=grpc_error.code,
        ) from grpc_error

    def _release_segment(self, grant_id: int) -> None:
        with self._state:
            self._segments.pop(grant_id, None)
        if self._closed or self._end_reason is not None or self._pid != os.getpid():
            return
        self._release_grant(grant_id)

    def release(self, grant_id: int) -> int:
        """Releases a grant of this session by id and returns the bytes released. A live
        :class:`Segment` of that grant is unmapped first (when that fails, the grant is
        released all the same and the unmapping's error raised).

        Raises:
            NotFound: no such grant (e.g. released already).
            PermissionDenied: the grant belongs to another session.
            InvalidArgument: ``grant_id`` is not a grant id (an int of 64 bits).
            DaemonUnavailable: the daemon answered on none of its sockets while the session's
                stream stayed open (a hung daemon): nothing was released; the session's next
                ``allocate()`` releases it, ``close()`` with the session.
        """
        self._check()
        _uint("grant_id", grant_id, 64)
        with self._state:
            seg = self._segments.pop(grant_id, None)
        unmap_error: Exception | None = None
        if seg is not None:
            try:
                seg._forget()
            except Exception as e:  # a failed unmap (CudaError) must not keep the grant
                unmap_error = e
        released = self._release_grant(grant_id)
        if unmap_error is not None:
            raise unmap_error
        return released

    def fetch_fd(self, grant_id: int) -> int:
        """Fetches (another) fd of one of this session's grants; the caller owns it. A grant
        adopted after a daemon restart has no fd in the new daemon (``NotFound``/
        ``FailedPrecondition``): keep the fd or mapping you fetched before."""
        self._check()
        _uint("grant_id", grant_id, 64)
        fd: int = self._with_session(lambda sid: self._fds.fetch(sid, grant_id)[0])
        return fd

    def grants(self) -> list[GrantInfo]:
        """The grants this session holds, as the daemon lists them."""
        self._check()

        def list_grants(sid: int) -> list[GrantInfo]:
            resp: pb.ListGrantsResponse = self.client._call("ListGrants", pb.ListGrantsRequest(session_id=sid))
            return [GrantInfo._from(g) for g in resp.grants]

        out: list[GrantInfo] = self._with_session(list_grants)
        return out

    def plan_capture(
        self, plan_input: Any, reserve: bool = False, summary_only: bool = False
    ) -> pb.PlanCaptureResponse:
        """Plans the static buffers of a schedule (a ``graphpool.v1.PlanInput`` message) for
        this session; with ``reserve``, the plan's bytes are reserved in the ledger. (A plan's
        reservation is not carried over a daemon restart: plan again after ``"reattached"``.)
        ``summary_only`` leaves the per-buffer list (``Plan.buffers``) out of the response: a
        schedule of thousands of microbatches makes hundreds of thousands of buffers, more
        than the daemon sends in one message (it refuses such a plan with
        ``RESOURCE_EXHAUSTED`` otherwise)."""
        self._check()
        resp: pb.PlanCaptureResponse = self._with_session(
            lambda sid: self.client.plan_capture(sid, plan_input, reserve, summary_only)
        )
        return resp

    # -- ending ------------------------------------------------------------------------------

    def close(self) -> DetachResult:
        """Ends the session: the daemon releases every grant; local segments are unmapped and
        their fds closed. Idempotent (a second call returns zeros). In a child process after
        ``fork`` this only forgets the session locally: it belongs to the parent. While the
        session re-attaches after a daemon restart, this stops it (nothing is declared). When
        unmapping a segment fails (a ``CudaError``), the session still ends; the first such
        error is raised afterwards."""
        with self._lock:
            if self._closed:
                return DetachResult(0, 0)
            self._closed = True
        # Under the lock: another thread may be adding the segment it just allocated (it then
        # sees the session closed, see allocate()).
        with self._state:
            segments = list(self._segments.values())
            self._segments.clear()
        unmap_error: Exception | None = None
        for seg in segments:
            try:
                seg._forget()
            except Exception as e:  # the session must end all the same
                unmap_error = unmap_error or e
        del segments
        if self._pid != os.getpid():
            # The session, its thread and its events are the parent's: nothing else here.
            if unmap_error is not None:
                raise unmap_error
            return DetachResult(0, 0)
        self._stop.set()
        result = DetachResult(0, 0)
        if self._end_reason is None and self._reconnecting_since is None:
            try:
                result = self.client.detach(self.session_id)
            except (GraphpoolError, ValueError):
                pass  # the stream closing below ends the session as well
        with self._state:
            call = self._call_obj
            attempt, self._attempt = self._attempt, None
            self._held.clear()
            self._pending_release.clear()
        for c in (call, attempt):
            try:
                if c is not None:
                    c.cancel()
            except Exception:
                pass
        self._fds.close()
        self._attached.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        _SESSIONS.discard(self)
        if unmap_error is not None:
            raise unmap_error
        return result

    detach = close

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_sessions_at_exit() -> None:
    for s in list(_SESSIONS):
        if s._pid == os.getpid() and not s._closed:
            try:
                s.close()
            except Exception:
                pass
