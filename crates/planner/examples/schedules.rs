//! Plans random pipeline schedules whose layers differ and reports those above 1.001 × the
//! lower bound.
//!
//! `cargo run --release -p graphpool-planner --example schedules -- [CASES | FROM-TO] [BUDGET_MS] [THREADS]`
//!
//! Case `k` (1..=CASES, default 100) draws, from seed `k`: 1F1B or interleaved 1F1B; pipeline
//! size 1, 2, 4, 8 or 16 (at least 2 when interleaved) and a rank; for 1F1B 1, 2, 3, pp,
//! 2 pp, 4 pp + 1, 64, 128 or 256 microbatches, for interleaved 2–4 chunks and pp × 1, 2,
//! 4 or 8 microbatches; 1–8 layers per chunk from `pipeline::varied_layers` with sequence
//! 1024–8192, micro-batch 1–4 and hidden 1024–8192. Each is planned by `plan_schedule` with
//! `BUDGET_MS` (default 200, the daemon's default) and verified; plans that take over 1.25 ×
//! the budget are listed too; with `SCHEDULES_DUMP=DIR`, each case above 1.001 is written
//! there as `case-K.json`, a description `graphpool plan --schedule` reads. `CASES` may be a
//! range `FROM-TO`; a third argument sets the planner's threads (default 0: every core).
//!
//! `… --example schedules -- large [CASES | FROM-TO] [BUDGET_MS] [THREADS]` runs the same sweep
//! over long pipelines and many microbatches: pipeline size 8, 16 or 32; for 1F1B 512, 1024
//! or 2048 microbatches, for interleaved pp × 16, 32 or 64 (8k–313k buffers).
//!
//! `… --example schedules -- models [CASES | FROM-TO] [BUDGET_MS] [THREADS]` runs it over
//! whole models split across the pipeline: 32, 48, 64, 80, 96 or 128 layers over pipeline
//! size 2, 4, 8, 16 or 32; for 1F1B pp, 4 pp, 8 pp + 1 or 256 microbatches, for interleaved
//! 2, 3, 4, 6 or 8 chunks and pp × 1, 2, 4 or 8 microbatches; each chunk gets its share of
//! the layers, rounded up (1–64 a chunk).
//!
//! `… --example schedules -- deep [CASES | FROM-TO] [BUDGET_MS] [THREADS]` runs it over
//! pipelines of thousands of layers a rank, more than real models give (a test of planning
//! time): pipeline size 8, 16, 32 or 64; for 1F1B pp, 4 pp or 512 microbatches, for
//! interleaved 2, 3, 4, 6 or 8 chunks and pp × 1, 2, 3 or 8 microbatches; 6, 10, 16 or 20
//! layers a chunk (up to 160k buffers in tens of thousands of alias groups).
//!
//! `… --example schedules -- uneven [CASES | FROM-TO] [BUDGET_MS] [THREADS]` runs the first
//! sweep's schedules over layers whose byte counts look measured rather than derived
//! (`uneven_layers`): saved bytes of 1–200 MiB at 512 B granularity, workspaces of 0–64 MiB,
//! and a hidden state whose shape changes at a quarter of the layers (the output of one layer
//! then does not chain into the next). `large`, `models` or `deep` and `uneven` combine.
//!
//! `… --example schedules -- inputs [CASES | FROM-TO] [BUDGET_MS] [THREADS]` runs the first
//! sweep's schedules over layers with several static inputs and outputs (`inputs_layers`):
//! one to three inputs (a state kept for the backward most of the time, a second tensor kept
//! half of the time, an index tensor never), one or two outputs, each of its own shape and
//! element type (bf16, f16, f32, f8e4m3, i64), so that a layer's output chains into the next
//! layer's input only where their bytes happen to match; saved bytes and workspaces of none,
//! whole MiB or any byte count.
//!
//! `… --example schedules -- explicit [CASES | FROM-TO] [BUDGET_MS]` plans random explicit step orders
//! instead (TransformerEngine's `_order` form): 1–4 chunks, 1–64 microbatches, forwards
//! through the chunks in order and backwards in reverse, at most `W` microbatches in flight
//! (`W` from 1 to all of them: GPipe) and forwards taken before backwards with a drawn
//! probability, over `pipeline::varied_layers` (`pipeline::random_explicit_case`).
//!
//! `… --example schedules -- workspaces [BUDGET_MS]` sweeps 1F1B instead (pp 2 / 4 / 8 with
//! ranks 0, 2, 3, 7 where they exist, M 4, 8, 16, 33, 2 or 4 layers, hidden states of 1, 2,
//! 8 or 32 MiB) over layers alternating attention with 32 MiB workspaces (4 hidden states
//! saved) and MLP without (8 saved).

