//! Errors of the shim, and their JSON form for `graphpool_shim_last_error()`.

use std::fmt;

use graphpool_proto::v1::{CapacityRefusal, ErrorDetail, error_detail};
use prost::Message;
use serde_json::{Value, json};

/// Everything that can make a shim call fail.
#[derive(Debug)]
pub enum ShimError {
    /// `graphpool_shim_configure` was not called for this device (in this process).
    NotConfigured {
        /// The CUDA device index torch asked for.
        device: i32,
    },
    /// The shim was configured in another process (this one is a fork of it).
    Forked {
        /// Pid that configured the shim.
        parent: u32,
        /// This process.
        child: u32,
    },
    /// A bad argument from the caller.
    Invalid(String),
    /// The daemon could not be reached.
    Connect(String),
    /// The daemon answered with an error status.
    Daemon {
        /// Which call.
        call: &'static str,
        /// gRPC status code.
        code: tonic::Code,
        /// The daemon's message.
        message: String,
        /// The structured detail from the `graphpool-error-bin` trailer, if any.
        detail: Option<Box<ErrorDetail>>,
    },
    /// The session's stream ended for good (Detach, a refused re-attach, or the daemon did
    /// not come back within the reconnect deadline).
    SessionEnded(String),
    /// The daemon went away and the session is re-attaching (see `session`, "Daemon
    /// restarts").
    Restarting {
        /// The CUDA device of the session.
        device: i32,
        /// How long the daemon has been away, ms.
        for_ms: u64,
        /// How long the session keeps trying, s.
        deadline_s: u64,
        /// Why the last attempt failed (or why the stream ended).
        last_error: String,
    },
    /// Fetching the fd on the fd socket failed.
    Fd(String),
    /// The daemon answered something the shim cannot use (a grant smaller than the request).
    Protocol(String),
    /// A CUDA driver call failed.
    Cuda {
        /// The driver function.
        call: &'static str,
        /// The driver's error name and description.
        message: String,
    },
    /// An OS call failed.
    Os {
        /// The system call.
        call: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
}

impl ShimError {
    /// Builds a [`ShimError::Daemon`] from a gRPC status, decoding the error detail.
    pub fn from_status(call: &'static str, status: &tonic::Status) -> Self {
        let detail = status
            .metadata()
            .get_bin(graphpool_proto::ERROR_DETAIL_METADATA_KEY)
            .and_then(|v| v.to_bytes().ok())
            .and_then(|b| ErrorDetail::decode(b.as_ref()).ok())
            .map(Box::new);
        ShimError::Daemon { call, code: status.code(), message: status.message().to_string(), detail }
    }

    /// The capacity refusal this error carries, if it is one.
    pub fn capacity(&self) -> Option<&CapacityRefusal> {
        match self {
            ShimError::Daemon { detail: Some(d), .. } => match &d.detail {
                Some(error_detail::Detail::Capacity(c)) => Some(c),
                _ => None,
            },
            _ => None,
        }
    }

    /// Short machine-readable kind, the `kind` key of the JSON form.
    pub fn kind(&self) -> &'static str {
        match self {
            ShimError::NotConfigured { .. } => "not-configured",
            ShimError::Forked { .. } => "forked",
            ShimError::Invalid(_) => "invalid-argument",
            ShimError::Connect(_) => "unavailable",
            ShimError::Daemon { code: tonic::Code::ResourceExhausted, .. } => "capacity",
            ShimError::Daemon { code: tonic::Code::Unavailable, .. } => "unavailable",
            ShimError::Daemon { .. } => "daemon",
            ShimError::SessionEnded(_) => "session-ended",
            ShimError::Restarting { .. } => "unavailable",
            ShimError::Fd(_) => "fd",
            ShimError::Protocol(_) => "protocol",
            ShimError::Cuda { .. } => "cuda",
            ShimError::Os { .. } => "os",
        }
    }

