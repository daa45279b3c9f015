//! The CUDA backend: VMM allocations exported as POSIX fds, with no CUDA context.
//!
//! The driver (`libcuda.so.1`) is loaded at run time through cudarc's raw bindings
//! (`cudarc::driver::sys`). Only context-free driver calls are made: `cuInit`, device queries,
//! `cuMemGetAllocationGranularity`, `cuMemCreate`, `cuMemExportToShareableHandle` and
//! `cuMemRelease`. A primary context would cost about 1.5 GiB of device memory per GPU
//! (measured on an H200), so the daemon never retains, creates or makes current any context;
//! its device memory is exactly what it granted. Live figures come from NVML ([`super::nvml`]).
//!
//! A segment is one physical allocation (`cuMemCreate`, pinned, on the device, with
//! `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` requested) and the fd it was exported to. The
//! client imports the fd (`cuMemImportFromShareableHandle`), reserves a VA range, maps it and
//! sets access. Dropping the segment closes the fd and releases the daemon's handle; the
//! physical memory is freed once every importer has released its handle too.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::nvml::Nvml;
use super::{BackendError, BackendKind, DeviceBackend, DeviceInfo, DriverMemory, Segment};
use crate::config::CudaConfig;

/// The handle kind of a CUDA segment's fd, as the API names it.
pub const HANDLE_KIND: &str = "cuda-vmm-posix-fd";

/// CUDA VMM devices.
#[derive(Debug)]
pub struct CudaBackend {
    devices: Vec<DeviceInfo>,
    /// Driver device handle of each entry of `devices`.
    handles: Vec<sys::CUdevice>,
    /// What graphpool may grant on each device: total minus the configured reserve.
    capacity: Vec<u64>,
    nvml: Option<Nvml>,
}

impl CudaBackend {
    /// Loads the driver and enumerates devices (those of `config.devices`, or all).
    ///
    /// Returns [`BackendError::DriverUnavailable`] when `libcuda.so.1` cannot be loaded or
    /// `cuInit` fails, [`BackendError::NoDevice`] when no (selected) device is present.
    /// Device indices are dense (0..n) in CUDA ordinal order of the selected devices.
    pub fn open(config: &CudaConfig) -> Result<Self, BackendError> {
        load_driver()?;
        // SAFETY: the driver library is loaded (checked above); cuInit takes flags = 0.
        let r = unsafe { sys::cuInit(0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(BackendError::DriverUnavailable(format!("cuInit failed: {}", error_text(r))));
        }
        let mut count: c_int = 0;
        // SAFETY: valid out-pointer; the driver is initialised.
        check(unsafe { sys::cuDeviceGetCount(&mut count) }, "cuDeviceGetCount", 0)?;
        if count <= 0 {
            return Err(BackendError::NoDevice);
        }
        let mut all = Vec::with_capacity(count as usize);
        for ordinal in 0..count {
            all.push(query_device(ordinal)?);
        }
        let selected = select_devices(&all, &config.devices);
        if selected.is_empty() {
            return Err(BackendError::NoDevice);
        }
        let nvml = Nvml::init();
        let mut devices = Vec::with_capacity(selected.len());
        let mut handles = Vec::with_capacity(selected.len());
        let mut capacity = Vec::with_capacity(selected.len());
        for (index, found) in selected.into_iter().enumerate() {
            let index = index as u32;
            let granularity_bytes = granularity(found.handle, index)?;
            let cap = found.total_bytes.saturating_sub(config.reserve_bytes);
            // Keep the capacity a multiple of the granularity so that it can be granted whole.
            let cap = cap - cap % granularity_bytes;
            if cap == 0 {
                return Err(BackendError::ReserveTooLarge {
                    device: index,
                    total: found.total_bytes,
                    reserve: config.reserve_bytes,
                });
            }
            tracing::info!(
                index,
                ordinal = found.ordinal,
                uuid = %found.uuid,
                name = %found.name,
                total_bytes = found.total_bytes,
                capacity_bytes = cap,
                granularity_bytes,
                "cuda device"
            );
            devices.push(DeviceInfo {
                index,
                uuid: found.uuid,
                name: found.name,
                total_bytes: found.total_bytes,
                granularity_bytes,
            });
            handles.push(found.handle);
            capacity.push(cap);
        }
        Ok(CudaBackend { devices, handles, capacity, nvml })
    }

    /// Memory process `pid` holds on device `device`, from NVML (`None` without NVML).
    /// For the daemon's own pid this must read 0: it never creates a context.
    pub fn process_used_bytes(&self, device: u32, pid: u32) -> Option<u64> {
        let info = self.devices.get(device as usize)?;
        self.nvml.as_ref()?.process_used_bytes(&info.uuid, pid)
    }
}

impl DeviceBackend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    fn capacity_bytes(&self, device: u32) -> Option<u64> {
        self.capacity.get(device as usize).copied()
    }