use std::time::{Duration, Instant};

use graphpool_planner::pipeline::{ExplicitCase, random_explicit_case, varied_layers, workspace_layers};
use graphpool_planner::rng::Rng;
use graphpool_planner::{
    LayerSpec, PlaceOptions, Plan, Schedule, SchedulePlanInput, TensorSpec, plan_schedule, verify,
};

fn workspaces(budget_ms: u64) {
    let opts = PlaceOptions { time_budget: Duration::from_millis(budget_ms), ..PlaceOptions::default() };
    let (mut above, mut total, mut worst) = (0, 0, 1.0f64);
    for (pp, rank) in [(2, 0), (4, 0), (4, 2), (8, 0), (8, 3), (8, 7)] {
        for m in [4, 8, 16, 33] {
            for layers in [2, 4] {
                for mib in [1u64, 2, 8, 32] {
                    let input = SchedulePlanInput {
                        schedule: Schedule::OneFOneB { pp_size: pp, pp_rank: rank, num_microbatches: m },
                        layers: workspace_layers(layers, mib << 20),
                    };
                    let plan = plan_verified(&input, &opts);
                    total += 1;
                    worst = worst.max(plan.ratio());
                    if plan.ratio() > 1.001 {
                        above += 1;
                        println!(
                            "pp {pp} rank {rank} M {m}, {layers} layers, hidden {mib} MiB, {} MiB over the bound: {}",
                            (plan.footprint - plan.lower_bound) >> 20,
                            outcome(&plan)
                        );
                    }
                }
            }
        }
    }
    println!("{total} schedules, {budget_ms} ms each: {above} above 1.001 × the bound, worst {worst:.4}");
}

/// The plan of `input` (a generated schedule: valid), its placement checked.
fn plan_verified(input: &SchedulePlanInput, opts: &PlaceOptions) -> Plan {
    let plan = plan_schedule(input, opts).expect("generated schedules are valid");
    let buffers = graphpool_planner::pipeline::schedule_buffers(input).expect("valid").buffers;
    let offsets: Vec<u64> = plan.buffers.iter().map(|b| b.offset).collect();
    verify(&buffers, &offsets).expect("valid placement");
    plan
}

/// Each stage of `plan`: name, time and the footprint after it over the bound.
fn stage_list(plan: &Plan) -> Vec<String> {
    plan.stages
        .iter()
        .map(|st| match st.footprint {
            Some(f) => format!(
                "{} {:.1} ms {:.4}",
                st.name,
                st.elapsed.as_secs_f64() * 1e3,
                f as f64 / plan.lower_bound as f64
            ),
            None => format!("{} {:.1} ms", st.name, st.elapsed.as_secs_f64() * 1e3),
        })
        .collect()
}

/// How `plan` came out: buffers, footprint over the bound and the live bound, time, slots,
/// strategy, and its stages on a line of their own.
fn outcome(plan: &Plan) -> String {
    format!(
        "{} buffers: {:.4} of the bound ({:.4} of the live bound) in {:.1} ms, {} slots ({})\n    stages: {}",
        plan.buffers.len(),
        plan.ratio(),
        plan.footprint as f64 / plan.live_bound.max(1) as f64,
        plan.elapsed.as_secs_f64() * 1e3,
        plan.slots,
        plan.strategy,
        stage_list(plan).join(" | ")
    )
}

