"""graphpool: the client of graphpoold, the per-node daemon that owns the GPU memory used for
CUDA graph capture.

Quick start::

    import graphpool

    client = graphpool.Client()                      # $GRAPHPOOL_SOCKET or the system socket
    with client.attach("job-42", rank=0, budget="8GiB") as session:
        with session.allocate("256MiB", label="capture-pool") as seg:
            ...

``graphpool.torch`` (imported on first use, needs torch) provides a ``torch.cuda.MemPool``
backed by daemon segments. ``import graphpool`` never imports torch.
"""

from __future__ import annotations

import importlib
import os as _os

# gRPC's fork support is left as the environment says (off unless GRPC_ENABLE_FORK_SUPPORT=1):
# with it on, every os.fork() of a process with an open session waits ~1 s in gRPC's pre-fork
# handler (median 1000 ms over 100 forks, grpcio 1.85; 0.9 ms with it off) and was seen to
# hang there for good — a training rank forks its DataLoader workers. Without it a forked
# child must not open a gRPC channel (40-70% of those abort): graphpool refuses that with
# FailedPrecondition, and children that need the daemon are started with "spawn", or the
# parent sets GRPC_ENABLE_FORK_SUPPORT=1 before importing graphpool.
from typing import Any

from ._native import native_path as _native_path
from .client import Client, __version__, default_socket_path
from .errors import (
    CapacityExceeded,
    DaemonUnavailable,
    FailedPrecondition,
    GraphpoolError,
    Holder,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from .info import (
    DeviceInfo,
    DeviceLimit,
    DeviceUsage,
    GrantInfo,
    JobLimit,
    JobUsage,
    Limits,
    RankLimit,
    RankUsage,
    SessionInfo,
    Status,
    Usage,
)
from .segments import CudaError, DeviceMapping, Segment
from .session import DetachResult, Reattached, ReconnectPolicy, Session
from .units import format_size, parse_size

__all__ = [
    "CapacityExceeded",
    "Client",
    "CudaError",
    "DaemonUnavailable",
    "DetachResult",
    "DeviceInfo",
    "DeviceLimit",
    "DeviceMapping",
    "DeviceUsage",
    "FailedPrecondition",
    "GrantInfo",
    "GraphpoolError",
    "Holder",
    "InvalidArgument",
    "JobLimit",
    "JobUsage",
    "Limits",
    "NotFound",
    "PermissionDenied",
    "RankLimit",
    "RankUsage",
    "Reattached",
    "ReconnectPolicy",
    "Segment",
    "Session",
    "SessionInfo",
    "Status",
    "Usage",
    "__version__",
    "_native_path",
    "default_socket_path",
    "format_size",
    "parse_size",
]

# Submodules imported on first attribute access: `graphpool.torch` needs torch, the schedule
# module is optional, and `graphpool.snapshot` (PyTorch memory snapshots as buffer lists) is a
# tool few ranks need.
_LAZY_SUBMODULES = ("torch", "schedule", "capture", "snapshot")
_LAZY_ATTRS = {"Schedule": "schedule"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY_ATTRS:
        try:
            mod = importlib.import_module(f".{_LAZY_ATTRS[name]}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{_LAZY_ATTRS[name]}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
        return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES) | set(_LAZY_ATTRS))
