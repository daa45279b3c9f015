//! The layered construction (items with one interval): a *skeleton* of items is planned
//! first as an instance of its own, by this same engine (recursively, so a large skeleton
//! is layered in turn), and the other items are filled in around it by one greedy pass,
//! longest-lived first, best fit. A small instance gets far more search per item than the
//! whole list would.
//!
//! The skeleton is either the items live where the bytes live come within a tenth of the
//! bound ([`hot_items`]: at those steps a plan must stack its items almost without a gap,
//! and everywhere else the fill has room to spare), or the items that hold most of the area
//! (bytes × lifetime: [`skeleton_items`]) — on dense lists where those are fewer than the
//! hot items or the hot items' sizes repeat, and where a few items hold nearly all of it and
//! decide the footprint ([`choose_skeleton`]). A population of large
//! items standing apart from the rest (a tenfold drop between consecutive areas) is kept
//! whole in a skeleton by area ([`NATURAL_BREAK`]).
//!
//! A *tiered* construction (dense lists, where the greedy fill of every other item would
//! cost a whole greedy pass: each gap query visits the ~1400 items live with it) fills
//! greedily only the items that bring the area held to [`TIERED_FILL_AREA`], and sweeps the
//! rest in by online best fit around them ([`online_around`]), each stretch of the clock its
//! own tail after its greedy part: on dense 100k lists 21k items go in by the greedy fill and
//! 73k by the sweep, two stretches of ~360 ms side by side on 2 cores (one greedy pass over
//! every item would take ~1 s).

use super::*;

/// Share of the total area (bytes × lifetime) the skeleton holds.
pub(super) const SKELETON_AREA: f64 = 0.85;
/// Consecutive areas (largest first) this many times apart make a *natural break*: a
/// skeleton that ends just before one is extended to it, so that a population of large items
/// is planned together rather than split between the skeleton and the greedy fill.
pub(super) const NATURAL_BREAK: f64 = 10.0;
/// The skeleton may be at most this share of the items: where the area is spread so evenly
/// that 85% of it needs most of the items, planning them apart gains nothing.
pub(super) const SKELETON_MAX_SHARE: f64 = 0.6;
/// Items a list needs for the layered construction.
pub(super) const LAYERED_MIN_ITEMS: usize = 512;
/// Share of the budget the skeleton's plan gets (30% gave the improvement stage 80 ms less
/// at 100k, and plans 0.001–0.006 higher on average: docs/planner.md, "Lists of similar
/// sizes").
pub(super) const SKELETON_BUDGET: f64 = 0.2;
/// Share of the area above which a skeleton is *dominant*: its plan is the footprint (two
/// populations, 100k buffers: the fill and the improvement stage on the whole list left the
/// skeleton's footprint as it was on every seed measured), so it gets all the time the fill
/// leaves, up to [`DOMINANT_SKELETON_BUDGET`].
pub(super) const DOMINANT_AREA: f64 = 0.99;
/// The largest share of the budget a dominant skeleton's plan gets.
pub(super) const DOMINANT_SKELETON_BUDGET: f64 = 0.75;
/// How many times the measured fill a dominant skeleton leaves for it.
pub(super) const DOMINANT_FILL_MARGIN: u32 = 2;
/// Share of the total area the skeleton and the greedy fill hold together in a *tiered*
/// construction (dense lists); the rest (the *tail*: on dense 100k lists 0.5% of the area
/// and 73% of the items) goes in by an online sweep around them.
pub(super) const TIERED_FILL_AREA: f64 = 0.995;

/// The *tail* of a tiered construction around `skeleton`: the items of `p` outside it with
/// the smallest areas, those beyond the largest that bring the area held (with the
/// skeleton's) to [`TIERED_FILL_AREA`].
pub(super) fn tail_items(p: &Problem, skeleton: &[u32]) -> Vec<u32> {
    let n = p.len();
    let in_skeleton = mask(n, skeleton);
    let area = |i: u32| area(p, i);
    let total: f64 = (0..n as u32).map(area).sum();
    let mut held: f64 = skeleton.iter().map(|&i| area(i)).sum();
    let mut rest: Vec<u32> = (0..n as u32).filter(|&i| !in_skeleton[i as usize]).collect();
    rest.sort_unstable_by(|&a, &b| area(b).total_cmp(&area(a)).then(a.cmp(&b)));
    let keep = rest
        .iter()
        .position(|&i| {
            held += area(i);
            held > TIERED_FILL_AREA * total
        })
        .map_or(rest.len(), |k| k + 1);
    rest.split_off(keep)
}

/// The area (bytes × lifetime) of item `i` of `p`.
fn area(p: &Problem, i: u32) -> f64 {
    p.size[i as usize] as f64 * p.life[i as usize] as f64
}

/// Share of the area of `p` that `items` hold.
pub(super) fn area_share(p: &Problem, items: &[u32]) -> f64 {
    let total: f64 = (0..p.len() as u32).map(|i| area(p, i)).sum();
    let held: f64 = items.iter().map(|&i| area(p, i)).sum();
    if total > 0.0 { held / total } else { 0.0 }
}

