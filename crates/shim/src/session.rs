//! One daemon session per device: the Attach stream (read by a task of the shim's runtime),
//! segment requests, fd fetches, mappings, and their release.
//!
//! # Daemon restarts
//!
//! graphpoold may be killed or restarted while this process has segments mapped. The memory
//! stays valid (a memfd or CUDA VMM mapping outlives the exporter), and the session's task
//! recovers the accounting on its own:
//!
//! 1. When the Attach stream ends and the shim did not end it itself (`Detach`), the daemon
//!    went away: crashed, killed, or shut down after `Draining` (a drain also means the daemon
//!    is about to restart). The session becomes *reconnecting*.
//! 2. The task reconnects with exponential backoff (first attempt at once, then 50 ms doubling
//!    up to `GRAPHPOOL_RECONNECT_MAX_BACKOFF` seconds, default 2) for at most
//!    `GRAPHPOOL_RECONNECT_DEADLINE` seconds (default 600), each attempt on a fresh connection
//!    and given at most the attempt timeout (10 s) to answer.
//!    While nothing listens on the socket, a cheap connect probe every 20 ms ends the wait as
//!    soon as a new daemon listens, so recovery is not delayed by the backoff.
//! 3. It re-attaches with the same job, rank, local rank, budget and reservation, on the device
//!    by UUID, declaring in `AttachRequest.resume` every segment it still has mapped (its own
//!    table of live allocations: grant id, size, label). The new daemon adopts them: its usage
//!    equals what the old daemon had. The adopted set is checked; a declared grant the daemon
//!    did not adopt stays mapped but is no longer accounted (its free skips the daemon).
//! 4. The new session id and fd socket are swapped in; the next request uses them.
//!
//! While reconnecting, `graphpool_alloc` fails at once with a last-error of kind
//! `unavailable` and `"restarting": true` (torch raises its out-of-memory error, which
//! `graphpool.torch` turns into `graphpool.DaemonUnavailable`). A free while reconnecting
//! unmaps locally and drops the segment from the table, so it is simply **not declared** on
//! re-attach: the memory is already gone, and the new daemon never hears of the grant. This is
//! simpler and more exact than queueing `ReleaseSegment` calls for a daemon that does not know
//! the grant yet (there is no window in which the new daemon over-counts). A free that races
//! with an Attach already in flight (the segment was declared, then freed) is released on the
//! new session right after it attaches. Allocations hold a gate that the re-attach takes
//! exclusively while it snapshots the table, so a segment granted by the dying daemon is either
//! in the table when it is declared or its request failed.
//!
//! When the deadline passes, or the daemon refuses the re-attach for good (invalid argument,
//! permission denied), the session ends: allocations fail with `session-ended`; mapped
//! segments stay valid and their frees are local.
//!
//! # Timeouts
//!
//! Nothing the shim asks the daemon waits longer than the policy's attempt timeout (10 s):
//! the first Attach, each re-attach attempt, Detach, and each read or write on the fd socket
//! (a segment request or release). A daemon that stopped answering (stopped, wedged) fails the
//! call with kind `unavailable`; the fd connection is then dropped and the next call opens one.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use graphpool_proto::v1::graphpool_client::GraphpoolClient;
use graphpool_proto::v1::{
    AllocateSegmentRequest, AttachRequest, Attached, DetachRequest, HeldGrant, ReleaseSegmentRequest,
    SessionEvent, session_event,
};
use hyper_util::rt::TokioIo;
use tokio::runtime::Handle;
use tonic::Streaming;
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

/// How a session re-attaches after the daemon went away.
#[derive(Debug, Clone, Copy)]
pub struct ReconnectPolicy {
    /// Wait before the second attempt (the first is immediate).
    pub initial_backoff: Duration,
    /// Cap of the exponential backoff.
    pub max_backoff: Duration,
    /// Give up (the session ends) this long after the stream ended.
    pub deadline: Duration,
    /// How long one attempt may wait for the `attached` event.
    pub attempt_timeout: Duration,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        ReconnectPolicy {
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            deadline: Duration::from_secs(600),
            attempt_timeout: Duration::from_secs(10),
        }
    }
}

