"""Translation of gRPC errors into graphpool exceptions, without a daemon."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

import graphpool
from graphpool._proto.graphpool.v1 import graphpool_pb2 as pb
from graphpool.errors import ERROR_DETAIL_METADATA_KEY, error_from_code, error_from_rpc


class FakeCall(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, details: str, detail: pb.ErrorDetail | None = None) -> None:
        self._code, self._details = code, details
        self._md: tuple[tuple[str, Any], ...] = ()
        if detail is not None:
            self._md = (("other", "x"), (ERROR_DETAIL_METADATA_KEY, detail.SerializeToString()))

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._md

    def initial_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


def test_capacity_details() -> None:
    detail = pb.ErrorDetail(
        capacity=pb.CapacityRefusal(
            requested_bytes=96 << 20,
            free_bytes=16 << 20,
            limit="rank-quota",
            limit_bytes=64 << 20,
            device_uuid="GPU-1234",
            top_holders=[pb.Holder(job_id="j", rank=3, pid=42, granted_bytes=48 << 20)],
        )
    )
    e = error_from_rpc(FakeCall(grpc.StatusCode.RESOURCE_EXHAUSTED, "rank-quota: no", detail))
    assert isinstance(e, graphpool.CapacityExceeded)
    assert (e.requested, e.free, e.limit, e.limit_bytes, e.device_uuid) == (
        96 << 20,
        16 << 20,
        "rank-quota",
        64 << 20,
        "GPU-1234",
    )
    assert e.top_holders == (graphpool.Holder(job_id="j", rank=3, pid=42, granted_bytes=48 << 20),)
    text = str(e)
    for part in ("96 MiB", "16 MiB", "64 MiB", "rank-quota", "GPU-1234", "job j rank 3 (pid 42): 48 MiB"):
        assert part in text, text


def test_device_memory_refusal() -> None:
    """``device-memory``: the device has no physical memory left for the request."""
    detail = pb.ErrorDetail(
        capacity=pb.CapacityRefusal(
            requested_bytes=64 << 20, free_bytes=48 << 20, limit="device-memory", limit_bytes=1 << 30
        )
    )
    e = error_from_rpc(FakeCall(grpc.StatusCode.RESOURCE_EXHAUSTED, "device-memory: no", detail))
    assert isinstance(e, graphpool.CapacityExceeded) and e.limit == "device-memory"
    assert "device-memory limit of 1 GiB leaves 48 MiB free" in str(e) and "no physical memory" in str(e)


def test_fd_socket_unavailable_names_its_daemon(tmp_path: Any) -> None:
    """An fd socket that cannot be reached is not a socket to start graphpoold on: the message
    says it is the daemon's fd socket, names that daemon's gRPC socket and how to check it."""
    from graphpool.segments import FdChannel

    fd_path, grpc_path = str(tmp_path / "graphpool-fd.sock"), str(tmp_path / "g.sock")
    with pytest.raises(graphpool.DaemonUnavailable) as ei:
        FdChannel(fd_path, daemon_socket=grpc_path).fetch(1, 2)
    e = ei.value
    assert (e.socket_path, e.fd_socket, e.daemon_socket) == (fd_path, True, grpc_path)
    msg = str(e)
    assert f"fd socket {fd_path} of the daemon at {grpc_path} is not reachable" in msg, msg
    assert f"graphpool --socket {grpc_path} health" in msg, msg
    assert "graphpoold --socket" not in msg and "GRAPHPOOL_SOCKET" not in msg, msg
    # Without the daemon's socket known, it still does not give the fd socket as one.
    msg = str(graphpool.DaemonUnavailable(fd_path, "refused", fd_socket=True))
    assert "graphpoold --socket" not in msg and "`graphpool health`" in msg, msg
    plain = graphpool.DaemonUnavailable(grpc_path, "refused")
    assert not plain.fd_socket and plain.daemon_socket == grpc_path


def test_field_violation() -> None:
    detail = pb.ErrorDetail(field=pb.FieldViolation(field="job_id", description="too long"))
    e = error_from_rpc(FakeCall(grpc.StatusCode.INVALID_ARGUMENT, "job_id: too long", detail))
    assert isinstance(e, graphpool.InvalidArgument) and isinstance(e, ValueError)
    assert e.field == "job_id" and e.description == "too long"
    assert str(e) == "job_id: too long"


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.NOT_FOUND, graphpool.NotFound),
        (grpc.StatusCode.PERMISSION_DENIED, graphpool.PermissionDenied),
        (grpc.StatusCode.UNAUTHENTICATED, graphpool.PermissionDenied),
        (grpc.StatusCode.FAILED_PRECONDITION, graphpool.FailedPrecondition),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, graphpool.CapacityExceeded),
        (grpc.StatusCode.INTERNAL, graphpool.GraphpoolError),
    ],
)
def test_codes(code: grpc.StatusCode, cls: type[graphpool.GraphpoolError]) -> None:
    e = error_from_rpc(FakeCall(code, "msg"))
    assert type(e) is cls
    assert e.code == code
    assert "msg" in str(e)


def test_unavailable_names_socket() -> None:
    e = error_from_rpc(FakeCall(grpc.StatusCode.UNAVAILABLE, "connect failed"), "/x/g.sock")
    assert isinstance(e, graphpool.DaemonUnavailable)
    assert e.socket_path == "/x/g.sock"
    assert "/x/g.sock" in str(e) and "graphpoold" in str(e) and "GRAPHPOOL_SOCKET" in str(e)


def test_malformed_detail_keeps_error() -> None:
    call = FakeCall(grpc.StatusCode.NOT_FOUND, "gone")
    call._md = ((ERROR_DETAIL_METADATA_KEY, b"\xff\xff\xff"),)
    e = error_from_rpc(call)
    assert isinstance(e, graphpool.NotFound) and str(e) == "gone"


def test_from_numeric_code() -> None:
    e = error_from_code(7, "not yours")
    assert isinstance(e, graphpool.PermissionDenied) and str(e) == "not yours"
    assert isinstance(error_from_code(5, "x"), graphpool.NotFound)


def test_daemon_unavailable_without_socket(tmp_path: Any) -> None:
    path = str(tmp_path / "missing.sock")
    c = graphpool.Client(path)
    with pytest.raises(graphpool.DaemonUnavailable) as ei:
        c.status()
    assert ei.value.socket_path == path
    assert path in str(ei.value) and "graphpoold --socket" in str(ei.value)
    assert not c.health()


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("NOT_FOUND", graphpool.NotFound),
        ("PERMISSION_DENIED", graphpool.PermissionDenied),
        ("UNAUTHENTICATED", graphpool.PermissionDenied),
        ("FAILED_PRECONDITION", graphpool.FailedPrecondition),
    ],
)
def test_shim_daemon_refusals_are_typed(name: str, cls: type[graphpool.GraphpoolError]) -> None:
    """A daemon refusal reported by the allocator shim (graphpool.torch) raises the same
    exception as on a Session: ``MemPool(daemon_device="99")`` is NotFound naming the device."""
    from graphpool import _shim

    code = grpc.StatusCode[name]
    e = _shim.error_from_shim(
        {
            "kind": "daemon",
            "call": "Attach",
            "code": name,
            "code_number": code.value[0],
            "message": f"graphpoold refused Attach ({name}): device: no such device",
            "field": "device",
            "description": "no such device",
        }
    )
    assert type(e) is cls and e.code == code
    assert "no such device" in str(e)
    if cls is graphpool.NotFound:
        assert isinstance(e, graphpool.NotFound) and e.field == "device"


def test_shim_other_daemon_errors_stay_shim_errors() -> None:
    from graphpool import _shim

    e = _shim.error_from_shim({"kind": "daemon", "code": "INTERNAL", "code_number": 13, "message": "boom"})
    assert isinstance(e, _shim.ShimError) and e.kind == "daemon" and e.details["code"] == "INTERNAL"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank": -1}, "rank"),
        ({"local_rank": 1 << 32}, "local_rank"),
        ({"device": -1}, "device"),
        ({"budget_bytes": -5}, "budget_bytes"),
    ],
)
def test_shim_configure_refuses_values_ctypes_would_wrap(
    kwargs: dict[str, Any], field: str, tmp_path: Any
) -> None:
    """A negative rank must not reach the daemon as 4294967295."""
    from graphpool import _shim

    args: dict[str, Any] = {
        "socket": str(tmp_path / "none.sock"),
        "job_id": "j",
        "rank": 0,
        "local_rank": 0,
        "device": 0,
        "daemon_device": "0",
        "budget_bytes": 0,
        "reserve_budget": False,
        **kwargs,
    }
    with pytest.raises(graphpool.InvalidArgument) as ei:
        _shim.configure(**args)
    assert ei.value.field == field


@pytest.mark.parametrize("timeout", [None, 0, -1.0, float("nan"), "10"])
def test_client_timeout_is_checked_up_front(timeout: Any, tmp_path: Any) -> None:
    """A timeout every call would trip over (None: a TypeError adding it to a float, 0: every
    call past its deadline) is refused when the Client is made."""
    with pytest.raises(ValueError, match="timeout"):
        graphpool.Client(str(tmp_path / "g.sock"), timeout=timeout)