/// Plans random explicit orders (see the module documentation).
fn explicit(cases: std::ops::RangeInclusive<u64>, budget_ms: u64) {
    let opts = PlaceOptions { time_budget: Duration::from_millis(budget_ms), ..PlaceOptions::default() };
    let (mut above, mut worst, mut slowest) = (0, 1.0f64, (Duration::ZERO, 0));
    let count = cases.clone().count();
    for case in cases {
        let ExplicitCase { chunks: v, microbatches: m, window, eager, layers, input } =
            random_explicit_case(case);
        let plan = plan_verified(&input, &opts);
        worst = worst.max(plan.ratio());
        slowest = slowest.max((plan.elapsed, case));
        if plan.ratio() > 1.001 || plan.elapsed > opts.time_budget.mul_f64(1.25) {
            above += usize::from(plan.ratio() > 1.001);
            println!(
                "case {case}: {v} chunks, M {m}, window {window}, eager {eager}, {layers} layers, {}",
                outcome(&plan)
            );
        }
    }
    println!(
        "{count} explicit orders, {budget_ms} ms each: {above} above 1.001 × the bound, worst {worst:.4}, slowest plan {:.1} ms (case {})",
        slowest.0.as_secs_f64() * 1e3,
        slowest.1
    );
}

/// The layers a case of the sweep draws (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layers {
    /// `pipeline::varied_layers`: transformer layers of one hidden state.
    Varied,
    /// `uneven_layers`: byte counts that look measured.
    Uneven,
    /// `inputs_layers`: several inputs and outputs of their own shapes.
    Inputs,
}

/// The pipelines a case of the sweep draws (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pipelines {
    /// The first sweep's: pipeline size 1–16, up to 256 microbatches, 1–8 layers a chunk.
    Sweep,
    /// `large`: long pipelines and many microbatches.
    Large,
    /// `models`: whole models' layers split across the pipeline.
    Models,
    /// `deep`: long pipelines of many layers a chunk and up to 8 chunks (thousands of layers a
    /// rank: more than real models give, a test of the planner's time).
    Deep,
}

/// Case `case` of the sweep (see the module documentation): the schedule, layers per chunk
/// and the input. `pipelines` draws the pipelines, microbatch counts and layers per chunk,
/// `kind` the layers.
fn draw(case: u64, pipelines: Pipelines, kind: Layers) -> (Schedule, u32, SchedulePlanInput) {
    let mut rng = Rng::new(case);
    let pp = pick(
        &mut rng,
        match pipelines {
            Pipelines::Sweep => &[1, 2, 4, 8, 16],
            Pipelines::Large => &[8, 16, 32],
            Pipelines::Models => &[2, 4, 8, 16, 32],
            Pipelines::Deep => &[8, 16, 32, 64],
        },
    ) as u32;
    let (schedule, chunks) = if rng.below(2) == 0 {
        let p = pp as u64;
        let m = match pipelines {
            Pipelines::Sweep => pick(&mut rng, &[1, 2, 3, p, 2 * p, 4 * p + 1, 64, 128, 256]),
            Pipelines::Large => pick(&mut rng, &[512, 1024, 2048]),
            Pipelines::Models => pick(&mut rng, &[p, 4 * p, 8 * p + 1, 256]),
            Pipelines::Deep => pick(&mut rng, &[p, 4 * p, 512]),
        } as u32;
        let rank = rng.below(pp as u64) as u32;
        (Schedule::OneFOneB { pp_size: pp, pp_rank: rank, num_microbatches: m }, 1)
    } else {
        let pp = pp.max(2);
        let (chunk_counts, groups): (&[u64], &[u64]) = match pipelines {
            Pipelines::Sweep => (&[2, 3, 4], &[1, 2, 4, 8]),
            Pipelines::Large => (&[2, 3, 4], &[16, 32, 64]),
            Pipelines::Models => (&[2, 3, 4, 6, 8], &[1, 2, 4, 8]),
            Pipelines::Deep => (&[2, 3, 4, 6, 8], &[1, 2, 3, 8]),
        };
        let v = pick(&mut rng, chunk_counts) as u32;
        let m = pp * pick(&mut rng, groups) as u32;
        let rank = rng.below(pp as u64) as u32;
        (Schedule::Interleaved { pp_size: pp, pp_rank: rank, num_microbatches: m, virtual_chunks: v }, v)
    };
    let layers = match pipelines {
        Pipelines::Models => pick(&mut rng, &[32, 48, 64, 80, 96, 128]).div_ceil((pp * chunks) as u64),
        Pipelines::Deep => pick(&mut rng, &[6, 10, 16, 20]),
        _ => rng.range(1, 8),
    } as u32;
    let seq = pick(&mut rng, &[1024, 2048, 4096, 8192]);
    let batch = pick(&mut rng, &[1, 2, 4]);
    let hidden = pick(&mut rng, &[1024, 2048, 4096, 5120, 8192]);
    let layers_of = match kind {
        Layers::Uneven => uneven_layers(chunks, layers, case),
        Layers::Inputs => inputs_layers(chunks, layers, case),
        Layers::Varied => varied_layers(chunks, layers, seq, batch, hidden, case),
    };
    let input = SchedulePlanInput { schedule: schedule.clone(), layers: layers_of };
    (schedule, layers, input)
}

