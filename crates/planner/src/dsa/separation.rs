//! A merge judge for the coarsening that keeps apart blocks of one lifetime which their
//! steps balance one without the other ([`Separating`]).
//!
//! In a guillotine tiling, pieces of one lifetime `[s, e)` are strips of one rectangle cut in
//! memory, or strips of different rectangles whose cuts in time happen to meet. A rectangle
//! is balanced across its cut in time by its neighbour there: the pieces of that neighbour
//! ending where it starts (or starting where it ends) fill exactly its bytes. Strips of one
//! rectangle are balanced only together; strips of different rectangles each with the rest
//! of their own. So where a block about to join a stack fills, with some of the other blocks
//! starting at `s`, exactly the bytes of some blocks ending at `s` (or likewise at `e`), all
//! without the stack, it is taken for a strip of another rectangle and starts a stack of its
//! own. Stacking such strips together is what the coarsening most often gets wrong on
//! tilings cut mostly in time (docs/planner.md, "Keeping apart the strips of different
//! rectangles").
//!
//! Sizes may add up by chance; where most pieces share their size with another (tilings
//! cut at halves and quarters) they do at most steps, and [`applies`] leaves such lists to
//! the plain rules.

use super::coarsen::{Block, MergeJudge};
use super::*;

/// Blocks on the other side of a step beyond which [`Separating`] does not look for
/// balanced groups there (every subset of both sides is summed). More looks at more steps
/// and refuses more, wrongly too; 6 planned tilings of 100k pieces at least as low as 8 or
/// 10, whose checks also took longer (docs/planner.md).
const SIDE_MAX: usize = 6;

/// Share of the items whose size another item of at least 1/2^16 of the bound shares above
/// which [`applies`] is false: there sizes balance by chance at most steps (tilings cut at
/// halves and quarters: 83–98%; other tilings 20–80%).
const REPEATED_SIZES_MAX: f64 = 0.9;

/// Whether the coarsening of `p` should keep such strips apart ([`Separating`]): not where
/// most large sizes repeat ([`REPEATED_SIZES_MAX`]).
pub(super) fn applies(p: &Problem) -> bool {
    let floor = p.lower_bound() >> 16;
    let mut sizes: Vec<u64> = p.size.iter().copied().filter(|&size| size >= floor).collect();
    sizes.sort_unstable();
    let repeated = sizes.chunk_by(|a, b| a == b).filter(|run| run.len() > 1).map(<[u64]>::len).sum::<usize>();
    (repeated as f64) <= REPEATED_SIZES_MAX * p.len().max(1) as f64
}

/// The judge: every chain the rules find, and every stack that no step of its lifetime
/// separates from the block joining it (from the second level of stacks on: stacks that
/// chain at once are made as found).
pub(super) struct Separating {
    /// Per root item: the block's first rank, its end and its bytes while it is a block.
    blocks: Vec<(u32, u32, u64)>,
    /// Per rank: the blocks starting there, and those ending there.
    starts: Vec<Vec<u32>>,
    ends: Vec<Vec<u32>>,
    /// Per root item: where it sits in its first rank's `starts` (`[0]`) and its end's
    /// `ends` (`[1]`), so that a merge takes it off in constant time (a step may hold tens
    /// of thousands of blocks).
    slot: Vec<[u32; 2]>,
    /// Per rank: bumped whenever the blocks starting there (`[0]`) or ending there (`[1]`)
    /// change.
    version: [Vec<u32>; 2],
    /// Subset sums of the other side at the rank and version last asked, for blocks
    /// starting there (`[0]`) and for blocks ending there (`[1]`).
    other: [(u32, u32, Vec<u64>); 2],
    /// Scratch: subset sums of the rest of the side, and sums being merged in.
    rest: Vec<u64>,
    shifted: Vec<u64>,
}

impl Separating {
    /// A judge for the items of `p`, each a block of its own.
    pub(super) fn new(p: &Problem) -> Separating {
        let ranks = p.ranks as usize + 1;
        let (mut starts, mut ends) = (vec![Vec::<u32>::new(); ranks], vec![Vec::<u32>::new(); ranks]);
        let mut slot = Vec::with_capacity(p.len());
        let blocks = (0..p.len())
            .map(|i| {
                let (s, e) = p.ivs[i];
                slot.push([starts[s as usize].len() as u32, ends[e as usize].len() as u32]);
                starts[s as usize].push(i as u32);
                ends[e as usize].push(i as u32);
                (s, e, p.size[i])
            })
            .collect();
        Separating {
            blocks,
            starts,
            ends,
            slot,
            version: [vec![0; ranks], vec![0; ranks]],
            other: [(u32::MAX, 0, Vec::new()), (u32::MAX, 0, Vec::new())],
            rest: Vec::new(),
            shifted: Vec::new(),
        }
    }

