//! The coarsening checked against a placement known to be good (a tiling's own offsets, which
//! `bench/lists/lists.py --offsets` writes): which coarse blocks no placement at that height
//! keeps whole, which merges made them, and what the coarsening gives when it refuses exactly
//! those merges. A diagnostic for work on the coarsening: `cargo run --release --example
//! coarsening` (in the `graphpool` package, which reads `graphpool plan --buffers` files)
//! prints it. The planner never reads a placement it is asked to find. It checks the merge
//! rules of both orders as such, and, where the planner applies it, the chaining-first order
//! with the judge that keeps apart the blocks that their steps balance one without the other
//! (`separation`): the planner's own instance.
//!
//! A block is *crossed* when a piece of the known placement overlaps the block's bounding box
//! there (its lifetime × the bytes from its lowest member to its highest) without lying inside
//! it: that piece cannot be moved out of the block's way, so no re-arrangement of the known
//! placement keeps the block whole. A block that is not crossed lies, with the pieces between
//! its members, in a rectangle of the placement that nothing else enters. A stack's members
//! span that rectangle's lifetime, so what lies between them forms bands of their own, and
//! moving the bands makes the stack whole. A chain's members, and several blocks whose boxes
//! overlap, may still not be re-arrangeable: an instance without crossed blocks need not fit
//! at the known placement's height.

use std::collections::BTreeMap;

use super::coarsen::{Block, MergeJudge, MergeOrder, coarsen_judged};
use super::separation::{self, Separating};
use super::*;

/// Pairs of (rank, buffer) beyond which [`check_coarsening`] declines a list: it keeps, for
/// every rank, the buffers live there sorted by offset.
const CHECK_MAX_RANK_PAIRS: usize = 100_000_000;

/// Why [`check_coarsening`] cannot check a list.
#[derive(Debug, thiserror::Error)]
pub enum CoarseningCheckError {
    /// The list itself is malformed.
    #[error(transparent)]
    Place(#[from] PlaceError),
    /// Offsets and buffers differ in number.
    #[error("{offsets} offsets for {buffers} buffers; give one offset per buffer")]
    Count {
        /// Buffers in the list.
        buffers: usize,
        /// Offsets given.
        offsets: usize,
    },
    /// The known placement is not valid.
    #[error("the placement given is not valid ({0}); check it with `graphpool plan --buffers`")]
    Invalid(#[from] VerifyError),
    /// The coarsening takes buffers without alias groups only.
    #[error("buffer {index} is in an alias group; the coarsening check takes lists without alias groups")]
    AliasGroup {
        /// Position of the buffer in the input.
        index: usize,
    },
    /// Too large to index.
    #[error(
        "{pairs} (step, buffer) pairs live; the check indexes at most {CHECK_MAX_RANK_PAIRS}: take a smaller list"
    )]
    TooLarge {
        /// Steps × buffers live at them, summed.
        pairs: usize,
    },
}

/// One kind of merge, how often the coarsening made it, and how often its result was the
/// first crossed block of its line (its inputs were not crossed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeCount {
    /// `chain, level L` or `stack, level L, G in group, lifetime W` (G: blocks of the
    /// lifetime free to stack, 5 for five or more; W: its ranks on the compressed clock, in
    /// classes 1, 2, 3-4, 5-16, 17+).
    pub kind: String,
    /// Merges of this kind.
    pub merges: u64,
    /// Of them, crossed with inputs that were not.
    pub first_crossings: u64,
}

/// One merge order's coarsening, checked.
#[derive(Debug, Clone)]
pub struct OrderCheck {
    /// `plain`, `chaining stacks first`, or `chaining stacks first, separating` (the
    /// planner's own instance where it applies the separating judge).
    pub order: &'static str,
    /// Its coarse instance (over the compressed clock).
    pub coarse: Vec<Buffer>,
    /// Coarse blocks that are crossed.
    pub crossed_blocks: usize,
    /// Their share of the list's bytes × steps.
    pub crossed_area: f64,
    /// Merges by kind.
    pub merges: Vec<MergeCount>,
    /// The coarse instance of the same order refusing every merge whose result is crossed.
    pub refusing_crossed: Vec<Buffer>,
    /// Its crossed blocks (none: each merge was checked).
    pub refusing_crossed_blocks: usize,
}

