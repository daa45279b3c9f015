//! The time-bucketed index of placed items, and gap queries that visit only the items live
//! near the one being placed.

use super::*;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::collections::binary_heap::PeekMut;

#[derive(Debug, Clone, Copy)]
pub(super) struct Entry {
    pub(super) off: u64,
    pub(super) top: u64,
    pub(super) s: u32,
    pub(super) e: u32,
    pub(super) item: u32,
}

/// Placed intervals, bucketed by compressed clock rank at several resolutions; each bucket
/// sorted by offset. An interval goes to the finest level whose buckets are at least as
/// wide as it is (so it lands in one or two buckets), which keeps short queries from
/// scanning long-lived entries bucket by bucket and long ones from being copied into many.
#[derive(Debug, Clone)]
pub(super) struct Index {
    pub(super) levels: Vec<Level>,
    /// Where the problem has [`Problem::meeting_rows`]: which items are placed (a bit each),
    /// their offsets, and the placed items sorted by offset; empty otherwise.
    placed: Vec<u64>,
    off_of: Vec<u64>,
    by_off: Vec<(u64, u32)>,
}

#[derive(Debug, Clone)]
pub(super) struct Level {
    pub(super) shift: u32,
    pub(super) entries: usize,
    pub(super) buckets: Vec<Vec<Entry>>,
}

/// Bucket width of the finest level: 2^BASE_SHIFT ranks; each level is 4 times wider.
pub(super) const BASE_SHIFT: u32 = 5;

impl Index {
    pub(super) fn new(p: &Problem) -> Index {
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
        let (placed, off_of) = match p.meeting_rows() {
            Some(_) => (vec![0; p.len().div_ceil(64)], vec![0; p.len()]),
            None => (Vec::new(), Vec::new()),
        };
        Index { levels, placed, off_of, by_off: Vec::new() }
    }

    /// The index of `placed` (item, offset) pairs: each bucket filled, then sorted once —
    /// the same index as inserting them one by one in that order, without moving a bucket's
    /// entries on every insert (items spanning most of the clock share the widest bucket:
    /// 50k of them took ~0.5 s one by one).
    pub(super) fn with_placed(p: &Problem, placed: impl IntoIterator<Item = (usize, u64)>) -> Index {
        let mut index = Index::new(p);
        for (item, off) in placed {
            index.add(p, item, off, |bucket, en| bucket.push(en));
        }
        for level in &mut index.levels {
            for bucket in &mut level.buckets {
                // Stable: entries at one offset keep their order, as one-by-one inserts do.
                bucket.sort_by_key(|en| en.off);
            }
        }
        let Index { placed, off_of, by_off, .. } = &mut index;
        by_off.extend((0..off_of.len()).filter(|&i| bit(placed, i)).map(|i| (off_of[i], i as u32)));
        by_off.sort_unstable();
        index
    }

    pub(super) fn level_of(&self, s: u32, e: u32) -> usize {
        let len = e - s;
        let mut k = 0;
        while k + 1 < self.levels.len() && len > (1u32 << self.levels[k].shift) {
            k += 1;
        }
        k
    }

    pub(super) fn insert(&mut self, p: &Problem, item: usize, off: u64) {
        self.add(p, item, off, |bucket, en| {
            let pos = bucket.partition_point(|x| x.off <= en.off);
            bucket.insert(pos, en);
        });
        if !self.placed.is_empty() {
            let at = self.by_off.partition_point(|&x| x < (off, item as u32));
            self.by_off.insert(at, (off, item as u32));
        }
    }

    /// Hands `put` every bucket `item` at `off` belongs in, with its entry there, and marks
    /// it placed at `off` (without `by_off`, which the callers keep sorted their own way).
    fn add(&mut self, p: &Problem, item: usize, off: u64, mut put: impl FnMut(&mut Vec<Entry>, Entry)) {
        if !self.placed.is_empty() {
            self.placed[item / 64] |= 1 << (item % 64);
            self.off_of[item] = off;
        }
        let top = off + p.size[item];
        for &(s, e) in p.ivs(item) {
            let en = Entry { off, top, s, e, item: item as u32 };
            let k = self.level_of(s, e);
            let level = &mut self.levels[k];
            level.entries += 1;
            for b in (s >> level.shift)..=((e - 1) >> level.shift) {
                put(&mut level.buckets[b as usize], en);
            }
        }
    }