impl ReconnectPolicy {
    /// The default, with `GRAPHPOOL_RECONNECT_DEADLINE` and `GRAPHPOOL_RECONNECT_MAX_BACKOFF`
    /// (seconds, decimals allowed) applied when set and not empty. A value that is not a
    /// duration in seconds (not a number, negative, not finite, too large) is an error naming
    /// the variable.
    pub fn from_env() -> Result<Self, ShimError> {
        Self::from_vars(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// [`ReconnectPolicy::from_env`] with the variables read by `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, ShimError> {
        let secs = |name: &str| -> Result<Option<Duration>, ShimError> {
            let Some(v) = var(name).filter(|v| !v.trim().is_empty()) else { return Ok(None) };
            let v = v.trim();
            v.parse::<f64>().ok().and_then(|x| Duration::try_from_secs_f64(x).ok()).map(Some).ok_or_else(
                || {
                    ShimError::Invalid(format!(
                        "{name}={v:?} is not a duration in seconds (a number, 0 or more, decimals allowed)"
                    ))
                },
            )
        };
        let mut p = ReconnectPolicy::default();
        if let Some(d) = secs("GRAPHPOOL_RECONNECT_DEADLINE")? {
            p.deadline = d;
        }
        if let Some(d) = secs("GRAPHPOOL_RECONNECT_MAX_BACKOFF")? {
            p.max_backoff = d;
        }
        Ok(p)
    }
}

/// Phases of the last segment request, nanoseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timing {
    /// AllocateSegment on the fd socket's fast path, the fd included.
    pub rpc_ns: u64,
    /// A separate fd fetch: 0 since the fd comes with the grant (kept for the C ABI).
    pub fd_ns: u64,
    /// Import and map (CUDA) or mmap (host).
    pub map_ns: u64,
    /// Whole request.
    pub total_ns: u64,
}

/// Where a session stands with the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkState {
    /// Open in a daemon.
    Attached = 0,
    /// The daemon went away; re-attaching.
    Reconnecting = 1,
    /// Ended (detached, refused, or the reconnect deadline passed).
    Ended = 2,
}

#[derive(Debug)]
enum State {
    Attached,
    Reconnecting { since: Instant, last_error: String },
    Ended(String),
}

#[derive(Debug)]
struct Live {
    grant_id: u64,
    size: u64,
    label: String,
    mapping: Mapping,
}

/// The daemon connection the session uses now (replaced on re-attach).
#[derive(Debug, Clone)]
struct Link {
    client: GraphpoolClient<Channel>,
    session_id: u64,
    fd_socket: PathBuf,
    daemon_instance: String,
    reserved_bytes: u64,
}

#[derive(Debug)]
struct Inner {
    params: AttachParams,
    device_uuid: String,
    policy: ReconnectPolicy,
    link: Mutex<Link>,
    state: Mutex<State>,
    fd_conn: Mutex<Option<FdConn>>,
    live: Mutex<HashMap<usize, Live>>,
    /// Declared grants the last re-attach did not get adopted: freed locally only.
    unadopted: Mutex<HashSet<u64>>,
    /// Held shared by allocations, exclusively by the re-attach while it snapshots `live`.
    gate: tokio::sync::RwLock<()>,
    granted: AtomicU64,
    /// Set when the shim ends the session itself (by `end_if_empty` under `state`'s lock, or
    /// on drop).
    detached: AtomicBool,
    /// End the session once its last segment is freed (see `graphpool_shim_release_device`).
    close_when_empty: AtomicBool,
    reattaches: AtomicU64,
    last_recovery_ns: AtomicU64,
}

