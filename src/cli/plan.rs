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
//! The report gives footprint, lower bound, their ratio, the strategy that won, planning
//! time and, for schedules, slots and graphs; `--json` prints the whole plan with every
//! buffer's offset.
//!
//! A malformed input is refused with the file, the line (and for schedules the column) and
//! the field at fault: a CSV column, or a path into the schedule such as
//! `layers[2].outputs[0].shape`, whether the parser found the fault (a string where a number
//! belongs, a missing key) or the planner did (an unknown dtype, tensors past 2^64 bytes).

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use graphpool_planner::pipeline::{self, CaptureOverhead, NamedBuffer, Plan, PlanError, SchedulePlanInput};
use graphpool_planner::{PlaceOptions, Schedule};
use serde_json::json;

use crate::config::GuardsConfig;
use crate::units::{SizeDisplay, parse_size};

/// Arguments of `graphpool plan`.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// A buffer list: CSV with header `buffer,start,end,size` (optional columns `alias_group`
    /// and `offset`, another allocator's placement to check), one buffer per line, live over
    /// [start, end).
    #[arg(long, value_name = "FILE.csv", conflicts_with = "schedule", required_unless_present = "schedule")]
    pub buffers: Option<PathBuf>,
    /// A pipeline schedule with per-layer tensor specs, as TOML or JSON (by the extension
    /// `.toml` or `.json`, else whichever parses).
    #[arg(long, value_name = "FILE")]
    pub schedule: Option<PathBuf>,
    /// Print the plan as JSON, with every buffer's offset.
    #[arg(long)]
    pub json: bool,
    /// Time to spend planning, in milliseconds; plans at the lower bound stop sooner.
    /// Without it: 1000, capped for buffer lists at 8 µs per buffer + 5 ms (at least 60 ms). Reading
    /// the input comes on top, and lists of hundreds of thousands of buffers whose first plan
    /// is far from the bound may take longer (`planning time` reports what it took).
    #[arg(long, value_name = "MS")]
    pub time_budget_ms: Option<u64>,
    /// With --buffers: `end` is the last step a buffer is live, not the first it is not
    /// (for traces that record the last use).
    #[arg(long)]
    pub inclusive_end: bool,
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
    fn of_offset(text: &str, offset: usize) -> Location {
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
    let opts = match args.time_budget_ms {
        Some(ms) => PlaceOptions::with_budget(Duration::from_millis(ms), true),
        None => PlaceOptions::default(),
    };
    let (plan, given) = match (&args.buffers, &args.schedule) {
        (Some(path), None) => {
            let text = read(path)?;
            let list = parse_buffers_csv(path, &text, CsvOptions { inclusive_end: args.inclusive_end })?;
            let plan = pipeline::plan_buffers(&list.buffers, &opts).map_err(|source| PlanCliError::Plan {
                path: path.clone(),
                at: None,
                field: source.field(),
                source: Box::new(source),
            })?;
            let given = list.offsets.map(|offsets| GivenPlacement::check(&list.buffers, &offsets));
            (plan, given)
        }
        (None, Some(_)) if args.inclusive_end => return Err(PlanCliError::InclusiveEndWithSchedule),
        (None, Some(path)) => {
            let text = read(path)?;
            let desc = parse_schedule(path, &text)?;
            // The daemon's default limit: a schedule accepted here is one it would accept.
            let max = GuardsConfig::default().max_plan_buffers;
            let plan = pipeline::schedule_buffers_within(&desc.input, max)
                .and_then(|sb| pipeline::plan_schedule_buffers(sb, &opts))
                .map_err(|source| schedule_plan_error(path, &text, &desc.input.schedule, source))?
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

/// Reads a file as UTF-8 text; bytes that are not are refused with their place.
fn read(path: &Path) -> Result<String, PlanCliError> {
    let bytes =
        std::fs::read(path).map_err(|source| PlanCliError::Read { path: path.to_path_buf(), source })?;
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let at = Location::of_offset(std::str::from_utf8(&e.as_bytes()[..at]).unwrap_or_default(), at);
        PlanCliError::NotUtf8 { path: path.to_path_buf(), at }
    })
}

/// A `--schedule` file: what to plan, and optionally the capture overhead to add.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleDescription {
    /// The schedule and its layers.
    pub input: SchedulePlanInput,
    /// Capture overhead measured by an earlier capture (none: static buffers only).
    pub overhead: Option<CaptureOverhead>,
}

/// The file's keys: those of `SchedulePlanInput` plus `overhead`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptionFile {
    schedule: graphpool_planner::schedule::Schedule,
    layers: Vec<pipeline::LayerSpec>,
    #[serde(default)]
    overhead: Option<CaptureOverhead>,
}

impl From<DescriptionFile> for ScheduleDescription {
    fn from(f: DescriptionFile) -> Self {
        ScheduleDescription {
            input: SchedulePlanInput { schedule: f.schedule, layers: f.layers },
            overhead: f.overhead,
        }
    }
}

/// The formats of a schedule description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    Toml,
}

impl Format {
    /// The format a file's extension names, if any.
    fn of(path: &Path) -> Option<Format> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("json") => Some(Format::Json),
            Some("toml") => Some(Format::Toml),
            _ => None,
        }
    }

    /// The format `text` is in: by the file's extension, else JSON when it parses as JSON.
    fn detect(path: &Path, text: &str) -> Format {
        Format::of(path).unwrap_or_else(|| {
            if serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok() {
                Format::Json
            } else {
                Format::Toml
            }
        })
    }

    fn name(self) -> &'static str {
        match self {
            Format::Json => "JSON",
            Format::Toml => "TOML",
        }
    }
}

/// Why a description could not be read: the parser's place, the key at fault and its
/// message (the file's path is added by [`parse_schedule`]).
#[derive(Debug)]
struct ParseFailure {
    at: Option<Location>,
    field: Option<String>,
    message: String,
}

