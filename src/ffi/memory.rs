//! The C API for looking into memory: the largest cached block, private-pool holds, the
//! allocation history and snapshots (segments, blocks, history), and snapshot files that
//! PyTorch's viewer reads.

#![allow(non_camel_case_types)]

use super::boundary::{guard, invalid, require_out, write_out};
use super::types::{ccalloc_pool_id, ccalloc_status, cudaStream_t};
use crate::error::{Error, ErrorKind};
use crate::history;
use crate::runtime;
use crate::snapshot::{self, Snapshot};
use std::ffi::{c_char, c_void, CStr};

/// One event of the allocation history, with PyTorch's meanings (`TraceEntry`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ccalloc_trace_entry {
    /// Grows by one per recorded event.
    pub seq: u64,
    /// 0 alloc, 1 free_requested, 2 free_completed, 3 segment_alloc, 4 segment_free,
    /// 5 segment_map, 6 segment_unmap, 7 snapshot, 8 oom.
    pub action: u32,
    pub device: i32,
    pub addr: u64,
    pub size: u64,
    pub stream: cudaStream_t,
    /// Microseconds since the Unix epoch.
    pub time_us: i64,
    /// What `ccalloc_set_trace_context` tagged the event with (0: nothing).
    pub context: u64,
}

/// One segment of a snapshot. A paged segment appears as one segment per mapped range.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ccalloc_segment_info {
    pub device: i32,
    pub address: u64,
    pub total_size: u64,
    pub allocated_size: u64,
    pub active_size: u64,
    pub requested_size: u64,
    pub stream: cudaStream_t,
    /// Whether the segment serves blocks of more than 1 MiB.
    pub is_large: bool,
    /// Whether it is (part of) a paged segment.
    pub is_expandable: bool,
    /// The private pool it belongs to ({0, 0}: none).
    pub pool: ccalloc_pool_id,
    pub block_count: usize,
}

/// One block of a snapshot's segment.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ccalloc_block_info {
    pub address: u64,
    pub size: u64,
    /// The size asked for (0 for a block not handed out).
    pub requested_size: u64,
    /// 0 inactive (cached), 1 active_allocated, 2 active_pending_free (freed, awaiting
    /// other streams' work).
    pub state: u32,
}

/// Segments, blocks and history at one moment (`ccalloc_snapshot_take`).
pub struct ccalloc_snapshot(Snapshot);

/// The largest cached free block on `device`: what the biggest request served without
/// asking the driver could be (PyTorch's `cacheInfo`).
#[no_mangle]
pub extern "C" fn ccalloc_cache_info(device: i32, out_largest_block: *mut u64) -> ccalloc_status {
    guard(|| {
        require_out(out_largest_block, "out_largest_block")?;
        let largest = runtime::global()?
            .device(device as i64)?
            .largest_free_block()?;
        write_out(out_largest_block, "out_largest_block", largest)
    })
}

/// Takes one hold on private pool `pool` of `device`, creating it if new (PyTorch's
/// `MemPool`); `ccalloc_release_pool` drops a hold.
#[no_mangle]
pub extern "C" fn ccalloc_create_or_incref_pool(
    device: i32,
    pool: ccalloc_pool_id,
) -> ccalloc_status {
    guard(|| {
        runtime::global()?
            .device(device as i64)?
            .create_or_incref_pool((pool.first, pool.second))
    })
}

/// The holds on private pool `pool` of `device` (0 when it does not exist).
#[no_mangle]
pub extern "C" fn ccalloc_pool_use_count(
    device: i32,
    pool: ccalloc_pool_id,
    out_count: *mut u32,
) -> ccalloc_status {
    guard(|| {
        require_out(out_count, "out_count")?;
        let count = runtime::global()?
            .device(device as i64)?
            .pool_use_count((pool.first, pool.second))?;
        write_out(out_count, "out_count", count)
    })
}

