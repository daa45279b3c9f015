//! Repeated parts: where no buffer is live across a moment of the clock, a list falls into
//! parts that share no moment, and where some of those parts are the same buffers shifted in
//! time (a trace of repeated iterations), one copy of each is enough to plan: any placement
//! of the copies is one of every part like it, with the same footprint. Planned as one list,
//! every copy's peak has to be brought down at once, and the search, which lowers one stretch
//! of the clock at a time, reaches few of them (ten iterations of 1000 random buffers, ten
//! seeds: median 1.031 of the bound planned whole, 1.005 from one copy). The list of the
//! distinct parts, one after the other on the clock, is planned with the whole list's
//! budget. Buffers live through most of the trace (weights, gradients, optimizer state) would
//! join every part into one: they are set aside and planned beside the copies as buffers live
//! throughout, which loses nothing where every distinct part has a copy inside all their
//! lifetimes ([`split`]).

use super::*;

/// Parts of fewer buffers join the part before them (the first part, the one after it): a
/// list cut every few buffers is compared in pieces of some size, and iterations with cuts
/// inside them still come out as runs of parts that are alike.
const MIN_PART_BUFFERS: usize = 64;

/// At most about this many parts: smaller ones join up in order of time.
const MAX_PARTS: usize = 256;

/// A list split into parts that share no moment ([`split`]).
pub(super) struct Split {
    /// The distinct parts: their buffers (the clock shifted to start at 0, alias groups
    /// numbered in order of appearance), and how many parts of the list are each.
    distinct: Vec<(Vec<Buffer>, usize)>,
    /// Where every buffer goes.
    of: Vec<Home>,
    /// The sizes of the buffers set aside, planned as live throughout (see [`split`]).
    spanning: Vec<u64>,
    /// Parts of the list.
    parts: usize,
    /// Buffers live in the list (what its budget is capped by).
    intervals: usize,
}

/// Where a buffer of a [`Split`] list goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Home {
    /// Never live (or empty) and in no alias group with a live member: offset 0.
    Nowhere,
    /// Position `at` of distinct part `part`.
    Part { part: u32, at: u32 },
    /// The `k`th of the buffers set aside.
    Spanning(u32),
}

/// How many times [`split`] checks the buffers it would set aside against the hull of the
/// others (each check can send some back, which widens that hull).
const SPANNING_PASSES: usize = 4;

/// What a list's parts are made of: its items (lone live buffers, and alias groups with
/// their members that are never live).
struct Units {
    /// Every buffer's unit (`u32::MAX`: never live, in no group with a live member).
    unit_of: Vec<u32>,
    /// Every unit's hull of live members and its buffers: (start, end, buffers).
    hulls: Vec<(u64, u64, u32)>,
    /// Units that are one buffer of one interval (no alias group).
    lone: Vec<bool>,
}

impl Units {
    /// The units of `buffers`; `None` where a buffer ends before it starts.
    fn of(buffers: &[Buffer]) -> Option<Units> {
        let (unit_of, units, _) = number_items(buffers).ok()?;
        let mut hulls = vec![(u64::MAX, 0u64, 0u32); units as usize];
        let mut lone = vec![true; units as usize];
        for (b, &u) in buffers.iter().zip(&unit_of).filter(|(_, u)| **u != u32::MAX) {
            let h = &mut hulls[u as usize];
            if b.is_live() {
                h.0 = h.0.min(b.start);
                h.1 = h.1.max(b.end);
            }
            h.2 += 1;
            lone[u as usize] &= b.group.is_none();
        }
        Some(Units { unit_of, hulls, lone })
    }

    /// The hull of the units `keep` keeps.
    fn hull(&self, keep: impl Fn(usize) -> bool) -> Option<(u64, u64)> {
        let kept = self.hulls.iter().enumerate().filter(|&(u, _)| keep(u));
        kept.fold(None, |acc, (_, h)| {
            Some(acc.map_or((h.0, h.1), |(s, e): (u64, u64)| (s.min(h.0), e.max(h.1))))
        })
    }
}

