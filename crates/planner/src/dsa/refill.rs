//! The refilling sweep: a placement at the bound for *full* lists, whose bytes live equal the
//! bound at every step where anything is live (tilings of a rectangle; arenas whose memory is
//! re-cut as the clock runs). At the bound such a list leaves no byte free at any step: the
//! buffers ending at a step leave holes, and the buffers starting there fill them exactly.
//! Each step's enders and starters split into *runs*: a run's enders lie side by side and its
//! starters take their place, so its bytes balance. A placement at the bound is then an
//! order of the live buffers at every step in which each run's enders are consecutive, its
//! starters taking their place. The runs are found as the smallest balanced groups (atoms),
//! grouped where the tree below needs it (sizes may add up by chance).
//!
//! Which orders those are is decided by the whole clock, so the sweep runs twice. Backwards,
//! a PQ-tree ([`Pq`]) keeps every order of the live buffers from which the rest of the clock
//! can be placed: at each step, going back, the run's starters are made consecutive and
//! replaced by its enders, and the order the reduction left them in is kept ([`SetOrder`]).
//! Forwards, each run's starters fill the stretch its enders held in that order, turned so
//! that its anchor (a buffer beside it in the tree) lies on the side where it already lies;
//! every live byte being used, the offsets follow. The sweep gives up (`None`) where a list
//! is not full, where a step has too many enders or starters to find its runs
//! ([`RUN_MAX_BUFFERS`]: tilings cut along lines, whose time cuts meet in tens), where most
//! steps hold a choice of runs ([`CHOICES_MAX`]), or where no grouping it tries keeps every
//! run consecutive (arenas re-cut at several places per step, whose runs merged or split by
//! chance wrongly).

use super::pqtree::{Pq, SetOrder};
use super::*;

/// Enders or starters at one step beyond which the sweep does not look for its runs (it
/// tries every subset of each side).
pub(super) const RUN_MAX_BUFFERS: usize = 10;

/// Whether `p` is full: single intervals, and at every rank either nothing live or the live
/// bound.
pub(super) fn is_full(p: &Problem) -> bool {
    p.ivs.len() == p.len()
        && p.len() > 0
        && p.live()[..p.ranks as usize].iter().all(|&live| live == 0 || live == p.live_bound)
}

/// One run of a step: enders whose bytes the starters fill exactly.
struct Run {
    enders: Vec<u32>,
    starters: Vec<u32>,
}

/// The runs of one step: the enders and starters split, smallest balanced groups first.
fn runs_of(p: &Problem, enders: &[u32], starters: &[u32]) -> Option<Vec<Run>> {
    if enders.is_empty() || starters.is_empty() {
        return Some(vec![Run { enders: enders.to_vec(), starters: starters.to_vec() }]);
    }
    if enders.len() > RUN_MAX_BUFFERS || starters.len() > RUN_MAX_BUFFERS {
        return None;
    }
    let sums = |side: &[u32]| -> Vec<u64> {
        let mut s = vec![0u64; 1 << side.len()];
        for m in 1..s.len() {
            let low = m.trailing_zeros() as usize;
            s[m] = s[m & (m - 1)] + p.size[side[low] as usize];
        }
        s
    };
    let (es, ss) = (sums(enders), sums(starters));
    let (full_e, full_s) = ((1usize << enders.len()) - 1, (1usize << starters.len()) - 1);
    let mut left_e = full_e;
    let mut left_s = full_s;
    let mut runs = Vec::new();
    while left_e != 0 {
        // The smallest starter subset of each sum, among those left.
        let mut by_sum: HashMap<u64, usize, KeyHashing> = HashMap::default();
        let mut m = left_s;
        while m != 0 {
            let best = by_sum.entry(ss[m]).or_insert(m);
            if m.count_ones() < best.count_ones() {
                *best = m;
            }
            m = (m - 1) & left_s;
        }
        let mut found: Option<(u32, usize, usize)> = None;
        let mut m = left_e;
        while m != 0 {
            if let Some(&sm) = by_sum.get(&es[m]) {
                let cost = m.count_ones() + sm.count_ones();
                if found.is_none_or(|f| cost < f.0) {
                    found = Some((cost, m, sm));
                }
            }
            m = (m - 1) & left_e;
        }
        let (_, me, ms) = found?;
        let pick = |side: &[u32], mask: usize| -> Vec<u32> {
            side.iter().enumerate().filter(|(k, _)| mask >> k & 1 == 1).map(|(_, &i)| i).collect()
        };
        runs.push(Run { enders: pick(enders, me), starters: pick(starters, ms) });
        left_e &= !me;
        left_s &= !ms;
    }
    (left_s == 0).then_some(runs)
}