    fn allocate(
        &self,
        device: u32,
        size_bytes: u64,
        _headroom: u64,
    ) -> Result<Box<dyn Segment>, BackendError> {
        let info = self.devices.get(device as usize).ok_or(BackendError::UnknownDevice(device))?;
        let handle = self.handles[device as usize];
        debug_assert_eq!(size_bytes % info.granularity_bytes, 0);
        let size =
            usize::try_from(size_bytes).map_err(|_| BackendError::OutOfMemory { device, size_bytes })?;
        Ok(Box::new(CudaSegment::create(device, handle, size)?))
    }

    fn driver_memory(&self, device: u32) -> Option<DriverMemory> {
        let info = self.devices.get(device as usize)?;
        self.nvml.as_ref()?.memory(&info.uuid)
    }
}

/// One `cuMemCreate` allocation and the POSIX fd it was exported to.
#[derive(Debug)]
pub struct CudaSegment {
    fd: OwnedFd,
    handle: sys::CUmemGenericAllocationHandle,
    size_bytes: u64,
}

impl CudaSegment {
    fn create(device: u32, dev: sys::CUdevice, size: usize) -> Result<Self, BackendError> {
        let prop = allocation_prop(dev);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and a fully initialised prop; flags must be 0. No context
        // is needed for cuMemCreate with a device location.
        let r = unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(BackendError::OutOfMemory { device, size_bytes: size as u64 });
        }
        check(r, "cuMemCreate", device)?;
        let mut raw_fd: c_int = -1;
        // SAFETY: for POSIX fd handles the shareable handle is an `int` written through the
        // pointer; `handle` is a live allocation created with that handle type requested.
        let r = unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut raw_fd as *mut c_int).cast::<c_void>(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        if let Err(e) = check(r, "cuMemExportToShareableHandle", device) {
            // SAFETY: `handle` came from cuMemCreate above and is released exactly once.
            unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        // The driver's fd lacks FD_CLOEXEC; the daemon must not leak it into children.
        // SAFETY: `raw_fd` is a valid fd the driver just created for us.
        unsafe { libc::fcntl(raw_fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        // SAFETY: the exported fd is a fresh descriptor owned by us from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(raw_fd) };
        Ok(CudaSegment { fd, handle, size_bytes: size as u64 })
    }
}

impl Segment for CudaSegment {
    fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn handle_kind(&self) -> &'static str {
        HANDLE_KIND
    }
}

impl Drop for CudaSegment {
    fn drop(&mut self) {
        // The fd (OwnedFd) closes after this body; release the daemon's handle first.
        // SAFETY: `handle` came from cuMemCreate and is released exactly once, here.
        let r = unsafe { sys::cuMemRelease(self.handle) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(error = %error_text(r), size_bytes = self.size_bytes, "cuMemRelease failed");
        }
    }
}

/// A device as the driver enumerates it.
#[derive(Debug, Clone)]
struct FoundDevice {
    ordinal: c_int,
    handle: sys::CUdevice,
    uuid: String,
    name: String,
    total_bytes: u64,
}

/// Loads `libcuda` without panicking: cudarc's lazy loader panics when the library is
/// missing, so probe first and turn absence into [`BackendError::DriverUnavailable`].
fn load_driver() -> Result<(), BackendError> {
    // SAFETY: is_culib_present only tries to dlopen candidate names and drops them.
    if !unsafe { sys::is_culib_present() } {
        return Err(BackendError::DriverUnavailable(
            "libcuda.so.1 not found in the library search path".to_string(),
        ));
    }
    // A library that loads but lacks a symbol we use would panic inside cudarc's loader;
    // turn that into an error too.
    std::panic::catch_unwind(|| {
        // SAFETY: the library is present; culib() loads it once and keeps it for the process.
        let lib = unsafe { sys::culib() };
        for name in REQUIRED_SYMBOLS {
            // SAFETY: only checks that the symbol exists; it is not called here.
            unsafe { lib.get::<*const c_void>(name.as_bytes()) }.map_err(|e| format!("{name}: {e}"))?;
        }
        Ok::<(), String>(())
    })
    .map_err(|_| BackendError::DriverUnavailable("loading libcuda panicked".to_string()))?
    .map_err(|e| BackendError::DriverUnavailable(format!("libcuda lacks a required symbol: {e}")))
}

/// Every driver function the backend calls (their exact exported names).
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetUuid_v2",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemExportToShareableHandle",
    "cuMemRelease",
    "cuGetErrorName",
];

