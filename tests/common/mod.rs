//! Shared helpers of the integration tests: a real `graphpoold` process on a temporary
//! socket, and clients that talk to it over real sockets.
#![allow(dead_code)]

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use graphpool::client::{Clients, FdConnection, connect};
use graphpool_proto::v1 as pb;
use tonic::Streaming;

/// A running daemon; killed and its directory removed on drop.
pub struct Daemon {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub fd_socket: PathBuf,
    pub metrics: Option<std::net::SocketAddr>,
}

/// Extra TOML appended to the daemon's config.
pub fn start(extra_toml: &str) -> Daemon {
    start_with(extra_toml, false)
}

/// Starts a daemon (host backend, 2 devices of 1 GiB) with `extra_toml` in its config file,
/// and waits until it answers.
pub fn start_with(extra_toml: &str, metrics: bool) -> Daemon {
    let dir = tempfile::Builder::new().prefix("gp").tempdir_in("/tmp").expect("tempdir");
    let socket = dir.path().join("g.sock");
    let metrics_addr = metrics.then(|| {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    });
    let config = dir.path().join("graphpoold.toml");
    let ml = metrics_addr.map(|a| a.to_string()).unwrap_or_else(|| "off".into());
    let toml = format!(
        "socket = \"{}\"\nbackend = \"host\"\nmetrics_listen = \"{ml}\"\ndrain_timeout_seconds = 1\n{extra_toml}\n",
        socket.display()
    );
    let toml = if toml.contains("[host]") {
        toml
    } else {
        format!("{toml}\n[host]\ndevices = 2\ncapacity = \"1GiB\"\n")
    };
    std::fs::write(&config, toml).unwrap();
    let log = std::fs::File::create(dir.path().join("daemon.log")).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_graphpoold"))
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn graphpoold");
    let d =
        Daemon { child, fd_socket: dir.path().join("graphpool-fd.sock"), socket, dir, metrics: metrics_addr };
    d.wait_ready();
    d
}

