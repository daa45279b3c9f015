//! The contiguity bound: alias groups replayed by several slots keep one offset, so an item
//! live at one tick must find a contiguous interval among the bytes the groups live across
//! the ticks leave it (docs/planner.md, "Workspaces that differ between layers").

use super::*;

impl Problem {
    /// A lower bound that sees contiguity across ticks (alias groups replayed by several
    /// slots; see docs/planner.md, "Workspaces that differ between layers"). Any set F of
    /// ranks gives one (at most 64; tried: the ranks at or near the most bytes live, one
    /// per distinct set of live items, and of those one per largest live item; then each
    /// with ranks dropped, [`Problem::contiguity_bound_pruned`]).
    /// *Shared* items are live at all of F but at most one rank: any two of them are live
    /// together, so their smallest members' bytes are disjoint — call the rest of `[0, C)`
    /// R, `|R| = C − Σ shared`. An item live at exactly one rank `t` of F needs a contiguous
    /// interval at `t` that avoids every shared item live at `t`, so it lies in R plus the
    /// shared items *missing* `t` (`y_t` bytes). Take ranks whose such items are at least
    /// `W` bytes (and `W`-byte sub-intervals J of them). Two J share only bytes of R (no
    /// shared item misses two ranks), so if three, sorted by left end, had the first meet
    /// the third, the middle one would lie within them, hence in R. Unless some J lies
    /// wholly in R, then, every other J is apart from the rest, each holding `W − y` bytes of
    /// R ([`Pattern::alternate_runs`]: `2W − y₁ − y₂` for three ranks). So `C ≥ Σ shared +
    /// min(W, those runs)`. A rank's *escorts* ([`Problem::escorts`], `e` bytes at each of
    /// the ranks) lie in R beside its J, so a J in R needs `W + e` bytes of R:
    /// `C ≥ Σ shared + min(W + e, runs)`. A J wholly in R makes a run of R of `W` bytes,
    /// which a second set of ranks whose shared items are among the first's (its R holds
    /// the first's) may find too little ([`Pattern::beside_run`]): the bound is then the
    /// lesser of the two sets' ([`Problem::run_then_beside`]). Where a single shared item
    /// is missing at each of k ranks, the argument in [`Problem::pattern_bound`] gives
    /// `Σ shared + min(W, the ⌈k/2⌉ smallest shortfalls)`, and a run of R borders at most two
    /// ranks' missing shared items ([`Problem::bordering_runs`]). Returns the best such
    /// bound, or 0. `profile`: [`Problem::rank_profile`].
    pub(super) fn contiguity_bound(&self, profile: &RankProfile) -> u64 {
        let n = self.len();
        let r = self.ranks as usize;
        // Items of one interval can only miss the first or the last rank of F, so every
        // bound here is at most the bytes live at a rank in between: skipped.
        if n < 4 || r < 3 || self.ivs.len() == n {
            return 0;
        }
        let RankProfile { load, print } = profile;
        let peak = load[..r].iter().copied().max().unwrap_or(0);
        // The ranks within a few percent of the peak, one per distinct set of live items
        // (any set of ranks gives a valid bound; those near the peak the strongest).
        let mut best = 0;
        let mut last: Vec<u32> = Vec::new();
        let mut pruning = Work::new(CONTIGUITY_PRUNE_WORK);
        let mut patterns: Vec<Pattern> = Vec::new();
        for slack in [0, 64, 32, 16] {
            let floor = if slack == 0 { peak } else { peak - peak / slack };
            let ticks = ranks_at_least(load, print, floor, 0..r);
            if ticks.len() < 3 || ticks == last {
                continue;
            }
            let live = self.live_masks(&ticks);
            // One rank per largest item: a group replayed at several of the ranks (a slot
            // used by several microbatches) is live at one only.
            let kept = self.one_per_largest(&live, ticks.len());
            let spread: Vec<(usize, u64)> =
                live.iter().map(|&(i, l)| (i, compact(l, kept))).filter(|&(_, l)| l != 0).collect();
            for start in [self.pattern(live, ticks.len()), self.pattern(spread, kept.count_ones() as usize)] {
                let (bound, strongest) = self.contiguity_bound_pruned(&start, &mut pruning);
                best = best.max(bound);
                patterns.push(start);
                patterns.extend(strongest);
            }
            last = ticks;
        }
        let best = best.max(self.largest_starts_bound(load, print, peak));
        best.max(self.run_then_beside(&patterns, best, &mut pruning))
    }

    /// [`Problem::contiguity_bound`] of the ranks within 1/16 of the `peak` where an item of
    /// the largest size starts (one per distinct set of live items, at most 64), with ranks
    /// dropped ([`Problem::contiguity_bound_pruned`], on a budget of its own,
    /// [`LARGEST_STARTS_WORK`]). In a 1F1B stage these are each slot's forward that writes
    /// its largest output and the backward that writes the largest gradient; dropping the
    /// backwards leaves one forward per slot, where the other slots' kept blocks are shared
    /// items and each forward's output needs a run beside the bytes its own slot freed. The
    /// sets of ranks near the peak hold every step there, and dropping ranks from them did
    /// not reach that set (docs/planner.md, "The slots' forwards as ranks of the contiguity
    /// bound"). The first of each run of adjacent such ranks is a second start, on a budget
    /// of [`CONTIGUITY_PRUNE_WORK`]. Returns 0 where fewer than three such ranks are.
    fn largest_starts_bound(&self, load: &[i128], print: &[u64], peak: i128) -> u64 {
        let r = self.ranks as usize;
        let Some(&largest) = self.wmin.iter().max() else { return 0 };
        let mut starts = vec![false; r];
        for i in (0..self.len()).filter(|&i| self.wmin[i] == largest) {
            for &(s, _) in self.ivs(i) {
                starts[s as usize] = true;
            }
        }
        let ticks = ranks_at_least(load, print, peak - peak / 16, (0..r).filter(|&t| starts[t]));
        if ticks.len() < 3 {
            return 0;
        }
        let bound = |ticks: &[u32], work: u64| {
            let start = self.pattern(self.live_masks(ticks), ticks.len());
            self.contiguity_bound_pruned(&start, &mut Work::new(work)).0
        };
        // Ranks next to each other hold nearly the same items: where both are in the set,
        // what one of them lacks is missing at two ranks, neither shared nor own. The first
        // of each run of adjacent ranks is a second start, with a budget of its own
        // (an interleaved stage's slots reach their bound from it; dropping ranks from all of
        // them did not, even with 40 times the work: docs/planner.md, "The first of adjacent
        // ranks, a second start").
        let firsts: Vec<u32> = ticks
            .iter()
            .enumerate()
            .filter(|&(k, &t)| k == 0 || ticks[k - 1] + 1 != t)
            .map(|(_, &t)| t)
            .collect();
        if firsts.len() < 3 || firsts.len() == ticks.len() {
            return bound(&ticks, LARGEST_STARTS_WORK);
        }
        bound(&ticks, LARGEST_STARTS_WORK).max(bound(&firsts, CONTIGUITY_PRUNE_WORK))
    }