/// One of `options`, drawn uniformly.
fn pick(rng: &mut Rng, options: &[u64]) -> u64 {
    options[rng.below(options.len() as u64) as usize]
}

/// `layers` layers per chunk whose byte counts look measured (see the module documentation).
fn uneven_layers(chunks: u32, layers: u32, seed: u64) -> Vec<LayerSpec> {
    let mut rng = Rng::new(seed ^ 0x756e_6576_656e);
    let state = |shape: &[u64], kept: bool| TensorSpec {
        name: "hidden".to_string(),
        shape: shape.to_vec(),
        dtype: "bf16".to_string(),
        kept_for_backward: kept,
    };
    let mut out = Vec::new();
    for chunk in 0..chunks {
        let mut shape =
            vec![pick(&mut rng, &[1024, 2048, 4096]), 1, pick(&mut rng, &[1024, 2048, 4096, 5120])];
        for layer in 0..layers {
            let input = state(&shape, true);
            if rng.below(4) == 0 {
                shape[2] = pick(&mut rng, &[1024, 2048, 4096, 5120]);
            }
            out.push(LayerSpec {
                chunk,
                layer,
                inputs: vec![input],
                outputs: vec![state(&shape, false)],
                saved_bytes: (rng.range(1, 200) << 20) | (rng.below(2048) << 9),
                forward_workspace_bytes: rng.below(65) << 20,
                backward_workspace_bytes: rng.below(65) << 20,
            });
        }
    }
    out
}