/// Reads `text` as `format`, tracking the path of the key being read.
fn parse_as<T: serde::de::DeserializeOwned>(format: Format, text: &str) -> Result<T, ParseFailure> {
    match format {
        Format::Json => {
            let mut de = serde_json::Deserializer::from_str(text);
            let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
                // A syntax error is about the text, not about a key.
                let data = e.inner().classify() == serde_json::error::Category::Data;
                let field = data.then(|| field_path(e.path(), &e.inner().to_string())).flatten();
                ParseFailure { field, ..json_failure(e.inner()) }
            })?;
            // Nothing but blanks after the value.
            de.end().map_err(|e| json_failure(&e))?;
            Ok(value)
        }
        Format::Toml => {
            let de = toml::Deserializer::parse(text).map_err(|e| toml_failure(text, &e))?;
            serde_path_to_error::deserialize(de).map_err(|e| {
                let field = field_path(e.path(), e.inner().message());
                ParseFailure { field, ..toml_failure(text, e.inner()) }
            })
        }
    }
}

/// A serde_json error's place, and its message without the place serde_json appends.
fn json_failure(e: &serde_json::Error) -> ParseFailure {
    let text = e.to_string();
    if e.line() == 0 {
        return ParseFailure { at: None, field: None, message: text };
    }
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let message = text.strip_suffix(&suffix).unwrap_or(&text).to_string();
    ParseFailure { at: Some(Location { line: e.line(), column: e.column().max(1) }), field: None, message }
}

/// A toml error's place (from its span) and message.
fn toml_failure(text: &str, e: &toml::de::Error) -> ParseFailure {
    let at = e.span().map(|span| Location::of_offset(text, span.start));
    ParseFailure { at, field: None, message: e.message().trim_end().to_string() }
}

/// The key at fault as a path into the file (`layers[2].outputs[0].shape`): where the
/// parser was, and for a missing key the key itself (serde reports it on the table that
/// lacks it). None at the top of the file (a syntax error).
fn field_path(path: &serde_path_to_error::Path, message: &str) -> Option<String> {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    let key = |out: &mut String, key: &str| {
        if !out.is_empty() {
            out.push('.');
        }
        out.push_str(key);
    };
    for segment in path {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key: k } | Segment::Enum { variant: k } => key(&mut out, k),
            Segment::Unknown => key(&mut out, "?"),
        }
    }
    if let Some(missing) =
        message.strip_prefix("missing field `").and_then(|rest| rest.split_once('`')).map(|(name, _)| name)
    {
        key(&mut out, missing);
    }
    (!out.is_empty()).then_some(out)
}

/// Parses a schedule description: TOML for `.toml`, JSON for `.json`, else whichever parses.
/// Errors give the line and column and the key at fault.
pub fn parse_schedule(path: &Path, text: &str) -> Result<ScheduleDescription, PlanCliError> {
    let file: DescriptionFile = match Format::of(path) {
        Some(format) => parse_as(format, text),
        None => parse_as(Format::Json, text).or_else(|json| {
            parse_as(Format::Toml, text).map_err(|toml| {
                // Report the failure of the format the text is closer to.
                let (format, mut failure) = if text.trim_start().starts_with('{') {
                    (Format::Json, json)
                } else {
                    (Format::Toml, toml)
                };
                failure.message = format!(
                    "{} (read as {}: name the file .json or .toml to choose)",
                    failure.message,
                    format.name()
                );
                failure
            })
        }),
    }
    .map_err(|f| PlanCliError::Schedule {
        path: path.to_path_buf(),
        at: f.at,
        field: f.field,
        message: f.message,
    })?;
    Ok(file.into())
}

/// The planner's refusal of a schedule file, with the setting's path in the file (the
/// schedule's settings under its kind) and its place there.
fn schedule_plan_error(path: &Path, text: &str, schedule: &Schedule, source: PlanError) -> PlanCliError {
    let field = match &source {
        PlanError::Schedule(e) => format!("schedule.{}.{}", schedule.kind(), e.field),
        other => other.field(),
    };
    let at = locate(Format::detect(path, text), text, &field);
    PlanCliError::Plan { path: path.to_path_buf(), at, field, source: Box::new(source) }
}

/// One step of a field path: a key of a table or an index into an array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

/// The steps of `layers[2].outputs[0].shape`.
fn steps(field: &str) -> Option<Vec<Step<'_>>> {
    let mut out = Vec::new();
    for part in field.split('.') {
        let (key, mut indices) = part.split_once('[').map_or((part, ""), |(k, rest)| (k, rest));
        if !key.is_empty() {
            out.push(Step::Key(key));
        }
        while !indices.is_empty() {
            let (index, rest) = indices.split_once(']')?;
            out.push(Step::Index(index.parse().ok()?));
            indices = rest.strip_prefix('[').unwrap_or(rest);
        }
    }
    Some(out)
}

/// Where `field` is in a description file: the place of its value, or of the nearest
/// enclosing key the file has (a setting left to its default is not in the file).
fn locate(format: Format, text: &str, field: &str) -> Option<Location> {
    let steps = steps(field)?;
    (1..=steps.len()).rev().find_map(|n| {
        let probe = Probe { rest: &steps[..n] };
        match format {
            Format::Json => {
                let mut de = serde_json::Deserializer::from_str(text);
                let e = serde::de::DeserializeSeed::deserialize(probe, &mut de).err()?;
                (e.line() > 0).then(|| Location { line: e.line(), column: e.column().max(1) })
            }
            Format::Toml => {
                let de = toml::Deserializer::parse(text).ok()?;
                let e = serde::de::DeserializeSeed::deserialize(probe, de).err()?;
                e.span().map(|span| Location::of_offset(text, span.start))
            }
        }
    })
}

/// Walks a parsed file to the value at `rest` and fails there, so that the parser reports
/// the value's place (neither parser gives places otherwise). Finds nothing (`Ok`) when the
/// file has no such value.
struct Probe<'a> {
    rest: &'a [Step<'a>],
}

/// What [`Probe`] fails with where it arrives.
const FOUND: &str = "the value looked for";