    pub(super) fn remove(&mut self, p: &Problem, item: usize, off: u64) {
        if !self.placed.is_empty() {
            self.placed[item / 64] &= !(1 << (item % 64));
            let at = self.by_off.partition_point(|&x| x < (off, item as u32));
            self.by_off.remove(at);
        }
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
    pub(super) fn for_each(&self, s: u32, e: u32, mut f: impl FnMut(&Entry)) {
        self.scan(s, e, &mut f, |_| {}, |f, en| f(en));
    }

    /// Calls `f` once for every placed item live with `item` in any of its intervals (an
    /// entry of each; `item` itself too where it is placed). Where items have several
    /// intervals, a neighbour meets `item` in several of them: `seen` keeps it to once.
    pub(super) fn for_each_neighbour(
        &self,
        p: &Problem,
        item: usize,
        seen: &mut Marks,
        mut f: impl FnMut(&Entry),
    ) {
        let several = p.ivs.len() > p.len();
        if several {
            seen.clear(p.len());
        }
        for &(s, e) in p.ivs(item) {
            self.for_each(s, e, |en| {
                if !several || seen.mark(en.item as usize) {
                    f(en);
                }
            });
        }
    }

    /// [`Index::for_each`] with a `state` that `entry` gets with each interval and `bucket`
    /// before each bucket visited.
    #[inline(always)]
    pub(super) fn scan<S>(
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

    /// Appends `(offset, top)` of every placed interval overlapping any of `ivs` that `keep`
    /// accepts to `out`, one sorted run per bucket visited; `runs` gets the start of every
    /// run after the first that does not continue the one before it in order (empty: `out`
    /// is sorted).
    pub(super) fn query_runs(
        &self,
        ivs: &[(u32, u32)],
        out: &mut Vec<(u64, u64)>,
        runs: &mut Vec<u32>,
        mut keep: impl FnMut(&Entry) -> bool,
    ) {
        let mut run = 0usize;
        for &(s, e) in ivs {
            let mut state = (&mut *out, &mut *runs, &mut run, &mut keep);
            self.scan(
                s,
                e,
                &mut state,
                |(out, runs, run, _)| {
                    close_run(out, runs, **run);
                    **run = out.len();
                },
                |(out, _, _, keep), en| {
                    if keep(en) {
                        out.push((en.off, en.top));
                    }
                },
            );
        }
        close_run(out, runs, run);
    }

    /// Lowest offset at which `item` fits under `fit`.
    pub(super) fn find(&self, p: &Problem, item: usize, fit: Fit, scratch: &mut FindScratch) -> u64 {
        scratch.pairs.clear();
        let gaps = Gaps { size: p.size[item], fit, cur: 0, best: None };
        let ivs = p.ivs(item);
        if ivs.len() == 1 {
            scratch.runs.clear();
            self.query_runs(ivs, &mut scratch.pairs, &mut scratch.runs, |_| true);
            // A lowest-offset query ends at the first gap that fits, so it walks the runs in
            // offset order as they are; a best-fit one visits every pair, and there merging
            // the runs first is faster (greedy passes took 6% longer walking them), or, from
            // `SORT_RUNS` runs up, sorting them in place.
            if fit == Fit::LowestOffset {
                return gaps.over_runs(&scratch.pairs, &scratch.runs, &mut scratch.heads);
            }
            if scratch.runs.len() >= SORT_RUNS {
                // Pairs at one offset may end in any order: of those only the first visited
                // can end a gap, and the gap is the same whichever it is.
                scratch.pairs.sort_unstable_by_key(|x| x.0);
            } else if !scratch.runs.is_empty() {
                merge_runs(&mut scratch.pairs, &mut scratch.runs, &mut scratch.spare);
            }
            return gaps.over_sorted(&scratch.pairs);
        }
        // An item with several intervals meets most neighbours in several of them, and every
        // interval of a neighbour has its offset: one pair per neighbour, read from the
        // item's row of the items it meets where the problem has one (what the scan below
        // finds, without visiting each neighbour once per interval and bucket).
        if !self.placed.is_empty()
            && let Some(meeting) = p.meeting_rows()
        {
            let row = meeting.row(item);
            let met: usize = row.iter().zip(&self.placed).map(|(&r, &q)| (r & q).count_ones() as usize).sum();
            // Every placed item in offset order, the ones met visited; or the ones met,
            // sorted: whichever is fewer steps.
            if self.by_off.len() <= met * (met.max(2).ilog2() as usize + 1) {
                let mut gaps = gaps;
                for &(o, j) in &self.by_off {
                    if bit(row, j as usize)
                        && let Some(at) = gaps.visit(o, o + p.size[j as usize])
                    {
                        return at;
                    }
                }
                return gaps.end();
            }
            let pairs = &mut scratch.pairs;
            for (k, (&r, &q)) in row.iter().zip(&self.placed).enumerate() {
                let mut bits = r & q;
                while bits != 0 {
                    let j = k * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let o = self.off_of[j];
                    pairs.push((o, o + p.size[j]));
                }
            }
            pairs.sort_unstable_by_key(|x| x.0);
            return gaps.over_sorted(pairs);
        }
        // One sorted run per bucket visited, as for one interval; each neighbour is kept
        // once, where it is first met, which leaves every run sorted.
        let FindScratch { pairs, runs, seen, heads, .. } = scratch;
        runs.clear();
        seen.clear(p.len());
        self.query_runs(ivs, pairs, runs, |en| seen.mark(en.item as usize));
        if fit == Fit::LowestOffset {
            return gaps.over_runs(pairs, runs, heads);
        }
        // These runs are long (a neighbour's pair comes where it is first met): a stable
        // sort, which merges the runs it finds, took 15% less time than merging them pairwise
        // or sorting unstably (`cargo bench -- gap_query/alias_groups_pp32_v4_l20`).
        if !runs.is_empty() {
            pairs.sort_by_key(|x| x.0);
        }
        gaps.over_sorted(pairs)
    }
}

/// Ends the run of `out` that starts at `run` (a bucket's entries, sorted by offset): where
/// it does not continue the run before it in order, `runs` gets its start.
fn close_run(out: &[(u64, u64)], runs: &mut Vec<u32>, run: usize) {
    if run > 0 && out.len() > run && out[run - 1].0 > out[run].0 {
        runs.push(run as u32);
    }
}

/// Sorted runs a lowest-offset gap query walks by comparing their heads one by one; with
/// more, the heads go in a heap. A query on a placed 100k list meets 7–44 runs on average
/// (by list), one per bucket visited; merging them first took half of its time.
const LINEAR_RUNS: usize = 8;

/// Sorted runs from which a best-fit gap query sorts its pairs in place rather than merging
/// the runs pairwise (a pass, and a copy of every pair, per doubling). With 12, 24 or 40,
/// `cargo bench -p graphpool-planner -- gap_query/` took 8–19% less time than merging at
/// any count (the dense list, ~43 runs a query, the most); sorting at any count was up to
/// 10% slower where runs are few (docs/planner.md, "Gap queries sort many runs").
const SORT_RUNS: usize = 24;

/// The search for a gap among the neighbours' (offset, top) pairs, visited in offset order:
/// the lowest gap that fits (`Fit::LowestOffset`), or the smallest, lowest on a tie
/// (`Fit::BestFit`; one of exactly the item's size ends the search).
struct Gaps {
    size: u64,
    fit: Fit,
    /// The highest top visited so far.
    cur: u64,
    /// The smallest gap that fits so far: (its bytes, its offset).
    best: Option<(u64, u64)>,
}

impl Gaps {
    /// Visits the next pair; `Some(offset)` once the answer is known.
    #[inline(always)]
    fn visit(&mut self, o: u64, t: u64) -> Option<u64> {
        if o >= self.cur + self.size {
            let gap = o - self.cur;
            match self.fit {
                Fit::LowestOffset => return Some(self.cur),
                Fit::BestFit => {
                    if gap == self.size {
                        return Some(self.cur);
                    }
                    if self.best.is_none_or(|(g, _)| gap < g) {
                        self.best = Some((gap, self.cur));
                    }
                }
            }
        }
        self.cur = self.cur.max(t);
        None
    }

    /// The answer once every pair was visited: the best gap, or above them all.
    fn end(self) -> u64 {
        self.best.map_or(self.cur, |(_, o)| o)
    }

    /// The answer for `pairs` sorted by offset.
    fn over_sorted(mut self, pairs: &[(u64, u64)]) -> u64 {
        for &(o, t) in pairs {
            if let Some(at) = self.visit(o, t) {
                return at;
            }
        }
        self.end()
    }

    /// The answer for `pairs` made of sorted runs starting at 0 and at each of `runs`
    /// (ascending), walked in offset order without merging them; on equal offsets the
    /// earlier run goes first.
    fn over_runs(mut self, pairs: &[(u64, u64)], runs: &[u32], heads: &mut BinaryHeap<Reverse<Head>>) -> u64 {
        let count = runs.len() + 1;
        if count == 1 {
            return self.over_sorted(pairs);
        }
        let bounds = |k: usize| {
            let from = if k == 0 { 0 } else { runs[k - 1] };
            let to = if k + 1 < count { runs[k] } else { pairs.len() as u32 };
            (from, to)
        };
        if count <= LINEAR_RUNS {
            let mut next = [0u32; LINEAR_RUNS];
            let mut end = [0u32; LINEAR_RUNS];
            for k in 0..count {
                (next[k], end[k]) = bounds(k);
            }
            loop {
                // The lowest head, the earliest run on a tie.
                let mut lowest = None;
                let mut at = u64::MAX;
                for k in 0..count {
                    if next[k] < end[k] && (lowest.is_none() || pairs[next[k] as usize].0 < at) {
                        at = pairs[next[k] as usize].0;
                        lowest = Some(k);
                    }
                }
                let Some(k) = lowest else { return self.end() };
                let (o, t) = pairs[next[k] as usize];
                next[k] += 1;
                if let Some(found) = self.visit(o, t) {
                    return found;
                }
            }
        }
        heads.clear();
        for k in 0..count {
            let (next, end) = bounds(k);
            if next < end {
                heads.push(Reverse(Head { off: pairs[next as usize].0, run: k as u32, next, end }));
            }
        }
        while let Some(mut head) = heads.peek_mut() {
            let Head { next, end, .. } = head.0;
            let (o, t) = pairs[next as usize];
            if next + 1 < end {
                head.0.off = pairs[next as usize + 1].0;
                head.0.next = next + 1;
            } else {
                PeekMut::pop(head);
            }
            if let Some(found) = self.visit(o, t) {
                return found;
            }
        }
        self.end()
    }
}

/// The next pair of one sorted run of a gap query (the heap's order: offset, then run).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Head {
    off: u64,
    run: u32,
    next: u32,
    end: u32,
}

/// Scratch space of [`Index::find`]: the (offset, top) pairs of the neighbours, where their
/// sorted runs start, the runs' heads, room to merge them, and marks of the neighbours
/// already seen (items with several intervals).
#[derive(Debug, Default)]
pub(super) struct FindScratch {
    pub(super) pairs: Vec<(u64, u64)>,
    /// Starts of the sorted runs of `pairs` after the first.
    pub(super) runs: Vec<u32>,
    pub(super) heads: BinaryHeap<Reverse<Head>>,
    pub(super) spare: Vec<(u64, u64)>,
    pub(super) seen: Marks,
}

/// Gap queries, the engine's hot path, for benchmarks: a list placed by the online best
/// fit, with its index, whose items are taken out one at a time and asked where they fit.
pub struct GapQueries {
    p: Problem,
    off: Vec<u64>,
    index: Index,
    scratch: FindScratch,
}

impl std::fmt::Debug for GapQueries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GapQueries").field("items", &self.p.len()).finish_non_exhaustive()
    }
}

