//! The C API for pinned host memory and managed memory: caches of their own (the same
//! allocator core as a device's: size classes, split/merge, stream-aware reuse,
//! statistics), and managed memory's prefetch and advice.

#![allow(non_camel_case_types)]

use super::boundary::{guard, invalid, require_out, write_out};
use super::types::{ccalloc_stats, ccalloc_status, cudaStream_t};
use crate::driver::{Advice, DevicePtr, HostKind, StreamId};
use crate::error::{Error, ErrorKind};
use crate::runtime;
use std::ffi::c_void;

/// Advice on a managed range (`ccalloc_advise`), with `cuMemAdvise`'s values.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ccalloc_advice {
    /// The range is mostly read: devices that read it get copies of their own.
    CCALLOC_ADVISE_SET_READ_MOSTLY = 1,
    CCALLOC_ADVISE_UNSET_READ_MOSTLY = 2,
    /// The range should stay on the device named (-1: the host) when it can.
    CCALLOC_ADVISE_SET_PREFERRED_LOCATION = 3,
    CCALLOC_ADVISE_UNSET_PREFERRED_LOCATION = 4,
    /// The device named (-1: the host) accesses the range: keep it mapped there.
    CCALLOC_ADVISE_SET_ACCESSED_BY = 5,
    CCALLOC_ADVISE_UNSET_ACCESSED_BY = 6,
}

fn malloc(kind: HostKind, size: usize, out_ptr: *mut *mut c_void) -> ccalloc_status {
    guard(|| {
        require_out(out_ptr, "out_ptr")?;
        let ptr = runtime::global()?.host_malloc(kind, size as u64)?;
        write_out(out_ptr, "out_ptr", ptr as *mut c_void)
    })
}

fn free(kind: HostKind, ptr: *mut c_void) -> ccalloc_status {
    guard(|| {
        if ptr.is_null() {
            return Ok(());
        }
        runtime::global()?.host_free(kind, ptr as DevicePtr)
    })
}

fn record_stream(
    kind: HostKind,
    ptr: *mut c_void,
    device: i32,
    stream: cudaStream_t,
) -> ccalloc_status {
    guard(|| {
        if ptr.is_null() {
            return Err(invalid("ptr is NULL"));
        }
        let stream = StreamId(stream as u64);
        runtime::global()?.host_record_stream(kind, ptr as DevicePtr, device as i64, stream)
    })
}

fn get_stats(kind: HostKind, out_stats: *mut ccalloc_stats) -> ccalloc_status {
    guard(|| {
        require_out(out_stats, "out_stats")?;
        let a = runtime::global()?.host_side(kind)?.allocator();
        let stats = ccalloc_stats::new(&a.stats()?, a.max_split_size()?);
        write_out(out_stats, "out_stats", stats)
    })
}

fn empty_cache(kind: HostKind) -> ccalloc_status {
    guard(|| {
        runtime::global()?
            .host_side(kind)?
            .allocator()
            .empty_cache()
    })
}

fn reset_peak_stats(kind: HostKind) -> ccalloc_status {
    guard(|| {
        runtime::global()?
            .host_side(kind)?
            .allocator()
            .reset_peak_stats()
    })
}

/// Allocates `size` bytes of page-locked (pinned) host memory, mapped for every device, from
/// ccalloc's pinned cache. Sizes round to 512 bytes and blocks split and merge as device
/// blocks do (PyTorch's pinned cache rounds each request to a power of two). Size 0 fails
/// with `CCALLOC_INVALID_SIZE`. The host may use the block at once; for work queued on a
/// stream, see `ccalloc_host_record_stream`.
#[no_mangle]
pub extern "C" fn ccalloc_host_malloc(size: usize, out_ptr: *mut *mut c_void) -> ccalloc_status {
    malloc(HostKind::Pinned, size, out_ptr)
}

/// Frees a block from `ccalloc_host_malloc`. NULL is a no-op. The block is reused only
/// after the work queued on every stream recorded with `ccalloc_host_record_stream` has
/// completed. A device block (or a managed one) fails with `CCALLOC_UNKNOWN_POINTER` and a
/// message saying which it is; a second free with `CCALLOC_DOUBLE_FREE`.
#[no_mangle]
pub extern "C" fn ccalloc_host_free(ptr: *mut c_void) -> ccalloc_status {
    free(HostKind::Pinned, ptr)
}

/// Records that work queued until now on `stream` of `device` uses the live pinned block
/// `ptr` (an async copy from or to it): after `ccalloc_host_free` the block is reused only
/// once that work has completed (an event recorded on the stream at the free says when).
#[no_mangle]
pub extern "C" fn ccalloc_host_record_stream(
    ptr: *mut c_void,
    device: i32,
    stream: cudaStream_t,
) -> ccalloc_status {
    record_stream(HostKind::Pinned, ptr, device, stream)
}

