//! From a pipeline schedule and per-layer tensor specs to buffers with lifetimes, buffer
//! slots and alias groups; and from buffers to a [`Plan`].
//!
//! ## The clock
//! Every layer graph launch is one clock tick: the forward step of chunk `c` with `L` layers
//! takes ticks `base..base + L` (layer `l` at `base + l`), its backward the next `L` ticks
//! of its own step, layers in reverse. A buffer live over `[start, end)` is in use from the
//! launch at `start` through the launch at `end - 1`.
//!
//! ## Buffers of one (microbatch, chunk)
//! - `inJ` of layer 0 (and of any layer whose input `J` is not chained): the static input,
//!   live at its forward launch, or until its backward when `kept_for_backward`.
//! - `outJ` of layer `l`: its static output. When layer `l + 1` has an input `J` of the same
//!   byte size, that input *is* this buffer (layer `l`'s output aliases layer `l + 1`'s
//!   input), so it lives through layer `l + 1`'s forward, or through its backward when that
//!   input is kept for backward.
//! - `doutJ` of layer `l`: the gradient of output `J` (floating and complex dtypes only), the
//!   static input of the backward graph; for `l` below the last layer it is also the gradient
//!   layer `l + 1`'s backward writes for its input `J` (live from that backward to this one).
//! - `dinJ` of layer 0 (or of an input not chained): the gradient sent to the previous stage
//!   (floating and complex dtypes only).
//! - `saved`: `saved_bytes` kept from the forward to the backward of the layer.
//! - `fws` / `bws`: workspace of the forward / backward graph, live during its launch.
//!
//! ## Slots and graph reuse
//! The graphs of chunk `c` are replayed by several microbatches: those whose spans in that
//! chunk (forward of chunk `c` to backward of chunk `c`) do not overlap share a slot of the
//! chunk. Each chunk has as many slots as it has microbatches in flight at once (the
//! minimum), handed out by interval colouring. Each buffer above belongs to the alias group
//! `s<slot>.c<chunk>.l<layer>.<kind>`: one offset for every microbatch of the slot, live over
//! the union of their intervals. The graph count is `Σ_chunks slots × layers × 2`, whatever
//! the number of microbatches.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::dsa::{self, Buffer, PlaceError, PlaceOptions};
use crate::schedule::{Schedule, ScheduleError, assign_chunk_slots};

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 64-bit float.
    F64,
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit float (e4m3, e5m2 and their `fnuz` forms, e8m0) or two packed 4-bit floats.
    F8,
    /// 32-bit complex (two f16).
    C32,
    /// 64-bit complex (two f32).
    C64,
    /// 128-bit complex (two f64).
    C128,
    /// 64-bit integer.
    I64,
    /// 32-bit integer.
    I32,
    /// 16-bit integer.
    I16,
    /// 8-bit integer.
    I8,
    /// 64-bit unsigned integer.
    U64,
    /// 32-bit unsigned integer.
    U32,
    /// 16-bit unsigned integer.
    U16,
    /// 8-bit unsigned integer.
    U8,
    /// Boolean (one byte).
    Bool,
}

impl DType {
    /// Names accepted by [`DType::parse`].
    pub const NAMES: &'static str = "f64, f32, f16, bf16, f8e4m3, f8e5m2, c32, c64, c128, i64, i32, i16, \
        i8, u64, u32, u16, u8, bool (torch names such as float32, bfloat16, torch.float16, \
        float8_e4m3fnuz, complex64, long, int, uint32 also work)";

    /// Parses `bf16`, `torch.bfloat16`, `float32`, `half`, `long`, ...
    pub fn parse(name: &str) -> Option<DType> {
        let n = name.trim().to_ascii_lowercase();
        let n = n.strip_prefix("torch.").unwrap_or(&n);
        Some(match n {
            "f64" | "float64" | "double" | "fp64" => DType::F64,
            "f32" | "float32" | "float" | "fp32" => DType::F32,
            "f16" | "float16" | "half" | "fp16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "f8e4m3" | "f8e5m2" | "float8_e4m3fn" | "float8_e5m2" | "float8_e4m3fnuz" | "float8_e5m2fnuz"
            | "float8_e8m0fnu" | "float4_e2m1fn_x2" | "fp8" => DType::F8,
            "c32" | "complex32" | "chalf" => DType::C32,
            "c64" | "complex64" | "cfloat" => DType::C64,
            "c128" | "complex128" | "cdouble" => DType::C128,
            "i64" | "int64" | "long" => DType::I64,
            "i32" | "int32" | "int" => DType::I32,
            "i16" | "int16" | "short" => DType::I16,
            "i8" | "int8" => DType::I8,
            "u64" | "uint64" => DType::U64,
            "u32" | "uint32" => DType::U32,
            "u16" | "uint16" => DType::U16,
            "u8" | "uint8" => DType::U8,
            "bool" => DType::Bool,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            DType::C128 => 16,
            DType::F64 | DType::C64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::C32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F8 | DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Floating and complex types get gradients; integer and boolean ones do not.
    pub fn is_floating(self) -> bool {
        matches!(
            self,
            DType::F64
                | DType::F32
                | DType::F16
                | DType::BF16
                | DType::F8
                | DType::C32
                | DType::C64
                | DType::C128
        )
    }
}

/// A static input or output of a layer's graph.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorSpec {
    /// A name for people (optional).
    #[serde(default)]
    pub name: String,
    /// Dimensions.
    pub shape: Vec<u64>,
    /// Element type (see [`DType::NAMES`]).
    pub dtype: String,
    /// For inputs: the forward graph keeps this tensor for its backward.
    #[serde(default)]
    pub kept_for_backward: bool,
}

/// One layer of one model chunk: the graphs of its forward and backward.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerSpec {
    /// Model chunk (0-based).
    #[serde(default)]
    pub chunk: u32,
    /// Position of the layer in its chunk (0-based; every chunk numbers its layers 0..L).
    pub layer: u32,
    /// Static inputs of the forward graph.
    #[serde(default)]
    pub inputs: Vec<TensorSpec>,
    /// Static outputs of the forward graph.
    #[serde(default)]
    pub outputs: Vec<TensorSpec>,
    /// Bytes the forward keeps for the backward beyond its inputs (saved activations).
    #[serde(default)]
    pub saved_bytes: u64,
    /// Peak temporary bytes of the forward graph.
    #[serde(default)]
    pub forward_workspace_bytes: u64,
    /// Peak temporary bytes of the backward graph.
    #[serde(default)]
    pub backward_workspace_bytes: u64,
}

/// A schedule with the layers of every chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulePlanInput {
    /// The rank's schedule.
    pub schedule: Schedule,
    /// Layers of every chunk, in any order.
    pub layers: Vec<LayerSpec>,
}

