//! Fixed-height contour search (in the style of TelaMalloc): place single-interval items
//! bottom-up into a skyline under a target height `H`, backtracking on failure.
//!
//! The state is the skyline (highest placed byte at every clock rank) and, per rank, the
//! **slack** `H − skyline(t) − Σ sizes of unplaced items live at t`. Placing an item on the
//! skyline leaves the slack unchanged (the skyline rises by its size and the unplaced load
//! falls by it); only *raising* a valley that nothing fills wastes bytes and spends slack.
//! Every state with non-negative slack everywhere can still fit each unplaced item under
//! `H` in its own column, and a raise that would make some slack negative is refused — the
//! search backtracks instead.
//!
//! Each step takes the lowest valley `[a, b)` of the skyline (leftmost on ties) at height
//! `h`; the alternatives are the items that start at the earliest start in `[a, b)` having
//! an unplaced item that ends by `b` (placed at `h`; identical items are tried once), in
//! the order of the skyline's best-fit rule (ends at `b`, top meets a neighbour, larger
//! first), and then raising the valley to its lower neighbour. On an instance without slack
//! (optimum = live bound) the item covering the valley's first byte must start at `a`, so
//! these alternatives lose nothing there; otherwise it is a heuristic search. A new drop
//! of the skyline at a rank without slack must be filled by an item starting exactly there
//! (checked at once, not when the valley becomes the lowest).
//!
//! A dead end (no alternative left) backjumps to the latest decision that changed a rank
//! next to the conflict (skipping the decisions in between, so the search is not
//! exhaustive); after a budget of backtracks the attempt restarts with randomised orders
//! and a 1.5× budget, until the deadline. Everything is deterministic for a seed except
//! where the deadline stops it.

use std::time::Instant;

use crate::items::Items;
use crate::rng::Rng;

const NONE: u64 = u64::MAX;

/// Skyline heights over ranks: range assignment, min and max.
struct SkyTree {
    n: usize,
    mn: Vec<u64>,
    mx: Vec<u64>,
    lz: Vec<u64>,
}

impl SkyTree {
    fn new(n: usize) -> SkyTree {
        SkyTree { n, mn: vec![0; 4 * n], mx: vec![0; 4 * n], lz: vec![NONE; 4 * n] }
    }

    fn apply(&mut self, k: usize, v: u64) {
        self.mn[k] = v;
        self.mx[k] = v;
        self.lz[k] = v;
    }

    fn push(&mut self, k: usize) {
        if self.lz[k] != NONE {
            let v = self.lz[k];
            self.apply(2 * k, v);
            self.apply(2 * k + 1, v);
            self.lz[k] = NONE;
        }
    }

    fn assign(&mut self, l: usize, r: usize, v: u64) {
        self.assign_rec(1, 0, self.n, l, r, v);
    }

    fn assign_rec(&mut self, k: usize, kl: usize, kr: usize, l: usize, r: usize, v: u64) {
        if r <= kl || kr <= l {
            return;
        }
        if l <= kl && kr <= r {
            self.apply(k, v);
            return;
        }
        self.push(k);
        let m = (kl + kr) / 2;
        self.assign_rec(2 * k, kl, m, l, r, v);
        self.assign_rec(2 * k + 1, m, kr, l, r, v);
        self.mn[k] = self.mn[2 * k].min(self.mn[2 * k + 1]);
        self.mx[k] = self.mx[2 * k].max(self.mx[2 * k + 1]);
    }

    fn point(&self, i: usize) -> u64 {
        let (mut k, mut kl, mut kr) = (1, 0, self.n);
        loop {
            if self.lz[k] != NONE || kr - kl == 1 {
                return self.mn[k];
            }
            let m = (kl + kr) / 2;
            if i < m {
                k *= 2;
                kr = m;
            } else {
                k = 2 * k + 1;
                kl = m;
            }
        }
    }

