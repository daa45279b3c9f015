//! A Rust client of graphpoold: channels over the Unix socket, and the fd socket (fd
//! fetching, and the fast path of allocate and release, which answers an allocation with the
//! grant and its fd in one message). Used by the CLI, the integration tests and the benchmarks.

use std::io::{self, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};

use graphpool_proto::v1::admin_client::AdminClient;
use graphpool_proto::v1::graphpool_client::GraphpoolClient;
use graphpool_proto::v1::{
    AllocateSegmentRequest, ErrorDetail, FdRequest, FdResponse, Grant, ReleaseSegmentRequest,
    ReleaseSegmentResponse, fd_request, fd_response,
};
use hyper_util::rt::TokioIo;
use prost::Message;
use tonic::transport::{Channel, Endpoint};

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket could not be reached.
    #[error(
        "cannot reach graphpoold at {path}: {source}; start it with `graphpoold` or point GRAPHPOOL_SOCKET / --socket at its socket \
         (if it runs, its log says why it closed the connection: this uid is not on its allow-list, or holds too many connections)"
    )]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// The transport error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The daemon refused a request on the fd socket.
    #[error("graphpoold refused {call} on the fd socket ({}): {message}", tonic::Code::from(*.code))]
    FdRefused {
        /// Which call: `FetchFd`, `AllocateSegment` or `ReleaseSegment`.
        call: &'static str,
        /// gRPC code number.
        code: i32,
        /// The daemon's message.
        message: String,
        /// The structured detail (capacity refusal, field at fault), when the daemon sent one.
        detail: Option<Box<ErrorDetail>>,
    },
    /// The fd socket misbehaved.
    #[error("fd socket: {0}")]
    Io(#[from] io::Error),
}

/// The socket path a client uses: `$GRAPHPOOL_SOCKET`, else the daemon's default.
pub fn default_socket() -> PathBuf {
    if let Some(p) = std::env::var_os("GRAPHPOOL_SOCKET").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let system = PathBuf::from(crate::config::SYSTEM_SOCKET);
    if system.exists() {
        return system;
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(x) if !x.is_empty() => PathBuf::from(x).join("graphpool").join("graphpool.sock"),
        _ => system,
    }
}

/// Opens a gRPC channel to the daemon's socket.
pub async fn channel(socket: &Path) -> Result<Channel, ClientError> {
    let path = socket.to_path_buf();
    let connect_path = path.clone();
    // The URI is required by the API but unused: the connector dials the Unix socket.
    Endpoint::from_static("http://graphpoold.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let p = connect_path.clone();
            async move { Ok::<_, io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?)) }
        }))
        .await
        .map_err(|e| ClientError::Connect { path, source: Box::new(e) })
}

/// Both service clients over one channel.
#[derive(Debug, Clone)]
pub struct Clients {
    /// The Graphpool service.
    pub graphpool: GraphpoolClient<Channel>,
    /// The Admin service.
    pub admin: AdminClient<Channel>,
}

/// Connects both clients.
pub async fn connect(socket: &Path) -> Result<Clients, ClientError> {
    let ch = channel(socket).await?;
    Ok(Clients { graphpool: GraphpoolClient::new(ch.clone()), admin: AdminClient::new(ch) })
}

impl ClientError {
    /// The structured detail of a refusal on the fd socket, if the daemon sent one.
    pub fn detail(&self) -> Option<&ErrorDetail> {
        match self {
            ClientError::FdRefused { detail, .. } => detail.as_deref(),
            _ => None,
        }
    }
}

/// The structured detail of a failed call, if the daemon attached one.
pub fn error_detail(status: &tonic::Status) -> Option<ErrorDetail> {
    let v = status.metadata().get_bin(graphpool_proto::ERROR_DETAIL_METADATA_KEY)?;
    ErrorDetail::decode(v.to_bytes().ok()?).ok()
}

/// A blocking connection to the fd socket.
#[derive(Debug)]
pub struct FdConnection {
    stream: StdUnixStream,
}

impl FdConnection {
    /// Connects to the fd socket.
    pub fn connect(path: &Path) -> Result<Self, ClientError> {
        let stream = StdUnixStream::connect(path)
            .map_err(|e| ClientError::Connect { path: path.to_path_buf(), source: Box::new(e) })?;
        Ok(FdConnection { stream })
    }

