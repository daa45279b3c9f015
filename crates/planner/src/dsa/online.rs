//! The online constructions: best fit in clock order (the floor every plan gets) and its
//! aligned variant, which puts a buffer next to the live one whose end is closest to its own.

use super::*;
use std::collections::VecDeque;

/// The clock events of an online sweep over the items' hulls: (rank, start?, item), ends
/// before starts at the same rank. Sorted once per problem (`Problem::events`) and shared by
/// every online sweep of it — the floor, the aligned constructions, the repairing sweeps and
/// their restarts (7 ms each at 100k items).
pub(super) fn clock_events(p: &Problem) -> &[(u32, bool, u32)] {
    p.events.get_or_init(|| {
        let mut events: Vec<(u32, bool, u32)> = Vec::with_capacity(2 * p.len());
        for i in 0..p.len() {
            events.push((p.hull[i].0, true, i as u32));
            events.push((p.hull[i].1, false, i as u32));
        }
        events.sort_unstable();
        events
    })
}

/// A sorted set of pairs: a sorted vector while it is small (an online sweep usually has
/// about as many gaps as items live at once — hundreds — where moving a few hundred entries
/// costs less than a tree's nodes), a B-tree once it holds more than [`SORTED_VEC_MAX`]
/// (lists with many thousands of buffers live at once would otherwise move O(n) entries per
/// insert: 100k buffers all live together took 1 s for the online floor).
#[derive(Debug, Clone)]
pub(super) enum SortedPairs {
    Small(Vec<(u64, u64)>),
    Large(BTreeSet<(u64, u64)>),
}

/// An entry of a [`SortedPairs`].
pub(super) type Pair = (u64, u64);

/// Entries above which a [`SortedPairs`] turns into a B-tree (for good).
pub(super) const SORTED_VEC_MAX: usize = 4096;

impl Default for SortedPairs {
    fn default() -> Self {
        SortedPairs::Small(Vec::new())
    }
}

/// The entries of a [`SortedPairs`] from some key on, in order.
pub(super) enum SortedFrom<'a> {
    Small(std::slice::Iter<'a, (u64, u64)>),
    Large(std::collections::btree_set::Range<'a, (u64, u64)>),
}

impl<'a> Iterator for SortedFrom<'a> {
    type Item = &'a (u64, u64);

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            SortedFrom::Small(it) => it.next(),
            SortedFrom::Large(it) => it.next(),
        }
    }
}

impl SortedPairs {
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        match self {
            SortedPairs::Small(v) => v.len(),
            SortedPairs::Large(t) => t.len(),
        }
    }

    pub(super) fn insert(&mut self, x: (u64, u64)) {
        match self {
            SortedPairs::Small(v) => {
                let k = v.partition_point(|y| *y < x);
                v.insert(k, x);
                if v.len() > SORTED_VEC_MAX {
                    *self = SortedPairs::Large(v.drain(..).collect());
                }
            }
            SortedPairs::Large(t) => {
                t.insert(x);
            }
        }
    }

    /// Removes `x`; whether it was there.
    pub(super) fn remove(&mut self, x: (u64, u64)) -> bool {
        match self {
            SortedPairs::Small(v) => match v.binary_search(&x) {
                Ok(k) => {
                    v.remove(k);
                    true
                }
                Err(_) => false,
            },
            SortedPairs::Large(t) => t.remove(&x),
        }
    }

    /// The entries at or after `x`, in order.
    pub(super) fn from(&self, x: (u64, u64)) -> SortedFrom<'_> {
        match self {
            SortedPairs::Small(v) => SortedFrom::Small(v[v.partition_point(|y| *y < x)..].iter()),
            SortedPairs::Large(t) => SortedFrom::Large(t.range(x..)),
        }
    }

    /// The last entry before `x` and the first at or after it (one search).
    pub(super) fn around(&self, x: Pair) -> (Option<Pair>, Option<Pair>) {
        match self {
            SortedPairs::Small(v) => {
                let k = v.partition_point(|y| *y < x);
                (k.checked_sub(1).map(|j| v[j]), v.get(k).copied())
            }
            SortedPairs::Large(t) => (t.range(..x).next_back().copied(), t.range(x..).next().copied()),
        }
    }

    pub(super) fn last(&self) -> Option<(u64, u64)> {
        match self {
            SortedPairs::Small(v) => v.last().copied(),
            SortedPairs::Large(t) => t.last().copied(),
        }
    }
}

/// The free space of an online sweep: gaps below `top`, sorted by offset and by (length,
/// offset).
#[derive(Clone, Default)]
pub(super) struct FreeSpace {
    /// (offset, length), by offset.
    by_off: SortedPairs,
    /// (length, offset), by length, then offset.
    by_len: SortedPairs,
    pub(super) top: u64,
}

