//! The daemon's open-file limit. Every segment it grants holds an fd (the exported CUDA
//! handle, or the memfd of the host backend) until it is released, and every connection holds
//! one more, so the soft `RLIMIT_NOFILE` (often 1024) is raised to the hard limit at start-up.

use std::io;

/// Below this many open files the daemon warns at start-up: a few ranks capturing with many
/// small segments reach it.
pub const LOW_OPEN_FILE_LIMIT: u64 = 65_536;

/// The soft and hard `RLIMIT_NOFILE` of this process (`u64::MAX` for unlimited).
pub fn open_file_limit() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit through a valid pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((as_count(lim.rlim_cur), as_count(lim.rlim_max)))
}

// `rlim_t` is `u64` on 64-bit Linux and narrower elsewhere: the conversions stay.
#[allow(clippy::useless_conversion)]
fn as_count(v: libc::rlim_t) -> u64 {
    if v == libc::RLIM_INFINITY { u64::MAX } else { u64::from(v) }
}

/// Raises the soft open-file limit to the hard limit (to the kernel's `fs.nr_open` where the
/// hard limit is unlimited). Returns the soft limit before and after.
pub fn raise_open_file_limit() -> io::Result<(u64, u64)> {
    let (soft, hard) = open_file_limit()?;
    let ceiling = if hard == u64::MAX {
        std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(1 << 20)
    } else {
        hard
    };
    if soft >= ceiling {
        return Ok((soft, soft));
    }
    let lim = libc::rlimit { rlim_cur: raw(ceiling), rlim_max: raw(hard) };
    // SAFETY: setrlimit reads one rlimit through a valid pointer.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((soft, open_file_limit()?.0))
}

#[allow(clippy::useless_conversion, clippy::unnecessary_fallible_conversions)]
fn raw(v: u64) -> libc::rlim_t {
    libc::rlim_t::try_from(v).unwrap_or(libc::RLIM_INFINITY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let (_, hard) = open_file_limit().unwrap();
        let (_, ceiling) = raise_open_file_limit().unwrap();
        assert!(ceiling > 0);
        if hard != u64::MAX {
            assert_eq!(ceiling, hard);
        }
        // One below the ceiling (other tests of this process keep their fds), then raised back.
        let lowered = libc::rlimit { rlim_cur: raw(ceiling - 1), rlim_max: raw(hard) };
        // SAFETY: setrlimit reads one rlimit through a valid pointer.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) }, 0);
        assert_eq!(open_file_limit().unwrap(), (ceiling - 1, hard));
        assert_eq!(raise_open_file_limit().unwrap(), (ceiling - 1, ceiling));
        // Nothing left to raise.
        assert_eq!(raise_open_file_limit().unwrap(), (ceiling, ceiling));
    }
}
