//! The fd socket: hands a grant's file descriptor to the process that owns the grant, and
//! serves the fast path of the hot calls (allocate, release).
//!
//! gRPC cannot carry file descriptors, so they travel on a second Unix socket with
//! `SCM_RIGHTS`. Framing (both ways): a 4-byte little-endian length, then that many bytes of
//! protobuf (`FdRequest` in, `FdResponse` out). A response that carries an fd is sent in one
//! `sendmsg` together with the fd. The peer's pid and uid (`SO_PEERCRED`) must be those of
//! the session that owns the grant: holding a grant id is not enough.
//!
//! The fast path (`FdRequest.call`): `AllocateSegment` and `ReleaseSegment` with the gRPC
//! API's own messages, through [`crate::service::segments`], the code gRPC uses too (same
//! validation, admission, ledger, logs, errors and metrics, with `transport="fd-socket"`).
//! An allocation answers with the grant and its fd in one message. It exists because on a
//! small machine a gRPC call (HTTP/2 framing, a task hop on each side) costs several times
//! what the daemon does for the request.
//!
//! Connections are guarded: a peer not on the allow-list is dropped at accept, as on the gRPC
//! socket ([`crate::conn_limit`]); one uid holds at most [`crate::conn_limit::per_uid_cap`] at
//! once (the gRPC socket has the same cap and keeps its own count); and a frame whose first
//! byte has arrived must be whole within [`FRAME_TIMEOUT`] (a connection may wait idle between
//! frames as long as it likes: a rank keeps one open for its session's life).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use crate::shutdown::Shutdown;
use graphpool_proto::v1::{self as pb, FdRequest, FdResponse, fd_request, fd_response};
use prost::Message;
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tonic::Status;

use crate::conn_limit::{ConnLimit, Warnings, per_uid_cap};
use crate::ledger::{Peer, SharedSegment};
use crate::service::Shared;
use crate::service::graphpool::grant_proto;
use crate::service::segments::{self, Transport};

/// Largest request frame accepted on the fd socket.
pub const MAX_FRAME: usize = 1024;

/// Time a frame has to arrive whole once its first byte has: a peer that stalls mid-frame
/// loses its connection.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves the fd socket until `shutdown` fires.
pub async fn serve(listener: UnixListener, shared: Shared, shutdown: Shutdown) {
    let limit = ConnLimit::new(Transport::FdSocket, per_uid_cap(shared.ledger.guards()));
    let mut accept_failures = Warnings::default();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.wait() => return,
        };
        let (stream, _) = match accepted {
            Ok(s) => s,
            Err(e) => {
                if let Some(unlogged) = accept_failures.due(Instant::now()) {
                    tracing::warn!(error = %e, unlogged, "fd socket accept failed");
                }
                tokio::time::sleep(crate::server::ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        // Who it is, before anything is read: a peer not on the allow-list or past its uid's
        // connections is dropped at once (and logged, within the rate limit).
        let peer = match crate::peer::peer_of(&stream) {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(error = %e, "fd connection dropped: peer unknown");
                continue;
            }
        };
        let Some(slot) =
            limit.admit_peer(&shared.access, peer.uid, peer.gid, Some(peer.pid), &shared.metrics)
        else {
            continue;
        };
        let (shared, shutdown) = (shared.clone(), shutdown.clone());
        tokio::spawn(async move {
            let _slot = slot;
            tokio::select! {
                r = serve_connection(stream, peer, &shared) => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "fd connection ended");
                    }
                }
                _ = shutdown.wait() => {}
            }
        });
    }
}

/// What to send back for one request.
struct Reply {
    resp: FdResponse,
    /// The fd to attach.
    segment: Option<SharedSegment>,
    /// A grant made for this request: released again if the response cannot be delivered
    /// (the client never learned of it).
    granted: Option<(u64, u64)>,
}

async fn serve_connection(mut stream: UnixStream, peer: Peer, shared: &Shared) -> io::Result<()> {
    let mut buf = Vec::with_capacity(128);
    let mut out = Vec::with_capacity(256);
    loop {
        // Idle until a frame starts; then it has FRAME_TIMEOUT to arrive whole.
        let mut len = [0u8; 4];
        match stream.read_exact(&mut len[..1]).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let deadline = tokio::time::Instant::now() + FRAME_TIMEOUT;
        let stalled = |_| io::Error::new(io::ErrorKind::TimedOut, "a frame did not arrive whole in time");
        tokio::time::timeout_at(deadline, stream.read_exact(&mut len[1..])).await.map_err(stalled)??;
        let n = u32::from_le_bytes(len) as usize;
        if n > MAX_FRAME {
            let resp = failure(&Status::invalid_argument(format!(
                "frame of {n} bytes exceeds the fd socket's limit of {MAX_FRAME}"
            )));
            send(&stream, &resp, None, &mut out).await?;
            return Ok(());
        }
        buf.resize(n, 0);
        tokio::time::timeout_at(deadline, stream.read_exact(&mut buf)).await.map_err(stalled)??;
        let reply = handle(shared, peer, &buf);
        let fd = reply.segment.as_ref().map(|s| s.fd());
        let sent = send(&stream, &reply.resp, fd, &mut out).await;
        if let (Err(e), Some((session_id, grant_id))) = (&sent, reply.granted) {
            // The client is gone (or broke the connection) before it learned of the grant.
            let r = pb::ReleaseSegmentRequest { session_id, grant_id };
            if segments::release(shared, &peer, &r).is_ok() {
                tracing::info!(grant = grant_id, session = session_id, error = %e, "grant released: its response could not be delivered");
            }
        }
        sent?;
    }
}

