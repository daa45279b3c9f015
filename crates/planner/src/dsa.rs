//! Offsets for buffers with lifetimes: dynamic storage allocation (DSA).
//!
//! Every buffer is live over a half-open interval `[start, end)` of an abstract clock and
//! needs `size` contiguous bytes. Two buffers that are live at the same time must not
//! overlap in `[offset, offset + size)`. Finding the smallest arena is NP-complete; this
//! module combines, in order:
//!
//! 1. the **lower bound**: the most bytes live at any time (one sweep over the compressed
//!    clock, `O(n log n)`), reported with every placement;
//! 2. an **online best-fit floor**: buffers in start order, freed extents coalesced, the
//!    smallest free extent that fits taken (`O(n log n)`) — what a caching allocator would do;
//!    and its **aligned** variant (next to the live buffer that ends closest to the placed
//!    one), the best construction on lists of uniform sizes and the leading one on *dense*
//!    inputs, where one greedy pass (whose cost grows with the pairs of buffers live
//!    together) would not fit in the budget;
//! 3. **skyline** constructions (bottom-up: fill the lowest valley of the skyline with an
//!    item that starts at its left edge; three pick rules), then a **portfolio of greedy
//!    orders** (breadth, size, lifetime, size × lifetime, start) × (best-fit, lowest offset),
//!    run on all cores and time-boxed (costs from a model until a job of the kind has
//!    finished), keeping the best per window; the start for what follows is the lowest
//!    construction or one within 1% of it that comes earlier in the job order;
//! 4. **decomposition** of the clock at low-liveness cut points: buffers that cross a cut are
//!    placed first, and every window between cuts takes the best strategy for itself;
//! 5. **coarsening** (single-interval problems): buffers with one lifetime stacked into one,
//!    buffers handing over to one of equal size chained into one, and the coarse instance
//!    planned by this same engine when that removes a tenth of the items (see `coarsen`);
//!    then, for at most [`CANONICAL_MAX_ITEMS`] items, a complete **canonical search** at the
//!    lower bound and above it (`crate::canonical`, MiniMalloc-style inference, dominance
//!    and decomposition; 15% of what is left), and a fixed-height **contour search** with
//!    backjumping and a bisection of the target height (`crate::contour`), when a few
//!    skyline passes fit in its share;
//! 6. a time-boxed **improvement** stage: randomised skyline restarts for a quarter of the
//!    time left (single-interval problems), then windows of the clock around a buffer that defines
//!    the footprint (a random stretch of its lifetime when that is long) are taken out with
//!    that buffer and re-placed with perturbed orders; a window is kept when its highest
//!    byte (then the number of items reaching it) does not rise (hill climbing with sideways
//!    moves), and a re-placement stops as soon as it is worse;
//! 7. an **exact** branch-and-bound search over canonical placements when there are at most
//!    [`EXACT_MAX_ITEMS`] items.
//!
//! Buffers sharing an alias group are placed as one item at one offset: the item is a set
//! of disjoint intervals (the union of its members' intervals, gaps kept) and is as large
//! as the largest member; conflicts are checked interval by interval.
//!
//! **Bounds.** The live bound is the most bytes live at once (each buffer at its own size;
//! members of a group live together count once). Alias groups can force more: a group
//! holds its offset through its gaps, so groups that are pairwise live at *some* common
//! time must be stacked even if no single moment has them all live. The reported lower
//! bound is the larger of the live bound and the weight of such a clique (see
//! `Problem::alias_bound` for the proof that it is valid), or one byte above a capacity the
//! canonical search proved infeasible.
//!
//! Placed intervals are kept in a multi-resolution time index (buckets of the compressed
//! clock, 32 ranks wide at the finest level and 4 times wider per level; an interval lives
//! at the finest level whose buckets are at least as wide as it is; each bucket sorted by
//! offset), so finding the free gaps for a buffer costs time proportional to the buffers
//! live near it, not to all buffers placed; a query merges the sorted runs of the buckets it
//! visits instead of sorting what it collected.

#![allow(clippy::needless_range_loop)] // parallel arrays indexed by item read best as loops

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use crate::rng::Rng;

/// Interval comparisons the alias bound may spend growing its clique (about 20 ms).
pub const ALIAS_BOUND_WORK: u64 = 40_000_000;

/// Items the canonical search ([`crate::canonical`]) takes at most: each node costs
/// O(items + their lifetimes), and beyond a few thousand items the search rarely finishes.
pub const CANONICAL_MAX_ITEMS: usize = 2000;
/// Pairs of items live together the canonical search takes at most (its neighbour lists
/// are built before the search and cost time in proportion).
pub const CANONICAL_MAX_PAIRS: u64 = 1_000_000;

/// The least budget [`PlaceOptions::scaled_budget_per_item`] caps to: small lists that are
/// hard to pack (MiniMalloc's and TelaMalloc's benchmark traces of ~400 buffers) lose 4–10%
/// at 8 ms and reach within 1–7% of the bound in 60 ms.
pub const MIN_CAPPED_BUDGET: Duration = Duration::from_millis(60);

/// Problems with at most this many items are solved exactly (branch and bound).
pub const EXACT_MAX_ITEMS: usize = 8;

/// One buffer to place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Buffer {
    /// First clock step at which the buffer is live.
    pub start: u64,
    /// First clock step at which it is no longer live (`end` ≥ `start`; `end == start` means
    /// never live, and such a buffer is placed at offset 0).
    pub end: u64,
    /// Bytes.
    pub size: u64,
    /// Buffers with the same group are placed at the same offset (aliases of one memory).
    pub group: Option<u32>,
}

/// How a greedy strategy picks among the free gaps that fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fit {
    /// The smallest gap that fits (ties: lowest offset); the top of the arena otherwise.
    BestFit,
    /// The lowest gap that fits.
    LowestOffset,
}

/// The order in which a greedy strategy places buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Order {
    /// Largest first.
    Size,
    /// Longest-lived first.
    Lifetime,
    /// Largest size × lifetime first.
    Area,
    /// Earliest start first (an offline first-fit / best-fit in clock order).
    Start,
    /// Buffers live at the busiest times first ("greedy by breadth"): key = the most bytes
    /// live at any step of the buffer's lifetime, then size.
    Breadth,
}

/// One greedy strategy of the portfolio.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Strategy {
    /// Placement order.
    pub order: Order,
    /// Gap choice.
    pub fit: Fit,
}

impl Strategy {
    /// The portfolio, most useful first.
    pub const PORTFOLIO: [Strategy; 10] = [
        Strategy { order: Order::Breadth, fit: Fit::BestFit },
        Strategy { order: Order::Size, fit: Fit::BestFit },
        Strategy { order: Order::Breadth, fit: Fit::LowestOffset },
        Strategy { order: Order::Area, fit: Fit::BestFit },
        Strategy { order: Order::Size, fit: Fit::LowestOffset },
        Strategy { order: Order::Lifetime, fit: Fit::BestFit },
        Strategy { order: Order::Area, fit: Fit::LowestOffset },
        Strategy { order: Order::Lifetime, fit: Fit::LowestOffset },
        Strategy { order: Order::Start, fit: Fit::BestFit },
        Strategy { order: Order::Start, fit: Fit::LowestOffset },
    ];

    /// A short name such as `size/best-fit`.
    pub fn name(&self) -> &'static str {
        match (self.order, self.fit) {
            (Order::Size, Fit::BestFit) => "size/best-fit",
            (Order::Size, Fit::LowestOffset) => "size/lowest",
            (Order::Lifetime, Fit::BestFit) => "lifetime/best-fit",
            (Order::Lifetime, Fit::LowestOffset) => "lifetime/lowest",
            (Order::Area, Fit::BestFit) => "area/best-fit",
            (Order::Area, Fit::LowestOffset) => "area/lowest",
            (Order::Start, Fit::BestFit) => "start/best-fit",
            (Order::Start, Fit::LowestOffset) => "start/lowest",
            (Order::Breadth, Fit::BestFit) => "breadth/best-fit",
            (Order::Breadth, Fit::LowestOffset) => "breadth/lowest",
        }
    }
}

/// Knobs of [`place`].
#[derive(Debug, Clone)]
pub struct PlaceOptions {
    /// Upper bound on planning time. The portfolio skips strategies that would not finish
    /// in time, every stage stops at the deadline, and the online best-fit floor (always
    /// built) is the answer when nothing else finished.
    pub time_budget: Duration,
    /// Worker threads for the portfolio (0 = all cores).
    pub threads: usize,
    /// Run the improvement stage when the footprint is above the lower bound.
    pub improve: bool,
    /// Seed of the improvement stage's perturbations (plans are reproducible for a seed,
    /// except where the deadline cuts the search short).
    pub seed: u64,
    /// Cap the budget at `scaled_budget_per_item` × buffers + 5 ms, but not below
    /// [`MIN_CAPPED_BUDGET`], so large lists return in proportion to their size (8 µs per
    /// buffer: 10k buffers ≤ ~85 ms, 100k ≤ ~0.8 s) and small hard ones still get a search
    /// (lists at the bound stop at once whatever the cap). `None`: no cap (what
    /// [`crate::plan_schedule`] uses: a schedule's plan stops when it reaches the bound, and
    /// one that does not needs the time).
    pub scaled_budget_per_item: Option<Duration>,
}

impl PlaceOptions {
    /// Options for a budget: one the caller `given` is the search's whole (plans at the
    /// bound still stop at once); the default one is capped for buffer lists by their size
    /// ([`PlaceOptions::scaled_budget_per_item`]).
    pub fn with_budget(time_budget: Duration, given: bool) -> PlaceOptions {
        let default = PlaceOptions::default();
        let cap = if given { None } else { default.scaled_budget_per_item };
        PlaceOptions { time_budget, scaled_budget_per_item: cap, ..default }
    }
}

impl Default for PlaceOptions {
    fn default() -> Self {
        PlaceOptions {
            time_budget: Duration::from_secs(1),
            threads: 0,
            improve: true,
            seed: 0x6772_6170_6870_6f6f,
            scaled_budget_per_item: Some(Duration::from_micros(8)),
        }
    }
}

/// Where every buffer goes, and how good that is.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Offset of each buffer, in input order.
    pub offsets: Vec<u64>,
    /// Bytes of the arena: the highest `offset + size`.
    pub footprint: u64,
    /// No placement can use less: the largest of [`Placement::live_bound`], with alias
    /// groups the weight of a clique of pairwise conflicting groups, and what the canonical
    /// search proved infeasible plus one (see the module docs).
    pub lower_bound: u64,
    /// Most bytes live at any time (each buffer at its own size; members of one group that
    /// are live together count once).
    pub live_bound: u64,
    /// What produced the placement (a strategy name, `mixed(...)` when windows chose
    /// different strategies, `+improved` when the improvement stage lowered it, `exact`).
    pub strategy: String,
    /// Wall-clock time spent.
    pub elapsed: Duration,
    /// Footprint of the online best-fit floor.
    pub floor_footprint: u64,
    /// Footprint before the improvement stage.
    pub greedy_footprint: u64,
    /// Windows the clock was decomposed into.
    pub windows: usize,
    /// Portfolio strategies that ran (others were skipped for time).
    pub strategies_run: usize,
    /// Re-placement steps the improvement stage tried.
    pub improvement_steps: u64,
}

impl Placement {
    /// `footprint / lower_bound` (1.0 when both are 0).
    pub fn ratio(&self) -> f64 {
        if self.lower_bound == 0 { 1.0 } else { self.footprint as f64 / self.lower_bound as f64 }
    }
}

/// Why buffers could not be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    /// A buffer ends before it starts.
    #[error("buffer {index} ends at {end} before it starts at {start}; give every buffer start <= end")]
    Reversed {
        /// Position of the buffer in the input.
        index: usize,
        /// Its start.
        start: u64,
        /// Its end.
        end: u64,
    },
    /// The sizes add up to more than 2^64 bytes.
    #[error("buffer sizes add up to more than 2^64 bytes; check the sizes (they are bytes)")]
    Overflow,
}

/// A placement that breaks a rule (see [`verify`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// Wrong number of offsets.
    #[error("{got} offsets for {expected} buffers")]
    Count {
        /// Buffers.
        expected: usize,
        /// Offsets.
        got: usize,
    },
    /// Two buffers live at the same time share bytes.
    #[error("buffers {a} and {b} are live at the same time and overlap in memory")]
    Overlap {
        /// One buffer.
        a: usize,
        /// The other.
        b: usize,
    },
    /// Two buffers of one alias group were given different offsets.
    #[error("buffers {a} and {b} are in the same alias group but at different offsets")]
    Alias {
        /// One buffer.
        a: usize,
        /// The other.
        b: usize,
    },
}

// ------------------------------------------------------------------------------------------
// The problem in compressed form.

/// Items (alias groups or lone buffers) over a compressed clock.
#[derive(Debug, Clone, Default)]
struct Problem {
    size: Vec<u64>,
    /// Item `i`'s intervals are `ivs[ivp[i]..ivp[i + 1]]`, in compressed clock ranks.
    ivp: Vec<u32>,
    ivs: Vec<(u32, u32)>,
    hull: Vec<(u32, u32)>,
    /// Real-clock length covered (for the lifetime orders).
    life: Vec<u64>,
    /// Real-clock start.
    start: Vec<u64>,
    /// Most bytes live at any rank of the item's intervals.
    peak: Vec<u64>,
    /// Item of each buffer; `u32::MAX` for buffers that are never live or have size 0.
    item_of: Vec<u32>,
    ranks: u32,
    /// Smallest member of each item (its weight in the alias bound).
    wmin: Vec<u64>,
    /// Most bytes live at any time counting every buffer at its own size (members of one
    /// group that are live together count once, as the largest of them).
    live_bound: u64,
}

