//! PQ-trees (Booth and Lueker) over small sets of leaves: every order of the leaves in which
//! the sets asked for so far are consecutive. A P-node's children may come in any order, a
//! Q-node's only as they are or reversed. [`Pq::reduce_replace`] asks for one more set to
//! be consecutive, puts other leaves in its place and says which order it left the set in;
//! [`Pq::frontier_near`] reads one order of all the leaves out, as close as the tree allows
//! to given positions. Recursive and allocating: meant for
//! trees of tens to hundreds of leaves (the buffers live at one step of a list).

use std::rc::Rc;

/// A PQ-tree, or a subtree of one. Subtrees are shared, so a clone costs one count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Pq {
    /// One leaf (a buffer's item).
    Leaf(u32),
    /// Children in any order (two or more).
    P(Rc<Vec<Pq>>),
    /// Children in this order or reversed (three or more).
    Q(Rc<Vec<Pq>>),
}

/// What a subtree holds of the set being made consecutive.
enum Arranged {
    /// None of it: the subtree as it was.
    Empty(Pq),
    /// Only leaves of the set: these, in an order the subtree allows.
    Full(Vec<u32>),
    /// Both: the subtree becomes these children followed by the set's leaves (a Q-node, the
    /// set at its end), in this order.
    Partial(Vec<Pq>, Vec<u32>),
}

/// The order a reduction left a set in: the set's leaves in an order the tree allows, and a
/// leaf outside the set on the side where that order begins (`true`) or ends (`false`); with
/// no such leaf the set's order is free. The order read from the anchor's side is the
/// order of the set outward from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SetOrder {
    /// The set's leaves.
    pub(super) set: Vec<u32>,
    /// A leaf outside the set, and whether it lies where `set` begins.
    pub(super) anchor: Option<(u32, bool)>,
}

impl Pq {
    /// A node over `children`: none, the one child, or a P-node.
    pub(super) fn group(mut children: Vec<Pq>) -> Option<Pq> {
        match children.len() {
            0 => None,
            1 => children.pop(),
            _ => Some(Pq::P(Rc::new(children))),
        }
    }

    /// A Q-node over `children`, as few levels as that takes (two children make a P-node).
    fn sequence(mut children: Vec<Pq>) -> Option<Pq> {
        match children.len() {
            0 => None,
            1 => children.pop(),
            2 => Some(Pq::P(Rc::new(children))),
            _ => Some(Pq::Q(Rc::new(children))),
        }
    }

    /// The number of leaves of the subtree for which `inside` holds, and of all its leaves.
    fn count(&self, inside: &impl Fn(u32) -> bool) -> (usize, usize) {
        match self {
            Pq::Leaf(x) => (usize::from(inside(*x)), 1),
            Pq::P(c) | Pq::Q(c) => c.iter().fold((0, 0), |(a, b), x| {
                let (i, n) = x.count(inside);
                (a + i, b + n)
            }),
        }
    }

    /// The leaves of the smallest subtree holding every leaf of the set (`inside`, `set` of
    /// them in all): where a reduction of that set looks.
    pub(super) fn pertinent_leaves(&self, inside: &impl Fn(u32) -> bool, set: usize, out: &mut Vec<u32>) {
        if let Pq::P(c) | Pq::Q(c) = self
            && let Some(child) = c.iter().find(|x| x.count(inside).0 == set)
        {
            return child.pertinent_leaves(inside, set, out);
        }
        self.leaves(out);
    }

    /// Every leaf, in the tree's order.
    pub(super) fn leaves(&self, out: &mut Vec<u32>) {
        match self {
            Pq::Leaf(x) => out.push(*x),
            Pq::P(c) | Pq::Q(c) => c.iter().for_each(|x| x.leaves(out)),
        }
    }

    /// The tree with the `set` leaves (`inside`, `set` of them in all) made consecutive and
    /// replaced by `with` (removed when `None`); `None` when no order the tree allows has
    /// them consecutive; with it, the order the set was left in ([`SetOrder`]). `self` is
    /// left as it was either way.
    pub(super) fn reduce_replace(
        &self,
        inside: &impl Fn(u32) -> bool,
        set: usize,
        with: Option<Pq>,
    ) -> Option<(Option<Pq>, SetOrder)> {
        if set == 0 {
            return None;
        }
        let (held, all) = self.count(inside);
        if held != set {
            return None;
        }
        if held == all {
            let mut leaves = Vec::with_capacity(all);
            self.leaves(&mut leaves);
            return Some((with, SetOrder { set: leaves, anchor: None }));
        }
        let (tree, order) = self.at_root(inside, set, with)?;
        Some((Some(tree), order))
    }

