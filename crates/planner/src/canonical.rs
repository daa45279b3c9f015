//! Complete search over canonical placements (in the style of MiniMalloc) for
//! single-interval items: does everything fit under a capacity `C`? The planner asks it at
//! the lower bound, where the constructions often stop a few percent short of a placement
//! that exists (tight traces: every rank nearly full).
//!
//! **Canonical placements.** Sort a valid placement by (offset, priority) and let every
//! item drop as low as it goes, in that order: each then sits on the highest top among the
//! items before it that are live with it (or at 0), and the order is unchanged. So it is
//! enough to place items one at a time in that order, each at its *floor* — the highest top
//! among the placed items live with it — and to branch on which item comes next: the
//! search is complete (items at one offset are never live together, so they go in priority
//! order).
//!
//! **Inference.** Offsets never decrease along the order, so once the last item went to the
//! *level* `L` the free bytes below `L` are lost: at every rank, the unplaced items live
//! there stack from the lowest of their floors (or `L`) up, and that plus their bytes must
//! fit under `C`. Placing an item at `o` keeps this at every rank exactly when `o + B ≤ C`,
//! `B` being the most unplaced bytes at any rank. A node is dead when an unplaced item's
//! floor plus its size exceeds `C`, or when an item below the level has no unplaced item live
//! with it to lift it.
//!
//! **Dominance.** Nothing goes at or above the lowest top of an unplaced item: that item fits
//! wholly below, and dropping it there gives a placement that another branch reaches.
//!
//! **Decomposition.** When no unplaced item spans a boundary between two ranks, the items
//! on either side never meet: each side is searched on its own (from level 0), and a side
//! that does not fit fails the node without trying the other side's alternatives.
//!
//! Candidates are tried lowest floor first, then by a priority. Restarts take three static
//! priorities (most bytes live at the item's busiest rank, lifetime, size × lifetime, in
//! different precedence), then the same keys scaled by random factors, with node limits
//! that follow the Luby sequence; with several workers, each runs a stream of restarts of
//! its own on a thread of its own, and the answer is the one a single interleaved sequence
//! would give ([`fits_restarting`]). The search is deterministic (seeded by the capacity,
//! for a number of workers) but for its deadline (and the flag of a search running beside
//! it).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::items::Items;
use crate::rng::Rng;
use crate::until::Until;

/// What a search at one capacity found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A placement whose every item ends at or below the capacity.
    Fits(Vec<u64>),
    /// Nothing fits under the capacity (the search finished).
    Infeasible,
    /// The deadline (or the flag of a search beside it) came first.
    Unknown,
}

/// Static orders of the items (the tie-break after the floor): by the most bytes live at
/// any rank of the item ("total"), its lifetime in ranks ("width") and size × lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    TotalWidthArea = 0,
    WidthAreaTotal = 1,
    TotalAreaWidth = 2,
}

impl Order {
    pub(crate) const ALL: [Order; 3] = [Order::TotalWidthArea, Order::WidthAreaTotal, Order::TotalAreaWidth];
}

/// Restarts with node limits of `2n` times the Luby sequence (1, 1, 2, 1, 1, 2, 4, …: a bad
/// early choice costs one short restart, and every limit recurs, so a search long enough to
/// finish comes at a logarithmic factor over the shortest). The first three restarts take
/// the static orders; the later ones cycle through their keys with each item's key scaled
/// by a random factor in [0.5, 1.5) ([`Prepared::noisy_rank`]): searches on instances with
/// a few hundred alias groups are heavy-tailed, and a different order of ties often finds
/// in milliseconds what one order misses for seconds. Any fixed order keeps the search
/// complete.
///
/// With `workers` > 1, each worker runs a stream of restarts of its own on a thread of its
/// own (worker 0 the stream above, the others noisy orders only, from seeds of their own),
/// and restart `r` of worker `w` counts as restart `(r − 1) × workers + w` of one sequence.
/// The answer is the placement of the earliest restart in that sequence that finds one: a
/// worker that finds one stops the workers busy with later restarts and lets those with
/// earlier ones finish them. So the answer depends on the number of workers but not on
/// which thread runs faster; deterministic (seeded by the capacity) but for the deadline.
pub(crate) fn fits_restarting(
    prep: &Prepared<'_>,
    capacity: u64,
    until: Until<'_>,
    workers: usize,
) -> Outcome {
    let streams = Streams::new(workers.max(1));
    // A worker without a thread (resources exhausted) runs on this one once worker 0's stream
    // is done, so that its restarts before the answer still run: the same answer, later.
    let search_thread =
        || std::thread::Builder::new().name("graphpool-canonical".into()).stack_size(SEARCH_STACK_BYTES);
    crate::dsa::run_workers_with(workers, search_thread, |w| streams.run(prep, capacity, until, w));
    streams.outcome()
}

/// What the workers of [`fits_restarting`] share.
struct Streams {
    workers: usize,
    /// The earliest restart (in the one sequence) that found a placement, `u64::MAX` while
    /// none has; 0 once a worker proved the capacity infeasible.
    earliest: AtomicU64,
    /// The restart each worker is in (in the one sequence): its first, `w`, until it starts.
    /// A worker whose thread has not run yet is stopped only by an answer before its first
    /// restart; were it counted as beyond every restart, an answer found later in the
    /// sequence would stop it, and the answer would depend on when its thread ran.
    current: Vec<AtomicU64>,
    /// Raised for a worker whose restart can no longer be the answer.
    moot: Vec<AtomicBool>,
    /// The placement of `earliest`, or the proof.
    answer: Mutex<Option<Outcome>>,
}

impl Streams {
    fn new(workers: usize) -> Streams {
        Streams {
            workers,
            earliest: AtomicU64::new(u64::MAX),
            current: (0..workers as u64).map(AtomicU64::new).collect(),
            moot: (0..workers).map(|_| AtomicBool::new(false)).collect(),
            answer: Mutex::new(None),
        }
    }

