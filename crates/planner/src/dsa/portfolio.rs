//! The portfolio of constructions (stage 3 of the module documentation): greedy orders,
//! skyline rules, the online aligned constructions and the layered fill, as jobs on all
//! cores, each started only when the cost model says it ends in time; the best per window
//! of the decomposition is kept.

use super::*;

/// One construction of the portfolio.
#[derive(Debug, Clone, Copy)]
enum Job {
    /// A greedy order of [`Strategy::PORTFOLIO`] (on the decomposition).
    Greedy(usize),
    /// A rule of [`SKYLINE_RULES`].
    Skyline(usize),
    /// A variant of [`ALIGNED_VARIANTS`].
    Aligned(usize),
    /// The online aligned sweep that backs up where it would rise above a target
    /// ([`online_aligned_repair`] with [`REPAIR_RULE`]).
    Repair,
    /// One stretch of the clock filled in around the planned skeleton (a greedy pass over
    /// its items; see [`layered_fill`]).
    Layered(usize),
}

impl Job {
    /// Index of the job's kind (for the cost estimates).
    fn kind(self) -> usize {
        match self {
            Job::Greedy(_) => 0,
            Job::Skyline(_) => 1,
            Job::Aligned(_) => 2,
            Job::Layered(_) => 3,
            Job::Repair => 4,
        }
    }
}

/// A construction of the portfolio.
struct Built {
    /// Position in the job order (breaks ties).
    job: usize,
    name: String,
    off: Vec<u64>,
    high: u64,
    /// Built around a hot skeleton (see [`run`]).
    hot: bool,
}

/// What the repairing sweep is expected to take where an aligned construction takes
/// `aligned_ns`: half as long again (measured on 100k lists of similar or uniform sizes, 2
/// cores: 1.3–2 ×).
fn repair_from_aligned(aligned_ns: u64) -> u64 {
    aligned_ns * 3 / 2
}
/// Seeds the repairing sweep's noise in the portfolio.
const REPAIR_SEED: u64 = 0x7265_7061_6972;

/// How much higher than the lowest construction of the portfolio one earlier in the job
/// order may be and still be preferred as the start (see [`run`]; the lowest is kept as the
/// answer unless the stages after get below it).
const START_TIE: f64 = 0.01;

/// The first job of the portfolio runs to its end (past the deadline) when it is expected
/// to take at most the plan's budget or this, whichever is more ...
pub(super) const GUARANTEED_PASS_MIN: Duration = Duration::from_millis(100);
/// ... or, when the online floor is above `FAR_FLOOR` × the bound, this many times that.
pub(super) const FAR_FLOOR_PASS_BUDGETS: u32 = 20;
/// See [`FAR_FLOOR_PASS_BUDGETS`].
pub(super) const FAR_FLOOR: f64 = 1.1;

/// What the portfolio is given (see [`run`]).
pub(super) struct PortfolioPlan<'a> {
    pub(super) lb: u64,
    pub(super) dense: bool,
    /// The cost model's estimate of one greedy pass.
    pub(super) greedy_pass: Duration,
    /// The plan's whole budget (bounds the first job's guarantee).
    pub(super) budget: Duration,
    /// When every job stops.
    pub(super) deadline: Instant,
    /// After this no job starts that its estimate says would not finish.
    pub(super) portfolio_deadline: Instant,
    pub(super) threads: usize,
    /// A placement other than the floor exists already: a coarse plan, or the plan this one
    /// is the mirror image of, running beside it. The first job then need not finish.
    pub(super) placement_in_hand: bool,
    /// A planned skeleton: the layered construction's stretches are the first jobs.
    pub(super) skeleton: Option<&'a Skeleton>,
    /// What filling in around the skeleton is expected to take per worker.
    pub(super) fill_pass: Duration,
    /// The footprint of the first online aligned construction where it was built already
    /// (beside the skeleton's plan): that job is not run again, and its footprint counts
    /// among the aligned constructions' in [`Portfolio::aligned_led`].
    pub(super) aligned_built: Option<u64>,
    /// Whether the repairing sweep runs (not in the plan of a hot skeleton, nor around one:
    /// see [`run`]).
    pub(super) repair: bool,
}

