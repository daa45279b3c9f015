//! Turning a granted fd into memory the caller can use, and undoing it.
//!
//! - `cuda-vmm-posix-fd`: `cuMemImportFromShareableHandle`, close the fd, `cuMemAddressReserve`,
//!   `cuMemMap`, `cuMemSetAccess` (read/write for the device). Undo: `cuMemUnmap`,
//!   `cuMemAddressFree`, `cuMemRelease`. The driver is loaded at run time (cudarc's raw API);
//!   calls run on the caller's thread, which for torch has the device's context current.
//! - `memfd` (the daemon's host backend): `mmap(MAP_SHARED)`, close the fd. Undo: `munmap`.

use std::ffi::{CStr, c_char, c_void};
use std::os::fd::{IntoRawFd, OwnedFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use cudarc::driver::sys;

use crate::error::ShimError;

/// Handle kind of the daemon's CUDA segments.
pub const CUDA_KIND: &str = "cuda-vmm-posix-fd";
/// Handle kind of the daemon's host segments.
pub const MEMFD_KIND: &str = "memfd";

/// A mapped segment.
#[derive(Debug)]
pub enum Mapping {
    /// A CUDA VMM import.
    Cuda {
        /// Device pointer (start of the reserved VA range).
        ptr: u64,
        /// Mapped size.
        size: usize,
        /// The imported allocation handle.
        handle: sys::CUmemGenericAllocationHandle,
    },
    /// A host mapping of a memfd.
    Host {
        /// Start of the mapping.
        ptr: usize,
        /// Mapped size.
        size: usize,
    },
}

impl Mapping {
    /// Maps `fd` (consumed: closed once mapped) of `kind` and `size` for `device`.
    pub fn map(kind: &str, fd: OwnedFd, size: u64, device: i32) -> Result<Mapping, ShimError> {
        let size = usize::try_from(size).map_err(|_| ShimError::Invalid(format!("size {size} too large")))?;
        match kind {
            MEMFD_KIND => map_memfd(fd, size),
            CUDA_KIND => import_cuda(fd, size, device),
            other => Err(ShimError::Invalid(format!("unknown handle kind {other:?} from the daemon"))),
        }
    }

    /// The address the caller uses.
    pub fn ptr(&self) -> usize {
        match self {
            Mapping::Cuda { ptr, .. } => *ptr as usize,
            Mapping::Host { ptr, .. } => *ptr,
        }
    }

    /// Mapped size.
    pub fn size(&self) -> usize {
        match self {
            Mapping::Cuda { size, .. } | Mapping::Host { size, .. } => *size,
        }
    }

    /// Unmaps and releases. Errors are returned but the mapping is gone either way.
    pub fn unmap(self) -> Result<(), ShimError> {
        match self {
            Mapping::Host { ptr, size } => {
                // SAFETY: (ptr, size) is a mapping this module created with mmap and that is
                // unmapped exactly once, here.
                if unsafe { libc::munmap(ptr as *mut c_void, size) } != 0 {
                    return Err(ShimError::Os { call: "munmap", source: std::io::Error::last_os_error() });
                }
                Ok(())
            }
            Mapping::Cuda { ptr, size, handle } => unmap_cuda(ptr, size, handle),
        }
    }
}

fn map_memfd(fd: OwnedFd, size: usize) -> Result<Mapping, ShimError> {
    use std::os::fd::AsRawFd;
    // SAFETY: mapping a valid fd with a length that the daemon sized it to; the kernel picks
    // the address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(ShimError::Os { call: "mmap", source: std::io::Error::last_os_error() });
    }
    drop(fd);
    Ok(Mapping::Host { ptr: p as usize, size })
}

/// Loads libcuda and runs `cuInit` once; the error is remembered. Refused in a forked child of
/// the process that did (CUDA does not work there), without waiting on the once-lock, which a
/// parent thread may have held at fork time.
fn driver() -> Result<(), ShimError> {
    static INIT: OnceLock<Result<(), String>> = OnceLock::new();
    static INIT_PID: AtomicU32 = AtomicU32::new(0);
    let pid = std::process::id();
    match INIT_PID.compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {}
        Err(p) if p == pid => {}
        Err(p) => {
            return Err(ShimError::Cuda {
                call: "loading the CUDA driver",
                message: format!(
                    "this process is a fork of pid {p}, which loaded CUDA; CUDA cannot be used in a \
                     forked child (start the process with spawn instead)"
                ),
            });
        }
    }
    INIT.get_or_init(|| {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcuda.so.1 not found".to_string());
        }
        let symbols_ok = std::panic::catch_unwind(|| {
            // SAFETY: the library is present; culib() opens it once for the process.
            let lib = unsafe { sys::culib() };
            REQUIRED_SYMBOLS.iter().all(|name| {
                // SAFETY: only looks the symbol up; it is not called.
                unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_ok()
            })
        })
        .unwrap_or(false);
        if !symbols_ok {
            return Err("libcuda lacks a VMM symbol the shim needs".to_string());
        }
        // SAFETY: the library is loaded; flags must be 0.
        let r = unsafe { sys::cuInit(0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuInit: {}", error_text(r)));
        }
        Ok(())
    })
    .clone()
    .map_err(|message| ShimError::Cuda { call: "loading the CUDA driver", message })
}