    /// Leftmost rank of the lowest height, and that height.
    fn leftmost_min(&self) -> (usize, u64) {
        let target = self.mn[1];
        let (mut k, mut kl, mut kr) = (1, 0, self.n);
        loop {
            if self.lz[k] != NONE || kr - kl == 1 {
                return (kl, target);
            }
            let m = (kl + kr) / 2;
            if self.mn[2 * k] == target {
                k *= 2;
                kr = m;
            } else {
                k = 2 * k + 1;
                kl = m;
            }
        }
    }

    /// First rank ≥ `from` whose height is above `v` (`n` when none).
    fn first_above(&self, from: usize, v: u64) -> usize {
        self.first_above_rec(1, 0, self.n, from, v).unwrap_or(self.n)
    }

    fn first_above_rec(&self, k: usize, kl: usize, kr: usize, from: usize, v: u64) -> Option<usize> {
        if kr <= from || self.mx[k] <= v {
            return None;
        }
        if self.lz[k] != NONE || kr - kl == 1 {
            return Some(kl.max(from));
        }
        let m = (kl + kr) / 2;
        self.first_above_rec(2 * k, kl, m, from, v)
            .or_else(|| self.first_above_rec(2 * k + 1, m, kr, from, v))
    }
}

/// Slack over ranks: range add, range min.
struct SlackTree {
    n: usize,
    mn: Vec<i64>,
    add: Vec<i64>,
}

impl SlackTree {
    fn new(values: &[i64]) -> SlackTree {
        let n = values.len();
        let mut t = SlackTree { n, mn: vec![0; 4 * n], add: vec![0; 4 * n] };
        t.build(1, 0, n, values);
        t
    }

    fn build(&mut self, k: usize, kl: usize, kr: usize, v: &[i64]) {
        if kr - kl == 1 {
            self.mn[k] = v[kl];
            return;
        }
        let m = (kl + kr) / 2;
        self.build(2 * k, kl, m, v);
        self.build(2 * k + 1, m, kr, v);
        self.mn[k] = self.mn[2 * k].min(self.mn[2 * k + 1]);
    }

    fn add(&mut self, l: usize, r: usize, d: i64) {
        self.add_rec(1, 0, self.n, l, r, d);
    }

    fn add_rec(&mut self, k: usize, kl: usize, kr: usize, l: usize, r: usize, d: i64) {
        if r <= kl || kr <= l {
            return;
        }
        if l <= kl && kr <= r {
            self.mn[k] += d;
            self.add[k] += d;
            return;
        }
        let m = (kl + kr) / 2;
        self.add_rec(2 * k, kl, m, l, r, d);
        self.add_rec(2 * k + 1, m, kr, l, r, d);
        self.mn[k] = self.mn[2 * k].min(self.mn[2 * k + 1]) + self.add[k];
    }

    fn point(&self, i: usize) -> i64 {
        let (mut k, mut kl, mut kr) = (1, 0, self.n);
        let mut acc = 0;
        while kr - kl > 1 {
            acc += self.add[k];
            let m = (kl + kr) / 2;
            if i < m {
                k *= 2;
                kr = m;
            } else {
                k = 2 * k + 1;
                kl = m;
            }
        }
        acc + self.mn[k]
    }

    fn min(&self, l: usize, r: usize) -> i64 {
        self.min_rec(1, 0, self.n, l, r)
    }

    fn min_rec(&self, k: usize, kl: usize, kr: usize, l: usize, r: usize) -> i64 {
        if r <= kl || kr <= l {
            return i64::MAX;
        }
        if l <= kl && kr <= r {
            return self.mn[k];
        }
        let m = (kl + kr) / 2;
        let x = self.min_rec(2 * k, kl, m, l, r).min(self.min_rec(2 * k + 1, m, kr, l, r));
        if x == i64::MAX { x } else { x + self.add[k] }
    }
}

/// Per start rank, the earliest end of an unplaced item starting there (point update,
/// "first start in `[a, b)` with an item ending by `b`").
struct StartTree {
    n: usize,
    mn: Vec<u32>,
}

impl StartTree {
    fn new(n: usize) -> StartTree {
        StartTree { n, mn: vec![u32::MAX; 2 * n.next_power_of_two()] }
    }

