//! Coarsening (single-interval problems): buffers with one lifetime stacked into one, and
//! buffers handing over to one of equal size chained into one; the coarse instance is planned
//! by this same engine and its placement expanded back.

use super::separation::Separating;
use super::*;

/// A coarser instance: buffers with one lifetime stacked into one, buffers handing over to
/// one of equal size at the same rank chained into one, repeated until nothing changes.
/// Any placement of the coarse buffers gives one of the items (each item at its coarse
/// buffer's offset plus its delta), with the same footprint, and the live bound does not
/// change — the coarse optimum can only be worse, so it is one more construction.
pub(super) struct Coarse {
    /// Coarse buffers over the compressed clock of the problem.
    pub(super) buffers: Vec<Buffer>,
    /// For every item of the problem: its coarse buffer and its offset inside it.
    pub(super) member: Vec<(u32, u64)>,
}

/// What the first round of [`coarsen_both`] would merge (a cheap test, [`merges`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Merges {
    /// Less than a tenth of the items: not worth coarsening.
    Few,
    /// A tenth of the items or more, but not a tenth beyond what chance makes: hand-overs
    /// between items of equal size that the list's mix of starts and sizes explains
    /// ([`chance_hand_overs`]), and stacks of items that its mix of starts and lifetimes
    /// explains ([`chance_stacks`]). Such lists coarsen to three quarters of their items or so
    /// (power-of-two sizes, eight items starting a step), an instance planned only after the
    /// constructions, when there is time for it; coarsening them before (a quarter to a third
    /// of a 10k list's default budget) left the constructions that time short for nothing
    /// (docs/planner.md, "Hand-overs by chance").
    ByChance {
        /// The share of the items the first round would leave unmerged: an estimate of the
        /// coarse instance's size (ambiguous hand-overs do not merge, so it keeps more).
        unmerged: f64,
    },
    /// A tenth of the items or more beyond chance: stacks and chains of a tiling's pieces,
    /// of a training step's activations.
    Structural,
    /// As [`Merges::Structural`], on a clock so crowded ([`CROWDED_RANK`] items per rank or
    /// more) that most of what would stack is items of one rank, whose stacks are mostly
    /// wrong: not coarsened (docs/planner.md, "Crowded clocks").
    Crowded,
}

/// Items per rank of the compressed clock from which a list whose merges are structural is
/// not coarsened ([`Merges::Crowded`]).
pub(super) const CROWDED_RANK: f64 = 32.0;

/// Items per rank from which stacks by chance ([`chance_stacks`]) are weighed: below it the
/// test keeps to hand-overs, as tilings (2–5 items per rank) need no more.
pub(super) const CHANCE_STACKS_RANK: f64 = 8.0;

/// What the first round of [`coarsen_both`] would merge: pairs of items sharing a lifetime,
/// and items whose end meets the start of one of equal size, against a tenth of the items;
/// hand-overs and stacks that chance makes are counted only to tell [`Merges::ByChance`]
/// apart.
pub(super) fn merges(p: &Problem) -> Merges {
    let n = p.len() as f64;
    let (stacked, chained) = merge_candidates(p);
    let candidates = (stacked + chained) as f64;
    if candidates < n / 10.0 {
        Merges::Few
    } else {
        let starts_at = starts_per_rank(p);
        let beyond_chance = candidates - chance_hand_overs(p, &starts_at);
        let by_chance = Merges::ByChance { unmerged: 1.0 - (candidates / n).min(1.0) };
        if beyond_chance < n / 10.0 {
            by_chance
        } else if n >= p.ranks as f64 * CROWDED_RANK {
            Merges::Crowded
        } else if n >= p.ranks as f64 * CHANCE_STACKS_RANK
            && beyond_chance - chance_stacks(p, &starts_at) < n / 10.0
        {
            // Stacks by chance: many items start at a rank and share lifetimes as often as
            // chance has them do (random lists over few steps; docs/planner.md, "Crowded
            // clocks"). After the crowded test: tilings over few steps stack little beyond
            // chance too, and plan best without a coarse instance at all.
            by_chance
        } else {
            Merges::Structural
        }
    }
}

/// Pairs of items sharing their lifetime (a group of `k` counts `k − 1`), and items whose end
/// meets the start of an item of equal size: what the first round of coarsening could merge.
fn merge_candidates(p: &Problem) -> (usize, usize) {
    let n = p.len();
    let mut lives: Vec<u64> = p.ivs.iter().map(|&(s, e)| (s as u64) << 32 | e as u64).collect();
    lives.sort_unstable();
    let stacked = lives.windows(2).filter(|w| w[0] == w[1]).count();
    // (start, size) hashed into one word: a collision only makes the test say yes.
    let key = |t: u32, size: u64| (t as u64) << 32 ^ (size.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32);
    let mut heads: Vec<u64> = (0..n).map(|i| key(p.ivs[i].0, p.size[i])).collect();
    heads.sort_unstable();
    let chained = (0..n).filter(|&i| heads.binary_search(&key(p.ivs[i].1, p.size[i])).is_ok()).count();
    (stacked, chained)
}

/// How many items start at each rank of `p`'s clock.
fn starts_per_rank(p: &Problem) -> Vec<u32> {
    let mut starts_at = vec![0u32; p.ranks as usize + 1];
    for &(s, _) in &p.ivs {
        starts_at[s as usize] += 1;
    }
    starts_at
}

/// How many items would meet one of their size starting where they end if sizes were drawn
/// independently of the steps: each with probability `1 − e^−λ`, `λ` = the items starting
/// at its end ([`starts_per_rank`]) × the share of the items that have its size.
fn chance_hand_overs(p: &Problem, starts_at: &[u32]) -> f64 {
    let n = p.len();
    // (size, the step where it ends) by size: each run of one size is the items of that size.
    let mut ends: Vec<(u64, u32)> = (0..n).map(|i| (p.size[i], p.ivs[i].1)).collect();
    ends.sort_unstable();
    ends.chunk_by(|a, b| a.0 == b.0)
        .map(|run| {
            let share = run.len() as f64 / n as f64;
            run.iter().map(|&(_, e)| 1.0 - (-(starts_at[e as usize] as f64) * share).exp()).sum::<f64>()
        })
        .sum()
}

/// How many items would stack (share a lifetime with one starting at their rank, counted as
/// [`merge_candidates`] counts: a group of `k` counts `k − 1`) if lifetimes were drawn
/// independently of the ranks: a rank where `k` items start ([`starts_per_rank`]) holds
/// `Σ_L (k p_L − 1 + (1 − p_L)^k)` of them, `p_L` the share of the items whose lifetime is
/// `L` ranks.
fn chance_stacks(p: &Problem, starts_at: &[u32]) -> f64 {
    let n = p.len() as f64;
    let mut lifetimes = vec![0u32; p.ranks as usize + 1];
    for &(s, e) in &p.ivs {
        lifetimes[(e - s) as usize] += 1;
    }
    let shares: Vec<f64> = lifetimes.iter().filter(|&&c| c > 0).map(|&c| c as f64 / n).collect();
    // How many ranks see `k` items start, by `k`.
    let most = starts_at.iter().copied().max().unwrap_or(0) as usize;
    let mut ranks_with = vec![0u32; most + 1];
    for &k in starts_at {
        ranks_with[k as usize] += 1;
    }
    ranks_with
        .iter()
        .enumerate()
        .skip(2)
        .filter(|&(_, &ranks)| ranks > 0)
        .map(|(k, &ranks)| {
            let k = k as f64;
            ranks as f64 * shares.iter().map(|&q| k * q - 1.0 + (1.0 - q).powf(k)).sum::<f64>()
        })
        .sum()
}