/// The merge orders' coarsenings of a list, checked against a placement of it.
#[derive(Debug, Clone)]
pub struct CoarseningCheck {
    /// The list's lower bound (as the coarse instances': coarsening keeps it).
    pub lower_bound: u64,
    /// The placement's footprint (buffers of no bytes count for none).
    pub footprint: u64,
    /// The plain order, the one that chains stacks first, then (where the planner applies
    /// it) that one with the separating judge.
    pub orders: Vec<OrderCheck>,
}

/// Checks the merge orders' coarsenings of `buffers` (no alias groups) against the valid
/// placement `offsets`; see the module documentation.
pub fn check_coarsening(
    buffers: &[Buffer],
    offsets: &[u64],
) -> Result<CoarseningCheck, CoarseningCheckError> {
    if offsets.len() != buffers.len() {
        return Err(CoarseningCheckError::Count { buffers: buffers.len(), offsets: offsets.len() });
    }
    if let Some(index) = buffers.iter().position(|b| b.group.is_some()) {
        return Err(CoarseningCheckError::AliasGroup { index });
    }
    verify(buffers, offsets)?;
    let footprint = buffers.iter().zip(offsets).filter(|(b, _)| b.size > 0).map(|(b, &o)| o + b.size).max();
    let p = Problem::build(buffers)?;
    // The items are the buffers of some bytes (the others take no part in a plan).
    let mut at = vec![0u64; p.len()];
    for (i, &o) in offsets.iter().enumerate() {
        if let Some(item) = at.get_mut(p.item_of[i] as usize) {
            *item = o;
        }
    }
    let known = Known::new(&p, at)?;
    let mut orders = vec![
        check_order(&p, &known, MergeOrder::Stacks, "plain", false),
        check_order(&p, &known, MergeOrder::ChainingStacksFirst, "chaining stacks first", false),
    ];
    if separation::applies(&p) {
        orders.push(check_order(
            &p,
            &known,
            MergeOrder::ChainingStacksFirst,
            "chaining stacks first, separating",
            true,
        ));
    }
    Ok(CoarseningCheck { lower_bound: p.lower_bound(), footprint: footprint.unwrap_or(0), orders })
}

/// One merge order's coarsening of `p` checked against `known`, with the planner's
/// [`Separating`] judge where `separate`.
fn check_order(
    p: &Problem,
    known: &Known,
    order: MergeOrder,
    name: &'static str,
    separate: bool,
) -> OrderCheck {
    let far = Instant::now() + Duration::from_secs(24 * 3600);
    let coarsen = |refuse: bool| {
        let mut judge = Judge::new(p, known, refuse);
        let coarse = if separate {
            let mut both = SeparatingToo { check: judge, separating: Separating::new(p) };
            let coarse = coarsen_judged(p, order, far, &mut both);
            judge = both.check;
            coarse
        } else {
            coarsen_judged(p, order, far, &mut judge)
        };
        let crossed = judge.crossed(p, &coarse);
        (coarse, crossed, judge.tally)
    };
    let (coarse, (crossed_blocks, crossed_area), tally) = coarsen(false);
    let (refused, (refusing_crossed_blocks, _), _) = coarsen(true);
    let merges = tally
        .into_iter()
        .map(|(kind, (merges, first_crossings))| MergeCount {
            kind: kind.to_string(),
            merges,
            first_crossings,
        })
        .collect();
    OrderCheck {
        order: name,
        coarse: coarse.buffers,
        crossed_blocks,
        crossed_area,
        merges,
        refusing_crossed: refused.buffers,
        refusing_crossed_blocks,
    }
}

