//! The memory limit (`per_process_memory_fraction`) as a driver adaptor: device memory is
//! claimed from one count before the driver below is asked for it, and given back when it
//! is released or the driver refuses it.

use crate::driver::{DevicePtr, Driver, DriverError, DriverResult, HostKind, PhysHandle};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Limits the memory one device's allocator takes from `inner`. Every shard of the device
/// allocates through the same `Limit`, so that shards growing at the same time cannot pass
/// the limit together: a claim is made before the driver is asked. Claimed (`committed`)
/// bytes are memory taken from the driver, mapped or not: segments from `allocate` and
/// physical chunks from `create_physical`, until `release` or `release_physical` gives them
/// back. A claim past the limit fails as the device would, with `OutOfMemory`.
pub struct Limit {
    inner: Arc<dyn Driver>,
    committed: AtomicU64,
    /// The limit for segments (`u64::MAX`: none, the device decides).
    limit: AtomicU64,
    /// The device's memory: physical chunks are claimed under the smaller of it and `limit`.
    total_memory: u64,
}

impl Limit {
    pub fn new(inner: Arc<dyn Driver>, limit: u64, total_memory: u64) -> Self {
        Self {
            inner,
            committed: AtomicU64::new(0),
            limit: AtomicU64::new(limit),
            total_memory,
        }
    }

    /// A new limit, for claims from now on (memory claimed already stays).
    pub fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// Claims `bytes` under `limit`; false (nothing claimed) past it.
    fn claim(&self, bytes: u64, limit: u64) -> bool {
        self.committed
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                c.checked_add(bytes).filter(|&n| n <= limit)
            })
            .is_ok()
    }

    fn unclaim(&self, bytes: u64) {
        self.committed.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Runs `call` under a claim of `bytes`, which it keeps only if `call` succeeds.
    fn claimed<T>(
        &self,
        bytes: u64,
        limit: u64,
        call: impl FnOnce() -> DriverResult<T>,
    ) -> DriverResult<T> {
        if !self.claim(bytes, limit) {
            return Err(DriverError::OutOfMemory);
        }
        let result = call();
        if result.is_err() {
            self.unclaim(bytes);
        }
        result
    }

    /// Gives back `bytes` once `result` says the memory went back.
    fn released(&self, bytes: u64, result: DriverResult<()>) -> DriverResult<()> {
        if result.is_ok() {
            self.unclaim(bytes);
        }
        result
    }
}

impl Driver for Limit {
    fn allocate(&self, device: usize, size: u64) -> DriverResult<DevicePtr> {
        let limit = self.limit.load(Ordering::Relaxed);
        self.claimed(size, limit, || self.inner.allocate(device, size))
    }
    fn release(&self, device: usize, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        self.released(size, self.inner.release(device, ptr, size))
    }
    fn create_physical(&self, device: usize, size: u64) -> DriverResult<PhysHandle> {
        let limit = self.limit.load(Ordering::Relaxed).min(self.total_memory);
        self.claimed(size, limit, || self.inner.create_physical(device, size))
    }
    fn release_physical(&self, device: usize, handle: PhysHandle, size: u64) -> DriverResult<()> {
        self.released(size, self.inner.release_physical(device, handle, size))
    }
    // Host-side memory is not the device's: not under its limit.
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
        map,
        set_access,
        unmap,
        host_allocate,
        host_release,
        prefetch,
        advise
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::SimDriver;

    const MIB: u64 = 1 << 20;

    #[test]
    fn claims_past_the_limit_never_reach_the_driver_and_releases_give_back() {
        let sim = Arc::new(SimDriver::new(1, 64 * MIB));
        let limit = Limit::new(sim.clone(), 6 * MIB, 64 * MIB);
        let a = limit.allocate(0, 4 * MIB).unwrap();
        assert_eq!(limit.allocate(0, 4 * MIB), Err(DriverError::OutOfMemory));
        assert_eq!(
            sim.counters(0).allocate_calls,
            1,
            "the refused claim asked nothing"
        );
        // Physical chunks count against the same claim.
        assert_eq!(
            limit.create_physical(0, 4 * MIB),
            Err(DriverError::OutOfMemory)
        );
        let chunk = limit.create_physical(0, 2 * MIB).unwrap();
        limit.release(0, a, 4 * MIB).unwrap();
        let b = limit.allocate(0, 4 * MIB).unwrap();
        limit.release_physical(0, chunk, 2 * MIB).unwrap();
        limit.release(0, b, 4 * MIB).unwrap();
        assert_eq!(limit.committed.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_refusal_below_gives_the_claim_back_and_chunks_stay_within_the_device() {
        let sim = Arc::new(SimDriver::new(1, 8 * MIB));
        let limit = Limit::new(sim.clone(), u64::MAX, 8 * MIB);
        // Past the device: the driver below refuses, and nothing stays claimed.
        assert!(limit.allocate(0, 16 * MIB).is_err());
        assert_eq!(
            sim.counters(0).failed_allocations,
            1,
            "the driver was asked"
        );
        assert_eq!(limit.committed.load(Ordering::Relaxed), 0);
        // Without a limit, chunks are still claimed within the device's memory.
        assert_eq!(
            limit.create_physical(0, 16 * MIB),
            Err(DriverError::OutOfMemory)
        );
        assert_eq!(sim.counters(0).physical_creates, 0);
        limit.set_limit(2 * MIB);
        assert_eq!(limit.allocate(0, 4 * MIB), Err(DriverError::OutOfMemory));
    }
}