type KeyMap<V> = HashMap<(u32, u64), V, KeyHashing>;

/// How many coarse buffers start and end at one (rank, size) key, the first to start, and
/// whether those that start there all end at one rank (and those that end there all start
/// at one): such buffers are interchangeable.
#[derive(Debug, Clone, Copy, Default)]
struct KeyUse {
    starts: u32,
    first_start: u32,
    ends: u32,
    /// The rank where every buffer starting here ends ([`MIXED`] if they differ).
    starters_end: u32,
    /// The rank where every buffer ending here starts ([`MIXED`] if they differ).
    enders_start: u32,
}

/// [`KeyUse`]'s mark for buffers of one key that do not share their other end.
const MIXED: u32 = u32::MAX;

impl KeyUse {
    /// Whether the buffers ending at this key can be chained one to one with those
    /// starting at it whatever the pairing: one of each, or as many of each where those of
    /// one side are interchangeable (one lifetime and one size), so every pairing is the
    /// same placement up to which of them is which.
    fn pairs(&self) -> bool {
        self.starts == self.ends
            && self.starts > 0
            && (self.starts == 1 || self.starters_end != MIXED || self.enders_start != MIXED)
    }
}

/// Which stacks a round of [`coarsen_in_order`] makes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MergeOrder {
    /// Every group of one lifetime whose members have no possible chain partner.
    Stacks,
    /// Only groups whose stack chains at once (a buffer of the stack's size ends where they
    /// start or starts where they end), while there are any; then as `Stacks`. Pieces of one
    /// lifetime that are not siblings (a tiling cut twice at the same steps) then do not
    /// stack before the stacks they belong to have formed and chained: 3 tilings of 500
    /// pieces keep 26 coarse buffers instead of 70, of 100k 22.2k instead of 24.3k.
    ChainingStacksFirst,
}

/// A round of stacks that chain at once (level 0) that merges fewer than one buffer in this
/// many hands over to the next level, as a round that merges nothing does.
const CASCADE_MERGES: usize = 200;

/// Items from which [`coarsen_both`] runs its two merge orders on two threads (below, both take
/// less than starting a thread can).
const PARALLEL_COARSEN_ITEMS: usize = 20_000;

/// Coarsens `p` (items of one interval each; see [`Coarse`]) in both merge orders — side by
/// side on two threads for large lists when `threads` allows: the two instances, the
/// coarser first (fewer buffers: more structure found; on a tie the plain order's). Each
/// order starts no round of merges after `until` (what it merged so far is a coarse
/// instance too). Which of them a plan uses is decided by its coarse stage. The
/// chaining-first order keeps apart the blocks of one lifetime that their steps balance one
/// without the other ([`Separating`]) where that [`applies`](super::separation::applies):
/// one instance with and one without, since either plans lower on some tilings.
pub(super) fn coarsen_both(p: &Problem, threads: usize, until: Instant) -> [Coarse; 2] {
    let separate = super::separation::applies(p);
    let coarsen = |order: MergeOrder| coarsen_for_plan(p, order, separate, until);
    let orders = [MergeOrder::Stacks, MergeOrder::ChainingStacksFirst];
    let [plain, other] = if threads >= 2 && p.len() >= PARALLEL_COARSEN_ITEMS {
        let mut both = run_workers(2, |k| coarsen(orders[k]));
        let other = both.pop().expect("two workers ran");
        [both.pop().expect("two workers ran"), other]
    } else {
        orders.map(coarsen)
    };
    if other.buffers.len() < plain.buffers.len() { [other, plain] } else { [plain, other] }
}

/// The coarsening of `p` in `order` as [`coarsen_both`] makes it: in the chaining-first
/// order with [`Separating`] where `separate` (what [`super::separation::applies`] says).
pub(super) fn coarsen_for_plan(p: &Problem, order: MergeOrder, separate: bool, until: Instant) -> Coarse {
    match order {
        MergeOrder::ChainingStacksFirst if separate => {
            coarsen_judged(p, order, until, &mut Separating::new(p))
        }
        _ => coarsen_in_order(p, order, until),
    }
}

/// A coarse buffer over ranks `[s, e)` while [`coarsen_in_order`] runs; its members hang off
/// its `root` item (the item it started from: a merge keeps the absorbing block's root).
#[derive(Debug, Clone, Copy)]
pub(super) struct Block {
    pub(super) s: u32,
    pub(super) e: u32,
    pub(super) size: u64,
    pub(super) root: u32,
}

/// Sees the merges a coarsening makes and may refuse them ([`coarsen_judged`]). The planner
/// refuses none ([`AnyMerge`]); [`super::check_coarsening`] refuses or counts them against a
/// placement it knows. Blocks are named by their roots, which a merge keeps.
pub(super) trait MergeJudge {
    /// Whether `head` may absorb `next`, which starts where it ends and has its size, in a
    /// round at `level` (0–2, see [`coarsen_judged`]).
    fn chain(&mut self, head: &Block, next: &Block, level: u8) -> bool;
    /// Whether `onto` (a stack being built, or one block) may absorb `next`, of its lifetime,
    /// on top.
    fn stack(&mut self, onto: &Block, next: &Block, level: u8) -> bool;
    /// Whether [`MergeJudge::formed_stack`] is to be called.
    const WATCHES_STACKS: bool = false;
    /// The stacks of a round at `level` are made: `stack` is one of them, or a block of a
    /// lifetime that `group` blocks were free to stack and whose merges were refused.
    fn formed_stack(&mut self, _stack: &Block, _group: u32, _level: u8) {}
    /// Where `block` goes among those of its lifetime when they are stacked (lowest first;
    /// ties largest first).
    fn stack_key(&self, _block: &Block) -> u64 {
        0
    }
}

/// The planner's judge: every merge the rules find is made.
pub(super) struct AnyMerge;

impl MergeJudge for AnyMerge {
    #[inline]
    fn chain(&mut self, _: &Block, _: &Block, _: u8) -> bool {
        true
    }
    #[inline]
    fn stack(&mut self, _: &Block, _: &Block, _: u8) -> bool {
        true
    }
}

impl Block {
    /// Every item of `p` as a block of its own.
    fn items(p: &Problem) -> Vec<Block> {
        (0..p.len())
            .map(|i| Block { s: p.ivs[i].0, e: p.ivs[i].1, size: p.size[i], root: i as u32 })
            .collect()
    }
}

/// No successor in a chain (`succ` of [`coarsen_in_order`]).
const NO_SUCC: u32 = u32::MAX;

/// The share of the items (one in this many) that undecided hand-over keys must reach in the
/// first round for a coarsening to decide them by lifetime alone ([`pair_by_lifetime`] with
/// [`Evidence::Lifetime`]); below it they need [`Evidence::NextMerge`]. Tilings whose sizes
/// repeat (cut at halves and quarters: 5.9–7.8% of the pieces at 10k and 100k) reach it, and
/// stall at those keys otherwise; on tilings cut anywhere (0.1–3.2%) a lifetime alone is
/// shared by chance too often, and a wrong chain high in the merge tree costs more than the
/// chains gained.
const LIFETIME_PAIRING_SHARE: usize = 20;

/// What [`pair_by_lifetime`] asks of an ender and a starter before it chains them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Evidence {
    /// Another block already has the lifetime they would span together.
    Lifetime,
    /// That, and the chain with all the blocks of that lifetime adds up to the size of a
    /// block that ends where they start or starts where they end: the stack the chain would
    /// join would chain in turn.
    NextMerge,
}