/// A session with the daemon for one device.
#[derive(Debug)]
pub struct Session {
    /// CUDA device index in this process.
    pub device: i32,
    /// UUID of the device, as the daemon reported it.
    pub device_uuid: String,
    /// The budget asked for.
    pub budget_bytes: u64,
    inner: Arc<Inner>,
    rt: Handle,
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

/// Connects, opens the Attach stream and waits for `attached`.
async fn attach_once(
    p: &AttachParams,
    device: &str,
    resume: Vec<HeldGrant>,
) -> Result<(GraphpoolClient<Channel>, Attached, Streaming<SessionEvent>), ShimError> {
    let mut client = connect(&p.socket).await?;
    let req = AttachRequest {
        job_id: p.job_id.clone(),
        rank: p.rank,
        local_rank: p.local_rank,
        device: device.to_string(),
        resume,
        client: format!("graphpool-shim/{}", env!("CARGO_PKG_VERSION")),
        budget_bytes: p.budget_bytes,
        reserve_budget: p.reserve_budget,
    };
    let mut stream = client.attach(req).await.map_err(|s| ShimError::from_status("Attach", &s))?.into_inner();
    let first = stream.message().await.map_err(|s| ShimError::from_status("Attach", &s))?;
    match first.and_then(|e| e.event) {
        Some(session_event::Event::Attached(a)) => Ok((client, a, stream)),
        other => Err(ShimError::SessionEnded(format!(
            "the Attach stream's first event was {other:?}, not `attached`"
        ))),
    }
}

impl Session {
    /// Attaches: connects, opens the Attach stream, waits for `attached`, and leaves a task
    /// reading the stream (and re-attaching after a daemon restart) for as long as the
    /// session lives.
    pub fn attach(rt: &Handle, p: &AttachParams) -> Result<Session, ShimError> {
        Self::attach_with(rt, p, ReconnectPolicy::from_env()?)
    }

    /// [`Session::attach`] with an explicit reconnect policy. The daemon has the policy's
    /// attempt timeout to answer with `attached`.
    pub fn attach_with(rt: &Handle, p: &AttachParams, policy: ReconnectPolicy) -> Result<Session, ShimError> {
        let t = policy.attempt_timeout;
        let what = format!("Attach on {}", p.socket.display());
        let (client, attached, stream) =
            rt.block_on(answered_within(t, &what, attach_once(p, &p.daemon_device, Vec::new())))?;
        let device_uuid = attached.device.as_ref().map(|d| d.uuid.clone()).unwrap_or_default();
        let inner = Arc::new(Inner {
            params: p.clone(),
            device_uuid: device_uuid.clone(),
            policy,
            link: Mutex::new(Link {
                client,
                session_id: attached.session_id,
                fd_socket: PathBuf::from(attached.fd_socket),
                daemon_instance: attached.daemon_instance,
                reserved_bytes: attached.reserved_bytes,
            }),
            state: Mutex::new(State::Attached),
            fd_conn: Mutex::new(None),
            live: Mutex::new(HashMap::new()),
            unadopted: Mutex::new(HashSet::new()),
            gate: tokio::sync::RwLock::new(()),
            granted: AtomicU64::new(0),
            detached: AtomicBool::new(false),
            close_when_empty: AtomicBool::new(false),
            reattaches: AtomicU64::new(0),
            last_recovery_ns: AtomicU64::new(0),
        });
        let stream_task = rt.spawn(serve(inner.clone(), stream));
        Ok(Session {
            device: p.device,
            device_uuid,
            budget_bytes: p.budget_bytes,
            inner,
            rt: rt.clone(),
            stream_task,
        })
    }

    /// The daemon's id of the session now (changes on re-attach).
    pub fn session_id(&self) -> u64 {
        lock(&self.inner.link).session_id
    }

    /// Bytes the daemon reserved for the session at the last (re-)attach.
    pub fn reserved_bytes(&self) -> u64 {
        lock(&self.inner.link).reserved_bytes
    }

