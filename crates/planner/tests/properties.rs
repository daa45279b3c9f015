//! Property tests of the offset engine and the schedule planner, and a comparison with an
//! exact solver on small cases.

use std::time::Duration;

use graphpool_planner::pipeline::{schedule_buffers, transformer_layers};
use graphpool_planner::{
    Buffer, MAX_TOTAL_BYTES, PlaceError, PlaceOptions, Schedule, SchedulePlanInput, live_bound, lower_bound,
    place, verify,
};
use proptest::prelude::*;

fn quick() -> PlaceOptions {
    PlaceOptions { time_budget: Duration::from_millis(20), threads: 2, ..PlaceOptions::default() }
}

fn buffers(max: usize, groups: u32) -> impl Strategy<Value = Vec<Buffer>> {
    prop::collection::vec((0u64..40, 1u64..12, 0u64..64, 0u32..groups + 4), 0..max).prop_map(move |v| {
        v.into_iter()
            .map(|(start, len, size, g)| Buffer {
                start,
                end: start + len,
                size,
                group: (g < groups).then_some(g),
            })
            .collect()
    })
}

/// Optimum by brute force: lowest-offset placement in every order (an optimal placement is
/// reached by placing its buffers in order of offset, each as low as it fits).
fn brute_force(b: &[Buffer]) -> u64 {
    fn rec(b: &[Buffer], placed: &mut Vec<(usize, u64)>, used: &mut Vec<bool>, best: &mut u64) {
        let high = placed.iter().map(|&(i, o)| o + b[i].size).max().unwrap_or(0);
        if high >= *best {
            return;
        }
        if placed.len() == b.len() {
            *best = high;
            return;
        }
        for i in 0..b.len() {
            if used[i] {
                continue;
            }
            let live = |j: usize| b[j].start < b[i].end && b[i].start < b[j].end;
            let mut cands: Vec<u64> = vec![0];
            cands.extend(placed.iter().filter(|&&(j, _)| live(j)).map(|&(j, o)| o + b[j].size));
            cands.sort_unstable();
            let o = cands
                .into_iter()
                .find(|&c| {
                    placed
                        .iter()
                        .filter(|&&(j, _)| live(j))
                        .all(|&(j, o)| c + b[i].size <= o || c >= o + b[j].size)
                })
                .expect("the top is free");
            used[i] = true;
            placed.push((i, o));
            rec(b, placed, used, best);
            placed.pop();
            used[i] = false;
        }
    }
    let mut best = u64::MAX;
    rec(b, &mut Vec::new(), &mut vec![false; b.len()], &mut best);
    if b.is_empty() { 0 } else { best }
}

/// Copies of one list of 64–100 buffers (alias groups numbered apart in each), one after the
/// other in time with gaps of 0–3 steps, beside up to two buffers live from somewhere in the
/// first copy to the end, in shuffled order: a list of repeated parts.
fn repeated_parts() -> impl Strategy<Value = Vec<Buffer>> {
    let part = prop::collection::vec((0u64..40, 1u64..12, 0u64..64, 0u32..8), 64..100);
    let long = prop::collection::vec((0u64..40, 1u64..64), 0..3);
    (part, 2u64..5, 0u64..4, long)
        .prop_map(|(part, copies, gap, long)| {
            let period = part.iter().map(|&(start, len, _, _)| start + len).max().unwrap_or(0) + gap;
            let mut out: Vec<Buffer> = (0..copies)
                .flat_map(|c| {
                    part.iter().map(move |&(start, len, size, g)| Buffer {
                        start: start + c * period,
                        end: start + len + c * period,
                        size,
                        group: (g < 4).then_some(g + 4 * c as u32),
                    })
                })
                .collect();
            let end = copies * period + 1;
            out.extend(long.into_iter().map(|(start, size)| Buffer { start, end, size, group: None }));
            out
        })
        .prop_shuffle()
}