/// Fills `keys` with how the blocks of `cur` start and end at each (rank, size) key.
fn hand_over_keys(cur: &[Block], keys: &mut KeyMap<KeyUse>) {
    keys.clear();
    for (k, x) in cur.iter().enumerate() {
        let at_start = keys.entry((x.s, x.size)).or_default();
        if at_start.starts == 0 {
            at_start.first_start = k as u32;
            at_start.starters_end = x.e;
        } else if at_start.starters_end != x.e {
            at_start.starters_end = MIXED;
        }
        at_start.starts += 1;
        let at_end = keys.entry((x.e, x.size)).or_default();
        if at_end.ends == 0 {
            at_end.enders_start = x.s;
        } else if at_end.enders_start != x.s {
            at_end.enders_start = MIXED;
        }
        at_end.ends += 1;
    }
}

/// Hand-over keys (a rank and a size at which buffers end and others start) whose pairing is
/// not certain ([`KeyUse::pairs`]).
fn undecided_keys(keys: &KeyMap<KeyUse>) -> usize {
    keys.values().filter(|u| u.starts > 0 && u.ends > 0 && !u.pairs()).count()
}

/// At hand-over keys whose pairing is not certain, chains a block that ends there to one that
/// starts there when together they would span a lifetime that some block already has (and
/// with [`Evidence::NextMerge`], the stack they would make with those chains on), and that
/// pairing is the only such one for both: in a tiling, a rectangle cut in time lies in a
/// band beside others of its lifetime, with which the chain then stacks, and that stack is
/// cut in time from its neighbours. `succ` and `has_pred` are the round's chains; only
/// blocks without a successor (enders) or without a predecessor (starters) take part.
fn pair_by_lifetime(
    cur: &[Block],
    keys: &KeyMap<KeyUse>,
    evidence: Evidence,
    succ: &mut [u32],
    has_pred: &mut [bool],
) {
    let undecided = |key: (u32, u64), ending: bool| {
        keys.get(&key).is_some_and(|u| !u.pairs() && if ending { u.starts > 0 } else { u.ends > 0 })
    };
    let mut enders: Vec<((u32, u64), u32)> = Vec::new();
    let mut starters: Vec<((u32, u64), u32)> = Vec::new();
    for (k, x) in cur.iter().enumerate() {
        if succ[k] == NO_SUCC && undecided((x.e, x.size), true) {
            enders.push(((x.e, x.size), k as u32));
        }
        if !has_pred[k] && undecided((x.s, x.size), false) {
            starters.push(((x.s, x.size), k as u32));
        }
    }
    if enders.is_empty() || starters.is_empty() {
        return;
    }
    // The bytes of each lifetime.
    let mut lives: KeyMap<u64> = KeyMap::with_capacity_and_hasher(cur.len(), Default::default());
    for x in cur {
        *lives.entry((x.s, x.e as u64)).or_default() += x.size;
    }
    let spans = |a: u32, b: u32| {
        let (x, y) = (cur[a as usize], cur[b as usize]);
        let Some(&others) = lives.get(&(x.s, y.e as u64)) else { return false };
        let whole = others.saturating_add(x.size);
        evidence == Evidence::Lifetime
            || keys.get(&(x.s, whole)).is_some_and(|u| u.ends > 0)
            || keys.get(&(y.e, whole)).is_some_and(|u| u.starts > 0)
    };
    enders.sort_unstable();
    starters.sort_unstable();
    let (mut i, mut j) = (0, 0);
    while i < enders.len() && j < starters.len() {
        let key = enders[i].0;
        let ie = i + enders[i..].iter().take_while(|x| x.0 == key).count();
        let je = j + starters[j..].iter().take_while(|x| x.0 <= key).count();
        let first = j + starters[j..je].iter().take_while(|x| x.0 < key).count();
        let (group_e, group_s) = (&enders[i..ie], &starters[first..je]);
        (i, j) = (ie, je);
        // Crowded keys are left undecided: the test is quadratic in their blocks.
        if group_e.len() * group_s.len() > LIFETIME_PAIRING_MAX_CANDIDATES {
            continue;
        }
        for &(_, a) in group_e {
            let mut partners = group_s.iter().filter(|&&(_, b)| spans(a, b));
            let (Some(&(_, b)), None) = (partners.next(), partners.next()) else { continue };
            if !has_pred[b as usize] && group_e.iter().filter(|&&(_, a2)| spans(a2, b)).count() == 1 {
                succ[a as usize] = b;
                has_pred[b as usize] = true;
            }
        }
    }
}

/// Pairs of an ender and a starter at one key beyond which [`pair_by_lifetime`] leaves the
/// key undecided (the keys that stall tilings hold two to six blocks).
const LIFETIME_PAIRING_MAX_CANDIDATES: usize = 1024;

/// Coarsens `p` (items of one interval each) in one merge order: see [`Coarse`]. Starts no
/// round after `until` but the first.
pub(super) fn coarsen_in_order(p: &Problem, order: MergeOrder, until: Instant) -> Coarse {
    coarsen_judged(p, order, until, &mut AnyMerge)
}