/// The known placement, indexed: per rank, the items live there by offset.
struct Known<'a> {
    p: &'a Problem,
    offset: Vec<u64>,
    live: Vec<Vec<(u64, u32)>>,
}

impl<'a> Known<'a> {
    fn new(p: &'a Problem, offset: Vec<u64>) -> Result<Known<'a>, CoarseningCheckError> {
        let pairs: usize = p.ivs.iter().map(|&(s, e)| (e - s) as usize).sum();
        if pairs > CHECK_MAX_RANK_PAIRS {
            return Err(CoarseningCheckError::TooLarge { pairs });
        }
        let mut live = vec![Vec::new(); p.ranks as usize];
        for (i, &(s, e)) in p.ivs.iter().enumerate() {
            for r in s..e {
                live[r as usize].push((offset[i], i as u32));
            }
        }
        for at in &mut live {
            at.sort_unstable();
        }
        Ok(Known { p, offset, live })
    }

    fn top(&self, i: usize) -> u64 {
        self.offset[i] + self.p.size[i]
    }

    /// The items live at rank `r` that overlap bytes `[lo, hi)`.
    fn overlapping(&self, r: u32, lo: u64, hi: u64) -> impl Iterator<Item = usize> + '_ {
        let at = &self.live[r as usize];
        // Items at one rank do not overlap: those ending above `lo` start at or after the
        // last one starting at or below it.
        let first = at.partition_point(|&(o, _)| o <= lo).saturating_sub(1);
        at[first..]
            .iter()
            .take_while(move |&&(o, _)| o < hi)
            .map(|&(_, i)| i as usize)
            .filter(move |&i| self.top(i) > lo)
    }

    /// Whether an item overlaps ranks `[s, e)` × bytes `[lo, hi)` without lying inside it.
    fn crossed(&self, s: u32, e: u32, lo: u64, hi: u64) -> bool {
        let (ivs, inside) = (&self.p.ivs, |i: usize| self.offset[i] >= lo && self.top(i) <= hi);
        // Such an item reaches past an edge: live at the first or last rank and reaching
        // past it in time, or reaching past the lowest or highest byte at some rank.
        if self.overlapping(s, lo, hi).any(|i| ivs[i].0 < s || !inside(i))
            || self.overlapping(e - 1, lo, hi).any(|i| ivs[i].1 > e || !inside(i))
        {
            return true;
        }
        let mut r = s;
        while r < e {
            // The items holding byte `lo` and byte `hi - 1` at rank `r`: one reaching below
            // `lo` or above `hi` crosses; skip to the earliest of their ends.
            let mut next = e;
            for byte in [lo, hi - 1] {
                match self.overlapping(r, byte, byte + 1).next() {
                    Some(i) if !inside(i) => return true,
                    Some(i) => next = next.min(ivs[i].1),
                    None => next = next.min(r + 1),
                }
            }
            r = next;
        }
        false
    }
}

/// A kind of merge: a chain at a level, or a stack at a level with its group's size (5: five
/// or more) and its lifetime's class ([`WIDTHS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Chain { level: u8 },
    Stack { level: u8, group: u32, width: usize },
}

/// Classes of a stack's lifetime in ranks: up to 1, 2, 4, 16, more.
const WIDTHS: [(u32, &str); 5] = [(1, "1"), (2, "2"), (4, "3-4"), (16, "5-16"), (u32::MAX, "17+")];

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Kind::Chain { level } => write!(f, "chain, level {level}"),
            Kind::Stack { level, group, width } => {
                write!(f, "stack, level {level}, {group} in group, lifetime {}", WIDTHS[width].1)
            }
        }
    }
}

