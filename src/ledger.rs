//! The ledger: who holds what, and the admission rules.
//!
//! One mutex guards the whole state, so an admission check and the grant it admits are one
//! atomic step: two ranks racing for the last bytes cannot both be admitted. Every change goes
//! through [`Ledger`] methods; the gRPC services, the fd broker and the metrics only read
//! snapshots.
//!
//! What a session is charged: `max(granted, reserved)`, where `reserved` is the budget it
//! asked to hold at attach or the bytes of its last reserved plan. The charge counts against
//! the device budget, the job quota and the rank quota.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::backend::{BackendError, DeviceBackend, DeviceInfo, Segment, round_up};
use crate::config::{GuardsConfig, LimitsConfig};

/// Identity of a connected peer, from `SO_PEERCRED`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Process id in the daemon's pid namespace.
    pub pid: u32,
    /// Effective uid.
    pub uid: u32,
    /// Effective gid.
    pub gid: u32,
}

/// Why a session ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndReason {
    /// The client called Detach.
    Detach,
    /// The Attach stream closed.
    StreamClosed,
    /// The attaching process exited.
    ProcessExit,
    /// The daemon shut down.
    Shutdown,
}

impl EndReason {
    /// Every reason.
    pub const ALL: [EndReason; 4] =
        [EndReason::Detach, EndReason::StreamClosed, EndReason::ProcessExit, EndReason::Shutdown];

    /// Label value for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Detach => "detach",
            EndReason::StreamClosed => "stream-closed",
            EndReason::ProcessExit => "process-exit",
            EndReason::Shutdown => "shutdown",
        }
    }
}

/// Which limit refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitKind {
    /// The device's graphpool budget.
    DeviceBudget,
    /// The job's quota.
    JobQuota,
    /// The rank's quota.
    RankQuota,
    /// The session's own budget.
    SessionBudget,
    /// Grants per session.
    SessionGrants,
    /// The device had no physical memory left (used outside graphpool).
    DeviceMemory,
}

impl LimitKind {
    /// Every limit.
    pub const ALL: [LimitKind; 6] = [
        LimitKind::DeviceBudget,
        LimitKind::JobQuota,
        LimitKind::RankQuota,
        LimitKind::SessionBudget,
        LimitKind::SessionGrants,
        LimitKind::DeviceMemory,
    ];

    /// The name used in the API, metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::DeviceBudget => "device-budget",
            LimitKind::JobQuota => "job-quota",
            LimitKind::RankQuota => "rank-quota",
            LimitKind::SessionBudget => "session-budget",
            LimitKind::SessionGrants => "session-grants",
            LimitKind::DeviceMemory => "device-memory",
        }
    }
}

/// A holder of memory, for refusal details.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// Job id.
    pub job_id: String,
    /// Global rank.
    pub rank: u32,
    /// Process id.
    pub pid: u32,
    /// Bytes charged.
    pub bytes: u64,
}

/// A refused admission: what was asked, what the limit still allows, who holds the most.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Bytes asked for (after rounding).
    pub requested_bytes: u64,
    /// What the limit that bit still allows.
    pub free_bytes: u64,
    /// The limit.
    pub limit: LimitKind,
    /// Its value in bytes (for session-grants: the grant count).
    pub limit_bytes: u64,
    /// Device index.
    pub device: u32,
    /// Device UUID.
    pub device_uuid: String,
    /// Largest holders under that limit, largest first (at most 5).
    pub top_holders: Vec<Holder>,
}

/// Errors of ledger operations. The service layer turns them into gRPC statuses.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The request does not fit a limit.
    #[error("{}", refusal_message(.0))]
    Refused(Box<Refusal>),
    /// No such session.
    #[error("session_id {0} does not exist (it ended, or the daemon restarted: attach again)")]
    UnknownSession(u64),
    /// The session belongs to another process.
    #[error(
        "session_id {session} belongs to another process; a session can only be used by the process that attached it"
    )]
    ForeignSession {
        /// The session.
        session: u64,
    },
    /// No such grant (or already released).
    #[error("grant_id {0} does not exist (never granted, or already released)")]
    UnknownGrant(u64),
    /// The grant belongs to another session.
    #[error("grant_id {grant} belongs to another session")]
    ForeignGrant {
        /// The grant.
        grant: u64,
    },
    /// The device is not one of the daemon's.
    #[error("device {0:?} is not a device of this daemon; `graphpool status` lists them")]
    UnknownDevice(String),
    /// Too many sessions for this uid.
    #[error("uid {uid} already holds {limit} sessions (guards.max_sessions_per_uid); detach unused sessions")]
    TooManySessions {
        /// The uid.
        uid: u32,
        /// The limit.
        limit: u32,
    },
    /// The grant has no fd (adopted after a restart).
    #[error("grant_id {0} was adopted after a daemon restart and has no fd; allocate a new segment")]
    NoFd(u64),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The daemon is shutting down.
    #[error("the daemon is shutting down; retry against the restarted daemon")]
    ShuttingDown,
    /// A configured device budget is more than the device can hold.
    #[error(
        "limits.devices.{key}: {} is more than the device's capacity of {}; set at most that, or \
         leave the device out to let graphpool use all of it",
        crate::units::SizeDisplay(*budget), crate::units::SizeDisplay(*capacity)
    )]
    BudgetAboveCapacity {
        /// The device as the configuration names it.
        key: String,
        /// The budget configured.
        budget: u64,
        /// The device's capacity.
        capacity: u64,
    },
}

/// What a client asks for when it attaches.
#[derive(Clone, Debug, Default)]
pub struct AttachSpec {
    /// Job id (validated by the caller).
    pub job_id: String,
    /// Global rank.
    pub rank: u32,
    /// Rank on this node.
    pub local_rank: u32,
    /// Device index.
    pub device: u32,
    /// Client name.
    pub client: String,
    /// Session budget (0 = none).
    pub budget_bytes: u64,
    /// Reserve the budget now.
    pub reserve_budget: bool,
}

/// A grant declared by a client re-attaching after a daemon restart.
#[derive(Clone, Debug)]
pub struct Declared {
    /// The id the earlier daemon gave it.
    pub grant_id: u64,
    /// Its size.
    pub size_bytes: u64,
    /// Its label.
    pub label: String,
}

/// A session, as the ledger keeps it.
#[derive(Debug, Clone)]
pub struct SessionView {
    /// Session id.
    pub id: u64,
    /// Job id.
    pub job_id: String,
    /// Global rank.
    pub rank: u32,
    /// Rank on this node.
    pub local_rank: u32,
    /// Device index.
    pub device: u32,
    /// The owning process.
    pub peer: Peer,
    /// Client name.
    pub client: String,
    /// Attach time, seconds since the epoch.
    pub attached_unix: f64,
    /// Bytes granted.
    pub granted_bytes: u64,
    /// Grants held.
    pub grants: u32,
    /// Bytes reserved.
    pub reserved_bytes: u64,
    /// Session budget (0 = none).
    pub budget_bytes: u64,
    /// Latest plan: (footprint, saved by aliasing).
    pub plan: Option<(u64, u64)>,
}