    /// Any leaf of the subtree (its first).
    fn any_leaf(&self) -> u32 {
        match self {
            Pq::Leaf(x) => *x,
            Pq::P(c) | Pq::Q(c) => c[0].any_leaf(),
        }
    }

    /// [`Pq::reduce_replace`] below the root of the whole set (the deepest node holding all
    /// of it, not all leaves of the tree).
    fn at_root(&self, inside: &impl Fn(u32) -> bool, set: usize, with: Option<Pq>) -> Option<(Pq, SetOrder)> {
        let children = match self {
            Pq::Leaf(_) => unreachable!("a leaf holds all of a set or none"),
            Pq::P(c) | Pq::Q(c) => c,
        };
        // Children are counted until the set is found: one child holding all of it and more
        // is where the root lies (the others need no count), one child that is the set or a
        // set spread over several makes this node the root.
        let mut counts: Vec<(usize, usize)> = Vec::with_capacity(children.len());
        let mut held = 0;
        for (k, c) in children.iter().enumerate() {
            if held == set {
                counts.push((0, 0));
                continue;
            }
            let (h, n) = c.count(inside);
            if h == set && h < n {
                let mut out: Vec<Pq> = children.to_vec();
                let root;
                (out[k], root) = children[k].at_root(inside, set, with)?;
                let tree = match self {
                    Pq::P(_) => Pq::P(Rc::new(out)),
                    _ => Pq::Q(Rc::new(out)),
                };
                return Some((tree, root));
            }
            held += h;
            counts.push((h, n));
        }
        if held != set {
            return None;
        }
        let arranged: Vec<Arranged> = children
            .iter()
            .zip(&counts)
            .map(|(c, &(h, n))| c.arrange(inside, h, n))
            .collect::<Option<_>>()?;
        match self {
            Pq::P(_) => {
                let mut empty = Vec::new();
                let mut full: Vec<u32> = Vec::new();
                let mut partial: Vec<(Vec<Pq>, Vec<u32>)> = Vec::new();
                for a in arranged {
                    match a {
                        Arranged::Empty(c) => empty.push(c),
                        Arranged::Full(leaves) => full.extend(leaves),
                        Arranged::Partial(e, inner) => partial.push((e, inner)),
                    }
                }
                if partial.len() > 2 {
                    return None;
                }
                // [first partial's rest] set [second partial's rest, reversed]; the set runs
                // from the first partial's part of it through the full children to the
                // second's, reversed.
                let mut run: Vec<Pq> = Vec::new();
                let mut order = Vec::with_capacity(set);
                let mut parts = partial.into_iter();
                let mut anchor = None;
                if let Some((rest, inner)) = parts.next() {
                    anchor = rest.first().map(|c| (c.any_leaf(), true));
                    run.extend(rest);
                    order.extend(inner);
                }
                order.extend(full);
                run.extend(with);
                if let Some((mut rest, mut inner)) = parts.next() {
                    inner.reverse();
                    order.extend(inner);
                    rest.reverse();
                    run.extend(rest);
                }
                if let Some(block) = Pq::sequence(run) {
                    empty.push(block);
                }
                let tree = Pq::group(empty).expect("a root of a set keeps its other leaves");
                Some((tree, SetOrder { set: order, anchor }))
            }
            _ => {
                // Empty*, [partial], full*, [partial], empty*.
                let first = arranged.iter().position(|a| !matches!(a, Arranged::Empty(_)))?;
                let last = arranged.iter().rposition(|a| !matches!(a, Arranged::Empty(_)))?;
                if last > first + 1
                    && !arranged[first + 1..last].iter().all(|a| matches!(a, Arranged::Full(_)))
                {
                    return None;
                }
                let mut out: Vec<Pq> = Vec::new();
                let mut order = Vec::with_capacity(set);
                // Where the set goes in the sequence.
                let mut at = 0;
                for (k, a) in arranged.into_iter().enumerate() {
                    match a {
                        Arranged::Empty(c) => out.push(c),
                        Arranged::Full(leaves) => {
                            if k == first {
                                at = out.len();
                                out.extend(with.clone());
                            }
                            order.extend(leaves);
                        }
                        Arranged::Partial(e, inner) if k == first => {
                            out.extend(e);
                            at = out.len();
                            out.extend(with.clone());
                            order.extend(inner);
                        }
                        Arranged::Partial(mut e, mut inner) => {
                            inner.reverse();
                            order.extend(inner);
                            e.reverse();
                            out.extend(e);
                        }
                    }
                }
                // A leaf before the set in the sequence, or else one after it.
                let after = at + usize::from(with.is_some());
                let anchor = if at > 0 {
                    Some((out[0].any_leaf(), true))
                } else {
                    out.get(after).map(|c| (c.any_leaf(), false))
                };
                let tree = Pq::sequence(out).expect("a root of a set keeps its other leaves");
                Some((tree, SetOrder { set: order, anchor }))
            }
        }
    }