impl Problem {
    fn build(buffers: &[Buffer]) -> Result<Problem, PlaceError> {
        let mut groups: HashMap<u32, u32> = HashMap::new();
        let mut item_ivs: Vec<Vec<(u64, u64)>> = Vec::new();
        let mut size: Vec<u64> = Vec::new();
        let mut item_of = vec![u32::MAX; buffers.len()];
        let mut times = Vec::with_capacity(buffers.len() * 2);
        let mut members: Vec<(u32, u64, u64, u64)> = Vec::with_capacity(buffers.len());
        for (index, b) in buffers.iter().enumerate() {
            if b.end < b.start {
                return Err(PlaceError::Reversed { index, start: b.start, end: b.end });
            }
            if b.end == b.start || b.size == 0 {
                continue;
            }
            let item = match b.group {
                Some(g) => *groups.entry(g).or_insert_with(|| {
                    item_ivs.push(Vec::new());
                    size.push(0);
                    (size.len() - 1) as u32
                }),
                None => {
                    item_ivs.push(Vec::new());
                    size.push(0);
                    (size.len() - 1) as u32
                }
            };
            item_of[index] = item;
            item_ivs[item as usize].push((b.start, b.end));
            members.push((item, b.start, b.end, b.size));
            size[item as usize] = size[item as usize].max(b.size);
            times.push(b.start);
            times.push(b.end);
        }
        // Zero-size or never-live members of a group follow the group.
        for (index, b) in buffers.iter().enumerate() {
            if item_of[index] == u32::MAX
                && let Some(g) = b.group
                && let Some(&item) = groups.get(&g)
            {
                item_of[index] = item;
            }
        }
        size.iter().try_fold(0u64, |acc, &s| acc.checked_add(s)).ok_or(PlaceError::Overflow)?;
        times.sort_unstable();
        times.dedup();
        let rank = |t: u64| times.partition_point(|&x| x < t) as u32;
        let n = size.len();
        let mut p = Problem {
            size,
            ivp: Vec::with_capacity(n + 1),
            ivs: Vec::with_capacity(n),
            hull: Vec::with_capacity(n),
            life: Vec::with_capacity(n),
            start: Vec::with_capacity(n),
            peak: Vec::new(),
            item_of,
            ranks: times.len() as u32,
            wmin: Vec::new(),
            live_bound: 0,
        };
        p.ivp.push(0);
        for mut ivs in item_ivs {
            ivs.sort_unstable();
            let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ivs.len());
            for (s, e) in ivs {
                match merged.last_mut() {
                    Some(last) if s <= last.1 => last.1 = last.1.max(e),
                    _ => merged.push((s, e)),
                }
            }
            p.life.push(merged.iter().map(|(s, e)| e - s).sum());
            p.start.push(merged[0].0);
            let first = p.ivs.len();
            for (s, e) in merged {
                p.ivs.push((rank(s), rank(e)));
            }
            p.hull.push((p.ivs[first].0, p.ivs[p.ivs.len() - 1].1));
            p.ivp.push(p.ivs.len() as u32);
        }
        p.peak = p.peaks();
        // The bound counts every buffer at its own size: per item, the largest member live
        // at each moment (members of one item overlap in memory, so they count once).
        p.wmin = vec![u64::MAX; n];
        members.sort_unstable();
        let mut diff = vec![0i128; p.ranks as usize + 1];
        let mut k = 0;
        while k < members.len() {
            let item = members[k].0;
            let mut j = k;
            while j < members.len() && members[j].0 == item {
                p.wmin[item as usize] = p.wmin[item as usize].min(members[j].3);
                j += 1;
            }
            if j - k == 1 {
                let (_, s, e, size) = members[k];
                diff[rank(s) as usize] += size as i128;
                diff[rank(e) as usize] -= size as i128;
            } else {
                // Sweep the members' events keeping the multiset of live sizes.
                let mut ev: Vec<(u64, bool, u64)> =
                    members[k..j].iter().flat_map(|&(_, s, e, z)| [(s, true, z), (e, false, z)]).collect();
                ev.sort_unstable();
                let mut sizes: BTreeMap<u64, u32> = BTreeMap::new();
                let mut cur = 0u64;
                for (t, is_start, z) in ev {
                    if is_start {
                        *sizes.entry(z).or_insert(0) += 1;
                    } else if let Some(c) = sizes.get_mut(&z) {
                        *c -= 1;
                        if *c == 0 {
                            sizes.remove(&z);
                        }
                    }
                    let now = sizes.last_key_value().map_or(0, |(&z, _)| z);
                    if now != cur {
                        diff[rank(t) as usize] += now as i128 - cur as i128;
                        cur = now;
                    }
                }
            }
            k = j;
        }
        let mut live = 0i128;
        for d in &diff {
            live += d;
            p.live_bound = p.live_bound.max(live as u64);
        }
        Ok(p)
    }

    /// Bytes live at each rank.
    fn live(&self) -> Vec<u64> {
        let mut diff = vec![0i128; self.ranks as usize + 1];
        for i in 0..self.len() {
            for &(s, e) in self.ivs(i) {
                diff[s as usize] += self.size[i] as i128;
                diff[e as usize] -= self.size[i] as i128;
            }
        }
        let mut live = 0i128;
        diff.iter()
            .map(|d| {
                live += d;
                live as u64
            })
            .collect()
    }

    /// For every item, the most bytes live during its lifetime (a max segment tree over
    /// the live profile).
    fn peaks(&self) -> Vec<u64> {
        let live = self.live();
        let m = live.len().max(1);
        let mut tree = vec![0u64; 2 * m];
        tree[m..m + live.len()].copy_from_slice(&live);
        for k in (1..m).rev() {
            tree[k] = tree[2 * k].max(tree[2 * k + 1]);
        }
        let query = |mut l: usize, mut r: usize| {
            let mut best = 0;
            l += m;
            r += m;
            while l < r {
                if l & 1 == 1 {
                    best = best.max(tree[l]);
                    l += 1;
                }
                if r & 1 == 1 {
                    r -= 1;
                    best = best.max(tree[r]);
                }
                l >>= 1;
                r >>= 1;
            }
            best
        };
        (0..self.len())
            .map(|i| self.ivs(i).iter().map(|&(s, e)| query(s as usize, e as usize)).max().unwrap_or(0))
            .collect()
    }

    fn len(&self) -> usize {
        self.size.len()
    }

    fn ivs(&self, i: usize) -> &[(u32, u32)] {
        &self.ivs[self.ivp[i] as usize..self.ivp[i + 1] as usize]
    }

    /// The most bytes live at any rank (see [`Problem::live_bound`]).
    fn lower_bound(&self) -> u64 {
        self.live_bound
    }

    /// Whether items `a` and `b` are live at a common rank.
    fn conflict(&self, a: usize, b: usize) -> bool {
        let (x, y) = (self.ivs(a), self.ivs(b));
        let (mut i, mut j) = (0, 0);
        while i < x.len() && j < y.len() {
            if x[i].0 < y[j].1 && y[j].0 < x[i].1 {
                return true;
            }
            if x[i].1 <= y[j].1 {
                i += 1;
            } else {
                j += 1;
            }
        }
        false
    }

    /// A lower bound that sees alias groups: the weight of a clique of items that are
    /// pairwise live at a common time (a different time for every pair is allowed).
    ///
    /// **Validity.** Let items `A` and `B` conflict: some member `a` of `A` and `b` of `B`
    /// are live at a common time, so the byte ranges `[o_A, o_A + |a|)` and
    /// `[o_B, o_B + |b|)` are disjoint in every valid placement (members of a group share
    /// the group's offset `o`). With `w_X` ≤ the size of every member of `X`, the ranges
    /// `[o_X, o_X + w_X)` of a clique (items pairwise in conflict) are then pairwise
    /// disjoint and all lie in `[0, footprint)`, so `Σ w_X ≤ footprint` for every valid
    /// placement. Any clique gives a valid bound: this one is the heavier of a greedy clique
    /// (stopped after [`ALIAS_BOUND_WORK`] interval comparisons) and, up to
    /// [`CLIQUE_MAX_ITEMS`] items, a search on the conflict graph
    /// ([`ConflictGraph::heavy_clique`]); both deterministic, so the bound does not depend on
    /// the machine's speed.
    ///
    /// Without multi-interval items a clique of intervals has a common point (Helly), so
    /// this is never above the live bound and is skipped.
    fn alias_bound(&self) -> u64 {
        let n = self.len();
        if self.ivs.len() == n {
            return 0;
        }
        let greedy = self.greedy_clique();
        match self.conflict_graph() {
            Some(graph) => greedy.max(graph.heavy_clique(&self.wmin, &self.life)),
            None => greedy,
        }
    }

    /// The conflict graph (items live at a common rank), built by a sweep over the
    /// intervals; `None` above [`CLIQUE_MAX_ITEMS`] items or when the sweep would visit more
    /// than [`ALIAS_BOUND_WORK`] pairs of intervals.
    fn conflict_graph(&self) -> Option<ConflictGraph> {
        let n = self.len();
        if n > CLIQUE_MAX_ITEMS {
            return None;
        }
        let mut graph = ConflictGraph::new(n);
        let mut ivs: Vec<(u32, u32, u32)> = Vec::with_capacity(self.ivs.len());
        for i in 0..n {
            ivs.extend(self.ivs(i).iter().map(|&(s, e)| (s, e, i as u32)));
        }
        ivs.sort_unstable();
        // Intervals live at the current start: (end, item).
        let mut active: Vec<(u32, u32)> = Vec::new();
        let mut work = 0u64;
        for &(s, e, i) in &ivs {
            active.retain(|&(end, _)| end > s);
            work += active.len() as u64 + 1;
            if work > ALIAS_BOUND_WORK {
                return None;
            }
            for &(_, j) in &active {
                if j != i {
                    graph.connect(i as usize, j as usize);
                }
            }
            active.push((e, i));
        }
        Some(graph)
    }

    /// The greedy clique of [`Problem::alias_bound`] (no conflict graph needed).
    fn greedy_clique(&self) -> u64 {
        let n = self.len();
        // Greedy clique: items in order of weight × lifetime (long, large groups first),
        // each taken when it conflicts with every item taken so far. The item that blocked
        // the previous candidate is tried first (it usually blocks the next one too).
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_unstable_by_key(|&i| std::cmp::Reverse(self.wmin[i] as u128 * self.life[i] as u128));
        let mut clique: Vec<usize> = Vec::new();
        let mut weight = 0u64;
        let mut blocker = 0usize;
        let mut work = 0u64;
        let cost =
            |a: usize, b: usize| (self.ivp[a + 1] - self.ivp[a] + self.ivp[b + 1] - self.ivp[b]) as u64;
        for &x in &order {
            if work > ALIAS_BOUND_WORK {
                break;
            }
            if blocker < clique.len() {
                work += cost(x, clique[blocker]);
                if !self.conflict(x, clique[blocker]) {
                    continue;
                }
            }
            match clique.iter().position(|&y| {
                work += cost(x, y);
                !self.conflict(x, y)
            }) {
                Some(b) => blocker = b,
                None => {
                    clique.push(x);
                    weight += self.wmin[x];
                }
            }
        }
        weight
    }

    /// Average interval length in ranks.
    /// Pairs of items whose hulls overlap in time: what one greedy pass's gap queries visit
    /// (each item's query sees every placed item live with it). `O(n log n)`.
    fn overlapping_pairs(&self) -> u64 {
        let mut starts: Vec<u32> = self.hull.iter().map(|h| h.0).collect();
        starts.sort_unstable();
        // Two hulls overlap when one starts inside the other: per item, count the items
        // starting inside its hull. That counts each item itself once and pairs with the
        // same start twice.
        let mut pairs = 0u64;
        for &(s, e) in &self.hull {
            let lo = starts.partition_point(|&x| x < s);
            let hi = starts.partition_point(|&x| x < e);
            pairs += (hi - lo) as u64;
        }
        pairs -= starts.len() as u64;
        for run in starts.chunk_by(|a, b| a == b) {
            let k = run.len() as u64;
            pairs -= k * (k - 1) / 2;
        }
        pairs
    }

    fn mean_span(&self) -> u32 {
        if self.ivs.is_empty() {
            return 1;
        }
        let total: u64 = self.ivs.iter().map(|&(s, e)| (e - s) as u64).sum();
        (total / self.ivs.len() as u64).max(1) as u32
    }
}

/// Items up to which [`Problem::alias_bound`] builds the conflict graph and searches it
/// (its bitsets take `n² / 8` bytes: 2 MiB at this size).
const CLIQUE_MAX_ITEMS: usize = 4096;

/// Items in conflict (live at a common rank), one bitset row per item.
struct ConflictGraph {
    n: usize,
    words: usize,
    rows: Vec<u64>,
}

impl ConflictGraph {
    fn new(n: usize) -> ConflictGraph {
        let words = n.div_ceil(64);
        ConflictGraph { n, words, rows: vec![0; n * words] }
    }

    fn connect(&mut self, a: usize, b: usize) {
        self.rows[a * self.words + b / 64] |= 1 << (b % 64);
        self.rows[b * self.words + a / 64] |= 1 << (a % 64);
    }

    fn adjacent(&self, a: usize, b: usize) -> bool {
        self.rows[a * self.words + b / 64] >> (b % 64) & 1 == 1
    }

    /// The items in conflict with `a`.
    fn neighbours(&self, a: usize) -> impl Iterator<Item = usize> + '_ {
        self.rows[a * self.words..(a + 1) * self.words].iter().enumerate().flat_map(|(k, &word)| {
            let mut bits = word;
            std::iter::from_fn(move || {
                (bits != 0).then(|| {
                    let b = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    k * 64 + b
                })
            })
        })
    }

    /// The weight of a heavy clique (weights `w`; `life` orders the first attempt). Each
    /// attempt builds a clique greedily in some order — weight × lifetime, weight, weight of
    /// the item and its neighbours, then those with random noise — and improves it by swaps:
    /// an item outside comes in when it outweighs the members it does not conflict with,
    /// which leave, and the clique is filled up again; until no swap gains. Attempts stop
    /// after [`CLIQUE_WORK`] adjacency tests (deterministic: the bound does not depend on the
    /// machine's speed). Any clique is a valid bound (see [`Problem::alias_bound`]).
    fn heavy_clique(&self, w: &[u64], life: &[u64]) -> u64 {
        let n = self.n;
        let around: Vec<f64> =
            (0..n).map(|i| (w[i] + self.neighbours(i).map(|j| w[j]).sum::<u64>()) as f64).collect();
        let mut rng = Rng::new(0x636c_6971_7565);
        let mut member = vec![false; n];
        let mut clique: Vec<usize> = Vec::new();
        let mut work = 0u64;
        let mut best = 0u64;
        for attempt in 0..MAX_CLIQUE_ATTEMPTS {
            if work > CLIQUE_WORK {
                break;
            }
            let key = |i: usize| match attempt % 3 {
                0 => w[i] as f64 * life[i] as f64,
                1 => w[i] as f64,
                _ => around[i],
            };
            let mut keyed: Vec<(f64, usize)> =
                (0..n).map(|i| (if attempt < 3 { key(i) } else { key(i) * (0.5 + rng.unit()) }, i)).collect();
            keyed.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let order: Vec<usize> = keyed.into_iter().map(|(_, i)| i).collect();
            member.iter_mut().for_each(|m| *m = false);
            clique.clear();
            let mut weight = 0u64;
            let fill = |clique: &mut Vec<usize>, member: &mut [bool], weight: &mut u64, work: &mut u64| {
                for &x in &order {
                    if !member[x] {
                        *work += clique.len() as u64;
                        if clique.iter().all(|&y| self.adjacent(x, y)) {
                            clique.push(x);
                            member[x] = true;
                            *weight += w[x];
                        }
                    }
                }
            };
            fill(&mut clique, &mut member, &mut weight, &mut work);
            let mut gained = true;
            while gained && work <= CLIQUE_WORK {
                gained = false;
                for &x in &order {
                    if member[x] {
                        continue;
                    }
                    work += clique.len() as u64;
                    let lost: u64 = clique.iter().filter(|&&y| !self.adjacent(x, y)).map(|&y| w[y]).sum();
                    if w[x] > lost {
                        for &y in &clique {
                            if !self.adjacent(x, y) {
                                member[y] = false;
                            }
                        }
                        clique.retain(|&y| member[y]);
                        clique.push(x);
                        member[x] = true;
                        weight = weight - lost + w[x];
                        fill(&mut clique, &mut member, &mut weight, &mut work);
                        gained = true;
                    }
                }
            }
            best = best.max(weight);
        }
        best
    }
}

/// Clique attempts of [`ConflictGraph::heavy_clique`] at most (three plain orders, the
/// rest with noise).
const MAX_CLIQUE_ATTEMPTS: usize = 32;

/// Adjacency tests of [`ConflictGraph::heavy_clique`] after which no attempt starts (about
/// 10 ms).
const CLIQUE_WORK: u64 = 8_000_000;

/// No placement of `buffers` fits in fewer bytes: the larger of [`live_bound`] and the
/// alias bound (a clique of pairwise conflicting alias groups; see [`Placement::lower_bound`]).
pub fn lower_bound(buffers: &[Buffer]) -> Result<u64, PlaceError> {
    let p = Problem::build(buffers)?;
    Ok(p.lower_bound().max(p.alias_bound()))
}

/// Most bytes live at any time, every buffer at its own size (members of one alias group
/// that are live together count once, as the largest of them).
pub fn live_bound(buffers: &[Buffer]) -> Result<u64, PlaceError> {
    Ok(Problem::build(buffers)?.lower_bound())
}

// ------------------------------------------------------------------------------------------
// The time-bucketed index of placed items.

#[derive(Debug, Clone, Copy)]
struct Entry {
    off: u64,
    top: u64,
    s: u32,
    e: u32,
    item: u32,
}

/// Placed intervals, bucketed by compressed clock rank at several resolutions; each bucket
/// sorted by offset. An interval goes to the finest level whose buckets are at least as
/// wide as it is (so it lands in one or two buckets), which keeps short queries from
/// scanning long-lived entries bucket by bucket and long ones from being copied into many.
#[derive(Debug, Clone)]
struct Index {
    levels: Vec<Level>,
}

#[derive(Debug, Clone)]
struct Level {
    shift: u32,
    entries: usize,
    buckets: Vec<Vec<Entry>>,
}

/// Bucket width of the finest level: 2^BASE_SHIFT ranks; each level is 4 times wider.
const BASE_SHIFT: u32 = 5;

impl Index {
    fn new(p: &Problem) -> Index {
        let mut levels = Vec::new();
        let mut shift = BASE_SHIFT;
        loop {
            let n = ((p.ranks as usize) >> shift) + 1;
            levels.push(Level { shift, entries: 0, buckets: vec![Vec::new(); n] });
            if n == 1 {
                break;
            }
            shift += 2;
        }
        Index { levels }
    }

    fn level_of(&self, s: u32, e: u32) -> usize {
        let len = e - s;
        let mut k = 0;
        while k + 1 < self.levels.len() && len > (1u32 << self.levels[k].shift) {
            k += 1;
        }
        k
    }

