//! Reliability: the real `graphpoold` (host backend) under faults. A SIGKILLed and restarted
//! daemon, SIGKILLed ranks, foreign processes and uids, recycled memory, structured logs, and
//! the guards that keep one client from exhausting the daemon.
//!
//! Child processes re-run this test binary with one test selected (see `child_test`); the
//! `child_*` tests do nothing unless their environment variables are set.

mod common;
#[path = "common/faults.rs"]
mod faults;

use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use faults::*;
use graphpool::client::{ClientError, FdConnection, connect, error_detail};
use graphpool::server::{CALLS_PER_CONNECTION, STREAMS_PER_CONNECTION};
use graphpool_proto::v1 as pb;
use tonic::Code;
use tonic::codegen::{Bytes, http};

const MIB: u64 = 1 << 20;

fn socket_paths(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    (dir.join("g.sock"), dir.join("graphpool-fd.sock"))
}

fn capacity(status: &tonic::Status) -> pb::CapacityRefusal {
    match error_detail(status).and_then(|d| d.detail) {
        Some(pb::error_detail::Detail::Capacity(c)) => c,
        other => panic!("expected a capacity refusal, got {other:?} for {status:?}"),
    }
}

async fn release(c: &mut graphpool::client::Clients, session: u64, grant: u64) -> Result<u64, tonic::Status> {
    let r = c
        .graphpool
        .release_segment(pb::ReleaseSegmentRequest { session_id: session, grant_id: grant })
        .await?;
    Ok(r.into_inner().bytes_released)
}