/// A grant, as the ledger keeps it.
#[derive(Debug, Clone)]
pub struct GrantView {
    /// Grant id.
    pub id: u64,
    /// Owning session.
    pub session: u64,
    /// Device index.
    pub device: u32,
    /// Device UUID.
    pub device_uuid: String,
    /// Granted bytes.
    pub size_bytes: u64,
    /// Requested bytes.
    pub requested_bytes: u64,
    /// Label.
    pub label: String,
    /// Job id.
    pub job_id: String,
    /// Rank.
    pub rank: u32,
    /// Owner pid.
    pub pid: u32,
    /// Creation time, seconds since the epoch.
    pub created_unix: f64,
    /// Adopted after a restart (no fd).
    pub adopted: bool,
    /// Handle kind.
    pub handle_kind: &'static str,
}

/// Per-device figures.
#[derive(Debug, Clone)]
pub struct DeviceView {
    /// The device.
    pub info: DeviceInfo,
    /// Graphpool's budget on it.
    pub budget_bytes: u64,
    /// Bytes granted.
    pub granted_bytes: u64,
    /// Bytes charged (granted, or reserved where more).
    pub charged_bytes: u64,
    /// Reserved beyond granted.
    pub planned_bytes: u64,
    /// Grants held.
    pub grants: u32,
}

impl DeviceView {
    /// What can still be admitted on the device.
    pub fn free_bytes(&self) -> u64 {
        self.budget_bytes.saturating_sub(self.charged_bytes)
    }
}

/// Quotas and budgets in force.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    /// Default per-rank quota (0 = unlimited).
    pub default_rank_quota_bytes: u64,
    /// Default per-job quota (0 = unlimited).
    pub default_job_quota_bytes: u64,
    /// Per-job quotas.
    pub jobs: BTreeMap<String, u64>,
    /// Per-(job, rank) quotas.
    pub ranks: BTreeMap<(String, u32), u64>,
    /// Device budgets by index.
    pub device_budgets: BTreeMap<u32, u64>,
}

impl Limits {
    fn job_quota(&self, job: &str) -> u64 {
        self.jobs.get(job).copied().unwrap_or(self.default_job_quota_bytes)
    }

    fn rank_quota(&self, job: &str, rank: u32) -> u64 {
        self.ranks.get(&(job.to_string(), rank)).copied().unwrap_or(self.default_rank_quota_bytes)
    }
}

/// A change of limits (Admin.SetLimits).
#[derive(Debug, Clone, Default)]
pub struct LimitsUpdate {
    /// New default rank quota.
    pub default_rank_quota_bytes: Option<u64>,
    /// New default job quota.
    pub default_job_quota_bytes: Option<u64>,
    /// Job quotas to set (0 removes).
    pub jobs: Vec<(String, u64)>,
    /// Rank quotas to set (0 removes).
    pub ranks: Vec<(String, u32, u64)>,
    /// Device budgets to set, by index.
    pub devices: Vec<(u32, u64)>,
}

#[derive(Debug)]
struct SessionRec {
    view: SessionView,
    grant_ids: Vec<u64>,
}

impl SessionRec {
    fn charge(&self) -> u64 {
        self.view.granted_bytes.max(self.view.reserved_bytes)
    }
}

#[derive(Debug)]
struct GrantRec {
    view: GrantView,
    segment: Option<SharedSegment>,
}

/// A granted segment, shared with the fd broker while it sends the fd.
pub type SharedSegment = Arc<Box<dyn Segment>>;

#[derive(Debug)]
struct State {
    sessions: HashMap<u64, SessionRec>,
    grants: HashMap<u64, GrantRec>,
    limits: Limits,
    next_session: u64,
    next_grant: u64,
    shutting_down: bool,
}

/// The daemon's accounting of sessions, grants and limits.
#[derive(Debug)]
pub struct Ledger {
    backend: Arc<dyn DeviceBackend>,
    guards: GuardsConfig,
    state: Mutex<State>,
    started: Instant,
}

/// Result of ending a session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Released {
    /// Grants released.
    pub grants: u32,
    /// Bytes released.
    pub bytes: u64,
}

