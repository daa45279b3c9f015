//! Property tests of the offset engine and the schedule planner, and a comparison with an
//! exact solver on small cases.

use std::time::Duration;

use graphpool_planner::pipeline::{schedule_buffers, transformer_layers};
use graphpool_planner::{Buffer, PlaceOptions, Schedule, SchedulePlanInput, lower_bound, place, verify};
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn placements_are_valid(b in buffers(80, 6)) {
        let p = place(&b, &quick()).unwrap();
        prop_assert_eq!(p.offsets.len(), b.len());
        verify(&b, &p.offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(p.footprint >= p.lower_bound);
        prop_assert_eq!(p.lower_bound, lower_bound(&b).unwrap());
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