/// Waits (bounded) for a line containing `marker` on the child's stdout.
fn wait_for_line(child: &mut std::process::Child, marker: &'static str, limit: Duration) -> bool {
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            if l.contains(marker) {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(limit).is_ok()
}

// ---- 1. daemon restart -------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_restart_keeps_mappings_and_rebuilds_the_ledger() {
    let dir = tempfile::Builder::new().prefix("gpr").tempdir_in("/tmp").unwrap();
    let config = write_config(dir.path(), "");
    let (socket, fd_socket) = socket_paths(dir.path());
    let log = dir.path().join("daemon.log");
    let m1 = free_addr();
    let mut d1 = DaemonProc::spawn(&config, Some(m1), &log);
    d1.wait_ready(&socket, &fd_socket);

    let mut c = connect(&socket).await.unwrap();
    let req = pb::AttachRequest {
        job_id: "resume".into(),
        rank: 2,
        local_rank: 1,
        device: "1".into(),
        client: "reliability".into(),
        ..Default::default()
    };
    let s = attach_req(&mut c, req.clone()).await.unwrap();
    let mut grants = Vec::new();
    let mut maps = Vec::new();
    let mut conn = FdConnection::connect(&fd_socket).unwrap();
    for (i, size) in [2 * MIB, 6 * MIB, 10 * MIB].into_iter().enumerate() {
        let r = pb::AllocateSegmentRequest { session_id: s.id, size_bytes: size, label: format!("pool-{i}") };
        let g = c.graphpool.allocate_segment(r).await.unwrap().into_inner();
        let (fd, resp) = conn.fetch(s.id, g.grant_id).unwrap();
        let mut m = Mapping::new(&fd, resp.size_bytes as usize);
        m.bytes().fill(i as u8 + 1);
        grants.push(g);
        maps.push((fd, m));
    }
    let names = [
        "graphpool_device_granted_bytes",
        "graphpool_device_free_bytes",
        "graphpool_grants",
        "graphpool_job_granted_bytes",
        "graphpool_rank_granted_bytes",
        "graphpool_sessions",
    ];
    let usage_before = usage(&mut c).await;
    let metrics_before = metric_lines(&scrape(m1).await, &names);
    assert!(
        metrics_before
            .iter()
            .any(|l| l.starts_with("graphpool_rank_granted_bytes{") && l.contains("\"resume\"")),
        "{metrics_before:#?}\n{}",
        scrape(m1).await
    );
    let instance_before = s.attached.daemon_instance.clone();

    d1.kill9();
    drop(s);
    // The rank keeps computing on its mappings while no daemon runs.
    for (i, (_, m)) in maps.iter_mut().enumerate() {
        assert!(m.bytes().iter().all(|b| *b == i as u8 + 1), "mapping {i} changed after the daemon died");
        m.bytes().fill(0x40 + i as u8);
        assert!(m.bytes().iter().all(|b| *b == 0x40 + i as u8));
    }

    // Restart on the same socket; the client re-attaches and declares what it holds.
    let m2 = free_addr();
    let d2 = DaemonProc::spawn(&config, Some(m2), &log);
    let ready = d2.wait_ready(&socket, &fd_socket);
    let mut c = connect(&socket).await.unwrap();
    let resume = grants
        .iter()
        .map(|g| pb::HeldGrant {
            grant_id: g.grant_id,
            device_uuid: g.device_uuid.clone(),
            size_bytes: g.size_bytes,
            label: g.label.clone(),
        })
        .collect();
    let s2 = attach_req(&mut c, pb::AttachRequest { resume, ..req }).await.unwrap();
    let rebuilt = d2.started.elapsed();
    eprintln!("RESTART-RECOVERY daemon ready {ready:?}, ledger rebuilt {rebuilt:?} after spawn");
    assert!(rebuilt < Duration::from_secs(5), "recovery took {rebuilt:?}");
    assert_ne!(s2.attached.daemon_instance, instance_before);
    let adopted: Vec<u64> = s2.attached.adopted.iter().map(|g| g.grant_id).collect();
    assert_eq!(adopted, grants.iter().map(|g| g.grant_id).collect::<Vec<_>>());
    assert!(s2.attached.adopted.iter().all(|g| g.adopted && g.session_id == s2.id));
    assert_eq!(usage(&mut c).await, usage_before, "usage equals the value before the kill");
    assert_eq!(metric_lines(&scrape(m2).await, &names), metrics_before, "metrics equal the values before");

    // Adopted grants are accounted but have no fd.
    let mut conn = FdConnection::connect(&fd_socket).unwrap();
    match conn.fetch(s2.id, grants[0].grant_id) {
        Err(ClientError::FdRefused { code: 9, .. }) => {}
        other => panic!("an adopted grant must have no fd: {other:?}"),
    }

    // Declarations the daemon cannot verify: a session that never held the memory declares a
    // grant id that never existed, and one that another session already declared.
    let liar = attach_req(
        &mut c,
        pb::AttachRequest {
            job_id: "liar".into(),
            device: "1".into(),
            resume: vec![
                pb::HeldGrant { grant_id: 0xdead_beef, size_bytes: 64 * MIB, ..Default::default() },
                pb::HeldGrant { grant_id: grants[0].grant_id, size_bytes: 2 * MIB, ..Default::default() },
            ],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(liar.attached.adopted.len(), 1, "an id already held by another session is not adopted twice");
    let dev1 = |u: &pb::Usage| u.devices[1].granted_bytes;
    assert_eq!(dev1(&usage(&mut c).await), dev1(&usage_before) + 64 * MIB, "charged to the declarer");
    assert_eq!(release(&mut c, liar.id, 0xdead_beef).await.unwrap(), 64 * MIB);
    assert_eq!(usage(&mut c).await.devices, usage_before.devices);
    // Another session cannot release what it did not declare.
    let e = release(&mut c, liar.id, grants[0].grant_id).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);

    // Releasing the adopted grants empties the ledger; the mappings stay valid (the client
    // unmaps on its own schedule).
    for g in &grants {
        assert_eq!(release(&mut c, s2.id, g.grant_id).await.unwrap(), g.size_bytes);
    }
    assert_eq!(granted_total(&mut c).await, 0);
    maps[2].1.bytes()[0] = 9;
    assert_eq!(maps[2].1.bytes()[0], 9);
}

// ---- 2. rank faults ----------------------------------------------------------------------

/// Child side of `sigkilled_ranks_leave_exactly_the_survivors_grants`: churns sessions,
/// allocations, fd fetches, plans and releases as fast as it can until it is killed.
#[test]
fn child_churn() {
    let Ok(socket) = std::env::var("GP_CHURN_SOCKET") else { return };
    let rank: u32 = child_arg("GP_CHURN_RANK");
    let fd_socket = child_arg::<String>("GP_CHURN_FD_SOCKET");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = connect(Path::new(&socket)).await.unwrap();
        let mut conn = FdConnection::connect(Path::new(&fd_socket)).unwrap();
        let mut rng = Rng(u64::from(rank) * 7919 + 17);
        let mut ready = false;
        for round in 0u64.. {
            let s = attach(&mut c, "churn", rank, &(round % 2).to_string()).await.unwrap();
            let mut held = Vec::new();
            for n in 0..40u64 {
                let size = MIB * (1 + rng.below(8));
                let Ok(g) = allocate(&mut c, &s, size).await else { continue };
                if let Ok((fd, _)) = conn.fetch(s.id, g.grant_id) {
                    drop(fd);
                }
                if n % 9 == 0 {
                    let plan = pb::PlanCaptureRequest {
                        session_id: s.id,
                        input: Some(small_plan()),
                        reserve: true,
                        ..Default::default()
                    };
                    let _ = c.graphpool.plan_capture(plan).await;
                }
                held.push(g.grant_id);
                if held.len() > 2 || rng.below(2) == 0 {
                    let id = held.remove(0);
                    release(&mut c, s.id, id).await.unwrap();
                }
                if !ready {
                    println!("READY");
                    ready = true;
                }
            }
            drop(s);
        }
    });
}

