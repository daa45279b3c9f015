"""``torch.cuda.MemPool`` backed by graphpoold segments.

::

    import torch, graphpool
    pool = graphpool.torch.MemPool(device=local_rank, budget="8GiB")
    g = torch.cuda.CUDAGraph()
    with pool.capture(g):                      # = torch.cuda.graph(g, pool=pool.id), with
        y = model(x)                           #   refusals raised as graphpool.CapacityExceeded
    graphed = torch.cuda.make_graphed_callables(layers, sample_args, pool=pool.id)

Every segment torch's caching allocator takes for the pool comes from the daemon through the
native shim (``libgraphpool_shim.so``, torch calls it without the GIL, also during capture):
one ``AllocateSegment`` per torch segment, the fd imported and mapped into this process. The
daemon's ledger shows it under this job and rank; it goes back when torch frees the segment
(``pool.release()``, or the pool's destruction) or when the process exits.

All MemPools of one CUDA device in a process share one daemon session (torch's allocator hook
does not say which pool asks): the first pool opens it with its ``job_id``, ``rank``,
``budget`` and ``reserve_budget``; later ones reuse it and must ask the same values (a pool
asking others raises instead of silently not getting them). The session ends when the last
pool is released; while CUDA graphs captured into the pools still hold segments, it stays open
and ends when torch frees the last of them (or the process exits), unless a new pool of the
device takes it over first. A session that ended by itself (the daemon did not come back within
the reconnect deadline) is not reused: the next pool opens a new one.

A refused segment request makes torch raise ``torch.OutOfMemoryError``; :meth:`MemPool.capture`
and :func:`translate_errors` turn that into ``graphpool.CapacityExceeded`` carrying the daemon's
details (requested, free, which limit, the top holders).

torch is imported only here: ``import graphpool`` never imports it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import _shim
from ._fork import ForkSafeLock, park
from .client import Client
from .session import Session
from .errors import GraphpoolError, InvalidArgument
from .units import format_size, parse_size

__all__ = ["MemPool", "graph", "make_graphed_callables", "translate_errors"]

_lock = ForkSafeLock()
_allocator: Any = None
_allocator_pid = 0
# device -> number of live MemPools using its session, per process.
_sessions: dict[int, int] = {}
_sessions_pid = 0


@dataclass(frozen=True)
class _DeviceSession:
    """What the shim's daemon session of a device was opened with, and by which pool."""

    job_id: str
    rank: int
    budget_bytes: int
    reserve_budget: bool
    opened_by: str  # the pool that opened it, as its repr names it


# device -> the session the shim holds for it.
_owners: dict[int, _DeviceSession] = {}


def _pluggable_allocator() -> Any:
    """One ``CUDAPluggableAllocator`` over the shim per process."""
    global _allocator, _allocator_pid
    if _allocator is None or _allocator_pid != os.getpid():
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(
            _shim.loaded_path(), "graphpool_alloc", "graphpool_free"
        )
        _allocator_pid = os.getpid()
    return _allocator


def _env_int(name: str) -> int | None:
    """The integer value of environment variable ``name``; None when it is unset or not an
    integer."""
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        return int(v.strip())
    except ValueError:
        return None