    /// Worker `w`'s restarts until an answer, the deadline, or an earlier restart's answer.
    fn run(&self, prep: &Prepared<'_>, capacity: u64, until: Until<'_>, w: usize) {
        let unit = prep.items.size.len() as u64 * 2;
        let mut rng = Rng::new(capacity ^ (w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let stop = until.and_raised(&self.moot[w]);
        for restart in 1u64.. {
            let index = (restart - 1) * self.workers as u64 + w as u64;
            // Announce the restart before reading the earliest answer: a worker that finds
            // one first records it and then reads the announcements (both sequentially
            // consistent), so either it sees this restart and stops it, or this reads its
            // answer and stops here.
            self.current[w].store(index, Ordering::SeqCst);
            if index > self.earliest.load(Ordering::SeqCst) || stop.passed() {
                return;
            }
            let order = Order::ALL[(restart % 3) as usize];
            let noisy;
            let rank = if restart <= 3 && w == 0 {
                &prep.rank[order as usize]
            } else {
                noisy = prep.noisy_rank(order, &mut rng);
                &noisy
            };
            match fits(prep, capacity, stop, rank, unit.saturating_mul(luby(restart))) {
                Outcome::Unknown => {}
                Outcome::Infeasible => {
                    *self.answer.lock().expect("no worker panics holding the answer") =
                        Some(Outcome::Infeasible);
                    self.earliest.store(0, Ordering::SeqCst);
                    self.moot.iter().for_each(|m| m.store(true, Ordering::SeqCst));
                    return;
                }
                Outcome::Fits(off) => {
                    let mut answer = self.answer.lock().expect("no worker panics holding the answer");
                    if index < self.earliest.load(Ordering::SeqCst) {
                        self.earliest.store(index, Ordering::SeqCst);
                        *answer = Some(Outcome::Fits(off));
                    }
                    drop(answer);
                    for (m, at) in self.moot.iter().zip(&self.current) {
                        if at.load(Ordering::SeqCst) > index {
                            m.store(true, Ordering::SeqCst);
                        }
                    }
                    return;
                }
            }
        }
    }

    fn outcome(self) -> Outcome {
        self.answer.into_inner().expect("no worker panics holding the answer").unwrap_or(Outcome::Unknown)
    }
}

/// Term `i` (from 1) of the Luby sequence: 1, 1, 2, 1, 1, 2, 4, 1, 1, 2, 1, 1, 2, 4, 8, …
fn luby(i: u64) -> u64 {
    let mut i = i;
    loop {
        let k = 64 - u64::from(i.leading_zeros());
        if i == (1 << k) - 1 {
            return 1 << (k - 1);
        }
        i -= (1 << (k - 1)) - 1;
    }
}

/// The greatest common divisor of `a` and `b` (`b` when `a` is 0).
fn gcd(mut a: u64, mut b: u64) -> u64 {
    while a != 0 {
        (a, b) = (b % a, a);
    }
    b
}

/// Bisects the capacities between `lower` (a lower bound) and `upper` (the footprint of a
/// placement known) until `until` passes: first `lower` itself (after a short probe halfway
/// up where items have several intervals: see `bisect`), then midpoints. A capacity
/// that fits lowers the upper end to the placement found; one proved infeasible raises the
/// lower end; the first undecided one ends the search. Returns the lowest placement found
/// with its footprint, and the proved lower bound (`lower` or higher). Raises `until`'s flag
/// when the search settles the question: a placement at `bound` (the bound proved so far,
/// at most `lower`), or, for a search started there (`lower == bound`), the two ends meeting
/// (the placement found is optimal, or nothing below `upper` fits); a search started above
/// the bound proves nothing of it. Each capacity is searched by `workers` streams of
/// restarts on threads of their own ([`fits_restarting`]).
pub(crate) fn search(
    items: &Items<'_>,
    (bound, lower, upper): (u64, u64, u64),
    until: Until<'_>,
    workers: usize,
) -> (Option<(Vec<u64>, u64)>, u64) {
    // The search recurses once per item placed (~0.5 KiB a level in release builds, more in
    // debug ones): its own thread with a stack for that, whatever the caller's.
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("graphpool-canonical".into())
            .stack_size(SEARCH_STACK_BYTES)
            .spawn_scoped(scope, || bisect(items, bound, (lower, upper), until, workers))
            .map(|h| h.join().expect("the canonical search panicked"))
            // No thread (resources exhausted): nothing proved, nothing found.
            .unwrap_or((None, lower))
    })
}

/// Stack of the search's thread: room for [`crate::dsa::CANONICAL_MAX_ITEMS`] levels of
/// recursion many times over.
const SEARCH_STACK_BYTES: usize = 64 << 20;

/// [`search`] on its thread: bisects `[lo, hi]`.
///
/// Where items have several intervals (alias groups), a probe halfway between the two ends
/// comes first, for [`PROBE_SHARE`] of the time: there the bound is often out of reach and
/// the search at it undecided to the end, while a capacity above it may settle at once (an
/// 88-buffer 1F1B schedule: the probe fits in 0.2 ms with a placement 1.0004 × the bound,
/// where the bound's search, undecided, left the constructions' 1.029).
fn bisect(
    items: &Items<'_>,
    bound: u64,
    (mut lo, mut hi): (u64, u64),
    until: Until<'_>,
    workers: usize,
) -> (Option<(Vec<u64>, u64)>, u64) {
    let from_bound = lo <= bound;
    let prep = Prepared::new(items);
    let mut best = None;
    let several_intervals = items.ivs.len() > items.size.len();
    if several_intervals && hi - lo >= 2 && !until.passed() {
        let capacity = lo + (hi - lo) / 2;
        let now = std::time::Instant::now();
        let share = until.deadline.saturating_duration_since(now).mul_f64(PROBE_SHARE);
        let probe = Until { deadline: now + share, ..until };
        let outcome = fits_restarting(&prep, capacity, probe, workers);
        narrow(items, outcome, capacity, (&mut lo, &mut hi), &mut best);
    }
    let mut first = true;
    while lo < hi && !until.passed() {
        let capacity = if first { lo } else { lo + (hi - lo) / 2 };
        first = false;
        let outcome = fits_restarting(&prep, capacity, until, workers);
        if !narrow(items, outcome, capacity, (&mut lo, &mut hi), &mut best) {
            break;
        }
    }
    if hi <= bound || (from_bound && lo >= hi) {
        until.raise();
    }
    (best, lo)
}

