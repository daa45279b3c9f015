//! Generated workloads for benchmarks and tests: random buffer lists and adversarial,
//! perfectly packed instances whose optimum equals their lower bound.

use crate::dsa::Buffer;
use crate::rng::Rng;

/// `n` random buffers: starts uniform over `[0, n)` (one arrival per clock step on
/// average), lifetimes log-uniform in `1..=1000` steps (about 145 buffers live at a time),
/// sizes log-uniform in 1 KiB..=16 MiB rounded up to 512 bytes.
pub fn random(n: usize, seed: u64) -> Vec<Buffer> {
    uniform_starts(n, Rng::new(seed), |rng| {
        (rng.log_uniform(1, 1000), rng.log_uniform(1 << 10, 16 << 20).div_ceil(512) * 512)
    })
}

/// `n` random buffers of the common benchmark form: starts uniform over `[0, n)`, lifetimes
/// uniform in `1..=256` steps (about 128 buffers live at a time), sizes log-uniform in
/// 4 KiB..=4 MiB rounded up to 512 bytes.
pub fn random_uniform(n: usize, seed: u64) -> Vec<Buffer> {
    uniform_starts(n, Rng::new(seed ^ 0x5eed_0001), |rng| {
        (rng.range(1, 256), rng.log_uniform(4 << 10, 4 << 20).div_ceil(512) * 512)
    })
}

/// `n` random buffers of uniform sizes: starts uniform over `[0, n)`, lifetimes uniform in
/// `1..=256` steps (about 128 buffers live at a time), sizes uniform in 1 KiB..=1 MiB
/// rounded up to 512 bytes — few small buffers to fill the gaps the others leave.
pub fn random_uniform_sizes(n: usize, seed: u64) -> Vec<Buffer> {
    uniform_starts(n, Rng::new(seed ^ 0x0075_7369_7a65), |rng| {
        (rng.range(1, 256), rng.range(1 << 10, 1 << 20).div_ceil(512) * 512)
    })
}

/// `n` random buffers with long lifetimes: starts uniform over `[0, n)`, lifetimes
/// log-uniform in `1..=n/10` steps (about 1400 buffers live at a time at `n` = 100k: every
/// buffer overlaps thousands of others), sizes log-uniform in 1 KiB..=64 MiB rounded up to
/// 512 bytes. The case where a greedy pass, whose gap queries visit every buffer live with
/// the one placed, costs far more than the skyline.
pub fn random_dense(n: usize, seed: u64) -> Vec<Buffer> {
    let longest = (n as u64 / 10).max(2);
    uniform_starts(n, Rng::new(seed ^ 0xde05_e000), |rng| {
        (rng.log_uniform(1, longest), rng.log_uniform(1 << 10, 64 << 20).div_ceil(512) * 512)
    })
}

/// `n` random buffers of two populations, as in training, where weights and optimizer
/// state live long beside short-lived activations: 2% large and long-lived (lifetimes
/// uniform in `n/100..=n/5` steps, sizes uniform in 64..=256 MiB), the others small and
/// short-lived (lifetimes uniform in `1..=50`, sizes uniform in 1 KiB..=2 MiB), starts
/// uniform over `[0, n)`.
pub fn random_bimodal(n: usize, seed: u64) -> Vec<Buffer> {
    let n64 = n as u64;
    uniform_starts(n, Rng::new(seed ^ 0xb1_0da1), |rng| {
        if rng.below(50) == 0 {
            (rng.range((n64 / 100).max(1), (n64 / 5).max(2)), rng.range(64, 256) << 20)
        } else {
            (rng.range(1, 50), rng.range(1, 2048) << 10)
        }
    })
}

/// `n` buffers starting uniformly over `[0, n)` (one arrival per clock step on average),
/// each with the (lifetime, size) `draw` gives.
fn uniform_starts(n: usize, mut rng: Rng, mut draw: impl FnMut(&mut Rng) -> (u64, u64)) -> Vec<Buffer> {
    (0..n)
        .map(|_| {
            let start = rng.below(n.max(1) as u64);
            let (life, size) = draw(&mut rng);
            Buffer { start, end: start + life, size, group: None }
        })
        .collect()
}

/// `n` buffers that tile a `horizon` × `height` rectangle exactly (guillotine cuts of the
/// rectangle at random places, in time or in memory), shuffled. Every step has exactly
/// `height` bytes live, so the optimum footprint is `height` = the lower bound; greedy
/// orders typically land 10–40% above it.
pub fn packed(n: usize, seed: u64) -> Vec<Buffer> {
    let mut rng = Rng::new(seed);
    let horizon: u64 = (n as u64 * 4).max(16);
    let height: u64 = 1 << 32;
    // (start, end, offset, size)
    let mut pieces: Vec<(u64, u64, u64, u64)> = vec![(0, horizon, 0, height)];
    let mut attempts = 0;
    while pieces.len() < n && attempts < n * 64 {
        attempts += 1;
        let k = rng.below(pieces.len() as u64) as usize;
        let (s, e, o, h) = pieces[k];
        let cut_time = rng.below(2) == 0;
        if cut_time && e - s >= 2 {
            let c = rng.range(s + 1, e - 1);
            pieces[k] = (s, c, o, h);
            pieces.push((c, e, o, h));
        } else if !cut_time && h >= 2 * 512 {
            let c = rng.range(1, h / 512 - 1) * 512;
            pieces[k] = (s, e, o, c);
            pieces.push((s, e, o + c, h - c));
        }
    }
    for i in (1..pieces.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        pieces.swap(i, j);
    }
    pieces.into_iter().map(|(start, end, _, size)| Buffer { start, end, size, group: None }).collect()
}