impl FreeSpace {
    /// Gaps of at least `size` bytes, smallest first: (length, offset).
    pub(super) fn fitting(&self, size: u64) -> SortedFrom<'_> {
        self.by_len.from((size, 0))
    }

    pub(super) fn insert(&mut self, o: u64, len: u64) {
        self.by_off.insert((o, len));
        self.by_len.insert((len, o));
    }

    /// Removes the gap `[o, o + len)` (a gap of the free space).
    pub(super) fn remove(&mut self, o: u64, len: u64) {
        assert!(self.by_off.remove((o, len)), "not a gap of the free space");
        self.by_len.remove((len, o));
    }

    /// Takes `[at, at + size)` out of the gap `[o, o + len)`.
    pub(super) fn take(&mut self, o: u64, len: u64, at: u64, size: u64) {
        self.remove(o, len);
        if at > o {
            self.insert(o, at - o);
        }
        if at + size < o + len {
            self.insert(at + size, o + len - at - size);
        }
    }

    /// Takes `[o, o + size)` out of the free space: it lies in one gap, or above the top
    /// (from a gap ending at the top or from the top on). `false` (and nothing taken) when
    /// it is not free.
    #[must_use]
    pub(super) fn claim(&mut self, o: u64, size: u64) -> bool {
        if o >= self.top {
            if o > self.top {
                // The space skipped joins the gap ending at the top, if any.
                let top = self.top;
                match self.by_off.last() {
                    Some((go, gl)) if go + gl == top => {
                        self.remove(go, gl);
                        self.insert(go, o - go);
                    }
                    _ => self.insert(top, o - top),
                }
            }
            self.top = o + size;
            return true;
        }
        let Some((go, gl)) = self.by_off.around((o, u64::MAX)).0 else { return false };
        if go + gl <= o || (o + size > go + gl && go + gl != self.top) {
            return false;
        }
        let inside = size.min(go + gl - o);
        self.take(go, gl, o, inside);
        if o + size > self.top {
            self.top = o + size;
        }
        true
    }

    /// Where an item that fits in no gap goes: the gap that ends at the top, else the top.
    pub(super) fn above(&mut self, size: u64) -> u64 {
        match self.by_off.last() {
            Some((o, len)) if o + len == self.top => {
                self.remove(o, len);
                self.top = o + size;
                o
            }
            _ => {
                self.top += size;
                self.top - size
            }
        }
    }

    /// Frees `[o, o + size)`, merged with the gaps it touches.
    pub(super) fn free(&mut self, o: u64, size: u64) {
        let (mut o, mut len) = (o, size);
        let (below, above) = self.by_off.around((o, 0));
        let below = below.filter(|&(po, pl)| po + pl == o);
        let above = above.filter(|&(no, _)| no == o + len);
        if let Some((po, pl)) = below {
            self.remove(po, pl);
            o = po;
            len += pl;
        }
        if let Some((no, nl)) = above {
            self.remove(no, nl);
            len += nl;
        }
        self.insert(o, len);
    }

    /// Gaps below the top.
    #[cfg(test)]
    pub(super) fn gaps(&self) -> usize {
        self.by_off.len()
    }
}

/// How an online best-fit sweep treats the gap that ends at the top (the free space above
/// the highest live item, below the highest top so far).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TopGap {
    /// As any other gap: the smallest that fits is taken (the floor).
    AsAnyGap,
    /// Taken only where no gap below the highest live item fits, as allocators keep their
    /// "wilderness" for last: an item then goes into a hole between live items even where
    /// the gap at the top fits it more tightly, and the top stays free for what does not
    /// fit elsewhere (four of the seven eager training steps recorded from PyTorch:
    /// 1.0123–1.0465 × the bound with the floor's rule, 1.0046–1.0239 with this one; random
    /// lists go either way: docs/planner.md, "The gap at the top kept for last").
    Last,
}

/// Online best-fit in clock order over each item's hull (the floor). Returns offsets and
/// footprint.
pub(super) fn online_best_fit(p: &Problem) -> (Vec<u64>, u64) {
    online_best_fit_with(p, TopGap::AsAnyGap)
}

/// Online best-fit in clock order over each item's hull, the gap at the top treated as
/// `top_gap` says. Returns offsets and footprint.
pub(super) fn online_best_fit_with(p: &Problem, top_gap: TopGap) -> (Vec<u64>, u64) {
    let mut off = vec![0u64; p.len()];
    let mut free = FreeSpace::default();
    for &(_, is_start, i) in clock_events(p) {
        let i = i as usize;
        let size = p.size[i];
        if !is_start {
            free.free(off[i], size);
            continue;
        }
        let top = free.top;
        let fit = match top_gap {
            TopGap::AsAnyGap => free.fitting(size).next(),
            TopGap::Last => {
                free.fitting(size).find(|&&(len, o)| o + len != top).or_else(|| free.fitting(size).next())
            }
        }
        .copied();
        off[i] = match fit {
            Some((len, o)) => {
                free.take(o, len, o, size);
                o
            }
            None => free.above(size),
        };
    }
    (off, free.top)
}

