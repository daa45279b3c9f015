//! The client side of the daemon's fd socket: length-prefixed `FdRequest`/`FdResponse`
//! frames, the fd arriving in an `SCM_RIGHTS` control message.
//!
//! The shim makes its segment requests here, on the fast path: `AllocateSegment` answers with
//! the grant and its fd in one message, `ReleaseSegment` follows; the daemon runs the same
//! code for them as for the gRPC calls. Blocking I/O on the caller's thread: each is one small
//! round trip on a connection kept open for the session, so it needs no async runtime. Reads
//! and writes time out (the session's attempt timeout), so a daemon that stopped answering
//! fails the call instead of hanging torch's thread.

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use graphpool_proto::v1::{
    AllocateSegmentRequest, ErrorDetail, FdRequest, FdResponse, Grant, ReleaseSegmentRequest, fd_request,
    fd_response,
};
use prost::Message;

use crate::error::ShimError;

/// Largest response frame accepted.
const MAX_FRAME: usize = 1 << 20;

/// A connection to the fd socket.
#[derive(Debug)]
pub struct FdConn {
    stream: UnixStream,
    timeout: Duration,
}

/// A response, the fd that came with it, and whether the kernel dropped fds sent with it
/// (`MSG_CTRUNC`: this process is at its fd limit).
struct Reply {
    resp: FdResponse,
    fd: Option<OwnedFd>,
    truncated: bool,
}

impl Reply {
    /// The fd, or why it is missing.
    fn fd(self, call: &str) -> (FdResponse, Result<OwnedFd, ShimError>) {
        let fd = match (self.fd, self.truncated) {
            (Some(fd), _) => Ok(fd),
            (None, true) => Err(ShimError::Fd(
                "this process is out of file descriptors (RLIMIT_NOFILE): the kernel dropped the fd \
                 the daemon sent; close files or raise the limit"
                    .to_string(),
            )),
            (None, false) => Err(ShimError::Fd(format!("the answer to {call} carried no fd"))),
        };
        (self.resp, fd)
    }
}

impl FdConn {
    /// Connects to the daemon's fd socket; each read and write of the connection fails after
    /// `timeout` (zero: never).
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, ShimError> {
        let stream = UnixStream::connect(path)
            .map_err(|e| ShimError::Fd(format!("cannot connect to {}: {e}", path.display())))?;
        let t = (!timeout.is_zero()).then_some(timeout);
        stream
            .set_read_timeout(t)
            .and_then(|()| stream.set_write_timeout(t))
            .map_err(|e| ShimError::Fd(format!("setting the timeouts of {}: {e}", path.display())))?;
        Ok(FdConn { stream, timeout })
    }

    /// Asks for the fd of `grant_id`; returns it with the response (size, handle kind).
    pub fn fetch(&mut self, session_id: u64, grant_id: u64) -> Result<(OwnedFd, FdResponse), ShimError> {
        let (resp, fd) =
            self.call("FdRequest", &FdRequest { session_id, grant_id, call: None })?.fd("FdRequest");
        Ok((fd?, resp))
    }

    /// `AllocateSegment` on the fast path: the grant and its fd in one round trip. The fd is
    /// an error when the grant came without it (the caller owns the grant then and must release
    /// it); the connection stays usable.
    pub fn allocate(
        &mut self,
        req: AllocateSegmentRequest,
    ) -> Result<(Grant, Result<OwnedFd, ShimError>), ShimError> {
        let req = FdRequest { call: Some(fd_request::Call::Allocate(req)), ..Default::default() };
        let (resp, fd) = self.call("AllocateSegment", &req)?.fd("AllocateSegment");
        let Some(fd_response::Result::Grant(grant)) = resp.result else {
            return Err(ShimError::Fd("the answer to AllocateSegment carried no grant".to_string()));
        };
        Ok((grant, fd))
    }

    /// `ReleaseSegment` on the fast path.
    pub fn release(&mut self, session_id: u64, grant_id: u64) -> Result<(), ShimError> {
        let release = ReleaseSegmentRequest { session_id, grant_id };
        let req = FdRequest { call: Some(fd_request::Call::Release(release)), ..Default::default() };
        match self.call("ReleaseSegment", &req)?.resp.result {
            Some(fd_response::Result::Released(_)) => Ok(()),
            _ => Err(ShimError::Fd("the answer to ReleaseSegment carried no result".to_string())),
        }
    }