    fn insert(&mut self, p: &Problem, item: usize, off: u64) {
        let top = off + p.size[item];
        for &(s, e) in p.ivs(item) {
            let en = Entry { off, top, s, e, item: item as u32 };
            let k = self.level_of(s, e);
            let level = &mut self.levels[k];
            level.entries += 1;
            for b in (s >> level.shift)..=((e - 1) >> level.shift) {
                let bucket = &mut level.buckets[b as usize];
                let pos = bucket.partition_point(|x| x.off <= off);
                bucket.insert(pos, en);
            }
        }
    }

    fn remove(&mut self, p: &Problem, item: usize, off: u64) {
        for &(s, e) in p.ivs(item) {
            let k = self.level_of(s, e);
            let level = &mut self.levels[k];
            level.entries -= 1;
            for b in (s >> level.shift)..=((e - 1) >> level.shift) {
                let bucket = &mut level.buckets[b as usize];
                let mut pos = bucket.partition_point(|x| x.off < off);
                while bucket[pos].item != item as u32 || bucket[pos].s != s {
                    pos += 1;
                }
                bucket.remove(pos);
            }
        }
    }

    /// Calls `f` once for every placed interval overlapping `[s, e)`, bucket by bucket
    /// (each bucket's entries by offset).
    fn for_each(&self, s: u32, e: u32, mut f: impl FnMut(&Entry)) {
        self.scan(s, e, &mut f, |_| {}, |f, en| f(en));
    }

    /// [`Index::for_each`] with a `state` that `entry` gets with each interval and `bucket`
    /// before each bucket visited.
    #[inline(always)]
    fn scan<S>(
        &self,
        s: u32,
        e: u32,
        state: &mut S,
        mut bucket: impl FnMut(&mut S),
        mut entry: impl FnMut(&mut S, &Entry),
    ) {
        for level in &self.levels {
            if level.entries == 0 {
                continue;
            }
            let b0 = s >> level.shift;
            let b1 = (e - 1) >> level.shift;
            for b in b0..=b1 {
                bucket(state);
                for en in &level.buckets[b as usize] {
                    if en.s < e && en.e > s && (en.s >> level.shift).max(b0) == b {
                        entry(state, en);
                    }
                }
            }
        }
    }

    /// Appends `(offset, top)` of every placed interval overlapping `[s, e)` to `out`, one
    /// sorted run per bucket visited; `runs` gets the start of every run after the first
    /// that does not continue the one before it in order (empty: `out` is sorted).
    fn query_runs(&self, s: u32, e: u32, out: &mut Vec<(u64, u64)>, runs: &mut Vec<u32>) {
        // A run is closed when the next bucket starts, and at the end.
        let close = |out: &Vec<(u64, u64)>, runs: &mut Vec<u32>, run: usize| {
            if run > 0 && out.len() > run && out[run - 1].0 > out[run].0 {
                runs.push(run as u32);
            }
        };
        let mut state = (out, runs, 0usize);
        self.scan(
            s,
            e,
            &mut state,
            |(out, runs, run)| {
                close(out, runs, *run);
                *run = out.len();
            },
            |(out, _, _), en| out.push((en.off, en.top)),
        );
        let (out, runs, run) = state;
        close(out, runs, run);
    }

    /// Lowest offset at which `item` fits under `fit`.
    fn find(&self, p: &Problem, item: usize, fit: Fit, scratch: &mut FindScratch) -> u64 {
        scratch.pairs.clear();
        let mut sorted = true;
        let ivs = p.ivs(item);
        if ivs.len() == 1 {
            scratch.runs.clear();
            self.query_runs(ivs[0].0, ivs[0].1, &mut scratch.pairs, &mut scratch.runs);
            if !scratch.runs.is_empty() {
                merge_runs(&mut scratch.pairs, &mut scratch.runs, &mut scratch.spare);
            }
        } else {
            // An item with several intervals meets most neighbours in several of them, and
            // every interval of a neighbour has its offset: one pair per neighbour.
            if scratch.seen.len() < p.len() {
                scratch.seen.resize(p.len(), 0);
            }
            scratch.epoch = scratch.epoch.wrapping_add(1);
            if scratch.epoch == 0 {
                scratch.seen.fill(0);
                scratch.epoch = 1;
            }
            let FindScratch { pairs, seen, epoch, .. } = scratch;
            for &(s, e) in ivs {
                self.for_each(s, e, |en| {
                    let k = en.item as usize;
                    if seen[k] != *epoch {
                        seen[k] = *epoch;
                        if let Some(last) = pairs.last()
                            && last.0 > en.off
                        {
                            sorted = false;
                        }
                        pairs.push((en.off, en.top));
                    }
                });
            }
        }
        if !sorted {
            scratch.pairs.sort_unstable_by_key(|x| x.0);
        }
        let scratch = &scratch.pairs;
        let size = p.size[item];
        let mut cur = 0u64;
        let mut best: Option<(u64, u64)> = None;
        for &(o, t) in scratch.iter() {
            if o >= cur + size {
                let gap = o - cur;
                match fit {
                    Fit::LowestOffset => return cur,
                    Fit::BestFit => {
                        if gap == size {
                            return cur;
                        }
                        if best.is_none_or(|(g, _)| gap < g) {
                            best = Some((gap, cur));
                        }
                    }
                }
            }
            cur = cur.max(t);
        }
        best.map_or(cur, |(_, o)| o)
    }
}

/// Scratch space of [`Index::find`]: the (offset, top) pairs of the neighbours, and marks of
/// the neighbours already seen (items with several intervals).
#[derive(Debug, Default)]
struct FindScratch {
    pairs: Vec<(u64, u64)>,
    /// Starts of the sorted runs of `pairs` after the first, and room to merge them.
    runs: Vec<u32>,
    spare: Vec<(u64, u64)>,
    seen: Vec<u32>,
    epoch: u32,
}

/// Sorts `v` by offset, given that it is sorted runs starting at 0 and at each of `runs`
/// (ascending): adjacent runs merged pairwise, pass after pass, through `spare`.
fn merge_runs(v: &mut Vec<(u64, u64)>, runs: &mut Vec<u32>, spare: &mut Vec<(u64, u64)>) {
    let n = v.len() as u32;
    while !runs.is_empty() {
        spare.clear();
        let mut merged = 0;
        let mut k = 0;
        // Run k covers [start(k), start(k + 1)); start(0) = 0, the last ends at n.
        let start = |runs: &[u32], k: usize| if k == 0 { 0 } else { runs[k - 1] };
        let count = runs.len() + 1;
        while k < count {
            let a = start(runs, k) as usize;
            let m = if k + 1 < count { start(runs, k + 1) as usize } else { n as usize };
            let b = if k + 2 < count { start(runs, k + 2) as usize } else { n as usize };
            if k > 0 {
                runs[merged] = spare.len() as u32;
                merged += 1;
            }
            let (mut i, mut j) = (a, m);
            while i < m && j < b {
                if v[j].0 < v[i].0 {
                    spare.push(v[j]);
                    j += 1;
                } else {
                    spare.push(v[i]);
                    i += 1;
                }
            }
            spare.extend_from_slice(&v[i..m]);
            spare.extend_from_slice(&v[j..b]);
            k += 2;
        }
        runs.truncate(merged);
        std::mem::swap(v, spare);
    }
}

/// Places `items` in order into `index`, writing `off`; returns the highest top.
fn greedy(p: &Problem, items: &[u32], fit: Fit, index: &mut Index, off: &mut [u64]) -> u64 {
    let mut scratch = FindScratch::default();
    let mut high = 0;
    for &i in items {
        let i = i as usize;
        let o = index.find(p, i, fit, &mut scratch);
        off[i] = o;
        index.insert(p, i, o);
        high = high.max(o + p.size[i]);
    }
    high
}

/// Sorts `items` into the placement order of `order`, with multiplicative noise on the
/// key (0 = none) drawn from `rng`.
fn sort_items(p: &Problem, items: &mut [u32], order: Order, noise: f64, rng: &mut Rng) {
    if noise == 0.0 {
        match order {
            Order::Size => items.sort_unstable_by_key(|&i| {
                let i = i as usize;
                (std::cmp::Reverse(p.size[i]), std::cmp::Reverse(p.life[i]), p.start[i], i)
            }),
            Order::Lifetime => items.sort_unstable_by_key(|&i| {
                let i = i as usize;
                (std::cmp::Reverse(p.life[i]), std::cmp::Reverse(p.size[i]), p.start[i], i)
            }),
            Order::Area => items.sort_unstable_by_key(|&i| {
                let i = i as usize;
                let area = p.size[i] as u128 * p.life[i] as u128;
                (std::cmp::Reverse(area), std::cmp::Reverse(p.size[i]), p.start[i], i)
            }),
            Order::Start => items.sort_unstable_by_key(|&i| {
                let i = i as usize;
                (p.start[i], std::cmp::Reverse(p.size[i]), i)
            }),
            Order::Breadth => items.sort_unstable_by_key(|&i| {
                let i = i as usize;
                (std::cmp::Reverse(p.peak[i]), std::cmp::Reverse(p.size[i]), p.start[i], i)
            }),
        }
        return;
    }
    let mut keyed: Vec<(f64, u32)> = items
        .iter()
        .map(|&i| {
            let u = i as usize;
            let base = match order {
                Order::Size => p.size[u] as f64,
                Order::Lifetime => p.life[u] as f64,
                Order::Area => p.size[u] as f64 * p.life[u] as f64,
                Order::Start => -(p.start[u] as f64) - 1.0,
                Order::Breadth => p.peak[u] as f64 + p.size[u] as f64 / (1u64 << 40) as f64,
            };
            let factor = 1.0 + noise * (rng.unit() - 0.5);
            (if base >= 0.0 { base * factor } else { base / factor }, i)
        })
        .collect();
    keyed.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    for (slot, (_, i)) in items.iter_mut().zip(keyed) {
        *slot = i;
    }
}

// ------------------------------------------------------------------------------------------
// The online best-fit floor.

/// The clock events of an online sweep over the items' hulls: (rank, start?, item), ends
/// before starts at the same rank.
fn clock_events(p: &Problem) -> Vec<(u32, bool, u32)> {
    let mut events: Vec<(u32, bool, u32)> = Vec::with_capacity(2 * p.len());
    for i in 0..p.len() {
        events.push((p.hull[i].0, true, i as u32));
        events.push((p.hull[i].1, false, i as u32));
    }
    events.sort_unstable();
    events
}

/// The free space of an online sweep: gaps below `top` by offset and by (length, offset).
#[derive(Default)]
struct FreeSpace {
    by_off: BTreeMap<u64, u64>,
    by_len: BTreeSet<(u64, u64)>,
    top: u64,
}

impl FreeSpace {
    /// Gaps of at least `size` bytes, smallest first: (length, offset).
    fn fitting(&self, size: u64) -> impl Iterator<Item = &(u64, u64)> {
        self.by_len.range((size, 0)..)
    }

    fn insert(&mut self, o: u64, len: u64) {
        self.by_off.insert(o, len);
        self.by_len.insert((len, o));
    }

    fn remove(&mut self, o: u64, len: u64) {
        self.by_off.remove(&o);
        self.by_len.remove(&(len, o));
    }

    /// Takes `[at, at + size)` out of the gap `[o, o + len)`.
    fn take(&mut self, o: u64, len: u64, at: u64, size: u64) {
        self.remove(o, len);
        if at > o {
            self.insert(o, at - o);
        }
        if at + size < o + len {
            self.insert(at + size, o + len - at - size);
        }
    }