fn now_unix() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl Ledger {
    /// Creates an empty ledger over `backend`'s devices with the configured limits.
    /// Device budgets in `limits` are keyed by index or UUID; unknown keys are an error.
    pub fn new(
        backend: Arc<dyn DeviceBackend>,
        limits: &LimitsConfig,
        guards: GuardsConfig,
    ) -> Result<Ledger, LedgerError> {
        let mut device_budgets = BTreeMap::new();
        for (key, bytes) in &limits.devices {
            let idx = resolve_device(backend.devices(), key)?;
            // As SetLimits does: a budget the device cannot hold is a mistake, not a wish.
            let capacity = backend.capacity_bytes(idx).unwrap_or(0);
            if *bytes > capacity {
                return Err(LedgerError::BudgetAboveCapacity { key: key.clone(), budget: *bytes, capacity });
            }
            device_budgets.insert(idx, *bytes);
        }
        // Ids start from a per-instance random base so that ids of a restarted daemon never
        // collide with ids clients still hold from the previous instance.
        let base: u64 = (rand::random::<u32>() as u64) << 24;
        Ok(Ledger {
            backend,
            guards,
            state: Mutex::new(State {
                sessions: HashMap::new(),
                grants: HashMap::new(),
                limits: Limits {
                    default_rank_quota_bytes: limits.default_rank_quota_bytes,
                    default_job_quota_bytes: limits.default_job_quota_bytes,
                    jobs: limits.jobs.clone(),
                    ranks: limits.ranks.clone(),
                    device_budgets,
                },
                next_session: base + 1,
                next_grant: base + 1,
                shutting_down: false,
            }),
            started: Instant::now(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the maps half-updated in a way that
        // matters more than stopping service would; keep serving.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn DeviceBackend> {
        &self.backend
    }

    /// The guards the ledger enforces.
    pub fn guards(&self) -> &GuardsConfig {
        &self.guards
    }

    /// Seconds since the ledger was created.
    pub fn uptime_seconds(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Resolves a device named by index or UUID ("" = device 0).
    pub fn resolve_device(&self, key: &str) -> Result<u32, LedgerError> {
        resolve_device(self.backend.devices(), key)
    }

    fn budget_of(&self, st: &State, device: u32) -> u64 {
        let cap = self.backend.capacity_bytes(device).unwrap_or(0);
        st.limits.device_budgets.get(&device).copied().unwrap_or(cap).min(cap)
    }

    /// Opens a session for `peer`. With `reserve_budget`, the budget is admitted now.
    /// Grants in `resume` (declared after a daemon restart) are adopted: accounted to the
    /// session without an fd, even past limits, because the memory is physically in use.
    pub fn attach(
        &self,
        peer: Peer,
        spec: AttachSpec,
        resume: &[Declared],
    ) -> Result<(SessionView, Vec<GrantView>), LedgerError> {
        let mut st = self.lock();
        if st.shutting_down {
            return Err(LedgerError::ShuttingDown);
        }
        let dev = self.backend.devices().get(spec.device as usize).cloned();
        let Some(dev) = dev else { return Err(LedgerError::UnknownDevice(spec.device.to_string())) };
        let of_uid = st.sessions.values().filter(|s| s.view.peer.uid == peer.uid).count();
        if of_uid >= self.guards.max_sessions_per_uid as usize {
            return Err(LedgerError::TooManySessions {
                uid: peer.uid,
                limit: self.guards.max_sessions_per_uid,
            });
        }
        if resume.len() > self.guards.max_grants_per_session as usize {
            return Err(LedgerError::Refused(Box::new(Refusal {
                requested_bytes: resume.iter().fold(0, |a, d| a.saturating_add(d.size_bytes)),
                free_bytes: 0,
                limit: LimitKind::SessionGrants,
                limit_bytes: u64::from(self.guards.max_grants_per_session),
                device: spec.device,
                device_uuid: dev.uuid.clone(),
                top_holders: Vec::new(),
            })));
        }
        // Declared memory is physically in use, so it cannot be more than the device's memory
        // that no grant accounts for yet: a declaration past that is refused whole.
        let declared: u64 = resume
            .iter()
            .filter(|d| !st.grants.contains_key(&d.grant_id))
            .fold(0, |a, d| a.saturating_add(d.size_bytes));
        if declared > 0 {
            let on_device: u64 = st
                .sessions
                .values()
                .filter(|s| s.view.device == spec.device)
                .map(|s| s.view.granted_bytes)
                .sum();
            let unaccounted = dev.total_bytes.saturating_sub(on_device);
            if declared > unaccounted {
                return Err(LedgerError::Refused(Box::new(Refusal {
                    requested_bytes: declared,
                    free_bytes: unaccounted,
                    limit: LimitKind::DeviceMemory,
                    limit_bytes: dev.total_bytes,
                    device: spec.device,
                    device_uuid: dev.uuid.clone(),
                    top_holders: top_holders(st.sessions.values().filter(|s| s.view.device == spec.device)),
                })));
            }
        }
        // A budget is whole granules: a grant is rounded up to them, so a budget that is not
        // could never be used whole.
        let budget_bytes = round_up(spec.budget_bytes, dev.granularity_bytes).unwrap_or(spec.budget_bytes);
        let reserved = if spec.reserve_budget {
            match self.admit(&st, spec.device, &spec.job_id, spec.rank, None, budget_bytes) {
                Ok(()) => budget_bytes,
                // Declared grants are adopted whatever the limits say (the memory is in use);
                // the reservation is then left out, and `reserved_bytes` says so.
                Err(_) if declared > 0 => 0,
                Err(e) => return Err(e),
            }
        } else {
            0
        };
        let id = st.next_session;
        st.next_session += 1;
        let mut rec = SessionRec {
            view: SessionView {
                id,
                job_id: spec.job_id,
                rank: spec.rank,
                local_rank: spec.local_rank,
                device: spec.device,
                peer,
                client: spec.client,
                attached_unix: now_unix(),
                granted_bytes: 0,
                grants: 0,
                reserved_bytes: reserved,
                budget_bytes,
                plan: None,
            },
            grant_ids: Vec::new(),
        };
        let mut adopted = Vec::new();
        for d in resume {
            if st.grants.contains_key(&d.grant_id) || d.size_bytes == 0 {
                continue;
            }
            let view = GrantView {
                id: d.grant_id,
                session: id,
                device: spec.device,
                device_uuid: dev.uuid.clone(),
                size_bytes: d.size_bytes,
                requested_bytes: d.size_bytes,
                label: d.label.clone(),
                job_id: rec.view.job_id.clone(),
                rank: rec.view.rank,
                pid: peer.pid,
                created_unix: now_unix(),
                adopted: true,
                handle_kind: "adopted",
            };
            rec.view.granted_bytes += d.size_bytes;
            rec.view.grants += 1;
            rec.grant_ids.push(d.grant_id);
            adopted.push(view.clone());
            st.grants.insert(d.grant_id, GrantRec { view, segment: None });
        }
        let view = rec.view.clone();
        st.sessions.insert(id, rec);
        Ok((view, adopted))
    }

    /// Checks that `bytes` more can be charged for (job, rank) on `device`. `session` is the
    /// session asking (its own reservation is accounted by the caller through `bytes`).
    fn admit(
        &self,
        st: &State,
        device: u32,
        job: &str,
        rank: u32,
        session: Option<&SessionRec>,
        delta: u64,
    ) -> Result<(), LedgerError> {
        let dev = &self.backend.devices()[device as usize];
        let refuse = |limit: LimitKind, free: u64, limit_bytes: u64, holders: Vec<Holder>| {
            LedgerError::Refused(Box::new(Refusal {
                requested_bytes: delta,
                free_bytes: free,
                limit,
                limit_bytes,
                device,
                device_uuid: dev.uuid.clone(),
                top_holders: holders,
            }))
        };
        if let Some(s) = session {
            self.within_session_budget(s, s.view.granted_bytes.saturating_add(delta), delta)?;
        }
        // The charge increase: a session with a reservation only grows its charge past it.
        let increase = match session {
            Some(s) => s.view.granted_bytes.saturating_add(delta).max(s.view.reserved_bytes) - s.charge(),
            None => delta,
        };
        if increase == 0 {
            return Ok(());
        }
        let budget = self.budget_of(st, device);
        let dev_charge: u64 =
            st.sessions.values().filter(|s| s.view.device == device).map(SessionRec::charge).sum();
        if dev_charge.saturating_add(increase) > budget {
            let holders = top_holders(st.sessions.values().filter(|s| s.view.device == device));
            return Err(refuse(LimitKind::DeviceBudget, budget.saturating_sub(dev_charge), budget, holders));
        }
        let rq = st.limits.rank_quota(job, rank);
        if rq > 0 {
            let c: u64 = st
                .sessions
                .values()
                .filter(|s| s.view.job_id == job && s.view.rank == rank)
                .map(SessionRec::charge)
                .sum();
            if c.saturating_add(increase) > rq {
                let holders =
                    top_holders(st.sessions.values().filter(|s| s.view.job_id == job && s.view.rank == rank));
                return Err(refuse(LimitKind::RankQuota, rq.saturating_sub(c), rq, holders));
            }
        }
        let jq = st.limits.job_quota(job);
        if jq > 0 {
            let c: u64 = st.sessions.values().filter(|s| s.view.job_id == job).map(SessionRec::charge).sum();
            if c.saturating_add(increase) > jq {
                let holders = top_holders(st.sessions.values().filter(|s| s.view.job_id == job));
                return Err(refuse(LimitKind::JobQuota, jq.saturating_sub(c), jq, holders));
            }
        }
        Ok(())
    }

    fn session_of<'a>(st: &'a mut State, id: u64, peer: &Peer) -> Result<&'a mut SessionRec, LedgerError> {
        let s = st.sessions.get_mut(&id).ok_or(LedgerError::UnknownSession(id))?;
        if s.view.peer.pid != peer.pid || s.view.peer.uid != peer.uid {
            return Err(LedgerError::ForeignSession { session: id });
        }
        Ok(s)
    }

    /// Checks that `peer` owns session `id` and returns it.
    pub fn session(&self, id: u64, peer: &Peer) -> Result<SessionView, LedgerError> {
        let mut st = self.lock();
        Ok(Self::session_of(&mut st, id, peer)?.view.clone())
    }

    /// Admits and creates a segment of `size_bytes` (rounded up to the granularity).
    pub fn allocate(
        &self,
        session: u64,
        peer: &Peer,
        size_bytes: u64,
        label: &str,
    ) -> Result<GrantView, LedgerError> {
        let mut st = self.lock();
        if st.shutting_down {
            return Err(LedgerError::ShuttingDown);
        }
        let s = Self::session_of(&mut st, session, peer)?;
        let device = s.view.device;
        let dev = self.backend.devices()[device as usize].clone();
        let rounded = round_up(size_bytes, dev.granularity_bytes).unwrap_or(u64::MAX);
        if s.grant_ids.len() >= self.guards.max_grants_per_session as usize {
            let limit = u64::from(self.guards.max_grants_per_session);
            return Err(LedgerError::Refused(Box::new(Refusal {
                requested_bytes: rounded,
                free_bytes: 0,
                limit: LimitKind::SessionGrants,
                limit_bytes: limit,
                device,
                device_uuid: dev.uuid,
                top_holders: Vec::new(),
            })));
        }
        let (job, rank) = (s.view.job_id.clone(), s.view.rank);
        let s = &st.sessions[&session];
        self.admit(&st, device, &job, rank, Some(s), rounded)?;
        // What the budget leaves on the device once this grant is charged.
        let increase = s.view.granted_bytes.saturating_add(rounded).max(s.view.reserved_bytes) - s.charge();
        let dev_charge: u64 =
            st.sessions.values().filter(|x| x.view.device == device).map(SessionRec::charge).sum();
        let headroom = self.budget_of(&st, device).saturating_sub(dev_charge + increase);
        let segment = match self.backend.allocate(device, rounded, headroom) {
            Ok(seg) => seg,
            Err(BackendError::OutOfMemory { .. }) => {
                let holders = top_holders(st.sessions.values().filter(|s| s.view.device == device));
                let free = self.backend.driver_memory(device).map(|m| m.free_bytes).unwrap_or(0);
                return Err(LedgerError::Refused(Box::new(Refusal {
                    requested_bytes: rounded,
                    free_bytes: free,
                    limit: LimitKind::DeviceMemory,
                    limit_bytes: dev.total_bytes,
                    device,
                    device_uuid: dev.uuid,
                    top_holders: holders,
                })));
            }
            Err(e) => return Err(e.into()),
        };
        // Skip ids declared by clients re-attaching after a restart: they may name any id.
        while st.grants.contains_key(&st.next_grant) {
            st.next_grant += 1;
        }
        let id = st.next_grant;
        st.next_grant += 1;
        let s = st.sessions.get_mut(&session).expect("checked above");
        let view = GrantView {
            id,
            session,
            device,
            device_uuid: dev.uuid,
            size_bytes: rounded,
            requested_bytes: size_bytes,
            label: label.to_string(),
            job_id: s.view.job_id.clone(),
            rank: s.view.rank,
            pid: s.view.peer.pid,
            created_unix: now_unix(),
            adopted: false,
            handle_kind: segment.handle_kind(),
        };
        s.view.granted_bytes += rounded;
        s.view.grants += 1;
        s.grant_ids.push(id);
        st.grants.insert(id, GrantRec { view: view.clone(), segment: Some(Arc::new(segment)) });
        Ok(view)
    }

    /// Releases a grant of the session.
    pub fn release(&self, session: u64, peer: &Peer, grant: u64) -> Result<GrantView, LedgerError> {
        let removed = {
            let mut st = self.lock();
            Self::session_of(&mut st, session, peer)?;
            let g = st.grants.get(&grant).ok_or(LedgerError::UnknownGrant(grant))?;
            if g.view.session != session {
                return Err(LedgerError::ForeignGrant { grant });
            }
            let g = st.grants.remove(&grant).expect("present");
            let s = st.sessions.get_mut(&session).expect("checked");
            s.view.granted_bytes -= g.view.size_bytes;
            s.view.grants -= 1;
            s.grant_ids.retain(|id| *id != grant);
            g
        };
        // The segment (and its backend handle) is destroyed outside the lock.
        self.retire(removed.segment);
        Ok(removed.view)
    }

    /// The segment behind a grant, if `peer` owns the grant's session.
    pub fn segment_for(&self, session: u64, peer: &Peer, grant: u64) -> Result<SharedSegment, LedgerError> {
        let mut st = self.lock();
        Self::session_of(&mut st, session, peer)?;
        let g = st.grants.get(&grant).ok_or(LedgerError::UnknownGrant(grant))?;
        if g.view.session != session {
            return Err(LedgerError::ForeignGrant { grant });
        }
        g.segment.clone().ok_or(LedgerError::NoFd(grant))
    }

    /// Ends a session and releases its grants. Ending an unknown session is a no-op (the
    /// stream guard and the pid watcher may both fire).
    pub fn end_session(&self, session: u64, reason: EndReason) -> Option<(SessionView, Released)> {
        let (view, segments) = {
            let mut st = self.lock();
            let rec = st.sessions.remove(&session)?;
            let mut released = Released::default();
            let mut segments = Vec::with_capacity(rec.grant_ids.len());
            for id in &rec.grant_ids {
                if let Some(g) = st.grants.remove(id) {
                    released.grants += 1;
                    released.bytes += g.view.size_bytes;
                    segments.push(g.segment);
                }
            }
            ((rec.view, released), segments)
        };
        for seg in segments {
            self.retire(seg);
        }
        tracing::info!(
            session, job = %view.0.job_id, rank = view.0.rank, pid = view.0.peer.pid,
            grants = view.1.grants, bytes = view.1.bytes, reason = reason.as_str(), "session ended"
        );
        Some(view)
    }

    /// Hands a released segment to the backend for destruction; if the fd broker still holds
    /// it, it is destroyed when the broker lets go.
    fn retire(&self, segment: Option<SharedSegment>) {
        if let Some(Ok(seg)) = segment.map(Arc::try_unwrap) {
            self.backend.retire(seg);
        }
    }

    /// Refuses a session's charge of `total` bytes past its own budget (none when 0);
    /// `requested` is what the refusal says was asked for.
    fn within_session_budget(&self, s: &SessionRec, total: u64, requested: u64) -> Result<(), LedgerError> {
        let b = s.view.budget_bytes;
        if b == 0 || total <= b {
            return Ok(());
        }
        let dev = &self.backend.devices()[s.view.device as usize];
        Err(LedgerError::Refused(Box::new(Refusal {
            requested_bytes: requested,
            free_bytes: b.saturating_sub(s.view.granted_bytes),
            limit: LimitKind::SessionBudget,
            limit_bytes: b,
            device: s.view.device,
            device_uuid: dev.uuid.clone(),
            top_holders: top_holders(std::iter::once(s)),
        })))
    }

    /// Sets the session's reservation (e.g. from a reserved plan), admitting the increase;
    /// refused past the session's own budget.
    pub fn reserve(&self, session: u64, peer: &Peer, bytes: u64) -> Result<u64, LedgerError> {
        let mut st = self.lock();
        if st.shutting_down {
            return Err(LedgerError::ShuttingDown);
        }
        let s = Self::session_of(&mut st, session, peer)?;
        let dev = &self.backend.devices()[s.view.device as usize];
        let want = round_up(bytes, dev.granularity_bytes).unwrap_or(u64::MAX);
        self.within_session_budget(s, want, want)?;
        let (device, job, rank, charge) = (s.view.device, s.view.job_id.clone(), s.view.rank, s.charge());
        if want > charge {
            self.admit(&st, device, &job, rank, None, want - charge)?;
        }
        let s = st.sessions.get_mut(&session).expect("checked");
        s.view.reserved_bytes = want;
        Ok(want)
    }

    /// Checks whether `bytes` could be charged to the session now (its own budget included),
    /// without changing anything.
    pub fn check_fits(&self, session: u64, peer: &Peer, bytes: u64) -> Result<(), LedgerError> {
        let mut st = self.lock();
        let s = Self::session_of(&mut st, session, peer)?;
        self.within_session_budget(s, bytes, bytes)?;
        let (device, job, rank, charge) = (s.view.device, s.view.job_id.clone(), s.view.rank, s.charge());
        if bytes > charge { self.admit(&st, device, &job, rank, None, bytes - charge) } else { Ok(()) }
    }

    /// Records the latest plan of a session (footprint, saved bytes) for metrics.
    pub fn record_plan(&self, session: u64, footprint: u64, saved: u64) {
        if let Some(s) = self.lock().sessions.get_mut(&session) {
            s.view.plan = Some((footprint, saved));
        }
    }

    /// All sessions.
    pub fn sessions(&self) -> Vec<SessionView> {
        let mut v: Vec<_> = self.lock().sessions.values().map(|s| s.view.clone()).collect();
        v.sort_by_key(|s| s.id);
        v
    }

    /// Grants, optionally of one session or one job.
    pub fn grants(&self, session: Option<u64>, job: Option<&str>) -> Vec<GrantView> {
        let st = self.lock();
        let mut v: Vec<_> = st
            .grants
            .values()
            .filter(|g| session.is_none_or(|s| g.view.session == s))
            .filter(|g| job.is_none_or(|j| g.view.job_id == j))
            .map(|g| g.view.clone())
            .collect();
        v.sort_by_key(|g| g.id);
        v
    }

    /// Per-device figures.
    pub fn devices(&self) -> Vec<DeviceView> {
        let st = self.lock();
        self.backend
            .devices()
            .iter()
            .map(|info| {
                let on = || st.sessions.values().filter(|s| s.view.device == info.index);
                let granted: u64 = on().map(|s| s.view.granted_bytes).sum();
                let charged: u64 = on().map(SessionRec::charge).sum();
                DeviceView {
                    info: info.clone(),
                    budget_bytes: self.budget_of(&st, info.index),
                    granted_bytes: granted,
                    charged_bytes: charged,
                    planned_bytes: charged - granted,
                    grants: on().map(|s| s.view.grants).sum(),
                }
            })
            .collect()
    }

    /// Limits in force.
    pub fn limits(&self) -> Limits {
        self.lock().limits.clone()
    }

    /// Changes limits. Lowering a limit below current use refuses new requests but takes
    /// nothing away.
    pub fn set_limits(&self, update: LimitsUpdate) -> Result<Limits, LedgerError> {
        let mut st = self.lock();
        let n = self.backend.devices().len() as u32;
        if let Some((d, _)) = update.devices.iter().find(|(d, _)| *d >= n) {
            return Err(LedgerError::UnknownDevice(d.to_string()));
        }
        let l = &mut st.limits;
        if let Some(v) = update.default_rank_quota_bytes {
            l.default_rank_quota_bytes = v;
        }
        if let Some(v) = update.default_job_quota_bytes {
            l.default_job_quota_bytes = v;
        }
        for (job, q) in update.jobs {
            if q == 0 {
                l.jobs.remove(&job);
            } else {
                l.jobs.insert(job, q);
            }
        }
        for (job, rank, q) in update.ranks {
            if q == 0 {
                l.ranks.remove(&(job, rank));
            } else {
                l.ranks.insert((job, rank), q);
            }
        }
        for (d, b) in update.devices {
            l.device_budgets.insert(d, b);
        }
        Ok(l.clone())
    }

    /// Refuses new sessions, allocations and reservations from now on.
    pub fn begin_shutdown(&self) {
        self.lock().shutting_down = true;
    }

    /// Ends every session (at shutdown).
    pub fn end_all(&self, reason: EndReason) -> usize {
        let ids: Vec<u64> = self.lock().sessions.keys().copied().collect();
        ids.iter().filter(|id| self.end_session(**id, reason).is_some()).count()
    }
}

/// What a refusal says. The session-grants limit counts grants, not bytes.
fn refusal_message(r: &Refusal) -> String {
    use crate::units::SizeDisplay;
    let limit = r.limit.as_str();
    match r.limit {
        LimitKind::SessionGrants => format!(
            "{limit}: a session may hold at most {} grants (guards.max_grants_per_session) on device {}; {}",
            r.limit_bytes,
            r.device,
            refusal_advice(r.limit)
        ),
        _ => format!(
            "{limit}: asked for {} on device {}, but {limit} allows only {} more (limit {}); {}",
            SizeDisplay(r.requested_bytes),
            r.device,
            SizeDisplay(r.free_bytes),
            SizeDisplay(r.limit_bytes),
            refusal_advice(r.limit)
        ),
    }
}

/// What to do about a refusal by `limit` (the end of its message).
fn refusal_advice(limit: LimitKind) -> &'static str {
    match limit {
        LimitKind::DeviceBudget => {
            "the top holders are listed in the error's details and by `graphpool status`; wait for \
             them to release, or raise the budget: `graphpool limits set --device D=SIZE`"
        }
        LimitKind::JobQuota => {
            "release segments the job no longer needs (`graphpool grants --job JOB` lists them), \
             or raise its quota: `graphpool limits set --job JOB=SIZE`"
        }
        LimitKind::RankQuota => {
            "release segments this rank no longer needs, or raise its quota: \
             `graphpool limits set --rank JOB:RANK=SIZE`"
        }
        LimitKind::SessionBudget => {
            "release segments of this session, or attach with a larger budget (0 = none)"
        }
        LimitKind::SessionGrants => "release segments it no longer needs, or ask for fewer, larger ones",
        LimitKind::DeviceMemory => {
            "memory in use that no grant accounts for (another process, or grants declared after \
             a restart) fills the device; free it, lower the device budget, or declare only \
             grants the process still maps"
        }
    }
}

fn top_holders<'a>(sessions: impl Iterator<Item = &'a SessionRec>) -> Vec<Holder> {
    let mut by: BTreeMap<(String, u32, u32), u64> = BTreeMap::new();
    for s in sessions {
        *by.entry((s.view.job_id.clone(), s.view.rank, s.view.peer.pid)).or_default() += s.charge();
    }
    let mut v: Vec<Holder> =
        by.into_iter().map(|((job_id, rank, pid), bytes)| Holder { job_id, rank, pid, bytes }).collect();
    v.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.job_id.cmp(&b.job_id)).then(a.rank.cmp(&b.rank)));
    v.truncate(5);
    v
}

