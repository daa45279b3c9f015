//! Integration tests: the real `graphpoold` binary (host backend) on a temporary socket,
//! real gRPC over Unix sockets, real fds over SCM_RIGHTS, real child processes.

mod common;

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use graphpool::client::{ClientError, error_detail};
use graphpool_proto::v1 as pb;
use tonic::Code;

const MIB: u64 = 1 << 20;

fn capacity(status: &tonic::Status) -> pb::CapacityRefusal {
    match error_detail(status).and_then(|d| d.detail) {
        Some(pb::error_detail::Detail::Capacity(c)) => c,
        other => panic!("expected a capacity refusal, got {other:?} for {status:?}"),
    }
}

fn field(status: &tonic::Status) -> String {
    match error_detail(status).and_then(|d| d.detail) {
        Some(pb::error_detail::Detail::Field(f)) => f.field,
        other => panic!("expected a field violation, got {other:?} for {status:?}"),
    }
}

/// A log written to a file (or the journal) carries no terminal colour codes.
#[tokio::test]
async fn a_log_that_is_not_a_terminal_has_no_colour_codes() {
    let d = start("");
    let mut c = d.clients().await;
    attach(&mut c, "train", 0, "").await.unwrap();
    let log = d.log();
    assert!(log.contains("graphpoold ready"), "{log}");
    assert!(!log.contains('\u{1b}'), "escape codes in the log:\n{log:?}");
}

#[tokio::test]
async fn allocate_map_release_round_trip() {
    let d = start("");
    let mut c = d.clients().await;
    let s = attach(&mut c, "train", 0, "1").await.unwrap();
    assert_eq!(s.attached.device.as_ref().unwrap().index, 1);
    let g = allocate(&mut c, &s, 3 * MIB).await.unwrap();
    assert_eq!(g.size_bytes, 4 * MIB, "rounded to the 2 MiB granularity");
    assert_eq!(g.requested_bytes, 3 * MIB);
    assert_eq!(g.handle_kind, "memfd");
    let (fd, resp) = d.fd_conn().fetch(s.id, g.grant_id).unwrap();
    assert_eq!(resp.size_bytes, 4 * MIB);
    let mut m = Mapping::new(&fd, resp.size_bytes as usize);
    m.bytes()[4 * MIB as usize - 1] = 7;
    assert_eq!(granted_total(&mut c).await, 4 * MIB);
    let rel = c
        .graphpool
        .release_segment(pb::ReleaseSegmentRequest { session_id: s.id, grant_id: g.grant_id })
        .await
        .unwrap();
    assert_eq!(rel.into_inner().bytes_released, 4 * MIB);
    assert_eq!(granted_total(&mut c).await, 0);
    // Double release names the grant.
    let e = c
        .graphpool
        .release_segment(pb::ReleaseSegmentRequest { session_id: s.id, grant_id: g.grant_id })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert_eq!(field(&e), "grant_id");
}

/// Child side of `two_processes_share_a_grant`: maps the inherited fd, checks the parent's
/// pattern, writes its own, and tries (and must fail) to fetch the fd itself.
#[test]
fn child_maps_inherited_fd() {
    let Ok(fd) = std::env::var("GP_CHILD_FD") else { return };
    let fd: i32 = fd.parse().unwrap();
    let len: usize = child_arg("GP_CHILD_LEN");
    // SAFETY: the parent passed this fd to us open.
    let owned = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut m = Mapping::new(&owned, len);
    assert_eq!(&m.bytes()[..5], b"hello");
    m.bytes()[len - 5..].copy_from_slice(b"world");
    // Holding the session and grant ids is not enough to get the fd.
    let fd_socket = child_arg::<String>("GP_CHILD_FD_SOCKET");
    let session: u64 = child_arg("GP_CHILD_SESSION");
    let grant: u64 = child_arg("GP_CHILD_GRANT");
    let mut conn = graphpool::client::FdConnection::connect(std::path::Path::new(&fd_socket)).unwrap();
    match conn.fetch(session, grant) {
        Err(ClientError::FdRefused { code: 7, .. }) => println!("CHILD-REFUSED"),
        other => panic!("a foreign process got {other:?}"),
    }
    println!("CHILD-OK");
}

#[tokio::test]
async fn two_processes_share_a_grant_and_only_the_owner_gets_fds() {
    let d = start("");
    let mut c = d.clients().await;
    let s = attach(&mut c, "train", 0, "").await.unwrap();
    let g = allocate(&mut c, &s, 2 * MIB).await.unwrap();
    let (fd, _) = d.fd_conn().fetch(s.id, g.grant_id).unwrap();
    let len = g.size_bytes as usize;
    let mut m = Mapping::new(&fd, len);
    m.bytes()[..5].copy_from_slice(b"hello");
    inheritable(&fd);
    run_child(
        "child_maps_inherited_fd",
        &[
            ("GP_CHILD_FD", fd.as_raw_fd().to_string()),
            ("GP_CHILD_LEN", len.to_string()),
            ("GP_CHILD_FD_SOCKET", d.fd_socket.display().to_string()),
            ("GP_CHILD_SESSION", s.id.to_string()),
            ("GP_CHILD_GRANT", g.grant_id.to_string()),
        ],
        &["CHILD-REFUSED", "CHILD-OK"],
    );
    assert_eq!(&m.bytes()[len - 5..], b"world", "the parent sees the child's write");
}