/// Narrows `[lo, hi]` by the outcome of the search at `capacity`: a placement lowers `hi` to
/// its footprint (and becomes `best`), a proof raises `lo` past the capacity. False where the
/// capacity was left undecided.
fn narrow(
    items: &Items<'_>,
    outcome: Outcome,
    capacity: u64,
    (lo, hi): (&mut u64, &mut u64),
    best: &mut Option<(Vec<u64>, u64)>,
) -> bool {
    match outcome {
        Outcome::Fits(off) => {
            *hi = (0..items.size.len()).map(|i| off[i] + items.size[i]).max().unwrap_or(0);
            *best = Some((off, *hi));
            true
        }
        Outcome::Infeasible => {
            *lo = capacity + 1;
            true
        }
        Outcome::Unknown => false,
    }
}

/// The share of the search's time that [`bisect`]'s probe above the bound takes.
const PROBE_SHARE: f64 = 0.03;

/// The items live together with each item (compressed sparse rows).
struct Neighbours {
    start: Vec<u32>,
    list: Vec<u32>,
}

impl Neighbours {
    /// The lists of [`Items::meeting_rows`].
    fn new(items: &Items<'_>) -> Neighbours {
        let n = items.size.len();
        let words = n.div_ceil(64);
        let rows = items.meeting_rows(u64::MAX).expect("no cap on the pairs");
        let mut start = Vec::with_capacity(n + 1);
        let mut list = Vec::with_capacity(rows.iter().map(|w| w.count_ones() as usize).sum());
        for i in 0..n {
            start.push(list.len() as u32);
            for w in 0..words {
                let mut bits = rows[i * words + w];
                while bits != 0 {
                    list.push((w * 64) as u32 + bits.trailing_zeros());
                    bits &= bits - 1;
                }
            }
        }
        start.push(list.len() as u32);
        Neighbours { start, list }
    }

    fn of(&self, i: usize) -> &[u32] {
        &self.list[self.start[i] as usize..self.start[i + 1] as usize]
    }
}

/// What every search of one problem shares: the neighbours, the bytes at every rank and
/// the boundaries each item spans, and the keys of the static orders.
pub(crate) struct Prepared<'a> {
    items: &'a Items<'a>,
    nb: Neighbours,
    load: Vec<u64>,
    cut: Vec<u32>,
    /// Priority rank of each item under each [`Order`] (the order of candidates at one
    /// floor, and the order items at one offset are placed in).
    rank: Vec<Vec<u32>>,
    /// The keys of the orders: the most bytes live at any rank of the item, its lifetime.
    total: Vec<u64>,
    width: Vec<u64>,
    /// The greatest common divisor of the sizes: every floor is a multiple of it.
    sizes_gcd: u64,
    /// See [`Prepared::paints`].
    paints: bool,
}

