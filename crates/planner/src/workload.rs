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

/// `n` random buffers of uniform sizes, busier: starts uniform over `[0, n)`, lifetimes
/// uniform in `1..=1000` steps (about 500 buffers live at a time), sizes uniform in
/// 1..=1 MiB bytes (any byte, unrounded). The plainest random list one would write, and the
/// hardest of the random generators for the planner (docs/planner.md, "Busier lists of
/// uniform sizes").
pub fn random_uniform_sizes_busy(n: usize, seed: u64) -> Vec<Buffer> {
    uniform_starts(n, Rng::new(seed ^ 0x6275_7379), |rng| (rng.range(1, 1000), rng.range(1, 1 << 20)))
}

/// `n` random buffers of similar sizes: starts uniform over `[0, n)`, lifetimes uniform in
/// `1..=300` steps (about 150 buffers live at a time), sizes uniform in 512 KiB..=1.5 MiB
/// (any byte: within a factor of three of one another). Gaps freed by one buffer are seldom
/// the room the next one needs, and the space left over is too small for any other: the
/// weakest random class measured for the planner (docs/planner.md, "Lists of similar
/// sizes").
pub fn random_similar_sizes(n: usize, seed: u64) -> Vec<Buffer> {
    uniform_starts(n, Rng::new(seed ^ 0x7369_6d69), |rng| {
        (rng.range(1, 300), rng.range(512 << 10, 1536 << 10))
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

/// `n` random buffers of power-of-two sizes: starts uniform over `[0, n)`, lifetimes
/// log-uniform in `1..=2000` steps (about 260 buffers live at a time), sizes `2^k` bytes
/// with `k` uniform in `10..=26` (1 KiB..=64 MiB, as tensors of power-of-two shapes and
/// allocators that round up to powers of two give them). Busy enough that one greedy pass
/// takes most of a 10k list's default budget (docs/planner.md, "Lists of power-of-two
/// sizes").
pub fn random_powers_of_two(n: usize, seed: u64) -> Vec<Buffer> {
    uniform_starts(n, Rng::new(seed ^ 0x706f_7732), |rng| (rng.log_uniform(1, 2000), 1 << rng.range(10, 26)))
}

/// `n` random buffers of power-of-two sizes, busier at each step: starts uniform over
/// `[0, n/8)` (eight arrivals a step on average), lifetimes uniform in `1..=63` steps (about
/// 256 buffers live at a time), sizes `2^k` bytes with `k` uniform in `9..=30` (512 B..=1
/// GiB). With 22 sizes and eight buffers starting a step, a third of the buffers end where
/// one of their size starts by chance: coarsening finds hand-overs that carry no structure
/// (docs/planner.md, "Hand-overs by chance").
pub fn random_powers_of_two_busy(n: usize, seed: u64) -> Vec<Buffer> {
    starts_over(n, (n as u64 / 8).max(1), Rng::new(seed ^ 0x6275_7379_7032), |rng| {
        (rng.range(1, 63), 1 << rng.range(9, 30))
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

/// `n` random buffers, a few long-lived among many short-lived ones of the same sizes: 5%
/// with lifetimes uniform in `n/20..=n/5` steps (about 600 live at a time, 98% of the area),
/// the others in `1..=30`; sizes uniform in 512 B..=64 MiB (multiples of 512 bytes) for both.
/// The long-lived buffers' areas spread over less than a decade, unlike [`random_dense`]'s.
pub fn random_long_short(n: usize, seed: u64) -> Vec<Buffer> {
    let n64 = n as u64;
    uniform_starts(n, Rng::new(seed ^ 0x10_6e55), |rng| {
        let life = if rng.below(20) == 0 {
            rng.range((n64 / 20).max(1), (n64 / 5).max(2))
        } else {
            rng.range(1, 30)
        };
        (life, rng.range(1, 128 << 10) * 512)
    })
}

/// `n` random buffers, half of them in alias groups as a buffer list's `alias_group` column
/// gives them: a group's 2–8 members have one size and recur every `period` steps (uniform
/// in `50..=400`), each live for `1..period` steps, as a buffer replayed by the microbatches
/// of one slot; the others single, with lifetimes uniform in `1..=300`. Starts uniform over
/// `[0, n)`, sizes uniform in 1 KiB..=1 MiB rounded up to 512 bytes; groups are numbered
/// from 0 in the order drawn.
pub fn random_grouped(n: usize, seed: u64) -> Vec<Buffer> {
    let mut rng = Rng::new(seed ^ 0x6772_6f75_7073);
    let mut out = Vec::with_capacity(n);
    let mut groups = 0u32;
    while out.len() < n {
        let start = rng.below(n as u64);
        let size = rng.range(1 << 10, 1 << 20).div_ceil(512) * 512;
        // One draw in six is a group (of five members on average): half the buffers.
        if rng.below(6) != 0 {
            out.push(Buffer { start, end: start + rng.range(1, 300), size, group: None });
            continue;
        }
        let period = rng.range(50, 400);
        let life = rng.range(1, period - 1);
        let members = (rng.range(2, 8) as usize).min(n - out.len());
        for m in 0..members as u64 {
            let s = start + m * period;
            out.push(Buffer { start: s, end: s + life, size, group: Some(groups) });
        }
        groups += 1;
    }
    out
}

/// `n` buffers as a trace of ten iterations of one step: [`random_uniform`]'s list of `n / 10`
/// buffers ten times over, each iteration starting one clock step after the last buffer of
/// the one before has ended (nothing is live between iterations), in order of iteration.
pub fn repeated_iterations(n: usize, seed: u64) -> Vec<Buffer> {
    let iteration = random_uniform(n / 10, seed);
    let period = iteration.iter().map(|b| b.end).max().unwrap_or(0) + 1;
    (0..10u64)
        .flat_map(|k| {
            iteration.iter().map(move |b| Buffer {
                start: b.start + k * period,
                end: b.end + k * period,
                ..*b
            })
        })
        .collect()
}

/// About `n` buffers as an allocator sees one pipeline rank's training step in eager mode:
/// microbatches in 1F1B order (as many forwards as are kept in flight, then one forward and
/// one backward in turn, then the remaining backwards) through every layer, one clock step
/// per layer and pass. Each layer's forward keeps three activations (1, 1, 2 or 4 hidden
/// states each) until its backward, and every step allocates the same number of short-lived
/// temporaries (1, 2 or 8 hidden states, freed 1–3 steps later). The seed draws the shape:
/// 8–48 layers, 0–4 temporaries per step, 1–16 microbatches in flight, hidden states of 1, 2
/// or 4 MiB; the microbatch count makes about `n` buffers. Sizes repeat, lifetimes nest, and unrelated buffers of one size often hand over
/// to each other: the placement a caching allocator faces, unlike the random lists.
pub fn training_trace(n: usize, seed: u64) -> Vec<Buffer> {
    let mut rng = Rng::new(seed ^ 0x7472_6169_6e00);
    let layers = [8u64, 12, 16, 24, 32, 48][rng.below(6) as usize];
    let temporaries = rng.below(5);
    let hidden = [1u64, 2, 4][rng.below(3) as usize] << 20;
    let per_microbatch = layers * (3 + 2 * temporaries);
    let microbatches = (n as u64).div_ceil(per_microbatch).max(1);
    let in_flight = [1u64, 2, 4, 8, 16][rng.below(5) as usize].min(microbatches);
    // The 1F1B order: (backward, microbatch).
    let mut order = Vec::with_capacity(2 * microbatches as usize);
    let (mut forwards, mut backwards) = (0, 0);
    while forwards < in_flight {
        order.push((false, forwards));
        forwards += 1;
    }
    while backwards < microbatches {
        if forwards < microbatches {
            order.push((false, forwards));
            forwards += 1;
        }
        order.push((true, backwards));
        backwards += 1;
    }
    let mut buffers = Vec::with_capacity((microbatches * per_microbatch) as usize);
    // The forward step of every (microbatch, layer) still waiting for its backward, and its
    // activations' sizes.
    let mut kept: Vec<Option<(u64, [u64; 3])>> = vec![None; (microbatches * layers) as usize];
    let mut t = 0u64;
    for (backward, mb) in order {
        for k in 0..layers {
            let layer = if backward { layers - 1 - k } else { k };
            t += 1;
            if backward {
                let (start, sizes) =
                    kept[(mb * layers + layer) as usize].take().expect("forward before backward");
                buffers.extend(sizes.iter().map(|&size| Buffer { start, end: t + 1, size, group: None }));
            } else {
                let sizes = [0; 3].map(|_| hidden * [1, 1, 2, 4][rng.below(4) as usize]);
                kept[(mb * layers + layer) as usize] = Some((t, sizes));
            }
            for _ in 0..temporaries {
                let size = hidden * [1, 2, 8][rng.below(3) as usize];
                buffers.push(Buffer { start: t, end: t + rng.range(1, 3), size, group: None });
            }
        }
    }
    buffers
}

/// `n` buffers starting uniformly over `[0, n)` (one arrival per clock step on average),
/// each with the (lifetime, size) `draw` gives.
fn uniform_starts(n: usize, rng: Rng, draw: impl FnMut(&mut Rng) -> (u64, u64)) -> Vec<Buffer> {
    starts_over(n, n.max(1) as u64, rng, draw)
}

/// `n` buffers starting uniformly over `[0, steps)`, each with the (lifetime, size) `draw`
/// gives.
fn starts_over(
    n: usize,
    steps: u64,
    mut rng: Rng,
    mut draw: impl FnMut(&mut Rng) -> (u64, u64),
) -> Vec<Buffer> {
    (0..n)
        .map(|_| {
            let start = rng.below(steps);
            let (life, size) = draw(&mut rng);
            Buffer { start, end: start + life, size, group: None }
        })
        .collect()
}

/// The shape of a guillotine tiling drawn by [`packed_tiling`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tiling {
    /// Clock steps of the rectangle per piece (at least 16 in all): 4 gives long pieces
    /// whose cuts rarely meet; 1 gives short pieces, many of which end at the same steps.
    pub horizon_per_piece: u64,
    /// Bytes a cut in memory is a multiple of (512: the pieces' sizes are too).
    pub granularity: u64,
    /// Pieces drawn for each cut, the one of most bytes × steps cut: 1 cuts a piece drawn
    /// uniformly (many slivers), 3 favours the large pieces (even sizes, few slivers).
    pub cut_largest_of: u32,
    /// Cuts in memory at half the piece (7 cuts in 10) or a quarter of it (rounded down to
    /// the granularity) instead of anywhere: sizes repeat, as power-of-two tensors do, and
    /// many pieces of one size meet at one step.
    pub halves: bool,
    /// Clock steps of the rectangle instead of `horizon_per_piece` per piece (at least 16):
    /// a few steps for many pieces leave most of them living one step, tens starting at
    /// every step.
    pub steps: Option<u64>,
}

impl Default for Tiling {
    /// The shape of [`packed`]: 4 steps per piece, 512-byte cuts, uniform draws.
    fn default() -> Self {
        Tiling { horizon_per_piece: 4, granularity: 512, cut_largest_of: 1, halves: false, steps: None }
    }
}

/// `n` buffers that tile a `horizon` × `height` rectangle exactly (guillotine cuts of the
/// rectangle at random places, in time or in memory), shuffled. Every step has exactly
/// `height` bytes live, so the optimum footprint is `height` = the lower bound; greedy
/// orders typically land 10–40% above it. [`packed_tiling`] with [`Tiling::default`].
pub fn packed(n: usize, seed: u64) -> Vec<Buffer> {
    packed_tiling(n, seed, &Tiling::default())
}

/// `n` buffers that tile a `n × horizon_per_piece` (or `steps`) × 4 GiB rectangle exactly,
/// cut as `shape` says (see [`packed`]).
pub fn packed_tiling(n: usize, seed: u64, shape: &Tiling) -> Vec<Buffer> {
    packed_tiling_placed(n, seed, shape).0
}

/// [`packed_tiling`] with each buffer's offset in the rectangle: a placement at the lower
/// bound.
pub fn packed_tiling_placed(n: usize, seed: u64, shape: &Tiling) -> (Vec<Buffer>, Vec<u64>) {
    let mut rng = Rng::new(seed);
    let horizon: u64 = shape.steps.unwrap_or(n as u64 * shape.horizon_per_piece).max(16);
    let height: u64 = 1 << 32;
    let unit = shape.granularity.max(1);
    let area = |x: (u64, u64, u64, u64)| (x.1 - x.0) as u128 * x.3 as u128;
    // (start, end, offset, size)
    let mut pieces: Vec<(u64, u64, u64, u64)> = vec![(0, horizon, 0, height)];
    let mut attempts = 0;
    while pieces.len() < n && attempts < n * 64 {
        attempts += 1;
        let mut k = rng.below(pieces.len() as u64) as usize;
        for _ in 1..shape.cut_largest_of {
            let j = rng.below(pieces.len() as u64) as usize;
            if area(pieces[j]) > area(pieces[k]) {
                k = j;
            }
        }
        let (s, e, o, h) = pieces[k];
        let cut_time = rng.below(2) == 0;
        if cut_time && e - s >= 2 {
            let c = rng.range(s + 1, e - 1);
            pieces[k] = (s, c, o, h);
            pieces.push((c, e, o, h));
        } else if !cut_time && h >= 2 * unit {
            let c = if shape.halves {
                let part = if rng.below(10) < 7 { h / 2 } else { h / 4 };
                (part / unit).max(1) * unit
            } else {
                rng.range(1, h / unit - 1) * unit
            };
            pieces[k] = (s, e, o, c);
            pieces.push((s, e, o + c, h - c));
        }
    }
    for i in (1..pieces.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        pieces.swap(i, j);
    }
    pieces
        .into_iter()
        .map(|(start, end, offset, size)| (Buffer { start, end, size, group: None }, offset))
        .unzip()
}

/// About `n` buffers (within a few percent) that tile a rectangle of 4 GiB exactly, built
/// bottom-up like a skyline: each buffer starts at the left edge of the lowest stretch of
/// the skyline, at its level, `1..=400` steps wide and up to a sixteenth of the height
/// tall (uniform), cut to the stretch and to what is left of the height; shuffled. Unlike
/// [`packed`]'s cuts, the tiling need not split along any line; the optimum footprint is
/// the height = the lower bound.
pub fn packed_skyline(n: usize, seed: u64) -> Vec<Buffer> {
    let mut rng = Rng::new(seed ^ 0x5b7_11e5);
    let unit: u64 = 512;
    let height: u64 = 1 << 23; // in units: 4 GiB
    let horizon: u64 = (n as u64 * 5 / 8).max(4);
    // The skyline: (start, level) of each stretch, in clock order; a stretch ends where the
    // next starts (the last at `horizon`).
    let mut sky: Vec<(u64, u64)> = vec![(0, 0)];
    let mut out = Vec::with_capacity(n + n / 8);
    loop {
        let (k, &(a, level)) = sky.iter().enumerate().min_by_key(|&(_, &(_, l))| l).expect("skyline");
        if level >= height {
            break;
        }
        let b = sky.get(k + 1).map_or(horizon, |x| x.0);
        let w = rng.range(1, 400).min(b - a);
        let d = rng.range(1, height / 16).min(height - level);
        out.push(Buffer { start: a, end: a + w, size: d * unit, group: None });
        // Raise [a, a + w) by d: split the stretch, then merge equal neighbours.
        if a + w < b {
            sky.insert(k + 1, (a + w, level));
        }
        sky[k].1 = level + d;
        if k + 1 < sky.len() && sky[k + 1].1 == sky[k].1 {
            sky.remove(k + 1);
        }
        if k > 0 && sky[k - 1].1 == sky[k].1 {
            sky.remove(k);
        }
    }
    for i in (1..out.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        out.swap(i, j);
    }
    out
}

/// About `n` buffers (the last step's may add up to three) that fill a 4 GiB arena exactly,
/// its memory re-cut as the clock runs: 16 buffers start at step 0; at every step,
/// `runs_per_step` times, a run of one to four buffers lying side by side ends and the
/// stretch they held is cut afresh (at 512-byte multiples) into one to four buffers that
/// start there (runs that would overlap one already taken at the step are skipped). Unlike
/// [`packed`]'s guillotine cuts, a new buffer may span the boundary between two old ones,
/// and few buffers share a lifetime or hand over to one of their size. Every step has the
/// arena's bytes live, so the optimum footprint is 4 GiB = the lower bound; shuffled.
pub fn packed_recut(n: usize, seed: u64, runs_per_step: u32) -> Vec<Buffer> {
    packed_recut_arena(n, seed, runs_per_step, 1 << 23)
}

/// [`packed_recut`] in an arena of `arena_units` × 512 bytes (at least 16 units): small
/// arenas hold few sizes, which repeat and add up by chance at most steps.
pub fn packed_recut_arena(n: usize, seed: u64, runs_per_step: u32, arena_units: u64) -> Vec<Buffer> {
    packed_recut_arena_placed(n, seed, runs_per_step, arena_units).0
}

/// [`packed_recut_arena`] with each buffer's offset in the arena: a placement at the lower
/// bound.
pub fn packed_recut_arena_placed(
    n: usize,
    seed: u64,
    runs_per_step: u32,
    arena_units: u64,
) -> (Vec<Buffer>, Vec<u64>) {
    let mut rng = Rng::new(seed ^ 0x7ec0_7000);
    let unit: u64 = 512;
    let height = arena_units.max(16);
    // `span` units cut into up to `k` pieces at distinct places.
    let cut = |rng: &mut Rng, span: u64, k: u64| -> Vec<u64> {
        let k = k.min(span).max(1);
        let mut at: Vec<u64> = Vec::with_capacity(k as usize + 1);
        while at.len() + 1 < k as usize {
            let c = rng.range(1, span - 1);
            if !at.contains(&c) {
                at.push(c);
            }
        }
        at.push(0);
        at.push(span);
        at.sort_unstable();
        at.windows(2).map(|w| w[1] - w[0]).collect()
    };
    // (offset, size, start) of the live buffers, by offset.
    let mut live: Vec<(u64, u64, u64)> = Vec::new();
    let mut o = 0;
    for z in cut(&mut rng, height, 16) {
        live.push((o, z, 0));
        o += z;
    }
    let mut out: Vec<(Buffer, u64)> = Vec::with_capacity(n + 4);
    let mut t = 0;
    while out.len() + live.len() < n {
        t += 1;
        let mut taken = vec![false; live.len()];
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for _ in 0..runs_per_step {
            let i = rng.below(live.len() as u64) as usize;
            let j = (i + rng.range(1, 4) as usize).min(live.len());
            if taken[i..j].iter().any(|&x| x) {
                continue;
            }
            taken[i..j].iter_mut().for_each(|x| *x = true);
            runs.push((i, j));
        }
        runs.sort_unstable();
        let mut next: Vec<(u64, u64, u64)> = Vec::with_capacity(live.len() + 8);
        let mut k = 0;
        for (i, j) in runs {
            next.extend_from_slice(&live[k..i]);
            let lo = live[i].0;
            let span: u64 = live[i..j].iter().map(|x| x.1).sum();
            for &(o, z, s) in &live[i..j] {
                out.push((Buffer { start: s, end: t, size: z * unit, group: None }, o * unit));
            }
            let mut o = lo;
            let pieces = rng.range(1, 4);
            for z in cut(&mut rng, span, pieces) {
                next.push((o, z, t));
                o += z;
            }
            k = j;
        }
        next.extend_from_slice(&live[k..]);
        live = next;
    }
    for &(o, z, s) in &live {
        out.push((Buffer { start: s, end: t + 1, size: z * unit, group: None }, o * unit));
    }
    for i in (1..out.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        out.swap(i, j);
    }
    out.into_iter().unzip()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes × steps of `b` and its live bound: a list tiles a `horizon` × `height`
    /// rectangle exactly when the first is `horizon × height` and the second `height`.
    fn area_and_bound(b: &[Buffer]) -> (u128, u64) {
        let area = b.iter().map(|x| (x.end - x.start) as u128 * x.size as u128).sum();
        (area, crate::live_bound(b).unwrap())
    }

    #[test]
    fn tilings_of_every_shape_fill_their_rectangle() {
        let shapes = [
            Tiling::default(),
            Tiling { horizon_per_piece: 1, ..Tiling::default() },
            Tiling { granularity: 1, ..Tiling::default() },
            Tiling { cut_largest_of: 3, ..Tiling::default() },
            Tiling { halves: true, ..Tiling::default() },
            Tiling { steps: Some(20), ..Tiling::default() },
        ];
        for shape in shapes {
            for seed in 1..=3 {
                let b = packed_tiling(700, seed, &shape);
                assert_eq!(b.len(), 700, "{shape:?}");
                let horizon = b.iter().map(|x| x.end).max().unwrap();
                assert_eq!(horizon, shape.steps.unwrap_or(700 * shape.horizon_per_piece), "{shape:?}");
                assert_eq!(
                    area_and_bound(&b),
                    (horizon as u128 * (1 << 32), 1 << 32),
                    "{shape:?} seed {seed}"
                );
                assert!(b.iter().all(|x| x.size % shape.granularity == 0 && x.end > x.start));
                // The pieces' own offsets place them at the bound.
                let (placed, offsets) = packed_tiling_placed(700, seed, &shape);
                assert_eq!(placed, b);
                crate::verify(&b, &offsets).unwrap();
                assert!(b.iter().zip(&offsets).all(|(x, &o)| o + x.size <= 1 << 32), "{shape:?} seed {seed}");
            }
        }
        assert_eq!(packed(300, 5), packed_tiling(300, 5, &Tiling::default()));
    }

    /// A training step has about the buffers asked for, each live for at least a step and at
    /// least a hidden state large, activations that outlive the temporaries, and the same
    /// list for the same seed.
    #[test]
    fn training_traces_keep_activations_until_their_backward() {
        for seed in 1..=6 {
            let b = training_trace(5000, seed);
            assert!((5000..5000 + 48 * 11).contains(&b.len()), "seed {seed}: {} buffers", b.len());
            assert!(b.iter().all(|x| x.start < x.end && x.size >= 1 << 20 && x.group.is_none()));
            // The first layers' activations outlive every temporary (at most 3 steps).
            let long: Vec<&Buffer> = b.iter().filter(|x| x.end - x.start > 3).collect();
            assert!(!long.is_empty(), "seed {seed}: no activation kept");
            assert_eq!(training_trace(5000, seed), b);
        }
    }

    /// Similar sizes keep to their ranges, and a seed gives one list.
    #[test]
    fn similar_sizes_keep_to_their_ranges() {
        let b = random_similar_sizes(20_000, 3);
        assert_eq!(b.len(), 20_000);
        assert!(b.iter().all(|x| x.start < 20_000 && (1..=300).contains(&(x.end - x.start))));
        assert!(b.iter().all(|x| (512 << 10..=1536 << 10).contains(&x.size) && x.group.is_none()));
        // Sizes at any byte, not rounded.
        assert!(b.iter().any(|x| x.size % 512 != 0));
        assert_eq!(random_similar_sizes(20_000, 3), b);
        assert_ne!(random_similar_sizes(20_000, 4), b);
    }

    /// Power-of-two sizes span 1 KiB..=64 MiB, lifetimes 1..=2000 steps, and a seed gives one
    /// list.
    #[test]
    fn powers_of_two_keep_to_their_ranges() {
        let b = random_powers_of_two(20_000, 3);
        assert_eq!(b.len(), 20_000);
        assert!(b.iter().all(|x| x.start < 20_000 && (1..=2000).contains(&(x.end - x.start))));
        assert!(b.iter().all(|x| x.size.is_power_of_two() && (1 << 10..=64 << 20).contains(&x.size)));
        assert!(b.iter().any(|x| x.size == 1 << 10) && b.iter().any(|x| x.size == 64 << 20));
        assert!(b.iter().all(|x| x.group.is_none()));
        assert_eq!(random_powers_of_two(20_000, 3), b);
        assert_ne!(random_powers_of_two(20_000, 4), b);
    }

    /// Repeated iterations: ten copies of one list, apart in time, each the same buffers.
    #[test]
    fn repeated_iterations_are_copies_apart_in_time() {
        let b = repeated_iterations(10_000, 4);
        assert_eq!(b.len(), 10_000);
        let one = &b[..1000];
        let period = one.iter().map(|x| x.end).max().unwrap() + 1;
        for (k, copy) in b.chunks(1000).enumerate() {
            let k = k as u64;
            assert!(copy.iter().all(|x| x.start >= k * period && x.end < (k + 1) * period));
            assert!(copy.iter().zip(one).all(|(x, y)| x.start - k * period == y.start && x.size == y.size));
        }
        assert_ne!(repeated_iterations(10_000, 5)[..1000], b[..1000]);
    }

    /// Grouped lists: about half the buffers in groups, each group's members of one size,
    /// recurring at one period without overlapping, and a seed gives one list.
    #[test]
    fn grouped_members_recur_at_one_period() {
        let b = random_grouped(20_000, 2);
        assert_eq!(b.len(), 20_000);
        let grouped = b.iter().filter(|x| x.group.is_some()).count();
        assert!((8_000..=12_000).contains(&grouped), "{grouped} of 20000 in groups");
        let mut members: std::collections::BTreeMap<u32, Vec<&Buffer>> = Default::default();
        for x in &b {
            assert!(x.start < x.end && x.size % 512 == 0 && (1 << 10..=1 << 20).contains(&x.size));
            if let Some(g) = x.group {
                members.entry(g).or_default().push(x);
            }
        }
        for (g, m) in &members {
            assert!(m.len() <= 8, "group {g}: {} members", m.len());
            for w in m.windows(2) {
                assert_eq!(w[0].size, w[1].size, "group {g}");
                assert!(w[0].end < w[1].start, "group {g}: members overlap");
                assert_eq!(w[1].start - w[0].start, m[1].start - m[0].start, "group {g}: one period");
            }
        }
        assert_eq!(random_grouped(20_000, 2), b);
        assert_ne!(random_grouped(20_000, 3), b);
    }

    #[test]
    fn skyline_fills_tile_their_rectangle() {
        for (n, seed) in [(1_000, 1), (10_000, 2)] {
            let b = packed_skyline(n, seed);
            assert!(b.len() * 10 >= n * 8 && b.len() * 10 <= n * 12, "{} buffers for {n}", b.len());
            let horizon = b.iter().map(|x| x.end).max().unwrap();
            assert_eq!(area_and_bound(&b), (horizon as u128 * (4 << 30), 4 << 30));
        }
    }

    #[test]
    fn recut_lists_fill_their_arena() {
        for (n, seed, runs) in [(1_000, 1, 1), (10_000, 2, 4)] {
            let b = packed_recut(n, seed, runs);
            assert!(b.len() >= n && b.len() <= n + 3, "{} buffers for {n}", b.len());
            let horizon = b.iter().map(|x| x.end).max().unwrap();
            assert_eq!(area_and_bound(&b), (horizon as u128 * (4 << 30), 4 << 30));
            assert_eq!(packed_recut(n, seed, runs), b);
        }
        // Small arenas too, down to the 16 units the first cut needs.
        for (units, runs) in [(16, 1), (64, 2), (1024, 4)] {
            let b = packed_recut_arena(3_000, 3, runs, units);
            let horizon = b.iter().map(|x| x.end).max().unwrap();
            let height = units as u128 * 512;
            assert_eq!(area_and_bound(&b), (horizon as u128 * height, height as u64));
        }
    }
}
