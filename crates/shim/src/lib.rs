//! `libgraphpool_shim.so`: the allocator behind `graphpool.torch.MemPool`.
//!
//! torch's `CUDAPluggableAllocator(path, "graphpool_alloc", "graphpool_free")` calls
//! [`graphpool_alloc`] and [`graphpool_free`] from C++, without the GIL, also while a stream
//! is being captured. Each call is served here with no Python on the path: the shim keeps one
//! daemon session per CUDA device (its Attach stream read by a task of a small tokio runtime
//! that the shim owns), asks graphpoold for a segment per torch segment request
//! (`AllocateSegment`), fetches the fd over the fd socket, imports and maps it
//! (`cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`), and
//! returns the device pointer. Free unmaps, releases the handle and the VA range, and releases
//! the grant. The daemon's host backend hands out `memfd`s; those are `mmap`ed instead, so the
//! whole daemon path is tested without a GPU.
//!
//! **Per segment, not ahead.** torch's caching allocator already turns many tensor
//! allocations into few segment requests (2 MiB, 20 MiB, or the rounded size of a large
//! tensor) and keeps them cached in the pool, so the shim asks the daemon once per torch
//! segment. Capacity can still be secured ahead, without holding physical memory: with
//! `reserve_budget` the daemon admits the whole budget at attach, so later segment requests up
//! to it cannot be refused. Holding physical memory ahead would make the daemon's ledger show
//! memory torch never used and would need a sub-allocator that the caching allocator already
//! is. The measured cost per request is in README (bench/gpu).
//!
//! **Errors.** A refused or failed request returns NULL to torch (which raises
//! `torch.OutOfMemoryError`); [`graphpool_shim_last_error`] returns the reason as JSON,
//! including the daemon's structured capacity refusal, so `graphpool.torch` raises
//! `graphpool.CapacityExceeded` instead.
//!
//! **Daemon restarts.** When graphpoold dies or restarts, each session's task re-attaches on
//! its own with backoff, declaring the segments still mapped, so the new daemon's ledger
//! equals the old one's; allocations meanwhile fail with an `unavailable` last-error that says
//! the daemon is restarting, and frees are local (not declared). Details: [`mod@session`].
//!
//! **fork.** Sessions, the runtime and mappings belong to the process that configured them.
//! In a forked child every call refuses with a `forked` error until the child configures the
//! shim again; the parent's state is left untouched (never dropped) in the child.

pub mod error;
pub mod fdsock;
pub mod map;
pub mod session;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use error::ShimError;
use map::Mapping;
use session::{AttachParams, Session, Timing};

/// The shim's process-wide state.
struct Shim {
    pid: u32,
    rt: tokio::runtime::Runtime,
    sessions: HashMap<i32, Arc<Session>>,
    /// Segments mapped through [`graphpool_shim_import`] (not tied to a session).
    imports: HashMap<usize, Mapping>,
}

static STATE: Mutex<Option<Shim>> = Mutex::new(None);
static LAST_ERROR: Mutex<Option<String>> = Mutex::new(None);

thread_local! {
    static ERROR_COPY: RefCell<CString> = RefCell::new(CString::default());
    static LAST_TIMING: Cell<Timing> = Cell::new(Timing::default());
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn set_error(e: &ShimError) {
    let json = e.to_json().to_string();
    if std::env::var_os("GRAPHPOOL_SHIM_LOG").is_some() {
        eprintln!("graphpool shim: {json}");
    }
    *lock(&LAST_ERROR) = Some(json);
}

fn clear_error() {
    *lock(&LAST_ERROR) = None;
}

/// Runs `f` with the state of this process, checking that it was configured here (not in
/// a parent before fork).
fn with_state<R>(f: impl FnOnce(&mut Shim) -> Result<R, ShimError>) -> Result<R, ShimError> {
    let mut guard = lock(&STATE);
    let pid = std::process::id();
    match guard.as_mut() {
        Some(s) if s.pid == pid => f(s),
        Some(s) => Err(ShimError::Forked { parent: s.pid, child: pid }),
        None => Err(ShimError::NotConfigured { device: -1 }),
    }
}

/// The state of this process, created on first use. A fork's copy of the parent's state is
/// leaked, never dropped: its runtime's threads do not exist in the child, and dropping it
/// would wait for them.
fn ensure_state(guard: &mut Option<Shim>, pid: u32) -> Result<&mut Shim, ShimError> {
    if guard.as_ref().is_some_and(|s| s.pid != pid) {
        std::mem::forget(guard.take());
    }
    if guard.is_none() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("graphpool-shim")
            .enable_all()
            .build()
            .map_err(|source| ShimError::Os { call: "starting the shim's runtime", source })?;
        *guard = Some(Shim { pid, rt, sessions: HashMap::new(), imports: HashMap::new() });
    }
    Ok(guard.as_mut().expect("set above"))
}