    /// Bytes live at every rank and a fingerprint of the set of items live there.
    pub(super) fn rank_profile(&self) -> RankProfile {
        let r = self.ranks as usize;
        let mut load = vec![0i128; r + 1];
        let mut print = vec![0u64; r + 1];
        for i in 0..self.len() {
            // A mixed hash (a linear one makes sets with equal sums of indices collide).
            let mut h = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            h ^= h >> 31;
            for &(s, e) in self.ivs(i) {
                load[s as usize] += self.size[i] as i128;
                load[e as usize] -= self.size[i] as i128;
                print[s as usize] = print[s as usize].wrapping_add(h);
                print[e as usize] = print[e as usize].wrapping_sub(h);
            }
        }
        for t in 1..=r {
            load[t] += load[t - 1];
            print[t] = print[t].wrapping_add(print[t - 1]);
        }
        RankProfile { load, print }
    }

    /// The bound of one set of ranks that forces a run of R and of another that then needs
    /// more ([`Problem::contiguity_bound`]), over pairs of `patterns` (a pair may be one
    /// pattern twice) whose first's shared items include the second's, where it can beat
    /// `best`. Subset tests and the second's escorts charge `work`.
    fn run_then_beside(&self, patterns: &[Pattern], best: u64, work: &mut Work) -> u64 {
        let mut bound = best;
        let mut escorts: Vec<Option<Vec<u64>>> = vec![None; patterns.len()];
        for f in patterns {
            let mut widths: Vec<u64> = f.own.iter().map(|&(w, _)| w).filter(|&w| w > 0).collect();
            widths.sort_unstable();
            widths.dedup();
            for (b_at, b) in patterns.iter().enumerate() {
                if f.shared_bytes < b.shared_bytes || !work.charge((f.shared.len() + b.shared.len()) as u64) {
                    continue;
                }
                if !includes(&f.shared, &b.shared) {
                    continue;
                }
                for &w in &widths {
                    let Some(runs) = f.alternate_runs(w, 0, None) else { continue };
                    // Without escorts first: with them the bound can only be lower.
                    let Some(beside) = b.beside_run(w, None) else { continue };
                    if (f.shared_bytes + runs).min(b.shared_bytes + beside) <= bound {
                        continue;
                    }
                    let e = escorts[b_at].get_or_insert_with(|| {
                        let ranks = (0..b.m).filter(|&k| b.own[k].0 > 0).fold(0u64, |bits, k| bits | 1 << k);
                        self.escorts(&b.live, ranks, &b.own, &b.absent, work)
                    });
                    if let Some(beside) = b.beside_run(w, Some(e)) {
                        bound = bound.max((f.shared_bytes + runs).min(b.shared_bytes + beside));
                    }
                }
            }
        }
        bound
    }

