//! The C ABI: the only module with `extern "C"`. Every export runs behind `guard` (no panic
//! crosses into C), checks its pointers, writes out-params only on success, and leaves a
//! message for `ccalloc_last_error()` on failure.
#![allow(clippy::missing_safety_doc)]

pub(crate) mod boundary;
pub(crate) mod host;
pub(crate) mod memory;
#[cfg(feature = "sim")]
pub(crate) mod sim;
pub(crate) mod types;

use crate::driver::{DevicePtr, StreamId};
use crate::error::{Error, ErrorKind};
use crate::runtime::{self, Runtime};
use boundary::{guard, invalid, require_out, write_out};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::io::Write;
use types::{
    ccalloc_lock_stats, ccalloc_memory_breakdown, ccalloc_paging_stats, ccalloc_pool_id,
    ccalloc_release_fn, ccalloc_stats, ccalloc_status, ccalloc_stream_filter, cudaStream_t,
};

fn stream_of(stream: cudaStream_t) -> StreamId {
    StreamId(stream as u64)
}

/// Runs `body` against the global runtime and each device it names (-1 = every started one).
fn for_devices(
    device: i32,
    mut body: impl FnMut(&crate::DeviceAllocator) -> Result<(), Error>,
) -> Result<(), Error> {
    let rt = runtime::global()?;
    if device == -1 {
        rt.started_devices().try_for_each(body)
    } else {
        body(rt.device(device as i64)?)
    }
}

/// Starts ccalloc: backend from `CCALLOC_BACKEND` (`cuda` default, or `sim`), settings from
/// `CCALLOC_CONF`. Calling it again while running does nothing and returns `CCALLOC_OK`.
/// `sim` needs a library built with the simulated device (cargo feature `sim`; the Python
/// package's has it): without it, `CCALLOC_CONFIG_ERROR`.
#[no_mangle]
pub extern "C" fn ccalloc_init() -> ccalloc_status {
    guard(|| runtime::init_global().map(|_| ()))
}

/// Returns all cached memory to the driver and stops; refused with `CCALLOC_BUSY` (nothing
/// changed) while allocations are live. Later calls fail with `CCALLOC_SHUT_DOWN` until
/// `ccalloc_init` is called again.
#[no_mangle]
pub extern "C" fn ccalloc_shutdown() -> ccalloc_status {
    guard(runtime::shutdown_global)
}

/// The library version, e.g. "0.1.0" (static string).
#[no_mangle]
pub extern "C" fn ccalloc_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The message of this thread's last failed call ("" if none). Valid until the thread's
/// next failing ccalloc call.
#[no_mangle]
pub extern "C" fn ccalloc_last_error() -> *const c_char {
    boundary::last_error_ptr()
}

/// The name of a status code, e.g. "CCALLOC_OUT_OF_MEMORY" (static string).
#[no_mangle]
pub extern "C" fn ccalloc_status_name(status: u32) -> *const c_char {
    ccalloc_status::from_u32(status)
        .map_or(c"CCALLOC_UNKNOWN_STATUS", ccalloc_status::name)
        .as_ptr()
}

/// The backend in use: "cuda" or "sim" (static string).
#[no_mangle]
pub extern "C" fn ccalloc_backend(out_name: *mut *const c_char) -> ccalloc_status {
    guard(|| {
        let name: &'static str = match runtime::global()?.backend() {
            "sim" => "sim\0",
            _ => "cuda\0",
        };
        write_out(out_name, "out_name", name.as_ptr().cast())
    })
}

#[no_mangle]
pub extern "C" fn ccalloc_device_count(out_count: *mut i32) -> ccalloc_status {
    guard(|| {
        write_out(
            out_count,
            "out_count",
            runtime::global()?.device_count() as i32,
        )
    })
}

/// Whether ccalloc is initialized (and not shut down). Never fails.
#[no_mangle]
pub extern "C" fn ccalloc_is_initialized() -> bool {
    runtime::global().is_ok()
}

