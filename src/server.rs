//! The serve loop: sockets, services, metrics, readiness, signals and the drain.

use std::ffi::CString;
use std::future::Future;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use graphpool_proto::v1 as pb;
use graphpool_proto::v1::admin_server::AdminServer;
use graphpool_proto::v1::graphpool_server::GraphpoolServer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{SignalKind, signal};
use tokio_stream::Stream;
use tonic::transport::server::{Connected, UdsConnectInfo};

use crate::config::{AccessConfig, Config};
use crate::conn_limit::{ConnLimit, Slot, Warnings, per_uid_cap};
use crate::error::DaemonError;
use crate::ledger::{EndReason, Ledger};
use crate::metrics::Metrics;
use crate::service::Shared;
use crate::service::admin::AdminService;
use crate::service::graphpool::{GraphpoolService, PlanLimits};
use crate::service::segments::Transport;
use crate::service::sessions::SessionRegistry;
use crate::shutdown::Shutdown;

/// Runs the daemon until SIGTERM or SIGINT, then drains and returns.
pub async fn run(config: Config) -> Result<(), DaemonError> {
    match crate::fd_limit::raise_open_file_limit() {
        Ok((_, after)) if after < crate::fd_limit::LOW_OPEN_FILE_LIMIT => tracing::warn!(
            limit = after,
            "the open-file limit is {after}: each segment held for a rank and each connection take an \
             fd, so a node's ranks can exhaust it; raise the hard limit (LimitNOFILE= in the \
             systemd unit, the container runtime's nofile ulimit)"
        ),
        Ok((before, after)) if after > before => tracing::info!(before, after, "open-file limit raised"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "could not read or raise the open-file limit"),
    }
    let node_cores = crate::config::node_cores();
    if config.plan_cores > node_cores {
        tracing::warn!(
            plan_cores = config.plan_cores,
            node_cores,
            "plan_cores is {} but this process may use {node_cores} cores: plans that run together \
             then share cores and may end past their time budget; set plan_cores to at most \
             {node_cores}, or leave it out for every core",
            config.plan_cores
        );
    }
    let backend = crate::backend::open(&config)?;
    for d in backend.devices() {
        tracing::info!(
            backend = %backend.kind(), index = d.index, uuid = %d.uuid, name = %d.name,
            total = d.total_bytes, capacity = backend.capacity_bytes(d.index).unwrap_or(0),
            granularity = d.granularity_bytes, "device"
        );
    }
    let ledger = Arc::new(Ledger::new(backend.clone(), &config.limits, config.guards.clone())?);
    let metrics = Metrics::new(backend.kind().as_str());
    metrics.start_counters(backend.devices());
    let shutdown = Shutdown::new();
    let sessions = Arc::new(SessionRegistry::default());
    let shared =
        Shared { ledger: ledger.clone(), metrics: metrics.clone(), access: config.access.clone(), sessions };

    let grpc_listener = bind_socket(&config.socket, &config)?;
    let fd_listener = bind_socket(&config.fd_socket, &config)?;

    let metrics_task = match config.metrics_listen {
        Some(addr) => {
            let l =
                crate::metrics::bind(addr).await.map_err(|source| DaemonError::Metrics { addr, source })?;
            tracing::info!(%addr, "metrics at http://{addr}/metrics");
            Some(tokio::spawn(crate::metrics::serve(l, metrics.clone(), ledger.clone(), shutdown.clone())))
        }
        None => None,
    };
    let fd_task = tokio::spawn(crate::fd_broker::serve(fd_listener, shared.clone(), shutdown.clone()));

    tokio::spawn(housekeeping(metrics.clone(), shutdown.clone()));

    let instance = format!("{:016x}", rand::random::<u64>());
    let max_msg = config.guards.max_message_bytes;
    let plans = PlanLimits {
        time_budget: config.plan_time_budget,
        max_buffers: config.guards.max_plan_buffers,
        max_response_bytes: max_msg,
        cores: config.plan_cores,
    };
    let service = GraphpoolService::new(
        shared.clone(),
        config.fd_socket.display().to_string(),
        instance.clone(),
        plans,
    );
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<GraphpoolServer<GraphpoolService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(graphpool_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| DaemonError::Serve(e.to_string()))?;

    let grpc_shutdown = shutdown.clone();
    let incoming = GrpcIncoming {
        listener: grpc_listener,
        access: config.access.clone(),
        limit: ConnLimit::new(Transport::Grpc, per_uid_cap(&config.guards)),
        metrics: metrics.clone(),
        pause: None,
        accept_failures: Warnings::default(),
    };
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(STREAMS_PER_CONNECTION))
        .concurrency_limit_per_connection(CALLS_PER_CONNECTION)
        .initial_stream_window_size(Some(STREAM_WINDOW_BYTES))
        .initial_connection_window_size(Some(STREAMS_PER_CONNECTION * STREAM_WINDOW_BYTES))
        .add_service(health)
        .add_service(reflection)
        .add_service(
            GraphpoolServer::new(service)
                .max_decoding_message_size(max_msg)
                .max_encoding_message_size(max_msg),
        )
        .add_service(AdminServer::new(AdminService::new(shared.clone())).max_decoding_message_size(max_msg))
        .serve_with_incoming_shutdown(incoming, async move { grpc_shutdown.wait().await });
    let server_task = tokio::spawn(server);

    let mut sigterm = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(DaemonError::Signals)?;
    tracing::info!(
        socket = %config.socket.display(), fd_socket = %config.fd_socket.display(), instance = %instance,
        version = env!("CARGO_PKG_VERSION"), plan_cores = config.plan_cores, "graphpoold ready"
    );
    notify(&[sd_notify::NotifyState::Ready]);

    let sig = tokio::select! {
        _ = sigterm.recv() => "SIGTERM",
        _ = sigint.recv() => "SIGINT",
        r = &mut Box::pin(wait_task(server_task)) => {
            return r;
        }
    };
    tracing::info!(signal = sig, sessions = shared.sessions.len(), drain_timeout = ?config.drain_timeout, "draining");
    notify(&[sd_notify::NotifyState::Stopping]);
    drain(&shared, config.drain_timeout).await;
    shutdown.trigger();
    let _ = fd_task.await;
    if let Some(t) = metrics_task {
        let _ = t.await;
    }
    for p in [&config.socket, &config.fd_socket] {
        let _ = std::fs::remove_file(p);
    }
    tracing::info!("graphpoold stopped");
    Ok(())
}