    /// The bound of `start` ([`Problem::pattern_bound`]), then of fewer of its ranks. Any
    /// set of ranks gives a valid bound, and fewer can give a stronger one: an item missing
    /// at two ranks is shared once one of them goes (a slot's forward and backward
    /// workspaces near the peak, each beside the same saved buffer missing there, spoil
    /// each other's pattern). So while some item is missing at exactly two ranks, one of the
    /// ranks where such an item is missing goes — the one whose drop gives the highest
    /// bound, then the most shared bytes — down to three. The start and each set kept are
    /// also bounded by [`Problem::bordering_runs`] (not every set tried: it cost the
    /// interleaved stage of `cargo bench -- lower_bound/` 4 ms more, 16.6 against 12.8 ms).
    /// Returns the best bound seen and, when a drop raised it, the pattern where it was
    /// first reached. The first bound looks for escorts with a budget of its own
    /// ([`ALIAS_BOUND_WORK`]); the drops charge `pruning` an item visit per item live at the
    /// ranks and a step per pair of ranks, for every set tried, and their escorts' conflict
    /// tests, and stop when it is spent.
    fn contiguity_bound_pruned(&self, start: &Pattern, pruning: &mut Work) -> (u64, Option<Pattern>) {
        let mut best =
            self.bordering_runs(start, self.pattern_bound(start, &mut Work::new(ALIAS_BOUND_WORK)));
        let mut strongest: Option<Pattern> = None;
        let mut current = start.clone();
        // Bits without bit `k`: the ranks above it move down one.
        let drop = |l: u64, k: usize| (l & ((1 << k) - 1)) | (l.checked_shr(k as u32 + 1).unwrap_or(0) << k);
        'drops: while current.m > 3 {
            let m = current.m;
            let all = u64::MAX >> (64 - m);
            let candidates = current
                .live
                .iter()
                .filter(|&&(_, l)| l.count_ones() as usize + 2 == m)
                .fold(0u64, |bits, &(_, l)| bits | (!l & all));
            let mut step: Option<((u64, u64), Pattern)> = None;
            for k in (0..m).filter(|&k| candidates >> k & 1 == 1) {
                if !pruning.charge((current.live.len() + m * m) as u64) {
                    break 'drops;
                }
                let without = self.pattern(
                    current.live.iter().map(|&(i, l)| (i, drop(l, k))).filter(|&(_, l)| l != 0).collect(),
                    m - 1,
                );
                let value = (self.pattern_bound(&without, pruning), without.shared_bytes);
                if step.as_ref().is_none_or(|(v, _)| value > *v) {
                    step = Some((value, without));
                }
            }
            let Some(((bound, _), next)) = step else { break };
            let bound = self.bordering_runs(&next, bound);
            if bound > best {
                best = bound;
                strongest = Some(next.clone());
            }
            current = next;
        }
        (best, strongest)
    }

    /// The items live at some rank of `ticks` (ascending, at most 64), each with the ranks
    /// where it is live, as bits.
    pub(super) fn live_masks(&self, ticks: &[u32]) -> Vec<(usize, u64)> {
        (0..self.len())
            .map(|i| {
                let mut live = 0u64;
                for &(s, e) in self.ivs(i) {
                    for k in ticks.partition_point(|&t| t < s)..ticks.partition_point(|&t| t < e) {
                        live |= 1 << k;
                    }
                }
                (i, live)
            })
            .filter(|&(_, live)| live != 0)
            .collect()
    }

    /// Of `m` ranks (`live`: [`Problem::live_masks`]), those whose largest live item is live
    /// at no other rank kept, as bits.
    fn one_per_largest(&self, live: &[(usize, u64)], m: usize) -> u64 {
        // For every rank, the wmin and item of its largest live item, and that item's bits.
        let mut largest: Vec<(u64, usize, u64)> = vec![(0, usize::MAX, 0); m];
        for &(i, l) in live {
            for (_, x) in largest.iter_mut().enumerate().filter(|&(k, _)| l >> k & 1 == 1) {
                if (self.wmin[i], i) > (x.0, x.1) {
                    *x = (self.wmin[i], i, l);
                }
            }
        }
        let mut kept = 0u64;
        for k in 0..m {
            let (_, i, bits) = largest[k];
            if i == usize::MAX || bits & kept != 0 {
                continue;
            }
            if (0..m).any(|j| kept >> j & 1 == 1 && largest[j].2 >> k & 1 == 1) {
                continue;
            }
            kept |= 1 << k;
        }
        kept
    }

    /// `live` (items with the ranks of a set where they are live, as bits; `m` ranks) sorted
    /// into the kinds the contiguity bound reasons about.
    fn pattern(&self, live: Vec<(usize, u64)>, m: usize) -> Pattern {
        let mut p = Pattern {
            m,
            shared: Vec::new(),
            shared_bytes: 0,
            missing: vec![0; m],
            absent: vec![Vec::new(); m],
            own: vec![(0, usize::MAX); m],
            live: Vec::new(),
        };
        if m < 3 {
            return p;
        }
        for &(i, bits) in &live {
            let count = bits.count_ones() as usize;
            if count + 1 >= m {
                p.shared.push(i);
                p.shared_bytes += self.wmin[i];
                if count + 1 == m {
                    let absent = (0..m).find(|&k| bits >> k & 1 == 0).expect("one rank missing");
                    p.missing[absent] += self.wmin[i];
                    p.absent[absent].push(i);
                }
            } else if count == 1 {
                let k = bits.trailing_zeros() as usize;
                p.own[k] = p.own[k].max((self.wmin[i], i));
            }
        }
        p.shared.sort_unstable();
        p.live = live;
        p
    }

    /// [`Problem::contiguity_bound`] for the ranks of `p`. Escorts charge their conflict
    /// tests to `work`.
    fn pattern_bound(&self, p: &Pattern, work: &mut Work) -> u64 {
        let m = p.m;
        if m < 3 {
            return 0;
        }
        let own: Vec<u64> = p.own.iter().map(|&(w, _)| w).collect();
        // Escorts can raise the bound only where the runs the intervals need apart exceed
        // `w`, and are looked for only then.
        let escorts =
            match own.iter().filter(|&&w| w > 0 && p.alternate_runs(w, 0, None).is_some_and(|t| t > w)).min()
            {
                // Only ranks with an own item of at least such a `w` can be among those.
                Some(&w) => {
                    let ranks = (0..m).filter(|&k| own[k] >= w).fold(0u64, |bits, k| bits | 1 << k);
                    self.escorts(&p.live, ranks, &p.own, &p.absent, work)
                }
                None => vec![0; m],
            };
        let distinct = |values: &[u64]| {
            let mut v: Vec<u64> = values.iter().copied().chain([0]).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let mut best = 0;
        let thresholds = distinct(&escorts);
        for w in distinct(&own).into_iter().filter(|&w| w > 0) {
            // Of the ranks with an item of at least `w` bytes and escorts of at least `e`
            // bytes (`e = 0` takes every such rank).
            for &e in &thresholds {
                if let Some(runs) = p.alternate_runs(w, e, Some(&escorts)) {
                    best = best.max(p.shared_bytes + (w + e).min(runs));
                }
            }
        }
        // Where a single shared item X_t is missing at rank t, the interval there lies in R
        // and X_t, which is contiguous: either wholly in R (a run of R of its length) or
        // over X_t with its other bytes in the runs of R right below and above X_t. Of the
        // X_t in address order, every other one has runs of its own, so R holds at least
        // the ⌈k/2⌉ smallest shortfalls (interval − X_t) of k such ranks.
        let ranks: Vec<usize> = (0..m).filter(|&k| p.absent[k].len() == 1 && own[k] > 0).collect();
        if let Some(w) = ranks.iter().map(|&k| own[k]).min() {
            let mut short: Vec<u64> = ranks.iter().map(|&k| own[k].saturating_sub(p.missing[k])).collect();
            short.sort_unstable();
            let runs: u64 = short[..ranks.len().div_ceil(2)].iter().sum();
            best = best.max(p.shared_bytes + w.min(runs));
        }
        best
    }

    /// The bytes R must hold because its runs border at most two ranks' missing shared
    /// items (see [`Problem::contiguity_bound`] for R and `y`). At a rank `t`, the items
    /// live there that are not shared (`O_t` bytes in all) lie in R and the shared items
    /// missing at `t`. Call those lying wholly in R `A_t`: R holds them, and the others
    /// need `O_t − y_t − |A_t|` bytes of R more, all in runs of R that border a shared item
    /// missing at `t` (an item meeting both such a run and those items crosses the run's
    /// end onto them, as nothing else lies between). A run of R has two ends, each against
    /// one shared item, missing at one rank at most, so it serves two ranks at most: if R
    /// holds `r` bytes, `2r ≥ Σ_t (O_t − y_t − |A_t|)` with `|A_t| ≤ r`, where `|A_t|` is a
    /// sum of the rank's items. Returns `bound` raised to `Σ shared` and the least such `r`
    /// (at least the most `O_t − y_t`) where that is higher and three ranks or more need
    /// bytes of R. The sums are listed on a budget of [`SUBSET_SUMS_WORK`] steps.
    fn bordering_runs(&self, p: &Pattern, bound: u64) -> u64 {
        let m = p.m;
        let beat = bound.saturating_sub(p.shared_bytes);
        let not_shared = |l: u64| (l.count_ones() as usize) + 1 < m;
        let mut bytes = vec![0u64; m];
        for &(i, l) in p.live.iter().filter(|&&(_, l)| not_shared(l)) {
            for k in (0..m).filter(|&k| l >> k & 1 == 1) {
                bytes[k] += self.wmin[i];
            }
        }
        let need: Vec<u64> = (0..m).map(|k| bytes[k].saturating_sub(p.missing[k])).collect();
        let lo = need.iter().copied().max().unwrap_or(0);
        let hi = need.iter().sum::<u64>().div_ceil(2).max(lo);
        // At most `lo` (no more than the bytes live) or `beat`: nothing to gain.
        if hi <= beat.max(lo) || need.iter().filter(|&&d| d > 0).count() < 3 {
            return bound;
        }
        let wanted = (0..m).filter(|&k| need[k] > 0).fold(0u64, |bits, k| bits | 1 << k);
        let mut items: Vec<Vec<u64>> = vec![Vec::new(); m];
        for &(i, l) in p.live.iter().filter(|&&(_, l)| l & wanted != 0 && not_shared(l)) {
            for k in (0..m).filter(|&k| (l & wanted) >> k & 1 == 1) {
                items[k].push(self.wmin[i]);
            }
        }
        // Nothing above `beat` and the bytes live (`lo`) where sums found greedily, largest
        // items first (no more than the best sums), already meet `2r ≥ Σ shortfalls` there.
        let r0 = beat.max(lo);
        let greedy: u64 = (0..m)
            .filter(|&k| need[k] > 0)
            .map(|k| {
                items[k].sort_unstable_by(|a, b| b.cmp(a));
                let a = items[k].iter().fold(0, |a, &x| if a + x <= r0 { a + x } else { a });
                need[k].saturating_sub(a)
            })
            .sum();
        if 2 * r0 >= greedy {
            return bound;
        }
        // Every rank's sums of items up to `hi`, ascending (`None`: too many to list, where
        // any value up to `r` is taken as a sum, which can only lower the bound).
        let mut work = Work::new(SUBSET_SUMS_WORK);
        let sums: Vec<Option<Vec<u64>>> = (0..m)
            .map(|k| if need[k] == 0 { Some(vec![0]) } else { subset_sums(&items[k], hi, &mut work) })
            .collect();
        let short = |r: u64| -> u64 {
            (0..m)
                .map(|k| {
                    let a = match &sums[k] {
                        Some(s) => s[s.partition_point(|&x| x <= r) - 1],
                        None => r,
                    };
                    need[k].saturating_sub(a)
                })
                .sum()
        };
        // The least r in [lo, hi] with 2r ≥ short(r): short falls as r grows.
        let (mut a, mut b) = (lo, hi);
        while a < b {
            let r = a + (b - a) / 2;
            if 2 * r >= short(r) {
                b = r;
            } else {
                a = r + 1;
            }
        }
        bound.max(p.shared_bytes + a)
    }

    /// For each rank (`own`: its largest own item's wmin and index; only the ranks in the
    /// bits of `ranks` are looked at), the bytes its *escorts* need in R beside the rank's own
    /// interval (see [`Problem::contiguity_bound`]): items live at the rank, neither shared
    /// nor its largest own item (`own`: wmin and item), that conflict with every shared item
    /// missing there (`absent_items`). Such an item avoids the shared items live at the rank
    /// (it is live there too) and those missing it (they meet elsewhere), so its smallest
    /// member's bytes lie in R, beside the own interval. Conflict tests charge `work` a step
    /// per interval passed and stop when it is spent (an item not tested is not counted:
    /// still a valid bound).
    fn escorts(
        &self,
        live: &[(usize, u64)],
        ranks: u64,
        own: &[(u64, usize)],
        absent_items: &[Vec<usize>],
        work: &mut Work,
    ) -> Vec<u64> {
        let m = own.len();
        let mut escorts = vec![0u64; m];
        for &(i, l) in live {
            if l.count_ones() as usize + 1 >= m {
                continue;
            }
            for k in (0..m).filter(|&k| (l & ranks) >> k & 1 == 1 && own[k].1 != i) {
                let mut escorted = true;
                for &x in &absent_items[k] {
                    let (conflict, steps) = self.conflict_steps(i, x);
                    if !work.charge(steps + 1) || !conflict {
                        escorted = false;
                        break;
                    }
                }
                if escorted {
                    escorts[k] += self.wmin[i];
                }
            }
        }
        escorts
    }
}

