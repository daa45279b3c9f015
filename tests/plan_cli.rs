//! `graphpool plan`: the real binary on CSV buffer lists and schedule files, as an operator
//! runs it.

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

/// `graphpool plan ARGS` with `input` on its standard input.
fn plan_stdin(args: &[&str], input: &str) -> Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_graphpool"))
        .arg("plan")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run graphpool plan");
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
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
fn repeated_iterations_are_planned_from_one_copy() {
    let dir = tempfile::tempdir().unwrap();
    // Four iterations of the same 100 buffers, 60 steps apart (nothing live between them).
    let mut text = String::from("buffer,start,end,size\n");
    for copy in 0..4u64 {
        for k in 0..100u64 {
            let start = k % 50 + 60 * copy;
            text.push_str(&format!("i{copy}b{k},{start},{},{}KiB\n", start + 1 + k % 7, k % 13 + 1));
        }
    }
    let csv = write(dir.path(), "iterations.csv", &text);
    let report = stdout(&plan(&["--buffers", csv.to_str().unwrap()]));
    assert!(row(&report, "strategy").starts_with("parts(4, 1 distinct: "), "{report}");
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&plan(&["--buffers", csv.to_str().unwrap(), "--json"]))).unwrap();
    assert_eq!(json["stages"][0]["name"], "parts");
    // Every iteration's buffers sit where the first iteration's do.
    let offsets: Vec<u64> =
        json["buffers"].as_array().unwrap().iter().map(|b| b["offset"].as_u64().unwrap()).collect();
    assert_eq!(offsets.len(), 400);
    for copy in 1..4 {
        assert_eq!(offsets[100 * copy..100 * (copy + 1)], offsets[..100], "iteration {copy}");
    }
}

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

/// `bench/lists/lists.py --offsets` writes each tiling piece's place in its rectangle: the
/// planner reads it as another allocator's placement and finds it valid at the lower bound
/// (so the bench's tilings are what it says: lists whose optimum is the bound). Random
/// families have no known placement and get no column.
#[test]
fn the_bench_lists_tilings_come_with_a_placement_at_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/lists/lists.py");
    let families =
        "tiling-time70,tiling-memory70,tiling-middle,tiling-largest,tiling-eighths,tiling-short,lognormal";
    let out = Command::new("python3")
        .arg(&script)
        .arg("--out")
        .arg(dir.path())
        .args(["--sizes", "400", "--seeds", "1-2", "--families", families, "--offsets"])
        .output()
        .expect("python3 runs bench/lists/lists.py");
    assert!(out.status.success(), "lists.py failed: {}", String::from_utf8_lossy(&out.stderr));
    let files: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect();
    assert_eq!(files.len(), 14, "{files:?}");
    for file in &files {
        let report = stdout(&plan(&["--buffers", file, "--json", "--time-budget-ms", "20"]));
        let json: serde_json::Value = serde_json::from_str(&report).unwrap();
        if file.contains("tiling-") {
            assert_eq!(json["given_offsets"]["valid"], true, "{file}: {}", json["given_offsets"]);
            assert_eq!(json["given_offsets"]["footprint_bytes"], json["lower_bound_bytes"], "{file}");
            assert_eq!(json["lower_bound_bytes"], 1u64 << 32, "{file}");
        } else {
            assert!(json.get("given_offsets").is_none_or(|g| g.is_null()), "{file}: {json}");
        }
    }
}

