//! Plans for CUDA graph buffers: the bridge between the API's `PlanInput`/`Plan` messages
//! and the `graphpool-planner` crate.
//!
//! [`plan`] validates a [`PlanInput`](pb::PlanInput) (errors name the offending field as a path into the
//! message, e.g. `schedule.layers[2].inputs[0].dtype`), converts it, runs the planner and
//! converts the result back. Planning is CPU-bound and uses all cores for up to the time
//! budget: call it from a blocking context (`tokio::task::spawn_blocking`), not on an async
//! worker thread.

use std::time::Duration;

use graphpool_planner::pipeline::{self, CaptureOverhead, NamedBuffer, PlanError, SchedulePlanInput};
use graphpool_planner::{PlaceOptions, Schedule};
use graphpool_proto::v1 as pb;

/// The most time a caller may ask for with `PlanInput.time_budget_ms`.
pub const MAX_TIME_BUDGET: Duration = Duration::from_secs(10);

/// Why a `PlanInput` could not be planned. [`PlanningError::field`] names the field at
/// fault; the daemon answers `INVALID_ARGUMENT` with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanningError {
    /// A required field or oneof is not set.
    #[error("{field} is not set: {hint}")]
    Missing {
        /// Path of the field.
        field: String,
        /// What to set.
        hint: &'static str,
    },
    /// A field has a value the planner cannot use.
    #[error("{field}: {message}")]
    Invalid {
        /// Path of the field.
        field: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// The plan would have more buffers than this planner accepts.
    #[error(
        "{field}: the plan has {count} buffers, more than the limit of {max}; plan fewer \
         microbatches or layers per request, or raise the planner's buffer limit"
    )]
    TooManyBuffers {
        /// Path of the field that makes the buffers (`buffers.buffers` or `schedule`).
        field: String,
        /// Buffers the input makes.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// The planner refused the input.
    #[error("{field}: {}", source.message())]
    Planner {
        /// Path of the field.
        field: String,
        /// The planner's error.
        source: PlanError,
    },
}

impl PlanningError {
    /// The field at fault, as a path into `PlanInput` (e.g. `schedule.schedule.one_f_one_b.pp_rank`,
    /// `buffers.buffers[7].end`).
    pub fn field(&self) -> Option<&str> {
        match self {
            PlanningError::Missing { field, .. }
            | PlanningError::Invalid { field, .. }
            | PlanningError::TooManyBuffers { field, .. }
            | PlanningError::Planner { field, .. } => Some(field),
        }
    }
}

fn missing(field: &str, hint: &'static str) -> PlanningError {
    PlanningError::Missing { field: field.to_string(), hint }
}

/// Plans `input`: validates it, places its buffers within the time budget
/// (`input.time_budget_ms`, at most [`MAX_TIME_BUDGET`], used whole; or when 0
/// `default_time_budget`, which buffer lists use in proportion to their size) on `threads`
/// threads (0: every core) and returns the plan. Inputs that make more than `max_buffers`
/// buffers are refused.
pub fn plan(
    input: &pb::PlanInput,
    default_time_budget: Duration,
    max_buffers: usize,
    threads: usize,
) -> Result<pb::Plan, PlanningError> {
    let mut opts = match input.time_budget_ms {
        0 => PlaceOptions::with_budget(default_time_budget, false),
        ms => PlaceOptions::with_budget(Duration::from_millis(ms as u64).min(MAX_TIME_BUDGET), true),
    };
    opts.threads = threads;
    let plan = match &input.input {
        None => return Err(missing("input", "send either `schedule` or `buffers`")),
        Some(pb::plan_input::Input::Buffers(list)) => {
            if list.buffers.len() > max_buffers {
                return Err(PlanningError::TooManyBuffers {
                    field: "buffers.buffers".to_string(),
                    count: list.buffers.len(),
                    max: max_buffers,
                });
            }
            let buffers = buffers_from_proto(list)?;
            pipeline::plan_buffers(&buffers, &opts).map_err(|e| planner_error("buffers.", "", e))?
        }
        Some(pb::plan_input::Input::Schedule(s)) => {
            let (sched, kind) = schedule_from_proto(s)?;
            // Counted before any buffer is built: a small request can describe billions.
            let sb = pipeline::schedule_buffers_within(&sched, max_buffers).map_err(|e| match e {
                PlanError::TooManyBuffers { count, max } => PlanningError::TooManyBuffers {
                    field: "schedule".to_string(),
                    count: usize::try_from(count).unwrap_or(usize::MAX),
                    max,
                },
                e => planner_error("schedule.", kind, e),
            })?;
            let overhead = s.overhead.as_ref().map(overhead_from_proto).unwrap_or_default();
            pipeline::plan_schedule_buffers(sb, &opts)
                .map_err(|e| planner_error("schedule.", kind, e))?
                .with_overhead(&overhead)
        }
    };
    Ok(plan_to_proto(&plan))
}