/// The state of an online aligned sweep (see [`online_aligned`]): the free space and the end
/// rank of each live item by its offset and by its top (offsets and tops are unique among
/// live items, which do not overlap and hold a byte or more), so that the neighbours of a
/// gap are a lookup each (hash maps: twice as fast as one ordered map here). Cloned as a
/// checkpoint by [`online_aligned_repair`].
#[derive(Clone, Default)]
struct AlignedSweep {
    free: FreeSpace,
    end_at: HashMap<u64, u32, KeyHashing>,
    end_below: HashMap<u64, u32, KeyHashing>,
}

/// How [`AlignedSweep::place`] scores the candidate gaps.
struct AlignedRule<'r> {
    /// The smallest fitting gaps considered.
    k: usize,
    /// Weight of the end distance (in mean lifetimes) against the gap's relative leftover.
    weight: f64,
    /// The mean lifetime.
    mean: f64,
    /// Every score scaled by a factor drawn from `1 ± q/2`, when set.
    noise: Option<(f64, &'r mut Rng)>,
}

impl AlignedSweep {
    /// Item `i` (at `off`) ends: its space is freed.
    fn end(&mut self, p: &Problem, i: usize, off: u64) {
        let size = p.size[i];
        self.end_at.remove(&off);
        self.end_below.remove(&(off + size));
        self.free.free(off, size);
    }

    /// Item `i` starts: its offset by `rule` (see [`online_aligned`]), taken out of the free
    /// space.
    fn place(&mut self, p: &Problem, i: usize, rule: &mut AlignedRule, cands: &mut Vec<(u64, u64)>) -> u64 {
        let size = p.size[i];
        let end = p.hull[i].1;
        cands.clear();
        cands.extend(self.free.fitting(size).take(rule.k).copied());
        let mut best: Option<(f64, u64, u64, u64)> = None; // score, gap len, gap off, item off
        for &(len, o) in cands.iter() {
            let waste = (len - size) as f64 / size as f64;
            // Bottom: next to the item below (its top is `o`); top: next to the one above.
            let below = self.end_below.get(&o).copied();
            let above = self.end_at.get(&(o + len)).copied();
            for (at, nb) in [(o, below), (o + len - size, above)] {
                let dist = nb.map_or(rule.mean * 4.0, |e| (e as f64 - end as f64).abs());
                let mut score = waste + rule.weight * dist / rule.mean;
                if let Some((q, rng)) = rule.noise.as_mut() {
                    score *= 1.0 + *q * (rng.unit() - 0.5);
                }
                if best.is_none_or(|b| score < b.0) {
                    best = Some((score, len, o, at));
                }
            }
            if len == size {
                break;
            }
        }
        let at = match best {
            Some((_, len, o, at)) => {
                self.free.take(o, len, at, size);
                at
            }
            None => self.free.above(size),
        };
        self.end_at.insert(at, end);
        self.end_below.insert(at + size, end);
        at
    }
}

/// Online placement in clock order like [`online_best_fit`], choosing among the `k` smallest
/// free gaps that fit: the item goes to the bottom or the top of a gap, next to the live
/// item whose end is closest to its own (space freed together coalesces), scored by the
/// gap's leftover relative to the item plus `weight` × the end distance in mean lifetimes.
/// With `noise` `(q, rng)` every score is scaled by a factor drawn from `1 ± q/2` (restarts).
/// `None` when `stop()` says so (asked every 4096 clock events).
pub(super) fn online_aligned(
    p: &Problem,
    k: usize,
    weight: f64,
    noise: Option<(f64, &mut Rng)>,
    stop: impl Fn() -> bool,
) -> Option<(Vec<u64>, u64)> {
    let mut rule = AlignedRule { k, weight, mean: p.mean_span().max(1) as f64, noise };
    let mut off = vec![0u64; p.len()];
    let mut sweep = AlignedSweep::default();
    let mut cands: Vec<(u64, u64)> = Vec::with_capacity(k);
    for (step, &(_, is_start, i)) in clock_events(p).iter().enumerate() {
        if step % 4096 == 4095 && stop() {
            return None;
        }
        let i = i as usize;
        if is_start {
            off[i] = sweep.place(p, i, &mut rule, &mut cands);
        } else {
            sweep.end(p, i, off[i]);
        }
    }
    Some((off, sweep.free.top))
}