/// How many shards (allocators with a lock and cache of their own) `device` has made: 1
/// once it has allocated, more where threads each on a stream of their own contended for its
/// lock (`thread_shards`, `thread_shards_on_contention`) or with `per_stream_shards`; 0
/// before its first allocation.
#[no_mangle]
pub extern "C" fn ccalloc_shard_count(device: i32, out_count: *mut u32) -> ccalloc_status {
    guard(|| {
        require_out(out_count, "out_count")?;
        let shards = runtime::global()?.device(device as i64)?.shards_made();
        write_out(out_count, "out_count", shards as u32)
    })
}

/// Bytes of memory `device` has in all.
#[no_mangle]
pub extern "C" fn ccalloc_device_total_memory(device: i32, out_bytes: *mut u64) -> ccalloc_status {
    guard(|| {
        require_out(out_bytes, "out_bytes")?;
        let total = runtime::global()?.device(device as i64)?.total_memory();
        write_out(out_bytes, "out_bytes", total)
    })
}

/// Puts every setting back to its default, then applies `CCALLOC_CONF` again (a device that
/// has allocated keeps its `per_stream_shards`, `thread_shards` and
/// `thread_shards_on_contention`).
#[no_mangle]
pub extern "C" fn ccalloc_reset_config() -> ccalloc_status {
    guard(|| runtime::global()?.reset_config())
}

/// Allocates `size` bytes on `device` for use on `stream` (a `cudaStream_t`; any value on
/// sim). Size 0 fails with `CCALLOC_INVALID_SIZE`. `stream` must stay valid until the block
/// is freed: as `cudaFreeAsync` does, freeing it may record an event on that stream (after
/// which the stream may be destroyed).
#[no_mangle]
pub extern "C" fn ccalloc_malloc(
    size: usize,
    device: i32,
    stream: cudaStream_t,
    out_ptr: *mut *mut c_void,
) -> ccalloc_status {
    guard(|| {
        require_out(out_ptr, "out_ptr")?;
        let ptr = traced_malloc(runtime::global()?, size, device, stream)?;
        write_out(out_ptr, "out_ptr", ptr as *mut c_void)
    })
}

/// Frees a block from `ccalloc_malloc`. NULL is a no-op. The block is reused on its
/// allocation stream at once, and on other streams recorded with `ccalloc_record_stream`
/// only after their queued work completes. As with PyTorch's allocator, the block's
/// allocation stream must still exist: ccalloc may record an event on it here.
#[no_mangle]
pub extern "C" fn ccalloc_free(ptr: *mut c_void, device: i32) -> ccalloc_status {
    guard(|| {
        if ptr.is_null() {
            return Ok(());
        }
        runtime::global()?.free(ptr as DevicePtr, device as i64)?;
        crate::history::freed(device, ptr as u64);
        Ok(())
    })
}

/// `Runtime::malloc`, recorded in the history (an OOM too) when recording is on.
#[inline]
fn traced_malloc(
    rt: &Runtime,
    size: usize,
    device: i32,
    stream: cudaStream_t,
) -> Result<DevicePtr, Error> {
    match rt.malloc(size as u64, device as i64, stream_of(stream)) {
        Ok(ptr) => {
            crate::history::allocated(device, ptr, size as u64, stream as u64);
            Ok(ptr)
        }
        Err(e) => Err(trace_failed_malloc(e, size, device, stream)),
    }
}

/// Logs and records an allocation that ran out of memory; returns `error`.
#[cold]
#[inline(never)]
fn trace_failed_malloc(error: Error, size: usize, device: i32, stream: cudaStream_t) -> Error {
    if error.kind == ErrorKind::OutOfMemory {
        tracing::warn!(device, "{}", error.message);
        let oom = crate::history::Action::Oom;
        crate::history::record(oom, device, 0, size as u64, stream as u64);
    }
    error
}