/// What the portfolio did.
pub(super) struct Portfolio {
    /// Windows of the decomposition.
    pub(super) windows: usize,
    /// Greedy orders that finished.
    pub(super) strategies_run: usize,
    /// The slowest skyline pass and greedy pass (the cost model's estimate when none ran,
    /// zero when the portfolio did not run).
    pub(super) sky_estimate: Duration,
    pub(super) greedy_estimate: Duration,
    /// Whether an online aligned construction came out lower than every skyline pass (and
    /// one ran): the family the restarts draw from.
    pub(super) aligned_led: bool,
    /// What the repairing sweep took where it came out below every other construction
    /// (the restarts then repeat it: see `place`).
    pub(super) repair_led: Option<Duration>,
}

impl Default for Portfolio {
    fn default() -> Self {
        Portfolio {
            windows: 1,
            strategies_run: 0,
            sky_estimate: Duration::ZERO,
            greedy_estimate: Duration::ZERO,
            aligned_led: false,
            repair_led: None,
        }
    }
}

/// How much faster than modelled a greedy pass over alias groups runs (see [`expected`]).
const GROUP_PASS_MODEL_ERROR: u32 = 6;

/// What the portfolio expects a job the cost model puts at `est` to take. The model errs
/// high on lists with alias groups (an explicit order of 6.7k items modelled at 287 ms took
/// ~70 ms on the development machine, ~200 ms on a slower 16-core host; 40 schedules of
/// 2.5k–313k buffers took 1/5.5 to 1/13 of their estimate), where nothing replaces the
/// greedy passes (the floor and the improvement stage stayed 7% above the bound there, 39%
/// on a 313k-buffer interleaved schedule): passes over groups (`over_groups`) are expected at
/// [`GROUP_PASS_MODEL_ERROR`] times the modelled speed until one has been measured, the
/// first both for starting it and for letting it finish past the deadline — and a first
/// pass let finish is stopped once it has run longer than the guarantee allows the model's
/// own estimate (a safety net where the model erred low).
fn expected(est: Duration, over_groups: bool) -> Duration {
    if over_groups { est / GROUP_PASS_MODEL_ERROR } else { est }
}

/// Sets its flag when dropped (at the end of a loop iteration, however it ends).
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, AtomicOrdering::Release);
    }
}

/// The greedy orders after the first (breadth / best fit, which places most schedules at
/// their bound) on lists that no skyline pass takes (alias groups): size and area with the
/// lowest offset lead there, then the orders that schedules' windows mix to reach their bound
/// (breadth / lowest offset, start / best fit). Lists of 10k buffers in alias groups (members
/// recurring at a period, scattered at random, or one after another with gaps), each order
/// alone: size / lowest ranks first on average, 1.4% above the lowest, area / lowest second,
/// breadth / best fit last, 15% above (docs/planner.md, "Lists with alias groups").
const GROUPS_AFTER_FIRST: [Strategy; 9] = [
    Strategy { order: Order::Size, fit: Fit::LowestOffset },
    Strategy { order: Order::Breadth, fit: Fit::LowestOffset },
    Strategy { order: Order::Area, fit: Fit::LowestOffset },
    Strategy { order: Order::Size, fit: Fit::BestFit },
    Strategy { order: Order::Start, fit: Fit::BestFit },
    Strategy { order: Order::Area, fit: Fit::BestFit },
    Strategy { order: Order::Lifetime, fit: Fit::BestFit },
    Strategy { order: Order::Lifetime, fit: Fit::LowestOffset },
    Strategy { order: Order::Start, fit: Fit::LowestOffset },
];