/// `bench/lists/ab.sh lists` plans every list with both builds and compares them family by
/// family: here against a stand-in "build" that reports 1.5 for every list.
#[test]
fn the_bench_ab_script_compares_two_builds_list_by_list() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let worse = write(dir.path(), "worse", "#!/bin/sh\necho '{\"ratio\": 1.5}'\n");
    std::fs::set_permissions(&worse, std::fs::Permissions::from_mode(0o755)).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/lists/ab.sh");
    let out = Command::new("bash")
        .arg(&script)
        .args(["lists", env!("CARGO_BIN_EXE_graphpool")])
        .arg(&worse)
        .args(["--sizes", "300", "--seeds", "1-2", "--families", "lognormal,tiling-largest"])
        .env("BUDGET_MS", "50")
        .env("OUT", dir.path().join("out"))
        .output()
        .expect("bash runs bench/lists/ab.sh");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ab.sh failed: {}\n{text}", String::from_utf8_lossy(&out.stderr));
    for list in ["lognormal-300-1", "lognormal-300-2", "tiling-largest-300-1", "tiling-largest-300-2"] {
        let line = text.lines().find(|l| l.starts_with(list)).unwrap_or_else(|| panic!("no {list}:\n{text}"));
        let ratios: Vec<f64> = line.split_whitespace().skip(1).map(|r| r.parse().unwrap()).collect();
        assert_eq!(ratios.len(), 2, "{line}");
        assert!((1.0..1.5).contains(&ratios[0]) && ratios[1] == 1.5, "{line}");
    }
    // Per family: two lists, B higher on both, within the target (1.035 random, 1.10
    // tilings) for A only where A's plans are.
    for family in ["lognormal-300 ", "tiling-largest-300 "] {
        let line =
            text.lines().find(|l| l.starts_with(family)).unwrap_or_else(|| panic!("no {family}:\n{text}"));
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cells[1], "2", "{line}");
        assert_eq!(cells[3], "1.5000", "{line}");
        assert_eq!((cells[6], cells[7]), ("0", "2"), "B lower, B higher: {line}");
        assert!(line.contains(" / 0 (≤ "), "{line}");
    }
    // A build that is not there is named before anything runs.
    let out = Command::new("bash")
        .arg(&script)
        .args(["lists", "/nonexistent/graphpool"])
        .arg(&worse)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/graphpool is not an executable"));
}

/// `bench/lists/ab.sh figures` runs the two builds of the `figures` example one after the
/// other for every seed (side by side they would share the cores and slow each other), and
/// pairs their rows by name.
#[test]
fn the_bench_ab_script_runs_figures_builds_one_after_the_other() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    // A stand-in `figures`: a header, then one row for the seed asked; it logs its start and
    // end, and takes a moment.
    let stand_in = |name: &str, ratio: &str| {
        let text = format!(
            "#!/bin/sh\necho \"start {name}\" >> {log}\nsleep 0.2\n\
             echo 'workload buffers floor greedy ratio'\n\
             echo \"packed n=10 seed=${{FIGURES_SEEDS%-*}} budget=1s 10 2.0 1.1 {ratio} 1.0\"\n\
             echo \"end {name}\" >> {log}\n",
            log = log.display()
        );
        let path = write(dir.path(), name, &text);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    };
    let (a, b) = (stand_in("a", "1.0500"), stand_in("b", "1.1500"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/lists/ab.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg("figures")
        .args([&a, &b])
        .args(["packed", "1-2"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ab.sh failed: {}\n{text}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("packed_n=10_seed=1_budget=1s 1.0500 1.1500"), "{text}");
    assert!(text.contains("packed_n=10_seed=2_budget=1s 1.0500 1.1500"), "{text}");
    let family =
        text.lines().find(|l| l.starts_with("packed_n=10_budget=1s ")).unwrap_or_else(|| panic!("{text}"));
    assert!(family.contains(" 2 / 0 (≤ 1.1)"), "{family}");
    let order = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        order.lines().collect::<Vec<_>>(),
        ["start a", "end a", "start b", "end b"].repeat(2),
        "{order}"
    );
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

/// The message of a refused input (the command must fail with status 2).
fn refusal(args: &[&str]) -> String {
    let out = plan(args);
    assert_eq!(out.status.code(), Some(2), "graphpool plan {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stderr).trim_end().to_string()
}

#[test]
fn malformed_buffer_lists_name_the_line_and_the_column_at_fault() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        // An unclosed quote in the size column.
        (
            "quote.csv",
            "buffer,start,end,size\na,0,4,16\nb,0,4,\"16\n",
            "quote.csv:3: field `size`: a quoted field",
        ),
        // Two sizes of 10^19 bytes: more than the 2^62 bytes the planner places.
        (
            "huge.csv",
            "buffer,start,end,size\na,0,4,10000000000000000000\nb,2,6,10000000000000000000\n",
            "huge.csv:2: field `size`: is 10000000000000000000 bytes, the largest of buffers that add up",
        ),
        ("empty.csv", "", "empty.csv:1: field `header`: the file is empty"),
    ];
    for (name, text, expected) in cases {
        let path = write(dir.path(), name, text);
        let err = refusal(&["--buffers", path.to_str().unwrap()]);
        assert!(err.contains(expected), "{err}");
    }
    let latin1 = dir.path().join("latin1.csv");
    std::fs::write(&latin1, b"buffer,start,end,size\n# caf\xe9\na,0,4,16\n").unwrap();
    let err = refusal(&["--buffers", latin1.to_str().unwrap()]);
    assert!(err.contains("latin1.csv:2:6: not UTF-8 text"), "{err}");
}

const SCHEDULE_JSON: &str = r#"{
  "schedule": {"one_f_one_b": {"pp_size": 4, "pp_rank": 0, "num_microbatches": 8}},
  "layers": [
    {"layer": 0, "inputs": [{"shape": [16, 8], "dtype": "bf16", "kept_for_backward": true}],
     "outputs": [{"shape": [16, 8], "dtype": "bf16"}]},
    {"layer": 1,
     "outputs": [{"shape": [16, 8], "dtype": "bf16"}]}
  ]
}
"#;