    fn set(&mut self, i: usize, v: u32) {
        let base = self.mn.len() / 2;
        let mut k = base + i;
        self.mn[k] = v;
        while k > 1 {
            k /= 2;
            self.mn[k] = self.mn[2 * k].min(self.mn[2 * k + 1]);
        }
    }

    fn value(&self, i: usize) -> u32 {
        self.mn[self.mn.len() / 2 + i]
    }

    /// First `t` in `[a, b)` whose value is ≤ `b`.
    fn first(&self, a: usize, b: usize) -> Option<usize> {
        let base = self.mn.len() / 2;
        self.first_rec(1, 0, base, a, b.min(self.n), b as u32)
    }

    fn first_rec(&self, k: usize, kl: usize, kr: usize, a: usize, b: usize, v: u32) -> Option<usize> {
        if kr <= a || b <= kl || self.mn[k] > v {
            return None;
        }
        if kr - kl == 1 {
            return Some(kl);
        }
        let m = (kl + kr) / 2;
        self.first_rec(2 * k, kl, m, a, b, v).or_else(|| self.first_rec(2 * k + 1, m, kr, a, b, v))
    }
}

#[derive(Clone, Copy)]
enum Undo {
    Sky { l: u32, r: u32, old: u64 },
    Slack { l: u32, r: u32, d: i64 },
    Take { start: u32, pos: u32, item: u32 },
}

#[derive(Clone, Copy)]
enum Alt {
    Place { item: u32, pos: u32 },
    Raise { to: u64 },
}

struct Frame {
    trail: usize,
    a: u32,
    b: u32,
    h: u64,
    /// Alternatives: `pool[first..end]`, of which `pool[next..end]` are left.
    first: usize,
    next: usize,
    end: usize,
    /// Ranks the current alternative changed.
    act: (u32, u32),
    /// Ranks whose state explains the failures seen here (for backjumping).
    conf: (u32, u32),
}

fn hull(x: (u32, u32), y: (u32, u32)) -> (u32, u32) {
    (x.0.min(y.0), x.1.max(y.1))
}

/// What one call of [`pack`] did.
#[derive(Debug, Default, Clone)]
pub(crate) struct PackStats {
    /// Steps (placements and raises, undone ones included).
    pub nodes: u64,
    /// Restarts.
    pub restarts: u32,
}

/// Offsets of every item with every top ≤ `height`, or `None` when the search found none
/// by `deadline` (at once when the live bytes exceed `height` somewhere).
pub(crate) fn pack(
    items: &Items<'_>,
    height: u64,
    deadline: Instant,
    seed: u64,
    stats: &mut PackStats,
) -> Option<Vec<u64>> {
    let n = items.size.len();
    let r = items.ranks as usize;
    if n == 0 {
        return Some(Vec::new());
    }
    if r == 0 || items.size.iter().any(|&s| s > height) {
        return None;
    }
    // Slack fits in i64 (beyond that the search is skipped).
    let total = items.size.iter().try_fold(0u64, |acc, &z| acc.checked_add(z));
    if height > (i64::MAX / 4) as u64 || total.is_none_or(|t| t > (i64::MAX / 4) as u64) {
        return None;
    }
    let mut diff = vec![0i64; r + 1];
    for i in 0..n {
        let (s, e) = items.hull[i];
        diff[s as usize] += items.size[i] as i64;
        diff[e as usize] -= items.size[i] as i64;
    }
    let mut slack0 = Vec::with_capacity(r);
    let mut load = 0i64;
    for d in &diff[..r] {
        load += d;
        if load > height as i64 {
            return None;
        }
        slack0.push(height as i64 - load);
    }
    // Unplaced items by start, each list sorted by (end, size).
    let mut by_start: Vec<Vec<u32>> = vec![Vec::new(); r];
    for i in 0..n {
        by_start[items.hull[i].0 as usize].push(i as u32);
    }
    for list in by_start.iter_mut() {
        list.sort_unstable_by_key(|&i| (items.hull[i as usize].1, items.size[i as usize], i));
    }
    let mut rng = Rng::new(seed);
    let mut budget: u64 = 2_000;
    let mut attempt = 0u32;
    loop {
        if Instant::now() > deadline {
            return None;
        }
        attempt += 1;
        let noise = if attempt == 1 { 0.0 } else { [0.05, 0.1, 0.2, 0.3][rng.below(4) as usize] };
        match attempt_pack(items, &slack0, &mut by_start, deadline, &mut rng, noise, budget, stats) {
            Outcome::Placed(off) => return Some(off),
            Outcome::Deadline => return None,
            // Backjumping skips alternatives, so running out of them proves nothing: restart.
            Outcome::Exhausted | Outcome::Budget => {}
        }
        stats.restarts += 1;
        budget = budget.saturating_mul(3) / 2;
    }
}

