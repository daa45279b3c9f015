//! graphpool-load: starts a real `graphpoold` (host backend) and N client processes (this
//! binary re-executed as workers) that allocate, release, fetch fds and plan for a fixed
//! time; reports p50/p99 per RPC and counts, the daemon's RSS idle and under load, and checks
//! that the ledger is empty and the daemon's fds and RSS are back at baseline afterwards.
//!
//!   graphpool-load [--daemon PATH] [--seconds S] [--json OUT] [--runs rr:1,rr:8,rr:64,mixed:64]
//!
//! Modes: `rr` = allocate + release round trips (the rank's allocation latency) the way a rank makes them
//! (the shim): on the fd socket's fast path, the grant and its fd in one message, then the
//! release; `mixed` = random allocate / release (fast path) / fetch-fd / PlanCapture (gRPC;
//! skipped, and said so, where the daemon answers UNIMPLEMENTED). `rr-grpc` and `mixed-grpc`:
//! the same with allocate and release as gRPC calls (what the Python client does; no fd).
//! `plan-large`: PlanCapture of a list of [`LARGE_PLAN_BUFFERS`] buffers with a 1 s budget,
//! back to back (the daemon's memory while it plans: the node's plans at once, each holding
//! its list, its planner's structures and its answer).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use graphpool::client::{Clients, FdConnection, connect};
use graphpool_proto::v1 as pb;

const MIB: u64 = 1 << 20;

/// Buffers of each `plan-large` request: a large eager step or a long pipeline's stage.
const LARGE_PLAN_BUFFERS: u32 = 100_000;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("worker") {
        worker(&args);
    } else {
        driver(&args);
    }
}