impl Probe<'_> {
    fn leaf<E: serde::de::Error>(&self) -> Result<(), E> {
        if self.rest.is_empty() { Err(E::custom(FOUND)) } else { Ok(()) }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Probe<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

macro_rules! probe_leaves {
    ($($visit:ident: $ty:ty),*) => {
        $(fn $visit<E: serde::de::Error>(self, _: $ty) -> Result<(), E> {
            self.leaf()
        })*
    };
}

impl<'de> serde::de::Visitor<'de> for Probe<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(FOUND)
    }

    probe_leaves!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_i128: i128, visit_u128: u128,
        visit_f64: f64, visit_str: &str, visit_bytes: &[u8]);

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.leaf()
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<(), E> {
        self.leaf()
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Some((first, rest)) = self.rest.split_first() else {
            return Err(serde::de::Error::custom(FOUND));
        };
        let mut index = 0;
        loop {
            let found = if *first == Step::Index(index) {
                seq.next_element_seed(Probe { rest })?.is_some()
            } else {
                seq.next_element::<serde::de::IgnoredAny>()?.is_some()
            };
            if !found {
                return Ok(());
            }
            index += 1;
        }
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let Some((first, rest)) = self.rest.split_first() else {
            return Err(serde::de::Error::custom(FOUND));
        };
        while let Some(key) = map.next_key::<String>()? {
            if *first == Step::Key(&key) {
                map.next_value_seed(Probe { rest })?;
            } else {
                map.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// A parsed `--buffers` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferList {
    /// The buffers, in file order.
    pub buffers: Vec<NamedBuffer>,
    /// Offsets from an `offset` column (another allocator's placement of the same buffers),
    /// when the file has one.
    pub offsets: Option<Vec<u64>>,
}

/// How to read a `--buffers` file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CsvOptions {
    /// The `end` column is the last step a buffer is live (`[start, end]`, as traces that
    /// record the last use have it), rather than the first it is not.
    pub inclusive_end: bool,
}

/// A column of a `--buffers` file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Column {
    Buffer,
    Start,
    End,
    Size,
    AliasGroup,
    Offset,
}

impl Column {
    /// The column's name in messages.
    fn name(self) -> &'static str {
        match self {
            Column::Buffer => "buffer",
            Column::Start => "start",
            Column::End => "end",
            Column::Size => "size",
            Column::AliasGroup => "alias_group",
            Column::Offset => "offset",
        }
    }

    /// The column a header name stands for (case-insensitive; MiniMalloc's `id`, `lower`
    /// and `upper` are accepted, `upper` exclusive like `end`).
    fn parse(header: &str) -> Option<Column> {
        Some(match header.to_ascii_lowercase().as_str() {
            "buffer" | "id" | "buffer_id" | "name" => Column::Buffer,
            "start" | "lower" | "begin" => Column::Start,
            "end" | "upper" => Column::End,
            "size" => Column::Size,
            "alias_group" => Column::AliasGroup,
            "offset" => Column::Offset,
            _ => return None,
        })
    }
}

/// Splits one CSV record into `fields` (cleared first; RFC 4180: a field may be quoted, `""`
/// inside quotes is a quote), each trimmed of surrounding blanks. Unquoted fields borrow from
/// `line`, so that a list of a million rows is not a few million small strings. A malformed
/// record gives the position of the field at fault (0-based) and what is wrong.
fn split_record<'a>(line: &'a str, fields: &mut Vec<Cow<'a, str>>) -> Result<(), (usize, String)> {
    const BLANKS: [char; 2] = [' ', '\t'];
    fields.clear();
    let mut rest = line;
    loop {
        rest = rest.trim_start_matches(BLANKS);
        if let Some(quoted) = rest.strip_prefix('"') {
            let mut field = String::new();
            let mut chars = quoted.char_indices();
            rest = loop {
                match chars.next() {
                    Some((k, '"')) if quoted[k + 1..].starts_with('"') => {
                        chars.next();
                        field.push('"');
                    }
                    Some((k, '"')) => break quoted[k + 1..].trim_start_matches(BLANKS),
                    Some((_, c)) => field.push(c),
                    None => return Err((fields.len(), "a quoted field is not closed on its line".into())),
                }
            };
            if !rest.is_empty() && !rest.starts_with(',') {
                return Err((fields.len(), "text after a closing quote; quote the whole field".into()));
            }
            fields.push(Cow::Owned(field));
        } else {
            let end = rest.find(',').unwrap_or(rest.len());
            let field = &rest[..end];
            if field.contains('"') {
                return Err((
                    fields.len(),
                    "a quote inside an unquoted field; quote the field and double the quote".into(),
                ));
            }
            fields.push(Cow::Borrowed(field.trim_end()));
            rest = &rest[end..];
        }
        match rest.strip_prefix(',') {
            Some(after) => rest = after,
            None => return Ok(()),
        }
    }
}

