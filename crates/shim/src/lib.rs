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
//! `graphpool.CapacityExceeded` instead. The last error is the calling thread's (torch calls
//! the allocation hook on the thread that asks for memory); a successful allocation clears it.
//! The backward pass asks from autograd's device threads, not the caller's: for it,
//! [`graphpool_shim_alloc_failures`] and [`graphpool_shim_last_alloc_error`] give the
//! process's latest failed allocation, whichever thread made it.
//!
//! **Daemon restarts.** When graphpoold dies or restarts, each session's task re-attaches on
//! its own with backoff, declaring the segments still mapped, so the new daemon's ledger
//! equals the old one's; allocations meanwhile fail with an `unavailable` last-error that says
//! the daemon is restarting, and frees are local (not declared). Details: [`mod@session`].
//!
//! **Session end.** [`graphpool_shim_release_device`] ends a device's session once no segment
//! of it is mapped: at once, or when torch frees the last one (CUDA graphs that still hold
//! segments keep it open until then). A session that ended by itself (the daemon did not come
//! back within the reconnect deadline) grants nothing more: [`graphpool_shim_configure`]
//! replaces it even while it has segments mapped, which it keeps serving the frees of.
//!
//! **fork.** Sessions, the runtime and mappings belong to the process that configured them.
//! In a forked child every call refuses with a `forked` error until the child configures the
//! shim again; the parent's state is left untouched (never dropped, never locked) in the
//! child, so a lock that a parent thread held at fork time does not block it.

pub mod error;
pub mod fdsock;
pub mod map;
pub mod session;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use error::ShimError;
use map::Mapping;
use session::{AttachParams, Session, Timing};

/// The shim's state in one process.
struct Shim {
    rt: tokio::runtime::Runtime,
    sessions: HashMap<i32, Arc<Session>>,
    /// Sessions replaced by a newer one of their device while they still had segments mapped:
    /// they serve the frees of those segments and end with the last one.
    retired: Vec<Arc<Session>>,
    /// Segments mapped through [`graphpool_shim_import`] (not tied to a session).
    imports: HashMap<usize, Mapping>,
}

/// The state and the process it belongs to.
struct Process {
    pid: u32,
    shim: Mutex<Shim>,
    /// Failed allocations of the process, on any thread.
    alloc_failures: AtomicU64,
    /// The error of the latest of them (JSON).
    last_alloc_error: Mutex<Option<String>>,
}

/// This process's state: null before the first configure, else a leaked [`Process`] that is
/// never freed. A forked child checks the pid before taking any lock, and makes its own
/// state instead of touching its parent's (whose runtime threads do not exist in the child,
/// and whose lock a parent thread may have held at fork time).
static PROCESS: AtomicPtr<Process> = AtomicPtr::new(std::ptr::null_mut());

thread_local! {
    /// This thread's last error, as JSON.
    static LAST_ERROR: RefCell<Option<String>> = const { RefCell::new(None) };
    static ERROR_COPY: RefCell<CString> = RefCell::new(CString::default());
    static LAST_TIMING: Cell<Timing> = Cell::new(Timing::default());
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn set_error(e: &ShimError) {
    let json = e.to_json().to_string();
    if std::env::var_os("GRAPHPOOL_SHIM_LOG").is_some() {
        let _ = writeln!(std::io::stderr(), "graphpool shim: {json}");
    }
    let _ = LAST_ERROR.try_with(|l| l.replace(Some(json)));
}

fn clear_error() {
    let _ = LAST_ERROR.try_with(|l| l.replace(None));
}

/// The published state, if any.
fn process() -> Option<&'static Process> {
    // SAFETY: PROCESS is null or points at a leaked `Process`, which is never freed.
    unsafe { PROCESS.load(Ordering::Acquire).as_ref() }
}

/// The published state if it is this process's (not a parent's before fork).
fn this_process() -> Option<&'static Process> {
    process().filter(|p| p.pid == std::process::id())
}

/// Hands `s` to the caller as this thread's copy of an error string (valid until the thread's
/// next call of a function that returns one).
fn error_copy(s: Option<String>) -> *const c_char {
    std::panic::catch_unwind(|| {
        let c = CString::new(s?.replace('\0', " ")).unwrap_or_default();
        ERROR_COPY
            .try_with(|e| {
                *e.borrow_mut() = c;
                e.borrow().as_ptr()
            })
            .ok()
    })
    .ok()
    .flatten()
    .unwrap_or(std::ptr::null())
}

