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
//!    together) would not fit in the budget; with noise on its choices, it also runs as a
//!    *repairing sweep* (a portfolio job) that backs up to a checkpoint wherever it would
//!    rise above a target, so that each stretch of the clock gets the best of its own tries
//!    (`online_aligned_repair`); on a *full* list (the bound live at every step where anything
//!    is live) the floor leaves above the bound, the **refilling sweep** places the list at
//!    its bound, or gives up within milliseconds, before any other stage: each step's
//!    enders and starters split into runs, a PQ-tree kept going backwards holds every order
//!    of the live buffers from which the rest of the clock can be placed, and each step's
//!    order is read out of it going forwards (see `refill`);
//! 3. **skyline** constructions (bottom-up: fill the lowest valley of the skyline with an
//!    item that starts at its left edge; three pick rules), then a **portfolio of greedy
//!    orders** (breadth, size, lifetime, size × lifetime, start) × (best-fit, lowest offset),
//!    run on all cores and time-boxed (costs from a model until a job of the kind has
//!    finished), keeping the best per window; the start for what follows is the one built
//!    around a hot skeleton (below) wherever there is one, even above a lower one (set
//!    aside: every other improvement chain starts from it, and it is the answer unless the
//!    later stages get below it), else the lowest construction or one within 1% of it that
//!    comes earlier in the job order. The **layered** construction leads: a *skeleton* of
//!    items is planned first as a list of its own by this same engine, and the portfolio's
//!    first jobs fill the others in around them, a stretch of the clock each (see
//!    `layered`). The skeleton is the items live
//!    where the bytes live come within 10% of the bound (the *hot* items: the top of a plan
//!    is decided there), or, on dense lists and where a few items hold nearly all of the
//!    area (bytes × lifetime), the items holding most of the area; on dense inputs only
//!    those holding all but the last 0.5% of the area go in by that greedy fill, and the
//!    rest — most of the items — by an online best-fit sweep around them (`online_around`),
//!    a stretch each too. A skeleton holding 99% of the area decides the footprint: its
//!    fill is timed first, and its plan gets the time the fill leaves;
//! 4. **decomposition** of the clock at low-liveness cut points: buffers that cross a cut are
//!    placed first, and every window between cuts takes the best strategy for itself;
//! 5. **coarsening** (single-interval problems whose floor is more than
//!    [`COARSEN_MIN_FLOOR`] × the bound): buffers with one lifetime stacked into one,
//!    buffers handing over to one of equal size chained into one, and the coarse instance
//!    planned by this same engine when that removes a tenth of the items beyond the
//!    hand-overs that chance makes (a list whose merges are mostly chance is coarsened
//!    only after the constructions, where there is time to plan its instance; see
//!    `coarsen::merges`; the
//!    merges run in two orders, the second keeping apart blocks of one lifetime that their
//!    steps balance one without the other, see `separation`; on two cores or more both
//!    instances too large for the canonical search are planned side by side, the lower plan
//!    kept); on lists too large for the canonical search its plan is then **refined** as in a
//!    multilevel scheme: the coarse buffers at its top split into their items, the others
//!    kept whole, and the improvement stage run on that mixed instance beside the one on the
//!    items (before it on one core; `refine_coarse`); with eight cores or more (two for
//!    smaller lists), half of them plan the list's **mirror image** (the clock run
//!    backwards) in the same way, and the lower plan is kept (see `place_for`); then, for at
//!    most [`CANONICAL_MAX_ITEMS`] items, a
//!    complete **canonical search** at the lower bound and above it (`crate::canonical`,
//!    MiniMalloc-style inference, dominance and decomposition; 15% of what is left on lists of
//!    single intervals; on lists with alias groups half of it, or a core of its own beside the
//!    improvement chains until the deadline with three cores or more; there a second search
//!    from halfway between the bound and the best placement up runs beside the chains too,
//!    after the canonical stage on two cores, from the start with three or more), and a fixed-height
//!    **contour search** with backjumping and a bisection of the target height
//!    (`crate::contour`), when a few skyline passes fit in its share (the portfolio, the
//!    contour search and the restarts of step 6 do not run after a refined coarse plan);
//! 6. a time-boxed **improvement** stage: randomised restarts (`restarts`; single-interval
//!    problems):
//!    where the repairing sweep came out below every other construction, more of it with
//!    other seeds for 60% of the time left; else for a quarter of it skyline passes, and
//!    where an online aligned construction came out below every skyline pass, half of them
//!    aligned constructions with noise on their scores; then windows of the clock around a
//!    buffer that defines the footprint (a random stretch of its lifetime when that is long)
//!    are taken out with that buffer and re-placed with perturbed orders; a window is kept
//!    when its highest byte (then the number of items reaching it) does not rise (hill
//!    climbing with sideways moves), and a re-placement stops as soon as it is worse; most
//!    steps are cheaper *ejection moves* (the buffer at the top moved down, the buffers in
//!    its way re-placed — or moved down in turn, a short chain — kept under the same test);
//!    a chain on a small list with alias groups that stops coming down is *kicked* (one
//!    window kept however high it ends; the lowest placement reached is its result); the
//!    chains (and a canonical search beside them) stop as soon as one of them settles the
//!    answer;
//! 7. an **exact** branch-and-bound search over canonical placements when there are at most
//!    [`EXACT_MAX_ITEMS`] items.
//!
//! Before all of this, a list whose clock falls into parts that no buffer spans, some of them
//! copies of others (the same buffers shifted in time: repeated iterations), keeps one copy
//! of each part, and every copy takes its copy's offsets (see `parts`).
//!
//! Buffers sharing an alias group are placed as one item at one offset: the item is a set
//! of disjoint intervals (the union of its members' intervals, gaps kept) and is as large
//! as the largest member; conflicts are checked interval by interval.
//!
//! **Bounds.** The live bound is the most bytes live at once (each buffer at its own size;
//! members of a group live together count once). Alias groups can force more: a group
//! holds its offset through its gaps, so groups that are pairwise live at *some* common
//! time must be stacked even if no single moment has them all live; and groups replayed at
//! several ranks of the live bound can leave no room for a contiguous gap that a group live
//! at only one of them needs. The reported lower bound is the largest of the live bound, the
//! weight of such a clique (`Problem::alias_bound`), the contiguity bound
//! (`Problem::contiguity_bound`; each with the proof that it is valid), the lowest placement
//! of the items live at the three ranks of most bytes (`Problem::few_ranks_bound`), or one
//! byte above a capacity the canonical search proved infeasible.
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
use crate::until::Until;