impl GapQueries {
    /// `buffers` placed by the online best fit and indexed.
    pub fn new(buffers: &[Buffer]) -> Result<GapQueries, PlaceError> {
        let p = Problem::build(buffers)?;
        let (off, _) = online_best_fit(&p);
        let index = Index::with_placed(&p, off.iter().copied().enumerate());
        Ok(GapQueries { p, off, index, scratch: FindScratch::default() })
    }

    /// `queries` items drawn at random (from `seed`), each taken out, asked where it fits —
    /// lowest offset or best fit — and put back where it was. Returns the sum of the offsets
    /// found (the same for any correct gap query).
    pub fn run(&mut self, queries: usize, lowest_offset: bool, seed: u64) -> u64 {
        let GapQueries { p, off, index, scratch } = self;
        let n = p.len();
        if n == 0 {
            return 0;
        }
        let mut rng = Rng::new(seed);
        let fit = if lowest_offset { Fit::LowestOffset } else { Fit::BestFit };
        let mut sum = 0u64;
        for _ in 0..queries {
            let i = rng.below(n as u64) as usize;
            index.remove(p, i, off[i]);
            sum = sum.wrapping_add(index.find(p, i, fit, scratch));
            index.insert(p, i, off[i]);
        }
        sum
    }
}

/// Sorts `v` by offset, given that it is sorted runs starting at 0 and at each of `runs`
/// (ascending): adjacent runs merged pairwise, pass after pass, through `spare`.
pub(super) fn merge_runs(v: &mut Vec<(u64, u64)>, runs: &mut Vec<u32>, spare: &mut Vec<(u64, u64)>) {
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

    /// `runs` (each sorted by offset) one after the other, and where each nonempty run after
    /// the first starts: the form of a gap query's pairs.
    fn concatenated(runs: impl Iterator<Item = Vec<(u64, u64)>>) -> (Vec<(u64, u64)>, Vec<u32>) {
        let mut v: Vec<(u64, u64)> = Vec::new();
        let mut starts: Vec<u32> = Vec::new();
        for run in runs {
            if !run.is_empty() && !v.is_empty() {
                starts.push(v.len() as u32);
            }
            v.extend(run);
        }
        (v, starts)
    }

    /// Places the buffers `raw` (start, lifetime, size, group) one by one where a gap query
    /// says, checking every answer against [`scan`]; with `again`, then takes every third
    /// item out and asks for each again, checked the same way.
    fn agree_with_a_scan(
        raw: &[(u64, u64, u64, Option<u32>)],
        best_fit: bool,
        again: bool,
    ) -> Result<Problem, TestCaseError> {
        let b: Vec<Buffer> =
            raw.iter().map(|&(s, l, z, g)| Buffer { start: s, end: s + l, size: z, group: g }).collect();
        let p = Problem::build(&b).unwrap();
        let fit = if best_fit { Fit::BestFit } else { Fit::LowestOffset };
        let mut index = Index::new(&p);
        let mut scratch = FindScratch::default();
        let mut placed = Vec::new();
        let mut place = |index: &mut Index, placed: &mut Vec<(usize, u64)>, i: usize| {
            let o = index.find(&p, i, fit, &mut scratch);
            prop_assert_eq!(o, scan(&p, placed, i, fit), "item {} of {:?}", i, placed);
            index.insert(&p, i, o);
            placed.push((i, o));
            Ok(())
        };
        for i in 0..p.len() {
            place(&mut index, &mut placed, i)?;
        }
        if again {
            let out: Vec<(usize, u64)> = placed.iter().copied().filter(|&(i, _)| i % 3 == 0).collect();
            for &(i, o) in &out {
                index.remove(&p, i, o);
            }
            placed.retain(|&(i, _)| i % 3 != 0);
            for &(i, _) in &out {
                place(&mut index, &mut placed, i)?;
            }
        }
        Ok(p)
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
            agree_with_a_scan(&raw, best_fit, false)?;
        }

        /// Alias groups met at many steps read the items they meet from the problem's rows
        /// (both ways: every placed item in offset order, or the ones met, sorted) and agree
        /// with a scan, also after items are taken out and asked again.
        #[test]
        fn gap_queries_from_the_rows_of_items_met_agree_with_a_scan(
            raw in prop::collection::vec((0u64..40, 1u64..40, 1u64..64, prop::option::of(0u32..12)), 20..120),
            best_fit in any::<bool>(),
        ) {
            let p = agree_with_a_scan(&raw, best_fit, true)?;
            prop_assume!(p.meeting_rows().is_some());
        }

        /// The same on a long clock, where a query visits many buckets (sorted runs: more
        /// than a lowest-offset query walks head by head).
        #[test]
        fn gap_queries_on_a_long_clock_agree_with_a_scan(
            raw in prop::collection::vec((0u64..1000, prop_oneof![1u64..8, 200u64..1000], 1u64..64, Just(None)), 1..300),
            best_fit in any::<bool>(),
        ) {
            agree_with_a_scan(&raw, best_fit, false)?;
        }

        /// Alias groups on a long clock, without the rows of the items they meet: a query
        /// walks (lowest offset) or sorts (best fit) one run per bucket of each interval,
        /// each neighbour kept where it is first met, and agrees with a scan, also after
        /// items are taken out and asked again.
        #[test]
        fn gap_queries_of_groups_on_a_long_clock_agree_with_a_scan(
            raw in prop::collection::vec(
                (0u64..2000, prop_oneof![3 => 1u64..8, 1 => 100u64..600], 1u64..64, prop::option::of(0u32..40)),
                20..200,
            ),
            best_fit in any::<bool>(),
        ) {
            let p = agree_with_a_scan(&raw, best_fit, true)?;
            prop_assume!(p.meeting_rows().is_none() && p.ivs.len() > p.len());
        }

        /// A best-fit query over more sorted runs than `SORT_RUNS` (an item live over a long
        /// clock of short-lived neighbours at scattered offsets, many at one offset) sorts
        /// them in place and agrees with a scan.
        #[test]
        fn best_fit_queries_over_many_runs_agree_with_a_scan(
            short in prop::collection::vec((0u64..4000, 1u64..4, 0u64..40, 1u64..64), 700..900),
            long in prop::collection::vec((0u64..200, 3000u64..4000, 1u64..64), 1..4),
        ) {
            let mut b: Vec<Buffer> = short
                .iter()
                .map(|&(s, l, _, z)| Buffer { start: s, end: s + l, size: z, group: None })
                .collect();
            b.extend(long.iter().map(|&(s, l, z)| Buffer { start: s, end: s + l, size: z, group: None }));
            let p = Problem::build(&b).unwrap();
            // The short items at their drawn offsets (in steps of 64 bytes: ties are common),
            // then each long item asked for its best fit and placed there.
            let mut placed: Vec<(usize, u64)> = Vec::new();
            for (i, &(s, l, o, _)) in short.iter().enumerate() {
                let clash = placed.iter().any(|&(j, oj)| {
                    let (bj, bi) = (&b[j], &b[i]);
                    bj.start < s + l && s < bj.end && oj < 64 * o + bi.size && 64 * o < oj + bj.size
                });
                if !clash {
                    placed.push((i, 64 * o));
                }
            }
            let mut index = Index::with_placed(&p, placed.iter().copied());
            let mut scratch = FindScratch::default();
            for i in short.len()..b.len() {
                let (mut pairs, mut runs) = (Vec::new(), Vec::new());
                index.query_runs(p.ivs(i), &mut pairs, &mut runs, |_| true);
                prop_assert!(runs.len() >= SORT_RUNS, "{} runs", runs.len());
                let o = index.find(&p, i, Fit::BestFit, &mut scratch);
                prop_assert_eq!(o, scan(&p, &placed, i, Fit::BestFit));
                index.insert(&p, i, o);
                placed.push((i, o));
            }
        }

        /// An index built at once holds what one-by-one inserts in the same order give,
        /// bucket for bucket, and the same placed items in offset order.
        #[test]
        fn an_index_built_at_once_equals_one_built_by_inserts(
            raw in prop::collection::vec((0u64..200, 1u64..120, 1u64..64, prop::option::of(0u32..6), 0u64..5), 1..80),
        ) {
            let b: Vec<Buffer> = raw
                .iter()
                .map(|&(s, l, z, g, _)| Buffer { start: s, end: s + l, size: z, group: g })
                .collect();
            let p = Problem::build(&b).unwrap();
            // Offsets with ties (several items at one offset).
            let placed: Vec<(usize, u64)> = (0..p.len()).map(|i| (i, raw[i % raw.len()].4 * 8)).collect();
            let mut one_by_one = Index::new(&p);
            for &(i, o) in &placed {
                one_by_one.insert(&p, i, o);
            }
            let at_once = Index::with_placed(&p, placed.iter().copied());
            let key = |ix: &Index| -> Vec<Vec<Vec<(u64, u32, u32)>>> {
                ix.levels
                    .iter()
                    .map(|l| l.buckets.iter().map(|bk| bk.iter().map(|en| (en.off, en.item, en.s)).collect()).collect())
                    .collect()
            };
            prop_assert_eq!(key(&at_once), key(&one_by_one));
            // And the same placed items, offsets and offset order (where the rows of items met
            // are kept).
            prop_assert_eq!(
                (&at_once.placed, &at_once.off_of, &at_once.by_off),
                (&one_by_one.placed, &one_by_one.off_of, &one_by_one.by_off)
            );
            for (a, c) in at_once.levels.iter().zip(&one_by_one.levels) {
                prop_assert_eq!(a.entries, c.entries);
            }
        }

        /// Merging the sorted runs of a gap query sorts the pairs by offset, keeping every
        /// pair once.
        #[test]
        fn merged_runs_are_sorted(runs in prop::collection::vec(prop::collection::vec(0u64..50, 0..12), 1..20)) {
            let (mut v, mut starts) = concatenated(runs.into_iter().map(|mut run| {
                run.sort_unstable();
                run.iter().enumerate().map(|(j, &o)| (o, o + j as u64)).collect()
            }));
            let mut expected = v.clone();
            expected.sort_unstable();
            merge_runs(&mut v, &mut starts, &mut Vec::new());
            prop_assert!(v.windows(2).all(|w| w[0].0 <= w[1].0));
            v.sort_unstable();
            prop_assert_eq!(v, expected);
        }

        /// Walking the sorted runs of a gap query head by head (few runs) or through a heap
        /// (many) gives the answer of a sweep over the pairs sorted by offset, for both fits.
        #[test]
        fn runs_walked_in_order_give_the_sorted_answer(
            runs in prop::collection::vec(prop::collection::vec((0u64..200, 1u64..40), 0..12), 1..40),
            size in 1u64..40,
            best_fit in any::<bool>(),
        ) {
            let (v, starts) = concatenated(runs.into_iter().map(|mut run| {
                run.sort_unstable();
                run.iter().map(|&(o, z)| (o, o + z)).collect()
            }));
            let fit = if best_fit { Fit::BestFit } else { Fit::LowestOffset };
            let gaps = || Gaps { size, fit, cur: 0, best: None };
            let mut sorted = v.clone();
            sorted.sort_by_key(|x| x.0);
            let expected = gaps().over_sorted(&sorted);
            prop_assert_eq!(gaps().over_runs(&v, &starts, &mut BinaryHeap::new()), expected);
        }
    }
}
