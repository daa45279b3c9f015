//! Pipeline schedules: the order in which one pipeline rank runs the forward and backward
//! steps of its microbatches.

use serde::{Deserialize, Serialize};

/// A pipeline schedule of one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Schedule {
    /// Non-interleaved 1F1B (Megatron-LM's `forward_backward_pipelining_without_interleaving`):
    /// `min(pp_size - pp_rank - 1, M)` warm-up forwards, then one forward and one backward
    /// at a time, then the remaining backwards.
    OneFOneB {
        /// Pipeline stages.
        pp_size: u32,
        /// This rank's stage (0-based).
        pp_rank: u32,
        /// Microbatches per step (M).
        num_microbatches: u32,
    },
    /// Interleaved 1F1B with `virtual_chunks` model chunks per rank, in Megatron-LM's order:
    /// microbatches go through the chunks in groups of `pp_size`; warm-up has
    /// `2 (pp_size - pp_rank - 1) + (virtual_chunks - 1) pp_size` forwards.
    Interleaved {
        /// Pipeline stages.
        pp_size: u32,
        /// This rank's stage (0-based).
        pp_rank: u32,
        /// Microbatches per step (M ≥ `pp_size`).
        num_microbatches: u32,
        /// Model chunks per rank (≥ 1).
        virtual_chunks: u32,
    },
    /// An explicit step order: `+c` is the forward of chunk `c` (1-based) for the next
    /// microbatch of that chunk, `-c` the backward (TransformerEngine's `_order`).
    Explicit {
        /// Signed chunk numbers.
        order: Vec<i32>,
        /// Microbatches per step; each chunk must appear `num_microbatches` times with each sign.
        num_microbatches: u32,
        /// Model chunks per rank.
        virtual_chunks: u32,
    },
}

/// One step of a schedule: the forward or backward pass of one chunk for one microbatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Step {
    /// Model chunk (0-based).
    pub chunk: u32,
    /// Microbatch (0-based).
    pub microbatch: u32,
    /// Forward (true) or backward (false).
    pub forward: bool,
}

impl Step {
    /// The step in TransformerEngine's `_order` notation: `+(chunk + 1)` or `-(chunk + 1)`.
    pub fn signed(&self) -> i32 {
        let c = self.chunk as i32 + 1;
        if self.forward { c } else { -c }
    }
}

/// A schedule that cannot run. `field` names the offending setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ScheduleError {
    /// The setting at fault (`pp_rank`, `order[12]`, ...).
    pub field: String,
    /// What is wrong and what to do.
    pub message: String,
}

