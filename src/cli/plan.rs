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

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use graphpool_planner::PlaceOptions;
use graphpool_planner::pipeline::{self, CaptureOverhead, NamedBuffer, Plan, PlanError, SchedulePlanInput};
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
    /// A pipeline schedule with per-layer tensor specs, as TOML or JSON (by extension).
    #[arg(long, value_name = "FILE")]
    pub schedule: Option<PathBuf>,
    /// Print the plan as JSON, with every buffer's offset.
    #[arg(long)]
    pub json: bool,
    /// Time to spend planning, in milliseconds; plans at the lower bound stop sooner.
    /// Without it: 1000, capped for buffer lists at 8 µs per buffer (at least 60 ms). Reading
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
    #[error("{}: {message}", path.display())]
    Schedule {
        /// The file.
        path: PathBuf,
        /// The parser's message (with line and column).
        message: String,
    },
    /// The planner refused the input; `field` names the setting at fault.
    #[error("{}: {source}", path.display())]
    Plan {
        /// The input file.
        path: PathBuf,
        /// The planner's error (see [`PlanError::field`]).
        source: PlanError,
    },
}

impl PlanCliError {
    /// The field at fault (a CSV column, or a path into the schedule such as
    /// `layers[2].inputs[0].dtype`), when there is one.
    pub fn field(&self) -> Option<String> {
        match self {
            PlanCliError::Csv { field, .. } => Some(field.clone()),
            PlanCliError::Plan { source, .. } => Some(source.field()),
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
            let plan = pipeline::plan_buffers(&list.buffers, &opts)
                .map_err(|source| PlanCliError::Plan { path: path.clone(), source })?;
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
                .map_err(|source| PlanCliError::Plan { path: path.clone(), source })?
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

fn read(path: &Path) -> Result<String, PlanCliError> {
    std::fs::read_to_string(path).map_err(|source| PlanCliError::Read { path: path.to_path_buf(), source })
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

/// Parses a schedule description: TOML for `.toml`, JSON for `.json`, else whichever parses.
pub fn parse_schedule(path: &Path, text: &str) -> Result<ScheduleDescription, PlanCliError> {
    let err = |message: String| PlanCliError::Schedule { path: path.to_path_buf(), message };
    let file: DescriptionFile = match path.extension().and_then(|e| e.to_str()) {
        Some("json") => serde_json::from_str(text).map_err(|e| err(e.to_string()))?,
        Some("toml") => toml::from_str(text).map_err(|e| err(e.to_string()))?,
        _ => serde_json::from_str(text).or_else(|json_err| {
            toml::from_str(text).map_err(|toml_err| {
                err(format!("neither JSON ({json_err}) nor TOML ({toml_err}); name the file .json or .toml"))
            })
        })?,
    };
    Ok(file.into())
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

/// Splits one CSV record into fields (RFC 4180: a field may be quoted, `""` inside quotes
/// is a quote), each trimmed of surrounding blanks.
fn split_record(line: &str) -> Result<Vec<String>, String> {
    let mut fields = Vec::new();
    let mut chars = line.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ' ' || *c == '\t') {
            chars.next();
        }
        let mut field = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next() {
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        field.push('"');
                    }
                    Some('"') => break,
                    Some(c) => field.push(c),
                    None => return Err("a quoted field is not closed on its line".into()),
                }
            }
            while chars.peek().is_some_and(|c| *c == ' ' || *c == '\t') {
                chars.next();
            }
            if chars.peek().is_some_and(|c| *c != ',') {
                return Err("text after a closing quote; quote the whole field".into());
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == ',' {
                    break;
                }
                if c == '"' {
                    return Err(
                        "a quote inside an unquoted field; quote the field and double the quote".into()
                    );
                }
                field.push(c);
                chars.next();
            }
            field.truncate(field.trim_end().len());
        }
        fields.push(field);
        if chars.next().is_none() {
            return Ok(fields);
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
            || err(1, "buffer", "the file is empty; start with the header buffer,start,end,size".into()),
        )?;
    let names = split_record(header).map_err(|m| err(header_line, "header", m))?;
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
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut buffers = Vec::new();
    let mut offsets = offset_at.map(|_| Vec::new());
    for (line, raw) in lines {
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let fields = split_record(raw).map_err(|m| err(line, "buffer", m))?;
        if fields.len() != columns.len() {
            let field = columns.get(fields.len().min(columns.len() - 1)).map_or("size", |c| c.name());
            return Err(err(
                line,
                field,
                format!(
                    "expected {} comma-separated fields ({listed}), found {}",
                    columns.len(),
                    fields.len()
                ),
            ));
        }
        let name = fields[buffer_at].as_str();
        if name.is_empty() {
            return Err(err(line, "buffer", "is empty; give every buffer a name".into()));
        }
        if let Some(first) = seen.insert(name.to_string(), line) {
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
            last.checked_add(1).ok_or_else(|| err(line, "end", format!("{last} is too large")))?
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
            name: name.to_string(),
            start,
            end,
            size,
            // Blanks alone (quoted) name no group, as an empty field does.
            alias_group: alias_at.map(|k| fields[k].trim().to_string()).unwrap_or_default(),
        });
    }
    Ok(BufferList { buffers, offsets })
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