/// Starts or stops recording the allocation history (every device), keeping at most
/// `max_entries` events (at most 2^24); `clear` drops what was recorded. Snapshots include
/// it. Recording costs a lock per allocation and free while on, nothing measurable off.
#[no_mangle]
pub extern "C" fn ccalloc_record_history(
    enabled: bool,
    max_entries: usize,
    clear: bool,
) -> ccalloc_status {
    guard(|| history::set_recording(enabled, max_entries, clear))
}

/// Whether the allocation history is being recorded. Never fails.
#[no_mangle]
pub extern "C" fn ccalloc_is_recording_history() -> bool {
    history::is_recording()
}

/// Tags the calling thread's next recorded allocation or free with `context` (a host's key
/// for data of its own, e.g. a stack trace); later events are untagged until called again.
#[no_mangle]
pub extern "C" fn ccalloc_set_trace_context(context: u64) {
    history::set_thread_context(context);
}

/// The sequence number of the oldest history event still kept: a host may drop data it
/// keeps for events before it.
#[no_mangle]
pub extern "C" fn ccalloc_history_oldest_seq(out_seq: *mut u64) -> ccalloc_status {
    guard(|| write_out(out_seq, "out_seq", history::oldest_seq()?))
}

/// Called with each segment event (`ccalloc_set_segment_observer`); `ctx` is the caller's.
pub type ccalloc_trace_observer =
    Option<unsafe extern "C" fn(ctx: *mut c_void, entry: *const ccalloc_trace_entry)>;

struct ForeignObserver {
    call: unsafe extern "C" fn(*mut c_void, *const ccalloc_trace_entry),
    ctx: *mut c_void,
}

// SAFETY: the API contract requires observers callable from any thread.
unsafe impl Send for ForeignObserver {}
unsafe impl Sync for ForeignObserver {}

impl ForeignObserver {
    fn notify(&self, e: &history::Entry) {
        let entry = entry_of(e);
        // SAFETY: a caller-supplied function with the documented signature.
        unsafe { (self.call)(self.ctx, &entry) };
    }
}

fn entry_of(e: &history::Entry) -> ccalloc_trace_entry {
    ccalloc_trace_entry {
        seq: e.seq,
        action: e.action as u32,
        device: e.device,
        addr: e.addr,
        size: e.size,
        stream: e.stream as cudaStream_t,
        time_us: e.time_us,
        context: e.context,
    }
}

/// Adds `observer`, called with every segment event (actions 3 to 6) whether or not the
/// history is recorded: a segment's free or unmap comes before the memory goes, its
/// allocation or map once it is usable. It runs under the device's lock and must not call
/// ccalloc (such a call fails with `CCALLOC_INVALID_ARGUMENT`). Observers stay for the life
/// of the process (PyTorch's trace trackers).
#[no_mangle]
pub extern "C" fn ccalloc_add_segment_observer(
    observer: ccalloc_trace_observer,
    ctx: *mut c_void,
) -> ccalloc_status {
    guard(|| {
        let call = observer.ok_or_else(|| invalid("observer is NULL"))?;
        let foreign = ForeignObserver { call, ctx };
        history::observe_segments(Box::new(move |e| foreign.notify(e)))
    })
}

/// Takes a snapshot of `device` (-1: every device): its segments with their blocks and,
/// with `include_trace`, the recorded history (the snapshot is then recorded in it too).
/// Free it with `ccalloc_snapshot_free`.
#[no_mangle]
pub extern "C" fn ccalloc_snapshot_take(
    device: i32,
    include_trace: bool,
    out_snapshot: *mut *mut ccalloc_snapshot,
) -> ccalloc_status {
    guard(|| {
        require_out(out_snapshot, "out_snapshot")?;
        let rt = runtime::global()?;
        let snapshot = snapshot::take(rt, device_filter(device)?, include_trace)?;
        let boxed = Box::into_raw(Box::new(ccalloc_snapshot(snapshot)));
        write_out(out_snapshot, "out_snapshot", boxed)
    })
}

