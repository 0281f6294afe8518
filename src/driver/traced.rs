//! A driver adaptor that logs and records segment events: `segment_alloc` /
//! `segment_free` for plain segments, `segment_map` / `segment_unmap` for the pages of paged
//! ones, to the log (`crate::logging`, debug level) and to the history of memory snapshots
//! (`crate::history`). It only calls downward; with both off it adds a relaxed atomic load
//! and tracing's level check to the calls it watches, which are the slow path.

use super::{DevicePtr, Driver, DriverResult, HostKind, PhysHandle};
use crate::history::{self, Action};
use std::sync::Arc;

pub(crate) struct Traced {
    inner: Arc<dyn Driver>,
}

impl Traced {
    pub(crate) fn new(inner: Arc<dyn Driver>) -> Self {
        Self { inner }
    }
}

fn traced<T>(
    result: DriverResult<T>,
    action: Action,
    device: usize,
    addr: u64,
    size: u64,
) -> DriverResult<T> {
    if result.is_ok() {
        announce(action, device, addr, size);
    }
    result
}

fn announce(action: Action, device: usize, addr: u64, size: u64) {
    tracing::debug!(device, addr, size, "{}", action.name());
    history::record(action, device as i32, addr, size, 0);
}

impl Driver for Traced {
    fn allocate(&self, device: usize, size: u64) -> DriverResult<DevicePtr> {
        let result = self.inner.allocate(device, size);
        match result {
            Ok(addr) => traced(Ok(addr), Action::SegmentAlloc, device, addr, size),
            Err(e) => Err(e),
        }
    }
    fn release(&self, device: usize, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        // Said before the memory goes: an observer (NCCL) deregisters it while it exists.
        announce(Action::SegmentFree, device, ptr, size);
        self.inner.release(device, ptr, size)
    }
    fn map(&self, device: usize, va: DevicePtr, size: u64, handle: PhysHandle) -> DriverResult<()> {
        let result = self.inner.map(device, va, size, handle);
        traced(result, Action::SegmentMap, device, va, size)
    }
    fn unmap(&self, device: usize, va: DevicePtr, size: u64) -> DriverResult<()> {
        announce(Action::SegmentUnmap, device, va, size);
        self.inner.unmap(device, va, size)
    }
    // Host-side memory is not device memory: not in the device's segment history.
    fn host_memory(&self, kind: HostKind) -> DriverResult<u64> {
        self.inner.host_memory(kind)
    }
    crate::driver::forward_to_inner!(
        name,
        device_count,
        total_memory,
        record_event,
        event_done,
        wait_event,
        destroy_event,
        synchronize,
        min_free_fence_interval,
        times_page_moves,
        releases_outgrown_segments,
        synchronize_stream,
        vmm_granularity,
        reserve_address,
        free_address,
        create_physical,
        release_physical,
        set_access,
        host_allocate,
        host_release,
        prefetch,
        advise
    );
}