/// Work the alias bound may spend on the conflict graph (pairs of intervals visited to
/// build it), and the contiguity bound on the escorts of its first pattern.
pub const ALIAS_BOUND_WORK: u64 = 40_000_000;

/// Work the greedy clique of the alias bound may spend: steps of the interval walks that
/// test a candidate against the members (~2.5 ns each on the 2-core VM, the members'
/// intervals read in memory order; a 336k-buffer interleaved schedule's clique took 17·10⁶).
/// A 31k-buffer interleaved stage (pp 32, v 6, M 64) needs 49·10⁶ for its whole clique,
/// whose weight is that stage's plan: with 40·10⁶ its bound was 0.12% short.
pub const GREEDY_CLIQUE_WORK: u64 = 80_000_000;

/// Work the contiguity bound may spend beyond its first patterns: dropping ranks (an item
/// visit per item and a step per pair of ranks for every set evaluated), pairing patterns
/// (a step per shared item compared), and the conflict tests of their escorts.
pub const CONTIGUITY_PRUNE_WORK: u64 = 100_000;
/// Work of the contiguity bound's ranks where the largest items start
/// (`Problem::largest_starts_bound`): dropping 12 of 24 ranks down to one forward per slot
/// of a 1F1B stage at M 256, whose groups' conflict tests (escorts) cost the more
/// intervals the groups have, took 2 × [`CONTIGUITY_PRUNE_WORK`] (docs/planner.md, "The
/// slots' forwards as ranks of the contiguity bound").
pub const LARGEST_STARTS_WORK: u64 = 4 * CONTIGUITY_PRUNE_WORK;

