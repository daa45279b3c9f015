//! The offset engine's problem as the complete searches read it (`crate::canonical`,
//! `crate::contour`): items of one or more disjoint intervals of compressed clock ranks, and
//! their sizes.

/// Items over ranks `0..ranks`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Items<'a> {
    /// Item `i`'s intervals are `ivs[ivp[i]..ivp[i + 1]]`; `None`: one interval per item,
    /// `ivs[i]`.
    pub ivp: Option<&'a [u32]>,
    /// Intervals `[start, end)` in ranks (`end ≤ ranks`).
    pub ivs: &'a [(u32, u32)],
    /// First and last-plus-one rank of each item's intervals.
    pub hull: &'a [(u32, u32)],
    /// Bytes of each item.
    pub size: &'a [u64],
    /// Ranks of the clock.
    pub ranks: u32,
}

impl<'a> Items<'a> {
    /// Items of one interval each.
    pub fn single(ivs: &'a [(u32, u32)], size: &'a [u64], ranks: u32) -> Items<'a> {
        Items { ivp: None, ivs, hull: ivs, size, ranks }
    }

    /// Item `i`'s intervals.
    #[inline]
    pub fn ivs(&self, i: usize) -> &'a [(u32, u32)] {
        match self.ivp {
            Some(p) => &self.ivs[p[i] as usize..p[i + 1] as usize],
            None => std::slice::from_ref(&self.ivs[i]),
        }
    }

    /// Which items are live at a common rank: one bitset row of `n.div_ceil(64)` words per
    /// item, symmetric, no item in its own row. One sweep over the clock with the live items
    /// as a bitset: an interval that starts while another item is live meets it, so every
    /// pair is seen from the later of its two starts (the live set ORed into the starting
    /// item's row; an item's own intervals are disjoint, so it is never live then), and the
    /// rows are made symmetric at the end. `O(intervals × n / 64 + pairs)` — a list per
    /// meeting of two intervals cost 200 ms at 1100 alias groups. `None` when the sweep
    /// would visit more than `max_pairs` pairs of intervals (one per interval live at
    /// another's start).
    pub fn meeting_rows(&self, max_pairs: u64) -> Option<Vec<u64>> {
        let n = self.size.len();
        let words = n.div_ceil(64);
        // (rank, start?, item): ends before starts at one rank ([s, e) and [e, f) never meet).
        let mut events: Vec<(u32, bool, u32)> = Vec::with_capacity(2 * self.ivs.len());
        for i in 0..n {
            for &(s, e) in self.ivs(i) {
                events.push((s, true, i as u32));
                events.push((e, false, i as u32));
            }
        }
        events.sort_unstable();
        let mut rows = vec![0u64; n * words];
        let mut live = vec![0u64; words];
        let (mut count, mut pairs) = (0u64, 0u64);
        for &(_, start, i) in &events {
            let i = i as usize;
            if !start {
                live[i / 64] &= !(1 << (i % 64));
                count -= 1;
                continue;
            }
            pairs += count + 1;
            if pairs > max_pairs {
                return None;
            }
            for (row, &l) in rows[i * words..(i + 1) * words].iter_mut().zip(&live) {
                *row |= l;
            }
            live[i / 64] |= 1 << (i % 64);
            count += 1;
        }
        // Each meeting was recorded in the row of the item that started later.
        for i in 0..n {
            for k in 0..words {
                let mut bits = rows[i * words + k];
                while bits != 0 {
                    let j = k * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    rows[j * words + i / 64] |= 1 << (i % 64);
                }
            }
        }
        Some(rows)
    }
}
