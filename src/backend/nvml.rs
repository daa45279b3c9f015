//! Live device memory figures from NVML (libnvidia-ml, loaded at run time).
//!
//! NVML needs no CUDA context, so the daemon can report what the driver sees — all processes'
//! memory on a device, and the memory a given process holds — without costing any device
//! memory itself. When NVML cannot be loaded or initialised every figure is `None`: the
//! figures are informative, never a reason to fail.

use std::fmt;

use nvml_wrapper::Nvml as NvmlLib;
use nvml_wrapper::enums::device::UsedGpuMemory;

use super::DriverMemory;

/// An initialised NVML library.
pub struct Nvml {
    lib: NvmlLib,
}

impl fmt::Debug for Nvml {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nvml").finish_non_exhaustive()
    }
}

/// Device memory one process holds on one device, as NVML lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessDeviceMemory {
    /// Device UUID (`GPU-...`).
    pub device_uuid: String,
    /// Bytes the process uses there; `None` where the driver does not say.
    pub used_bytes: Option<u64>,
}

impl Nvml {
    /// Loads and initialises NVML; `None` (with a debug log) where it is unavailable.
    pub fn init() -> Option<Self> {
        match NvmlLib::init() {
            Ok(lib) => Some(Nvml { lib }),
            Err(e) => {
                tracing::debug!(error = %e, "NVML unavailable; live driver memory figures are not reported");
                None
            }
        }
    }

    /// Used and free memory of the device with this UUID, all processes together.
    pub fn memory(&self, uuid: &str) -> Option<DriverMemory> {
        let dev = self.lib.device_by_uuid(uuid).ok()?;
        let info = dev.memory_info().ok()?;
        Some(DriverMemory { used_bytes: info.used, free_bytes: info.free })
    }

    /// Memory that process `pid` holds on the device with this UUID, from NVML's list of
    /// running compute processes. `Some(0)` when the process is not listed there (a process
    /// with no CUDA context is not); `None` when NVML cannot answer.
    pub fn process_used_bytes(&self, uuid: &str, pid: u32) -> Option<u64> {
        let dev = self.lib.device_by_uuid(uuid).ok()?;
        let procs = dev.running_compute_processes().ok()?;
        Some(
            procs
                .iter()
                .filter(|p| p.pid == pid)
                .map(|p| match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => b,
                    UsedGpuMemory::Unavailable => 0,
                })
                .sum(),
        )
    }

    /// Every device on which process `pid` is listed as a compute process, with its memory.
    pub fn process_memory(&self, pid: u32) -> Option<Vec<ProcessDeviceMemory>> {
        let count = self.lib.device_count().ok()?;
        let mut out = Vec::new();
        for i in 0..count {
            let Ok(dev) = self.lib.device_by_index(i) else { continue };
            let Ok(uuid) = dev.uuid() else { continue };
            let Ok(procs) = dev.running_compute_processes() else { continue };
            for p in procs.iter().filter(|p| p.pid == pid) {
                let used_bytes = match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                };
                out.push(ProcessDeviceMemory { device_uuid: uuid.clone(), used_bytes });
            }
        }
        Some(out)
    }
}

/// Device memory that process `pid` holds, per device, from NVML's running compute
/// processes; `None` when NVML is unavailable. Used to report the daemon's own device memory
/// (`process_memory(std::process::id())`), which must stay zero: it never creates a context.
pub fn process_memory(pid: u32) -> Option<Vec<ProcessDeviceMemory>> {
    Nvml::init()?.process_memory(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_nvml_gives_none_not_an_error() {
        // On a machine with a driver this reads real figures; without one it must not fail.
        match Nvml::init() {
            Some(n) => {
                assert!(n.memory("GPU-00000000-0000-0000-0000-000000000000").is_none());
                assert!(n.process_memory(std::process::id()).is_some());
            }
            None => assert!(process_memory(std::process::id()).is_none()),
        }
    }
}
