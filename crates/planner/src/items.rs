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
    pub fn ivs(&self, i: usize) -> &'a [(u32, u32)] {
        match self.ivp {
            Some(p) => &self.ivs[p[i] as usize..p[i + 1] as usize],
            None => std::slice::from_ref(&self.ivs[i]),
        }
    }
}