#[tokio::test]
async fn quota_exhaustion_gives_structured_details() {
    let d = start(
        "[limits]\ndefault_rank_quota = \"64MiB\"\njobs = { capped = \"96MiB\" }\nranks = { \"other:3\" = \"8MiB\" }",
    );
    let mut c = d.clients().await;
    let a = attach(&mut c, "capped", 0, "").await.unwrap();
    let b = attach(&mut c, "capped", 1, "").await.unwrap();
    allocate(&mut c, &a, 64 * MIB).await.unwrap();
    let e = allocate(&mut c, &a, 2 * MIB).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    let r = capacity(&e);
    assert_eq!(
        (r.limit.as_str(), r.requested_bytes, r.free_bytes, r.limit_bytes),
        ("rank-quota", 2 * MIB, 0, 64 * MIB)
    );
    assert_eq!(r.top_holders[0].job_id, "capped");
    assert_eq!(r.top_holders[0].granted_bytes, 64 * MIB);
    allocate(&mut c, &b, 32 * MIB).await.unwrap();
    let r = capacity(&allocate(&mut c, &b, 2 * MIB).await.unwrap_err());
    assert_eq!(r.limit, "job-quota");
    assert_eq!(r.top_holders.len(), 2);
    // The device budget (1 GiB) bites for another job.
    let x = attach(&mut c, "other", 0, "").await.unwrap();
    let r = capacity(&allocate(&mut c, &x, 1024 * MIB).await.unwrap_err());
    assert_eq!((r.limit.as_str(), r.free_bytes), ("device-budget", 1024 * MIB - 96 * MIB));
    // A rank quota of the config file is in effect from the start.
    let y = attach(&mut c, "other", 3, "").await.unwrap();
    let r = capacity(&allocate(&mut c, &y, 16 * MIB).await.unwrap_err());
    assert_eq!((r.limit.as_str(), r.limit_bytes), ("rank-quota", 8 * MIB));
    // Quotas change at run time (the test runs as an admin: root or the daemon's uid).
    let set = pb::SetLimitsRequest {
        jobs: vec![pb::JobLimit { job_id: "capped".into(), quota_bytes: 0 }],
        default_rank_quota_bytes: Some(0),
        ..Default::default()
    };
    c.admin.set_limits(set).await.unwrap();
    allocate(&mut c, &a, 2 * MIB).await.unwrap();
    // A reserved budget that does not fit is refused at attach.
    let req = pb::AttachRequest {
        job_id: "big".into(),
        budget_bytes: 2048 * MIB,
        reserve_budget: true,
        ..Default::default()
    };
    let e = attach_req(&mut c, req).await.err().unwrap();
    assert_eq!(capacity(&e).limit, "device-budget");
}

/// Child side of the SIGKILL test: attaches, allocates, says so, then waits to be killed.
#[test]
fn child_holds_grants_until_killed() {
    let Ok(socket) = std::env::var("GP_HOLD_SOCKET") else { return };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = graphpool::client::connect(std::path::Path::new(&socket)).await.unwrap();
        let s = attach(&mut c, "victim", 5, "").await.unwrap();
        for _ in 0..4 {
            allocate(&mut c, &s, 8 * MIB).await.unwrap();
        }
        println!("READY");
        tokio::time::sleep(Duration::from_secs(60)).await;
        drop(s);
    });
}

#[tokio::test]
async fn sigkilled_client_is_reclaimed_within_a_second() {
    let d = start_with("", true);
    let mut child =
        child_test("child_holds_grants_until_killed", &[("GP_HOLD_SOCKET", d.socket.display().to_string())])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let l = lines.next().expect("child ended before READY").unwrap();
        if l.contains("READY") {
            break;
        }
    }
    let mut c = d.clients().await;
    assert_eq!(granted_total(&mut c).await, 32 * MIB);
    // SAFETY: killing our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let took = wait_until(Duration::from_secs(1), || {
        let mut c = c.clone();
        async move { granted_total(&mut c).await == 0 }
    })
    .await;
    let _ = child.wait();
    let took = took.unwrap_or_else(|| panic!("grants not reclaimed within 1 s; log:\n{}", d.log()));
    eprintln!("reclaimed after SIGKILL in {took:?}");
    let m = d.metrics_text().await;
    assert!(m.contains("graphpool_sessions{Hostname="), "{m}");
    let sessions_line = m.lines().find(|l| l.starts_with("graphpool_sessions{")).unwrap();
    assert!(sessions_line.ends_with(" 0"), "{sessions_line}");
    // Every reason is exported from the start (at 0); the killed client's session counts once.
    let ended = |reason: &str| {
        m.lines()
            .find(|l| l.starts_with(&format!("graphpool_sessions_ended_total{{reason=\"{reason}\"}}")))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no sessions_ended_total for {reason}: {m}"))
    };
    assert_eq!(ended("process-exit") + ended("stream-closed"), 1, "{m}");
    assert_eq!(ended("detach"), 0, "{m}");
    assert!(!m.contains("job_id=\"victim\""), "no stale series of the dead job:\n{m}");
}

