//! The gRPC services: `graphpool.v1.Graphpool` (sessions, segments, usage, plans) and
//! `graphpool.v1.Admin` (limits).

pub mod admin;
pub mod graphpool;
pub mod sessions;
pub mod status;
pub mod validate;

use std::sync::Arc;
use std::time::Instant;

use tonic::{Code, Request, Status};

use crate::config::AccessConfig;
use crate::ledger::{Ledger, Peer};
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
    /// The authenticated peer of a request: `SO_PEERCRED` of its connection, checked against
    /// the allow-list.
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
        if !self.access.allows(peer.uid, peer.gid) {
            tracing::warn!(
                pid = peer.pid,
                uid = peer.uid,
                gid = peer.gid,
                "refused a peer not on the allow-list"
            );
            return Err(Status::permission_denied(format!(
                "uid {} gid {} is not on graphpoold's allow-list (access.allowed_uids / access.allowed_gids)",
                peer.uid, peer.gid
            )));
        }
        Ok(peer)
    }

    /// Records a finished request in the metrics.
    pub fn observe<T>(&self, method: &'static str, started: Instant, result: &Result<T, Status>) {
        let code = match result {
            Ok(_) => Code::Ok,
            Err(s) => s.code(),
        };
        self.metrics.request(method, code_name(code), started.elapsed());
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