/// [`coarsen_in_order`], every merge put to `judge` first: a refused chain leaves the blocks
/// apart (the later one heads the rest of the chain), a refused member of a stack starts a
/// stack of its own (the members that follow it try that one).
pub(super) fn coarsen_judged<J: MergeJudge>(
    p: &Problem,
    order: MergeOrder,
    until: Instant,
    judge: &mut J,
) -> Coarse {
    let n = p.len();
    // The members of a coarse buffer form a tree of items: every item but the root sits
    // `delta` bytes above its parent. A block's root is its first member.
    let mut parent: Vec<u32> = (0..n as u32).collect();
    let mut delta = vec![0u64; n];
    let mut cur = Block::items(p);
    // The stacks a round may make: 0, only those that chain at once; 1, those whose members
    // have no possible chain partner; 2, all (nothing else was left to merge). A round that
    // merges anything returns to the order's first level.
    let first_level = match order {
        MergeOrder::Stacks => 1u8,
        MergeOrder::ChainingStacksFirst => 0,
    };
    let mut level = first_level;
    // Whether undecided hand-overs are common enough to decide them by lifetime alone, once
    // nothing else merges (set in the first round; otherwise they need the next merge too).
    let mut by_lifetime = false;
    // Scratch kept across rounds (the maps keep their capacity when cleared).
    let mut keys: KeyMap<KeyUse> = KeyMap::with_capacity_and_hasher(2 * n, Default::default());
    // (blocks free to stack, their bytes) per lifetime.
    let mut lifetimes: KeyMap<(u32, u64)> = KeyMap::with_capacity_and_hasher(n, Default::default());
    let mut free: Vec<bool> = Vec::new();
    let mut succ: Vec<u32> = Vec::new();
    let mut has_pred: Vec<bool> = Vec::new();
    let mut next: Vec<Block> = Vec::with_capacity(n);
    let mut stackable: Vec<Block> = Vec::new();
    let mut enders: Vec<((u32, u64), u32)> = Vec::new();
    let mut starters: Vec<((u32, u64), u32)> = Vec::new();
    for round in 0.. {
        if round > 0 && Instant::now() > until {
            break;
        }
        let before = cur.len();
        // Chain a buffer with one of equal size starting where it ends, where the pairing is
        // unambiguous: one buffer of that size ends there and one starts there, or as many
        // of each with those of one side interchangeable ([`KeyUse::pairs`]; a tiling cut
        // twice at the same steps makes such pieces, and stacking them instead breaks both
        // chains). Chains run forward in time, so they have no cycles; one pass finds them
        // all (a merge only removes keys whose buffers all pair, so it makes no new pair). A
        // merged key's counts are zeroed: no buffer left starts or ends there, so the counts
        // then describe the chained buffers and still serve the stacking. Once nothing else
        // merges (level 2), the keys left undecided are decided by lifetime where that
        // evidence settles them ([`pair_by_lifetime`]).
        hand_over_keys(&cur, &mut keys);
        let len = cur.len();
        succ.clear();
        succ.resize(len, NO_SUCC);
        has_pred.clear();
        has_pred.resize(len, false);
        // At a key that pairs, one buffer on each side chains at once (its counts are not
        // read again); several on each side are gathered and paired in the order of their
        // keys (any pairing will do).
        enders.clear();
        starters.clear();
        for (k, x) in cur.iter().enumerate() {
            if let Some(at_end) = keys.get_mut(&(x.e, x.size))
                && at_end.pairs()
            {
                if at_end.ends == 1 {
                    succ[k] = at_end.first_start;
                    has_pred[at_end.first_start as usize] = true;
                    *at_end = KeyUse::default();
                } else {
                    enders.push(((x.e, x.size), k as u32));
                }
            }
            if let Some(at_start) = keys.get(&(x.s, x.size))
                && at_start.starts > 1
                && at_start.pairs()
            {
                starters.push(((x.s, x.size), k as u32));
            }
        }
        enders.sort_unstable();
        starters.sort_unstable();
        debug_assert_eq!(enders.len(), starters.len());
        for (&(key, k), &(start_key, j)) in enders.iter().zip(&starters) {
            debug_assert_eq!(key, start_key);
            succ[k as usize] = j;
            has_pred[j as usize] = true;
            keys.insert(key, KeyUse::default());
        }
        if round == 0 {
            by_lifetime = undecided_keys(&keys) * LIFETIME_PAIRING_SHARE >= n;
        }
        if level == 2 {
            let evidence = if by_lifetime { Evidence::Lifetime } else { Evidence::NextMerge };
            pair_by_lifetime(&cur, &keys, evidence, &mut succ, &mut has_pred);
        }
        next.clear();
        for k in 0..len {
            if has_pred[k] {
                continue;
            }
            let mut x = cur[k];
            let mut j = succ[k];
            while j != NO_SUCC {
                let y = cur[j as usize];
                if judge.chain(&x, &y, level) {
                    x.e = y.e;
                    parent[y.root as usize] = x.root;
                } else {
                    next.push(x);
                    x = y;
                }
                j = succ[j as usize];
            }
            next.push(x);
        }
        std::mem::swap(&mut cur, &mut next);
        // Stack buffers with the same lifetime (largest at the bottom), except those that
        // still have a possible (ambiguous) chain partner, stacking which would hide it —
        // unless nothing else is left to merge. Only lifetimes shared by two or more buffers
        // free to stack are sorted.
        let uses = |rank: u32, size: u64| keys.get(&(rank, size)).copied().unwrap_or_default();
        free.clear();
        free.extend(
            cur.iter().map(|x| level == 2 || (uses(x.s, x.size).ends == 0 && uses(x.e, x.size).starts == 0)),
        );
        lifetimes.clear();
        for (x, _) in cur.iter().zip(&free).filter(|(_, f)| **f) {
            let group = lifetimes.entry((x.s, x.e as u64)).or_default();
            group.0 += 1;
            group.1 += x.size;
        }
        // At level 0, only groups whose stack would chain at once.
        let chains_at_once = |total: u64, x: &Block| uses(x.s, total).ends > 0 || uses(x.e, total).starts > 0;
        next.clear();
        stackable.clear();
        for (x, is_free) in cur.drain(..).zip(&free) {
            let group = if *is_free { lifetimes.get(&(x.s, x.e as u64)).copied() } else { None };
            match group {
                Some((count, total)) if count > 1 && (level > 0 || chains_at_once(total, &x)) => {
                    stackable.push(x)
                }
                _ => next.push(x),
            }
        }
        stackable.sort_unstable_by_key(|x| (x.s, x.e, judge.stack_key(x), std::cmp::Reverse(x.size), x.root));
        let first_stacked = next.len();
        for &x in &stackable {
            match next[first_stacked..].last_mut() {
                Some(last) if last.s == x.s && last.e == x.e && judge.stack(last, &x, level) => {
                    parent[x.root as usize] = last.root;
                    delta[x.root as usize] = last.size;
                    last.size += x.size;
                }
                _ => next.push(x),
            }
        }
        if J::WATCHES_STACKS {
            for x in &next[first_stacked..] {
                let group = lifetimes.get(&(x.s, x.e as u64)).map_or(1, |g| g.0);
                judge.formed_stack(x, group, level);
            }
        }
        std::mem::swap(&mut cur, &mut next);
        if cur.len() < before {
            // A round of stacks that chain at once merging few buffers is most often one
            // step of a cascade (a stack chains, which lets another stack chain, ...): the
            // next level's stacks go first, and the cascade goes on after them. Same counts
            // of coarse buffers on tilings of 10k–100k pieces, in half the time.
            let trickle = level == 0 && (before - cur.len()) * CASCADE_MERGES < before;
            level = if trickle { 1 } else { first_level };
        } else if level < 2 {
            level += 1;
        } else {
            break;
        }
    }
    // Every item's coarse buffer and offset in it: the deltas summed up its tree (`done`
    // marks items whose `member` is final; a walk stops at the first such or at a root).
    let mut member = vec![(u32::MAX, 0u64); n];
    for (k, x) in cur.iter().enumerate() {
        member[x.root as usize] = (k as u32, 0);
    }
    let mut done: Vec<bool> = (0..n).map(|i| parent[i] as usize == i).collect();
    let mut path: Vec<u32> = Vec::new();
    for i in 0..n {
        let mut j = i;
        while !done[j] {
            path.push(j as u32);
            j = parent[j] as usize;
        }
        while let Some(k) = path.pop() {
            let k = k as usize;
            let (block, base) = member[parent[k] as usize];
            member[k] = (block, base + delta[k]);
            done[k] = true;
        }
    }
    let buffers = cur
        .iter()
        .map(|x| Buffer { start: x.s as u64, end: x.e as u64, size: x.size, group: None })
        .collect();
    Coarse { buffers, member }
}

/// Plans the coarse instance `c` within `share` and keeps it when it is lower.
pub(super) fn solve_coarse(c: &Coarse, share: Duration, opts: &PlaceOptions, best: &mut Incumbent) {
    solve_coarse_instances(std::slice::from_ref(c), share, opts, best);
}