/// Online aligned placement ([`online_aligned`], with noise `q` drawn from `rng`) that
/// backs up where it would rise above a target height: the sweep keeps checkpoints of its
/// state (every mean lifetime's worth of clock events), and an item that would take the top
/// above the target sends it back to a checkpoint about one mean lifetime before, to place
/// the items live with it again with other draws of the noise — twice and four times as
/// far back after repeated failures; after [`REPAIR_TRIES`] failures in one stretch the
/// target rises to the lowest top those tries reached. The target starts at `target`. The
/// footprint is the highest over stretches of the clock, and each stretch gets the best of
/// its own tries, where a restart of the whole sweep must be lucky on every stretch at once
/// (a list of 100k buffers of similar sizes, ~300 live: 1.060 of the bound for one plain
/// sweep, 1.047 for the best of ~30 noisy restarts, 1.031–1.034 for one sweep that backs up,
/// in 1.3 plain sweeps' time). Once it has placed [`REPAIR_MAX_WORK`] times the events it
/// stops backing up and finishes as a plain noisy sweep.
/// `None` when `stop()` says so (asked every 4096 clock events placed).
pub(super) fn online_aligned_repair(
    p: &Problem,
    rule: (usize, f64, f64),
    rng: &mut Rng,
    target: u64,
    stop: impl Fn() -> bool,
) -> Option<(Vec<u64>, u64)> {
    let (k, weight, q) = rule;
    let events = clock_events(p);
    let n = p.len();
    let first = p.hull.iter().map(|&(s, _)| s as u64).min().unwrap_or(0);
    let span = (p.hull.iter().map(|&(_, e)| e as u64).max().unwrap_or(0) - first).max(1);
    let mean = p.mean_span().max(1) as f64;
    // The clock events over one mean lifetime (about twice the items live at once).
    let lifetime_events = ((2 * n) as f64 * mean / span as f64).ceil() as usize;
    let back = lifetime_events.max(REPAIR_MIN_EVENTS);
    let max_work = REPAIR_MAX_WORK * events.len() as u64;
    let mut off = vec![0u64; n];
    let mut sweep = AlignedSweep::default();
    // (first event not yet placed, the sweep's state before it), oldest first.
    let mut checkpoints: VecDeque<(usize, AlignedSweep)> = VecDeque::new();
    let mut cands: Vec<(u64, u64)> = Vec::with_capacity(k);
    let mut target = target;
    // Failures in the current stretch, the latest event that failed, and the lowest top
    // the failing tries reached.
    let (mut tries, mut failed_at, mut lowest) = (0u32, 0usize, u64::MAX);
    let (mut e, mut work) = (0usize, 0u64);
    while e < events.len() {
        work += 1;
        if work % 4096 == 0 && stop() {
            return None;
        }
        if e % back == 0 && checkpoints.back().is_none_or(|c| c.0 < e) {
            checkpoints.push_back((e, sweep.clone()));
            while checkpoints.len() > 2 && checkpoints[1].0 + (back << REPAIR_LEVELS) < e {
                checkpoints.pop_front();
            }
        }
        let (_, is_start, i) = events[e];
        let i = i as usize;
        if !is_start {
            sweep.end(p, i, off[i]);
            e += 1;
            continue;
        }
        let mut rule = AlignedRule { k, weight, mean, noise: Some((q, &mut *rng)) };
        off[i] = sweep.place(p, i, &mut rule, &mut cands);
        if sweep.free.top <= target || work > max_work {
            e += 1;
            continue;
        }
        // Above the target: this stretch again, further back after repeated failures, or
        // the target raised.
        if e > failed_at + 2 * back {
            (tries, lowest) = (0, u64::MAX);
        }
        failed_at = failed_at.max(e);
        lowest = lowest.min(sweep.free.top);
        tries += 1;
        if tries > REPAIR_TRIES {
            target = lowest;
            (tries, lowest) = (0, u64::MAX);
        }
        let level = (tries / REPAIR_TRIES_PER_LEVEL).min(REPAIR_LEVELS);
        let to = e.saturating_sub(back << level);
        while checkpoints.len() > 1 && checkpoints.back().is_some_and(|c| c.0 > to) {
            checkpoints.pop_back();
        }
        let (at, state) = checkpoints.back().expect("the first checkpoint is kept");
        e = *at;
        sweep = state.clone();
    }
    Some((off, sweep.free.top))
}