/// `layers` layers per chunk with several inputs and outputs (see the module documentation).
fn inputs_layers(chunks: u32, layers: u32, seed: u64) -> Vec<LayerSpec> {
    let mut rng = Rng::new(seed ^ 0x696e_7075_7473);
    let tensor = |rng: &mut Rng, name: &str, kept: bool| {
        let seq = pick(rng, &[512, 1024, 2048, 4096, 8192]);
        let batch = pick(rng, &[1, 2, 4]);
        let hidden = pick(rng, &[1024, 2048, 4096, 5120, 8192]);
        let shape = match rng.below(3) {
            0 => vec![seq, batch, hidden],
            1 => vec![batch, seq, hidden],
            _ => vec![seq * batch, hidden],
        };
        let dtype = ["bf16", "bf16", "f16", "f32", "f8e4m3"][rng.below(5) as usize];
        TensorSpec { name: name.to_string(), shape, dtype: dtype.to_string(), kept_for_backward: kept }
    };
    let bytes = |rng: &mut Rng, mib: u64| match rng.below(3) {
        0 => 0,
        1 => rng.range(1, mib) << 20,
        _ => rng.range(1, mib << 20),
    };
    let mut out = Vec::new();
    for chunk in 0..chunks {
        for layer in 0..layers {
            let kept = rng.below(5) != 0;
            let mut inputs = vec![tensor(&mut rng, "hidden", kept)];
            if rng.below(10) < 3 {
                let kept = rng.below(2) == 0;
                inputs.push(tensor(&mut rng, "mask", kept));
            }
            if rng.below(5) == 0 {
                let shape = vec![pick(&mut rng, &[1, 2, 4]), pick(&mut rng, &[1024, 4096])];
                inputs.push(TensorSpec {
                    name: "ids".into(),
                    shape,
                    dtype: "i64".into(),
                    kept_for_backward: false,
                });
            }
            let mut outputs = vec![tensor(&mut rng, "hidden", false)];
            if rng.below(4) == 0 {
                outputs.push(tensor(&mut rng, "aux", false));
            }
            out.push(LayerSpec {
                chunk,
                layer,
                inputs,
                outputs,
                saved_bytes: bytes(&mut rng, 400),
                forward_workspace_bytes: bytes(&mut rng, 128),
                backward_workspace_bytes: bytes(&mut rng, 256),
            });
        }
    }
    out
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("explicit") {
        let usage = "usage: schedules explicit [CASES | FROM-TO] [BUDGET_MS]";
        let cases = std::env::args().nth(2).unwrap_or_else(|| "200".to_string());
        let (first, last) = match cases.split_once('-') {
            Some((a, b)) => (a.parse().expect(usage), b.parse().expect(usage)),
            None => (1, cases.parse().expect(usage)),
        };
        explicit(first..=last, std::env::args().nth(3).map_or(200, |v| v.parse().expect(usage)));
        return;
    }
    if std::env::args().nth(1).as_deref() == Some("workspaces") {
        let budget_ms = std::env::args()
            .nth(2)
            .map_or(200, |v| v.parse().expect("usage: schedules workspaces [BUDGET_MS]"));
        workspaces(budget_ms);
        return;
    }
    // Words that pick the pipelines (`large`, `models`, `deep`) and the layers (`uneven`,
    // `inputs`), anywhere among the arguments; the first sweep's by default.
    let pipeline_words =
        [("large", Pipelines::Large), ("models", Pipelines::Models), ("deep", Pipelines::Deep)];
    let layer_words = [("inputs", Layers::Inputs), ("uneven", Layers::Uneven)];
    let given = |word: &str| std::env::args().any(|a| a == word);
    let pipelines = pipeline_words.iter().find(|(w, _)| given(w)).map_or(Pipelines::Sweep, |&(_, p)| p);
    let kind = layer_words.iter().find(|(w, _)| given(w)).map_or(Layers::Varied, |&(_, k)| k);
    let args: Vec<String> = std::env::args()
        .filter(|a| {
            !pipeline_words.iter().map(|w| w.0).chain(layer_words.iter().map(|w| w.0)).any(|w| w == a)
        })
        .collect();
    let arg = |k: usize, default: u64| -> u64 {
        args.get(k)
            .cloned()
            .map_or(default, |v| v.parse().expect("usage: schedules [CASES | FROM-TO] [BUDGET_MS] [THREADS]"))
    };
    // CASES: a count (cases 1..=CASES) or a range FROM-TO.
    let (first, cases) = match args.get(1).cloned() {
        Some(v) if v.contains('-') => {
            let (a, b) = v.split_once('-').expect("contains '-'");
            let parse =
                |x: &str| x.parse::<u64>().expect("usage: schedules [CASES | FROM-TO] [BUDGET_MS] [THREADS]");
            (parse(a), parse(b))
        }
        _ => (1, arg(1, 100)),
    };
    let budget_ms = arg(2, 200);
    let threads = arg(3, 0) as usize;
    let opts =
        PlaceOptions { time_budget: Duration::from_millis(budget_ms), threads, ..PlaceOptions::default() };
    // Cases above 1.001 written as `graphpool plan --schedule` descriptions, where asked.
    let dump = std::env::var_os("SCHEDULES_DUMP").map(std::path::PathBuf::from);
    if let Some(dir) = &dump {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    }
    let began = Instant::now();
    let (mut above, mut worst, mut slowest) = (0, 1.0f64, (Duration::ZERO, 0));
    for case in first..=cases {
        let (schedule, layers, input) = draw(case, pipelines, kind);
        let plan = plan_verified(&input, &opts);
        worst = worst.max(plan.ratio());
        slowest = slowest.max((plan.elapsed, case));
        let stages = stage_list(&plan);
        if plan.elapsed > opts.time_budget.mul_f64(1.25) {
            println!(
                "case {case}: {schedule:?}, {layers} layers, {} buffers: planned in {:.1} ms ({})",
                plan.buffers.len(),
                plan.elapsed.as_secs_f64() * 1e3,
                stages.join(", ")
            );
        }
        if plan.ratio() > 1.001 {
            above += 1;
            println!("case {case}: {schedule:?}, {layers} layers, {}", outcome(&plan));
            if let Some(dir) = &dump {
                let path = dir.join(format!("case-{case}.json"));
                let text = serde_json::to_string(&input).expect("a schedule serializes");
                std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            }
        }
    }
    println!(
        "{} schedules, {budget_ms} ms each: {above} above 1.001 × the bound, worst {worst:.4}, slowest plan {:.1} ms (case {}; {:.1} s in all)",
        cases + 1 - first,
        slowest.0.as_secs_f64() * 1e3,
        slowest.1,
        began.elapsed().as_secs_f64()
    );
}
