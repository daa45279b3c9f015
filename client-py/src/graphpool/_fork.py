"""What a process forked from a graphpool user may and may not do with what it inherited.

Two rules, shared by every module of the package:

* Locks are renewed in the child: a lock that another thread of the parent held at fork time
  stays held forever in the child, which would then hang on it (:class:`ForkSafeLock`).
* Objects whose destruction would act for the parent (close its gRPC channel, free its CUDA
  graphs and pools, call the CUDA driver) are never destroyed in the child: :func:`park` keeps
  them referenced for the life of the process.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType
from typing import Any

_LOCKS: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()
_PARKED: list[object] = []


class ForkSafeLock:
    """A ``threading.Lock`` that a forked child gets anew (free) instead of inheriting its
    state. Use it as a context manager, or with :meth:`acquire` / :meth:`release`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _LOCKS.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """As ``threading.Lock.acquire``."""
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        """As ``threading.Lock.release``."""
        self._lock.release()

    def locked(self) -> bool:
        """Whether the lock is held."""
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()

    def _renew(self) -> None:
        self._lock = threading.Lock()


def park(obj: Any) -> None:
    """Keeps ``obj`` referenced for the life of this process, so that it is never destroyed
    here (it was inherited through fork and belongs to the parent)."""
    _PARKED.append(obj)


def _after_fork_in_child() -> None:
    for lock in list(_LOCKS):
        lock._renew()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