/// The name of the repairing sweep's construction.
pub(super) const REPAIR_NAME: &str = "aligned-repair";
/// Failures in one stretch after which [`online_aligned_repair`] raises its target.
pub(super) const REPAIR_TRIES: u32 = 4;
/// Failures after which it backs up twice as far (up to [`REPAIR_LEVELS`] doublings).
pub(super) const REPAIR_TRIES_PER_LEVEL: u32 = 2;
/// How many times it doubles the distance it backs up.
pub(super) const REPAIR_LEVELS: u32 = 2;
/// Fewest clock events between checkpoints (and backed up at least).
pub(super) const REPAIR_MIN_EVENTS: usize = 256;
/// Clock events placed, as a multiple of the list's, after which it stops backing up.
pub(super) const REPAIR_MAX_WORK: u64 = 6;
/// The repairing sweep of the portfolio: candidates, weight of the end distance (the end
/// alignment decides; the leftover breaks near-ties: weights 64 / 1024 / 4096 gave 1.035–1.037
/// / 1.031–1.034 / about the same on lists of similar sizes), noise.
pub(super) const REPAIR_RULE: (usize, f64, f64) = (32, 1024.0, 0.3);
/// The first target of the repairing sweep: the bound plus this share of the excess of the
/// best placement so far over it, at most [`REPAIR_FIRST_TARGET_MAX`] of the bound above it
/// (from the bound itself, twice the time for plans no lower).
pub(super) const REPAIR_FIRST_TARGET: f64 = 1.0 / 3.0;
/// See [`REPAIR_FIRST_TARGET`].
pub(super) const REPAIR_FIRST_TARGET_MAX: f64 = 0.03;

/// The first target of a repairing sweep on a list with bound `lb`, its best placement so
/// far `high` high (see [`REPAIR_FIRST_TARGET`]).
pub(super) fn repair_first_target(lb: u64, high: u64) -> u64 {
    let excess =
        (high.saturating_sub(lb) as f64 * REPAIR_FIRST_TARGET).min(lb as f64 * REPAIR_FIRST_TARGET_MAX);
    lb + excess as u64
}

/// The `j`th online aligned construction of [`ALIGNED_VARIANTS`] (see [`online_aligned`]).
pub(super) fn aligned_variant(p: &Problem, j: usize, stop: impl Fn() -> bool) -> Option<(Vec<u64>, u64)> {
    let (candidates, weight, _) = ALIGNED_VARIANTS[j];
    online_aligned(p, candidates, weight, None, stop)
}

/// The online constructions, for benchmarks: a list prepared once, then planned by the
/// online best fit (the floor), the first aligned variant of the portfolio, or the
/// repairing sweep.
pub struct OnlineConstructions {
    p: Problem,
}

impl std::fmt::Debug for OnlineConstructions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnlineConstructions").field("items", &self.p.len()).finish_non_exhaustive()
    }
}

impl OnlineConstructions {
    /// `buffers` prepared for planning.
    pub fn new(buffers: &[Buffer]) -> Result<OnlineConstructions, PlaceError> {
        Ok(OnlineConstructions { p: Problem::build(buffers)? })
    }

    /// The footprint of the online best fit in clock order.
    pub fn best_fit(&self) -> u64 {
        online_best_fit(&self.p).1
    }

    /// The footprint of the online aligned construction (the portfolio's first variant).
    pub fn aligned(&self) -> u64 {
        aligned_variant(&self.p, 0, || false).map_or(0, |(_, high)| high)
    }

    /// The footprint of the repairing sweep as the portfolio runs it (its first target from
    /// the online best fit's footprint, which is not timed here: `floor`).
    pub fn repairing(&self, floor: u64) -> u64 {
        let target = repair_first_target(self.p.lower_bound(), floor);
        let mut rng = crate::rng::Rng::new(1);
        online_aligned_repair(&self.p, REPAIR_RULE, &mut rng, target, || false).map_or(0, |(_, high)| high)
    }
}

/// Gaps a tail item of [`online_around`] tries (smallest first) before it goes to the top.
const AROUND_CANDIDATES: usize = 16;