/// Connections the allow-list child opens on each socket to see that refusals are not each
/// logged.
const REFUSED_CONNECTIONS: usize = 300;

/// Child side of the allow-list test: drops to an unprivileged uid, then tries both sockets.
#[test]
fn child_outside_allow_list() {
    let Ok(socket) = std::env::var("GP_NOBODY_SOCKET") else { return };
    become_nobody();
    let socket = std::path::PathBuf::from(socket);
    let fd_socket = socket.with_file_name("graphpool-fd.sock");
    // Both sockets close such a peer at accept, before reading anything: a connection that
    // sends nothing is closed all the same.
    for path in [&socket, &fd_socket] {
        let mut s = std::os::unix::net::UnixStream::connect(path).unwrap();
        assert!(closed_within(&mut s, Duration::from_secs(5)), "{} kept the connection open", path.display());
    }
    // A gRPC client gets no answer: its request is never read, let alone served.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let call = async {
            let mut c = graphpool::client::connect(&socket).await.map_err(|e| e.to_string())?;
            let req = pb::AttachRequest { job_id: "sneaky".into(), ..Default::default() };
            c.graphpool.attach(req).await.map(|_| ()).map_err(|e| format!("{e:?}"))
        };
        match tokio::time::timeout(Duration::from_secs(5), call).await {
            Ok(Err(e)) => assert!(!e.contains("PermissionDenied"), "the request was read: {e}"),
            Ok(Ok(())) => panic!("a peer off the allow-list attached"),
            Err(_) => panic!("the connection of a peer off the allow-list was kept open"),
        }
    });
    // Many more: the daemon closes each of them, and logs a few lines, not one per connection.
    for _ in 0..REFUSED_CONNECTIONS {
        for path in [&socket, &fd_socket] {
            if let Ok(s) = std::os::unix::net::UnixStream::connect(path) {
                drop(s);
            }
        }
    }
    println!("NOBODY-REFUSED");
}

#[tokio::test]
async fn uid_not_on_allow_list_is_refused_at_accept() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run a child under another uid");
        return;
    }
    let d =
        start_with("socket_mode = \"0666\"\nlog_format = \"json\"\n[access]\nallowed_uids = [4242]", true);
    // Let the unprivileged child reach the socket inside the test's private directory.
    std::fs::set_permissions(d.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    run_child(
        "child_outside_allow_list",
        &[("GP_NOBODY_SOCKET", d.socket.display().to_string())],
        &["NOBODY-REFUSED"],
    );
    // The daemon keeps serving allowed peers (root is always allowed).
    let mut c = d.clients().await;
    let _s = attach(&mut c, "ok", 0, "").await.unwrap();
    let status = c.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap().into_inner();
    assert_eq!(status.sessions.len(), 1, "only root's session: {status:?}");
    // Each refusal at accept was dropped, not logged: at most one line per socket every 10 s
    // (two if the child's connections spanned an interval), naming the uid and the socket.
    let log = d.log();
    let lines: Vec<serde_json::Value> = d
        .json_log()
        .into_iter()
        .filter(|v| v["message"].as_str().is_some_and(|m| m.contains("not on the allow-list")))
        .collect();
    for socket in ["grpc", "fd-socket"] {
        let on: Vec<_> = lines.iter().filter(|v| v["socket"] == socket).collect();
        assert!(
            (1..=2).contains(&on.len()),
            "{socket}: {} lines for {} refusals:\n{log}",
            on.len(),
            REFUSED_CONNECTIONS
        );
        assert_eq!(on[0]["level"], "WARN");
        assert_eq!(
            (&on[0]["uid"], &on[0]["gid"], &on[0]["unlogged"]),
            (&65534.into(), &65534.into(), &0.into())
        );
        assert!(on[0]["message"].as_str().unwrap().contains("closed at accept"), "{}", on[0]);
    }
    // Every refusal is counted, though few are logged (once the daemon has accepted the last
    // of the child's connections, which may still wait in the socket's backlog); none of them
    // counts as a uid past its connection cap.
    let series = |name: &str, transport: &str| format!("{name}{{transport=\"{transport}\"}}");
    let waited = std::time::Instant::now();
    let m = loop {
        let m = d.metrics_text().await;
        let counted =
            ["grpc", "fd-socket"].map(|t| metric_value(&m, &series("graphpool_peers_refused_total", t)));
        if counted.iter().all(|&c| c >= Some(REFUSED_CONNECTIONS as f64)) {
            break m;
        }
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "refusals counted (gRPC, fd socket): {counted:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for transport in ["grpc", "fd-socket"] {
        let capped = metric_value(&m, &series("graphpool_connections_refused_total", transport));
        assert_eq!(capped, Some(0.0), "{transport}");
    }
    // All of them at accept: no request of the refused peer reached a handler.
    assert_eq!(lines.len(), lines.iter().filter(|v| v["socket"].is_string()).count(), "{log}");
    assert!(!log.contains("sneaky"), "the refused peer's request was read:\n{log}");
}

