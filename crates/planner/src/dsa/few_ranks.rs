//! The bound of a few ranks: the placement kept only at the ranks where the most bytes are
//! live, and placed there exactly (docs/planner.md, "The bound of a few ranks").

use std::cmp::Reverse;
use std::collections::HashSet;

use super::contiguity::{RankProfile, Work};
use super::*;

/// Ranks kept by [`Problem::few_ranks_bound`]: one more makes the search tens of times
/// longer on the stages it proves.
const FEW_RANKS: usize = 3;

/// Items live at a kept rank but not at all of them, past which the search is not tried
/// (at most 255).
const FEW_RANKS_MAX_ITEMS: usize = 64;

/// Kinds of those items (bytes, ranks) past which the search is not tried: eight to a word
/// of a state.
const FEW_RANKS_MAX_KINDS: usize = 32;

/// States the search remembers as refuted, at most (56 bytes each).
const FEW_RANKS_MAX_REFUTED: usize = 1 << 16;

impl Problem {
    /// A lower bound from the [`FEW_RANKS`] ranks with the most bytes live, one per distinct
    /// set of live items: every placement of the problem places the items live there, each
    /// at one offset at all of them, so the lowest footprint of those items alone at those
    /// ranks bounds it (each at its smallest member's bytes, [`Problem::wmin`]). Items live at
    /// every kept rank go below the others in some lowest placement (moving one down and
    /// the items under it up by its bytes keeps them apart: it is live with all of them),
    /// so they count as bytes; the others are searched exactly ([`FewRanks`]). Where alias
    /// groups are replayed by several slots, the groups live at two of the ranks must fit
    /// among those live at one, and whole bytes may not: a 1F1B stage whose three slots
    /// each peak at their own backward proves optimal this way where every clique is the
    /// bytes live at once. Items of one interval each never gain (with three ranks the
    /// items live at the middle rank can always be stacked, those of the first from below
    /// and of the last from above), so only problems with alias groups are searched.
    /// Returns the bound, or `floor` where it is not above it or the search runs out of
    /// work ([`FEW_RANKS_WORK`]). `profile`: [`Problem::rank_profile`].
    pub(super) fn few_ranks_bound(&self, floor: u64, profile: &RankProfile) -> u64 {
        let n = self.len();
        if n < 4 || (self.ranks as usize) < FEW_RANKS || self.ivs.len() == n {
            return floor;
        }
        let RankProfile { load, print } = profile;
        // The FEW_RANKS distinct sets of live items with the most bytes: (bytes, print, rank).
        let mut top: Vec<(i128, u64, u32)> = Vec::with_capacity(FEW_RANKS + 1);
        for t in 0..self.ranks as usize {
            if top.len() == FEW_RANKS && load[t] <= top[FEW_RANKS - 1].0
                || top.iter().any(|x| x.1 == print[t])
            {
                continue;
            }
            top.push((load[t], print[t], t as u32));
            top.sort_by_key(|x| Reverse(x.0));
            top.truncate(FEW_RANKS);
        }
        if top.len() < FEW_RANKS {
            return floor;
        }
        let mut ticks: Vec<u32> = top.iter().map(|x| x.2).collect();
        ticks.sort_unstable();
        let all = (1u64 << FEW_RANKS) - 1;
        let mut below = 0u64;
        let mut kinds: HashMap<(u64, u64), u8> = HashMap::new();
        let mut others = 0;
        for (i, live) in self.live_masks(&ticks) {
            if live == all {
                below += self.wmin[i];
            } else {
                others += 1;
                if others > FEW_RANKS_MAX_ITEMS {
                    return floor;
                }
                *kinds.entry((self.wmin[i], live)).or_default() += 1;
            }
        }
        if kinds.len() > FEW_RANKS_MAX_KINDS {
            return floor;
        }
        let mut kinds: Vec<((u64, u64), u8)> = kinds.into_iter().collect();
        // Largest first: the first placements found are low, and prune the rest.
        kinds.sort_unstable_by_key(|&((size, live), _)| (Reverse(size), live));
        let Some(lowest) = FewRanks::new(&kinds, floor.saturating_sub(below)).lowest(FEW_RANKS_WORK) else {
            return floor;
        };
        floor.max(below + lowest)
    }
}

/// The exact search of [`Problem::few_ranks_bound`]: items of a few kinds (bytes, ranks
/// live as bits, count), placed one at a time, each on the highest top among its ranks.
/// That reaches a lowest placement: sorted by offset, a lowest placement with every item
/// moved down as far as it fits (until none moves) has each item on the highest top of the
/// items before it at its ranks, and placing them in that order puts each there (by
/// induction, no higher). States — the tops at the ranks and the counts left — that the
/// search has left without a placement below the best found are remembered and not entered
/// again (the best only comes down, so they stay refuted). Pruned by the bytes each rank
/// still needs above its top.
struct FewRanks<'a> {
    kinds: &'a [((u64, u64), u8)],
    /// Items of each kind left, eight kinds to a word.
    left: [u64; FEW_RANKS_MAX_KINDS / 8],
    /// Items left in all.
    unplaced: usize,
    top: [u64; FEW_RANKS],
    need: [u64; FEW_RANKS],
    /// The lowest footprint found.
    best: u64,
    /// A footprint at or below which the search stops: no bound above the floor then.
    enough: u64,
    refuted: HashSet<State, KeyHashing>,
    work: Work,
}