    /// How this subtree (holding `held` of the set among its `all` leaves) arranges to put
    /// the set at one end; `None` when it cannot.
    fn arrange(&self, inside: &impl Fn(u32) -> bool, held: usize, all: usize) -> Option<Arranged> {
        if held == 0 {
            return Some(Arranged::Empty(self.clone()));
        }
        if held == all {
            let mut leaves = Vec::with_capacity(all);
            self.leaves(&mut leaves);
            return Some(Arranged::Full(leaves));
        }
        let children = match self {
            Pq::Leaf(_) => unreachable!("a leaf holds all of a set or none"),
            Pq::P(c) | Pq::Q(c) => c,
        };
        let arranged: Vec<Arranged> = children
            .iter()
            .map(|c| {
                let (h, n) = c.count(inside);
                c.arrange(inside, h, n)
            })
            .collect::<Option<_>>()?;
        match self {
            Pq::P(_) => {
                let mut empty = Vec::new();
                let mut full: Vec<u32> = Vec::new();
                let mut partial: Option<(Vec<Pq>, Vec<u32>)> = None;
                for a in arranged {
                    match a {
                        Arranged::Empty(c) => empty.push(c),
                        Arranged::Full(leaves) => full.extend(leaves),
                        Arranged::Partial(e, inner) => {
                            if partial.replace((e, inner)).is_some() {
                                return None;
                            }
                        }
                    }
                }
                let mut out: Vec<Pq> = Pq::group(empty).into_iter().collect();
                let mut order = Vec::with_capacity(held);
                if let Some((rest, inner)) = partial {
                    out.extend(rest);
                    order.extend(inner);
                }
                order.extend(full);
                Some(Arranged::Partial(out, order))
            }
            _ => {
                // Empty*, [partial], full* in one of the two directions.
                let kinds: Vec<u8> = arranged
                    .iter()
                    .map(|a| match a {
                        Arranged::Empty(_) => 0,
                        Arranged::Partial(..) => 1,
                        Arranged::Full(_) => 2,
                    })
                    .collect();
                let partials = kinds.iter().filter(|&&k| k == 1).count();
                let forwards = kinds.windows(2).all(|w| w[0] <= w[1]) && partials <= 1;
                let backwards = kinds.windows(2).all(|w| w[0] >= w[1]) && partials <= 1;
                let mut arranged = arranged;
                if !forwards {
                    if !backwards {
                        return None;
                    }
                    arranged.reverse();
                }
                let mut out = Vec::new();
                let mut order = Vec::with_capacity(held);
                for a in arranged {
                    match a {
                        Arranged::Empty(c) => out.push(c),
                        Arranged::Full(leaves) => order.extend(leaves),
                        Arranged::Partial(e, inner) => {
                            out.extend(e);
                            order.extend(inner);
                        }
                    }
                }
                Some(Arranged::Partial(out, order))
            }
        }
    }