    /// One request and its response. A refusal becomes [`ShimError::Daemon`] with the code,
    /// message and structured detail the gRPC call would have given; a broken connection is
    /// [`ShimError::Fd`], and so is a daemon that does not answer within the timeout. The
    /// whole frame is read even when fds were dropped (`truncated`), so that a grant sent
    /// with them is still known, and can be released.
    fn call(&mut self, call: &'static str, req: &FdRequest) -> Result<Reply, ShimError> {
        let mut frame = Vec::with_capacity(4 + req.encoded_len());
        frame.extend_from_slice(&(req.encoded_len() as u32).to_le_bytes());
        req.encode(&mut frame).expect("a Vec grows as needed");
        self.stream.write_all(&frame).map_err(|e| self.io_error("send", e))?;

        let mut buf: Vec<u8> = Vec::with_capacity(256);
        let mut fd: Option<OwnedFd> = None;
        let mut truncated = false;
        let mut want: Option<usize> = None;
        loop {
            if let Some(n) = want
                && buf.len() >= 4 + n
            {
                break;
            }
            if want.is_none() && buf.len() >= 4 {
                let n = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
                if n > MAX_FRAME {
                    return Err(ShimError::Fd(format!("response frame of {n} bytes is too large")));
                }
                want = Some(n);
                continue;
            }
            let (got, received, cut) =
                recv_with_fd(self.stream.as_raw_fd(), &mut buf).map_err(|e| self.io_error("recvmsg", e))?;
            truncated |= cut;
            if let Some(f) = received {
                // A second fd would be a protocol error; keep the first, close the others.
                if fd.is_none() {
                    fd = Some(f);
                }
            }
            if got == 0 {
                return Err(ShimError::Fd("the daemon closed the fd socket".to_string()));
            }
        }
        let n = want.unwrap_or(0);
        let resp = FdResponse::decode(&buf[4..4 + n])
            .map_err(|e| ShimError::Fd(format!("undecodable FdResponse: {e}")))?;
        if !resp.ok {
            return Err(ShimError::Daemon {
                call,
                code: tonic::Code::from(resp.code),
                message: resp.message,
                detail: resp.error.map(|d: ErrorDetail| Box::new(d)),
            });
        }
        Ok(Reply { resp, fd, truncated })
    }

    /// A failed read or write; a timeout says that the daemon does not answer.
    fn io_error(&self, what: &str, e: std::io::Error) -> ShimError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                ShimError::Fd(format!("graphpoold did not answer within {:?} ({what}: {e})", self.timeout))
            }
            _ => ShimError::Fd(format!("{what}: {e}")),
        }
    }
}

/// One `recvmsg` appending to `buf`; returns the byte count, the fd if one came with it, and
/// whether the kernel dropped control data (`MSG_CTRUNC`: fds that this process had no room for).
fn recv_with_fd(sock: RawFd, buf: &mut Vec<u8>) -> std::io::Result<(usize, Option<OwnedFd>, bool)> {
    let mut chunk = [0u8; 4096];
    // Room for one cmsghdr with up to 4 ints, aligned.
    let mut cbuf = [0u64; 16];
    let mut iov = libc::iovec { iov_base: chunk.as_mut_ptr().cast(), iov_len: chunk.len() };
    // SAFETY: msghdr is a plain C struct; zeroed is a valid empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    let n = loop {
        // SAFETY: `msg` points at live buffers (`chunk`, `cbuf`) for the whole call.
        let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        break n as usize;
    };
    let mut fd = None;
    // SAFETY: walking the control buffer the kernel filled, with the libc CMSG macros, which
    // stay within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<libc::c_int>();
                for i in 0..count {
                    let raw = std::ptr::read_unaligned(data.add(i));
                    // Every received fd is ours; the first is kept, the rest are closed on drop.
                    let owned = OwnedFd::from_raw_fd(raw);
                    if fd.is_none() {
                        fd = Some(owned);
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let truncated = msg.msg_flags & libc::MSG_CTRUNC != 0;
    buf.extend_from_slice(&chunk[..n]);
    Ok((n, fd, truncated))
}
