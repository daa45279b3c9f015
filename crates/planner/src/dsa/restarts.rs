//! Randomised restarts (stage 9 of the module documentation): skyline passes, online aligned
//! constructions or repairing sweeps with noise on their choices, one loop per core until a
//! deadline, the lowest kept.

use super::*;

/// The constructions [`restarts()`] draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Restarts {
    /// Skyline passes, each with a random rule and noise on its choices.
    Skyline,
    /// Half the restarts (every other core, or every other restart on one core) online
    /// aligned constructions, each with the end distance weighted log-uniformly in 2..=128
    /// and noise on its scores; the others skyline passes. On lists where the aligned
    /// constructions lead, one run's footprint moves by ±1% with the order of items that
    /// start together, so the best of many runs is well below a single one: on a population
    /// of 2046 buffers of 64–256 MiB, runs with noise came out at 1.046–1.083 of the bound
    /// (30 per variant and noise level), the plain runs at 1.051–1.060; with weight 32–256
    /// the medians of 40 runs were 1.055–1.058 against 1.062 at weight 4. The skyline keeps
    /// its share: on some lists the aligned construction leads and a skyline restart
    /// reaches the bound.
    Aligned,
    /// The repairing sweep ([`online_aligned_repair`]) with other draws of its noise, on
    /// every core: it led the portfolio.
    Repair,
}

impl Restarts {
    /// The family for a plan `plan_for` whose portfolio had an aligned construction below
    /// every skyline pass (`aligned_led`) or not.
    pub(super) fn family(aligned_led: bool, plan_for: PlanFor) -> Restarts {
        if aligned_led && plan_for == PlanFor::Footprint { Restarts::Aligned } else { Restarts::Skyline }
    }
}

/// Share of what is left after the portfolio that repairing sweeps get where one led it (on
/// lists of similar sizes, ~300 live, the improvement stage lowered such a plan by ~0.001).
pub(super) const REPAIR_RESTARTS_SHARE: f64 = 0.6;

/// Randomised restarts (single-interval problems) until `until`, drawing from `family`: one
/// restart loop per core (different seeds), each keeping its best.
pub(super) fn restarts(
    p: &Problem,
    lb: u64,
    until: Instant,
    seed: u64,
    threads: usize,
    family: Restarts,
    best: &mut Incumbent,
) {
    let start_high = best.high;
    let repair_target = repair_first_target(lb, start_high);
    let workers = workers_for(threads.clamp(1, 8), until.saturating_duration_since(Instant::now()));
    let results: Vec<Option<(Vec<u64>, u64, String)>> = run_workers(workers, |k| {
        let mut rng = Rng::new(seed ^ 0x736b_796c ^ (k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut found: Option<(Vec<u64>, u64, String)> = None;
        let mut high_k = start_high;
        // Restarts so far of each kind: skyline passes, aligned constructions, repairing sweeps.
        let mut runs = [0u32; 3];
        while Instant::now() < until && high_k > lb {
            let total: u32 = runs.iter().sum();
            // Aligned on every other core (every other restart on one core).
            let aligned_turn = if workers > 1 { k } else { total as usize }.is_multiple_of(2);
            let kind = match family {
                Restarts::Repair => 2,
                Restarts::Aligned if aligned_turn => 1,
                _ => 0,
            };
            runs[kind] += 1;
            let stop = || Instant::now() > until;
            let placed = match kind {
                2 => online_aligned_repair(p, REPAIR_RULE, &mut rng, repair_target, stop),
                1 => {
                    // The weight of the end distance log-uniform in 2..=128: on long-lived
                    // buffers the heavier weights give lower runs.
                    let (candidates, _, _) = ALIGNED_VARIANTS[0];
                    let weight = (1.0 + 6.0 * rng.unit()).exp2();
                    let q = [0.05, 0.1, 0.2, 0.4][rng.below(4) as usize];
                    online_aligned(p, candidates, weight, Some((q, &mut rng)), stop)
                }
                _ => {
                    let rule = [1u8, 3, 4, 5][rng.below(4) as usize];
                    let q = [0.02, 0.05, 0.1, 0.2][rng.below(4) as usize];
                    skyline(p, rule, Some((q, &mut rng)), until)
                }
            };
            if let Some((off, high)) = placed
                && high < high_k
            {
                high_k = high;
                let name = ["skyline-restarts", "aligned-restarts", REPAIR_NAME][kind];
                found = Some((off, high, format!("{name}({})", runs[kind])));
            }
        }
        found
    });
    for (off, high, name) in results.into_iter().flatten() {
        best.offer(high, off, name);
    }
}