    /// Whether [`MergeJudge::stack`] would refuse to stack `next` onto `onto`; asks without
    /// merging anything.
    pub(super) fn keeps_apart(&mut self, onto: &Block, next: &Block, level: u8) -> bool {
        let (o, x) = (onto.root, next.root);
        level >= 1 && (self.separated(x, o, onto.s, true) || self.separated(x, o, onto.e, false))
    }

    /// Follows the merge of `next` onto `onto` (judged elsewhere: see [`Self::keeps_apart`]).
    pub(super) fn stacked(&mut self, onto: &Block, next: &Block) {
        let (o, x) = (onto.root, next.root);
        let (s, e, size) = self.blocks[x as usize];
        self.forget(0, s, x);
        self.forget(1, e, x);
        self.blocks[o as usize].2 += size;
    }

    /// Takes `root` off the blocks starting (`list` 0) or ending (1) at `rank`.
    fn forget(&mut self, list: usize, rank: u32, root: u32) {
        let at = if list == 0 { &mut self.starts[rank as usize] } else { &mut self.ends[rank as usize] };
        let k = self.slot[root as usize][list] as usize;
        debug_assert_eq!(at[k], root);
        at.swap_remove(k);
        if let Some(&moved) = at.get(k) {
            self.slot[moved as usize][list] = k as u32;
        }
        self.touch(list, rank);
    }

    /// Puts `root` among the blocks ending at `rank`.
    fn ends_at(&mut self, rank: u32, root: u32) {
        let at = &mut self.ends[rank as usize];
        self.slot[root as usize][1] = at.len() as u32;
        at.push(root);
        self.touch(1, rank);
    }

    fn touch(&mut self, list: usize, rank: u32) {
        let v = &mut self.version[list][rank as usize];
        *v = v.wrapping_add(1);
    }

    /// Every subset sum of `sizes` up to `most` (the empty one too), ascending, into `out`:
    /// each size merges the sums so far with themselves shifted by it.
    fn subset_sums(sizes: impl Iterator<Item = u64>, most: u64, out: &mut Vec<u64>, shifted: &mut Vec<u64>) {
        out.clear();
        out.push(0);
        for size in sizes {
            shifted.clear();
            shifted.extend(out.iter().map(|&v| v + size).take_while(|&v| v <= most));
            let mut i = out.len();
            out.extend_from_slice(shifted);
            // Merge the two ascending runs from the back.
            let (mut j, mut k) = (shifted.len(), out.len());
            while j > 0 {
                k -= 1;
                if i > 0 && out[i - 1] > shifted[j - 1] {
                    out[k] = out[i - 1];
                    i -= 1;
                } else {
                    out[k] = shifted[j - 1];
                    j -= 1;
                }
            }
        }
    }

    /// Whether at rank `t` some blocks on `x`'s side with `x` but without `stack` fill
    /// exactly the bytes of some blocks on the other side (`x` and `stack` start at `t`
    /// where `starting`, else end there). `false` where the other side holds more than
    /// [`SIDE_MAX`] blocks, or `x`'s side more than two beyond that.
    fn separated(&mut self, x: u32, stack: u32, t: u32, starting: bool) -> bool {
        let (side, other) = if starting {
            (&self.starts[t as usize], &self.ends[t as usize])
        } else {
            (&self.ends[t as usize], &self.starts[t as usize])
        };
        if other.is_empty() || other.len() > SIDE_MAX || side.len() > SIDE_MAX + 2 {
            return false;
        }
        let blocks = &self.blocks;
        let own = blocks[x as usize].2;
        // The other side's sums change only with its blocks: kept while its version holds.
        let other_version = self.version[starting as usize][t as usize];
        let cached = &mut self.other[!starting as usize];
        if (cached.0, cached.1) != (t, other_version) {
            Self::subset_sums(
                other.iter().map(|&r| blocks[r as usize].2),
                u64::MAX,
                &mut cached.2,
                &mut self.shifted,
            );
            (cached.0, cached.1) = (t, other_version);
        }
        let other_sums = &cached.2;
        // Sums of the rest beyond the other side's total, less `own`, match nothing.
        let Some(most) = other_sums.last().and_then(|total| total.checked_sub(own)) else {
            return false;
        };
        Self::subset_sums(
            side.iter().filter(|&&r| r != x && r != stack).map(|&r| blocks[r as usize].2),
            most,
            &mut self.rest,
            &mut self.shifted,
        );
        // Both ascending: walk them together for `own + rest == other`.
        let (mut i, mut j) = (0, 0);
        while i < self.rest.len() && j < other_sums.len() {
            match (own + self.rest[i]).cmp(&other_sums[j]) {
                std::cmp::Ordering::Equal => return true,
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
            }
        }
        false
    }
}

