//! graphpool: a per-node daemon (`graphpoold`) that owns the GPU memory used for CUDA graph
//! capture, hands it to training ranks as file descriptors, bounds it centrally and exports
//! it as Prometheus metrics; and the `graphpool` CLI.

pub mod backend;
pub mod cli;
pub mod config;
pub mod ledger;
pub mod planning;
pub mod units;