/// Follows every block's bounding box in the known placement (by root) and counts or refuses
/// the merges whose result is crossed.
struct Judge<'a> {
    known: &'a Known<'a>,
    /// Per root item: the lowest byte and the top of the block's members, and whether the
    /// block is crossed.
    boxes: Vec<(u64, u64, bool)>,
    refuse: bool,
    /// Per kind ([`Kind`]): merges, first crossings.
    tally: BTreeMap<Kind, (u64, u64)>,
}

impl<'a> Judge<'a> {
    fn new(p: &Problem, known: &'a Known<'a>, refuse: bool) -> Judge<'a> {
        let boxes = (0..p.len()).map(|i| (known.offset[i], known.top(i), false)).collect();
        Judge { known, boxes, refuse, tally: BTreeMap::new() }
    }

    /// The bounding box of `a` and `b` together, and whether either was crossed.
    fn union(&self, a: &Block, b: &Block) -> (u64, u64, bool) {
        let (x, y) = (self.boxes[a.root as usize], self.boxes[b.root as usize]);
        (x.0.min(y.0), x.1.max(y.1), x.2 || y.2)
    }

    fn count(&mut self, kind: Kind, first_crossing: bool) {
        let entry = self.tally.entry(kind).or_default();
        entry.0 += 1;
        entry.1 += first_crossing as u64;
    }

    /// Crossed blocks of `c` and their share of the list's area.
    fn crossed(&self, p: &Problem, c: &Coarse) -> (usize, f64) {
        let blocks = c.buffers.len();
        let (mut lo, mut hi, mut area) = (vec![u64::MAX; blocks], vec![0u64; blocks], vec![0u128; blocks]);
        for (i, &(k, _)) in c.member.iter().enumerate() {
            let k = k as usize;
            lo[k] = lo[k].min(self.known.offset[i]);
            hi[k] = hi[k].max(self.known.top(i));
            area[k] += (p.ivs[i].1 - p.ivs[i].0) as u128 * p.size[i] as u128;
        }
        let crossed: Vec<bool> = (0..blocks)
            .map(|k| {
                let b = &c.buffers[k];
                self.known.crossed(b.start as u32, b.end as u32, lo[k], hi[k])
            })
            .collect();
        let total: u128 = area.iter().sum();
        let bad: u128 = area.iter().zip(&crossed).filter(|(_, x)| **x).map(|(a, _)| a).sum();
        (crossed.iter().filter(|x| **x).count(), if total == 0 { 0.0 } else { bad as f64 / total as f64 })
    }
}

impl MergeJudge for Judge<'_> {
    fn chain(&mut self, head: &Block, next: &Block, level: u8) -> bool {
        let (lo, hi, inputs_crossed) = self.union(head, next);
        let crossed = inputs_crossed || self.known.crossed(head.s, next.e, lo, hi);
        if self.refuse && crossed {
            return false;
        }
        self.count(Kind::Chain { level }, crossed && !inputs_crossed);
        self.boxes[head.root as usize] = (lo, hi, crossed);
        true
    }

    fn stack(&mut self, onto: &Block, next: &Block, _level: u8) -> bool {
        // A stack's box is judged whole when formed (a stack in the making may be crossed
        // by a strip of its own rectangle that a later member brings in).
        let (lo, hi, inputs_crossed) = self.union(onto, next);
        if self.refuse && (inputs_crossed || self.known.crossed(onto.s, onto.e, lo, hi)) {
            return false;
        }
        // The flag says for now whether an input was crossed, which `formed_stack` reads.
        self.boxes[onto.root as usize] = (lo, hi, inputs_crossed);
        true
    }

    const WATCHES_STACKS: bool = true;

    fn formed_stack(&mut self, stack: &Block, group: u32, level: u8) {
        // Refusing, no stack is crossed, and the merges are not counted.
        if self.refuse {
            return;
        }
        let (lo, hi, inputs_crossed) = self.boxes[stack.root as usize];
        let crossed = inputs_crossed || self.known.crossed(stack.s, stack.e, lo, hi);
        let width =
            WIDTHS.iter().position(|&(most, _)| stack.e - stack.s <= most).unwrap_or(WIDTHS.len() - 1);
        self.count(Kind::Stack { level, group: group.min(5), width }, crossed && !inputs_crossed);
        self.boxes[stack.root as usize].2 = crossed;
    }

    fn stack_key(&self, block: &Block) -> u64 {
        // Refusing, members are stacked in their order in the known placement, so that
        // those lying side by side meet.
        if self.refuse { self.boxes[block.root as usize].0 } else { 0 }
    }
}