/// Records that a live block is used on `stream` as well as its own.
#[no_mangle]
pub extern "C" fn ccalloc_record_stream(
    ptr: *mut c_void,
    device: i32,
    stream: cudaStream_t,
) -> ccalloc_status {
    guard(|| {
        if ptr.is_null() {
            return Err(invalid("ptr is NULL"));
        }
        runtime::global()?.record_stream(ptr as DevicePtr, device as i64, stream_of(stream))
    })
}

/// Returns every unused cached segment of `device` (-1: all devices) to the driver. During a
/// CUDA graph capture nothing is released (that would invalidate the capture).
#[no_mangle]
pub extern "C" fn ccalloc_empty_cache(device: i32) -> ccalloc_status {
    guard(|| for_devices(device, |d| d.empty_cache()))
}

/// Limits what `device` may reserve to `fraction` (0..=1) of its memory.
#[no_mangle]
pub extern "C" fn ccalloc_set_memory_fraction(fraction: f64, device: i32) -> ccalloc_status {
    guard(|| {
        if fraction.is_nan() {
            return Err(invalid("fraction is NaN"));
        }
        runtime::global()?
            .device(device as i64)?
            .set_memory_fraction(fraction)
    })
}

/// The memory fraction of `device` (1.0 when unlimited).
#[no_mangle]
pub extern "C" fn ccalloc_get_memory_fraction(
    device: i32,
    out_fraction: *mut f64,
) -> ccalloc_status {
    guard(|| {
        require_out(out_fraction, "out_fraction")?;
        let f = runtime::global()?
            .device(device as i64)?
            .memory_fraction()?;
        write_out(out_fraction, "out_fraction", f)
    })
}

/// Applies settings such as "max_split_size_mb:256,garbage_collection_threshold:0.8" to every
/// device. An unknown key or bad value fails with `CCALLOC_CONFIG_ERROR` and changes nothing,
/// as does changing `per_stream_shards`, `thread_shards` or `thread_shards_on_contention` once
/// a device has allocated.
#[no_mangle]
pub unsafe extern "C" fn ccalloc_set_config(conf: *const c_char) -> ccalloc_status {
    guard(|| {
        if conf.is_null() {
            return Err(invalid("conf is NULL"));
        }
        // SAFETY: non-null and, per the API contract, a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(conf) }
            .to_str()
            .map_err(|_| Error::new(ErrorKind::Config, "conf is not UTF-8"))?;
        runtime::global()?.set_config(text)?;
        tracing::info!("settings changed: {text}");
        Ok(())
    })
}

/// Copies `device`'s statistics into `*out_stats`.
#[no_mangle]
pub extern "C" fn ccalloc_get_stats(device: i32, out_stats: *mut ccalloc_stats) -> ccalloc_status {
    guard(|| {
        require_out(out_stats, "out_stats")?;
        let d = runtime::global()?.device(device as i64)?;
        let stats = ccalloc_stats::new(&d.stats()?, d.max_split_size()?);
        write_out(out_stats, "out_stats", stats)
    })
}

/// Copies what paged segments' growth has cost on `device` into `*out_stats`.
#[no_mangle]
pub extern "C" fn ccalloc_get_paging_stats(
    device: i32,
    out_stats: *mut ccalloc_paging_stats,
) -> ccalloc_status {
    guard(|| {
        require_out(out_stats, "out_stats")?;
        let d = runtime::global()?.device(device as i64)?;
        let stats = ccalloc_paging_stats::new(&d.stats()?.paging, d.page_slack()?);
        write_out(out_stats, "out_stats", stats)
    })
}

/// Copies how callers have met `device`'s locks into `*out_stats`: whether threads contend
/// for it, and how often its bookkeeping moves between threads.
#[no_mangle]
pub extern "C" fn ccalloc_get_lock_stats(
    device: i32,
    out_stats: *mut ccalloc_lock_stats,
) -> ccalloc_status {
    guard(|| {
        require_out(out_stats, "out_stats")?;
        let d = runtime::global()?.device(device as i64)?;
        write_out(out_stats, "out_stats", d.lock_counters()?.into())
    })
}