/// Runs `f` with the state of this process, checking that it was configured here (not in
/// a parent before fork) before locking it.
fn with_state<R>(f: impl FnOnce(&mut Shim) -> Result<R, ShimError>) -> Result<R, ShimError> {
    let pid = std::process::id();
    match process() {
        Some(p) if p.pid == pid => f(&mut lock(&p.shim)),
        Some(p) => Err(ShimError::Forked { parent: p.pid, child: pid }),
        None => Err(ShimError::NotConfigured { device: -1 }),
    }
}

/// The state of this process, created on first use; in a forked child, a new one (the
/// parent's copy is left as it is, never dropped).
fn ensure_state() -> Result<&'static Process, ShimError> {
    let pid = std::process::id();
    let current = PROCESS.load(Ordering::Acquire);
    if let Some(p) = process()
        && p.pid == pid
    {
        return Ok(p);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("graphpool-shim")
        .enable_all()
        .build()
        .map_err(|source| ShimError::Os { call: "starting the shim's runtime", source })?;
    let shim = Shim { rt, sessions: HashMap::new(), retired: Vec::new(), imports: HashMap::new() };
    let new = Box::into_raw(Box::new(Process {
        pid,
        shim: Mutex::new(shim),
        alloc_failures: AtomicU64::new(0),
        last_alloc_error: Mutex::new(None),
    }));
    match PROCESS.compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: `new` is leaked from here on, never freed.
        Ok(_) => Ok(unsafe { &*new }),
        Err(_) => {
            // Another thread of this process published its state first: use that one.
            // SAFETY: `new` was never published; this is its only owner.
            drop(unsafe { Box::from_raw(new) });
            process().ok_or(ShimError::NotConfigured { device: -1 })
        }
    }
}

fn session(device: i32) -> Result<Arc<Session>, ShimError> {
    with_state(|s| s.sessions.get(&device).cloned().ok_or(ShimError::NotConfigured { device }))
        .map_err(|e| for_device(e, device))
}

fn for_device(e: ShimError, device: i32) -> ShimError {
    match e {
        ShimError::NotConfigured { .. } => ShimError::NotConfigured { device },
        e => e,
    }
}

/// The session that mapped `ptr`: `device`'s, or a retired one; else `device`'s (whose free
/// then reports that `ptr` is not a segment).
fn owner(device: i32, ptr: usize) -> Result<Arc<Session>, ShimError> {
    with_state(|s| {
        let current = s.sessions.get(&device);
        if let Some(c) = current.filter(|c| c.owns(ptr)) {
            return Ok(c.clone());
        }
        if let Some(r) = s.retired.iter().find(|r| r.owns(ptr)) {
            return Ok(r.clone());
        }
        current.cloned().ok_or(ShimError::NotConfigured { device })
    })
    .map_err(|e| for_device(e, device))
}

/// Ends `s` if it is to close when empty and has no segment mapped: it leaves the state, and
/// Detach is called (outside the lock). Returns whether it ended (or already had).
fn close_if_unused(s: &Arc<Session>) -> Result<bool, ShimError> {
    let ended = with_state(|st| {
        if !s.close_when_empty() {
            return Ok(None);
        }
        // Under the state's lock: no free looks for the session while it leaves.
        let Some(was_attached) = s.end_if_empty() else { return Ok(None) };
        if st.sessions.get(&s.device).is_some_and(|c| Arc::ptr_eq(c, s)) {
            st.sessions.remove(&s.device);
        }
        st.retired.retain(|r| !Arc::ptr_eq(r, s));
        Ok(Some(was_attached))
    })?;
    match ended {
        Some(was_attached) => s.finish_detach(was_attached).map(|()| true),
        None => Ok(false),
    }
}

/// Catches panics at the C boundary: they must never unwind into torch. Recording the error
/// runs inside the guarded region too.
fn guarded<R: Copy>(fail: R, f: impl FnOnce() -> Result<R, ShimError>) -> R {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match f() {
        Ok(r) => r,
        Err(e) => {
            set_error(&e);
            fail
        }
    }));
    r.unwrap_or_else(|p| {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            set_error(&ShimError::Invalid(format!("internal error (panic): {msg}")));
        }));
        fail
    })
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
/// same device that still has segments mapped is not replaced (error), unless it ended
/// (the daemon did not come back within the reconnect deadline): then it serves the frees of
/// its segments and is gone with the last one.
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
            let shim = lock(&ensure_state()?.shim);
            if let Some(old) = shim.sessions.get(&device)
                && old.has_segments()
                && !old.is_ended()
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
        let old = with_state(|s| {
            let old = s.sessions.insert(device, new);
            if let Some(o) = &old {
                // Ends now, or with its last segment (one may have been granted meanwhile).
                o.set_close_when_empty(true);
                s.retired.push(o.clone());
            }
            Ok(old)
        })?;
        if let Some(old) = old {
            let _ = close_if_unused(&old);
        }
        clear_error();
        Ok(0)
    })
}