    /// Where an item that fits in no gap goes: the gap that ends at the top, else the top.
    fn above(&mut self, size: u64) -> u64 {
        match self.by_off.last_key_value().map(|(&o, &len)| (o, len)) {
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
    fn free(&mut self, o: u64, size: u64) {
        let (mut o, mut len) = (o, size);
        if let Some((&po, &pl)) = self.by_off.range(..o).next_back()
            && po + pl == o
        {
            self.remove(po, pl);
            o = po;
            len += pl;
        }
        if let Some(&nl) = self.by_off.get(&(o + len)) {
            self.remove(o + len, nl);
            len += nl;
        }
        self.insert(o, len);
    }
}

/// Online best-fit in clock order over each item's hull. Returns offsets and footprint.
fn online_best_fit(p: &Problem) -> (Vec<u64>, u64) {
    let mut off = vec![0u64; p.len()];
    let mut free = FreeSpace::default();
    for (_, is_start, i) in clock_events(p) {
        let i = i as usize;
        let size = p.size[i];
        if !is_start {
            free.free(off[i], size);
            continue;
        }
        let fit = free.fitting(size).next().copied();
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

/// Online placement in clock order like [`online_best_fit`], choosing among the `k` smallest
/// free gaps that fit: the item goes to the bottom or the top of a gap, next to the live
/// item whose end is closest to its own (space freed together coalesces), scored by the
/// gap's leftover relative to the item plus `weight` × the end distance in mean lifetimes.
/// `None` when `stop()` says so (asked every 4096 clock events).
fn online_aligned(p: &Problem, k: usize, weight: f64, stop: impl Fn() -> bool) -> Option<(Vec<u64>, u64)> {
    let mean = p.mean_span().max(1) as f64;
    let mut off = vec![0u64; p.len()];
    let mut free = FreeSpace::default();
    // Live items by offset: (top, end rank).
    let mut live: BTreeMap<u64, (u64, u32)> = BTreeMap::new();
    let mut cands: Vec<(u64, u64)> = Vec::with_capacity(k);
    for (step, (_, is_start, i)) in clock_events(p).into_iter().enumerate() {
        if step % 4096 == 4095 && stop() {
            return None;
        }
        let i = i as usize;
        let size = p.size[i];
        let end = p.hull[i].1;
        if !is_start {
            live.remove(&off[i]);
            free.free(off[i], size);
            continue;
        }
        cands.clear();
        cands.extend(free.fitting(size).take(k).copied());
        let mut best: Option<(f64, u64, u64, u64)> = None; // score, gap len, gap off, item off
        for &(len, o) in &cands {
            let waste = (len - size) as f64 / size as f64;
            // Bottom: next to the item below (its top is `o`); top: next to the one above.
            let below = if o == 0 {
                None
            } else {
                live.range(..o).next_back().filter(|(_, v)| v.0 == o).map(|(_, v)| v.1)
            };
            let above = live.get(&(o + len)).map(|v| v.1);
            for (at, nb) in [(o, below), (o + len - size, above)] {
                let dist = nb.map_or(mean * 4.0, |e| (e as f64 - end as f64).abs());
                let score = waste + weight * dist / mean;
                if best.is_none_or(|b| score < b.0) {
                    best = Some((score, len, o, at));
                }
            }
            if len == size {
                break;
            }
        }
        off[i] = match best {
            Some((_, len, o, at)) => {
                free.take(o, len, at, size);
                at
            }
            None => free.above(size),
        };
        live.insert(off[i], (off[i] + size, end));
    }
    Some((off, free.top))
}

// ------------------------------------------------------------------------------------------
// Exact search for tiny problems.

/// Exact search over *canonical* placements: every item sits as low as it fits given the
/// items placed before it, and items are placed in order of offset. Any placement can be
/// lowered item by item until nothing can move down, and sorted by offset that one is
/// canonical (an item's lower positions cannot be blocked by items above it, which start at
/// or above its top where they conflict), so the search is complete. Pruned by the
/// incumbent and by what must still fit above the last offset: at every rank, the bytes of
/// placed items above it plus the unplaced bytes live there; a branch ends as soon as an
/// unplaced item fits wholly below the last offset (nothing placed later can block that
/// spot, and canonical order would need it higher); items at one offset that do not
/// conflict go in index order. Returns a placement lower than `incumbent` (stopping at
/// `lb`), or `None` when there is none. Exponential: for [`EXACT_MAX_ITEMS`] items at most.
fn exact(p: &Problem, lb: u64, incumbent: u64) -> Option<Vec<u64>> {
    let n = p.len();
    let conflicts: Vec<Vec<usize>> =
        (0..n).map(|a| (0..n).filter(|&b| b != a && p.conflict(a, b)).collect()).collect();
    let ranks = p.ranks as usize;
    let mut unplaced = vec![0u64; ranks];
    for i in 0..n {
        for &(s, e) in p.ivs(i) {
            for load in &mut unplaced[s as usize..e as usize] {
                *load += p.size[i];
            }
        }
    }
    struct Search<'a> {
        p: &'a Problem,
        conflicts: Vec<Vec<usize>>,
        placed: Vec<bool>,
        off: Vec<u64>,
        unplaced: Vec<u64>,
        above: Vec<u64>,
        best: u64,
        best_off: Option<Vec<u64>>,
        lb: u64,
    }
    impl Search<'_> {
        /// Lowest offset where `i` fits beside the placed items.
        fn lowest(&self, i: usize) -> u64 {
            let size = self.p.size[i];
            let mut taken: Vec<(u64, u64)> = self.conflicts[i]
                .iter()
                .filter(|&&j| self.placed[j])
                .map(|&j| (self.off[j], self.off[j] + self.p.size[j]))
                .collect();
            taken.sort_unstable();
            let mut cur = 0;
            for (o, t) in taken {
                if o >= cur + size {
                    return cur;
                }
                cur = cur.max(t);
            }
            cur
        }

        /// No placement below this from here: the tops so far, and at every rank the last
        /// offset plus the placed bytes above it plus the unplaced bytes live there.
        fn bound(&mut self, high: u64, last: u64) -> u64 {
            self.above.iter_mut().for_each(|x| *x = 0);
            for j in 0..self.p.len() {
                let top = self.off[j] + self.p.size[j];
                if self.placed[j] && top > last {
                    let part = top - self.off[j].max(last);
                    for &(s, e) in self.p.ivs(j) {
                        for x in &mut self.above[s as usize..e as usize] {
                            *x += part;
                        }
                    }
                }
            }
            let need =
                self.unplaced.iter().zip(&self.above).map(|(u, a)| if *u > 0 { last + a + u } else { 0 });
            need.max().unwrap_or(0).max(high)
        }

        fn dfs(&mut self, depth: usize, high: u64, last: u64, last_item: usize) {
            if self.best <= self.lb {
                return;
            }
            let n = self.p.len();
            if depth == n {
                if high < self.best {
                    self.best = high;
                    self.best_off = Some(self.off.clone());
                }
                return;
            }
            if self.bound(high, last) >= self.best {
                return;
            }
            let mut cands: Vec<(u64, std::cmp::Reverse<u64>, usize)> = Vec::new();
            for i in 0..n {
                if self.placed[i] {
                    continue;
                }
                let o = self.lowest(i);
                if o + self.p.size[i] <= last {
                    // It fits wholly below the last offset, where nothing placed from now
                    // on can block it, yet canonical order puts it at or above that offset.
                    return;
                }
                let symmetric =
                    o == last && last_item < n && i < last_item && !self.conflicts[i].contains(&last_item);
                if o < last || symmetric || o + self.p.size[i] >= self.best {
                    continue;
                }
                cands.push((o, std::cmp::Reverse(self.p.size[i]), i));
            }
            cands.sort_unstable();
            for (o, _, i) in cands {
                if o + self.p.size[i] >= self.best {
                    continue;
                }
                self.placed[i] = true;
                self.off[i] = o;
                for &(s, e) in self.p.ivs(i) {
                    for load in &mut self.unplaced[s as usize..e as usize] {
                        *load -= self.p.size[i];
                    }
                }
                self.dfs(depth + 1, high.max(o + self.p.size[i]), o, i);
                for &(s, e) in self.p.ivs(i) {
                    for load in &mut self.unplaced[s as usize..e as usize] {
                        *load += self.p.size[i];
                    }
                }
                self.placed[i] = false;
            }
        }
    }
    let mut s = Search {
        p,
        conflicts,
        placed: vec![false; n],
        off: vec![0; n],
        unplaced,
        above: vec![0; ranks],
        best: incumbent,
        best_off: None,
        lb,
    };
    s.dfs(0, 0, 0, usize::MAX);
    s.best_off
}

// ------------------------------------------------------------------------------------------
// Decomposition.

/// Cut points of the clock and which items cross them.
#[derive(Debug)]
struct Decomposition {
    /// Window of each item, or `u32::MAX` for items crossing a cut.
    window: Vec<u32>,
    windows: usize,
    crossing: Vec<u32>,
    rest: Vec<u32>,
}

fn decompose(p: &Problem, lb: u64) -> Decomposition {
    let r = p.ranks as usize;
    let mut diff = vec![0i128; r + 2];
    let mut starts = vec![0u32; r + 1];
    for i in 0..p.len() {
        let (s, e) = p.hull[i];
        starts[s as usize] += 1;
        if s + 1 < e {
            diff[s as usize + 1] += p.size[i] as i128;
            diff[e as usize] -= p.size[i] as i128;
        }
    }
    // A cut at rank c splits [.., c) from [c, ..); items with s < c < e cross it.
    let threshold = (lb / 20) as i128;
    let mut cuts: Vec<u32> = Vec::new();
    let (mut cross, mut since) = (0i128, 0u32);
    for c in 0..r {
        cross += diff[c];
        if c > 0 && since > 0 && (cross == 0 || (cross <= threshold && since >= 512)) {
            cuts.push(c as u32);
            since = 0;
        }
        since += starts[c];
    }
    let mut window = vec![0u32; p.len()];
    let (mut crossing, mut rest) = (Vec::new(), Vec::new());
    for i in 0..p.len() {
        let (s, e) = p.hull[i];
        let k = cuts.partition_point(|&c| c <= s);
        if k < cuts.len() && cuts[k] < e {
            window[i] = u32::MAX;
            crossing.push(i as u32);
        } else {
            window[i] = k as u32;
            rest.push(i as u32);
        }
    }
    Decomposition { window, windows: cuts.len() + 1, crossing, rest }
}

// ------------------------------------------------------------------------------------------
// The improvement stage.

#[derive(Debug, Default)]
struct ImproveStats {
    steps: u64,
    improved: bool,
}

/// Scratch space of [`repack`].
#[derive(Default)]
struct Repack {
    stamp: Vec<u32>,
    epoch: u32,
    window: Vec<u32>,
    times: Vec<u32>,
    floor: Vec<u64>,
    ents: Vec<(u64, u32, u32)>,
    next: Vec<u32>,
}

/// A skyline re-pack of the top of a window (improvement stage, items with one interval):
/// the items that lie in a window of the clock around `c` (an item at the top, `high`) and
/// sit at or above a level `y0` ≤ `off[c]` are taken out; every item left (inside the
/// window or crossing its ends) makes a *floor* — at each rank of the window the highest
/// byte still used — and the taken items are packed bottom-up on that floor by [`skyline_on`]
/// (a random pick rule, sometimes with noise). Each goes at or above the floor over its
/// whole lifetime and the skyline keeps them apart, so the result is valid. Kept when the
/// taken items' top (highest byte, then how many reach it) is not worse than before, like
/// the window moves. Returns the items that moved when kept.
#[allow(clippy::too_many_arguments)]
fn repack<'a>(
    p: &Problem,
    index: &mut Index,
    off: &mut [u64],
    high: u64,
    c: usize,
    span: u64,
    deadline: Instant,
    rng: &mut Rng,
    rp: &'a mut Repack,
) -> Option<&'a [u32]> {
    let m = span * [0u64, 1, 2, 4][rng.below(4) as usize];
    let (hs, he) = p.hull[c];
    let t0 = (hs as u64).saturating_sub(rng.below(m + 1)) as u32;
    let t1 = ((he as u64) + rng.below(m + 1)).min(p.ranks as u64) as u32;
    let f = [0.05, 0.1, 0.2, 0.4][rng.below(4) as usize];
    let y0 = off[c].min(high - (high as f64 * f) as u64);
    rp.epoch += 1;
    let epoch = rp.epoch;
    rp.window.clear();
    {
        let (stamp, window) = (&mut rp.stamp, &mut rp.window);
        index.for_each(t0, t1, |en| {
            let i = en.item as usize;
            if stamp[i] != epoch {
                stamp[i] = epoch;
                let (s, e) = p.hull[i];
                if s >= t0 && e <= t1 && en.off >= y0 {
                    window.push(en.item);
                }
            }
        });
    }
    let mut before = Reach::default();
    for &i in &rp.window {
        before.add(off[i as usize] + p.size[i as usize]);
        index.remove(p, i as usize, off[i as usize]);
    }
    // The sub-problem's clock: the distinct ends of the taken items (rank k of it covers
    // the ranks [times[k], times[k + 1]) of `p`).
    rp.times.clear();
    for &i in &rp.window {
        let (s, e) = p.hull[i as usize];
        rp.times.push(s);
        rp.times.push(e);
    }
    rp.times.sort_unstable();
    rp.times.dedup();
    let bufs: Vec<Buffer> = rp
        .window
        .iter()
        .map(|&i| {
            let (s, e) = p.hull[i as usize];
            Buffer { start: s as u64, end: e as u64, size: p.size[i as usize], group: None }
        })
        .collect();
    // The floor: the highest item left over each rank of the sub-problem. Items by top,
    // highest first, each fills the ranks not filled yet (`next` skips filled runs).
    let times = &rp.times;
    let last = times.len() - 1;
    rp.floor.clear();
    rp.floor.resize(times.len(), 0);
    rp.ents.clear();
    {
        let ents = &mut rp.ents;
        index.for_each(times[0], times[last], |en| ents.push((en.top, en.s, en.e)));
    }
    rp.ents.sort_unstable_by(|a, b| b.cmp(a));
    rp.next.clear();
    rp.next.extend(0..=last as u32);
    for &(t, s, e) in &rp.ents {
        let mut k = times.partition_point(|&x| x <= s).saturating_sub(1);
        let kb = times.partition_point(|&x| x < e).min(last);
        while k < kb {
            let mut r = k;
            while rp.next[r] as usize != r {
                let nn = rp.next[rp.next[r] as usize];
                rp.next[r] = nn;
                r = nn as usize;
            }
            if r >= kb {
                break;
            }
            rp.floor[r] = t;
            rp.next[r] = r as u32 + 1;
            k = r + 1;
        }
    }
    let mut kept = false;
    if let Ok(sub) = Problem::build(&bufs) {
        let rule = [5u8, 1, 4, 3][rng.below(4) as usize];
        let q = [0.0, 0.02, 0.1][rng.below(3) as usize];
        let res = if q > 0.0 {
            skyline_on(&sub, rule, Some((q, &mut *rng)), deadline, Some(&rp.floor))
        } else {
            skyline_on(&sub, rule, None, deadline, Some(&rp.floor))
        };
        if let Some((so, _)) = res {
            let mut after = Reach::default();
            for (k, &i) in rp.window.iter().enumerate() {
                after.add(so[k] + p.size[i as usize]);
            }
            if after <= before {
                for (k, &i) in rp.window.iter().enumerate() {
                    off[i as usize] = so[k];
                }
                kept = true;
            }
        }
    }
    for &i in &rp.window {
        index.insert(p, i as usize, off[i as usize]);
    }
    if kept { Some(&rp.window) } else { None }
}

/// How high a set of items reaches (the improvement stage's acceptance test): the highest
/// top, then how many items reach it. Lower is better; it can only grow as items are added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
struct Reach {
    high: u64,
    count: u32,
}

impl Reach {
    fn add(&mut self, top: u64) {
        if top > self.high {
            self.high = top;
            self.count = 1;
        } else if top == self.high {
            self.count += 1;
        }
    }
}

/// Items a window of the improvement stage holds at most, about (see `improve`).
const WINDOW_ITEMS: u64 = 4096;
/// Placed items one window re-placement may visit, about (see `improve`).
const WINDOW_WORK: u64 = 1_000_000;

/// The improvement stage from `off` (see the module documentation); `pairs` is
/// [`Problem::overlapping_pairs`].
fn improve(p: &Problem, off: &mut [u64], lb: u64, pairs: u64, deadline: Instant, seed: u64) -> ImproveStats {
    let n = p.len();
    let mut stats = ImproveStats::default();
    let mut index = Index::new(p);
    for i in 0..n {
        index.insert(p, i, off[i]);
    }
    let mut top: Vec<u64> = (0..n).map(|i| off[i] + p.size[i]).collect();
    let mut high = top.iter().copied().max().unwrap_or(0);
    let start_high = high;
    let mut crit: Vec<u32> = (0..n as u32).filter(|&i| top[i as usize] == high).collect();
    let mut rng = Rng::new(seed);
    let span = p.mean_span() as u64;
    // Ranks a window may cover: at the input's arrival rate, as many items as keep one
    // re-placement to about `WINDOW_WORK` visits of placed items (each item's gap query sees
    // the items live with it), at most `WINDOW_ITEMS`: dense inputs with long lifetimes
    // would otherwise spend tens of milliseconds per step.
    let overlap = (2 * pairs / n.max(1) as u64).max(1);
    let items = (WINDOW_WORK / overlap).clamp(64, WINDOW_ITEMS);
    let reach = (items * p.ranks as u64 / n.max(1) as u64).max(64);
    let mut stamp = vec![0u32; n];
    let mut epoch = 0u32;
    let mut window: Vec<u32> = Vec::new();
    let mut crossing: Vec<u32> = Vec::new();
    let mut new_off = vec![0u64; n];
    let mut scratch = FindScratch::default();
    let single = p.ivs.len() == n;
    let mut rp = Repack { stamp: vec![0; n], ..Repack::default() };
    while high > lb && Instant::now() < deadline {
        // A buffer at the top.
        let c = loop {
            if crit.is_empty() {
                high = top.iter().copied().max().unwrap_or(0);
                crit = (0..n as u32).filter(|&i| top[i as usize] == high).collect();
            }
            let k = rng.below(crit.len() as u64) as usize;
            if top[crit[k] as usize] == high {
                break crit[k] as usize;
            }
            crit.swap_remove(k);
        };
        if high <= lb {
            break;
        }
        stats.steps += 1;
        if single && rng.below(4) == 0 {
            if let Some(kept) =
                repack(p, &mut index, off, high, c, span.min(reach / 8), deadline, &mut rng, &mut rp)
            {
                for &i in kept {
                    top[i as usize] = off[i as usize] + p.size[i as usize];
                    if top[i as usize] == high {
                        crit.push(i);
                    }
                }
            }
            continue;
        }
        // A window of the clock around it (a random stretch of its lifetime when that is long).
        let mult = [0u64, 1, 2, 4, 8][rng.below(5) as usize];
        let (mut hs, mut he) = p.hull[c];
        let max_len = (span * 16).max(64).min(reach) as u32;
        if he - hs > max_len {
            hs += rng.below((he - hs - max_len) as u64 + 1) as u32;
            he = hs + max_len;
        }
        let ext = (span * mult).min(reach / 2);
        let t0 = (hs as u64).saturating_sub(rng.below(ext + 1)) as u32;
        let t1 = ((he as u64) + rng.below(ext + 1)).min(p.ranks as u64) as u32;
        epoch += 1;
        window.clear();
        window.push(c as u32);
        stamp[c] = epoch;
        crossing.clear();
        index.for_each(t0, t1, |en| {
            let i = en.item as usize;
            if stamp[i] != epoch {
                stamp[i] = epoch;
                let (s, e) = p.hull[i];
                if s >= t0 && e <= t1 {
                    window.push(en.item);
                } else if !single {
                    crossing.push(en.item);
                }
            }
        });
        // Items with several intervals (alias groups) can span the whole clock, so no window
        // would hold them: those live in the window join it (a re-placement checks every
        // interval), a random sample of them when they are many.
        if !crossing.is_empty() {
            let room = (items as usize).saturating_sub(window.len());
            for k in 0..crossing.len().min(room) {
                let j = k + rng.below((crossing.len() - k) as u64) as usize;
                crossing.swap(k, j);
                window.push(crossing[k]);
            }
        }
        let mut before = Reach::default();
        for &i in &window {
            before.add(off[i as usize] + p.size[i as usize]);
        }
        for &i in &window {
            index.remove(p, i as usize, off[i as usize]);
        }
        let strat = Strategy::PORTFOLIO[rng.below(Strategy::PORTFOLIO.len() as u64) as usize];
        let noise = [0.0, 0.05, 0.2, 0.6][rng.below(4) as usize];
        sort_items(p, &mut window, strat.order, noise, &mut rng);
        if rng.below(2) == 0 {
            // The buffer at the top goes first.
            let pos = window.iter().position(|&i| i as usize == c).unwrap_or(0);
            window[..=pos].rotate_right(1);
        }
        // Re-place in order; give up as soon as the window's top (highest byte, then how
        // many items reach it) is worse than before.
        let mut after = Reach::default();
        let mut placed = 0;
        for &i in &window {
            let i = i as usize;
            let o = index.find(p, i, strat.fit, &mut scratch);
            new_off[i] = o;
            index.insert(p, i, o);
            placed += 1;
            after.add(o + p.size[i]);
            if after > before || (placed % 64 == 0 && Instant::now() > deadline) {
                after.high = u64::MAX;
                break;
            }
        }
        if after <= before {
            for &i in &window {
                let i = i as usize;
                off[i] = new_off[i];
                top[i] = off[i] + p.size[i];
                if top[i] == high {
                    crit.push(i as u32);
                }
            }
        } else {
            for &i in &window[..placed] {
                index.remove(p, i as usize, new_off[i as usize]);
            }
            // `off` still holds the old offsets.
            for &i in &window {
                index.insert(p, i as usize, off[i as usize]);
            }
        }
    }
    let final_high = top.iter().copied().max().unwrap_or(0);
    stats.improved = final_high < start_high;
    stats
}