const SCHEDULE_TOML: &str = r#"[schedule.one_f_one_b]
pp_size = 4
pp_rank = 0
num_microbatches = 8

[[layers]]
layer = 0
inputs = [{ shape = [16, 8], dtype = "bf16", kept_for_backward = true }]
outputs = [{ shape = [16, 8], dtype = "bf16" }]

[[layers]]
layer = 1
saved_bytes = 1000
outputs = [{ shape = [16, 8], dtype = "bf16" }]
"#;

/// Each bad value, in JSON and in TOML, refused with the file's line and the key's path,
/// whether the parser finds it (a type) or the planner does (a value).
#[test]
fn malformed_schedules_name_the_line_and_the_field() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in [("good.json", SCHEDULE_JSON), ("good.toml", SCHEDULE_TOML)] {
        let path = write(dir.path(), name, text);
        assert_eq!(row(&stdout(&plan(&["--schedule", path.to_str().unwrap()])), "slots"), "4");
    }
    // (file, the good text, what to change, into what, the line and the field named)
    let cases: &[(&str, &str, &str, &str, &str)] = &[
        (
            "size.json",
            SCHEDULE_JSON,
            r#""pp_size": 4"#,
            r#""pp_size": "four""#,
            ":2:48: field `schedule.one_f_one_b.pp_size`: invalid type: string \"four\", expected u32",
        ),
        (
            "size.toml",
            SCHEDULE_TOML,
            "pp_size = 4",
            "pp_size = \"four\"",
            ":2:11: field `schedule.one_f_one_b.pp_size`: invalid type: string \"four\", expected u32",
        ),
        (
            "count.json",
            SCHEDULE_JSON,
            r#""num_microbatches": 8"#,
            r#""num_microbatches": -8"#,
            ":2:81: field `schedule.one_f_one_b.num_microbatches`: invalid value: integer `-8`",
        ),
        (
            "count.toml",
            SCHEDULE_TOML,
            "num_microbatches = 8",
            "num_microbatches = -8",
            ":4:20: field `schedule.one_f_one_b.num_microbatches`: invalid value: integer `-8`",
        ),
        (
            "shape.json",
            SCHEDULE_JSON,
            r#""outputs": [{"shape": [16, 8], "dtype": "bf16"}]}
  ]"#,
            r#""outputs": [{"shape": "16x8", "dtype": "bf16"}]}
  ]"#,
            ":7:33: field `layers[1].outputs[0].shape`: invalid type: string \"16x8\", expected a sequence",
        ),
        (
            "shape.toml",
            SCHEDULE_TOML,
            "saved_bytes = 1000\noutputs = [{ shape = [16, 8]",
            "saved_bytes = 1000\noutputs = [{ shape = \"16x8\"",
            ":14:22: field `layers[1].outputs[0].shape`: invalid type",
        ),
        (
            "dtype.json",
            SCHEDULE_JSON,
            r#""dtype": "bf16", "kept"#,
            r#""kept"#,
            ":4:73: field `layers[0].inputs[0].dtype`: missing field `dtype`",
        ),
        (
            "dtype.toml",
            SCHEDULE_TOML,
            r#"dtype = "bf16", kept"#,
            "kept",
            ":8:11: field `layers[0].inputs[0].dtype`: missing field `dtype`",
        ),
        (
            "key.toml",
            SCHEDULE_TOML,
            "saved_bytes",
            "saved_byte",
            ":13:1: field `layers[1].saved_byte`: unknown field `saved_byte`, expected one of",
        ),
        // Found by the planner: the place of the value in the file.
        (
            "rank.json",
            SCHEDULE_JSON,
            r#""pp_rank": 0"#,
            r#""pp_rank": 4"#,
            ":2:57: field `schedule.one_f_one_b.pp_rank`: is 4; ranks of pp_size = 4 are 0..4",
        ),
        (
            "rank.toml",
            SCHEDULE_TOML,
            "pp_rank = 0",
            "pp_rank = 4",
            ":3:11: field `schedule.one_f_one_b.pp_rank`: is 4; ranks of pp_size = 4 are 0..4",
        ),
        (
            "bf17.toml",
            SCHEDULE_TOML,
            r#"dtype = "bf16" }"#,
            r#"dtype = "bf17" }"#,
            ":9:39: field `layers[0].outputs[0].dtype`: unknown dtype \"bf17\"; use one of",
        ),
        // 2^63 bytes per microbatch in each of 4 buffer slots, with its gradient: past 2^62.
        (
            "bytes.json",
            SCHEDULE_JSON,
            r#"{"layer": 1,
     "outputs": [{"shape": [16, 8]"#,
            r#"{"layer": 1,
     "outputs": [{"shape": [4611686018427387904]"#,
            ":7:28: field `layers[1].outputs[0].shape`: makes a tensor of 9223372036854775808 bytes, held in \
          each of chunk 0's 4 buffer slot(s): with the schedule's other buffers that is more than 2^62 \
          bytes, the most the planner places; check the dimensions (elements, not bytes) and the dtype",
        ),
        (
            "saved.toml",
            SCHEDULE_TOML,
            "saved_bytes = 1000",
            "saved_bytes = 18446744073709551615",
            ":13:15: field `layers[1].saved_bytes`: is 18446744073709551615 bytes, held in each of chunk \
          0's 4 buffer slot(s)",
        ),
        (
            "layer.toml",
            SCHEDULE_TOML,
            "layer = 1",
            "layer = 0",
            ":12:9: field `layers[1].layer`: is 0, as is layers[0].layer of chunk 0; number the chunk's 2 \
          layers 0..2, each once",
        ),
    ];
    let mut wrong = Vec::new();
    for &(name, good, from, to, expected) in cases {
        let text = good.replacen(from, to, 1);
        assert_ne!(text, good, "{name}: {from:?} is not in the text");
        let path = write(dir.path(), name, &text);
        let err = refusal(&["--schedule", path.to_str().unwrap()]);
        let expected = format!("graphpool plan: {}{expected}", path.display());
        if !err.starts_with(&expected) {
            wrong.push(format!("{name}:\n  got      {err}\n  expected {expected}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // A syntax error has a place but no field.
    let path = write(dir.path(), "syntax.json", &SCHEDULE_JSON.replace(r#""layer": 1,"#, r#""layer": 1,,"#));
    let err = refusal(&["--schedule", path.to_str().unwrap()]);
    assert!(err.contains("syntax.json:6:17: key must be a string"), "{err}");
    assert!(!err.contains("field"), "{err}");
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

#[test]
fn the_planner_threads_are_chosen_and_reported() {
    let schedule = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/planner/examples/schedule-1f1b.toml");
    let schedule = schedule.to_str().unwrap();
    // As a PlanCapture on three threads plans it (its `planned` log line gives the threads).
    let report = stdout(&plan(&["--schedule", schedule, "--threads", "3"]));
    assert!(row(&report, "planning time").ends_with(" ms on 3 threads"), "{report}");
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&plan(&["--schedule", schedule, "--json", "--threads", "1"]))).unwrap();
    assert_eq!(json["threads"], 1);
    // Without the option, one per core.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&plan(&["--schedule", schedule, "--json"]))).unwrap();
    assert_eq!(json["threads"], cores);
    // No planner runs on no thread.
    let out = plan(&["--schedule", schedule, "--threads", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--threads"), "{out:?}");
}

/// `-` reads the input from standard input, as a converter's output piped in, and names it
/// `<stdin>` in messages.
#[test]
fn standard_input_is_read_for_a_dash() {
    let report = stdout(&plan_stdin(
        &["--buffers", "-"],
        "buffer,start,end,size\na,0,2,1KiB\nb,1,3,2KiB\nc,2,4,1KiB\n",
    ));
    assert_eq!(row(&report, "lower bound"), "3 KiB (3072 bytes)");
    assert_eq!(row(&report, "buffers"), "3");

    let bad = plan_stdin(&["--buffers", "-"], "buffer,start,end,size\na,0,2,1KiB\nb,3,1,1KiB\n");
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("<stdin>:3: field `end`"), "{err}");

    let schedule = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/crates/planner/examples/schedule-1f1b.toml"
    ))
    .expect("the example schedule");
    let report = stdout(&plan_stdin(&["--schedule", "-"], &schedule));
    assert_eq!(row(&report, "slots"), "8");
}

/// The recorded eager steps of `bench/lists/recorded/` (PyTorch's allocator, real training
/// steps, 4k–16k buffers) are planned from standard input: every buffer placed within the
/// footprint, the lower bound the most bytes live at once, and the footprint no higher than
/// the deterministic online best-fit floor gives them (at most 1.047 × the bound; release
/// builds reach 1.000–1.014 with the default budget: `bench/lists/recorded.sh`).
#[test]
fn recorded_eager_steps_are_planned() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/lists/recorded");
    let mut planned = 0;
    for entry in std::fs::read_dir(&dir).expect("bench/lists/recorded") {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        // The lists of 128 microbatches (60k buffers) are left to the benchmark: a debug build
        // plans them slowly.
        if !name.ends_with(".csv.gz") || name.contains("_128.") {
            continue;
        }
        let csv = Command::new("gzip").arg("-dc").arg(&path).output().expect("gzip -dc");
        assert!(csv.status.success(), "gzip -dc {name}");
        let text = String::from_utf8(csv.stdout).unwrap();
        let mut events: Vec<(u64, i128)> = Vec::new();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split(',').collect();
            let (start, end, size): (u64, u64, i128) =
                (f[1].parse().unwrap(), f[2].parse().unwrap(), f[3].parse().unwrap());
            events.push((start, size));
            events.push((end, -size));
        }
        events.sort();
        let (mut live, mut peak) = (0i128, 0i128);
        for (_, delta) in &events {
            live += delta;
            peak = peak.max(live);
        }

        let out = plan_stdin(&["--buffers", "-", "--json"], &text);
        let plan: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        let bound = plan["lower_bound_bytes"].as_u64().unwrap();
        let footprint = plan["footprint_bytes"].as_u64().unwrap();
        assert_eq!(i128::from(bound), peak, "{name}: the lower bound is the most bytes live at once");
        let buffers = plan["buffers"].as_array().unwrap();
        assert_eq!(buffers.len(), events.len() / 2, "{name}");
        for b in buffers {
            assert!(
                b["offset"].as_u64().unwrap() + b["size_bytes"].as_u64().unwrap() <= footprint,
                "{name}: {b}"
            );
        }
        assert!(footprint as f64 <= 1.047 * bound as f64, "{name}: {footprint} bytes for a bound of {bound}");
        planned += 1;
    }
    assert_eq!(planned, 6, "the recorded lists of 8 and 32 microbatches");
}