    /// The daemon instance the session is attached to.
    pub fn daemon_instance(&self) -> String {
        lock(&self.inner.link).daemon_instance.clone()
    }

    /// Where the session stands, how many times it re-attached, and how long the last
    /// re-attach took (from the end of the old stream to `attached`, nanoseconds).
    pub fn link_state(&self) -> (LinkState, u64, u64) {
        let s = match &*lock(&self.inner.state) {
            State::Attached => LinkState::Attached,
            State::Reconnecting { .. } => LinkState::Reconnecting,
            State::Ended(_) => LinkState::Ended,
        };
        (
            s,
            self.inner.reattaches.load(Ordering::Relaxed),
            self.inner.last_recovery_ns.load(Ordering::Relaxed),
        )
    }

    /// Bytes granted and mapped now, and the number of segments.
    pub fn stats(&self) -> (u64, u64) {
        (self.inner.granted.load(Ordering::Relaxed), lock(&self.inner.live).len() as u64)
    }

    /// Whether the session has live segments.
    pub fn has_segments(&self) -> bool {
        !lock(&self.inner.live).is_empty()
    }

    /// Whether the session ended (detached, refused, or the reconnect deadline passed): it
    /// grants nothing more.
    pub fn is_ended(&self) -> bool {
        matches!(&*lock(&self.inner.state), State::Ended(_))
    }

    /// Asks that the session be ended once its last segment is freed (`true`), or no longer.
    /// The shim's C ABI acts on it (`graphpool_shim_release_device`, `graphpool_free`).
    pub fn set_close_when_empty(&self, close: bool) {
        self.inner.close_when_empty.store(close, Ordering::SeqCst);
    }

    /// Whether the session is to be ended once its last segment is freed.
    pub fn close_when_empty(&self) -> bool {
        self.inner.close_when_empty.load(Ordering::SeqCst)
    }

    /// Fails unless the session is attached now.
    fn check_attached(&self) -> Result<(), ShimError> {
        match &*lock(&self.inner.state) {
            State::Attached => Ok(()),
            State::Reconnecting { since, last_error } => Err(ShimError::Restarting {
                device: self.device,
                for_ms: since.elapsed().as_millis() as u64,
                deadline_s: self.inner.policy.deadline.as_secs(),
                last_error: last_error.clone(),
            }),
            State::Ended(why) => Err(ShimError::SessionEnded(why.clone())),
        }
    }

    /// Asks the daemon for a segment of at least `size` bytes, fetches and maps it.
    pub fn allocate(&self, size: u64) -> Result<(usize, Timing), ShimError> {
        self.check_attached()?;
        // Shared with other allocations; the re-attach takes it exclusively to snapshot.
        let _gate = self.inner.gate.blocking_read();
        self.check_attached()?;
        let link = lock(&self.inner.link).clone();
        let t0 = Instant::now();
        let req =
            AllocateSegmentRequest { session_id: link.session_id, size_bytes: size, label: LABEL.into() };
        // The fast path: the grant and its fd in one round trip on the fd socket.
        let (grant, fd) = self.fd_call(&link, |c| c.allocate(req))?;
        let t1 = Instant::now();
        // A grant that came without its fd, or smaller than asked, is charged but unusable.
        let fd = match fd.and_then(|fd| check_grant(size, &grant).map(|()| fd)) {
            Ok(fd) => fd,
            Err(e) => {
                self.release_grant(&link, grant.grant_id);
                return Err(e);
            }
        };
        // The fd came with the grant: no separate fetch.
        let t2 = t1;
        let mapping = match Mapping::map(&grant.handle_kind, fd, grant.size_bytes, self.device) {
            Ok(m) => m,
            Err(e) => {
                self.release_grant(&link, grant.grant_id);
                return Err(e);
            }
        };
        let t3 = Instant::now();
        let ptr = mapping.ptr();
        self.inner.granted.fetch_add(grant.size_bytes, Ordering::Relaxed);
        lock(&self.inner.live).insert(
            ptr,
            Live { grant_id: grant.grant_id, size: grant.size_bytes, label: grant.label, mapping },
        );
        let ns = |a: Instant, b: Instant| (b - a).as_nanos() as u64;
        Ok((ptr, Timing { rpc_ns: ns(t0, t1), fd_ns: ns(t1, t2), map_ns: ns(t2, t3), total_ns: ns(t0, t3) }))
    }