/// What capture costs beyond the planned buffers, as graphpool's capture measures it
/// (`GraphedSchedule.capture_overhead()` of the Python client, after one training step).
///
/// The planner places buffers in one arena; capture realises them with the caching allocator
/// in one memory pool per (chunk, slot) for forwards and one pool for every backward, and the
/// CUDA runtime adds graph objects. None of it depends on the number of microbatches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaptureOverhead {
    /// Bytes outside the pools whatever the schedule: the libraries' workspaces for the
    /// capture stream and the CUDA runtime's state for graphs.
    #[serde(default)]
    pub fixed_bytes: u64,
    /// Device memory per captured graph outside any pool (the graph object).
    #[serde(default)]
    pub per_graph_bytes: u64,
    /// Allocator overhead per pool: segments for small (≤ 1 MiB) blocks.
    #[serde(default)]
    pub per_pool_bytes: u64,
    /// What the backward pool takes beyond its planned bytes (fragmentation: a large
    /// temporary that no longer fits the pool's first segment gets a segment of its own).
    #[serde(default)]
    pub backward_pool_extra_bytes: u64,
}

impl CaptureOverhead {
    /// Overhead of a capture with `graphs` graphs in `pools` pools.
    pub fn bytes(&self, graphs: u32, pools: u32) -> u64 {
        self.fixed_bytes
            .saturating_add(self.per_graph_bytes.saturating_mul(graphs as u64))
            .saturating_add(self.per_pool_bytes.saturating_mul(pools as u64))
            .saturating_add(self.backward_pool_extra_bytes)
    }
}

/// A named buffer with a lifetime, for plain buffer lists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedBuffer {
    /// Name.
    pub name: String,
    /// First step live.
    pub start: u64,
    /// First step no longer live.
    pub end: u64,
    /// Bytes.
    pub size: u64,
    /// Buffers with the same non-empty group share an offset.
    #[serde(default)]
    pub alias_group: String,
}

/// A buffer of a plan, placed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedBuffer {
    /// Name (`mb<m>.c<chunk>.l<layer>.<kind>` for schedules).
    pub name: String,
    /// First step live.
    pub start: u64,
    /// First step no longer live.
    pub end: u64,
    /// Bytes.
    pub size: u64,
    /// Offset in the arena.
    pub offset: u64,
    /// Alias group (empty when none).
    pub alias_group: String,
}

/// A plan: slots, placed buffers and the figures that explain them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Buffer slots: the most of any chunk (0 for plain buffer lists).
    pub slots: u32,
    /// Slot of each microbatch in each chunk, indexed `chunk × num_microbatches + microbatch`
    /// (by microbatch for one chunk).
    pub microbatch_slot: Vec<u32>,
    /// Every buffer with its offset.
    pub buffers: Vec<PlannedBuffer>,
    /// Bytes of the arena.
    pub footprint: u64,
    /// No placement can use fewer bytes: the most bytes live at any step, or more where
    /// alias groups force it or a search proved it (see [`crate::dsa::Placement::lower_bound`]).
    pub lower_bound: u64,
    /// The most bytes live at any step.
    #[serde(default)]
    pub live_bound: u64,
    /// Sum of all buffer sizes minus the footprint: what reuse saved against giving every
    /// buffer memory of its own.
    pub saved_by_aliasing: u64,
    /// Planning time.
    pub elapsed: Duration,
    /// What produced the placement.
    pub strategy: String,
    /// The planner's stages, in order, with their times.
    #[serde(default)]
    pub stages: Vec<crate::dsa::Stage>,
    /// Planner threads the plan ran on.
    #[serde(default)]
    pub threads: usize,
    /// Steps of the schedule as signed chunk numbers (`+c` forward, `-c` backward).
    pub steps: Vec<i32>,
    /// Device bytes capture needs for this plan: the footprint (static inputs and outputs,
    /// saved activations, workspaces) plus [`Plan::overhead_bytes`].
    pub predicted_capture_bytes: u64,
    /// CUDA graphs to capture (Σ over chunks of slots × layers × 2; 0 for buffer lists).
    pub graphs: u32,
    /// Memory pools capture makes: one per (chunk, slot) and one for the backward graphs
    /// (0 for buffer lists).
    #[serde(default)]
    pub pools: u32,
    /// Capture overhead beyond the footprint, from the [`CaptureOverhead`] given with the
    /// input (0 when none was given).
    #[serde(default)]
    pub overhead_bytes: u64,
}

impl Plan {
    /// Adds a capture overhead to the prediction (replacing any added before).
    pub fn with_overhead(mut self, overhead: &CaptureOverhead) -> Plan {
        self.overhead_bytes = overhead.bytes(self.graphs, self.pools);
        self.predicted_capture_bytes = self.footprint.saturating_add(self.overhead_bytes);
        self
    }

    /// `footprint / lower_bound` (1.0 when both are 0).
    pub fn ratio(&self) -> f64 {
        if self.lower_bound == 0 { 1.0 } else { self.footprint as f64 / self.lower_bound as f64 }
    }
}

/// Why a plan could not be made. [`PlanError::field`] names the input at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The schedule cannot run.
    #[error("schedule.{0}")]
    Schedule(#[from] ScheduleError),
    /// A setting is wrong.
    #[error("{field}: {message}")]
    Invalid {
        /// The input at fault, e.g. `layers[3].inputs[0].dtype`.
        field: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// The buffers cannot be placed.
    #[error("{0}")]
    Place(#[from] PlaceError),
    /// The schedule makes more buffers than the caller accepts (see
    /// [`schedule_buffers_within`]); none were built.
    #[error(
        "the schedule makes {count} buffers, more than the limit of {max}; describe fewer \
         microbatches or layers"
    )]
    TooManyBuffers {
        /// Buffers the schedule makes.
        count: u64,
        /// The limit.
        max: usize,
    },
}

impl PlanError {
    /// The input at fault, as a path into the input (`schedule.pp_rank`, `buffers[7]`,
    /// `layers[2].outputs[0].shape`). Settings of the schedule are named without its kind
    /// (`schedule.pp_rank`, not `schedule.one_f_one_b.pp_rank`).
    pub fn field(&self) -> String {
        match self {
            PlanError::Schedule(e) => format!("schedule.{}", e.field),
            PlanError::Invalid { field, .. } => field.clone(),
            PlanError::Place(PlaceError::Reversed { index, .. }) => format!("buffers[{index}]"),
            PlanError::Place(PlaceError::Overflow) => "buffers".to_string(),
            PlanError::TooManyBuffers { .. } => "schedule".to_string(),
        }
    }

