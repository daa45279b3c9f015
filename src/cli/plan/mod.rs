//! `graphpool plan`: predict graph memory offline, with no daemon and no session.
//!
//! Two inputs:
//!
//! - `--buffers FILE.csv`: a plain buffer list, for comparison with other allocators on the
//!   same inputs. The first line is the header `buffer,start,end,size`, in any order, with
//!   optional columns `alias_group` and `offset` (MiniMalloc's `id,lower,upper,size` names
//!   are read too); then one buffer per line: a name, the first step it is live, the first
//!   step it no longer is (`[start, end)`; with `--inclusive-end` the last step it is), and
//!   its size in bytes (a plain count or a size such as `64MiB`). Buffers with the same
//!   non-empty `alias_group` share one offset. An `offset` column is another allocator's
//!   placement: it is checked and its footprint reported beside the plan's. Empty lines,
//!   lines starting with `#` and a byte order mark are skipped; fields may be quoted.
//!
//! - `--schedule FILE.toml|FILE.json`: a pipeline schedule and the layers of every chunk,
//!   the same content as the API's `SchedulePlanInput`:
//!
//!   ```toml
//!   [schedule.one_f_one_b]          # or [schedule.interleaved] with virtual_chunks,
//!   pp_size = 8                     # or [schedule.explicit] with order = [1, 1, -1, ...],
//!   pp_rank = 0                     #    num_microbatches and virtual_chunks
//!   num_microbatches = 128
//!
//!   [[layers]]
//!   chunk = 0                       # default 0
//!   layer = 0                       # 0..L within the chunk
//!   saved_bytes = 83886080          # kept for backward beyond the inputs
//!   forward_workspace_bytes = 33554432
//!   backward_workspace_bytes = 33554432
//!   inputs = [{ name = "hidden", shape = [4096, 1, 1024], dtype = "bf16", kept_for_backward = true }]
//!   outputs = [{ name = "hidden", shape = [4096, 1, 1024], dtype = "bf16" }]
//!   ```
//!
//!   An optional `[overhead]` table (`fixed_bytes`, `per_graph_bytes`, `per_pool_bytes`,
//!   `backward_pool_extra_bytes`) adds what capture costs beyond the planned buffers, as an
//!   earlier capture of the model measured it (`GraphedSchedule.capture_overhead()` in the
//!   Python client); without it the prediction is the static buffers alone.
//!
//!   JSON has the same keys (`{"schedule": {"one_f_one_b": {...}}, "layers": [...]}`).
//!   `crates/planner/examples/schedule-1f1b.toml` is a complete example; `docs/planner.md`
//!   explains how buffers, lifetimes and slots follow from it.
//!
//! Either file may be `-`: the input is read from standard input and named `<stdin>` in
//! messages (a schedule there is read as whichever of TOML and JSON parses).
//!
//! The report gives footprint, lower bound, their ratio, the strategy that won, planning
//! time and, for schedules, slots and graphs; `--json` prints the whole plan with every
//! buffer's offset.
//!
//! A malformed input is refused with the file, the line (and for schedules the column) and
//! the field at fault: a CSV column, or a path into the schedule such as
//! `layers[2].outputs[0].shape`, whether the parser found the fault (a string where a number
//! belongs, a missing key) or the planner did (an unknown dtype, buffers past the 2^62 bytes it places).

mod buffers;
mod report;
mod schedule_file;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use graphpool_planner::PlaceOptions;
use graphpool_planner::pipeline::{self, NamedBuffer, PlanError};
use serde_json::json;

use crate::config::GuardsConfig;
use crate::units::SizeDisplay;

pub use buffers::{BufferList, CsvOptions, parse_buffers_csv};
use report::PlanJson;
pub use report::report;
use schedule_file::schedule_plan_error;
pub use schedule_file::{ScheduleDescription, parse_schedule};

/// Arguments of `graphpool plan`.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// A buffer list: CSV with header `buffer,start,end,size` (optional columns `alias_group`
    /// and `offset`, another allocator's placement to check), one buffer per line, live over
    /// [start, end). `-` reads standard input.
    #[arg(long, value_name = "FILE.csv", conflicts_with = "schedule", required_unless_present = "schedule")]
    pub buffers: Option<PathBuf>,
    /// A pipeline schedule with per-layer tensor specs, as TOML or JSON (by the extension
    /// `.toml` or `.json`, else whichever parses). `-` reads standard input.
    #[arg(long, value_name = "FILE")]
    pub schedule: Option<PathBuf>,
    /// Print the plan as JSON, with every buffer's offset.
    #[arg(long)]
    pub json: bool,
    /// Time to spend planning, in milliseconds; plans at the lower bound stop sooner.
    /// Without it: 1000, capped for buffer lists at 8 µs per buffer + 5 ms (at least 60 ms),
    /// and for schedules whose first plans come within 1.001 × the bound likewise. Reading
    /// the input comes on top, and lists of hundreds of thousands of buffers whose first plan
    /// is far from the bound may take longer (`planning time` reports what it took).
    #[arg(long, value_name = "MS")]
    pub time_budget_ms: Option<u64>,
    /// With --buffers: `end` is the last step a buffer is live, not the first it is not
    /// (for traces that record the last use).
    #[arg(long)]
    pub inclusive_end: bool,
    /// Planner threads (default: one per core). graphpoold's `planned` log line gives the
    /// threads and time of each `PlanCapture`: with both, this plans as the daemon did.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
}