/// The parts of `buffers`, where there are two or more of at least [`MIN_PART_BUFFERS`]
/// buffers each and some are copies of others; `None` otherwise, and where a buffer ends
/// before it starts (the plan of the whole list reports that).
///
/// Lone buffers live over half the clock or more (weights, gradients and optimizer state
/// through a trace of iterations) are set aside first: they would join every part into one.
/// They are planned as buffers live throughout the list of distinct parts, which loses
/// nothing where every distinct part has a copy inside the lifetimes of all of them (at such
/// a copy they are all live, so a placement of the list needs as many bytes as the distinct
/// part with them stacked under it; and stacking buffers live throughout under a placement
/// costs nothing). Where some distinct part has no such copy, only the buffers live
/// throughout the hull of everything else are set aside.
pub(super) fn split(buffers: &[Buffer]) -> Option<Split> {
    if buffers.len() < 2 * MIN_PART_BUFFERS {
        return None;
    }
    let units = Units::of(buffers)?;
    let hulls = &units.hulls;
    let (t0, t1) = units.hull(|_| true)?;
    let long: Vec<bool> =
        (0..hulls.len()).map(|u| units.lone[u] && hulls[u].1 - hulls[u].0 >= (t1 - t0).div_ceil(2)).collect();
    // All of them live at once over [latest start, earliest end).
    let within = (0..hulls.len())
        .filter(|&u| long[u])
        .fold((t0, t1), |(s, e), u| (s.max(hulls[u].0), e.min(hulls[u].1)));
    match parts_beside(buffers, &units, &long, within) {
        Parted::Split(split) => return Some(split),
        Parted::NoCopies => return None,
        Parted::NotWithin => {}
    }
    // Those live throughout the hull of the others: one that is not goes back to them, which
    // can widen that hull, until none goes back (within `SPANNING_PASSES`, else none).
    let mut spanning = long;
    let mut settled = false;
    for _ in 0..SPANNING_PASSES {
        let Some((s, e)) = units.hull(|u| !spanning[u]) else { break };
        let mut back = false;
        for (u, set) in spanning.iter_mut().enumerate() {
            if *set && !(hulls[u].0 <= s && hulls[u].1 >= e) {
                *set = false;
                back = true;
            }
        }
        if !back {
            settled = true;
            break;
        }
    }
    if !settled {
        spanning.fill(false);
    }
    match parts_beside(buffers, &units, &spanning, (t0, t1)) {
        Parted::Split(split) => Some(split),
        Parted::NoCopies | Parted::NotWithin => None,
    }
}

/// What [`parts_beside`] found.
enum Parted {
    Split(Split),
    /// Fewer than two parts, or no part a copy of another.
    NoCopies,
    /// Copies, but some distinct part has none inside the interval asked for.
    NotWithin,
}