/// Parses a buffer-list CSV (see the module documentation). Errors give the line number
/// and the column at fault.
pub fn parse_buffers_csv(path: &Path, text: &str, opts: CsvOptions) -> Result<BufferList, PlanCliError> {
    let err = |line: usize, field: &str, message: String| PlanCliError::Csv {
        path: path.to_path_buf(),
        line,
        field: field.to_string(),
        message,
    };
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim_end_matches('\r')));
    let (header_line, header) =
        lines.by_ref().find(|(_, l)| !l.trim().is_empty() && !l.trim_start().starts_with('#')).ok_or_else(
            || err(1, "header", "the file is empty; start with the header buffer,start,end,size".into()),
        )?;
    let mut names = Vec::new();
    split_record(header, &mut names).map_err(|(_, m)| err(header_line, "header", m))?;
    let mut columns: Vec<Column> = Vec::with_capacity(names.len());
    for name in &names {
        let column = Column::parse(name).ok_or_else(|| {
            err(
                header_line,
                "header",
                format!(
                    "unknown column {name:?}; the columns are buffer,start,end,size and optionally \
                     alias_group and offset (MiniMalloc's id,lower,upper also read)"
                ),
            )
        })?;
        if columns.contains(&column) {
            return Err(err(header_line, "header", format!("column {:?} appears twice", column.name())));
        }
        columns.push(column);
    }
    for required in [Column::Buffer, Column::Start, Column::End, Column::Size] {
        if !columns.contains(&required) {
            return Err(err(
                header_line,
                "header",
                format!("no {:?} column; the header must name buffer,start,end,size", required.name()),
            ));
        }
    }
    let at = |c: Column| columns.iter().position(|&x| x == c);
    let [buffer_at, start_at, end_at, size_at] =
        [Column::Buffer, Column::Start, Column::End, Column::Size].map(|c| at(c).expect("checked above"));
    let (alias_at, offset_at) = (at(Column::AliasGroup), at(Column::Offset));
    let listed = columns.iter().map(|c| c.name()).collect::<Vec<_>>().join(",");
    // The column at the `k`th field of a line (the last column for fields past it).
    let column_at = |k: usize| columns[k.min(columns.len() - 1)].name();
    // Rows at most: sized once, not grown (and rehashed) a million rows long.
    let rows = text.bytes().filter(|&b| b == b'\n').count() + 1;
    let mut seen: HashMap<Cow<'_, str>, usize> = HashMap::with_capacity(rows);
    let mut buffers = Vec::with_capacity(rows);
    let mut lines_of = Vec::with_capacity(rows);
    let mut offsets = offset_at.map(|_| Vec::new());
    let mut fields = Vec::with_capacity(columns.len());
    for (line, raw) in lines {
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        split_record(raw, &mut fields).map_err(|(k, m)| err(line, column_at(k), m))?;
        if fields.len() != columns.len() {
            return Err(err(
                line,
                column_at(fields.len()),
                format!(
                    "expected {} comma-separated fields ({listed}), found {}",
                    columns.len(),
                    fields.len()
                ),
            ));
        }
        let name = fields[buffer_at].clone();
        if name.is_empty() {
            return Err(err(line, "buffer", "is empty; give every buffer a name".into()));
        }
        if let Some(first) = seen.insert(name.clone(), line) {
            return Err(err(line, "buffer", format!("duplicate name {name:?} (first on line {first})")));
        }
        let int = |k: usize, column: Column, what: &str| {
            fields[k].parse::<u64>().map_err(|e| {
                let message = if *e.kind() == std::num::IntErrorKind::PosOverflow {
                    format!("{:?} is too large: a {what} is at most 2^64 - 1", fields[k])
                } else {
                    format!("expected a non-negative integer {what}, found {:?}", fields[k])
                };
                err(line, column.name(), message)
            })
        };
        let start = int(start_at, Column::Start, "step")?;
        let last = int(end_at, Column::End, "step")?;
        let end = if opts.inclusive_end {
            last.checked_add(1).ok_or_else(|| {
                err(
                    line,
                    "end",
                    format!(
                        "is {last}, the last step there is: with --inclusive-end the step after it must \
                         exist too; number the steps from 0"
                    ),
                )
            })?
        } else {
            last
        };
        if end <= start {
            let hint = if opts.inclusive_end {
                "buffers live over [start, end] with --inclusive-end"
            } else {
                "buffers live over [start, end); if end is the last step a buffer is live, pass \
                 --inclusive-end"
            };
            return Err(err(line, "end", format!("is {last}, not after start {start}; {hint}")));
        }
        let size = parse_size(&fields[size_at]).map_err(|e| err(line, "size", e.to_string()))?;
        if let (Some(k), Some(list)) = (offset_at, offsets.as_mut()) {
            list.push(int(k, Column::Offset, "byte offset")?);
        }
        buffers.push(NamedBuffer {
            name: name.into_owned(),
            start,
            end,
            size,
            // Blanks alone (quoted) name no group, as an empty field does.
            alias_group: alias_at.map(|k| fields[k].trim().to_string()).unwrap_or_default(),
        });
        lines_of.push(line);
    }
    check_total_size(&buffers).map_err(|(k, total)| {
        err(
            lines_of[k],
            "size",
            format!(
                "is {} bytes, the largest of buffers that add up to {total} bytes, more than 2^64 \
                 (an alias group counts once, at its largest member); check the sizes: byte counts, \
                 or sizes with a unit such as 64MiB",
                buffers[k].size
            ),
        )
    })?;
    Ok(BufferList { buffers, offsets })
}

/// Whether the buffers fit a 2^64-byte arena, as the planner counts them: each buffer once,
/// except that an alias group takes one place, as large as its largest member. Err: the
/// position of the largest buffer (the likeliest mistake), and the sum.
fn check_total_size(buffers: &[NamedBuffer]) -> Result<(), (usize, u128)> {
    let mut groups: HashMap<&str, u64> = HashMap::new();
    let mut total = 0u128;
    for b in buffers {
        if b.alias_group.is_empty() {
            total += b.size as u128;
        } else {
            let largest = groups.entry(&b.alias_group).or_insert(0);
            *largest = (*largest).max(b.size);
        }
    }
    total += groups.values().map(|&s| s as u128).sum::<u128>();
    if total <= u64::MAX as u128 {
        return Ok(());
    }
    let largest = (0..buffers.len()).max_by_key(|&k| (buffers[k].size, std::cmp::Reverse(k))).unwrap_or(0);
    Err((largest, total))
}

/// The human-readable report.
pub fn report(plan: &Plan) -> String {
    let mut s = String::new();
    let row = |s: &mut String, k: &str, v: String| s.push_str(&format!("{k:<19} {v}\n"));
    row(&mut s, "footprint", format!("{} ({} bytes)", SizeDisplay(plan.footprint), plan.footprint));
    row(&mut s, "lower bound", format!("{} ({} bytes)", SizeDisplay(plan.lower_bound), plan.lower_bound));
    if plan.live_bound < plan.lower_bound {
        // Alias groups hold one offset for all their members: what that costs.
        row(
            &mut s,
            "live bound",
            format!(
                "{} ({} bytes; most bytes live at once, {:.4} × it: alias groups keep their offsets)",
                SizeDisplay(plan.live_bound),
                plan.live_bound,
                plan.footprint as f64 / plan.live_bound.max(1) as f64
            ),
        );
    }
    row(&mut s, "ratio", format!("{:.4}", plan.ratio()));
    row(&mut s, "strategy", plan.strategy.clone());
    row(&mut s, "planning time", format!("{:.1} ms", plan.elapsed.as_secs_f64() * 1e3));
    for (k, stage) in plan.stages.iter().enumerate() {
        let after = match stage.footprint {
            Some(f) if plan.lower_bound > 0 => {
                format!(" → {:.4} × bound", f as f64 / plan.lower_bound as f64)
            }
            _ => String::new(),
        };
        let label = if k == 0 { "stages" } else { "" };
        row(
            &mut s,
            label,
            format!("{:<13} {:>8.1} ms{after}", stage.name, stage.elapsed.as_secs_f64() * 1e3),
        );
    }
    row(&mut s, "buffers", plan.buffers.len().to_string());
    let total = plan.buffers.iter().fold(0u64, |a, b| a.saturating_add(b.size));
    row(&mut s, "sum of buffers", SizeDisplay(total).to_string());
    row(&mut s, "saved by reuse", SizeDisplay(plan.saved_by_aliasing).to_string());
    if !plan.steps.is_empty() {
        row(&mut s, "slots", plan.slots.to_string());
        row(&mut s, "graphs", plan.graphs.to_string());
        row(&mut s, "microbatches", plan.microbatch_slot.len().to_string());
        let shown: Vec<String> = plan.microbatch_slot.iter().take(32).map(u32::to_string).collect();
        let more = if plan.microbatch_slot.len() > 32 { " ..." } else { "" };
        row(&mut s, "slot of microbatch", format!("{}{more}", shown.join(" ")));
        row(&mut s, "pools", plan.pools.to_string());
        let overhead = if plan.overhead_bytes == 0 {
            "none given (static buffers only)".to_string()
        } else {
            SizeDisplay(plan.overhead_bytes).to_string()
        };
        row(&mut s, "capture overhead", overhead);
        row(&mut s, "capture bytes", SizeDisplay(plan.predicted_capture_bytes).to_string());
    }
    s
}