fn device_filter(device: i32) -> Result<Option<usize>, Error> {
    match device {
        -1 => Ok(None),
        d if d >= 0 => Ok(Some(d as usize)),
        d => Err(Error::new(
            ErrorKind::InvalidDevice,
            format!("device {d} does not exist"),
        )),
    }
}

/// Frees a snapshot from `ccalloc_snapshot_take`. NULL is a no-op.
#[no_mangle]
pub unsafe extern "C" fn ccalloc_snapshot_free(snapshot: *mut ccalloc_snapshot) {
    if !snapshot.is_null() {
        // SAFETY: from `ccalloc_snapshot_take`, freed once per the API contract.
        drop(unsafe { Box::from_raw(snapshot) });
    }
}

fn snapshot_ref<'a>(snapshot: *const ccalloc_snapshot) -> Result<&'a Snapshot, Error> {
    if snapshot.is_null() {
        return Err(invalid("snapshot is NULL"));
    }
    // SAFETY: a live snapshot from `ccalloc_snapshot_take`, per the API contract.
    Ok(&unsafe { &*snapshot }.0)
}

fn out_of_range(what: &str, index: usize, count: usize) -> Error {
    invalid(format!(
        "{what} {index} is out of range ({count} in the snapshot)"
    ))
}

/// How many segments and history events the snapshot holds.
#[no_mangle]
pub unsafe extern "C" fn ccalloc_snapshot_counts(
    snapshot: *const ccalloc_snapshot,
    out_segments: *mut usize,
    out_trace_entries: *mut usize,
) -> ccalloc_status {
    guard(|| {
        let s = snapshot_ref(snapshot)?;
        require_out(out_segments, "out_segments")?;
        require_out(out_trace_entries, "out_trace_entries")?;
        write_out(out_segments, "out_segments", s.segments.len())?;
        write_out(out_trace_entries, "out_trace_entries", s.trace.len())
    })
}

/// Segment `index` of the snapshot, in address order per device.
#[no_mangle]
pub unsafe extern "C" fn ccalloc_snapshot_segment(
    snapshot: *const ccalloc_snapshot,
    index: usize,
    out_segment: *mut ccalloc_segment_info,
) -> ccalloc_status {
    guard(|| {
        let s = snapshot_ref(snapshot)?;
        require_out(out_segment, "out_segment")?;
        let seg = s
            .segments
            .get(index)
            .ok_or_else(|| out_of_range("segment", index, s.segments.len()))?;
        let info = ccalloc_segment_info {
            device: seg.device,
            address: seg.address,
            total_size: seg.total_size,
            allocated_size: seg.allocated_size(),
            active_size: seg.active_size(),
            requested_size: seg.requested_size(),
            stream: seg.stream as cudaStream_t,
            is_large: seg.is_large,
            is_expandable: seg.is_expandable,
            pool: ccalloc_pool_id {
                first: seg.private_pool.0,
                second: seg.private_pool.1,
            },
            block_count: seg.blocks.len(),
        };
        write_out(out_segment, "out_segment", info)
    })
}

/// Block `block` of segment `segment`, in address order.
#[no_mangle]
pub unsafe extern "C" fn ccalloc_snapshot_block(
    snapshot: *const ccalloc_snapshot,
    segment: usize,
    block: usize,
    out_block: *mut ccalloc_block_info,
) -> ccalloc_status {
    guard(|| {
        let s = snapshot_ref(snapshot)?;
        require_out(out_block, "out_block")?;
        let seg = s
            .segments
            .get(segment)
            .ok_or_else(|| out_of_range("segment", segment, s.segments.len()))?;
        let b = seg
            .blocks
            .get(block)
            .ok_or_else(|| out_of_range("block", block, seg.blocks.len()))?;
        let info = ccalloc_block_info {
            address: b.address,
            size: b.size,
            requested_size: b.requested_size,
            state: b.status as u32,
        };
        write_out(out_block, "out_block", info)
    })
}