#[tokio::test]
async fn bad_input_gets_the_right_code_and_the_daemon_keeps_serving() {
    let d = start("[guards]\nmax_message_bytes = \"64KiB\"\nmax_grants_per_session = 3");
    let mut c = d.clients().await;
    let s = attach(&mut c, "j", 0, "").await.unwrap();

    let cases: Vec<(pb::AllocateSegmentRequest, Code, &str)> = vec![
        (
            pb::AllocateSegmentRequest { session_id: s.id, size_bytes: 0, label: String::new() },
            Code::InvalidArgument,
            "size_bytes",
        ),
        (
            pb::AllocateSegmentRequest { session_id: s.id, size_bytes: u64::MAX, label: String::new() },
            Code::InvalidArgument,
            "size_bytes",
        ),
        (
            pb::AllocateSegmentRequest { session_id: s.id, size_bytes: MIB, label: "bad label!".into() },
            Code::InvalidArgument,
            "label",
        ),
        (
            pb::AllocateSegmentRequest { session_id: 0, size_bytes: MIB, label: String::new() },
            Code::InvalidArgument,
            "session_id",
        ),
        (
            pb::AllocateSegmentRequest { session_id: 12345, size_bytes: MIB, label: String::new() },
            Code::NotFound,
            "session_id",
        ),
    ];
    for (req, code, f) in cases {
        let e = c.graphpool.allocate_segment(req.clone()).await.unwrap_err();
        assert_eq!(e.code(), code, "{req:?}: {e:?}");
        assert_eq!(field(&e), f, "{req:?}");
        assert!(e.message().contains(f), "message names the field: {}", e.message());
    }
    // Attach validation.
    for (req, f) in [
        (pb::AttachRequest { job_id: String::new(), ..Default::default() }, "job_id"),
        (pb::AttachRequest { job_id: "has space".into(), ..Default::default() }, "job_id"),
        (
            pb::AttachRequest { job_id: "j".into(), reserve_budget: true, ..Default::default() },
            "budget_bytes",
        ),
    ] {
        let e = attach_req(&mut c, req).await.err().unwrap();
        assert_eq!((e.code(), field(&e).as_str()), (Code::InvalidArgument, f));
    }
    let e = attach(&mut c, "j", 0, "7").await.err().unwrap();
    assert_eq!((e.code(), field(&e).as_str()), (Code::NotFound, "device"));
    let e = attach(&mut c, "j", 0, "GPU-00000000-nope").await.err().unwrap();
    assert_eq!(e.code(), Code::NotFound);

    // Unknown and foreign grants.
    let other = attach(&mut c, "k", 0, "").await.unwrap();
    let g = allocate(&mut c, &other, MIB).await.unwrap();
    let e = c
        .graphpool
        .release_segment(pb::ReleaseSegmentRequest { session_id: s.id, grant_id: g.grant_id })
        .await
        .unwrap_err();
    assert_eq!((e.code(), field(&e).as_str()), (Code::PermissionDenied, "grant_id"));
    let e = c
        .graphpool
        .release_segment(pb::ReleaseSegmentRequest { session_id: s.id, grant_id: 99 })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    // Grants per session are bounded.
    for _ in 0..3 {
        allocate(&mut c, &s, MIB).await.unwrap();
    }
    let e = allocate(&mut c, &s, MIB).await.unwrap_err();
    assert_eq!(capacity(&e).limit, "session-grants");
    assert!(e.message().contains("at most 3 grants (guards.max_grants_per_session)"), "{}", e.message());

    // An oversized message is refused by the transport's limit before it is decoded.
    let huge = pb::AttachRequest { job_id: "x".repeat(100 * 1024), ..Default::default() };
    let e = attach_req(&mut c, huge).await.err().unwrap();
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
    assert!(e.message().contains("too large"), "{e:?}");

    // The fd socket rejects garbage and oversized frames.
    let mut conn = d.fd_conn();
    let r = conn.send_raw(&[3, 0, 0, 0, 0xff, 0xff, 0xff]).unwrap();
    assert_eq!((r.ok, r.code), (false, 3));
    let mut conn = d.fd_conn();
    let r = conn.send_raw(&(1u32 << 30).to_le_bytes()).unwrap();
    assert_eq!((r.ok, r.code), (false, 3));
    let mut conn = d.fd_conn();
    match conn.fetch(s.id, 424242) {
        Err(ClientError::FdRefused { code: 5, .. }) => {}
        other => panic!("{other:?}"),
    }
    // Unset ids are named, as on gRPC, not looked up and reported as gone.
    for (session, grant, f) in [(0, 1, "session_id"), (s.id, 0, "grant_id")] {
        match conn.fetch(session, grant) {
            Err(ClientError::FdRefused { code: 3, message, .. }) => {
                assert!(message.starts_with(f), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }

    // Still serving.
    let st = c.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap().into_inner();
    assert_eq!(st.backend, "host");
    assert_eq!(st.sessions.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_clients_leave_an_empty_ledger_and_no_fds() {
    let d = start("");
    // Warm up the daemon's own fds (listeners, epoll, first connection) before the baseline.
    {
        let mut c = d.clients().await;
        let s = attach(&mut c, "warm", 0, "").await.unwrap();
        let g = allocate(&mut c, &s, MIB).await.unwrap();
        d.fd_conn().fetch(s.id, g.grant_id).unwrap();
    }
    let mut c = d.clients().await;
    wait_until(Duration::from_secs(2), || {
        let mut c = c.clone();
        async move { granted_total(&mut c).await == 0 }
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let baseline = d.open_fds();
    let mut tasks = Vec::new();
    for i in 0..32u32 {
        let socket = d.socket.clone();
        let fd_socket = d.fd_socket.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = graphpool::client::connect(&socket).await.unwrap();
            let s = attach(&mut c, "load", i, &(i % 2).to_string()).await.unwrap();
            let mut conn = graphpool::client::FdConnection::connect(&fd_socket).unwrap();
            for n in 0..1000u64 {
                let g = allocate(&mut c, &s, MIB * (1 + n % 4)).await.unwrap();
                if n % 50 == 0 {
                    let (fd, _) = conn.fetch(s.id, g.grant_id).unwrap();
                    drop(fd);
                }
                c.graphpool
                    .release_segment(pb::ReleaseSegmentRequest { session_id: s.id, grant_id: g.grant_id })
                    .await
                    .unwrap();
            }
            drop(s);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_all_released(&d, &mut c, baseline).await;
}

#[tokio::test]
async fn detach_and_stream_close_release_grants() {
    let d = start("");
    let mut c = d.clients().await;
    let s = attach(&mut c, "j", 0, "").await.unwrap();
    allocate(&mut c, &s, 4 * MIB).await.unwrap();
    allocate(&mut c, &s, 4 * MIB).await.unwrap();
    let r = c.graphpool.detach(pb::DetachRequest { session_id: s.id }).await.unwrap().into_inner();
    assert_eq!((r.grants_released, r.bytes_released), (2, 8 * MIB));
    let mut events = s.events;
    let end = tokio::time::timeout(Duration::from_secs(2), events.message()).await.expect("stream ends");
    assert!(matches!(end, Ok(None)), "{end:?}");

    let s2 = attach(&mut c, "j", 1, "").await.unwrap();
    allocate(&mut c, &s2, 4 * MIB).await.unwrap();
    drop(s2); // closes the Attach stream
    let took = wait_until(Duration::from_secs(1), || {
        let mut c = c.clone();
        async move { granted_total(&mut c).await == 0 }
    })
    .await;
    assert!(took.is_some(), "stream close did not release within 1 s");
}

#[tokio::test]
async fn cli_reports_status_grants_and_health() {
    let d = start("");
    let mut c = d.clients().await;
    let s = attach(&mut c, "clijob", 3, "").await.unwrap();
    allocate(&mut c, &s, 6 * MIB).await.unwrap();
    let cli = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_graphpool"))
            .arg("--socket")
            .arg(&d.socket)
            .args(args)
            .output()
            .unwrap()
    };
    let out = cli(&["status", "--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["backend"], "host");
    assert_eq!(v["devices"][0]["granted_bytes"], 6 * MIB);
    assert_eq!(v["sessions"][0]["job_id"], "clijob");
    let out = cli(&["grants"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("clijob") && text.contains("6 MiB"), "{text}");
    assert!(cli(&["health"]).status.success());
    let out = cli(&["limits", "set", "--job", "clijob=8MiB"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("until graphpoold restarts"), "says how long the limits last: {said}");
    let e = allocate(&mut c, &s, 4 * MIB).await.unwrap_err();
    assert_eq!(capacity(&e).limit, "job-quota");
    assert!(e.message().contains("graphpool limits set --job"), "says what to do: {}", e.message());
    drop(d);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_graphpool"))
        .args(["--socket", "/nonexistent/graphpool.sock", "health", "--timeout", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

fn buffer_list(sizes: &[(u64, u64, u64)]) -> pb::PlanInput {
    pb::PlanInput {
        input: Some(pb::plan_input::Input::Buffers(pb::BufferList {
            buffers: sizes
                .iter()
                .enumerate()
                .map(|(i, (start, end, size))| pb::BufferSpec {
                    name: format!("b{i}"),
                    start: *start,
                    end: *end,
                    size_bytes: *size,
                    alias_group: String::new(),
                })
                .collect(),
        })),
        time_budget_ms: 50,
    }
}

#[tokio::test]
async fn plan_capture_is_checked_reserved_and_recorded() {
    let d = start_with("[limits]\ndefault_rank_quota = \"64MiB\"", true);
    let mut c = d.clients().await;
    let s = attach(&mut c, "planner", 0, "").await.unwrap();
    // Three buffers; b1 and b2 are live together at step 2: the lower bound is 64 MiB.
    let input = buffer_list(&[(0, 2, 16 * MIB), (1, 3, 32 * MIB), (2, 4, 32 * MIB)]);
    let resp = c
        .graphpool
        .plan_capture(pb::PlanCaptureRequest {
            session_id: s.id,
            input: Some(input.clone()),
            reserve: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let plan = resp.plan.unwrap();
    assert_eq!(plan.lower_bound_bytes, 64 * MIB, "b1 and b2 overlap at step 2");
    assert_eq!(plan.live_bound_bytes, 64 * MIB, "no alias groups: the two bounds agree");
    assert!(plan.footprint_bytes >= plan.lower_bound_bytes);
    assert_eq!(plan.buffers.len(), 3);
    assert_eq!(resp.reserved_bytes, 64 * MIB);
    let u = usage(&mut c).await;
    assert_eq!(u.devices[0].planned_bytes, 64 * MIB, "reserved, not yet granted");
    // The reservation is the rank's whole quota: another session of the rank is refused...
    let other = attach(&mut c, "planner", 0, "").await.unwrap();
    let e = allocate(&mut c, &other, 2 * MIB).await.unwrap_err();
    assert_eq!(capacity(&e).limit, "rank-quota");
    // ...while the planning session allocates within its reservation.
    allocate(&mut c, &s, 64 * MIB).await.unwrap();
    let m = d.metrics_text().await;
    assert!(
        m.lines().any(|l| l.starts_with("graphpool_plan_bytes{job_id=\"planner\",rank=\"0\"")
            && l.ends_with(" 67108864")),
        "{m}"
    );
    // A plan that cannot fit is refused before capture, with details.
    let big = buffer_list(&[(0, 1, 128 * MIB)]);
    let e = c
        .graphpool
        .plan_capture(pb::PlanCaptureRequest { session_id: other.id, input: Some(big), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert_eq!(capacity(&e).limit, "rank-quota");
    // Malformed input names the field.
    let bad = buffer_list(&[(3, 1, MIB)]);
    let e = c
        .graphpool
        .plan_capture(pb::PlanCaptureRequest { session_id: s.id, input: Some(bad), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(field(&e).starts_with("input."), "{e:?}");
}

/// A session may have one plan in flight: a second PlanCapture while the first plans is
/// refused at once, and the first still answers.
#[tokio::test]
async fn one_plan_at_a_time_per_session() {
    let d = start_with("", true);
    let mut c = d.clients().await;
    let s = attach(&mut c, "planner", 0, "").await.unwrap();
    // 3000 buffers of uneven sizes and lifetimes: the planner uses its whole time box (such
    // lists do not reach their lower bound).
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let list: Vec<(u64, u64, u64)> = (0..3000)
        .map(|_| {
            let start = next() % 2000;
            (start, start + 1 + next() % 200, (1 + next() % 256) * 4096)
        })
        .collect();
    let mut input = buffer_list(&list);
    input.time_budget_ms = 2000;
    let request = pb::PlanCaptureRequest { session_id: s.id, input: Some(input), ..Default::default() };
    let mut first_client = c.graphpool.clone();
    let first = tokio::spawn({
        let request = request.clone();
        async move { first_client.plan_capture(request).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let t = std::time::Instant::now();
    let e = c.graphpool.plan_capture(request.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("already has a PlanCapture in flight"), "{e:?}");
    assert!(t.elapsed() < std::time::Duration::from_millis(500), "refused at once, not after the first plan");
    let plan = first.await.unwrap().unwrap().into_inner().plan.unwrap();
    assert_eq!(plan.buffers.len(), 3000);
    // A caller that gives up does not free its place while its planner runs: cancelling and
    // asking again adds no planner.
    let mut gone_client = c.graphpool.clone();
    let gone = tokio::spawn({
        let request = request.clone();
        async move { gone_client.plan_capture(request).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    gone.abort();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let e = c.graphpool.plan_capture(request.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "the cancelled plan still runs: {e:?}");
    // Once its time box is over, the session plans again.
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    let plan = c.graphpool.plan_capture(request).await.unwrap().into_inner().plan.unwrap();
    assert_eq!(plan.buffers.len(), 3000);
}

/// A 1F1B schedule of `m` microbatches over three identical layers (a small request whose
/// plan has 17 buffers per microbatch).
fn one_f_one_b_plan(m: u32) -> pb::PlanInput {
    let hidden = |kept_for_backward| pb::TensorSpec {
        name: "hidden".into(),
        shape: vec![4096, 1, 1024],
        dtype: "bf16".into(),
        kept_for_backward,
    };
    let layer = |layer| pb::LayerSpec {
        chunk: 0,
        layer,
        inputs: vec![hidden(true)],
        outputs: vec![hidden(false)],
        saved_bytes: 8 * MIB,
        forward_workspace_bytes: MIB,
        backward_workspace_bytes: MIB,
    };
    let kind = pb::schedule::Kind::OneFOneB(pb::OneFOneB { pp_size: 4, pp_rank: 0, num_microbatches: m });
    let schedule = pb::SchedulePlanInput {
        schedule: Some(pb::Schedule { kind: Some(kind) }),
        layers: (0..3).map(layer).collect(),
        overhead: None,
    };
    pb::PlanInput { input: Some(pb::plan_input::Input::Schedule(schedule)), time_budget_ms: 50 }
}

/// The daemon's `planned` log lines (it logs JSON), one per plan made.
fn planned_lines(d: &Daemon) -> Vec<serde_json::Value> {
    d.json_log().into_iter().filter(|v| v["message"] == "planned").collect()
}

/// A plan whose response would pass the daemon's message limit is refused before anything
/// is reserved, with what to do; asked for without its buffers, it is sent and reserved.
#[tokio::test]
async fn plans_too_large_to_send_are_refused_before_reserving() {
    let d = start("log_format = \"json\"\n[guards]\nmax_message_bytes = \"64KiB\"");
    let mut c = d.clients().await;
    let s = attach(&mut c, "planner", 0, "").await.unwrap();
    let request = |summary_only| pb::PlanCaptureRequest {
        session_id: s.id,
        input: Some(one_f_one_b_plan(256)),
        reserve: true,
        summary_only,
    };
    let e = c.graphpool.plan_capture(request(false)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("4352 buffers") && e.message().contains("summary_only"), "{}", e.message());
    assert_eq!(usage(&mut c).await.devices[0].planned_bytes, 0, "nothing reserved for a plan not sent");
    let resp = c.graphpool.plan_capture(request(true)).await.unwrap().into_inner();
    let plan = resp.plan.unwrap();
    assert!(plan.buffers.is_empty());
    assert_eq!(plan.microbatch_slot.len(), 256);
    assert!(plan.footprint_bytes >= plan.lower_bound_bytes && plan.lower_bound_bytes > 0);
    // Reserved in whole units of the device's granularity.
    assert!(resp.reserved_bytes >= plan.predicted_capture_bytes.max(plan.footprint_bytes));
    assert_eq!(usage(&mut c).await.devices[0].planned_bytes, resp.reserved_bytes);
    // Alone on the node, the plan ran on every core (each plan gets its share of them).
    let cores = graphpool::config::node_cores();
    let planned = planned_lines(&d);
    assert_eq!(planned.len(), 1, "{planned:?}");
    assert_eq!(planned[0]["threads"], cores, "{planned:?}");
}

/// `plan_cores` bounds the cores the daemon's plans use: a plan alone runs on all of them,
/// not on every core of the node.
#[tokio::test]
async fn plans_run_on_the_cores_the_config_gives_them() {
    let d = start("log_format = \"json\"\nplan_cores = 1");
    let mut c = d.clients().await;
    let s = attach(&mut c, "planner", 0, "").await.unwrap();
    let request = pb::PlanCaptureRequest {
        session_id: s.id,
        input: Some(one_f_one_b_plan(8)),
        reserve: false,
        summary_only: true,
    };
    c.graphpool.plan_capture(request).await.unwrap();
    let planned = planned_lines(&d);
    assert_eq!(planned.len(), 1, "{planned:?}");
    assert_eq!(planned[0]["threads"], 1, "{planned:?}");
}

/// More plan cores than the daemon may use is taken as given, with a warning that names the
/// cores there are.
#[tokio::test]
async fn more_plan_cores_than_the_node_has_are_warned_of() {
    let warned = |d: &Daemon| {
        d.json_log().iter().any(|v| {
            v["level"] == "WARN" && v["message"].as_str().is_some_and(|m| m.contains("plan_cores is"))
        })
    };
    let d = start("log_format = \"json\"\nplan_cores = 100000");
    d.clients().await;
    assert!(warned(&d), "{}", d.log());
    let d = start("log_format = \"json\"\nplan_cores = 1");
    d.clients().await;
    assert!(!warned(&d), "{}", d.log());
}

/// Whether the session's Attach stream is still open: no event and no end within 300 ms.
async fn stream_open(s: &mut Session) -> bool {
    tokio::time::timeout(Duration::from_millis(300), s.events.message()).await.is_err()
}

/// A request field that an error message would echo cannot make the error too large for the
/// client's HTTP/2 limits: that closed the whole connection, and with it the Attach stream of
/// another session on it (its grants were released). Each answer names the field instead,
/// and the session on the same connection keeps its grant.
#[tokio::test]
async fn a_long_name_in_a_request_is_refused_without_breaking_the_connection() {
    let d = start("");
    let mut c = d.clients().await;
    let mut s = attach(&mut c, "j", 0, "").await.unwrap();
    allocate(&mut c, &s, 2 * MIB).await.unwrap();
    let long = "x".repeat(20_000);

    let e = attach(&mut c, "j", 1, &long).await.err().unwrap();
    assert_eq!((e.code(), field(&e).as_str()), (Code::InvalidArgument, "device"), "{e:?}");
    let held =
        pb::HeldGrant { grant_id: 7, device_uuid: long.clone(), size_bytes: 2 * MIB, label: String::new() };
    let req = pb::AttachRequest { job_id: "j".into(), resume: vec![held], ..Default::default() };
    let e = attach_req(&mut c, req).await.err().unwrap();
    assert_eq!((e.code(), field(&e).as_str()), (Code::InvalidArgument, "resume[0].device_uuid"), "{e:?}");
    let limits = pb::SetLimitsRequest {
        devices: vec![pb::DeviceLimit { device_uuid: long.clone(), device_index: 0, budget_bytes: MIB }],
        ..Default::default()
    };
    let e = c.admin.set_limits(limits).await.unwrap_err();
    assert_eq!((e.code(), field(&e).as_str()), (Code::InvalidArgument, "devices[0].device_uuid"), "{e:?}");

    // The planner's own messages echo what they refuse (here a dtype): cut to a bounded size,
    // with the start and the advice at the end kept.
    let mut plan = one_f_one_b_plan(4);
    let Some(pb::plan_input::Input::Schedule(sched)) = plan.input.as_mut() else { unreachable!() };
    sched.layers[0].inputs[0].dtype = long.clone();
    let req = pb::PlanCaptureRequest { session_id: s.id, input: Some(plan), ..Default::default() };
    let e = c.graphpool.plan_capture(req).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(field(&e).ends_with(".dtype"), "{e:?}");
    assert!(e.message().len() < 2048 && e.message().contains("unknown dtype"), "{}", e.message());

    assert!(stream_open(&mut s).await, "the session's stream was closed");
    assert_eq!(granted_total(&mut c).await, 2 * MIB);
}

/// A restart declaration of grant id 0 ("not set" in every other request) is refused: adopted,
/// it could never be released, since ReleaseSegment refuses grant_id 0.
#[tokio::test]
async fn a_declared_grant_without_an_id_is_refused() {
    let d = start("");
    let mut c = d.clients().await;
    let held =
        pb::HeldGrant { grant_id: 0, device_uuid: String::new(), size_bytes: 2 * MIB, label: String::new() };
    let req = pb::AttachRequest { job_id: "j".into(), resume: vec![held], ..Default::default() };
    let e = attach_req(&mut c, req).await.err().unwrap();
    assert_eq!((e.code(), field(&e).as_str()), (Code::InvalidArgument, "resume[0].grant_id"), "{e:?}");
    assert_eq!(granted_total(&mut c).await, 0);
    assert!(c.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap().into_inner().sessions.is_empty());
}

/// A socket path that names a file other than a socket is refused, and the file is left as it
/// was: only a stale socket is replaced (the daemon had deleted whatever file was there).
#[test]
fn a_socket_path_naming_another_file_is_refused_and_the_file_kept() {
    let dir = tempfile::Builder::new().prefix("gp").tempdir_in("/tmp").unwrap();
    for which in ["socket", "fd_socket"] {
        let (socket, fd_socket) = (dir.path().join("g.sock"), dir.path().join("g-fd.sock"));
        let victim = if which == "socket" { &socket } else { &fd_socket };
        std::fs::write(victim, "precious\n").unwrap();
        let config = dir.path().join("graphpoold.toml");
        std::fs::write(
            &config,
            format!(
                "socket = \"{}\"\nfd_socket = \"{}\"\nbackend = \"host\"\nmetrics_listen = \"off\"\n",
                socket.display(),
                fd_socket.display()
            ),
        )
        .unwrap();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_graphpoold"))
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let Some(status) = child.try_wait().unwrap() else {
            let _ = child.kill();
            panic!("graphpoold kept running with a regular file at its {which} path");
        };
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(!status.success(), "{which}: {err}");
        assert!(err.contains("is not a socket"), "{which}: {err}");
        assert_eq!(std::fs::read_to_string(victim).unwrap(), "precious\n", "{which}");
        for p in [&socket, &fd_socket] {
            let _ = std::fs::remove_file(p);
        }
    }
}