// ------------------------------------------------------------------------------------------
// The driver.

/// One construction of the portfolio.
#[derive(Debug, Clone, Copy)]
enum Job {
    /// A greedy order of [`Strategy::PORTFOLIO`] (on the decomposition).
    Greedy(usize),
    /// A rule of [`SKYLINE_RULES`].
    Skyline(usize),
    /// A variant of [`ALIGNED_VARIANTS`].
    Aligned(usize),
}

impl Job {
    /// Index of the job's kind (for the cost estimates).
    fn kind(self) -> usize {
        match self {
            Job::Greedy(_) => 0,
            Job::Skyline(_) => 1,
            Job::Aligned(_) => 2,
        }
    }
}

/// A construction of the portfolio.
struct Built {
    /// Position in the job order (breaks ties).
    job: usize,
    name: String,
    off: Vec<u64>,
    high: u64,
}

/// The online aligned constructions the portfolio runs (see [`online_aligned`]):
/// candidate gaps, weight of the end distance, name.
const ALIGNED_VARIANTS: [(usize, f64, &str); 3] =
    [(32, 4.0, "online-aligned/4"), (32, 8.0, "online-aligned/8"), (32, 2.0, "online-aligned/2")];

/// The skyline pick rules the portfolio runs (see [`skyline`]), most useful first.
const SKYLINE_RULES: [(u8, &str); 4] =
    [(5, "skyline/best-fit"), (1, "skyline/largest"), (4, "skyline/exact-end"), (3, "skyline/area")];

/// Bottom-up skyline packing (for problems whose items each have one interval): the
/// skyline is the highest placed byte at every rank; the lowest stretch of it (a valley
/// bounded by higher stretches) is filled with an unplaced item that starts earliest in it
/// and ends inside it; `rule` picks among those: 1 the largest, 3 the largest size ×
/// lifetime, 4 one that ends where the valley ends (the largest) else the largest, other
/// values the longest. When no item fits, the valley is raised to its lower neighbour (that
/// area is wasted). Zero-slack instances are built bottom-up this way; it is kept only when
/// it beats the other constructions. `O(n log n)` plus the scans of at most 64 start
/// positions per valley. Returns offsets and footprint, or `None` when an item has several
/// intervals or the deadline passes.
fn skyline(
    p: &Problem,
    rule: u8,
    noise: Option<(f64, &mut Rng)>,
    deadline: Instant,
) -> Option<(Vec<u64>, u64)> {
    skyline_on(p, rule, noise, deadline, None)
}

/// [`skyline`] on a floor: `floor[r]` is the lowest byte free at rank `r` (one entry per
/// rank; `None`: 0 everywhere). Every item goes at or above the floor over its interval.
fn skyline_on(
    p: &Problem,
    rule: u8,
    noise: Option<(f64, &mut Rng)>,
    deadline: Instant,
    floor: Option<&[u64]>,
) -> Option<(Vec<u64>, u64)> {
    let mut noise = noise;
    use std::cmp::Reverse;
    let n = p.len();
    if p.ivs.len() != n || n == 0 {
        return None;
    }
    let r = p.ranks as usize;
    let mut by_start = unplaced_by_start(p);
    // `skip[x]`: towards the first rank ≥ x with unplaced items (`r` when none); lists only
    // empty, so a rank, once skipped, stays skipped (path halving keeps the walks short).
    let mut skip: Vec<u32> = (0..=r as u32).collect();
    for (s, list) in by_start.iter().enumerate().take(r) {
        if list.is_empty() {
            skip[s] = s as u32 + 1;
        }
    }
    let next_start = |skip: &mut Vec<u32>, x: usize| -> usize {
        let mut x = x;
        while skip[x] as usize != x {
            let nx = skip[skip[x] as usize];
            skip[x] = nx;
            x = nx as usize;
        }
        x
    };
    let mut seg = Segments::new(r);
    match floor {
        Some(f) if f.len() == r && r > 0 => {
            let mut a = 0;
            let mut pv = NIL;
            for k in 1..=r {
                if k == r || f[k] != f[a] {
                    seg.set(a, k, f[a], pv);
                    pv = a as u32;
                    a = k;
                }
            }
        }
        _ => seg.set(0, r, 0, NIL),
    }
    let mut off = vec![0u64; n];
    let mut high = 0u64;
    let mut left = n;
    let mut steps = 0u32;
    while left > 0 {
        let Some(Reverse((h, a))) = seg.heap.pop() else { break };
        let a = a as usize;
        if !seg.on[a] || seg.height[a] != h {
            continue;
        }
        steps = steps.wrapping_add(1);
        if steps.is_multiple_of(512) && Instant::now() > deadline {
            return None;
        }
        let b = seg.end[a] as usize;
        let left_h = (seg.prev[a] != NIL).then(|| seg.height[seg.prev[a] as usize]);
        let right_h = (b < r).then(|| seg.height[b]);
        // The candidate: earliest start in [a, b), longest ending by b.
        let mut pick: Option<(u32, usize)> = None;
        let mut st = next_start(&mut skip, a);
        let mut scanned = 0;
        while st < b {
            let list = &by_start[st];
            let k = list.partition_point(|&i| p.ivs[i as usize].1 as usize <= b);
            if k > 0 {
                let choice = skyline_pick(p, list, k, rule, h, a, b, left_h, right_h);
                let choice = with_noise(choice, k, &mut noise);
                pick = Some((st as u32, choice));
                break;
            }
            if scanned >= 64 {
                break;
            }
            scanned += 1;
            st = next_start(&mut skip, st + 1);
        }
        match pick {
            Some((st, k)) => {
                let i = by_start[st as usize].remove(k) as usize;
                if by_start[st as usize].is_empty() {
                    skip[st as usize] = st + 1;
                }
                left -= 1;
                let (s, e) = (p.ivs[i].0 as usize, p.ivs[i].1 as usize);
                off[i] = h;
                let top = h + p.size[i];
                high = high.max(top);
                // Split [a, b) into [a, s) at h, [s, e) at top, [e, b) at h; then merge
                // [s, e) with neighbours of its height.
                let before = seg.prev[a];
                seg.on[a] = false;
                let mut pv = before;
                if a < s {
                    seg.set(a, s, h, before);
                    pv = a as u32;
                }
                let (mut ms, mut me, mut mprev) = (s, e, pv);
                if pv != NIL && seg.height[pv as usize] == top {
                    seg.on[pv as usize] = false;
                    ms = pv as usize;
                    mprev = seg.prev[pv as usize];
                }
                if e < b {
                    seg.set(e, b, h, NIL);
                } else if b < r && seg.height[b] == top {
                    seg.on[b] = false;
                    me = seg.end[b] as usize;
                }
                seg.set(ms, me, top, mprev);
                if e < b {
                    seg.prev[e] = ms as u32;
                    if b < r {
                        seg.prev[b] = e as u32;
                    }
                } else if me < r {
                    seg.prev[me] = ms as u32;
                }
            }
            None => {
                // Raise the valley to its lower neighbour and merge.
                let left_n =
                    (seg.prev[a] != NIL).then(|| (seg.prev[a] as usize, seg.height[seg.prev[a] as usize]));
                let right_n = (b < r).then(|| (seg.end[b] as usize, seg.height[b]));
                let target = match (left_n, right_n) {
                    (Some((_, lh)), Some((_, rh))) => lh.min(rh),
                    (Some((_, lh)), None) => lh,
                    (None, Some((_, rh))) => rh,
                    // Nothing fits anywhere: cannot happen while items are left, since
                    // every item fits in the whole clock.
                    (None, None) => return None,
                };
                seg.on[a] = false;
                let (mut ms, mut me, mut mprev) = (a, b, seg.prev[a]);
                if let Some((ps, ph)) = left_n
                    && ph == target
                {
                    seg.on[ps] = false;
                    ms = ps;
                    mprev = seg.prev[ps];
                }
                if let Some((ne, nh)) = right_n
                    && nh == target
                {
                    seg.on[b] = false;
                    me = ne;
                }
                seg.set(ms, me, target, mprev);
                if me < r {
                    seg.prev[me] = ms as u32;
                }
            }
        }
    }
    Some((off, high))
}

/// No segment (before the first).
const NIL: u32 = u32::MAX;

/// The skyline's segments: they partition the ranks; the one starting at `a` (`on[a]`) ends
/// at `end[a]` (the next one's start) at `height[a]`, and `prev[a]` is the start of the one
/// before (`NIL` for the first). A heap of (height, start), with stale entries skipped when
/// popped, finds the lowest.
struct Segments {
    on: Vec<bool>,
    end: Vec<u32>,
    height: Vec<u64>,
    prev: Vec<u32>,
    heap: std::collections::BinaryHeap<std::cmp::Reverse<(u64, u32)>>,
}

impl Segments {
    fn new(ranks: usize) -> Segments {
        Segments {
            on: vec![false; ranks + 1],
            end: vec![0; ranks + 1],
            height: vec![0; ranks + 1],
            prev: vec![NIL; ranks + 1],
            heap: std::collections::BinaryHeap::new(),
        }
    }

    /// Makes `[a, b)` one segment at height `h` after the one starting at `prev`.
    fn set(&mut self, a: usize, b: usize, h: u64, prev: u32) {
        self.on[a] = true;
        self.end[a] = b as u32;
        self.height[a] = h;
        self.prev[a] = prev;
        self.heap.push(std::cmp::Reverse((h, a as u32)));
    }
}

/// Items by start rank (one list per rank and one past the last), each list sorted by (end,
/// size): the skyline's unplaced items.
fn unplaced_by_start(p: &Problem) -> Vec<Vec<u32>> {
    let mut by_start: Vec<Vec<u32>> = vec![Vec::new(); p.ranks as usize + 1];
    for i in 0..p.len() {
        by_start[p.ivs[i].0 as usize].push(i as u32);
    }
    for list in &mut by_start {
        list.sort_unstable_by_key(|&i| (p.ivs[i as usize].1, p.size[i as usize]));
    }
    by_start
}

/// The skyline's pick among `list[..k]` (the unplaced items starting at one rank that end by
/// `b`, sorted by end then size) for the valley `[a, b)` at height `h` whose neighbours are
/// at `left_h` and `right_h`: 1 the largest, 3 the largest size × lifetime, 4 one that ends
/// at `b` (the largest) else the largest, 5 the best fit (ends at `b`, and its top meets the
/// left neighbour when it starts at `a` or the right one when it ends at `b`; then the
/// largest), other values the longest (ties: the largest).
#[allow(clippy::too_many_arguments)]
fn skyline_pick(
    p: &Problem,
    list: &[u32],
    k: usize,
    rule: u8,
    h: u64,
    a: usize,
    b: usize,
    left_h: Option<u64>,
    right_h: Option<u64>,
) -> usize {
    match rule {
        1 => (0..k).max_by_key(|&j| (p.size[list[j] as usize], j)).unwrap_or(k - 1),
        3 => (0..k)
            .max_by_key(|&j| {
                let i = list[j] as usize;
                (p.size[i] as u128 * (p.ivs[i].1 - p.ivs[i].0) as u128, j)
            })
            .unwrap_or(k - 1),
        4 => {
            let exact = list[..k].partition_point(|&i| (p.ivs[i as usize].1 as usize) < b);
            let from = if exact < k { exact } else { 0 };
            (from..k).max_by_key(|&j| (p.size[list[j] as usize], j)).unwrap_or(k - 1)
        }
        5 => (0..k)
            .max_by_key(|&j| {
                let i = list[j] as usize;
                let (s0, e0) = (p.ivs[i].0 as usize, p.ivs[i].1 as usize);
                let top = h + p.size[i];
                let fit = 2 * u8::from(e0 == b)
                    + u8::from(s0 == a && Some(top) == left_h)
                    + u8::from(e0 == b && Some(top) == right_h);
                (fit, p.size[i], j)
            })
            .unwrap_or(k - 1),
        _ => k - 1,
    }
}

/// `choice`, or with probability `q` of `noise` a uniform pick among `k`.
fn with_noise(choice: usize, k: usize, noise: &mut Option<(f64, &mut Rng)>) -> usize {
    match noise.as_mut() {
        Some((q, rng)) => {
            if rng.unit() < *q {
                rng.below(k as u64) as usize
            } else {
                choice
            }
        }
        None => choice,
    }
}

/// A coarser instance: buffers with one lifetime stacked into one, buffers handing over to
/// one of equal size at the same rank chained into one, repeated until nothing changes.
/// Any placement of the coarse buffers gives one of the items (each item at its coarse
/// buffer's offset plus its delta), with the same footprint, and the live bound does not
/// change — the coarse optimum can only be worse, so it is one more construction.
struct Coarse {
    /// Coarse buffers over the compressed clock of the problem.
    buffers: Vec<Buffer>,
    /// For every item of the problem: its coarse buffer and its offset inside it.
    member: Vec<(u32, u64)>,
}

/// Whether [`coarsen`] can remove a tenth of the items in its first round (a cheap test:
/// items sharing a lifetime with another, and items whose end meets the start of one of
/// equal size).
fn coarsens(p: &Problem) -> bool {
    let n = p.len();
    let mut lives: Vec<u64> = p.ivs.iter().map(|&(s, e)| (s as u64) << 32 | e as u64).collect();
    lives.sort_unstable();
    let stacked = lives.windows(2).filter(|w| w[0] == w[1]).count();
    // (start, size) hashed into one word: a collision only makes the test say yes.
    let key = |t: u32, size: u64| (t as u64) << 32 ^ (size.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32);
    let mut heads: Vec<u64> = (0..n).map(|i| key(p.ivs[i].0, p.size[i])).collect();
    heads.sort_unstable();
    let chained = (0..n).filter(|&i| heads.binary_search(&key(p.ivs[i].1, p.size[i])).is_ok()).count();
    (stacked + chained) * 10 >= n
}

