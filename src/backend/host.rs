//! The host backend: N simulated devices whose segments are sealed `memfd`s.
//!
//! It is a real implementation, not a mock: a grant is a memfd of exactly the granted size,
//! sealed against shrinking and growing, handed over the same fd socket as CUDA handles. A
//! client maps it with `mmap`. Pages are committed only when written.

use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

use super::{BackendError, BackendKind, DeviceBackend, DeviceInfo, DriverMemory, Segment};
use crate::config::HostConfig;

/// memfd-backed simulated devices.
#[derive(Debug)]
pub struct HostBackend {
    devices: Vec<DeviceInfo>,
}

impl HostBackend {
    /// Creates `config.devices` devices of `config.capacity_bytes` each.
    pub fn new(config: &HostConfig) -> Result<Self, BackendError> {
        let devices = (0..config.devices)
            .map(|i| DeviceInfo {
                index: i,
                uuid: format!("HOST-{i:08x}-0000-4000-8000-{:012x}", u64::from(i) + 1),
                name: "host-memfd".to_string(),
                total_bytes: config.capacity_bytes,
                granularity_bytes: config.granularity_bytes,
            })
            .collect();
        Ok(HostBackend { devices })
    }
}

impl DeviceBackend for HostBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    fn allocate(
        &self,
        device: u32,
        size_bytes: u64,
        _headroom: u64,
    ) -> Result<Box<dyn Segment>, BackendError> {
        let info = self.devices.get(device as usize).ok_or(BackendError::UnknownDevice(device))?;
        debug_assert_eq!(size_bytes % info.granularity_bytes, 0);
        Ok(Box::new(MemfdSegment::create(device, size_bytes)?))
    }

    fn driver_memory(&self, _device: u32) -> Option<DriverMemory> {
        None
    }
}

/// A sealed memfd of a fixed size.
#[derive(Debug)]
pub struct MemfdSegment {
    fd: OwnedFd,
    size_bytes: u64,
}

impl MemfdSegment {
    fn create(device: u32, size_bytes: u64) -> Result<Self, BackendError> {
        let os = |call| move |source| BackendError::Os { call, source };
        let name = CString::new(format!("graphpool-host{device}")).expect("no NUL");
        // SAFETY: `name` is a valid C string; flags are valid for memfd_create.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(os("memfd_create")(std::io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let len = libc::off_t::try_from(size_bytes)
            .map_err(|_| os("ftruncate")(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
        // SAFETY: valid fd and length.
        if unsafe { libc::ftruncate(raw, len) } != 0 {
            return Err(os("ftruncate")(std::io::Error::last_os_error()));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: valid fd; F_ADD_SEALS takes an int.
        if unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, seals) } != 0 {
            return Err(os("fcntl(F_ADD_SEALS)")(std::io::Error::last_os_error()));
        }
        Ok(MemfdSegment { fd, size_bytes })
    }
}

impl Segment for MemfdSegment {
    fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn handle_kind(&self) -> &'static str {
        "memfd"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn segment_is_sealed_memfd_of_the_size() {
        let b = HostBackend::new(&HostConfig::default()).unwrap();
        assert_eq!(b.devices().len(), 2);
        let s = b.allocate(1, 4 << 20, 0).unwrap();
        let fd = s.fd().as_raw_fd();
        // SAFETY: fstat on a valid fd into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
        assert_eq!(st.st_size as u64, 4 << 20);
        // SAFETY: growing must fail because of F_SEAL_GROW.
        assert_ne!(unsafe { libc::ftruncate(fd, 8 << 20) }, 0);
        let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
        assert_ne!(seals & libc::F_SEAL_GROW, 0);
        assert!(matches!(b.allocate(9, 2 << 20, 0), Err(BackendError::UnknownDevice(9))));
    }
}
