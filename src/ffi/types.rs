//! Types that cross the C boundary.
#![allow(non_camel_case_types)]

use crate::alloc::stats::{DeviceStats, LockCounters, PagingCounters, Stat, StatArray};

// The one list of status codes. build.rs reads this enum (its lines must stay of the forms
// `/// doc`, `CCALLOC_NAME = VALUE,`) and generates from it `ErrorKind` (src/error.rs: one
// variant per failure status, named by `Status::kind` in build.rs) and `ccalloc_status::ALL`,
// `from_u32`, `name` and `error_kind` (below); Python reads the names from
// `ccalloc_status_name`. Adding a status is adding it here (and, optionally, its exception
// class in python/ccalloc/_lib.py). cbindgen copies the enum into include/ccalloc.h: it reads
// only literal Rust, so the list cannot itself be a macro.
/// Result of every ccalloc call. `CCALLOC_OK` is 0; the message for any other value is
/// available from `ccalloc_last_error()` on the same thread.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ccalloc_status {
    CCALLOC_OK = 0,
    /// A NULL pointer, NaN, or otherwise unusable argument.
    CCALLOC_INVALID_ARGUMENT = 1,
    /// `ccalloc_init` has not been called.
    CCALLOC_NOT_INITIALIZED = 2,
    /// `ccalloc_shutdown` has been called.
    CCALLOC_SHUT_DOWN = 3,
    /// The device, or the memory limit, cannot hold the request even after freeing cache.
    CCALLOC_OUT_OF_MEMORY = 4,
    /// The pointer was not allocated by ccalloc (or points inside a block).
    CCALLOC_UNKNOWN_POINTER = 5,
    /// The pointer was allocated by ccalloc but is already freed.
    CCALLOC_DOUBLE_FREE = 6,
    /// The pointer belongs to another device than the one named.
    CCALLOC_WRONG_DEVICE = 7,
    /// No such device.
    CCALLOC_INVALID_DEVICE = 8,
    /// Size 0.
    CCALLOC_INVALID_SIZE = 9,
    /// Unknown config key or bad value, or bad CCALLOC_* environment variable.
    CCALLOC_CONFIG_ERROR = 10,
    /// The CUDA driver library is missing, too old, or failed to initialise.
    CCALLOC_DRIVER_UNAVAILABLE = 11,
    /// A CUDA driver call failed.
    CCALLOC_DRIVER_ERROR = 12,
    /// Shutdown refused: allocations are still live.
    CCALLOC_BUSY = 13,
    /// A bug in ccalloc (a caught panic); the message says where.
    CCALLOC_INTERNAL_ERROR = 14,
}

include!(concat!(env!("OUT_DIR"), "/status_table.rs"));

/// One counter, as in `torch.cuda.memory_stats()`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ccalloc_stat {
    pub current: i64,
    pub peak: i64,
    /// Total ever added.
    pub allocated: i64,
    /// Total ever removed.
    pub freed: i64,
}

/// A counter for all blocks and per pool (small: blocks of at most 1 MiB).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ccalloc_stat_array {
    pub all: ccalloc_stat,
    pub small_pool: ccalloc_stat,
    pub large_pool: ccalloc_stat,
}

/// Per-device statistics with PyTorch's names and meanings.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ccalloc_stats {
    pub allocation: ccalloc_stat_array,
    pub segment: ccalloc_stat_array,
    pub active: ccalloc_stat_array,
    pub inactive_split: ccalloc_stat_array,
    pub allocated_bytes: ccalloc_stat_array,
    pub reserved_bytes: ccalloc_stat_array,
    pub active_bytes: ccalloc_stat_array,
    pub inactive_split_bytes: ccalloc_stat_array,
    pub requested_bytes: ccalloc_stat_array,
    pub oversize_allocations: ccalloc_stat,
    pub oversize_segments: ccalloc_stat,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    pub num_sync_all_streams: u64,
    pub num_device_alloc: u64,
    pub num_device_free: u64,
    /// `max_split_size_mb` in bytes; -1 when unlimited (as PyTorch reports it).
    pub max_split_size: i64,
}