/// Items the complete canonical search (step 5 of the module documentation) takes at most:
/// each node costs O(items + their lifetimes), and beyond a few thousand items the search
/// rarely finishes.
pub const CANONICAL_MAX_ITEMS: usize = 2000;
/// Pairs of items live together the canonical search takes at most (its neighbour lists
/// are built before the search and cost time in proportion).
pub const CANONICAL_MAX_PAIRS: u64 = 1_000_000;
/// Streams of restarts the canonical search runs at most when it is a stage of its own (one
/// per core up to this): measured up to the GPU host's 16 cores, where MiniMalloc's trace I
/// reached its bound in 7 ms instead of 500 (docs/planner.md, stage 7). Each capacity the
/// search bisects starts its workers anew, and what more would gain is not measured.
pub const CANONICAL_MAX_WORKERS: usize = 16;

/// Share of the time left a coarse instance of at most half the items gets, planned before
/// anything else, on lists too large for the canonical search: where one exists its plan is
/// nearly always the one kept (tilings), and the stages on the whole list after it rarely
/// lower it (10 tilings of 10k pieces in 1 s: mean 1.0339 of the bound with 35%, 1.0332
/// with 80%; of 100k pieces 1.1288 and 1.1244). Smaller lists keep 35%: the canonical
/// search on the whole list places MiniMalloc's H at the bound, which its coarse instance
/// cannot (1.0137 with 80%).
pub const COARSE_FIRST_SHARE: f64 = 0.8;

/// Share of the budget the refilling sweep (`refill`) may take on a full list before the
/// other stages (counted from the start of the plan): it places an arena of 100k buffers
/// re-cut once per step in ~0.17 s on the 2-core VM and in 0.28–0.58 s on the GPU host
/// (30 seeds, the first plan of a process the slowest), and gives up within milliseconds
/// on tilings cut along lines. Where it gives up it has used little of its share (its
/// search is limited by work, see `refill`); a sweep stopped by the share leaves the other
/// stages little time (on the GPU host, a slower build stopped at 75% of 1 s ended at 1.48
/// of the bound after 2.1 s).
pub const REFILL_SHARE: f64 = 0.75;

/// Coarsening runs only where the online best-fit floor is above this × the lower bound.
/// Where the floor is already close, placing buffers in time order works on the list as it
/// is, and merging buffers only ties some of them together: on eager training steps
/// (`workload::training_trace`: sizes a few multiples of one hidden state, so unrelated
/// buffers of one size hand over to each other and get chained; floors 1.000–1.067), seeds
/// 1–20, mean ratio with coarsening → without: 10k buffers 1.0041 → 1.0017 and 1.0049 →
/// 1.0009 (worst 1.0335 → 1.0068), 100k 1.0017 → 1.0009 and 1.0022 → 1.0018, 1k 1.0000 and
/// 1.0002 → 1.0003. Tilings, whose coarse instance is what places them, have floors of
/// 1.098 or more (200 rows of every shape, 100 to 10k pieces; 1.78–2.72 at 100k).
pub const COARSEN_MIN_FLOOR: f64 = 1.08;

/// Share of the time left that coarsening may take: it starts no round of merges after that
/// (the first round of a 100k list takes 40–90 ms, later ones 10–40 ms on two busy cores; a
/// tiling of 100k one-step pieces took 0.5–1.4 s to coarsen to the end, which left the plan
/// of its coarse instance no time and the whole plan at the online floor, 1.3–1.8 s late).
/// Tilings of 100k pieces, 10 seeds, 1 s, with 30% / 45% / 60%: ≤ 1.10 on 4 / 3 / 3 (shape
/// of `workload::packed`), 3 / 6 / 6 (cuts at any byte), 1 / 2 / 1 (one step per piece).
pub const COARSEN_SHARE: f64 = 0.45;

/// Share of the time left after the constructions that a coarse instance planned then (more
/// than half the items, or a list whose merges are mostly chance, coarsened then) gets, when
/// four greedy passes over it fit in it.
pub const LATE_COARSE_SHARE: f64 = 0.35;

/// Items up to which the mirror image of a list (see `place_for`) is planned beside it on any
/// two cores or more; larger lists need [`MIRROR_LARGE_MIN_THREADS`]. Tilings of 10k pieces
/// cut at halves, 1 s, back to back with the build without: on two cores 14 of 20 seeds
/// lower and 6 higher (2-core VM; all 10 of another 10), on four 13 and 6.
pub const MIRROR_SMALL_MAX_ITEMS: usize = 20_000;