/// Online best fit in clock order for the `tail` items around the `placed` items (at their
/// offsets in `off`; every item that may be live with a tail item): each tail item takes the
/// smallest of the [`AROUND_CANDIDATES`] smallest free gaps at its start that has room clear
/// of the placed items starting while it lives (the lowest such room in it), else the lowest
/// clear room at the top. Writes the tail's offsets into `off`; returns the highest top of
/// the placed and tail items. Items of one interval each. `None` when the placed items
/// overlap or no room is left below 2^64 (the construction is dropped then, not the plan).
pub(super) fn online_around(p: &Problem, off: &mut [u64], placed: &[u32], tail: &[u32]) -> Option<u64> {
    // The placed items by start: their starts, and their (offset, top) in that order.
    let mut by_start: Vec<(u32, u64, u64)> = placed
        .iter()
        .map(|&i| {
            let i = i as usize;
            (p.hull[i].0, off[i], off[i] + p.size[i])
        })
        .collect();
    by_start.sort_unstable();
    let starts: Vec<u32> = by_start.iter().map(|x| x.0).collect();
    let ranges: Vec<(u64, u64)> = by_start.iter().map(|x| (x.1, x.2)).collect();
    // Events: ends first, then placed starts, then tail starts (largest first) at each rank.
    let mut events: Vec<(u32, u8, u64, u32)> = Vec::with_capacity(2 * (placed.len() + tail.len()));
    for (kind, items) in [(1, placed), (2, tail)] {
        for &i in items {
            let (s, e) = p.hull[i as usize];
            events.push((e, 0, 0, i));
            events.push((s, kind, u64::MAX - p.size[i as usize], i));
        }
    }
    events.sort_unstable();
    let mut free = FreeSpace::default();
    let mut meets: Vec<(u64, u64)> = Vec::new();
    for (t, kind, _, i) in events {
        let i = i as usize;
        let size = p.size[i];
        match kind {
            0 => free.free(off[i], size),
            1 => {
                if !free.claim(off[i], size) {
                    return None;
                }
            }
            _ => {
                // The placed items starting while it lives.
                let ahead = &ranges
                    [starts.partition_point(|&x| x <= t)..starts.partition_point(|&x| x < p.hull[i].1)];
                let mut at = None;
                for &(len, o) in free.fitting(size).take(AROUND_CANDIDATES) {
                    meets.clear();
                    meets.extend(ahead.iter().filter(|x| x.0 < o + len && x.1 > o));
                    if meets.is_empty() {
                        at = Some(o);
                        break;
                    }
                    if let Some(room) = lowest_room(&mut meets, o, o + len, size) {
                        at = Some(room);
                        break;
                    }
                }
                let at = match at {
                    Some(at) => at,
                    None => {
                        // The top, or the gap ending there.
                        let from = match free.by_off.last() {
                            Some((o, len)) if o + len == free.top => o,
                            _ => free.top,
                        };
                        meets.clear();
                        meets.extend(ahead.iter().filter(|x| x.1 > from));
                        lowest_room(&mut meets, from, u64::MAX, size)?
                    }
                };
                off[i] = at;
                if !free.claim(at, size) {
                    return None;
                }
            }
        }
    }
    Some(free.top)
}

/// The lowest offset in `[lo, hi)` with `size` bytes clear of the `(offset, top)` ranges of
/// `meets` (which it sorts; they may overlap one another: two of them need never be live
/// together).
fn lowest_room(meets: &mut [(u64, u64)], lo: u64, hi: u64, size: u64) -> Option<u64> {
    meets.sort_unstable();
    let mut cur = lo;
    for &(o, top) in meets.iter() {
        if o >= cur && o - cur >= size {
            break;
        }
        cur = cur.max(top);
    }
    (cur < hi && hi - cur >= size).then_some(cur)
}

/// The name every aligned construction's strategy starts with.
pub(super) const ALIGNED_NAME: &str = "online-aligned";