fn session(device: i32) -> Result<Arc<Session>, ShimError> {
    with_state(|s| s.sessions.get(&device).cloned().ok_or(ShimError::NotConfigured { device })).map_err(|e| {
        match e {
            ShimError::NotConfigured { .. } => ShimError::NotConfigured { device },
            e => e,
        }
    })
}

/// Catches panics at the C boundary: they must never unwind into torch.
fn guarded<R>(fail: R, f: impl FnOnce() -> Result<R, ShimError>) -> R {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            set_error(&e);
            fail
        }
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            set_error(&ShimError::Invalid(format!("internal error (panic): {msg}")));
            fail
        }
    }
}

/// # Safety
/// `p` is NULL or a valid NUL-terminated string.
unsafe fn c_str(p: *const c_char) -> Result<Option<String>, ShimError> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller guarantees a valid NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| ShimError::Invalid("a string argument is not UTF-8".to_string()))?;
    Ok((!s.is_empty()).then(|| s.to_string()))
}

/// The daemon's socket when none is given: `GRAPHPOOL_SOCKET`, else
/// `/run/graphpool/graphpool.sock` when it exists, else under `$XDG_RUNTIME_DIR`.
fn default_socket() -> Result<PathBuf, ShimError> {
    if let Some(s) = std::env::var_os("GRAPHPOOL_SOCKET").filter(|s| !s.is_empty()) {
        return Ok(PathBuf::from(s));
    }
    let system = PathBuf::from("/run/graphpool/graphpool.sock");
    if system.exists() {
        return Ok(system);
    }
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|s| !s.is_empty()) {
        Some(d) => Ok(PathBuf::from(d).join("graphpool/graphpool.sock")),
        None => Ok(system),
    }
}

/// Opens (or replaces) the daemon session of CUDA device `device` of this process.
///
/// - `socket`: the daemon's gRPC socket; NULL or "" = `GRAPHPOOL_SOCKET` or the default.
/// - `job_id`, `rank`, `local_rank`: who this process is.
/// - `device`: the CUDA device index torch will pass to `graphpool_alloc`.
/// - `daemon_device`: the device as the daemon names it (UUID or index); NULL or "" = the UUID
///   of CUDA device `device` (from the driver).
/// - `budget_bytes` (0 = none) and `reserve_budget` (nonzero = admit the whole budget now).
///
/// Returns 0 on success, -1 on error (see [`graphpool_shim_last_error`]). A session of the
/// same device that still has segments mapped is not replaced (error).
///
/// # Safety
/// String arguments are NULL or valid NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn graphpool_shim_configure(
    socket: *const c_char,
    job_id: *const c_char,
    rank: u32,
    local_rank: u32,
    device: c_int,
    daemon_device: *const c_char,
    budget_bytes: u64,
    reserve_budget: c_int,
) -> c_int {
    guarded(-1, || {
        // SAFETY: forwarded from the caller's contract.
        let (socket, job_id, daemon_device) =
            unsafe { (c_str(socket)?, c_str(job_id)?, c_str(daemon_device)?) };
        let socket = match socket {
            Some(s) => PathBuf::from(s),
            None => default_socket()?,
        };
        let job_id = job_id.ok_or_else(|| ShimError::Invalid("job_id is empty".to_string()))?;
        if device < 0 {
            return Err(ShimError::Invalid(format!("device {device} is negative")));
        }
        let daemon_device = match daemon_device {
            Some(d) => d,
            None => map::cuda_device_uuid(device)?,
        };
        let params = AttachParams {
            socket,
            job_id,
            rank,
            local_rank,
            device,
            daemon_device,
            budget_bytes,
            reserve_budget: reserve_budget != 0,
        };
        let rt = {
            let mut guard = lock(&STATE);
            let pid = std::process::id();
            let shim = ensure_state(&mut guard, pid)?;
            if let Some(old) = shim.sessions.get(&device)
                && old.has_segments()
            {
                return Err(ShimError::Invalid(format!(
                    "device {device} already has a daemon session (id {}) with segments mapped; \
                     release the pool that uses them first",
                    old.session_id()
                )));
            }
            shim.rt.handle().clone()
        };
        // Attach outside the lock: it waits for the daemon.
        let new = Arc::new(Session::attach(&rt, &params)?);
        let old = with_state(|s| Ok(s.sessions.insert(device, new)))?;
        if let Some(old) = old {
            let _ = old.detach();
        }
        clear_error();
        Ok(0)
    })
}

