//! Bottom-up skyline constructions: the lowest valley of the skyline filled with an item that
//! starts at its left edge, on an empty arena or on a floor.

use super::*;

/// The name every skyline construction's strategy starts with.
pub(super) const SKYLINE_NAME: &str = "skyline/";

/// The skyline pick rules the portfolio runs (see [`skyline()`]), most useful first.
pub(super) const SKYLINE_RULES: [(u8, &str); 4] =
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
pub(super) fn skyline(
    p: &Problem,
    rule: u8,
    noise: Option<(f64, &mut Rng)>,
    deadline: Instant,
) -> Option<(Vec<u64>, u64)> {
    skyline_on(p, rule, noise, deadline, None)
}

/// [`skyline()`] on a floor: `floor[r]` is the lowest byte free at rank `r` (one entry per
/// rank; `None`: 0 everywhere). Every item goes at or above the floor over its interval.
pub(super) fn skyline_on(
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
    let mut work = 0usize;
    while left > 0 {
        let Some(Reverse((h, a))) = seg.heap.pop() else { break };
        let a = a as usize;
        if !seg.on[a] || seg.height[a] != h {
            continue;
        }
        // The clock is read every 512 steps, or sooner when the steps scan long candidate
        // lists (thousands of items of one start: each step looks at all of them).
        steps = steps.wrapping_add(1);
        if (steps.is_multiple_of(512) || work > DEADLINE_WORK) && Instant::now() > deadline {
            return None;
        }
        if work > DEADLINE_WORK {
            work = 0;
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
            work += list.len();
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

/// Candidate entries a skyline pass looks at between two readings of the clock, at most
/// about (a reading costs ~25 ns; this many entries take ~0.1 ms).
const DEADLINE_WORK: usize = 1 << 16;

/// No segment (before the first).
pub(super) const NIL: u32 = u32::MAX;

/// The skyline's segments: they partition the ranks; the one starting at `a` (`on[a]`) ends
/// at `end[a]` (the next one's start) at `height[a]`, and `prev[a]` is the start of the one
/// before (`NIL` for the first). A heap of (height, start), with stale entries skipped when
/// popped, finds the lowest.
pub(super) struct Segments {
    pub(super) on: Vec<bool>,
    pub(super) end: Vec<u32>,
    pub(super) height: Vec<u64>,
    pub(super) prev: Vec<u32>,
    pub(super) heap: std::collections::BinaryHeap<std::cmp::Reverse<(u64, u32)>>,
}

impl Segments {
    pub(super) fn new(ranks: usize) -> Segments {
        Segments {
            on: vec![false; ranks + 1],
            end: vec![0; ranks + 1],
            height: vec![0; ranks + 1],
            prev: vec![NIL; ranks + 1],
            heap: std::collections::BinaryHeap::new(),
        }
    }

    /// Makes `[a, b)` one segment at height `h` after the one starting at `prev`.
    pub(super) fn set(&mut self, a: usize, b: usize, h: u64, prev: u32) {
        self.on[a] = true;
        self.end[a] = b as u32;
        self.height[a] = h;
        self.prev[a] = prev;
        self.heap.push(std::cmp::Reverse((h, a as u32)));
    }
}

/// Items by start rank (one list per rank and one past the last), each list sorted by (end,
/// size): the skyline's unplaced items.
pub(super) fn unplaced_by_start(p: &Problem) -> Vec<Vec<u32>> {
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
pub(super) fn skyline_pick(
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
pub(super) fn with_noise(choice: usize, k: usize, noise: &mut Option<(f64, &mut Rng)>) -> usize {
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