/// Bisection on the target height between `lower` (a lower bound) and `upper` (a height
/// already reached), until `deadline`, in rounds of one attempt per thread: thread `k` aims
/// at its own fraction of the interval; after the round, successes lower the upper end to
/// the lowest height reached and failures within the round's time slice (a third of the
/// stage) raise the lower end (a bound of this search only). Rounds are synchronous and the
/// lowest result wins (ties: the lowest thread), so the outcome depends on the clock only
/// through the deadline and the slices. Returns the best offsets found below `upper` with
/// their height, and the attempts made.
pub(crate) fn search(
    items: &Items<'_>,
    lower: u64,
    upper: u64,
    deadline: Instant,
    seed: u64,
    threads: usize,
) -> (Option<(Vec<u64>, u64)>, u32) {
    let began = Instant::now();
    let threads = crate::dsa::workers_for(threads, deadline.saturating_duration_since(began));
    let slice = deadline.saturating_duration_since(began) / 3;
    let (mut lo, mut hi) = (lower, upper);
    let mut best: Option<(Vec<u64>, u64)> = None;
    let mut attempts = 0u32;
    let mut round = 0u64;
    loop {
        let now = Instant::now();
        if now >= deadline || lo + 1 >= hi {
            break;
        }
        let until = (now + slice).min(deadline);
        let targets: Vec<u64> = (0..threads)
            .map(|k| {
                let frac = (k as f64 + 1.0) / (threads as f64 + 1.0);
                lo + (((hi - lo) as f64 * frac) as u64).clamp(1, hi - lo - 1)
            })
            .collect();
        let results = crate::dsa::run_workers(threads, |k| {
            let mut stats = PackStats::default();
            pack(items, targets[k], until, seed ^ ((k as u64) << 32) ^ round, &mut stats)
        });
        round += 1;
        attempts += threads as u32;
        let in_time = Instant::now() < deadline;
        for (k, found) in results.into_iter().enumerate() {
            match found {
                Some(off) => {
                    let high = off.iter().zip(items.size).map(|(o, z)| o + z).max().unwrap_or(0);
                    hi = hi.min(high);
                    if best.as_ref().is_none_or(|b| high < b.1) {
                        best = Some((off, high));
                    }
                }
                None if in_time => lo = lo.max(targets[k]),
                None => {}
            }
        }
    }
    (best, attempts)
}

enum Outcome {
    Placed(Vec<u64>),
    /// No alternative left (after backjumps).
    Exhausted,
    Deadline,
    Budget,
}