fn query_device(ordinal: c_int) -> Result<FoundDevice, BackendError> {
    let idx = ordinal as u32;
    let mut handle: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; ordinal < device count.
    check(unsafe { sys::cuDeviceGet(&mut handle, ordinal) }, "cuDeviceGet", idx)?;
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: valid out-pointer to a CUuuid; `handle` is a valid device.
    check(unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, handle) }, "cuDeviceGetUuid_v2", idx)?;
    let mut name = [0 as c_char; 256];
    // SAFETY: the buffer holds `len` bytes; the driver NUL-terminates within it.
    check(
        unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, handle) },
        "cuDeviceGetName",
        idx,
    )?;
    let mut total: usize = 0;
    // SAFETY: valid out-pointer; `handle` is a valid device. Needs no context.
    check(unsafe { sys::cuDeviceTotalMem_v2(&mut total, handle) }, "cuDeviceTotalMem_v2", idx)?;
    // SAFETY: the driver wrote a NUL-terminated string into `name` (last byte stays 0).
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
    let bytes: [u8; 16] = uuid.bytes.map(|b| b as u8);
    Ok(FoundDevice { ordinal, handle, uuid: format_uuid(&bytes), name, total_bytes: total as u64 })
}

/// The allocation properties of every segment: pinned device memory exportable as a POSIX fd.
fn allocation_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero is a valid value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop
}

fn granularity(dev: sys::CUdevice, index: u32) -> Result<u64, BackendError> {
    let prop = allocation_prop(dev);
    let mut g: usize = 0;
    // SAFETY: valid out-pointer and prop; needs no context.
    let r = unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    };
    check(r, "cuMemGetAllocationGranularity", index)?;
    if g == 0 {
        return Err(BackendError::Driver {
            call: "cuMemGetAllocationGranularity",
            device: index,
            message: "granularity 0".to_string(),
        });
    }
    Ok(g as u64)
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as nvidia-smi and NVML print it.
fn format_uuid(b: &[u8; 16]) -> String {
    let hex = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!("GPU-{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16))
}

/// The devices that `filter` (indices or UUIDs; empty = all) selects, in ordinal order.
/// Entries that match no device are logged and ignored.
fn select_devices(all: &[FoundDevice], filter: &[String]) -> Vec<FoundDevice> {
    if filter.is_empty() {
        return all.to_vec();
    }
    for entry in filter {
        if !all.iter().any(|d| matches_filter(d, entry)) {
            tracing::warn!(entry = %entry, "cuda.devices entry matches no device; ignored");
        }
    }
    all.iter().filter(|d| filter.iter().any(|e| matches_filter(d, e))).cloned().collect()
}

fn matches_filter(d: &FoundDevice, entry: &str) -> bool {
    let entry = entry.trim();
    match entry.parse::<c_int>() {
        Ok(i) => i == d.ordinal,
        Err(_) => entry.eq_ignore_ascii_case(&d.uuid),
    }
}

fn check(r: sys::CUresult, call: &'static str, device: u32) -> Result<(), BackendError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Driver { call, device, message: error_text(r) })
    }
}