/// The portfolio's jobs, most useful first: the layered fill's `fill_parts` stretches, then
/// greedy orders, skyline rules and the online aligned constructions interleaved; dense
/// inputs lead with the aligned constructions (less the first where it was `aligned_built`
/// beside the skeleton) and a skyline pass (the greedy passes there cost most of the
/// budget); lists no skyline pass takes (alias groups) run the greedy orders only, after the
/// first in the order of [`GROUPS_AFTER_FIRST`]. With `repair`, the repairing sweep right
/// after the first aligned construction.
fn job_order(
    dense: bool,
    with_skyline: bool,
    fill_parts: usize,
    aligned_built: bool,
    repair: bool,
) -> Vec<Job> {
    let mut order: Vec<Job> = (0..fill_parts).map(Job::Layered).collect();
    if dense {
        order.extend((usize::from(aligned_built)..ALIGNED_VARIANTS.len()).map(Job::Aligned));
        order.extend([Job::Skyline(0), Job::Greedy(0)]);
    } else if with_skyline {
        // The aligned constructions lead on lists of uniform sizes (few small buffers to fill
        // gaps: 10k lists 1.064 → 1.050 with them), and cost ~1 µs per item: after the first
        // greedy pass and skyline rule, or right after a skeleton's fill, behind which a
        // greedy pass left them no time (lists of uniform sizes with ~500 buffers live, given
        // 3 s, stayed at the online floor; docs/planner.md, "Busier lists of uniform sizes").
        let aligned = [0, 2, 1].map(Job::Aligned);
        let first_pass = [Job::Greedy(0), Job::Skyline(0)];
        if fill_parts > 0 {
            order.extend(aligned.into_iter().chain(first_pass));
        } else {
            order.extend(first_pass.into_iter().chain(aligned));
        }
    } else {
        order.push(Job::Greedy(0));
    }
    if with_skyline {
        order.push(Job::Greedy(1));
        order.extend((1..SKYLINE_RULES.len()).map(Job::Skyline));
        order.extend((2..Strategy::PORTFOLIO.len()).map(Job::Greedy));
    } else {
        order.extend(GROUPS_AFTER_FIRST.map(|s| {
            Job::Greedy(Strategy::PORTFOLIO.iter().position(|x| *x == s).expect("an order of the portfolio"))
        }));
    }
    if repair && let Some(k) = order.iter().position(|j| matches!(j, Job::Aligned(_))) {
        order.insert(k + 1, Job::Repair);
    }
    order
}