/// Copies what `device`'s reserved memory is made of into `*out_breakdown`: now, or with
/// `at_peak`, right after the allocation that took reserved to its highest since the
/// `record_peak_breakdown` setting was turned on or `ccalloc_reset_peak_stats` ran (the
/// memory at that moment if none has raised it since; with other threads freeing
/// meanwhile, possibly a moment later, whose `reserved_bytes` is then under the peak). A
/// breakdown walks every block, after the blocks threads keep for reuse
/// (`thread_cache`) go back to the device's cache. `at_peak` with `record_peak_breakdown`
/// off is a `CCALLOC_CONFIG_ERROR`.
#[no_mangle]
pub extern "C" fn ccalloc_get_memory_breakdown(
    device: i32,
    at_peak: bool,
    out_breakdown: *mut ccalloc_memory_breakdown,
) -> ccalloc_status {
    guard(|| {
        require_out(out_breakdown, "out_breakdown")?;
        let d = runtime::global()?.device(device as i64)?;
        let b = if at_peak {
            d.peak_breakdown()?.ok_or_else(|| {
                Error::new(
                    ErrorKind::Config,
                    "no breakdown at the peak is recorded: set record_peak_breakdown:True",
                )
            })?
        } else {
            d.memory_breakdown()?
        };
        write_out(out_breakdown, "out_breakdown", b.into())
    })
}

/// Sets every peak statistic of `device` (-1: all) to its current value.
#[no_mangle]
pub extern "C" fn ccalloc_reset_peak_stats(device: i32) -> ccalloc_status {
    guard(|| for_devices(device, |d| d.reset_peak_stats()))
}

/// Zeroes the accumulated (allocated/freed) totals and event counters of `device` (-1: all).
#[no_mangle]
pub extern "C" fn ccalloc_reset_accumulated_stats(device: i32) -> ccalloc_status {
    guard(|| for_devices(device, |d| d.reset_accumulated_stats()))
}

/// `torch.cuda.memory.CUDAPluggableAllocator`'s allocation function. Starts ccalloc on first
/// use and returns NULL for size 0. On failure it throws a C++ `std::runtime_error` with the
/// message (PyTorch raises it as a Python RuntimeError; it does not check for NULL): call it
/// only from C++, and use `ccalloc_malloc` from C.
#[no_mangle]
pub extern "C-unwind" fn ccalloc_torch_alloc(
    size: usize,
    device: c_int,
    stream: cudaStream_t,
) -> *mut c_void {
    if size == 0 {
        // PyTorch asks for 0 bytes (empty tensors) and expects NULL: not an error, so the
        // thread's last error message is left as it was.
        return std::ptr::null_mut();
    }
    let mut out: *mut c_void = std::ptr::null_mut();
    let status = guard(|| {
        let rt = match runtime::global() {
            Err(e) if e.kind == ErrorKind::NotInitialized => runtime::init_global()?,
            other => other?,
        };
        let ptr = traced_malloc(rt, size, device, stream)?;
        out = ptr as *mut c_void;
        Ok(())
    });
    if status == ccalloc_status::CCALLOC_OK {
        return out;
    }
    // SAFETY: this thread's NUL-terminated last error; the shim copies it before throwing.
    unsafe { ccalloc_shim_throw(boundary::last_error_ptr()) }
}

/// `CUDAPluggableAllocator`'s free function. Errors cannot be returned through this
/// signature: they are left in `ccalloc_last_error()` and logged.
#[no_mangle]
pub extern "C" fn ccalloc_torch_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: cudaStream_t,
) {
    // The block's own size is known. The stream is the one it was allocated on: its shard
    // is asked first (any other still finds it).
    let _ = size;
    let status = guard(|| {
        if ptr.is_null() {
            return Ok(());
        }
        runtime::global()?.free_on(ptr as DevicePtr, device as i64, stream_of(stream))?;
        crate::history::freed(device, ptr as u64);
        Ok(())
    });
    log_torch_failure("ccalloc_torch_free", status);
}