/// Pause after a failed accept (the daemon is out of fds, say) before the next one, on each
/// of the daemon's listeners: an accept that keeps failing would otherwise spin.
pub const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// Streams one gRPC connection may have open at once (HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`;
/// a client queues the streams it opens beyond it). A client's connection holds the event
/// stream of each of its sessions (`Attach`) for the session's life, plus its calls in
/// flight; 128 leaves room for a process that attaches a session on every device of a node
/// over one connection, while bounding what one connection can ask the daemon to hold (each
/// stream's request headers, up to hyper's default limit of 16 KiB, and its unread data, up
/// to [`STREAM_WINDOW_BYTES`]).
pub const STREAMS_PER_CONNECTION: u32 = 128;

/// Calls of one gRPC connection that the daemon serves at once; the connection's further
/// calls wait, unread, until one of these has its response (tower's per-connection
/// concurrency limit, whose permit is held from the start of a call until its response
/// headers are ready: while the request message is read and decoded, and while the handler
/// runs). A streaming response holds no permit once it has started, so the long-lived
/// `Attach` streams do not count. Each call being read may buffer up to
/// `guards.max_message_bytes` (16 MiB by default), and its decoded request may be larger
/// still: a message made of empty repeated entries decodes to some forty times its size (an
/// empty `LayerSpec` of a plan is 2 bytes on the wire and 80 in memory). So this bounds what
/// one connection can make the daemon hold to 8 such requests, plus the unread data of the
/// waiting streams ([`STREAM_WINDOW_BYTES`] each); how many connections a uid may hold is
/// bounded by [`crate::conn_limit::per_uid_cap`]. 8 lets several sessions or threads of one
/// process call at once; more wait their turn.
pub const CALLS_PER_CONNECTION: usize = 8;

