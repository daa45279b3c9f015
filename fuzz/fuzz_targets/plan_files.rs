//! Arbitrary text as the files of `graphpool plan`: the `--buffers` CSV and the schedule
//! (JSON or TOML). No panic; a parsed file of a bounded size plans without panicking.
#![no_main]

use std::path::Path;
use std::time::Duration;

use graphpool::cli::plan::{CsvOptions, parse_buffers_csv, parse_schedule};
use graphpool_planner::PlaceOptions;
use graphpool_planner::pipeline;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((kind, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let opts = PlaceOptions { time_budget: Duration::from_millis(1), threads: 1, ..PlaceOptions::default() };
    match kind % 3 {
        0 => {
            let csv = CsvOptions { inclusive_end: text.len() % 2 == 1 };
            if let Ok(list) = parse_buffers_csv(Path::new("fuzz.csv"), text, csv) {
                if list.buffers.len() <= 64 {
                    if let Ok(plan) = pipeline::plan_buffers(&list.buffers, &opts) {
                        assert!(plan.footprint >= plan.lower_bound);
                        // A valid placement from the file is never below the lower bound.
                        if let Some(Ok(given)) =
                            list.offsets.as_ref().map(|o| pipeline::check_placement(&list.buffers, o))
                        {
                            assert!(given >= plan.lower_bound);
                        }
                    }
                }
            }
        }
        k => {
            let path = if k == 1 { "fuzz.json" } else { "fuzz.toml" };
            if let Ok(s) = parse_schedule(Path::new(path), text) {
                if let Ok(sb) = pipeline::schedule_buffers(&s.input) {
                    if sb.buffers.len() <= 64 {
                        let _ = pipeline::plan_schedule_buffers(sb, &opts);
                    }
                }
            }
        }
    }
});
