//! Arbitrary bytes on the daemon's fd socket (the real broker, in process, over a real Unix
//! socket): fetches and the fast path's allocate/release. Every complete frame is answered
//! with a decodable `FdResponse` (or the connection is closed after an oversized frame);
//! refusals carry a known code; nothing hangs; the ledger stays consistent and only the
//! peer's own session ever changes.
#![no_main]

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use graphpool::config::AccessConfig;
use graphpool::ledger::{AttachSpec, Ledger, Peer};
use graphpool::service::Shared;
use graphpool_fuzz::{Bytes, Daemon, own_cred, pick, runtime};
use graphpool_proto::v1::{FdRequest, FdResponse, fd_request, fd_response};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Broker {
    path: std::path::PathBuf,
    daemon: Daemon,
    ledger: Arc<Ledger>,
    me: Peer,
    /// This process's session, then the other process's.
    sessions: Vec<u64>,
    /// This process's standing grant (re-made when an input released it), then the other's.
    grants: Mutex<Vec<u64>>,
}

fn broker() -> &'static Broker {
    static B: OnceLock<Broker> = OnceLock::new();
    B.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("graphpool-fuzz-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("fd.sock");
        let _ = std::fs::remove_file(&path);
        let d = Daemon::new();
        let cred = own_cred();
        let me = Peer { pid: cred.pid().unwrap() as u32, uid: cred.uid(), gid: cred.gid() };
        let other = Peer { pid: me.pid + 1, ..me };
        let mut sessions = Vec::new();
        let mut grants = Vec::new();
        for (peer, job) in [(me, "mine"), (other, "theirs")] {
            let (s, _) =
                d.ledger.attach(peer, AttachSpec { job_id: job.into(), ..Default::default() }, &[]).unwrap();
            sessions.push(s.id);
            grants.push(d.ledger.allocate(s.id, &peer, 2 << 20, "fuzz").unwrap().id);
        }
        let ledger = d.ledger.clone();
        let listener = runtime().block_on(async { tokio::net::UnixListener::bind(&path).expect("bind") });
        let shutdown = graphpool::shutdown::Shutdown::new();
        let shared = Shared {
            ledger: ledger.clone(),
            metrics: d.metrics.clone(),
            access: AccessConfig::default(),
            sessions: d.sessions.clone(),
        };
        runtime().spawn(graphpool::fd_broker::serve(listener, shared, shutdown));
        Broker { path, daemon: d, ledger, me, sessions, grants: Mutex::new(grants) }
    })
}

fuzz_target!(|data: &[u8]| {
    let b = broker();
    let known = b.grants.lock().unwrap().clone();
    let mut input = Bytes(data);
    // Mode 0: the raw bytes. Otherwise: frames built from the input with live ids, each with
    // a length prefix that may lie, interleaved with raw chunks.
    let mut wire = Vec::new();
    match input.u8() {
        None | Some(0) => wire.extend_from_slice(input.0),
        Some(_) => {
            while let (Some(kind), Some(body)) = (input.u8(), input.chunk()) {
                if kind % 3 == 0 {
                    wire.extend_from_slice(body);
                    continue;
                }
                let mut req = FdRequest::decode(body).unwrap_or_default();
                req.session_id = pick(req.session_id, &b.sessions);
                req.grant_id = pick(req.grant_id, &known);
                match &mut req.call {
                    Some(fd_request::Call::Allocate(a)) => {
                        a.session_id = pick(a.session_id, &b.sessions);
                        // Mostly sizes that fit, so that grants are made and released.
                        if kind % 2 == 0 {
                            a.size_bytes %= 8 << 20;
                        }
                    }
                    Some(fd_request::Call::Release(r)) => {
                        r.session_id = pick(r.session_id, &b.sessions);
                        r.grant_id = pick(r.grant_id, &known);
                    }
                    None => {}
                }
                let bytes = req.encode_to_vec();
                let len =
                    if kind % 3 == 1 { bytes.len() as u32 } else { bytes.len() as u32 ^ u32::from(kind) };
                wire.extend_from_slice(&len.to_le_bytes());
                wire.extend_from_slice(&bytes);
            }
        }
    }
    let got = runtime().block_on(async {
        let mut s = tokio::net::UnixStream::connect(&b.path).await.expect("connect");
        let (mut r, mut w) = s.split();
        let write = async {
            let _ = w.write_all(&wire).await;
            let _ = w.shutdown().await;
        };
        let mut out = Vec::new();
        let read = r.read_to_end(&mut out);
        let (_, res) = tokio::time::timeout(Duration::from_secs(5), async { tokio::join!(write, read) })
            .await
            .expect("the fd socket hung");
        let _ = res;
        out
    });
    // Every response frame decodes and carries a known code.
    let mut rest = got.as_slice();
    while !rest.is_empty() {
        assert!(rest.len() >= 4, "truncated length prefix in a response");
        let n = u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize;
        assert!(rest.len() >= 4 + n, "truncated response");
        let resp = FdResponse::decode(&rest[4..4 + n]).expect("a response decodes");
        if resp.ok {
            assert_eq!(resp.code, 0);
            match &resp.result {
                None => {
                    assert_eq!(resp.handle_kind, "memfd");
                    assert!(resp.size_bytes > 0 && resp.size_bytes % (2 << 20) == 0);
                }
                Some(fd_response::Result::Grant(g)) => {
                    assert_eq!(g.session_id, b.sessions[0], "a grant for another process's session");
                    assert_eq!((g.size_bytes, g.handle_kind.as_str()), (resp.size_bytes, "memfd"));
                    assert!(g.size_bytes % (2 << 20) == 0 && g.size_bytes >= g.requested_bytes);
                }
                Some(fd_response::Result::Released(r)) => assert!(r.bytes_released % (2 << 20) == 0),
            }
        } else {
            // INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED,
            // FAILED_PRECONDITION.
            assert!(
                matches!(resp.code, 3 | 5 | 7 | 8 | 9),
                "unexpected code {}: {}",
                resp.code,
                resp.message
            );
        }
        rest = &rest[4 + n..];
    }
    b.daemon.check();
    // The other process's session and grant are untouched; only this process's changed.
    let all = b.ledger.grants(None, None);
    assert!(all.iter().any(|g| g.id == known[1] && g.session == b.sessions[1]), "the other's grant is gone");
    assert!(all.iter().all(|g| g.session == b.sessions[0] || g.id == known[1]));
    // Back to the standing state: this process's session holds exactly one 2 MiB grant.
    let mut grants = b.grants.lock().unwrap();
    for g in all.iter().filter(|g| g.session == b.sessions[0] && g.id != grants[0]) {
        b.ledger.release(b.sessions[0], &b.me, g.id).expect("release");
    }
    if !all.iter().any(|g| g.id == grants[0]) {
        grants[0] = b.ledger.allocate(b.sessions[0], &b.me, 2 << 20, "fuzz").expect("allocate").id;
    }
});