/// Every way to group `k` atoms (fewest groups first), each as the group of every atom;
/// only the coarsest and the finest beyond [`GROUPING_MAX_ATOMS`] atoms.
fn groupings(k: usize) -> Vec<Vec<usize>> {
    if k <= 1 {
        return vec![vec![0; k]];
    }
    if k > GROUPING_MAX_ATOMS {
        return vec![vec![0; k], (0..k).collect()];
    }
    // Restricted growth strings: atom j joins one of the groups before it or opens the next.
    let mut all = Vec::new();
    let mut g = vec![0usize; k];
    loop {
        all.push(g.clone());
        // Next string: bump the last position that may grow.
        let mut j = k - 1;
        loop {
            let limit = g[..j].iter().max().map_or(0, |&m| m + 1);
            if g[j] < limit {
                g[j] += 1;
                g[j + 1..].iter_mut().for_each(|x| *x = 0);
                break;
            }
            if j == 1 {
                all.sort_by_key(|g| g.iter().max().copied().unwrap_or(0));
                return all;
            }
            j -= 1;
        }
    }
}

/// Steps the backward sweep may visit beyond one visit per step of the list before it gives
/// up: a wrong grouping shows only steps later, and a long search there costs more than the
/// other stages gain from the time. Arenas re-cut at two places per step, seeds 1–10, with
/// 4, 8 and 16 visits per step instead: 2, 3 and 5 of 10 placed at 1k buffers; none at
/// 10k, given up in ≤ 73, ≤ 120 and ≤ 242 ms; at 100k up to 0.45 s with 8.
const BACKTRACK_EXTRA_WORK: usize = 4096;

/// Steps with several atoms (a choice of grouping) beyond which, when they are also more
/// than one step in [`CHOICES_MAX_SHARE`], the sweep does not search. Arenas re-cut at one
/// place per step have them where sizes add up by chance (3.7–3.9% of the steps, 147 of
/// 4k at 10k buffers, 1.6k of 40k at 100k), and are placed; re-cut at two places, 87–97%
/// of the steps (189 at 1k, 1.9k at 10k): placed on 5 of 10 at 1k, on none at 10k, where
/// the search gave up after 0.14–0.18 s at 100k on the 2-core VM and 0.3–0.45 s on the GPU
/// host, whose plans then ran to 1.0–1.6 s.
const CHOICES_MAX: usize = 500;
/// See [`CHOICES_MAX`].
const CHOICES_MAX_SHARE: usize = 4;

/// Atoms of one step beyond which [`groupings`] tries only the coarsest and the finest.
const GROUPING_MAX_ATOMS: usize = 6;

/// The runs of `atoms` grouped as `grouping` says.
fn merged(atoms: &[Run], grouping: &[usize]) -> Vec<Run> {
    let groups = grouping.iter().max().map_or(0, |&m| m + 1);
    let mut runs: Vec<Run> = (0..groups).map(|_| Run { enders: Vec::new(), starters: Vec::new() }).collect();
    for (a, &g) in atoms.iter().zip(grouping) {
        runs[g].enders.extend_from_slice(&a.enders);
        runs[g].starters.extend_from_slice(&a.starters);
    }
    runs
}

/// One step of the backward sweep: the tree before the step (going back) from the tree
/// after it, with the order each run's starters were left in; `None` where the runs'
/// starters cannot be kept together.
fn back_step(
    tree: Option<&Pq>,
    runs: &[Run],
    mark: &mut [bool],
) -> Option<(Option<Pq>, Vec<Option<SetOrder>>)> {
    let mut tree = tree.cloned();
    let mut found = Vec::with_capacity(runs.len());
    for run in runs {
        let with = Pq::group(run.enders.iter().map(|&i| Pq::Leaf(i)).collect());
        if run.starters.is_empty() {
            // Nothing is live after this step: the enders are all there is.
            if tree.is_some() {
                return None;
            }
            tree = with;
            found.push(None);
            continue;
        }
        run.starters.iter().for_each(|&i| mark[i as usize] = true);
        let reduced =
            tree.as_ref().and_then(|t| t.reduce_replace(&|i| mark[i as usize], run.starters.len(), with));
        run.starters.iter().for_each(|&i| mark[i as usize] = false);
        let (t, order) = reduced?;
        tree = t;
        found.push(Some(order));
    }
    Some((tree, found))
}