// ---- worker ------------------------------------------------------------------------------

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn worker(args: &[String]) {
    let socket = PathBuf::from(arg(args, "--socket").unwrap());
    let fd_socket = PathBuf::from(arg(args, "--fd-socket").unwrap());
    let id: u32 = arg(args, "--id").unwrap().parse().unwrap();
    let mode = arg(args, "--mode").unwrap();
    let start_at: u64 = arg(args, "--start-at").unwrap().parse().unwrap();
    let seconds: f64 = arg(args, "--seconds").unwrap().parse().unwrap();
    // Operations per second of this client; 0 = closed loop (the next right after the last).
    let rate: f64 = arg(args, "--rate").map(|r| r.parse().unwrap()).unwrap_or(0.0);
    let out = PathBuf::from(arg(args, "--out").unwrap());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let mut c = connect(&socket).await.expect("connect");
        let req = pb::AttachRequest {
            job_id: "load".into(),
            rank: id,
            device: (id % 2).to_string(),
            client: "graphpool-load".into(),
            ..Default::default()
        };
        let mut events = c.graphpool.attach(req).await.expect("attach").into_inner();
        let Some(pb::session_event::Event::Attached(a)) = events.message().await.unwrap().unwrap().event
        else {
            panic!("no attached event")
        };
        let sid = a.session_id;
        let mut conn = FdConnection::connect(&fd_socket).expect("fd socket");
        let mut rng = Rng(u64::from(id) * 0x9e37_79b9 + 1);
        let mut lat: BTreeMap<&'static str, Vec<u32>> = BTreeMap::new();
        let mut errors: BTreeMap<String, u64> = BTreeMap::new();
        let mut held: Vec<u64> = Vec::new();
        let mut plan_ok = true;
        let mut plan_note = String::new();
        // `-grpc` modes make allocate/release gRPC calls; the others use the fd socket.
        let grpc = mode.ends_with("-grpc");
        let mode = mode.trim_end_matches("-grpc");
        let wait = start_at.saturating_sub(now_ms());
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let end = Instant::now() + Duration::from_secs_f64(seconds);
        let us = |t: Instant| t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
        // Open loop when paced: operations start on a fixed schedule (staggered per client), so
        // latency is measured at a known offered load rather than at saturation.
        let period = (rate > 0.0).then(|| Duration::from_secs_f64(1.0 / rate));
        // The answer to a `plan-large` request (every offset) is larger than a client takes by
        // default.
        let mut large_plans = c.graphpool.clone().max_decoding_message_size(64 << 20);
        let mut next =
            Instant::now() + period.map(|p| p.mul_f64(f64::from(id % 97) / 97.0)).unwrap_or_default();
        while Instant::now() < end {
            if let Some(p) = period {
                tokio::time::sleep_until(next.into()).await;
                next += p;
            }
            if mode == "plan-large" {
                let req = large_plan_request(sid, id);
                let t = Instant::now();
                match large_plans.plan_capture(req).await {
                    Ok(_) => lat.entry("PlanCapture").or_default().push(us(t)),
                    Err(e) => *errors.entry(format!("plan {:?}", e.code())).or_default() += 1,
                }
                continue;
            }
            let op = if mode == "rr" { 0 } else { rng.below(100) };
            match op {
                // allocate + release round trip (rr), or allocate (mixed, while < 8 held)
                0..=39 if mode == "rr" || held.len() < 8 => {
                    let size = MIB * (1 + rng.below(4));
                    let t = Instant::now();
                    let r = allocate(&mut c, &mut conn, grpc, sid, size).await;
                    let ta = us(t);
                    match r {
                        Ok(g) => {
                            lat.entry("AllocateSegment").or_default().push(ta);
                            if mode == "rr" {
                                let t2 = Instant::now();
                                match release(&mut c, &mut conn, grpc, sid, g).await {
                                    Ok(()) => {
                                        lat.entry("ReleaseSegment").or_default().push(us(t2));
                                        lat.entry("allocate+release").or_default().push(us(t));
                                    }
                                    Err(e) => *errors.entry(format!("release {e}")).or_default() += 1,
                                }
                            } else {
                                held.push(g);
                            }
                        }
                        Err(e) => *errors.entry(format!("allocate {e}")).or_default() += 1,
                    }
                }
                0..=69 if !held.is_empty() => {
                    let g = held.swap_remove(rng.below(held.len() as u64) as usize);
                    let t = Instant::now();
                    match release(&mut c, &mut conn, grpc, sid, g).await {
                        Ok(()) => lat.entry("ReleaseSegment").or_default().push(us(t)),
                        Err(e) => *errors.entry(format!("release {e}")).or_default() += 1,
                    }
                }
                0..=94 if !held.is_empty() => {
                    let g = held[rng.below(held.len() as u64) as usize];
                    let t = Instant::now();
                    match conn.fetch(sid, g) {
                        Ok((fd, _)) => {
                            lat.entry("FetchFd").or_default().push(us(t));
                            drop(fd);
                        }
                        Err(e) => *errors.entry(format!("fetch {e}")).or_default() += 1,
                    }
                }
                _ if plan_ok => {
                    let t = Instant::now();
                    match c.graphpool.plan_capture(plan_request(sid)).await {
                        Ok(_) => lat.entry("PlanCapture").or_default().push(us(t)),
                        Err(e) if e.code() == tonic::Code::Unimplemented => {
                            plan_ok = false;
                            plan_note = format!("PlanCapture skipped: UNIMPLEMENTED ({})", e.message());
                        }
                        Err(e) => *errors.entry(format!("plan {:?}", e.code())).or_default() += 1,
                    }
                }
                _ => {}
            }
        }
        for g in held.drain(..) {
            let _ = release(&mut c, &mut conn, grpc, sid, g).await;
        }
        let _ = c.graphpool.detach(pb::DetachRequest { session_id: sid }).await;
        drop(events);
        let lat: serde_json::Map<String, serde_json::Value> =
            lat.into_iter().map(|(k, v)| (k.to_string(), serde_json::json!(v))).collect();
        let v = serde_json::json!({ "latencies_us": lat, "errors": errors, "plan_note": plan_note,
            "cpu_seconds": own_cpu_seconds() });
        std::fs::write(out, v.to_string()).unwrap();
    });
}