    /// What is wrong and what to do, without the field that [`PlanError::field`] names (for
    /// callers that print the field their own way).
    pub fn message(&self) -> String {
        match self {
            PlanError::Schedule(e) => e.message.clone(),
            PlanError::Invalid { message, .. } => message.clone(),
            PlanError::Place(_) | PlanError::TooManyBuffers { .. } => self.to_string(),
        }
    }
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> PlanError {
    PlanError::Invalid { field: field.into(), message: message.into() }
}

/// The planner's buffers for a named list (alias groups numbered in order of appearance).
fn unnamed(list: &[NamedBuffer]) -> Vec<Buffer> {
    let mut groups: HashMap<&str, u32> = HashMap::new();
    list.iter()
        .map(|b| {
            let group = (!b.alias_group.is_empty()).then(|| {
                let next = groups.len() as u32;
                *groups.entry(b.alias_group.as_str()).or_insert(next)
            });
            Buffer { start: b.start, end: b.end, size: b.size, group }
        })
        .collect()
}

/// Checks a placement of a named list made elsewhere (e.g. another allocator's offsets for
/// the same buffers) and returns its footprint: the highest byte used.
pub fn check_placement(list: &[NamedBuffer], offsets: &[u64]) -> Result<u64, PlacementError> {
    let buffers = unnamed(list);
    dsa::verify(&buffers, offsets).map_err(|e| {
        let name = |i: usize| list[i].name.clone();
        match e {
            dsa::VerifyError::Count { expected, got } => PlacementError::Count { expected, got },
            dsa::VerifyError::Overlap { a, b } => PlacementError::Overlap { a: name(a), b: name(b) },
            dsa::VerifyError::Alias { a, b } => PlacementError::Alias { a: name(a), b: name(b) },
            dsa::VerifyError::PastAddressSpace(i) => PlacementError::PastAddressSpace(name(i)),
        }
    })?;
    // Buffers of no bytes take no memory, wherever their offset points.
    Ok(list.iter().zip(offsets).filter(|(b, _)| b.size > 0).map(|(b, &o)| o + b.size).max().unwrap_or(0))
}

/// Why a placement given for a named list is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// Not one offset per buffer.
    #[error("{got} offsets for {expected} buffers")]
    Count {
        /// Buffers.
        expected: usize,
        /// Offsets.
        got: usize,
    },
    /// Two buffers live at the same time share bytes.
    #[error("buffers {a:?} and {b:?} are live at the same time and overlap in memory")]
    Overlap {
        /// One buffer.
        a: String,
        /// The other.
        b: String,
    },
    /// Two buffers of one alias group at different offsets.
    #[error("buffers {a:?} and {b:?} are in one alias group but at different offsets")]
    Alias {
        /// One buffer.
        a: String,
        /// The other.
        b: String,
    },
    /// A buffer's offset plus its size is past 2^64.
    #[error("buffer {0:?} ends past 2^64 bytes (offset + size)")]
    PastAddressSpace(String),
}

/// Places a plain buffer list.
pub fn plan_buffers(list: &[NamedBuffer], opts: &PlaceOptions) -> Result<Plan, PlanError> {
    let placement = dsa::place(&unnamed(list), opts)?;
    let buffers = list
        .iter()
        .zip(&placement.offsets)
        .map(|(b, &offset)| PlannedBuffer {
            name: b.name.clone(),
            start: b.start,
            end: b.end,
            size: b.size,
            offset,
            alias_group: b.alias_group.clone(),
        })
        .collect();
    Ok(Plan::placed(buffers, placement))
}

impl Plan {
    /// The plan of `buffers`, placed as `placement` says (their offsets taken from it
    /// already), with no schedule: no slots, steps, graphs or pools.
    fn placed(buffers: Vec<PlannedBuffer>, placement: dsa::Placement) -> Plan {
        let total = buffers.iter().fold(0u64, |a, b| a.saturating_add(b.size));
        Plan {
            slots: 0,
            microbatch_slot: Vec::new(),
            buffers,
            footprint: placement.footprint,
            lower_bound: placement.lower_bound,
            live_bound: placement.live_bound,
            saved_by_aliasing: total.saturating_sub(placement.footprint),
            elapsed: placement.elapsed,
            strategy: placement.strategy,
            stages: placement.stages,
            threads: placement.threads,
            steps: Vec::new(),
            predicted_capture_bytes: placement.footprint,
            graphs: 0,
            pools: 0,
            overhead_bytes: 0,
        }
    }
}

/// Byte sizes and flags of one layer's tensors, checked.
struct Layer {
    /// Position of the layer in [`SchedulePlanInput::layers`].
    index: usize,
    inputs: Vec<(u64, bool, bool)>,
    outputs: Vec<(u64, bool)>,
    saved: u64,
    fws: u64,
    bws: u64,
}

fn tensor_bytes(t: &TensorSpec, field: &str) -> Result<(u64, bool), PlanError> {
    let dtype = DType::parse(&t.dtype).ok_or_else(|| {
        invalid(format!("{field}.dtype"), format!("unknown dtype {:?}; use one of {}", t.dtype, DType::NAMES))
    })?;
    let mut bytes = dtype.bytes();
    for &d in &t.shape {
        bytes = bytes.checked_mul(d).ok_or_else(|| {
            invalid(format!("{field}.shape"), "has more than 2^64 bytes; check the dimensions")
        })?;
    }
    Ok((bytes, dtype.is_floating()))
}

/// The buffers of a schedule (one per microbatch and kind), before placement.
#[derive(Debug, Clone)]
pub struct ScheduleBuffers {
    /// Buffers (with their alias group as `Buffer::group`).
    pub buffers: Vec<Buffer>,
    /// Name of each buffer.
    pub names: Vec<String>,
    /// Names of the alias groups, indexed by `Buffer::group`.
    pub groups: Vec<String>,
    /// Buffer slots: the most of any chunk.
    pub slots: u32,
    /// Slot of each microbatch in each chunk, indexed `chunk × num_microbatches + microbatch`.
    pub microbatch_slot: Vec<u32>,
    /// The schedule as signed chunk numbers.
    pub steps: Vec<i32>,
    /// CUDA graphs to capture.
    pub graphs: u32,
    /// Memory pools of the capture: Σ over chunks of slots, plus one for the backward graphs.
    pub pools: u32,
}

/// Builds the buffers of a schedule: see the module documentation.
pub fn schedule_buffers(input: &SchedulePlanInput) -> Result<ScheduleBuffers, PlanError> {
    schedule_buffers_within(input, usize::MAX)
}

/// When a buffer of a layer's graphs starts or is last live, within its microbatch's steps.
#[derive(Debug, Clone, Copy)]
enum Tick {
    /// The forward of this layer of the chunk.
    Forward(usize),
    /// The backward of this layer of the chunk.
    Backward(usize),
}

/// The setting of a [`LayerSpec`] that gives a buffer its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// `inputs[j]` (its shape and dtype).
    Input(usize),
    /// `outputs[j]` (its shape and dtype).
    Output(usize),
    /// `saved_bytes`.
    Saved,
    /// `forward_workspace_bytes`.
    ForwardWorkspace,
    /// `backward_workspace_bytes`.
    BackwardWorkspace,
}

