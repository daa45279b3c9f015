//! The `graphpool` command-line tool.

pub mod plan;