/// Plans the coarse instances `cs` side by side within `share`, each on its share of
/// `opts.threads`, and keeps the lowest plan when it is lower than `best`; returns the index
/// of the instance that planned lowest (the first on a tie).
pub(super) fn solve_coarse_instances(
    cs: &[Coarse],
    share: Duration,
    opts: &PlaceOptions,
    best: &mut Incumbent,
) -> usize {
    // Each instance its share of the cores, the first any left over; one instance keeps the
    // caller's threads as given (0 is every core).
    let threads_of = |k: usize| match cs.len() {
        1 => opts.threads,
        len => (opts.threads / len + if k == 0 { opts.threads % len } else { 0 }).max(1),
    };
    let plans = run_workers(cs.len(), |k| {
        let sub = PlaceOptions {
            time_budget: share,
            scaled_budget_per_item: None,
            threads: threads_of(k),
            ..opts.clone()
        };
        place_for(&cs[k].buffers, &sub, PlanFor::Footprint, Mirror::Never).ok()
    });
    let Some((k, cp)) = plans
        .into_iter()
        .enumerate()
        .filter_map(|(k, cp)| cp.map(|cp| (k, cp)))
        .min_by_key(|(k, cp)| (cp.footprint, *k))
    else {
        return 0;
    };
    if cp.footprint < best.high {
        let c = &cs[k];
        let off = (0..c.member.len())
            .map(|i| {
                let (block, delta) = c.member[i];
                cp.offsets[block as usize] + delta
            })
            .collect();
        let which =
            if cs.len() > 1 { format!(", instance {} of {}", k + 1, cs.len()) } else { String::new() };
        best.offer(cp.footprint, off, format!("coarse({}{which}: {})", c.buffers.len(), cp.strategy));
    }
    k
}

/// Share of the time left after the coarse plan that [`refine_coarse`] takes on one core
/// (with more, it runs beside the improvement stage on the items: [`refine_beside`]); the
/// improvement stage on the items gets the rest. Measured with the two one after the other on
/// two cores (tilings of 100k pieces, 10 seeds, 1 s, 2-core VM, mean of the ratios over two or
/// three runs): 30% 1.0984–1.1009, 50% 1.0992–1.1011, 70% 1.1002–1.1018, 100%
/// 1.0996–1.1014, against 1.1042–1.1055 without the refinement. The shares lie within one
/// another's spread: more refinement lowers the hardest seeds further, and the improvement
/// on the items, left with less, lowers others less.
pub(super) const REFINE_SHARE: f64 = 0.5;

/// Refines a placement of `p` built from the coarse instance `c` (every item at its coarse
/// buffer's offset plus its delta), as a multilevel scheme does on its way back up: the
/// coarse buffers that reach above `lb` are split into their items, the others stay whole at
/// their offsets, and the improvement stage runs on that mixed instance until `until`. What
/// keeps a coarse plan high is most often a merge at the top that no placement at the bound
/// has (pieces stacked or chained that do not lie together there): on the mixed instance
/// those pieces move apart, while everything below moves as the blocks it was planned as.
/// Keeps the result in `best` when it is lower; returns the improvement stage's steps.
pub(super) fn refine_coarse(
    p: &Problem,
    c: &Coarse,
    lb: u64,
    until: Until<'_>,
    seed: u64,
    threads: usize,
    best: &mut Incumbent,
) -> u64 {
    let n = p.len();
    let blocks = c.buffers.len();
    let mut block_off = vec![0u64; blocks];
    for i in 0..n {
        let (k, delta) = c.member[i];
        block_off[k as usize] = best.off[i] - delta;
    }
    let split: Vec<bool> = (0..blocks).map(|k| block_off[k] + c.buffers[k].size > lb).collect();
    // The mixed instance: the whole blocks first, then the items of the split ones; each
    // buffer's offset in `best` comes along as the improvement stage's start.
    let mut buffers: Vec<Buffer> = Vec::with_capacity(blocks + n / 4);
    let mut start: Vec<u64> = Vec::with_capacity(blocks + n / 4);
    let mut whole_at = vec![u32::MAX; blocks];
    for k in (0..blocks).filter(|&k| !split[k]) {
        whole_at[k] = buffers.len() as u32;
        buffers.push(c.buffers[k]);
        start.push(block_off[k]);
    }
    // For every item: its buffer in the mixed instance.
    let mut mixed_of = vec![0u32; n];
    for i in 0..n {
        let k = c.member[i].0 as usize;
        if split[k] {
            mixed_of[i] = buffers.len() as u32;
            let (s, e) = p.ivs[i];
            buffers.push(Buffer { start: s as u64, end: e as u64, size: p.size[i], group: None });
            start.push(best.off[i]);
        } else {
            mixed_of[i] = whole_at[k];
        }
    }
    let Ok(q) = Problem::build(&buffers) else { return 0 };
    // Every buffer is live and of one interval, so each is an item of its own.
    let mut inc = Incumbent::new(best.high, vec![0; q.len()], String::new());
    for (b, &o) in start.iter().enumerate() {
        inc.off[q.item_of[b] as usize] = o;
    }
    let steps = improvement_chains(&q, lb, q.overlapping_pairs(), until, seed, threads, &mut inc);
    if inc.high < best.high {
        let off = (0..n)
            .map(|i| {
                let (k, delta) = c.member[i];
                let at = inc.off[q.item_of[mixed_of[i] as usize] as usize];
                if split[k as usize] { at } else { at + delta }
            })
            .collect();
        let name = format!("{}+refined", best.strategy);
        best.offer(inc.high, off, name);
    }
    steps
}

/// The coarse plan in `best` (see [`refine_coarse`]) refined on half the cores and improved
/// as it is, on the items, on the others, side by side until `deadline` (the first at the
/// bound stops the other); the lower result is kept. Each search's outcome varies a lot
/// between lists: on tilings of 100k pieces the refinement lowers some seeds by up to 2%, the
/// improvement on the items others by up to 0.7%, and run one after the other each had half
/// the time (medians 1.102–1.103 in three runs on two cores; side by side 1.0999–1.1051 in
/// nine). `threads` ≥ 2; returns the steps of both.
#[allow(clippy::too_many_arguments)]
pub(super) fn refine_beside(
    p: &Problem,
    c: &Coarse,
    lb: u64,
    pairs: u64,
    deadline: Instant,
    seed: u64,
    threads: usize,
    best: &mut Incumbent,
) -> u64 {
    let settled = AtomicBool::new(false);
    let until = Until::or_raised(deadline, &settled);
    let mut refined = best.clone();
    let refining = threads / 2;
    let steps = std::thread::scope(|scope| {
        // (Without a thread for it, the chains go on alone.)
        let refiner = spawn_beside(scope, || refine_coarse(p, c, lb, until, seed, refining, &mut refined));
        let steps = improvement_chains(p, lb, pairs, until, seed ^ 0x6974_656d, threads - refining, best);
        steps + refiner.map_or(0, |h| h.join().expect("the coarse plan's refinement panicked"))
    });
    best.offer(refined.high, refined.off, refined.strategy);
    steps
}

#[cfg(test)]
mod coarse_tests {
    use super::*;
    use proptest::prelude::*;

    /// The coarser instance.
    fn coarsen(p: &Problem, threads: usize, until: Instant) -> Coarse {
        let [coarser, _] = coarsen_both(p, threads, until);
        coarser
    }

    /// A placement of the coarse instance `c` of `b` (5 ms, one core) mapped back to the
    /// buffers, checked valid; and the coarse placement's footprint.
    fn placed_through(b: &[Buffer], p: &Problem, c: &Coarse) -> Result<(Vec<u64>, u64), TestCaseError> {
        let opts =
            PlaceOptions { time_budget: Duration::from_millis(5), threads: 1, ..PlaceOptions::default() };
        let cp = place(&c.buffers, &opts).unwrap();
        let offsets: Vec<u64> = (0..b.len())
            .map(|i| {
                let (k, d) = c.member[p.item_of[i] as usize];
                cp.offsets[k as usize] + d
            })
            .collect();
        verify(b, &offsets).map_err(|e| TestCaseError::fail(e.to_string()))?;
        Ok((offsets, cp.footprint))
    }

    /// A judge that refuses about one merge in three, at random.
    struct Coin(u64);

