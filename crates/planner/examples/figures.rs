//! Prints footprint / lower bound and planning time for generated workloads.
//!
//! `cargo run --release -p graphpool-planner --example figures [-- FILTER]`

use std::time::Duration;

use graphpool_planner::{PlaceOptions, place, verify, workload};

fn main() {
    let filter = std::env::args().nth(1).unwrap_or_default();
    let mut cases: Vec<(String, Vec<graphpool_planner::Buffer>)> = Vec::new();
    for n in [1_000, 10_000, 100_000] {
        for seed in 1..=3 {
            cases.push((format!("random n={n} seed={seed}"), workload::random(n, seed)));
        }
    }
    for n in [100, 1_000, 10_000] {
        for seed in 1..=3 {
            cases.push((format!("packed n={n} seed={seed}"), workload::packed(n, seed)));
        }
    }
    println!(
        "{:<36} {:>8} {:>9} {:>9} {:>9} {:>10} {:>6} {:>8}  strategy",
        "workload", "buffers", "floor", "greedy", "ratio", "time", "win", "steps"
    );
    for (name, buffers) in cases {
        if !name.contains(&filter) {
            continue;
        }
        let opts = PlaceOptions { time_budget: Duration::from_secs(1), ..PlaceOptions::default() };
        let p = place(&buffers, &opts).expect("valid workload");
        verify(&buffers, &p.offsets).expect("valid placement");
        let r = |x: u64| x as f64 / p.lower_bound.max(1) as f64;
        println!(
            "{:<36} {:>8} {:>9.4} {:>9.4} {:>9.4} {:>8.1}ms {:>6} {:>8}  {}",
            name,
            buffers.len(),
            r(p.floor_footprint),
            r(p.greedy_footprint),
            p.ratio(),
            p.elapsed.as_secs_f64() * 1e3,
            p.windows,
            p.improvement_steps,
            p.strategy
        );
    }
}
