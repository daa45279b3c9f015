//! `--schedule` files: TOML or JSON schedule descriptions, and errors that name the field and
//! its place in the file.

use std::path::Path;

use graphpool_planner::Schedule;
use graphpool_planner::pipeline::{self, CaptureOverhead, PlanError, SchedulePlanInput};

use super::{Location, PlanCliError};

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
pub(super) fn schedule_plan_error(
    path: &Path,
    text: &str,
    schedule: &Schedule,
    source: PlanError,
) -> PlanCliError {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::plan::report;
    use crate::config::GuardsConfig;
    use graphpool_planner::PlaceOptions;
    use serde_json::json;

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
            // 2^63 bytes in each of 4 slots, twice (the output and its gradient): past 2^62.
            let huge = {
                let (head, tail) = text.rsplit_once("[16, 8]").unwrap();
                format!("{head}[4611686018427387904]{tail}")
            };
            let e = planner_error(path, &huge);
            assert_eq!(place_and_field(&e), (shape_line, "layers[1].outputs[0].shape".to_string()));
            assert!(
                e.to_string()
                    .contains("more than 2^62 bytes, the most the planner places; check the dimensions"),
                "{e}"
            );
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
