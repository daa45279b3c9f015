//! `graphpoold`: the per-node daemon. All the work is in the `graphpool` library.

use std::process::ExitCode;

use clap::Parser;
use graphpool::config::{Config, DaemonArgs, LogFormat};

fn main() -> ExitCode {
    graphpool::server::return_large_blocks_to_the_os();
    let args = DaemonArgs::parse();
    let config = match Config::load(&args) {
        Ok(c) => c,
        Err(e) => {
            graphpool::logging::init(args.log_format.unwrap_or(LogFormat::Text));
            tracing::error!("{e}");
            return ExitCode::from(2);
        }
    };
    graphpool::logging::init(config.log_format);
    let runtime =
        match tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("graphpoold").build() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("cannot start the async runtime: {e}");
                return ExitCode::FAILURE;
            }
        };
    match runtime.block_on(graphpool::server::run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}