    impl Coin {
        fn toss(&mut self) -> bool {
            // xorshift64
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            !self.0.is_multiple_of(3)
        }
    }

    impl MergeJudge for Coin {
        fn chain(&mut self, _: &Block, _: &Block, _: u8) -> bool {
            self.toss()
        }
        fn stack(&mut self, _: &Block, _: &Block, _: u8) -> bool {
            self.toss()
        }
    }

    /// A deadline coarsening never meets.
    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Any valid placement of the coarse instance (either merge order, coarsened to the
        /// end or stopped early, with stacks kept apart by `Separating` or merges refused at
        /// random) maps back to a valid placement of the items with the same
        /// footprint, and coarsening keeps the live bound.
        #[test]
        fn coarse_placements_map_back(
            raw in prop::collection::vec((0u64..30, 1u64..10, 1u64..8), 1..60),
            coin in any::<u64>(),
        ) {
            let b: Vec<Buffer> = raw
                .into_iter()
                .map(|(start, len, size)| Buffer { start, end: start + len, size: size * 4, group: None })
                .collect();
            let p = Problem::build(&b).unwrap();
            // Coarsened to the end, and stopped after the first round.
            let orders = [MergeOrder::Stacks, MergeOrder::ChainingStacksFirst];
            for (order, until) in orders.into_iter().flat_map(|o| [(o, far()), (o, Instant::now())]) {
                let c = coarsen_in_order(&p, order, until);
                // Merges refused at random (as a judge may) leave a valid instance too.
                let refusing = coarsen_judged(&p, order, until, &mut Coin(coin | 1));
                prop_assert_eq!(live_bound(&refusing.buffers).unwrap(), p.lower_bound());
                placed_through(&b, &p, &refusing)?;
                // And so do the stacks kept apart where steps balance without them.
                let separated = coarsen_for_plan(&p, order, true, until);
                prop_assert_eq!(live_bound(&separated.buffers).unwrap(), p.lower_bound());
                placed_through(&b, &p, &separated)?;
                prop_assert!(c.buffers.len() <= p.len());
                prop_assert_eq!(live_bound(&c.buffers).unwrap(), p.lower_bound());
                let (offsets, coarse_footprint) = placed_through(&b, &p, &c)?;
                let high = (0..b.len()).map(|i| offsets[i] + b[i].size).max().unwrap_or(0);
                prop_assert_eq!(high, coarse_footprint);
                // Refining the plan (the blocks above the bound split) keeps it valid and
                // no higher, and reports its footprint.
                let mut inc = Incumbent::new(high, offsets, "coarse");
                let until = Until::at(Instant::now() + Duration::from_millis(2));
                refine_coarse(&p, &c, p.lower_bound(), until, 1, 1, &mut inc);
                verify(&b, &inc.off).map_err(|e| TestCaseError::fail(e.to_string()))?;
                let refined = (0..b.len()).map(|i| inc.off[i] + b[i].size).max().unwrap_or(0);
                prop_assert_eq!(refined, inc.high);
                prop_assert!(refined <= high);
            }
        }
    }

    /// Stacks by chance: where every item lives one rank, all but one of each rank's starters
    /// stack; where the `k` items starting at a rank each have a lifetime of their own, as
    /// many stack as `k` draws among `k` lifetimes repeat one (`k (1 − 1/k)^k`).
    #[test]
    fn chance_stacks_follow_the_lifetimes_shares() {
        let buffer = |start: u64, end: u64| Buffer { start, end, size: 512, group: None };
        // Three steps where four buffers of one step start: 3 × 3 stack.
        let alike: Vec<Buffer> = (0..12).map(|i| buffer(i / 4, i / 4 + 1)).collect();
        let p = Problem::build(&alike).unwrap();
        let got = chance_stacks(&p, &starts_per_rank(&p));
        assert!((got - 9.0).abs() < 1e-9, "{got}");
        // Twenty buffers starting together, ending at twenty ranks.
        let apart: Vec<Buffer> = (1..=20).map(|e| buffer(0, e)).collect();
        let p = Problem::build(&apart).unwrap();
        let want = 20.0 * 0.95f64.powi(20);
        let got = chance_stacks(&p, &starts_per_rank(&p));
        assert!((got - want).abs() < 1e-9, "{got} against {want}");
    }

    /// A plan that reaches the lower bound before the deadline does not depend on the
    /// clock: the same input and seed give the same offsets.
    #[test]
    fn plans_that_reach_the_bound_are_reproducible() {
        let opts = PlaceOptions { scaled_budget_per_item: None, ..PlaceOptions::default() };
        let mut reached = 0;
        for seed in 1..=6 {
            let b = crate::workload::packed(300, seed);
            let first = place(&b, &opts).unwrap();
            verify(&b, &first.offsets).unwrap();
            if first.footprint == first.lower_bound {
                reached += 1;
                assert_eq!(place(&b, &opts).unwrap().offsets, first.offsets, "seed {seed}");
            }
        }
        assert!(reached >= 3, "only {reached} of 6 packed lists reached the bound");
    }

    /// Skyline fills (tilings that need not split along any line) still coarsen to a few
    /// blocks, and are placed at their bound.
    #[test]
    fn skyline_fills_fit_at_their_bound() {
        for seed in 1..=3 {
            let b = crate::workload::packed_skyline(3000, seed);
            let p = place(&b, &uncapped(Duration::from_secs(10))).unwrap();
            verify(&b, &p.offsets).unwrap();
            assert_eq!(p.footprint, p.lower_bound, "seed {seed}: {}", p.strategy);
        }
    }

    /// Past its deadline coarsening stops after the first round: an instance between the
    /// list and the one coarsened to the end.
    #[test]
    fn coarsening_stops_at_its_deadline() {
        let p = Problem::build(&crate::workload::packed(30_000, 4)).unwrap();
        for order in [MergeOrder::Stacks, MergeOrder::ChainingStacksFirst] {
            let full = coarsen_in_order(&p, order, far()).buffers.len();
            let cut = coarsen_in_order(&p, order, Instant::now()).buffers.len();
            assert!(full < cut && cut < p.len(), "{order:?}: {full} coarsened to the end, {cut} stopped");
        }
    }

    /// A tiling of 3000 pieces, its coarse instance, and a plan of that instance by the
    /// constructions alone (above the bound), expanded to the pieces.
    fn poor_coarse_plan() -> (Vec<Buffer>, Problem, Coarse, Incumbent) {
        let b = crate::workload::packed(3000, 5);
        let p = Problem::build(&b).unwrap();
        let c = coarsen(&p, 1, far());
        let opts = PlaceOptions {
            time_budget: Duration::from_millis(100),
            threads: 1,
            improve: false,
            ..PlaceOptions::default()
        };
        let cp = place(&c.buffers, &opts).unwrap();
        assert!(
            cp.footprint > p.lower_bound(),
            "the constructions placed {} coarse buffers at the bound",
            c.buffers.len()
        );
        let off = (0..b.len())
            .map(|i| {
                let (k, d) = c.member[i];
                cp.offsets[k as usize] + d
            })
            .collect();
        (b, p, c, Incumbent::new(cp.footprint, off, "coarse"))
    }