def _default_job_id() -> str:
    for n in ("GRAPHPOOL_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        v = os.environ.get(n)
        if v and v != "none":
            return v
    return f"pid-{os.getpid()}"


def _oom_in_chain(e: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, torch.OutOfMemoryError) or "out of memory" in str(cur).lower():
            return True
        cur = cur.__cause__ or cur.__context__
    return False


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Raises ``graphpool.CapacityExceeded`` (or the shim's error) instead of the
    ``torch.OutOfMemoryError`` that a refused segment request causes, for code that allocates
    from a graphpool pool: ``torch.cuda.graph(..., pool=pool.id)``,
    ``torch.cuda.make_graphed_callables(..., pool=pool.id)``, ``torch.cuda.use_mem_pool``.
    Only exceptions are translated: ``KeyboardInterrupt``, ``SystemExit`` and other
    ``BaseException``s pass through as they are."""
    _shim.clear_error()
    failures = _shim.alloc_failures()
    try:
        yield
    except GraphpoolError:
        raise
    except Exception as e:
        # The shim's error is this thread's and was cleared on entry: one recorded now comes
        # from a segment request of this block (a successful request clears it). torch reports
        # it as OutOfMemoryError, or (when the refusal surfaces through capture_end) as a
        # RuntimeError, possibly without the out-of-memory error in its chain. Any other
        # exception is not the refusal's, even if torch recovered from one earlier in the
        # block (it frees its cache and retries).
        d = _shim.last_error()
        if d is None and _shim.alloc_failures() != failures:
            # The request failed on another thread: autograd runs the backward pass on its
            # device threads. The process's latest failed request is the best account of it.
            d = _shim.last_alloc_error()
        if d is None:
            raise
        capture_end = isinstance(e, RuntimeError) and d.get("kind") == "capacity"
        if not (_oom_in_chain(e) or capture_end):
            raise
        raise _shim.error_from_shim(d) from e


@contextlib.contextmanager
def graph(g: torch.cuda.CUDAGraph, pool: MemPool, **kwargs: Any) -> Iterator[None]:
    """``torch.cuda.graph(g, pool=pool.id, **kwargs)`` with refusals raised as
    ``graphpool.CapacityExceeded``. Like ``torch.cuda.graph``, it gives nothing to ``as``."""
    with translate_errors():
        with torch.cuda.graph(g, pool=pool.id, **kwargs):
            yield


class MemPool:
    """A ``torch.cuda.MemPool`` whose segments are granted by graphpoold.

    Args:
        device: CUDA device (index, ``torch.device`` or None for the current one).
        budget: most bytes the device's daemon session may hold (``"8GiB"``, an int, or
            None/0 for no session budget; the job/rank quotas and device budget still apply).
            The device's session is shared by all its pools: a pool made while it is open must
            ask the budget and ``reserve_budget`` it was opened with.
        job_id: the job (default: ``$GRAPHPOOL_JOB_ID``, ``$SLURM_JOB_ID``,
            ``$TORCHELASTIC_RUN_ID``, else ``pid-<pid>``).
        rank / local_rank: default ``$RANK`` / ``$LOCAL_RANK`` (when set to an integer), else
            0 / the device index.
        reserve_budget: admit the whole budget now, so that capture cannot be refused later
            up to it; raises ``CapacityExceeded`` at once if it does not fit.
        socket: the daemon's socket (default ``$GRAPHPOOL_SOCKET`` or the system socket).
        client: a ``graphpool.Client`` whose socket to use, or a ``graphpool.Session``: the
            socket of its client (the pool's segments still come through the shim's own
            session of the device, with this pool's ``job_id`` and ``rank``). Ignored when
            ``socket`` is given.
        daemon_device: the device as the daemon names it (default: this device's UUID).
        label: a name for this pool (shown in ``repr``).

    Raises:
        InvalidArgument: the device's daemon session is open (another pool of the device) with
            another ``budget`` or ``reserve_budget`` (``.field`` says which; the message names
            the pool that opened it).
        GraphpoolError: that session belongs to another ``job_id`` or ``rank``.
        CapacityExceeded: ``reserve_budget`` and the budget does not fit.
        DaemonUnavailable: the daemon cannot be reached.
    """

    def __init__(
        self,
        device: int | torch.device | None = None,
        budget: int | str | None = "8GiB",
        job_id: str | None = None,
        rank: int | None = None,
        *,
        local_rank: int | None = None,
        reserve_budget: bool = False,
        socket: str | os.PathLike[str] | None = None,
        client: Client | Session | None = None,
        daemon_device: str | None = None,
        label: str = "",
    ) -> None:
        global _sessions, _sessions_pid, _owners
        if device is None:
            index = torch.cuda.current_device()
        elif isinstance(device, torch.device):
            index = device.index if device.index is not None else torch.cuda.current_device()
        else:
            index = int(device)
        self.device = index
        self.label = label
        self.budget_bytes = parse_size(budget) if budget else 0
        self.reserve_budget = bool(reserve_budget)
        self.job_id = job_id or _default_job_id()
        env_rank, env_local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
        self.rank = rank if rank is not None else (env_rank if env_rank is not None else 0)
        if local_rank is None:
            local_rank = env_local_rank if env_local_rank is not None else index
        self.local_rank = local_rank
        if isinstance(client, Session):
            client = client.client
        if socket is None and client is not None:
            socket = getattr(client, "socket_path", None)
            if socket is None:  # not the default socket in silence
                raise TypeError(f"client must be a graphpool.Client or graphpool.Session, not {client!r}")
        self.socket = os.fspath(socket) if socket is not None else None
        self._pid = os.getpid()
        self._released = False
        # The primary context must exist before the shim maps memory for torch.
        torch.cuda.init()
        with _lock:
            if _sessions_pid != os.getpid():
                _sessions, _sessions_pid, _owners = {}, os.getpid(), {}
            # A session left open by released pools whose segments torch still holds (graphs
            # alive) is reused as it is, and kept past its last segment's free. One that ended
            # (the daemon did not come back within the reconnect deadline) is not open:
            # configure replaces it (its segments stay mapped until torch frees them).
            is_open = _shim.keep_device(index)
            owner = _owners.get(index)
            if is_open and owner is not None:
                try:
                    self._check_shares(owner)
                except BaseException:
                    # Refused: keep_device must not have kept the session for this pool. With
                    # no pool of the device left, its end is given back (at once, or with the
                    # last segment torch frees).
                    if _sessions.get(index, 0) == 0:
                        _shim.release_device(index)
                    raise
            if not is_open:
                _shim.configure(
                    socket=self.socket,
                    job_id=self.job_id,
                    rank=self.rank,
                    local_rank=self.local_rank,
                    device=index,
                    daemon_device=daemon_device,
                    budget_bytes=self.budget_bytes,
                    reserve_budget=self.reserve_budget,
                )
                _owners[index] = _DeviceSession(
                    self.job_id, self.rank, self.budget_bytes, self.reserve_budget, repr(self)
                )
            _sessions[index] = _sessions.get(index, 0) + 1
        try:
            with torch.cuda.device(index):
                self._pool = torch.cuda.MemPool(_pluggable_allocator().allocator())
        except BaseException:
            self._drop_session_ref()
            raise
        # The finalizer holds the torch pool too: collected in a forked child, the pool must
        # not be destroyed there (that calls CUDA), so the finalizer keeps it referenced.
        self._finalizer = weakref.finalize(self, MemPool._collected, index, [self._pool], self._pid)

    def _check_shares(self, owner: _DeviceSession) -> None:
        """Refuses a pool that asks the device's shared session for other values than it was
        opened with (they could not apply: every pool of the device allocates through it)."""
        index = self.device
        share = (
            "all graphpool pools of a device in one process share one daemon session (torch's "
            "allocator does not say which pool asks)"
        )
        if (owner.job_id, owner.rank) != (self.job_id, self.rank):
            raise GraphpoolError(
                f"device {index} already has a graphpool session of job {owner.job_id} rank "
                f"{owner.rank} in this process, opened by {owner.opened_by}; {share} (release the "
                f"other pools first, or use the same job_id and rank)"
            )
        if (owner.budget_bytes, owner.reserve_budget) != (self.budget_bytes, self.reserve_budget):
            field = "budget" if owner.budget_bytes != self.budget_bytes else "reserve_budget"

            def said(budget: int, reserve: bool) -> str:
                b = format_size(budget) if budget else "none"
                return f"budget={b}, reserve_budget={reserve}"

            raise InvalidArgument(
                f"device {index}'s graphpool session was opened by {owner.opened_by} with "
                f"{said(owner.budget_bytes, owner.reserve_budget)}; this pool asks "
                f"{said(self.budget_bytes, self.reserve_budget)}, which cannot apply: {share}. "
                f"Ask for the same values to share the session (for make_graphed_callables, its "
                f"budget=), or release the other pools of the device (and the graphs captured "
                f"into them) first",
                field=field,
            )

    # -- identity ------------------------------------------------------------------------------

    @property
    def id(self) -> tuple[int, int]:
        """The pool id, for ``torch.cuda.graph(g, pool=...)`` and ``make_graphed_callables``."""
        a, b = self._pool.id
        return int(a), int(b)

    @property
    def torch_pool(self) -> torch.cuda.MemPool:
        """The underlying ``torch.cuda.MemPool``."""
        return self._pool

    def __repr__(self) -> str:
        name = f" {self.label!r}" if self.label else ""
        return f"<graphpool.torch.MemPool{name} device={self.device} job={self.job_id} rank={self.rank}>"

    # -- capture -------------------------------------------------------------------------------

    def capture(self, g: torch.cuda.CUDAGraph, **kwargs: Any) -> contextlib.AbstractContextManager[Any]:
        """``torch.cuda.graph(g, pool=self.id, **kwargs)``, raising ``CapacityExceeded``
        instead of ``torch.OutOfMemoryError`` when the daemon refuses a segment."""
        return graph(g, self, **kwargs)

    def use(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.cuda.use_mem_pool(self)`` (eager allocations from this pool), with refusals
        raised as ``CapacityExceeded``."""

        @contextlib.contextmanager
        def ctx() -> Iterator[None]:
            with translate_errors(), torch.cuda.use_mem_pool(self._pool, device=self.device):
                yield

        return ctx()

    # -- counters ------------------------------------------------------------------------------

    def _segments(self) -> list[dict[str, Any]]:
        try:
            snap = self._pool.snapshot()
        except (AttributeError, RuntimeError):
            return []
        return [s for s in snap if s.get("device", self.device) == self.device]

    def reserved_bytes(self) -> int:
        """Bytes of this pool's segments, as torch counts them (cached, used or not)."""
        return sum(int(s.get("total_size", 0)) for s in self._segments())

    def allocated_bytes(self) -> int:
        """Bytes of this pool's segments that hold live tensors."""
        return sum(int(s.get("allocated_size", 0)) for s in self._segments())

    def granted_bytes(self) -> int:
        """Bytes the daemon granted to this process on this device (all graphpool pools of
        the device share the session)."""
        s = _shim.stats(self.device)
        return s[0] if s else 0

    def stats(self) -> dict[str, Any]:
        """Counters of the pool and of the device's daemon session (``budget_bytes`` and
        ``reserve_budget`` are the session's, shared by every pool of the device)."""
        granted, segments = _shim.stats(self.device) or (0, 0)
        info = _shim.session_info(self.device)
        owner = _owners.get(self.device) if info is not None and _sessions_pid == os.getpid() else None
        return {
            "device": self.device,
            "label": self.label,
            "pool_reserved_bytes": self.reserved_bytes(),
            "pool_allocated_bytes": self.allocated_bytes(),
            "pool_segments": len(self._segments()),
            "session_granted_bytes": granted,
            "session_segments": segments,
            "session_id": info[0] if info else 0,
            "session_reserved_bytes": info[1] if info else 0,
            "device_uuid": info[2] if info else "",
            "budget_bytes": owner.budget_bytes if owner else self.budget_bytes,
            "reserve_budget": owner.reserve_budget if owner else self.reserve_budget,
        }

    # -- lifetime ------------------------------------------------------------------------------

    def release(self) -> None:
        """Drops the torch pool and returns its free segments to the daemon. Graphs captured
        into it must be gone first (their memory stays in use until they are). Ends the
        device's daemon session when no other graphpool pool of the device is left: at once,
        or, while graphs still hold segments of it, when torch frees the last of them.

        Idempotent. In a process forked from the one that created the pool, this only drops
        the pool locally: the memory and the daemon session belong to the parent, so nothing
        calls CUDA or the shim, and the torch pool is kept referenced (never destroyed there)."""
        if self._released:
            return
        self._released = True
        self._finalizer.detach()
        pool = self._pool
        del self._pool
        if self._pid != os.getpid():
            park(pool)  # destroying it would call CUDA in the child
            return
        del pool
        try:
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        finally:
            # The pool is gone whatever CUDA said (a sticky error of an earlier kernel, say):
            # its reference to the device's session goes with it, or the session would
            # outlive every pool.
            self._drop_session_ref()

    def _drop_session_ref(self) -> None:
        MemPool._finalize(self.device)

    @staticmethod
    def _collected(device: int, pool: list[Any], pid: int) -> None:
        # A pool collected without release(): in the process that made it, its daemon session
        # reference goes; in a forked child, nothing is touched and the torch pool is parked.
        if pid != os.getpid():
            park(pool)
            return
        MemPool._finalize(device)

    @staticmethod
    def _finalize(device: int) -> None:
        with _lock:
            if _sessions_pid != os.getpid() or _sessions.get(device, 0) == 0:
                return
            _sessions[device] -= 1
            if _sessions[device] == 0:
                # While torch still holds segments (graphs alive) the session stays, and ends
                # with the last segment's free (or at exit) unless a new pool keeps it.
                _shim.release_device(device)

    def __enter__(self) -> MemPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()



# Schedule-aware capture, the drop-in for torch.cuda.make_graphed_callables plus a pipeline
# schedule. Imported last: it uses MemPool from this module.
from .capture import make_graphed_callables  # noqa: E402
