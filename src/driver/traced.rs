//! A driver adaptor that logs and records segment events: `segment_alloc` /
//! `segment_free` for plain segments, `segment_map` / `segment_unmap` for the pages of paged
//! ones, to the log (`crate::logging`, debug level) and to the history of memory snapshots
//! (`crate::history`). It only calls downward; with both off it adds a relaxed atomic load
//! and tracing's level check to the calls it watches, which are the slow path.

use super::{
    Advice, DevicePtr, Driver, DriverResult, EventId, HostKind, Location, PhysHandle, StreamId,
};
use crate::history::{self, Action};
use std::sync::Arc;
use std::time::Duration;

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
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn device_count(&self) -> usize {
        self.inner.device_count()
    }
    fn total_memory(&self, device: usize) -> DriverResult<u64> {
        self.inner.total_memory(device)
    }
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
    fn record_event(&self, device: usize, stream: StreamId) -> DriverResult<EventId> {
        self.inner.record_event(device, stream)
    }
    fn event_done(&self, device: usize, event: EventId) -> DriverResult<bool> {
        self.inner.event_done(device, event)
    }
    fn wait_event(&self, device: usize, event: EventId) -> DriverResult<()> {
        self.inner.wait_event(device, event)
    }
    fn destroy_event(&self, device: usize, event: EventId) {
        self.inner.destroy_event(device, event)
    }
    fn synchronize(&self, device: usize) -> DriverResult<()> {
        self.inner.synchronize(device)
    }
    fn min_free_fence_interval(&self) -> Duration {
        self.inner.min_free_fence_interval()
    }
    fn times_page_moves(&self) -> bool {
        self.inner.times_page_moves()
    }
    fn releases_outgrown_segments(&self) -> bool {
        self.inner.releases_outgrown_segments()
    }
    fn synchronize_stream(&self, device: usize, stream: StreamId) -> DriverResult<()> {
        self.inner.synchronize_stream(device, stream)
    }
    fn vmm_granularity(&self, device: usize) -> Option<u64> {
        self.inner.vmm_granularity(device)
    }
    fn reserve_address(&self, device: usize, size: u64) -> DriverResult<DevicePtr> {
        self.inner.reserve_address(device, size)
    }
    fn free_address(&self, device: usize, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        self.inner.free_address(device, ptr, size)
    }
    fn create_physical(&self, device: usize, size: u64) -> DriverResult<PhysHandle> {
        self.inner.create_physical(device, size)
    }
    fn release_physical(&self, device: usize, handle: PhysHandle, size: u64) -> DriverResult<()> {
        self.inner.release_physical(device, handle, size)
    }
    fn map(&self, device: usize, va: DevicePtr, size: u64, handle: PhysHandle) -> DriverResult<()> {
        let result = self.inner.map(device, va, size, handle);
        traced(result, Action::SegmentMap, device, va, size)
    }
    fn set_access(&self, device: usize, va: DevicePtr, size: u64) -> DriverResult<()> {
        self.inner.set_access(device, va, size)
    }
    fn unmap(&self, device: usize, va: DevicePtr, size: u64) -> DriverResult<()> {
        announce(Action::SegmentUnmap, device, va, size);
        self.inner.unmap(device, va, size)
    }
    // Host-side memory is not device memory: not in the device's segment history.
    fn host_memory(&self, kind: HostKind) -> DriverResult<u64> {
        self.inner.host_memory(kind)
    }
    fn host_allocate(&self, kind: HostKind, size: u64) -> DriverResult<DevicePtr> {
        self.inner.host_allocate(kind, size)
    }
    fn host_release(&self, kind: HostKind, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        self.inner.host_release(kind, ptr, size)
    }
    fn prefetch(
        &self,
        ptr: DevicePtr,
        size: u64,
        to: Location,
        stream_device: usize,
        stream: StreamId,
    ) -> DriverResult<()> {
        self.inner.prefetch(ptr, size, to, stream_device, stream)
    }
    fn advise(
        &self,
        ptr: DevicePtr,
        size: u64,
        advice: Advice,
        location: Location,
    ) -> DriverResult<()> {
        self.inner.advise(ptr, size, advice, location)
    }
}
