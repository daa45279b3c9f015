//! The shim's C ABI against a real graphpoold (host backend): segments come from the daemon,
//! are mapped, show in its ledger, go back on free; refusals carry structured details.

mod common;

use std::ffi::{CString, c_void};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::last_error;
use graphpool_proto::v1::{GetUsageRequest, ListGrantsRequest};
use graphpool_shim::session::{AttachParams, ReconnectPolicy, Session};
use graphpool_shim::*;

const MIB: u64 = 1 << 20;

/// The tests of this file run one at a time: one lowers the process's fd limit.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn configure(socket: &std::path::Path, job: &str, rank: u32, device: i32, budget: u64, reserve: bool) -> i32 {
    configure_on(socket, job, rank, device, &device.to_string(), budget, reserve)
}

/// [`configure`] with the daemon's name of the device.
fn configure_on(
    socket: &std::path::Path,
    job: &str,
    rank: u32,
    device: i32,
    daemon_device: &str,
    budget: u64,
    reserve: bool,
) -> i32 {
    let sock = CString::new(socket.to_str().unwrap()).unwrap();
    let job = CString::new(job).unwrap();
    let dd = CString::new(daemon_device).unwrap();
    // SAFETY: valid C strings.
    unsafe {
        graphpool_shim_configure(
            sock.as_ptr(),
            job.as_ptr(),
            rank,
            rank,
            device,
            dd.as_ptr(),
            budget,
            reserve as i32,
        )
    }
}

fn stats(device: i32) -> (u64, u64) {
    let (mut g, mut n) = (0u64, 0u64);
    // SAFETY: valid out-pointers.
    assert_eq!(unsafe { graphpool_shim_stats(device, &mut g, &mut n) }, 0);
    (g, n)
}

/// Granted bytes of `job` in the daemon's ledger, and its grant count.
fn ledger(socket: &std::path::Path, job: &str) -> (u64, u32) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = graphpool_shim::session::connect(socket).await.unwrap();
        let u = c.get_usage(GetUsageRequest {}).await.unwrap().into_inner();
        let g = c
            .list_grants(ListGrantsRequest { session_id: 0, job_id: job.to_string() })
            .await
            .unwrap()
            .into_inner();
        let granted = u.jobs.iter().filter(|j| j.job_id == job).map(|j| j.granted_bytes).sum();
        (granted, g.grants.len() as u32)
    })
}

#[test]
fn segments_come_from_the_daemon_and_go_back() {
    let _serial = serial();
    let d = common::Daemon::start(4, "1GiB");

    // Not configured yet: refused with a clear error, no crash.
    assert!(graphpool_alloc(MIB as usize, 3, std::ptr::null_mut()).is_null());
    assert_eq!(last_error()["kind"], "not-configured");

    assert_eq!(configure(&d.socket, "job-a", 0, 0, 0, false), 0, "{:?}", graphpool_shim_last_error());
    let mut ptrs = Vec::new();
    let mut lat = Vec::new();
    for size in [20 * MIB, 3 * MIB, 64 * MIB] {
        let t = Instant::now();
        let p = graphpool_alloc(size as usize, 0, std::ptr::null_mut());
        lat.push(t.elapsed());
        assert!(!p.is_null(), "{}", last_error());
        // The memory is the memfd the daemon granted, mapped read/write.
        // SAFETY: p points at `size` mapped bytes.
        unsafe {
            std::ptr::write_bytes(p.cast::<u8>(), 0x5a, size as usize);
            assert_eq!(*p.cast::<u8>().add(size as usize - 1), 0x5a);
        }
        ptrs.push((p, size));
    }
    // 3 MiB is rounded up to the 2 MiB granularity.
    let want = (20 + 4 + 64) * MIB;
    assert_eq!(stats(0), (want, 3));
    assert_eq!(ledger(&d.socket, "job-a"), (want, 3));
    let mut t = [0u64; 4];
    // SAFETY: room for 4 values.
    unsafe { graphpool_shim_last_timing(t.as_mut_ptr()) };
    assert!(t[3] >= t[0] && t[3] > 0);
    // The fast path: the fd came with the grant, there was no separate fetch.
    assert_eq!(t[1], 0, "{t:?}");
    eprintln!("host-backend segment requests: {lat:?}; last phases rpc/fd/map/total ns = {t:?}");

    for (p, size) in ptrs {
        graphpool_free(p, size as usize, 0, std::ptr::null_mut());
    }
    assert_eq!(stats(0), (0, 0));
    assert_eq!(ledger(&d.socket, "job-a"), (0, 0));

    // Freeing something that is not a segment is reported, not fatal.
    let mut x = 0u8;
    graphpool_free((&mut x as *mut u8).cast::<c_void>(), 1, 0, std::ptr::null_mut());
    assert_eq!(last_error()["kind"], "invalid-argument");

    // A session budget refuses with the daemon's structured details.
    assert_eq!(configure(&d.socket, "job-b", 1, 1, 8 * MIB, false), 0);
    let p = graphpool_alloc((6 * MIB) as usize, 1, std::ptr::null_mut());
    assert!(!p.is_null());
    assert!(graphpool_alloc((4 * MIB) as usize, 1, std::ptr::null_mut()).is_null());
    let e = last_error();
    assert_eq!(e["kind"], "capacity", "{e}");
    assert_eq!(e["code"], "RESOURCE_EXHAUSTED");
    assert_eq!(e["call"], "AllocateSegment");
    assert_eq!(e["limit"], "session-budget");
    assert_eq!(e["requested"], 4 * MIB);
    assert_eq!(e["free"], 2 * MIB);
    assert_eq!(e["limit_bytes"], 8 * MIB);
    assert_eq!(stats(1), (6 * MIB, 1));
    // A successful allocation clears the thread's last error.
    let q = graphpool_alloc((2 * MIB) as usize, 1, std::ptr::null_mut());
    assert!(!q.is_null(), "{}", last_error());
    assert!(graphpool_shim_last_error().is_null());
    graphpool_free(q, (2 * MIB) as usize, 1, std::ptr::null_mut());
    assert_eq!(stats(1), (6 * MIB, 1));

    // A session with segments is not replaced underneath torch.
    assert_eq!(configure(&d.socket, "job-b", 1, 1, 0, false), -1);
    assert_eq!(graphpool_shim_release_device(1), -1);
    graphpool_free(p, (6 * MIB) as usize, 1, std::ptr::null_mut());
    assert_eq!(graphpool_shim_release_device(1), 0);
    assert!(graphpool_alloc(MIB as usize, 1, std::ptr::null_mut()).is_null());
    assert_eq!(last_error()["kind"], "not-configured");

    // reserve_budget: a budget that does not fit fails at configure time.
    assert_eq!(configure(&d.socket, "job-c", 2, 2, 2 << 30, true), -1);
    let e = last_error();
    assert_eq!(e["kind"], "capacity", "{e}");
    assert_eq!(e["requested"], 2u64 << 30);
    // One that fits is held for the session at once.
    assert_eq!(configure(&d.socket, "job-c", 2, 2, 512 * MIB, true), 0);
    let mut reserved = 0u64;
    // SAFETY: valid out-pointer; NULLs for the rest.
    unsafe { graphpool_shim_session_info(2, std::ptr::null_mut(), &mut reserved, std::ptr::null_mut(), 0) };
    assert_eq!(reserved, 512 * MIB);

    // Unknown device on the daemon's side is the daemon's field error.
    assert_eq!(configure(&d.socket, "job-d", 3, 9, 0, false), -1);
    let e = last_error();
    assert_eq!(e["kind"], "daemon", "{e}");

    assert_eq!(graphpool_shim_shutdown(), 0);
}

