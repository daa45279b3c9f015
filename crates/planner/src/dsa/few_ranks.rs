//! The bound of a few ranks: the placement kept only at the three ranks where the most bytes
//! are live, and placed there exactly (docs/planner.md, "The bound of a few ranks").

use std::cmp::Reverse;
use std::collections::HashSet;

use super::contiguity::{RankProfile, Work};
use super::*;

/// Ranks kept: three, where the items live at two of them lie one above the other
/// ([`ThreeRanks`]).
const RANKS: usize = 3;

/// Items live at exactly one of the three ranks, at one rank, past which the search is not
/// tried: the search enumerates their subsets.
const MAX_SINGLES: usize = 8;

/// Items live at exactly two of the three ranks past which the search is not tried.
const MAX_PAIRS: usize = 64;

/// Kinds of those items (bytes, ranks) past which the search is not tried: eight to a word
/// of a state.
const MAX_PAIR_KINDS: usize = 32;

/// States the search remembers as refuted, at most (72 bytes each: at most ~5.5 MB with the
/// table's own, freed when the search ends).
const MAX_REFUTED: usize = 1 << 16;

/// Work of [`ThreeRanks`]: a unit per choice of what goes below a pair (~12 ns each on the
/// 2-core VM). Of the bounds it raised in `--example schedules -- inputs 300 200` the
/// costliest took 1.0·10⁶ (8 ms).
pub(super) const FEW_RANKS_WORK: u64 = 1_200_000;

impl Problem {
    /// A lower bound from the three ranks with the most bytes live, one per distinct
    /// set of live items: every placement of the problem places the items live there, each
    /// at one offset at all of them, so the lowest footprint of those items alone at those
    /// ranks bounds it (each at its smallest member's bytes, [`Problem::wmin`]). Items live at
    /// every kept rank go below the others in some lowest placement (moving one down and
    /// the items under it up by its bytes keeps them apart: it is live with all of them),
    /// so they count as bytes; the others are searched exactly ([`ThreeRanks`]). Where alias
    /// groups replayed by several slots are live at two of the ranks, the items live at one
    /// must fit whole into the rooms those leave, which bytes alone do not see: 1F1B stages
    /// whose three slots each peak at their own backward prove optimal this way where every
    /// clique weighs the bytes live at once. Items of one interval each never gain (with three ranks the
    /// items live at the middle rank can always be stacked, those of the first from below
    /// and of the last from above), so only problems with alias groups are searched.
    /// Returns the bound, or `floor` where it is not above it or the search runs out of
    /// work ([`FEW_RANKS_WORK`]). `profile`: [`Problem::rank_profile`].
    pub(super) fn few_ranks_bound(&self, floor: u64, profile: &RankProfile) -> u64 {
        let n = self.len();
        if n < 4 || (self.ranks as usize) < RANKS || self.ivs.len() == n {
            return floor;
        }
        let RankProfile { load, print } = profile;
        // The RANKS distinct sets of live items with the most bytes: (bytes, print, rank).
        let mut top: Vec<(i128, u64, u32)> = Vec::with_capacity(RANKS + 1);
        for t in 0..self.ranks as usize {
            if (top.len() == RANKS && load[t] <= top[RANKS - 1].0) || top.iter().any(|x| x.1 == print[t]) {
                continue;
            }
            top.push((load[t], print[t], t as u32));
            top.sort_by_key(|x| Reverse(x.0));
            top.truncate(RANKS);
        }
        if top.len() < RANKS {
            return floor;
        }
        let mut ticks: Vec<u32> = top.iter().map(|x| x.2).collect();
        ticks.sort_unstable();
        let mut below = 0u64;
        let mut singles: [Vec<u64>; 3] = Default::default();
        let mut pairs: HashMap<(u64, u64), u8> = HashMap::new();
        let mut pair_count = 0;
        for (i, live) in self.live_masks(&ticks) {
            let w = self.wmin[i];
            match live.count_ones() {
                3 => below += w,
                1 => singles[live.trailing_zeros() as usize].push(w),
                _ => {
                    pair_count += 1;
                    *pairs.entry((w, live)).or_default() += 1;
                }
            }
        }
        if singles.iter().any(|s| s.len() > MAX_SINGLES)
            || pair_count > MAX_PAIRS
            || pairs.len() > MAX_PAIR_KINDS
        {
            return floor;
        }
        let mut pairs: Vec<((u64, u64), u8)> = pairs.into_iter().collect();
        // Largest first: the first placements found are low, and prune the rest.
        pairs.sort_unstable_by_key(|&((size, live), _)| (Reverse(size), live));
        let search = ThreeRanks::new(&singles, &pairs, floor.saturating_sub(below));
        match search.lowest(FEW_RANKS_WORK) {
            Some(lowest) => floor.max(below + lowest),
            None => floor,
        }
    }
}