    /// Whether `ptr` is a segment of this session.
    pub fn owns(&self, ptr: usize) -> bool {
        lock(&self.inner.live).contains_key(&ptr)
    }

    /// Unmaps the segment at `ptr` and releases its grant. While the daemon is away the
    /// release is local only: the segment left the table, so it is not declared on re-attach.
    pub fn free(&self, ptr: usize) -> Result<(), ShimError> {
        let live = lock(&self.inner.live).remove(&ptr).ok_or_else(|| {
            ShimError::Invalid(format!("free of {ptr:#x}, which is not a graphpool segment"))
        })?;
        let unmapped = live.mapping.unmap();
        self.inner.granted.fetch_sub(live.size, Ordering::Relaxed);
        if lock(&self.inner.unadopted).remove(&live.grant_id) {
            return unmapped;
        }
        if !matches!(&*lock(&self.inner.state), State::Attached) {
            // Reconnecting: not declared (or released right after the re-attach). Ended: the
            // daemon released everything of the session.
            return unmapped;
        }
        let link = lock(&self.inner.link).clone();
        let released = self.release(&link, live.grant_id);
        let released = match released {
            // The daemon died under the call: the grant is not in the table, so it will not
            // be declared to the next daemon.
            Err(
                ShimError::Daemon { code: tonic::Code::Unavailable | tonic::Code::Unknown, .. }
                | ShimError::Connect(_)
                | ShimError::Restarting { .. }
                | ShimError::SessionEnded(_),
            ) if !matches!(&*lock(&self.inner.state), State::Attached) => Ok(()),
            r => r,
        };
        unmapped.and(released)
    }

    fn release(&self, link: &Link, grant_id: u64) -> Result<(), ShimError> {
        self.fd_call(link, |c| c.release(link.session_id, grant_id))
    }

    /// Runs `f` on the session's fd-socket connection (the fast path of the segment calls),
    /// opening the connection first if needed. A broken connection is dropped, so that the
    /// next call opens a new one, and reported as the daemon being unreachable (or, once the
    /// session noticed, as the restart it is).
    fn fd_call<T>(
        &self,
        link: &Link,
        f: impl FnOnce(&mut FdConn) -> Result<T, ShimError>,
    ) -> Result<T, ShimError> {
        let mut conn = lock(&self.inner.fd_conn);
        let r = match &mut *conn {
            Some(c) => f(c),
            None => FdConn::connect(&link.fd_socket, self.inner.policy.attempt_timeout)
                .and_then(|c| f(conn.insert(c))),
        };
        match r {
            Err(ShimError::Fd(m)) => {
                *conn = None;
                drop(conn);
                let e = ShimError::Connect(format!("fd socket {}: {m}", link.fd_socket.display()));
                Err(self.check_attached().err().unwrap_or(e))
            }
            r => r,
        }
    }

    fn release_grant(&self, link: &Link, grant_id: u64) {
        let _ = self.release(link, grant_id);
    }

    /// Ends the session (Detach) if it has no segment mapped; returns whether it did. With
    /// segments mapped it changes nothing (`Ok(false)`). [`Session::end_if_empty`] and
    /// [`Session::finish_detach`] in one.
    pub fn try_detach(&self) -> Result<bool, ShimError> {
        match self.end_if_empty() {
            Some(was_attached) => self.finish_detach(was_attached).map(|()| true),
            None => Ok(false),
        }
    }