/// `n` and the noun in the number `n` asks for: "1 step", "2 steps".
fn counted(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ScheduleError {
    ScheduleError { field: field.into(), message: message.into() }
}

/// Sanity cap on the steps of one schedule (microbatches × chunks × 2).
pub const MAX_STEPS: u64 = 1 << 22;

impl Schedule {
    /// The schedule's key in a description (`one_f_one_b`, `interleaved`, `explicit`): the
    /// table or object its settings are under.
    pub fn kind(&self) -> &'static str {
        match self {
            Schedule::OneFOneB { .. } => "one_f_one_b",
            Schedule::Interleaved { .. } => "interleaved",
            Schedule::Explicit { .. } => "explicit",
        }
    }

    /// Model chunks per rank.
    pub fn chunks(&self) -> u32 {
        match self {
            Schedule::OneFOneB { .. } => 1,
            Schedule::Interleaved { virtual_chunks, .. } | Schedule::Explicit { virtual_chunks, .. } => {
                *virtual_chunks
            }
        }
    }

    /// Microbatches per step.
    pub fn num_microbatches(&self) -> u32 {
        match self {
            Schedule::OneFOneB { num_microbatches, .. }
            | Schedule::Interleaved { num_microbatches, .. }
            | Schedule::Explicit { num_microbatches, .. } => *num_microbatches,
        }
    }

    /// The steps in the order this rank runs them.
    pub fn steps(&self) -> Result<Vec<Step>, ScheduleError> {
        match *self {
            Schedule::OneFOneB { pp_size, pp_rank, num_microbatches: m } => {
                check_pipeline(pp_size, pp_rank, m, 1)?;
                let warmup = (pp_size - pp_rank - 1).min(m);
                let f = |mb| Step { chunk: 0, microbatch: mb, forward: true };
                let b = |mb| Step { chunk: 0, microbatch: mb, forward: false };
                let mut steps: Vec<Step> = (0..warmup).map(f).collect();
                for i in 0..m - warmup {
                    steps.push(f(warmup + i));
                    steps.push(b(i));
                }
                steps.extend((m - warmup..m).map(b));
                Ok(steps)
            }
            Schedule::Interleaved { pp_size, pp_rank, num_microbatches: m, virtual_chunks: v } => {
                check_pipeline(pp_size, pp_rank, m, v)?;
                if v < 1 {
                    return Err(err("virtual_chunks", "must be at least 1"));
                }
                if m < pp_size {
                    return Err(err(
                        "num_microbatches",
                        format!("interleaved 1F1B needs at least pp_size = {pp_size} microbatches, got {m}"),
                    ));
                }
                // Megatron's schedule table: (microbatch, chunk) of each virtual microbatch.
                let group = pp_size;
                let mut table: Vec<(u32, u32)> = Vec::with_capacity((m * v) as usize);
                let mut lo = 0;
                while lo < m {
                    let hi = if lo + group >= m { m } else { lo + group };
                    for c in 0..v {
                        table.extend((lo..hi).map(|mb| (mb, c)));
                    }
                    lo = hi;
                }
                let total = m * v;
                let warmup = (2 * (pp_size - pp_rank - 1) + (v - 1) * group).min(total);
                let f = |k: u32| {
                    let (mb, c) = table[k as usize];
                    Step { chunk: c, microbatch: mb, forward: true }
                };
                let b = |k: u32| {
                    let (mb, c) = table[k as usize];
                    Step { chunk: v - 1 - c, microbatch: mb, forward: false }
                };
                let mut steps: Vec<Step> = (0..warmup).map(f).collect();
                for k in 0..total - warmup {
                    steps.push(f(warmup + k));
                    steps.push(b(k));
                }
                steps.extend((total - warmup..total).map(b));
                Ok(steps)
            }
            Schedule::Explicit { ref order, num_microbatches: m, virtual_chunks: v } => {
                if v < 1 {
                    return Err(err("virtual_chunks", "must be at least 1"));
                }
                if m < 1 {
                    return Err(err("num_microbatches", "must be at least 1"));
                }
                if order.len() as u64 != 2 * m as u64 * v as u64 {
                    return Err(err(
                        "order",
                        format!(
                            "has {}; {} × {} need {} (each chunk {} as +c and as -c)",
                            counted(order.len() as u64, "step", "steps"),
                            counted(m.into(), "microbatch", "microbatches"),
                            counted(v.into(), "chunk", "chunks"),
                            2 * m as u64 * v as u64,
                            counted(m.into(), "time", "times"),
                        ),
                    ));
                }
                let mut fwd = vec![0u32; v as usize];
                let mut bwd = vec![0u32; v as usize];
                let mut steps = Vec::with_capacity(order.len());
                for (k, &o) in order.iter().enumerate() {
                    let c = o.unsigned_abs();
                    if o == 0 || c > v {
                        return Err(err(
                            format!("order[{k}]"),
                            format!("is {o}; use +c / -c with 1 <= c <= virtual_chunks = {v}"),
                        ));
                    }
                    let c = c - 1;
                    let (count, forward) =
                        if o > 0 { (&mut fwd[c as usize], true) } else { (&mut bwd[c as usize], false) };
                    if *count >= m {
                        return Err(err(
                            format!("order[{k}]"),
                            format!(
                                "chunk {} already has {}",
                                c + 1,
                                if forward {
                                    counted(m.into(), "forward step", "forward steps")
                                } else {
                                    counted(m.into(), "backward step", "backward steps")
                                }
                            ),
                        ));
                    }
                    let mb = *count;
                    *count += 1;
                    if !forward && mb >= fwd[c as usize] {
                        return Err(err(
                            format!("order[{k}]"),
                            format!("backward of chunk {} microbatch {mb} comes before its forward", c + 1),
                        ));
                    }
                    steps.push(Step { chunk: c, microbatch: mb, forward });
                }
                Ok(steps)
            }
        }
    }
}