const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetUuid_v2",
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemRelease",
    "cuGetErrorName",
    "cuGetErrorString",
];

fn check(r: sys::CUresult, call: &'static str) -> Result<(), ShimError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(ShimError::Cuda { call, message: error_text(r) })
    }
}

fn error_text(r: sys::CUresult) -> String {
    let mut name: *const c_char = std::ptr::null();
    let mut desc: *const c_char = std::ptr::null();
    // SAFETY: valid out-pointers; the driver sets them to static strings or leaves them null.
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

/// Imports a CUDA VMM fd and maps it read/write for `device` (a CUDA ordinal of this
/// process). The fd is closed once imported.
pub fn import_cuda(fd: OwnedFd, size: usize, device: i32) -> Result<Mapping, ShimError> {
    driver()?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; the driver is initialised.
    check(unsafe { sys::cuDeviceGet(&mut dev, device) }, "cuDeviceGet")?;
    let raw = fd.into_raw_fd();
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: for POSIX fd handles the OS handle is the fd value passed as a pointer-sized
    // integer; `raw` is a valid fd we own.
    let r = unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            raw as usize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    };
    // The import holds its own reference to the memory; the fd is no longer needed.
    // SAFETY: `raw` is ours and closed exactly once.
    unsafe { libc::close(raw) };
    check(r, "cuMemImportFromShareableHandle")?;
    let release = |h| {
        // SAFETY: `h` is the imported handle, released exactly once on this error path.
        unsafe { sys::cuMemRelease(h) };
    };
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: valid out-pointer; alignment 0 = the default (the allocation granularity).
    let r = unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) };
    if let Err(e) = check(r, "cuMemAddressReserve") {
        release(handle);
        return Err(e);
    }
    // SAFETY: maps the whole imported allocation at the start of the range just reserved.
    let r = unsafe { sys::cuMemMap(ptr, size, 0, handle, 0) };
    if let Err(e) = check(r, "cuMemMap") {
        // SAFETY: the range was reserved above with this size and is freed once.
        unsafe { sys::cuMemAddressFree(ptr, size) };
        release(handle);
        return Err(e);
    }
    // SAFETY: CUmemAccessDesc is a plain C struct; zeroed is valid before the fields are set.
    let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = dev;
    desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    // SAFETY: (ptr, size) is exactly the range mapped above; one descriptor.
    let r = unsafe { sys::cuMemSetAccess(ptr, size, &desc, 1) };
    if let Err(e) = check(r, "cuMemSetAccess") {
        let _ = unmap_cuda(ptr, size, handle);
        return Err(e);
    }
    Ok(Mapping::Cuda { ptr, size, handle })
}

fn unmap_cuda(ptr: u64, size: usize, handle: sys::CUmemGenericAllocationHandle) -> Result<(), ShimError> {
    // SAFETY: (ptr, size) was mapped and reserved by import_cuda, and `handle` imported there;
    // each is undone exactly once, in this order.
    let (a, b, c) =
        unsafe { (sys::cuMemUnmap(ptr, size), sys::cuMemAddressFree(ptr, size), sys::cuMemRelease(handle)) };
    check(a, "cuMemUnmap")?;
    check(b, "cuMemAddressFree")?;
    check(c, "cuMemRelease")
}

/// The UUID (`GPU-...`) of CUDA device `device` of this process, to name it to the daemon.
pub fn cuda_device_uuid(device: i32) -> Result<String, ShimError> {
    driver()?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; the driver is initialised.
    check(unsafe { sys::cuDeviceGet(&mut dev, device) }, "cuDeviceGet")?;
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: valid out-pointer; `dev` is a valid device.
    check(unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev) }, "cuDeviceGetUuid_v2")?;
    let b = uuid.bytes.map(|x| x as u8);
    let hex = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    Ok(format!("GPU-{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    #[test]
    fn memfd_maps_shared_and_unmaps() {
        let name = c"shim-test";
        // SAFETY: valid name and flags.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: fresh fd.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: valid fd and size.
        assert_eq!(unsafe { libc::ftruncate(raw, 4 << 20) }, 0);
        // SAFETY: dup of a valid fd, to read the memfd back after the mapping closes its copy.
        let check_fd = unsafe { OwnedFd::from_raw_fd(libc::dup(raw)) };
        let m = Mapping::map(MEMFD_KIND, fd, 4 << 20, 0).unwrap();
        assert_eq!(m.size(), 4 << 20);
        // SAFETY: the mapping is 4 MiB, read/write.
        unsafe { *(m.ptr() as *mut u8).add(12345) = 0xab };
        m.unmap().unwrap();
        let mut b = [0u8; 1];
        use std::os::fd::AsRawFd;
        // SAFETY: reading one byte into a valid buffer.
        assert_eq!(unsafe { libc::pread(check_fd.as_raw_fd(), b.as_mut_ptr().cast(), 1, 12345) }, 1);
        assert_eq!(b[0], 0xab);
    }

    #[test]
    fn unknown_kind_is_refused() {
        // SAFETY: /dev/null opened read-only is a valid fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY)) };
        assert!(matches!(Mapping::map("weird", fd, 4096, 0), Err(ShimError::Invalid(_))));
    }
}