/// The plan as JSON, with the API's field names.
/// `graphpool plan --json`: the plan's figures, its stages and every buffer with its offset
/// (and the check of a given placement), serialized as it is written.
struct PlanJson<'a> {
    /// The plan.
    plan: &'a Plan,
    /// The check of an `offset` column, when the list had one.
    given_offsets: Option<serde_json::Value>,
}

impl serde::Serialize for PlanJson<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let plan = self.plan;
        let stages: Vec<serde_json::Value> = plan
            .stages
            .iter()
            .map(|st| {
                json!({"name": st.name, "seconds": st.elapsed.as_secs_f64(), "footprint_bytes": st.footprint})
            })
            .collect();
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("footprint_bytes", &plan.footprint)?;
        m.serialize_entry("lower_bound_bytes", &plan.lower_bound)?;
        m.serialize_entry("live_bound_bytes", &plan.live_bound)?;
        m.serialize_entry("ratio", &plan.ratio())?;
        m.serialize_entry("strategy", &plan.strategy)?;
        m.serialize_entry("planning_seconds", &plan.elapsed.as_secs_f64())?;
        m.serialize_entry("stages", &stages)?;
        m.serialize_entry("saved_by_aliasing_bytes", &plan.saved_by_aliasing)?;
        m.serialize_entry("predicted_capture_bytes", &plan.predicted_capture_bytes)?;
        m.serialize_entry("overhead_bytes", &plan.overhead_bytes)?;
        m.serialize_entry("slots", &plan.slots)?;
        m.serialize_entry("graphs", &plan.graphs)?;
        m.serialize_entry("pools", &plan.pools)?;
        m.serialize_entry("microbatch_slot", &plan.microbatch_slot)?;
        m.serialize_entry("steps", &plan.steps)?;
        m.serialize_entry("buffers", &BuffersJson(&plan.buffers))?;
        if let Some(g) = &self.given_offsets {
            m.serialize_entry("given_offsets", g)?;
        }
        m.end()
    }
}

/// A plan's buffers as a JSON array, one object at a time.
struct BuffersJson<'a>(&'a [pipeline::PlannedBuffer]);

impl serde::Serialize for BuffersJson<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|b| {
            json!({
                "name": b.name, "start": b.start, "end": b.end, "size_bytes": b.size,
                "offset": b.offset, "alias_group": b.alias_group,
            })
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csv(text: &str) -> Result<Vec<NamedBuffer>, PlanCliError> {
        parse_buffers_csv(Path::new("t.csv"), text, CsvOptions::default()).map(|l| l.buffers)
    }

    fn line_field(e: PlanCliError) -> (usize, String) {
        match e {
            PlanCliError::Csv { line, field, .. } => (line, field),
            other => panic!("not a CSV error: {other}"),
        }
    }

    #[test]
    fn reads_buffers() {
        let b = csv("buffer,start,end,size\n# comment\na,0,4,1024\n\nb, 2, 6, 1MiB\n").unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(b[1].size, 1 << 20);
        let b = csv("buffer,start,end,size,alias_group\na,0,4,16,g\nb,5,6,16,g\n").unwrap();
        assert_eq!(b[1].alias_group, "g");
        let b = csv("buffer,start,end,size,alias_group\na,0,4,16,\" \"\n").unwrap();
        assert_eq!(b[0].alias_group, "", "a quoted blank is no group");
    }

    #[test]
    fn rejects_malformed_lines_with_line_and_field() {
        let e = csv("buffer,start,end,size\na,18446744073709551616,5,4\n").unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        assert_eq!(line_field(e), (2, "start".into()));
        assert_eq!(line_field(csv("buf,start,end,size\n").unwrap_err()), (1, "header".into()));
        assert_eq!(line_field(csv("buffer,start,end,size\na,0,x,4\n").unwrap_err()), (2, "end".into()));
        assert_eq!(
            line_field(csv("buffer,start,end,size\na,0,4,4\nb,-1,4,4\n").unwrap_err()),
            (3, "start".into())
        );
        assert_eq!(line_field(csv("buffer,start,end,size\na,5,4,4\n").unwrap_err()), (2, "end".into()));
        assert_eq!(line_field(csv("buffer,start,end,size\na,0,4,lots\n").unwrap_err()), (2, "size".into()));
        assert_eq!(line_field(csv("buffer,start,end,size\na,0,4\n").unwrap_err()), (2, "size".into()));
        assert_eq!(
            line_field(csv("buffer,start,end,size\na,0,4,4\na,1,2,3\n").unwrap_err()),
            (3, "buffer".into())
        );
        assert_eq!(line_field(csv("buffer,start,end,size\n,0,4,4\n").unwrap_err()), (2, "buffer".into()));
        assert_eq!(line_field(csv("").unwrap_err()), (1, "header".into()));
        // A quote gone wrong is named by its column, wherever it is.
        assert_eq!(line_field(csv("buffer,start,end,size\na,0,4,\"16\n").unwrap_err()), (2, "size".into()));
        assert_eq!(line_field(csv("buffer,start,end,size\na,0,\"4\"x,16\n").unwrap_err()), (2, "end".into()));
        let e = parse_buffers_csv(
            Path::new("t.csv"),
            "buffer,start,end,size\na,0,18446744073709551615,4\n",
            CsvOptions { inclusive_end: true },
        )
        .unwrap_err();
        assert!(e.to_string().contains("the step after it must exist"), "{e}");
        assert_eq!(line_field(e), (2, "end".into()));
    }