/// How many times its estimate the fill of a tiered construction (not dominant) is given
/// room for: it is guaranteed to finish, so a fill slower than estimated ends the plan late
/// (dense 100k lists on 2 cores: ~300 ms estimated, 340–380 ms measured).
pub(super) const TIERED_FILL_MARGIN: f64 = 1.5;
/// The least share of the budget worth planning a skeleton with.
pub(super) const SKELETON_MIN_BUDGET: f64 = 0.1;

/// The share of `budget` the skeleton of a tiered construction (not dominant) gets, `spent`
/// already gone and its fill expected to take `fill`: [`SKELETON_BUDGET`], or less where the
/// fill with [`TIERED_FILL_MARGIN`] would not fit after it; `None` (no skeleton) where that
/// leaves less than [`SKELETON_MIN_BUDGET`].
pub(super) fn tiered_share(budget: Duration, spent: Duration, fill: Duration) -> Option<f64> {
    let left = budget.saturating_sub(spent + fill.mul_f64(TIERED_FILL_MARGIN));
    let share = (left.as_secs_f64() / budget.as_secs_f64().max(f64::MIN_POSITIVE)).min(SKELETON_BUDGET);
    (share >= SKELETON_MIN_BUDGET).then_some(share)
}

/// The share of the budget a dominant skeleton's plan gets when `left` (a share of the
/// budget) remains once it is planned and filled ([`DOMINANT_FILL_MARGIN`] times the fill
/// measured): all of it, between [`SKELETON_BUDGET`] and [`DOMINANT_SKELETON_BUDGET`].
pub(super) fn dominant_share(left: f64) -> f64 {
    left.clamp(SKELETON_BUDGET, DOMINANT_SKELETON_BUDGET)
}

/// The whole layered construction around `sk`, its stretches filled on `parts` workers (each
/// stopping at `deadline`): offsets and footprint, `None` when stopped. What planning the
/// fill after the skeleton will take, measured (on a dominant skeleton at its online
/// best-fit offsets, before the skeleton's budget is chosen).
pub(super) fn layered_now(
    p: &Problem,
    sk: &Skeleton,
    parts: usize,
    deadline: Instant,
) -> Option<(Vec<u64>, u64)> {
    let fill = layered_fill(p, sk, parts);
    let filled = run_workers(fill.parts(), |k| fill_part(p, &fill, k, || Instant::now() > deadline));
    Some(assemble(&fill, filled.into_iter().collect::<Option<Vec<_>>>()?))
}

/// Marks of the `items` among `n`.
fn mask(n: usize, items: &[u32]) -> Vec<bool> {
    let mut marked = vec![false; n];
    for &i in items {
        marked[i as usize] = true;
    }
    marked
}

/// The items of `p` in neither `skeleton` nor `tail`: those the greedy fill places.
fn fill_items(p: &Problem, skeleton: &[u32], tail: &[u32]) -> Vec<u32> {
    let (in_skeleton, in_tail) = (mask(p.len(), skeleton), mask(p.len(), tail));
    (0..p.len() as u32).filter(|&i| !in_skeleton[i as usize] && !in_tail[i as usize]).collect()
}

/// What the online sweep of a tiered construction takes per tail item and worker, about
/// (measured: the two halves of a dense 100k list's tail, 36k items each, in 117–146 ms side
/// by side on 2 cores).
const TAIL_SWEEP_PER_ITEM: Duration = Duration::from_micros(3);

/// What the fill of a tiered construction around `skeleton` is expected to take with
/// `threads` workers: a greedy pass over the items it fills (by the pairs of their
/// intervals and the skeleton's), then the online sweep of `tail`, shared among them.
pub(super) fn tiered_fill_estimate(p: &Problem, skeleton: &[u32], tail: &[u32], threads: u32) -> Duration {
    let fill = fill_items(p, skeleton, tail);
    let ivs: Vec<(u32, u32)> = skeleton.iter().chain(&fill).map(|&i| p.hull[i as usize]).collect();
    let pairs = overlapping_pairs(&ivs);
    (greedy_pass_estimate(fill.len(), pairs) + TAIL_SWEEP_PER_ITEM * tail.len() as u32) / threads.max(1)
}

/// A planned skeleton.
pub(super) struct Skeleton {
    /// Its items, largest area first.
    pub(super) items: Vec<u32>,
    /// The offset of each, in the order of `items`.
    pub(super) off: Vec<u64>,
    /// What planned it (the nested plan's strategy).
    pub(super) strategy: String,
    /// The items left to an online sweep instead of the greedy fill (a tiered construction;
    /// [`tail_items`]); empty: none.
    pub(super) tail: Vec<u32>,
    /// Whether its items are the [`hot_items`]: the construction around it is then where
    /// the improvement stage starts (see `portfolio::run`).
    pub(super) hot: bool,
}

