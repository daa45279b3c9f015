//! `cargo bench -p graphpool-planner`: planning time on generated pipeline schedules and
//! random / dense / two-population / tightly packed buffer lists up to 100k buffers,
//! `plan_schedule` (what PlanCapture runs) on schedules with varied layers at the daemon's
//! default budget, and the gap queries every construction and improvement step is made of
//! (`gap_query/…`: 10k queries on a placed 100k list, and on the alias groups of two long
//! pipelines, read through the rows of the items each meets and past their cap, for each
//! fit), the online constructions (`online/…`: best fit, aligned and the repairing sweep
//! over 100k buffers), the improvement stage (`improvement/…`: a fixed number of its steps
//! on a 100k list, and on a pipeline stage's alias groups), the lower bound of alias groups
//! (`lower_bound/…`) and the canonical search (`canonical/…`: 20k nodes on lists of up to
//! 2000 items, each way of checking a node). Ratios are printed by `cargo run --release -p
//! graphpool-planner --example figures`.

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use graphpool_planner::dsa::{CanonicalNodes, GapQueries, ImprovementSteps, OnlineConstructions};
use graphpool_planner::pipeline::{
    random_explicit_case, schedule_buffers, transformer_layers, varied_layers,
};
use graphpool_planner::{
    Buffer, PlaceOptions, Schedule, SchedulePlanInput, lower_bound, place, plan_schedule, workload,
};

fn pipeline(schedule: Schedule, chunks: u32) -> Vec<Buffer> {
    let input = SchedulePlanInput { schedule, layers: transformer_layers(chunks, 9, 4096, 1, 1024) };
    schedule_buffers(&input).expect("valid schedule").buffers
}