/// The hook-style functions have no status to return: log what failed (the message stays
/// in `ccalloc_last_error()`).
#[inline]
fn log_torch_failure(call: &str, status: ccalloc_status) {
    if status != ccalloc_status::CCALLOC_OK {
        say_torch_failure(call, status);
    }
}

#[cold]
#[inline(never)]
fn say_torch_failure(call: &str, status: ccalloc_status) {
    // Outside `guard`, so a failure to log (a closed stderr, thread exit) must not unwind
    // into C: it is dropped.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: the pointer is this thread's NUL-terminated last-error string (or a static
        // one once the thread's storage is gone).
        let message = unsafe { CStr::from_ptr(boundary::last_error_ptr()) }.to_string_lossy();
        // PyTorch's hooks have no way to report failure: say it on stderr, where it is seen.
        let _ = writeln!(std::io::stderr(), "ccalloc: {call}: {status:?}: {message}");
        tracing::error!("{call}: {status:?}: {message}");
    });
}

/// PyTorch's `set_init_fn` hook: starts ccalloc (PyTorch passes its device count).
#[no_mangle]
pub extern "C" fn ccalloc_torch_init(device_count: c_int) {
    let _ = device_count;
    log_torch_failure("ccalloc_torch_init", ccalloc_init());
}

/// PyTorch's `set_reset_fn` hook (`torch.cuda.empty_cache()`): empties every device's cache.
#[no_mangle]
pub extern "C" fn ccalloc_torch_empty_cache() {
    log_torch_failure("ccalloc_torch_empty_cache", ccalloc_empty_cache(-1));
}

/// PyTorch's `set_memory_fraction_fn` hook.
#[no_mangle]
pub extern "C" fn ccalloc_torch_set_memory_fraction(fraction: f64, device: c_int) {
    log_torch_failure(
        "ccalloc_torch_set_memory_fraction",
        ccalloc_set_memory_fraction(fraction, device),
    );
}

/// PyTorch's `set_record_stream_fn` hook (`Tensor.record_stream`): the device is the one
/// whose allocator holds `ptr`.
#[no_mangle]
pub extern "C" fn ccalloc_torch_record_stream(ptr: *mut c_void, stream: cudaStream_t) {
    let status = guard(|| {
        if ptr.is_null() {
            return Ok(());
        }
        let rt = runtime::global()?;
        let device = rt.device_holding(ptr as DevicePtr).ok_or_else(|| {
            Error::new(
                ErrorKind::UnknownPointer,
                format!("record_stream: {ptr:p} was not allocated by ccalloc"),
            )
        })?;
        rt.record_stream(ptr as DevicePtr, device as i64, stream_of(stream))
    });
    log_torch_failure("ccalloc_torch_record_stream", status);
}

/// A filter handed over through the C API, called before any of the device's locks is taken.
struct ForeignFilter {
    call: ccalloc_stream_filter,
    ctx: *mut c_void,
    release: ccalloc_release_fn,
}

// SAFETY: the API contract requires filters callable from any thread.
unsafe impl Send for ForeignFilter {}

impl ForeignFilter {
    fn accepts(&self, stream: StreamId) -> bool {
        match self.call {
            // SAFETY: a caller-supplied function with the documented signature.
            Some(f) => unsafe { f(self.ctx, stream.0 as cudaStream_t) },
            None => true,
        }
    }
}

impl Drop for ForeignFilter {
    fn drop(&mut self) {
        if let Some(release) = self.release {
            // SAFETY: called once, when the filter is no longer used.
            unsafe { release(self.ctx) };
        }
    }
}

fn begin_pool(device: i32, pool: ccalloc_pool_id, filter: ForeignFilter) -> Result<(), Error> {
    let allocator = runtime::global()?.device(device as i64)?;
    allocator.begin_allocate_to_pool(
        (pool.first, pool.second),
        Box::new(move |stream| filter.accepts(stream)),
    )
}