    /// The first half of a detach: marks the session ended if it has no segment mapped, and
    /// returns whether it was attached (`None`, and nothing changed, with segments mapped).
    ///
    /// Exclusive with allocations: the check and the mark happen under the gate, so an
    /// allocation in flight either finished first (its segment is in the table: not ended)
    /// or fails with `session-ended`. Quick: it calls nothing.
    pub fn end_if_empty(&self) -> Option<bool> {
        let _gate = self.inner.gate.blocking_write();
        if self.has_segments() {
            return None;
        }
        let mut state = lock(&self.inner.state);
        self.inner.detached.store(true, Ordering::SeqCst);
        Some(matches!(std::mem::replace(&mut *state, State::Ended("detached".to_string())), State::Attached))
    }

    /// The second half: calls Detach when the session was attached (waiting at most the
    /// attempt timeout) and ends the session's task. An error of the call is returned, but
    /// the session is ended either way (its Attach stream closes, which ends it on the
    /// daemon's side too).
    pub fn finish_detach(&self, was_attached: bool) -> Result<(), ShimError> {
        let r = if was_attached {
            let link = lock(&self.inner.link).clone();
            let mut client = link.client.clone();
            let t = self.inner.policy.attempt_timeout;
            self.rt.block_on(answered_within(t, "Detach", async {
                let r = client.detach(DetachRequest { session_id: link.session_id }).await;
                r.map(|_| ()).map_err(|s| ShimError::from_status("Detach", &s))
            }))
        } else {
            Ok(())
        };
        self.stream_task.abort();
        r
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Closing the Attach stream ends the session on the daemon's side.
        self.inner.detached.store(true, Ordering::SeqCst);
        self.stream_task.abort();
    }
}

/// `call`, given at most `t` to answer; past it, a `Connect` error naming `what`.
async fn answered_within<T>(
    t: Duration,
    what: &str,
    call: impl std::future::Future<Output = Result<T, ShimError>>,
) -> Result<T, ShimError> {
    tokio::time::timeout(t, call)
        .await
        .unwrap_or_else(|_| Err(ShimError::Connect(format!("graphpoold did not answer {what} within {t:?}"))))
}

/// Refuses a grant smaller than the `size` bytes asked for.
fn check_grant(size: u64, grant: &graphpool_proto::v1::Grant) -> Result<(), ShimError> {
    if grant.size_bytes < size {
        return Err(ShimError::Protocol(format!(
            "grant {} is {} bytes, less than the {size} bytes asked for (it was released)",
            grant.grant_id, grant.size_bytes
        )));
    }
    Ok(())
}

/// Whether a stream that ended this way means the daemon went away (re-attach) rather than
/// a deliberate end of the session.
fn went_away(end: &Result<(), tonic::Status>, draining: bool) -> bool {
    draining
        || match end {
            Ok(()) => true,
            Err(s) => matches!(
                s.code(),
                tonic::Code::Unavailable
                    | tonic::Code::Unknown
                    | tonic::Code::Internal
                    | tonic::Code::Cancelled
                    | tonic::Code::Aborted
                    | tonic::Code::DeadlineExceeded
            ),
        }
}

/// The session's task: reads the stream; after the daemon went away, re-attaches and reads
/// the new stream.
async fn serve(inner: Arc<Inner>, mut stream: Streaming<SessionEvent>) {
    loop {
        let mut draining = false;
        let end = loop {
            match stream.message().await {
                Ok(Some(ev)) => {
                    if let Some(session_event::Event::Draining(_)) = ev.event {
                        draining = true;
                    }
                }
                Ok(None) => break Ok(()),
                Err(s) => break Err(s),
            }
        };
        let why = match &end {
            Ok(()) => "the daemon closed the session stream".to_string(),
            Err(s) => format!("session stream error: {} {}", s.code(), s.message()),
        };
        if inner.detached.load(Ordering::SeqCst) {
            *lock(&inner.state) = State::Ended("detached".to_string());
            return;
        }
        if !went_away(&end, draining) {
            *lock(&inner.state) = State::Ended(why);
            return;
        }
        match reattach(&inner, why).await {
            Some(s) => stream = s,
            None => return,
        }
    }
}

fn is_fatal(e: &ShimError) -> bool {
    matches!(
        e,
        ShimError::Daemon {
            code: tonic::Code::InvalidArgument
                | tonic::Code::PermissionDenied
                | tonic::Code::Unauthenticated
                | tonic::Code::Unimplemented,
            ..
        }
    )
}

/// Re-attaches with backoff, declaring the live segments; `None` when the session ended.
async fn reattach(inner: &Arc<Inner>, why: String) -> Option<Streaming<SessionEvent>> {
    let t0 = Instant::now();
    *lock(&inner.state) = State::Reconnecting { since: t0, last_error: why.clone() };
    let policy = inner.policy;
    let mut delay = Duration::ZERO;
    let mut next_delay = policy.initial_backoff;
    let mut unreachable = false;
    loop {
        // While nothing listens, end the wait as soon as a new daemon accepts connections.
        // Not past the deadline; saturating, as both come from the environment.
        let wait = delay.min(policy.deadline.saturating_sub(t0.elapsed()));
        let until = Instant::now().checked_add(wait);
        while until.is_none_or(|u| Instant::now() < u) {
            let step = until.map_or(wait, |u| u.saturating_duration_since(Instant::now()));
            tokio::time::sleep(if unreachable { step.min(Duration::from_millis(20)) } else { step }).await;
            if unreachable && tokio::net::UnixStream::connect(&inner.params.socket).await.is_ok() {
                break;
            }
        }
        if inner.detached.load(Ordering::SeqCst) {
            *lock(&inner.state) = State::Ended("detached".to_string());
            return None;
        }
        if t0.elapsed() > policy.deadline {
            let last = match &*lock(&inner.state) {
                State::Reconnecting { last_error, .. } => last_error.clone(),
                _ => String::new(),
            };
            *lock(&inner.state) = State::Ended(format!(
                "the daemon did not come back within {} s ({why}; last attempt: {last})",
                policy.deadline.as_secs_f64()
            ));
            return None;
        }
        delay = next_delay.min(policy.max_backoff);
        next_delay = next_delay.saturating_mul(2).min(policy.max_backoff);

        // The snapshot: no allocation is between its grant and its entry in the table.
        let declared: HashMap<u64, (u64, String)> = {
            let _gate = inner.gate.write().await;
            lock(&inner.live).values().map(|l| (l.grant_id, (l.size, l.label.clone()))).collect()
        };
        let resume = declared
            .iter()
            .map(|(&grant_id, (size, label))| HeldGrant {
                grant_id,
                device_uuid: inner.device_uuid.clone(),
                size_bytes: *size,
                label: label.clone(),
            })
            .collect();
        let device =
            if inner.device_uuid.is_empty() { &inner.params.daemon_device } else { &inner.device_uuid };
        let attempt =
            tokio::time::timeout(policy.attempt_timeout, attach_once(&inner.params, device, resume)).await;
        let (client, attached, stream) = match attempt {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => {
                unreachable = matches!(e, ShimError::Connect(_));
                if is_fatal(&e) {
                    *lock(&inner.state) =
                        State::Ended(format!("re-attaching after a daemon restart was refused: {e}"));
                    return None;
                }
                if let State::Reconnecting { last_error, .. } = &mut *lock(&inner.state) {
                    *last_error = e.to_string();
                }
                continue;
            }
            Err(_) => {
                unreachable = false;
                if let State::Reconnecting { last_error, .. } = &mut *lock(&inner.state) {
                    *last_error = format!("no `attached` within {:?}", policy.attempt_timeout);
                }
                continue;
            }
        };
        if inner.detached.load(Ordering::SeqCst) {
            *lock(&inner.state) = State::Ended("detached".to_string());
            return None; // dropping the stream ends the new session
        }
        // Check what the daemon adopted.
        let adopted: HashSet<u64> = attached
            .adopted
            .iter()
            .filter(|g| declared.get(&g.grant_id).is_some_and(|(size, _)| *size == g.size_bytes))
            .map(|g| g.grant_id)
            .collect();
        let unadopted: Vec<u64> = declared.keys().copied().filter(|id| !adopted.contains(id)).collect();
        if !unadopted.is_empty() {
            let _ = writeln!(
                std::io::stderr(),
                "graphpool shim: the restarted daemon did not adopt grants {unadopted:?}; they stay \
                 mapped but are no longer accounted"
            );
        }
        let link = Link {
            client,
            session_id: attached.session_id,
            fd_socket: PathBuf::from(attached.fd_socket),
            daemon_instance: attached.daemon_instance,
            reserved_bytes: attached.reserved_bytes,
        };
        *lock(&inner.link) = link.clone();
        *lock(&inner.fd_conn) = None;
        {
            let live = lock(&inner.live);
            let mut u = lock(&inner.unadopted);
            for id in &unadopted {
                if live.values().any(|l| l.grant_id == *id) {
                    u.insert(*id);
                }
            }
        }
        {
            // Under the state's lock, with which try_detach marks the end: a session detached
            // meanwhile is not shown as attached (its task is being aborted).
            let mut state = lock(&inner.state);
            if inner.detached.load(Ordering::SeqCst) {
                *state = State::Ended("detached".to_string());
                return None;
            }
            *state = State::Attached;
        }
        // Freed after the snapshot, before the state changed: declared and adopted, so
        // release them now (a free after the change released them itself; NOT_FOUND then).
        let late: Vec<u64> = {
            let live = lock(&inner.live);
            let ids: HashSet<u64> = live.values().map(|l| l.grant_id).collect();
            adopted.iter().copied().filter(|id| !ids.contains(id)).collect()
        };
        for grant_id in late {
            let mut c = link.client.clone();
            let _ = c.release_segment(ReleaseSegmentRequest { session_id: link.session_id, grant_id }).await;
        }
        inner.reattaches.fetch_add(1, Ordering::Relaxed);
        inner.last_recovery_ns.store(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        return Some(stream);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(vars: &[(&str, &str)]) -> Result<ReconnectPolicy, ShimError> {
        ReconnectPolicy::from_vars(|name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn reconnect_variables_are_checked() {
        let p = policy(&[("GRAPHPOOL_RECONNECT_DEADLINE", " 1.5 "), ("GRAPHPOOL_RECONNECT_MAX_BACKOFF", "")])
            .unwrap();
        assert_eq!(p.deadline, Duration::from_millis(1500));
        assert_eq!(p.max_backoff, ReconnectPolicy::default().max_backoff);
        for bad in ["-1", "NaN", "inf", "1e300", "soon"] {
            for name in ["GRAPHPOOL_RECONNECT_DEADLINE", "GRAPHPOOL_RECONNECT_MAX_BACKOFF"] {
                let e = policy(&[(name, bad)]).unwrap_err().to_string();
                assert!(e.contains(name) && e.contains(bad), "{e}");
            }
        }
    }

    #[test]
    fn a_grant_smaller_than_asked_is_refused() {
        let grant = |size_bytes| graphpool_proto::v1::Grant { grant_id: 7, size_bytes, ..Default::default() };
        assert!(check_grant(4 << 20, &grant(4 << 20)).is_ok());
        assert!(check_grant(3 << 20, &grant(4 << 20)).is_ok());
        let e = check_grant(4 << 20, &grant(2 << 20)).unwrap_err();
        assert_eq!(e.kind(), "protocol");
        assert!(e.to_string().contains("grant 7"), "{e}");
    }
}
