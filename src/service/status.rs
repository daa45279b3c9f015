//! Turning daemon errors into gRPC statuses with structured details.

use graphpool_proto::ERROR_DETAIL_METADATA_KEY;
use graphpool_proto::v1::{CapacityRefusal, ErrorDetail, FieldViolation, Holder, error_detail};
use prost::Message;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Status};

use crate::backend::BackendError;
use crate::ledger::{LedgerError, Refusal};

/// Longest message a status carries. A status travels in HTTP/2 trailers (`grpc-message`,
/// and the detail again in `graphpool-error-bin`), and clients bound the size of those (8 KiB
/// in grpc-python; tonic's client closes the whole HTTP/2 connection, every stream on it
/// included, when the limit is passed): a message that echoes a long request field is cut.
pub const MAX_MESSAGE: usize = 1024;

/// `message` cut to at most about [`MAX_MESSAGE`] bytes: its start and its end (where an error
/// says what to do) are kept, the middle is replaced by a note of how much was left out.
pub fn bounded(message: String) -> String {
    if message.len() <= MAX_MESSAGE {
        return message;
    }
    let floor = |mut i: usize| {
        while !message.is_char_boundary(i) {
            i -= 1;
        }
        i
    };
    let head = floor(MAX_MESSAGE * 2 / 3);
    let tail = floor(message.len() - MAX_MESSAGE / 4);
    format!("{} [{} bytes left out] {}", &message[..head], tail - head, &message[tail..])
}

/// A status whose details name the request field at fault.
pub fn field_status(code: Code, field: &str, message: impl Into<String>) -> Status {
    let message = bounded(message.into());
    let detail = ErrorDetail {
        detail: Some(error_detail::Detail::Field(FieldViolation {
            field: field.to_string(),
            description: message.clone(),
        })),
    };
    with_detail(code, format!("{field}: {message}"), &detail)
}

/// `INVALID_ARGUMENT` naming `field`.
pub fn invalid(field: &str, message: impl Into<String>) -> Status {
    field_status(Code::InvalidArgument, field, message)
}

/// `RESOURCE_EXHAUSTED` with the refusal's details.
pub fn refusal_status(r: &Refusal, message: String) -> Status {
    let detail = ErrorDetail { detail: Some(error_detail::Detail::Capacity(refusal_proto(r))) };
    with_detail(Code::ResourceExhausted, message, &detail)
}

/// The API form of a refusal.
pub fn refusal_proto(r: &Refusal) -> CapacityRefusal {
    CapacityRefusal {
        requested_bytes: r.requested_bytes,
        free_bytes: r.free_bytes,
        limit: r.limit.as_str().to_string(),
        limit_bytes: r.limit_bytes,
        device_uuid: r.device_uuid.clone(),
        top_holders: r
            .top_holders
            .iter()
            .map(|h| Holder { job_id: h.job_id.clone(), rank: h.rank, pid: h.pid, granted_bytes: h.bytes })
            .collect(),
    }
}

fn with_detail(code: Code, message: String, detail: &ErrorDetail) -> Status {
    let mut md = MetadataMap::new();
    md.insert_bin(ERROR_DETAIL_METADATA_KEY, MetadataValue::from_bytes(&detail.encode_to_vec()));
    Status::with_metadata(code, message, md)
}

impl From<LedgerError> for Status {
    fn from(e: LedgerError) -> Status {
        let msg = e.to_string();
        match &e {
            LedgerError::Refused(r) => refusal_status(r, msg),
            LedgerError::UnknownSession(_) => field_status(Code::NotFound, "session_id", msg),
            LedgerError::ForeignSession { .. } => field_status(Code::PermissionDenied, "session_id", msg),
            LedgerError::UnknownGrant(_) => field_status(Code::NotFound, "grant_id", msg),
            LedgerError::ForeignGrant { .. } => field_status(Code::PermissionDenied, "grant_id", msg),
            LedgerError::UnknownDevice(_) => field_status(Code::NotFound, "device", msg),
            LedgerError::TooManySessions { .. } => Status::resource_exhausted(msg),
            LedgerError::NoFd(_) => field_status(Code::FailedPrecondition, "grant_id", msg),
            LedgerError::ShuttingDown => Status::unavailable(msg),
            // Only at start-up (configuration); never in answer to a request.
            LedgerError::BudgetAboveCapacity { .. } => Status::invalid_argument(msg),
            LedgerError::Backend(BackendError::UnknownDevice(_)) => {
                field_status(Code::NotFound, "device", msg)
            }
            LedgerError::Backend(_) => Status::internal(msg),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_errors_carry_the_field() {
        let s = invalid("size_bytes", "must be > 0");
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().starts_with("size_bytes:"));
        let raw = s.metadata().get_bin(ERROR_DETAIL_METADATA_KEY).unwrap().to_bytes().unwrap();
        let d = ErrorDetail::decode(raw).unwrap();
        let Some(error_detail::Detail::Field(f)) = d.detail else { panic!() };
        assert_eq!(f.field, "size_bytes");
    }

    #[test]
    fn long_messages_are_cut_but_keep_their_start_and_end() {
        let long = format!("unknown dtype \"{}\"; use one of bf16, fp32", "é".repeat(20_000));
        let s = invalid("input.schedule.layers[0].inputs[0].dtype", long);
        assert!(s.message().len() <= MAX_MESSAGE + 100, "{} bytes", s.message().len());
        assert_eq!(s.message().matches("bytes left out").count(), 1);
        assert!(s.message().starts_with("input.schedule.layers[0].inputs[0].dtype: unknown dtype"));
        assert!(s.message().ends_with("use one of bf16, fp32"), "{}", s.message());
        let raw = s.metadata().get_bin(ERROR_DETAIL_METADATA_KEY).unwrap().to_bytes().unwrap();
        let Some(error_detail::Detail::Field(f)) = ErrorDetail::decode(raw).unwrap().detail else { panic!() };
        assert!(f.description.len() <= MAX_MESSAGE + 100);
        assert_eq!(bounded("short".to_string()), "short");
    }
}