/// The online aligned constructions the portfolio runs (see [`online_aligned`]):
/// candidate gaps, weight of the end distance, name.
pub(super) const ALIGNED_VARIANTS: [(usize, f64, &str); 3] =
    [(32, 4.0, "online-aligned/4"), (32, 8.0, "online-aligned/8"), (32, 2.0, "online-aligned/2")];

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// A sorted set of pairs answers like a B-tree set before and after it turns into one.
        #[test]
        fn sorted_pairs_agree_with_a_tree(
            bulk in 0u64..6000,
            ops in prop::collection::vec((any::<bool>(), 0u64..3000, 0u64..4, 0u64..3000), 1..2000),
        ) {
            let mut pairs = SortedPairs::default();
            let mut reference: BTreeSet<(u64, u64)> = BTreeSet::new();
            // Past the vector's limit on most cases.
            for k in 0..bulk {
                pairs.insert((k, 5));
                reference.insert((k, 5));
            }
            for (insert, a, b, probe) in ops {
                let x = (a, b);
                if insert {
                    if !reference.contains(&x) {
                        pairs.insert(x);
                        reference.insert(x);
                    }
                } else {
                    prop_assert_eq!(pairs.remove(x), reference.remove(&x));
                }
                let q = (probe, 1);
                prop_assert_eq!(pairs.from(q).next(), reference.range(q..).next());
                prop_assert_eq!(
                    pairs.around(q),
                    (reference.range(..q).next_back().copied(), reference.range(q..).next().copied())
                );
                prop_assert_eq!(pairs.last(), reference.last().copied());
                prop_assert_eq!(pairs.len(), reference.len());
            }
            prop_assert!(pairs.from((0, 0)).copied().eq(reference.iter().copied()));
        }
    }

    /// The gap at the top kept for last: an item that fits both a hole between live items
    /// and, more tightly, the gap at the top goes into the hole, and a later item too large
    /// for either then starts in the gap at the top instead of above everything (11 bytes
    /// against the floor's 14; the bound is 10). Every item is placed as the sweep says and
    /// neither placement overlaps.
    #[test]
    fn the_gap_at_the_top_is_taken_last() {
        let b = |start: u64, end: u64, size: u64| Buffer { start, end, size, group: None };
        // At 2 the hole [0, 4) opens below the long-lived item at 4, and the gap [6, 9) at
        // the top; 3 bytes start there, 5 more at 3.
        let buffers = [b(0, 2, 4), b(0, 10, 2), b(0, 2, 3), b(2, 10, 3), b(3, 10, 5)];
        let p = Problem::build(&buffers).unwrap();
        assert_eq!(p.lower_bound(), 10);
        let offsets = |off: &[u64]| -> Vec<u64> { p.item_of.iter().map(|&i| off[i as usize]).collect() };
        let (any_off, any_high) = online_best_fit_with(&p, TopGap::AsAnyGap);
        let (last_off, last_high) = online_best_fit_with(&p, TopGap::Last);
        assert_eq!(offsets(&any_off), vec![0, 4, 6, 6, 9]);
        assert_eq!(offsets(&last_off), vec![0, 4, 6, 0, 6]);
        assert_eq!((any_high, last_high), (14, 11));
        verify(&buffers, &offsets(&any_off)).unwrap();
        verify(&buffers, &offsets(&last_off)).unwrap();
        assert_eq!(online_best_fit(&p).1, any_high, "the floor keeps its rule");
    }

    /// Claimed ranges come out of the gap holding them, or extend the top; the space a claim
    /// above the top skips joins the gap ending there, so a later claim across both holds.
    #[test]
    fn claims_keep_the_gaps_whole() {
        let mut free = FreeSpace::default();
        assert!(free.claim(0, 10));
        free.free(5, 5);
        assert_eq!((free.top, free.gaps()), (10, 1));
        // Above the top: [5, 10) and [10, 12) are one gap.
        assert!(free.claim(12, 3));
        assert_eq!((free.top, free.gaps()), (15, 1));
        assert_eq!(free.fitting(7).next(), Some(&(7, 5)));
        assert!(free.claim(5, 7));
        assert_eq!((free.top, free.gaps()), (15, 0));
        // Taken space is refused.
        assert!(!free.claim(3, 4));
        // Inside a gap: what is left on either side stays free.
        free.free(0, 15);
        assert!(free.claim(4, 2));
        assert!(!free.claim(5, 2));
        assert_eq!(free.fitting(0).copied().collect::<Vec<_>>(), vec![(4, 0), (9, 6)]);
        // Across the gap ending at the top and beyond it.
        assert!(free.claim(13, 5));
        assert_eq!((free.top, free.gaps()), (18, 2));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// The online sweep around placed items places every tail item without overlaps,
        /// leaves the placed items where they were, and returns the true footprint.
        #[test]
        fn the_sweep_around_placed_items_is_valid(
            raw in prop::collection::vec((0u64..50, 1u64..30, 1u64..64, any::<bool>()), 1..120),
        ) {
            let b: Vec<Buffer> = raw
                .iter()
                .map(|&(start, life, size, _)| Buffer { start, end: start + life, size, group: None })
                .collect();
            let p = Problem::build(&b).unwrap();
            let (placed, tail): (Vec<u32>, Vec<u32>) = (0..p.len() as u32).partition(|&i| {
                let k = p.item_of.iter().position(|&x| x == i).unwrap();
                raw[k].3
            });
            let mut off = vec![0u64; p.len()];
            let mut index = Index::new(&p);
            greedy(&p, &placed, Fit::BestFit, &mut index, &mut off);
            let before = off.clone();
            let high = online_around(&p, &mut off, &placed, &tail).expect("the placed items do not overlap");
            let offsets: Vec<u64> = p.item_of.iter().map(|&i| off[i as usize]).collect();
            verify(&b, &offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(high, (0..p.len()).map(|i| off[i] + p.size[i]).max().unwrap());
            for &i in &placed {
                prop_assert_eq!(off[i as usize], before[i as usize]);
            }
        }
    }

    /// Many buffers live at once: the free space grows past the vector's limit and the floor
    /// stays valid, stacks them, and returns in time.
    #[test]
    fn the_floor_handles_thousands_of_live_buffers() {
        let mut rng = crate::rng::Rng::new(7);
        // 20k buffers live over one common step, ending in random order.
        let buffers: Vec<Buffer> = (0..20_000u64)
            .map(|i| Buffer {
                start: i,
                end: 20_000 + rng.below(20_000),
                size: 1 + rng.below(1 << 20),
                group: None,
            })
            .collect();
        let p = Problem::build(&buffers).unwrap();
        let began = Instant::now();
        let (off, high) = online_best_fit(&p);
        assert!(began.elapsed() < Duration::from_secs(5), "{:?}", began.elapsed());
        let offsets: Vec<u64> = p.item_of.iter().map(|&i| off[i as usize]).collect();
        verify(&buffers, &offsets).unwrap();
        assert_eq!(high, buffers.iter().map(|b| b.size).sum::<u64>(), "all are live at step 19 999");
        // The frees in random order leave thousands of gaps before they coalesce.
        let mut free = FreeSpace::default();
        let mut placed = Vec::new();
        for b in &buffers {
            placed.push(free.above(b.size));
        }
        let mut most = 0;
        for k in (0..buffers.len()).step_by(2).chain((1..buffers.len()).step_by(2)) {
            free.free(placed[k], buffers[k].size);
            most = most.max(free.gaps());
        }
        assert!(most > SORTED_VEC_MAX, "the test must cross the limit: {most} gaps at most");
        assert_eq!(free.gaps(), 1, "everything freed coalesces into one gap");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// The repairing sweep places every item without overlaps, at or above the bound,
        /// whatever its first target (backing up to the first checkpoint on lists this short)
        /// and rule.
        #[test]
        fn repairing_sweeps_are_valid(
            raw in prop::collection::vec((0u64..60, 1u64..20, 1u64..64), 1..120),
            above in 0u64..64,
            weight in 0.0f64..2000.0,
            seed in 0u64..1000,
        ) {
            let b: Vec<Buffer> =
                raw.iter().map(|&(s, l, z)| Buffer { start: s, end: s + l, size: z, group: None }).collect();
            let p = Problem::build(&b).unwrap();
            let lb = p.lower_bound();
            let mut rng = crate::rng::Rng::new(seed);
            let (off, high) = online_aligned_repair(&p, (8, weight, 0.3), &mut rng, lb + above, || false).unwrap();
            let offsets: Vec<u64> = p.item_of.iter().map(|&i| off[i as usize]).collect();
            prop_assert!(verify(&b, &offsets).is_ok());
            prop_assert!(high >= lb);
            prop_assert_eq!(high, (0..p.len()).map(|i| off[i] + p.size[i]).max().unwrap_or(0));
        }
    }

    /// On lists of similar sizes with ~300 buffers live (sizes and lifetimes about normal,
    /// where whole noisy restarts of the aligned construction gain least), the repairing
    /// sweep comes out below the plain sweep, and below the best of four noisy ones on
    /// average over three lists (one sweep's footprint varies by ±0.5%; 60k buffers, seeds
    /// 1–8: below the plain sweep on all, below the best of four on 7); a sweep asked to stop
    /// gives nothing.
    #[test]
    fn the_repairing_sweep_backs_up_below_whole_restarts() {
        let n = 60_000;
        let (mut repaired, mut restarted) = (0.0, 0.0);
        for seed in 1..=3 {
            let mut draw = crate::rng::Rng::new(seed);
            // About normal: the sum of four uniform draws (variance 1/3), centred.
            let normal = |draw: &mut crate::rng::Rng, mean: f64, sd: f64| {
                let u: f64 = (0..4).map(|_| draw.unit()).sum::<f64>() - 2.0;
                (mean + sd * u * 3f64.sqrt()).max(1.0) as u64
            };
            let buffers: Vec<Buffer> = (0..n)
                .map(|_| {
                    let start = draw.below(n);
                    let life = normal(&mut draw, 300.0, 100.0);
                    let size = normal(&mut draw, (1 << 20) as f64, (1 << 18) as f64);
                    Buffer { start, end: start + life, size, group: None }
                })
                .collect();
            let p = Problem::build(&buffers).unwrap();
            let lb = p.lower_bound();
            let ratio = |h: u64| h as f64 / lb as f64;
            let (k, weight, q) = REPAIR_RULE;
            let (_, plain) = online_aligned(&p, k, weight, None, || false).unwrap();
            let mut rng = crate::rng::Rng::new(seed);
            let restarts = (0..4)
                .map(|_| online_aligned(&p, k, weight, Some((q, &mut rng)), || false).unwrap().1)
                .min()
                .unwrap();
            let target = repair_first_target(lb, plain);
            let (off, high) = online_aligned_repair(&p, REPAIR_RULE, &mut rng, target, || false).unwrap();
            let offsets: Vec<u64> = p.item_of.iter().map(|&i| off[i as usize]).collect();
            verify(&buffers, &offsets).unwrap();
            assert!(high < plain, "seed {seed}: repaired {:.4}, plain {:.4}", ratio(high), ratio(plain));
            (repaired, restarted) = (repaired + ratio(high), restarted + ratio(restarts));
            assert!(online_aligned_repair(&p, REPAIR_RULE, &mut rng, target, || true).is_none());
        }
        assert!(
            repaired < restarted,
            "mean ratio repaired {:.4}, best of 4 restarts {:.4}",
            repaired / 3.0,
            restarted / 3.0
        );
    }
}
