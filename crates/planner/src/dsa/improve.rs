//! The time-boxed improvement stage: windows of the clock around an item at the top taken
//! out and re-placed with perturbed orders, skyline re-packs of a window's top on its
//! floor, and ejection moves (the item at the top moved down, the items in its way
//! re-placed); each kept when the moved items' top does not rise.

use super::*;
use crate::until::Until;

#[derive(Debug, Default)]
pub(super) struct ImproveStats {
    pub(super) steps: u64,
    pub(super) improved: bool,
    /// Kicks made (see [`KICK_AFTER`]).
    pub(super) kicks: u64,
    /// The lowest top the chain reached: that of the placement it leaves.
    pub(super) high: u64,
}

/// Scratch space of [`repack`].
#[derive(Default)]
pub(super) struct Repack {
    pub(super) taken: Marks,
    pub(super) window: Vec<u32>,
    pub(super) times: Vec<u32>,
    pub(super) floor: Vec<u64>,
    pub(super) ents: Vec<(u64, u32, u32)>,
    pub(super) next: Vec<u32>,
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
pub(super) fn repack<'a>(
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
    rp.taken.clear(p.len());
    rp.window.clear();
    {
        let (taken, window) = (&mut rp.taken, &mut rp.window);
        index.for_each(t0, t1, |en| {
            let i = en.item as usize;
            if taken.mark(i) {
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

/// Candidate offsets an ejection move weighs (see [`eject`]).
pub(super) const EJECT_CANDIDATES: usize = 16;
/// Share of the improvement steps that are ejection moves, in percent: one costs tens of
/// microseconds, a window re-placement up to a millisecond, so at this share the windows
/// still take most of the time. Lists with alias groups too (schedules whose layers have
/// several inputs: excess over the bound summed over the misses of 300 schedules 0.31 →
/// 0.25; lists half in alias groups, 10k, six seeds: mean 1.1918 → 1.1833).
pub(super) const EJECT_PERCENT: u64 = 95;
/// Steps without a lower top (highest byte, then how many items reach it) after which the
/// improvement stage *kicks* a list with alias groups: one window re-placement is kept
/// however high it ends, and the chain climbs down again from there; the lowest placement
/// seen is the result. Chains on schedules whose groups span the clock settle in a local
/// optimum that sideways moves do not leave (docs/planner.md, "Layers of several inputs
/// and outputs").
pub(super) const KICK_AFTER: u64 = 100;
/// Most items of a list that is kicked: on lists of 100k buffers half in alias groups the
/// chains make a few thousand steps in all, and kicks there cost more than they found.
pub(super) const KICK_MAX_ITEMS: usize = 4096;
/// Items of an ejection move that may go down in turn when they would reach above the top
/// (see [`eject`]).
pub(super) const EJECT_CHAIN: u32 = 3;

/// Scratch space of [`eject`].
#[derive(Default)]
pub(super) struct Eject {
    near: Vec<(u64, u64, u32)>,
    way: Vec<u32>,
    pending: Vec<u32>,
    moved: Vec<(u32, u64)>,
    out: Vec<u32>,
    /// The items the move has taken out.
    taken: Marks,
    /// The neighbours already met (items of several intervals).
    seen: Marks,
}

/// Moves the elements of `v` for which `pred` holds to its front; returns how many.
fn partition_front<T>(v: &mut [T], pred: impl Fn(&T) -> bool) -> usize {
    let mut k = 0;
    for j in 0..v.len() {
        if pred(&v[j]) {
            v.swap(k, j);
            k += 1;
        }
    }
    k
}

/// Where item `i` (one interval) could go below `limit`: of [`EJECT_CANDIDATES`] offsets
/// where an item live with it below `limit` starts or ends, the one whose way holds the
/// least area (bytes × lifetime: long-lived items are the hard ones to re-place) and no item
/// this move has already taken out; the items in its way are left in `ej.way`.
fn eject_target(
    p: &Problem,
    index: &Index,
    i: usize,
    limit: u64,
    rng: &mut Rng,
    ej: &mut Eject,
) -> Option<u64> {
    let size = p.size[i];
    if limit == 0 {
        return None;
    }
    // Candidates come from the items below `limit`; the way at one may reach up to
    // `limit - 1 + size`. Those below `limit` first. Each neighbour once, however many of
    // an alias group's intervals it meets.
    ej.near.clear();
    let Eject { near, seen, .. } = ej;
    index.for_each_neighbour(p, i, seen, |en| {
        if en.item as usize != i && en.off < limit - 1 + size {
            near.push((en.off, en.top, en.item));
        }
    });
    let below = partition_front(&mut ej.near, |&(o, _, _)| o < limit);
    if below == 0 {
        return None;
    }
    let mut best: Option<(f64, u64)> = None;
    for _ in 0..EJECT_CANDIDATES {
        let (o, t, _) = ej.near[rng.below(below as u64) as usize];
        let cand = if rng.below(2) == 0 { o } else { t.min(limit - 1) };
        let mut cost = 0.0;
        for &(o, t, j) in &ej.near {
            if o < cand + size && t > cand {
                if ej.taken.marked(j as usize) {
                    cost = f64::INFINITY;
                    break;
                }
                cost += p.size[j as usize] as f64 * p.life[j as usize] as f64;
            }
        }
        if cost.is_finite() && best.is_none_or(|(c, _)| cost < c) {
            best = Some((cost, cand));
        }
    }
    let (_, y) = best?;
    ej.way.clear();
    for &(o, t, j) in &ej.near {
        if o < y + size && t > y {
            ej.way.push(j);
        }
    }
    Some(y)
}

/// An ejection move (improvement stage): the item `c` at the top goes down to an offset
/// where an item live with it below starts or ends — of [`EJECT_CANDIDATES`] drawn, the one
/// with the least area in its way — the items in its way there are taken out and re-placed
/// one by one by a greedy fit, largest or longest-lived first (sometimes with noise); one
/// that would reach above the items' top before the move may in turn go down by the same
/// rule, taking out the items in its way (at most [`EJECT_CHAIN`] times a move). Kept when
/// the items moved reach no higher (then no more of them to the top) than before, as the
/// window moves are. Returns the items that moved when kept.
#[allow(clippy::too_many_arguments)]
pub(super) fn eject<'a>(
    p: &Problem,
    index: &mut Index,
    off: &mut [u64],
    c: usize,
    deadline: Instant,
    rng: &mut Rng,
    scratch: &mut FindScratch,
    ej: &'a mut Eject,
) -> Option<&'a [u32]> {
    ej.taken.clear(p.len());
    let y = eject_target(p, index, c, off[c], rng, ej)?;
    let noise = [0.0, 0.1, 0.5][rng.below(3) as usize];
    let order = if rng.below(2) == 0 { Order::Size } else { Order::Lifetime };
    let fit = if rng.below(2) == 0 { Fit::BestFit } else { Fit::LowestOffset };
    let mut before = Reach::default();
    let mut after = Reach::default();
    ej.pending.clear();
    ej.moved.clear();
    ej.out.clear();
    // Takes the items in `ej.way` out of the index (to `pending`, in the move's order).
    fn take_way(
        p: &Problem,
        index: &mut Index,
        off: &[u64],
        before: &mut Reach,
        ej: &mut Eject,
        noise: f64,
        order: Order,
        rng: &mut Rng,
    ) {
        let from = ej.pending.len();
        for k in 0..ej.way.len() {
            let j = ej.way[k];
            ej.taken.mark(j as usize);
            ej.out.push(j);
            before.add(off[j as usize] + p.size[j as usize]);
            index.remove(p, j as usize, off[j as usize]);
            ej.pending.push(j);
        }
        sort_items(p, &mut ej.pending[from..], order, noise, rng);
    }
    ej.taken.mark(c);
    ej.out.push(c as u32);
    before.add(off[c] + p.size[c]);
    take_way(p, index, off, &mut before, ej, noise, order, rng);
    index.remove(p, c, off[c]);
    index.insert(p, c, y);
    ej.moved.push((c as u32, y));
    after.add(y + p.size[c]);
    let mut chains = EJECT_CHAIN;
    let mut k = 0;
    let mut failed = false;
    while k < ej.pending.len() {
        let i = ej.pending[k] as usize;
        k += 1;
        let mut o = index.find(p, i, fit, scratch);
        if o + p.size[i] > before.high && chains > 0 && before.high >= p.size[i] {
            let limit = before.high - p.size[i] + 1;
            if let Some(y) = eject_target(p, index, i, limit, rng, ej) {
                chains -= 1;
                take_way(p, index, off, &mut before, ej, noise, order, rng);
                o = y;
            }
        }
        index.insert(p, i, o);
        ej.moved.push((i as u32, o));
        after.add(o + p.size[i]);
        // On dense lists one gap query visits thousands of items: check the clock often.
        if after > before || (k % 8 == 0 && Instant::now() > deadline) {
            failed = true;
            break;
        }
    }
    if !failed && after <= before {
        for &(i, o) in &ej.moved {
            off[i as usize] = o;
        }
        return Some(&ej.out);
    }
    for &(i, o) in &ej.moved {
        index.remove(p, i as usize, o);
    }
    for &i in &ej.out {
        index.insert(p, i as usize, off[i as usize]);
    }
    None
}

/// How high a set of items reaches (the improvement stage's acceptance test): the highest
/// top, then how many items reach it. Lower is better; it can only grow as items are added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub(super) struct Reach {
    pub(super) high: u64,
    pub(super) count: u32,
}

impl Reach {
    pub(super) fn add(&mut self, top: u64) {
        if top > self.high {
            self.high = top;
            self.count = 1;
        } else if top == self.high {
            self.count += 1;
        }
    }
}

/// The kicks of one chain (see [`KICK_AFTER`]): the lowest top (highest byte, then items
/// reaching it) seen, and from the first kick on the placement that reached it (until then
/// every step keeps or lowers the placement, so the chain's own is that one).
struct Kicks {
    best: Reach,
    best_off: Option<Vec<u64>>,
    since_best: u64,
    reaching: Vec<u32>,
    made: u64,
}

impl Kicks {
    fn new(tops: &Tops) -> Kicks {
        let mut reaching = Vec::new();
        tops.reaching(tops.high(), &mut reaching);
        let best = Reach { high: tops.high(), count: reaching.len() as u32 };
        Kicks { best, best_off: None, since_best: 0, reaching, made: 0 }
    }

    /// Before each step, with the chain's placement `off` and its tops: whether the step is
    /// a kick ([`KICK_AFTER`] steps without a lower top).
    fn due(&mut self, tops: &Tops, off: &[u64]) -> bool {
        self.since_best += 1;
        tops.reaching(tops.high(), &mut self.reaching);
        let now = Reach { high: tops.high(), count: self.reaching.len() as u32 };
        if now < self.best {
            self.best = now;
            self.since_best = 0;
            if let Some(b) = &mut self.best_off {
                b.copy_from_slice(off);
            }
        }
        if self.since_best <= KICK_AFTER {
            return false;
        }
        self.since_best = 0;
        self.made += 1;
        self.best_off.get_or_insert_with(|| off.to_vec());
        true
    }

    /// The chain is done at `high`: leaves in `off` the lowest placement it reached, and
    /// returns its top.
    fn finish(self, off: &mut [u64], high: u64) -> u64 {
        match self.best_off {
            Some(b) if self.best.high < high => {
                off.copy_from_slice(&b);
                self.best.high
            }
            _ => high,
        }
    }
}

/// Items a window of the improvement stage holds at most, about (see `improve`).
pub(super) const WINDOW_ITEMS: u64 = 4096;
/// Placed items one window re-placement may visit, about (see `improve`).
pub(super) const WINDOW_WORK: u64 = 1_000_000;

/// The items' tops in a tree of maxima: the highest top, and the items that reach it,
/// without a scan of every item each time the top comes down (at 100k items that scan
/// took a fifth of the improvement stage: the highest item moves nearly every step).
struct Tops {
    /// Leaves from `leaves` on (one per item, 0 beyond them); node `k` holds the larger of
    /// `2k` and `2k + 1`.
    tree: Vec<u64>,
    leaves: usize,
    items: usize,
}

impl Tops {
    fn new(tops: impl ExactSizeIterator<Item = u64>) -> Tops {
        let items = tops.len();
        let leaves = items.next_power_of_two();
        let mut tree = vec![0u64; 2 * leaves];
        for (i, t) in tops.enumerate() {
            tree[leaves + i] = t;
        }
        for k in (1..leaves).rev() {
            tree[k] = tree[2 * k].max(tree[2 * k + 1]);
        }
        Tops { tree, leaves, items }
    }

    fn get(&self, i: usize) -> u64 {
        self.tree[self.leaves + i]
    }

    fn set(&mut self, i: usize, top: u64) {
        let mut k = self.leaves + i;
        self.tree[k] = top;
        while k > 1 {
            k /= 2;
            let m = self.tree[2 * k].max(self.tree[2 * k + 1]);
            if self.tree[k] == m {
                break;
            }
            self.tree[k] = m;
        }
    }

    fn high(&self) -> u64 {
        self.tree[1]
    }

    /// Item `i` moved to `top`: set, and added to `crit` (the items at the top) where it
    /// reaches `high`.
    fn moved(&mut self, i: usize, top: u64, high: u64, crit: &mut Vec<u32>) {
        self.set(i, top);
        if top == high {
            crit.push(i as u32);
        }
    }

    /// Replaces `out` with the items whose top is `high` (the highest), in item order.
    fn reaching(&self, high: u64, out: &mut Vec<u32>) {
        out.clear();
        let mut stack = vec![1usize];
        while let Some(k) = stack.pop() {
            if self.tree[k] != high {
                continue;
            }
            if k >= self.leaves {
                if k - self.leaves < self.items {
                    out.push((k - self.leaves) as u32);
                }
            } else {
                stack.push(2 * k + 1);
                stack.push(2 * k);
            }
        }
    }
}

/// The improvement stage from `off` (see the `dsa` module documentation) until `until`
/// passes, the footprint reaches `lb` (then it raises `until`'s flag) or `max_steps` steps
/// are made; `pairs` is [`Problem::overlapping_pairs`].
pub(super) fn improve(
    p: &Problem,
    off: &mut [u64],
    lb: u64,
    pairs: u64,
    until: Until<'_>,
    seed: u64,
    max_steps: u64,
) -> ImproveStats {
    let deadline = until.deadline;
    let n = p.len();
    let mut stats = ImproveStats::default();
    let mut index = Index::with_placed(p, off.iter().copied().enumerate());
    let mut tops = Tops::new((0..n).map(|i| off[i] + p.size[i]));
    let mut high = tops.high();
    let start_high = high;
    let mut crit: Vec<u32> = Vec::new();
    tops.reaching(high, &mut crit);
    let mut rng = Rng::new(seed);
    let span = p.mean_span() as u64;
    // Ranks a window may cover: at the input's arrival rate, as many items as keep one
    // re-placement to about `WINDOW_WORK` visits of placed items (each item's gap query sees
    // the items live with it), at most `WINDOW_ITEMS`: dense inputs with long lifetimes
    // would otherwise spend tens of milliseconds per step.
    let overlap = (2 * pairs / n.max(1) as u64).max(1);
    let items = (WINDOW_WORK / overlap).clamp(64, WINDOW_ITEMS);
    let reach = (items * p.ranks as u64 / n.max(1) as u64).max(64);
    let mut taken = Marks::default();
    let mut window: Vec<u32> = Vec::new();
    let mut crossing: Vec<u32> = Vec::new();
    let mut new_off = vec![0u64; n];
    let mut scratch = FindScratch::default();
    let single = p.ivs.len() == n;
    let mut rp = Repack::default();
    let mut ej = Eject::default();
    let mut kicks = (!single && n <= KICK_MAX_ITEMS).then(|| Kicks::new(&tops));
    while high > lb && stats.steps < max_steps && !until.passed() {
        let kick = kicks.as_mut().is_some_and(|k| k.due(&tops, off));
        // A buffer at the top.
        let c = loop {
            if crit.is_empty() {
                high = tops.high();
                tops.reaching(high, &mut crit);
            }
            let k = rng.below(crit.len() as u64) as usize;
            if tops.get(crit[k] as usize) == high {
                break crit[k] as usize;
            }
            crit.swap_remove(k);
        };
        if high <= lb {
            break;
        }
        stats.steps += 1;
        if !kick && rng.below(100) < EJECT_PERCENT {
            if let Some(kept) = eject(p, &mut index, off, c, deadline, &mut rng, &mut scratch, &mut ej) {
                for &i in kept {
                    tops.moved(i as usize, off[i as usize] + p.size[i as usize], high, &mut crit);
                }
            }
            continue;
        }
        if !kick && single && rng.below(4) == 0 {
            if let Some(kept) =
                repack(p, &mut index, off, high, c, span.min(reach / 8), deadline, &mut rng, &mut rp)
            {
                for &i in kept {
                    tops.moved(i as usize, off[i as usize] + p.size[i as usize], high, &mut crit);
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
        taken.clear(n);
        window.clear();
        window.push(c as u32);
        taken.mark(c);
        crossing.clear();
        index.for_each(t0, t1, |en| {
            let i = en.item as usize;
            if taken.mark(i) {
                let (s, e) = p.hull[i];
                if s >= t0 && e <= t1 {
                    window.push(en.item);
                } else if !single {
                    crossing.push(en.item);
                }
            }
        });
        // Where the items crowd far more densely than on average (tilings with many pieces
        // per clock step), the window keeps only the items nearest to the one at the top:
        // any subset can be re-placed around the others, and a window of 25k items cost
        // 30-90 ms to take out and sort, past the deadline.
        let most = 2 * items as usize;
        if window.len() > most {
            let mid = |i: u32| p.hull[i as usize].0 as u64 + p.hull[i as usize].1 as u64;
            let at = mid(c as u32);
            window[1..].select_nth_unstable_by_key(most - 2, |&i| mid(i).abs_diff(at));
            window.truncate(most);
        }
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
            if (after > before && !kick) || (placed % 64 == 0 && until.passed()) {
                after.high = u64::MAX;
                break;
            }
        }
        if after <= before || (kick && after.high != u64::MAX) {
            for &i in &window {
                let i = i as usize;
                off[i] = new_off[i];
                tops.moved(i, off[i] + p.size[i], high, &mut crit);
            }
            if kick {
                high = tops.high();
                tops.reaching(high, &mut crit);
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
    let final_high = match kicks {
        Some(k) => {
            stats.kicks = k.made;
            k.finish(off, tops.high())
        }
        None => tops.high(),
    };
    stats.high = final_high;
    stats.improved = final_high < start_high;
    if final_high <= lb {
        until.raise();
    }
    stats
}

/// The improvement stage until `until` passes: independent chains (one per core, different
/// seeds) from the same start — every other one from the placement set aside, if any —, all
/// stopping once one reaches `lb`; the lowest result (or placement set aside) is kept (the
/// search's outcome varies a lot between seeds). Returns the steps of all chains.
pub(super) fn improvement_chains(
    p: &Problem,
    lb: u64,
    pairs: u64,
    until: Until<'_>,
    seed: u64,
    threads: usize,
    best: &mut Incumbent,
) -> u64 {
    let n = p.len();
    let chains = workers_for(threads.clamp(1, 8), until.deadline.saturating_duration_since(Instant::now()));
    // Where the stages went on from a construction above a lower placement set aside
    // (`Incumbent::start_from`), every other chain starts from that placement: which of the
    // two ends lower varies (a construction around a hot skeleton came out at 1.07 on 2
    // cores and 1.13 on 16 for one list), and on 2 cores one chain from each ended as low as
    // two from the construction (100k, seeds 1-20: similar sizes 1.017, uniform sizes 1.012
    // against 1.014, heavy-tailed 1.003 against 1.0045).
    let aside = best.aside.take();
    let starts: Vec<&Incumbent> = std::iter::once(&*best).chain(aside.as_deref()).collect();
    let results: Vec<(usize, Vec<u64>, ImproveStats)> = run_workers(chains, |k| {
        let from = k % starts.len();
        let mut off = starts[from].off.clone();
        let seed = seed.wrapping_add((k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let stats = improve(p, &mut off, lb, pairs, until, seed, u64::MAX);
        (from, off, stats)
    });
    let names: Vec<String> = starts.iter().map(|s| s.strategy.clone()).collect();
    if let Some(aside) = aside {
        best.offer(aside.high, aside.off, aside.strategy);
    }
    let mut steps = 0;
    for (from, off, stats) in results {
        steps += stats.steps;
        let high = (0..n).map(|i| off[i] + p.size[i]).max().unwrap_or(0);
        if stats.improved && high < best.high {
            best.high = high;
            best.off = off;
            best.strategy = names[from].clone();
            if !best.strategy.ends_with("+improved") {
                best.strategy.push_str("+improved");
            }
        }
    }
    steps
}

/// Improvement steps, for benchmarks: a list placed by the online best fit, from which
/// [`ImprovementSteps::run`] makes a fixed number of the improvement stage's steps.
pub struct ImprovementSteps {
    p: Problem,
    off: Vec<u64>,
    lb: u64,
    pairs: u64,
}

impl std::fmt::Debug for ImprovementSteps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImprovementSteps").field("items", &self.p.len()).finish_non_exhaustive()
    }
}

impl ImprovementSteps {
    /// `buffers` placed by the online best fit.
    pub fn new(buffers: &[Buffer]) -> Result<ImprovementSteps, PlaceError> {
        let p = Problem::build(buffers)?;
        let (off, _) = online_best_fit(&p);
        let (lb, pairs) = (p.lower_bound(), p.overlapping_pairs());
        Ok(ImprovementSteps { p, off, lb, pairs })
    }

    /// `steps` steps of the improvement stage (fewer where it reaches the lower bound) from
    /// the online placement, with the moves drawn from `seed`. Returns the footprint
    /// reached; the same for a seed on every run.
    pub fn run(&self, steps: u64, seed: u64) -> u64 {
        let mut off = self.off.clone();
        let far = Instant::now() + std::time::Duration::from_secs(3600);
        improve(&self.p, &mut off, self.lb, self.pairs, Until::at(far), seed, steps);
        (0..self.p.len()).map(|i| off[i] + self.p.size[i]).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod move_tests {
    use super::*;
    use crate::rng::Rng;
    use proptest::prelude::{ProptestConfig, Strategy as _, prop, proptest};

    /// Runs `moves` improvement moves from the online best fit of `b`, each made by `make`
    /// on a random item at the top (given the problem, the index, the offsets, the top, the
    /// item and a generator; it returns the items it moved, `None` when not kept). After
    /// every move the placement is valid and no higher than before, offsets change only for
    /// the items reported (none when the move is not kept), and every so often the index
    /// finds the same gaps as one built afresh. Returns how many moves were kept.
    fn drive(
        b: &[Buffer],
        moves: usize,
        seed: u64,
        mut make: impl FnMut(&Problem, &mut Index, &mut [u64], u64, usize, &mut Rng) -> Option<Vec<u32>>,
    ) -> usize {
        let p = Problem::build(b).unwrap();
        if p.len() == 0 {
            return 0;
        }
        let (mut off, mut high) = online_best_fit(&p);
        let mut index = Index::with_placed(&p, off.iter().copied().enumerate());
        let mut rng = Rng::new(seed);
        let mut kept = 0;
        for step in 0..moves {
            let tops: Vec<usize> = (0..p.len()).filter(|&i| off[i] + p.size[i] == high).collect();
            let c = tops[rng.below(tops.len() as u64) as usize];
            let before = off.clone();
            match make(&p, &mut index, &mut off, high, c, &mut rng) {
                Some(moved) => {
                    kept += 1;
                    for i in 0..p.len() {
                        assert!(
                            off[i] == before[i] || moved.contains(&(i as u32)),
                            "item {i} moved unreported"
                        );
                    }
                }
                None => assert_eq!(off, before, "a move not kept changed offsets"),
            }
            let offsets: Vec<u64> =
                p.item_of.iter().map(|&i| if i == u32::MAX { 0 } else { off[i as usize] }).collect();
            verify(b, &offsets).unwrap();
            if step % 20 == 0 || step + 1 == moves {
                let fresh = Index::with_placed(&p, off.iter().copied().enumerate());
                let (mut s1, mut s2) = (FindScratch::default(), FindScratch::default());
                for i in (0..p.len()).step_by(7) {
                    assert_eq!(
                        index.find(&p, i, Fit::LowestOffset, &mut s1),
                        fresh.find(&p, i, Fit::LowestOffset, &mut s2)
                    );
                }
            }
            let now = (0..p.len()).map(|i| off[i] + p.size[i]).max().unwrap_or(0);
            assert!(now <= high, "a move raised the footprint: {now} > {high}");
            high = now;
        }
        kept
    }

    /// Skyline re-packs of a window's top ([`repack`]; items of one interval).
    fn repacks(b: &[Buffer], moves: usize, seed: u64) -> usize {
        let mut rp = Repack::default();
        let deadline = Instant::now() + Duration::from_secs(60);
        if b.iter().any(|x| x.group.is_some()) {
            return 0;
        }
        drive(b, moves, seed, |p, index, off, high, c, rng| {
            let span = p.mean_span() as u64;
            repack(p, index, off, high, c, span, deadline, rng, &mut rp).map(<[u32]>::to_vec)
        })
    }

    /// Ejection moves and chains ([`eject`]); the item at the top is among those moved.
    fn ejections(b: &[Buffer], moves: usize, seed: u64) -> usize {
        let (mut scratch, mut ej) = (FindScratch::default(), Eject::default());
        let deadline = Instant::now() + Duration::from_secs(60);
        drive(b, moves, seed, |p, index, off, _, c, rng| {
            let moved = eject(p, index, off, c, deadline, rng, &mut scratch, &mut ej)?.to_vec();
            assert!(moved.contains(&(c as u32)), "the item at the top is among those moved");
            Some(moved)
        })
    }

    /// The tree of tops answers as a scan of every item does, through random updates.
    #[test]
    fn the_tree_of_tops_finds_the_highest_and_every_item_reaching_it() {
        let mut rng = Rng::new(5);
        for n in [1usize, 2, 3, 7, 64, 100] {
            let mut top: Vec<u64> = (0..n).map(|_| rng.below(8)).collect();
            let mut tops = Tops::new(top.iter().copied());
            let mut crit = Vec::new();
            for _ in 0..200 {
                let high = top.iter().copied().max().unwrap_or(0);
                assert_eq!(tops.high(), high);
                tops.reaching(high, &mut crit);
                let scan: Vec<u32> = (0..n as u32).filter(|&i| top[i as usize] == high).collect();
                assert_eq!(crit, scan);
                let i = rng.below(n as u64) as usize;
                top[i] = rng.below(8);
                tops.set(i, top[i]);
                assert_eq!(tops.get(i), top[i]);
            }
        }
    }

    /// Ejection moves on lists with alias groups (items of several intervals, each meeting
    /// some neighbours in several of them): a pipeline schedule's buffers, and lists half in
    /// groups.
    #[test]
    fn ejections_keep_placements_with_alias_groups_valid() {
        let schedule =
            crate::Schedule::Interleaved { pp_size: 4, pp_rank: 1, num_microbatches: 8, virtual_chunks: 2 };
        let input = crate::SchedulePlanInput {
            schedule,
            layers: crate::pipeline::varied_layers(2, 2, 2048, 1, 2048, 3),
        };
        let pipeline = crate::pipeline::schedule_buffers(&input).expect("valid schedule").buffers;
        let mut ejected = ejections(&pipeline, 200, 1);
        for seed in 1..=3 {
            ejected += ejections(&crate::workload::random_grouped(2000, seed), 200, seed);
        }
        assert!(ejected > 0, "no ejection was kept: the test checks nothing");
    }

    /// Runs the improvement stage for `steps` steps on `b` from its online best fit, and
    /// checks the result: valid, the lowest placement the chain reached (whatever the kicks
    /// did after it) and so no higher than the start. Returns the kicks made.
    fn improved_with_kicks(b: &[Buffer], steps: u64, seed: u64) -> u64 {
        let p = Problem::build(b).unwrap();
        if p.len() == 0 {
            return 0;
        }
        let (mut off, high) = online_best_fit(&p);
        let far = Instant::now() + Duration::from_secs(60);
        let stats =
            improve(&p, &mut off, p.lower_bound(), p.overlapping_pairs(), Until::at(far), seed, steps);
        let offsets: Vec<u64> =
            p.item_of.iter().map(|&i| if i == u32::MAX { 0 } else { off[i as usize] }).collect();
        verify(b, &offsets).unwrap();
        let top = (0..p.len()).map(|i| off[i] + p.size[i]).max().unwrap_or(0);
        assert_eq!(top, stats.high, "the placement left is not the lowest the chain reached");
        assert!(top <= high, "the stage ended above its start: {top} > {high}");
        stats.kicks
    }

    /// Kicks on lists with alias groups end at the lowest placement seen: pipeline
    /// schedules and small lists half in groups.
    #[test]
    fn kicked_chains_end_valid_and_no_higher_than_they_started() {
        let mut kicks = 0;
        for (seed, rank) in [(1, 0), (2, 1), (3, 3)] {
            let schedule = crate::Schedule::Interleaved {
                pp_size: 4,
                pp_rank: rank,
                num_microbatches: 8,
                virtual_chunks: 2,
            };
            let input = crate::SchedulePlanInput {
                schedule,
                layers: crate::pipeline::varied_layers(2, 3, 2048, 1, 2048, seed),
            };
            let pipeline = crate::pipeline::schedule_buffers(&input).expect("valid schedule").buffers;
            kicks += improved_with_kicks(&pipeline, 3000, seed);
            kicks += improved_with_kicks(&crate::workload::random_grouped(600, seed), 3000, seed);
        }
        assert!(kicks > 0, "no chain was kicked: the test checks nothing");
    }

    /// Small random lists with alias groups for the property tests: groups 0..4 shared, the
    /// other buffers alone.
    fn small_grouped_lists() -> impl proptest::strategy::Strategy<Value = Vec<Buffer>> {
        prop::collection::vec((0u64..40, 1u64..12, 1u64..9, 0u32..12), 1..60).prop_map(|raw| {
            raw.into_iter()
                .map(|(start, life, size, g)| Buffer {
                    start,
                    end: start + life,
                    size,
                    group: (g < 4).then_some(g),
                })
                .collect()
        })
    }

    /// Small random lists for the property tests.
    fn small_lists() -> impl proptest::strategy::Strategy<Value = Vec<Buffer>> {
        prop::collection::vec((0u64..40, 1u64..12, 1u64..9), 1..60).prop_map(|raw| {
            raw.into_iter()
                .map(|(start, life, size)| Buffer { start, end: start + life, size, group: None })
                .collect()
        })
    }

    #[test]
    fn moves_keep_random_placements_valid() {
        let (mut repacked, mut ejected) = (0, 0);
        for seed in 1..=3 {
            repacked += repacks(&crate::workload::random(2000, seed), 300, seed);
            repacked += repacks(&crate::workload::random_uniform(2000, seed), 300, seed);
            ejected += ejections(&crate::workload::random_uniform_sizes(2000, seed), 300, seed);
            ejected += ejections(&crate::workload::random(2000, seed), 300, seed);
        }
        assert!(repacked > 0, "no re-pack was kept: the test checks nothing");
        assert!(ejected > 0, "no ejection was kept: the test checks nothing");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn repacks_keep_small_placements_valid(b in small_lists(), seed in 0u64..1000) {
            repacks(&b, 40, seed);
        }

        #[test]
        fn ejections_keep_small_placements_valid(b in small_lists(), seed in 0u64..1000) {
            ejections(&b, 40, seed);
        }

        #[test]
        fn ejections_keep_small_grouped_placements_valid(b in small_grouped_lists(), seed in 0u64..1000) {
            ejections(&b, 40, seed);
        }

        #[test]
        fn kicked_chains_keep_small_grouped_placements_valid(b in small_grouped_lists(), seed in 0u64..1000) {
            improved_with_kicks(&b, 600, seed);
        }
    }
}
