//! Plans every stretch of a generated 100k list alone, lifetimes clipped to the stretch, and
//! prints the stretches placed above 1.03 × the whole list's lower bound and the worst.
//!
//! `cargo run --release -p graphpool-planner --example stretches -- GENERATOR SEED WIDTH MS [FROM]`
//!
//! `GENERATOR` is `random`, `uniform` or `dense` (the `workload` generators), `WIDTH` the
//! stretch length in clock steps, `MS` each stretch's budget on one core; `FROM` plans only
//! the stretch starting there. Clipping is a relaxation — a placement of the whole list places
//! every clipped stretch — so a stretch that cannot be placed low here bounds what the whole
//! list's plan can reach with this engine.

use std::time::{Duration, Instant};

use graphpool_planner::{Buffer, PlaceOptions, lower_bound, place, workload};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: stretches GENERATOR SEED WIDTH MS [FROM]";
    let arg = |k: usize| -> u64 { args.get(k).and_then(|v| v.parse().ok()).expect(usage) };
    let (seed, width, ms) = (arg(1), arg(2).max(1), arg(3));
    let n = 100_000;
    let buffers = match args.first().map(String::as_str) {
        Some("random") => workload::random(n, seed),
        Some("uniform") => workload::random_uniform(n, seed),
        Some("dense") => workload::random_dense(n, seed),
        _ => panic!("{usage}"),
    };
    let bound = lower_bound(&buffers).expect("generated lists are valid");
    let horizon = buffers.iter().map(|b| b.end).max().unwrap_or(0);
    let only = args.get(4).map(|_| arg(4));
    let opts = PlaceOptions {
        time_budget: Duration::from_millis(ms),
        threads: 1,
        scaled_budget_per_item: None,
        ..PlaceOptions::default()
    };
    let began = Instant::now();
    let (mut worst, mut stretches) = (0.0f64, 0);
    let mut from = only.unwrap_or(0);
    while from < horizon {
        let to = from + width;
        let clipped: Vec<Buffer> = buffers
            .iter()
            .filter(|b| b.start < to && b.end > from)
            .map(|b| Buffer { start: b.start.max(from), end: b.end.min(to), ..*b })
            .collect();
        let plan = place(&clipped, &opts).expect("clipped lists are valid");
        let ratio = plan.footprint as f64 / bound as f64;
        worst = worst.max(ratio);
        stretches += 1;
        if ratio > 1.03 {
            println!(
                "steps {from}..{to}: {} buffers, {ratio:.4} of the bound ({:.4} live at its peak), {}",
                clipped.len(),
                plan.lower_bound as f64 / bound as f64,
                plan.strategy
            );
        }
        if only.is_some() {
            break;
        }
        from = to;
    }
    println!(
        "{} seed {seed}, stretches of {width} steps, {ms} ms each: {stretches} stretches, worst {worst:.4} ({:.1} s)",
        args[0],
        began.elapsed().as_secs_f64()
    );
}
