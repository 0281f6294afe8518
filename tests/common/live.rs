//! A model of what the caller holds live (address → requested size), checked for overlap on
//! every allocation, and the statistics that must follow from it.

use super::figures::{rounded, PoolFigures};
use ccalloc::{Config, DeviceAllocator, DeviceStats, SimDriver};
use std::collections::BTreeMap;
use std::sync::Arc;

/// An allocator on a one-device sim of `capacity` bytes under settings `conf`.
pub fn sim_allocator(capacity: u64, conf: &str) -> (Arc<SimDriver>, Arc<DeviceAllocator>) {
    let sim = Arc::new(SimDriver::new(1, capacity));
    let mut config = Config::default();
    config.apply(conf).unwrap();
    let a = DeviceAllocator::new(0, sim.clone(), config).unwrap();
    (sim, Arc::new(a))
}

/// What the caller holds live, and the statistics that must follow from it.
#[derive(Default)]
pub struct LiveModel {
    pub figures: PoolFigures,
    pub allocations: i64,
    pub live: BTreeMap<u64, u64>,
}

impl LiveModel {
    /// `size` bytes handed out at `p`: no other live block may overlap it.
    pub fn alloc(&mut self, p: u64, size: u64) {
        assert!(
            self.live.insert(p, size).is_none(),
            "{p:#x} handed out twice"
        );
        let end = p + rounded(size);
        if let Some((&q, &s)) = self.live.range(..p).next_back() {
            assert!(q + rounded(s) <= p, "{p:#x} overlaps {q:#x}");
        }
        if let Some((&q, _)) = self.live.range(p + 1..).next() {
            assert!(end <= q, "{p:#x} overlaps {q:#x}");
        }
        self.figures.change(size, rounded(size), 1, &[0, 1, 2]);
        self.allocations += 1;
    }

    pub fn free(&mut self, p: u64) {
        let size = self.live.remove(&p).expect("freeing a live block");
        self.figures.change(size, rounded(size), -1, &[0, 1, 2]);
    }

    /// Exact figures, peaks included (one shard), and the allocations ever made.
    pub fn check(&self, s: &DeviceStats, what: &str) {
        self.figures.check(s, what);
        assert_eq!(s.allocation.all().allocated, self.allocations, "{what}");
    }
}

/// Allocates `size` bytes on `stream` and notes the block in `m`.
pub fn malloc(a: &DeviceAllocator, m: &mut LiveModel, size: u64, stream: ccalloc::StreamId) -> u64 {
    let p = a.malloc(size, stream).unwrap();
    m.alloc(p, size);
    p
}

/// Frees `p`, noted in `m` first.
pub fn free(a: &DeviceAllocator, m: &mut LiveModel, p: u64) {
    m.free(p);
    a.free(p).unwrap();
}

/// Driver calls that cost on a GPU.
pub fn driver_calls(c: &ccalloc::SimCounters) -> u64 {
    c.allocate_calls
        + c.release_calls
        + c.maps
        + c.unmaps
        + c.physical_creates
        + c.physical_releases
        + c.reserve_calls
        + c.synchronize_calls
        + c.event_waits
}
