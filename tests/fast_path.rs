//! Integration tests of the fd socket's fast path (`FdRequest.call`: allocate and release on
//! the fd socket, the grant and its fd in one message): the real `graphpoold` binary, real
//! sockets, real fds, real child processes. The fast path must behave exactly as the gRPC
//! calls do: same checks, same errors and details, same ledger, logs and metrics.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use graphpool::client::{ClientError, Clients, FdConnection};
use graphpool_proto::v1 as pb;
use tonic::Code;

const MIB: u64 = 1 << 20;

fn alloc_req(session_id: u64, size_bytes: u64, label: &str) -> pb::AllocateSegmentRequest {
    pb::AllocateSegmentRequest { session_id, size_bytes, label: label.into() }
}

/// The code, message and detail of a fast-path refusal.
fn refused(e: ClientError) -> (Code, String, Option<pb::error_detail::Detail>) {
    match e {
        ClientError::FdRefused { code, message, detail, .. } => {
            (Code::from(code), message, detail.and_then(|d| d.detail))
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn field_of(e: ClientError) -> (Code, String) {
    match refused(e) {
        (code, _, Some(pb::error_detail::Detail::Field(f))) => (code, f.field),
        other => panic!("expected a field violation, got {other:?}"),
    }
}

/// One allocate and release over the fast path, so the daemon's own first-use fds are open
/// before a test takes its fd baseline.
async fn warm_up(d: &Daemon, c: &mut Clients) {
    let s = attach(c, "warm", 0, "").await.unwrap();
    let mut conn = d.fd_conn();
    let (g, _fd) = conn.allocate(alloc_req(s.id, MIB, "")).unwrap();
    conn.release(s.id, g.grant_id).unwrap();
}

fn own_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

#[tokio::test]
async fn allocate_and_release_on_the_fd_socket() {
    let d = start_with("", true);
    let mut c = d.clients().await;
    let s = attach(&mut c, "fast", 3, "1").await.unwrap();
    let mut conn = d.fd_conn();
    let (g, fd) = conn.allocate(alloc_req(s.id, 3 * MIB, "capture-pool")).unwrap();
    assert_eq!((g.size_bytes, g.requested_bytes), (4 * MIB, 3 * MIB), "rounded to 2 MiB");
    assert_eq!((g.session_id, g.device_index, g.rank), (s.id, 1, 3));
    assert_eq!(
        (g.handle_kind.as_str(), g.label.as_str(), g.job_id.as_str()),
        ("memfd", "capture-pool", "fast")
    );
    assert_eq!(g.pid, std::process::id());
    // The fd is the grant's memory: map it, write it, see it through a fetched fd too.
    let mut m = Mapping::new(&fd, g.size_bytes as usize);
    m.bytes()[0] = 42;
    let (fd2, r) = conn.fetch(s.id, g.grant_id).unwrap();
    assert_eq!(r.size_bytes, 4 * MIB);
    assert_eq!(Mapping::new(&fd2, 4096).bytes()[0], 42);
    // The ledger and gRPC see the grant.
    assert_eq!(granted_total(&mut c).await, 4 * MIB);
    let listed = c
        .graphpool
        .list_grants(pb::ListGrantsRequest { session_id: s.id, job_id: String::new() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.grants.len(), 1);
    assert_eq!(listed.grants[0], g);
    // Release on the fast path; a second release names the grant, as gRPC does.
    assert_eq!(conn.release(s.id, g.grant_id).unwrap().bytes_released, 4 * MIB);
    assert_eq!(granted_total(&mut c).await, 0);
    assert_eq!(field_of(conn.release(s.id, g.grant_id).unwrap_err()), (Code::NotFound, "grant_id".into()));
    // The two transports mix: a fast-path grant released over gRPC, and the other way round.
    let (g, _fd) = conn.allocate(alloc_req(s.id, MIB, "x")).unwrap();
    c.graphpool
        .release_segment(pb::ReleaseSegmentRequest { session_id: s.id, grant_id: g.grant_id })
        .await
        .unwrap();
    let g = allocate(&mut c, &s, MIB).await.unwrap();
    assert_eq!(conn.release(s.id, g.grant_id).unwrap().bytes_released, 2 * MIB);
    assert_eq!(granted_total(&mut c).await, 0);
    drop(m);

    // Counted in the same request metrics, told apart by the transport label.
    let text = d.metrics_text().await;
    let count = |method: &str, transport: &str, code: &str| -> u64 {
        text.lines()
            .find(|l| {
                l.starts_with("graphpool_requests_total{")
                    && l.contains(&format!("method=\"{method}\""))
                    && l.contains(&format!("transport=\"{transport}\""))
                    && l.contains(&format!("code=\"{code}\""))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    assert_eq!(count("AllocateSegment", "fd-socket", "OK"), 2, "{text}");
    assert_eq!(count("ReleaseSegment", "fd-socket", "OK"), 2, "{text}");
    assert_eq!(count("ReleaseSegment", "fd-socket", "NOT_FOUND"), 1, "{text}");
    assert_eq!(count("AllocateSegment", "grpc", "OK"), 1, "{text}");
    assert_eq!(count("ReleaseSegment", "grpc", "OK"), 1, "{text}");
    assert_eq!(count("FetchFd", "fd-socket", "OK"), 1, "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("graphpool_request_duration_seconds_count{")
            && l.contains("method=\"AllocateSegment\"")
            && l.contains("transport=\"fd-socket\"")),
        "{text}"
    );
    // And logged as gRPC grants are: one line per grant and per release.
    let log = d.log();
    assert_eq!(log.lines().filter(|l| l.contains("granted")).count(), 3, "{log}");
    assert_eq!(log.lines().filter(|l| l.contains("released")).count(), 3, "{log}");
}

#[tokio::test]
async fn quota_refusal_on_the_fast_path_carries_the_details() {
    let d = start("[limits]\ndefault_rank_quota = \"64MiB\"");
    let mut c = d.clients().await;
    let s = attach(&mut c, "capped", 0, "").await.unwrap();
    let mut conn = d.fd_conn();
    let (_g, _fd) = conn.allocate(alloc_req(s.id, 64 * MIB, "a")).unwrap();
    let e = conn.allocate(alloc_req(s.id, 2 * MIB, "b")).unwrap_err();
    assert!(e.to_string().contains("rank-quota"), "{e}");
    let (code, message, detail) = refused(e);
    assert_eq!(code, Code::ResourceExhausted);
    let Some(pb::error_detail::Detail::Capacity(r)) = detail else { panic!("no capacity detail") };
    assert_eq!(
        (r.limit.as_str(), r.requested_bytes, r.free_bytes, r.limit_bytes),
        ("rank-quota", 2 * MIB, 0, 64 * MIB)
    );
    assert_eq!(r.top_holders[0].job_id, "capped");
    assert_eq!(r.top_holders[0].granted_bytes, 64 * MIB);
    // Exactly what the gRPC call says.
    let grpc = allocate(&mut c, &s, 2 * MIB).await.unwrap_err();
    assert_eq!((grpc.code(), grpc.message()), (code, message.as_str()));
    assert_eq!(granted_total(&mut c).await, 64 * MIB);
}

#[tokio::test]
async fn bad_fields_on_the_fast_path_name_the_field() {
    let d = start("[guards]\nmax_grants_per_session = 2");
    let mut c = d.clients().await;
    let s = attach(&mut c, "bad", 0, "").await.unwrap();
    let mut conn = d.fd_conn();
    let cases = [
        (alloc_req(0, MIB, ""), Code::InvalidArgument, "session_id"),
        (alloc_req(s.id, 0, ""), Code::InvalidArgument, "size_bytes"),
        (alloc_req(s.id, 2048 * MIB, ""), Code::InvalidArgument, "size_bytes"),
        (alloc_req(s.id, MIB, "no spaces"), Code::InvalidArgument, "label"),
        (alloc_req(s.id, MIB, &"x".repeat(65)), Code::InvalidArgument, "label"),
        (alloc_req(987_654, MIB, ""), Code::NotFound, "session_id"),
    ];
    for (req, code, field) in cases {
        let grpc = c.graphpool.allocate_segment(req.clone()).await.unwrap_err();
        let e = conn.allocate(req).unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
        let (got, message, _) = refused(e);
        assert_eq!((got, message.as_str()), (grpc.code(), grpc.message()), "same as gRPC");
        assert_eq!(got, code, "{field}");
    }
    for (sid, gid, code, field) in [
        (0, 1, Code::InvalidArgument, "session_id"),
        (s.id, 0, Code::InvalidArgument, "grant_id"),
        (s.id, 77, Code::NotFound, "grant_id"),
    ] {
        assert_eq!(field_of(conn.release(sid, gid).unwrap_err()), (code, field.to_string()));
    }
    // Grants per session are bounded on this path too.
    let _a = conn.allocate(alloc_req(s.id, MIB, "")).unwrap();
    let _b = conn.allocate(alloc_req(s.id, MIB, "")).unwrap();
    let (code, _, detail) = refused(conn.allocate(alloc_req(s.id, MIB, "")).unwrap_err());
    assert_eq!(code, Code::ResourceExhausted);
    assert!(matches!(detail, Some(pb::error_detail::Detail::Capacity(r)) if r.limit == "session-grants"));
    // An oversized frame is refused and the connection closed; the daemon keeps serving.
    let mut big = FdConnection::connect(&d.fd_socket).unwrap();
    let r = big.send_raw(&2048u32.to_le_bytes()).unwrap();
    assert_eq!((r.ok, r.code), (false, Code::InvalidArgument as i32));
    // A frame that is not an FdRequest.
    let mut garbage = FdConnection::connect(&d.fd_socket).unwrap();
    let r = garbage.send_raw(&[3, 0, 0, 0, 0x1a, 0xff, 0xff]).unwrap();
    assert_eq!((r.ok, r.code), (false, Code::InvalidArgument as i32));
    assert_eq!(granted_total(&mut c).await, 4 * MIB);
}

/// Child side of `foreign_process_cannot_use_a_session_on_the_fast_path`: knows the parent's
/// session and grant ids, and must be refused everything.
#[test]
fn child_fast_path_foreign() {
    let Ok(fd_socket) = std::env::var("GP_FOREIGN_FD_SOCKET") else { return };
    let session: u64 = child_arg("GP_FOREIGN_SESSION");
    let grant: u64 = child_arg("GP_FOREIGN_GRANT");
    let mut conn = FdConnection::connect(Path::new(&fd_socket)).unwrap();
    let (code, message, detail) = refused(conn.allocate(alloc_req(session, MIB, "")).unwrap_err());
    assert_eq!(code, Code::PermissionDenied, "{message}");
    assert!(matches!(detail, Some(pb::error_detail::Detail::Field(f)) if f.field == "session_id"));
    assert_eq!(
        field_of(conn.release(session, grant).unwrap_err()),
        (Code::PermissionDenied, "session_id".into())
    );
    assert!(matches!(conn.fetch(session, grant), Err(ClientError::FdRefused { code: 7, .. })));
    println!("CHILD-REFUSED");
}

#[tokio::test]
async fn foreign_process_cannot_use_a_session_on_the_fast_path() {
    let d = start("");
    let mut c = d.clients().await;
    let s = attach(&mut c, "owner", 0, "").await.unwrap();
    let (g, _fd) = d.fd_conn().allocate(alloc_req(s.id, 2 * MIB, "")).unwrap();
    run_child(
        "child_fast_path_foreign",
        &[
            ("GP_FOREIGN_FD_SOCKET", d.fd_socket.display().to_string()),
            ("GP_FOREIGN_SESSION", s.id.to_string()),
            ("GP_FOREIGN_GRANT", g.grant_id.to_string()),
        ],
        &["CHILD-REFUSED"],
    );
    // Nothing changed: the grant is still the owner's, and no grant was made for the child.
    let u = usage(&mut c).await;
    assert_eq!(u.devices.iter().map(|d| d.grants).sum::<u32>(), 1);
    assert_eq!(granted_total(&mut c).await, 2 * MIB);
}

/// Child side of `client_killed_mid_request_is_reclaimed`: attaches, then allocates and
/// releases on the fast path as fast as it can, holding a few grants, until it is killed.
#[test]
fn child_fast_path_churn() {
    let Ok(socket) = std::env::var("GP_CHURN_SOCKET") else { return };
    let fd_socket = child_arg::<String>("GP_CHURN_FD_SOCKET");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut c = rt.block_on(graphpool::client::connect(Path::new(&socket))).unwrap();
    let s = rt.block_on(attach(&mut c, "victim", 9, "")).unwrap();
    let mut conn = FdConnection::connect(Path::new(&fd_socket)).unwrap();
    let mut held = std::collections::VecDeque::new();
    for n in 0u64.. {
        let (g, fd) = conn.allocate(alloc_req(s.id, MIB * (1 + n % 3), "churn")).unwrap();
        held.push_back((g.grant_id, fd));
        if held.len() > 3 {
            let (id, _fd) = held.pop_front().unwrap();
            conn.release(s.id, id).unwrap();
        }
        if n == 100 {
            println!("READY");
        }
    }
}

#[tokio::test]
async fn client_killed_mid_request_is_reclaimed() {
    let d = start("");
    let mut c = d.clients().await;
    warm_up(&d, &mut c).await;
    wait_until(Duration::from_secs(2), || {
        let mut c = c.clone();
        async move {
            c.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap().into_inner().sessions.is_empty()
        }
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let baseline = d.open_fds();
    for round in 0..3 {
        let mut child = child_test(
            "child_fast_path_churn",
            &[
                ("GP_CHURN_SOCKET", d.socket.display().to_string()),
                ("GP_CHURN_FD_SOCKET", d.fd_socket.display().to_string()),
            ],
        )
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
        // Mid-stream: the child is between requests or inside one; a few ms apart per round.
        std::thread::sleep(Duration::from_millis(7 * round));
        // SAFETY: killing our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        let _ = child.wait();
        let took = wait_until(Duration::from_secs(1), || {
            let mut c = c.clone();
            async move { ledger_empty(&mut c).await }
        })
        .await;
        assert!(took.is_some(), "not reclaimed within 1 s: {:?}\n{}", usage(&mut c).await, d.log());
    }
    let back = wait_until(Duration::from_secs(3), || async { d.open_fds() <= baseline }).await;
    assert!(back.is_some(), "daemon fds {} > baseline {baseline}", d.open_fds());
}

/// Child side of `fast_path_leaks_no_fds_on_either_side` (a process of its own, so that its
/// fd count is its own): 8 sessions x 500 allocate/release on the fast path from 8 threads,
/// with refusals and bad requests mixed in; every fd it received must be closed again.
#[test]
fn child_fast_path_fd_churn() {
    let Ok(socket) = std::env::var("GP_LEAK_SOCKET") else { return };
    let fd_socket = std::path::PathBuf::from(child_arg::<String>("GP_LEAK_FD_SOCKET"));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut c = rt.block_on(graphpool::client::connect(Path::new(&socket))).unwrap();
    let mine = own_fds();
    let sessions: Vec<_> =
        (0..8u32).map(|i| rt.block_on(attach(&mut c, "leak", i, &(i % 2).to_string())).unwrap()).collect();
    let workers: Vec<_> = sessions
        .iter()
        .map(|s| {
            let (sid, fd_socket) = (s.id, fd_socket.clone());
            std::thread::spawn(move || {
                let mut conn = FdConnection::connect(&fd_socket).unwrap();
                for n in 0..500u64 {
                    let (g, fd) = conn.allocate(alloc_req(sid, MIB * (1 + n % 4), "")).unwrap();
                    drop(fd);
                    // Refusals (grants per session) and bad requests leave nothing behind either.
                    if n % 50 == 0 {
                        let held: Vec<_> =
                            (0..3).map(|_| conn.allocate(alloc_req(sid, MIB, "")).unwrap()).collect();
                        assert!(conn.allocate(alloc_req(sid, MIB, "")).is_err());
                        assert!(conn.release(sid, 0).is_err());
                        for (h, _fd) in held {
                            conn.release(sid, h.grant_id).unwrap();
                        }
                    }
                    conn.release(sid, g.grant_id).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(rt.block_on(granted_total(&mut c)), 0);
    drop(sessions);
    assert_eq!(own_fds(), mine, "every fd received was closed");
    println!("CHILD-CLEAN");
}

#[tokio::test]
async fn fast_path_leaks_no_fds_on_either_side() {
    let d = start("[guards]\nmax_grants_per_session = 4");
    let mut c = d.clients().await;
    warm_up(&d, &mut c).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let baseline = d.open_fds();
    run_child(
        "child_fast_path_fd_churn",
        &[
            ("GP_LEAK_SOCKET", d.socket.display().to_string()),
            ("GP_LEAK_FD_SOCKET", d.fd_socket.display().to_string()),
        ],
        &["CHILD-CLEAN"],
    );
    assert_all_released(&d, &mut c, baseline).await;
}

#[tokio::test]
async fn the_fd_socket_bounds_connections_per_uid_and_drops_stalled_frames() {
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    // One session per uid: four fd connections at once.
    let d = start("[guards]\nmax_sessions_per_uid = 1");
    let mut c = d.clients().await;
    // The start-up probe's connection is gone before the count matters.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut held: Vec<UnixStream> = (0..4).map(|_| UnixStream::connect(&d.fd_socket).unwrap()).collect();
    let mut fifth = UnixStream::connect(&d.fd_socket).unwrap();
    assert!(closed_within(&mut fifth, Duration::from_secs(5)), "a fifth connection of one uid is dropped");
    assert!(!closed_within(&mut held[3], Duration::from_millis(200)), "the first four stay open");
    assert!(d.log().contains("fd connection refused"), "{}", d.log());
    // The daemon still answers, and a closed connection frees a place.
    c.graphpool.get_status(pb::GetStatusRequest {}).await.unwrap();
    drop(held.pop());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = attach(&mut c, "fd-cap", 0, "").await.unwrap();
    let mut conn = d.fd_conn();
    let (g, _fd) = conn.allocate(alloc_req(s.id, MIB, "")).unwrap();
    conn.release(s.id, g.grant_id).unwrap();
    // A frame started and left unfinished loses its connection; an idle one keeps it.
    let t = std::time::Instant::now();
    held[0].write_all(&[16, 0]).unwrap();
    assert!(closed_within(&mut held[0], Duration::from_secs(10)), "a stalled frame is dropped");
    assert!(t.elapsed() >= Duration::from_secs(4), "not before its time: {:?}", t.elapsed());
    assert!(!closed_within(&mut held[1], Duration::from_millis(100)), "an idle connection stays");
}