fn small_plan() -> pb::PlanInput {
    let b = |name: &str, start, end, size| pb::BufferSpec {
        name: name.into(),
        start,
        end,
        size_bytes: size,
        ..Default::default()
    };
    pb::PlanInput {
        input: Some(pb::plan_input::Input::Buffers(pb::BufferList {
            buffers: vec![b("a", 0, 2, 2 * MIB), b("b", 1, 3, 4 * MIB), b("c", 2, 4, 2 * MIB)],
        })),
        time_budget_ms: 5,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_ranks_leave_exactly_the_survivors_grants() {
    let d = start("");
    let mut c = d.clients().await;
    let survivor = attach(&mut c, "survivor", 0, "0").await.unwrap();
    let survivor1 = attach(&mut c, "survivor", 1, "1").await.unwrap();
    for size in [4 * MIB, 8 * MIB] {
        allocate(&mut c, &survivor, size).await.unwrap();
    }
    allocate(&mut c, &survivor1, 6 * MIB).await.unwrap();
    let expected = usage(&mut c).await;
    let sessions = |st: pb::Status| st.sessions.iter().map(|s| s.session_id).collect::<Vec<_>>();
    let expected_sessions =
        sessions(c.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap().into_inner());
    // Warm the daemon's fds (fd socket connections, memfds) before taking the baseline.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let baseline_fds = d.open_fds();

    let seed = seed();
    eprintln!("seed {seed} (GP_SEED={seed} replays the kill moments)");
    let mut rng = Rng(seed);
    let mut worst = Duration::ZERO;
    let (ranks, rounds) = (4u32, 3u32);
    for round in 0..rounds {
        let mut children = Vec::new();
        for r in 0..ranks {
            let env = [
                ("GP_CHURN_SOCKET", d.socket.display().to_string()),
                ("GP_CHURN_FD_SOCKET", d.fd_socket.display().to_string()),
                ("GP_CHURN_RANK", (round * ranks + r).to_string()),
            ];
            let child = child_test("child_churn", &env).stdout(Stdio::piped()).spawn().unwrap();
            children.push(Killed(child));
        }
        for k in &mut children {
            assert!(wait_for_line(&mut k.0, "READY", Duration::from_secs(20)), "churn child never got going");
        }
        // Kill each at a random moment of its loop: mid-attach, -allocation, -fetch, -plan, -release.
        for k in &mut children {
            tokio::time::sleep(Duration::from_millis(rng.below(60))).await;
            k.kill9();
        }
        let c2 = c.clone();
        let took = wait_until(Duration::from_secs(1), || {
            let (mut c, expected, expected_sessions) =
                (c2.clone(), expected.clone(), expected_sessions.clone());
            async move {
                let st = c.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap().into_inner();
                usage(&mut c).await == expected && sessions(st) == expected_sessions
            }
        })
        .await;
        let Some(took) = took else {
            panic!(
                "round {round}: ledger is not the survivor's within 1 s: {:?}\n{}",
                usage(&mut c).await,
                d.log()
            )
        };
        worst = worst.max(took);
    }
    eprintln!("RECLAIM {} SIGKILLed churning ranks, worst reclaim {worst:?}", ranks * rounds);
    let back = wait_until(Duration::from_secs(3), || async { d.open_fds() <= baseline_fds }).await;
    assert!(back.is_some(), "daemon fds {} > baseline {baseline_fds}", d.open_fds());
    // The survivor was never disturbed.
    assert_eq!(usage(&mut c).await, expected);
    allocate(&mut c, &survivor, 2 * MIB).await.unwrap();
}

// ---- 3. isolation ------------------------------------------------------------------------

/// Child side of `foreign_processes_never_get_the_fd`: tries every way to the owner's fd.
#[test]
fn child_foreign() {
    let Ok(socket) = std::env::var("GP_FOREIGN_SOCKET") else { return };
    if std::env::var("GP_FOREIGN_SETUID").is_ok() {
        become_nobody();
    }
    let fd_socket = child_arg::<String>("GP_FOREIGN_FD_SOCKET");
    let session: u64 = child_arg("GP_FOREIGN_SESSION");
    let grant: u64 = child_arg("GP_FOREIGN_GRANT");
    let mut conn = FdConnection::connect(Path::new(&fd_socket)).unwrap();
    match conn.fetch(session, grant) {
        Err(ClientError::FdRefused { code: 7, .. }) => {}
        other => panic!("a foreign process got {other:?}"),
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = connect(Path::new(&socket)).await.unwrap();
        // Its own session does not open the owner's grant either.
        let own = attach(&mut c, "foreign", 0, "").await.unwrap();
        match conn.fetch(own.id, grant) {
            Err(ClientError::FdRefused { code: 7, .. }) => {}
            other => panic!("a foreign session got {other:?}"),
        }
        let e = release(&mut c, session, grant).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        let e = release(&mut c, own.id, grant).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        let e = c.graphpool.detach(pb::DetachRequest { session_id: session }).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    });
    println!("FOREIGN-OK");
}

#[tokio::test]
async fn foreign_processes_never_get_the_fd() {
    let d = start("socket_mode = \"0666\"");
    std::fs::set_permissions(d.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut c = d.clients().await;
    let s = attach(&mut c, "owner", 0, "").await.unwrap();
    let g = allocate(&mut c, &s, 4 * MIB).await.unwrap();
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let mut modes = vec![false];
    if root {
        modes.push(true);
    } else {
        eprintln!("other-uid case skipped: needs root to setuid in the child");
    }
    for setuid in modes {
        let mut env = vec![
            ("GP_FOREIGN_SOCKET", d.socket.display().to_string()),
            ("GP_FOREIGN_FD_SOCKET", d.fd_socket.display().to_string()),
            ("GP_FOREIGN_SESSION", s.id.to_string()),
            ("GP_FOREIGN_GRANT", g.grant_id.to_string()),
        ];
        if setuid {
            env.push(("GP_FOREIGN_SETUID", "1".into()));
        }
        let out = child_test("child_foreign", &env).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("FOREIGN-OK"),
            "setuid={setuid}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The owner still gets it, and holds it alone.
    let (fd, _) = d.fd_conn().fetch(s.id, g.grant_id).unwrap();
    drop(fd);
    // The foreign children's sessions end as the daemon sees their processes go (at once, or
    // a moment later on a busy machine).
    let jobs = |c: &mut graphpool::client::Clients| {
        let mut c = c.clone();
        async move { usage(&mut c).await.jobs.into_iter().map(|j| j.job_id).collect::<Vec<_>>() }
    };
    let alone = wait_until(Duration::from_secs(5), || {
        let jobs = jobs(&mut c);
        async move { jobs.await == ["owner"] }
    })
    .await;
    assert!(alone.is_some(), "jobs left: {:?}", jobs(&mut c).await);
}

fn inode(fd: &OwnedFd) -> u64 {
    // SAFETY: fstat of a valid fd into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
    st.st_ino
}

#[tokio::test]
async fn released_memory_is_never_handed_to_another_session() {
    let d = start("");
    let mut c = d.clients().await;
    let a = attach(&mut c, "first", 0, "").await.unwrap();
    let mut old = Vec::new();
    for _ in 0..3 {
        let g = allocate(&mut c, &a, 8 * MIB).await.unwrap();
        let (fd, r) = d.fd_conn().fetch(a.id, g.grant_id).unwrap();
        let mut m = Mapping::new(&fd, r.size_bytes as usize);
        m.bytes().fill(0xa5);
        release(&mut c, a.id, g.grant_id).await.unwrap();
        old.push((fd, m));
    }
    drop(a);
    let b = attach(&mut c, "second", 0, "").await.unwrap();
    for _ in 0..6 {
        let g = allocate(&mut c, &b, 8 * MIB).await.unwrap();
        let (fd, r) = d.fd_conn().fetch(b.id, g.grant_id).unwrap();
        assert!(old.iter().all(|(o, _)| inode(o) != inode(&fd)), "a released segment was handed out again");
        let mut m = Mapping::new(&fd, r.size_bytes as usize);
        assert!(m.bytes().iter().all(|x| *x == 0), "new memory of another session is not zero");
        m.bytes().fill(0x11);
    }
    for (_, m) in &mut old {
        assert!(m.bytes().iter().all(|x| *x == 0xa5), "the first session's memory was reused");
    }
}

/// Child side of the log test: asks for a grant's fd it does not own.
#[test]
fn child_fetch_foreign_fd() {
    let Ok(fd_socket) = std::env::var("GP_LOGCHILD_FD_SOCKET") else { return };
    let session: u64 = child_arg("GP_LOGCHILD_SESSION");
    let grant: u64 = child_arg("GP_LOGCHILD_GRANT");
    let mut conn = FdConnection::connect(Path::new(&fd_socket)).unwrap();
    assert!(matches!(conn.fetch(session, grant), Err(ClientError::FdRefused { code: 7, .. })));
    println!("LOGCHILD-OK");
}

#[tokio::test]
async fn each_grant_and_refusal_leaves_one_structured_log_line() {
    let dir = tempfile::Builder::new().prefix("gpl").tempdir_in("/tmp").unwrap();
    let extra = "[guards]\nmax_grants_per_session = 3\nmax_sessions_per_uid = 2\n\
                 [limits]\ndefault_rank_quota = \"16MiB\"";
    let config = write_config(dir.path(), extra);
    let (socket, fd_socket) = socket_paths(dir.path());
    let log = dir.path().join("daemon.log");
    let d = DaemonProc::spawn(&config, None, &log);
    d.wait_ready(&socket, &fd_socket);
    let mut c = connect(&socket).await.unwrap();
    let s = attach(&mut c, "logjob", 7, "").await.unwrap();
    let mut granted = Vec::new();
    for size in [4 * MIB, 4 * MIB, 6 * MIB] {
        granted.push(allocate(&mut c, &s, size).await.unwrap());
    }
    // Refusal 1: grants per session.
    assert_eq!(capacity(&allocate(&mut c, &s, 2 * MIB).await.unwrap_err()).limit, "session-grants");
    release(&mut c, s.id, granted[0].grant_id).await.unwrap();
    // Refusal 2: rank quota (10 MiB held + 8 MiB > 16 MiB).
    assert_eq!(capacity(&allocate(&mut c, &s, 8 * MIB).await.unwrap_err()).limit, "rank-quota");
    granted.push(allocate(&mut c, &s, 2 * MIB).await.unwrap());
    // A malformed request is neither a grant nor a refusal.
    assert_eq!(allocate(&mut c, &s, 0).await.unwrap_err().code(), Code::InvalidArgument);
    // Refusal 3: sessions per uid (the second fits, the third does not).
    let _s2 = attach(&mut c, "logjob", 8, "").await.unwrap();
    let e = attach(&mut c, "logjob", 9, "").await.err().unwrap();
    assert_eq!(e.code(), Code::ResourceExhausted);
    // Refusal 4: an fd asked for by a process that does not own the grant.
    let out = child_test(
        "child_fetch_foreign_fd",
        &[
            ("GP_LOGCHILD_FD_SOCKET", fd_socket.display().to_string()),
            ("GP_LOGCHILD_SESSION", s.id.to_string()),
            ("GP_LOGCHILD_GRANT", granted[1].grant_id.to_string()),
        ],
    )
    .output()
    .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("LOGCHILD-OK"), "{out:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let lines = json_lines(&log);
    let grants = with_message(&lines, "granted");
    assert_eq!(grants.len(), granted.len(), "one line per grant:\n{grants:#?}");
    for (line, g) in grants.iter().zip(&granted) {
        let f = line;
        assert_eq!(line["level"], "INFO");
        assert_eq!(f["grant"], g.grant_id);
        assert_eq!(f["session"], s.id);
        assert_eq!(f["job"], "logjob");
        assert_eq!(f["rank"], 7);
        assert_eq!(f["pid"], std::process::id());
        assert_eq!(f["bytes"], g.size_bytes);
        assert_eq!(f["requested"], g.requested_bytes);
        assert_eq!(f["device"], 0);
        assert_eq!(f["label"], "test");
    }
    let refused = with_message(&lines, "refused");
    let limits: Vec<&str> = refused.iter().map(|l| l["limit"].as_str().unwrap_or("")).collect();
    assert_eq!(limits, ["session-grants", "rank-quota", "sessions-per-uid"], "{refused:#?}");
    for line in &refused {
        let f = line;
        assert_eq!(line["level"], "WARN");
        assert!(f["who"].as_str().unwrap().starts_with("logjob"), "who: {line}");
    }
    assert_eq!(refused[0]["requested"], 2 * MIB);
    assert_eq!((&refused[1]["requested"], &refused[1]["free"]), (&(8 * MIB).into(), &(6 * MIB).into()));
    for line in &refused[..2] {
        assert!(line["limit_bytes"].is_u64() && line["device"].is_u64(), "limit_bytes, device: {line}");
    }
    assert_eq!(refused[2]["uid"], unsafe { libc::geteuid() });
    assert!(refused[2]["limit_sessions"].is_u64(), "limit_sessions: {}", refused[2]);
    let fd_refused = with_message(&lines, "fd request refused: the peer does not own the grant");
    assert_eq!(fd_refused.len(), 1, "{fd_refused:#?}");
    assert_eq!(fd_refused[0]["grant"], granted[1].grant_id);
    assert_ne!(fd_refused[0]["pid"], std::process::id());
    drop(d);
}

// ---- 4. guards ---------------------------------------------------------------------------

/// Child side of the guard test: another uid is not limited by root's sessions.
#[test]
fn child_other_uid_attaches() {
    let Ok(socket) = std::env::var("GP_GUARD_SOCKET") else { return };
    become_nobody();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = connect(Path::new(&socket)).await.unwrap();
        let s = attach(&mut c, "nobody", 0, "").await.unwrap();
        allocate(&mut c, &s, 2 * MIB).await.unwrap();
    });
    println!("OTHER-UID-OK");
}

#[tokio::test]
async fn sessions_per_uid_and_grants_per_session_are_bounded() {
    let d = start("socket_mode = \"0666\"\n[guards]\nmax_sessions_per_uid = 3\nmax_grants_per_session = 4");
    std::fs::set_permissions(d.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut c = d.clients().await;
    let mut sessions = Vec::new();
    for r in 0..3 {
        sessions.push(attach(&mut c, "guarded", r, "").await.unwrap());
    }
    let e = attach(&mut c, "guarded", 3, "").await.err().unwrap();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("max_sessions_per_uid"), "{e:?}");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let out =
            child_test("child_other_uid_attaches", &[("GP_GUARD_SOCKET", d.socket.display().to_string())])
                .output()
                .unwrap();
        assert!(String::from_utf8_lossy(&out.stdout).contains("OTHER-UID-OK"), "{out:?}");
    }
    // A session that ends frees its slot.
    drop(sessions.pop());
    let again = wait_until(Duration::from_secs(1), || {
        let mut c = c.clone();
        async move { attach(&mut c, "guarded", 3, "").await.map(sessions_keep).is_ok() }
    })
    .await;
    assert!(again.is_some(), "a freed session slot was not reusable within 1 s");

    let s = &sessions[0];
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(allocate(&mut c, s, MIB).await.unwrap());
    }
    let e = allocate(&mut c, s, MIB).await.unwrap_err();
    let r = capacity(&e);
    assert_eq!((r.limit.as_str(), r.limit_bytes), ("session-grants", 4));
    // Another session of the same uid has its own count.
    allocate(&mut c, &sessions[1], MIB).await.unwrap();
    release(&mut c, s.id, held[0].grant_id).await.unwrap();
    allocate(&mut c, s, MIB).await.unwrap();
    // Declarations after a restart count too: more than the limit are refused whole.
    let resume = (0..5)
        .map(|i| pb::HeldGrant { grant_id: 1000 + i, size_bytes: 2 * MIB, ..Default::default() })
        .collect();
    let _ = sessions.pop();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let e = attach_req(&mut c, pb::AttachRequest { job_id: "guarded".into(), resume, ..Default::default() })
        .await
        .err()
        .expect("5 declarations with max_grants_per_session = 4");
    assert_eq!(capacity(&e).limit, "session-grants", "{e:?}");
}