/// What keeping reserved ≈ live has cost on a device (paged segments; all 0 with plain
/// segments). Counts and times accumulate until `ccalloc_reset_accumulated_stats`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ccalloc_paging_stats {
    /// Requests that had to map pages, and those of them that moved pages from under free
    /// blocks (the rest used new or idle memory).
    pub growths: u64,
    pub moving_growths: u64,
    /// Physical chunks (1 to 64 pages each, see `chunk_pages_for`) mapped and unmapped.
    pub chunks_mapped: u64,
    pub chunks_unmapped: u64,
    /// Times the host waited for the device (a fence before moving pages, or a synchronize).
    pub host_waits: u64,
    /// Wall time spent in growth, and in growth that moved pages, in nanoseconds.
    pub growth_ns: u64,
    pub moving_ns: u64,
    /// Of that time, the host's waits for the device (`host_waits`), in nanoseconds: the
    /// device was running the work queued before the moved pages were freed, so these
    /// waits are not what `page_move_budget` limits.
    pub wait_ns: u64,
    /// The share of peak live bytes that growth may keep beyond it while page moves are
    /// within `page_move_budget` (the `page_slack` setting).
    pub page_slack: f64,
    /// Of the chunks mapped, those taken from idle memory of the device's other shards
    /// (with `per_stream_shards`): memory that changed streams without being released.
    pub chunks_borrowed: u64,
    /// Growths refused page moves because moves had taken their share of the time
    /// (`page_move_budget`), or, in a job that keeps its device busy, had taken it and not
    /// yet earned it back in full: each mapped new memory instead, past the slack bound
    /// where it needed more than the slack held.
    pub growths_past_slack: u64,
}

/// How callers met a device's locks (each shard's), counted until
/// `ccalloc_reset_accumulated_stats`. A call served by the calling thread's cache of freed
/// blocks (`thread_cache`) takes no lock and counts nothing.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ccalloc_lock_stats {
    /// Times a lock was taken: allocations and frees past the thread caches, statistics
    /// reads (not this one: it takes no lock), and the device's own bookkeeping.
    pub acquisitions: u64,
    /// Of those, the ones that found another thread holding the lock, and of these the ones
    /// that slept after spinning (about 20 µs).
    pub contended: u64,
    pub blocked: u64,
    /// Wall time the contended acquisitions waited, in nanoseconds.
    pub wait_ns: u64,
    /// Acquisitions by another thread than the one before: the allocator's bookkeeping moved
    /// between threads (and likely cores). Threads that take turns on a stream, as PyTorch's
    /// forward and autograd threads do, make a few per step; threads that allocate at the
    /// same time on one stream make about one per call.
    pub handoffs: u64,
}

impl From<LockCounters> for ccalloc_lock_stats {
    fn from(l: LockCounters) -> Self {
        Self {
            acquisitions: l.acquisitions,
            contended: l.contended,
            blocked: l.blocked,
            wait_ns: l.wait_ns,
            handoffs: l.handoffs,
        }
    }
}

impl ccalloc_paging_stats {
    pub fn new(p: &PagingCounters, page_slack: f64) -> Self {
        Self {
            growths: p.growths,
            moving_growths: p.moving_growths,
            chunks_mapped: p.chunks_mapped,
            chunks_unmapped: p.chunks_unmapped,
            host_waits: p.host_waits,
            growth_ns: p.growth_ns,
            moving_ns: p.moving_ns,
            wait_ns: p.wait_ns,
            page_slack,
            chunks_borrowed: p.chunks_borrowed,
            growths_past_slack: p.growths_past_slack,
        }
    }
}

/// What a device's reserved memory is made of (`ccalloc_get_memory_breakdown`): live bytes
/// and the excess over them by cause. The six byte counts from `live_bytes` on add up to
/// `reserved_bytes`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ccalloc_memory_breakdown {
    pub reserved_bytes: u64,
    /// Blocks handed out, or freed while other streams' work on them is still pending.
    pub live_bytes: u64,
    /// Mapped chunks of paged segments holding no live byte: cached memory that growth
    /// elsewhere may move.
    pub free_chunk_bytes: u64,
    /// Whole pages without a live byte in chunks that hold some: kept mapped because a
    /// chunk (one physical allocation) is unmapped only whole.
    pub pinned_bytes: u64,
    /// The chunks holding `pinned_bytes`.
    pub pinning_chunks: u64,
    /// The free part of pages that hold some live bytes (2 MiB pages on current GPUs).
    pub rounding_bytes: u64,
    /// Reserved physical memory not mapped anywhere, kept for later growth.
    pub parked_bytes: u64,
    /// The free part of plain (not paged) segments: cached memory as in PyTorch's native
    /// allocator.
    pub plain_bytes: u64,
}

impl From<crate::MemoryBreakdown> for ccalloc_memory_breakdown {
    fn from(b: crate::MemoryBreakdown) -> Self {
        Self {
            reserved_bytes: b.reserved_bytes,
            live_bytes: b.live_bytes,
            free_chunk_bytes: b.free_chunk_bytes,
            pinned_bytes: b.pinned_bytes,
            pinning_chunks: b.pinning_chunks,
            rounding_bytes: b.rounding_bytes,
            parked_bytes: b.parked_bytes,
            plain_bytes: b.plain_bytes,
        }
    }
}

