//! The hot segment calls, `AllocateSegment` and `ReleaseSegment`, shared by both transports
//! that serve them: gRPC ([`super::graphpool`]) and the fd socket's fast path
//! ([`crate::fd_broker`]). Validation, admission, the ledger, refusal metrics and the log line
//! of every grant and release are here and only here; a transport authenticates the peer
//! (`SO_PEERCRED` of its connection, then [`Shared::authorize`]), calls these, and records
//! the request with [`Shared::observe_on`] under its own [`Transport`] label.

use graphpool_proto::v1 as pb;
use tonic::Status;

use super::{Shared, validate};
use crate::ledger::{GrantView, Peer};

/// The transport a request came in on: the `transport` label of the request metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// gRPC over the daemon's socket.
    Grpc,
    /// Length-framed protobuf on the fd socket (`FdRequest`/`FdResponse`).
    FdSocket,
}

impl Transport {
    /// The label value: `grpc` or `fd-socket`.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Grpc => "grpc",
            Transport::FdSocket => "fd-socket",
        }
    }
}

/// Validates and admits an allocation of `peer`'s session, creates the segment and logs the
/// grant. The caller turns the grant into [`pb::Grant`] with
/// [`super::graphpool::grant_proto`]; the fd-socket caller also fetches its segment.
pub fn allocate(shared: &Shared, peer: &Peer, r: &pb::AllocateSegmentRequest) -> Result<GrantView, Status> {
    validate::id("session_id", r.session_id)?;
    validate::label("label", &r.label)?;
    let ledger = &shared.ledger;
    let session = ledger.session(r.session_id, peer)?;
    let capacity = ledger.backend().capacity_bytes(session.device).unwrap_or(0);
    validate::size("size_bytes", r.size_bytes, capacity)?;
    let g = ledger.allocate(r.session_id, peer, r.size_bytes, &r.label).map_err(|e| {
        let who = format!("{}/{}", session.job_id, session.rank);
        shared.ledger_error(e, &who)
    })?;
    tracing::info!(
        grant = g.id, session = g.session, job = %g.job_id, rank = g.rank, pid = g.pid, device = g.device,
        bytes = g.size_bytes, requested = g.requested_bytes, label = %g.label, "granted"
    );
    Ok(g)
}

/// Validates and releases a grant of `peer`'s session and logs the release.
pub fn release(
    shared: &Shared,
    peer: &Peer,
    r: &pb::ReleaseSegmentRequest,
) -> Result<pb::ReleaseSegmentResponse, Status> {
    validate::id("session_id", r.session_id)?;
    validate::id("grant_id", r.grant_id)?;
    let g = shared.ledger.release(r.session_id, peer, r.grant_id)?;
    tracing::info!(grant = g.id, session = g.session, job = %g.job_id, rank = g.rank, bytes = g.size_bytes, "released");
    Ok(pb::ReleaseSegmentResponse { bytes_released: g.size_bytes })
}