/// HTTP/2 flow-control window of each stream of a gRPC connection: what a client may send on
/// a stream that the daemon has not read yet (a call waiting for one of the
/// [`CALLS_PER_CONNECTION`] places is not read at all). The connection's window is
/// [`STREAMS_PER_CONNECTION`] times this (16 MiB), so that waiting streams holding their
/// whole windows never leave the calls being served without window to receive their data.
pub const STREAM_WINDOW_BYTES: u32 = 128 << 10;

/// The gRPC socket's connections, as tonic takes them. Each peer's credentials
/// (`SO_PEERCRED`) are read at accept, before any byte of the connection is: a peer not on the
/// allow-list, or one past its uid's connection cap, is closed at once
/// ([`ConnLimit::admit_peer`]); the others are counted in `limit`. A refused peer is not told
/// why (nothing is read from it, and nothing is sent): the daemon's log says so, within the
/// rate limit of [`crate::conn_limit`].
#[derive(Debug)]
struct GrpcIncoming {
    listener: UnixListener,
    access: AccessConfig,
    limit: ConnLimit,
    metrics: Arc<Metrics>,
    /// Set after a failed accept: tonic polls again at once, so without it an accept that
    /// keeps failing would spin.
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The rate limit of the warnings about failed accepts.
    accept_failures: Warnings,
}

impl GrpcIncoming {
    /// Admits and counts an accepted connection, or closes it (by dropping it).
    fn admit(&self, stream: UnixStream) -> Option<GrpcConnection> {
        let cred = match stream.peer_cred() {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "gRPC connection dropped: peer credentials unreadable");
                return None;
            }
        };
        let pid = crate::peer::pid_of_ucred(&cred);
        let slot = self.limit.admit_peer(&self.access, cred.uid(), cred.gid(), pid, &self.metrics)?;
        Some(GrpcConnection { stream, _slot: slot })
    }
}

impl Stream for GrpcIncoming {
    type Item = Result<GrpcConnection, std::convert::Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(pause) = &mut this.pause {
                ready!(pause.as_mut().poll(cx));
                this.pause = None;
            }
            match ready!(this.listener.poll_accept(cx)) {
                Ok((stream, _)) => {
                    if let Some(conn) = this.admit(stream) {
                        return Poll::Ready(Some(Ok(conn)));
                    }
                }
                Err(e) => {
                    if let Some(unlogged) = this.accept_failures.due(Instant::now()) {
                        tracing::warn!(error = %e, unlogged, "gRPC socket accept failed");
                    }
                    this.pause = Some(Box::pin(tokio::time::sleep(ACCEPT_ERROR_PAUSE)));
                }
            }
        }
    }
}

/// An accepted gRPC connection: holds its place in its uid's count until tonic drops it,
/// when the connection has closed.
#[derive(Debug)]
struct GrpcConnection {
    stream: UnixStream,
    _slot: Slot,
}

impl Connected for GrpcConnection {
    type ConnectInfo = UdsConnectInfo;

