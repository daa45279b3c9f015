//! Folding the clock: the ranks that constrain nothing left out.
//!
//! A placement is valid when the items live together at each rank lie apart, so what a
//! placement must satisfy is only which items are live together. A rank whose live items
//! are all live together at another rank that is kept adds nothing. Pipeline schedules
//! repeat themselves: every slot of the steady state replays the same graphs microbatch
//! after microbatch, so the same set of live alias groups comes back every period, and a
//! schedule of 256 microbatches holds its few hundred distinct sets dozens of times each.
//! Folded, the problem keeps each set once: the same placements are valid (the same pairs of
//! items are live together), over far fewer ranks and intervals, so the searches that are
//! bounded by intervals (the canonical search, [`CANONICAL_MAX_ITEMS`]) reach them, and every
//! stage's work shrinks.

use std::collections::HashSet;
use std::hash::BuildHasher;

use super::*;

impl Problem {
    /// Leaves out the ranks that add no constraint: those whose live set is a subset of the
    /// rank before (nothing starts there) or of the rank after (nothing ends there, something
    /// starts), and those whose live set came before. Only the intervals, hulls and the
    /// clock change: sizes, lifetimes on the real clock, bounds, peaks (the heaviest rank of
    /// an item's is kept) and `item_of` hold as they are. False, and nothing changed, where
    /// no rank can go.
    ///
    /// Sets are compared by a sum of 128-bit random keys of their items, drawn per call: two
    /// different sets agree with probability 2⁻¹²⁸ (a plan's final placement is checked in
    /// the tests against the unfolded list).
    pub(super) fn fold(&mut self) -> bool {
        let ranks = self.ranks as usize;
        if ranks < 3 {
            return false;
        }
        // Intervals starting and ending at each rank, as (item, starts) events sorted by rank.
        let mut first = vec![0u32; ranks + 1];
        for &(s, e) in &self.ivs {
            first[s as usize] += 1;
            first[e as usize] += 1;
        }
        let mut at = 0u32;
        for f in first.iter_mut() {
            let count = *f;
            *f = at;
            at += count;
        }
        let mut fill = first.clone();
        let mut events = vec![(0u32, false); at as usize];
        for i in 0..self.len() {
            for &(s, e) in self.ivs(i) {
                events[fill[s as usize] as usize] = (i as u32, true);
                fill[s as usize] += 1;
                events[fill[e as usize] as usize] = (i as u32, false);
                fill[e as usize] += 1;
            }
        }
        let events_at = |r: usize| &events[first[r] as usize..first[r + 1] as usize];
        let starts_at = |r: usize| events_at(r).iter().any(|&(_, starts)| starts);
        let ends_at = |r: usize| r < ranks && events_at(r).iter().any(|&(_, starts)| !starts);
        let mut rng = Rng::new(std::collections::hash_map::RandomState::new().hash_one(self.len()));
        let keys: Vec<u128> =
            (0..self.len()).map(|_| ((rng.next_u64() as u128) << 64) | rng.next_u64() as u128).collect();
        let mut seen: HashSet<u128, KeyHashing> = HashSet::default();
        let mut kept: Vec<u32> = Vec::new();
        let (mut set, mut live) = (0u128, 0usize);
        for r in 0..ranks {
            for &(item, starts) in events_at(r) {
                if starts {
                    set = set.wrapping_add(keys[item as usize]);
                    live += 1;
                } else {
                    set = set.wrapping_sub(keys[item as usize]);
                    live -= 1;
                }
            }
            // A subset of the rank before, or of the rank after (a superset there; a chain of
            // such ranks ends at a rank that is kept or whose set came before, which is kept).
            let within_before = r > 0 && !starts_at(r);
            let within_after = r + 1 < ranks && !ends_at(r + 1) && starts_at(r + 1);
            if live == 0 || within_before || within_after {
                continue;
            }
            if seen.insert(set) {
                kept.push(r as u32);
            }
        }
        if kept.len() + 1 >= ranks {
            return false;
        }
        // Rank r of the clock becomes the number of kept ranks before it; an interval keeps
        // the kept ranks within it (none: it goes, its item is live together elsewhere).
        let mut before = vec![0u32; ranks + 1];
        let mut k = 0usize;
        for (r, b) in before.iter_mut().enumerate() {
            while k < kept.len() && (kept[k] as usize) < r {
                k += 1;
            }
            *b = k as u32;
        }
        let mut ivp = Vec::with_capacity(self.len() + 1);
        let mut ivs: Vec<(u32, u32)> = Vec::with_capacity(kept.len());
        let mut hull = Vec::with_capacity(self.len());
        ivp.push(0);
        for i in 0..self.len() {
            let from = ivs.len();
            for &(s, e) in self.ivs(i) {
                let (s, e) = (before[s as usize], before[e as usize]);
                if s == e {
                    continue;
                }
                match ivs[from..].last_mut() {
                    Some(last) if last.1 == s => last.1 = e,
                    _ => ivs.push((s, e)),
                }
            }
            if ivs.len() == from {
                // Cannot happen (every rank of an item is within a kept rank holding it); keep
                // the problem whole rather than lose an item.
                debug_assert!(false, "item {i} kept no rank");
                return false;
            }
            hull.push((ivs[from].0, ivs[ivs.len() - 1].1));
            ivp.push(ivs.len() as u32);
        }
        (self.ivp, self.ivs, self.hull) = (ivp, ivs, hull);
        self.ranks = kept.len() as u32 + 1;
        self.events = std::sync::OnceLock::new();
        // (`meeting` holds: the pairs of items live together are the same.)
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `p` folded, where anything folds.
    fn folded(p: &Problem) -> Option<Problem> {
        let mut f = p.clone();
        f.fold().then_some(f)
    }

    /// The pairs of items live together at some rank.
    fn together(p: &Problem) -> BTreeSet<(usize, usize)> {
        let mut pairs = BTreeSet::new();
        for r in 0..p.ranks {
            let live: Vec<usize> =
                (0..p.len()).filter(|&i| p.ivs(i).iter().any(|&(s, e)| s <= r && r < e)).collect();
            for (k, &a) in live.iter().enumerate() {
                for &b in &live[k + 1..] {
                    pairs.insert((a, b));
                }
            }
        }
        pairs
    }

    fn group(g: u32, spans: &[(u64, u64)], size: u64) -> Vec<Buffer> {
        spans.iter().map(|&(start, end)| Buffer { start, end, size, group: Some(g) }).collect()
    }

    #[test]
    fn a_repeating_schedule_keeps_one_period() {
        // Two slots replayed over ten periods of 4 steps, and a workspace in every step.
        let mut list = Vec::new();
        for slot in 0..2u32 {
            let spans: Vec<(u64, u64)> =
                (0..10).map(|k| (k * 4 + 2 * slot as u64, k * 4 + 2 * slot as u64 + 3)).collect();
            list.extend(group(slot, &spans, 100));
        }
        let steps: Vec<(u64, u64)> = (0..41).map(|t| (t, t + 1)).collect();
        list.extend(group(9, &steps, 10));
        let p = Problem::build(&list).unwrap();
        let f = folded(&p).expect("the periods repeat");
        assert!(f.ranks < p.ranks / 4, "{} ranks of {}", f.ranks, p.ranks);
        assert!(f.ivs.len() < p.ivs.len() / 4, "{} intervals of {}", f.ivs.len(), p.ivs.len());
        assert_eq!(together(&f), together(&p));
        assert_eq!(
            (f.size.clone(), f.item_of.clone(), f.live_bound),
            (p.size.clone(), p.item_of.clone(), p.live_bound)
        );
        assert_eq!(f.live().into_iter().max(), p.live().into_iter().max(), "the heaviest set is kept");
    }

    #[test]
    fn a_clock_with_nothing_to_leave_out_is_not_folded() {
        // Every rank holds a set of its own, none within another.
        let list: Vec<Buffer> =
            (0..6u64).map(|k| Buffer { start: k, end: k + 1, size: 1 + k, group: None }).collect();
        assert!(folded(&Problem::build(&list).unwrap()).is_none());
        // The first and last ranks are within their neighbours: they go.
        let list: Vec<Buffer> =
            (0..6u64).map(|k| Buffer { start: k, end: k + 2, size: 1 + k, group: None }).collect();
        let p = Problem::build(&list).unwrap();
        let f = folded(&p).unwrap();
        assert_eq!((p.ranks, f.ranks), (8, 6));
        assert_eq!(together(&f), together(&p));
    }

    /// Stage 8 of a 16-stage 1F1B pipeline, 256 microbatches, six layers whose byte counts
    /// look measured: (sequence, hidden) of the layer's input and output, saved bytes,
    /// forward and backward workspaces. No layer's output chains into the next.
    fn uneven_schedule() -> Vec<Buffer> {
        const LAYERS: [(u64, u64, u64, u64, u64); 6] = [
            (1024, 1024, 24_582_656, 22_020_096, 40_894_464),
            (4096, 4096, 57_821_184, 20_971_520, 57_671_680),
            (4096, 5120, 138_923_520, 58_720_256, 67_108_864),
            (1024, 4096, 9_915_392, 61_865_984, 41_943_040),
            (2048, 5120, 142_247_424, 23_068_672, 31_457_280),
            (1024, 2048, 49_597_952, 23_068_672, 17_825_792),
        ];
        use crate::pipeline::specs::{layer, tensor};
        let hidden = |seq: u64, h: u64, kept| tensor("hidden", &[seq, 1, h], "bf16", kept);
        let layers = LAYERS
            .iter()
            .enumerate()
            .map(|(l, &(seq, h, saved, fws, bws))| {
                layer(0, l as u32, vec![hidden(seq, h, true)], vec![hidden(seq, h, false)], [saved, fws, bws])
            })
            .collect();
        let input = crate::SchedulePlanInput {
            schedule: crate::Schedule::OneFOneB { pp_size: 16, pp_rank: 8, num_microbatches: 256 },
            layers,
        };
        crate::pipeline::schedule_buffers(&input).unwrap().buffers
    }

    #[test]
    fn a_pipeline_schedule_folds_to_a_few_periods_with_the_same_conflicts() {
        let buffers = uneven_schedule();
        let p = Problem::build(&buffers).unwrap();
        let f = folded(&p).expect("the steady state repeats");
        assert!(f.ranks * 10 < p.ranks, "{} ranks of {}", f.ranks, p.ranks);
        assert!(f.ivs.len() * 5 < p.ivs.len(), "{} intervals of {}", f.ivs.len(), p.ivs.len());
        for a in 0..p.len() {
            for b in a + 1..p.len() {
                assert_eq!(f.conflict(a, b), p.conflict(a, b), "items {a} and {b}");
            }
        }
        assert_eq!(f.peaks(), p.peak, "each item's heaviest rank is kept");
    }

    /// Planned on the folded clock, the schedule reaches its bound (the canonical search
    /// reaches the folded problem; unfolded, the plan stopped at 1.0034 of it), and the
    /// placement holds on the whole clock.
    #[test]
    fn a_folded_schedule_is_placed_at_its_bound() {
        let buffers = uneven_schedule();
        let placed = place(&buffers, &uncapped(Duration::from_secs(5))).unwrap();
        verify(&buffers, &placed.offsets).unwrap();
        assert_eq!(placed.footprint, placed.lower_bound, "{}", placed.strategy);
        let names: Vec<&str> = placed.stages.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names[..3], ["prepare", "fold", "floor"], "{names:?}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// Folding keeps exactly the pairs of items live together (and so the rows of items
        /// met), every item, and the heaviest rank.
        #[test]
        fn folding_keeps_who_is_live_together(
            raw in prop::collection::vec((0u64..30, 1u64..8, 1u64..50, prop::option::of(0u32..6)), 1..40)
        ) {
            let list: Vec<Buffer> =
                raw.iter().map(|&(start, len, size, group)| Buffer { start, end: start + len, size, group }).collect();
            let p = Problem::build(&list).unwrap();
            if let Some(f) = folded(&p) {
                prop_assert!(f.ranks < p.ranks);
                prop_assert_eq!(together(&f), together(&p));
                // So the rows of items met, which a folded problem keeps, hold.
                prop_assert_eq!(f.items().meeting_rows(u64::MAX), p.items().meeting_rows(u64::MAX));
                prop_assert_eq!(f.live().into_iter().max(), p.live().into_iter().max());
                prop_assert_eq!(f.peaks(), p.peak.clone());
                for i in 0..f.len() {
                    prop_assert!(!f.ivs(i).is_empty());
                    prop_assert!(f.ivs(i).windows(2).all(|w| w[0].1 < w[1].0), "intervals apart and in order");
                    prop_assert_eq!(f.hull[i], (f.ivs(i)[0].0, f.ivs(i).last().unwrap().1));
                }
            }
        }
    }
}