impl MergeJudge for Separating {
    fn chain(&mut self, head: &Block, next: &Block, _level: u8) -> bool {
        let (h, x) = (head.root, next.root);
        let head_end = self.blocks[h as usize].1;
        let (next_start, next_end, _) = self.blocks[x as usize];
        self.forget(1, head_end, h);
        self.forget(0, next_start, x);
        self.forget(1, next_end, x);
        self.ends_at(next_end, h);
        self.blocks[h as usize].1 = next_end;
        true
    }

    fn stack(&mut self, onto: &Block, next: &Block, level: u8) -> bool {
        if self.keeps_apart(onto, next, level) {
            return false;
        }
        self.stacked(onto, next);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::coarsen::{MergeOrder, coarsen_judged};
    use super::*;

    fn buffer(start: u64, end: u64, size: u64) -> Buffer {
        Buffer { start, end, size, group: None }
    }

    #[test]
    fn subset_sums_are_every_sum_in_order_up_to_the_limit() {
        let (mut out, mut shifted) = (Vec::new(), Vec::new());
        Separating::subset_sums([3u64, 5, 3].into_iter(), u64::MAX, &mut out, &mut shifted);
        assert_eq!(out, vec![0, 3, 3, 5, 6, 8, 8, 11]);
        Separating::subset_sums([3u64, 5, 3].into_iter(), 6, &mut out, &mut shifted);
        assert_eq!(out, vec![0, 3, 3, 5, 6]);
        Separating::subset_sums(std::iter::empty(), 6, &mut out, &mut shifted);
        assert_eq!(out, vec![0]);
    }

    /// Two rectangles of 3 and 5 bytes over steps 0-2, each followed at step 2 by strips of
    /// one lifetime (1 + 2 bytes and 1 + 4 bytes): the strip of 2 fills the first
    /// rectangle's bytes with a strip of 1, without the strip of 4, so it is not stacked
    /// onto it; the strips of one rectangle alone are stacked, and chain with it.
    #[test]
    fn strips_balanced_apart_are_not_stacked_and_strips_balanced_together_are() {
        let apart = [
            buffer(0, 2, 3),
            buffer(0, 2, 5),
            buffer(2, 4, 1),
            buffer(2, 4, 2),
            buffer(2, 4, 1),
            buffer(2, 4, 4),
        ];
        let p = Problem::build(&apart).unwrap();
        let mut judge = Separating::new(&p);
        // Level 2: nothing else to merge. The 4 first (largest at the bottom).
        let strip = |i: usize| Block { s: 1, e: 2, size: p.size[i], root: i as u32 };
        let (four, two) = (p.item_of[5] as usize, p.item_of[3] as usize);
        assert!(!judge.stack(&strip(four), &strip(two), 2), "2 + 1 fill the rectangle of 3");
        assert!(judge.stack(&strip(four), &strip(two), 0), "stacks that chain at once are made");

        let together = [buffer(0, 2, 3), buffer(2, 4, 1), buffer(2, 4, 2)];
        let p = Problem::build(&together).unwrap();
        for order in [MergeOrder::Stacks, MergeOrder::ChainingStacksFirst] {
            let far = Instant::now() + Duration::from_secs(60);
            let c = coarsen_judged(&p, order, far, &mut Separating::new(&p));
            assert_eq!(c.buffers.len(), 1, "{order:?}: one rectangle of 3 bytes over steps 0-4");
        }
    }

    #[test]
    fn lists_whose_large_sizes_mostly_repeat_are_left_to_the_plain_rules() {
        let halves = crate::workload::packed_tiling(
            10_000,
            1,
            &crate::workload::Tiling { halves: true, ..Default::default() },
        );
        assert!(!applies(&Problem::build(&halves).unwrap()));
        assert!(applies(&Problem::build(&crate::workload::packed(10_000, 1)).unwrap()));
    }
}