/// The exact search of [`Problem::few_ranks_bound`] over three ranks. An item live at two
/// of them (a *pair*) meets every other pair at a rank both are live at, so the pairs lie
/// one above the other; an item live at one (a *single*) fills a *room* of its rank: the
/// bytes between two pairs live there (pairs live elsewhere do not bound it), or below the
/// first, or above the last. The search places the pairs from the bottom up, each choosing
/// which singles of its two ranks go into the rooms it closes; it sits as low as the pair
/// below it and those singles, stacked, allow. A lowest placement is reached so: sorted
/// by offset, its pairs can each be moved down to there (the singles below repacked from
/// the room's floor) without rising elsewhere. A room keeps no single out that would still
/// fit (placing it there leaves the rest the same room later; so rooms not filled as far
/// as they can be are not tried). States — the top of the last pair, where each rank's room
/// begins, the singles and pairs left — that the search has left without a placement below
/// the best found are remembered and not entered again (the best only comes down).
/// Pruned by the pairs' bytes above the last pair and, at each rank, the bytes still live
/// there above its room's floor.
struct ThreeRanks<'a> {
    /// Bytes of each subset of a rank's singles (bits as in `singles`).
    sum: [Vec<u64>; 3],
    /// The smallest single of each subset (`u64::MAX` for none).
    least: [Vec<u64>; 3],
    /// Kinds of pairs: (bytes, ranks as bits), count.
    pairs: &'a [((u64, u64), u8)],
    /// Pairs of each kind left, eight kinds to a word.
    left: [u64; MAX_PAIR_KINDS / 8],
    /// Bytes of the pairs left, in all and live at each rank.
    pair_bytes: u64,
    pair_bytes_at: [u64; 3],
    /// Singles left at each rank, as bits.
    free: [u32; 3],
    /// The top of the last pair placed.
    top: u64,
    /// Where each rank's room begins: the top of the last pair live there.
    floor: [u64; 3],
    /// The lowest footprint found.
    best: u64,
    /// A footprint at or below which the search stops: no bound above the floor then.
    enough: u64,
    refuted: HashSet<State, KeyHashing>,
    work: Work,
}

/// Where [`ThreeRanks`] ended.
enum Ended {
    /// Every state was searched (or refuted).
    Searched,
    /// A placement at or below `enough`, or out of work.
    Stopped,
}

/// A state of [`ThreeRanks`]: the top of the last pair, the rooms' floors, the singles left
/// (eight bits a rank) and the pairs left.
#[derive(PartialEq, Eq)]
struct State(u64, [u64; 3], u32, [u64; MAX_PAIR_KINDS / 8]);

impl std::hash::Hash for State {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        // A word at a time (arrays of integers hash as bytes, one call each).
        h.write_u64(self.0);
        h.write_u32(self.2);
        for &w in self.1.iter().chain(&self.3) {
            h.write_u64(w);
        }
    }
}

