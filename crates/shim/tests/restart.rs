//! The shim survives a daemon restart: SIGKILL graphpoold while segments are mapped; they stay
//! usable; allocations fail cleanly until a new daemon listens on the same socket; the session
//! re-attaches by itself declaring its live segments, and the new daemon's ledger equals the
//! old one's. Frees during the outage are not declared.

mod common;

use std::ffi::CString;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::last_error;
use graphpool_proto::v1::{GetUsageRequest, ListGrantsRequest, Usage};
use graphpool_shim::*;

const MIB: u64 = 1 << 20;

/// The tests of this file run one at a time: one sets the reconnect deadline in the
/// environment.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn configure(socket: &std::path::Path, job: &str, rank: u32, device: i32) -> i32 {
    let sock = CString::new(socket.to_str().unwrap()).unwrap();
    let job = CString::new(job).unwrap();
    let dd = CString::new(device.to_string()).unwrap();
    // SAFETY: valid C strings.
    unsafe { graphpool_shim_configure(sock.as_ptr(), job.as_ptr(), rank, rank, device, dd.as_ptr(), 0, 0) }
}

fn state(device: i32) -> (i32, u64, u64) {
    let (mut n, mut ns) = (0u64, 0u64);
    // SAFETY: valid out-pointers.
    let s = unsafe { graphpool_shim_session_state(device, &mut n, &mut ns) };
    (s, n, ns)
}

fn session_id(device: i32) -> u64 {
    let mut id = 0u64;
    // SAFETY: valid out-pointer; NULLs for the rest.
    let rc = unsafe {
        graphpool_shim_session_info(device, &mut id, std::ptr::null_mut(), std::ptr::null_mut(), 0)
    };
    assert_eq!(rc, 0);
    id
}

fn usage(socket: &std::path::Path) -> Usage {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = graphpool_shim::session::connect(socket).await.unwrap();
        c.get_usage(GetUsageRequest {}).await.unwrap().into_inner()
    })
}

fn grants(socket: &std::path::Path, job: &str) -> Vec<(u64, u64, bool, String)> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut c = graphpool_shim::session::connect(socket).await.unwrap();
        let g = c
            .list_grants(ListGrantsRequest { session_id: 0, job_id: job.to_string() })
            .await
            .unwrap()
            .into_inner();
        let mut v: Vec<_> =
            g.grants.into_iter().map(|g| (g.grant_id, g.size_bytes, g.adopted, g.label)).collect();
        v.sort();
        v
    })
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn sessions_reattach_after_the_daemon_restarts() {
    let _serial = serial();
    let mut d = common::Daemon::start(2, "1GiB");
    assert_eq!(configure(&d.socket, "job-r", 5, 0), 0, "{}", last_error());
    assert_eq!(configure(&d.socket, "job-r", 6, 1), 0, "{}", last_error());
    let sizes = [4 * MIB, 6 * MIB, 8 * MIB];
    let ptrs: Vec<_> = sizes
        .iter()
        .map(|&s| {
            let p = graphpool_alloc(s as usize, 0, std::ptr::null_mut());
            assert!(!p.is_null(), "{}", last_error());
            p
        })
        .collect();
    let other = graphpool_alloc((2 * MIB) as usize, 1, std::ptr::null_mut());
    assert!(!other.is_null());
    // SAFETY: ptrs[0] points at 4 MiB of mapped memory.
    unsafe { std::ptr::write_bytes(ptrs[0].cast::<u8>(), 0xa5, (4 * MIB) as usize) };
    let before = usage(&d.socket);
    let grants_before = grants(&d.socket, "job-r");
    assert_eq!(grants_before.len(), 4);
    let old_sid = session_id(0);

    d.kill();
    // The memory outlives the daemon.
    // SAFETY: still mapped.
    unsafe {
        assert_eq!(*ptrs[0].cast::<u8>().add((4 * MIB - 1) as usize), 0xa5);
        *ptrs[0].cast::<u8>() = 0x11;
    }
    wait_for("the session to notice", Duration::from_secs(5), || state(0).0 == 1);
    // Allocations fail cleanly: torch raises OOM, graphpool.torch reads this.
    assert!(graphpool_alloc((2 * MIB) as usize, 0, std::ptr::null_mut()).is_null());
    let e = last_error();
    assert_eq!(e["kind"], "unavailable", "{e}");
    assert_eq!(e["restarting"], true, "{e}");
    assert!(e["message"].as_str().unwrap().contains("restarting"), "{e}");
    // A free during the outage is local: device 1's segment is not declared to the new daemon.
    graphpool_free(other, (2 * MIB) as usize, 1, std::ptr::null_mut());

    // A longer outage than the first backoff steps: recovery must not wait for the backoff.
    std::thread::sleep(Duration::from_millis(1500));
    let t = Instant::now();
    d.restart();
    let ready = t.elapsed();
    wait_for("the re-attach", Duration::from_secs(10), || state(0).0 == 0 && state(1).0 == 0);
    let recovered = t.elapsed();
    eprintln!(
        "restart recovery (shim): daemon start -> sessions re-attached {:.0} ms (daemon listening \
         after {:.0} ms; outage as the session saw it {:.0} ms)",
        recovered.as_secs_f64() * 1e3,
        ready.as_secs_f64() * 1e3,
        state(0).2 as f64 / 1e6
    );
    assert!(recovered < Duration::from_secs(5));
    assert_eq!(state(0).1, 1);
    assert_ne!(session_id(0), old_sid);

    // The ledger equals the old one's, less the segment freed during the outage.
    let after = usage(&d.socket);
    let dev0 =
        |u: &Usage| u.devices.iter().find(|x| x.device_index == 0).map(|x| (x.granted_bytes, x.grants));
    let dev1 =
        |u: &Usage| u.devices.iter().find(|x| x.device_index == 1).map(|x| (x.granted_bytes, x.grants));
    assert_eq!(dev0(&after), dev0(&before));
    assert_eq!(dev0(&after), Some((18 * MIB, 3)));
    assert_eq!(dev1(&before), Some((2 * MIB, 1)));
    assert_eq!(dev1(&after), Some((0, 0)));
    let rank5 = |u: &Usage| {
        u.ranks.iter().find(|r| r.job_id == "job-r" && r.rank == 5).map(|r| (r.granted_bytes, r.grants))
    };
    assert_eq!(rank5(&after), rank5(&before));
    let g = grants(&d.socket, "job-r");
    let want: Vec<_> =
        grants_before.iter().filter(|x| x.1 != 2 * MIB).map(|x| (x.0, x.1, true, x.3.clone())).collect();
    assert_eq!(g, want, "adopted grants keep their ids, sizes and labels");

    // Free of an adopted segment releases it in the new daemon.
    graphpool_free(ptrs[1], (6 * MIB) as usize, 0, std::ptr::null_mut());
    assert_eq!(dev0(&usage(&d.socket)), Some((12 * MIB, 2)));
    // New segments come from the new daemon.
    let p = graphpool_alloc((2 * MIB) as usize, 0, std::ptr::null_mut());
    assert!(!p.is_null(), "{}", last_error());
    assert_eq!(dev0(&usage(&d.socket)), Some((14 * MIB, 3)));
    graphpool_free(p, (2 * MIB) as usize, 0, std::ptr::null_mut());
    // SAFETY: still mapped.
    assert_eq!(unsafe { *ptrs[0].cast::<u8>() }, 0x11);
    graphpool_free(ptrs[0], (4 * MIB) as usize, 0, std::ptr::null_mut());
    graphpool_free(ptrs[2], (8 * MIB) as usize, 0, std::ptr::null_mut());
    assert_eq!(graphpool_shim_shutdown(), 0);
    let end = usage(&d.socket);
    assert!(end.devices.iter().all(|x| x.granted_bytes == 0 && x.grants == 0), "{end:?}");
    assert!(end.jobs.is_empty(), "{end:?}");
}