/// A set of ranks sorted into the kinds the contiguity bound reasons about
/// ([`Problem::contiguity_bound`]).
#[derive(Clone)]
pub(super) struct Pattern {
    /// The items live at some rank of the set, each with those ranks as bits.
    live: Vec<(usize, u64)>,
    /// Ranks in the set.
    m: usize,
    /// Shared items (live at every rank but at most one), ascending, and their bytes (the
    /// smallest members').
    shared: Vec<usize>,
    shared_bytes: u64,
    /// For every rank: the shared bytes missing there (`y`), and those items.
    missing: Vec<u64>,
    absent: Vec<Vec<usize>>,
    /// For every rank: its largest own item (live at no other rank of the set), as wmin and
    /// item; `(0, usize::MAX)` where none is.
    own: Vec<(u64, usize)>,
}

impl Pattern {
    /// The bytes of R that intervals of `w` bytes at the ranks with an own item of at least
    /// `w` (and escorts of at least `e`, where `escorts` are given) need unless one of them
    /// lies wholly in R. Sorted by left end, no interval may then meet the one after next,
    /// so every other one is disjoint from the rest, each holding at least `w − y` bytes of
    /// R: of the `2j − 1` ranks needing the most, the `j` smallest needs. The most over `j`;
    /// `None` below three ranks.
    fn alternate_runs(&self, w: u64, e: u64, escorts: Option<&[u64]>) -> Option<u64> {
        let mut needs: Vec<u64> = (0..self.m)
            .filter(|&k| self.own[k].0 >= w && escorts.is_none_or(|es| es[k] >= e))
            .map(|k| w.saturating_sub(self.missing[k]))
            .collect();
        if needs.len() < 3 {
            return None;
        }
        needs.sort_unstable_by(|a, b| b.cmp(a));
        // The `j` smallest of the first `2j − 1`: needs[j − 1..2j − 1].
        let mut prefix = vec![0u64; needs.len() + 1];
        for (i, &x) in needs.iter().enumerate() {
            prefix[i + 1] = prefix[i] + x;
        }
        (2..).take_while(|&j| 2 * j - 1 <= needs.len()).map(|j| prefix[2 * j - 1] - prefix[j - 1]).max()
    }