    /// The JSON object `graphpool_shim_last_error()` returns: `kind`, `message`, and for a
    /// daemon error `code`/`call`; for a capacity refusal also `requested`, `free`, `limit`,
    /// `limit_bytes`, `device_uuid` and `holders`; for a field error `field`.
    pub fn to_json(&self) -> Value {
        let mut v = json!({ "kind": self.kind(), "message": self.to_string() });
        if let ShimError::Restarting { device, for_ms, .. } = self {
            v["restarting"] = json!(true);
            v["device"] = json!(device);
            v["outage_ms"] = json!(for_ms);
        }
        if let ShimError::Daemon { call, code, detail, .. } = self {
            v["call"] = json!(call);
            v["code"] = json!(code_name(*code));
            v["code_number"] = json!(*code as i32);
            match detail.as_ref().and_then(|d| d.detail.as_ref()) {
                Some(error_detail::Detail::Capacity(c)) => {
                    v["requested"] = json!(c.requested_bytes);
                    v["free"] = json!(c.free_bytes);
                    v["limit"] = json!(c.limit);
                    v["limit_bytes"] = json!(c.limit_bytes);
                    v["device_uuid"] = json!(c.device_uuid);
                    v["holders"] = c
                        .top_holders
                        .iter()
                        .map(|h| {
                            json!({"job_id": h.job_id, "rank": h.rank, "pid": h.pid,
                                   "granted_bytes": h.granted_bytes})
                        })
                        .collect();
                }
                Some(error_detail::Detail::Field(f)) => {
                    v["field"] = json!(f.field);
                    v["description"] = json!(f.description);
                }
                None => {}
            }
        }
        v
    }
}

impl fmt::Display for ShimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShimError::NotConfigured { device } => write!(
                f,
                "graphpool shim: device {device} is not configured in this process; create a \
                 graphpool.torch.MemPool for it (or call graphpool_shim_configure) first"
            ),
            ShimError::Forked { parent, child } => write!(
                f,
                "graphpool shim: this process (pid {child}) is a fork of pid {parent}, whose \
                 daemon sessions and mappings it cannot use; create a new graphpool.torch.MemPool \
                 (graphpool_shim_configure) in the child"
            ),
            ShimError::Invalid(m) => write!(f, "graphpool shim: {m}"),
            ShimError::Connect(m) => write!(f, "graphpool shim: cannot reach graphpoold: {m}"),
            ShimError::Daemon { call, code, message, .. } => {
                write!(f, "graphpoold refused {call} ({}): {message}", code_name(*code))
            }
            ShimError::SessionEnded(m) => write!(f, "graphpool shim: the daemon session ended: {m}"),
            ShimError::Restarting { device, for_ms, deadline_s, last_error } => write!(
                f,
                "graphpool shim: graphpoold is restarting: the session of device {device} lost the \
                 daemon {:.1} s ago and is re-attaching (for up to {deadline_s} s); mapped segments \
                 stay valid, new segments are refused until then (last: {last_error})",
                *for_ms as f64 / 1000.0
            ),
            ShimError::Fd(m) => write!(f, "graphpool shim: fetching the segment's fd failed: {m}"),
            ShimError::Protocol(m) => write!(f, "graphpool shim: unusable answer from graphpoold: {m}"),
            ShimError::Cuda { call, message } => write!(f, "graphpool shim: {call} failed: {message}"),
            ShimError::Os { call, source } => write!(f, "graphpool shim: {call} failed: {source}"),
        }
    }
}

impl std::error::Error for ShimError {}

/// The canonical upper-case name of a gRPC code ("RESOURCE_EXHAUSTED").
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphpool_proto::v1::Holder;

    #[test]
    fn capacity_refusal_becomes_structured_json() {
        let detail = ErrorDetail {
            detail: Some(error_detail::Detail::Capacity(CapacityRefusal {
                requested_bytes: 10,
                free_bytes: 4,
                limit: "session-budget".into(),
                limit_bytes: 8,
                device_uuid: "GPU-x".into(),
                top_holders: vec![Holder { job_id: "j".into(), rank: 1, pid: 7, granted_bytes: 4 }],
            })),
        };
        let mut status = tonic::Status::resource_exhausted("too big");
        status.metadata_mut().insert_bin(
            graphpool_proto::ERROR_DETAIL_METADATA_KEY,
            tonic::metadata::MetadataValue::from_bytes(&detail.encode_to_vec()),
        );
        let e = ShimError::from_status("AllocateSegment", &status);
        assert_eq!(e.capacity().unwrap().limit, "session-budget");
        let j = e.to_json();
        assert_eq!(j["kind"], "capacity");
        assert_eq!(j["code"], "RESOURCE_EXHAUSTED");
        assert_eq!(j["requested"], 10);
        assert_eq!(j["free"], 4);
        assert_eq!(j["limit_bytes"], 8);
        assert_eq!(j["holders"][0]["pid"], 7);
    }
}