/// History event `index` of the snapshot, oldest first.
#[no_mangle]
pub unsafe extern "C" fn ccalloc_snapshot_trace_entry(
    snapshot: *const ccalloc_snapshot,
    index: usize,
    out_entry: *mut ccalloc_trace_entry,
) -> ccalloc_status {
    guard(|| {
        let s = snapshot_ref(snapshot)?;
        require_out(out_entry, "out_entry")?;
        let e = s
            .trace
            .get(index)
            .ok_or_else(|| out_of_range("trace entry", index, s.trace.len()))?;
        write_out(out_entry, "out_entry", entry_of(e))
    })
}

/// Writes a snapshot of every device to `path` as PyTorch's pickled snapshot (what
/// `torch.cuda.memory._dump_snapshot` writes), which `python -m torch.cuda._memory_viz` and
/// `ccalloc replay` read. Stack frames are empty.
#[no_mangle]
pub unsafe extern "C" fn ccalloc_dump_snapshot(path: *const c_char) -> ccalloc_status {
    guard(|| {
        if path.is_null() {
            return Err(invalid("path is NULL"));
        }
        // SAFETY: non-null and, per the API contract, a NUL-terminated string.
        let path = unsafe { CStr::from_ptr(path) }
            .to_str()
            .map_err(|_| invalid("path is not UTF-8"))?;
        let bytes = snapshot::take(runtime::global()?, None, true)?.to_pickle()?;
        std::fs::write(path, bytes).map_err(|e| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("cannot write the snapshot to {path:?}: {e}"),
            )
        })
    })
}

/// Receives one block of a pool restore: `allocated` false for a block freed, true for one
/// made again (`ccalloc_restore_pool`).
pub type ccalloc_restore_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, ptr: *mut c_void, allocated: bool)>;

/// Restores private pool `pool` of `device` to a saved layout (PyTorch's
/// `setCheckpointPoolState`): `blocks` lists every block of the pool's segments in address
/// order, as `ccalloc_snapshot_block` gave them (`state` 1: handed out; others: free). Every
/// block of the pool handed out now is freed, then the saved blocks are made again at their
/// addresses, those saved as handed out staying handed out. On success `report(ctx, ptr,
/// false)` is called for each block freed, then `report(ctx, ptr, true)` for each made
/// again. Fails with `CCALLOC_INVALID_ARGUMENT` when the pool's segments no longer match the
/// layout or one of its blocks awaits another stream's work; the pool's blocks are then
/// freed and it must not be used further.
#[no_mangle]
pub unsafe extern "C" fn ccalloc_restore_pool(
    device: i32,
    pool: ccalloc_pool_id,
    blocks: *const ccalloc_block_info,
    count: usize,
    report: ccalloc_restore_fn,
    ctx: *mut c_void,
) -> ccalloc_status {
    guard(|| {
        if blocks.is_null() && count > 0 {
            return Err(invalid("blocks is NULL"));
        }
        let report = report.ok_or_else(|| invalid("report is NULL"))?;
        let saved: Vec<crate::alloc::SavedBlock> = if count == 0 {
            Vec::new()
        } else {
            // SAFETY: `count` readable blocks, per the API contract.
            unsafe { std::slice::from_raw_parts(blocks, count) }
                .iter()
                .map(|b| crate::alloc::SavedBlock {
                    addr: b.address,
                    size: b.size,
                    allocated: b.state == 1,
                })
                .collect()
        };
        let done = runtime::global()?
            .device(device as i64)?
            .restore_pool((pool.first, pool.second), &saved)?;
        // The history records the restore's frees and allocations as those of any other
        // path (PyTorch's setCheckpointPoolState frees and allocates through its own).
        for ptr in done.freed {
            crate::history::freed(device, ptr);
            // SAFETY: a caller-supplied function with the documented signature.
            unsafe { report(ctx, ptr as *mut c_void, false) };
        }
        for made in done.allocated {
            crate::history::allocated(device, made.ptr, made.size, made.stream.0);
            // SAFETY: as above.
            unsafe { report(ctx, made.ptr as *mut c_void, true) };
        }
        Ok(())
    })
}
