//! Decomposition of the clock at low-liveness cut points: the items crossing a cut are placed
//! first, and every window between cuts takes the greedy order best for it.

use super::*;

/// Cut points of the clock and which items cross them.
#[derive(Debug)]
pub(super) struct Decomposition {
    /// Window of each item, or `u32::MAX` for items crossing a cut.
    pub(super) window: Vec<u32>,
    pub(super) windows: usize,
    pub(super) crossing: Vec<u32>,
    pub(super) rest: Vec<u32>,
}

pub(super) fn decompose(p: &Problem, lb: u64) -> Decomposition {
    let r = p.ranks as usize;
    let mut diff = vec![0i128; r + 2];
    let mut starts = vec![0u32; r + 1];
    for i in 0..p.len() {
        let (s, e) = p.hull[i];
        starts[s as usize] += 1;
        if s + 1 < e {
            diff[s as usize + 1] += p.size[i] as i128;
            diff[e as usize] -= p.size[i] as i128;
        }
    }
    // A cut at rank c splits [.., c) from [c, ..); items with s < c < e cross it.
    let threshold = (lb / 20) as i128;
    let mut cuts: Vec<u32> = Vec::new();
    let (mut cross, mut since) = (0i128, 0u32);
    for c in 0..r {
        cross += diff[c];
        if c > 0 && since > 0 && (cross == 0 || (cross <= threshold && since >= 512)) {
            cuts.push(c as u32);
            since = 0;
        }
        since += starts[c];
    }
    let mut window = vec![0u32; p.len()];
    let (mut crossing, mut rest) = (Vec::new(), Vec::new());
    for i in 0..p.len() {
        let (s, e) = p.hull[i];
        let k = cuts.partition_point(|&c| c <= s);
        if k < cuts.len() && cuts[k] < e {
            window[i] = u32::MAX;
            crossing.push(i as u32);
        } else {
            window[i] = k as u32;
            rest.push(i as u32);
        }
    }
    Decomposition { window, windows: cuts.len() + 1, crossing, rest }
}