/// Allocates a segment of `size` bytes: on the fd socket's fast path (the grant and its fd in
/// one message; the fd is closed at once), or as a gRPC call (no fd); returns the grant id.
async fn allocate(
    c: &mut Clients,
    conn: &mut FdConnection,
    grpc: bool,
    sid: u64,
    size: u64,
) -> Result<u64, String> {
    let req = pb::AllocateSegmentRequest { session_id: sid, size_bytes: size, label: "load".into() };
    if grpc {
        let g = c.graphpool.allocate_segment(req).await.map_err(|e| format!("{:?}", e.code()))?;
        Ok(g.into_inner().grant_id)
    } else {
        let (g, fd) = conn.allocate(req).map_err(|e| e.to_string())?;
        drop(fd);
        Ok(g.grant_id)
    }
}

/// Releases a grant: on the fd socket's fast path or as a gRPC call.
async fn release(
    c: &mut Clients,
    conn: &mut FdConnection,
    grpc: bool,
    sid: u64,
    g: u64,
) -> Result<(), String> {
    if grpc {
        let req = pb::ReleaseSegmentRequest { session_id: sid, grant_id: g };
        c.graphpool.release_segment(req).await.map(|_| ()).map_err(|e| format!("{:?}", e.code()))
    } else {
        conn.release(sid, g).map(|_| ()).map_err(|e| e.to_string())
    }
}

/// A buffer of a `PlanCapture` list, live over `[start, end)`.
fn buffer(name: String, start: u64, end: u64, size_bytes: u64) -> pb::BufferSpec {
    pb::BufferSpec { name, start, end, size_bytes, ..Default::default() }
}

/// `PlanCapture` of `buffers` for session `sid` within `time_budget_ms`.
fn plan_of(sid: u64, buffers: Vec<pb::BufferSpec>, time_budget_ms: u32) -> pb::PlanCaptureRequest {
    pb::PlanCaptureRequest {
        session_id: sid,
        input: Some(pb::PlanInput {
            input: Some(pb::plan_input::Input::Buffers(pb::BufferList { buffers })),
            time_budget_ms,
        }),
        ..Default::default()
    }
}

/// The `mixed` modes' plan: six buffers, a 2 ms budget.
fn plan_request(sid: u64) -> pb::PlanCaptureRequest {
    let b = |name: &str, start, end, size| buffer(name.into(), start, end, size);
    let buffers = vec![
        b("x0", 0, 3, 4 * MIB),
        b("x1", 1, 4, 2 * MIB),
        b("x2", 2, 6, 8 * MIB),
        b("x3", 4, 8, 4 * MIB),
        b("x4", 5, 9, 2 * MIB),
        b("x5", 7, 10, 6 * MIB),
    ];
    plan_of(sid, buffers, 2)
}

/// A `plan-large` request: [`LARGE_PLAN_BUFFERS`] buffers drawn for client `id` (starts
/// uniform over as many steps, lifetimes of 1–1000 steps, sizes of 4 KiB–16 MiB in powers of
/// two and three quarters of them), every offset asked back, a 1 s budget.
fn large_plan_request(sid: u64, id: u32) -> pb::PlanCaptureRequest {
    let n = u64::from(LARGE_PLAN_BUFFERS);
    let mut rng = Rng(u64::from(id) * 0x2545_f491 + 7);
    let buffers = (0..n)
        .map(|i| {
            let start = rng.below(n);
            let size = (4096u64 << rng.below(13)) / 4 * (3 + rng.below(2));
            buffer(format!("b{i}"), start, start + 1 + rng.below(1000), size)
        })
        .collect();
    plan_of(sid, buffers, 1000)
}

// ---- driver ------------------------------------------------------------------------------

struct Daemon {
    child: Child,
    socket: PathBuf,
    fd_socket: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn proc_rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// CPU time (user + system) of process `pid`, in clock ticks.
fn proc_cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which may contain spaces): state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = rest.split_whitespace().skip(11).take(2).filter_map(|x| x.parse().ok()).collect();
    f.iter().sum()
}