impl Source {
    /// The setting's path in the input, for the layer at `index` of
    /// [`SchedulePlanInput::layers`].
    fn field(self, index: usize) -> String {
        match self {
            Source::Input(j) => format!("layers[{index}].inputs[{j}].shape"),
            Source::Output(j) => format!("layers[{index}].outputs[{j}].shape"),
            Source::Saved => format!("layers[{index}].saved_bytes"),
            Source::ForwardWorkspace => format!("layers[{index}].forward_workspace_bytes"),
            Source::BackwardWorkspace => format!("layers[{index}].backward_workspace_bytes"),
        }
    }

    /// What its bytes are, for messages.
    fn what(self) -> &'static str {
        match self {
            Source::Input(_) | Source::Output(_) => "makes a tensor of",
            Source::Saved | Source::ForwardWorkspace | Source::BackwardWorkspace => "is",
        }
    }

    /// What to check when its bytes are implausible.
    fn hint(self) -> &'static str {
        match self {
            Source::Input(_) | Source::Output(_) => {
                "check the dimensions (elements, not bytes) and the dtype"
            }
            Source::Saved | Source::ForwardWorkspace | Source::BackwardWorkspace => {
                "check the value (a byte count, not kilo- or megabytes)"
            }
        }
    }
}

/// One buffer of a chunk's layers, made by each microbatch that runs the chunk.
#[derive(Debug, Clone)]
struct BufferKind {
    layer: usize,
    /// The setting its bytes come from.
    source: Source,
    /// `in0`, `dout1`, `saved`, ...: with slot, chunk and layer, the buffer's alias group.
    kind: String,
    start: Tick,
    last: Tick,
    size: u64,
}

/// The buffers one microbatch makes in a chunk of `layers` (a buffer of no bytes is none).
fn buffer_kinds(layers: &[Layer]) -> Vec<BufferKind> {
    let mut out = Vec::new();
    let mut push = |layer: usize, source: Source, kind: String, start: Tick, last: Tick, size: u64| {
        if size > 0 {
            out.push(BufferKind { layer, source, kind, start, last, size });
        }
    };
    use Tick::{Backward as B, Forward as F};
    for (l, layer) in layers.iter().enumerate() {
        let next = layers.get(l + 1);
        let prev = l.checked_sub(1).map(|p| &layers[p]);
        // Input j is chained to output j of the previous layer when the bytes match.
        let chained_in =
            |j: usize| prev.and_then(|p| p.outputs.get(j)).map(|o| o.0) == Some(layer.inputs[j].0);
        for (j, &(bytes, floating, kept)) in layer.inputs.iter().enumerate() {
            if !chained_in(j) {
                push(l, Source::Input(j), format!("in{j}"), F(l), if kept { B(l) } else { F(l) }, bytes);
                if floating {
                    push(l, Source::Input(j), format!("din{j}"), B(l), B(l), bytes);
                }
            }
        }
        for (j, &(bytes, floating)) in layer.outputs.iter().enumerate() {
            let consumer = next.and_then(|nx| nx.inputs.get(j)).filter(|i| i.0 == bytes);
            let last = match consumer {
                Some(&(_, _, true)) => B(l + 1),
                Some(_) => F(l + 1),
                None => F(l),
            };
            push(l, Source::Output(j), format!("out{j}"), F(l), last, bytes);
            if floating {
                // Written by the next layer's backward when chained, else an input of this
                // backward only.
                let start = if consumer.is_some() { B(l + 1) } else { B(l) };
                push(l, Source::Output(j), format!("dout{j}"), start, B(l), bytes);
            }
        }
        push(l, Source::Saved, "saved".to_string(), F(l), B(l), layer.saved);
        push(l, Source::ForwardWorkspace, "fws".to_string(), F(l), F(l), layer.fws);
        push(l, Source::BackwardWorkspace, "bws".to_string(), B(l), B(l), layer.bws);
    }
    out
}