    /// The bytes R must hold when it has a run M of at least `w` bytes: an interval at a
    /// rank with an own item (`W` bytes, `y` shared bytes missing there, escorts `e` —
    /// unbounded where `escorts` are not given, for an optimistic value) lies inside M only if R also holds its escorts (`W +
    /// e` bytes), avoids M only if R holds `W − y` bytes beyond M (`w + W − y` in all), and
    /// otherwise crosses an end of M, where the byte beyond is a shared item's, missing at
    /// that rank — so at most two ranks cross. The third largest of `min(W + e, w + W − y)`
    /// over the ranks; `None` below three ranks.
    fn beside_run(&self, w: u64, escorts: Option<&[u64]>) -> Option<u64> {
        let mut needs: Vec<u64> = (0..self.m)
            .filter(|&k| self.own[k].0 > 0)
            .map(|k| {
                let (own, e) = (self.own[k].0, escorts.map_or(u64::MAX, |es| es[k]));
                own.saturating_add(e).min((w + own).saturating_sub(self.missing[k]))
            })
            .collect();
        if needs.len() < 3 {
            return None;
        }
        needs.sort_unstable_by(|a, b| b.cmp(a));
        Some(needs[2])
    }
}

/// Most sums [`subset_sums`] lists.
const SUBSET_SUMS_MAX: usize = 256;

/// Steps of [`subset_sums`] for all the ranks of one set ([`Problem::bordering_runs`]).
const SUBSET_SUMS_WORK: u64 = 1 << 16;

/// The sums of subsets of `items` up to `cap`, ascending and distinct (0 among them), or
/// `None` where there are more than [`SUBSET_SUMS_MAX`] or `work` runs out (a step per sum
/// listed).
fn subset_sums(items: &[u64], cap: u64, work: &mut Work) -> Option<Vec<u64>> {
    let mut sums = vec![0u64];
    let mut next = Vec::new();
    for &x in items.iter().filter(|&&x| x > 0 && x <= cap) {
        next.clear();
        let (mut i, mut j) = (0, 0);
        // Merge `sums` with `sums + x` (those up to `cap`).
        while i < sums.len() || j < sums.len() {
            let shifted = sums.get(j).map(|&s| s + x).filter(|&s| s <= cap);
            let v = match (sums.get(i), shifted) {
                (Some(&a), Some(b)) if b < a => {
                    j += 1;
                    b
                }
                (Some(&a), _) => {
                    i += 1;
                    a
                }
                (None, Some(b)) => {
                    j += 1;
                    b
                }
                (None, None) => break,
            };
            if next.last() != Some(&v) {
                next.push(v);
            }
        }
        if next.len() > SUBSET_SUMS_MAX || !work.charge(next.len() as u64) {
            return None;
        }
        std::mem::swap(&mut sums, &mut next);
    }
    Some(sums)
}

/// Whether the ascending `outer` holds every element of the ascending `inner`.
fn includes(outer: &[usize], inner: &[usize]) -> bool {
    let mut it = outer.iter();
    inner.iter().all(|x| it.any(|y| y == x))
}

/// What [`Problem::rank_profile`] gives: at every rank (`ranks + 1` entries, the last past
/// the clock), the bytes live and a fingerprint of the set of items live there.
pub(super) struct RankProfile {
    pub(super) load: Vec<i128>,
    pub(super) print: Vec<u64>,
}

/// A budget of work steps for a bound's searches, so that the bound does not depend on the
/// machine's speed.
pub(super) struct Work {
    spent: u64,
    limit: u64,
}

impl Work {
    pub(super) fn new(limit: u64) -> Work {
        Work { spent: 0, limit }
    }

