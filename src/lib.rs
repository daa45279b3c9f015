//! graphpool: a per-node daemon (`graphpoold`) that owns the GPU memory used for CUDA graph
//! capture, hands it to training ranks as file descriptors, bounds it centrally and exports
//! it as Prometheus metrics; and the `graphpool` CLI.
//!
//! Layout: [`config`] (parsed in one place), [`backend`] (cuda VMM / host memfd),
//! [`ledger`] (accounting and admission), [`service`] (gRPC), [`fd_broker`] (fds over
//! `SCM_RIGHTS`), [`conn_limit`] (per-uid connection caps of both sockets), [`metrics`],
//! [`server`] (the serve loop), [`planning`] (buffer plans), and [`cli`].

pub mod backend;
pub mod cli;
pub mod client;
pub mod config;
pub mod conn_limit;
pub mod error;
pub mod fd_broker;
pub mod fd_limit;
pub mod ledger;
pub mod logging;
pub mod metrics;
pub mod peer;
pub mod planning;
pub mod server;
pub mod service;
pub mod shutdown;
pub mod units;