/// The items of `p` (one interval each) with the largest areas, largest first, that
/// together hold [`SKELETON_AREA`] of the area — or more, up to a [`NATURAL_BREAK`] in the
/// areas further on within [`SKELETON_MAX_SHARE`] of the items; `None` where they are more
/// than that share.
pub(super) fn skeleton_items(p: &Problem) -> Option<Vec<u32>> {
    let n = p.len();
    let area = |i: u32| area(p, i);
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.sort_unstable_by(|&a, &b| area(b).total_cmp(&area(a)).then(a.cmp(&b)));
    let total: f64 = order.iter().map(|&i| area(i)).sum();
    let mut held = 0.0;
    let mut k = 0;
    while k < n && held < SKELETON_AREA * total {
        held += area(order[k]);
        k += 1;
    }
    let most = (SKELETON_MAX_SHARE * n as f64) as usize;
    if k > 0
        && let Some(j) = (k..n.min(most + 1)).find(|&j| area(order[j - 1]) >= NATURAL_BREAK * area(order[j]))
    {
        k = j;
    }
    if k == 0 || k > most {
        return None;
    }
    order.truncate(k);
    Some(order)
}

/// Share of the live bound at or above which a clock step is *hot* (see [`hot_items`]):
/// 0.85, 0.875, 0.925 measured against it (docs/planner.md, "The hot skeleton").
pub(super) const HOT_LIVE: f64 = 0.9;

/// The items of `p` (one interval each) live at a *hot* step — one where the bytes live
/// reach [`HOT_LIVE`] of the most live at any step —, largest area first; `None` where there
/// are none or more than [`SKELETON_MAX_SHARE`] of the items (as in the nested plan of such a
/// skeleton, where every item is live at a hot step).
///
/// The hot steps are where a plan's top is decided: at the step of the live bound every byte
/// under the footprint but the plan's excess is used, so the items live there must stack
/// almost without a gap, and those live beside them must leave them room. On lists whose
/// buffers come from one population, the improvement stage spent its last thousands of
/// steps on an item at such a step (lists of similar sizes, 100k: the item at the top lives
/// where 98.7–100% of the bound is live). Planned first as a list of their own (1.6–15k of
/// 100k items), they stack near the bound, and every other step has a tenth of the bound
/// to spare for the fill.
pub(super) fn hot_items(p: &Problem) -> Option<Vec<u32>> {
    let n = p.len();
    // An item is hot when the most bytes live during its lifetime (`Problem::peak`) reach
    // the level; the most of those is the most live at any step.
    let bound = p.peak.iter().copied().max().unwrap_or(0);
    let level = HOT_LIVE * bound as f64;
    let mut items: Vec<u32> =
        (0..n as u32).filter(|&i| bound > 0 && p.peak[i as usize] as f64 >= level).collect();
    if items.is_empty() || items.len() as f64 > SKELETON_MAX_SHARE * n as f64 {
        return None;
    }
    items.sort_unstable_by(|&a, &b| area(p, b).total_cmp(&area(p, a)).then(a.cmp(&b)));
    Some(items)
}

/// Share of a skeleton's items whose size no other item of it has, at or above which its
/// sizes are *distinct* (see [`choose_skeleton`]).
pub(super) const DISTINCT_SIZES: f64 = 0.5;

/// Whether at least [`DISTINCT_SIZES`] of `items` have a size no other of them has.
fn sizes_distinct(p: &Problem, items: &[u32]) -> bool {
    let mut sizes: Vec<u64> = items.iter().map(|&i| p.size[i as usize]).collect();
    sizes.sort_unstable();
    let alone = sizes.chunk_by(|a, b| a == b).filter(|run| run.len() == 1).count();
    alone as f64 >= DISTINCT_SIZES * items.len() as f64
}

/// The skeleton of the layered construction of `p` (one interval each; `dense`: the list's
/// greedy pass is not expected to fit in the budget, see `place`), planned for `plan_for`,
/// and whether it is the hot items. The [`hot_items`], unless
/// - the items with the largest areas ([`skeleton_items`]) hold [`DOMINANT_AREA`] of it;
/// - the list is dense and the hot items are no fewer than those (or there are none), or of
///   repeating sizes ([`sizes_distinct`]): where a few long-lived items hold the area, the
///   tiered fill sweeps most items in around them and a hot skeleton measured worse; where
///   sizes repeat, holes fit later items exactly and the skeleton by area's plan leads;
///   elsewhere the smaller hot skeleton gets more search per item (docs/planner.md,
///   "Log-uniform sizes over twelve octaves");
/// - `p` is itself a skeleton planned for the fill around it: its hot steps are where the
///   skeleton's bytes peak, not where the list's top is decided (lists of power-of-two
///   sizes, 100k, seeds 1–9: median 1.016 without a hot skeleton in the plan of their dense
///   skeleton, 1.026 with, mean 1.021 both ways);
///
/// then, or where no item is hot, the items with the largest areas.
pub(super) fn choose_skeleton(p: &Problem, dense: bool, plan_for: PlanFor) -> Option<(Vec<u32>, bool)> {
    let by_area = skeleton_items(p);
    let dominant = by_area.as_ref().is_some_and(|items| area_share(p, items) >= DOMINANT_AREA);
    if !dominant
        && plan_for == PlanFor::Footprint
        && let Some(hot) = hot_items(p)
        && (!dense
            || (by_area.as_ref().is_some_and(|by_area| hot.len() < by_area.len()) && sizes_distinct(p, &hot)))
    {
        return Some((hot, true));
    }
    by_area.map(|items| (items, false))
}