/// Child side of the connection-cap test: another uid is not limited by root's connections.
#[test]
fn child_other_uid_connects() {
    let Ok(socket) = std::env::var("GP_CONN_CAP_SOCKET") else { return };
    become_nobody();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = connect(Path::new(&socket)).await.unwrap();
        c.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap();
    });
    println!("OTHER-UID-CONNECTED");
}

/// Whether a new gRPC client gets an answer from the daemon at `socket`.
async fn grpc_answers(socket: &Path) -> bool {
    let call = async {
        let mut c = connect(socket).await.ok()?;
        c.graphpool.get_status(pb::GetStatusRequest {}).await.ok()
    };
    matches!(tokio::time::timeout(Duration::from_secs(5), call).await, Ok(Some(_)))
}

#[tokio::test]
async fn grpc_connections_per_uid_are_capped_at_accept() {
    // One session per uid: four gRPC connections at once (the fd socket counts its own).
    let d = start_with("socket_mode = \"0666\"\n[guards]\nmax_sessions_per_uid = 1", true);
    std::fs::set_permissions(d.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // The start-up probe's connections are gone before the count matters.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut c = d.clients().await;
        c.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap();
        held.push(c);
    }
    // The fifth is closed at accept, before anything of it is read; a client gets no answer.
    let mut fifth = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
    assert!(closed_within(&mut fifth, Duration::from_secs(5)), "a fifth connection of one uid is closed");
    assert!(!grpc_answers(&d.socket).await, "a fifth gRPC client was served");
    // The first four keep working: a session attaches on one and uses the fd socket.
    for c in &mut held {
        c.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap();
    }
    let s = attach(&mut held[0], "conn-cap", 0, "").await.unwrap();
    let mut fd = d.fd_conn();
    let (g, _fd) = fd
        .allocate(pb::AllocateSegmentRequest { session_id: s.id, size_bytes: MIB, label: String::new() })
        .unwrap();
    fd.release(s.id, g.grant_id).unwrap();
    // Logged (with uid and cap) and counted per transport.
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let log = d.log();
    assert!(
        log.contains(&format!("gRPC connection refused: uid {uid} already holds 4 connections")),
        "{log}"
    );
    assert!(log.contains("limit=4"), "{log}");
    let m = d.metrics_text().await;
    let refused = metric_value(&m, "graphpool_connections_refused_total{transport=\"grpc\"}");
    assert!(refused.is_some_and(|n| n >= 2.0), "{m}");
    assert_eq!(metric_value(&m, "graphpool_connections_refused_total{transport=\"fd-socket\"}"), Some(0.0));
    // Another uid has its own count.
    if uid == 0 {
        run_child(
            "child_other_uid_connects",
            &[("GP_CONN_CAP_SOCKET", d.socket.display().to_string())],
            &["OTHER-UID-CONNECTED"],
        );
    }
    // A closed connection frees its place (the session's connection is kept).
    drop(held.pop());
    let t = std::time::Instant::now();
    let mut again = None;
    while again.is_none() && t.elapsed() < Duration::from_secs(2) {
        let call = async {
            let mut c = connect(&d.socket).await.ok()?;
            c.graphpool.get_status(pb::GetStatusRequest {}).await.ok()?;
            Some(c)
        };
        again = tokio::time::timeout(Duration::from_secs(1), call).await.ok().flatten();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(again.is_some(), "a closed connection's place was not freed within 2 s");
    assert!(!grpc_answers(&d.socket).await, "the cap holds again with four connections open");
    drop(s);
}

/// An HTTP/2 connection to the gRPC socket made with `h2` directly, with windows large
/// enough that only the daemon's limits hold back what it sends.
async fn raw_h2(socket: &Path) -> h2::client::SendRequest<Bytes> {
    let io = tokio::net::UnixStream::connect(socket).await.unwrap();
    let (client, conn) = h2::client::Builder::new()
        .initial_window_size(1 << 30)
        .initial_connection_window_size(1 << 30)
        .handshake(io)
        .await
        .unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client.ready().await.unwrap()
}

/// A gRPC call's request headers.
fn grpc_post(path: &str) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!("http://graphpoold{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// Resident memory of process `pid`.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kib << 10
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_grpc_connection_gets_a_bounded_number_of_streams_and_calls() {
    let d = start("");
    // A client's long-lived Attach streams hold none of its connection's call places: more
    // sessions than there are places on one connection, and its unary calls are still served.
    let mut c = d.clients().await;
    let mut sessions = Vec::new();
    for rank in 0..CALLS_PER_CONNECTION as u32 + 4 {
        sessions.push(attach(&mut c, "streams", rank, "").await.unwrap());
    }
    for s in &sessions {
        allocate(&mut c, s, 2 * MIB).await.unwrap();
    }
    assert_eq!(granted_total(&mut c).await, 2 * MIB * sessions.len() as u64);

    // The daemon announces its stream limit (seen by the client once a call has completed).
    let mut h2c = raw_h2(&d.socket).await;
    let (resp, mut body) = h2c.send_request(grpc_post("/graphpool.v1.Graphpool/GetStatus"), false).unwrap();
    body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true).unwrap();
    let resp = resp.await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut resp = resp.into_body();
    while resp.data().await.is_some() {}
    let trailers = resp.trailers().await.unwrap().unwrap();
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(h2c.current_max_send_streams(), STREAMS_PER_CONNECTION as usize);

    // One stream per place, each with most of a message just under the 16 MiB limit, never
    // finished: the daemon reads only the calls it serves at once, so it holds a few of
    // them, not all (unbounded, this is STREAMS_PER_CONNECTION × 16 MiB = 2 GiB).
    let pid = d.pid();
    let base = rss_bytes(pid);
    let declared = (16 << 20) - 16;
    let mut prefix = vec![0u8];
    prefix.extend_from_slice(&(declared as u32).to_be_bytes());
    let (prefix, most) = (Bytes::from(prefix), Bytes::from(vec![0u8; declared - 4096]));
    let mut held = Vec::new();
    for _ in 0..STREAMS_PER_CONNECTION {
        h2c = h2c.ready().await.unwrap();
        let (resp, mut body) =
            h2c.send_request(grpc_post("/graphpool.v1.Graphpool/GetStatus"), false).unwrap();
        body.send_data(prefix.clone(), false).unwrap();
        body.send_data(most.clone(), false).unwrap();
        held.push((resp, body));
    }
    let message = declared as u64;
    let calls = CALLS_PER_CONNECTION as u64;
    let reading = wait_until(Duration::from_secs(30), || async {
        rss_bytes(pid).saturating_sub(base) >= (calls - 1) * message
    })
    .await;
    assert!(
        reading.is_some(),
        "the daemon did not read the calls it serves: +{} MiB",
        rss_bytes(pid).saturating_sub(base) >> 20
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let grown = rss_bytes(pid).saturating_sub(base);
    assert!(
        grown < calls * message + 128 * MIB,
        "one connection made the daemon hold {} MiB ({} calls at once of {} MiB)",
        grown >> 20,
        calls,
        message >> 20
    );
    // Meanwhile the daemon serves other connections: a new client, and the sessions' one.
    let answer = tokio::time::timeout(Duration::from_secs(5), async {
        let mut other = d.clients().await;
        other.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap();
        allocate(&mut c, &sessions[0], 2 * MIB).await.unwrap();
    })
    .await;
    assert!(answer.is_ok(), "the daemon stopped serving other connections");
    drop(held);
}

/// Keeps a session attached for the rest of the process (the guard test holds its slot).
fn sessions_keep(s: Session) {
    std::mem::forget(s);
}

// ---- regressions found by the fuzz targets and these tests ---------------------------------

/// A client re-attaching after a restart may declare any grant id; the daemon's next ids must
/// skip the declared ones, or a new grant would overwrite an adopted one and the ledger would
/// count memory twice.
#[test]
fn declared_grant_ids_never_collide_with_new_grants() {
    use graphpool::backend::host::HostBackend;
    use graphpool::config::{GuardsConfig, HostConfig, LimitsConfig};
    use graphpool::ledger::{AttachSpec, Declared, EndReason, Ledger, Peer};
    let backend =
        HostBackend::new(&HostConfig { devices: 1, capacity_bytes: 256 * MIB, granularity_bytes: 2 * MIB })
            .unwrap();
    let l = Ledger::new(Arc::new(backend), &LimitsConfig::default(), GuardsConfig::default()).unwrap();
    let p = Peer { pid: 1, uid: 1000, gid: 1000 };
    let q = Peer { pid: 2, uid: 1000, gid: 1000 };
    let spec = |job: &str| AttachSpec { job_id: job.into(), ..Default::default() };
    let (a, _) = l.attach(p, spec("a"), &[]).unwrap();
    let first = l.allocate(a.id, &p, 2 * MIB, "").unwrap();
    let declared: Vec<Declared> = (1..=4)
        .map(|k| Declared { grant_id: first.id + k, size_bytes: 2 * MIB, label: String::new() })
        .collect();
    let (b, adopted) = l.attach(q, spec("b"), &declared).unwrap();
    assert_eq!(adopted.len(), 4);
    for _ in 0..4 {
        let g = l.allocate(a.id, &p, 2 * MIB, "").unwrap();
        assert!(declared.iter().all(|d| d.grant_id != g.id), "new grant {} reuses a declared id", g.id);
    }
    let sum: u64 = l.grants(None, None).iter().map(|g| g.size_bytes).sum();
    assert_eq!(l.grants(None, None).len(), 9);
    assert_eq!(sum, l.devices()[0].granted_bytes);
    for d in &declared {
        l.release(b.id, &q, d.grant_id).unwrap();
    }
    l.end_session(a.id, EndReason::Detach).unwrap();
    assert!(l.grants(None, None).is_empty());
    assert_eq!(l.devices()[0].granted_bytes, 0);
}