#[allow(clippy::too_many_arguments)]
fn attempt_pack(
    items: &Items<'_>,
    slack0: &[i64],
    by_start: &mut [Vec<u32>],
    deadline: Instant,
    rng: &mut Rng,
    noise: f64,
    budget: u64,
    stats: &mut PackStats,
) -> Outcome {
    let n = items.size.len();
    let r = items.ranks as usize;
    let mut sky = SkyTree::new(r);
    let mut slack = SlackTree::new(slack0);
    let mut starts = StartTree::new(r);
    for (t, list) in by_start.iter().enumerate() {
        if let Some(&i) = list.first() {
            starts.set(t, items.hull[i as usize].1);
        }
    }
    let mut off = vec![0u64; n];
    let mut placed = 0usize;
    let mut trail: Vec<Undo> = Vec::new();
    let mut frames: Vec<Frame> = Vec::new();
    let mut pool: Vec<Alt> = Vec::new();
    let mut scored: Vec<(u64, u32)> = Vec::new();
    let mut backtracks = 0u64;
    let mut nodes = 0u64;
    let head = |list: &Vec<u32>| list.first().map_or(u32::MAX, |&i| items.hull[i as usize].1);
    let outcome = 'search: loop {
        if placed == n {
            break Outcome::Placed(off.clone());
        }
        nodes += 1;
        if nodes.is_multiple_of(256) && Instant::now() > deadline {
            break Outcome::Deadline;
        }
        // Expand the lowest valley.
        let (a, h) = sky.leftmost_min();
        let b = sky.first_above(a, h);
        let left_h = (a > 0).then(|| sky.point(a - 1));
        let right_h = (b < r).then(|| sky.point(b));
        let first = pool.len();
        let alts = &mut pool;
        if let Some(st) = starts.first(a, b) {
            let list = &by_start[st];
            let k = list.partition_point(|&i| items.hull[i as usize].1 as usize <= b);
            scored.clear();
            for j in 0..k {
                let i = list[j] as usize;
                if j > 0 {
                    let p = list[j - 1] as usize;
                    if items.hull[p] == items.hull[i] && items.size[p] == items.size[i] {
                        continue;
                    }
                }
                let (s0, e0) = items.hull[i];
                let top = h + items.size[i];
                let fit = 2 * u64::from(e0 as usize == b)
                    + u64::from(s0 as usize == a && Some(top) == left_h)
                    + u64::from(e0 as usize == b && Some(top) == right_h);
                scored.push((fit, j as u32));
            }
            scored.sort_by(|x, y| {
                let (i, k) = (list[x.1 as usize] as usize, list[y.1 as usize] as usize);
                (y.0, items.size[k], y.1).cmp(&(x.0, items.size[i], x.1))
            });
            if noise > 0.0 && scored.len() > 1 && rng.unit() < noise {
                let j = rng.below(scored.len() as u64) as usize;
                scored.swap(0, j);
            }
            alts.extend(scored.iter().map(|&(_, j)| Alt::Place { item: list[j as usize], pos: j }));
        }
        let to = match (left_h, right_h) {
            (Some(x), Some(y)) => Some(x.min(y)),
            (x, y) => x.or(y),
        };
        if let Some(to) = to {
            // Whether the slack allows it is checked when it is tried.
            alts.push(Alt::Raise { to });
        }
        let conf = (a.saturating_sub(1) as u32, (b + 1).min(r) as u32);
        frames.push(Frame {
            trail: trail.len(),
            a: a as u32,
            b: b as u32,
            h,
            first,
            next: first,
            end: pool.len(),
            act: (0, 0),
            conf,
        });
        // Take the next alternative of the deepest frame that has one.
        loop {
            let Some(f) = frames.last_mut() else { break 'search Outcome::Exhausted };
            // Undo to the frame's state.
            while trail.len() > f.trail {
                match trail.pop().expect("trail entry") {
                    Undo::Sky { l, r, old } => sky.assign(l as usize, r as usize, old),
                    Undo::Slack { l, r, d } => slack.add(l as usize, r as usize, -d),
                    Undo::Take { start, pos, item } => {
                        by_start[start as usize].insert(pos as usize, item);
                        placed -= 1;
                        starts.set(start as usize, head(&by_start[start as usize]));
                    }
                }
            }
            if f.next < f.end {
                let alt = pool[f.next];
                f.next += 1;
                match alt {
                    Alt::Place { item, pos } => {
                        let i = item as usize;
                        let (s, e) = items.hull[i];
                        let list = &mut by_start[s as usize];
                        debug_assert_eq!(list[pos as usize], item);
                        list.remove(pos as usize);
                        starts.set(s as usize, head(list));
                        trail.push(Undo::Take { start: s, pos, item });
                        off[i] = f.h;
                        placed += 1;
                        trail.push(Undo::Sky { l: s, r: e, old: f.h });
                        let top = f.h + items.size[i];
                        sky.assign(s as usize, e as usize, top);
                        f.act = (s, e);
                        // New drops of the skyline without slack must start an item.
                        let (s, e) = (s as usize, e as usize);
                        if s > 0
                            && sky.point(s - 1) > top
                            && let Err(c) = drop_ok(&sky, &slack, &starts, s, top)
                        {
                            f.conf = hull(f.conf, c);
                            continue;
                        }
                        if e < r {
                            let below = sky.point(e);
                            if below < top
                                && let Err(c) = drop_ok(&sky, &slack, &starts, e, below)
                            {
                                f.conf = hull(f.conf, c);
                                continue;
                            }
                        }
                    }
                    Alt::Raise { to } => {
                        let d = (to - f.h) as i64;
                        if slack.min(f.a as usize, f.b as usize) < d {
                            continue;
                        }
                        trail.push(Undo::Slack { l: f.a, r: f.b, d: -d });
                        slack.add(f.a as usize, f.b as usize, -d);
                        trail.push(Undo::Sky { l: f.a, r: f.b, old: f.h });
                        sky.assign(f.a as usize, f.b as usize, to);
                        f.act = (f.a, f.b);
                        let b = f.b as usize;
                        if b < r {
                            let below = sky.point(b);
                            if below < to
                                && let Err(c) = drop_ok(&sky, &slack, &starts, b, below)
                            {
                                f.conf = hull(f.conf, c);
                                continue;
                            }
                        }
                    }
                }
                break;
            }
            // Exhausted: jump back to the latest frame that changed a rank of the conflict.
            let conf = f.conf;
            pool.truncate(f.first);
            frames.pop();
            backtracks += 1;
            if backtracks > budget {
                break 'search Outcome::Budget;
            }
            while let Some(g) = frames.last_mut() {
                if g.act.0 < conf.1 && conf.0 < g.act.1 {
                    g.conf = hull(g.conf, conf);
                    break;
                }
                pool.truncate(g.first);
                frames.pop();
            }
        }
    };
    // Put the unplaced lists back as they were.
    while let Some(u) = trail.pop() {
        if let Undo::Take { start, pos, item } = u {
            by_start[start as usize].insert(pos as usize, item);
        }
    }
    stats.nodes += nodes;
    outcome
}