impl<'a> Prepared<'a> {
    pub(crate) fn new(items: &'a Items<'a>) -> Prepared<'a> {
        let n = items.size.len();
        let ranks = items.ranks as usize;
        let mut load = vec![0u64; ranks];
        let mut cut = vec![0u32; ranks.saturating_sub(1)];
        for i in 0..n {
            for &(s, e) in items.ivs(i) {
                for l in &mut load[s as usize..e as usize] {
                    *l += items.size[i];
                }
            }
            let (s, e) = items.hull[i];
            for c in &mut cut[s as usize..(e as usize - 1)] {
                *c += 1;
            }
        }
        let total: Vec<u64> = (0..n)
            .map(|i| {
                items
                    .ivs(i)
                    .iter()
                    .map(|&(s, e)| load[s as usize..e as usize].iter().copied().max().unwrap_or(0))
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let width: Vec<u64> =
            (0..n).map(|i| items.ivs(i).iter().map(|&(s, e)| (e - s) as u64).sum()).collect();
        let rank = Order::ALL
            .iter()
            .map(|&order| {
                let mut by_priority: Vec<u32> = (0..n as u32).collect();
                by_priority.sort_unstable_by_key(|&i| {
                    let i = i as usize;
                    let (t, w, a) = (total[i], width[i], items.size[i].saturating_mul(width[i]));
                    let key = match order {
                        Order::TotalWidthArea => (t, w, a),
                        Order::WidthAreaTotal => (w, a, t),
                        Order::TotalAreaWidth => (t, a, w),
                    };
                    (std::cmp::Reverse(key), i)
                });
                let mut rank = vec![0u32; n];
                for (r, &i) in by_priority.iter().enumerate() {
                    rank[i as usize] = r as u32;
                }
                rank
            })
            .collect();
        let sizes_gcd = items.size.iter().fold(0, |g, &z| gcd(g, z)).max(1);
        let cover: u64 = width.iter().sum();
        let paints = cover > PAINT_MIN_COVER * (ranks as u64 + n as u64);
        Prepared { items, nb: Neighbours::new(items), load, cut, rank, total, width, sizes_gcd, paints }
    }

    /// Whether the search checks its nodes by painting the ranks: where the items live at
    /// more than [`PAINT_MIN_COVER`] times as many ranks as there are ranks and items.
    pub(crate) fn paints(&self) -> bool {
        self.paints
    }

    /// The priority rank of the static `order`.
    pub(crate) fn static_rank(&self, order: Order) -> &[u32] {
        &self.rank[order as usize]
    }

    /// A priority rank like `order`'s, its first key scaled by a random factor in
    /// [0.5, 1.5) for every item (ties by index).
    fn noisy_rank(&self, order: Order, rng: &mut Rng) -> Vec<u32> {
        let n = self.items.size.len();
        let keys: Vec<f64> = (0..n)
            .map(|i| {
                let key = match order {
                    Order::TotalWidthArea => self.total[i] as f64,
                    Order::WidthAreaTotal => self.width[i] as f64,
                    Order::TotalAreaWidth => self.items.size[i] as f64 * self.width[i] as f64,
                };
                key * (0.5 + rng.unit())
            })
            .collect();
        let mut by_priority: Vec<u32> = (0..n as u32).collect();
        by_priority.sort_unstable_by(|&a, &b| keys[b as usize].total_cmp(&keys[a as usize]).then(a.cmp(&b)));
        let mut rank = vec![0u32; n];
        for (r, &i) in by_priority.iter().enumerate() {
            rank[i as usize] = r as u32;
        }
        rank
    }
}

/// Decides whether the prepared items fit under `capacity` (see the module documentation),
/// trying candidates by the priority `rank` (one of [`Prepared`]'s, or a noisy one); gives
/// up when `until` passes or after `node_limit` nodes.
pub(crate) fn fits(
    prep: &Prepared<'_>,
    capacity: u64,
    until: Until<'_>,
    rank: &[u32],
    node_limit: u64,
) -> Outcome {
    fits_checking(prep, capacity, until, rank, node_limit, prep.paints()).0
}

/// [`fits`], its nodes checked by painting the ranks or rank by rank (the same answers after
/// the same nodes either way; the time differs), with the number of nodes it visited.
pub(crate) fn fits_checking(
    prep: &Prepared<'_>,
    capacity: u64,
    until: Until<'_>,
    rank: &[u32],
    node_limit: u64,
    painting: bool,
) -> (Outcome, u64) {
    let items = prep.items;
    let n = items.size.len();
    if n == 0 {
        return (Outcome::Fits(Vec::new()), 0);
    }
    if items.size.iter().any(|&z| z > capacity) || prep.load.iter().any(|&l| l > capacity) {
        return (Outcome::Infeasible, 0);
    }
    let open = (0..n).map(|i| prep.nb.of(i).len() as u32).collect();
    let ranks = items.ranks as usize;
    let mut solver = Solver {
        items,
        capacity,
        until,
        node_limit,
        nodes: 0,
        nb: &prep.nb,
        rank,
        load: prep.load.clone(),
        floor: vec![0; n],
        placed: vec![false; n],
        open,
        cut: prep.cut.clone(),
        off: vec![0; n],
        undo: Vec::new(),
        // Each check's room, for the check in use only.
        lowest: if painting { Vec::new() } else { vec![0; ranks] },
        painting,
        next: if painting { vec![0; ranks + 1] } else { Vec::new() },
        stamp: if painting { vec![0; ranks + 1] } else { Vec::new() },
        keys: Vec::new(),
        order: Vec::new(),
        pass: 0,
        // Floors in units that fit in 32 bits below the capacity: the sizes' common divisor
        // where it does (exact), else coarser (floors rounded down: the check they serve
        // prunes less, never wrongly). Lanes of 32 bits take the per-rank minimum of floors
        // several times faster than 64-bit ones.
        floor_unit: if capacity / prep.sizes_gcd < u64::from(u32::MAX) {
            prep.sizes_gcd
        } else {
            capacity / (u64::from(u32::MAX) - 1) + 1
        },
    };
    let all: Vec<u32> = (0..n as u32).collect();
    let outcome = match solver.decompose(&all, 0, ranks) {
        Status::Fits => Outcome::Fits(solver.off),
        Status::NotFound => Outcome::Infeasible,
        Status::Stopped => Outcome::Unknown,
    };
    (outcome, solver.nodes)
}

/// Where the items live at more than this many times as many ranks (summed over the items)
/// as there are ranks and items, the search checks its nodes by painting the ranks
/// ([`Solver::check_by_painting`]) rather than rank by rank. 20k nodes painted / rank by
/// rank (`cargo bench -p graphpool-planner -- canonical/`, 2-core VM): a pipeline stage's
/// alias groups (137 times) 317 ms / 1.17 s, an explicit order's (247) 527 ms / 1.96 s,
/// 2000 buffers of uniform sizes ~500 live (195) 827 ms / 2.27 s; random alias groups (61)
/// 951 / 968 ms; a tiling of 1k pieces (7) 185 / 101 ms.
const PAINT_MIN_COVER: u64 = 64;

/// The first rank from `t` on that the node's check has not reached (see
/// [`Solver::check_by_painting`]), shortening the paths it follows.
fn unreached(next: &mut [u32], stamp: &[u32], pass: u32, t: u32) -> u32 {
    let mut root = t;
    while stamp[root as usize] == pass {
        root = next[root as usize];
    }
    let mut at = t;
    while at != root {
        let after = next[at as usize];
        next[at as usize] = root;
        at = after;
    }
    root
}

/// The top of an unplaced item at its floor `f`, or `None` where it makes its node dead: it
/// does not fit under `capacity`, or it lies below the `level` with no unplaced item live
/// with it (`open`) to lift it.
fn alive_top(f: u64, size: u64, open: u32, capacity: u64, level: u64) -> Option<u64> {
    let top = f + size;
    (top <= capacity && (f >= level || open > 0)).then_some(top)
}

/// Whether a (sub)search found a placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Fits,
    NotFound,
    /// Deadline or node limit.
    Stopped,
}

/// The search state (see the module documentation).
struct Solver<'a, 'b> {
    items: &'a Items<'b>,
    capacity: u64,
    until: Until<'a>,
    node_limit: u64,
    nodes: u64,
    nb: &'a Neighbours,
    /// Priority rank of each item (the order of candidates at one floor).
    rank: &'a [u32],
    /// Bytes of unplaced items live at each clock rank.
    load: Vec<u64>,
    floor: Vec<u64>,
    placed: Vec<bool>,
    /// Unplaced items live with each item.
    open: Vec<u32>,
    /// Unplaced items live at both sides of each boundary (between ranks `b` and `b + 1`).
    cut: Vec<u32>,
    off: Vec<u64>,
    /// (item, floor before) for every floor raised.
    undo: Vec<(u32, u64)>,
    /// Whether nodes check the ranks by painting them ([`Solver::check_by_painting`]).
    painting: bool,
    /// The lowest floor of the unplaced items live at each rank, in `floor_unit`s.
    lowest: Vec<u32>,
    /// Bytes per unit of the floors the check reads (every floor below the capacity fits in
    /// 32 bits of them).
    floor_unit: u64,
    /// The ranks a node's check has reached ([`Solver::check_by_painting`]): rank `t` is reached
    /// when `stamp[t]` is the node's `pass`, and then `next[t]` leads to a later rank that
    /// may not be (a union-find over the ranks, whose roots are those not reached).
    next: Vec<u32>,
    stamp: Vec<u32>,
    /// Room to sort a node's items by floor, and the order the check paints them in.
    keys: Vec<u128>,
    order: Vec<u32>,
    pass: u32,
}

