//! Checks the coarsening of buffer lists against placements known to be good: for each merge
//! order, the coarse blocks that no re-arrangement of the known placement keeps whole
//! ("crossed"), the merges by kind and how often each made the first crossed block of its
//! line, and the coarse instance refusing exactly those merges; then both instances planned
//! alone (`graphpool_planner::dsa::check_coarsening` says what is checked).
//!
//! `cargo run --release --example coarsening -- [--budget-ms MS] FILE.csv...`
//!
//! Each file is a `graphpool plan --buffers` list with an `offset` column (the placement to
//! check against) and no alias groups — what `bench/lists/lists.py --offsets` writes for its
//! tilings. `--budget-ms` is the time each coarse instance is planned with (default 560: the
//! coarse plan's share of a 1 s plan of 100k pieces on two cores).

use std::path::Path;
use std::time::Duration;

use graphpool::cli::plan::{CsvOptions, parse_buffers_csv};
use graphpool_planner::dsa::check_coarsening;
use graphpool_planner::{Buffer, PlaceOptions, place};

fn main() {
    let mut budget = Duration::from_millis(560);
    let mut files = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--budget-ms" {
            let ms = args
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| fail("--budget-ms takes milliseconds"));
            budget = Duration::from_millis(ms);
        } else {
            files.push(arg);
        }
    }
    if files.is_empty() {
        fail("give one or more `graphpool plan --buffers` files with an `offset` column");
    }
    for file in &files {
        let (buffers, offsets) = read(Path::new(file));
        let check = check_coarsening(&buffers, &offsets).unwrap_or_else(|e| fail(&format!("{file}: {e}")));
        let bound = check.lower_bound as f64;
        println!(
            "{file}: {} buffers, placement given at {:.4} of the lower bound",
            buffers.len(),
            check.footprint as f64 / bound
        );
        for order in &check.orders {
            println!(
                "  {}: {} coarse blocks, {} crossed ({:.2}% of the area); refusing crossed merges: {} blocks",
                order.order,
                order.coarse.len(),
                order.crossed_blocks,
                100.0 * order.crossed_area,
                order.refusing_crossed.len()
            );
            for m in &order.merges {
                println!(
                    "    {:48} {:>7} merges, {:>6} first crossings",
                    m.kind, m.merges, m.first_crossings
                );
            }
            let opts =
                PlaceOptions { time_budget: budget, scaled_budget_per_item: None, ..PlaceOptions::default() };
            let plan = |coarse: &[Buffer]| {
                let p = place(coarse, &opts).unwrap_or_else(|e| fail(&format!("{file}: {e}")));
                p.footprint as f64 / bound
            };
            println!(
                "    planned alone with {} ms: {:.4} as coarsened, {:.4} refusing crossed merges",
                budget.as_millis(),
                plan(&order.coarse),
                plan(&order.refusing_crossed)
            );
        }
    }
}

/// The buffers and offsets of a `graphpool plan --buffers` file with an `offset` column.
fn read(path: &Path) -> (Vec<Buffer>, Vec<u64>) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| fail(&format!("{}: {e}", path.display())));
    let list = parse_buffers_csv(path, &text, CsvOptions::default()).unwrap_or_else(|e| fail(&e.to_string()));
    let Some(offsets) = list.offsets else {
        fail(&format!("{}: no `offset` column: give the placement to check against", path.display()))
    };
    let buffers = list
        .buffers
        .iter()
        .map(|b| {
            if !b.alias_group.is_empty() {
                fail(&format!(
                    "{}: buffer {:?} is in an alias group; the check takes none",
                    path.display(),
                    b.name
                ));
            }
            Buffer { start: b.start, end: b.end, size: b.size, group: None }
        })
        .collect();
    (buffers, offsets)
}

fn fail(message: &str) -> ! {
    eprintln!("coarsening: {message}");
    std::process::exit(2);
}