/// torch's allocation hook: a segment of `size` bytes on `device`. NULL when refused or
/// failed (reason in [`graphpool_shim_last_error`]).
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_alloc(size: usize, device: c_int, _stream: *mut c_void) -> *mut c_void {
    guarded(std::ptr::null_mut(), || {
        if size == 0 {
            return Ok(std::ptr::null_mut());
        }
        let s = session(device)?;
        let (ptr, timing) = s.allocate(size as u64)?;
        LAST_TIMING.with(|t| t.set(timing));
        Ok(ptr as *mut c_void)
    })
}

/// torch's free hook: unmaps the segment at `ptr` and releases its grant.
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_free(ptr: *mut c_void, _size: usize, device: c_int, _stream: *mut c_void) {
    guarded((), || {
        if ptr.is_null() {
            return Ok(());
        }
        let s = session(device)?;
        s.free(ptr as usize)
    })
}

/// Granted bytes and segment count of `device`'s session. Returns 0, or -1 when the device
/// has no session.
///
/// # Safety
/// `granted` and `segments` are NULL or valid pointers to `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn graphpool_shim_stats(device: c_int, granted: *mut u64, segments: *mut u64) -> c_int {
    guarded(-1, || {
        let (g, n) = session(device)?.stats();
        // SAFETY: the caller passes NULL or valid pointers.
        unsafe {
            if !granted.is_null() {
                *granted = g;
            }
            if !segments.is_null() {
                *segments = n;
            }
        }
        Ok(0)
    })
}

/// The daemon session id, reserved bytes and device UUID (into `uuid`, `uuid_len` bytes
/// with the NUL) of `device`'s session. Returns 0, or -1 without a session.
///
/// # Safety
/// Pointers are NULL or valid; `uuid` has room for `uuid_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn graphpool_shim_session_info(
    device: c_int,
    session_id: *mut u64,
    reserved_bytes: *mut u64,
    uuid: *mut c_char,
    uuid_len: usize,
) -> c_int {
    guarded(-1, || {
        let s = session(device)?;
        // SAFETY: the caller passes NULL or valid pointers, and `uuid_len` bytes at `uuid`.
        unsafe {
            if !session_id.is_null() {
                *session_id = s.session_id();
            }
            if !reserved_bytes.is_null() {
                *reserved_bytes = s.reserved_bytes();
            }
            if !uuid.is_null() && uuid_len > 0 {
                let b = s.device_uuid.as_bytes();
                let n = b.len().min(uuid_len - 1);
                std::ptr::copy_nonoverlapping(b.as_ptr(), uuid.cast::<u8>(), n);
                *uuid.add(n) = 0;
            }
        }
        Ok(0)
    })
}

/// Where `device`'s session stands with the daemon: returns 0 attached, 1 re-attaching after
/// the daemon went away, 2 ended, -1 no session. `reattaches` (if not NULL) receives how many
/// times it re-attached, `recovery_ns` how long the last re-attach took (from the end of the
/// old stream to the new `attached` event).
///
/// # Safety
/// `reattaches` and `recovery_ns` are NULL or valid pointers to `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn graphpool_shim_session_state(
    device: c_int,
    reattaches: *mut u64,
    recovery_ns: *mut u64,
) -> c_int {
    guarded(-1, || {
        let (state, n, ns) = session(device)?.link_state();
        // SAFETY: the caller passes NULL or valid pointers.
        unsafe {
            if !reattaches.is_null() {
                *reattaches = n;
            }
            if !recovery_ns.is_null() {
                *recovery_ns = ns;
            }
        }
        Ok(state as c_int)
    })
}

/// Phases of this thread's last successful segment request, in nanoseconds:
/// `out[0]` RPC, `out[1]` fd fetch, `out[2]` import+map, `out[3]` total.
///
/// # Safety
/// `out` points to 4 writable `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn graphpool_shim_last_timing(out: *mut u64) -> c_int {
    if out.is_null() {
        return -1;
    }
    let t = LAST_TIMING.with(|t| t.get());
    // SAFETY: the caller passes room for 4 values.
    unsafe {
        *out = t.rpc_ns;
        *out.add(1) = t.fd_ns;
        *out.add(2) = t.map_ns;
        *out.add(3) = t.total_ns;
    }
    0
}

