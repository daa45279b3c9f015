//! Validation of request fields. Every error names the field and says what is accepted.

use tonic::Status;

use super::status::invalid;

/// Longest job id accepted.
pub const MAX_JOB_ID: usize = 128;
/// Longest label accepted.
pub const MAX_LABEL: usize = 64;
/// Longest client name accepted.
pub const MAX_CLIENT: usize = 128;
/// Most grants a client may declare when re-attaching.
pub const MAX_RESUME: usize = 65_536;
/// Longest device name (an index or a UUID) accepted.
pub const MAX_DEVICE: usize = 128;

/// A job id: 1..=128 bytes of `[A-Za-z0-9._:-]`.
pub fn job_id(v: &str) -> Result<(), Status> {
    if v.is_empty() {
        return Err(invalid("job_id", "must not be empty (use your scheduler's job id, e.g. $SLURM_JOB_ID)"));
    }
    if v.len() > MAX_JOB_ID {
        return Err(invalid("job_id", format!("is {} bytes; at most {MAX_JOB_ID}", v.len())));
    }
    if !v.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b)) {
        return Err(invalid("job_id", "may contain only letters, digits and . _ : -"));
    }
    Ok(())
}

/// A label: 0..=64 bytes of `[A-Za-z0-9._:/-]`.
pub fn label(field: &str, v: &str) -> Result<(), Status> {
    if v.len() > MAX_LABEL {
        return Err(invalid(field, format!("is {} bytes; at most {MAX_LABEL}", v.len())));
    }
    if !v.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:/-".contains(&b)) {
        return Err(invalid(field, "may contain only letters, digits and . _ : / -"));
    }
    Ok(())
}

/// A client name: printable ASCII, at most 128 bytes.
pub fn client(v: &str) -> Result<(), Status> {
    if v.len() > MAX_CLIENT || !v.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(invalid("client", format!("must be printable ASCII of at most {MAX_CLIENT} bytes")));
    }
    Ok(())
}

/// A device as a request names it: an index or a UUID, printable ASCII of at most 128 bytes.
/// Whether the daemon has that device is checked where it is resolved; this bounds what an
/// error message may echo back.
pub fn device(field: &str, v: &str) -> Result<(), Status> {
    if v.len() > MAX_DEVICE || !v.bytes().all(|b| (0x21..0x7f).contains(&b)) {
        return Err(invalid(
            field,
            format!(
                "must be a device index or UUID (printable ASCII, at most {MAX_DEVICE} bytes, no spaces); \
                 `graphpool status` lists them"
            ),
        ));
    }
    Ok(())
}

/// A non-zero id.
pub fn id(field: &str, v: u64) -> Result<(), Status> {
    if v == 0 {
        return Err(invalid(field, "must be set (non-zero)"));
    }
    Ok(())
}

/// A segment size: > 0 and at most `max` (the device's capacity).
pub fn size(field: &str, v: u64, max: u64) -> Result<(), Status> {
    if v == 0 {
        return Err(invalid(field, "must be greater than 0"));
    }
    if v > max {
        return Err(invalid(
            field,
            format!(
                "{} is larger than the device's capacity of {}",
                crate::units::SizeDisplay(v),
                crate::units::SizeDisplay(max)
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids() {
        assert!(job_id("train-42.a:b_c").is_ok());
        assert!(job_id("").is_err());
        assert!(job_id("a b").is_err());
        assert!(job_id(&"x".repeat(129)).is_err());
    }

    #[test]
    fn sizes() {
        assert!(size("size_bytes", 0, 10).is_err());
        assert!(size("size_bytes", 11, 10).unwrap_err().message().contains("size_bytes"));
        assert!(size("size_bytes", 10, 10).is_ok());
    }

    #[test]
    fn devices() {
        assert!(device("device", "").is_ok());
        assert!(device("device", "1").is_ok());
        assert!(device("device", "GPU-5f4e6d2c-0b1a-4c3d-9e8f-7a6b5c4d3e2f").is_ok());
        let e = device("device", &"x".repeat(MAX_DEVICE + 1)).unwrap_err();
        assert!(e.message().starts_with("device:") && e.message().len() < 200, "{}", e.message());
        assert!(device("device", "GPU 0").is_err());
    }

    #[test]
    fn labels() {
        assert!(label("label", "capture-pool/fwd.0").is_ok());
        assert!(label("label", "no spaces").is_err());
    }
}