#[test]
fn unreachable_daemon_is_a_clear_error() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(configure(&dir.path().join("none.sock"), "job-x", 0, 5, 0, false), -1);
    let e = last_error();
    assert_eq!(e["kind"], "unavailable", "{e}");
    assert!(e["message"].as_str().unwrap().contains("none.sock"));
}

/// When the daemon's fd cannot be received (the process is at its fd limit), the grant that
/// came with it is released: the daemon's ledger does not keep memory nobody holds.
#[test]
fn a_grant_whose_fd_does_not_arrive_is_released() {
    let _serial = serial();
    let d = common::Daemon::start(1, "1GiB");
    assert_eq!(configure_on(&d.socket, "job-nofile", 0, 6, "0", 0, false), 0, "{}", last_error());
    // One request first: the fd connection is open, the next one needs no new fd but the
    // segment's.
    let p = graphpool_alloc((2 * MIB) as usize, 6, std::ptr::null_mut());
    assert!(!p.is_null(), "{}", last_error());
    graphpool_free(p, (2 * MIB) as usize, 6, std::ptr::null_mut());

    // No room for one more fd: the limit becomes the lowest free fd number.
    // SAFETY: opens and closes an fd of our own.
    let lowest = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    assert!(lowest >= 0);
    // SAFETY: closes the fd just opened.
    unsafe { libc::close(lowest) };
    let mut saved = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut saved) }, 0);
    let low = libc::rlimit { rlim_cur: lowest as libc::rlim_t, rlim_max: saved.rlim_max };
    // SAFETY: lowers the soft limit only; restored right after the call.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    let q = graphpool_alloc((2 * MIB) as usize, 6, std::ptr::null_mut());
    // SAFETY: restores the limit read above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &saved) }, 0);

    assert!(q.is_null(), "allocated without room for the segment's fd");
    let e = last_error();
    assert_eq!(e["kind"], "fd", "{e}");
    assert!(e["message"].as_str().unwrap().contains("out of file descriptors"), "{e}");
    assert_eq!(stats(6), (0, 0));
    assert_eq!(ledger(&d.socket, "job-nofile"), (0, 0), "the grant stayed charged");
    // The connection still works.
    let p = graphpool_alloc((2 * MIB) as usize, 6, std::ptr::null_mut());
    assert!(!p.is_null(), "{}", last_error());
    graphpool_free(p, (2 * MIB) as usize, 6, std::ptr::null_mut());
    assert_eq!(graphpool_shim_release_device(6), 0);
}