    #[test]
    fn refining_lowers_a_coarse_plan_of_a_tiling() {
        let (b, p, c, mut inc) = poor_coarse_plan();
        let (lb, before) = (p.lower_bound(), inc.clone());
        let steps =
            refine_coarse(&p, &c, lb, Until::at(Instant::now() + Duration::from_millis(500)), 1, 1, &mut inc);
        verify(&b, &inc.off).unwrap();
        // The blocks that stayed below the bound moved whole: their members kept their
        // offsets inside them.
        let mut block_at: Vec<Option<u64>> = vec![None; c.buffers.len()];
        let mut whole = 0;
        for i in 0..b.len() {
            let (k, d) = c.member[i];
            if before.off[i] - d + c.buffers[k as usize].size <= lb {
                let at = inc.off[i] - d;
                assert_eq!(*block_at[k as usize].get_or_insert(at), at, "block {k} was split");
                whole += 1;
            }
        }
        assert!(whole > 0 && whole < b.len(), "{whole} of {} pieces in blocks below the bound", b.len());
        assert!(
            inc.high < before.high,
            "refinement left the coarse plan at {:.4} of the bound",
            before.high as f64 / lb as f64
        );
        assert_eq!(inc.strategy, "coarse+refined");
        assert!(steps > 0);
    }

    #[test]
    fn refining_beside_the_improvement_keeps_the_lower_plan() {
        let (b, p, c, mut inc) = poor_coarse_plan();
        let before = inc.high;
        let until = Instant::now() + Duration::from_millis(500);
        let steps = refine_beside(&p, &c, p.lower_bound(), p.overlapping_pairs(), until, 1, 2, &mut inc);
        verify(&b, &inc.off).unwrap();
        let high = (0..b.len()).map(|i| inc.off[i] + b[i].size).max().unwrap();
        assert_eq!(high, inc.high);
        assert!(inc.high < before, "neither search lowered the coarse plan");
        assert!(
            inc.strategy.ends_with("+refined") || inc.strategy.ends_with("+improved"),
            "{}",
            inc.strategy
        );
        assert!(steps > 0);
    }

    /// Both merge orders' instances, the coarser first, each one that any placement of its
    /// buffers expands into a placement of the items.
    #[test]
    fn both_coarse_instances_come_coarser_first() {
        let b = crate::workload::packed(3000, 5);
        let p = Problem::build(&b).unwrap();
        let both = coarsen_both(&p, 2, far());
        let separate = super::super::separation::applies(&p);
        let mut orders = [MergeOrder::Stacks, MergeOrder::ChainingStacksFirst]
            .map(|order| coarsen_for_plan(&p, order, separate, far()).buffers.len());
        orders.sort_unstable();
        assert_eq!(both.each_ref().map(|c| c.buffers.len()), orders);
        assert_eq!(coarsen(&p, 1, far()).buffers.len(), orders[0]);
        for c in &both {
            // The coarse buffers placed one above the other expand into a valid placement.
            let mut top = 0;
            let coarse_off: Vec<u64> = c
                .buffers
                .iter()
                .map(|x| {
                    top += x.size;
                    top - x.size
                })
                .collect();
            let off: Vec<u64> = (0..b.len())
                .map(|i| {
                    let (k, d) = c.member[p.item_of[i] as usize];
                    coarse_off[k as usize] + d
                })
                .collect();
            verify(&b, &off).unwrap();
        }
    }

    /// Instances planned side by side: the plan kept is valid, at the footprint it claims,
    /// and names the instance it came from.
    #[test]
    fn instances_side_by_side_give_a_valid_plan_named_by_its_instance() {
        let b = crate::workload::packed(3000, 5);
        let p = Problem::build(&b).unwrap();
        let cs = coarsen_both(&p, 2, far());
        let opts = PlaceOptions { threads: 2, ..PlaceOptions::default() };
        let mut best = Incumbent::new(u64::MAX, vec![0; p.len()], "none");
        let k = solve_coarse_instances(&cs, Duration::from_millis(300), &opts, &mut best);
        assert!(k < cs.len());
        assert!(best.strategy.starts_with(&format!(
            "coarse({}, instance {} of 2",
            cs[k].buffers.len(),
            k + 1
        )));
        let offsets: Vec<u64> = p.item_of.iter().map(|&i| best.off[i as usize]).collect();
        verify(&b, &offsets).unwrap();
        let high = (0..b.len()).map(|i| offsets[i] + b[i].size).max().unwrap();
        assert_eq!(high, best.high);
    }

    /// Two buffers of one size ending at one step, and two interchangeable ones (one
    /// lifetime, that size) starting there: each pair chains, whichever way they are paired,
    /// instead of the two starting ones stacking and neither chaining.
    #[test]
    fn interchangeable_hand_overs_chain() {
        let at = |start, end, size| Buffer { start, end, size, group: None };
        let b = [at(0, 4, 8), at(2, 4, 8), at(4, 9, 8), at(4, 9, 8), at(0, 9, 16)];
        let p = Problem::build(&b).unwrap();
        for order in [MergeOrder::Stacks, MergeOrder::ChainingStacksFirst] {
            let c = coarsen_in_order(&p, order, far());
            let block = |i: usize| c.member[p.item_of[i] as usize].0;
            assert_ne!(block(0), block(1), "{order:?}: the buffers ending at 4 were stacked");
            assert_ne!(block(2), block(3), "{order:?}: the interchangeable buffers were stacked");
            for ender in [0, 1] {
                assert!(
                    [2, 3].iter().any(|&j| block(j) == block(ender)),
                    "{order:?}: buffer {ender} chained to none"
                );
            }
        }
    }

    #[test]
    fn guillotine_instances_coarsen() {
        // A packed instance of 2000 pieces collapses to a small fraction of its size, and
        // its optimum (the lower bound) is then found within the default budget.
        let b = crate::workload::packed(2000, 11);
        let p = Problem::build(&b).unwrap();
        let c = coarsen(&p, 2, far());
        assert!(c.buffers.len() * 4 < b.len(), "{} coarse buffers", c.buffers.len());
    }

    /// Both merge orders give valid coarse instances (checked by mapping a placement back),
    /// the coarser one is kept, and on tilings the order that chains stacks first finds more
    /// structure.
    #[test]
    fn the_coarser_merge_order_is_kept() {
        let (mut plain, mut first) = (0, 0);
        for seed in 1..=3 {
            let b = crate::workload::packed(500, seed);
            let p = Problem::build(&b).unwrap();
            let separate = super::super::separation::applies(&p);
            let a = coarsen_for_plan(&p, MergeOrder::Stacks, separate, far());
            let c = coarsen_for_plan(&p, MergeOrder::ChainingStacksFirst, separate, far());
            assert_eq!(coarsen(&p, 2, far()).buffers.len(), a.buffers.len().min(c.buffers.len()));
            assert_eq!(coarsen(&p, 1, far()).buffers.len(), a.buffers.len().min(c.buffers.len()));
            for coarse in [&a, &c] {
                let cp = place(
                    &coarse.buffers,
                    &PlaceOptions {
                        time_budget: Duration::from_millis(5),
                        threads: 1,
                        ..PlaceOptions::default()
                    },
                )
                .unwrap();
                let offsets: Vec<u64> = (0..b.len())
                    .map(|i| {
                        let (k, d) = coarse.member[p.item_of[i] as usize];
                        cp.offsets[k as usize] + d
                    })
                    .collect();
                verify(&b, &offsets).unwrap();
            }
            plain += a.buffers.len();
            first += c.buffers.len();
        }
        assert!(first < plain, "chaining stacks first kept {first} coarse buffers, the plain order {plain}");
        // Large lists run the two orders on two threads: the same instance as one thread.
        let p = Problem::build(&crate::workload::packed(PARALLEL_COARSEN_ITEMS + 1000, 4)).unwrap();
        assert!(p.len() >= PARALLEL_COARSEN_ITEMS);
        let (one, two) = (coarsen(&p, 1, far()), coarsen(&p, 2, far()));
        assert_eq!((one.buffers, one.member), (two.buffers, two.member));
    }