    /// Asks for a grant's fd.
    pub fn fetch(&mut self, session_id: u64, grant_id: u64) -> Result<(OwnedFd, FdResponse), ClientError> {
        let (resp, fd) = self.call("FetchFd", &FdRequest { session_id, grant_id, call: None })?;
        let fd = fd.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "response carried no fd"))?;
        Ok((fd, resp))
    }

    /// `AllocateSegment` on the fast path: the grant and its fd in one round trip. Same
    /// checks, errors and accounting as the gRPC call.
    pub fn allocate(&mut self, req: AllocateSegmentRequest) -> Result<(Grant, OwnedFd), ClientError> {
        let req = FdRequest { call: Some(fd_request::Call::Allocate(req)), ..Default::default() };
        let (resp, fd) = self.call("AllocateSegment", &req)?;
        let Some(fd_response::Result::Grant(grant)) = resp.result else {
            return Err(unexpected("AllocateSegment", "no grant"));
        };
        let fd = fd.ok_or_else(|| unexpected("AllocateSegment", "no fd"))?;
        Ok((grant, fd))
    }

    /// `ReleaseSegment` on the fast path.
    pub fn release(&mut self, session_id: u64, grant_id: u64) -> Result<ReleaseSegmentResponse, ClientError> {
        let release = ReleaseSegmentRequest { session_id, grant_id };
        let req = FdRequest { call: Some(fd_request::Call::Release(release)), ..Default::default() };
        match self.call("ReleaseSegment", &req)?.0.result {
            Some(fd_response::Result::Released(r)) => Ok(r),
            _ => Err(unexpected("ReleaseSegment", "no result")),
        }
    }

    /// One request and its response; a refusal becomes [`ClientError::FdRefused`].
    fn call(
        &mut self,
        call: &'static str,
        req: &FdRequest,
    ) -> Result<(FdResponse, Option<OwnedFd>), ClientError> {
        let mut frame = Vec::with_capacity(4 + req.encoded_len());
        frame.extend_from_slice(&(req.encoded_len() as u32).to_le_bytes());
        req.encode(&mut frame).expect("a Vec grows as needed");
        self.stream.write_all(&frame)?;
        let (resp, fd) = self.read_frame()?;
        if !resp.ok {
            return Err(ClientError::FdRefused {
                call,
                code: resp.code,
                message: resp.message,
                detail: resp.error.map(Box::new),
            });
        }
        Ok((resp, fd))
    }

    /// Sends raw bytes (for tests of malformed input) and reads one response.
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<FdResponse, ClientError> {
        self.stream.write_all(bytes)?;
        Ok(self.read_frame()?.0)
    }

    fn read_frame(&mut self) -> io::Result<(FdResponse, Option<OwnedFd>)> {
        let mut buf = vec![0u8; 4096];
        let mut got = 0usize;
        let mut fd = None;
        // Read at least the length prefix, taking the fd from whichever read carries it.
        loop {
            let (n, f) = recvmsg(&self.stream, &mut buf[got..])?;
            if f.is_some() {
                fd = f;
            }
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "fd socket closed"));
            }
            got += n;
            if got >= 4 {
                let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
                if len + 4 > buf.len() {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "oversized frame"));
                }
                if got >= len + 4 {
                    let resp = FdResponse::decode(&buf[4..4 + len])
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                    return Ok((resp, fd));
                }
            }
        }
    }
}

/// A successful response that lacks what its request asks for.
fn unexpected(call: &str, what: &str) -> ClientError {
    ClientError::Io(io::Error::new(
        io::ErrorKind::InvalidData,
        format!(
            "the daemon's answer to {call} on the fd socket carried {what}; is graphpoold older than this client?"
        ),
    ))
}

fn recvmsg(stream: &StdUnixStream, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    use std::os::fd::AsRawFd;
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() };
    let mut cbuf = [0u64; 8];
    // SAFETY: zeroed msghdr is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    // SAFETY: all pointers in `msg` are valid for the call; MSG_CMSG_CLOEXEC marks received fds.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fd = None;
    // SAFETY: iterating the control messages the kernel wrote into `cbuf`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let raw = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const i32);
                fd = Some(OwnedFd::from_raw_fd(raw));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n as usize, fd))
}