/// Why `graphpool plan` failed.
#[derive(Debug, thiserror::Error)]
pub enum PlanCliError {
    /// Neither or both inputs given.
    #[error("give exactly one of --buffers FILE.csv or --schedule FILE")]
    Usage,
    /// The report could not be written (a closed pipe, a full disk).
    #[error("cannot write the plan: {0}")]
    Write(String),
    /// `--inclusive-end` is about the ends of a buffer list; a schedule has none.
    #[error("--inclusive-end reads the `end` column of --buffers; a --schedule has no such column")]
    InclusiveEndWithSchedule,
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A file is not UTF-8 text.
    #[error("{}:{at}: not UTF-8 text; save the file as UTF-8", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// The first byte that is not UTF-8.
        at: Location,
    },
    /// A line of the CSV is malformed.
    #[error("{}:{line}: field `{field}`: {message}", path.display())]
    Csv {
        /// The file.
        path: PathBuf,
        /// Line number (1-based).
        line: usize,
        /// Column name.
        field: String,
        /// What is wrong and what to write instead.
        message: String,
    },
    /// The schedule file is not valid TOML/JSON for a schedule.
    #[error("{}: {}{message}", located(path, at.as_ref()), named(field.as_deref()))]
    Schedule {
        /// The file.
        path: PathBuf,
        /// Where the parser found the fault (none when it gave no place).
        at: Option<Location>,
        /// The key at fault, as a path into the file (`schedule.one_f_one_b.pp_size`,
        /// `layers[2].outputs[0].dtype`); none for syntax errors.
        field: Option<String>,
        /// The parser's message, without its place.
        message: String,
    },
    /// The planner refused the input; `field` names the setting at fault.
    #[error("{}: field `{field}`: {}", located(path, at.as_ref()), source.message())]
    Plan {
        /// The input file.
        path: PathBuf,
        /// Where the setting is in a schedule file, or the table that would hold it when the
        /// file leaves it out (none for buffer lists).
        at: Option<Location>,
        /// The setting at fault, as a path into the file: [`PlanError::field`], with the
        /// schedule's kind for its settings (`schedule.one_f_one_b.pp_rank`).
        field: String,
        /// The planner's error.
        source: Box<PlanError>,
    },
}

/// A place in a file: line and column, both 1-based (the column counts characters, or for
/// JSON bytes, as serde_json does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Line.
    pub line: usize,
    /// Column.
    pub column: usize,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

impl Location {
    /// The place of byte `offset` of `text`.
    pub(super) fn of_offset(text: &str, offset: usize) -> Location {
        let before = &text.as_bytes()[..offset.min(text.len())];
        let line_start = before.iter().rposition(|&b| b == b'\n').map_or(0, |k| k + 1);
        let column = String::from_utf8_lossy(&before[line_start..]).chars().count() + 1;
        Location { line: before.iter().filter(|&&b| b == b'\n').count() + 1, column }
    }
}

/// `path` or `path:line:column`.
fn located(path: &Path, at: Option<&Location>) -> String {
    match at {
        Some(at) => format!("{}:{at}", path.display()),
        None => path.display().to_string(),
    }
}

/// "field `x`: " when there is a field.
fn named(field: Option<&str>) -> String {
    field.map(|f| format!("field `{f}`: ")).unwrap_or_default()
}

impl PlanCliError {
    /// The field at fault (a CSV column, or a path into the schedule such as
    /// `layers[2].inputs[0].dtype`), when there is one.
    pub fn field(&self) -> Option<String> {
        match self {
            PlanCliError::Csv { field, .. } | PlanCliError::Plan { field, .. } => Some(field.clone()),
            PlanCliError::Schedule { field, .. } => field.clone(),
            _ => None,
        }
    }

    /// The line at fault, when the error has one.
    pub fn line(&self) -> Option<usize> {
        match self {
            PlanCliError::Csv { line, .. } => Some(*line),
            PlanCliError::NotUtf8 { at, .. } => Some(at.line),
            PlanCliError::Schedule { at, .. } | PlanCliError::Plan { at, .. } => at.map(|a| a.line),
            _ => None,
        }
    }
}