/// Opaque CUDA stream, declared as the CUDA runtime does (`cudaStream_t`). cbindgen.toml
/// replaces its definition with a forward declaration.
#[repr(C)]
pub struct CUstream_st {
    _private: [u8; 0],
}

/// Identical to the CUDA runtime's `cudaStream_t`.
pub type cudaStream_t = *mut CUstream_st;

/// Names a private pool; identical in layout to PyTorch's `c10::cuda::MempoolId_t`
/// (`std::pair<unsigned long long, unsigned long long>`, passed in two registers).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ccalloc_pool_id {
    pub first: u64,
    pub second: u64,
}

/// Says whether an allocation on `stream` goes to the private pool (`ctx` is the caller's).
pub type ccalloc_stream_filter =
    Option<unsafe extern "C" fn(ctx: *mut std::ffi::c_void, stream: cudaStream_t) -> bool>;

/// Releases the caller's `ctx` when ccalloc no longer needs it.
pub type ccalloc_release_fn = Option<unsafe extern "C" fn(ctx: *mut std::ffi::c_void)>;

impl From<&Stat> for ccalloc_stat {
    fn from(s: &Stat) -> Self {
        Self {
            current: s.current,
            peak: s.peak,
            allocated: s.allocated,
            freed: s.freed,
        }
    }
}

impl From<&StatArray> for ccalloc_stat_array {
    fn from(a: &StatArray) -> Self {
        Self {
            all: (&a.0[0]).into(),
            small_pool: (&a.0[1]).into(),
            large_pool: (&a.0[2]).into(),
        }
    }
}

impl ccalloc_stats {
    /// Every per-pool counter with its PyTorch name, for checks that run over all of them.
    pub fn arrays(&self) -> [(&'static str, &ccalloc_stat_array); 9] {
        let arrays = crate::alloc::stats::per_pool_arrays!(self, &);
        std::array::from_fn(|i| (crate::alloc::stats::ARRAY_NAMES[i], arrays[i]))
    }

    pub fn new(s: &DeviceStats, max_split_size: u64) -> Self {
        Self {
            allocation: (&s.allocation).into(),
            segment: (&s.segment).into(),
            active: (&s.active).into(),
            inactive_split: (&s.inactive_split).into(),
            allocated_bytes: (&s.allocated_bytes).into(),
            reserved_bytes: (&s.reserved_bytes).into(),
            active_bytes: (&s.active_bytes).into(),
            inactive_split_bytes: (&s.inactive_split_bytes).into(),
            requested_bytes: (&s.requested_bytes).into(),
            oversize_allocations: (&s.oversize_allocations).into(),
            oversize_segments: (&s.oversize_segments).into(),
            num_alloc_retries: s.num_alloc_retries,
            num_ooms: s.num_ooms,
            num_sync_all_streams: s.num_sync_all_streams,
            num_device_alloc: s.num_device_alloc,
            num_device_free: s.num_device_free,
            max_split_size: i64::try_from(max_split_size).unwrap_or(-1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ccalloc_status;
    use crate::ffi::ccalloc_status_name;
    use std::ffi::CStr;

    fn c_name(status: u32) -> &'static CStr {
        // SAFETY: ccalloc_status_name returns a static NUL-terminated string for any value.
        unsafe { CStr::from_ptr(ccalloc_status_name(status)) }
    }

    /// The table build.rs generates agrees with the enum it was read from: values 0, 1, ...
    /// in order, each name the variant's own, and `ccalloc_status_name` answers with it.
    #[test]
    fn generated_status_table_matches_the_enum() {
        for (index, &status) in ccalloc_status::ALL.iter().enumerate() {
            assert_eq!(status as u32 as usize, index);
            assert_eq!(ccalloc_status::from_u32(index as u32), Some(status));
            assert_eq!(status.name().to_str().unwrap(), format!("{status:?}"));
            assert_eq!(c_name(index as u32), status.name());
        }
        for past in [ccalloc_status::ALL.len() as u32, u32::MAX] {
            assert_eq!(ccalloc_status::from_u32(past), None);
            assert_eq!(c_name(past), c"CCALLOC_UNKNOWN_STATUS");
        }
    }

    #[test]
    fn every_failure_status_has_its_own_error_kind() {
        for status in ccalloc_status::ALL {
            match status.error_kind() {
                None => assert_eq!(status, ccalloc_status::CCALLOC_OK),
                Some(kind) => assert_eq!(kind.status(), status, "{kind:?}"),
            }
        }
    }
}