/// What the backward sweep decided: each step's runs, the order each run's starters were
/// left in, and the tree after each step with a choice of groupings.
struct Backwards {
    runs: Vec<Vec<Run>>,
    set_orders: Vec<Vec<Option<SetOrder>>>,
    saved: Vec<Option<Pq>>,
}

/// The backward sweep over `steps` (their atoms, and the step each buffer ends at), trying
/// each step's groupings from the coarsest or from the finest.
fn backwards(
    steps: &[Vec<Run>],
    end_step: &[u32],
    n: usize,
    coarsest_first: bool,
    until: Instant,
) -> Option<Backwards> {
    // The tree of the orders just after each step. A step's runs are its atoms grouped
    // (sizes may add up by chance, so an atom may be part of a run), the first grouping in
    // the order asked for whose starters the tree can keep together; where a step finds none,
    // the search goes back to the nearest step after it (in time) where one of its starters
    // ended and another grouping is left (within `BACKTRACK_EXTRA_WORK`).
    let mut mark = vec![false; n];
    let options: Vec<Vec<Vec<usize>>> = steps
        .iter()
        .map(|atoms| {
            let mut g = groupings(atoms.len());
            if !coarsest_first {
                g.reverse();
            }
            g
        })
        .collect();
    let choice = |j: usize| options[j].len() > 1;
    let mut next_option = vec![0usize; steps.len()];
    let mut runs: Vec<Vec<Run>> = (0..steps.len()).map(|_| Vec::new()).collect();
    // The order each run's starters were left in.
    let mut set_orders: Vec<Vec<Option<SetOrder>>> = (0..steps.len()).map(|_| Vec::new()).collect();
    // The tree after the step being decided, and after each step with a choice of groupings
    // (kept to go back to, and to order a step of several runs forwards).
    let mut current: Option<Pq> = None;
    let mut saved: Vec<Option<Pq>> = vec![None; steps.len()];
    let mut work = 0usize;
    let work_cap = steps.len() + BACKTRACK_EXTRA_WORK;
    let mut k = steps.len();
    while k > 0 {
        let j = k - 1;
        work += 1;
        if work > work_cap || (work.is_multiple_of(1024) && Instant::now() > until) {
            return None;
        }
        if choice(j) && next_option[j] == 0 {
            saved[j] = current.clone();
        }
        let mut advanced = false;
        while next_option[j] < options[j].len() {
            let grouping = &options[j][next_option[j]];
            next_option[j] += 1;
            let step_runs = merged(&steps[j], grouping);
            let input = if choice(j) { saved[j].as_ref() } else { current.as_ref() };
            if let Some((t, orders)) = back_step(input, &step_runs, &mut mark) {
                runs[j] = step_runs;
                set_orders[j] = orders;
                current = t;
                advanced = true;
                break;
            }
        }
        if advanced {
            k -= 1;
        } else {
            // Back to the nearest step after this one (in time) where one of this step's
            // starters ended and another grouping is left (else the nearest step with one
            // left): its grouping set where they lie.
            next_option[j] = 0;
            let left = |c: &usize| *c > j && next_option[*c] < options[*c].len();
            let culprit = steps[j]
                .iter()
                .flat_map(|a| &a.starters)
                .map(|&i| end_step[i as usize] as usize)
                .filter(left)
                .min();
            let back = culprit.or_else(|| (j + 1..steps.len()).find(left))?;
            next_option[j + 1..back].iter_mut().for_each(|o| *o = 0);
            current = saved[back].clone();
            k = back + 1;
        }
    }
    Some(Backwards { runs, set_orders, saved })
}

