//! Peers: who is on the other end of a Unix socket, and when that process exits.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use tokio::io::unix::AsyncFd;

use crate::ledger::Peer;

/// Reads `SO_PEERCRED` of a connected Unix stream.
pub fn peer_of(stream: &tokio::net::UnixStream) -> io::Result<Peer> {
    let cred = stream.peer_cred()?;
    let pid = pid_of_ucred(&cred).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            "peer pid unknown (is the client in another pid namespace?)",
        )
    })?;
    Ok(Peer { pid, uid: cred.uid(), gid: cred.gid() })
}

/// Converts tonic's view of a Unix connection into a [`Peer`].
pub fn peer_of_ucred(cred: &tokio::net::unix::UCred) -> Option<Peer> {
    let pid = pid_of_ucred(cred)?;
    Some(Peer { pid, uid: cred.uid(), gid: cred.gid() })
}

/// The peer's pid, when the kernel could name it: a peer in another pid namespace has none
/// (0) in this one.
pub fn pid_of_ucred(cred: &tokio::net::unix::UCred) -> Option<u32> {
    cred.pid().and_then(|p| u32::try_from(p).ok()).filter(|p| *p > 0)
}

/// Resolves when process `pid` has exited. Uses a pidfd where the kernel has one, and
/// otherwise polls `/proc/<pid>` every 100 ms.
pub async fn process_exit(pid: u32) {
    match pidfd_open(pid) {
        // SAFETY: the pidfd is owned by the AsyncFd and closed only when it is dropped.
        Ok(fd) => match unsafe { AsyncFd::register(fd) } {
            Ok(afd) => {
                // A pidfd becomes readable when the process exits.
                if let Ok(mut guard) = afd.readable().await {
                    guard.retain_ready();
                }
            }
            Err(_) => poll_proc(pid).await,
        },
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
        Err(_) => poll_proc(pid).await,
    }
}

async fn poll_proc(pid: u32) {
    let path = format!("/proc/{pid}");
    while std::path::Path::new(&path).exists() && !is_zombie(pid) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('Z')))
        .unwrap_or(true)
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the syscall returned a fresh fd that we now own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    debug_assert!(fd.as_raw_fd() >= 0);
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn notices_child_exit() {
        let mut child = std::process::Command::new("sleep").arg("0.2").spawn().unwrap();
        let pid = child.id();
        let waiter = tokio::spawn(process_exit(pid));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        // Reap in a thread so the pid stays valid until the exit was seen.
        std::thread::spawn(move || child.wait());
        tokio::time::timeout(Duration::from_secs(2), waiter).await.unwrap().unwrap();
    }
}
