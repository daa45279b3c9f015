//! One daemon session per device: the Attach stream (read by a task of the shim's runtime),
//! segment requests, fd fetches, mappings, and their release.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use graphpool_proto::v1::graphpool_client::GraphpoolClient;
use graphpool_proto::v1::{
    AllocateSegmentRequest, AttachRequest, DetachRequest, ReleaseSegmentRequest, session_event,
};
use hyper_util::rt::TokioIo;
use tokio::runtime::Handle;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::error::ShimError;
use crate::fdsock::FdConn;
use crate::map::Mapping;

/// Label of the segments the shim asks for.
pub const LABEL: &str = "capture-pool";

/// What a session is opened with.
#[derive(Debug, Clone)]
pub struct AttachParams {
    /// The daemon's gRPC socket.
    pub socket: PathBuf,
    /// Job id.
    pub job_id: String,
    /// Global rank.
    pub rank: u32,
    /// Rank on the node.
    pub local_rank: u32,
    /// CUDA device index in this process (what torch passes to alloc).
    pub device: i32,
    /// The device as the daemon knows it (UUID or index).
    pub daemon_device: String,
    /// Session budget, bytes (0 = none).
    pub budget_bytes: u64,
    /// Reserve the whole budget at attach.
    pub reserve_budget: bool,
}

/// Phases of the last segment request, nanoseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timing {
    /// AllocateSegment RPC.
    pub rpc_ns: u64,
    /// fd fetch on the fd socket.
    pub fd_ns: u64,
    /// Import and map (CUDA) or mmap (host).
    pub map_ns: u64,
    /// Whole request.
    pub total_ns: u64,
}

#[derive(Debug)]
struct Live {
    grant_id: u64,
    mapping: Mapping,
}

/// A session with the daemon for one device.
#[derive(Debug)]
pub struct Session {
    /// CUDA device index in this process.
    pub device: i32,
    /// The daemon's session id.
    pub session_id: u64,
    /// UUID of the device, as the daemon reported it.
    pub device_uuid: String,
    /// Bytes the daemon reserved for the session at attach.
    pub reserved_bytes: u64,
    /// The budget asked for.
    pub budget_bytes: u64,
    client: GraphpoolClient<Channel>,
    rt: Handle,
    fd_socket: PathBuf,
    fd_conn: Mutex<Option<FdConn>>,
    ended: Arc<Mutex<Option<String>>>,
    live: Mutex<HashMap<usize, Live>>,
    granted: AtomicU64,
    stream_task: tokio::task::JoinHandle<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Opens a gRPC channel to the daemon's Unix socket.
pub async fn connect(socket: &Path) -> Result<GraphpoolClient<Channel>, ShimError> {
    let path = socket.to_path_buf();
    let channel = Endpoint::try_from("http://[::]:50051")
        .map_err(|e| ShimError::Connect(e.to_string()))?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
        .map_err(|e| ShimError::Connect(format!("{}: {e}", socket.display())))?;
    Ok(GraphpoolClient::new(channel).max_decoding_message_size(64 << 20))
}

impl Session {
    /// Attaches: connects, opens the Attach stream, waits for `attached`, and leaves a task
    /// reading the stream for as long as the session lives.
    pub fn attach(rt: &Handle, p: &AttachParams) -> Result<Session, ShimError> {
        let (client, attached, stream_task, ended) = rt.block_on(async {
            let mut client = connect(&p.socket).await?;
            let req = AttachRequest {
                job_id: p.job_id.clone(),
                rank: p.rank,
                local_rank: p.local_rank,
                device: p.daemon_device.clone(),
                resume: Vec::new(),
                client: format!("graphpool-shim/{}", env!("CARGO_PKG_VERSION")),
                budget_bytes: p.budget_bytes,
                reserve_budget: p.reserve_budget,
            };
            let mut stream =
                client.attach(req).await.map_err(|s| ShimError::from_status("Attach", &s))?.into_inner();
            let first = stream.message().await.map_err(|s| ShimError::from_status("Attach", &s))?;
            let attached = match first.and_then(|e| e.event) {
                Some(session_event::Event::Attached(a)) => a,
                other => {
                    return Err(ShimError::SessionEnded(format!(
                        "the Attach stream's first event was {other:?}, not `attached`"
                    )));
                }
            };
            let ended = Arc::new(Mutex::new(None));
            let ended_task = ended.clone();
            let task = tokio::spawn(async move {
                let why = loop {
                    match stream.message().await {
                        Ok(Some(ev)) => {
                            if let Some(session_event::Event::Draining(d)) = ev.event {
                                *lock(&ended_task) = Some(format!(
                                    "the daemon is draining (ends in {:.1} s)",
                                    d.drain_seconds
                                ));
                            }
                        }
                        Ok(None) => break "the daemon closed the session stream".to_string(),
                        Err(s) => break format!("session stream error: {} {}", s.code(), s.message()),
                    }
                };
                *lock(&ended_task) = Some(why);
            });
            Ok::<_, ShimError>((client, attached, task, ended))
        })?;
        let device_uuid = attached.device.as_ref().map(|d| d.uuid.clone()).unwrap_or_default();
        Ok(Session {
            device: p.device,
            session_id: attached.session_id,
            device_uuid,
            reserved_bytes: attached.reserved_bytes,
            budget_bytes: p.budget_bytes,
            client,
            rt: rt.clone(),
            fd_socket: PathBuf::from(attached.fd_socket),
            fd_conn: Mutex::new(None),
            ended,
            live: Mutex::new(HashMap::new()),
            granted: AtomicU64::new(0),
            stream_task,
        })
    }

