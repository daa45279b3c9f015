//! `graphpool plan --buffers`: the real binary on CSV files, as an operator runs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write a test file");
    path
}

fn plan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_graphpool")).arg("plan").args(args).output().expect("run graphpool plan")
}

fn stdout(out: &Output) -> String {
    assert!(out.status.success(), "graphpool plan failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).expect("UTF-8 output")
}

/// The value of a report row (`name   value`).
fn row(report: &str, name: &str) -> String {
    report
        .lines()
        .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
        .unwrap_or_else(|| panic!("no row {name:?} in:\n{report}"))
}

#[test]
fn a_buffer_list_is_planned_and_every_offset_printed() {
    let dir = tempfile::tempdir().unwrap();
    // Five buffers; at most 3 KiB live at once (steps 2–3: a, b and c).
    let csv = write(
        dir.path(),
        "list.csv",
        "buffer,start,end,size\n# a comment\na,0,4,1KiB\nb,2,6,1024\nc,1,4,1024\nd,4,8,2KiB\ne,6,9,1024\n",
    );
    let report = stdout(&plan(&["--buffers", csv.to_str().unwrap()]));
    assert_eq!(row(&report, "lower bound"), "3 KiB (3072 bytes)");
    assert_eq!(row(&report, "ratio"), "1.0000");
    assert_eq!(row(&report, "buffers"), "5");

    let json: serde_json::Value =
        serde_json::from_str(&stdout(&plan(&["--buffers", csv.to_str().unwrap(), "--json"]))).unwrap();
    let buffers = json["buffers"].as_array().unwrap();
    assert_eq!(buffers.len(), 5);
    let footprint = json["footprint_bytes"].as_u64().unwrap();
    // The stages that ran, from the preparation to the last, which ends at the footprint.
    let stages = json["stages"].as_array().unwrap();
    assert_eq!(stages[0]["name"], "prepare");
    assert_eq!(stages[1]["name"], "floor");
    assert_eq!(stages.last().unwrap()["footprint_bytes"].as_u64(), Some(footprint));
    let staged: f64 = stages.iter().map(|st| st["seconds"].as_f64().unwrap()).sum();
    assert!(staged <= json["planning_seconds"].as_f64().unwrap() + 1e-6);
    let get = |b: &serde_json::Value, k: &str| b[k].as_u64().unwrap();
    for (i, x) in buffers.iter().enumerate() {
        assert!(get(x, "offset") + get(x, "size_bytes") <= footprint);
        for y in &buffers[i + 1..] {
            let live_together = get(x, "start") < get(y, "end") && get(y, "start") < get(x, "end");
            let share_bytes = get(x, "offset") < get(y, "offset") + get(y, "size_bytes")
                && get(y, "offset") < get(x, "offset") + get(x, "size_bytes");
            assert!(!(live_together && share_bytes), "{x} and {y} overlap");
        }
    }
}

/// Three alias groups, each pair live together at some step but never all three: the lower
/// bound (a clique of groups) is above the live bound, and the report shows both.
#[test]
fn alias_groups_show_the_live_bound_beside_the_lower_bound() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "groups.csv",
        "buffer,start,end,size,alias_group\n\
         a1,0,1,4,a\na2,2,3,4,a\nb1,0,1,4,b\nb2,4,5,4,b\nc1,2,3,4,c\nc2,4,5,4,c\n",
    );
    let path = path.to_str().unwrap();
    let report = stdout(&plan(&["--buffers", path]));
    assert_eq!(row(&report, "lower bound"), "12 B (12 bytes)");
    assert!(
        row(&report, "live bound").starts_with("8 B (8 bytes; most bytes live at once, 1.5000 × it"),
        "{report}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&plan(&["--buffers", path, "--json"]))).unwrap();
    assert_eq!(json["live_bound_bytes"], 8);
    assert_eq!(json["lower_bound_bytes"], 12);
    assert_eq!(json["footprint_bytes"], 12);
    // Without alias groups the two bounds agree and the row is left out.
    let plain = write(dir.path(), "plain.csv", "buffer,start,end,size\na,0,2,4\nb,1,3,4\n");
    let report = stdout(&plan(&["--buffers", plain.to_str().unwrap()]));
    assert!(!report.contains("live bound"), "{report}");
}

#[test]
fn another_allocators_file_and_offsets_are_read_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    // MiniMalloc's older format (id,lower,upper,size: upper exclusive) with its offsets.
    let good = write(
        dir.path(),
        "good.csv",
        "id,lower,upper,size,offset\nb1,0,3,4,8\nb2,3,9,4,8\nb3,0,9,4,4\nb4,9,21,4,4\nb5,0,21,4,0\n",
    );
    let report = stdout(&plan(&["--buffers", good.to_str().unwrap()]));
    assert_eq!(row(&report, "lower bound"), "12 B (12 bytes)");
    assert_eq!(row(&report, "given offsets"), "footprint 12 B (12 bytes), ratio 1.0000, valid");

    let bad = write(dir.path(), "bad.csv", "buffer,start,end,size,offset\na,0,4,16,0\nb,2,6,16,8\n");
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&plan(&["--buffers", bad.to_str().unwrap(), "--json"]))).unwrap();
    assert_eq!(json["given_offsets"]["valid"], false);
    assert!(json["given_offsets"]["error"].as_str().unwrap().contains("\"a\" and \"b\""));

    // The newer format's `end` is the last live step: b1 and b2 then meet at step 3.
    let inclusive = write(dir.path(), "inclusive.csv", "buffer,start,end,size\nb1,0,3,4\nb2,3,9,4\n");
    let path = inclusive.to_str().unwrap();
    assert_eq!(row(&stdout(&plan(&["--buffers", path])), "lower bound"), "4 B (4 bytes)");
    assert_eq!(row(&stdout(&plan(&["--buffers", path, "--inclusive-end"])), "lower bound"), "8 B (8 bytes)");
}

#[test]
fn malformed_files_fail_with_the_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let csv = write(dir.path(), "bad.csv", "buffer,start,end,size\na,0,4,16\nb,9,3,16\n");
    let out = plan(&["--buffers", csv.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.csv:3: field `end`: is 3, not after start 9"), "{err}");

    let missing = dir.path().join("missing.csv");
    let out = plan(&["--buffers", missing.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
}

#[test]
fn options_that_do_not_apply_and_placements_past_the_address_space_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    // --inclusive-end reads a buffer list's ends; a schedule has none to read.
    let schedule = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/planner/examples/schedule-1f1b.toml");
    let out = plan(&["--schedule", schedule.to_str().unwrap(), "--inclusive-end"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--inclusive-end"), "{out:?}");
    // An offset that would wrap around 2^64 is not a placement.
    let csv = write(
        dir.path(),
        "wrap.csv",
        "buffer,start,end,size,offset\na,0,10,100,18446744073709551600\nb,0,10,100,50\n",
    );
    let out = plan(&["--buffers", csv.to_str().unwrap()]);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("past 2^64"), "{text}");
}