/// Runs `graphpool plan`: reads the input, plans it and prints the report to stdout.
pub fn run(args: &PlanArgs) -> Result<(), PlanCliError> {
    let mut opts = match args.time_budget_ms {
        Some(ms) => PlaceOptions::with_budget(Duration::from_millis(ms), true),
        None => PlaceOptions::default(),
    };
    opts.threads = args.threads.map_or(0, usize::from);
    let (plan, given) = match (&args.buffers, &args.schedule) {
        (Some(path), None) => {
            let (name, text) = read(path)?;
            let list = parse_buffers_csv(&name, &text, CsvOptions { inclusive_end: args.inclusive_end })?;
            let plan = pipeline::plan_buffers(&list.buffers, &opts).map_err(|source| PlanCliError::Plan {
                path: name.clone(),
                at: None,
                field: source.field(),
                source: Box::new(source),
            })?;
            let given = list.offsets.map(|offsets| GivenPlacement::check(&list.buffers, &offsets));
            (plan, given)
        }
        (None, Some(_)) if args.inclusive_end => return Err(PlanCliError::InclusiveEndWithSchedule),
        (None, Some(path)) => {
            let (name, text) = read(path)?;
            let desc = parse_schedule(&name, &text)?;
            // The daemon's default limit: a schedule accepted here is one it would accept.
            let max = GuardsConfig::default().max_plan_buffers;
            let plan = pipeline::schedule_buffers_within(&desc.input, max)
                .and_then(|sb| pipeline::plan_schedule_buffers(sb, &opts))
                .map_err(|source| schedule_plan_error(&name, &text, &desc.input.schedule, source))?
                .with_overhead(&desc.overhead.unwrap_or_default());
            (plan, None)
        }
        _ => return Err(PlanCliError::Usage),
    };
    if args.json {
        // Streamed: a plan of a million buffers is 150 MB of JSON, and a tree of it in memory
        // took 2 GB.
        let given = given.as_ref().map(|g| g.json(plan.lower_bound));
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        let write = |e: &dyn std::fmt::Display| PlanCliError::Write(e.to_string());
        serde_json::to_writer_pretty(&mut out, &PlanJson { plan: &plan, given_offsets: given })
            .map_err(|e| write(&e))?;
        writeln!(out).and_then(|()| out.flush()).map_err(|e| write(&e))?;
    } else {
        print!("{}", report(&plan));
        if let Some(g) = &given {
            println!("{:<19} {}", "given offsets", g.describe(plan.lower_bound));
        }
    }
    Ok(())
}

/// The placement an `offset` column gave, checked: for comparing another allocator's
/// answer with the plan on the same buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GivenPlacement {
    /// Its footprint (highest byte used), or why it is not a valid placement.
    pub footprint: Result<u64, pipeline::PlacementError>,
}

impl GivenPlacement {
    /// Checks `offsets` for `buffers`.
    pub fn check(buffers: &[NamedBuffer], offsets: &[u64]) -> GivenPlacement {
        GivenPlacement { footprint: pipeline::check_placement(buffers, offsets) }
    }

    /// One line for the report.
    fn describe(&self, lower_bound: u64) -> String {
        match &self.footprint {
            Ok(f) => format!(
                "footprint {} ({f} bytes), ratio {:.4}, valid",
                SizeDisplay(*f),
                *f as f64 / lower_bound.max(1) as f64
            ),
            Err(e) => format!("not a valid placement: {e}"),
        }
    }

    fn json(&self, lower_bound: u64) -> serde_json::Value {
        match &self.footprint {
            Ok(f) => json!({
                "valid": true, "footprint_bytes": f, "ratio": *f as f64 / lower_bound.max(1) as f64,
            }),
            Err(e) => json!({ "valid": false, "error": e.to_string() }),
        }
    }
}

/// How standard input is named in messages when `-` is given for a file.
const STDIN_NAME: &str = "<stdin>";

/// Reads an input file, or standard input for `-`, as UTF-8 text (bytes that are not are
/// refused with their place). Returns the name to give the input in messages, and the text.
fn read(path: &Path) -> Result<(PathBuf, String), PlanCliError> {
    let (path, bytes) = if path == Path::new("-") {
        let path = PathBuf::from(STDIN_NAME);
        let mut bytes = Vec::new();
        match std::io::Read::read_to_end(&mut std::io::stdin().lock(), &mut bytes) {
            Ok(_) => (path, bytes),
            Err(source) => return Err(PlanCliError::Read { path, source }),
        }
    } else {
        match std::fs::read(path) {
            Ok(bytes) => (path.to_path_buf(), bytes),
            Err(source) => return Err(PlanCliError::Read { path: path.to_path_buf(), source }),
        }
    };
    match String::from_utf8(bytes) {
        Ok(text) => Ok((path, text)),
        Err(e) => {
            let at = e.utf8_error().valid_up_to();
            let at = Location::of_offset(std::str::from_utf8(&e.as_bytes()[..at]).unwrap_or_default(), at);
            Err(PlanCliError::NotUtf8 { path, at })
        }
    }
}
