//! Errors that stop the daemon from starting or serving. Each says what to do about it.

use std::path::PathBuf;

use crate::backend::BackendError;
use crate::config::ConfigError;
use crate::ledger::LedgerError;

/// Why `graphpoold` could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The device backend could not be opened.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The configured limits do not match the devices.
    #[error("limits: {0}")]
    Limits(#[from] LedgerError),
    /// Another daemon already serves the socket.
    #[error("another graphpoold is already serving {0}; stop it first or pass another --socket")]
    SocketInUse(PathBuf),
    /// The socket path names a file that is not a socket.
    #[error(
        "{0} exists and is not a socket; graphpoold replaces only a stale socket there: pass another path"
    )]
    NotASocket(PathBuf),
    /// A socket could not be created.
    #[error("cannot create socket {path}: {source}; check that its directory exists and is writable")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The socket's group or mode could not be set.
    #[error("cannot set group {group:?} / mode {mode:o} on {path}: {message}")]
    Permissions {
        /// The socket path.
        path: PathBuf,
        /// The group asked for.
        group: String,
        /// The mode asked for.
        mode: u32,
        /// What failed.
        message: String,
    },
    /// The metrics listener could not be bound.
    #[error("cannot listen for metrics on {addr}: {source}; pass another --metrics-listen or \"off\"")]
    Metrics {
        /// The address.
        addr: std::net::SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("gRPC server failed: {0}")]
    Serve(String),
    /// Signal handlers could not be installed.
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
}