/// Decodes and serves one request, and records it in the metrics. `peer` passed the
/// allow-list when its connection was accepted (the list is fixed at start-up).
fn handle(shared: &Shared, peer: Peer, frame: &[u8]) -> Reply {
    let started = Instant::now();
    let req = match FdRequest::decode(frame) {
        Ok(r) => r,
        Err(e) => {
            let s = Status::invalid_argument(format!("FdRequest could not be decoded: {e}"));
            shared.observe_on::<()>(Transport::FdSocket, "FetchFd", started, &Err(s.clone()));
            return Reply { resp: failure(&s), segment: None, granted: None };
        }
    };
    match req.call {
        None => {
            let r = (|| {
                // As the gRPC calls: an unset id is named, not looked up (and reported as gone).
                crate::service::validate::id("session_id", req.session_id)?;
                crate::service::validate::id("grant_id", req.grant_id)?;
                let seg =
                    shared.ledger.segment_for(req.session_id, &peer, req.grant_id).inspect_err(|e| {
                        if matches!(
                            e,
                            crate::ledger::LedgerError::ForeignSession { .. }
                                | crate::ledger::LedgerError::ForeignGrant { .. }
                        ) {
                            tracing::warn!(
                                pid = peer.pid,
                                uid = peer.uid,
                                grant = req.grant_id,
                                session = req.session_id,
                                "fd request refused: the peer does not own the grant"
                            );
                        }
                    })?;
                Ok(seg)
            })();
            shared.observe_on(Transport::FdSocket, "FetchFd", started, &r);
            match r {
                Ok(seg) => Reply {
                    resp: FdResponse {
                        ok: true,
                        size_bytes: seg.size_bytes(),
                        handle_kind: seg.handle_kind().to_string(),
                        ..Default::default()
                    },
                    segment: Some(seg),
                    granted: None,
                },
                Err(s) => Reply { resp: failure(&s), segment: None, granted: None },
            }
        }
        Some(fd_request::Call::Allocate(a)) => {
            let r = segments::allocate(shared, &peer, &a).and_then(|g| {
                // The grant is the caller's until its session ends; a session ended under us
                // (its process exited) took the grant with it.
                let seg = shared.ledger.segment_for(g.session, &peer, g.id)?;
                Ok((g, seg))
            });
            shared.observe_on(Transport::FdSocket, "AllocateSegment", started, &r);
            match r {
                Ok((g, seg)) => Reply {
                    resp: FdResponse {
                        ok: true,
                        size_bytes: seg.size_bytes(),
                        handle_kind: seg.handle_kind().to_string(),
                        result: Some(fd_response::Result::Grant(grant_proto(&g))),
                        ..Default::default()
                    },
                    segment: Some(seg),
                    granted: Some((g.session, g.id)),
                },
                Err(s) => Reply { resp: failure(&s), segment: None, granted: None },
            }
        }
        Some(fd_request::Call::Release(rel)) => {
            let r = segments::release(shared, &peer, &rel);
            shared.observe_on(Transport::FdSocket, "ReleaseSegment", started, &r);
            match r {
                Ok(released) => Reply {
                    resp: FdResponse {
                        ok: true,
                        result: Some(fd_response::Result::Released(released)),
                        ..Default::default()
                    },
                    segment: None,
                    granted: None,
                },
                Err(s) => Reply { resp: failure(&s), segment: None, granted: None },
            }
        }
    }
}

/// The fd-socket form of a failed call: the status's code and message, and the structured
/// detail gRPC would carry in its `graphpool-error-bin` trailer.
fn failure(s: &Status) -> FdResponse {
    let error = s
        .metadata()
        .get_bin(graphpool_proto::ERROR_DETAIL_METADATA_KEY)
        .and_then(|v| v.to_bytes().ok())
        .and_then(|b| pb::ErrorDetail::decode(b).ok());
    FdResponse {
        ok: false,
        code: s.code() as i32,
        message: s.message().to_string(),
        error,
        ..Default::default()
    }
}

/// Sends one frame, with `fd` attached to its first byte when given; `frame` is scratch space.
async fn send(
    stream: &UnixStream,
    resp: &FdResponse,
    fd: Option<BorrowedFd<'_>>,
    frame: &mut Vec<u8>,
) -> io::Result<()> {
    frame.clear();
    frame.extend_from_slice(&(resp.encoded_len() as u32).to_le_bytes());
    resp.encode(frame).expect("a Vec grows as needed");
    let mut sent = 0;
    let mut fd = fd.map(|f| f.as_raw_fd());
    while sent < frame.len() {
        stream.writable().await?;
        match stream.try_io(Interest::WRITABLE, || sendmsg(stream.as_raw_fd(), &frame[sent..], fd)) {
            Ok(n) => {
                sent += n;
                fd = None;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn sendmsg(sock: i32, data: &[u8], fd: Option<i32>) -> io::Result<usize> {
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    // Room for one int of SCM_RIGHTS, aligned as cmsghdr needs.
    let mut cbuf = [0u64; 4];
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: CMSG_SPACE is a pure computation.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) } as usize;
        debug_assert!(space <= std::mem::size_of_val(&cbuf));
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points to a buffer of `space` bytes, enough for one cmsghdr
        // carrying one int; CMSG_FIRSTHDR/CMSG_DATA stay within it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut i32, fd);
        }
    }
    // SAFETY: `msg` and everything it points to live across the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}