    fn connect_info(&self) -> UdsConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for GrpcConnection {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for GrpcConnection {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

async fn wait_task(
    t: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
) -> Result<(), DaemonError> {
    match t.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(DaemonError::Serve(e.to_string())),
        Err(e) => Err(DaemonError::Serve(e.to_string())),
    }
}

/// Refuses new work, tells sessions to detach, waits for them up to `timeout`, then ends the
/// rest.
async fn drain(shared: &Shared, timeout: Duration) {
    shared.ledger.begin_shutdown();
    shared.sessions.broadcast(pb::SessionEvent {
        event: Some(pb::session_event::Event::Draining(pb::Draining {
            drain_seconds: timeout.as_secs_f64(),
        })),
    });
    let deadline = Instant::now() + timeout;
    while !shared.ledger.sessions().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ended = shared.ledger.end_all(EndReason::Shutdown);
    for _ in 0..ended {
        shared.metrics.session_ended(EndReason::Shutdown);
    }
    shared.sessions.close_all();
}

/// Makes the allocator take blocks of 128 KiB or more from the OS and give them back when
/// freed, for the daemon's whole life. Call it before any thread starts. glibc otherwise
/// raises that threshold (up to 32 MiB) each time a large block is freed, after which a
/// plan's large vectors come from the planner threads' arenas, whose free tops
/// `malloc_trim` (in the housekeeping task) does not release: after `PlanCapture`s of 100k-buffer
/// lists the daemon stayed 30 MiB above its idle RSS. With the threshold fixed it returns
/// within 3 MiB, and two such plans at once peak at 128 MiB instead of 195–240 MiB; plans
/// come out the same (`bench/load`, mode `plan-large`; README, "Measured figures").
pub fn return_large_blocks_to_the_os() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets an allocator parameter; no memory is touched.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
    }
}

/// Every few seconds: folds buffered histogram samples into buckets (they would otherwise
/// accumulate without bound while nobody scrapes), and returns freed heap to the OS (glibc
/// keeps per-thread arenas after a burst of requests, so RSS would stay at its peak).
async fn housekeeping(metrics: Arc<Metrics>, shutdown: Shutdown) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                metrics.upkeep();
                #[cfg(target_env = "gnu")]
                // SAFETY: malloc_trim only releases free memory of the allocator's arenas.
                unsafe {
                    libc::malloc_trim(0);
                }
            }
            _ = shutdown.wait() => return,
        }
    }
}

fn notify(state: &[sd_notify::NotifyState<'_>]) {
    if std::env::var_os("NOTIFY_SOCKET").is_some()
        && let Err(e) = sd_notify::notify(false, state)
    {
        tracing::warn!(error = %e, "sd_notify failed");
    }
}

/// Binds a Unix socket at `path`: creates its directory, replaces a stale socket file (but
/// refuses if a daemon still answers there, or if the file there is not a socket), and
/// applies the configured mode and group.
fn bind_socket(path: &Path, config: &Config) -> Result<UnixListener, DaemonError> {
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
        && !dir.exists()
    {
        std::fs::create_dir_all(dir)
            .map_err(|source| DaemonError::Bind { path: path.to_path_buf(), source })?;
    }
    if let Ok(meta) = std::fs::metadata(path) {
        // Only a socket is replaced: any other file there is not ours to delete.
        if !meta.file_type().is_socket() {
            return Err(DaemonError::NotASocket(path.to_path_buf()));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(DaemonError::SocketInUse(path.to_path_buf()));
        }
        let _ = std::fs::remove_file(path);
    }
    let listener =
        UnixListener::bind(path).map_err(|source| DaemonError::Bind { path: path.to_path_buf(), source })?;
    let perm_err = |message: String| DaemonError::Permissions {
        path: path.to_path_buf(),
        group: config.socket_group.clone().unwrap_or_default(),
        mode: config.socket_mode,
        message,
    };
    if let Some(group) = &config.socket_group {
        let gid = resolve_group(group).ok_or_else(|| perm_err(format!("no group named {group:?}")))?;
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|e| perm_err(e.to_string()))?;
        // SAFETY: valid C path; uid -1 leaves the owner unchanged.
        if unsafe { libc::chown(c.as_ptr(), u32::MAX, gid) } != 0 {
            return Err(perm_err(std::io::Error::last_os_error().to_string()));
        }
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(config.socket_mode))
        .map_err(|e| perm_err(e.to_string()))?;
    Ok(listener)
}

fn resolve_group(group: &str) -> Option<u32> {
    if let Ok(gid) = group.parse::<u32>() {
        return Some(gid);
    }
    let text = std::fs::read_to_string("/etc/group").ok()?;
    text.lines().find_map(|l| {
        let mut f = l.split(':');
        (f.next()? == group).then(|| f.nth(1)?.parse().ok())?
    })
}