/// A state of [`FewRanks`]: the tops at the ranks and the items of each kind left.
#[derive(PartialEq, Eq)]
struct State([u64; FEW_RANKS], [u64; FEW_RANKS_MAX_KINDS / 8]);

impl std::hash::Hash for State {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        // A word at a time (arrays of integers hash as bytes, one call each).
        for &w in self.0.iter().chain(&self.1) {
            h.write_u64(w);
        }
    }
}

/// Work of [`FewRanks`]: a unit per kind visited at each state. The stages it proves take
/// 0.7–2·10⁶ (about a millisecond per 10⁶ on one core of the 2-core VM).
pub(super) const FEW_RANKS_WORK: u64 = 2_500_000;

/// Where the search ended.
enum Ended {
    /// Every state was searched (or refuted).
    Searched,
    /// A placement at or below `enough`, or out of work.
    Stopped,
}

impl<'a> FewRanks<'a> {
    /// The search over `kinds` (at most [`FEW_RANKS_MAX_KINDS`] kinds of at most
    /// [`FEW_RANKS_MAX_ITEMS`] items in all).
    fn new(kinds: &'a [((u64, u64), u8)], enough: u64) -> FewRanks<'a> {
        let mut need = [0u64; FEW_RANKS];
        let mut left = [0u64; FEW_RANKS_MAX_KINDS / 8];
        for (j, &((size, live), count)) in kinds.iter().enumerate() {
            for (k, need) in need.iter_mut().enumerate() {
                if live >> k & 1 == 1 {
                    *need += size * count as u64;
                }
            }
            left[j / 8] += (count as u64) << (8 * (j % 8));
        }
        FewRanks {
            kinds,
            left,
            unplaced: kinds.iter().map(|k| k.1 as usize).sum(),
            top: [0; FEW_RANKS],
            need,
            best: u64::MAX,
            enough,
            refuted: HashSet::default(),
            work: Work::new(0),
        }
    }

    /// The lowest footprint of the items, or `None` where it is at most `enough` or the
    /// search ran out of `work`.
    fn lowest(mut self, work: u64) -> Option<u64> {
        self.work = Work::new(work);
        match self.search() {
            Ended::Searched if self.best > self.enough => Some(self.best),
            _ => None,
        }
    }

    fn search(&mut self) -> Ended {
        if !self.work.charge(self.kinds.len() as u64) {
            return Ended::Stopped;
        }
        let reach = (0..FEW_RANKS).map(|k| self.top[k] + self.need[k]).max().unwrap_or(0);
        if reach >= self.best {
            return Ended::Searched;
        }
        if self.unplaced == 0 {
            self.best = reach;
            return if reach <= self.enough { Ended::Stopped } else { Ended::Searched };
        }
        let key = State(self.top, self.left);
        if self.refuted.contains(&key) {
            return Ended::Searched;
        }
        for (j, &((size, live), _)) in self.kinds.iter().enumerate() {
            let (word, shift) = (j / 8, 8 * (j % 8));
            if self.left[word] >> shift & 0xff == 0 {
                continue;
            }
            let ranks = || (0..FEW_RANKS).filter(move |&k| live >> k & 1 == 1);
            let at = ranks().map(|k| self.top[k]).max().unwrap_or(0);
            let (top, need) = (self.top, self.need);
            for k in ranks() {
                self.top[k] = at + size;
                self.need[k] -= size;
            }
            self.left[word] -= 1 << shift;
            self.unplaced -= 1;
            let ended = self.search();
            self.left[word] += 1 << shift;
            self.unplaced += 1;
            (self.top, self.need) = (top, need);
            if let Ended::Stopped = ended {
                return Ended::Stopped;
            }
        }
        if self.refuted.len() < FEW_RANKS_MAX_REFUTED {
            self.refuted.insert(key);
        }
        Ended::Searched
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    /// Three slots' backwards, at three ranks: each needs 8 MiB of its own, contiguous, and
    /// each slot keeps a 2 MiB group live at the other two slots' backwards. 12 MiB are live
    /// at each and every clique weighs at most 12 MiB; but the three groups are pairwise
    /// apart, and each backward's 8 MiB need a run beside two of them with no byte to spare:
    /// {0, 2}, {0, 10} or {8, 10} MiB for the two groups, which no three offsets give in all
    /// three pairs. With 14 MiB, offsets 0, 2 and 4 MiB do.
    fn three_backwards() -> Vec<Buffer> {
        let mut b = Vec::new();
        for slot in 0..3u64 {
            b.push(Buffer { start: 10 * slot, end: 10 * slot + 1, size: 8 * MIB, group: None });
            for other in (0..3).filter(|&s| s != slot) {
                b.push(Buffer {
                    start: 10 * other,
                    end: 10 * other + 1,
                    size: 2 * MIB,
                    group: Some(slot as u32),
                });
            }
        }
        b
    }

    #[test]
    fn three_backwards_need_more_than_their_bytes() {
        let b = three_backwards();
        let p = Problem::build(&b).unwrap();
        assert_eq!(p.lower_bound(), 12 * MIB);
        assert_eq!(p.alias_bound(), 12 * MIB);
        assert_eq!(p.few_ranks_bound_of_its_ranks(12 * MIB), 14 * MIB);
        let placed = place(&b, &uncapped(Duration::from_millis(200))).unwrap();
        assert_eq!((placed.footprint, placed.lower_bound), (14 * MIB, 14 * MIB));
    }

    #[test]
    fn the_floor_stands_where_the_search_runs_out_or_finds_nothing_above_it() {
        let p = Problem::build(&three_backwards()).unwrap();
        assert_eq!(p.few_ranks_bound_of_its_ranks(15 * MIB), 15 * MIB);
        // Two of 5 bytes at ranks 0 and 1, 3 bytes at 1 and 2, 4 bytes at 0 and 2: all four
        // pairwise live together, 17 bytes. Out of work there is no claim.
        let kinds = [((5, 0b011), 2), ((3, 0b110), 1), ((4, 0b101), 1)];
        assert_eq!(FewRanks::new(&kinds, 0).lowest(1), None);
        assert_eq!(FewRanks::new(&kinds, 0).lowest(1 << 20), Some(17));
        assert_eq!(FewRanks::new(&kinds, 17).lowest(1 << 20), None);
    }

    impl Problem {
        fn few_ranks_bound_of_its_ranks(&self, floor: u64) -> u64 {
            self.few_ranks_bound(floor, &self.rank_profile())
        }
    }

    /// The optimum of `p` by the exact search (small problems).
    fn optimum(p: &Problem) -> u64 {
        let off = exact(p, 0, u64::MAX).expect("a placement");
        (0..p.len()).map(|i| off[i] + p.size[i]).max().unwrap_or(0)
    }

    /// The buffers of `raw` (start, length, size index, group) with sizes from `sizes`, a
    /// group's members all of its own size from `group_sizes`.
    fn buffers(raw: &[(u64, u64, usize, Option<u32>)], sizes: &[u64], group_sizes: &[u64]) -> Vec<Buffer> {
        raw.iter()
            .map(|&(start, len, z, g)| {
                let size = g.map_or(sizes[z], |g| group_sizes[g as usize]);
                Buffer { start, end: start + len, size, group: g }
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Never above the optimum.
        #[test]
        fn few_ranks_bound_is_at_most_the_optimum(
            raw in prop::collection::vec((0u64..8, 1u64..4, 0usize..6, prop::option::of(0u32..4)), 2..12),
            sizes in prop::collection::vec(1u64..40, 6),
            group_sizes in prop::collection::vec(1u64..40, 4),
        ) {
            let p = Problem::build(&buffers(&raw, &sizes, &group_sizes)).unwrap();
            prop_assume!(p.len() <= EXACT_MAX_ITEMS);
            let opt = optimum(&p);
            prop_assert!(p.few_ranks_bound_of_its_ranks(0) <= opt, "bound {} above the optimum {}", p.few_ranks_bound_of_its_ranks(0), opt);
        }

        /// The optimum itself where items are live at three ranks only, of three sets of live
        /// items, and every member of a group has its group's bytes.
        #[test]
        fn few_ranks_bound_of_three_ranks_is_the_optimum(
            raw in prop::collection::vec((0u64..3, 0usize..6, prop::option::of(0u32..4)), 4..12),
            sizes in prop::collection::vec(1u64..40, 6),
            group_sizes in prop::collection::vec(1u64..40, 4),
        ) {
            // Steps 0, 2 and 4: a group live at two of them has two intervals.
            let raw: Vec<_> = raw.iter().map(|&(t, z, g)| (2 * t, 1, z, g)).collect();
            let p = Problem::build(&buffers(&raw, &sizes, &group_sizes)).unwrap();
            let RankProfile { load, print } = p.rank_profile();
            let mut live: Vec<u64> = (0..p.ranks as usize).filter(|&t| load[t] > 0).map(|t| print[t]).collect();
            live.sort_unstable();
            live.dedup();
            prop_assume!(live.len() == 3 && p.ivs.len() > p.len() && p.len() >= 4);
            prop_assume!(p.len() <= EXACT_MAX_ITEMS);
            prop_assert_eq!(p.few_ranks_bound_of_its_ranks(0), optimum(&p));
        }
    }
}
