//! A real `graphpoold` (host backend) on a temporary socket, for the shim's tests.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A daemon process, killed on drop.
pub struct Daemon {
    child: Child,
    dir: tempfile::TempDir,
    devices: u32,
    capacity: String,
    starts: u32,
    pub socket: PathBuf,
}

/// The `graphpoold` binary: `$GRAPHPOOLD`, else next to this test's target directory, built
/// with cargo when missing.
pub fn graphpoold() -> PathBuf {
    if let Some(p) = std::env::var_os("GRAPHPOOLD") {
        return PathBuf::from(p);
    }
    // target/<profile>/deps/<test-binary>
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf();
    let bin = profile_dir.join("graphpoold");
    if !bin.is_file() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-p", "graphpool", "--bin", "graphpoold", "--manifest-path"]).arg(&manifest);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        if let Some(target) = profile_dir.parent() {
            cmd.env("CARGO_TARGET_DIR", target);
        }
        let st = cmd.status().expect("running cargo to build graphpoold");
        assert!(st.success(), "building graphpoold failed");
    }
    bin
}

impl Daemon {
    /// Starts a host-backend daemon with `devices` devices of `capacity` each.
    pub fn start(devices: u32, capacity: &str) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("g.sock");
        let child = spawn(dir.path(), &socket, devices, capacity, 1);
        let d = Daemon { child, dir, devices, capacity: capacity.to_string(), starts: 1, socket };
        d.wait_listening();
        d
    }

    fn wait_listening(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&self.socket).is_err() {
            assert!(Instant::now() < deadline, "graphpoold did not listen on {}", self.socket.display());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILLs the daemon; its socket files stay behind, as after a crash.
    #[allow(dead_code)]
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGSTOPs the daemon (`resume` continues it): it keeps its sockets but answers nothing.
    #[allow(dead_code)]
    pub fn pause(&self) {
        // SAFETY: signals our own child process.
        assert_eq!(unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGSTOP) }, 0);
        // The signal is delivered asynchronously: wait until every thread stopped.
        let tasks = format!("/proc/{}/task", self.child.id());
        let stopped = || {
            std::fs::read_dir(&tasks).expect("the daemon's threads").all(|t| {
                let stat =
                    std::fs::read_to_string(t.expect("a thread").path().join("stat")).unwrap_or_default();
                // "pid (comm) S ...": the state follows the command's closing parenthesis.
                stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T'))
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !stopped() {
            assert!(Instant::now() < deadline, "graphpoold did not stop");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGCONTs a daemon stopped by `pause`.
    #[allow(dead_code)]
    pub fn resume(&self) {
        // SAFETY: signals our own child process.
        assert_eq!(unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGCONT) }, 0);
    }

    /// Starts the daemon again on the same sockets and waits until it listens.
    #[allow(dead_code)]
    pub fn restart(&mut self) {
        self.kill();
        self.starts += 1;
        self.child = spawn(self.dir.path(), &self.socket, self.devices, &self.capacity, self.starts);
        self.wait_listening();
    }
}

fn spawn(dir: &Path, socket: &Path, devices: u32, capacity: &str, n: u32) -> Child {
    let log = std::fs::File::create(dir.join(format!("graphpoold-{n}.log"))).expect("log file");
    Command::new(graphpoold())
        .args(["--backend", "host", "--metrics-listen", "off", "--host-devices"])
        .arg(devices.to_string())
        .arg("--host-capacity")
        .arg(capacity)
        .arg("--socket")
        .arg(socket)
        .env_remove("GRAPHPOOL_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("starting graphpoold")
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The shim's last error, parsed (it is JSON); panics if there is none.
#[allow(dead_code)] // not every test binary uses every helper
pub fn last_error() -> serde_json::Value {
    let p = graphpool_shim::graphpool_shim_last_error();
    assert!(!p.is_null(), "expected an error");
    // SAFETY: the shim returns a valid C string that lives until the next call.
    let s = unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap().to_string();
    serde_json::from_str(&s).unwrap()
}