impl Solver<'_, '_> {
    fn place(&mut self, j: usize) -> usize {
        let o = self.floor[j];
        let z = self.items.size[j];
        let top = o + z;
        self.off[j] = o;
        self.placed[j] = true;
        for &(s, e) in self.items.ivs(j) {
            for l in &mut self.load[s as usize..e as usize] {
                *l -= z;
            }
        }
        let (s, e) = self.items.hull[j];
        for c in &mut self.cut[s as usize..(e as usize - 1)] {
            *c -= 1;
        }
        let mark = self.undo.len();
        for &k in self.nb.of(j) {
            let k = k as usize;
            self.open[k] -= 1;
            if !self.placed[k] && self.floor[k] < top {
                self.undo.push((k as u32, self.floor[k]));
                self.floor[k] = top;
            }
        }
        mark
    }

    fn unplace(&mut self, j: usize, mark: usize) {
        let z = self.items.size[j];
        self.placed[j] = false;
        for &(s, e) in self.items.ivs(j) {
            for l in &mut self.load[s as usize..e as usize] {
                *l += z;
            }
        }
        let (s, e) = self.items.hull[j];
        for c in &mut self.cut[s as usize..(e as usize - 1)] {
            *c += 1;
        }
        for &k in self.nb.of(j) {
            self.open[k as usize] += 1;
        }
        while self.undo.len() > mark {
            let (k, f) = self.undo.pop().expect("undo entry");
            self.floor[k as usize] = f;
        }
    }

    /// The candidates of a node of the partition `part` (ranks `lo..hi`) at `level` after
    /// `last`, best first; `None` when the node is dead.
    fn candidates(&mut self, part: &[u32], lo: usize, hi: usize, level: u64, last: u32) -> Option<Vec<u32>> {
        let ceiling = if self.painting {
            self.check_by_painting(part, level)?
        } else {
            self.check_rank_by_rank(part, lo, hi, level)?
        };
        let mut out: Vec<u32> = part
            .iter()
            .copied()
            .filter(|&j| {
                let j = j as usize;
                let f = self.floor[j];
                !self.placed[j]
                    && f >= level
                    && f <= ceiling
                    && !(f == level && last != u32::MAX && self.rank[j] < self.rank[last as usize])
            })
            .collect();
        out.sort_unstable_by_key(|&j| (self.floor[j as usize], self.rank[j as usize]));
        Some(out)
    }

    /// The checks of a node of `part` at `level` (module documentation, "Inference" and
    /// "Dominance"): `None` where it is dead, else the ceiling its candidates' floors must
    /// not pass. The lowest floor of the unplaced items live at each rank is taken item by
    /// item over the ranks of `lo..hi` it lives at.
    fn check_rank_by_rank(&mut self, part: &[u32], lo: usize, hi: usize, level: u64) -> Option<u64> {
        let c = self.capacity;
        let most = self.load[lo..hi].iter().copied().max().unwrap_or(0);
        let mut ceiling = c.checked_sub(most)?;
        // Nothing may go at or above the lowest top of an unplaced item first (that item fits
        // wholly below; dropping it there gives a placement another branch reaches).
        let unit = self.floor_unit;
        let lowest = &mut self.lowest[lo..hi];
        lowest.fill(u32::MAX);
        for &j in part {
            let j = j as usize;
            if self.placed[j] {
                continue;
            }
            let top = alive_top(self.floor[j], self.items.size[j], self.open[j], c, level)?;
            ceiling = ceiling.min(top - 1);
            // `f ≤ c` here, and `c / unit` fits below `u32::MAX`.
            let fu = (self.floor[j] / unit) as u32;
            for &(s, e) in self.items.ivs(j) {
                for x in &mut lowest[s as usize - lo..e as usize - lo] {
                    *x = (*x).min(fu);
                }
            }
        }
        // At every rank, the unplaced items live there stack from the lowest of their
        // floors (and the level) up.
        for (t, &x) in lowest.iter().enumerate() {
            if x != u32::MAX && (u64::from(x) * unit).max(level) + self.load[lo + t] > c {
                return None;
            }
        }
        Some(ceiling)
    }

