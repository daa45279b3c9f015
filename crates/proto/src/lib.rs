//! Generated types and service stubs of the graphpool v1 API (`proto/graphpool/v1`).
//!
//! The `.proto` files are the source of truth; this crate compiles them at build time with
//! protox, so no system `protoc` is needed.
#![allow(missing_docs, clippy::all, missing_debug_implementations)]

/// `graphpool.v1`: sessions, segments, usage, limits and plans.
pub mod v1 {
    tonic::include_proto!("graphpool.v1");
}

/// Encoded `FileDescriptorSet` of the API, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("graphpool_descriptor");

/// Trailing-metadata key that carries a serialized [`v1::ErrorDetail`] on failed calls.
pub const ERROR_DETAIL_METADATA_KEY: &str = "graphpool-error-bin";
