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

/// One thread's churn on its own stream that never holds more than `cap` bytes: the
/// barrier tests' churn, whose threads then top up to a known level together, so that the
/// device's true peak is known. Sizes come in 512-byte steps (requested equals allocated).
pub struct CappedChurn {
    stream: ccalloc::StreamId,
    cap: u64,
    /// Past this many live blocks, each step may free more (a coin per block).
    keep: usize,
    live: Vec<(u64, u64)>,
    /// Bytes of the blocks in `live`.
    pub bytes: u64,
}

impl CappedChurn {
    pub fn new(stream: ccalloc::StreamId, cap: u64, keep: usize) -> Self {
        Self {
            stream,
            cap,
            keep,
            live: Vec::new(),
            bytes: 0,
        }
    }

    /// Allocates 512 B to `max_steps` x 512 B, freeing random blocks first until it fits
    /// under the cap (and while a coin says so past `keep` blocks); `next` draws.
    pub fn step(&mut self, a: &DeviceAllocator, max_steps: u64, next: &mut impl FnMut() -> u64) {
        let size = 512 * (1 + next() % max_steps);
        while self.bytes + size > self.cap
            || (self.live.len() > self.keep && next().is_multiple_of(2))
        {
            let i = (next() % self.live.len() as u64) as usize;
            let (p, s) = self.live.swap_remove(i);
            a.free(p).unwrap();
            self.bytes -= s;
        }
        self.live.push((a.malloc(size, self.stream).unwrap(), size));
        self.bytes += size;
    }

    /// Frees every block still held.
    pub fn free_all(self, a: &DeviceAllocator) {
        for (p, _) in self.live {
            a.free(p).unwrap();
        }
    }
}