fn check_pipeline(pp_size: u32, pp_rank: u32, m: u32, v: u32) -> Result<(), ScheduleError> {
    if pp_size < 1 {
        return Err(err("pp_size", "must be at least 1"));
    }
    if pp_rank >= pp_size {
        return Err(err("pp_rank", format!("is {pp_rank}; ranks of pp_size = {pp_size} are 0..{pp_size}")));
    }
    if m < 1 {
        return Err(err("num_microbatches", "must be at least 1"));
    }
    if 2 * m as u64 * v.max(1) as u64 > MAX_STEPS {
        let most = MAX_STEPS / (2 * v.max(1) as u64);
        return Err(err(
            "num_microbatches",
            format!(
                "is {m}: {} forward and backward steps, more than {MAX_STEPS}; at most {most} microbatches \
                 with {} chunk(s)",
                2 * m as u64 * v.max(1) as u64,
                v.max(1)
            ),
        ));
    }
    Ok(())
}

/// For each microbatch, the first and last step index at which it is in flight (from its
/// first forward to its last backward).
pub fn microbatch_spans(steps: &[Step], num_microbatches: u32) -> Vec<(usize, usize)> {
    let mut spans = vec![(usize::MAX, 0usize); num_microbatches as usize];
    for (k, s) in steps.iter().enumerate() {
        let span = &mut spans[s.microbatch as usize];
        span.0 = span.0.min(k);
        span.1 = span.1.max(k);
    }
    spans
}

/// The most microbatches in flight at once.
pub fn max_in_flight(steps: &[Step], num_microbatches: u32) -> u32 {
    let mut delta = vec![0i64; steps.len() + 1];
    for (first, last) in microbatch_spans(steps, num_microbatches) {
        if first != usize::MAX {
            delta[first] += 1;
            delta[last + 1] -= 1;
        }
    }
    let (mut live, mut best) = (0i64, 0i64);
    for d in delta {
        live += d;
        best = best.max(live);
    }
    best as u32
}

/// Buffer slots: microbatches whose in-flight spans do not overlap share a slot. Slots are
/// handed out in order of first step, lowest free slot first, so the count equals
/// [`max_in_flight`] (interval graphs colour optimally this way). Returns (slots, slot of
/// each microbatch).
pub fn assign_slots(steps: &[Step], num_microbatches: u32) -> (u32, Vec<u32>) {
    color_spans(&microbatch_spans(steps, num_microbatches))
}

/// Buffer slots per model chunk: the graphs of chunk `c` are replayed by every microbatch
/// of a slot of that chunk, so what counts is how many microbatches are between the forward
/// and the backward *of that chunk* at once. Returns, per chunk, (slots, slot of each
/// microbatch).
pub fn assign_chunk_slots(steps: &[Step], chunks: u32, num_microbatches: u32) -> Vec<(u32, Vec<u32>)> {
    // One pass over the steps (a pass per chunk was quadratic in the chunks: 18 s for 160k).
    let mut spans = vec![vec![(usize::MAX, 0usize); num_microbatches as usize]; chunks as usize];
    for (k, s) in steps.iter().enumerate() {
        if let Some(span) = spans.get_mut(s.chunk as usize).and_then(|c| c.get_mut(s.microbatch as usize)) {
            span.0 = span.0.min(k);
            span.1 = span.1.max(k);
        }
    }
    spans.iter().map(|s| color_spans(s)).collect()
}