/// Maps a planner error to a `PlanInput` field path. `kind` is the set `Schedule.kind`
/// (`one_f_one_b`, ...), used for schedule settings.
fn planner_error(prefix: &str, kind: &str, e: PlanError) -> PlanningError {
    let inner = e.field();
    let field = if let Some(rest) = inner.strip_prefix("schedule.") {
        format!("{prefix}schedule.{kind}.{rest}")
    } else {
        // `buffers[i]` of a list is `buffers.buffers[i]`; layer paths are under `schedule.`.
        format!("{prefix}{inner}")
    };
    PlanningError::Planner { field, source: e }
}

/// Converts a proto buffer list, checking every buffer.
pub fn buffers_from_proto(list: &pb::BufferList) -> Result<Vec<NamedBuffer>, PlanningError> {
    list.buffers
        .iter()
        .enumerate()
        .map(|(i, b)| {
            if b.end <= b.start {
                return Err(PlanningError::Invalid {
                    field: format!("buffers.buffers[{i}].end"),
                    message: format!(
                        "is {} but start is {}; a buffer lives over [start, end), so end must be greater",
                        b.end, b.start
                    ),
                });
            }
            Ok(NamedBuffer {
                name: if b.name.is_empty() { format!("b{i}") } else { b.name.clone() },
                start: b.start,
                end: b.end,
                size: b.size_bytes,
                alias_group: b.alias_group.clone(),
            })
        })
        .collect()
}

/// Converts a proto schedule input. Returns it with the name of the schedule kind set.
pub fn schedule_from_proto(
    s: &pb::SchedulePlanInput,
) -> Result<(SchedulePlanInput, &'static str), PlanningError> {
    let kind = s
        .schedule
        .as_ref()
        .ok_or_else(|| missing("schedule.schedule", "set one_f_one_b, interleaved or explicit_order"))?
        .kind
        .as_ref()
        .ok_or_else(|| missing("schedule.schedule.kind", "set one_f_one_b, interleaved or explicit_order"))?;
    let (schedule, name) = match kind {
        pb::schedule::Kind::OneFOneB(k) => (
            Schedule::OneFOneB {
                pp_size: k.pp_size,
                pp_rank: k.pp_rank,
                num_microbatches: k.num_microbatches,
            },
            "one_f_one_b",
        ),
        pb::schedule::Kind::Interleaved(k) => (
            Schedule::Interleaved {
                pp_size: k.pp_size,
                pp_rank: k.pp_rank,
                num_microbatches: k.num_microbatches,
                virtual_chunks: k.virtual_chunks,
            },
            "interleaved",
        ),
        pb::schedule::Kind::ExplicitOrder(k) => (
            Schedule::Explicit {
                order: k.order.clone(),
                num_microbatches: k.num_microbatches,
                virtual_chunks: k.virtual_chunks,
            },
            "explicit_order",
        ),
    };
    let tensor = |t: &pb::TensorSpec| pipeline::TensorSpec {
        name: t.name.clone(),
        shape: t.shape.clone(),
        dtype: t.dtype.clone(),
        kept_for_backward: t.kept_for_backward,
    };
    let layers = s
        .layers
        .iter()
        .map(|l| pipeline::LayerSpec {
            chunk: l.chunk,
            layer: l.layer,
            inputs: l.inputs.iter().map(tensor).collect(),
            outputs: l.outputs.iter().map(tensor).collect(),
            saved_bytes: l.saved_bytes,
            forward_workspace_bytes: l.forward_workspace_bytes,
            backward_workspace_bytes: l.backward_workspace_bytes,
        })
        .collect();
    Ok((SchedulePlanInput { schedule, layers }, name))
}

