//! Helpers of the reliability tests: a daemon that can be SIGKILLed and restarted on the same
//! socket, child processes that are killed on drop, JSON log lines, /proc figures.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `graphpoold` process started from a config file; SIGKILLed on drop.
pub struct DaemonProc {
    pub child: Child,
    pub log: PathBuf,
    pub started: Instant,
}

/// Writes a daemon config into `dir` (host backend, 2 devices of 1 GiB, JSON logs) and
/// returns its path. `extra` is appended.
pub fn write_config(dir: &Path, extra: &str) -> PathBuf {
    let config = dir.join("graphpoold.toml");
    let toml = format!(
        "socket = \"{}\"\nbackend = \"host\"\nlog_format = \"json\"\ndrain_timeout_seconds = 1\n{extra}\n",
        dir.join("g.sock").display()
    );
    let toml = if toml.contains("[host]") {
        toml
    } else {
        format!("{toml}\n[host]\ndevices = 2\ncapacity = \"1GiB\"\n")
    };
    std::fs::write(&config, toml).unwrap();
    config
}

/// A free loopback TCP address for a metrics endpoint.
pub fn free_addr() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

impl DaemonProc {
    /// Starts the daemon with `config`, metrics at `metrics` (or off), stderr appended to `log`.
    pub fn spawn(config: &Path, metrics: Option<std::net::SocketAddr>, log: &Path) -> DaemonProc {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
        let ml = metrics.map(|a| a.to_string()).unwrap_or_else(|| "off".into());
        let started = Instant::now();
        let child = Command::new(env!("CARGO_BIN_EXE_graphpoold"))
            .arg("--config")
            .arg(config)
            .arg("--metrics-listen")
            .arg(ml)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("spawn graphpoold");
        DaemonProc { child, log: log.to_path_buf(), started }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until both sockets accept connections; returns the time since spawn.
    pub fn wait_ready(&self, socket: &Path, fd_socket: &Path) -> Duration {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(socket).is_ok()
                && std::os::unix::net::UnixStream::connect(fd_socket).is_ok()
            {
                return self.started.elapsed();
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        panic!(
            "graphpoold did not become ready; log:\n{}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

impl Drop for DaemonProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A child process SIGKILLed and reaped on drop.
pub struct Killed(pub Child);

impl Killed {
    pub fn kill9(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The JSON objects of a daemon log (`--log-format json`: one flattened event per line) (lines that are not JSON are skipped).
pub fn json_lines(log: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .collect()
}

/// Log objects whose message is `msg`.
pub fn with_message(lines: &[serde_json::Value], msg: &str) -> Vec<serde_json::Value> {
    lines.iter().filter(|v| v["message"] == msg).cloned().collect()
}

/// Open fds of a process.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// Resident set size of a process, bytes.
pub fn rss_bytes(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .unwrap_or(0)
}

/// The lines of a Prometheus exposition whose metric name is one of `names`, sorted.
pub fn metric_lines(text: &str, names: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| names.iter().any(|n| l.starts_with(&format!("{n}{{")) || l.starts_with(&format!("{n} "))))
        .map(str::to_string)
        .collect();
    v.sort();
    v
}

/// GET /metrics from `addr` (body only).
pub async fn scrape(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or(out)
}

/// A small xorshift generator: tests pick kill moments from a seed they print.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A seed from the clock, or `GP_SEED` when set (to replay a run).
pub fn seed() -> u64 {
    std::env::var("GP_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    })
}