/// Refuses a schedule whose buffers add up to more than the planner places
/// ([`crate::MAX_TOTAL_BYTES`], 2^62 bytes), naming the
/// setting of the layer that weighs most (the likeliest mistake: a dimension or a byte count
/// off by a factor), where the placement would only say that the sizes add up too high.
///
/// Every (chunk, slot, layer, buffer kind) is one alias group, placed once at its bytes:
/// the arena needs at most Σ over chunks of slots × the bytes of one microbatch's buffers,
/// which is what the placement adds up.
fn check_total_bytes(
    layers: &[Vec<Layer>],
    kinds: &[Vec<BufferKind>],
    chunk_slots: &[(u32, Vec<u32>)],
) -> Result<(), PlanError> {
    let mut total = 0u128;
    // (bytes over the chunk's slots, chunk, kind) of the heaviest buffer kind
    let mut heaviest: Option<(u128, usize, &BufferKind)> = None;
    for (c, chunk) in kinds.iter().enumerate() {
        let slots = chunk_slots[c].0 as u128;
        for k in chunk {
            let bytes = slots * k.size as u128;
            total = total.saturating_add(bytes);
            if heaviest.is_none_or(|(most, _, _)| bytes > most) {
                heaviest = Some((bytes, c, k));
            }
        }
    }
    match heaviest {
        Some((_, c, k)) if total > crate::MAX_TOTAL_BYTES as u128 => {
            let slots = chunk_slots[c].0;
            Err(invalid(
                k.source.field(layers[c][k.layer].index),
                format!(
                    "{} {} bytes, held in each of chunk {c}'s {slots} buffer slot(s): with the \
                     schedule's other buffers that is more than 2^62 bytes, the most the planner places; {}",
                    k.source.what(),
                    k.size,
                    k.source.hint()
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// [`schedule_buffers`], refused with [`PlanError::TooManyBuffers`] before anything is
/// built when the schedule makes more than `max_buffers` buffers (a daemon's guard: a
/// million microbatches of 64 layers would make a billion).
pub fn schedule_buffers_within(
    input: &SchedulePlanInput,
    max_buffers: usize,
) -> Result<ScheduleBuffers, PlanError> {
    let steps = input.schedule.steps()?;
    let chunks = input.schedule.chunks() as usize;
    let m = input.schedule.num_microbatches() as usize;
    if input.layers.is_empty() {
        return Err(invalid("layers", "is empty; describe at least one layer per chunk"));
    }
    let mut per_chunk: Vec<Vec<(u32, usize)>> = vec![Vec::new(); chunks];
    for (i, l) in input.layers.iter().enumerate() {
        if l.chunk as usize >= chunks {
            return Err(invalid(
                format!("layers[{i}].chunk"),
                format!("is {}; the schedule has chunks 0..{chunks}", l.chunk),
            ));
        }
        per_chunk[l.chunk as usize].push((l.layer, i));
    }
    let mut layers: Vec<Vec<Layer>> = Vec::with_capacity(chunks);
    for (c, list) in per_chunk.iter_mut().enumerate() {
        if list.is_empty() {
            return Err(invalid(
                "layers",
                format!(
                    "chunk {c} has no layers, and the schedule runs chunks 0..{chunks}; describe every \
                     chunk's layers (those of chunk {c} with `chunk` set to {c})"
                ),
            ));
        }
        list.sort_unstable();
        let mut out = Vec::with_capacity(list.len());
        let n = list.len();
        for (pos, &(layer, i)) in list.iter().enumerate() {
            if layer as usize != pos {
                let message = match pos.checked_sub(1).map(|p| list[p]) {
                    Some((previous, first)) if previous == layer => format!(
                        "is {layer}, as is layers[{first}].layer of chunk {c}; number the chunk's {n} \
                         layers 0..{n}, each once"
                    ),
                    _ => format!(
                        "is {layer}, but chunk {c} has no layer {pos}; number the chunk's {n} layers \
                         0..{n}, each once"
                    ),
                };
                return Err(invalid(format!("layers[{i}].layer"), message));
            }
            let spec = &input.layers[i];
            let inputs = spec
                .inputs
                .iter()
                .enumerate()
                .map(|(j, t)| {
                    tensor_bytes(t, &format!("layers[{i}].inputs[{j}]"))
                        .map(|(b, f)| (b, f, t.kept_for_backward))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let outputs = spec
                .outputs
                .iter()
                .enumerate()
                .map(|(j, t)| tensor_bytes(t, &format!("layers[{i}].outputs[{j}]")))
                .collect::<Result<Vec<_>, _>>()?;
            out.push(Layer {
                index: i,
                inputs,
                outputs,
                saved: spec.saved_bytes,
                fws: spec.forward_workspace_bytes,
                bws: spec.backward_workspace_bytes,
            });
        }
        layers.push(out);
    }
    let kinds: Vec<Vec<BufferKind>> = layers.iter().map(|chunk| buffer_kinds(chunk)).collect();
    let count: u64 = kinds.iter().map(|k| k.len() as u64 * m as u64).sum();
    if count > max_buffers as u64 {
        return Err(PlanError::TooManyBuffers { count, max: max_buffers });
    }
    let chunk_slots = assign_chunk_slots(&steps, chunks as u32, m as u32);
    check_total_bytes(&layers, &kinds, &chunk_slots)?;
    let slots = chunk_slots.iter().map(|c| c.0).max().unwrap_or(0);
    // Counted wide: layers of no bytes make no buffers, so the buffer limit does not bound these.
    let graphs: u64 = chunk_slots.iter().zip(&layers).map(|(c, l)| c.0 as u64 * l.len() as u64 * 2).sum();
    let graphs = u32::try_from(graphs).map_err(|_| PlanError::Invalid {
        field: "layers".into(),
        message: format!(
            "the capture would take {graphs} graphs (2 per layer and buffer slot), more than 2^32; \
             use fewer layers or fewer microbatches in flight"
        ),
    })?;
    let pools = chunk_slots.iter().map(|c| c.0 as u64).sum::<u64>() + 1;
    let pools = u32::try_from(pools).map_err(|_| PlanError::Invalid {
        field: "schedule".into(),
        message: format!(
            "the capture would take {pools} pools (one per chunk and buffer slot), more than 2^32; \
             use fewer chunks or fewer microbatches in flight"
        ),
    })?;
    let microbatch_slot: Vec<u32> = chunk_slots.iter().flat_map(|c| c.1.iter().copied()).collect();
    // Clock: base tick of every step; the forward / backward step of each (chunk, microbatch).
    let mut base = Vec::with_capacity(steps.len());
    let mut tick = 0u64;
    let mut fstep = vec![vec![0usize; m]; chunks];
    let mut bstep = vec![vec![0usize; m]; chunks];
    for (k, s) in steps.iter().enumerate() {
        base.push(tick);
        tick += layers[s.chunk as usize].len() as u64;
        let table = if s.forward { &mut fstep } else { &mut bstep };
        table[s.chunk as usize][s.microbatch as usize] = k;
    }
    let mut out = ScheduleBuffers {
        buffers: Vec::with_capacity(count as usize),
        names: Vec::with_capacity(count as usize),
        groups: Vec::new(),
        slots,
        microbatch_slot,
        steps: steps.iter().map(|s| s.signed()).collect(),
        graphs,
        pools,
    };
    for (c, chunk) in kinds.iter().enumerate() {
        let n = layers[c].len() as u64;
        // Alias group of each (slot, buffer kind) of the chunk, numbered as first met.
        let mut group_of = vec![u32::MAX; chunk_slots[c].0 as usize * chunk.len()];
        for mb in 0..m {
            let slot = out.microbatch_slot[c * m + mb];
            let (fb, bb) = (base[fstep[c][mb]], base[bstep[c][mb]]);
            // A layer's forward runs at its base tick plus its index; backwards in reverse.
            let at = |t: Tick| match t {
                Tick::Forward(l) => fb + l as u64,
                Tick::Backward(l) => bb + (n - 1 - l as u64),
            };
            for (j, k) in chunk.iter().enumerate() {
                let group = &mut group_of[slot as usize * chunk.len() + j];
                if *group == u32::MAX {
                    *group = out.groups.len() as u32;
                    out.groups.push(format!("s{slot}.c{c}.l{}.{}", k.layer, k.kind));
                }
                let group = *group;
                out.names.push(format!("mb{mb}.c{c}.l{}.{}", k.layer, k.kind));
                out.buffers.push(Buffer {
                    start: at(k.start),
                    end: at(k.last) + 1,
                    size: k.size,
                    group: Some(group),
                });
            }
        }
    }
    Ok(out)
}

/// The footprint over the lower bound that a schedule's plan is held to (and settles for
/// with the default budget: [`plan_schedule_buffers`]).
pub const SCHEDULE_TOLERANCE: f64 = 1.001;

/// Plans a schedule: slots, buffers, offsets and figures.
pub fn plan_schedule(input: &SchedulePlanInput, opts: &PlaceOptions) -> Result<Plan, PlanError> {
    plan_schedule_buffers(schedule_buffers(input)?, opts)
}

/// Places the buffers of a schedule built by [`schedule_buffers`] (for callers that look at
/// them first, e.g. to bound their number). Most schedules reach the bound within
/// milliseconds and stop there. A plan still above [`SCHEDULE_TOLERANCE`] × the bound after
/// the constructions has the whole `opts.time_budget`; one within it stops at the
/// [`PlaceOptions::scaled_budget_per_item`] cap where `opts` set one (the default budget),
/// and has the whole budget where they do not (a budget the caller gave).
pub fn plan_schedule_buffers(sb: ScheduleBuffers, opts: &PlaceOptions) -> Result<Plan, PlanError> {
    let opts = PlaceOptions { settle_within: Some(SCHEDULE_TOLERANCE), ..opts.clone() };
    let placement = dsa::place(&sb.buffers, &opts)?;
    let buffers = sb
        .buffers
        .iter()
        .zip(&sb.names)
        .zip(&placement.offsets)
        .map(|((b, name), &offset)| PlannedBuffer {
            name: name.clone(),
            start: b.start,
            end: b.end,
            size: b.size,
            offset,
            alias_group: b.group.map(|g| sb.groups[g as usize].clone()).unwrap_or_default(),
        })
        .collect();
    Ok(Plan {
        slots: sb.slots,
        microbatch_slot: sb.microbatch_slot,
        steps: sb.steps,
        graphs: sb.graphs,
        pools: sb.pools,
        ..Plan::placed(buffers, placement)
    })
}

/// The hidden state of the layer generators below: `shape` in bf16.
fn hidden_state(shape: Vec<u64>, kept_for_backward: bool) -> TensorSpec {
    TensorSpec { name: "hidden".to_string(), shape, dtype: "bf16".to_string(), kept_for_backward }
}

/// A transformer-like layer stack for examples, tests and benchmarks: `layers` layers per
/// chunk, hidden state `[seq, batch, hidden]` in bf16 chained from layer to layer and kept
/// for backward, `saved_bytes` ≈ 10 hidden states (attention and FFN activations) and
/// workspaces of 4 hidden states.
pub fn transformer_layers(chunks: u32, layers: u32, seq: u64, batch: u64, hidden: u64) -> Vec<LayerSpec> {
    let h = hidden_state(vec![seq, batch, hidden], true);
    let bytes = seq * batch * hidden * 2;
    let mut out = Vec::new();
    for c in 0..chunks {
        for l in 0..layers {
            out.push(LayerSpec {
                chunk: c,
                layer: l,
                inputs: vec![h.clone()],
                outputs: vec![hidden_state(h.shape.clone(), false)],
                saved_bytes: 10 * bytes,
                forward_workspace_bytes: 4 * bytes,
                backward_workspace_bytes: 4 * bytes,
            });
        }
    }
    out
}

/// A transformer-like stack whose layers differ, for tests and figures (seeded): `layers`
/// layers per chunk alternating at random between attention (≈ 4–6 hidden states saved for
/// backward, sometimes a rotary-embedding input of fp32 kept for backward) and MLP (≈ 8–12
/// hidden states saved); each graph's workspace is none, 32 MiB, one or two hidden states;
/// the hidden state `[seq, batch, hidden]` in bf16 is chained from layer to layer and kept
/// for backward with probability 0.8; the first layer of chunk 0 takes int64 token ids
/// (no gradient) with probability 0.3.
pub fn varied_layers(
    chunks: u32,
    layers: u32,
    seq: u64,
    batch: u64,
    hidden: u64,
    seed: u64,
) -> Vec<LayerSpec> {
    let mut rng = crate::rng::Rng::new(seed ^ 0x7661_7269_6564);
    let state = |kept| hidden_state(vec![seq, batch, hidden], kept);
    let bytes = seq * batch * hidden * 2;
    let mut out = Vec::new();
    for c in 0..chunks {
        for l in 0..layers {
            let attention = rng.below(2) == 0;
            let mut inputs = vec![state(rng.below(5) != 0)];
            if c == 0 && l == 0 && rng.below(10) < 3 {
                inputs = vec![TensorSpec {
                    name: "tokens".to_string(),
                    shape: vec![seq, batch],
                    dtype: "int64".to_string(),
                    kept_for_backward: false,
                }];
            } else if attention && rng.below(2) == 0 {
                inputs.push(TensorSpec {
                    name: "rope".to_string(),
                    shape: vec![seq, 1, 1, 128],
                    dtype: "fp32".to_string(),
                    kept_for_backward: true,
                });
            }
            let saved =
                if attention { [4, 6][rng.below(2) as usize] } else { [8, 12][rng.below(2) as usize] };
            let mut workspace = || [0, 32 << 20, bytes, 2 * bytes][rng.below(4) as usize];
            out.push(LayerSpec {
                chunk: c,
                layer: l,
                inputs,
                outputs: vec![state(false)],
                saved_bytes: saved * bytes,
                forward_workspace_bytes: workspace(),
                backward_workspace_bytes: workspace(),
            });
        }
    }
    out
}

/// `layers` layers alternating attention (fixed 32 MiB forward and backward workspaces, 4
/// hidden states saved) and MLP (no workspace, 8 saved), hidden state of `hidden_bytes` in
/// bf16 chained from layer to layer and kept for backward: layers whose workspaces differ
/// and do not scale with the activations (for figures).
pub fn workspace_layers(layers: u32, hidden_bytes: u64) -> Vec<LayerSpec> {
    let shape = vec![(hidden_bytes / 2048).max(1), 1, 1024];
    (0..layers)
        .map(|layer| {
            let attention = layer % 2 == 0;
            let workspace = if attention { 32 << 20 } else { 0 };
            LayerSpec {
                chunk: 0,
                layer,
                inputs: vec![hidden_state(shape.clone(), true)],
                outputs: vec![hidden_state(shape.clone(), false)],
                saved_bytes: if attention { 4 * hidden_bytes } else { 8 * hidden_bytes },
                forward_workspace_bytes: workspace,
                backward_workspace_bytes: workspace,
            }
        })
        .collect()
}

/// A random explicit pipeline case (TransformerEngine's `_order` form), for tests and
/// figures: see [`random_explicit_case`].
#[derive(Debug, Clone)]
pub struct ExplicitCase {
    /// Virtual chunks (1–4).
    pub chunks: u32,
    /// Microbatches (1, 2, 3, 4, 8, 16, 33 or 64).
    pub microbatches: u32,
    /// Most microbatches in flight.
    pub window: u32,
    /// Probability of taking an allowed forward before an allowed backward.
    pub eager: f64,
    /// Layers per chunk (1–6).
    pub layers: u32,
    /// The schedule and its layers ([`varied_layers`], sequence 2048, micro-batch 1).
    pub input: SchedulePlanInput,
}

/// Case `case` of the random explicit orders (seeded): 1–4 chunks, 1–64 microbatches,
/// forwards through the chunks in order and backwards in reverse, at most `window`
/// microbatches in flight (from 1 to all of them: GPipe), a forward taken before an allowed
/// backward with probability `eager` (0, ¼, ½, ¾ or 1), over 1–6 [`varied_layers`] per chunk
/// with hidden 1024–8192.
pub fn random_explicit_case(case: u64) -> ExplicitCase {
    let mut rng = crate::rng::Rng::new(case ^ 0x6578_706c);
    let pick = |rng: &mut crate::rng::Rng, options: &[u64]| options[rng.below(options.len() as u64) as usize];
    let chunks = rng.range(1, 4) as u32;
    let microbatches = pick(&mut rng, &[1, 2, 3, 4, 8, 16, 33, 64]) as u32;
    let window = match rng.below(4) {
        0 => 1,
        1 => 2,
        2 => rng.range(2, microbatches.max(2) as u64) as u32,
        _ => microbatches,
    };
    let eager = pick(&mut rng, &[0, 1, 2, 3, 4]) as f64 / 4.0;
    let order = random_order(&mut rng, microbatches, chunks, window, eager);
    let layers = rng.range(1, 6) as u32;
    let hidden = pick(&mut rng, &[1024, 2048, 4096, 8192]);
    let schedule = Schedule::Explicit { order, num_microbatches: microbatches, virtual_chunks: chunks };
    let input = SchedulePlanInput { schedule, layers: varied_layers(chunks, layers, 2048, 1, hidden, case) };
    ExplicitCase { chunks, microbatches, window, eager, layers, input }
}

/// A random valid explicit order of `m` microbatches through `v` chunks: at most `window`
/// microbatches in flight, a forward taken before an allowed backward with probability
/// `eager`.
fn random_order(rng: &mut crate::rng::Rng, m: u32, v: u32, window: u32, eager: f64) -> Vec<i32> {
    let v = v as usize;
    let (mut fwd, mut bwd) = (vec![0u32; v], vec![0u32; v]);
    let mut order = Vec::with_capacity(2 * m as usize * v);
    while order.len() < 2 * m as usize * v {
        // A new microbatch starts (chunk 1's forward) only while fewer than `window` are in flight.
        let forwards: Vec<usize> = (0..v)
            .filter(|&c| fwd[c] < m && if c == 0 { fwd[0] - bwd[0] < window } else { fwd[c - 1] > fwd[c] })
            .collect();
        let backwards: Vec<usize> =
            (0..v).filter(|&c| bwd[c] < fwd[c] && (c + 1 == v || bwd[c + 1] > bwd[c])).collect();
        let forward = backwards.is_empty() || (!forwards.is_empty() && rng.unit() < eager);
        let list = if forward { &forwards } else { &backwards };
        let c = list[rng.below(list.len() as u64) as usize];
        if forward {
            fwd[c] += 1;
            order.push(c as i32 + 1);
        } else {
            bwd[c] += 1;
            order.push(-(c as i32 + 1));
        }
    }
    order
}

/// Layer descriptions written out by hand in tests.
#[cfg(test)]
pub(crate) mod specs {
    use super::{LayerSpec, TensorSpec};

    /// A static tensor: `name`, `shape`, `dtype`, kept for the backward or not.
    pub(crate) fn tensor(name: &str, shape: &[u64], dtype: &str, kept: bool) -> TensorSpec {
        TensorSpec { name: name.into(), shape: shape.to_vec(), dtype: dtype.into(), kept_for_backward: kept }
    }

    /// Layer `layer` of `chunk` with its tensors and `[saved, forward workspace, backward
    /// workspace]` bytes.
    pub(crate) fn layer(
        chunk: u32,
        layer: u32,
        inputs: Vec<TensorSpec>,
        outputs: Vec<TensorSpec>,
        [saved, fws, bws]: [u64; 3],
    ) -> LayerSpec {
        LayerSpec {
            chunk,
            layer,
            inputs,
            outputs,
            saved_bytes: saved,
            forward_workspace_bytes: fws,
            backward_workspace_bytes: bws,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str, start: u64, end: u64, size: u64, group: &str) -> NamedBuffer {
        NamedBuffer { name: name.into(), start, end, size, alias_group: group.into() }
    }

    /// Every torch dtype of a fixed element size parses under the name `str(dtype)` gives,
    /// with torch's `element_size()`; floating and complex ones get gradients.
    #[test]
    fn torch_dtype_names_parse_with_their_element_size() {
        let torch = [
            ("torch.float64", 8, true),
            ("torch.float32", 4, true),
            ("torch.float16", 2, true),
            ("torch.bfloat16", 2, true),
            ("torch.float8_e4m3fn", 1, true),
            ("torch.float8_e5m2", 1, true),
            ("torch.float8_e4m3fnuz", 1, true),
            ("torch.float8_e5m2fnuz", 1, true),
            ("torch.float8_e8m0fnu", 1, true),
            ("torch.float4_e2m1fn_x2", 1, true),
            ("torch.complex32", 4, true),
            ("torch.complex64", 8, true),
            ("torch.complex128", 16, true),
            ("torch.int64", 8, false),
            ("torch.int32", 4, false),
            ("torch.int16", 2, false),
            ("torch.int8", 1, false),
            ("torch.uint64", 8, false),
            ("torch.uint32", 4, false),
            ("torch.uint16", 2, false),
            ("torch.uint8", 1, false),
            ("torch.bool", 1, false),
        ];
        for (name, bytes, floating) in torch {
            let d = DType::parse(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!((d.bytes(), d.is_floating()), (bytes, floating), "{name}");
            let short = name.strip_prefix("torch.").unwrap();
            assert_eq!(DType::parse(short), Some(d), "{short}");
        }
        assert_eq!(DType::parse("qint8"), None);
    }

    #[test]
    fn a_given_placement_is_checked_as_memory_is_used() {
        // A group is as high as its largest member live *now*: C may sit above the small B
        // once the large A has ended.
        let list = [named("A", 0, 10, 100, "g"), named("B", 5, 20, 10, "g"), named("C", 12, 20, 10, "")];
        assert_eq!(check_placement(&list, &[0, 0, 10]), Ok(100));
        assert_eq!(
            check_placement(&list, &[0, 0, 5]),
            Err(PlacementError::Overlap { a: "B".into(), b: "C".into() })
        );
        // Past the address space: refused, not wrapped around.
        let list = [named("a", 0, 10, 100, ""), named("b", 0, 10, 100, "")];
        assert_eq!(
            check_placement(&list, &[u64::MAX - 15, 50]),
            Err(PlacementError::PastAddressSpace("a".into()))
        );
        // A buffer of no bytes takes no memory, wherever it is said to be.
        let list = [named("a", 0, 10, 100, ""), named("b", 0, 10, 0, "")];
        assert_eq!(check_placement(&list, &[0, 1 << 40]), Ok(100));
    }

    fn layer(layer: u32, output: &[u64], saved_bytes: u64) -> LayerSpec {
        let tensor = |shape: &[u64]| TensorSpec {
            name: String::new(),
            shape: shape.to_vec(),
            dtype: "bf16".to_string(),
            kept_for_backward: false,
        };
        LayerSpec {
            chunk: 0,
            layer,
            inputs: vec![tensor(&[16])],
            outputs: vec![tensor(output)],
            saved_bytes,
            forward_workspace_bytes: 0,
            backward_workspace_bytes: 0,
        }
    }

    /// 1F1B stage 0 of 4 with 4 microbatches: 4 buffer slots.
    fn four_slots(layers: Vec<LayerSpec>) -> SchedulePlanInput {
        SchedulePlanInput {
            schedule: Schedule::OneFOneB { pp_size: 4, pp_rank: 0, num_microbatches: 4 },
            layers,
        }
    }

    #[test]
    fn bytes_past_the_arena_name_the_heaviest_setting() {
        // Layer 0 is listed second; its output (2^62 bytes, and as many for its gradient) in
        // each of 4 slots is 2^65 bytes: the setting is named, not the buffer list.
        let e = schedule_buffers(&four_slots(vec![layer(1, &[16], 0), layer(0, &[1 << 61], 0)])).unwrap_err();
        assert_eq!(e.field(), "layers[1].outputs[0].shape", "{e}");
        assert!(
            e.message().contains("4611686018427387904 bytes") && e.message().contains("4 buffer slot"),
            "{e}"
        );
        assert!(e.to_string().contains("check the dimensions"), "{e}");
        let e = schedule_buffers(&four_slots(vec![layer(0, &[16], 1 << 62), layer(1, &[16], u64::MAX / 2)]))
            .unwrap_err();
        assert_eq!(e.field(), "layers[1].saved_bytes", "{e}");
        assert!(e.message().contains("a byte count"), "{e}");
        // One tensor past 2^64 bytes on its own: its shape.
        let e = schedule_buffers(&four_slots(vec![layer(0, &[1 << 32, 1 << 32], 0)])).unwrap_err();
        assert_eq!(e.field(), "layers[0].outputs[0].shape", "{e}");
        // Exactly 2^62 bytes fit: one slot holding one buffer of them; a byte more does not.
        let one_slot = |bytes: u64| SchedulePlanInput {
            schedule: Schedule::OneFOneB { pp_size: 1, pp_rank: 0, num_microbatches: 1 },
            layers: vec![LayerSpec { inputs: vec![], outputs: vec![], ..layer(0, &[], bytes) }],
        };
        let plan = plan_schedule(&one_slot(crate::MAX_TOTAL_BYTES), &PlaceOptions::default()).unwrap();
        assert_eq!(plan.footprint, crate::MAX_TOTAL_BYTES);
        let e = plan_schedule(&one_slot(crate::MAX_TOTAL_BYTES + 1), &PlaceOptions::default()).unwrap_err();
        assert_eq!(e.field(), "layers[0].saved_bytes", "{e}");
    }

    #[test]
    fn layer_numbers_name_the_entry_at_fault() {
        let e =
            schedule_buffers(&four_slots(vec![layer(0, &[16], 0), layer(1, &[16], 0), layer(0, &[16], 0)]))
                .unwrap_err();
        assert_eq!(e.field(), "layers[2].layer");
        assert!(e.message().contains("as is layers[0].layer"), "{e}");
        let e = schedule_buffers(&four_slots(vec![layer(0, &[16], 0), layer(2, &[16], 0)])).unwrap_err();
        assert_eq!(e.field(), "layers[1].layer");
        assert!(e.message().contains("has no layer 1"), "{e}");
        let mut input = four_slots(vec![layer(0, &[16], 0)]);
        input.schedule =
            Schedule::Interleaved { pp_size: 2, pp_rank: 0, num_microbatches: 2, virtual_chunks: 2 };
        let e = schedule_buffers(&input).unwrap_err();
        assert_eq!(e.field(), "layers");
        assert!(
            e.message().contains("chunk 1 has no layers") && e.message().contains("`chunk` set to 1"),
            "{e}"
        );
    }

    #[test]
    fn the_message_leaves_the_field_out() {
        let mut input = four_slots(vec![layer(0, &[16], 0)]);
        input.layers[0].outputs[0].dtype = "bfloat17".to_string();
        let e = schedule_buffers(&input).unwrap_err();
        assert_eq!(e.field(), "layers[0].outputs[0].dtype");
        assert_eq!(e.to_string(), format!("{}: {}", e.field(), e.message()));
        input.schedule = Schedule::OneFOneB { pp_size: 4, pp_rank: 4, num_microbatches: 4 };
        let e = schedule_buffers(&input).unwrap_err();
        assert_eq!(e.field(), "schedule.pp_rank");
        assert_eq!(e.to_string(), format!("{}: {}", e.field(), e.message()));
        let e = schedule_buffers_within(&four_slots(vec![layer(0, &[16], 0)]), 3).unwrap_err();
        assert_eq!((e.field().as_str(), e.message()), ("schedule", e.to_string()));
    }

    #[test]
    fn overhead_counts_graphs_and_pools_and_not_microbatches() {
        let plan = |m: u32| {
            let input = SchedulePlanInput {
                schedule: Schedule::OneFOneB { pp_size: 4, pp_rank: 0, num_microbatches: m },
                layers: transformer_layers(1, 3, 1024, 1, 256),
            };
            plan_schedule(&input, &PlaceOptions::default()).unwrap()
        };
        let overhead = CaptureOverhead {
            fixed_bytes: 1000,
            per_graph_bytes: 10,
            per_pool_bytes: 100,
            backward_pool_extra_bytes: 7,
        };
        let small = plan(4).with_overhead(&overhead);
        // 4 slots × 3 layers × 2 graphs; 4 forward pools + 1 backward pool
        assert_eq!((small.graphs, small.pools), (24, 5));
        assert_eq!(small.overhead_bytes, 1000 + 24 * 10 + 5 * 100 + 7);
        assert_eq!(small.predicted_capture_bytes, small.footprint + small.overhead_bytes);
        let large = plan(64).with_overhead(&overhead);
        assert_eq!(large.overhead_bytes, small.overhead_bytes);
        // no overhead given: the prediction is the footprint
        let bare = plan(4);
        assert_eq!((bare.overhead_bytes, bare.predicted_capture_bytes), (0, bare.footprint));
    }

    /// An explicit GPipe-like order (each microbatch's forwards through the four chunks
    /// while fewer than 51 of 64 are in flight, else the oldest one's backwards: 8.4k
    /// buffers), whose first greedy pass the cost model puts at 293 ms, above the daemon's
    /// default budget: that pass still runs (it takes a fraction of that; without it the
    /// plan was 1.0858 of the bound) and the plan reaches the bound.
    #[test]
    fn gpipe_orders_get_a_greedy_pass() {
        let (m, v, w) = (64, 4, 51);
        let mut order: Vec<i32> = Vec::new();
        let (mut started, mut done) = (0, 0);
        while done < m {
            if started < m && started - done < w {
                order.extend(1..=v);
                started += 1;
            } else {
                order.extend((1..=v).rev().map(|c| -c));
                done += 1;
            }
        }
        let input = SchedulePlanInput {
            schedule: Schedule::Explicit { order, num_microbatches: m, virtual_chunks: v as u32 },
            layers: varied_layers(v as u32, 6, 2048, 1, 2048, 919),
        };
        // A debug build spends 150–260 ms on the bounds alone, and a plan that late ends at
        // its floor (by design): there the budget leaves the pass time, and only the release
        // build checks the pass beyond the budget.
        let budget = if cfg!(debug_assertions) { 1000 } else { 200 };
        let opts = PlaceOptions { time_budget: Duration::from_millis(budget), ..PlaceOptions::default() };
        let plan = plan_schedule(&input, &opts).unwrap();
        assert_ne!(plan.strategy, "online-best-fit", "{:?}", plan.stages);
        assert!(plan.ratio() <= 1.001, "{:.4} of the bound ({})", plan.ratio(), plan.strategy);
    }
}