/// Converts the API's `CaptureOverhead` (every value is valid: bytes, added saturating).
pub fn overhead_from_proto(o: &pb::CaptureOverhead) -> CaptureOverhead {
    CaptureOverhead {
        fixed_bytes: o.fixed_bytes,
        per_graph_bytes: o.per_graph_bytes,
        per_pool_bytes: o.per_pool_bytes,
        backward_pool_extra_bytes: o.backward_pool_extra_bytes,
    }
}

/// Converts a planner [`pipeline::Plan`] to the API's `Plan`.
pub fn plan_to_proto(p: &pipeline::Plan) -> pb::Plan {
    pb::Plan {
        slots: p.slots,
        microbatch_slot: p.microbatch_slot.clone(),
        buffers: p
            .buffers
            .iter()
            .map(|b| pb::PlannedBuffer {
                name: b.name.clone(),
                start: b.start,
                end: b.end,
                size_bytes: b.size,
                offset: b.offset,
                alias_group: b.alias_group.clone(),
            })
            .collect(),
        footprint_bytes: p.footprint,
        lower_bound_bytes: p.lower_bound,
        live_bound_bytes: p.live_bound,
        saved_by_aliasing_bytes: p.saved_by_aliasing,
        planning_seconds: p.elapsed.as_secs_f64(),
        strategy: p.strategy.clone(),
        steps: p.steps.clone(),
        predicted_capture_bytes: p.predicted_capture_bytes,
        graphs: p.graphs,
        pools: p.pools,
        overhead_bytes: p.overhead_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_f_one_b(pp_size: u32, pp_rank: u32, m: u32) -> pb::PlanInput {
        let hidden = pb::TensorSpec {
            name: "hidden".into(),
            shape: vec![4096, 1, 1024],
            dtype: "bf16".into(),
            kept_for_backward: true,
        };
        let layers = (0..3)
            .map(|l| pb::LayerSpec {
                chunk: 0,
                layer: l,
                inputs: vec![hidden.clone()],
                outputs: vec![pb::TensorSpec { kept_for_backward: false, ..hidden.clone() }],
                saved_bytes: 80 << 20,
                forward_workspace_bytes: 32 << 20,
                backward_workspace_bytes: 32 << 20,
            })
            .collect();
        pb::PlanInput {
            input: Some(pb::plan_input::Input::Schedule(pb::SchedulePlanInput {
                schedule: Some(pb::Schedule {
                    kind: Some(pb::schedule::Kind::OneFOneB(pb::OneFOneB {
                        pp_size,
                        pp_rank,
                        num_microbatches: m,
                    })),
                }),
                layers,
                overhead: None,
            })),
            time_budget_ms: 0,
        }
    }

    /// A budget the caller gives is used whole on a list that does not reach its bound; the
    /// default one is capped by the list's size (8 µs per buffer + 5 ms, at least 60 ms).
    #[test]
    fn a_budget_given_is_used_whole_and_the_default_is_capped() {
        let list = graphpool_planner::workload::random_uniform_sizes(3000, 2);
        let buffers = pb::BufferList {
            buffers: list
                .iter()
                .enumerate()
                .map(|(k, b)| pb::BufferSpec {
                    name: format!("b{k}"),
                    start: b.start,
                    end: b.end,
                    size_bytes: b.size,
                    alias_group: String::new(),
                })
                .collect(),
        };
        let input = |ms| pb::PlanInput {
            input: Some(pb::plan_input::Input::Buffers(buffers.clone())),
            time_budget_ms: ms,
        };
        let given = plan(&input(400), Duration::from_secs(1), 10_000, 0).unwrap();
        if given.footprint_bytes > given.lower_bound_bytes {
            assert!(given.planning_seconds >= 0.35, "{} s", given.planning_seconds);
        }
        let default = plan(&input(0), Duration::from_secs(1), 10_000, 0).unwrap();
        assert!(default.planning_seconds < 0.3, "{} s", default.planning_seconds);
    }

    #[test]
    fn plans_a_schedule() {
        let p = plan(&one_f_one_b(8, 0, 16), Duration::from_millis(200), 100_000, 0).unwrap();
        assert_eq!(p.slots, 8);
        assert_eq!(p.microbatch_slot.len(), 16);
        assert_eq!(p.graphs, 8 * 3 * 2);
        assert!(p.footprint_bytes >= p.lower_bound_bytes);
        assert_eq!(p.steps.len(), 32);
        assert!(p.buffers.iter().all(|b| b.offset + b.size_bytes <= p.footprint_bytes));
    }

    #[test]
    fn names_the_field() {
        let e = plan(&pb::PlanInput::default(), Duration::from_millis(10), 10, 0).unwrap_err();
        assert_eq!(e.field(), Some("input"));
        let e = plan(&one_f_one_b(4, 4, 8), Duration::from_millis(10), 1000, 0).unwrap_err();
        assert_eq!(e.field(), Some("schedule.schedule.one_f_one_b.pp_rank"), "{e}");
        let mut bad = one_f_one_b(4, 0, 8);
        if let Some(pb::plan_input::Input::Schedule(s)) = &mut bad.input {
            s.layers[1].inputs[0].dtype = "bfloat17".into();
        }
        let e = plan(&bad, Duration::from_millis(10), 1000, 0).unwrap_err();
        assert_eq!(e.field(), Some("schedule.layers[1].inputs[0].dtype"), "{e}");
        assert_eq!(e.to_string().matches("inputs[0]").count(), 1, "the field is named once: {e}");
        let e = plan(&one_f_one_b(4, 0, 8), Duration::from_millis(10), 5, 0).unwrap_err();
        assert!(matches!(e, PlanningError::TooManyBuffers { .. }));
    }

    /// A schedule is refused on its buffer count before any buffer is built: two million
    /// microbatches (a few hundred bytes of request) would make 34 million.
    #[test]
    fn refuses_a_schedule_by_its_count_before_building_it() {
        let made = plan(&one_f_one_b(4, 0, 8), Duration::from_millis(10), 1000, 0).unwrap().buffers.len();
        let e = plan(&one_f_one_b(4, 0, 8), Duration::from_millis(10), made - 1, 0).unwrap_err();
        assert_eq!(e, PlanningError::TooManyBuffers { field: "schedule".into(), count: made, max: made - 1 });
        let t = std::time::Instant::now();
        let e = plan(&one_f_one_b(8, 0, 2_000_000), Duration::from_millis(10), 1_000_000, 0).unwrap_err();
        let count = made / 8 * 2_000_000;
        assert_eq!(e, PlanningError::TooManyBuffers { field: "schedule".into(), count, max: 1_000_000 });
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    #[test]
    fn plans_a_buffer_list() {
        let b = |name: &str, start, end, size_bytes, alias: &str| pb::BufferSpec {
            name: name.into(),
            start,
            end,
            size_bytes,
            alias_group: alias.into(),
        };
        let input = pb::PlanInput {
            input: Some(pb::plan_input::Input::Buffers(pb::BufferList {
                buffers: vec![
                    b("a", 0, 2, 10, ""),
                    b("b", 1, 3, 20, "g"),
                    b("c", 5, 6, 5, "g"),
                    b("d", 2, 4, 10, ""),
                ],
            })),
            time_budget_ms: 50,
        };
        let p = plan(&input, Duration::from_millis(10), 100, 0).unwrap();
        assert_eq!(p.lower_bound_bytes, 30);
        assert_eq!(p.footprint_bytes, 30);
        assert_eq!(p.buffers[1].offset, p.buffers[2].offset);
        let mut reversed = input.clone();
        if let Some(pb::plan_input::Input::Buffers(l)) = &mut reversed.input {
            l.buffers[3].end = 1;
        }
        let e = plan(&reversed, Duration::from_millis(10), 100, 0).unwrap_err();
        assert_eq!(e.field(), Some("buffers.buffers[3].end"));
        // A buffer that is never live ([2, 2)) is refused too (found by the fuzzer: it used to
        // be placed outside a zero footprint).
        let mut empty = input.clone();
        if let Some(pb::plan_input::Input::Buffers(l)) = &mut empty.input {
            l.buffers[3].start = 2;
            l.buffers[3].end = 2;
        }
        let e = plan(&empty, Duration::from_millis(10), 100, 0).unwrap_err();
        assert_eq!(e.field(), Some("buffers.buffers[3].end"));
    }
}