/// Interval colouring in order of start, lowest free colour first (optimal for intervals).
fn color_spans(spans: &[(usize, usize)]) -> (u32, Vec<u32>) {
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&mb| spans[mb].0);
    let mut free: std::collections::BTreeSet<u32> = std::collections::BTreeSet::new();
    let mut busy: std::collections::BinaryHeap<std::cmp::Reverse<(usize, u32)>> = Default::default();
    let mut slot = vec![0u32; spans.len()];
    let mut slots = 0;
    for mb in order {
        let (first, last) = spans[mb];
        while let Some(&std::cmp::Reverse((end, s))) = busy.peek() {
            if end < first {
                busy.pop();
                free.insert(s);
            } else {
                break;
            }
        }
        let s = match free.pop_first() {
            Some(s) => s,
            None => {
                slots += 1;
                slots - 1
            }
        };
        slot[mb] = s;
        busy.push(std::cmp::Reverse((last, s)));
    }
    (slots, slot)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_f_one_b(pp_size: u32, pp_rank: u32, m: u32) -> Vec<Step> {
        Schedule::OneFOneB { pp_size, pp_rank, num_microbatches: m }.steps().unwrap()
    }

    #[test]
    fn too_many_steps_says_how_many_microbatches_fit() {
        let sched =
            Schedule::Interleaved { pp_size: 4, pp_rank: 0, num_microbatches: 1 << 21, virtual_chunks: 4 };
        let e = sched.steps().unwrap_err().to_string();
        assert!(e.contains("num_microbatches") && e.contains(&format!("at most {}", MAX_STEPS / 8)), "{e}");
    }

    #[test]
    fn first_rank_of_eight_has_eight_in_flight() {
        let s = one_f_one_b(8, 0, 8);
        assert_eq!(max_in_flight(&s, 8), 8);
        assert_eq!(s.len(), 16);
        let s = one_f_one_b(8, 0, 128);
        assert_eq!(max_in_flight(&s, 128), 8);
        let (slots, slot) = assign_slots(&s, 128);
        assert_eq!(slots, 8);
        assert_eq!(slot[8], slot[0]);
    }

    #[test]
    fn last_rank_has_one_in_flight() {
        let s = one_f_one_b(8, 7, 16);
        assert_eq!(max_in_flight(&s, 16), 1);
        assert_eq!(s.iter().map(Step::signed).take(4).collect::<Vec<_>>(), vec![1, -1, 1, -1]);
    }

    #[test]
    fn fewer_microbatches_than_stages() {
        let s = one_f_one_b(8, 0, 3);
        assert_eq!(max_in_flight(&s, 3), 3);
        assert!(s[..3].iter().all(|s| s.forward));
    }

    #[test]
    fn interleaved_warmup_and_counts() {
        // pp=4, v=2, rank 0: warm-up 2*3 + 1*4 = 10 forwards.
        let sched = Schedule::Interleaved { pp_size: 4, pp_rank: 0, num_microbatches: 8, virtual_chunks: 2 };
        let s = sched.steps().unwrap();
        assert_eq!(s.len(), 32);
        assert_eq!(s.iter().take_while(|s| s.forward).count(), 11);
        // Chunk 0 for microbatches 0..4, then chunk 1 for 0..4, then chunk 0 for 4..8.
        let first: Vec<(u32, u32)> = s[..10].iter().map(|s| (s.chunk, s.microbatch)).collect();
        assert_eq!(&first[..5], &[(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]);
        assert_eq!(first[8], (0, 4));
        // The first backward is chunk 1 (the last chunk) of microbatch 0.
        let b = s.iter().find(|s| !s.forward).unwrap();
        assert_eq!((b.chunk, b.microbatch), (1, 0));
        // Microbatch 0 finishes with the backward of virtual microbatch 4 (its chunk 0), after
        // forward 14 (chunk 1 of microbatch 6) has started: all 8 are in flight then.
        assert_eq!(max_in_flight(&s, 8), 8);
        // The last rank: warm-up (v-1)*pp = 4.
        let last = Schedule::Interleaved { pp_size: 4, pp_rank: 3, num_microbatches: 8, virtual_chunks: 2 };
        let s = last.steps().unwrap();
        assert_eq!(s.iter().take_while(|s| s.forward).count(), 5);
        assert_eq!(max_in_flight(&s, 8), 5);
        // Per chunk: chunk 1's backward follows its forward at once on the last rank.
        let per_chunk = assign_chunk_slots(&s, 2, 8);
        assert_eq!(per_chunk[1].0, 1);
        assert_eq!(per_chunk[0].0, 5);
    }

    #[test]
    fn explicit_order_is_checked() {
        let ok =
            Schedule::Explicit { order: vec![1, 1, -1, 1, -1, -1], num_microbatches: 3, virtual_chunks: 1 };
        let s = ok.steps().unwrap();
        assert_eq!(max_in_flight(&s, 3), 2);
        let bad = Schedule::Explicit { order: vec![1, -1, -1, 1], num_microbatches: 2, virtual_chunks: 1 };
        assert_eq!(bad.steps().unwrap_err().field, "order[2]");
        let zero = Schedule::Explicit { order: vec![1, 0], num_microbatches: 1, virtual_chunks: 1 };
        assert_eq!(zero.steps().unwrap_err().field, "order[1]");
        let short = Schedule::Explicit { order: vec![1], num_microbatches: 1, virtual_chunks: 1 };
        assert_eq!(short.steps().unwrap_err().field, "order");
    }

    #[test]
    fn explicit_matches_one_f_one_b() {
        let s = one_f_one_b(4, 1, 6);
        let order: Vec<i32> = s.iter().map(Step::signed).collect();
        let e = Schedule::Explicit { order, num_microbatches: 6, virtual_chunks: 1 }.steps().unwrap();
        assert_eq!(e, s);
    }

    #[test]
    fn kind_is_the_serialized_key() {
        for sched in [
            Schedule::OneFOneB { pp_size: 2, pp_rank: 0, num_microbatches: 2 },
            Schedule::Interleaved { pp_size: 2, pp_rank: 0, num_microbatches: 2, virtual_chunks: 2 },
            Schedule::Explicit { order: vec![1, -1], num_microbatches: 1, virtual_chunks: 1 },
        ] {
            let json = serde_json::to_value(&sched).unwrap();
            assert!(json.get(sched.kind()).is_some(), "{json}");
        }
    }

    #[test]
    fn bad_rank_named() {
        let e = Schedule::OneFOneB { pp_size: 2, pp_rank: 2, num_microbatches: 4 }.steps().unwrap_err();
        assert_eq!(e.field, "pp_rank");
    }

    /// Malformed explicit orders name the entry or the field, with counts in words that agree
    /// with their numbers.
    #[test]
    fn malformed_explicit_orders_say_what_is_wrong() {
        let explicit = |order: Vec<i32>, m, v| {
            Schedule::Explicit { order, num_microbatches: m, virtual_chunks: v }.steps().unwrap_err()
        };
        let e = explicit(vec![1], 1, 1);
        assert_eq!(e.field, "order");
        assert!(
            e.to_string().contains("has 1 step; 1 microbatch × 1 chunk need 2 (each chunk 1 time"),
            "{e}"
        );
        let e = explicit(vec![1, 1, -1], 2, 2);
        assert!(e.to_string().contains("has 3 steps; 2 microbatches × 2 chunks need 8"), "{e}");
        let e = explicit(vec![1, 1], 1, 1);
        assert_eq!(e.field, "order[1]");
        assert!(e.to_string().contains("chunk 1 already has 1 forward step"), "{e}");
        let e = explicit(vec![1, -1, -1, 1], 2, 1);
        assert_eq!(e.field, "order[2]");
        assert!(e.to_string().contains("before its forward"), "{e}");
    }
}