/// The last error as a JSON object (`kind`, `message`, and for capacity refusals
/// `requested`, `free`, `limit`, `limit_bytes`, `device_uuid`, `holders`), or NULL when the
/// last configure succeeded and nothing failed since. The string stays valid until this
/// thread calls this function again.
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_shim_last_error() -> *const c_char {
    let Some(s) = lock(&LAST_ERROR).clone() else { return std::ptr::null() };
    let c = CString::new(s.replace('\0', " ")).unwrap_or_default();
    ERROR_COPY.with(|e| {
        *e.borrow_mut() = c;
        e.borrow().as_ptr()
    })
}

/// Forgets the last error.
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_shim_clear_error() {
    clear_error();
}

/// Ends the session of `device` if it has no segments mapped. Returns 0 (also when there
/// was no session), or -1 when segments are still mapped (the session stays).
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_shim_release_device(device: c_int) -> c_int {
    guarded(-1, || {
        let s = with_state(|st| {
            match st.sessions.get(&device) {
                Some(s) if s.has_segments() => {
                    let (g, n) = s.stats();
                    return Err(ShimError::Invalid(format!(
                        "device {device}'s session still has {n} segments ({g} bytes) mapped"
                    )));
                }
                _ => {}
            }
            Ok(st.sessions.remove(&device))
        });
        match s {
            Ok(Some(s)) => s.detach().map(|_| 0),
            Ok(None) => Ok(0),
            Err(ShimError::NotConfigured { .. }) => Ok(0),
            Err(e) => Err(e),
        }
    })
}

/// Ends every session that has no segments mapped. Returns 0 when none is left, -1 when
/// some still have segments mapped (they stay; see [`graphpool_shim_last_error`]).
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_shim_shutdown() -> c_int {
    guarded(-1, || {
        let devices: Vec<i32> = match with_state(|s| Ok(s.sessions.keys().copied().collect())) {
            Ok(d) => d,
            Err(ShimError::NotConfigured { .. }) => return Ok(0),
            Err(e) => return Err(e),
        };
        let mut left = 0;
        for d in devices {
            if graphpool_shim_release_device(d) != 0 {
                left += 1;
            }
        }
        if left > 0 {
            return Err(ShimError::Invalid(format!("{left} device sessions still have segments mapped")));
        }
        Ok(0)
    })
}

/// Maps a granted fd that the caller fetched itself (the Python client's segment import):
/// `kind` is the grant's handle kind (`cuda-vmm-posix-fd` or `memfd`). The fd is consumed
/// (closed) on success and on failure. Writes the address to `*ptr`. Returns 0 or -1.
/// Undo with [`graphpool_shim_unmap`].
///
/// # Safety
/// `fd` is an fd the caller owns and gives up; `kind` a valid C string; `ptr` valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn graphpool_shim_import(
    fd: c_int,
    size: u64,
    device: c_int,
    kind: *const c_char,
    ptr: *mut u64,
) -> c_int {
    guarded(-1, || {
        if fd < 0 || ptr.is_null() {
            return Err(ShimError::Invalid("fd < 0 or ptr is NULL".to_string()));
        }
        // SAFETY: the caller hands us ownership of `fd`.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: forwarded from the caller's contract.
        let kind = unsafe { c_str(kind)? }.unwrap_or_default();
        let m = Mapping::map(&kind, owned, size, device)?;
        let p = m.ptr();
        let pid = std::process::id();
        {
            let mut guard = lock(&STATE);
            ensure_state(&mut guard, pid)?.imports.insert(p, m);
        }
        // SAFETY: `ptr` is valid (checked non-null; the caller guarantees it is writable).
        unsafe { *ptr = p as u64 };
        Ok(0)
    })
}

/// Unmaps a segment mapped by [`graphpool_shim_import`]. Returns 0 or -1.
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_shim_unmap(ptr: u64) -> c_int {
    guarded(-1, || {
        let m = with_state(|s| {
            s.imports.remove(&(ptr as usize)).ok_or_else(|| {
                ShimError::Invalid(format!("{ptr:#x} was not mapped by graphpool_shim_import"))
            })
        })?;
        m.unmap().map(|_| 0)
    })
}