    fn blocks(list: &[(u32, u32, u64)]) -> Vec<Block> {
        list.iter().enumerate().map(|(k, &(s, e, size))| Block { s, e, size, root: k as u32 }).collect()
    }

    /// Pairs [`pair_by_lifetime`] links in `cur` on `evidence`, as (ender, starter).
    fn pairs_on(cur: &[Block], evidence: Evidence) -> Vec<(u32, u32)> {
        let mut keys = KeyMap::default();
        hand_over_keys(cur, &mut keys);
        let mut succ = vec![NO_SUCC; cur.len()];
        let mut has_pred = vec![false; cur.len()];
        pair_by_lifetime(cur, &keys, evidence, &mut succ, &mut has_pred);
        let links: Vec<(u32, u32)> = (0..cur.len() as u32)
            .filter(|&k| succ[k as usize] != NO_SUCC)
            .map(|k| (k, succ[k as usize]))
            .collect();
        assert_eq!(links.len(), has_pred.iter().filter(|&&x| x).count());
        links
    }

    fn lifetime_pairs(cur: &[Block]) -> Vec<(u32, u32)> {
        pairs_on(cur, Evidence::Lifetime)
    }

    #[test]
    fn a_lifetime_already_there_decides_a_hand_over() {
        // At rank 2, blocks of size 1 end (0: [0, 2), 1: [1, 2)) and start (2: [2, 4), 3:
        // [2, 3)), neither side interchangeable. Block 4 spans [0, 4): 0 then 2 would too.
        let cur = blocks(&[(0, 2, 1), (1, 2, 1), (2, 4, 1), (2, 3, 1), (0, 4, 1)]);
        assert_eq!(lifetime_pairs(&cur), vec![(0, 2)]);
        // A block over [1, 4) as well: starter 2 would span a lifetime there after either
        // ender, so nothing is decided.
        let cur = blocks(&[(0, 2, 1), (1, 2, 1), (2, 4, 1), (2, 3, 1), (0, 4, 1), (1, 4, 2)]);
        assert_eq!(lifetime_pairs(&cur), vec![]);
        // A key that pairs on its own (one of each) is left to the round's chaining.
        let cur = blocks(&[(0, 2, 1), (2, 4, 1), (0, 4, 1)]);
        assert_eq!(lifetime_pairs(&cur), vec![]);
    }

    #[test]
    fn crowded_keys_are_left_undecided() {
        // 40 blocks end at rank 50 and 40 start there, one size, all different lifetimes; a
        // block spans [0, 100), the lifetime of the first ender chained to the first starter.
        let mut list: Vec<(u32, u32, u64)> = (0..40).map(|k| (k, 50, 1)).collect();
        list.extend((0..40).map(|k| (50, 100 + k, 1)));
        list.push((0, 100, 7));
        assert_eq!(lifetime_pairs(&blocks(&list)), vec![]);
        // Within the limit the same pairing is decided.
        let mut few: Vec<(u32, u32, u64)> = (0..20).map(|k| (k, 50, 1)).collect();
        few.extend((0..20).map(|k| (50, 100 + k, 1)));
        few.push((0, 100, 7));
        const { assert!(40 * 40 > LIFETIME_PAIRING_MAX_CANDIDATES && 20 * 20 <= LIFETIME_PAIRING_MAX_CANDIDATES) };
        assert_eq!(lifetime_pairs(&blocks(&few)), vec![(0, 20)]);
    }

    #[test]
    fn the_next_merge_must_follow_where_asked() {
        // As above: 0 then 2 would span [0, 4), as block 4 does; with it 2 bytes, which no
        // block ends with at rank 0 or starts with at rank 4.
        let base = [(0, 2, 1), (1, 2, 1), (2, 4, 1), (2, 3, 1), (0, 4, 1)];
        assert_eq!(pairs_on(&blocks(&base), Evidence::NextMerge), vec![]);
        // A block of 2 bytes from rank 4 on: the stack of [0, 4) would chain with it.
        let mut more = base.to_vec();
        more.push((4, 6, 2));
        assert_eq!(pairs_on(&blocks(&more), Evidence::NextMerge), vec![(0, 2)]);
        // One of 3 bytes does not add up.
        more[5] = (4, 6, 3);
        assert_eq!(pairs_on(&blocks(&more), Evidence::NextMerge), vec![]);
    }

    #[test]
    fn undecided_hand_overs_are_common_where_sizes_repeat() {
        use crate::workload::{Tiling, packed_tiling};
        let share = |shape: &Tiling, seed| {
            let b = packed_tiling(10_000, seed, shape);
            let p = Problem::build(&b).unwrap();
            let cur = Block::items(&p);
            let mut keys = KeyMap::default();
            hand_over_keys(&cur, &mut keys);
            undecided_keys(&keys) * LIFETIME_PAIRING_SHARE >= p.len()
        };
        for seed in 1..=3 {
            assert!(share(&Tiling { halves: true, ..Tiling::default() }, seed), "halves, seed {seed}");
            assert!(!share(&Tiling::default(), seed), "cut anywhere, seed {seed}");
            assert!(
                !share(&Tiling { horizon_per_piece: 1, ..Tiling::default() }, seed),
                "one step, seed {seed}"
            );
        }
    }

    /// The merge rules do not depend on the direction of the clock: the mirror image of a
    /// tiling coarsens to the mirror image of its coarse instance, in either merge order.
    /// (Not on every tiling whose sizes repeat: where two identical blocks are interchangeable
    /// starters at one key and interchangeable enders at the next, the round chains through
    /// them in the order of their indices, which the mirror image reverses.)
    #[test]
    fn the_mirror_image_coarsens_to_the_mirror_image() {
        use crate::workload::{Tiling, packed_tiling};
        let shapes = [Tiling::default(), Tiling { horizon_per_piece: 1, ..Tiling::default() }];
        for (shape, seed) in shapes.iter().flat_map(|s| (1..=5).map(move |seed| (s, seed))) {
            let b = packed_tiling(3000, seed, shape);
            let end = b.iter().map(|x| x.end).max().unwrap();
            let m: Vec<Buffer> =
                b.iter().map(|x| Buffer { start: end - x.end, end: end - x.start, ..*x }).collect();
            let (p, q) = (Problem::build(&b).unwrap(), Problem::build(&m).unwrap());
            for order in [MergeOrder::Stacks, MergeOrder::ChainingStacksFirst] {
                // Blocks over the compressed clock, run backwards when `flip`.
                let shape_of = |c: &Coarse, flip: bool| {
                    let last = c.buffers.iter().map(|x| x.end).max().unwrap();
                    let mut v: Vec<(u64, u64, u64)> = c
                        .buffers
                        .iter()
                        .map(|x| {
                            if flip {
                                (last - x.end, last - x.start, x.size)
                            } else {
                                (x.start, x.end, x.size)
                            }
                        })
                        .collect();
                    v.sort_unstable();
                    v
                };
                let (c, d) = (coarsen_in_order(&p, order, far()), coarsen_in_order(&q, order, far()));
                assert!(c.buffers.len() < p.len(), "{shape:?} seed {seed}: nothing merged");
                assert_eq!(shape_of(&c, false), shape_of(&d, true), "{shape:?} seed {seed} {order:?}");
            }
        }
    }
}