    /// [`Solver::check_rank_by_rank`], its result the same, for items that live at many
    /// ranks each: the unplaced items go in order of floor (those at or below the level
    /// first, in any order: they stack from it), and each marks the ranks of its intervals
    /// that no item before it reached (their lowest floor is its own), skipping the others
    /// through `next`. So every rank is read once, not once per item live at it.
    fn check_by_painting(&mut self, part: &[u32], level: u64) -> Option<u64> {
        let (c, unit) = (self.capacity, self.floor_unit);
        let mut ceiling = c;
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        self.keys.clear();
        for &j in part {
            let ju = j as usize;
            if self.placed[ju] {
                continue;
            }
            let f = self.floor[ju];
            let Some(top) = alive_top(f, self.items.size[ju], self.open[ju], c, level) else {
                self.order = order;
                return None;
            };
            ceiling = ceiling.min(top - 1);
            if f <= level {
                order.push(j);
            } else {
                self.keys.push((u128::from(f) << 64) | u128::from(j));
            }
        }
        self.keys.sort_unstable();
        order.extend(self.keys.iter().map(|&k| k as u32));
        self.pass = self.pass.wrapping_add(1);
        if self.pass == 0 {
            self.stamp.fill(0);
            self.pass = 1;
        }
        let pass = self.pass;
        let mut most = 0;
        let mut dead = false;
        'items: for &j in &order {
            // Rounded down to the unit, as the rank-by-rank check reads it.
            let f = (self.floor[j as usize] / unit * unit).max(level);
            for &(s, e) in self.items.ivs(j as usize) {
                let mut t = unreached(&mut self.next, &self.stamp, pass, s);
                while t < e {
                    let load = self.load[t as usize];
                    if f + load > c {
                        dead = true;
                        break 'items;
                    }
                    most = most.max(load);
                    self.stamp[t as usize] = pass;
                    self.next[t as usize] = t + 1;
                    t = unreached(&mut self.next, &self.stamp, pass, t + 1);
                }
            }
        }
        self.order = order;
        if dead {
            return None;
        }
        // Ranks no unplaced item lives at hold no unplaced bytes: `most` is the most at any.
        Some(ceiling.min(c - most))
    }

    /// Places the unplaced items of `part` (ranks `lo..hi`), canonically from level 0.
    fn solve_part(&mut self, part: &[u32], lo: usize, hi: usize) -> Status {
        self.search(part, lo, hi, 0, u32::MAX)
    }

    fn search(&mut self, part: &[u32], lo: usize, hi: usize, level: u64, last: u32) -> Status {
        self.nodes += 1;
        if self.nodes >= self.node_limit || self.until.passed() {
            return Status::Stopped;
        }
        if part.iter().all(|&j| self.placed[j as usize]) {
            return Status::Fits;
        }
        let Some(candidates) = self.candidates(part, lo, hi, level, last) else {
            return Status::NotFound;
        };
        for j in candidates {
            let j = j as usize;
            let o = self.floor[j];
            let mark = self.place(j);
            // Boundaries inside the partition no unplaced item spans any more split it.
            let (s, e) = self.items.hull[j];
            let split = ((s as usize).max(lo)..(e as usize - 1).min(hi - 1)).any(|b| self.cut[b] == 0);
            let status =
                if split { self.decompose(part, lo, hi) } else { self.search(part, lo, hi, o, j as u32) };
            if status == Status::Fits {
                return Status::Fits;
            }
            self.unplace(j, mark);
            if status == Status::Stopped {
                return Status::Stopped;
            }
        }
        Status::NotFound
    }

    /// Solves the pieces of `part` between boundaries no unplaced item spans, one after the
    /// other (they share no rank, so a failed piece fails the node): all fit, or nothing of
    /// them is kept.
    fn decompose(&mut self, part: &[u32], lo: usize, hi: usize) -> Status {
        let mut bounds = vec![lo];
        bounds.extend((lo..hi - 1).filter(|&b| self.cut[b] == 0).map(|b| b + 1));
        bounds.push(hi);
        let saved = (
            self.floor.clone(),
            self.load.clone(),
            self.placed.clone(),
            self.open.clone(),
            self.cut.clone(),
            self.undo.len(),
        );
        for w in bounds.windows(2) {
            let (a, b) = (w[0], w[1]);
            let piece: Vec<u32> = part
                .iter()
                .copied()
                .filter(|&j| {
                    let (s, e) = self.items.hull[j as usize];
                    !self.placed[j as usize] && s as usize >= a && e as usize <= b
                })
                .collect();
            if piece.is_empty() {
                continue;
            }
            let status = self.solve_part(&piece, a, b);
            if status != Status::Fits {
                let (floor, load, placed, open, cut, undo) = saved;
                (self.floor, self.load, self.placed, self.open, self.cut) = (floor, load, placed, open, cut);
                self.undo.truncate(undo);
                return status;
            }
        }
        Status::Fits
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::{Duration, Instant};

    /// Decides items of one interval each at `capacity`.
    fn run(ivs: &[(u32, u32)], size: &[u64], capacity: u64) -> Outcome {
        run_groups(&single(ivs), size, capacity)
    }

    /// Items of one interval each.
    fn single(ivs: &[(u32, u32)]) -> Vec<Vec<(u32, u32)>> {
        ivs.iter().map(|&iv| vec![iv]).collect()
    }

    fn meet(a: &[(u32, u32)], b: &[(u32, u32)]) -> bool {
        a.iter().any(|x| b.iter().any(|y| x.0 < y.1 && y.0 < x.1))
    }

    /// Decides `groups` (each item a list of intervals) at `capacity`.
    fn run_groups(groups: &[Vec<(u32, u32)>], size: &[u64], capacity: u64) -> Outcome {
        run_workers(groups, size, capacity, 1)
    }

    /// [`run_groups`] with `workers` streams of restarts.
    fn run_workers(groups: &[Vec<(u32, u32)>], size: &[u64], capacity: u64, workers: usize) -> Outcome {
        with_items(groups, size, |items| {
            fits_restarting(
                &Prepared::new(items),
                capacity,
                Until::at(Instant::now() + Duration::from_secs(60)),
                workers,
            )
        })
    }

    fn with_items<T>(groups: &[Vec<(u32, u32)>], size: &[u64], f: impl FnOnce(&Items<'_>) -> T) -> T {
        let mut ivp = vec![0u32];
        let mut ivs = Vec::new();
        for g in groups {
            ivs.extend_from_slice(g);
            ivp.push(ivs.len() as u32);
        }
        let hull: Vec<(u32, u32)> = groups
            .iter()
            .map(|g| (g.iter().map(|x| x.0).min().unwrap(), g.iter().map(|x| x.1).max().unwrap()))
            .collect();
        let ranks = hull.iter().map(|x| x.1).max().unwrap_or(0);
        f(&Items { ivp: Some(&ivp), ivs: &ivs, hull: &hull, size, ranks })
    }

    /// A placement that fits: every item under the capacity, no two live together sharing
    /// a byte.
    fn valid(groups: &[Vec<(u32, u32)>], size: &[u64], capacity: u64, off: &[u64]) -> bool {
        (0..groups.len()).all(|i| {
            off[i] + size[i] <= capacity
                && (0..i).all(|j| {
                    !meet(&groups[i], &groups[j]) || off[i] + size[i] <= off[j] || off[j] + size[j] <= off[i]
                })
        })
    }

    /// The optimum by brute force: every order, each item as low as it fits.
    fn optimum(groups: &[Vec<(u32, u32)>], size: &[u64]) -> u64 {
        fn rec(groups: &[Vec<(u32, u32)>], size: &[u64], placed: &mut Vec<(usize, u64)>, best: &mut u64) {
            let high = placed.iter().map(|&(i, o)| o + size[i]).max().unwrap_or(0);
            if high >= *best {
                return;
            }
            if placed.len() == groups.len() {
                *best = high;
                return;
            }
            for i in 0..groups.len() {
                if placed.iter().any(|&(j, _)| j == i) {
                    continue;
                }
                let live: Vec<(usize, u64)> =
                    placed.iter().copied().filter(|&(j, _)| meet(&groups[i], &groups[j])).collect();
                let mut spots: Vec<u64> = live.iter().map(|&(j, o)| o + size[j]).collect();
                spots.push(0);
                spots.sort_unstable();
                let o = spots
                    .into_iter()
                    .find(|&c| live.iter().all(|&(j, o)| c + size[i] <= o || c >= o + size[j]))
                    .expect("the top is free");
                placed.push((i, o));
                rec(groups, size, placed, best);
                placed.pop();
            }
        }
        let mut best = u64::MAX;
        rec(groups, size, &mut Vec::new(), &mut best);
        best
    }

    #[test]
    fn luby_sequence() {
        let terms: Vec<u64> = (1..=15).map(luby).collect();
        assert_eq!(terms, [1, 1, 2, 1, 1, 2, 4, 1, 1, 2, 1, 1, 2, 4, 8]);
    }

    #[test]
    fn decides_small_cases() {
        // Five 4-byte buffers: 12 bytes fit (b1 and b2 share an offset), 11 do not.
        let ivs = [(0, 1), (1, 3), (0, 3), (3, 4), (0, 4)];
        match run(&ivs, &[4; 5], 12) {
            Outcome::Fits(off) => assert!(valid(&single(&ivs), &[4; 5], 12, &off)),
            other => panic!("{other:?}"),
        }
        assert_eq!(run(&ivs, &[4; 5], 11), Outcome::Infeasible);
        // Three buffers live together need their sum.
        let ivs = [(0, 4), (1, 5), (2, 6)];
        assert!(matches!(run(&ivs, &[1, 2, 3], 6), Outcome::Fits(_)));
        assert_eq!(run(&ivs, &[1, 2, 3], 5), Outcome::Infeasible);
    }

    /// Floors counted in units coarser than a byte where bytes do not fit in 32 bits (sizes
    /// with no common divisor, a capacity past 2^32 of them) still decide exactly: the
    /// per-rank test prunes less, never a placement that fits.
    #[test]
    fn floors_beyond_32_bits_decide_exactly() {
        let big = 1u64 << 33;
        // Two items live together, then one of the two sizes and a third of the rest: the
        // capacity is their sum exactly.
        let ivs = [(0, 2), (0, 1), (1, 2), (1, 2)];
        let size = [big + 1, 3 * big + 7, big + 3, 2 * big + 4];
        let capacity = 4 * big + 8;
        match run(&ivs, &size, capacity) {
            Outcome::Fits(off) => assert!(valid(&single(&ivs), &size, capacity, &off)),
            other => panic!("{other:?}"),
        }
        assert_eq!(run(&ivs, &size, capacity - 1), Outcome::Infeasible);
        // Tilings of 2^32 bytes cut at any byte (floors in units of 2 bytes) fit at their bound.
        let shape = crate::workload::Tiling { granularity: 1, ..Default::default() };
        for seed in 1..=3 {
            let bufs = crate::workload::packed_tiling(100, seed, &shape);
            let (ivs, size) = compressed(&bufs);
            match run(&ivs, &size, 1 << 32) {
                Outcome::Fits(off) => assert!(valid(&single(&ivs), &size, 1 << 32, &off), "seed {seed}"),
                other => panic!("seed {seed}: {other:?}"),
            }
        }
    }

    /// `workload::packed(n, seed)` over its compressed clock: intervals and sizes.
    fn tiling(n: usize, seed: u64) -> (Vec<(u32, u32)>, Vec<u64>) {
        compressed(&crate::workload::packed(n, seed))
    }

    /// `bufs` over their compressed clock: intervals and sizes.
    fn compressed(bufs: &[crate::Buffer]) -> (Vec<(u32, u32)>, Vec<u64>) {
        let mut times: Vec<u64> = bufs.iter().flat_map(|b| [b.start, b.end]).collect();
        times.sort_unstable();
        times.dedup();
        let r = |t: u64| times.binary_search(&t).expect("a time of the list") as u32;
        (bufs.iter().map(|b| (r(b.start), r(b.end))).collect(), bufs.iter().map(|b| b.size).collect())
    }

    /// Tilings (every rank exactly full at the bound) fit at the bound: 100 pieces in
    /// well under a second.
    #[test]
    fn tilings_fit_at_their_bound() {
        for seed in 1..=3 {
            let (ivs, size) = tiling(100, seed);
            match run(&ivs, &size, 1 << 32) {
                Outcome::Fits(off) => assert!(valid(&single(&ivs), &size, 1 << 32, &off), "seed {seed}"),
                other => panic!("seed {seed}: {other:?}"),
            }
        }
    }

    /// Streams of restarts on several threads answer as one sequence of restarts would:
    /// the same placement in every run, whichever thread is faster (tilings whose static
    /// orders miss, so that noisy restarts decide).
    #[test]
    fn workers_answer_as_one_sequence() {
        for seed in [2, 3, 8] {
            let (ivs, size) = tiling(200, seed);
            // The static orders' restarts alone do not place it.
            with_items(&single(&ivs), &size, |items| {
                let prep = Prepared::new(items);
                let far = Until::at(Instant::now() + Duration::from_secs(10));
                for (restart, order) in
                    [(1, Order::TotalWidthArea), (2, Order::WidthAreaTotal), (3, Order::TotalAreaWidth)]
                {
                    let limit = 2 * ivs.len() as u64 * luby(restart);
                    let out = fits(&prep, 1 << 32, far, &prep.rank[order as usize], limit);
                    assert_eq!(out, Outcome::Unknown, "seed {seed}, restart {restart}");
                }
            });
            let first = run_workers(&single(&ivs), &size, 1 << 32, 4);
            match &first {
                Outcome::Fits(off) => assert!(valid(&single(&ivs), &size, 1 << 32, off), "seed {seed}"),
                other => panic!("seed {seed}: {other:?}"),
            }
            for _ in 0..3 {
                assert_eq!(run_workers(&single(&ivs), &size, 1 << 32, 4), first, "seed {seed}");
            }
        }
    }

    /// The answer does not depend on when each worker's thread gets to run: workers run one
    /// after another, the last first (as when threads start late, or only one runs), answer
    /// what the four running side by side answer.
    #[test]
    fn workers_answer_the_same_whenever_their_threads_run() {
        for seed in [2, 3, 8] {
            let (ivs, size) = tiling(200, seed);
            let side_by_side = run_workers(&single(&ivs), &size, 1 << 32, 4);
            assert!(matches!(side_by_side, Outcome::Fits(_)), "seed {seed}");
            for order in [[3, 2, 1, 0], [1, 3, 0, 2]] {
                let one_by_one = with_items(&single(&ivs), &size, |items| {
                    let prep = Prepared::new(items);
                    let streams = Streams::new(4);
                    // (A deadline reached would change the answer: far beyond the seconds
                    // these take in a debug build on a busy machine.)
                    let far = Until::at(Instant::now() + Duration::from_secs(120));
                    order.iter().for_each(|&w| streams.run(&prep, 1 << 32, far, w));
                    streams.outcome()
                });
                assert_eq!(one_by_one, side_by_side, "seed {seed}, workers in the order {order:?}");
            }
        }
    }

    /// An item drawn as (parts, start, size): each part a (gap, length).
    type DrawnItem = (Vec<(u32, u32)>, u32, u64);

    /// Drawn items' intervals: each part `gap` ranks after the end of the one before (plus
    /// one rank), the first from `start`; only the first part where not `grouped`.
    fn drawn_groups(raw: &[DrawnItem], grouped: bool) -> Vec<Vec<(u32, u32)>> {
        raw.iter()
            .map(|(parts, start, _)| {
                let parts = if grouped { &parts[..] } else { &parts[..1] };
                let mut t = *start;
                parts
                    .iter()
                    .map(|&(gap, len)| {
                        t += gap;
                        let iv = (t, t + len);
                        t += len + 1;
                        iv
                    })
                    .collect()
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Every item's neighbours are exactly the items one of whose intervals meets one of
        /// its own, each once, in order (items of up to four disjoint intervals, some
        /// touching end to start, which do not meet).
        #[test]
        fn neighbours_are_the_items_that_meet(
            raw in prop::collection::vec(prop::collection::vec((0u32..30, 1u32..6), 1..5), 1..90),
        ) {
            // Each item's intervals laid end to end from its first start, gaps of 0–2 ranks.
            let groups: Vec<Vec<(u32, u32)>> = raw
                .iter()
                .map(|ivs| {
                    let mut at = ivs[0].0;
                    ivs.iter()
                        .map(|&(gap, len)| {
                            at += gap % 3;
                            let iv = (at, at + len);
                            at += len;
                            iv
                        })
                        .collect()
                })
                .collect();
            let size = vec![1u64; groups.len()];
            with_items(&groups, &size, |items| {
                let nb = Neighbours::new(items);
                for i in 0..groups.len() {
                    let expected: Vec<u32> = (0..groups.len())
                        .filter(|&j| j != i && meet(&groups[i], &groups[j]))
                        .map(|j| j as u32)
                        .collect();
                    assert_eq!(nb.of(i), &expected[..], "item {}", i);
                }
            });
        }

        /// Checking a node by painting the ranks gives what checking it rank by rank gives:
        /// the same answer after the same number of nodes, at the live bound and above it —
        /// items of up to six intervals or of one, sizes of a few units or of up to 2^40
        /// bytes (floors then counted in units coarser than a byte).
        #[test]
        fn both_checks_visit_the_same_nodes(
            raw in prop::collection::vec(
                (prop::collection::vec((0u32..6, 1u32..8), 1..7), 0u32..40, 1u64..1 << 40),
                2..60,
            ),
            grouped in any::<bool>(),
            huge in any::<bool>(),
            above in 0u64..4,
        ) {
            let groups = drawn_groups(&raw, grouped);
            let size: Vec<u64> = raw.iter().map(|&(_, _, z)| if huge { z } else { 1 + z % 16 }).collect();
            with_items(&groups, &size, |items| {
                let prep = Prepared::new(items);
                let live = prep.load.iter().copied().max().unwrap_or(0);
                let capacity = live + above * (live / 16);
                let far = Until::at(Instant::now() + Duration::from_secs(60));
                for order in Order::ALL {
                    let rank = prep.static_rank(order);
                    let by_ranks = fits_checking(&prep, capacity, far, rank, 3000, false);
                    let painted = fits_checking(&prep, capacity, far, rank, 3000, true);
                    assert_eq!(by_ranks, painted, "{order:?} at {capacity}");
                }
            });
        }

        /// Sound and complete: a placement at the optimum, and a proof that one byte less
        /// does not fit — items of one interval, and alias groups of up to three.
        #[test]
        fn agrees_with_brute_force(
            raw in prop::collection::vec(
                (prop::collection::vec((0u32..4, 1u32..4), 1..4), 0u32..10, 1u64..9),
                1..8,
            ),
            grouped in any::<bool>(),
        ) {
            let groups = drawn_groups(&raw, grouped);
            let size: Vec<u64> = raw.iter().map(|&(_, _, z)| z).collect();
            let best = optimum(&groups, &size);
            match run_groups(&groups, &size, best) {
                Outcome::Fits(off) => prop_assert!(valid(&groups, &size, best, &off)),
                other => prop_assert!(false, "{:?} at the optimum {}", other, best),
            }
            prop_assert_eq!(run_groups(&groups, &size, best - 1), Outcome::Infeasible);
            // Several streams of restarts decide the same.
            match run_workers(&groups, &size, best, 3) {
                Outcome::Fits(off) => prop_assert!(valid(&groups, &size, best, &off)),
                other => prop_assert!(false, "{:?} at the optimum {} with 3 workers", other, best),
            }
            prop_assert_eq!(run_workers(&groups, &size, best - 1, 3), Outcome::Infeasible);
            // Bisecting from 0 proves the optimum as the bound and places there.
            for workers in [1, 2] {
                let (found, proved) = with_items(&groups, &size, |items| {
                    search(items, (0, 0, 2 * best + 1), Until::at(Instant::now() + Duration::from_secs(10)), workers)
                });
                prop_assert_eq!(proved, best);
                prop_assert_eq!(found.map(|f| f.1), Some(best));
            }
        }
    }
}