/// [`Judge`] behind the planner's [`Separating`]: a merge is made when both take it, and
/// each follows only the merges made.
struct SeparatingToo<'a> {
    check: Judge<'a>,
    separating: Separating,
}

impl MergeJudge for SeparatingToo<'_> {
    fn chain(&mut self, head: &Block, next: &Block, level: u8) -> bool {
        // The separating judge takes every chain.
        self.check.chain(head, next, level) && self.separating.chain(head, next, level)
    }

    fn stack(&mut self, onto: &Block, next: &Block, level: u8) -> bool {
        let made = !self.separating.keeps_apart(onto, next, level) && self.check.stack(onto, next, level);
        if made {
            self.separating.stacked(onto, next);
        }
        made
    }

    const WATCHES_STACKS: bool = true;

    fn formed_stack(&mut self, stack: &Block, group: u32, level: u8) {
        self.check.formed_stack(stack, group, level);
    }

    fn stack_key(&self, block: &Block) -> u64 {
        self.check.stack_key(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Tiling, packed_tiling_placed};

    fn buffer(start: u64, end: u64, size: u64) -> Buffer {
        Buffer { start, end, size, group: None }
    }

    /// Regions of a small placement (with a hole) are crossed exactly when an item reaches
    /// past one of their edges.
    #[test]
    fn a_region_is_crossed_by_an_item_reaching_past_its_edge() {
        // Steps 0-4, bytes 0-3: `a` along the bottom over steps 0-2, `b` then `c` above it,
        // `d` two bytes tall over steps 2-4, nothing above it (a hole at byte 2).
        let b = [buffer(0, 2, 1), buffer(0, 1, 1), buffer(1, 2, 1), buffer(2, 4, 2)];
        let p = Problem::build(&b).unwrap();
        let mut offset = vec![0; p.len()];
        for (i, o) in [0, 1, 1, 0].into_iter().enumerate() {
            offset[p.item_of[i] as usize] = o;
        }
        let known = Known::new(&p, offset).unwrap();
        // Ranks 0, 1, 2 begin at steps 0, 1, 2 (`d` is one rank of the compressed clock).
        assert_eq!(p.ivs[p.item_of[3] as usize], (2, 3));
        assert!(!known.crossed(0, 2, 0, 2), "the rectangle of a, b and c");
        assert!(!known.crossed(0, 2, 1, 2), "b and c");
        assert!(!known.crossed(0, 1, 1, 2), "b alone");
        assert!(!known.crossed(0, 3, 0, 3), "everything, and the hole");
        assert!(!known.crossed(2, 3, 0, 3), "d and the hole above it");
        assert!(known.crossed(0, 1, 0, 2), "a lives on past rank 1");
        assert!(known.crossed(1, 3, 0, 1), "a starts before rank 1");
        assert!(known.crossed(2, 3, 0, 1), "d reaches above byte 1");
        assert!(known.crossed(2, 3, 1, 3), "d reaches below byte 1");
    }

    /// On tilings, the coarsening's crossed blocks are found, and refusing the merges that
    /// make them leaves none and fewer blocks.
    #[test]
    fn refusing_crossed_merges_leaves_no_crossed_block() {
        let shape = Tiling { horizon_per_piece: 1, ..Tiling::default() };
        let (mut crossed, mut blocks, mut refusing) = (0, 0, 0);
        for seed in 1..=3 {
            let (b, offsets) = packed_tiling_placed(3000, seed, &shape);
            let check = check_coarsening(&b, &offsets).unwrap();
            assert_eq!((check.lower_bound, check.footprint), (1 << 32, 1 << 32));
            for order in &check.orders {
                assert_eq!(order.refusing_crossed_blocks, 0, "{}, seed {seed}", order.order);
                assert!(order.crossed_blocks <= order.coarse.len());
                assert_eq!(live_bound(&order.refusing_crossed).unwrap(), 1 << 32);
                let first: u64 = order.merges.iter().map(|m| m.first_crossings).sum();
                // A crossed block was made by some merge (a crossed merge can still end
                // inside a block that is not, once the rest of its rectangle joins).
                assert!(first > 0 || order.crossed_blocks == 0, "{}, seed {seed}", order.order);
                crossed += order.crossed_blocks;
                blocks += order.coarse.len();
                refusing += order.refusing_crossed.len();
            }
        }
        assert!(crossed > 0, "no crossed block in six coarsenings of tilings");
        assert!(refusing < blocks, "refusing crossed merges kept {refusing} blocks against {blocks}");
    }

    /// Where the planner separates, the third instance checked is the planner's own, and
    /// where it does not (halves), there is none.
    #[test]
    fn the_separating_instance_checked_is_the_planners() {
        let (b, offsets) = packed_tiling_placed(3000, 1, &Tiling::default());
        let check = check_coarsening(&b, &offsets).unwrap();
        let p = Problem::build(&b).unwrap();
        let far = Instant::now() + Duration::from_secs(60);
        let planners =
            super::super::coarsen::coarsen_for_plan(&p, MergeOrder::ChainingStacksFirst, true, far);
        assert_eq!(check.orders.len(), 3);
        assert_eq!(check.orders[2].coarse, planners.buffers);
        assert_eq!(check.orders[2].refusing_crossed_blocks, 0);
        assert!(check.orders[2].crossed_blocks <= check.orders[2].coarse.len());
        let halves = Tiling { halves: true, ..Tiling::default() };
        let (b, offsets) = packed_tiling_placed(3000, 1, &halves);
        assert_eq!(check_coarsening(&b, &offsets).unwrap().orders.len(), 2);
    }

    /// Buffers of no bytes are no items of the plan: they neither cross a block nor widen one.
    #[test]
    fn buffers_of_no_bytes_cross_nothing() {
        // `a` over bytes 0-10 and steps 0-4, an empty buffer inside it at byte 5, one far
        // above; `b` and `c` share a lifetime above `a` and stack.
        let b = [buffer(0, 4, 10), buffer(0, 4, 0), buffer(0, 4, 0), buffer(0, 4, 6), buffer(0, 4, 4)];
        let check = check_coarsening(&b, &[0, 5, 1000, 10, 16]).unwrap();
        for order in &check.orders {
            assert_eq!(order.crossed_blocks, 0, "{}: {:?}", order.order, order.coarse);
            assert_eq!(order.coarse.len(), 1, "{}: one stack of everything", order.order);
        }
    }

    #[test]
    fn lists_the_check_cannot_take_are_refused_with_the_reason() {
        let b = [buffer(0, 2, 4), buffer(1, 3, 4)];
        assert!(matches!(
            check_coarsening(&b, &[0]),
            Err(CoarseningCheckError::Count { buffers: 2, offsets: 1 })
        ));
        assert!(matches!(check_coarsening(&b, &[0, 2]), Err(CoarseningCheckError::Invalid(_))));
        let grouped = [buffer(0, 2, 4), Buffer { group: Some(7), ..buffer(1, 3, 4) }];
        assert!(matches!(
            check_coarsening(&grouped, &[0, 4]),
            Err(CoarseningCheckError::AliasGroup { index: 1 })
        ));
        assert!(check_coarsening(&b, &[0, 4]).is_ok());
    }
}
