//! Static-buffer planner for CUDA graph capture.
//!
//! - [`schedule`]: pipeline schedules (1F1B, interleaved 1F1B, explicit orders) as steps.
//! - [`pipeline`]: from a schedule and per-layer tensor specs to buffers with lifetimes,
//!   microbatch slots and alias groups, and from there to a [`pipeline::Plan`].
//! - [`dsa`]: the offset engine (dynamic storage allocation) with its lower bound.
//! - [`workload`]: generated workloads for benchmarks and tests.

pub(crate) mod canonical;
pub(crate) mod contour;
pub mod dsa;
pub(crate) mod items;
pub mod pipeline;
pub mod rng;
pub mod schedule;
pub(crate) mod until;
pub mod workload;

pub use dsa::{
    Buffer, MAX_TOTAL_BYTES, PlaceError, PlaceOptions, Placement, Stage, live_bound, lower_bound, place,
    verify,
};
pub use pipeline::{
    DType, LayerSpec, NamedBuffer, Plan, PlanError, PlannedBuffer, SchedulePlanInput, TensorSpec,
    plan_buffers, plan_schedule,
};
pub use schedule::{Schedule, ScheduleError, Step};
