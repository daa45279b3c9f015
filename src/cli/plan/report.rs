//! What `graphpool plan` prints: the report, or the plan as JSON.

use graphpool_planner::pipeline::{self, Plan};
use serde_json::json;

use crate::units::SizeDisplay;

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
    let threads =
        if plan.threads == 1 { "1 thread".to_string() } else { format!("{} threads", plan.threads) };
    row(&mut s, "planning time", format!("{:.1} ms on {threads}", plan.elapsed.as_secs_f64() * 1e3));
    // Stage names in one column, as wide as the longest (`canonical+improvement`).
    let width = plan.stages.iter().map(|stage| stage.name.chars().count()).max().unwrap_or(0).max(13);
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
            format!("{:<width$} {:>8.1} ms{after}", stage.name, stage.elapsed.as_secs_f64() * 1e3),
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
pub(super) struct PlanJson<'a> {
    /// The plan.
    pub(super) plan: &'a Plan,
    /// The check of an `offset` column, when the list had one.
    pub(super) given_offsets: Option<serde_json::Value>,
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
        m.serialize_entry("threads", &plan.threads)?;
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

/// One buffer of [`BuffersJson`], its keys in alphabetical order (as a JSON object built
/// key by key prints them), written without building an object first: at 100k buffers that
/// object took ~60 ms of the command.
#[derive(serde::Serialize)]
struct BufferJson<'a> {
    alias_group: &'a str,
    end: u64,
    name: &'a str,
    offset: u64,
    size_bytes: u64,
    start: u64,
}

impl serde::Serialize for BuffersJson<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|b| BufferJson {
            alias_group: &b.alias_group,
            end: b.end,
            name: &b.name,
            offset: b.offset,
            size_bytes: b.size,
            start: b.start,
        }))
    }
}