    #[test]
    fn sizes_past_the_arena_name_the_line_of_the_largest() {
        // Two buffers of 10^19 bytes: 2 × 10^19 > 2^64. The planner would only say "the sizes".
        let e =
            csv("buffer,start,end,size\na,0,4,16\nb,0,4,10000000000000000000\nc,0,2,10000000000000000000\n")
                .unwrap_err();
        assert!(e.to_string().starts_with("t.csv:3: field `size`: is 10000000000000000000 bytes"), "{e}");
        assert_eq!(e.line(), Some(3));
        // An alias group takes one place, as large as its largest member: these fit.
        let b = csv(
            "buffer,start,end,size,alias_group\na,0,4,10000000000000000000,g\nb,5,6,10000000000000000000,g\n",
        )
        .unwrap();
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn reads_columns_by_name_in_any_order_and_other_allocators_headers() {
        let b = csv("\u{feff}size,end,start,buffer\r\n64,4,0,a\r\n").unwrap();
        assert_eq!((b[0].name.as_str(), b[0].start, b[0].end, b[0].size), ("a", 0, 4, 64));
        // MiniMalloc's older header: `upper` is exclusive like `end`.
        let b = csv("id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\n").unwrap();
        assert_eq!((b[1].name.as_str(), b[1].start, b[1].end), ("b2", 3, 9));
        let e = csv("buffer,start,end,size,alignment\n").unwrap_err();
        assert_eq!(line_field(e), (1, "header".into()));
        let e = csv("buffer,start,end,size,start\n").unwrap_err();
        assert!(e.to_string().contains("appears twice"), "{e}");
        let e = csv("buffer,start,size\n").unwrap_err();
        assert!(e.to_string().contains("no \"end\" column"), "{e}");
    }

    #[test]
    fn records_split_into_trimmed_fields_borrowed_unless_quoted() {
        let mut f = Vec::new();
        let split = |line: &'static str, f: &mut Vec<Cow<'static, str>>| split_record(line, f);
        split(" a ,\tb\t, \"c, \"\"d\"\"\" ,", &mut f).unwrap();
        assert_eq!(f, ["a", "b", "c, \"d\"", ""]);
        assert!(matches!(f[0], Cow::Borrowed(_)) && matches!(f[2], Cow::Owned(_)));
        split("ünï,\"çödé\",", &mut f).unwrap();
        assert_eq!(f, ["ünï", "çödé", ""], "the vector is cleared first; multibyte text kept");
        split("", &mut f).unwrap();
        assert_eq!(f, [""]);
        assert_eq!(split("a,\"b\" c", &mut f).unwrap_err().0, 1);
        assert_eq!(split("a,b,\"c", &mut f).unwrap_err().0, 2);
        assert_eq!(split("a,b\"c", &mut f).unwrap_err().0, 1);
    }

    #[test]
    fn reads_quoted_fields() {
        let b = csv("buffer,start,end,size\n\"layer.0, \"\"attn\"\"\", 0, 4, \"16\"\n").unwrap();
        assert_eq!(b[0].name, "layer.0, \"attn\"");
        assert_eq!(b[0].size, 16);
        assert_eq!(line_field(csv("buffer,start,end,size\n\"a,0,4,16\n").unwrap_err()), (2, "buffer".into()));
        assert_eq!(
            line_field(csv("buffer,start,end,size\na\"b,0,4,16\n").unwrap_err()),
            (2, "buffer".into())
        );
    }

    #[test]
    fn inclusive_end_reads_the_last_live_step() {
        let text = "buffer,start,end,size\na,0,3,4\nb,3,3,4\n";
        let e = csv(text).unwrap_err();
        assert!(e.to_string().contains("--inclusive-end"), "{e}");
        let list = parse_buffers_csv(Path::new("t.csv"), text, CsvOptions { inclusive_end: true }).unwrap();
        assert_eq!((list.buffers[0].end, list.buffers[1].end), (4, 4));
        // Live together at step 3: they cannot share bytes.
        let plan = pipeline::plan_buffers(&list.buffers, &PlaceOptions::default()).unwrap();
        assert_eq!(plan.lower_bound, 8);
    }

    #[test]
    fn an_offset_column_is_checked_against_the_plan() {
        let text = "buffer,start,end,size,offset\na,0,4,16,0\nb,2,6,16,16\nc,4,8,32,32\n";
        let list = parse_buffers_csv(Path::new("t.csv"), text, CsvOptions::default()).unwrap();
        assert_eq!(list.offsets.as_deref(), Some(&[0, 16, 32][..]));
        let plan = pipeline::plan_buffers(&list.buffers, &PlaceOptions::default()).unwrap();
        let given = GivenPlacement::check(&list.buffers, list.offsets.as_ref().unwrap());
        assert_eq!(given.footprint, Ok(64));
        assert!(given.describe(plan.lower_bound).contains("valid"));
        assert_eq!(given.json(plan.lower_bound)["footprint_bytes"], 64);
        // b and c overlap in memory while both live.
        let given = GivenPlacement::check(&list.buffers, &[0, 16, 20]);
        assert!(
            matches!(&given.footprint, Err(pipeline::PlacementError::Overlap { a, b }) if a == "b" && b == "c")
        );
        assert_eq!(given.json(plan.lower_bound)["valid"], false);
        let e = parse_buffers_csv(
            Path::new("t.csv"),
            "buffer,start,end,size,offset\na,0,4,16,x\n",
            CsvOptions::default(),
        )
        .unwrap_err();
        assert_eq!(line_field(e), (2, "offset".into()));
    }

    #[test]
    fn reads_schedules_in_toml_and_json() {
        let toml_text = r#"
            [schedule.one_f_one_b]
            pp_size = 4
            pp_rank = 0
            num_microbatches = 8

            [[layers]]
            layer = 0
            saved_bytes = 1000
            inputs = [{ shape = [16, 8], dtype = "bf16", kept_for_backward = true }]
            outputs = [{ shape = [16, 8], dtype = "bf16" }]
        "#;
        let s = parse_schedule(Path::new("s.toml"), toml_text).unwrap();
        assert_eq!(s.overhead, None);
        let json_text = serde_json::to_string(&json!({
            "schedule": s.input.schedule, "layers": s.input.layers,
            "overhead": {"fixed_bytes": 1000, "per_pool_bytes": 10},
        }))
        .unwrap();
        let j = parse_schedule(Path::new("s.json"), &json_text).unwrap();
        assert_eq!(s.input, j.input);
        let overhead = j.overhead.unwrap();
        assert_eq!((overhead.fixed_bytes, overhead.per_pool_bytes, overhead.per_graph_bytes), (1000, 10, 0));
        let plan = pipeline::plan_schedule(&s.input, &PlaceOptions::default()).unwrap();
        assert_eq!(plan.slots, 4);
        assert!(report(&plan).lines().any(|l| l.split_whitespace().eq(["slots", "4"])));
        // 4 forward pools + 1 backward pool
        let with = plan.clone().with_overhead(&overhead);
        assert_eq!(with.predicted_capture_bytes, plan.footprint + 1000 + 5 * 10);
        assert!(report(&with).lines().any(|l| l.starts_with("capture overhead")));
        let e =
            parse_schedule(Path::new("s.json"), r#"{"schedule": {}, "layers": [], "extra": 1}"#).unwrap_err();
        assert!(e.to_string().contains("s.json"), "{e}");
        let e = parse_schedule(Path::new("s.toml"), "[schedule.one_f_one_b]\npp_size = \"x\"\n").unwrap_err();
        assert!(e.to_string().contains("s.toml"), "{e}");
    }

    fn schedule_error(path: &str, text: &str) -> PlanCliError {
        parse_schedule(Path::new(path), text).unwrap_err()
    }

    /// (line, field) of an error, checking that the message shows both.
    fn place_and_field(e: &PlanCliError) -> (usize, String) {
        let (line, field) = (e.line().expect("a line"), e.field().expect("a field"));
        let text = e.to_string();
        assert!(text.contains(&format!(":{line}:")) && text.contains(&format!("field `{field}`")), "{text}");
        (line, field)
    }

    const JSON: &str = r#"{
  "schedule": {"one_f_one_b": {"pp_size": 4, "pp_rank": 0, "num_microbatches": 8}},
  "layers": [
    {"layer": 0, "outputs": [{"shape": [8, 16], "dtype": "bf16"}]},
    {"layer": 1,
     "outputs": [{"shape": [16, 8], "dtype": "bf16"}]}
  ]
}"#;

    const TOML: &str = r#"
[schedule.one_f_one_b]
pp_size = 4
pp_rank = 0
num_microbatches = 8

[[layers]]
layer = 0
outputs = [{ shape = [8, 16], dtype = "bf16" }]

[[layers]]
layer = 1
outputs = [{ shape = [16, 8], dtype = "bf16" }]
"#;

    #[test]
    fn json_type_errors_name_the_field_line_and_column() {
        parse_schedule(Path::new("s.json"), JSON).unwrap();
        let cases = [
            (r#""pp_size": 4"#, r#""pp_size": "four""#, 2, "schedule.one_f_one_b.pp_size"),
            (
                r#""num_microbatches": 8"#,
                r#""num_microbatches": -8"#,
                2,
                "schedule.one_f_one_b.num_microbatches",
            ),
            (r#""pp_rank": 0, "#, "", 2, "schedule.one_f_one_b.pp_rank"),
            (
                r#"[{"shape": [16, 8], "dtype": "bf16"}]}"#,
                r#"[{"shape": "16x8", "dtype": "bf16"}]}"#,
                6,
                "layers[1].outputs[0].shape",
            ),
            (
                r#"[{"shape": [16, 8], "dtype": "bf16"}]}"#,
                r#"[{"shape": [16, 8]}]}"#,
                6,
                "layers[1].outputs[0].dtype",
            ),
            (r#"{"layer": 1,"#, r#"{"layer": 1, "depth": 2,"#, 5, "layers[1].depth"),
            (r#""layers""#, r#""layer""#, 3, "layer"),
        ];
        for (from, to, line, field) in cases {
            let text = JSON.replace(from, to);
            assert_ne!(text, JSON, "{from}");
            let e = schedule_error("s.json", &text);
            assert_eq!(place_and_field(&e), (line, field.to_string()), "{e}");
            assert!(
                matches!(e, PlanCliError::Schedule { at: Some(Location { column, .. }), .. } if column > 1)
            );
        }
        let e = schedule_error("s.json", r#"{"schedule": {"one_f_one_b": {"pp_size": -4}}}"#);
        assert!(e.to_string().starts_with("s.json:1:"), "{e}");
        assert!(e.to_string().contains("invalid value: integer `-4`, expected u32"), "{e}");
        assert!(!e.to_string().contains(" at line "), "the place is said once: {e}");
        // Syntax errors have a place and no field.
        let e = schedule_error("s.json", &JSON.replace(r#""layer": 1,"#, r#""layer": 1,,"#));
        assert_eq!((e.line(), e.field()), (Some(5), None), "{e}");
        let e = schedule_error("s.json", &format!("{JSON}\nx"));
        assert_eq!((e.line(), e.field()), (Some(9), None), "{e}");
    }

    #[test]
    fn toml_type_errors_name_the_field_and_line() {
        parse_schedule(Path::new("s.toml"), TOML).unwrap();
        let cases = [
            ("pp_size = 4", "pp_size = \"four\"", 3, "schedule.one_f_one_b.pp_size"),
            ("num_microbatches = 8", "num_microbatches = -8", 5, "schedule.one_f_one_b.num_microbatches"),
            ("pp_rank = 0\n", "", 2, "schedule.one_f_one_b.pp_rank"),
            (
                "layer = 1\noutputs = [{ shape = [16, 8]",
                "layer = 1\noutputs = [{ shape = \"16x8\"",
                13,
                "layers[1].outputs[0].shape",
            ),
            (
                "layer = 1\noutputs = [{ shape = [16, 8], dtype = \"bf16\" }]",
                "layer = 1\noutputs = [{ shape = [16, 8] }]",
                13,
                "layers[1].outputs[0].dtype",
            ),
            ("layer = 1\n", "layer = 1\ndepth = 2\n", 13, "layers[1].depth"),
        ];
        for (from, to, line, field) in cases {
            let text = TOML.replace(from, to);
            assert_ne!(text, TOML, "{from}");
            let e = schedule_error("s.toml", &text);
            assert_eq!(place_and_field(&e), (line, field.to_string()), "{e}");
        }
        let e = schedule_error("s.toml", &TOML.replace("layer = 1", "layer = = 1"));
        assert_eq!((e.line(), e.field()), (Some(12), None), "{e}");
        // Without an extension the text decides, and the message says which was read.
        let e = schedule_error("s.txt", &TOML.replace("pp_size = 4", "pp_size = \"four\""));
        assert_eq!(place_and_field(&e), (3, "schedule.one_f_one_b.pp_size".to_string()));
        assert!(e.to_string().contains("read as TOML"), "{e}");
        let e = schedule_error("s", &JSON.replace(r#""pp_size": 4"#, r#""pp_size": "four""#));
        assert!(e.to_string().contains("read as JSON"), "{e}");
    }

    /// The planner's refusal of a parsed file, as `run` reports it.
    fn planner_error(path: &str, text: &str) -> PlanCliError {
        let desc = parse_schedule(Path::new(path), text).unwrap();
        let e = pipeline::schedule_buffers_within(&desc.input, GuardsConfig::default().max_plan_buffers)
            .unwrap_err();
        schedule_plan_error(Path::new(path), text, &desc.input.schedule, e)
    }

    #[test]
    fn planner_errors_name_the_field_and_its_place_in_the_file() {
        for (path, text, shape_line) in [("s.json", JSON, 6), ("s.toml", TOML, 13)] {
            let rank = text.replace("\"pp_rank\": 0", "\"pp_rank\": 4").replace("pp_rank = 0", "pp_rank = 4");
            let e = planner_error(path, &rank);
            let line = if path.ends_with("json") { 2 } else { 4 };
            assert_eq!(place_and_field(&e), (line, "schedule.one_f_one_b.pp_rank".to_string()));
            // The last tensor is layer 1's output.
            let dtype = {
                let (head, tail) = text.rsplit_once("\"bf16\"").unwrap();
                format!("{head}\"bf17\"{tail}")
            };
            let e = planner_error(path, &dtype);
            assert_eq!(place_and_field(&e), (shape_line, "layers[1].outputs[0].dtype".to_string()));
            assert!(e.to_string().contains("unknown dtype \"bf17\"; use one of"), "{e}");
            // 2^62 bytes in each of 4 slots, twice (the output and its gradient): past 2^64.
            let huge = {
                let (head, tail) = text.rsplit_once("[16, 8]").unwrap();
                format!("{head}[4611686018427387904]{tail}")
            };
            let e = planner_error(path, &huge);
            assert_eq!(place_and_field(&e), (shape_line, "layers[1].outputs[0].shape".to_string()));
            assert!(e.to_string().contains("more than 2^64 bytes; check the dimensions"), "{e}");
            // A setting the file leaves out is placed at the table that would hold it.
            let chunkless =
                text.replace("\"pp_size\": 4", "\"pp_size\": 1").replace("pp_size = 4", "pp_size = 1");
            let chunkless = chunkless
                .replace("one_f_one_b", "interleaved")
                .replace("\"num_microbatches\": 8", "\"num_microbatches\": 8, \"virtual_chunks\": 2");
            let chunkless =
                chunkless.replace("num_microbatches = 8", "num_microbatches = 8\nvirtual_chunks = 2");
            let e = planner_error(path, &chunkless);
            assert_eq!(e.field().as_deref(), Some("layers"), "{e}");
            assert!(e.line().is_some(), "{e}");
        }
    }

    #[test]
    fn field_paths_are_read_back_into_steps() {
        assert_eq!(
            steps("layers[2].outputs[0].shape").unwrap(),
            [Step::Key("layers"), Step::Index(2), Step::Key("outputs"), Step::Index(0), Step::Key("shape")]
        );
        assert_eq!(steps("schedule.explicit.order[12]").unwrap().last(), Some(&Step::Index(12)));
        assert_eq!(steps("order[x]"), None);
        // Left to its default, `chunk` is not in the file: its layer is.
        assert_eq!(locate(Format::Toml, TOML, "layers[1].chunk").map(|l| l.line), Some(11));
        assert_eq!(locate(Format::Json, JSON, "layers[1].chunk").map(|l| l.line), Some(5));
        assert_eq!(locate(Format::Json, JSON, "nothing"), None);
    }

    /// The seed benchmark's description of 1F1B stage 0 at M = 128 (the profile of one eager
    /// step, and the capture overhead measured on the same stage at M = 8), recorded on an
    /// H200: the prediction must stay within 5 % of the footprint measured there (9.646 GiB,
    /// docs/capture.md).
    #[test]
    fn recorded_seed_description_predicts_the_measured_footprint() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/gpu/seed/plan-1f1b-s0-m128.json");
        let desc = parse_schedule(&path, &std::fs::read_to_string(&path).unwrap()).unwrap();
        let overhead = desc.overhead.expect("the recorded description has an overhead");
        let plan =
            pipeline::plan_schedule(&desc.input, &PlaceOptions::default()).unwrap().with_overhead(&overhead);
        assert_eq!((plan.slots, plan.graphs, plan.pools), (8, 144, 9));
        let measured = 9.646484375 * (1u64 << 30) as f64;
        let error = plan.predicted_capture_bytes as f64 / measured - 1.0;
        assert!(
            error.abs() <= 0.05,
            "predicted {} bytes, {:+.1}% of the measured footprint",
            plan.predicted_capture_bytes,
            100.0 * error
        );
    }

    #[test]
    fn example_schedule_plans() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/planner/examples/schedule-1f1b.toml");
        let text = std::fs::read_to_string(&path).unwrap();
        let desc = parse_schedule(&path, &text).unwrap();
        let plan = pipeline::plan_schedule(&desc.input, &PlaceOptions::default()).unwrap();
        assert_eq!(plan.slots, 8);
        assert!(plan.ratio() <= 1.001, "ratio {}", plan.ratio());
    }
}