/// A session whose daemon did not come back within the reconnect deadline is not kept for
/// new users: configure replaces it even while it still has a segment mapped, whose free it
/// still serves.
#[test]
fn an_ended_session_is_replaced() {
    let _serial = serial();
    let mut d = common::Daemon::start(4, "1GiB");
    // SAFETY: the tests of this file run one at a time (serial) and read the environment only
    // through std.
    unsafe { std::env::set_var("GRAPHPOOL_RECONNECT_DEADLINE", "0.3") };
    let rc = configure(&d.socket, "job-e", 0, 2);
    // SAFETY: as above.
    unsafe { std::env::remove_var("GRAPHPOOL_RECONNECT_DEADLINE") };
    assert_eq!(rc, 0, "{}", last_error());
    let p = graphpool_alloc((2 * MIB) as usize, 2, std::ptr::null_mut());
    assert!(!p.is_null(), "{}", last_error());

    d.kill();
    wait_for("the session to end", Duration::from_secs(10), || state(2).0 == 2);
    assert!(graphpool_alloc((2 * MIB) as usize, 2, std::ptr::null_mut()).is_null());
    assert_eq!(last_error()["kind"], "session-ended");
    assert_eq!(graphpool_shim_keep_device(2), -1, "an ended session is not kept");

    d.restart();
    assert_eq!(configure(&d.socket, "job-e", 0, 2), 0, "{}", last_error());
    assert_eq!(state(2).0, 0);
    let q = graphpool_alloc((4 * MIB) as usize, 2, std::ptr::null_mut());
    assert!(!q.is_null(), "{}", last_error());
    // The ended session's segment is still freed (locally: the daemon forgot it).
    graphpool_shim_clear_error();
    graphpool_free(p, (2 * MIB) as usize, 2, std::ptr::null_mut());
    assert!(graphpool_shim_last_error().is_null(), "{}", last_error());
    let (mut g, mut n) = (0u64, 0u64);
    // SAFETY: valid out-pointers.
    assert_eq!(unsafe { graphpool_shim_stats(2, &mut g, &mut n) }, 0);
    assert_eq!((g, n), (4 * MIB, 1));
    assert_eq!(grants(&d.socket, "job-e").len(), 1);
    graphpool_free(q, (4 * MIB) as usize, 2, std::ptr::null_mut());
    assert_eq!(graphpool_shim_release_device(2), 0);
    assert!(grants(&d.socket, "job-e").is_empty());
}
