//! A forked child never uses its parent's runtime, session or mappings: it is refused with a
//! `forked` error until it configures the shim itself, then works on its own session.

mod common;

use std::ffi::{CStr, CString};

use graphpool_shim::*;

fn configure(socket: &std::path::Path, job: &str) -> i32 {
    let sock = CString::new(socket.to_str().unwrap()).unwrap();
    let job = CString::new(job).unwrap();
    // SAFETY: valid C strings.
    unsafe { graphpool_shim_configure(sock.as_ptr(), job.as_ptr(), 0, 0, 0, c"0".as_ptr(), 0, 0) }
}

fn last_kind() -> String {
    let p = graphpool_shim_last_error();
    if p.is_null() {
        return String::new();
    }
    // SAFETY: valid C string from the shim.
    let s = unsafe { CStr::from_ptr(p) }.to_str().unwrap();
    serde_json::from_str::<serde_json::Value>(s).unwrap()["kind"].as_str().unwrap_or("").to_string()
}

#[test]
fn child_after_fork_is_refused_then_reconfigures() {
    let d = common::Daemon::start(1, "1GiB");
    assert_eq!(configure(&d.socket, "job-parent"), 0);
    let p = graphpool_alloc(4 << 20, 0, std::ptr::null_mut());
    assert!(!p.is_null());

    // SAFETY: the child only runs the checks below and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let mut code = 0;
        if !graphpool_alloc(2 << 20, 0, std::ptr::null_mut()).is_null() || last_kind() != "forked" {
            code |= 1;
        }
        // Freeing the parent's segment from the child is refused too (the parent keeps it).
        graphpool_free(p, 4 << 20, 0, std::ptr::null_mut());
        if last_kind() != "forked" {
            code |= 2;
        }
        if configure(&d.socket, "job-child") != 0 {
            code |= 4;
        }
        let q = graphpool_alloc(2 << 20, 0, std::ptr::null_mut());
        if q.is_null() {
            code |= 8;
        } else {
            graphpool_free(q, 2 << 20, 0, std::ptr::null_mut());
        }
        // SAFETY: leave the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status));
    assert_eq!(libc::WEXITSTATUS(status), 0, "child checks failed (bitmask)");

    // The parent's segment and session are untouched.
    let (mut g, mut n) = (0u64, 0u64);
    // SAFETY: valid out-pointers.
    assert_eq!(unsafe { graphpool_shim_stats(0, &mut g, &mut n) }, 0);
    assert_eq!((g, n), (4 << 20, 1));
    // SAFETY: p points at 4 MiB of mapped memory.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 1, 4 << 20) };
    graphpool_free(p, 4 << 20, 0, std::ptr::null_mut());
    assert_eq!(graphpool_shim_shutdown(), 0);
}
