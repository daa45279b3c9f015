//! The online constructions: best fit in clock order (the floor every plan gets) and its
//! aligned variant, which puts a buffer next to the live one whose end is closest to its own.

use super::*;

/// The clock events of an online sweep over the items' hulls: (rank, start?, item), ends
/// before starts at the same rank.
pub(super) fn clock_events(p: &Problem) -> Vec<(u32, bool, u32)> {
    let mut events: Vec<(u32, bool, u32)> = Vec::with_capacity(2 * p.len());
    for i in 0..p.len() {
        events.push((p.hull[i].0, true, i as u32));
        events.push((p.hull[i].1, false, i as u32));
    }
    events.sort_unstable();
    events
}

/// The free space of an online sweep: gaps below `top`, sorted by offset and by (length,
/// offset). Sorted vectors, not trees: an online sweep has about as many gaps as items live
/// at once (hundreds), where moving a few hundred entries costs less than a tree's nodes.
#[derive(Default)]
pub(super) struct FreeSpace {
    /// (offset, length), by offset.
    by_off: Vec<(u64, u64)>,
    /// (length, offset), by length, then offset.
    by_len: Vec<(u64, u64)>,
    pub(super) top: u64,
}

impl FreeSpace {
    /// Gaps of at least `size` bytes, smallest first: (length, offset).
    pub(super) fn fitting(&self, size: u64) -> impl Iterator<Item = &(u64, u64)> {
        self.by_len[self.by_len.partition_point(|g| g.0 < size)..].iter()
    }

    pub(super) fn insert(&mut self, o: u64, len: u64) {
        let k = self.by_off.partition_point(|g| g.0 < o);
        self.by_off.insert(k, (o, len));
        let k = self.by_len.partition_point(|g| *g < (len, o));
        self.by_len.insert(k, (len, o));
    }

    /// Removes the gap `[o, o + len)` (a gap of the free space).
    pub(super) fn remove(&mut self, o: u64, len: u64) {
        let k = self.by_off.partition_point(|g| g.0 < o);
        assert_eq!(self.by_off.get(k), Some(&(o, len)), "not a gap of the free space");
        self.by_off.remove(k);
        let k = self.by_len.partition_point(|g| *g < (len, o));
        self.by_len.remove(k);
    }

    /// Takes `[at, at + size)` out of the gap `[o, o + len)`.
    pub(super) fn take(&mut self, o: u64, len: u64, at: u64, size: u64) {
        self.remove(o, len);
        if at > o {
            self.insert(o, at - o);
        }
        if at + size < o + len {
            self.insert(at + size, o + len - at - size);
        }
    }

    /// Where an item that fits in no gap goes: the gap that ends at the top, else the top.
    pub(super) fn above(&mut self, size: u64) -> u64 {
        match self.by_off.last().copied() {
            Some((o, len)) if o + len == self.top => {
                self.remove(o, len);
                self.top = o + size;
                o
            }
            _ => {
                self.top += size;
                self.top - size
            }
        }
    }

    /// Frees `[o, o + size)`, merged with the gaps it touches.
    pub(super) fn free(&mut self, o: u64, size: u64) {
        let (mut o, mut len) = (o, size);
        let k = self.by_off.partition_point(|g| g.0 < o);
        let below = k.checked_sub(1).map(|j| self.by_off[j]).filter(|&(po, pl)| po + pl == o);
        let above = self.by_off.get(k).copied().filter(|&(no, _)| no == o + len);
        if let Some((po, pl)) = below {
            self.remove(po, pl);
            o = po;
            len += pl;
        }
        if let Some((no, nl)) = above {
            self.remove(no, nl);
            len += nl;
        }
        self.insert(o, len);
    }
}

/// Online best-fit in clock order over each item's hull. Returns offsets and footprint.
pub(super) fn online_best_fit(p: &Problem) -> (Vec<u64>, u64) {
    let mut off = vec![0u64; p.len()];
    let mut free = FreeSpace::default();
    for (_, is_start, i) in clock_events(p) {
        let i = i as usize;
        let size = p.size[i];
        if !is_start {
            free.free(off[i], size);
            continue;
        }
        let fit = free.fitting(size).next().copied();
        off[i] = match fit {
            Some((len, o)) => {
                free.take(o, len, o, size);
                o
            }
            None => free.above(size),
        };
    }
    (off, free.top)
}

/// Online placement in clock order like [`online_best_fit`], choosing among the `k` smallest
/// free gaps that fit: the item goes to the bottom or the top of a gap, next to the live
/// item whose end is closest to its own (space freed together coalesces), scored by the
/// gap's leftover relative to the item plus `weight` × the end distance in mean lifetimes.
/// `None` when `stop()` says so (asked every 4096 clock events).
pub(super) fn online_aligned(
    p: &Problem,
    k: usize,
    weight: f64,
    stop: impl Fn() -> bool,
) -> Option<(Vec<u64>, u64)> {
    let mean = p.mean_span().max(1) as f64;
    let mut off = vec![0u64; p.len()];
    let mut free = FreeSpace::default();
    // Live items by offset: (top, end rank).
    let mut live: BTreeMap<u64, (u64, u32)> = BTreeMap::new();
    let mut cands: Vec<(u64, u64)> = Vec::with_capacity(k);
    for (step, (_, is_start, i)) in clock_events(p).into_iter().enumerate() {
        if step % 4096 == 4095 && stop() {
            return None;
        }
        let i = i as usize;
        let size = p.size[i];
        let end = p.hull[i].1;
        if !is_start {
            live.remove(&off[i]);
            free.free(off[i], size);
            continue;
        }
        cands.clear();
        cands.extend(free.fitting(size).take(k).copied());
        let mut best: Option<(f64, u64, u64, u64)> = None; // score, gap len, gap off, item off
        for &(len, o) in &cands {
            let waste = (len - size) as f64 / size as f64;
            // Bottom: next to the item below (its top is `o`); top: next to the one above.
            let below = if o == 0 {
                None
            } else {
                live.range(..o).next_back().filter(|(_, v)| v.0 == o).map(|(_, v)| v.1)
            };
            let above = live.get(&(o + len)).map(|v| v.1);
            for (at, nb) in [(o, below), (o + len - size, above)] {
                let dist = nb.map_or(mean * 4.0, |e| (e as f64 - end as f64).abs());
                let score = waste + weight * dist / mean;
                if best.is_none_or(|b| score < b.0) {
                    best = Some((score, len, o, at));
                }
            }
            if len == size {
                break;
            }
        }
        off[i] = match best {
            Some((_, len, o, at)) => {
                free.take(o, len, at, size);
                at
            }
            None => free.above(size),
        };
        live.insert(off[i], (off[i] + size, end));
    }
    Some((off, free.top))
}

/// The online aligned constructions the portfolio runs (see [`online_aligned`]):
/// candidate gaps, weight of the end distance, name.
pub(super) const ALIGNED_VARIANTS: [(usize, f64, &str); 3] =
    [(32, 4.0, "online-aligned/4"), (32, 8.0, "online-aligned/8"), (32, 2.0, "online-aligned/2")];
