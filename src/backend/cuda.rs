//! The CUDA backend: VMM allocations exported as POSIX fds, with no CUDA context.
//! (Being written: until then it reports the driver as unavailable.)

use super::{BackendError, BackendKind, DeviceBackend, DeviceInfo, DriverMemory, Segment};
use crate::config::CudaConfig;

/// CUDA VMM devices.
#[derive(Debug)]
pub struct CudaBackend {
    devices: Vec<DeviceInfo>,
}

impl CudaBackend {
    /// Loads the driver and enumerates devices.
    pub fn open(_config: &CudaConfig) -> Result<Self, BackendError> {
        Err(BackendError::DriverUnavailable("not built yet".into()))
    }
}

impl DeviceBackend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }
    fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }
    fn allocate(&self, device: u32, _size_bytes: u64) -> Result<Box<dyn Segment>, BackendError> {
        Err(BackendError::UnknownDevice(device))
    }
    fn driver_memory(&self, _device: u32) -> Option<DriverMemory> {
        None
    }
}