fn coarsen(p: &Problem) -> Coarse {
    type Block = (u32, u32, u64, Vec<(u32, u64)>);
    let n = p.len();
    // (start, end, size, members as (item, delta))
    let mut cur: Vec<Block> =
        (0..n).map(|i| (p.ivs[i].0, p.ivs[i].1, p.size[i], vec![(i as u32, 0)])).collect();
    let mut guard = true;
    loop {
        let before = cur.len();
        // Chain a buffer with one of equal size starting where it ends, where the pairing is
        // unambiguous (one buffer of that size ends there and one starts there).
        loop {
            let len = cur.len();
            let mut starting: HashMap<(u32, u64), (u32, usize)> = HashMap::new();
            let mut ending: HashMap<(u32, u64), u32> = HashMap::new();
            for (k, x) in cur.iter().enumerate() {
                let e = starting.entry((x.0, x.2)).or_insert((0, k));
                e.0 += 1;
                *ending.entry((x.1, x.2)).or_default() += 1;
            }
            let mut succ = vec![usize::MAX; len];
            let mut has_pred = vec![false; len];
            for k in 0..len {
                let key = (cur[k].1, cur[k].2);
                if let Some(&(1, j)) = starting.get(&key)
                    && ending[&key] == 1
                {
                    succ[k] = j;
                    has_pred[j] = true;
                }
            }
            let mut taken: Vec<Option<Block>> = std::mem::take(&mut cur).into_iter().map(Some).collect();
            for k in 0..len {
                if has_pred[k] {
                    continue;
                }
                let Some(mut x) = taken[k].take() else { continue };
                let mut j = succ[k];
                while j != usize::MAX {
                    let Some(y) = taken[j].take() else { break };
                    x.1 = y.1;
                    x.3.extend(y.3);
                    j = succ[j];
                }
                cur.push(x);
            }
            if cur.len() == len {
                break;
            }
        }
        // Stack buffers with the same lifetime (largest at the bottom), except those that
        // still have a possible (ambiguous) chain partner, stacking which would hide it —
        // unless nothing else is left to merge.
        let mut starting: HashMap<(u32, u64), u32> = HashMap::new();
        let mut ending: HashMap<(u32, u64), u32> = HashMap::new();
        for x in &cur {
            *starting.entry((x.0, x.2)).or_default() += 1;
            *ending.entry((x.1, x.2)).or_default() += 1;
        }
        let free =
            |x: &Block| !guard || (!ending.contains_key(&(x.0, x.2)) && !starting.contains_key(&(x.1, x.2)));
        let (stackable, mut next): (Vec<Block>, Vec<Block>) = cur.into_iter().partition(free);
        let mut stackable = stackable;
        stackable.sort_unstable_by(|x, y| {
            (x.0, x.1, std::cmp::Reverse(x.2), x.3[0].0).cmp(&(y.0, y.1, std::cmp::Reverse(y.2), y.3[0].0))
        });
        let mut stacked: Vec<Block> = Vec::with_capacity(stackable.len());
        for (s, e, size, members) in stackable {
            match stacked.last_mut() {
                Some(last) if last.0 == s && last.1 == e => {
                    let base = last.2;
                    last.3.extend(members.into_iter().map(|(i, d)| (i, d + base)));
                    last.2 += size;
                }
                _ => stacked.push((s, e, size, members)),
            }
        }
        next.extend(stacked);
        cur = next;
        if cur.len() == before {
            if !guard {
                break;
            }
            guard = false;
        } else {
            guard = true;
        }
    }
    let mut member = vec![(0u32, 0u64); n];
    let buffers = cur
        .iter()
        .enumerate()
        .map(|(k, (s, e, size, members))| {
            for &(i, d) in members {
                member[i as usize] = (k as u32, d);
            }
            Buffer { start: *s as u64, end: *e as u64, size: *size, group: None }
        })
        .collect();
    Coarse { buffers, member }
}

/// Plans the coarse instance `c` within `share` and keeps it when it is lower.
fn solve_coarse(
    c: &Coarse,
    share: Duration,
    opts: &PlaceOptions,
    best_high: &mut u64,
    best_off: &mut [u64],
    strategy: &mut String,
) {
    let sub = PlaceOptions { time_budget: share, scaled_budget_per_item: None, ..opts.clone() };
    if let Ok(cp) = place(&c.buffers, &sub)
        && cp.footprint < *best_high
    {
        *best_high = cp.footprint;
        for (i, off) in best_off.iter_mut().enumerate() {
            let (k, delta) = c.member[i];
            *off = cp.offsets[k as usize] + delta;
        }
        *strategy = format!("coarse({}: {})", c.buffers.len(), cp.strategy);
    }
}

/// One portfolio run: offsets of every item and the highest top per window.
struct Run {
    strategy: Strategy,
    off: Vec<u64>,
    window_high: Vec<u64>,
    crossing_high: u64,
}

/// One portfolio run, or `None` when `stop` (if any) passes first.
fn run_strategy(p: &Problem, d: &Decomposition, strategy: Strategy, stop: impl Fn() -> bool) -> Option<Run> {
    let mut index = Index::new(p);
    let mut off = vec![0u64; p.len()];
    let mut crossing = d.crossing.clone();
    let mut rng = Rng::new(0);
    sort_items(p, &mut crossing, Order::Size, 0.0, &mut rng);
    let crossing_high = greedy(p, &crossing, Fit::BestFit, &mut index, &mut off);
    let mut rest = d.rest.clone();
    sort_items(p, &mut rest, strategy.order, 0.0, &mut rng);
    for chunk in rest.chunks(256) {
        if stop() {
            return None;
        }
        greedy(p, chunk, strategy.fit, &mut index, &mut off);
    }
    let mut window_high = vec![0u64; d.windows];
    for &i in &d.rest {
        let i = i as usize;
        let w = d.window[i] as usize;
        window_high[w] = window_high[w].max(off[i] + p.size[i]);
    }
    Some(Run { strategy, off, window_high, crossing_high })
}

/// How much higher than the lowest construction of the portfolio one earlier in the job
/// order may be and still be preferred as the start (see `place`).
const START_TIE: f64 = 0.01;

/// Offers a construction: it becomes the incumbent when lower.
fn offer(
    best_high: &mut u64,
    best_off: &mut Vec<u64>,
    strategy: &mut String,
    high: u64,
    off: Vec<u64>,
    name: String,
) {
    if high < *best_high {
        *best_high = high;
        *best_off = off;
        *strategy = name;
    }
}

/// What one greedy pass over `n` items with `pairs` overlapping pairs is expected to take
/// (measured on the development machine: ~1 µs per item and ~22 ns per pair; a scheduling
/// estimate, not a limit).
fn greedy_pass_estimate(n: usize, pairs: u64) -> Duration {
    Duration::from_nanos((n as u64).saturating_mul(1_000).saturating_add(pairs.saturating_mul(22)))
}

/// Runs `f(k)` for `k` in `0..workers`: worker 0 on the calling thread, the others on
/// scoped threads (none at all for one worker: on a loaded machine a new thread can wait
/// milliseconds to be scheduled, which a stage with little time left cannot afford).
pub(crate) fn run_workers<T: Send>(workers: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    if workers <= 1 {
        return vec![f(0)];
    }
    std::thread::scope(|scope| {
        let f = &f;
        let handles: Vec<_> = (1..workers).map(|k| scope.spawn(move || f(k))).collect();
        let mut out = vec![f(0)];
        out.extend(handles.into_iter().map(|h| h.join().expect("planner worker panicked")));
        out
    })
}

/// Workers for a stage with `left` time: all `threads` unless too little is left to pay
/// for starting threads.
pub(crate) fn workers_for(threads: usize, left: Duration) -> usize {
    if left < Duration::from_millis(4) { 1 } else { threads.max(1) }
}

