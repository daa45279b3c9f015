from . import plan_pb2 as _plan_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttachRequest(_message.Message):
    __slots__ = ("job_id", "rank", "local_rank", "device", "resume", "client", "budget_bytes", "reserve_budget")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    local_rank: int
    device: str
    resume: _containers.RepeatedCompositeFieldContainer[HeldGrant]
    client: str
    budget_bytes: int
    reserve_budget: bool
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., device: _Optional[str] = ..., resume: _Optional[_Iterable[_Union[HeldGrant, _Mapping]]] = ..., client: _Optional[str] = ..., budget_bytes: _Optional[int] = ..., reserve_budget: bool = ...) -> None: ...

class HeldGrant(_message.Message):
    __slots__ = ("grant_id", "device_uuid", "size_bytes", "label")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    grant_id: int
    device_uuid: str
    size_bytes: int
    label: str
    def __init__(self, grant_id: _Optional[int] = ..., device_uuid: _Optional[str] = ..., size_bytes: _Optional[int] = ..., label: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("attached", "draining", "limits_changed")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LIMITS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    attached: Attached
    draining: Draining
    limits_changed: Limits
    def __init__(self, attached: _Optional[_Union[Attached, _Mapping]] = ..., draining: _Optional[_Union[Draining, _Mapping]] = ..., limits_changed: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("session_id", "device", "daemon_instance", "adopted", "fd_socket", "reserved_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    device: Device
    daemon_instance: str
    adopted: _containers.RepeatedCompositeFieldContainer[Grant]
    fd_socket: str
    reserved_bytes: int
    def __init__(self, session_id: _Optional[int] = ..., device: _Optional[_Union[Device, _Mapping]] = ..., daemon_instance: _Optional[str] = ..., adopted: _Optional[_Iterable[_Union[Grant, _Mapping]]] = ..., fd_socket: _Optional[str] = ..., reserved_bytes: _Optional[int] = ...) -> None: ...

class Draining(_message.Message):
    __slots__ = ("drain_seconds",)
    DRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    drain_seconds: float
    def __init__(self, drain_seconds: _Optional[float] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ("grants_released", "bytes_released")
    GRANTS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    grants_released: int
    bytes_released: int
    def __init__(self, grants_released: _Optional[int] = ..., bytes_released: _Optional[int] = ...) -> None: ...

class AllocateSegmentRequest(_message.Message):
    __slots__ = ("session_id", "size_bytes", "label")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    size_bytes: int
    label: str
    def __init__(self, session_id: _Optional[int] = ..., size_bytes: _Optional[int] = ..., label: _Optional[str] = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("grant_id", "session_id", "size_bytes", "requested_bytes", "device_uuid", "device_index", "label", "job_id", "rank", "pid", "created_unix_seconds", "adopted", "handle_kind")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    HANDLE_KIND_FIELD_NUMBER: _ClassVar[int]
    grant_id: int
    session_id: int
    size_bytes: int
    requested_bytes: int
    device_uuid: str
    device_index: int
    label: str
    job_id: str
    rank: int
    pid: int
    created_unix_seconds: float
    adopted: bool
    handle_kind: str
    def __init__(self, grant_id: _Optional[int] = ..., session_id: _Optional[int] = ..., size_bytes: _Optional[int] = ..., requested_bytes: _Optional[int] = ..., device_uuid: _Optional[str] = ..., device_index: _Optional[int] = ..., label: _Optional[str] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., created_unix_seconds: _Optional[float] = ..., adopted: bool = ..., handle_kind: _Optional[str] = ...) -> None: ...

class ReleaseSegmentRequest(_message.Message):
    __slots__ = ("session_id", "grant_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    grant_id: int
    def __init__(self, session_id: _Optional[int] = ..., grant_id: _Optional[int] = ...) -> None: ...

class ReleaseSegmentResponse(_message.Message):
    __slots__ = ("bytes_released",)
    BYTES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    bytes_released: int
    def __init__(self, bytes_released: _Optional[int] = ...) -> None: ...

class ListGrantsRequest(_message.Message):
    __slots__ = ("session_id", "job_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    job_id: str
    def __init__(self, session_id: _Optional[int] = ..., job_id: _Optional[str] = ...) -> None: ...

class ListGrantsResponse(_message.Message):
    __slots__ = ("grants",)
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    grants: _containers.RepeatedCompositeFieldContainer[Grant]
    def __init__(self, grants: _Optional[_Iterable[_Union[Grant, _Mapping]]] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Usage(_message.Message):
    __slots__ = ("devices", "jobs", "ranks")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceUsage]
    jobs: _containers.RepeatedCompositeFieldContainer[JobUsage]
    ranks: _containers.RepeatedCompositeFieldContainer[RankUsage]
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceUsage, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[JobUsage, _Mapping]]] = ..., ranks: _Optional[_Iterable[_Union[RankUsage, _Mapping]]] = ...) -> None: ...

class DeviceUsage(_message.Message):
    __slots__ = ("device_index", "device_uuid", "capacity_bytes", "granted_bytes", "free_bytes", "grants", "planned_bytes")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    device_uuid: str
    capacity_bytes: int
    granted_bytes: int
    free_bytes: int
    grants: int
    planned_bytes: int
    def __init__(self, device_index: _Optional[int] = ..., device_uuid: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., granted_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., grants: _Optional[int] = ..., planned_bytes: _Optional[int] = ...) -> None: ...

class JobUsage(_message.Message):
    __slots__ = ("job_id", "granted_bytes", "grants", "sessions")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    granted_bytes: int
    grants: int
    sessions: int
    def __init__(self, job_id: _Optional[str] = ..., granted_bytes: _Optional[int] = ..., grants: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...

class RankUsage(_message.Message):
    __slots__ = ("job_id", "rank", "device_index", "granted_bytes", "grants")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    device_index: int
    granted_bytes: int
    grants: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., device_index: _Optional[int] = ..., granted_bytes: _Optional[int] = ..., grants: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Status(_message.Message):
    __slots__ = ("version", "daemon_instance", "backend", "devices", "sessions", "fd_socket", "uptime_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: str
    daemon_instance: str
    backend: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    fd_socket: str
    uptime_seconds: float
    def __init__(self, version: _Optional[str] = ..., daemon_instance: _Optional[str] = ..., backend: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., fd_socket: _Optional[str] = ..., uptime_seconds: _Optional[float] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("index", "uuid", "name", "total_bytes", "capacity_bytes", "granted_bytes", "free_bytes", "granularity_bytes", "driver_used_bytes", "driver_free_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANULARITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRIVER_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRIVER_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    total_bytes: int
    capacity_bytes: int
    granted_bytes: int
    free_bytes: int
    granularity_bytes: int
    driver_used_bytes: int
    driver_free_bytes: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., total_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., granted_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., granularity_bytes: _Optional[int] = ..., driver_used_bytes: _Optional[int] = ..., driver_free_bytes: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "job_id", "rank", "local_rank", "device_index", "pid", "uid", "granted_bytes", "grants", "client", "attached_unix_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    job_id: str
    rank: int
    local_rank: int
    device_index: int
    pid: int
    uid: int
    granted_bytes: int
    grants: int
    client: str
    attached_unix_seconds: float
    def __init__(self, session_id: _Optional[int] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., device_index: _Optional[int] = ..., pid: _Optional[int] = ..., uid: _Optional[int] = ..., granted_bytes: _Optional[int] = ..., grants: _Optional[int] = ..., client: _Optional[str] = ..., attached_unix_seconds: _Optional[float] = ...) -> None: ...

class PlanCaptureRequest(_message.Message):
    __slots__ = ("session_id", "input", "reserve", "summary_only")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_ONLY_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    input: _plan_pb2.PlanInput
    reserve: bool
    summary_only: bool
    def __init__(self, session_id: _Optional[int] = ..., input: _Optional[_Union[_plan_pb2.PlanInput, _Mapping]] = ..., reserve: bool = ..., summary_only: bool = ...) -> None: ...

class PlanCaptureResponse(_message.Message):
    __slots__ = ("plan", "reserved_bytes")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    plan: _plan_pb2.Plan
    reserved_bytes: int
    def __init__(self, plan: _Optional[_Union[_plan_pb2.Plan, _Mapping]] = ..., reserved_bytes: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("devices", "jobs", "default_rank_quota_bytes", "default_job_quota_bytes", "ranks")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_RANK_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_JOB_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceLimit]
    jobs: _containers.RepeatedCompositeFieldContainer[JobLimit]
    default_rank_quota_bytes: int
    default_job_quota_bytes: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankLimit]
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceLimit, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[JobLimit, _Mapping]]] = ..., default_rank_quota_bytes: _Optional[int] = ..., default_job_quota_bytes: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankLimit, _Mapping]]] = ...) -> None: ...

class DeviceLimit(_message.Message):
    __slots__ = ("device_uuid", "device_index", "budget_bytes")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    device_index: int
    budget_bytes: int
    def __init__(self, device_uuid: _Optional[str] = ..., device_index: _Optional[int] = ..., budget_bytes: _Optional[int] = ...) -> None: ...

class JobLimit(_message.Message):
    __slots__ = ("job_id", "quota_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    quota_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., quota_bytes: _Optional[int] = ...) -> None: ...

class RankLimit(_message.Message):
    __slots__ = ("job_id", "rank", "quota_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    quota_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., quota_bytes: _Optional[int] = ...) -> None: ...

class GetLimitsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetLimitsRequest(_message.Message):
    __slots__ = ("default_rank_quota_bytes", "default_job_quota_bytes", "jobs", "ranks", "devices")
    DEFAULT_RANK_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_JOB_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    default_rank_quota_bytes: int
    default_job_quota_bytes: int
    jobs: _containers.RepeatedCompositeFieldContainer[JobLimit]
    ranks: _containers.RepeatedCompositeFieldContainer[RankLimit]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceLimit]
    def __init__(self, default_rank_quota_bytes: _Optional[int] = ..., default_job_quota_bytes: _Optional[int] = ..., jobs: _Optional[_Iterable[_Union[JobLimit, _Mapping]]] = ..., ranks: _Optional[_Iterable[_Union[RankLimit, _Mapping]]] = ..., devices: _Optional[_Iterable[_Union[DeviceLimit, _Mapping]]] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("capacity", "field")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    capacity: CapacityRefusal
    field: FieldViolation
    def __init__(self, capacity: _Optional[_Union[CapacityRefusal, _Mapping]] = ..., field: _Optional[_Union[FieldViolation, _Mapping]] = ...) -> None: ...

class CapacityRefusal(_message.Message):
    __slots__ = ("requested_bytes", "free_bytes", "limit", "limit_bytes", "device_uuid", "top_holders")
    REQUESTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    TOP_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    requested_bytes: int
    free_bytes: int
    limit: str
    limit_bytes: int
    device_uuid: str
    top_holders: _containers.RepeatedCompositeFieldContainer[Holder]
    def __init__(self, requested_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., limit: _Optional[str] = ..., limit_bytes: _Optional[int] = ..., device_uuid: _Optional[str] = ..., top_holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ...) -> None: ...

class Holder(_message.Message):
    __slots__ = ("job_id", "rank", "pid", "granted_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    pid: int
    granted_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., granted_bytes: _Optional[int] = ...) -> None: ...

class FieldViolation(_message.Message):
    __slots__ = ("field", "description")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    field: str
    description: str
    def __init__(self, field: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class FdRequest(_message.Message):
    __slots__ = ("session_id", "grant_id", "allocate", "release")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    grant_id: int
    allocate: AllocateSegmentRequest
    release: ReleaseSegmentRequest
    def __init__(self, session_id: _Optional[int] = ..., grant_id: _Optional[int] = ..., allocate: _Optional[_Union[AllocateSegmentRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseSegmentRequest, _Mapping]] = ...) -> None: ...

class FdResponse(_message.Message):
    __slots__ = ("ok", "code", "message", "size_bytes", "handle_kind", "error", "grant", "released")
    OK_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDLE_KIND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    code: int
    message: str
    size_bytes: int
    handle_kind: str
    error: ErrorDetail
    grant: Grant
    released: ReleaseSegmentResponse
    def __init__(self, ok: bool = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., size_bytes: _Optional[int] = ..., handle_kind: _Optional[str] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ..., grant: _Optional[_Union[Grant, _Mapping]] = ..., released: _Optional[_Union[ReleaseSegmentResponse, _Mapping]] = ...) -> None: ...