impl<'a> ThreeRanks<'a> {
    /// The search over `singles` (at most [`MAX_SINGLES`] a rank) and `pairs` (at most
    /// [`MAX_PAIR_KINDS`] kinds), stopping at a footprint of `enough`.
    fn new(singles: &'a [Vec<u64>; 3], pairs: &'a [((u64, u64), u8)], enough: u64) -> ThreeRanks<'a> {
        let subsets = |k: usize, f: &dyn Fn(u64, u64) -> u64, empty: u64| -> Vec<u64> {
            let mut out = vec![empty; 1 << singles[k].len()];
            for bits in 1..out.len() {
                let j = bits.trailing_zeros() as usize;
                out[bits] = f(out[bits & (bits - 1)], singles[k][j]);
            }
            out
        };
        let sum = [0, 1, 2].map(|k| subsets(k, &|a, b| a + b, 0));
        let least = [0, 1, 2].map(|k| subsets(k, &|a, b| a.min(b), u64::MAX));
        let mut left = [0u64; MAX_PAIR_KINDS / 8];
        let (mut pair_bytes, mut pair_bytes_at) = (0, [0u64; 3]);
        for (j, &((size, live), count)) in pairs.iter().enumerate() {
            left[j / 8] += (count as u64) << (8 * (j % 8));
            pair_bytes += size * count as u64;
            for (k, at) in pair_bytes_at.iter_mut().enumerate() {
                if live >> k & 1 == 1 {
                    *at += size * count as u64;
                }
            }
        }
        ThreeRanks {
            sum,
            least,
            pairs,
            left,
            pair_bytes,
            pair_bytes_at,
            free: [0, 1, 2].map(|k| (1u32 << singles[k].len()) - 1),
            top: 0,
            floor: [0; 3],
            best: u64::MAX,
            enough,
            refuted: HashSet::default(),
            work: Work::new(0),
        }
    }

    /// The lowest footprint, or `None` where it is at most `enough` or the search ran out
    /// of `work`.
    fn lowest(mut self, work: u64) -> Option<u64> {
        self.work = Work::new(work);
        match self.search() {
            Ended::Searched if self.best > self.enough => Some(self.best),
            _ => None,
        }
    }

    /// Whether no single of rank `k` left out of `chosen` fits in `room` beside them.
    fn filled(&self, k: usize, chosen: u32, room: u64) -> bool {
        self.least[k][(self.free[k] & !chosen) as usize] > room - self.sum[k][chosen as usize]
    }

    fn search(&mut self) -> Ended {
        let singles_at = |k: usize| self.sum[k][self.free[k] as usize];
        let reach = (0..3)
            .map(|k| self.floor[k] + singles_at(k) + self.pair_bytes_at[k])
            .fold(self.top + self.pair_bytes, u64::max);
        if reach >= self.best {
            return Ended::Searched;
        }
        if self.pair_bytes == 0 {
            // The singles left stack in their ranks' last rooms.
            self.best = reach;
            return if reach <= self.enough { Ended::Stopped } else { Ended::Searched };
        }
        let key = State(self.top, self.floor, self.free.iter().rev().fold(0, |w, &f| w << 8 | f), self.left);
        if self.refuted.contains(&key) {
            return Ended::Searched;
        }
        for (j, &((size, live), _)) in self.pairs.iter().enumerate() {
            let (word, shift) = (j / 8, 8 * (j % 8));
            if self.left[word] >> shift & 0xff == 0 {
                continue;
            }
            let a = live.trailing_zeros() as usize;
            let b = (live & (live - 1)).trailing_zeros() as usize;
            let (free_a, free_b) = (self.free[a], self.free[b]);
            // Every subset of each rank's singles left, the empty one last.
            let mut below_a = free_a;
            loop {
                let mut below_b = free_b;
                loop {
                    if !self.work.charge(1) {
                        return Ended::Stopped;
                    }
                    let at = self
                        .top
                        .max(self.floor[a] + self.sum[a][below_a as usize])
                        .max(self.floor[b] + self.sum[b][below_b as usize]);
                    if at + size < self.best
                        && self.filled(a, below_a, at - self.floor[a])
                        && self.filled(b, below_b, at - self.floor[b])
                    {
                        let saved = (self.top, self.floor);
                        self.top = at + size;
                        (self.floor[a], self.floor[b]) = (at + size, at + size);
                        (self.free[a], self.free[b]) = (free_a & !below_a, free_b & !below_b);
                        self.left[word] -= 1 << shift;
                        self.pair_bytes -= size;
                        self.pair_bytes_at[a] -= size;
                        self.pair_bytes_at[b] -= size;
                        let ended = self.search();
                        self.pair_bytes_at[a] += size;
                        self.pair_bytes_at[b] += size;
                        self.pair_bytes += size;
                        self.left[word] += 1 << shift;
                        (self.free[a], self.free[b]) = (free_a, free_b);
                        (self.top, self.floor) = saved;
                        if let Ended::Stopped = ended {
                            return Ended::Stopped;
                        }
                    }
                    if below_b == 0 {
                        break;
                    }
                    below_b = (below_b - 1) & free_b;
                }
                if below_a == 0 {
                    break;
                }
                below_a = (below_a - 1) & free_a;
            }
        }
        if self.refuted.len() < MAX_REFUTED {
            self.refuted.insert(key);
        }
        Ended::Searched
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::schedule_buffers;
    use crate::pipeline::specs::{layer, tensor};
    use crate::{Schedule, SchedulePlanInput};
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
        // Two of 5 bytes at ranks 0 and 1, 4 bytes at 0 and 2, 3 bytes at 1 and 2: all four
        // pairwise live together, 17 bytes. Out of work there is no claim.
        let pairs = [((5, 0b011), 2), ((4, 0b101), 1), ((3, 0b110), 1)];
        let none: [Vec<u64>; 3] = Default::default();
        assert_eq!(ThreeRanks::new(&none, &pairs, 0).lowest(1), None);
        assert_eq!(ThreeRanks::new(&none, &pairs, 0).lowest(1 << 20), Some(17));
        assert_eq!(ThreeRanks::new(&none, &pairs, 17).lowest(1 << 20), None);
        // A single of 6 bytes at rank 2 fits below the 4 and the 3 there.
        let singles: [Vec<u64>; 3] = [vec![], vec![], vec![6]];
        assert_eq!(ThreeRanks::new(&singles, &pairs, 0).lowest(1 << 20), Some(17));
    }

    impl Problem {
        fn few_ranks_bound_of_its_ranks(&self, floor: u64) -> u64 {
            self.few_ranks_bound(floor, &self.rank_profile())
        }
    }

    /// A 1F1B stage (pp 8, rank 5, M 8: three slots) whose layers take several inputs and
    /// give several outputs. Every clique weighs the bytes live at once, which no placement
    /// reaches: at each slot's backward its own 64, 32 and 149 MiB need whole rooms among
    /// the other two slots' kept inputs. The bound of a few ranks is 1.003 × the bytes, and
    /// the plan reaches it.
    #[test]
    fn a_stage_whose_slots_peak_at_their_own_backwards_is_proved_optimal() {
        let spec = |l, inputs, outputs, bytes| layer(0, l, inputs, outputs, bytes);
        let t = tensor;
        let layers = vec![
            spec(
                0,
                vec![
                    t("hidden", &[4, 8192, 1024], "bf16", false),
                    t("mask", &[1024, 2, 2048], "bf16", true),
                    t("ids", &[4, 4096], "i64", false),
                ],
                vec![t("hidden", &[1, 2048, 8192], "f32", false)],
                [0, 110120436, 260846762],
            ),
            spec(
                1,
                vec![t("hidden", &[2048, 1, 8192], "f32", true)],
                vec![t("hidden", &[4096, 2, 2048], "bf16", false)],
                [247989180, 16777216, 156237824],
            ),
            spec(
                2,
                vec![t("hidden", &[2048, 4096], "bf16", true)],
                vec![t("hidden", &[4096, 2, 2048], "bf16", false)],
                [12886974, 102321885, 134217728],
            ),
        ];
        let input = SchedulePlanInput {
            schedule: Schedule::OneFOneB { pp_size: 8, pp_rank: 5, num_microbatches: 8 },
            layers,
        };
        let buffers = schedule_buffers(&input).unwrap().buffers;
        let p = Problem::build(&buffers).unwrap();
        let live = p.lower_bound();
        assert_eq!(p.alias_bound().max(p.contiguity_bound(&p.rank_profile())), live);
        let bound = p.bound();
        assert!(bound as f64 > 1.0029 * live as f64, "{bound} against {live}");
        let placed = place(&buffers, &uncapped(Duration::from_secs(30))).unwrap();
        verify(&buffers, &placed.offsets).unwrap();
        assert_eq!((placed.lower_bound, placed.footprint), (bound, bound), "{}", placed.strategy);
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
