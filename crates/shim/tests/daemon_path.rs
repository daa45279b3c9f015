//! The shim's C ABI against a real graphpoold (host backend): segments come from the daemon,
//! are mapped, show in its ledger, go back on free; refusals carry structured details.

mod common;

use std::ffi::{CString, c_void};
use std::time::Instant;

use common::last_error;
use graphpool_proto::v1::{GetUsageRequest, ListGrantsRequest};
use graphpool_shim::*;

const MIB: u64 = 1 << 20;

fn configure(socket: &std::path::Path, job: &str, rank: u32, device: i32, budget: u64, reserve: bool) -> i32 {
    let sock = CString::new(socket.to_str().unwrap()).unwrap();
    let job = CString::new(job).unwrap();
    let dd = CString::new(device.to_string()).unwrap();
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
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(configure(&dir.path().join("none.sock"), "job-x", 0, 5, 0, false), -1);
    let e = last_error();
    assert_eq!(e["kind"], "unavailable", "{e}");
    assert!(e["message"].as_str().unwrap().contains("none.sock"));
}
