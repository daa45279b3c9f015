//! The greedy orders of the portfolio: one pass places the items in an order, each in the
//! gap its fit picks, window by window of the decomposition.

use super::*;

/// Places `items` in order into `index`, writing `off`; returns the highest top.
pub(super) fn greedy(p: &Problem, items: &[u32], fit: Fit, index: &mut Index, off: &mut [u64]) -> u64 {
    let mut scratch = FindScratch::default();
    let mut high = 0;
    for &i in items {
        let i = i as usize;
        let o = index.find(p, i, fit, &mut scratch);
        off[i] = o;
        index.insert(p, i, o);
        high = high.max(o + p.size[i]);
    }
    high
}

/// [`greedy()`] that asks `stop` every 256 items and gives up (`None`) when it says so.
pub(super) fn greedy_until(
    p: &Problem,
    items: &[u32],
    fit: Fit,
    index: &mut Index,
    off: &mut [u64],
    stop: impl Fn() -> bool,
) -> Option<u64> {
    let mut high = 0;
    for chunk in items.chunks(256) {
        if stop() {
            return None;
        }
        high = high.max(greedy(p, chunk, fit, index, off));
    }
    Some(high)
}

/// Sorts `items` into the placement order of `order`, with multiplicative noise on the
/// key (0 = none) drawn from `rng`.
pub(super) fn sort_items(p: &Problem, items: &mut [u32], order: Order, noise: f64, rng: &mut Rng) {
    if noise == 0.0 {
        match order {
            Order::Size => items.sort_unstable_by_key(|&i| {
                let i = i as usize;
                (std::cmp::Reverse(p.size[i]), std::cmp::Reverse(p.life[i]), p.start[i], i)
            }),
            Order::Lifetime => items.sort_unstable_by_key(|&i| {
                let i = i as usize;
                (std::cmp::Reverse(p.life[i]), std::cmp::Reverse(p.size[i]), p.start[i], i)
            }),
            Order::Area => items.sort_unstable_by_key(|&i| {
                let i = i as usize;
                let area = p.size[i] as u128 * p.life[i] as u128;
                (std::cmp::Reverse(area), std::cmp::Reverse(p.size[i]), p.start[i], i)
            }),
            Order::Start => items.sort_unstable_by_key(|&i| {
                let i = i as usize;
                (p.start[i], std::cmp::Reverse(p.size[i]), i)
            }),
            Order::Breadth => items.sort_unstable_by_key(|&i| {
                let i = i as usize;
                (std::cmp::Reverse(p.peak[i]), std::cmp::Reverse(p.size[i]), p.start[i], i)
            }),
        }
        return;
    }
    let mut keyed: Vec<(f64, u32)> = items
        .iter()
        .map(|&i| {
            let u = i as usize;
            let base = match order {
                Order::Size => p.size[u] as f64,
                Order::Lifetime => p.life[u] as f64,
                Order::Area => p.size[u] as f64 * p.life[u] as f64,
                Order::Start => -(p.start[u] as f64) - 1.0,
                Order::Breadth => p.peak[u] as f64 + p.size[u] as f64 / (1u64 << 40) as f64,
            };
            let factor = 1.0 + noise * (rng.unit() - 0.5);
            (if base >= 0.0 { base * factor } else { base / factor }, i)
        })
        .collect();
    keyed.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    for (slot, (_, i)) in items.iter_mut().zip(keyed) {
        *slot = i;
    }
}

/// One portfolio run: offsets of every item and the highest top per window.
pub(super) struct Run {
    pub(super) strategy: Strategy,
    pub(super) off: Vec<u64>,
    pub(super) window_high: Vec<u64>,
    pub(super) crossing_high: u64,
}

/// One portfolio run, or `None` when `stop` (if any) passes first.
pub(super) fn run_strategy(
    p: &Problem,
    d: &Decomposition,
    strategy: Strategy,
    stop: impl Fn() -> bool,
) -> Option<Run> {
    let mut index = Index::new(p);
    let mut off = vec![0u64; p.len()];
    let mut crossing = d.crossing.clone();
    let mut rng = Rng::new(0);
    sort_items(p, &mut crossing, Order::Size, 0.0, &mut rng);
    let crossing_high = greedy(p, &crossing, Fit::BestFit, &mut index, &mut off);
    let mut rest = d.rest.clone();
    sort_items(p, &mut rest, strategy.order, 0.0, &mut rng);
    greedy_until(p, &rest, strategy.fit, &mut index, &mut off, stop)?;
    let mut window_high = vec![0u64; d.windows];
    for &i in &d.rest {
        let i = i as usize;
        let w = d.window[i] as usize;
        window_high[w] = window_high[w].max(off[i] + p.size[i]);
    }
    Some(Run { strategy, off, window_high, crossing_high })
}