/// Places a full list at its live bound, or `None` (see the module documentation), or at
/// `until`.
pub(super) fn refill(p: &Problem, until: Instant) -> Option<Vec<u64>> {
    if !is_full(p) {
        return None;
    }
    let n = p.len();
    let ranks = p.ranks as usize + 1;
    // Enders and starters of every rank.
    let mut at: Vec<(Vec<u32>, Vec<u32>)> = vec![(Vec::new(), Vec::new()); ranks];
    for (i, &(s, e)) in p.ivs.iter().enumerate() {
        at[s as usize].1.push(i as u32);
        at[e as usize].0.push(i as u32);
    }
    // The atoms of every step where anything starts or ends, and the step each buffer ends at.
    let mut steps: Vec<Vec<Run>> = Vec::new();
    let mut end_step = vec![0u32; n];
    for (t, (enders, starters)) in at.iter().enumerate() {
        if enders.is_empty() && starters.is_empty() {
            continue;
        }
        enders.iter().for_each(|&i| end_step[i as usize] = steps.len() as u32);
        if t.is_multiple_of(1024) && Instant::now() > until {
            return None;
        }
        steps.push(runs_of(p, enders, starters)?);
    }
    // Many steps of several atoms: a search that fails late (see `CHOICES_MAX_SHARE`).
    let choices = steps.iter().filter(|atoms| atoms.len() > 1).count();
    if choices > CHOICES_MAX && choices * CHOICES_MAX_SHARE > steps.len() {
        return None;
    }
    // Backwards, the coarsest groupings first, then (where that fails) the finest first:
    // merging atoms wrongly and splitting runs wrongly fail on different lists (arenas
    // re-cut at two places per step, 1k buffers, seeds 1–20: 6 placed the first way, 9 the
    // second, those 6 among them; at one place per step the finest first fails at 10k).
    let Backwards { runs, set_orders, saved } = backwards(&steps, &end_step, n, true, until)
        .or_else(|| backwards(&steps, &end_step, n, false, until))?;
    // Forwards: each run's starters fill the stretch of memory its enders held, in the order
    // its reduction left them in where the step has one run, and in an order read from the
    // whole tree after the step where it has more (the runs' orders depend on one another
    // there), sorted nearest to the buffers already placed. The keys: twice the offset, plus
    // one for a buffer already live; a run's starters all take twice the stretch's start.
    let mut off = vec![0u64; n];
    let mut run_of = vec![u32::MAX; n];
    let mut bases: Vec<u64> = Vec::new();
    let mut seen: Vec<u32> = Vec::new();
    let mut tiles: Vec<u32> = Vec::new();
    let mut filled: Vec<Vec<u32>> = Vec::new();
    for (k, (runs, orders)) in runs.iter().zip(&set_orders).enumerate() {
        if k.is_multiple_of(1024) && Instant::now() > until {
            return None;
        }
        // Each run's enders must tile a stretch (then no byte of it is used by another
        // buffer, and the starters filling it overlap nothing).
        bases.clear();
        for run in runs {
            tiles.clear();
            tiles.extend_from_slice(&run.enders);
            tiles.sort_unstable_by_key(|&i| off[i as usize]);
            let base = tiles.first().map_or(0, |&i| off[i as usize]);
            let mut top = base;
            for &i in &tiles {
                if off[i as usize] != top {
                    return None;
                }
                top += p.size[i as usize];
            }
            bases.push(base);
        }
        for (r, run) in runs.iter().enumerate() {
            run.starters.iter().for_each(|&i| run_of[i as usize] = r as u32);
        }
        let key = |i: u32| match run_of[i as usize] {
            u32::MAX => 2 * off[i as usize] + 1,
            r => 2 * bases[r as usize],
        };
        filled.resize_with(runs.len(), Vec::new);
        filled.iter_mut().for_each(Vec::clear);
        seen.clear();
        match orders.as_slice() {
            [Some(order)] => {
                // The set's order outward from its anchor: reversed where the anchor lies
                // above the stretch.
                seen.extend_from_slice(&order.set);
                if let Some((a, begins)) = order.anchor
                    && (off[a as usize] < bases[0]) != begins
                {
                    seen.reverse();
                }
            }
            [None] => {}
            _ => {
                if let Some(t) = &saved[k] {
                    t.frontier_near(&key, &mut seen);
                }
            }
        }
        for &i in &seen {
            if let Some(f) = filled.get_mut(run_of[i as usize] as usize) {
                f.push(i);
            }
        }
        for (r, run) in runs.iter().enumerate() {
            run.starters.iter().for_each(|&i| run_of[i as usize] = u32::MAX);
            if filled[r].len() != run.starters.len() {
                return None;
            }
            let mut top = bases[r];
            for &i in &filled[r] {
                off[i as usize] = top;
                top += p.size[i as usize];
            }
        }
    }
    Some(off)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{packed, packed_recut};

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    fn placed_at_the_bound(buffers: &[Buffer]) -> bool {
        let p = Problem::build(buffers).unwrap();
        let Some(off) = refill(&p, far()) else { return false };
        let offsets: Vec<u64> = p.item_of.iter().map(|&i| off[i as usize]).collect();
        crate::verify(buffers, &offsets).expect("a valid placement");
        let high = buffers.iter().zip(&offsets).map(|(b, o)| o + b.size).max().unwrap();
        assert_eq!(high, p.live_bound, "a refill is at the bound");
        true
    }

    #[test]
    fn arenas_re_cut_once_per_step_are_placed_at_the_bound() {
        for (n, seed) in [(200, 1), (1_000, 2), (10_000, 3), (10_000, 4)] {
            assert!(placed_at_the_bound(&packed_recut(n, seed, 1)), "n {n} seed {seed}");
        }
    }

    #[test]
    fn the_planner_answers_with_a_refill_at_the_bound() {
        let b = packed_recut(5_000, 7, 1);
        // Time enough for a debug build on a busy machine.
        let opts = crate::PlaceOptions {
            time_budget: Duration::from_secs(20),
            scaled_budget_per_item: None,
            ..Default::default()
        };
        let plan = crate::place(&b, &opts).unwrap();
        assert_eq!(plan.footprint, plan.lower_bound);
        assert_eq!(plan.strategy, "refill");
        assert!(plan.stages.iter().any(|s| s.name == "refill"));
    }

    /// Steps of two runs order both runs from the whole tree after the step.
    #[test]
    fn arenas_re_cut_at_two_places_per_step_can_be_placed_at_the_bound() {
        assert!(placed_at_the_bound(&packed_recut(1_000, 1, 2)));
    }

    #[test]
    fn a_list_with_a_byte_free_is_not_full() {
        let mut b = packed_recut(300, 1, 1);
        b.push(Buffer { start: 0, end: 1, size: 512, group: None });
        let p = Problem::build(&b).unwrap();
        assert!(!is_full(&p));
        assert!(refill(&p, far()).is_none());
        assert!(is_full(&Problem::build(&packed_recut(300, 1, 1)).unwrap()));
    }

    /// Two runs at one step (a and c re-cut, b running on), then one.
    #[test]
    fn a_step_of_two_runs_is_placed_at_the_bound() {
        let buf = |start, end, size| Buffer { start, end, size, group: None };
        // Bottom to top at step 0: a (3) b (5) c (4), all 12 bytes live until 4. At 2, a and
        // c end and are re-cut (a → d 1 + e 2, c → f 4 by another piece's size), b runs on.
        let b = vec![
            buf(0, 2, 3),
            buf(0, 4, 5),
            buf(0, 2, 4),
            buf(2, 4, 1),
            buf(2, 4, 2),
            buf(2, 3, 4),
            buf(3, 4, 4),
        ];
        assert!(placed_at_the_bound(&b));
    }

    #[test]
    fn tilings_cut_along_lines_are_left_to_the_other_stages() {
        // Tens of pieces start at the first step: more than the runs are looked for in.
        let p = Problem::build(&packed(1_000, 1)).unwrap();
        assert!(is_full(&p));
        assert!(refill(&p, far()).is_none());
    }

    #[test]
    fn groupings_run_from_the_coarsest() {
        assert_eq!(groupings(1), vec![vec![0]]);
        let g = groupings(3);
        assert_eq!(g.len(), 5, "the Bell number of 3");
        assert_eq!(g[0], vec![0, 0, 0]);
        assert_eq!(g[4], vec![0, 1, 2]);
        assert_eq!(groupings(GROUPING_MAX_ATOMS + 1).len(), 2);
    }

    #[test]
    fn runs_are_the_smallest_balanced_groups() {
        let b = vec![
            Buffer { start: 0, end: 1, size: 3, group: None },
            Buffer { start: 0, end: 1, size: 5, group: None },
            Buffer { start: 1, end: 2, size: 1, group: None },
            Buffer { start: 1, end: 2, size: 2, group: None },
            Buffer { start: 1, end: 2, size: 5, group: None },
        ];
        let p = Problem::build(&b).unwrap();
        let runs = runs_of(&p, &[0, 1], &[2, 3, 4]).unwrap();
        let mut got: Vec<(usize, usize)> = runs.iter().map(|r| (r.enders.len(), r.starters.len())).collect();
        got.sort_unstable();
        assert_eq!(got, vec![(1, 1), (1, 2)]);
    }
}