/// The driver's name and description of an error code.
fn error_text(r: sys::CUresult) -> String {
    let mut name: *const c_char = std::ptr::null();
    let mut desc: *const c_char = std::ptr::null();
    // SAFETY: valid out-pointers; the driver returns static strings or leaves them null.
    unsafe {
        sys::cuGetErrorName(r, &mut name);
        sys::cuGetErrorString(r, &mut desc);
    }
    let s = |p: *const c_char| {
        // SAFETY: non-null pointers from the driver point to static NUL-terminated strings.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    match (s(name), s(desc)) {
        (Some(n), Some(d)) => format!("{n}: {d}"),
        (Some(n), None) => n,
        _ => format!("CUresult {}", r as i32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(ordinal: c_int, uuid: &str) -> FoundDevice {
        FoundDevice { ordinal, handle: ordinal, uuid: uuid.into(), name: "x".into(), total_bytes: 1 << 30 }
    }

    #[test]
    fn uuid_is_formatted_like_nvidia_smi() {
        let b: [u8; 16] =
            [0x3f, 0x1a, 0x00, 0xff, 0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x02, 0x03, 0x04];
        assert_eq!(format_uuid(&b), "GPU-3f1a00ff-1234-5678-9abc-def001020304");
    }

    #[test]
    fn device_filter_by_index_and_uuid() {
        let all = vec![found(0, "GPU-a"), found(1, "GPU-b"), found(2, "GPU-c")];
        assert_eq!(select_devices(&all, &[]).len(), 3);
        let s = select_devices(&all, &["2".into(), "gpu-A".into(), "GPU-zz".into()]);
        assert_eq!(s.iter().map(|d| d.ordinal).collect::<Vec<_>>(), vec![0, 2]);
        assert!(select_devices(&all, &["7".into()]).is_empty());
    }

    /// Without a driver, `open` reports it as unavailable instead of panicking; with one
    /// (on a GPU machine), it enumerates devices and a segment can be created and exported.
    #[test]
    fn open_without_driver_is_an_error_and_with_one_allocates() {
        let config = CudaConfig { reserve_bytes: 1 << 30, ..CudaConfig::default() };
        match CudaBackend::open(&config) {
            Err(BackendError::DriverUnavailable(_)) | Err(BackendError::NoDevice) => {}
            Err(e) => panic!("unexpected error: {e}"),
            Ok(b) => {
                let d = &b.devices()[0];
                assert!(d.uuid.starts_with("GPU-") && d.uuid.len() == 40, "{}", d.uuid);
                assert!(d.granularity_bytes > 0);
                assert_eq!(
                    b.capacity_bytes(0),
                    Some((d.total_bytes - (1 << 30)) / d.granularity_bytes * d.granularity_bytes)
                );
                let s = b.allocate(0, d.granularity_bytes, 0).unwrap();
                assert_eq!(s.size_bytes(), d.granularity_bytes);
                assert_eq!(s.handle_kind(), HANDLE_KIND);
                assert!(matches!(
                    b.allocate(99, d.granularity_bytes, 0),
                    Err(BackendError::UnknownDevice(99))
                ));
            }
        }
    }
}