/// Alias groups of 1–4 members at separate times (gaps between them), every member of a
/// group the same size, and lone buffers: multi-interval items.
fn grouped(groups: usize, lone: usize) -> impl Strategy<Value = Vec<Buffer>> {
    let group = (prop::collection::vec((0u64..6, 1u64..5), 1..5), 1u64..32);
    let lone_buffer = (0u64..60, 1u64..10, 1u64..32);
    (prop::collection::vec(group, 0..groups), prop::collection::vec(lone_buffer, 0..lone)).prop_map(
        |(gs, ls)| {
            let mut out = Vec::new();
            for (g, (members, size)) in gs.into_iter().enumerate() {
                let mut t = 0;
                for (gap, len) in members {
                    t += gap;
                    out.push(Buffer { start: t, end: t + len, size, group: Some(g as u32) });
                    t += len;
                }
            }
            out.extend(ls.into_iter().map(|(start, len, size)| Buffer {
                start,
                end: start + len,
                size,
                group: None,
            }));
            out
        },
    )
}

/// Groups over 3 to `max_ticks − 1` one-step ticks in the pattern the contiguity bound
/// reasons about: shared groups live at every tick but one or two (shared once one of the
/// two is left out of the pattern) or at all, at every tick a group live there alone whose
/// size tops the tick up to one peak, stray buffers that may break the tie, and escorts:
/// buffers live at one tick and in the gap before it, where the shared groups missing that
/// tick may meet them (they then have a member there too). At most `items` items: the
/// brute force tries their orders.
fn ticked(max_ticks: usize, items: usize) -> impl Strategy<Value = Vec<Buffer>> {
    (
        3usize..max_ticks,
        prop::collection::vec((1u64..24, 0usize..max_ticks, 0usize..max_ticks + 3), 2..max_ticks - 1),
        0u64..12,
        prop::collection::vec((0usize..max_ticks - 1, 1u64..6), 0..2),
        prop::collection::vec((0usize..max_ticks - 1, 1u64..6, any::<bool>()), 0..4),
    )
        .prop_map(move |(ticks, shared, extra, mut strays, mut escorts)| {
            escorts.truncate(items.saturating_sub(ticks + shared.len()));
            strays.truncate(items.saturating_sub(ticks + shared.len() + escorts.len()));
            let at = |k: usize| (3 * k as u64 + 3, 3 * k as u64 + 4);
            let gap_before = |k: usize| (3 * k as u64 + 2, 3 * k as u64 + 3);
            let mut out = Vec::new();
            let mut load = vec![0u64; ticks];
            for (g, &(size, missing, also)) in shared.iter().enumerate() {
                for (k, l) in load.iter_mut().enumerate().filter(|&(k, _)| k != missing && k != also) {
                    let (start, end) = at(k);
                    out.push(Buffer { start, end, size, group: Some(g as u32) });
                    *l += size;
                }
            }
            let groups = (shared.len() + ticks) as u32;
            for (e, &(k, size, meet)) in escorts.iter().enumerate() {
                let k = k.min(ticks - 1);
                let (start, end) = gap_before(k);
                out.push(Buffer { start, end: end + 1, size, group: Some(groups + e as u32) });
                load[k] += size;
                if meet {
                    for (g, _) in shared
                        .iter()
                        .enumerate()
                        .filter(|&(_, &(_, missing, also))| missing == k || also == k)
                    {
                        out.push(Buffer { start, end, size: shared[g].0, group: Some(g as u32) });
                    }
                }
            }
            let peak = load.iter().copied().max().unwrap_or(0) + 1 + extra;
            for (k, l) in load.iter().enumerate() {
                let (start, end) = at(k);
                out.push(Buffer { start, end, size: peak - l, group: Some((shared.len() + k) as u32) });
            }
            for (k, size) in strays {
                let (start, end) = at(k.min(ticks - 1));
                out.push(Buffer { start, end, size, group: None });
            }
            out
        })
}