/// Returns every unused cached pinned segment to the driver (`cuMemFreeHost`).
#[no_mangle]
pub extern "C" fn ccalloc_host_empty_cache() -> ccalloc_status {
    empty_cache(HostKind::Pinned)
}

/// Copies the pinned cache's statistics into `*out_stats` (the device statistics' struct;
/// the "all" entries carry the totals). In `torch.cuda.host_memory_stats()`'s names:
/// `allocations` is `allocation`, `allocated_bytes` is `allocated_bytes`, `reserved_bytes`
/// is `reserved_bytes` (bytes of the driver's segments), `segments` is `segment`,
/// `num_host_alloc` / `num_host_free` are `num_device_alloc` / `num_device_free` (calls of
/// `cuMemHostAlloc` / `cuMemFreeHost`); `requested_bytes` is what was asked for.
#[no_mangle]
pub extern "C" fn ccalloc_host_get_stats(out_stats: *mut ccalloc_stats) -> ccalloc_status {
    get_stats(HostKind::Pinned, out_stats)
}

/// Sets every peak statistic of the pinned cache to its current value.
#[no_mangle]
pub extern "C" fn ccalloc_host_reset_peak_stats() -> ccalloc_status {
    reset_peak_stats(HostKind::Pinned)
}

/// Allocates `size` bytes of managed (unified) memory from ccalloc's managed cache
/// (`cuMemAllocManaged`, attached globally): usable from the host and every device, moved
/// on demand or by `ccalloc_prefetch`. Size 0 fails with `CCALLOC_INVALID_SIZE`.
#[no_mangle]
pub extern "C" fn ccalloc_managed_malloc(size: usize, out_ptr: *mut *mut c_void) -> ccalloc_status {
    malloc(HostKind::Managed, size, out_ptr)
}

/// Frees a block from `ccalloc_managed_malloc`. NULL is a no-op. As `ccalloc_host_free`:
/// reused only after the work on its recorded streams (and its prefetches) completed.
#[no_mangle]
pub extern "C" fn ccalloc_managed_free(ptr: *mut c_void) -> ccalloc_status {
    free(HostKind::Managed, ptr)
}

/// `ccalloc_host_record_stream` for a managed block (a kernel on `stream` uses it).
#[no_mangle]
pub extern "C" fn ccalloc_managed_record_stream(
    ptr: *mut c_void,
    device: i32,
    stream: cudaStream_t,
) -> ccalloc_status {
    record_stream(HostKind::Managed, ptr, device, stream)
}

/// Returns every unused cached managed segment to the driver.
#[no_mangle]
pub extern "C" fn ccalloc_managed_empty_cache() -> ccalloc_status {
    empty_cache(HostKind::Managed)
}

/// Copies the managed cache's statistics into `*out_stats` (as `ccalloc_host_get_stats`).
#[no_mangle]
pub extern "C" fn ccalloc_managed_get_stats(out_stats: *mut ccalloc_stats) -> ccalloc_status {
    get_stats(HostKind::Managed, out_stats)
}

/// Sets every peak statistic of the managed cache to its current value.
#[no_mangle]
pub extern "C" fn ccalloc_managed_reset_peak_stats() -> ccalloc_status {
    reset_peak_stats(HostKind::Managed)
}

/// Queues on `stream` a move of managed `[ptr, ptr+size)` to `device` (-1: the host)
/// (`cuMemPrefetchAsync`). `stream` belongs to `device` (to device 0 for the host). The
/// range must lie inside one live block from `ccalloc_managed_malloc`: otherwise
/// `CCALLOC_UNKNOWN_POINTER` (not managed memory), `CCALLOC_DOUBLE_FREE` (freed memory) or
/// `CCALLOC_INVALID_ARGUMENT` (past the block's end). The block is not reused after its
/// free before the move has completed.
#[no_mangle]
pub extern "C" fn ccalloc_prefetch(
    ptr: *mut c_void,
    size: usize,
    device: i32,
    stream: cudaStream_t,
) -> ccalloc_status {
    guard(|| {
        let stream = StreamId(stream as u64);
        runtime::global()?.prefetch(ptr as DevicePtr, size as u64, device as i64, stream)
    })
}

/// Advises how managed `[ptr, ptr+size)` is used (`cuMemAdvise`): `advice` is a
/// `ccalloc_advice` value, about `device` (-1: the host). The range is checked as for
/// `ccalloc_prefetch`; an unknown advice value fails with `CCALLOC_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn ccalloc_advise(
    ptr: *mut c_void,
    size: usize,
    advice: u32,
    device: i32,
) -> ccalloc_status {
    guard(|| {
        let advice = Advice::from_raw(advice).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("advice {advice} is not a ccalloc_advice value (1 to 6)"),
            )
        })?;
        runtime::global()?.advise(ptr as DevicePtr, size as u64, advice, device as i64)
    })
}