/// Places `buffers`: see the module documentation for how.
pub fn place(buffers: &[Buffer], opts: &PlaceOptions) -> Result<Placement, PlaceError> {
    let began = Instant::now();
    let p = Problem::build(buffers)?;
    let n = p.len();
    let mut budget = opts.time_budget;
    if let Some(per) = opts.scaled_budget_per_item {
        budget = budget.min((per * p.ivs.len() as u32 + Duration::from_millis(5)).max(MIN_CAPPED_BUDGET));
    }
    let deadline = began + budget;
    let mut lb = p.lower_bound().max(p.alias_bound());
    let pairs = p.overlapping_pairs();
    // A greedy pass costs in proportion to the pairs of items live together (each gap query
    // visits the placed items live with its item); the skyline and the online constructions
    // do not. Inputs where one greedy pass would take most of the budget are *dense*: the
    // online aligned constructions and a skyline pass lead, the greedy orders run only where
    // the estimate says they fit, and the constructions get 70% of the budget (the
    // improvement stage's windows hold few items there and gain little).
    let greedy_pass = greedy_pass_estimate(n, pairs);
    let dense = p.ivs.len() == n && n > EXACT_MAX_ITEMS && greedy_pass > budget.mul_f64(0.7);
    let share = if dense { 0.7 } else { 0.4 };
    let (floor_off, floor_high) = online_best_fit(&p);
    let mut best_off = floor_off;
    let mut best_high = floor_high;
    let mut strategy = "online-best-fit".to_string();
    // Coarsening (single-interval problems): the instance with stacked and chained buffers
    // merged, when that removes a tenth of the items. A coarse instance of at most half the
    // items is planned first, with 35% of the budget; a larger one after the portfolio.
    let mut coarse = None;
    if best_high > lb && n > EXACT_MAX_ITEMS && opts.improve && p.ivs.len() == n && coarsens(&p) {
        let c = coarsen(&p);
        if c.buffers.len() * 2 <= n {
            solve_coarse(&c, budget.mul_f64(0.35), opts, &mut best_high, &mut best_off, &mut strategy);
        } else if c.buffers.len() * 10 <= n * 9 {
            coarse = Some(c);
        }
    }
    let coarse_placed = strategy.starts_with("coarse");
    // The portfolio gets 40% of the budget (of what the coarse instance left); the
    // improvement stage the rest.
    let portfolio_deadline = if coarse_placed {
        let now = Instant::now();
        now + deadline.saturating_duration_since(now).mul_f64(share)
    } else {
        began + budget.mul_f64(share)
    };
    let mut windows = 1;
    let mut strategies_run = 0;
    let mut sky_estimate = Duration::ZERO;
    let mut greedy_estimate = Duration::ZERO;
    let threads = if opts.threads == 0 {
        std::thread::available_parallelism().map_or(1, |t| t.get())
    } else {
        opts.threads
    };
    if best_high > lb && n > 0 {
        let d = decompose(&p, lb);
        windows = d.windows;
        let threads = threads.clamp(1, Strategy::PORTFOLIO.len());
        // Jobs: greedy strategies (index into the portfolio) and skyline rules (index into
        // SKYLINE_RULES; single-interval problems only), interleaved most useful first.
        let with_skyline = p.ivs.len() == n && n > EXACT_MAX_ITEMS;
        // Jobs, most useful first: greedy orders, skyline rules and the online aligned
        // constructions interleaved; dense inputs lead with the aligned constructions and a
        // skyline pass (the greedy passes there cost most of the budget).
        let mut order: Vec<Job> = Vec::new();
        if dense {
            order.extend((0..ALIGNED_VARIANTS.len()).map(Job::Aligned));
            order.push(Job::Skyline(0));
        }
        order.push(Job::Greedy(0));
        if with_skyline && !dense {
            order.push(Job::Skyline(0));
            // The aligned constructions lead on lists of uniform sizes (few small buffers to
            // fill gaps: 10k lists 1.064 → 1.050 with them), and cost ~2 µs per item.
            order.extend([0, 2, 1].map(Job::Aligned));
        }
        order.push(Job::Greedy(1));
        if with_skyline {
            order.extend((1..SKYLINE_RULES.len()).map(Job::Skyline));
        }
        order.extend((2..Strategy::PORTFOLIO.len()).map(Job::Greedy));
        let jobs = order.len();
        let next = AtomicUsize::new(0);
        // The slowest finished job of each kind estimates the next one of that kind; until
        // one has finished, the cost model does: a greedy pass from the pairs of items live
        // together, ~1 µs per item for a skyline pass, ~2 µs per item for an aligned one.
        let modelled_ns = [greedy_pass.as_nanos() as u64, 1_000 * n as u64, 2_000 * n as u64];
        let estimate_ns = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
        let runs: Mutex<Vec<Run>> = Mutex::new(Vec::new());
        let built_any = AtomicBool::new(false);
        let at_bound = AtomicBool::new(false);
        // Whole-instance constructions.
        let whole: Mutex<Vec<Built>> = Mutex::new(Vec::new());
        let workers = workers_for(threads.min(jobs), deadline.saturating_duration_since(Instant::now()));
        run_workers(workers, |_| {
            loop {
                let k = next.fetch_add(1, AtomicOrdering::Relaxed);
                // Nothing is lower than the bound: once a construction reaches it, no job starts.
                if k >= jobs || at_bound.load(AtomicOrdering::Relaxed) {
                    break;
                }
                let kind = order[k].kind();
                let est = Duration::from_nanos(match estimate_ns[kind].load(AtomicOrdering::Relaxed) {
                    0 => modelled_ns[kind],
                    e => e,
                });
                if k > 0 && Instant::now() + est > portfolio_deadline {
                    continue;
                }
                let t = Instant::now();
                // Jobs stop at the deadline; the first one only once another construction
                // than the online floor exists (every plan gets one, and on a machine slower
                // than the cost model a long first pass does not overrun for nothing).
                let guaranteed = k == 0 && !coarse_placed;
                let stop =
                    || Instant::now() > deadline && (!guaranteed || built_any.load(AtomicOrdering::Relaxed));
                let done = match order[k] {
                    Job::Skyline(j) => {
                        let (rule, name) = SKYLINE_RULES[j];
                        skyline(&p, rule, None, deadline).map(|(off, high)| (name, off, high))
                    }
                    Job::Aligned(j) => {
                        let (candidates, weight, name) = ALIGNED_VARIANTS[j];
                        online_aligned(&p, candidates, weight, stop).map(|(off, high)| (name, off, high))
                    }
                    Job::Greedy(j) => {
                        let Some(run) = run_strategy(&p, &d, Strategy::PORTFOLIO[j], stop) else { continue };
                        built_any.store(true, AtomicOrdering::Relaxed);
                        if run.window_high.iter().all(|&h| h <= lb) && run.crossing_high <= lb {
                            at_bound.store(true, AtomicOrdering::Relaxed);
                        }
                        estimate_ns[0].fetch_max(t.elapsed().as_nanos() as u64, AtomicOrdering::Relaxed);
                        runs.lock().expect("portfolio worker panicked").push(run);
                        continue;
                    }
                };
                estimate_ns[kind].fetch_max(t.elapsed().as_nanos() as u64, AtomicOrdering::Relaxed);
                if let Some((name, off, high)) = done {
                    built_any.store(true, AtomicOrdering::Relaxed);
                    if high <= lb {
                        at_bound.store(true, AtomicOrdering::Relaxed);
                    }
                    let name = name.to_string();
                    whole.lock().expect("portfolio worker panicked").push(Built { job: k, name, off, high });
                }
            }
        });
        sky_estimate = Duration::from_nanos(estimate_ns[1].load(AtomicOrdering::Relaxed));
        greedy_estimate = Duration::from_nanos(estimate_ns[0].load(AtomicOrdering::Relaxed));
        let mut built = whole.into_inner().expect("portfolio worker panicked");
        let mut runs = runs.into_inner().expect("portfolio worker panicked");
        strategies_run = runs.len();
        if !runs.is_empty() {
            runs.sort_by_key(|r| Strategy::PORTFOLIO.iter().position(|s| *s == r.strategy));
            // Per window, the run with the lowest top; crossing items are the same in every run.
            let mut off = runs[0].off.clone();
            let mut high = runs[0].crossing_high;
            let mut chosen: Vec<usize> = Vec::with_capacity(d.windows);
            for w in 0..d.windows {
                let k = (0..runs.len()).min_by_key(|&k| (runs[k].window_high[w], k)).unwrap_or(0);
                high = high.max(runs[k].window_high[w]);
                chosen.push(k);
            }
            for &i in &d.rest {
                let i = i as usize;
                off[i] = runs[chosen[d.window[i] as usize]].off[i];
            }
            let mut names: Vec<&str> = Vec::new();
            for &k in &chosen {
                let name = runs[k].strategy.name();
                if !names.contains(&name) {
                    names.push(name);
                }
            }
            let name =
                if names.len() == 1 { names[0].to_string() } else { format!("mixed({})", names.join(",")) };
            let job = order.iter().position(|j| matches!(j, Job::Greedy(0))).unwrap_or(0);
            built.push(Built { job, name, off, high });
        }
        // The start for what follows: the lowest construction, except that one within
        // `START_TIE` of it that comes earlier in the job order is preferred (the order puts
        // the constructions the improvement stage does best from first; footprints that
        // close are within what that stage changes).
        if let Some(low) = built.iter().map(|b| b.high).min() {
            let within = low.saturating_add((low as f64 * START_TIE) as u64);
            if let Some(k) = (0..built.len())
                .filter(|&k| built[k].high <= within)
                .min_by_key(|&k| (built[k].job, built[k].high))
            {
                let b = built.swap_remove(k);
                offer(&mut best_high, &mut best_off, &mut strategy, b.high, b.off, b.name);
            }
        }
    }
    let greedy_high = best_high;
    let mut improvement_steps = 0;
    // Coarsening, late (a coarse instance more than half the size): when a few greedy
    // passes over it fit in 35% of what is left (the nested portfolio always runs its first
    // job).
    if let Some(c) = coarse.take() {
        let pass = greedy_estimate.max(sky_estimate).mul_f64(c.buffers.len() as f64 / n as f64);
        let share = deadline.saturating_duration_since(Instant::now()).mul_f64(0.35);
        if best_high > lb && pass * 4 <= share {
            solve_coarse(&c, share, opts, &mut best_high, &mut best_off, &mut strategy);
        }
    }
    // Complete canonical search (at most CANONICAL_MAX_ITEMS items) for 15% of what is
    // left: at the bound first — tight instances, where the constructions stop a few percent
    // short, it places there in milliseconds — then, when it proves the bound infeasible,
    // between the bound and the best placement; each capacity proved infeasible raises the
    // bound reported (and where the later stages stop).
    if best_high > lb
        && n > EXACT_MAX_ITEMS
        && n <= CANONICAL_MAX_ITEMS
        && p.ivs.len() <= 4 * CANONICAL_MAX_ITEMS
        && pairs <= CANONICAL_MAX_PAIRS
        && opts.improve
    {
        let now = Instant::now();
        let until = now + deadline.saturating_duration_since(now).mul_f64(0.15);
        let items = crate::items::Items {
            ivp: Some(&p.ivp),
            ivs: &p.ivs,
            hull: &p.hull,
            size: &p.size,
            ranks: p.ranks,
        };
        let (found, proved) = crate::canonical::search(&items, lb, best_high, until);
        if let Some((off, high)) = found {
            offer(&mut best_high, &mut best_off, &mut strategy, high, off, "canonical".to_string());
        }
        lb = lb.max(proved);
    }
    // Fixed-height contour search (single-interval problems) for 40% of what is left,
    // when a few skyline passes fit in it.
    let now = Instant::now();
    let until = now + deadline.saturating_duration_since(now).mul_f64(0.4);
    if best_high > lb
        && n > EXACT_MAX_ITEMS
        && opts.improve
        && p.ivs.len() == n
        && sky_estimate * 6 <= until.saturating_duration_since(now)
    {
        let items = crate::items::Items::single(&p.ivs, &p.size, p.ranks);
        let (found, attempts) = crate::contour::search(
            &items,
            lb,
            best_high,
            until,
            opts.seed ^ 0x636f_6e74,
            threads.clamp(1, 8),
        );
        if let Some((off, high)) = found {
            offer(&mut best_high, &mut best_off, &mut strategy, high, off, format!("contour({attempts})"));
        }
    }
    // Randomised skyline restarts for a quarter of what is left (single-interval problems).
    let now = Instant::now();
    let until = now + deadline.saturating_duration_since(now) / 4;
    // Skipped when fewer than two restarts would fit (large inputs: the improvement stage
    // gains more from the time).
    let restart_fits = sky_estimate * 2 <= until.saturating_duration_since(now);
    if best_high > lb && n > EXACT_MAX_ITEMS && opts.improve && p.ivs.len() == n && restart_fits {
        // One restart loop per core (different seeds); each keeps its best.
        let start_high = best_high;
        let workers = workers_for(threads.clamp(1, 8), until.saturating_duration_since(Instant::now()));
        let p = &p;
        let results: Vec<Option<(Vec<u64>, u64, u32)>> = run_workers(workers, |k| {
            let mut rng = Rng::new(opts.seed ^ 0x736b_796c ^ (k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut best: Option<(Vec<u64>, u64, u32)> = None;
            let mut high_k = start_high;
            let mut restarts = 0u32;
            while Instant::now() < until && high_k > lb {
                let rule = [1u8, 3, 4, 5][rng.below(4) as usize];
                let q = [0.02, 0.05, 0.1, 0.2][rng.below(4) as usize];
                restarts += 1;
                if let Some((off, high)) = skyline(p, rule, Some((q, &mut rng)), until)
                    && high < high_k
                {
                    high_k = high;
                    best = Some((off, high, restarts));
                }
            }
            best
        });
        for (off, high, restarts) in results.into_iter().flatten() {
            let name = format!("skyline-restarts({restarts})");
            offer(&mut best_high, &mut best_off, &mut strategy, high, off, name);
        }
    }
    if best_high > lb
        && n <= EXACT_MAX_ITEMS
        && let Some(off) = exact(&p, lb, best_high)
    {
        best_high = (0..n).map(|i| off[i] + p.size[i]).max().unwrap_or(0);
        best_off = off;
        strategy = "exact".to_string();
    }
    if best_high > lb && n > EXACT_MAX_ITEMS && opts.improve {
        // Independent chains (one per core, different seeds) from the same start; the
        // lowest result is kept (the search's outcome varies a lot between seeds).
        let chains = workers_for(threads.clamp(1, 8), deadline.saturating_duration_since(Instant::now()));
        let start = &best_off;
        let results: Vec<(Vec<u64>, ImproveStats)> = run_workers(chains, |k| {
            let mut off = start.clone();
            let seed = opts.seed.wrapping_add((k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let stats = improve(&p, &mut off, lb, pairs, deadline, seed);
            (off, stats)
        });
        for (off, stats) in results {
            improvement_steps += stats.steps;
            let high = (0..n).map(|i| off[i] + p.size[i]).max().unwrap_or(0);
            if stats.improved && high < best_high {
                best_high = high;
                best_off = off;
                if !strategy.ends_with("+improved") {
                    strategy.push_str("+improved");
                }
            }
        }
    }
    let offsets = p.item_of.iter().map(|&i| if i == u32::MAX { 0 } else { best_off[i as usize] }).collect();
    Ok(Placement {
        offsets,
        footprint: best_high,
        lower_bound: lb,
        live_bound: p.lower_bound(),
        strategy,
        elapsed: began.elapsed(),
        floor_footprint: floor_high,
        greedy_footprint: greedy_high,
        windows,
        strategies_run,
        improvement_steps,
    })
}

/// Checks a placement: one offset per buffer, members of a group at one offset, and no two
/// items live at the same time sharing a byte. `O(n log n)`.
pub fn verify(buffers: &[Buffer], offsets: &[u64]) -> Result<(), VerifyError> {
    if buffers.len() != offsets.len() {
        return Err(VerifyError::Count { expected: buffers.len(), got: offsets.len() });
    }
    let mut first_of_group: HashMap<u32, usize> = HashMap::new();
    for (i, b) in buffers.iter().enumerate() {
        if let Some(g) = b.group {
            let f = *first_of_group.entry(g).or_insert(i);
            if offsets[f] != offsets[i] {
                return Err(VerifyError::Alias { a: f, b: i });
            }
        }
    }
    // Sweep over time with the live buffers keyed by offset. Members of one group may
    // coincide; they are the same memory.
    let mut events: Vec<(u64, bool, usize)> = Vec::new();
    for (i, b) in buffers.iter().enumerate() {
        if b.size > 0 && b.end > b.start {
            events.push((b.start, true, i));
            events.push((b.end, false, i));
        }
    }
    events.sort_unstable();
    let key = |i: usize| (offsets[i], buffers[i].group.map_or(u64::MAX - i as u64, |g| g as u64));
    // (offset, owner) -> (top, count, buffer)
    let mut live: BTreeMap<(u64, u64), (u64, u32, usize)> = BTreeMap::new();
    for (_, is_start, i) in events {
        let k = key(i);
        let top = offsets[i] + buffers[i].size;
        if !is_start {
            let entry = live.get_mut(&k).expect("ended buffer is live");
            entry.1 -= 1;
            if entry.1 == 0 {
                live.remove(&k);
            }
            continue;
        }
        if let Some(entry) = live.get_mut(&k) {
            entry.0 = entry.0.max(top);
            entry.1 += 1;
            // Same group at the same offset: check the grown extent against the next one.
            if let Some((_, &(_, _, j))) = live.range((k.0, k.1 + 1)..).next()
                && offsets[j] < top
            {
                return Err(VerifyError::Overlap { a: i, b: j });
            }
            continue;
        }
        if let Some((_, &(ptop, _, j))) = live.range(..k).next_back()
            && ptop > offsets[i]
        {
            return Err(VerifyError::Overlap { a: j, b: i });
        }
        if let Some((&(no, _), &(_, _, j))) = live.range(k..).next()
            && no < top
        {
            return Err(VerifyError::Overlap { a: i, b: j });
        }
        live.insert(k, (top, 1, i));
    }
    Ok(())
}

#[cfg(test)]
mod timing {
    use super::*;

    /// `cargo test --release -p graphpool-planner --lib dsa::timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn greedy_pass_time() {
        for (name, b) in [
            ("random", crate::workload::random(100_000, 1)),
            ("uniform", crate::workload::random_uniform(100_000, 1)),
        ] {
            let p = Problem::build(&b).unwrap();
            let t = Instant::now();
            let c = coarsens(&p);
            println!("{name} coarsens {c} {:.1}ms", t.elapsed().as_secs_f64() * 1e3);
            let lb = p.lower_bound();
            let d = decompose(&p, lb);
            for s in [Strategy::PORTFOLIO[0], Strategy::PORTFOLIO[1]] {
                let t = Instant::now();
                let run = run_strategy(&p, &d, s, || false).unwrap();
                let high = run.window_high.iter().copied().max().unwrap_or(0).max(run.crossing_high);
                println!(
                    "{name} {} {:.1}ms ratio {:.4}",
                    s.name(),
                    t.elapsed().as_secs_f64() * 1e3,
                    high as f64 / lb as f64
                );
            }
            let t = Instant::now();
            let r = skyline(&p, 5, None, Instant::now() + Duration::from_secs(10)).unwrap();
            println!(
                "{name} skyline {:.1}ms ratio {:.4}",
                t.elapsed().as_secs_f64() * 1e3,
                r.1 as f64 / lb as f64
            );
        }
    }
}

#[cfg(test)]
mod density_tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// The pair count that schedules the portfolio is the number of pairs of items whose
        /// hulls overlap.
        #[test]
        fn overlapping_pairs_are_counted(raw in prop::collection::vec((0u64..40, 1u64..15), 1..60)) {
            let b: Vec<Buffer> =
                raw.iter().map(|&(s, l)| Buffer { start: s, end: s + l, size: 1, group: None }).collect();
            let p = Problem::build(&b).unwrap();
            let mut brute = 0u64;
            for i in 0..p.len() {
                for j in 0..i {
                    let (x, y) = (p.hull[i], p.hull[j]);
                    brute += u64::from(x.0 < y.1 && y.0 < x.1);
                }
            }
            prop_assert_eq!(p.overlapping_pairs(), brute);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// The online aligned construction places every buffer (alias groups over their
        /// hull) without overlaps, at or above the lower bound, whatever its parameters.
        #[test]
        fn aligned_placements_are_valid(
            raw in prop::collection::vec((0u64..40, 1u64..15, 1u64..64, prop::option::of(0u32..4)), 1..80),
            candidates in 1usize..40,
            weight in 0.0f64..10.0,
        ) {
            let b: Vec<Buffer> = raw
                .iter()
                .map(|&(s, l, z, g)| Buffer { start: s, end: s + l, size: z, group: g })
                .collect();
            let p = Problem::build(&b).unwrap();
            let (off, high) = online_aligned(&p, candidates, weight, || false).unwrap();
            let offsets: Vec<u64> =
                p.item_of.iter().map(|&i| if i == u32::MAX { 0 } else { off[i as usize] }).collect();
            prop_assert!(verify(&b, &offsets).is_ok());
            prop_assert!(high >= p.lower_bound());
            prop_assert_eq!(high, (0..p.len()).map(|i| off[i] + p.size[i]).max().unwrap_or(0));
        }
    }

    /// With no budget at all every plan still gets its first greedy pass (the online floor
    /// alone can be far off: 1.8 × the bound on interleaved schedules), alias groups
    /// included; a pass told to stop gives nothing.
    #[test]
    fn the_first_greedy_pass_finishes_when_nothing_else_was_built() {
        let b = crate::workload::random(5_000, 3);
        for multi in [false, true] {
            // Alias groups make items with several intervals (no skyline for those).
            let b: Vec<Buffer> = b
                .iter()
                .enumerate()
                .map(|(k, x)| Buffer { group: (multi && k % 50 == 0).then_some(k as u32 % 7), ..*x })
                .collect();
            let opts = PlaceOptions {
                time_budget: Duration::ZERO,
                scaled_budget_per_item: None,
                ..PlaceOptions::default()
            };
            let placed = place(&b, &opts).unwrap();
            // No budget makes any single-interval input dense (a greedy pass does not fit):
            // the aligned construction leads there.
            let first = if multi { super::Strategy::PORTFOLIO[0].name() } else { ALIGNED_VARIANTS[0].2 };
            assert_eq!(placed.strategy, first, "multi-interval: {multi}");
            assert!(placed.footprint < placed.floor_footprint);
            verify(&b, &placed.offsets).unwrap();
            let p = Problem::build(&b).unwrap();
            let d = decompose(&p, p.lower_bound());
            assert!(run_strategy(&p, &d, super::Strategy::PORTFOLIO[0], || true).is_none());
        }
    }

    /// A dense input (every buffer live with hundreds of others), where one greedy pass
    /// costs several budgets: the skyline leads, the greedy orders are not started, and the
    /// plan is valid.
    #[test]
    fn dense_inputs_skip_greedy_passes_that_do_not_fit() {
        let b = crate::workload::random_dense(30_000, 1);
        let p = Problem::build(&b).unwrap();
        let budget = Duration::from_millis(60);
        assert!(greedy_pass_estimate(p.len(), p.overlapping_pairs()) > budget * 2);
        let opts =
            PlaceOptions { time_budget: budget, scaled_budget_per_item: None, ..PlaceOptions::default() };
        let placed = place(&b, &opts).unwrap();
        verify(&b, &placed.offsets).unwrap();
        assert_eq!(placed.strategies_run, 0, "a greedy pass ran: {}", placed.strategy);
        assert!(placed.footprint <= placed.floor_footprint);
    }
}

#[cfg(test)]
mod coarse_tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Any valid placement of the coarse instance maps back to a valid placement of
        /// the items with the same footprint, and coarsening keeps the live bound.
        #[test]
        fn coarse_placements_map_back(raw in prop::collection::vec((0u64..30, 1u64..10, 1u64..8), 1..60)) {
            let b: Vec<Buffer> = raw
                .into_iter()
                .map(|(start, len, size)| Buffer { start, end: start + len, size: size * 4, group: None })
                .collect();
            let p = Problem::build(&b).unwrap();
            let c = coarsen(&p);
            prop_assert!(c.buffers.len() <= p.len());
            prop_assert_eq!(live_bound(&c.buffers).unwrap(), p.lower_bound());
            let opts = PlaceOptions { time_budget: Duration::from_millis(5), threads: 1, ..PlaceOptions::default() };
            let cp = place(&c.buffers, &opts).unwrap();
            let offsets: Vec<u64> = (0..b.len())
                .map(|i| {
                    let (k, d) = c.member[p.item_of[i] as usize];
                    cp.offsets[k as usize] + d
                })
                .collect();
            verify(&b, &offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let high = (0..b.len()).map(|i| offsets[i] + b[i].size).max().unwrap_or(0);
            prop_assert_eq!(high, cp.footprint);
        }
    }

    /// A plan that reaches the lower bound before the deadline does not depend on the
    /// clock: the same input and seed give the same offsets.
    #[test]
    fn plans_that_reach_the_bound_are_reproducible() {
        let opts = PlaceOptions { scaled_budget_per_item: None, ..PlaceOptions::default() };
        let mut reached = 0;
        for seed in 1..=6 {
            let b = crate::workload::packed(300, seed);
            let first = place(&b, &opts).unwrap();
            verify(&b, &first.offsets).unwrap();
            if first.footprint == first.lower_bound {
                reached += 1;
                assert_eq!(place(&b, &opts).unwrap().offsets, first.offsets, "seed {seed}");
            }
        }
        assert!(reached >= 3, "only {reached} of 6 packed lists reached the bound");
    }

    #[test]
    fn guillotine_instances_coarsen() {
        // A packed instance of 2000 pieces collapses to a small fraction of its size, and
        // its optimum (the lower bound) is then found within the default budget.
        let b = crate::workload::packed(2000, 11);
        let p = Problem::build(&b).unwrap();
        let c = coarsen(&p);
        assert!(c.buffers.len() * 4 < b.len(), "{} coarse buffers", c.buffers.len());
    }
}

#[cfg(test)]
mod repack_tests {
    use super::*;
    use proptest::prelude::*;

    /// Repeated skyline re-packs of the top of a placement keep it valid and never raise
    /// its footprint.
    /// Runs `moves` re-packs from the online best fit;
    /// every one leaves a valid placement no higher than before. Returns how many were kept.
    fn check(b: &[Buffer], moves: usize, seed: u64) -> usize {
        let p = Problem::build(b).unwrap();
        if p.len() == 0 || p.ivs.len() != p.len() {
            return 0;
        }
        let mut kept = 0;
        let (mut off, mut high) = online_best_fit(&p);
        let mut index = Index::new(&p);
        for (i, &o) in off.iter().enumerate() {
            index.insert(&p, i, o);
        }
        let mut rng = crate::rng::Rng::new(seed);
        let mut rp = Repack { stamp: vec![0; p.len()], ..Repack::default() };
        let span = p.mean_span() as u64;
        let deadline = Instant::now() + Duration::from_secs(60);
        for _ in 0..moves {
            let tops: Vec<usize> = (0..p.len()).filter(|&i| off[i] + p.size[i] == high).collect();
            let c = tops[rng.below(tops.len() as u64) as usize];
            kept += usize::from(
                repack(&p, &mut index, &mut off, high, c, span, deadline, &mut rng, &mut rp).is_some(),
            );
            let offsets: Vec<u64> =
                p.item_of.iter().map(|&i| if i == u32::MAX { 0 } else { off[i as usize] }).collect();
            verify(b, &offsets).unwrap();
            let now = (0..p.len()).map(|i| off[i] + p.size[i]).max().unwrap_or(0);
            assert!(now <= high, "re-pack raised the footprint: {now} > {high}");
            high = now;
        }
        kept
    }

    #[test]
    fn repacks_keep_random_placements_valid() {
        let mut kept = 0;
        for seed in 1..=3 {
            kept += check(&crate::workload::random(2000, seed), 300, seed);
            kept += check(&crate::workload::random_uniform(2000, seed), 300, seed);
        }
        assert!(kept > 0, "no re-pack was kept: the test checks nothing");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn repacks_keep_small_placements_valid(
            raw in prop::collection::vec((0u64..40, 1u64..12, 1u64..9), 1..60),
            seed in 0u64..1000,
        ) {
            let b: Vec<Buffer> = raw
                .into_iter()
                .map(|(start, life, size)| Buffer { start, end: start + life, size, group: None })
                .collect();
            check(&b, 40, seed);
        }
    }
}

#[cfg(test)]
mod skyline_tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    /// The skyline as first written (ordered maps), kept to check the array version against.
    fn skyline_on_reference(
        p: &Problem,
        rule: u8,
        noise: Option<(f64, &mut Rng)>,
        deadline: Instant,
        floor: Option<&[u64]>,
    ) -> Option<(Vec<u64>, u64)> {
        let mut noise = noise;
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let n = p.len();
        if p.ivs.len() != n || n == 0 {
            return None;
        }
        let r = p.ranks as usize;
        let mut by_start = unplaced_by_start(p);
        let mut starts: BTreeSet<u32> =
            (0..by_start.len() as u32).filter(|&s| !by_start[s as usize].is_empty()).collect();
        // Skyline segments: start -> (end, height); heap of (height, start) with lazy deletion.
        let mut seg: BTreeMap<u32, (u32, u64)> = BTreeMap::new();
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
        match floor {
            Some(f) if f.len() == r && r > 0 => {
                let mut a = 0;
                for k in 1..=r {
                    if k == r || f[k] != f[a] {
                        seg.insert(a as u32, (k as u32, f[a]));
                        heap.push(Reverse((f[a], a as u32)));
                        a = k;
                    }
                }
            }
            _ => {
                seg.insert(0, (p.ranks, 0));
                heap.push(Reverse((0, 0)));
            }
        }
        let mut off = vec![0u64; n];
        let mut high = 0u64;
        let mut left = n;
        let mut steps = 0u32;
        while left > 0 {
            let Some(Reverse((h, a))) = heap.pop() else { break };
            match seg.get(&a) {
                Some(&(_, sh)) if sh == h => {}
                _ => continue,
            }
            steps = steps.wrapping_add(1);
            if steps.is_multiple_of(512) && Instant::now() > deadline {
                return None;
            }
            let b = seg[&a].0;
            let left_h = seg.range(..a).next_back().map(|(_, &(_, lh))| lh);
            let right_h = seg.get(&b).map(|&(_, rh)| rh);
            // The candidate: earliest start in [a, b), longest ending by b.
            let mut pick: Option<(u32, usize)> = None;
            for (scanned, &st) in starts.range(a..b).enumerate() {
                let list = &by_start[st as usize];
                let k = list.partition_point(|&i| p.ivs[i as usize].1 <= b);
                if k > 0 {
                    let choice = skyline_pick(p, list, k, rule, h, a as usize, b as usize, left_h, right_h);
                    let choice = with_noise(choice, k, &mut noise);
                    pick = Some((st, choice));
                    break;
                }
                if scanned >= 64 {
                    break;
                }
            }
            match pick {
                Some((st, k)) => {
                    let i = by_start[st as usize].remove(k) as usize;
                    if by_start[st as usize].is_empty() {
                        starts.remove(&st);
                    }
                    left -= 1;
                    let (s, e) = p.ivs[i];
                    off[i] = h;
                    let top = h + p.size[i];
                    high = high.max(top);
                    // Split [a, b) into [a, s), [s, e) at top, [e, b).
                    seg.remove(&a);
                    if a < s {
                        seg.insert(a, (s, h));
                        heap.push(Reverse((h, a)));
                    }
                    seg.insert(s, (e, top));
                    heap.push(Reverse((top, s)));
                    if e < b {
                        seg.insert(e, (b, h));
                        heap.push(Reverse((h, e)));
                    }
                    // Merge the new segment with equal neighbours.
                    let mut ms = s;
                    let mut me = e;
                    if let Some((&ps, &(_, ph))) = seg.range(..s).next_back()
                        && ph == top
                    {
                        seg.remove(&ps);
                        ms = ps;
                    }
                    if let Some(&(ne, nh)) = seg.get(&e)
                        && nh == top
                    {
                        seg.remove(&e);
                        me = ne;
                    }
                    if ms != s {
                        seg.remove(&s);
                    }
                    seg.insert(ms, (me, top));
                    heap.push(Reverse((top, ms)));
                }
                None => {
                    // Raise the valley to its lower neighbour and merge.
                    let left_n = seg.range(..a).next_back().map(|(&ps, &(_, ph))| (ps, ph));
                    let right_n = seg.get(&b).map(|&(ne, nh)| (ne, nh));
                    let target = match (left_n, right_n) {
                        (Some((_, lh)), Some((_, rh))) => lh.min(rh),
                        (Some((_, lh)), None) => lh,
                        (None, Some((_, rh))) => rh,
                        (None, None) => {
                            // Nothing fits anywhere: cannot happen while items are left, since
                            // every item fits in the whole clock.
                            return None;
                        }
                    };
                    seg.remove(&a);
                    let mut ms = a;
                    let mut me = b;
                    if let Some((ps, ph)) = left_n
                        && ph == target
                    {
                        seg.remove(&ps);
                        ms = ps;
                    }
                    if let Some((ne, nh)) = right_n
                        && nh == target
                    {
                        seg.remove(&b);
                        me = ne;
                    }
                    seg.insert(ms, (me, target));
                    heap.push(Reverse((target, ms)));
                }
            }
        }
        Some((off, high))
    }

    /// The array-based skyline places exactly as the reference does, for every rule, with
    /// and without noise and floors.
    #[test]
    fn skyline_matches_the_reference() {
        let far = Instant::now() + Duration::from_secs(60);
        for seed in 1..=6u64 {
            for b in [
                crate::workload::random(3000, seed),
                crate::workload::random_uniform(3000, seed),
                crate::workload::packed(500, seed),
            ] {
                let p = Problem::build(&b).unwrap();
                let mut frng = Rng::new(seed);
                let floor: Vec<u64> = (0..p.ranks).map(|_| frng.below(1 << 20)).collect();
                for rule in [1u8, 3, 4, 5, 0] {
                    for fl in [None, Some(&floor[..])] {
                        let a = skyline_on(&p, rule, None, far, fl);
                        let r = skyline_on_reference(&p, rule, None, far, fl);
                        assert_eq!(a, r, "rule {rule} seed {seed}");
                        let (mut x, mut y) = (Rng::new(seed), Rng::new(seed));
                        let a = skyline_on(&p, rule, Some((0.1, &mut x)), far, fl);
                        let r = skyline_on_reference(&p, rule, Some((0.1, &mut y)), far, fl);
                        assert_eq!(a, r, "rule {rule} seed {seed} with noise");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod alias_bound_tests {
    use super::*;
    use crate::pipeline::{LayerSpec, TensorSpec, schedule_buffers};
    use crate::{Schedule, SchedulePlanInput};
    use proptest::prelude::*;

    /// The heaviest clique by brute force over subsets (small graphs).
    fn brute_force_clique(g: &ConflictGraph, w: &[u64]) -> u64 {
        let n = g.n;
        let mut best = 0;
        for mask in 0u32..(1 << n) {
            let members: Vec<usize> = (0..n).filter(|&i| mask >> i & 1 == 1).collect();
            if members.iter().all(|&a| members.iter().all(|&b| a == b || g.adjacent(a, b))) {
                best = best.max(members.iter().map(|&i| w[i]).sum());
            }
        }
        best
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// The clique search returns the weight of a clique (never above the heaviest one)
        /// and never less than the greedy clique; the graph matches the pairwise test.
        #[test]
        fn heavy_clique_is_a_clique_and_beats_greedy(
            raw in prop::collection::vec((0u64..30, 1u64..8, 1u64..64, prop::option::of(0u32..5)), 1..24),
        ) {
            let b: Vec<Buffer> =
                raw.iter().map(|&(s, l, z, g)| Buffer { start: s, end: s + l, size: z, group: g }).collect();
            let p = Problem::build(&b).unwrap();
            prop_assume!(p.len() <= 14);
            let g = p.conflict_graph().unwrap();
            for a in 0..p.len() {
                for c in 0..p.len() {
                    prop_assert_eq!(g.adjacent(a, c), a != c && p.conflict(a, c));
                }
            }
            let heavy = g.heavy_clique(&p.wmin, &p.life);
            prop_assert!(heavy <= brute_force_clique(&g, &p.wmin));
            prop_assert!(heavy >= p.greedy_clique());
        }
    }

    fn layer(chunk: u32, saved_mib: u64, fws_mib: u64, bws_mib: u64) -> LayerSpec {
        let hidden = |kept| TensorSpec {
            name: "hidden".into(),
            shape: vec![1024, 4, 5120],
            dtype: "bf16".into(),
            kept_for_backward: kept,
        };
        LayerSpec {
            chunk,
            layer: 0,
            inputs: vec![hidden(false)],
            outputs: vec![hidden(false)],
            saved_bytes: saved_mib << 20,
            forward_workspace_bytes: fws_mib << 20,
            backward_workspace_bytes: bws_mib << 20,
        }
    }

    /// Chunks of different sizes on interleaved 1F1B: the greedy clique (by weight ×
    /// lifetime) stops short of the bound the placement reaches, the clique search finds it,
    /// so the plan is proved optimal (and the search stops as soon as it is there).
    #[test]
    fn heterogeneous_interleaved_plans_are_proved_optimal() {
        let input = SchedulePlanInput {
            schedule: Schedule::Interleaved {
                pp_size: 8,
                pp_rank: 0,
                num_microbatches: 16,
                virtual_chunks: 2,
            },
            layers: vec![layer(0, 240, 0, 32), layer(1, 160, 40, 32)],
        };
        let buffers = schedule_buffers(&input).unwrap().buffers;
        let p = Problem::build(&buffers).unwrap();
        assert!(p.alias_bound() > p.greedy_clique().max(p.lower_bound()));
        let opts = PlaceOptions { time_budget: Duration::from_secs(5), ..PlaceOptions::default() };
        let placed = place(&buffers, &opts).unwrap();
        verify(&buffers, &placed.offsets).unwrap();
        assert_eq!(placed.footprint, placed.lower_bound, "{}", placed.strategy);
        assert!(placed.elapsed < Duration::from_secs(4));
    }
}

#[cfg(test)]
mod long_group_tests {
    use super::*;
    use crate::pipeline::{schedule_buffers, varied_layers};
    use crate::{Schedule, SchedulePlanInput};

    /// Two slots replayed by 128 microbatches: every alias group spans the whole clock, so
    /// no window of the clock holds one; the windows take the groups live in them instead,
    /// and the plan reaches the bound (the constructions alone are 20% above it).
    #[test]
    fn groups_spanning_the_clock_are_improved() {
        let input = SchedulePlanInput {
            schedule: Schedule::OneFOneB { pp_size: 2, pp_rank: 0, num_microbatches: 128 },
            layers: varied_layers(1, 3, 1024, 1, 1024, 162),
        };
        let buffers = schedule_buffers(&input).unwrap().buffers;
        let opts = PlaceOptions {
            time_budget: Duration::from_secs(20),
            scaled_budget_per_item: None,
            ..PlaceOptions::default()
        };
        let placed = place(&buffers, &opts).unwrap();
        verify(&buffers, &placed.offsets).unwrap();
        assert!(placed.greedy_footprint as f64 > 1.1 * placed.lower_bound as f64);
        assert_eq!(placed.footprint, placed.lower_bound, "{}", placed.strategy);
    }
}

#[cfg(test)]
mod find_tests {
    use super::*;
    use proptest::prelude::*;

    /// The gap a scan of every placed item gives: the lowest (or smallest fitting, then
    /// lowest) offset where `item` meets none of them.
    fn scan(p: &Problem, placed: &[(usize, u64)], item: usize, fit: Fit) -> u64 {
        let meets =
            |j: usize| p.ivs(item).iter().any(|&(s, e)| p.ivs(j).iter().any(|&(s2, e2)| s < e2 && s2 < e));
        let mut used: Vec<(u64, u64)> =
            placed.iter().filter(|&&(j, _)| meets(j)).map(|&(j, o)| (o, o + p.size[j])).collect();
        used.sort_unstable();
        let size = p.size[item];
        let (mut cur, mut best) = (0u64, None::<(u64, u64)>);
        for (o, t) in used {
            if o >= cur + size {
                match fit {
                    Fit::LowestOffset => return cur,
                    Fit::BestFit => {
                        if best.is_none_or(|(g, _)| o - cur < g) {
                            best = Some((o - cur, cur));
                        }
                    }
                }
            }
            cur = cur.max(t);
        }
        best.map_or(cur, |(_, o)| o)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Gap queries (one pair per neighbour for items with several intervals) agree with
        /// a scan of every placed item, for both fits.
        #[test]
        fn gap_queries_agree_with_a_scan(
            raw in prop::collection::vec((0u64..60, 1u64..20, 1u64..64, prop::option::of(0u32..6)), 1..60),
            best_fit in any::<bool>(),
        ) {
            let b: Vec<Buffer> = raw
                .iter()
                .map(|&(s, l, z, g)| Buffer { start: s, end: s + l, size: z, group: g })
                .collect();
            let p = Problem::build(&b).unwrap();
            let fit = if best_fit { Fit::BestFit } else { Fit::LowestOffset };
            let mut index = Index::new(&p);
            let mut scratch = FindScratch::default();
            let mut placed = Vec::new();
            for i in 0..p.len() {
                let o = index.find(&p, i, fit, &mut scratch);
                prop_assert_eq!(o, scan(&p, &placed, i, fit), "item {}", i);
                index.insert(&p, i, o);
                placed.push((i, o));
            }
        }

        /// Merging the sorted runs of a gap query sorts the pairs by offset, keeping every
        /// pair once.
        #[test]
        fn merged_runs_are_sorted(runs in prop::collection::vec(prop::collection::vec(0u64..50, 0..12), 1..20)) {
            let mut v: Vec<(u64, u64)> = Vec::new();
            let mut starts: Vec<u32> = Vec::new();
            for (k, mut run) in runs.into_iter().enumerate() {
                run.sort_unstable();
                if k > 0 && !run.is_empty() && !v.is_empty() {
                    starts.push(v.len() as u32);
                }
                v.extend(run.iter().enumerate().map(|(j, &o)| (o, o + j as u64)));
            }
            let mut expected = v.clone();
            expected.sort_unstable();
            merge_runs(&mut v, &mut starts, &mut Vec::new());
            prop_assert!(v.windows(2).all(|w| w[0].0 <= w[1].0));
            v.sort_unstable();
            prop_assert_eq!(v, expected);
        }
    }
}