fn bench(c: &mut Criterion) {
    let opts = PlaceOptions { time_budget: Duration::from_secs(1), ..PlaceOptions::default() };
    let cases: Vec<(String, Vec<Buffer>)> = vec![
        (
            "1f1b_pp8_r0_m128".into(),
            pipeline(Schedule::OneFOneB { pp_size: 8, pp_rank: 0, num_microbatches: 128 }, 1),
        ),
        (
            "interleaved_pp4_v2_r0_m64".into(),
            pipeline(
                Schedule::Interleaved { pp_size: 4, pp_rank: 0, num_microbatches: 64, virtual_chunks: 2 },
                2,
            ),
        ),
        (
            // 24k buffers in alias groups of ~11 intervals: the gap queries of groups.
            "interleaved_pp8_v4_r3_m128".into(),
            pipeline(
                Schedule::Interleaved { pp_size: 8, pp_rank: 3, num_microbatches: 128, virtual_chunks: 4 },
                4,
            ),
        ),
        ("random_1k".into(), workload::random(1_000, 1)),
        ("random_10k".into(), workload::random(10_000, 1)),
        ("random_100k".into(), workload::random(100_000, 1)),
        ("uniform_10k".into(), workload::random_uniform(10_000, 1)),
        ("uniform_100k".into(), workload::random_uniform(100_000, 1)),
        ("usize_100k".into(), workload::random_uniform_sizes(100_000, 1)),
        ("dense_10k".into(), workload::random_dense(10_000, 1)),
        ("dense_100k".into(), workload::random_dense(100_000, 1)),
        ("bimodal_100k".into(), workload::random_bimodal(100_000, 1)),
        // Half the buffers in alias groups that recur at a period: greedy passes only.
        ("grouped_10k".into(), workload::random_grouped(10_000, 1)),
        // Ten iterations of one list: split into parts, one copy planned.
        ("repeated_10k".into(), workload::repeated_iterations(10_000, 1)),
        // An eager training step as an allocator sees it (seed 3: its floor is 1.03 × the
        // bound, so the search runs).
        ("training_10k_seed3".into(), workload::training_trace(10_000, 3)),
        // A tiling the canonical search places at the bound (in its coarse instance).
        ("packed_1k_seed7".into(), workload::packed(1_000, 7)),
        ("packed_10k".into(), workload::packed(10_000, 1)),
    ];
    let mut group = c.benchmark_group("place");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    for (name, buffers) in &cases {
        group.bench_function(name.as_str(), |b| b.iter(|| place(buffers, &opts).expect("valid")));
    }
    group.finish();

    let daemon = PlaceOptions { time_budget: Duration::from_millis(200), ..PlaceOptions::default() };
    let long = Schedule::Interleaved { pp_size: 32, pp_rank: 22, num_microbatches: 2048, virtual_chunks: 4 };
    let schedules = [
        ("varied_1f1b_pp8_r0_m64", Schedule::OneFOneB { pp_size: 8, pp_rank: 0, num_microbatches: 64 }, 1),
        (
            "varied_interleaved_pp8_v3_r2_m64",
            Schedule::Interleaved { pp_size: 8, pp_rank: 2, num_microbatches: 64, virtual_chunks: 3 },
            3,
        ),
        // Hundreds of thousands of buffers in a few thousand alias groups.
        ("varied_interleaved_pp32_v4_r22_m2048", long.clone(), 4),
    ];
    let mut group = c.benchmark_group("plan_schedule");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    for (name, schedule, chunks) in schedules {
        let input = SchedulePlanInput { schedule, layers: varied_layers(chunks, 4, 2048, 1, 2048, 1) };
        group.bench_function(name, |b| b.iter(|| plan_schedule(&input, &daemon).expect("valid")));
    }
    group.finish();

    let lists = [
        ("random_100k", workload::random(100_000, 1)),
        ("packed_100k", workload::packed(100_000, 1)),
        ("dense_100k", workload::random_dense(100_000, 1)),
    ];
    // Alias groups of several intervals each (their queries read the items they meet).
    let groups = SchedulePlanInput { schedule: long, layers: varied_layers(4, 4, 2048, 1, 2048, 1) };
    let groups = ("alias_groups_pp32_m2048", schedule_buffers(&groups).expect("valid schedule").buffers);
    // And a stage of 20 layers a chunk: 40k buffers in 20k groups, too many for the rows of
    // the items each meets (the buckets' runs, each neighbour kept once).
    let many = SchedulePlanInput {
        schedule: Schedule::Interleaved { pp_size: 32, pp_rank: 2, num_microbatches: 96, virtual_chunks: 4 },
        layers: varied_layers(4, 20, 2048, 1, 2048, 1),
    };
    let many = ("alias_groups_pp32_v4_l20", schedule_buffers(&many).expect("valid schedule").buffers);
    let mut group = c.benchmark_group("gap_query");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    for (name, buffers) in lists.iter().chain([&groups, &many]) {
        let mut queries = GapQueries::new(buffers).expect("valid");
        for (fit, lowest) in [("best_fit", false), ("lowest_offset", true)] {
            group.bench_function(format!("{name}_{fit}_10k"), |b| b.iter(|| queries.run(10_000, lowest, 7)));
        }
    }
    group.finish();

    // The online constructions (the floor every plan gets; the aligned construction and its
    // repairing sweep, which win the busier lists of uniform sizes), whole passes over 100k
    // buffers.
    let mut group = c.benchmark_group("online");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    let busy = ("usize_busy_100k", workload::random_uniform_sizes_busy(100_000, 1));
    for (name, buffers) in lists.iter().chain([&busy]) {
        let online = OnlineConstructions::new(buffers).expect("valid");
        let floor = online.best_fit();
        group.bench_function(format!("{name}_best_fit"), |b| b.iter(|| online.best_fit()));
        group.bench_function(format!("{name}_aligned"), |b| b.iter(|| online.aligned()));
        group.bench_function(format!("{name}_repairing"), |b| b.iter(|| online.repairing(floor)));
    }
    group.finish();

    // The improvement stage: 1000 of its steps from the online best fit's placement (the
    // top moves down nearly every step there, as it does late in a plan); 100 on the dense
    // list, whose steps take milliseconds.
    // And 1000 on a pipeline stage whose layers differ (alias groups, a few hundred items:
    // its chains are kicked when they stall).
    let stage = SchedulePlanInput {
        schedule: Schedule::Interleaved { pp_size: 8, pp_rank: 2, num_microbatches: 64, virtual_chunks: 3 },
        layers: varied_layers(3, 4, 2048, 1, 2048, 1),
    };
    let stage =
        ("varied_interleaved_pp8_v3_r2_m64", schedule_buffers(&stage).expect("valid schedule").buffers);
    let mut group = c.benchmark_group("improvement");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    for ((name, buffers), count) in lists.iter().chain([&stage]).zip([1000, 1000, 100, 1000]) {
        let steps = ImprovementSteps::new(buffers).expect("valid");
        group.bench_function(format!("{name}_{count}_steps"), |b| b.iter(|| steps.run(count, 7)));
    }
    group.finish();

    // The lower bound every plan starts with (live bytes, the alias groups' heaviest clique,
    // the contiguity bound and the bound of a few ranks): the stage above's alias groups, an
    // explicit order's 1917 groups (the conflict graph at its busiest among the sweeps), the
    // long pipeline's, too many meetings for the conflict graph (the greedy clique alone),
    // and a stage of thousands of graphs whose greedy clique takes nearly every candidate.
    let explicit =
        ("explicit_case_172", schedule_buffers(&random_explicit_case(172).input).expect("valid").buffers);
    let deep = SchedulePlanInput {
        schedule: Schedule::Interleaved { pp_size: 32, pp_rank: 11, num_microbatches: 64, virtual_chunks: 6 },
        layers: varied_layers(6, 16, 2048, 1, 2048, 1),
    };
    let deep = ("deep_interleaved_pp32_v6_m64", schedule_buffers(&deep).expect("valid schedule").buffers);
    let mut group = c.benchmark_group("lower_bound");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    for (name, buffers) in [&stage, &explicit, &groups, &deep] {
        group.bench_function(*name, |b| b.iter(|| lower_bound(buffers).expect("valid")));
    }
    group.finish();

    // The canonical search: one restart of 20k nodes at the live bound with the first static
    // order (the stage runs such restarts back to back), its nodes checked by painting the
    // ranks and rank by rank (the search takes one by how many ranks the items live at), on
    // lists it takes: a tiling of 1k pieces, random 2k lists with alias groups and of uniform
    // sizes ~500 live, the stage above's alias groups and the explicit order's. None is
    // decided within the nodes. Each run prepares the search first (10–13 ms of it on the
    // explicit order and the 2k lists).
    let lists = [
        ("packed_1k", workload::packed(1000, 1)),
        ("grouped_2k", workload::random_grouped(2000, 1)),
        ("usize_busy_2k", workload::random_uniform_sizes_busy(2000, 1)),
    ];
    let mut group = c.benchmark_group("canonical");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    for (name, buffers) in lists.iter().chain([&stage, &explicit]) {
        let search = CanonicalNodes::new(buffers).expect("valid");
        let taken = if search.paints() { "painted" } else { "rank_by_rank" };
        println!("canonical/{name}: the search checks its nodes {taken}");
        for (check, painting) in [("painted", true), ("rank_by_rank", false)] {
            group.bench_function(format!("{name}_20k_nodes_{check}"), |b| {
                // Here, not above: only where the filter selects it.
                assert_eq!(
                    search.run(20_000, painting),
                    (20_000, false),
                    "{name} is decided within the nodes"
                );
                b.iter(|| search.run(20_000, painting))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