/// The `items` of `p` (one interval each) as a buffer list of their own, on the real clock.
fn item_buffers(p: &Problem, items: &[u32]) -> Vec<Buffer> {
    items
        .iter()
        .map(|&i| {
            let i = i as usize;
            Buffer { start: p.start[i], end: p.start[i] + p.life[i], size: p.size[i], group: None }
        })
        .collect()
}

/// Plans the skeleton `items` of `p` as a list of their own (real clock, no alias groups)
/// with `budget`, uncapped, for `plan_for` (a dominant skeleton's plan is the footprint);
/// `tail`: see [`Skeleton::tail`].
pub(super) fn plan_skeleton(
    p: &Problem,
    items: Vec<u32>,
    budget: Duration,
    opts: &PlaceOptions,
    plan_for: PlanFor,
    tail: Vec<u32>,
) -> Option<Skeleton> {
    let buffers = item_buffers(p, &items);
    let sub = PlaceOptions { time_budget: budget, scaled_budget_per_item: None, ..opts.clone() };
    let plan = place_for(&buffers, &sub, plan_for, Mirror::Never).ok()?;
    Some(Skeleton { items, off: plan.offsets, strategy: plan.strategy, tail, hot: false })
}

/// The skeleton `items` of a dense list planned for the fill ([`plan_skeleton`]) on all cores
/// but one, and on that one the first online aligned construction of the whole list
/// (stopped at `deadline`): the skeleton and that construction's offsets and footprint.
///
/// On dense lists the skeleton's plan and its fill take most of the budget, and the
/// portfolio's constructions of the whole list then seldom start; which of the two is lower
/// depends on the list. Where a few thousand long-lived buffers of sizes within two orders
/// of magnitude hold the area (`workload::random_long_short`, 100k buffers, 2 cores) the
/// skeleton holds only the larger of them, and the whole-list construction is lower on
/// most seeds (mean of 10 seeds, two runs each: 1.0373 / 1.0379 → 1.0339 / 1.0351); on
/// `random_dense`, where the skeleton is the answer, one core less for it left the plans
/// within their spread (1.0326 / 1.0342 → 1.0343 / 1.0318).
pub(super) fn skeleton_beside_aligned(
    p: &Problem,
    items: Vec<u32>,
    budget: Duration,
    opts: &PlaceOptions,
    tail: Vec<u32>,
    deadline: Instant,
) -> (Option<Skeleton>, Option<(Vec<u64>, u64)>) {
    let sk_opts = PlaceOptions { threads: opts.threads.saturating_sub(1).max(1), ..opts.clone() };
    std::thread::scope(|scope| {
        let aligned = || aligned_variant(p, 0, || Instant::now() > deadline);
        let whole = spawn_beside(scope, aligned);
        let sk = plan_skeleton(p, items, budget, &sk_opts, PlanFor::Fill, tail);
        // (Without a thread for it, the aligned construction runs after the skeleton's.)
        let whole = whole.map_or_else(aligned, |h| h.join().expect("the aligned construction panicked"));
        (sk, whole)
    })
}

/// The layered construction's fill, split into stretches of the clock that workers fill
/// side by side: the skeleton and the items crossing a cut between stretches are placed
/// first (into `base`); every other item lies within one stretch and meets only those and
/// the items of its own stretch — tail items too, which each worker sweeps in after its
/// greedy fill, so the sweep of a tiered construction is shared among the workers as well.
pub(super) struct LayeredFill {
    /// The skeleton and the crossing items.
    base: Index,
    /// The same items (the skeleton's, then the crossing ones).
    base_items: Vec<u32>,
    /// Their offsets (the others' are filled in by the parts).
    off: Vec<u64>,
    /// Their highest top.
    high: u64,
    /// The items of each stretch the greedy fill places, in fill order.
    parts: Vec<Vec<u32>>,
    /// The items of each stretch left to the online sweep (tiered constructions; see
    /// [`online_around`]).
    tails: Vec<Vec<u32>>,
    /// The clock steps `[from, to)` of each stretch.
    spans: Vec<(u32, u32)>,
}

impl LayeredFill {
    /// Stretches.
    pub(super) fn parts(&self) -> usize {
        self.parts.len()
    }
}

/// Items of one stretch and where each went, with their highest top.
pub(super) type FilledPart = (Vec<(u32, u64)>, u64);

