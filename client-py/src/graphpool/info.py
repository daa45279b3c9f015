"""What graphpoold reports, as typed results: devices, grants, sessions, usage and limits."""

from __future__ import annotations

from dataclasses import dataclass

from ._proto.graphpool.v1 import graphpool_pb2 as pb


@dataclass(frozen=True)
class DeviceInfo:
    """A device as the daemon sees it. Sizes in bytes."""

    index: int
    uuid: str
    name: str
    total: int
    capacity: int
    granted: int
    free: int
    granularity: int
    driver_used: int
    driver_free: int

    @classmethod
    def _from(cls, m: pb.Device) -> DeviceInfo:
        return cls(
            index=m.index,
            uuid=m.uuid,
            name=m.name,
            total=m.total_bytes,
            capacity=m.capacity_bytes,
            granted=m.granted_bytes,
            free=m.free_bytes,
            granularity=m.granularity_bytes,
            driver_used=m.driver_used_bytes,
            driver_free=m.driver_free_bytes,
        )


@dataclass(frozen=True)
class GrantInfo:
    """A grant in the daemon's ledger. Sizes in bytes."""

    grant_id: int
    session_id: int
    size: int
    requested: int
    device_uuid: str
    device_index: int
    label: str
    job_id: str
    rank: int
    pid: int
    created_unix_seconds: float
    adopted: bool
    handle_kind: str

    @classmethod
    def _from(cls, m: pb.Grant) -> GrantInfo:
        return cls(
            grant_id=m.grant_id,
            session_id=m.session_id,
            size=m.size_bytes,
            requested=m.requested_bytes,
            device_uuid=m.device_uuid,
            device_index=m.device_index,
            label=m.label,
            job_id=m.job_id,
            rank=m.rank,
            pid=m.pid,
            created_unix_seconds=m.created_unix_seconds,
            adopted=m.adopted,
            handle_kind=m.handle_kind,
        )


@dataclass(frozen=True)
class SessionInfo:
    """A session in the daemon's status listing."""

    session_id: int
    job_id: str
    rank: int
    local_rank: int
    device_index: int
    pid: int
    uid: int
    granted: int
    grants: int
    client: str
    attached_unix_seconds: float

    @classmethod
    def _from(cls, m: pb.SessionInfo) -> SessionInfo:
        return cls(
            session_id=m.session_id,
            job_id=m.job_id,
            rank=m.rank,
            local_rank=m.local_rank,
            device_index=m.device_index,
            pid=m.pid,
            uid=m.uid,
            granted=m.granted_bytes,
            grants=m.grants,
            client=m.client,
            attached_unix_seconds=m.attached_unix_seconds,
        )


@dataclass(frozen=True)
class Status:
    """The daemon's identity, devices and sessions (``GetStatus``)."""

    version: str
    daemon_instance: str
    backend: str
    devices: tuple[DeviceInfo, ...]
    sessions: tuple[SessionInfo, ...]
    fd_socket: str
    uptime_seconds: float

    @classmethod
    def _from(cls, m: pb.Status) -> Status:
        return cls(
            version=m.version,
            daemon_instance=m.daemon_instance,
            backend=m.backend,
            devices=tuple(DeviceInfo._from(d) for d in m.devices),
            sessions=tuple(SessionInfo._from(s) for s in m.sessions),
            fd_socket=m.fd_socket,
            uptime_seconds=m.uptime_seconds,
        )


@dataclass(frozen=True)
class DeviceUsage:
    """Usage of one device. ``free`` is capacity minus granted minus planned."""

    device_index: int
    device_uuid: str
    capacity: int
    granted: int
    free: int
    grants: int
    planned: int


@dataclass(frozen=True)
class JobUsage:
    """Usage of one job over all its ranks."""

    job_id: str
    granted: int
    grants: int
    sessions: int


@dataclass(frozen=True)
class RankUsage:
    """Usage of one rank of a job."""

    job_id: str
    rank: int
    device_index: int
    granted: int
    grants: int


@dataclass(frozen=True)
class Usage:
    """Usage per device, per job and per rank (``GetUsage``)."""

    devices: tuple[DeviceUsage, ...]
    jobs: tuple[JobUsage, ...]
    ranks: tuple[RankUsage, ...]

    @property
    def granted(self) -> int:
        """Bytes granted over all devices."""
        return sum(d.granted for d in self.devices)

    def job(self, job_id: str) -> JobUsage | None:
        """The usage of ``job_id``, or ``None`` if it holds nothing."""
        return next((j for j in self.jobs if j.job_id == job_id), None)

    @classmethod
    def _from(cls, m: pb.Usage) -> Usage:
        return cls(
            devices=tuple(
                DeviceUsage(
                    device_index=d.device_index,
                    device_uuid=d.device_uuid,
                    capacity=d.capacity_bytes,
                    granted=d.granted_bytes,
                    free=d.free_bytes,
                    grants=d.grants,
                    planned=d.planned_bytes,
                )
                for d in m.devices
            ),
            jobs=tuple(
                JobUsage(job_id=j.job_id, granted=j.granted_bytes, grants=j.grants, sessions=j.sessions)
                for j in m.jobs
            ),
            ranks=tuple(
                RankUsage(
                    job_id=r.job_id,
                    rank=r.rank,
                    device_index=r.device_index,
                    granted=r.granted_bytes,
                    grants=r.grants,
                )
                for r in m.ranks
            ),
        )


@dataclass(frozen=True)
class DeviceLimit:
    """graphpool's budget on one device, in bytes."""

    device_uuid: str
    device_index: int
    budget: int


@dataclass(frozen=True)
class JobLimit:
    """A job-specific quota, in bytes."""

    job_id: str
    quota: int


@dataclass(frozen=True)
class RankLimit:
    """A rank-specific quota, in bytes."""

    job_id: str
    rank: int
    quota: int


@dataclass(frozen=True)
class Limits:
    """The limits in force (``GetLimits``). A quota of 0 means unlimited."""

    devices: tuple[DeviceLimit, ...]
    jobs: tuple[JobLimit, ...]
    ranks: tuple[RankLimit, ...]
    default_rank_quota: int
    default_job_quota: int

    @classmethod
    def _from(cls, m: pb.Limits) -> Limits:
        return cls(
            devices=tuple(
                DeviceLimit(device_uuid=d.device_uuid, device_index=d.device_index, budget=d.budget_bytes)
                for d in m.devices
            ),
            jobs=tuple(JobLimit(job_id=j.job_id, quota=j.quota_bytes) for j in m.jobs),
            ranks=tuple(RankLimit(job_id=r.job_id, rank=r.rank, quota=r.quota_bytes) for r in m.ranks),
            default_rank_quota=m.default_rank_quota_bytes,
            default_job_quota=m.default_job_quota_bytes,
        )