impl Daemon {
    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok()
                && std::os::unix::net::UnixStream::connect(&self.fd_socket).is_ok()
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("graphpoold did not become ready; log:\n{}", self.log());
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// The JSON objects of the log (`log_format = "json"`: one event per line; other lines
    /// skipped).
    pub fn json_log(&self) -> Vec<serde_json::Value> {
        self.log().lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).collect()
    }

    pub async fn clients(&self) -> Clients {
        connect(&self.socket).await.expect("connect")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Number of open fds of the daemon process.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid())).map(|d| d.count()).unwrap_or(0)
    }

    pub fn fd_conn(&self) -> FdConnection {
        FdConnection::connect(&self.fd_socket).expect("fd socket")
    }

    pub async fn metrics_text(&self) -> String {
        let addr = self.metrics.expect("daemon started with metrics");
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An attached session: keep it alive to keep the session.
pub struct Session {
    pub id: u64,
    pub events: Streaming<pb::SessionEvent>,
    pub attached: pb::Attached,
}

pub async fn attach(c: &mut Clients, job: &str, rank: u32, device: &str) -> Result<Session, tonic::Status> {
    attach_req(c, pb::AttachRequest { job_id: job.into(), rank, device: device.into(), ..Default::default() })
        .await
}

pub async fn attach_req(c: &mut Clients, req: pb::AttachRequest) -> Result<Session, tonic::Status> {
    let mut events = c.graphpool.attach(req).await?.into_inner();
    let first = events.message().await?.expect("first event");
    let Some(pb::session_event::Event::Attached(a)) = first.event else {
        panic!("first event is not attached")
    };
    Ok(Session { id: a.session_id, events, attached: a })
}

pub async fn allocate(c: &mut Clients, s: &Session, size: u64) -> Result<pb::Grant, tonic::Status> {
    let req = pb::AllocateSegmentRequest { session_id: s.id, size_bytes: size, label: "test".into() };
    Ok(c.graphpool.allocate_segment(req).await?.into_inner())
}

pub async fn usage(c: &mut Clients) -> pb::Usage {
    c.graphpool.get_usage(pb::GetUsageRequest {}).await.unwrap().into_inner()
}

pub async fn granted_total(c: &mut Clients) -> u64 {
    usage(c).await.devices.iter().map(|d| d.granted_bytes).sum()
}

/// Polls `f` until it returns true, up to `limit`; returns the time it took.
pub async fn wait_until<F, Fut>(limit: Duration, mut f: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t = Instant::now();
    while t.elapsed() < limit {
        if f().await {
            return Some(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// Whether the daemon's ledger holds no job, no grant and no granted byte.
pub async fn ledger_empty(c: &mut Clients) -> bool {
    let u = usage(c).await;
    u.devices.iter().all(|d| d.granted_bytes == 0 && d.grants == 0) && u.jobs.is_empty()
}

/// Asserts that the daemon's ledger empties (no job, no grant, no granted byte) within 2 s
/// and its open descriptors fall back to `baseline` within 3 s: what every test of crashing
/// or churning clients ends with.
pub async fn assert_all_released(d: &Daemon, c: &mut Clients, baseline: usize) {
    let empty = wait_until(Duration::from_secs(2), || {
        let mut c = c.clone();
        async move { ledger_empty(&mut c).await }
    })
    .await;
    assert!(empty.is_some(), "ledger not empty: {:?}", usage(c).await);
    let back = wait_until(Duration::from_secs(3), || async { d.open_fds() <= baseline }).await;
    assert!(back.is_some(), "daemon fds {} > baseline {baseline}", d.open_fds());
}

/// Whether the daemon closed `s` (end of stream, or reset) within `within`.
pub fn closed_within(s: &mut std::os::unix::net::UnixStream, within: Duration) -> bool {
    use std::io::Read;
    s.set_read_timeout(Some(within)).unwrap();
    match s.read(&mut [0u8; 64]) {
        Ok(n) => n == 0,
        Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
    }
}

/// The value of the series of `text` (a metrics exposition) that starts with `series`.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find(|l| l.starts_with(series)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Maps a memfd grant shared and read-write.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    pub fn new(fd: &impl AsRawFd, len: usize) -> Mapping {
        // SAFETY: mapping a valid fd of at least `len` bytes, shared, read-write.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap failed: {}", std::io::Error::last_os_error());
        Mapping { ptr: p as *mut u8, len }
    }

    pub fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` bytes and lives as long as self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping what `new` mapped.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// Clears FD_CLOEXEC so a child process inherits `fd`.
pub fn inheritable(fd: &OwnedFd) {
    // SAFETY: fcntl on a valid fd.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, 0) };
}

/// Makes this process uid and gid 65534 (nobody), for a child test that must be another user.
/// Call it before the process starts any thread: credentials change per thread.
pub fn become_nobody() {
    // SAFETY: plain system calls; the caller has started no thread yet.
    unsafe {
        assert_eq!(libc::setgid(65534), 0, "setgid(65534): run the tests as root");
        assert_eq!(libc::setuid(65534), 0, "setuid(65534): run the tests as root");
    }
}

/// Re-runs this test binary, running only `test_name`, with `env` set: the way a test gets a
/// second real process that runs test code.
pub fn child_test(test_name: &str, env: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test_name, "--nocapture", "--test-threads=1"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// An argument the parent passed to a child test in its environment, parsed.
#[allow(dead_code)]
pub fn child_arg<T: std::str::FromStr>(name: &str) -> T
where
    T::Err: std::fmt::Debug,
{
    let raw =
        std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run this child through run_child"));
    raw.parse().unwrap_or_else(|e| panic!("{name}={raw:?}: {e:?}"))
}

/// Runs a child test (see [`child_test`]) to completion and asserts that it succeeded and
/// printed every one of `markers`; returns its stdout.
#[allow(dead_code)]
pub fn run_child(test_name: &str, env: &[(&str, String)], markers: &[&str]) -> String {
    let out = child_test(test_name, env).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && markers.iter().all(|m| stdout.contains(m)),
        "child {test_name} ({}), expected {markers:?}:\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

pub fn socket_path(d: &Daemon) -> &Path {
    &d.socket
}