/// Cores from which lists larger than [`MIRROR_SMALL_MAX_ITEMS`] plan their mirror image
/// beside them. Each plan gets half the cores, and a coarse plan of a large list made on few
/// cores loses what the second direction gains: tilings of 100k pieces (`workload::packed`,
/// 1 s, back to back with the build without) went higher on 14 of 20 seeds on the 2-core VM
/// (mean 1.1130 against 1.1088; 18 of 30 in another run), on 11 of 20 (8 lower) on four
/// cores of the GPU host, and lower on 7 of 10 (1 higher; median 1.084 against 1.100) on its
/// sixteen. Eight lies between the measured four and sixteen.
pub const MIRROR_LARGE_MIN_THREADS: usize = 8;

/// Share of the budget kept back from the stages' deadline, for the step each is in when
/// the deadline comes and for assembling the answer: 100k-piece tilings with a 1 s budget
/// ended up to 14 ms late on the 2-core VM and 32 ms on the GPU host's 16 cores (eight
/// improvement chains) with none.
pub const DEADLINE_RESERVE: f64 = 0.03;

/// Time per item the improvement stage needs left to start (it indexes every item first).
const IMPROVE_MIN_LEFT_PER_ITEM: Duration = Duration::from_nanos(500);

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

impl Buffer {
    /// Whether the buffer needs bytes at all: live at some step (`end > start`) and not
    /// empty. Only such buffers must be kept apart; the others go at offset 0, or at their
    /// alias group's offset.
    pub fn is_live(&self) -> bool {
        self.end > self.start && self.size > 0
    }
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
    /// Planning time. The portfolio skips strategies that would not finish in time, every
    /// stage stops at the deadline ([`DEADLINE_RESERVE`] before the end of the budget, for
    /// the step in progress then), and the online best-fit floor (always built) is the
    /// answer when nothing else finished — except that the portfolio's first construction
    /// runs to its end while nothing else was built, when it is expected within this budget
    /// (or 100 ms), or 20 times that where the floor is above 1.1 × the bound.
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
    /// (lists at the bound stop at once whatever the cap). `None`: no cap (a budget the
    /// caller gave; see also [`PlaceOptions::settle_within`], which schedules use).
    pub scaled_budget_per_item: Option<Duration>,
    /// With [`PlaceOptions::scaled_budget_per_item`]: the cap holds only once the
    /// constructions have come within this factor of the lower bound; until then the search
    /// has the whole `time_budget`. What [`crate::plan_schedule`] uses with the default
    /// budget (1.001, the tolerance schedules are held to: a plan above it is worth the
    /// time, one within it has little left to gain). `None`: the cap holds from the start.
    pub settle_within: Option<f64>,
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
            settle_within: None,
        }
    }
}

/// One stage of a placement's search: what ran, how long it took, and the best footprint
/// once it ended.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stage {
    /// `parts` (the list split into parts that share no moment, one copy of each kept: the stages
    /// after it plan those), `prepare` (the compressed problem, its bounds), `fold` (the clock
    /// without the ranks that add no constraint: lists with alias groups that repeat, such as
    /// schedules; the stages after it plan the folded clock), `floor` (online best fit), `refill`
    /// (the refilling sweep of a full list; its footprint is the bound where it placed the list,
    /// `None` where it gave up), `coarsen` (the coarse instance built), `coarse` (the coarse
    /// instance planned), `refine` (the coarse plan refined) or `refine+improvement` (beside the
    /// improvement stage on the items), `fill-probe` (the layered construction's fill timed around
    /// a dominant skeleton at its floor offsets), `skeleton` (the layered construction's skeleton
    /// planned), `constructions` (the portfolio), `top-gap-last` (where no construction got 1%
    /// below the floor: the floor's sweep with the gap at the top kept for last, kept as the answer
    /// unless the stages after get below it), `canonical`, `contour`, `restarts` (skyline, aligned
    /// or repairing restarts), `exact`, `improvement`, or `canonical+improvement` (the two side by
    /// side, lists with alias groups on three cores or more), `above+improvement` (a canonical
    /// search from halfway above the bound beside the improvement stage after the canonical stage,
    /// lists with alias groups on two cores), `mirrored` (the wait for the plan of the list's
    /// mirror image, run beside; its footprint is the lower of the two); the stages that ran, in
    /// order.
    pub name: String,
    /// Wall-clock time it took.
    pub elapsed: Duration,
    /// The best footprint once it ended (`None` before the first placement exists, and for
    /// the skeleton, which places only part of the list).
    pub footprint: Option<u64>,
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
    /// different strategies, `+improved` when the improvement stage lowered it, `exact`;
    /// `parts(N, K distinct: ...)` when the list fell into N parts that share no moment, of
    /// which K differ, and was planned from one copy of each).
    pub strategy: String,
    /// Wall-clock time spent.
    pub elapsed: Duration,
    /// Footprint of the online best-fit floor.
    pub floor_footprint: u64,
    /// Footprint of the construction the stages after the portfolio start from: the lowest,
    /// or the one around a hot skeleton, which may be higher than the floor.
    pub greedy_footprint: u64,
    /// Windows the clock was decomposed into.
    pub windows: usize,
    /// Portfolio strategies that ran (others were skipped for time).
    pub strategies_run: usize,
    /// Re-placement steps the improvement stage tried.
    pub improvement_steps: u64,
    /// The stages that ran, in order, with their times (nested plans of a coarse instance
    /// or a skeleton count as one stage).
    pub stages: Vec<Stage>,
    /// Planner threads the plan ran on ([`PlaceOptions::threads`], one per core for 0).
    pub threads: usize,
}