/// The portfolio of constructions (see the module documentation), on all cores and
/// time-boxed; offers the start for the stages after it to `best`.
pub(super) fn run(p: &Problem, plan: &PortfolioPlan, best: &mut Incumbent) -> Portfolio {
    let PortfolioPlan { lb, dense, greedy_pass, deadline, portfolio_deadline, threads, .. } = *plan;
    let floor_far = best.high as f64 > lb as f64 * FAR_FLOOR;
    let (placement_in_hand, skeleton) = (plan.placement_in_hand, plan.skeleton);
    let n = p.len();
    let d = decompose(p, lb);
    let threads = threads.clamp(1, Strategy::PORTFOLIO.len());
    // Skyline passes need items of one interval each.
    let with_skyline = p.ivs.len() == n && n > EXACT_MAX_ITEMS;
    let parts = workers_for(threads, deadline.saturating_duration_since(Instant::now()));
    let fill = skeleton.map(|sk| layered_fill(p, sk, parts));
    let fill_parts = fill.as_ref().map_or(0, |f| f.parts());
    // Around a hot skeleton the construction it gives is the start (below), and the
    // repairing sweep only took time from the stages after (100k lists, seeds 1–10: four of
    // 30 plans higher by 0.001–0.011, none lower).
    let hot_skeleton = skeleton.is_some_and(|sk| sk.hot);
    let order = job_order(
        dense,
        with_skyline,
        fill_parts,
        plan.aligned_built.is_some(),
        plan.repair && !hot_skeleton,
    );
    let jobs = order.len();
    let next = AtomicUsize::new(0);
    // The slowest finished job of each kind estimates the next one of that kind; until
    // one has finished, the cost model does: a greedy pass from the pairs of items live
    // together, ~1 µs per item for a skyline pass, ~1.2 µs per item for an aligned one, for
    // a stretch of the layered fill what `PortfolioPlan::fill_pass` expects per worker, and
    // for the repairing sweep half as much again as an aligned construction.
    let greedy_ns = greedy_pass.as_nanos() as u64;
    let part_ns = plan.fill_pass.as_nanos() as u64;
    let modelled_ns =
        [greedy_ns, 1_000 * n as u64, 1_200 * n as u64, part_ns, repair_from_aligned(1_200 * n as u64)];
    let estimate_ns = [(); 5].map(|_| AtomicU64::new(0));
    let repair_target = repair_first_target(lb, best.high);
    let measured = |kind: usize| estimate_ns[kind].load(AtomicOrdering::Relaxed);
    // The repairing sweep, until one has run, from an aligned construction that has.
    let (repair_kind, aligned_kind) = (Job::Repair.kind(), Job::Aligned(0).kind());
    let measured_or_modelled = |kind: usize| match (measured(kind), measured(aligned_kind)) {
        (0, aligned) if kind == repair_kind && aligned > 0 => repair_from_aligned(aligned),
        (0, _) => modelled_ns[kind],
        (e, _) => e,
    };
    let runs: Mutex<Vec<Run>> = Mutex::new(Vec::new());
    let filled: Mutex<Vec<Option<FilledPart>>> =
        Mutex::new((0..fill.as_ref().map_or(0, |f| f.parts())).map(|_| None).collect());
    let built_any = AtomicBool::new(false);
    let at_bound = AtomicBool::new(false);
    // Whole-instance constructions.
    let whole: Mutex<Vec<Built>> = Mutex::new(Vec::new());
    // The portfolio waits for its first job, which always runs (the layered stretches: all
    // of them): until that is expected to end, the other workers take any job expected to
    // end by then too, even after `portfolio_deadline`.
    let first_ns = order.first().map_or(0, |j| measured_or_modelled(j.kind()));
    let first_end = Instant::now() + Duration::from_nanos(first_ns);
    let start_by = portfolio_deadline.max(first_end.min(deadline));
    let workers = workers_for(threads.min(jobs), deadline.saturating_duration_since(Instant::now()));
    // Jobs passed over while the first job runs, on an estimate of the cost model (no job of
    // their kind measured yet): taken up again once the first job has ended and measured its
    // kind. The model errs high (up to 9 ×), and a worker that passed over every job while
    // the first ran left them all undone: an interleaved schedule whose first pass took 8 ms
    // stayed at 1.0032 on 2 cores with 180 ms left, and reached its bound on one core.
    let deferred: Mutex<std::collections::VecDeque<usize>> = Mutex::new(Default::default());
    let first_ended = AtomicBool::new(jobs == 0);
    run_workers(workers, |_| {
        loop {
            let fresh = next.fetch_add(1, AtomicOrdering::Relaxed);
            let k = if fresh < jobs {
                fresh
            } else {
                while !first_ended.load(AtomicOrdering::Acquire) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_micros(100));
                }
                match deferred.lock().expect("portfolio worker panicked").pop_front() {
                    Some(k) => k,
                    None => break,
                }
            };
            // Nothing is lower than the bound: once a construction reaches it, no job starts.
            if at_bound.load(AtomicOrdering::Relaxed) {
                break;
            }
            let _first = (k == 0).then(|| SetOnDrop(&first_ended));
            let kind = order[k].kind();
            let over_groups = matches!(order[k], Job::Greedy(_)) && p.ivs.len() > n;
            let first_over_groups = k == 0 && over_groups;
            // Until a pass over alias groups has run, every one is expected as the first is:
            // the other workers start theirs beside it (on the model's estimate they waited
            // for it, and on 10k buffers in groups no second pass then fitted in the
            // portfolio's share: one construction, the first order, which is the weakest
            // there).
            let est = expected(
                Duration::from_nanos(measured_or_modelled(kind)),
                over_groups && measured(kind) == 0,
            );
            // Jobs stop at the deadline; the first one only once another construction
            // than the online floor exists (every plan gets one, and on a machine slower
            // than the cost model a long first pass does not overrun for nothing) — when it
            // is expected to take at most the budget (or `GUARANTEED_PASS_MIN`), or, where
            // the floor is far above the bound (schedules: 1.8–2.5 ×), at most
            // `FAR_FLOOR_PASS_BUDGETS` budgets. Beyond that the floor is the answer, not a
            // pass that many budgets long (a million buffers near the bound; 1.3 million
            // in alias groups: a 245 s pass). The layered fill's stretches are that first
            // construction together (it needs every one): each has the guarantee (on a
            // loaded machine a stretch stopped at the deadline left a dense list at the floor,
            // 1.15, where the aligned constructions it replaces give 1.05).
            let allowed = plan.budget.max(GUARANTEED_PASS_MIN);
            let allowed = if floor_far { allowed * FAR_FLOOR_PASS_BUDGETS } else { allowed };
            let first = k == 0 || matches!(order[k], Job::Layered(_));
            let guaranteed = first && !placement_in_hand && est <= allowed;
            // A job starts when it is expected to end by `start_by`; the first job (every
            // plan waits for it) by the deadline — with a placement in hand one that
            // cannot would only be stopped there, giving nothing. The guaranteed first job
            // and the layered fill's stretches (the construction needs every one) always
            // start.
            let must_start = guaranteed || matches!(order[k], Job::Layered(_));
            let start_limit = if k == 0 { deadline } else { start_by };
            if !must_start && Instant::now() + est > start_limit {
                let modelled = estimate_ns[kind].load(AtomicOrdering::Relaxed) == 0;
                if k == fresh && modelled && !first_ended.load(AtomicOrdering::Acquire) {
                    deferred.lock().expect("portfolio worker panicked").push_back(k);
                }
                continue;
            }
            let t = Instant::now();
            // A first pass over alias groups, expected faster than modelled, is stopped past the
            // deadline once it has run longer than the guarantee allows the model's own estimate.
            let overrun = || first_over_groups && t.elapsed() > allowed * GROUP_PASS_MODEL_ERROR;
            // Once a construction is at the bound, the others stop too (the portfolio waits
            // for every job it started).
            let stop = || {
                at_bound.load(AtomicOrdering::Relaxed)
                    || (Instant::now() > deadline
                        && (!guaranteed || built_any.load(AtomicOrdering::Relaxed) || overrun()))
            };
            let done = match order[k] {
                Job::Skyline(j) => {
                    let (rule, name) = SKYLINE_RULES[j];
                    skyline(p, rule, None, deadline).map(|(off, high)| (name.to_string(), off, high, false))
                }
                Job::Aligned(j) => aligned_variant(p, j, stop)
                    .map(|(off, high)| (ALIGNED_VARIANTS[j].2.to_string(), off, high, false)),
                Job::Repair => {
                    let mut rng = Rng::new(REPAIR_SEED);
                    online_aligned_repair(p, REPAIR_RULE, &mut rng, repair_target, stop)
                        .map(|(off, high)| (REPAIR_NAME.to_string(), off, high, false))
                }
                Job::Layered(j) => {
                    let (Some(fill), Some(sk)) = (&fill, skeleton) else { continue };
                    let part = fill_part(p, fill, j, stop);
                    // The worker that fills the last stretch puts the construction together.
                    let parts = {
                        let mut filled = filled.lock().expect("portfolio worker panicked");
                        filled[j] = part;
                        if filled.iter().all(Option::is_some) {
                            filled.drain(..).collect::<Option<Vec<FilledPart>>>()
                        } else {
                            None
                        }
                    };
                    let done = parts.map(|parts| {
                        let (off, high) = assemble(fill, parts);
                        (format!("layered({}: {})", sk.items.len(), sk.strategy), off, high, sk.hot)
                    });
                    estimate_ns[kind].fetch_max(t.elapsed().as_nanos() as u64, AtomicOrdering::Relaxed);
                    done
                }
                Job::Greedy(j) => {
                    let Some(run) = run_strategy(p, &d, Strategy::PORTFOLIO[j], stop) else { continue };
                    built_any.store(true, AtomicOrdering::Relaxed);
                    if run.window_high.iter().all(|&h| h <= lb) && run.crossing_high <= lb {
                        at_bound.store(true, AtomicOrdering::Relaxed);
                    }
                    estimate_ns[0].fetch_max(t.elapsed().as_nanos() as u64, AtomicOrdering::Relaxed);
                    runs.lock().expect("portfolio worker panicked").push(run);
                    continue;
                }
            };
            estimate_ns[kind].fetch_max(t.elapsed().as_nanos() as u64, AtomicOrdering::Relaxed);
            if let Some((name, off, high, hot)) = done {
                built_any.store(true, AtomicOrdering::Relaxed);
                if high <= lb {
                    at_bound.store(true, AtomicOrdering::Relaxed);
                }
                whole.lock().expect("portfolio worker panicked").push(Built { job: k, name, off, high, hot });
            }
        }
    });
    let mut built = whole.into_inner().expect("portfolio worker panicked");
    let lowest = |family: &str| built.iter().filter(|b| b.name.starts_with(family)).map(|b| b.high).min();
    let aligned = lowest(ALIGNED_NAME).into_iter().chain(plan.aligned_built).min();
    let aligned_led = aligned.is_some_and(|a| lowest(SKYLINE_NAME).is_none_or(|s| a < s));
    let mut runs = runs.into_inner().expect("portfolio worker panicked");
    let strategies_run = runs.len();
    if !runs.is_empty() {
        runs.sort_by_key(|r| Strategy::PORTFOLIO.iter().position(|s| *s == r.strategy));
        // Per window, the run with the lowest top; crossing items are the same in every run.
        let mut off = runs[0].off.clone();
        let mut high = runs[0].crossing_high;
        let mut chosen: Vec<usize> = Vec::with_capacity(d.windows);
        for w in 0..d.windows {
            let k = (0..runs.len()).min_by_key(|&k| (runs[k].window_high[w], k)).unwrap_or(0);
            high = high.max(runs[k].window_high[w]);
            chosen.push(k);
        }
        for &i in &d.rest {
            let i = i as usize;
            off[i] = runs[chosen[d.window[i] as usize]].off[i];
        }
        let mut names: Vec<&str> = Vec::new();
        for &k in &chosen {
            let name = runs[k].strategy.name();
            if !names.contains(&name) {
                names.push(name);
            }
        }
        let name =
            if names.len() == 1 { names[0].to_string() } else { format!("mixed({})", names.join(",")) };
        let job = order.iter().position(|j| matches!(j, Job::Greedy(0))).unwrap_or(0);
        built.push(Built { job, name, off, high, hot: false });
    }
    // The start for what follows: the lowest construction, except that one within
    // `START_TIE` of it that comes earlier in the job order is preferred (the order puts
    // the constructions the improvement stage does best from first; footprints that close
    // are within what that stage changes; the lowest is then kept, and one at the bound is
    // the start) — and the construction around a hot skeleton
    // wherever there is one, even above that start, which is then set aside (every other
    // improvement chain starts from it, and it stays the answer unless the stages after get
    // below it): the hot construction's excess lies where the bytes live are at most 90% of
    // the bound, which the improvement stage removes, while at the hot steps, which it does
    // not get right, the skeleton's plan stacks the items near the bound (lists of similar
    // sizes, 100k: from the floor, 1.058–1.062, to 1.037–1.042; from the construction
    // around the hot skeleton, 1.077–1.082, to 1.009–1.018).
    let repair = built.iter().filter(|b| b.name == REPAIR_NAME).map(|b| b.high).min();
    let repair_led = repair
        .filter(|&r| built.iter().all(|b| b.name == REPAIR_NAME || b.high > r))
        .map(|_| Duration::from_nanos(measured(4)));
    let hot = built.iter().position(|b| b.hot).map(|k| built.swap_remove(k));
    if let Some(lowest) = (0..built.len()).min_by_key(|&k| (built[k].high, built[k].job)) {
        let low = built[lowest].high;
        let within = low.saturating_add((low as f64 * START_TIE) as u64);
        // A construction at the bound is the answer; none earlier in the order is preferred.
        let start = (0..built.len())
            .filter(|&k| low > lb && built[k].high <= within)
            .min_by_key(|&k| (built[k].job, built[k].high))
            .unwrap_or(lowest);
        let take = |b: &mut Built| (b.high, std::mem::take(&mut b.off), std::mem::take(&mut b.name));
        let (high, off, name) = take(&mut built[start]);
        best.offer(high, off, name);
        // The lowest construction stays a candidate answer where the start is another: near
        // the bound 1% is the whole excess (a 62k-buffer eager step went on from a 1.0123
        // start and lost a 1.0027 construction that the stages after never reached).
        if start != lowest {
            let (high, off, name) = take(&mut built[lowest]);
            best.keep(high, off, name);
        }
    }
    if let Some(b) = hot {
        best.start_from(b.high, b.off, b.name);
    }
    Portfolio {
        windows: d.windows,
        strategies_run,
        sky_estimate: Duration::from_nanos(measured_or_modelled(1)),
        greedy_estimate: Duration::from_nanos(measured_or_modelled(0)),
        aligned_led,
        repair_led,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every job kind in its place: the layered fill first, the aligned constructions right
    /// after it (before any greedy pass) where a skeleton was planned, after the first greedy
    /// pass and skyline rule where none was, and first on dense lists (less the one built
    /// beside the skeleton); every aligned variant runs once; the repairing sweep, where it
    /// runs, right after the first of them.
    #[test]
    fn the_aligned_constructions_follow_the_fill() {
        let first_greedy = |o: &[Job]| o.iter().position(|j| matches!(j, Job::Greedy(_))).unwrap();
        let aligned = |o: &[Job]| -> Vec<usize> {
            o.iter().enumerate().filter(|(_, j)| matches!(j, Job::Aligned(_))).map(|(k, _)| k).collect()
        };
        let after_fill = job_order(false, true, 2, false, false);
        assert!(matches!(after_fill[..2], [Job::Layered(0), Job::Layered(1)]));
        assert_eq!(aligned(&after_fill), vec![2, 3, 4]);
        assert!(first_greedy(&after_fill) > 4);
        let plain = job_order(false, true, 0, false, false);
        assert!(matches!(plain[..2], [Job::Greedy(0), Job::Skyline(0)]));
        assert_eq!(aligned(&plain), vec![2, 3, 4]);
        let dense = job_order(true, true, 2, true, false);
        assert_eq!(aligned(&dense), vec![2, 3]);
        assert!(matches!(dense[2], Job::Aligned(1)));
        let groups = job_order(false, false, 0, false, true);
        assert!(aligned(&groups).is_empty(), "alias groups: greedy orders only");
        // On alias groups: breadth / best fit first (schedules), size / lowest offset next,
        // and every greedy order once.
        let greedy: Vec<Strategy> = groups
            .iter()
            .map(|j| match j {
                Job::Greedy(k) => Strategy::PORTFOLIO[*k],
                other => panic!("{other:?} on alias groups"),
            })
            .collect();
        assert_eq!(greedy[0], Strategy { order: Order::Breadth, fit: Fit::BestFit });
        assert_eq!(greedy[1], Strategy { order: Order::Size, fit: Fit::LowestOffset });
        let mut all = greedy.clone();
        all.sort_by_key(|s| Strategy::PORTFOLIO.iter().position(|x| x == s));
        assert_eq!(all, Strategy::PORTFOLIO.to_vec());
        // The repairing sweep right after the first aligned construction, once, when asked.
        for o in [&after_fill, &plain, &dense, &groups] {
            assert!(!o.iter().any(|j| matches!(j, Job::Repair)));
        }
        for (dense, fill_parts, built) in
            [(false, 2, false), (false, 0, false), (true, 2, true), (true, 0, false)]
        {
            let o = job_order(dense, true, fill_parts, built, true);
            let repair: Vec<usize> =
                o.iter().enumerate().filter(|(_, j)| matches!(j, Job::Repair)).map(|(k, _)| k).collect();
            assert_eq!(repair, vec![aligned(&o)[0] + 1], "{o:?}");
        }
        for o in [&after_fill, &plain] {
            let mut variants: Vec<usize> =
                o.iter().filter_map(|j| if let Job::Aligned(v) = j { Some(*v) } else { None }).collect();
            variants.sort_unstable();
            assert_eq!(variants, vec![0, 1, 2]);
        }
    }

    /// A first greedy pass over alias groups is expected faster than modelled; any other job
    /// at the model's.
    #[test]
    fn a_first_pass_over_alias_groups_is_expected_faster_than_modelled() {
        let ms = Duration::from_millis;
        // A 313k-buffer interleaved schedule: modelled at 11.9 s, it took 1.3 s and reached
        // the bound (1.39 × it without). Expected within the guarantee at the daemon's
        // 200 ms budget (20 budgets where the floor is far: 1.39 here).
        let est = expected(ms(11_927), true);
        assert!(est <= ms(200) * FAR_FLOOR_PASS_BUDGETS && est >= ms(1_300), "{est:?}");
        assert_eq!(expected(ms(287), false), ms(287));
    }

    /// Past the deadline, the first construction runs to its end where the plan has only its
    /// floor, and does not start where it has a placement in hand (a coarse plan, or the
    /// plan beside a mirror image): such a plan then ends at its deadline with what it has.
    #[test]
    fn with_a_placement_in_hand_no_construction_runs_past_the_deadline() {
        let b = crate::workload::packed(3000, 2);
        let p = Problem::build(&b).unwrap();
        let (floor_off, floor_high) = online_best_fit(&p);
        for in_hand in [false, true] {
            let now = Instant::now();
            let plan = PortfolioPlan {
                lb: p.lower_bound(),
                dense: false,
                greedy_pass: greedy_pass_estimate(p.len(), p.overlapping_pairs()),
                budget: Duration::from_secs(1),
                deadline: now,
                portfolio_deadline: now,
                threads: 2,
                placement_in_hand: in_hand,
                skeleton: None,
                fill_pass: Duration::ZERO,
                aligned_built: None,
                repair: true,
            };
            let mut best = Incumbent::new(floor_high, floor_off.clone(), "online-best-fit");
            let built = run(&p, &plan, &mut best);
            if in_hand {
                assert_eq!(built.strategies_run, 0);
                assert_eq!((best.high, best.strategy.as_str()), (floor_high, "online-best-fit"));
            } else {
                assert!(built.strategies_run >= 1);
                assert!(best.high < floor_high, "the first construction ran: {}", best.strategy);
            }
        }
    }

    /// The construction around a hot skeleton is where the stages after the portfolio start,
    /// even far above the lowest construction, which is set aside and stays the answer
    /// unless they get below it; around a skeleton by area the lowest construction is the
    /// start.
    #[test]
    fn the_construction_around_a_hot_skeleton_is_the_start() {
        let b = crate::workload::random_similar_sizes(4000, 13);
        let p = Problem::build(&b).unwrap();
        let items = hot_items(&p).expect("hot items");
        // The skeleton stacked whole, one item above the other: valid, and far too high.
        let off: Vec<u64> = items
            .iter()
            .scan(0u64, |below, &i| {
                let at = *below;
                *below += p.size[i as usize];
                Some(at)
            })
            .collect();
        let (floor_off, floor_high) = online_best_fit(&p);
        let greedy_pass = greedy_pass_estimate(p.len(), p.overlapping_pairs());
        for hot in [true, false] {
            let sk = Skeleton {
                items: items.clone(),
                off: off.clone(),
                strategy: "stacked".into(),
                tail: Vec::new(),
                hot,
            };
            let now = Instant::now();
            let plan = PortfolioPlan {
                lb: p.lower_bound(),
                dense: false,
                greedy_pass,
                budget: Duration::from_secs(1),
                deadline: now + Duration::from_secs(5),
                portfolio_deadline: now + Duration::from_millis(300),
                threads: 2,
                placement_in_hand: false,
                skeleton: Some(&sk),
                fill_pass: greedy_pass / 2,
                aligned_built: None,
                repair: true,
            };
            let mut best = Incumbent::new(floor_high, floor_off.clone(), "online-best-fit");
            run(&p, &plan, &mut best);
            assert_eq!(best.strategy.starts_with("layered("), hot, "hot {hot}: {}", best.strategy);
            if hot {
                assert!(best.high > floor_high, "the stacked skeleton is above the floor");
                let aside = best.aside.as_ref().expect("the lowest construction set aside");
                assert!(aside.high <= floor_high && !aside.strategy.starts_with("layered("));
            } else {
                assert!(best.high <= floor_high && best.aside.is_none());
            }
            let settled = best.settled();
            assert!(settled.high <= floor_high);
            let offsets: Vec<u64> = p.item_of.iter().map(|&i| settled.off[i as usize]).collect();
            verify(&b, &offsets).unwrap();
        }
    }
}