    /// Spends `steps`; whether the budget still holds after them.
    pub(super) fn charge(&mut self, steps: u64) -> bool {
        self.spent += steps;
        self.spent <= self.limit
    }
}

/// Of `ranks` (ascending), those with at least `floor` bytes live, the first of each
/// distinct set of live items, at most 64 (a set of ranks of the contiguity bound).
fn ranks_at_least(load: &[i128], print: &[u64], floor: i128, ranks: impl Iterator<Item = usize>) -> Vec<u32> {
    let mut ticks: Vec<u32> = Vec::new();
    let mut seen: Vec<u64> = Vec::new();
    for t in ranks.filter(|&t| load[t] >= floor) {
        if !seen.contains(&print[t]) {
            seen.push(print[t]);
            ticks.push(t as u32);
            if ticks.len() == 64 {
                break;
            }
        }
    }
    ticks
}

/// The bits of `bits` at the positions set in `keep`, packed from bit 0 up in order.
fn compact(bits: u64, keep: u64) -> u64 {
    let mut out = 0u64;
    let mut to = 0;
    let mut rest = keep;
    while rest != 0 {
        let k = rest.trailing_zeros();
        out |= (bits >> k & 1) << to;
        to += 1;
        rest &= rest - 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::schedule_buffers;
    use crate::{Schedule, SchedulePlanInput};

    /// The buffers of 1F1B (pp `pp`, rank `rank`, `m` microbatches) over
    /// [`crate::pipeline::workspace_layers`] with `layers` layers and `hidden` bytes of
    /// hidden state.
    fn workspace_mix(pp: u32, rank: u32, m: u32, layers: u32, hidden: u64) -> Vec<Buffer> {
        let input = SchedulePlanInput {
            schedule: Schedule::OneFOneB { pp_size: pp, pp_rank: rank, num_microbatches: m },
            layers: crate::pipeline::workspace_layers(layers, hidden),
        };
        schedule_buffers(&input).unwrap().buffers
    }

    /// The problem of `schedule` over `layers`, and its bound of the ranks where the largest
    /// items start ([`Problem::largest_starts_bound`]).
    fn largest_starts_of(schedule: Schedule, layers: Vec<crate::LayerSpec>) -> (Problem, u64) {
        let input = SchedulePlanInput { schedule, layers };
        let p = Problem::build(&schedule_buffers(&input).unwrap().buffers).unwrap();
        let RankProfile { load, print } = p.rank_profile();
        let peak = load[..p.ranks as usize].iter().copied().max().unwrap();
        let bound = p.largest_starts_bound(&load, &print, peak);
        (p, bound)
    }

    /// A verified placement with `seconds` of budget: searches that reach the bound stop
    /// there, so a generous budget only bounds a slow machine.
    fn placed_within(buffers: &[Buffer], seconds: u64) -> Placement {
        let opts = PlaceOptions {
            time_budget: std::time::Duration::from_secs(seconds),
            scaled_budget_per_item: None,
            ..PlaceOptions::default()
        };
        let placed = place(buffers, &opts).unwrap();
        verify(buffers, &placed.offsets).unwrap();
        placed
    }

    #[test]
    fn subset_sums_are_listed_up_to_the_cap() {
        let mut work = Work::new(1 << 10);
        assert_eq!(subset_sums(&[5, 3, 5, 0], 10, &mut work), Some(vec![0, 3, 5, 8, 10]));
        assert_eq!(subset_sums(&[], 10, &mut work), Some(vec![0]));
        assert_eq!(subset_sums(&[11, 4], 10, &mut work), Some(vec![0, 4]));
        // Distinct powers of two give every sum: 512 of them pass the limit.
        let powers: Vec<u64> = (0..9).map(|k| 1 << k).collect();
        assert_eq!(subset_sums(&powers, u64::MAX / 2, &mut Work::new(1 << 20)), None);
        assert_eq!(
            subset_sums(&powers[..8], u64::MAX / 2, &mut Work::new(1 << 20)).map(|s| s.len()),
            Some(256)
        );
        // Out of work: none.
        assert_eq!(subset_sums(&powers[..8], u64::MAX / 2, &mut Work::new(100)), None);
    }

    #[test]
    fn compact_packs_the_kept_bits_in_order() {
        assert_eq!(compact(0b1011_0110, 0b1111_0000), 0b1011);
        assert_eq!(compact(0b1011_0110, 0b0101_0101), 0b0110);
        assert_eq!(compact(u64::MAX, 0), 0);
        assert_eq!(compact(1 << 63, 1 << 63 | 1), 0b10);
    }

    /// 1F1B with a 32 MiB attention workspace beside MLP and 1 MiB hidden states, four
    /// replayed slots: the live bound is 81 MiB, but the slots' backward workspaces cannot
    /// all be contiguous there (docs/planner.md) — 88 MiB — and each slot's gradient of the
    /// attention output, live the tick before the workspace while the bytes the workspace
    /// could borrow are taken, needs a hidden state of R beside it: 89 MiB, where the plan
    /// is.
    #[test]
    fn replayed_workspaces_raise_the_bound() {
        let buffers = workspace_mix(4, 0, 8, 2, 1 << 20);
        let p = Problem::build(&buffers).unwrap();
        assert_eq!(p.lower_bound(), 81 << 20);
        assert_eq!(p.contiguity_bound(&p.rank_profile()), 89 << 20);
        let placed = placed_within(&buffers, 1);
        assert_eq!((placed.lower_bound, placed.footprint), (89 << 20, 89 << 20));
        // One microbatch per slot: no slot is replayed, nothing to prove beyond the live bound.
        let p = Problem::build(&workspace_mix(4, 0, 4, 2, 1 << 20)).unwrap();
        assert!(p.contiguity_bound(&p.rank_profile()) <= p.lower_bound());
    }

    /// The same layers with 2 MiB hidden states. At the backward workspaces' ticks each
    /// slot misses its MLP saved buffer and a hidden state (18 MiB, over half the workspace),
    /// so those three intervals need not overlap: 140 MiB. At the forward workspaces' ticks
    /// of the slots' later microbatches each slot misses only the MLP saved buffer (16 MiB):
    /// the pattern holds there, and the middle interval lies in R — 144 MiB, where the plan
    /// is. Near the peak both kinds of ticks are in one set, where each saved buffer misses
    /// two ranks and is not shared; the bound is found once the backward ticks are dropped.
    #[test]
    fn dropping_ranks_finds_the_forward_workspaces_pattern() {
        let buffers = workspace_mix(4, 0, 8, 2, 2 << 20);
        let p = Problem::build(&buffers).unwrap();
        assert_eq!(p.lower_bound(), 130 << 20);
        assert_eq!(p.contiguity_bound(&p.rank_profile()), 144 << 20);
        // The canonical search places it at the bound (~10 ms in release builds).
        let placed = placed_within(&buffers, 5);
        assert_eq!((placed.lower_bound, placed.footprint), (144 << 20, 144 << 20));
    }

    /// The same layers with 2 MiB hidden states on five or more slots. The forward
    /// workspaces' pattern alone gives Σ shared + W, and it forces more: unless R holds a
    /// whole forward workspace, every other one of them (by address) is apart from the
    /// rest, each needing 16 MiB of R — more than W in all. So R has a run of 32 MiB, and
    /// every backward workspace must either lie inside it with its slot's gradient of the
    /// attention output beside it (34 MiB of R), or cross one of the run's two ends into
    /// its own slot's missing buffers — two slots at most. One hidden state more: 258 MiB on
    /// pp 8, rank 0 (8 slots), 174 MiB on pp 8, rank 3 (5 slots), where the plans are.
    #[test]
    fn a_forced_run_leaves_no_room_beside_it() {
        for (rank, m, bound) in [(0, 16, 258u64 << 20), (3, 8, 174 << 20)] {
            let buffers = workspace_mix(8, rank, m, 2, 2 << 20);
            let p = Problem::build(&buffers).unwrap();
            assert_eq!(p.contiguity_bound(&p.rank_profile()), bound, "pp 8, rank {rank}, M {m}");
            let placed = placed_within(&buffers, 5);
            assert_eq!((placed.lower_bound, placed.footprint), (bound, bound), "pp 8, rank {rank}, M {m}");
        }
    }

    /// Four layers (two with workspaces) on pp 4, rank 0: the bound (256 MiB) is reached
    /// only by an interleaving of the slots' workspaces and saved buffers, which the
    /// canonical search's static orders took 8–12 s to find; its restarts with noisy orders
    /// find it in milliseconds.
    #[test]
    fn four_layers_reach_their_bound() {
        let placed = placed_within(&workspace_mix(4, 0, 8, 4, 2 << 20), 10);
        assert_eq!((placed.lower_bound, placed.footprint), (256 << 20, 256 << 20));
    }

    /// Five ticks; a 16-byte group live at all of them, a 24-byte group missing each one,
    /// and a 32-byte buffer at each tick alone: 128 + 16 bytes live at every tick, but each
    /// 32-byte interval needs 8 bytes of R next to its tick's missing group, and R must hold
    /// three of those shortfalls apart — 16 + 120 + 24 bytes. The placement reaches it.
    #[test]
    fn single_missing_groups_need_runs_of_free_bytes() {
        let at = |k: u64| (4 * k, 4 * k + 1);
        let mut b = Vec::new();
        for k in 0..5 {
            let (start, end) = at(k);
            b.push(Buffer { start, end, size: 16, group: Some(0) });
            b.push(Buffer { start, end, size: 32, group: None });
            for j in (0..5).filter(|&j| j != k) {
                b.push(Buffer { start, end, size: 24, group: Some(1 + j as u32) });
            }
        }
        let p = Problem::build(&b).unwrap();
        assert_eq!(p.lower_bound(), 16 + 4 * 24 + 32);
        assert_eq!(p.contiguity_bound(&p.rank_profile()), 16 + 5 * 24 + 24);
        let placed = place(&b, &PlaceOptions::default()).unwrap();
        verify(&b, &placed.offsets).unwrap();
        assert_eq!(placed.footprint, placed.lower_bound);
        assert_eq!(placed.lower_bound, 16 + 5 * 24 + 24);
    }

    /// Three ticks; a 16-byte group live at all of them, an 80-byte group missing each one,
    /// and buffers of 64, 32 and 4 bytes at each tick alone: 276 bytes live at every tick.
    /// Below 32 bytes of R, a tick's 64 and 32 bytes both cross onto its missing group and
    /// need 16 bytes of R beside it (only the 4 bytes may lie wholly in R), and a run of R
    /// borders two groups at most: R holds 24 bytes. The placement needs 32 (a run of R
    /// between the first and the second group serves both, the third needs one of its own).
    #[test]
    fn runs_of_free_bytes_border_two_ticks_at_most() {
        let mut b = Vec::new();
        for k in 0..3u64 {
            let (start, end) = (4 * k, 4 * k + 1);
            b.push(Buffer { start, end, size: 16, group: Some(0) });
            for size in [64, 32, 4] {
                b.push(Buffer { start, end, size, group: None });
            }
            for j in (0..3).filter(|&j| j != k) {
                b.push(Buffer { start, end, size: 80, group: Some(1 + j as u32) });
            }
        }
        let p = Problem::build(&b).unwrap();
        assert_eq!(p.lower_bound(), 16 + 2 * 80 + 100);
        assert_eq!(p.contiguity_bound(&p.rank_profile()), 16 + 3 * 80 + 24);
        // The placement of the items live at the three ticks gives the rest.
        let placed = placed_within(&b, 1);
        assert_eq!((placed.lower_bound, placed.footprint), (16 + 3 * 80 + 32, 16 + 3 * 80 + 32));
    }

    /// A 1F1B stage of 12 slots (pp 16, rank 4) whose first layer writes a 320 MiB output at
    /// every forward, where its own slot has freed 269 MiB of kept blocks and the other
    /// eleven keep theirs: each forward's output needs a run of 51 MiB beside its slot's
    /// freed bytes, and a run borders at most two slots. The ranks near the peak do not give
    /// it; the forwards where the largest items start do: 3630 MiB where 3465.4 are live.
    #[test]
    fn the_slots_forwards_raise_the_contiguity_bound() {
        use crate::pipeline::specs::{layer, tensor};
        let layers = vec![
            layer(
                0,
                0,
                vec![tensor("hidden", &[4096, 2048], "f8e4m3", true)],
                vec![tensor("hidden", &[32768, 5120], "bf16", false)],
                [0, 0, 24688934],
            ),
            layer(
                0,
                1,
                vec![tensor("hidden", &[4096, 4, 2048], "bf16", true)],
                vec![tensor("hidden", &[8192, 4096], "f8e4m3", false)],
                [214958080, 114665897, 4194304],
            ),
        ];
        const MIB: u64 = 1 << 20;
        for m in [24, 256] {
            let schedule = Schedule::OneFOneB { pp_size: 16, pp_rank: 4, num_microbatches: m };
            let (p, largest_starts) = largest_starts_of(schedule, layers.clone());
            assert_eq!(p.lower_bound() / MIB, 3465);
            assert_eq!(largest_starts, 3630 * MIB, "M {m}");
            assert_eq!(p.contiguity_bound(&p.rank_profile()), 3630 * MIB, "M {m}");
        }
    }

    /// An interleaved stage (pp 8, rank 0, v 2, M 32; layers of several inputs and outputs)
    /// whose largest items start at pairs of adjacent ranks: from all those ranks, dropping
    /// ranks stays at 10 777 MiB, below the 10 870 MiB live; from the first of each pair
    /// the bound is 11 093 MiB, where the plan is.
    #[test]
    fn the_first_of_adjacent_ranks_is_a_start_of_its_own() {
        use crate::pipeline::specs::{layer, tensor};
        let layers = vec![
            layer(
                0,
                0,
                vec![tensor("hidden", &[1, 4096, 1024], "bf16", true)],
                vec![
                    tensor("hidden", &[2048, 2, 4096], "f16", false),
                    tensor("aux", &[8192, 1024], "f8e4m3", false),
                ],
                [0, 57671680, 51592978],
            ),
            layer(
                0,
                1,
                vec![tensor("hidden", &[2, 4096, 4096], "bf16", true)],
                vec![tensor("hidden", &[2048, 2, 2048], "bf16", false)],
                [0, 51380224, 0],
            ),
            layer(
                0,
                2,
                vec![
                    tensor("hidden", &[4, 512, 4096], "bf16", false),
                    tensor("mask", &[8192, 1024], "f32", false),
                ],
                vec![
                    tensor("hidden", &[512, 4, 5120], "f32", false),
                    tensor("aux", &[2048, 4, 5120], "bf16", false),
                ],
                [66060288, 107142847, 54525952],
            ),
            layer(
                0,
                3,
                vec![
                    tensor("hidden", &[8192, 2048], "bf16", false),
                    tensor("mask", &[2, 4096, 8192], "f32", false),
                    tensor("ids", &[4, 4096], "i64", false),
                ],
                vec![
                    tensor("hidden", &[1, 2048, 1024], "bf16", false),
                    tensor("aux", &[16384, 2048], "f16", false),
                ],
                [87031808, 67108864, 204472320],
            ),
            layer(
                0,
                4,
                vec![tensor("hidden", &[4096, 4096], "bf16", true)],
                vec![tensor("hidden", &[512, 2, 5120], "f8e4m3", false)],
                [183500800, 46352274, 187939828],
            ),
            layer(
                0,
                5,
                vec![
                    tensor("hidden", &[2048, 4, 4096], "f32", false),
                    tensor("mask", &[1024, 5120], "f32", true),
                ],
                vec![tensor("hidden", &[8192, 4, 8192], "bf16", false)],
                [0, 1048576, 64765698],
            ),
            layer(
                1,
                0,
                vec![tensor("hidden", &[2, 1024, 4096], "f8e4m3", true)],
                vec![
                    tensor("hidden", &[16384, 8192], "bf16", false),
                    tensor("aux", &[1024, 1024], "bf16", false),
                ],
                [0, 38781778, 0],
            ),
            layer(
                1,
                1,
                vec![tensor("hidden", &[2048, 8192], "f32", true)],
                vec![tensor("hidden", &[1024, 1, 1024], "f8e4m3", false)],
                [56009073, 22554546, 257949696],
            ),
            layer(
                1,
                2,
                vec![tensor("hidden", &[8192, 2048], "f16", true)],
                vec![tensor("hidden", &[16384, 5120], "bf16", false)],
                [156237824, 0, 0],
            ),
            layer(
                1,
                3,
                vec![tensor("hidden", &[1, 512, 1024], "bf16", true)],
                vec![
                    tensor("hidden", &[512, 1, 2048], "bf16", false),
                    tensor("aux", &[16384, 4096], "f16", false),
                ],
                [0, 49800171, 48234496],
            ),
            layer(
                1,
                4,
                vec![tensor("hidden", &[1024, 1024], "f16", true)],
                vec![tensor("hidden", &[2048, 4096], "bf16", false)],
                [47475953, 57987011, 171966464],
            ),
            layer(
                1,
                5,
                vec![tensor("hidden", &[2, 4096, 1024], "f16", false)],
                vec![tensor("hidden", &[8192, 2048], "bf16", false)],
                [81788928, 0, 23664262],
            ),
        ];
        let schedule =
            Schedule::Interleaved { pp_size: 8, pp_rank: 0, num_microbatches: 32, virtual_chunks: 2 };
        let (p, largest_starts) = largest_starts_of(schedule, layers);
        assert_eq!(p.lower_bound(), 11_398_652_848);
        assert_eq!(largest_starts, 11_632_407_312);
    }
}