/// The parts of `buffers` with the units marked in `set_aside` set aside (see [`split`]),
/// where every distinct part has a copy inside `within`.
fn parts_beside(buffers: &[Buffer], units: &Units, set_aside: &[bool], within: (u64, u64)) -> Parted {
    let n = buffers.len();
    let Units { unit_of, hulls, .. } = units;
    // Components of the clock: a unit starting at or after the end of every unit before it
    // starts a new one. Components join into parts of at least `min_part` buffers.
    let mut by_start: Vec<(u64, u32)> =
        hulls.iter().enumerate().filter(|&(u, _)| !set_aside[u]).map(|(u, h)| (h.0, u as u32)).collect();
    by_start.sort_unstable();
    let min_part = MIN_PART_BUFFERS.max(n / MAX_PARTS);
    let mut part_of_unit = vec![u32::MAX; hulls.len()];
    // Per part: buffers, first start, last end, bytes — parts alike in these may be copies.
    let mut outline: Vec<(usize, u64, u64, u64)> = Vec::new();
    let mut reach = 0u64;
    for &(s, u) in &by_start {
        let (_, e, count) = hulls[u as usize];
        let fresh = match outline.last() {
            None => true,
            Some(&(buffers, ..)) => s >= reach && buffers >= min_part,
        };
        if fresh {
            outline.push((0, s, 0, 0));
        }
        reach = reach.max(e);
        let last = outline.len() - 1;
        let o = &mut outline[last];
        o.0 += count as usize;
        o.2 = reach;
        part_of_unit[u as usize] = last as u32;
    }
    // The last part, if small, joins the one before it.
    if outline.len() >= 2 && outline[outline.len() - 1].0 < min_part {
        let last = outline.pop().expect("two parts");
        let k = outline.len() - 1;
        part_of_unit.iter_mut().filter(|p| **p as usize == outline.len()).for_each(|p| *p = k as u32);
        outline[k].0 += last.0;
        outline[k].2 = last.2;
    }
    let parts = outline.len();
    if parts < 2 {
        return Parted::NoCopies;
    }
    for (b, &u) in buffers.iter().zip(unit_of).filter(|(_, u)| **u != u32::MAX && !set_aside[**u as usize]) {
        let o = &mut outline[part_of_unit[u as usize] as usize];
        o.3 = o.3.wrapping_add(b.size);
    }
    let mut shapes: Vec<(usize, u64, u64)> = outline.iter().map(|&(k, s, e, z)| (k, e - s, z)).collect();
    shapes.sort_unstable();
    if shapes.windows(2).all(|w| w[0] != w[1]) {
        return Parted::NoCopies;
    }
    // Each part in a canonical form: its buffers sorted by (start, end, size) from the part's
    // first start, groups renumbered in that order; equal forms are one distinct part.
    let mut members: Vec<Vec<u32>> = vec![Vec::new(); parts];
    let mut of = vec![Home::Nowhere; n];
    let mut spanning = Vec::new();
    for (i, &u) in unit_of.iter().enumerate().filter(|(_, u)| **u != u32::MAX) {
        if set_aside[u as usize] {
            of[i] = Home::Spanning(spanning.len() as u32);
            spanning.push(buffers[i].size);
        } else {
            members[part_of_unit[u as usize] as usize].push(i as u32);
        }
    }
    let mut index: HashMap<Vec<Buffer>, u32> = HashMap::new();
    let mut copies: Vec<usize> = Vec::new();
    // Whether each distinct part has a copy inside `within`.
    let mut inside: Vec<bool> = Vec::new();
    for (p, mut m) in members.into_iter().enumerate() {
        let t0 = m.iter().map(|&i| &buffers[i as usize]).filter(|b| b.is_live()).map(|b| b.start).min();
        let t0 = t0.expect("every part holds a live buffer");
        let shifted = |b: &Buffer| if b.is_live() { (b.start - t0, b.end - t0) } else { (0, 0) };
        m.sort_by_key(|&i| {
            let b = &buffers[i as usize];
            (shifted(b), b.size, b.group.is_some(), i)
        });
        let mut renumbered: HashMap<u32, u32> = HashMap::new();
        let canonical: Vec<Buffer> = m
            .iter()
            .map(|&i| {
                let b = &buffers[i as usize];
                let (start, end) = shifted(b);
                let fresh = renumbered.len() as u32;
                let group = b.group.map(|g| *renumbered.entry(g).or_insert(fresh));
                Buffer { start, end, size: b.size, group }
            })
            .collect();
        let fresh = index.len() as u32;
        let d = *index.entry(canonical).or_insert(fresh);
        if d == fresh {
            copies.push(0);
            inside.push(false);
        }
        copies[d as usize] += 1;
        inside[d as usize] |= within.0 <= outline[p].1 && outline[p].2 <= within.1;
        for (at, &i) in m.iter().enumerate() {
            of[i as usize] = Home::Part { part: d, at: at as u32 };
        }
    }
    if index.len() == parts {
        return Parted::NoCopies;
    }
    if inside.contains(&false) {
        return Parted::NotWithin;
    }
    let mut distinct = vec![(Vec::new(), 0); index.len()];
    for (canonical, d) in index {
        distinct[d as usize] = (canonical, copies[d as usize]);
    }
    let intervals = buffers.iter().filter(|b| b.is_live()).count();
    Parted::Split(Split { distinct, of, spanning, parts, intervals })
}