/// torch's allocation hook: a segment of `size` bytes on `device`. NULL when refused or
/// failed (reason in [`graphpool_shim_last_error`], for this thread); a success clears this
/// thread's last error.
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_alloc(size: usize, device: c_int, _stream: *mut c_void) -> *mut c_void {
    guarded(std::ptr::null_mut(), || {
        if size == 0 {
            return Ok(std::ptr::null_mut());
        }
        let r = session(device).and_then(|s| s.allocate(size as u64));
        let (ptr, timing) = r.inspect_err(|e| {
            if let Some(p) = this_process() {
                *lock(&p.last_alloc_error) = Some(e.to_json().to_string());
                p.alloc_failures.fetch_add(1, Ordering::SeqCst);
            }
        })?;
        let _ = LAST_TIMING.try_with(|t| t.set(timing));
        clear_error();
        Ok(ptr as *mut c_void)
    })
}

/// torch's free hook: unmaps the segment at `ptr` and releases its grant. Freeing the last
/// segment of a session that [`graphpool_shim_release_device`] could not end yet ends it.
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_free(ptr: *mut c_void, _size: usize, device: c_int, _stream: *mut c_void) {
    guarded((), || {
        if ptr.is_null() {
            return Ok(());
        }
        let s = owner(device, ptr as usize)?;
        let freed = s.free(ptr as usize);
        if s.close_when_empty() {
            // A failed Detach call still ended the session; the free itself is what reports.
            let _ = close_if_unused(&s);
        }
        freed
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
    let t = LAST_TIMING.try_with(|t| t.get()).unwrap_or_default();
    // SAFETY: the caller passes room for 4 values.
    unsafe {
        *out = t.rpc_ns;
        *out.add(1) = t.fd_ns;
        *out.add(2) = t.map_ns;
        *out.add(3) = t.total_ns;
    }
    0
}

/// This thread's last error as a JSON object (`kind`, `message`, and for capacity refusals
/// `requested`, `free`, `limit`, `limit_bytes`, `device_uuid`, `holders`), or NULL when
/// nothing failed on this thread since its last successful configure or allocation, or
/// [`graphpool_shim_clear_error`]. The string stays valid until this thread calls this
/// function again.
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_shim_last_error() -> *const c_char {
    error_copy(LAST_ERROR.try_with(|l| l.borrow().clone()).ok().flatten())
}

/// How many [`graphpool_alloc`] calls of this process failed so far, on any thread (0 before
/// the first configure). Read it before and after a block to learn whether a request of the
/// block failed on a thread other than the caller's (autograd's device threads run the
/// backward pass); [`graphpool_shim_last_alloc_error`] then says why.
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_shim_alloc_failures() -> u64 {
    this_process().map_or(0, |p| p.alloc_failures.load(Ordering::SeqCst))
}

/// The error of this process's latest failed [`graphpool_alloc`], on any thread, as JSON like
/// [`graphpool_shim_last_error`]; NULL when none failed. The string stays valid until this
/// thread calls this function or [`graphpool_shim_last_error`] again.
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_shim_last_alloc_error() -> *const c_char {
    error_copy(this_process().and_then(|p| lock(&p.last_alloc_error).clone()))
}

/// Forgets this thread's last error.
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_shim_clear_error() {
    clear_error();
}

/// Ends the session of `device`. Returns 0 when it ended (also when there was no session).
///
/// Returns -1 when segments of it are still mapped (torch still holds them, e.g. for CUDA
/// graphs that are alive): the session then stays, unchanged (allocations included), until
/// the last of them is freed, which ends it, or until the process exits;
/// [`graphpool_shim_keep_device`] cancels that end.
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_shim_release_device(device: c_int) -> c_int {
    guarded(-1, || {
        let s = match with_state(|st| Ok(st.sessions.get(&device).cloned())) {
            Ok(Some(s)) => s,
            Ok(None) | Err(ShimError::NotConfigured { .. }) => return Ok(0),
            Err(e) => return Err(e),
        };
        s.set_close_when_empty(true);
        if close_if_unused(&s)? {
            return Ok(0);
        }
        let (g, n) = s.stats();
        Err(ShimError::Invalid(format!(
            "device {device}'s session still has {n} segments ({g} bytes) mapped; it stays open \
             and ends when the last of them is freed (or when the process exits)"
        )))
    })
}

/// Keeps the session of `device` for further use: cancels the end that
/// [`graphpool_shim_release_device`] left for when its last segment is freed. Returns 0, or
/// -1 when the device has no session or its session ended (the daemon did not come back
/// within the reconnect deadline, or refused the re-attach): [`graphpool_shim_configure`]
/// then opens a new one.
#[unsafe(no_mangle)]
pub extern "C" fn graphpool_shim_keep_device(device: c_int) -> c_int {
    guarded(-1, || {
        let s = session(device)?;
        if s.is_ended() {
            return Err(ShimError::SessionEnded(format!(
                "device {device}'s daemon session ended; configure a new one"
            )));
        }
        s.set_close_when_empty(false);
        Ok(0)
    })
}

/// Ends every session that has no segments mapped. Returns 0 when none is left, -1 when
/// some still have segments mapped (they stay, and end when their last segment is freed;
/// see [`graphpool_shim_last_error`]).
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
        if fd < 0 {
            return Err(ShimError::Invalid(format!("fd {fd} is negative")));
        }
        // First of all: from here on, every return closes the fd.
        // SAFETY: the caller hands us ownership of `fd`.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        if ptr.is_null() {
            return Err(ShimError::Invalid("ptr is NULL".to_string()));
        }
        // SAFETY: forwarded from the caller's contract.
        let kind = unsafe { c_str(kind)? }.unwrap_or_default();
        let m = Mapping::map(&kind, owned, size, device)?;
        let p = m.ptr();
        match ensure_state() {
            Ok(st) => lock(&st.shim).imports.insert(p, m),
            Err(e) => {
                let _ = m.unmap();
                return Err(e);
            }
        };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A forked child is refused at once, also when its parent's state was locked at fork
    /// time (by a thread that does not exist in the child, so it would never be unlocked).
    #[test]
    fn forked_child_does_not_wait_for_a_lock_held_at_fork() {
        let p = ensure_state().unwrap();
        let held = lock(&p.shim);
        // SAFETY: the child only makes the calls below and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: a child that hangs is killed by SIGALRM (the test then fails).
            unsafe { libc::alarm(5) };
            let refused = graphpool_alloc(1 << 20, 0, std::ptr::null_mut()).is_null();
            let e = graphpool_shim_last_error();
            // SAFETY: a valid C string from the shim, or NULL.
            let forked =
                !e.is_null() && unsafe { CStr::from_ptr(e) }.to_string_lossy().contains("\"forked\"");
            let stats = unsafe { graphpool_shim_stats(0, std::ptr::null_mut(), std::ptr::null_mut()) };
            // SAFETY: leaves the child without running the parent's destructors.
            unsafe { libc::_exit(if refused && forked && stats == -1 { 0 } else { 1 }) };
        }
        drop(held);
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "the child hung (status {status:#x})");
        assert_eq!(libc::WEXITSTATUS(status), 0);
    }

    /// The last error is the calling thread's: another thread's clear does not touch it, and
    /// a successful call clears it.
    #[test]
    fn last_error_is_per_thread() {
        assert!(graphpool_alloc(1 << 20, 99, std::ptr::null_mut()).is_null());
        assert!(!graphpool_shim_last_error().is_null());
        std::thread::spawn(|| {
            assert!(graphpool_shim_last_error().is_null(), "another thread's error is not this one's");
            graphpool_shim_clear_error();
        })
        .join()
        .unwrap();
        assert!(!graphpool_shim_last_error().is_null(), "cleared by another thread");
        graphpool_shim_clear_error();
        assert!(graphpool_shim_last_error().is_null());
    }

    /// A failed allocation on another thread is seen through the process's failure count and
    /// latest allocation error.
    #[test]
    fn failed_allocations_of_other_threads_are_counted() {
        ensure_state().unwrap();
        let before = graphpool_shim_alloc_failures();
        std::thread::spawn(|| assert!(graphpool_alloc(1 << 20, 98, std::ptr::null_mut()).is_null()))
            .join()
            .unwrap();
        assert!(graphpool_shim_alloc_failures() > before);
        let e = graphpool_shim_last_alloc_error();
        assert!(!e.is_null());
        // SAFETY: a valid C string from the shim.
        let e = unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned();
        assert!(e.contains("not-configured"), "{e}");
    }
}