fn resolve_device(devices: &[DeviceInfo], key: &str) -> Result<u32, LedgerError> {
    if key.is_empty() {
        return if devices.is_empty() { Err(LedgerError::UnknownDevice(String::new())) } else { Ok(0) };
    }
    if let Ok(i) = key.parse::<u32>()
        && (i as usize) < devices.len()
    {
        return Ok(i);
    }
    devices
        .iter()
        .find(|d| d.uuid.eq_ignore_ascii_case(key))
        .map(|d| d.index)
        .ok_or_else(|| LedgerError::UnknownDevice(key.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::host::HostBackend;
    use crate::config::HostConfig;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn ledger(capacity: u64, limits: LimitsConfig) -> Ledger {
        let b = HostBackend::new(&HostConfig {
            devices: 2,
            capacity_bytes: capacity,
            granularity_bytes: 2 * MIB,
        })
        .unwrap();
        Ledger::new(Arc::new(b), &limits, GuardsConfig { max_grants_per_session: 64, ..Default::default() })
            .unwrap()
    }

    fn peer(pid: u32) -> Peer {
        Peer { pid, uid: 1000, gid: 1000 }
    }

    fn spec(job: &str, rank: u32, device: u32) -> AttachSpec {
        AttachSpec { job_id: job.into(), rank, device, ..Default::default() }
    }

    #[test]
    fn allocate_rounds_and_release_returns() {
        let l = ledger(64 * MIB, LimitsConfig::default());
        let (s, _) = l.attach(peer(1), spec("j", 0, 0), &[]).unwrap();
        let g = l.allocate(s.id, &peer(1), 3 * MIB, "x").unwrap();
        assert_eq!(g.size_bytes, 4 * MIB);
        assert_eq!(l.devices()[0].granted_bytes, 4 * MIB);
        assert!(matches!(l.release(s.id, &peer(2), g.id), Err(LedgerError::ForeignSession { .. })));
        l.release(s.id, &peer(1), g.id).unwrap();
        assert!(matches!(l.release(s.id, &peer(1), g.id), Err(LedgerError::UnknownGrant(_))));
        assert_eq!(l.devices()[0].granted_bytes, 0);
    }

    #[test]
    fn device_budget_refusal_names_holders() {
        let l = ledger(8 * MIB, LimitsConfig::default());
        let (a, _) = l.attach(peer(1), spec("big", 3, 0), &[]).unwrap();
        let (b, _) = l.attach(peer(2), spec("small", 1, 0), &[]).unwrap();
        l.allocate(a.id, &peer(1), 6 * MIB, "").unwrap();
        let e = l.allocate(b.id, &peer(2), 4 * MIB, "").unwrap_err();
        let LedgerError::Refused(r) = e else { panic!("{e}") };
        assert_eq!(r.limit, LimitKind::DeviceBudget);
        assert_eq!(r.free_bytes, 2 * MIB);
        assert_eq!(r.top_holders[0].job_id, "big");
        // Other device is unaffected.
        let (c, _) = l.attach(peer(3), spec("small", 2, 1), &[]).unwrap();
        l.allocate(c.id, &peer(3), 8 * MIB, "").unwrap();
    }

    #[test]
    fn job_and_rank_quotas() {
        let limits = LimitsConfig {
            default_rank_quota_bytes: 4 * MIB,
            jobs: [("j".to_string(), 6 * MIB)].into(),
            ..Default::default()
        };
        let l = ledger(64 * MIB, limits);
        let (a, _) = l.attach(peer(1), spec("j", 0, 0), &[]).unwrap();
        let (b, _) = l.attach(peer(2), spec("j", 1, 0), &[]).unwrap();
        l.allocate(a.id, &peer(1), 4 * MIB, "").unwrap();
        let LedgerError::Refused(r) = l.allocate(a.id, &peer(1), 2 * MIB, "").unwrap_err() else { panic!() };
        assert_eq!(r.limit, LimitKind::RankQuota);
        l.allocate(b.id, &peer(2), 2 * MIB, "").unwrap();
        let LedgerError::Refused(r) = l.allocate(b.id, &peer(2), 2 * MIB, "").unwrap_err() else { panic!() };
        assert_eq!(r.limit, LimitKind::JobQuota);
    }

    #[test]
    fn rank_quotas_of_the_config_file_apply_from_the_start() {
        let limits = LimitsConfig {
            default_rank_quota_bytes: 8 * MIB,
            ranks: [(("j".to_string(), 1), 2 * MIB)].into(),
            ..Default::default()
        };
        let l = ledger(64 * MIB, limits);
        let (a, _) = l.attach(peer(1), spec("j", 0, 0), &[]).unwrap();
        let (b, _) = l.attach(peer(2), spec("j", 1, 0), &[]).unwrap();
        l.allocate(a.id, &peer(1), 4 * MIB, "").unwrap();
        l.allocate(b.id, &peer(2), 2 * MIB, "").unwrap();
        let LedgerError::Refused(r) = l.allocate(b.id, &peer(2), 2 * MIB, "").unwrap_err() else { panic!() };
        assert_eq!(r.limit, LimitKind::RankQuota);
        assert_eq!(r.limit_bytes, 2 * MIB);
    }

    #[test]
    fn reserved_budget_is_held_and_drawn_down() {
        let l = ledger(16 * MIB, LimitsConfig::default());
        let s = AttachSpec { budget_bytes: 10 * MIB, reserve_budget: true, ..spec("j", 0, 0) };
        let (a, _) = l.attach(peer(1), s.clone(), &[]).unwrap();
        assert_eq!(a.reserved_bytes, 10 * MIB);
        // A second reservation of 10 MiB does not fit next to the first.
        assert!(matches!(l.attach(peer(2), s, &[]), Err(LedgerError::Refused(_))));
        // Allocations within the reservation do not raise the charge.
        l.allocate(a.id, &peer(1), 8 * MIB, "").unwrap();
        assert_eq!(l.devices()[0].charged_bytes, 10 * MIB);
        let LedgerError::Refused(r) = l.allocate(a.id, &peer(1), 4 * MIB, "").unwrap_err() else { panic!() };
        assert_eq!(r.limit, LimitKind::SessionBudget);
    }

    #[test]
    fn a_device_budget_above_the_capacity_is_refused_at_start() {
        let limits = LimitsConfig { devices: [("0".to_string(), 65 * MIB)].into(), ..Default::default() };
        let b = HostBackend::new(&HostConfig {
            devices: 1,
            capacity_bytes: 64 * MIB,
            granularity_bytes: 2 * MIB,
        })
        .unwrap();
        let Err(e) = Ledger::new(Arc::new(b), &limits, GuardsConfig::default()) else { panic!("accepted") };
        let msg = e.to_string();
        assert!(msg.contains("limits.devices.0") && msg.contains("64 MiB"), "{msg}");
    }

    #[test]
    fn refusals_say_what_to_do() {
        let limits = LimitsConfig { jobs: [("j".to_string(), 4 * MIB)].into(), ..Default::default() };
        let l = ledger(64 * MIB, limits);
        let (a, _) = l.attach(peer(1), spec("j", 0, 0), &[]).unwrap();
        let msg = l.allocate(a.id, &peer(1), 8 * MIB, "").unwrap_err().to_string();
        assert!(msg.contains("graphpool limits set --job"), "{msg}");
        for limit in LimitKind::ALL {
            assert!(!refusal_advice(limit).is_empty());
        }
    }

    #[test]
    fn a_session_can_use_its_whole_budget_of_any_size() {
        let l = ledger(64 * MIB, LimitsConfig::default());
        // 3 MiB is not whole granules (2 MiB): the budget is rounded up, like the grants.
        let (a, _) = l.attach(peer(1), AttachSpec { budget_bytes: 3 * MIB, ..spec("j", 0, 0) }, &[]).unwrap();
        assert_eq!(a.budget_bytes, 4 * MIB);
        l.allocate(a.id, &peer(1), 3 * MIB, "").unwrap();
        let LedgerError::Refused(r) = l.allocate(a.id, &peer(1), 1, "").unwrap_err() else { panic!() };
        assert_eq!(r.limit, LimitKind::SessionBudget);
    }

    #[test]
    fn a_plan_past_the_session_budget_is_neither_reserved_nor_said_to_fit() {
        let l = ledger(64 * MIB, LimitsConfig::default());
        let (a, _) = l.attach(peer(1), AttachSpec { budget_bytes: 8 * MIB, ..spec("j", 0, 0) }, &[]).unwrap();
        for e in [
            l.reserve(a.id, &peer(1), 48 * MIB).unwrap_err(),
            l.check_fits(a.id, &peer(1), 48 * MIB).unwrap_err(),
        ] {
            let LedgerError::Refused(r) = e else { panic!("{e}") };
            assert_eq!(
                (r.limit, r.requested_bytes, r.limit_bytes),
                (LimitKind::SessionBudget, 48 * MIB, 8 * MIB)
            );
        }
        assert_eq!(l.devices()[0].charged_bytes, 0, "nothing reserved");
        assert_eq!(l.reserve(a.id, &peer(1), 8 * MIB).unwrap(), 8 * MIB);
        l.check_fits(a.id, &peer(1), 8 * MIB).unwrap();
    }

    #[test]
    fn declarations_are_adopted_even_when_the_reservation_does_not_fit() {
        let l = ledger(16 * MIB, LimitsConfig::default());
        let (other, _) = l.attach(peer(1), spec("c", 0, 0), &[]).unwrap();
        l.allocate(other.id, &peer(1), 8 * MIB, "").unwrap();
        // After a restart, a rank that reserved 12 MiB declares the 4 MiB it holds: only 8 MiB
        // are free, so the reservation is left out, but the memory in use is adopted.
        let declared = [Declared { grant_id: 77, size_bytes: 4 * MIB, label: String::new() }];
        let s = AttachSpec { budget_bytes: 12 * MIB, reserve_budget: true, ..spec("a", 0, 0) };
        let (a, adopted) = l.attach(peer(2), s.clone(), &declared).unwrap();
        assert_eq!((adopted.len(), a.reserved_bytes), (1, 0));
        assert_eq!(l.devices()[0].granted_bytes, 12 * MIB);
        // Without declarations, a reservation that does not fit is still refused.
        assert!(matches!(l.attach(peer(3), s, &[]), Err(LedgerError::Refused(_))));
    }

    #[test]
    fn declarations_cannot_add_up_to_more_than_the_device_memory() {
        let l = ledger(64 * MIB, LimitsConfig::default());
        let (a, _) = l.attach(peer(1), spec("j", 0, 0), &[]).unwrap();
        l.allocate(a.id, &peer(1), 16 * MIB, "").unwrap();
        let declare = |id: u64, size: u64| Declared { grant_id: id, size_bytes: size, label: String::new() };
        // 16 MiB are granted: 48 MiB of the device's 64 may still be in use elsewhere.
        let e = l
            .attach(peer(2), spec("k", 0, 0), &[declare(100, 32 * MIB), declare(101, 32 * MIB)])
            .unwrap_err();
        let LedgerError::Refused(r) = &e else { panic!("{e}") };
        assert_eq!((r.limit, r.requested_bytes, r.free_bytes), (LimitKind::DeviceMemory, 64 * MIB, 48 * MIB));
        assert_eq!(l.devices()[0].granted_bytes, 16 * MIB, "nothing adopted: {e}");
        let (_, adopted) =
            l.attach(peer(2), spec("k", 0, 0), &[declare(100, 32 * MIB), declare(101, 16 * MIB)]).unwrap();
        assert_eq!(adopted.len(), 2);
        assert_eq!(l.devices()[0].granted_bytes, 64 * MIB);
    }

    #[test]
    fn nothing_new_is_reserved_while_shutting_down() {
        let l = ledger(64 * MIB, LimitsConfig::default());
        let (a, _) = l.attach(peer(1), spec("j", 0, 0), &[]).unwrap();
        assert_eq!(l.reserve(a.id, &peer(1), 4 * MIB).unwrap(), 4 * MIB);
        l.begin_shutdown();
        assert!(matches!(l.reserve(a.id, &peer(1), 8 * MIB), Err(LedgerError::ShuttingDown)));
        assert_eq!(l.devices()[0].charged_bytes, 4 * MIB, "the reservation made before stays");
    }

    #[test]
    fn grant_count_refusal_counts_grants_not_bytes() {
        let b = HostBackend::new(&HostConfig {
            devices: 1,
            capacity_bytes: 64 * MIB,
            granularity_bytes: 2 * MIB,
        })
        .unwrap();
        let guards = GuardsConfig { max_grants_per_session: 2, ..Default::default() };
        let l = Ledger::new(Arc::new(b), &LimitsConfig::default(), guards).unwrap();
        let (a, _) = l.attach(peer(1), spec("j", 0, 0), &[]).unwrap();
        l.allocate(a.id, &peer(1), MIB, "").unwrap();
        l.allocate(a.id, &peer(1), MIB, "").unwrap();
        let e = l.allocate(a.id, &peer(1), MIB, "").unwrap_err();
        let msg = e.to_string();
        assert!(matches!(&e, LedgerError::Refused(r) if r.limit == LimitKind::SessionGrants), "{msg}");
        assert!(msg.contains("at most 2 grants") && msg.contains("guards.max_grants_per_session"), "{msg}");
        assert!(!msg.contains("2 B") && !msg.contains("0 B"), "a grant count is not a size: {msg}");
    }

    #[test]
    fn end_session_releases_everything_once() {
        let l = ledger(64 * MIB, LimitsConfig::default());
        let (a, _) = l.attach(peer(1), spec("j", 0, 0), &[]).unwrap();
        for _ in 0..3 {
            l.allocate(a.id, &peer(1), MIB, "").unwrap();
        }
        let (_, r) = l.end_session(a.id, EndReason::ProcessExit).unwrap();
        assert_eq!(r, Released { grants: 3, bytes: 6 * MIB });
        assert!(l.end_session(a.id, EndReason::StreamClosed).is_none());
        assert!(l.grants(None, None).is_empty());
    }

    #[test]
    fn adopted_grants_are_accounted_without_fd() {
        let l = ledger(64 * MIB, LimitsConfig::default());
        let declared = [Declared { grant_id: 42, size_bytes: 4 * MIB, label: "old".into() }];
        let (a, adopted) = l.attach(peer(1), spec("j", 0, 0), &declared).unwrap();
        assert_eq!(adopted.len(), 1);
        assert_eq!(l.devices()[0].granted_bytes, 4 * MIB);
        assert!(matches!(l.segment_for(a.id, &peer(1), 42), Err(LedgerError::NoFd(42))));
        l.release(a.id, &peer(1), 42).unwrap();
        assert_eq!(l.devices()[0].granted_bytes, 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Attach(u32, u8, u8),
        Alloc(u8, u8),
        Release(u8, u8),
        End(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u32..5, 0u8..3, 0u8..2).prop_map(|(p, r, d)| Op::Attach(p, r, d)),
            (0u8..8, 1u8..12).prop_map(|(s, m)| Op::Alloc(s, m)),
            (0u8..8, 0u8..8).prop_map(|(s, g)| Op::Release(s, g)),
            (0u8..8).prop_map(Op::End),
        ]
    }

    proptest! {
        /// Whatever the sequence of operations: device figures equal the sum of grants,
        /// charges never exceed budgets or quotas, and ending all sessions empties the ledger.
        #[test]
        fn accounting_is_exact(ops in proptest::collection::vec(op(), 1..120)) {
            let limits = LimitsConfig { default_rank_quota_bytes: 24 * MIB, default_job_quota_bytes: 40 * MIB,
                ..Default::default() };
            let l = ledger(32 * MIB, limits);
            let mut sessions: Vec<(u64, Peer)> = Vec::new();
            for op in ops {
                match op {
                    Op::Attach(p, r, d) => {
                        let job = if p % 2 == 0 { "a" } else { "b" };
                        if let Ok((s, _)) = l.attach(peer(p), spec(job, u32::from(r), u32::from(d)), &[]) {
                            sessions.push((s.id, peer(p)));
                        }
                    }
                    Op::Alloc(s, m) => if let Some((id, p)) = sessions.get(s as usize) {
                        let _ = l.allocate(*id, p, u64::from(m) * MIB, "");
                    },
                    Op::Release(s, g) => if let Some((id, p)) = sessions.get(s as usize) {
                        let gs = l.grants(Some(*id), None);
                        if let Some(g) = gs.get(g as usize) { l.release(*id, p, g.id).unwrap(); }
                    },
                    Op::End(s) => if let Some((id, _)) = sessions.get(s as usize) {
                        l.end_session(*id, EndReason::Detach);
                    },
                }
                let grants = l.grants(None, None);
                for d in l.devices() {
                    let sum: u64 = grants.iter().filter(|g| g.device == d.info.index).map(|g| g.size_bytes).sum();
                    prop_assert_eq!(sum, d.granted_bytes);
                    prop_assert!(d.charged_bytes <= d.budget_bytes);
                }
                for job in ["a", "b"] {
                    let j: u64 = grants.iter().filter(|g| g.job_id == job).map(|g| g.size_bytes).sum();
                    prop_assert!(j <= 40 * MIB);
                    for r in 0..3 {
                        let rs: u64 = grants.iter().filter(|g| g.job_id == job && g.rank == r)
                            .map(|g| g.size_bytes).sum();
                        prop_assert!(rs <= 24 * MIB);
                    }
                }
            }
            l.end_all(EndReason::Shutdown);
            prop_assert!(l.grants(None, None).is_empty());
            prop_assert!(l.devices().iter().all(|d| d.granted_bytes == 0 && d.charged_bytes == 0));
        }
    }
}