/// The layered construction, first half: the skeleton at its offsets, every other item to
/// be placed around it longest-lived first, best fit (the long small items take the gaps
/// that stay open longest while the short ones still fit almost anywhere), in `parts`
/// stretches of about as many items each (cut where items start); the items crossing a cut
/// go in now (tail items among them after the others).
pub(super) fn layered_fill(p: &Problem, sk: &Skeleton, parts: usize) -> LayeredFill {
    let n = p.len();
    let mut base = Index::with_placed(p, sk.items.iter().zip(&sk.off).map(|(&i, &o)| (i as usize, o)));
    let mut off = vec![0u64; n];
    let mut high = 0;
    for (k, &i) in sk.items.iter().enumerate() {
        let i = i as usize;
        off[i] = sk.off[k];
        high = high.max(off[i] + p.size[i]);
    }
    let mut rest = fill_items(p, &sk.items, &sk.tail);
    sort_items(p, &mut rest, Order::Lifetime, 0.0, &mut Rng::new(0));
    let mut starts: Vec<u32> = rest.iter().map(|&i| p.hull[i as usize].0).collect();
    starts.sort_unstable();
    let parts = parts.clamp(1, rest.len().max(1));
    let mut cuts: Vec<u32> = (1..parts).map(|k| starts[k * starts.len() / parts]).collect();
    cuts.dedup();
    // Each item to the stretch holding it, or to the crossing ones.
    let split = |items: &[u32]| {
        let mut crossing = Vec::new();
        let mut split: Vec<Vec<u32>> = vec![Vec::new(); cuts.len() + 1];
        for &i in items {
            let (s, e) = p.hull[i as usize];
            // The stretch holding the start: cuts at or before it.
            let k = cuts.partition_point(|&c| c <= s);
            if k < cuts.len() && e > cuts[k] {
                crossing.push(i);
            } else {
                split[k].push(i);
            }
        }
        (crossing, split)
    };
    let (mut crossing, parts) = split(&rest);
    // The sweep orders each stretch's tail itself; the crossing ones go in by the greedy
    // fill, in its order.
    let (mut tail_crossing, tails) = split(&sk.tail);
    sort_items(p, &mut tail_crossing, Order::Lifetime, 0.0, &mut Rng::new(0));
    crossing.extend(tail_crossing);
    high = high.max(greedy(p, &crossing, Fit::BestFit, &mut base, &mut off));
    let mut base_items = sk.items.clone();
    base_items.extend(crossing);
    let bounds: Vec<u32> = std::iter::once(0).chain(cuts.iter().copied()).chain([u32::MAX]).collect();
    let spans = bounds.windows(2).map(|w| (w[0], w[1])).collect();
    LayeredFill { base, base_items, off, high, parts, tails, spans }
}

/// Fills stretch `k` of `fill` (on a copy of its index): its greedy part, then its tail swept
/// in around the items live in the stretch. `None` when `stop` says so first (checked every
/// 256 items of the greedy part), or when the sweep found the placed items overlapping (a
/// bug: the construction is dropped then, not the plan).
pub(super) fn fill_part(
    p: &Problem,
    fill: &LayeredFill,
    k: usize,
    stop: impl Fn() -> bool,
) -> Option<FilledPart> {
    let mut index = fill.base.clone();
    let mut off = fill.off.clone();
    let mut high = greedy_until(p, &fill.parts[k], Fit::BestFit, &mut index, &mut off, stop)?;
    let tail = &fill.tails[k];
    if !tail.is_empty() {
        let (from, to) = fill.spans[k];
        let around: Vec<u32> = (fill.base_items.iter().copied())
            .filter(|&i| {
                let (s, e) = p.hull[i as usize];
                s < to && e > from
            })
            .chain(fill.parts[k].iter().copied())
            .collect();
        high = high.max(online_around(p, &mut off, &around, tail)?);
    }
    let placed = fill.parts[k].iter().chain(tail);
    Some((placed.map(|&i| (i, off[i as usize])).collect(), high))
}

