//! The gRPC services: `graphpool.v1.Graphpool` (sessions, segments, usage, plans) and
//! `graphpool.v1.Admin` (limits); and [`segments`], the allocate/release logic that gRPC and
//! the fd socket's fast path share.

pub mod admin;
pub mod graphpool;
pub mod plan_gate;
pub mod segments;
pub mod sessions;
pub mod status;
pub mod validate;

use std::sync::{Arc, LazyLock};
use std::time::Instant;

use tonic::{Code, Request, Status};

use crate::config::AccessConfig;
use crate::conn_limit::UidWarnings;
use crate::ledger::{Ledger, LedgerError, Peer};
use crate::metrics::Metrics;

/// What every service needs.
#[derive(Debug, Clone)]
pub struct Shared {
    /// The ledger.
    pub ledger: Arc<Ledger>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Who may connect, who is admin.
    pub access: AccessConfig,
    /// Live sessions' streams and watchers.
    pub sessions: Arc<sessions::SessionRegistry>,
}

impl Shared {
    /// The authenticated peer of a gRPC request: `SO_PEERCRED` of its connection, checked
    /// against the allow-list.
    pub fn peer<T>(&self, req: &Request<T>) -> Result<Peer, Status> {
        let info = req
            .extensions()
            .get::<tonic::transport::server::UdsConnectInfo>()
            .ok_or_else(|| Status::permission_denied("graphpoold serves only Unix-socket peers"))?;
        let peer = info.peer_cred.as_ref().and_then(crate::peer::peer_of_ucred).ok_or_else(|| {
            Status::permission_denied(
                "the peer's pid is not visible to graphpoold (another pid namespace?); run the daemon with the host's pid namespace (Kubernetes: hostPID: true)",
            )
        })?;
        self.authorize(peer)
    }

    /// Checks a peer (from `SO_PEERCRED` of its connection) against the allow-list.
    ///
    /// Both sockets close a connection of a peer not on the list at accept, before reading
    /// anything from it ([`crate::conn_limit::ConnLimit::admit_peer`]), so a request that
    /// reaches this check comes from a listed peer; the check stays so that no handler
    /// depends on how its connection was accepted. A refusal here is logged like those at
    /// accept: at most one line per uid every [`crate::conn_limit::WARNING_INTERVAL`].
    pub fn authorize(&self, peer: Peer) -> Result<Peer, Status> {
        if !self.access.allows(peer.uid, peer.gid) {
            static WARNINGS: LazyLock<UidWarnings> = LazyLock::new(UidWarnings::default);
            if let Some(unlogged) = WARNINGS.due(peer.uid, Instant::now()) {
                tracing::warn!(
                    pid = peer.pid,
                    uid = peer.uid,
                    gid = peer.gid,
                    unlogged,
                    "refused a peer not on the allow-list"
                );
            }
            return Err(Status::permission_denied(format!(
                "uid {} gid {} is not on graphpoold's allow-list (access.allowed_uids / access.allowed_gids)",
                peer.uid, peer.gid
            )));
        }
        Ok(peer)
    }

    /// Turns a ledger error into a status; a capacity refusal is also counted
    /// (`graphpool_refusals_total`) and logged, naming `who` asked.
    pub fn ledger_error(&self, e: LedgerError, who: &str) -> Status {
        if let LedgerError::Refused(r) = &e {
            self.metrics.refusal(r);
            tracing::warn!(
                who,
                limit = r.limit.as_str(),
                requested = r.requested_bytes,
                free = r.free_bytes,
                limit_bytes = r.limit_bytes,
                device = r.device,
                "refused"
            );
        }
        if let LedgerError::TooManySessions { uid, limit } = &e {
            tracing::warn!(who, uid, limit = "sessions-per-uid", limit_sessions = limit, "refused");
        }
        e.into()
    }

    /// Records a finished gRPC request in the metrics.
    pub fn observe<T>(&self, method: &'static str, started: Instant, result: &Result<T, Status>) {
        self.observe_on(segments::Transport::Grpc, method, started, result);
    }

    /// Records a finished request of either transport in the metrics.
    pub fn observe_on<T>(
        &self,
        transport: segments::Transport,
        method: &'static str,
        started: Instant,
        result: &Result<T, Status>,
    ) {
        let code = match result {
            Ok(_) => Code::Ok,
            Err(s) => s.code(),
        };
        self.metrics.request(method, transport.as_str(), code_name(code), started.elapsed());
    }
}

/// The canonical upper-case name of a gRPC code, as used in metrics.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}
