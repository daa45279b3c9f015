//! The fd socket: hands a grant's file descriptor to the process that owns the grant.
//!
//! gRPC cannot carry file descriptors, so they travel on a second Unix socket with
//! `SCM_RIGHTS`. Framing (both ways): a 4-byte little-endian length, then that many bytes of
//! protobuf (`FdRequest` in, `FdResponse` out). A successful response is sent in one
//! `sendmsg` together with the fd. The peer's pid and uid (`SO_PEERCRED`) must be those of
//! the session that owns the grant: holding a grant id is not enough.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::shutdown::Shutdown;
use graphpool_proto::v1::{FdRequest, FdResponse};
use prost::Message;
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::{UnixListener, UnixStream};

use crate::config::AccessConfig;
use crate::ledger::{Ledger, LedgerError, Peer};
use crate::metrics::Metrics;

/// Largest request frame accepted on the fd socket.
pub const MAX_FRAME: usize = 1024;

/// Serves the fd socket until `shutdown` fires.
pub async fn serve(
    listener: UnixListener,
    ledger: Arc<Ledger>,
    access: AccessConfig,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.wait() => return,
        };
        let (stream, _) = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "fd socket accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (ledger, access, metrics, shutdown) =
            (ledger.clone(), access.clone(), metrics.clone(), shutdown.clone());
        tokio::spawn(async move {
            tokio::select! {
                r = serve_connection(stream, &ledger, &access, &metrics) => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "fd connection ended");
                    }
                }
                _ = shutdown.wait() => {}
            }
        });
    }
}

async fn serve_connection(
    mut stream: UnixStream,
    ledger: &Ledger,
    access: &AccessConfig,
    metrics: &Metrics,
) -> io::Result<()> {
    let peer = crate::peer::peer_of(&stream)?;
    let mut buf = Vec::with_capacity(64);
    loop {
        let mut len = [0u8; 4];
        match stream.read_exact(&mut len).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let n = u32::from_le_bytes(len) as usize;
        if n > MAX_FRAME {
            let resp = failure(3, format!("frame of {n} bytes exceeds the fd socket's limit of {MAX_FRAME}"));
            send(&stream, &resp, None).await?;
            return Ok(());
        }
        buf.resize(n, 0);
        stream.read_exact(&mut buf).await?;
        let started = Instant::now();
        let (resp, segment) = match FdRequest::decode(buf.as_slice()) {
            Err(e) => (failure(3, format!("FdRequest could not be decoded: {e}")), None),
            Ok(_) if !access.allows(peer.uid, peer.gid) => (
                failure(7, format!("uid {} gid {} is not on the daemon's allow-list", peer.uid, peer.gid)),
                None,
            ),
            Ok(req) => lookup(ledger, &peer, &req),
        };
        let code = resp.code;
        let fd = segment.as_ref().map(|s| s.fd());
        send(&stream, &resp, fd).await?;
        metrics.request("FetchFd", code_name(code), started.elapsed());
    }
}

fn lookup(
    ledger: &Ledger,
    peer: &Peer,
    req: &FdRequest,
) -> (FdResponse, Option<crate::ledger::SharedSegment>) {
    match ledger.segment_for(req.session_id, peer, req.grant_id) {
        Ok(seg) => {
            let resp = FdResponse {
                ok: true,
                code: 0,
                message: String::new(),
                size_bytes: seg.size_bytes(),
                handle_kind: seg.handle_kind().to_string(),
            };
            (resp, Some(seg))
        }
        Err(e) => {
            let code = match &e {
                LedgerError::UnknownSession(_) | LedgerError::UnknownGrant(_) => 5,
                LedgerError::ForeignSession { .. } | LedgerError::ForeignGrant { .. } => 7,
                LedgerError::NoFd(_) => 9,
                _ => 13,
            };
            if code == 7 {
                tracing::warn!(
                    pid = peer.pid,
                    uid = peer.uid,
                    grant = req.grant_id,
                    session = req.session_id,
                    "fd request refused: the peer does not own the grant"
                );
            }
            (failure(code, e.to_string()), None)
        }
    }
}

fn failure(code: i32, message: String) -> FdResponse {
    FdResponse { ok: false, code, message, size_bytes: 0, handle_kind: String::new() }
}

fn code_name(code: i32) -> &'static str {
    match code {
        0 => "OK",
        3 => "INVALID_ARGUMENT",
        5 => "NOT_FOUND",
        7 => "PERMISSION_DENIED",
        9 => "FAILED_PRECONDITION",
        _ => "INTERNAL",
    }
}

/// Sends one frame, with `fd` attached to its first byte when given.
async fn send(stream: &UnixStream, resp: &FdResponse, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let body = resp.encode_to_vec();
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
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