/// The layered construction, second half: every stretch filled (`filled[k]` for stretch k)
/// and put together: offsets and footprint.
pub(super) fn assemble(fill: &LayeredFill, filled: Vec<FilledPart>) -> (Vec<u64>, u64) {
    let mut off = fill.off.clone();
    let mut high = fill.high;
    for (items, h) in filled {
        for (i, o) in items {
            off[i as usize] = o;
        }
        high = high.max(h);
    }
    (off, high)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deadline no test reaches.
    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    /// The problem of `b`, its skeleton and the tail a tiered construction sweeps in.
    fn tiers_of(b: &[Buffer]) -> (Problem, Vec<u32>, Vec<u32>) {
        let p = Problem::build(b).unwrap();
        let items = skeleton_items(&p).expect("a skeleton");
        let tail = tail_items(&p, &items);
        (p, items, tail)
    }
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// On any list with a skeleton, the layered construction (tiered or not) places every
        /// item without overlaps, reports its true footprint, and keeps the skeleton where it
        /// was planned.
        #[test]
        fn layered_placements_are_valid(
            raw in prop::collection::vec((0u64..60, 1u64..40, 0u32..4, 1u64..64), 1..120),
            parts in 1usize..5,
            tiered in any::<bool>(),
            hot in any::<bool>(),
        ) {
            // Sizes over several orders of magnitude, so that some lists have a skeleton.
            let b: Vec<Buffer> = raw
                .into_iter()
                .map(|(start, life, scale, size)| Buffer {
                    start,
                    end: start + life,
                    size: size << (4 * scale),
                    group: None,
                })
                .collect();
            let p = Problem::build(&b).unwrap();
            let Some(items) = (if hot { hot_items(&p) } else { skeleton_items(&p) }) else { return Ok(()) };
            let opts = PlaceOptions { threads: 1, ..PlaceOptions::default() };
            let mut sk = plan_skeleton(&p, items, Duration::from_millis(2), &opts, PlanFor::Fill, Vec::new()).unwrap();
            sk.tail = if tiered { tail_items(&p, &sk.items) } else { Vec::new() };
            let (off, high) = layered_now(&p, &sk, parts, far()).unwrap();
            let offsets: Vec<u64> = p.item_of.iter().map(|&i| off[i as usize]).collect();
            verify(&b, &offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(high, (0..p.len()).map(|i| off[i] + p.size[i]).max().unwrap());
            for (k, &i) in sk.items.iter().enumerate() {
                prop_assert_eq!(off[i as usize], sk.off[k]);
            }
        }
    }

    #[test]
    fn skeletons_hold_most_of_the_area_in_few_items() {
        // Heavy-tailed sizes and lifetimes: a few items hold most of the area.
        let b = crate::workload::random(20_000, 3);
        let p = Problem::build(&b).unwrap();
        let items = skeleton_items(&p).expect("a heavy-tailed list has a skeleton");
        assert!(items.len() * 8 < p.len(), "{} of {} items", items.len(), p.len());
        let area = |i: usize| p.size[i] as f64 * p.life[i] as f64;
        let total: f64 = (0..p.len()).map(area).sum();
        let held: f64 = items.iter().map(|&i| area(i as usize)).sum();
        assert!(held >= SKELETON_AREA * total);
        // Largest first, and no item left out is larger than one taken.
        let smallest = items.iter().map(|&i| area(i as usize)).fold(f64::INFINITY, f64::min);
        let mut taken = vec![false; p.len()];
        for &i in &items {
            taken[i as usize] = true;
        }
        assert!((0..p.len()).filter(|&i| !taken[i]).all(|i| area(i) <= smallest));
        // Equal sizes and lifetimes spread the area evenly: no skeleton.
        let even: Vec<Buffer> = (0..5000)
            .map(|i| Buffer { start: i * 7 % 1000, end: i * 7 % 1000 + 10, size: 4096, group: None })
            .collect();
        assert!(skeleton_items(&Problem::build(&even).unwrap()).is_none());
    }

    /// Bytes live at each instant of the real clock of `b` (its ends below `t`).
    fn live_at(b: &[Buffer], t: usize) -> Vec<u64> {
        let mut live = vec![0u64; t];
        for x in b {
            for l in &mut live[x.start as usize..x.end as usize] {
                *l += x.size;
            }
        }
        live
    }

    #[test]
    fn hot_items_are_those_live_where_the_bound_is_nearly_reached() {
        for (b, seed) in [
            (crate::workload::random_similar_sizes(20_000, 1), 1),
            (crate::workload::random_uniform_sizes(20_000, 2), 2),
            (crate::workload::random(20_000, 3), 3),
        ] {
            let p = Problem::build(&b).unwrap();
            let items = hot_items(&p).expect("random lists have hot steps");
            let t = b.iter().map(|x| x.end).max().unwrap() as usize;
            let live = live_at(&b, t);
            let bound = *live.iter().max().unwrap();
            let hot_time = |x: &Buffer| {
                live[x.start as usize..x.end as usize].iter().any(|&l| l as f64 >= HOT_LIVE * bound as f64)
            };
            let mut taken = vec![false; p.len()];
            for &i in &items {
                taken[i as usize] = true;
            }
            for (k, x) in b.iter().enumerate() {
                let i = p.item_of[k] as usize;
                assert_eq!(taken[i], hot_time(x), "seed {seed}: buffer {k} {x:?}");
            }
            assert!(items.len() * 5 < p.len(), "seed {seed}: {} hot of {}", items.len(), p.len());
            // Largest area first.
            let area = |i: u32| area(&p, i);
            assert!(items.windows(2).all(|w| area(w[0]) >= area(w[1])), "seed {seed}");
            // In the list of the hot items alone every item is hot: no skeleton of its own.
            let alone = item_buffers(&p, &items);
            assert!(hot_items(&Problem::build(&alone).unwrap()).is_none(), "seed {seed}");
        }
    }

    #[test]
    fn the_skeleton_is_hot_unless_the_area_dominates_or_leads_a_dense_list() {
        let similar_buffers = crate::workload::random_similar_sizes(20_000, 4);
        let similar = Problem::build(&similar_buffers).unwrap();
        let footprint = PlanFor::Footprint;
        let hot = hot_items(&similar).map(|h| (h, true));
        assert_eq!(choose_skeleton(&similar, false, footprint), hot);
        assert!(hot_items(&similar) != skeleton_items(&similar));
        let by_area = skeleton_items(&similar).map(|a| (a, false));
        // Dense: hot where the hot items are fewer and of distinct sizes.
        let (hot_len, area_len) = (hot.as_ref().unwrap().0.len(), by_area.as_ref().unwrap().0.len());
        assert!(hot_len < area_len, "{hot_len} hot, {area_len} by area");
        assert!(sizes_distinct(&similar, &hot.as_ref().unwrap().0));
        assert_eq!(choose_skeleton(&similar, true, footprint), hot);
        // The same list with sizes rounded to 64 KiB (17 sizes): by area where dense.
        let rounded: Vec<Buffer> =
            similar_buffers.iter().map(|b| Buffer { size: b.size >> 16 << 16, ..*b }).collect();
        let rounded = Problem::build(&rounded).unwrap();
        assert!(!sizes_distinct(&rounded, &hot_items(&rounded).unwrap()));
        assert_eq!(choose_skeleton(&rounded, true, footprint), skeleton_items(&rounded).map(|a| (a, false)));
        assert_eq!(choose_skeleton(&rounded, false, footprint), hot_items(&rounded).map(|h| (h, true)));
        // A few long-lived items hold the area: by area where dense.
        let long = Problem::build(&crate::workload::random_long_short(20_000, 1)).unwrap();
        let by_area_long = skeleton_items(&long).expect("a skeleton");
        assert!(hot_items(&long).is_none_or(|h| h.len() >= by_area_long.len()));
        assert_eq!(choose_skeleton(&long, true, footprint), Some((by_area_long, false)));
        assert_eq!(choose_skeleton(&similar, false, PlanFor::Fill), by_area, "a skeleton's own plan");
        assert_eq!(choose_skeleton(&similar, false, PlanFor::HotFill), by_area, "a hot skeleton's own plan");
        // Two populations: the large long-lived buffers hold 99% of the area.
        let bimodal = Problem::build(&crate::workload::random_bimodal(20_000, 4)).unwrap();
        let by_area = skeleton_items(&bimodal).expect("a skeleton");
        assert!(area_share(&bimodal, &by_area) >= DOMINANT_AREA);
        assert_eq!(choose_skeleton(&bimodal, false, footprint), Some((by_area, false)));
        // Equal sizes and lifetimes, live evenly: every item is hot, and none holds more area.
        let even: Vec<Buffer> = (0..5000)
            .map(|i| Buffer { start: i * 7 % 1000, end: i * 7 % 1000 + 10, size: 4096, group: None })
            .collect();
        assert_eq!(choose_skeleton(&Problem::build(&even).unwrap(), false, footprint), None);
    }

    #[test]
    fn sizes_are_distinct_where_half_the_items_have_a_size_of_their_own() {
        let distinct = |sizes: &[u64]| {
            let p = Problem::of_sizes(sizes);
            sizes_distinct(&p, &(0..p.len() as u32).collect::<Vec<_>>())
        };
        // Two of four alone (5 and 9; 7 twice): distinct.
        assert!(distinct(&[7, 5, 7, 9]));
        // One of four alone: not.
        assert!(!distinct(&[7, 7, 5, 7]));
        assert!(!distinct(&[3, 3, 3, 3, 1, 1]));
        assert!(distinct(&[1, 2, 3]));
    }

    #[test]
    fn layered_placements_are_valid_and_keep_the_skeleton() {
        let b = crate::workload::random(6_000, 5);
        let p = Problem::build(&b).unwrap();
        let items = skeleton_items(&p).unwrap();
        let opts = PlaceOptions { threads: 1, ..PlaceOptions::default() };
        let mut sk =
            plan_skeleton(&p, items, Duration::from_millis(30), &opts, PlanFor::Fill, Vec::new()).unwrap();
        for (parts, tiered) in [(1, false), (2, false), (8, false), (1, true), (2, true)] {
            sk.tail = if tiered { tail_items(&p, &sk.items) } else { Vec::new() };
            let (off, high) = layered_now(&p, &sk, parts, far()).unwrap();
            let offsets: Vec<u64> = p.item_of.iter().map(|&i| off[i as usize]).collect();
            verify(&b, &offsets).unwrap();
            assert_eq!(high, (0..p.len()).map(|i| off[i] + p.size[i]).max().unwrap());
            for (k, &i) in sk.items.iter().enumerate() {
                assert_eq!(off[i as usize], sk.off[k]);
            }
        }
        let past = Instant::now().checked_sub(Duration::from_millis(1)).unwrap();
        assert!(layered_now(&p, &sk, 2, past).is_none(), "stopped at once");
    }

    /// Beside the skeleton's plan, the whole list is placed by the aligned construction: both
    /// come back, the construction valid and the skeleton's plan a placement of its items.
    #[test]
    fn the_aligned_construction_runs_beside_the_skeleton() {
        let b = crate::workload::random_long_short(20_000, 1);
        let (p, items, tail) = tiers_of(&b);
        let opts = PlaceOptions { threads: 2, ..PlaceOptions::default() };
        let (sk, whole) =
            skeleton_beside_aligned(&p, items.clone(), Duration::from_millis(50), &opts, tail.clone(), far());
        let (off, high) = whole.expect("nothing stopped the aligned construction");
        let offsets: Vec<u64> = p.item_of.iter().map(|&i| off[i as usize]).collect();
        verify(&b, &offsets).unwrap();
        assert_eq!(high, (0..b.len()).map(|i| offsets[i] + b[i].size).max().unwrap());
        assert!(high >= p.lower_bound());
        let sk = sk.expect("the skeleton was planned");
        assert_eq!(sk.items, items);
        assert_eq!(sk.tail, tail);
        let skeleton: Vec<Buffer> = items.iter().map(|&i| b[i as usize]).collect();
        verify(&skeleton, &sk.off).unwrap();
        // Stopped at once, the construction gives nothing and the skeleton still comes back.
        let (sk, whole) =
            skeleton_beside_aligned(&p, items, Duration::from_millis(5), &opts, tail, Instant::now());
        assert!(whole.is_none());
        assert!(sk.is_some());
    }

    /// A tiered skeleton gets what its fill leaves with the margin, up to the usual share, and
    /// none below the least share worth it.
    #[test]
    fn a_tiered_skeleton_gets_what_its_fill_leaves() {
        let ms = Duration::from_millis;
        let near = |share: Option<f64>, want: f64| share.is_some_and(|s| (s - want).abs() < 1e-9);
        assert_eq!(tiered_share(ms(1000), ms(100), ms(200)), Some(SKELETON_BUDGET));
        assert!(near(tiered_share(ms(1000), ms(100), ms(500)), 0.15));
        assert!(near(tiered_share(ms(1000), ms(140), ms(500)), 0.11));
        assert_eq!(tiered_share(ms(1000), ms(160), ms(500)), None, "less than the least share");
        assert_eq!(tiered_share(ms(1000), ms(900), ms(500)), None);
        assert_eq!(tiered_share(ms(0), ms(0), ms(0)), None);
    }

    /// A tiered construction leaves to the sweep the many items that hold the last
    /// `1 − TIERED_FILL_AREA` of the area (on dense lists most of the items), and no item left
    /// to it holds more area than one the greedy fill places.
    #[test]
    fn tiers_leave_the_smallest_areas_to_the_sweep() {
        let b = crate::workload::random_dense(20_000, 2);
        let (p, items, tail) = tiers_of(&b);
        let fill = fill_items(&p, &items, &tail);
        assert_eq!(items.len() + fill.len() + tail.len(), p.len());
        assert!(tail.len() * 2 > p.len(), "{} of {} items in the tail", tail.len(), p.len());
        let area = |i: u32| p.size[i as usize] as f64 * p.life[i as usize] as f64;
        let total: f64 = (0..p.len() as u32).map(area).sum();
        let held: f64 = items.iter().chain(&fill).map(|&i| area(i)).sum();
        assert!(held >= TIERED_FILL_AREA * total);
        let least = fill.iter().map(|&i| area(i)).fold(f64::INFINITY, f64::min);
        assert!(tail.iter().all(|&i| area(i) <= least));
        assert_eq!(fill_items(&p, &items, &[]).len(), fill.len() + tail.len());
    }

    /// Where the areas fall off a cliff (a population of large, long-lived items beside small,
    /// short-lived ones), the skeleton takes the whole large population; where they do not
    /// (log-uniform sizes and lifetimes), it holds just [`SKELETON_AREA`] of the area.
    #[test]
    fn natural_breaks_keep_a_population_together() {
        let b = crate::workload::random_bimodal(10_000, 1);
        let p = Problem::build(&b).unwrap();
        let items = skeleton_items(&p).unwrap();
        let large = (0..p.len()).filter(|&i| p.size[i] >= 64 << 20).count();
        assert_eq!(items.len(), large, "the skeleton is the large population");
        assert!(items.iter().all(|&i| p.size[i as usize] >= 64 << 20));
        let total: f64 = (0..p.len() as u32).map(|i| area(&p, i)).sum();
        let prefix: f64 = items.iter().map(|&i| area(&p, i)).sum();
        assert!(prefix > 0.99 * total, "the break lies beyond {SKELETON_AREA} of the area");
        // Such a skeleton is dominant: its plan gets what the fill leaves, within limits.
        assert!(area_share(&p, &items) >= DOMINANT_AREA);
        assert_eq!(dominant_share(0.6), 0.6);
        assert_eq!(dominant_share(0.95), DOMINANT_SKELETON_BUDGET);
        assert_eq!(dominant_share(0.1), SKELETON_BUDGET);
        let b = crate::workload::random(10_000, 1);
        let p = Problem::build(&b).unwrap();
        let items = skeleton_items(&p).unwrap();
        let total: f64 = (0..p.len() as u32).map(|i| area(&p, i)).sum();
        let held: f64 = items.iter().map(|&i| area(&p, i)).sum();
        let last = area(&p, *items.last().unwrap());
        assert!(held >= SKELETON_AREA * total && held - last < SKELETON_AREA * total);
        assert!(area_share(&p, &items) < DOMINANT_AREA, "not dominant");
    }
}
