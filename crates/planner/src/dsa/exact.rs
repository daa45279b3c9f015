//! Exact branch-and-bound search over canonical placements, for problems of at most
//! [`EXACT_MAX_ITEMS`] items.

use super::*;

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
pub(super) fn exact(p: &Problem, lb: u64, incumbent: u64) -> Option<Vec<u64>> {
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