/// Opens a window in which allocations on `device` from streams that `filter` accepts (all
/// streams when NULL) come from private pool `pool` and are reused only by it, as for a CUDA
/// graph capture. `release(ctx)` is called when the window closes. Each begin holds the pool
/// once; see `ccalloc_release_pool`.
///
/// `filter` is called once per allocation on `device` while any window is open, on the
/// allocating thread, before ccalloc takes any of its locks: it may call back into ccalloc
/// (read statistics, say). An allocation made from inside a filter on the same thread is
/// refused with `CCALLOC_INVALID_ARGUMENT` (the running filter would have to route it).
#[no_mangle]
pub extern "C" fn ccalloc_begin_allocate_to_pool(
    device: i32,
    pool: ccalloc_pool_id,
    filter: ccalloc_stream_filter,
    ctx: *mut c_void,
    release: ccalloc_release_fn,
) -> ccalloc_status {
    // Built before the guard so `release` runs even when beginning fails.
    let filter = ForeignFilter {
        call: filter,
        ctx,
        release,
    };
    guard(move || begin_pool(device, pool, filter))
}

/// Closes the window opened for `pool` on `device`.
#[no_mangle]
pub extern "C" fn ccalloc_end_allocate_to_pool(
    device: i32,
    pool: ccalloc_pool_id,
) -> ccalloc_status {
    guard(|| {
        runtime::global()?
            .device(device as i64)?
            .end_allocate_to_pool((pool.first, pool.second))
    })
}

/// Drops one hold on `pool`; once none is left its cached memory is released (unused
/// segments now, the rest as their blocks are freed and the cache emptied).
#[no_mangle]
pub extern "C" fn ccalloc_release_pool(device: i32, pool: ccalloc_pool_id) -> ccalloc_status {
    guard(|| {
        runtime::global()?
            .device(device as i64)?
            .release_pool((pool.first, pool.second))
    })
}

extern "C-unwind" {
    fn ccalloc_shim_throw(message: *const c_char) -> !;
}

extern "C" {
    fn ccalloc_shim_filter_clone(filter: *const c_void) -> *mut c_void;
    fn ccalloc_shim_filter_call(filter: *mut c_void, stream: cudaStream_t) -> bool;
    fn ccalloc_shim_filter_drop(filter: *mut c_void);
}

/// PyTorch's `set_begin_allocate_to_pool` hook. Its C++ type is
/// `void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>)`: the pair arrives in
/// registers and the std::function, passed by value, as a pointer to the caller's copy.
#[no_mangle]
pub unsafe extern "C" fn ccalloc_torch_begin_allocate_to_pool(
    device: c_int,
    pool: ccalloc_pool_id,
    filter: *const c_void,
) {
    let status = if filter.is_null() {
        ccalloc_begin_allocate_to_pool(device, pool, None, std::ptr::null_mut(), None)
    } else {
        // SAFETY: `filter` points at a live std::function<bool(cudaStream_t)>; the shim copies it.
        let copy = unsafe { ccalloc_shim_filter_clone(filter) };
        ccalloc_begin_allocate_to_pool(
            device,
            pool,
            Some(ccalloc_shim_filter_call),
            copy,
            Some(ccalloc_shim_filter_drop),
        )
    };
    log_torch_failure("ccalloc_torch_begin_allocate_to_pool", status);
}

/// PyTorch's `set_end_allocate_to_pool_fn` hook: `void(int, MempoolId_t)`.
#[no_mangle]
pub extern "C" fn ccalloc_torch_end_allocate_to_pool(device: c_int, pool: ccalloc_pool_id) {
    log_torch_failure(
        "ccalloc_torch_end_allocate_to_pool",
        ccalloc_end_allocate_to_pool(device, pool),
    );
}

/// PyTorch's `set_release_pool` hook: `void(int, MempoolId_t)`.
#[no_mangle]
pub extern "C" fn ccalloc_torch_release_pool(device: c_int, pool: ccalloc_pool_id) {
    log_torch_failure(
        "ccalloc_torch_release_pool",
        ccalloc_release_pool(device, pool),
    );
}