impl Placement {
    /// `footprint / lower_bound` (1.0 when both are 0).
    pub fn ratio(&self) -> f64 {
        if self.lower_bound == 0 { 1.0 } else { self.footprint as f64 / self.lower_bound as f64 }
    }
}

/// The most bytes the planner places: the sizes of the buffers, an alias group counted once at
/// its largest member, add up to at most this. 2^62 bytes (4 EiB) is far past any device's
/// memory, and leaves the engine's sums room below 2^64: a search that lifts a buffer out
/// adds its size to the tops of the buffers left floating above where it was, which may be
/// the whole sum.
pub const MAX_TOTAL_BYTES: u64 = 1 << 62;

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
    /// The sizes add up to more than [`MAX_TOTAL_BYTES`] (an alias group counted once, at its
    /// largest member).
    #[error(
        "buffer sizes add up to more than 2^62 bytes (4 EiB), the most the planner places; check \
         the sizes (they are bytes)"
    )]
    Overflow,
}

mod coarsen;
mod coarsening_check;
mod contiguity;
mod decompose;
mod driver;
mod exact;
mod few_ranks;
mod fold;
mod greedy;
mod hashing;
mod improve;
mod index;
mod layered;
mod marks;
mod online;
mod parts;
mod portfolio;
mod pqtree;
mod problem;
mod refill;
mod restarts;
mod separation;
mod skyline;
mod verify;

use coarsen::*;
pub use coarsening_check::{CoarseningCheck, CoarseningCheckError, MergeCount, OrderCheck, check_coarsening};
use decompose::*;
use driver::*;
pub use driver::{CanonicalNodes, place};
pub(crate) use driver::{run_workers, run_workers_with, workers_for};
use exact::*;
use greedy::*;
use hashing::KeyHashing;
pub use improve::ImprovementSteps;
use improve::*;
pub use index::GapQueries;
use index::*;
use layered::*;
use marks::Marks;
pub use online::OnlineConstructions;
use online::*;
use portfolio::{Portfolio, PortfolioPlan};
use problem::*;
use restarts::*;
use skyline::*;
pub use verify::{VerifyError, verify};

/// No placement of `buffers` fits in fewer bytes: the largest of [`live_bound`], the alias
/// bound (a clique of pairwise conflicting alias groups), the contiguity bound (groups
/// replayed across ticks keep one offset) and the bound of a few ranks (the items live at
/// the ranks with the most bytes, placed exactly); see [`Placement::lower_bound`].
pub fn lower_bound(buffers: &[Buffer]) -> Result<u64, PlaceError> {
    Ok(Problem::build(buffers)?.bound())
}

/// Most bytes live at any time, every buffer at its own size (members of one alias group
/// that are live together count once, as the largest of them).
pub fn live_bound(buffers: &[Buffer]) -> Result<u64, PlaceError> {
    Ok(Problem::build(buffers)?.lower_bound())
}