/// Optimum over items (a group is one item at one offset; its members have one size) by
/// lowest-offset placement in every order, given the footprint `upper` of a valid placement
/// (only placements below it are searched for).
fn brute_force_items(b: &[Buffer], upper: u64) -> u64 {
    let mut items: Vec<(Vec<(u64, u64)>, u64)> = Vec::new();
    let mut of_group = std::collections::HashMap::new();
    for x in b.iter().filter(|x| x.size > 0 && x.end > x.start) {
        let k = match x.group {
            Some(g) => *of_group.entry(g).or_insert_with(|| {
                items.push((Vec::new(), 0));
                items.len() - 1
            }),
            None => {
                items.push((Vec::new(), 0));
                items.len() - 1
            }
        };
        items[k].0.push((x.start, x.end));
        items[k].1 = items[k].1.max(x.size);
    }
    let n = items.len();
    let meets = |a: usize, c: usize| {
        items[a].0.iter().any(|&(s1, e1)| items[c].0.iter().any(|&(s2, e2)| s1 < e2 && s2 < e1))
    };
    let conflict: Vec<Vec<bool>> = (0..n).map(|a| (0..n).map(|c| meets(a, c)).collect()).collect();
    /// Two items that do not conflict take the same offsets in either order, so of two
    /// such items placed one after the other only the order with the lower index first
    /// is searched.
    fn rec(
        size: &[u64],
        conflict: &[Vec<bool>],
        placed: &mut Vec<(usize, u64)>,
        used: &mut [bool],
        best: &mut u64,
    ) {
        let high = placed.iter().map(|&(i, o)| o + size[i]).max().unwrap_or(0);
        if high >= *best {
            return;
        }
        if placed.len() == size.len() {
            *best = high;
            return;
        }
        for i in 0..size.len() {
            if used[i] || placed.last().is_some_and(|&(j, _)| i < j && !conflict[i][j]) {
                continue;
            }
            let mut cands: Vec<u64> = vec![0];
            cands.extend(placed.iter().filter(|&&(j, _)| conflict[i][j]).map(|&(j, o)| o + size[j]));
            cands.sort_unstable();
            let o = cands
                .into_iter()
                .find(|&c| {
                    placed
                        .iter()
                        .filter(|&&(j, _)| conflict[i][j])
                        .all(|&(j, o)| c + size[i] <= o || c >= o + size[j])
                })
                .expect("the top is free");
            used[i] = true;
            placed.push((i, o));
            rec(size, conflict, placed, used, best);
            placed.pop();
            used[i] = false;
        }
    }
    let size: Vec<u64> = items.iter().map(|x| x.1).collect();
    let mut best = upper;
    rec(&size, &conflict, &mut Vec::new(), &mut vec![false; n], &mut best);
    if n == 0 { 0 } else { best }
}