    /// Bytes granted and mapped now, and the number of segments.
    pub fn stats(&self) -> (u64, u64) {
        (self.granted.load(Ordering::Relaxed), lock(&self.live).len() as u64)
    }

    /// Whether the session has live segments.
    pub fn has_segments(&self) -> bool {
        !lock(&self.live).is_empty()
    }

    /// Asks the daemon for a segment of at least `size` bytes, fetches and maps it.
    pub fn allocate(&self, size: u64) -> Result<(usize, Timing), ShimError> {
        if let Some(why) = lock(&self.ended).clone() {
            return Err(ShimError::SessionEnded(why));
        }
        let t0 = Instant::now();
        let mut client = self.client.clone();
        let req =
            AllocateSegmentRequest { session_id: self.session_id, size_bytes: size, label: LABEL.into() };
        let grant = self
            .rt
            .block_on(client.allocate_segment(req))
            .map_err(|s| ShimError::from_status("AllocateSegment", &s))?
            .into_inner();
        let t1 = Instant::now();
        let fetched = {
            let mut conn = lock(&self.fd_conn);
            if conn.is_none() {
                *conn = Some(FdConn::connect(&self.fd_socket)?);
            }
            let r = conn.as_mut().map(|c| c.fetch(self.session_id, grant.grant_id));
            match r {
                Some(Ok(x)) => Ok(x),
                Some(Err(e)) => {
                    // A broken connection is reopened on the next request.
                    if matches!(e, ShimError::Fd(_)) {
                        *conn = None;
                    }
                    Err(e)
                }
                None => Err(ShimError::Fd("no fd connection".into())),
            }
        };
        let (fd, resp) = match fetched {
            Ok(x) => x,
            Err(e) => {
                self.release_grant(grant.grant_id);
                return Err(e);
            }
        };
        let t2 = Instant::now();
        let kind =
            if resp.handle_kind.is_empty() { grant.handle_kind.as_str() } else { resp.handle_kind.as_str() };
        let mapping = match Mapping::map(kind, fd, grant.size_bytes, self.device) {
            Ok(m) => m,
            Err(e) => {
                self.release_grant(grant.grant_id);
                return Err(e);
            }
        };
        let t3 = Instant::now();
        let ptr = mapping.ptr();
        self.granted.fetch_add(grant.size_bytes, Ordering::Relaxed);
        lock(&self.live).insert(ptr, Live { grant_id: grant.grant_id, mapping });
        let ns = |a: Instant, b: Instant| (b - a).as_nanos() as u64;
        Ok((ptr, Timing { rpc_ns: ns(t0, t1), fd_ns: ns(t1, t2), map_ns: ns(t2, t3), total_ns: ns(t0, t3) }))
    }

    /// Whether `ptr` is a segment of this session.
    pub fn owns(&self, ptr: usize) -> bool {
        lock(&self.live).contains_key(&ptr)
    }

    /// Unmaps the segment at `ptr` and releases its grant.
    pub fn free(&self, ptr: usize) -> Result<(), ShimError> {
        let live = lock(&self.live).remove(&ptr).ok_or_else(|| {
            ShimError::Invalid(format!("free of {ptr:#x}, which is not a graphpool segment"))
        })?;
        let size = live.mapping.size() as u64;
        let unmapped = live.mapping.unmap();
        self.granted.fetch_sub(size, Ordering::Relaxed);
        let released = self.release(live.grant_id);
        unmapped.and(released)
    }

    fn release(&self, grant_id: u64) -> Result<(), ShimError> {
        if lock(&self.ended).is_some() {
            // The daemon already released everything of the session.
            return Ok(());
        }
        let mut client = self.client.clone();
        self.rt
            .block_on(client.release_segment(ReleaseSegmentRequest { session_id: self.session_id, grant_id }))
            .map(|_| ())
            .map_err(|s| ShimError::from_status("ReleaseSegment", &s))
    }

    fn release_grant(&self, grant_id: u64) {
        let _ = self.release(grant_id);
    }

    /// Ends the session (Detach). Segments still mapped stay mapped in this process (the
    /// memory stays valid) but the daemon no longer accounts for them.
    pub fn detach(&self) -> Result<(), ShimError> {
        let mut client = self.client.clone();
        let r = if lock(&self.ended).is_none() {
            self.rt
                .block_on(client.detach(DetachRequest { session_id: self.session_id }))
                .map(|_| ())
                .map_err(|s| ShimError::from_status("Detach", &s))
        } else {
            Ok(())
        };
        self.stream_task.abort();
        *lock(&self.ended) = Some("detached".to_string());
        r
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Closing the Attach stream ends the session on the daemon's side.
        self.stream_task.abort();
    }
}