/// Busy (non-idle, non-iowait) CPU time of the whole machine, in clock ticks.
fn machine_busy_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let line = stat.lines().next().unwrap_or("");
    let v: Vec<u64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal guest guest_nice (guest is in user)
    [0, 1, 2, 5, 6].iter().filter_map(|i| v.get(*i)).sum()
}

/// CPU time (user + system) of this process so far, in seconds.
fn own_cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid rusage to write.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).max(1) as f64
}

fn proc_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

fn pct(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn start_daemon(bin: &Path, dir: &Path) -> Daemon {
    let socket = dir.join("g.sock");
    let config = dir.join("graphpoold.toml");
    std::fs::write(
        &config,
        format!(
            "socket = \"{}\"\nbackend = \"host\"\nmetrics_listen = \"off\"\n[host]\ndevices = 2\ncapacity = \"64GiB\"\n",
            socket.display()
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
    let child = Command::new(bin)
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let d = Daemon { child, fd_socket: dir.join("graphpool-fd.sock"), socket };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(&d.socket).is_err()
        || std::os::unix::net::UnixStream::connect(&d.fd_socket).is_err()
    {
        assert!(Instant::now() < deadline, "graphpoold did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    d
}

struct RunResult {
    json: serde_json::Value,
    table: Vec<String>,
}

fn run(d: &Daemon, dir: &Path, mode: &str, clients: u32, rate: f64, seconds: f64) -> RunResult {
    let exe = std::env::current_exe().unwrap();
    let start_at = now_ms() + 1500 + u64::from(clients) * 15;
    let mut kids = Vec::new();
    for i in 0..clients {
        let out = dir.join(format!("w-{mode}-{clients}-{i}.json"));
        let _ = std::fs::remove_file(&out);
        let child = Command::new(&exe)
            .args(["worker", "--mode", mode, "--id", &i.to_string()])
            .arg("--socket")
            .arg(&d.socket)
            .arg("--fd-socket")
            .arg(&d.fd_socket)
            .args(["--start-at", &start_at.to_string(), "--seconds", &seconds.to_string()])
            .args(["--rate", &rate.to_string()])
            .arg("--out")
            .arg(&out)
            .spawn()
            .unwrap();
        kids.push((child, out));
    }
    // Sample the daemon's RSS while the workers run.
    let pid = d.child.id();
    let mut rss_max = 0;
    // CPU time of the whole machine, of the daemon and of the workers over the measured window
    // (from the workers' start to the last one's exit): whatever else ran on the machine
    // competed with the benchmark for the same cores.
    let mut window: Option<(u64, u64)> = None;
    while kids.iter_mut().any(|(c, _)| c.try_wait().ok().flatten().is_none()) {
        rss_max = rss_max.max(proc_rss(pid));
        if window.is_none() && now_ms() >= start_at {
            window = Some((machine_busy_ticks(), proc_cpu_ticks(pid)));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (busy0, daemon0) = window.unwrap_or((machine_busy_ticks(), proc_cpu_ticks(pid)));
    let (busy, daemon_cpu) =
        (machine_busy_ticks().saturating_sub(busy0), proc_cpu_ticks(pid).saturating_sub(daemon0));
    let mut lat: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut notes = Vec::new();
    let mut workers_cpu = 0.0;
    for (mut c, out) in kids {
        let st = c.wait().unwrap();
        assert!(st.success(), "worker failed: {st}");
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        for (k, arr) in v["latencies_us"].as_object().unwrap() {
            lat.entry(k.clone())
                .or_default()
                .extend(arr.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32));
        }
        workers_cpu += v["cpu_seconds"].as_f64().unwrap_or(0.0);
        for (k, n) in v["errors"].as_object().unwrap() {
            *errors.entry(k.clone()).or_default() += n.as_u64().unwrap();
        }
        if let Some(n) = v["plan_note"].as_str().filter(|n| !n.is_empty())
            && !notes.iter().any(|x: &String| x == n)
        {
            notes.push(n.to_string());
        }
        let _ = std::fs::remove_file(out);
    }
    let mut rpcs = serde_json::Map::new();
    let mut table = Vec::new();
    let offered = if rate > 0.0 { format!("@{rate}") } else { String::new() };
    let label = format!("{clients}{offered}");
    for (k, mut v) in lat {
        v.sort_unstable();
        let (p50, p99, max) = (pct(&v, 0.5), pct(&v, 0.99), *v.last().unwrap_or(&0));
        let per_s = v.len() as f64 / seconds;
        table.push(format!(
            "{mode:<10} {label:>6}  {k:<17} {:>9} {per_s:>9.0} {p50:>8} {p99:>8} {max:>8}",
            v.len()
        ));
        rpcs.insert(
            k,
            serde_json::json!({ "count": v.len(), "per_second": per_s, "p50_us": p50, "p99_us": p99, "max_us": max }),
        );
    }
    // Percent of the machine (all cores) over the window.
    let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64;
    let pct_of = |cpu_seconds: f64| cpu_seconds / (seconds * ncpu) * 100.0;
    let (busy, daemon_cpu) = (busy as f64 / ticks_per_second(), daemon_cpu as f64 / ticks_per_second());
    let others = (busy - daemon_cpu - workers_cpu).max(0.0);
    let cpu = serde_json::json!({
        "machine_busy_percent": pct_of(busy), "daemon_percent": pct_of(daemon_cpu),
        "workers_percent": pct_of(workers_cpu), "others_percent": pct_of(others),
    });
    table.push(format!(
        "{mode:<10} {label:>6}  cpu: machine {:.0} %, daemon {:.0} %, workers {:.0} %, other processes {:.0} %",
        pct_of(busy),
        pct_of(daemon_cpu),
        pct_of(workers_cpu),
        pct_of(others)
    ));
    for n in &notes {
        table.push(format!("{mode:<10} {label:>6}  note: {n}"));
    }
    if !errors.is_empty() {
        table.push(format!("{mode:<10} {label:>6}  errors: {errors:?}"));
    }
    RunResult {
        json: serde_json::json!({
            "mode": mode, "clients": clients, "rate_per_client": rate, "seconds": seconds, "rpcs": rpcs,
            "errors": errors, "notes": notes, "daemon_rss_max_bytes": rss_max, "cpu": cpu,
        }),
        table,
    }
}

fn driver(args: &[String]) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let bin = arg(args, "--daemon")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("GRAPHPOOLD").map(PathBuf::from))
        .unwrap_or_else(|| {
            let t = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or(root.join("target"));
            t.join("release/graphpoold")
        });
    let seconds: f64 = arg(args, "--seconds").map(|s| s.parse().unwrap()).unwrap_or(5.0);
    let runs = arg(args, "--runs").unwrap_or_else(|| {
        "rr:1,rr:8,rr:64,rr:64@25,rr:64@50,mixed:64,mixed:64@25,rr-grpc:1,rr-grpc:64@25,mixed-grpc:64@25,plan-large:4"
            .into()
    });
    let json_out = arg(args, "--json").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("load.json"));
    let dir = tempfile::Builder::new().prefix("gpload").tempdir_in("/tmp").unwrap();
    let d = start_daemon(&bin, dir.path());
    let pid = d.child.id();
    std::thread::sleep(Duration::from_millis(300));
    let rss_idle = proc_rss(pid);
    let fds_idle = proc_fds(pid);
    // Warm up (first connections, runtime threads), then take the baseline.
    run(&d, dir.path(), "mixed", 2, 0.0, 1.0);
    std::thread::sleep(Duration::from_millis(500));
    let (rss_base, fds_base) = (proc_rss(pid), proc_fds(pid));

    let mut results = Vec::new();
    let mut table = vec![format!(
        "{:<10} {:>6}  {:<17} {:>9} {:>9} {:>8} {:>8} {:>8}",
        "mode", "n", "rpc", "count", "per s", "p50 µs", "p99 µs", "max µs"
    )];
    let mut rss_load = 0;
    for spec in runs.split(',') {
        let (mode, n) = spec.split_once(':').expect("runs are mode:clients[@rate]");
        let (n, rate) = match n.split_once('@') {
            Some((n, r)) => (n, r.parse::<f64>().expect("rate is operations per second per client")),
            None => (n, 0.0),
        };
        let r = run(&d, dir.path(), mode, n.parse().unwrap(), rate, seconds);
        rss_load = rss_load.max(r.json["daemon_rss_max_bytes"].as_u64().unwrap());
        table.extend(r.table);
        results.push(r.json);
    }

    // After the load: the ledger is empty, fds and RSS back at baseline.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (granted, grants, sessions) = rt.block_on(async {
        let mut c = connect(&d.socket).await.unwrap();
        for _ in 0..200 {
            let st = c.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap().into_inner();
            if st.sessions.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let u = c.graphpool.get_usage(pb::GetUsageRequest {}).await.unwrap().into_inner();
        let st = c.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap().into_inner();
        (
            u.devices.iter().map(|d| d.granted_bytes).sum::<u64>(),
            u.devices.iter().map(|d| d.grants).sum::<u32>(),
            st.sessions.len(),
        )
    });
    // Dropping the runtime closes the checker's own connection before the fds are counted.
    drop(rt);
    let deadline = Instant::now() + Duration::from_secs(3);
    while proc_fds(pid) > fds_base && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let rss_slack = 4 * MIB;
    // The daemon hands freed heap back to the OS every 5 s: give it two rounds.
    let deadline = Instant::now() + Duration::from_secs(11);
    while proc_rss(pid) > rss_base + rss_slack && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (rss_after, fds_after) = (proc_rss(pid), proc_fds(pid));
    let checks = serde_json::json!({
        "ledger_empty": granted == 0 && grants == 0 && sessions == 0,
        "fds_back_at_baseline": fds_after <= fds_base,
        "rss_back_at_baseline": rss_after <= rss_base + rss_slack,
    });
    let mib = |b: u64| b as f64 / MIB as f64;
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':').map(|(_, v)| v.trim().to_string()))
        .unwrap_or_default();
    let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let summary = serde_json::json!({
        "hardware": { "cpus": ncpu, "cpu_model": cpu },
        "daemon": bin.display().to_string(),
        "seconds_per_run": seconds,
        "runs": results,
        "daemon_rss_bytes": { "idle_at_start": rss_idle, "baseline_after_warmup": rss_base,
            "max_under_load": rss_load, "after_load": rss_after },
        "daemon_fds": { "idle_at_start": fds_idle, "baseline_after_warmup": fds_base, "after_load": fds_after },
        "ledger_after": { "granted_bytes": granted, "grants": grants, "sessions": sessions },
        "checks": checks,
    });
    for l in &table {
        println!("{l}");
    }
    println!(
        "daemon RSS: idle {:.1} MiB, baseline {:.1} MiB, max under load {:.1} MiB, after {:.1} MiB",
        mib(rss_idle),
        mib(rss_base),
        mib(rss_load),
        mib(rss_after)
    );
    println!("daemon fds: idle {fds_idle}, baseline {fds_base}, after {fds_after}");
    println!("ledger after: {granted} bytes, {grants} grants, {sessions} sessions");
    println!("checks: {checks}");
    println!("hardware: {ncpu} CPUs, {cpu}");
    let mut f = std::fs::File::create(&json_out).unwrap();
    writeln!(f, "{}", serde_json::to_string_pretty(&summary).unwrap()).unwrap();
    println!("wrote {}", json_out.display());
    let ok = checks.as_object().unwrap().values().all(|v| v == true);
    // `exit` runs no destructors: stop the daemon and remove its directory first.
    drop(d);
    drop(dir);
    std::process::exit(if ok { 0 } else { 1 });
}