/// The bounds of `b` (computed up front, and proved by the placement's search) are at most
/// its brute-force optimum, and the placement is valid and above them.
fn bounds_below_the_optimum(b: &[Buffer]) -> Result<(), TestCaseError> {
    let bound = lower_bound(b).unwrap();
    let p = place(b, &quick()).unwrap();
    verify(b, &p.offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let opt = brute_force_items(b, p.footprint);
    prop_assert!(bound <= opt, "bound {} above the optimum {}", bound, opt);
    prop_assert!(p.lower_bound <= opt, "proved {} above the optimum {}", p.lower_bound, opt);
    prop_assert!(p.lower_bound >= bound && p.footprint >= p.lower_bound);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Repeated parts are planned from one copy of each: the plan is valid for every copy.
    #[test]
    fn repeated_parts_are_valid(b in repeated_parts()) {
        let p = place(&b, &quick()).unwrap();
        verify(&b, &p.offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(p.live_bound, live_bound(&b).unwrap());
        prop_assert!(p.footprint >= p.lower_bound && p.lower_bound >= p.live_bound);
        for (i, x) in b.iter().enumerate() {
            prop_assert!(p.offsets[i] + x.size <= p.footprint);
        }
    }

    #[test]
    fn multi_interval_groups_are_valid(b in grouped(12, 40)) {
        let p = place(&b, &quick()).unwrap();
        verify(&b, &p.offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(p.footprint >= p.lower_bound);
        prop_assert!(p.lower_bound >= p.live_bound);
        for (i, x) in b.iter().enumerate() {
            prop_assert!(p.offsets[i] + x.size <= p.footprint);
            for (j, y) in b.iter().enumerate() {
                if x.group.is_some() && x.group == y.group {
                    prop_assert_eq!(p.offsets[i], p.offsets[j]);
                }
            }
        }
    }

    #[test]
    fn alias_bound_is_valid_and_small_groups_are_exact(b in grouped(5, 3)) {
        let p = place(&b, &quick()).unwrap();
        verify(&b, &p.offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let opt = brute_force_items(&b, p.footprint);
        prop_assert!(p.lower_bound <= opt, "bound {} above the optimum {}", p.lower_bound, opt);
        prop_assert_eq!(p.footprint, opt);
    }

    /// The contiguity bound (groups replayed over several ticks) never exceeds the optimum.
    #[test]
    fn contiguity_bound_is_valid(b in ticked(5, 10)) {
        bounds_below_the_optimum(&b)?;
    }

    #[test]
    fn interleaved_plans_reach_the_alias_bound(pp in 2u32..5, rank_frac in 0.0f64..1.0, v in 2u32..4, extra in 0u32..12) {
        let rank = ((pp as f64 * rank_frac) as u32).min(pp - 1);
        let m = pp + extra;
        let input = SchedulePlanInput {
            schedule: Schedule::Interleaved { pp_size: pp, pp_rank: rank, num_microbatches: m, virtual_chunks: v },
            layers: transformer_layers(v, 3, 128, 1, 64),
        };
        let sb = schedule_buffers(&input).unwrap();
        let p = place(&sb.buffers, &quick()).unwrap();
        verify(&sb.buffers, &p.offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(p.ratio() <= 1.01, "ratio {} (live bound ratio {})", p.ratio(),
            p.footprint as f64 / p.live_bound as f64);
    }

    #[test]
    fn placements_are_valid(b in buffers(80, 6)) {
        let p = place(&b, &quick()).unwrap();
        prop_assert_eq!(p.offsets.len(), b.len());
        verify(&b, &p.offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(p.footprint >= p.lower_bound);
        prop_assert!(p.lower_bound >= p.live_bound);
        // The search may prove more than the bounds computed up front.
        prop_assert!(p.lower_bound >= lower_bound(&b).unwrap());
        prop_assert_eq!(p.live_bound, live_bound(&b).unwrap());
        for (x, &o) in b.iter().zip(&p.offsets) {
            if x.size > 0 && x.end > x.start {
                prop_assert!(o + x.size <= p.footprint);
            }
        }
        for (i, x) in b.iter().enumerate() {
            for (j, y) in b.iter().enumerate() {
                if x.group.is_some() && x.group == y.group {
                    prop_assert_eq!(p.offsets[i], p.offsets[j]);
                }
            }
        }
    }

    #[test]
    fn small_cases_are_optimal(b in prop::collection::vec((0u64..10, 1u64..6, 1u64..20), 1..7)) {
        let b: Vec<Buffer> =
            b.into_iter().map(|(start, len, size)| Buffer { start, end: start + len, size, group: None }).collect();
        let p = place(&b, &quick()).unwrap();
        verify(&b, &p.offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(p.footprint, brute_force(&b));
    }

    /// Lists whose sizes add up to the most the planner places: a few giant buffers beside
    /// small ones (every stage lifts buffers out and adds sizes to the tops left above them;
    /// an earlier limit of 2^64 let such a sum overflow). A byte more is refused.
    #[test]
    fn lists_at_the_byte_limit_are_placed(
        b in buffers(40, 0),
        giants in prop::collection::vec((0u64..40, 1u64..48), 1..4),
    ) {
        let small: u64 = b.iter().map(|x| x.size).sum();
        let share = (MAX_TOTAL_BYTES - small) / giants.len() as u64;
        let mut list = b.clone();
        for (k, &(start, len)) in giants.iter().enumerate() {
            let extra = if k == 0 { MAX_TOTAL_BYTES - small - share * giants.len() as u64 } else { 0 };
            list.push(Buffer { start, end: start + len, size: share + extra, group: None });
        }
        let p = place(&list, &quick()).unwrap();
        verify(&list, &p.offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(p.footprint <= MAX_TOTAL_BYTES);
        list[b.len()].size += 1;
        prop_assert_eq!(place(&list, &quick()).unwrap_err(), PlaceError::Overflow);
    }

    #[test]
    fn one_f_one_b_plans_reach_the_lower_bound(pp in 1u32..9, rank_frac in 0.0f64..1.0, m in 1u32..40) {
        let rank = ((pp as f64 * rank_frac) as u32).min(pp - 1);
        let input = SchedulePlanInput {
            schedule: Schedule::OneFOneB { pp_size: pp, pp_rank: rank, num_microbatches: m },
            layers: transformer_layers(1, 3, 128, 1, 64),
        };
        let sb = schedule_buffers(&input).unwrap();
        prop_assert_eq!(sb.slots, (pp - rank).min(m));
        let p = place(&sb.buffers, &quick()).unwrap();
        verify(&sb.buffers, &p.offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(p.ratio() <= 1.001, "ratio {}", p.ratio());
    }
}

#[test]
fn exact_search_handles_groups() {
    // Two aliases of one memory around a buffer that must sit beside them.
    let b = vec![
        Buffer { start: 0, end: 2, size: 4, group: Some(0) },
        Buffer { start: 4, end: 6, size: 4, group: Some(0) },
        Buffer { start: 1, end: 5, size: 4, group: None },
        Buffer { start: 2, end: 4, size: 4, group: None },
    ];
    let p = place(&b, &quick()).unwrap();
    verify(&b, &p.offsets).unwrap();
    assert_eq!(p.lower_bound, 8);
    assert_eq!(p.footprint, 8);
}

#[test]
fn reversed_buffer_is_rejected() {
    let b = vec![Buffer { start: 3, end: 2, size: 1, group: None }];
    assert!(place(&b, &quick()).is_err());
}

proptest! {
    // Brute force over 9 items is slow in debug builds: fewer cases.
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Lists just beyond the exact search's size go to the canonical search: what it
    /// proves never exceeds the optimum, and with time it places there.
    #[test]
    fn proved_bounds_never_exceed_the_optimum(
        b in prop::collection::vec((0u64..8, 1u64..5, 1u64..12), 9..10),
    ) {
        let b: Vec<Buffer> = b
            .into_iter()
            .map(|(start, len, size)| Buffer { start, end: start + len, size, group: None })
            .collect();
        let opts = PlaceOptions { time_budget: Duration::from_millis(500), ..quick() };
        let p = place(&b, &opts).unwrap();
        verify(&b, &p.offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let best = brute_force(&b);
        prop_assert!(p.lower_bound <= best, "proved {} above the optimum {}", p.lower_bound, best);
        prop_assert_eq!(p.footprint, best);
    }

    /// Up to six ticks: patterns of four to six ranks, where the runs every other interval
    /// needs and a run forced by one set of ranks for another come into play.
    #[test]
    fn contiguity_bound_is_valid_on_more_ticks(b in ticked(7, 10)) {
        bounds_below_the_optimum(&b)?;
    }
}