/// Plans a list from its `split` (begun at `began`; see the module documentation) within the
/// budget `opts` give the whole list: the distinct parts one after the other on the clock,
/// every copy of a part at its offsets.
pub(super) fn place_parts(
    split: Split,
    began: Instant,
    opts: &PlaceOptions,
) -> Result<Placement, PlaceError> {
    let Split { distinct, of, spanning, parts, intervals } = split;
    // The distinct parts, each from the end of the one before it.
    let mut first = Vec::with_capacity(distinct.len());
    let mut list: Vec<Buffer> = Vec::with_capacity(distinct.iter().map(|(part, _)| part.len()).sum());
    let mut groups = 0u32;
    let mut clock = 0u64;
    for (part, _) in &distinct {
        first.push(list.len());
        let part_groups = part.iter().filter_map(|b| b.group).max().map_or(0, |g| g + 1);
        let span = part.iter().map(|b| b.end).max().unwrap_or(0);
        list.extend(part.iter().map(|b| {
            let (start, end) = if b.is_live() { (b.start + clock, b.end + clock) } else { (0, 0) };
            Buffer { start, end, size: b.size, group: b.group.map(|g| g + groups) }
        }));
        groups += part_groups;
        clock += span;
    }
    // The buffers set aside, live throughout.
    let spanning_first = list.len();
    list.extend(spanning.iter().map(|&size| Buffer { start: 0, end: clock, size, group: None }));
    let budget = capped_budget(opts, intervals);
    let sub = PlaceOptions {
        time_budget: budget.saturating_sub(began.elapsed()),
        scaled_budget_per_item: None,
        ..opts.clone()
    };
    let split_took = began.elapsed();
    let mut plan = place_for(&list, &sub, PlanFor::Footprint, Mirror::Beside)?;
    let copied = of.iter().map(|home| match *home {
        Home::Nowhere => 0,
        Home::Part { part, at } => plan.offsets[first[part as usize] + at as usize],
        Home::Spanning(k) => plan.offsets[spanning_first + k as usize],
    });
    plan.offsets = copied.collect();
    plan.strategy = format!("parts({parts}, {} distinct: {})", distinct.len(), plan.strategy);
    plan.stages.insert(0, Stage { name: "parts".into(), elapsed: split_took, footprint: None });
    plan.elapsed = began.elapsed();
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// `n` buffers over steps 0..250, with `groups` alias groups of two members apart in time.
    fn iteration(n: usize, groups: u32, seed: u64) -> Vec<Buffer> {
        let mut rng = Rng::new(seed);
        let mut out: Vec<Buffer> = (0..n)
            .map(|_| {
                let start = rng.below(200);
                Buffer { start, end: start + rng.range(1, 50), size: rng.range(1, 4096) * 512, group: None }
            })
            .collect();
        for g in 0..groups {
            let size = rng.range(1, 4096) * 512;
            out.push(Buffer { start: 10 * g as u64, end: 10 * g as u64 + 5, size, group: Some(g) });
            out.push(Buffer { start: 150 + 10 * g as u64, end: 160 + 10 * g as u64, size, group: Some(g) });
        }
        out
    }

    /// `copies` of `part`, each `period` steps after the one before (alias groups numbered
    /// apart), in shuffled order; with each buffer's copy and its position in `part`.
    fn repeated(
        part: &[Buffer],
        copies: usize,
        period: u64,
        seed: u64,
    ) -> (Vec<Buffer>, Vec<(usize, usize)>) {
        let mut out = Vec::new();
        for c in 0..copies {
            for (k, b) in part.iter().enumerate() {
                let shift = |t: u64| t + c as u64 * period;
                let group = b.group.map(|g| g + 1000 * c as u32);
                out.push((Buffer { start: shift(b.start), end: shift(b.end), group, ..*b }, (c, k)));
            }
        }
        let mut rng = Rng::new(seed);
        for i in (1..out.len()).rev() {
            out.swap(i, rng.below(i as u64 + 1) as usize);
        }
        out.into_iter().unzip()
    }

    fn opts() -> PlaceOptions {
        PlaceOptions { time_budget: Duration::from_millis(40), threads: 2, ..PlaceOptions::default() }
    }

    #[test]
    fn copies_of_a_part_are_planned_once_at_the_same_offsets() {
        let part = iteration(300, 4, 1);
        let (list, at) = repeated(&part, 8, 260, 2);
        let split = split(&list).expect("eight copies apart in time");
        assert_eq!((split.parts, split.distinct.len()), (8, 1));
        let placed = place(&list, &opts()).unwrap();
        verify(&list, &placed.offsets).unwrap();
        assert!(placed.strategy.starts_with("parts(8, 1 distinct: "), "{}", placed.strategy);
        assert_eq!(placed.stages[0].name, "parts");
        assert_eq!(placed.live_bound, live_bound(&part).unwrap());
        assert!(placed.footprint >= placed.lower_bound && placed.lower_bound >= placed.live_bound);
        // Every copy is laid out as the first: the same (start, end, size, offset) rows.
        let rows = |c: usize| {
            let mut r: Vec<(u64, u64, u64, u64)> = (0..list.len())
                .filter(|&i| at[i].0 == c)
                .map(|i| {
                    let b = list[i];
                    (b.start - 260 * c as u64, b.end - 260 * c as u64, b.size, placed.offsets[i])
                })
                .collect();
            r.sort_unstable();
            r
        };
        for c in 1..8 {
            assert_eq!(rows(c), rows(0), "copy {c}");
        }
    }

    #[test]
    fn parts_that_differ_are_planned_each_and_a_list_of_distinct_parts_whole() {
        let part = iteration(200, 2, 3);
        let (mut list, at) = repeated(&part, 5, 300, 4);
        // The third copy's first buffer grows: that copy is a part of its own.
        let i = at.iter().position(|&x| x == (2, 0)).unwrap();
        list[i].size += 512;
        let split = split(&list).expect("four copies alike");
        assert_eq!((split.parts, split.distinct.len()), (5, 2));
        let mut copies: Vec<usize> = split.distinct.iter().map(|(_, c)| *c).collect();
        copies.sort_unstable();
        assert_eq!(copies, [1, 4]);
        let placed = place(&list, &opts()).unwrap();
        verify(&list, &placed.offsets).unwrap();
        assert!(placed.strategy.starts_with("parts(5, 2 distinct: "), "{}", placed.strategy);
        // Five different parts: nothing to share, the list is planned whole.
        let distinct: Vec<Buffer> = (0..5u64)
            .flat_map(|c| {
                iteration(200, 0, 10 + c).into_iter().map(move |b| Buffer {
                    start: b.start + 300 * c,
                    end: b.end + 300 * c,
                    ..b
                })
            })
            .collect();
        assert!(split_none(&distinct));
        assert!(!place(&distinct, &opts()).unwrap().strategy.starts_with("parts("));
        // One stretch of the clock: no parts.
        assert!(split_none(&iteration(500, 3, 5)));
    }

    fn split_none(list: &[Buffer]) -> bool {
        split(list).is_none()
    }

    #[test]
    fn buffers_live_through_every_part_are_set_aside() {
        // Eight iterations beside the weights and the optimizer state, live throughout (one
        // past the last iteration's end).
        let part = iteration(200, 2, 11);
        let (mut list, _) = repeated(&part, 8, 260, 12);
        let end = 8 * 260;
        list.push(Buffer { start: 0, end, size: 96 << 20, group: None });
        list.push(Buffer { start: 0, end: end + 7, size: 32 << 20, group: None });
        let parts = split(&list).expect("the iterations are copies once the two are set aside");
        assert_eq!(parts.spanning, [96 << 20, 32 << 20]);
        assert_eq!((parts.parts, parts.distinct.len()), (8, 1));
        let placed = place(&list, &opts()).unwrap();
        verify(&list, &placed.offsets).unwrap();
        assert!(placed.strategy.starts_with("parts(8, 1 distinct: "), "{}", placed.strategy);
        assert_eq!(placed.live_bound, live_bound(&list).unwrap());
        // A buffer live through all but the first iteration is set aside too: the second to
        // the eighth lie inside all three lifetimes.
        let mut longer = list.clone();
        longer.push(Buffer { start: 260, end, size: 8 << 20, group: None });
        let parts = split(&longer).unwrap();
        assert_eq!((parts.spanning.len(), parts.parts, parts.distinct.len()), (3, 8, 1));
        let placed = place(&longer, &opts()).unwrap();
        verify(&longer, &placed.offsets).unwrap();
        assert_eq!(placed.live_bound, live_bound(&longer).unwrap());
        // Unless the first iteration is one of its kind (a warm-up): then nothing shows what
        // it needs beside that buffer, which joins the other seven into one part.
        let first = longer.iter().position(|b| b.start < 260 && b.group.is_none() && b.end < 260).unwrap();
        longer[first].size += 512;
        assert!(split_none(&longer));
        // Without that buffer, the warm-up is a part of its own beside seven copies.
        longer.pop();
        let parts = split(&longer).unwrap();
        assert_eq!((parts.spanning.len(), parts.parts, parts.distinct.len()), (2, 8, 2));
        let placed = place(&longer, &opts()).unwrap();
        verify(&longer, &placed.offsets).unwrap();
        // Nor is an alias group, however far apart its members: it spans every iteration.
        list.push(Buffer { start: 0, end: 3, size: 1 << 20, group: Some(7777) });
        list.push(Buffer { start: end - 3, end, size: 1 << 20, group: Some(7777) });
        assert!(split_none(&list));
    }

    #[test]
    fn clocks_near_the_end_of_u64_are_split_alike() {
        let part = iteration(100, 1, 13);
        let (mut list, _) = repeated(&part, 3, 1 << 62, 14);
        list.push(Buffer { start: 0, end: u64::MAX, size: 1 << 30, group: None });
        let split = split(&list).expect("three copies beside a buffer live throughout");
        assert_eq!((split.spanning.len(), split.parts, split.distinct.len()), (1, 3, 1));
        let placed = place(&list, &opts()).unwrap();
        verify(&list, &placed.offsets).unwrap();
    }

    #[test]
    fn small_parts_join_their_neighbours_and_stay_alike() {
        // 30 iterations of 21 buffers (one live through the iteration): parts of four
        // iterations (84 ≥ 64 buffers), the last two joining the part before them.
        let mut part = iteration(20, 0, 6);
        part.push(Buffer { start: 0, end: 250, size: 512, group: None });
        let (list, _) = repeated(&part, 30, 260, 7);
        let split = split(&list).expect("parts of four iterations");
        assert_eq!(split.parts, 7);
        let mut sizes: Vec<(usize, usize)> = split.distinct.iter().map(|(b, c)| (b.len(), *c)).collect();
        sizes.sort_unstable();
        assert_eq!(sizes, [(84, 6), (126, 1)]);
        let placed = place(&list, &opts()).unwrap();
        verify(&list, &placed.offsets).unwrap();
    }

    #[test]
    fn buffers_never_live_follow_their_group_or_go_at_zero() {
        let mut part = iteration(100, 3, 8);
        // Never live: one in group 1 (it takes the group's offset), one alone (offset 0),
        // and an empty one in group 2.
        part.push(Buffer { start: 40, end: 40, size: 1 << 20, group: Some(1) });
        part.push(Buffer { start: 70, end: 70, size: 1 << 20, group: None });
        part.push(Buffer { start: 20, end: 90, size: 0, group: Some(2) });
        let (list, _) = repeated(&part, 4, 260, 9);
        assert_eq!(split(&list).map(|s| (s.parts, s.distinct.len())), Some((4, 1)));
        let placed = place(&list, &opts()).unwrap();
        verify(&list, &placed.offsets).unwrap();
        for (i, b) in list.iter().enumerate() {
            if b.start == b.end && b.group.is_none() {
                assert_eq!(placed.offsets[i], 0);
            }
        }
        // A buffer that ends before it starts is reported as for any list.
        let mut reversed = list.clone();
        reversed[5] = Buffer { start: 9, end: 3, size: 1, group: None };
        assert!(split_none(&reversed));
        assert_eq!(
            place(&reversed, &opts()).unwrap_err(),
            PlaceError::Reversed { index: 5, start: 9, end: 3 }
        );
    }
}