/// Whether a drop of the skyline at rank `x` (to height `h`, higher at `x − 1`) can still be
/// filled: raising is possible where there is slack; without slack at `x` an unplaced item
/// must start exactly at `x` and end before the skyline rises above `h`.
/// Otherwise the ranks that explain the failure.
fn drop_ok(sky: &SkyTree, slack: &SlackTree, starts: &StartTree, x: usize, h: u64) -> Result<(), (u32, u32)> {
    if slack.point(x) > 0 {
        return Ok(());
    }
    let end = sky.first_above(x, h);
    if (starts.value(x) as usize) <= end {
        Ok(())
    } else {
        Err((x.saturating_sub(1) as u32, (end + 1).min(sky.n) as u32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(items: &Items<'_>, off: &[u64], height: u64) {
        for i in 0..items.size.len() {
            assert!(off[i] + items.size[i] <= height);
            for j in 0..i {
                let (a, b) = (items.hull[i], items.hull[j]);
                if a.0 < b.1 && b.0 < a.1 {
                    assert!(off[i] + items.size[i] <= off[j] || off[j] + items.size[j] <= off[i]);
                }
            }
        }
    }

    #[test]
    fn packs_a_zero_slack_tiling() {
        // Three columns of height 4 tiled exactly.
        let ivs = [(0, 2), (0, 1), (1, 3), (2, 3), (0, 3)];
        let size = [2, 1, 1, 1, 1];
        // load: t0 = 2+1+1 = 4, t1 = 2+1+1 = 4, t2 = 1+1+1 = 3
        let items = Items::single(&ivs, &size, 3);
        let mut stats = PackStats::default();
        let far = Instant::now() + std::time::Duration::from_secs(5);
        let off = pack(&items, 4, far, 1, &mut stats).expect("fits in 4");
        check(&items, &off, 4);
        assert!(pack(&items, 3, far, 1, &mut stats).is_none());
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Whatever height is asked, an answer places every item, under the height, with
        /// no two items live at the same rank sharing a byte; at the live bound of a
        /// tiling (no slack) it finds one.
        #[test]
        fn packings_are_valid(raw in prop::collection::vec((0u32..20, 1u32..8, 1u64..9), 1..40), extra in 0u64..20, seed in 0u64..4) {
            let ivs: Vec<(u32, u32)> = raw.iter().map(|&(s, l, _)| (s, s + l)).collect();
            let size: Vec<u64> = raw.iter().map(|&(_, _, z)| z).collect();
            let ranks = ivs.iter().map(|x| x.1).max().unwrap_or(0) + 1;
            let items = Items::single(&ivs, &size, ranks);
            let mut load = vec![0u64; ranks as usize];
            for (i, &(s, e)) in ivs.iter().enumerate() {
                for t in s..e {
                    load[t as usize] += size[i];
                }
            }
            let lb = load.iter().copied().max().unwrap_or(0);
            let far = Instant::now() + std::time::Duration::from_millis(20);
            let mut stats = PackStats::default();
            if let Some(off) = pack(&items, lb + extra, far, seed, &mut stats) {
                prop_assert_eq!(off.len(), size.len());
                check(&items, &off, lb + extra);
            }
            // Below the live bound nothing fits.
            prop_assert!(pack(&items, lb - 1, far, seed, &mut stats).is_none());
        }

        #[test]
        fn tilings_are_found(n in 2usize..32, seed in 0u64..1000) {
            let b = crate::workload::packed(n, seed);
            let mut times: Vec<u64> = b.iter().flat_map(|x| [x.start, x.end]).collect();
            times.sort_unstable();
            times.dedup();
            let rank = |t: u64| times.partition_point(|&x| x < t) as u32;
            let ivs: Vec<(u32, u32)> = b.iter().map(|x| (rank(x.start), rank(x.end))).collect();
            let size: Vec<u64> = b.iter().map(|x| x.size).collect();
            let items = Items::single(&ivs, &size, times.len() as u32);
            // Complete on zero slack: given time, a tiling is always found (debug builds
            // are slow; release takes well under a millisecond at this size).
            let far = Instant::now() + std::time::Duration::from_secs(20);
            let mut stats = PackStats::default();
            let off = pack(&items, 1 << 32, far, 1, &mut stats);
            prop_assert!(off.is_some(), "no tiling found for {} pieces", b.len());
            check(&items, &off.unwrap(), 1 << 32);
        }
    }
}

#[cfg(test)]
mod timing {
    use super::*;

    /// `cargo test --release -p graphpool-planner --lib contour::timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn pack_time() {
        for n in [10_000usize, 100_000] {
            let b = crate::workload::random_uniform(n, 1);
            let mut times: Vec<u64> = b.iter().flat_map(|x| [x.start, x.end]).collect();
            times.sort_unstable();
            times.dedup();
            let rank = |t: u64| times.partition_point(|&x| x < t) as u32;
            let ivs: Vec<(u32, u32)> = b.iter().map(|x| (rank(x.start), rank(x.end))).collect();
            let size: Vec<u64> = b.iter().map(|x| x.size).collect();
            let items = Items::single(&ivs, &size, times.len() as u32);
            let lb = crate::dsa::live_bound(&b).unwrap();
            for f in [1.2, 1.06] {
                let mut st = PackStats::default();
                let t = Instant::now();
                let r =
                    pack(&items, (lb as f64 * f) as u64, t + std::time::Duration::from_secs(3), 7, &mut st);
                println!(
                    "n={n} f={f} ok={} {:.1}ms nodes={} restarts={}",
                    r.is_some(),
                    t.elapsed().as_secs_f64() * 1e3,
                    st.nodes,
                    st.restarts
                );
            }
        }
    }
}