    /// One order of the leaves the tree allows, each node's children sorted by where `key`
    /// puts their leaves (by the lowest key, then the highest; a Q-node turned so that its
    /// ends go that way), appended to `out`.
    pub(super) fn frontier_near(&self, key: &impl Fn(u32) -> u64, out: &mut Vec<u32>) {
        let mut segments = Vec::new();
        let mut scratch = Vec::new();
        self.emit(key, out, &mut segments, &mut scratch);
    }

    /// [`Pq::frontier_near`] for one subtree, returning its (lowest, highest) key. Each
    /// node's children are written out in turn, their stretches of `out` noted on the
    /// `segments` stack, then put in order through `scratch`.
    fn emit(
        &self,
        key: &impl Fn(u32) -> u64,
        out: &mut Vec<u32>,
        segments: &mut Vec<((u64, u64), usize, usize)>,
        scratch: &mut Vec<u32>,
    ) -> (u64, u64) {
        let children = match self {
            Pq::Leaf(x) => {
                out.push(*x);
                return (key(*x), key(*x));
            }
            Pq::P(c) | Pq::Q(c) => c,
        };
        let base = out.len();
        let first = segments.len();
        for c in children.iter() {
            let from = out.len();
            let range = c.emit(key, out, segments, scratch);
            segments.push((range, from, out.len()));
        }
        let mine = &mut segments[first..];
        let lo = mine.iter().map(|s| s.0.0).min().unwrap_or(0);
        let hi = mine.iter().map(|s| s.0.1).max().unwrap_or(0);
        let sorted = match self {
            Pq::P(_) => mine.windows(2).all(|w| w[0].0 <= w[1].0),
            _ => mine.first().map(|s| s.0) <= mine.last().map(|s| s.0),
        };
        if !sorted {
            match self {
                Pq::P(_) => mine.sort_by_key(|s| s.0),
                _ => mine.reverse(),
            }
            scratch.clear();
            for &(_, from, to) in mine.iter() {
                scratch.extend_from_slice(&out[from..to]);
            }
            out[base..].copy_from_slice(scratch);
        }
        segments.truncate(first);
        (lo, hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use std::collections::BTreeSet;

    /// Every order of the leaves that `t` allows.
    fn frontiers(t: &Pq) -> BTreeSet<Vec<u32>> {
        match t {
            Pq::Leaf(x) => [vec![*x]].into_iter().collect(),
            Pq::P(c) | Pq::Q(c) => {
                let parts: Vec<Vec<Vec<u32>>> =
                    c.iter().map(|x| frontiers(x).into_iter().collect()).collect();
                let mut orders: Vec<Vec<usize>> = Vec::new();
                if matches!(t, Pq::P(_)) {
                    permutations(&(0..c.len()).collect::<Vec<_>>(), &mut Vec::new(), &mut orders);
                } else {
                    orders.push((0..c.len()).collect());
                    orders.push((0..c.len()).rev().collect());
                }
                let mut out = BTreeSet::new();
                for o in orders {
                    let mut acc: Vec<Vec<u32>> = vec![Vec::new()];
                    for &k in &o {
                        acc = acc
                            .iter()
                            .flat_map(|a| parts[k].iter().map(move |p| [a.clone(), p.clone()].concat()))
                            .collect();
                    }
                    out.extend(acc);
                }
                out
            }
        }
    }

    fn permutations(left: &[usize], cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if left.is_empty() {
            out.push(cur.clone());
        }
        for (k, &x) in left.iter().enumerate() {
            let rest: Vec<usize> =
                left.iter().enumerate().filter(|&(j, _)| j != k).map(|(_, &y)| y).collect();
            cur.push(x);
            permutations(&rest, cur, out);
            cur.pop();
        }
    }

    /// Reducing and replacing agrees with filtering every order the tree allowed: those with
    /// the set consecutive, the set collapsed into the new leaf.
    #[test]
    fn reductions_keep_exactly_the_orders_with_the_set_consecutive() {
        let mut rng = Rng::new(7);
        for case in 0..3000 {
            let leaves = rng.range(2, 7) as u32;
            let mut tree = Pq::P(Rc::new((0..leaves).map(Pq::Leaf).collect()));
            let mut next_leaf = leaves;
            for _ in 0..5 {
                let mut present = Vec::new();
                tree.leaves(&mut present);
                if present.len() < 2 {
                    break;
                }
                // A random set of 1..len leaves.
                let k = rng.range(1, present.len() as u64) as usize;
                for i in (1..present.len()).rev() {
                    let j = rng.below(i as u64 + 1) as usize;
                    present.swap(i, j);
                }
                let set: BTreeSet<u32> = present[..k].iter().copied().collect();
                // One to three new leaves, in any order, take the set's place.
                let fresh: Vec<u32> = (next_leaf..next_leaf + rng.range(1, 3) as u32).collect();
                let mut fresh_orders = Vec::new();
                permutations(&(0..fresh.len()).collect::<Vec<_>>(), &mut Vec::new(), &mut fresh_orders);
                let before = frontiers(&tree);
                let (fresh_ref, orders_ref) = (&fresh, &fresh_orders);
                let expected: BTreeSet<Vec<u32>> = before
                    .iter()
                    .filter(|o| {
                        let at: Vec<usize> = (0..o.len()).filter(|&i| set.contains(&o[i])).collect();
                        at.last().unwrap() - at[0] + 1 == at.len()
                    })
                    .flat_map(|o| {
                        let at: Vec<usize> = (0..o.len()).filter(|&i| set.contains(&o[i])).collect();
                        orders_ref.iter().map(move |f| {
                            let mut v: Vec<u32> = o[..at[0]].to_vec();
                            v.extend(f.iter().map(|&k| fresh_ref[k]));
                            v.extend_from_slice(&o[at.last().unwrap() + 1..]);
                            v
                        })
                    })
                    .collect();
                let with = Pq::group(fresh.iter().map(|&x| Pq::Leaf(x)).collect());
                let got = tree.reduce_replace(&|x| set.contains(&x), set.len(), with);
                match got {
                    None => assert!(expected.is_empty(), "case {case}: {tree:?} {set:?} refused"),
                    Some((t, order)) => {
                        // The set's order is one the tree allowed, turned as its anchor says.
                        let fits = before.iter().any(|o| {
                            let at: Vec<usize> = (0..o.len()).filter(|&i| set.contains(&o[i])).collect();
                            let (lo, hi) = (at[0], *at.last().unwrap());
                            if hi - lo + 1 != at.len() {
                                return false;
                            }
                            let pos = |x: u32| o.iter().position(|&y| y == x).unwrap();
                            let seq: Vec<u32> = o[lo..=hi].to_vec();
                            let mut rev = order.set.clone();
                            rev.reverse();
                            (seq == order.set && order.anchor.is_none_or(|(a, b)| (pos(a) < lo) == b))
                                || (seq == rev && order.anchor.is_none_or(|(a, b)| (pos(a) > hi) == b))
                        });
                        assert!(fits, "case {case}: {tree:?} with {set:?} left {order:?}");
                        let t = t.expect("new leaves replace the set");
                        assert_eq!(frontiers(&t), expected, "case {case}: {tree:?} with {set:?} gave {t:?}");
                        tree = t;
                        next_leaf += fresh.len() as u32;
                    }
                }
            }
        }
    }

    /// The smallest subtree holding a set: the node where its leaves first come apart.
    #[test]
    fn pertinent_leaves_are_those_of_the_smallest_subtree_holding_the_set() {
        let leaf = Pq::Leaf;
        let p = |c: Vec<Pq>| Pq::P(Rc::new(c));
        let q = |c: Vec<Pq>| Pq::Q(Rc::new(c));
        // P(0, Q(1, P(2, 3), 4), 5)
        let tree = p(vec![leaf(0), q(vec![leaf(1), p(vec![leaf(2), leaf(3)]), leaf(4)]), leaf(5)]);
        let pertinent = |set: &[u32]| {
            let mut out = Vec::new();
            tree.pertinent_leaves(&|x| set.contains(&x), set.len(), &mut out);
            out.sort_unstable();
            out
        };
        assert_eq!(pertinent(&[2, 3]), vec![2, 3]);
        assert_eq!(pertinent(&[3]), vec![3]);
        assert_eq!(pertinent(&[1, 3]), vec![1, 2, 3, 4]);
        assert_eq!(pertinent(&[0, 4]), vec![0, 1, 2, 3, 4, 5]);
    }
}