/// A daemon that stops answering (SIGSTOP) fails segment requests, Attach and Detach within
/// the attempt timeout instead of hanging the caller.
#[test]
fn a_stopped_daemon_fails_calls_within_the_timeout() {
    let _serial = serial();
    let d = common::Daemon::start(1, "1GiB");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let policy = ReconnectPolicy { attempt_timeout: Duration::from_millis(500), ..Default::default() };
    let params = AttachParams {
        socket: d.socket.clone(),
        job_id: "job-stopped".to_string(),
        rank: 0,
        local_rank: 0,
        device: 0,
        daemon_device: "0".to_string(),
        budget_bytes: 0,
        reserve_budget: false,
    };
    let s = Session::attach_with(rt.handle(), &params, policy).unwrap();
    let (p, _) = s.allocate(2 * MIB).unwrap();
    s.free(p).unwrap();

    d.pause();
    let bound = Duration::from_secs(5);
    let t = Instant::now();
    let e = s.allocate(2 * MIB).unwrap_err();
    assert!(t.elapsed() < bound, "allocate took {:?}", t.elapsed());
    assert_eq!(e.kind(), "unavailable", "{e}");
    assert!(e.to_string().contains("did not answer"), "{e}");

    let t = Instant::now();
    let e = Session::attach_with(rt.handle(), &params, policy).unwrap_err();
    assert!(t.elapsed() < bound, "attach took {:?}", t.elapsed());
    assert_eq!(e.kind(), "unavailable", "{e}");
    assert!(e.to_string().contains("did not answer Attach"), "{e}");

    let t = Instant::now();
    let e = s.try_detach().unwrap_err();
    assert!(t.elapsed() < bound, "detach took {:?}", t.elapsed());
    assert!(e.to_string().contains("did not answer Detach"), "{e}");
    d.resume();
}

/// A session that release_device could not end (segments mapped) ends with its last
/// segment's free, unless a new user keeps it.
#[test]
fn a_released_session_ends_with_its_last_segment() {
    let _serial = serial();
    let d = common::Daemon::start(1, "1GiB");
    let info = |device| {
        // SAFETY: NULL out-pointers are allowed.
        unsafe {
            graphpool_shim_session_info(
                device,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        }
    };
    assert_eq!(configure_on(&d.socket, "job-close", 0, 7, "0", 0, false), 0, "{}", last_error());
    let p = graphpool_alloc((2 * MIB) as usize, 7, std::ptr::null_mut());
    assert!(!p.is_null(), "{}", last_error());
    assert_eq!(graphpool_shim_release_device(7), -1);
    assert!(last_error()["message"].as_str().unwrap().contains("ends when the last of them is freed"));
    assert_eq!(info(7), 0, "the session stays while a segment is mapped");
    graphpool_free(p, (2 * MIB) as usize, 7, std::ptr::null_mut());
    assert_eq!(info(7), -1, "the last free ends it");
    assert_eq!(ledger(&d.socket, "job-close"), (0, 0));

    // Kept: the end is cancelled.
    assert_eq!(configure_on(&d.socket, "job-close", 0, 7, "0", 0, false), 0, "{}", last_error());
    let p = graphpool_alloc((2 * MIB) as usize, 7, std::ptr::null_mut());
    assert!(!p.is_null(), "{}", last_error());
    assert_eq!(graphpool_shim_release_device(7), -1);
    assert_eq!(graphpool_shim_keep_device(7), 0);
    graphpool_free(p, (2 * MIB) as usize, 7, std::ptr::null_mut());
    assert_eq!(info(7), 0, "a kept session stays");
    let p = graphpool_alloc((2 * MIB) as usize, 7, std::ptr::null_mut());
    assert!(!p.is_null(), "{}", last_error());
    graphpool_free(p, (2 * MIB) as usize, 7, std::ptr::null_mut());
    assert_eq!(graphpool_shim_release_device(7), 0);
    assert_eq!(info(7), -1);
    assert_eq!(graphpool_shim_keep_device(7), -1);
}

/// `graphpool_shim_import` consumes the fd on every failure, as documented.
#[test]
fn import_closes_the_fd_when_it_fails() {
    let _serial = serial();
    // SAFETY: valid name and flags.
    let fd = unsafe { libc::memfd_create(c"shim-import-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    let link = format!("/proc/self/fd/{fd}");
    assert!(std::fs::read_link(&link).unwrap().to_string_lossy().contains("shim-import-test"));
    // SAFETY: the fd is ours to give up; `ptr` NULL is the failure under test.
    let rc = unsafe { graphpool_shim_import(fd, 2 * MIB, 0, c"memfd".as_ptr(), std::ptr::null_mut()) };
    assert_eq!(rc, -1);
    let still = std::fs::read_link(&link).is_ok_and(|l| l.to_string_lossy().contains("shim-import-test"));
    if still {
        // SAFETY: the shim left it open: close it here.
        unsafe { libc::close(fd) };
    }
    assert!(!still, "the fd was left open");
}
