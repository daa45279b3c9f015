//! Device backends: where segment memory comes from.
//!
//! Every backend hands out memory as a file descriptor that a client maps:
//! - [`cuda`]: CUDA VMM allocations (`cuMemCreate`) exported as POSIX fds. No CUDA context
//!   is ever created in the daemon.
//! - [`host`]: sealed `memfd`s on N simulated devices, so that every protocol, accounting and
//!   fault path runs on a machine without a GPU.

pub mod cuda;
pub mod host;
pub mod nvml;
pub mod stock;

use std::fmt;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use crate::config::{BackendChoice, Config};

/// Which backend a daemon runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// CUDA VMM allocations on real GPUs.
    Cuda,
    /// memfd-backed simulated devices.
    Host,
}

impl BackendKind {
    /// The name used in config, logs and the API.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Host => "host",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A device as the backend sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Index in the daemon's device list (CUDA ordinal for the cuda backend).
    pub index: u32,
    /// Stable identity, `GPU-xxxxxxxx-...` (the host backend makes `HOST-<n>-...` ones).
    pub uuid: String,
    /// Marketing name ("NVIDIA H200") or "host-memfd".
    pub name: String,
    /// Total device memory in bytes.
    pub total_bytes: u64,
    /// Allocation granularity in bytes; every segment is a multiple of it.
    pub granularity_bytes: u64,
}

/// Memory of a device as its driver sees it (all processes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverMemory {
    /// Bytes in use on the device.
    pub used_bytes: u64,
    /// Bytes free on the device.
    pub free_bytes: u64,
}

/// A segment of device memory created for one grant. Dropping it releases the daemon's
/// handle; the physical memory goes away once every importer has unmapped it too.
pub trait Segment: Send + Sync + fmt::Debug {
    /// The shareable fd to hand to the grant's owner.
    fn fd(&self) -> BorrowedFd<'_>;
    /// Size in bytes (a multiple of the device's granularity).
    fn size_bytes(&self) -> u64;
    /// What kind of handle [`Segment::fd`] is: `memfd` or `cuda-vmm-posix-fd`.
    fn handle_kind(&self) -> &'static str;
}

/// A source of device memory.
pub trait DeviceBackend: Send + Sync + fmt::Debug {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;
    /// The devices, in index order.
    fn devices(&self) -> &[DeviceInfo];
    /// Creates a segment of `size_bytes` (already a multiple of the granularity) on `device`.
    /// `headroom` is what graphpool's budget on the device still allows after this grant: a
    /// backend that keeps memory of its own (a warm stock) keeps at most that much.
    fn allocate(&self, device: u32, size_bytes: u64, headroom: u64)
    -> Result<Box<dyn Segment>, BackendError>;
    /// Destroys a released segment, possibly off the caller's path.
    fn retire(&self, segment: Box<dyn Segment>) {
        drop(segment);
    }
    /// Bytes the backend holds on `device` that are not granted (a warm stock).
    fn idle_bytes(&self, _device: u32) -> u64 {
        0
    }
    /// Live memory figures from the driver (NVML), where available.
    fn driver_memory(&self, device: u32) -> Option<DriverMemory>;
    /// What graphpool may grant on `device`: its total memory minus the configured reserve
    /// (cuda), or the configured capacity (host, where it equals `total_bytes`).
    fn capacity_bytes(&self, device: u32) -> Option<u64> {
        self.devices().get(device as usize).map(|d| d.total_bytes)
    }
}

/// Errors of a backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// No CUDA driver library could be loaded.
    #[error(
        "the CUDA driver (libcuda.so.1) could not be loaded: {0}; install the NVIDIA driver or run with --backend host"
    )]
    DriverUnavailable(String),
    /// The driver loaded but reports no device.
    #[error("the CUDA driver reports no GPU; run with --backend host on machines without one")]
    NoDevice,
    /// `cuda.reserve` leaves no memory of a device to graphpool.
    #[error(
        "cuda.reserve ({}) leaves nothing of device {device}'s {} to graphpool; set a smaller cuda.reserve",
        crate::units::SizeDisplay(*reserve), crate::units::SizeDisplay(*total)
    )]
    ReserveTooLarge {
        /// Device index.
        device: u32,
        /// The device's memory.
        total: u64,
        /// The reserve configured.
        reserve: u64,
    },
    /// A driver call failed.
    #[error("CUDA driver call {call} failed on device {device}: {message}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// Device index.
        device: u32,
        /// The driver's error name/description.
        message: String,
    },
    /// The device is out of physical memory even though the ledger admitted the request
    /// (memory used outside graphpool).
    #[error(
        "device {device} has no physical memory left for {size_bytes} bytes (memory used outside graphpool); lower the device budget"
    )]
    OutOfMemory {
        /// Device index.
        device: u32,
        /// Size asked for.
        size_bytes: u64,
    },
    /// The device index is not one of the backend's.
    #[error("no device with index {0}")]
    UnknownDevice(u32),
    /// An OS call failed (memfd_create, ftruncate, fcntl).
    #[error("{call} failed: {source}")]
    Os {
        /// The system call.
        call: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Opens the backend the configuration asks for. `auto` picks CUDA when a driver and a GPU
/// are present, otherwise the host backend, and logs which and why.
pub fn open(config: &Config) -> Result<Arc<dyn DeviceBackend>, BackendError> {
    match config.backend {
        BackendChoice::Host => Ok(Arc::new(host::HostBackend::new(&config.host)?)),
        BackendChoice::Cuda => Ok(stocked(cuda::CudaBackend::open(&config.cuda)?, config)),
        BackendChoice::Auto => match cuda::CudaBackend::open(&config.cuda) {
            Ok(b) => {
                tracing::info!(
                    devices = b.devices().len(),
                    "backend auto: CUDA driver and GPU found, using the cuda backend"
                );
                Ok(stocked(b, config))
            }
            Err(e) => {
                tracing::info!(reason = %e, "backend auto: no usable CUDA GPU, using the host (memfd) backend");
                Ok(Arc::new(host::HostBackend::new(&config.host)?))
            }
        },
    }
}

fn stocked(b: cuda::CudaBackend, config: &Config) -> Arc<dyn DeviceBackend> {
    let b: Arc<dyn DeviceBackend> = Arc::new(b);
    match config.cuda.warm_stock_bytes {
        0 => b,
        max => Arc::new(stock::Stocked::new(b, max)),
    }
}

/// Rounds `size` up to a multiple of `granularity` (a power of two or any positive value).
/// Returns `None` on overflow.
pub fn round_up(size: u64, granularity: u64) -> Option<u64> {
    debug_assert!(granularity > 0);
    let rem = size % granularity;
    if rem == 0 { Some(size) } else { size.checked_add(granularity - rem) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_up_rounds_to_granularity() {
        assert_eq!(round_up(1, 2 << 20), Some(2 << 20));
        assert_eq!(round_up(2 << 20, 2 << 20), Some(2 << 20));
        assert_eq!(round_up((2 << 20) + 1, 2 << 20), Some(4 << 20));
        assert_eq!(round_up(u64::MAX, 2 << 20), None);
    }
}
