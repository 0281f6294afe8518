//! Shared by the integration tests that include it (`mod common;`); each uses only part.
#![allow(dead_code)]

pub mod figures;
pub mod heap;
pub mod live;
pub mod worker;

use ccalloc::SimDriver;
use ccalloc::StreamId;
use ccalloc::{DevicePtr, Driver, DriverResult, EventId, PhysHandle};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};

/// How long `within` waits before it calls a test deadlocked. A guard, not a time budget:
/// a deadlocked test never ends, so it only has to outlast the slowest host, where many
/// threads on 2 cores in a debug build can take minutes.
pub const DEADLOCK_GUARD: std::time::Duration = std::time::Duration::from_secs(900);

/// Runs `f` on a thread of its own and fails if it has not returned within
/// `DEADLOCK_GUARD` (a deadlock), or passes its panic on.
pub fn within<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let _ = tx.send(r);
    });
    match rx.recv_timeout(DEADLOCK_GUARD) {
        Ok(Ok(r)) => r,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("no result within {DEADLOCK_GUARD:?}: a deadlock?"),
    }
}

/// The driver call a `GatedDriver` holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// The next `allocate` (a growth, holding its shard's lock meanwhile).
    Allocate,
    /// The next `synchronize` of this device (a GPU still finishing its work).
    Synchronize(usize),
    /// The next `release`, after the memory is the device's again (the call still under
    /// way, its shard's lock held).
    AfterRelease,
}

/// The sim device (plain segments) with one driver call that, once armed, waits inside the
/// driver until the test opens the gate: a thread held there at a known point.
pub struct GatedDriver {
    pub sim: Arc<SimDriver>,
    gate: Gate,
    armed: AtomicBool,
    entered: AtomicBool,
    open: (Mutex<bool>, Condvar),
}

impl GatedDriver {
    pub fn new(sim: Arc<SimDriver>, gate: Gate) -> Arc<Self> {
        Arc::new(Self {
            sim,
            gate,
            armed: AtomicBool::new(false),
            entered: AtomicBool::new(false),
            open: Default::default(),
        })
    }

    /// The next call of the gated kind waits.
    pub fn arm(&self) {
        self.armed.store(true, SeqCst);
    }

    /// Returns once a call is held at the gate.
    pub fn wait_until_held(&self) {
        while !self.entered.load(SeqCst) {
            std::thread::yield_now();
        }
    }

    /// Lets the held call (and every later one) through.
    pub fn open(&self) {
        *self.open.0.lock().unwrap() = true;
        self.open.1.notify_all();
    }

    fn pass(&self, call: Gate) {
        if call == self.gate && self.armed.swap(false, SeqCst) {
            self.entered.store(true, SeqCst);
            let mut open = self.open.0.lock().unwrap();
            while !*open {
                open = self.open.1.wait(open).unwrap();
            }
        }
    }
}

impl Driver for GatedDriver {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn device_count(&self) -> usize {
        self.sim.device_count()
    }
    fn total_memory(&self, d: usize) -> DriverResult<u64> {
        self.sim.total_memory(d)
    }
    fn allocate(&self, d: usize, size: u64) -> DriverResult<DevicePtr> {
        self.pass(Gate::Allocate);
        self.sim.allocate(d, size)
    }
    fn release(&self, d: usize, p: DevicePtr, size: u64) -> DriverResult<()> {
        let released = self.sim.release(d, p, size);
        self.pass(Gate::AfterRelease);
        released
    }
    fn record_event(&self, d: usize, s: StreamId) -> DriverResult<EventId> {
        self.sim.record_event(d, s)
    }
    fn event_done(&self, d: usize, e: EventId) -> DriverResult<bool> {
        self.sim.event_done(d, e)
    }
    fn wait_event(&self, d: usize, e: EventId) -> DriverResult<()> {
        self.sim.wait_event(d, e)
    }
    fn destroy_event(&self, d: usize, e: EventId) {
        self.sim.destroy_event(d, e)
    }
    fn synchronize(&self, d: usize) -> DriverResult<()> {
        self.pass(Gate::Synchronize(d));
        self.sim.synchronize(d)
    }
    fn synchronize_stream(&self, d: usize, s: StreamId) -> DriverResult<()> {
        self.sim.synchronize_stream(d, s)
    }
}

/// The driver calls a `FaultDriver` counts and may fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    Allocate,
    Release,
    ReserveAddress,
    FreeAddress,
    CreatePhysical,
    ReleasePhysical,
    Map,
    SetAccess,
    Unmap,
    RecordEvent,
    EventDone,
    WaitEvent,
    Synchronize,
    SynchronizeStream,
}

pub const CALLS: [Call; 14] = [
    Call::Allocate,
    Call::Release,
    Call::ReserveAddress,
    Call::FreeAddress,
    Call::CreatePhysical,
    Call::ReleasePhysical,
    Call::Map,
    Call::SetAccess,
    Call::Unmap,
    Call::RecordEvent,
    Call::EventDone,
    Call::WaitEvent,
    Call::Synchronize,
    Call::SynchronizeStream,
];

/// The sim device, counting each kind of driver call and failing chosen ones: the n-th
/// call of a kind (1-based), each fault once.
pub struct FaultDriver {
    pub sim: Arc<SimDriver>,
    counts: [std::sync::atomic::AtomicU64; 14],
    faults: Mutex<Vec<(Call, u64)>>,
    hits: Mutex<Vec<(Call, u64)>>,
}

impl FaultDriver {
    pub fn new(sim: Arc<SimDriver>, faults: &[(Call, u64)]) -> Arc<Self> {
        Arc::new(Self {
            sim,
            counts: Default::default(),
            faults: Mutex::new(faults.to_vec()),
            hits: Mutex::new(Vec::new()),
        })
    }

    /// Calls of `kind` made so far.
    pub fn count(&self, kind: Call) -> u64 {
        self.counts[kind as usize].load(SeqCst)
    }

    /// The faults injected so far.
    pub fn hits(&self) -> Vec<(Call, u64)> {
        self.hits.lock().unwrap().clone()
    }

    fn enter(&self, kind: Call, name: &'static str) -> DriverResult<()> {
        let n = self.counts[kind as usize].fetch_add(1, SeqCst) + 1;
        let mut faults = self.faults.lock().unwrap();
        if let Some(i) = faults.iter().position(|&f| f == (kind, n)) {
            faults.remove(i);
            self.hits.lock().unwrap().push((kind, n));
            return Err(ccalloc::DriverError::Failed {
                call: name,
                detail: format!("injected failure of call {n}"),
            });
        }
        Ok(())
    }
}

impl Driver for FaultDriver {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn device_count(&self) -> usize {
        self.sim.device_count()
    }
    fn total_memory(&self, d: usize) -> DriverResult<u64> {
        self.sim.total_memory(d)
    }
    fn allocate(&self, d: usize, size: u64) -> DriverResult<DevicePtr> {
        self.enter(Call::Allocate, "allocate")?;
        self.sim.allocate(d, size)
    }
    fn release(&self, d: usize, p: DevicePtr, size: u64) -> DriverResult<()> {
        self.enter(Call::Release, "release")?;
        self.sim.release(d, p, size)
    }
    fn record_event(&self, d: usize, s: StreamId) -> DriverResult<EventId> {
        self.enter(Call::RecordEvent, "record_event")?;
        self.sim.record_event(d, s)
    }
    fn event_done(&self, d: usize, e: EventId) -> DriverResult<bool> {
        self.enter(Call::EventDone, "event_done")?;
        self.sim.event_done(d, e)
    }
    fn wait_event(&self, d: usize, e: EventId) -> DriverResult<()> {
        self.enter(Call::WaitEvent, "wait_event")?;
        self.sim.wait_event(d, e)
    }
    fn destroy_event(&self, d: usize, e: EventId) {
        self.sim.destroy_event(d, e)
    }
    fn synchronize(&self, d: usize) -> DriverResult<()> {
        self.enter(Call::Synchronize, "synchronize")?;
        self.sim.synchronize(d)
    }
    fn synchronize_stream(&self, d: usize, s: StreamId) -> DriverResult<()> {
        self.enter(Call::SynchronizeStream, "synchronize_stream")?;
        self.sim.synchronize_stream(d, s)
    }
    fn vmm_granularity(&self, d: usize) -> Option<u64> {
        self.sim.vmm_granularity(d)
    }
    fn reserve_address(&self, d: usize, size: u64) -> DriverResult<DevicePtr> {
        self.enter(Call::ReserveAddress, "reserve_address")?;
        self.sim.reserve_address(d, size)
    }
    fn free_address(&self, d: usize, p: DevicePtr, size: u64) -> DriverResult<()> {
        self.enter(Call::FreeAddress, "free_address")?;
        self.sim.free_address(d, p, size)
    }
    fn create_physical(&self, d: usize, size: u64) -> DriverResult<PhysHandle> {
        self.enter(Call::CreatePhysical, "create_physical")?;
        self.sim.create_physical(d, size)
    }
    fn release_physical(&self, d: usize, h: PhysHandle, size: u64) -> DriverResult<()> {
        self.enter(Call::ReleasePhysical, "release_physical")?;
        self.sim.release_physical(d, h, size)
    }
    fn map(&self, d: usize, va: DevicePtr, size: u64, h: PhysHandle) -> DriverResult<()> {
        self.enter(Call::Map, "map")?;
        self.sim.map(d, va, size, h)
    }
    fn set_access(&self, d: usize, va: DevicePtr, size: u64) -> DriverResult<()> {
        self.enter(Call::SetAccess, "set_access")?;
        self.sim.set_access(d, va, size)
    }
    fn unmap(&self, d: usize, va: DevicePtr, size: u64) -> DriverResult<()> {
        self.enter(Call::Unmap, "unmap")?;
        self.sim.unmap(d, va, size)
    }
}

/// A runtime (every device's allocator, pinned and managed host memory) on a sim of
/// `devices` devices of 8 GiB each.
pub fn sim_runtime(devices: usize) -> (Arc<SimDriver>, ccalloc::Runtime) {
    let sim = Arc::new(SimDriver::new(devices, 8 << 30));
    let rt = ccalloc::Runtime::with_sim(sim.clone(), ccalloc::Config::default());
    (sim, rt)
}

/// The layout of private pool `pool`'s blocks, as PyTorch's graph trees save it
/// (`getCheckpointState`), for `DeviceAllocator::restore_pool`.
pub fn pool_layout(a: &ccalloc::DeviceAllocator, pool: (u64, u64)) -> Vec<ccalloc::SavedBlock> {
    a.segments()
        .unwrap()
        .into_iter()
        .filter(|s| s.private_pool == Some(pool))
        .flat_map(|s| s.blocks)
        .map(|(addr, size, state)| ccalloc::SavedBlock {
            addr,
            size,
            allocated: state == ccalloc::BlockState::Allocated,
        })
        .collect()
}

/// A xorshift64 generator from `seed` (non-zero): reproducible random tests.
pub fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

/// A device allocator on a one-device sim of `capacity` bytes, with the settings `conf`.
pub fn sim_allocator(capacity: u64, conf: &str) -> (Arc<SimDriver>, Arc<ccalloc::DeviceAllocator>) {
    let sim = Arc::new(SimDriver::new(1, capacity));
    let mut config = ccalloc::Config::default();
    config.apply(conf).unwrap();
    let a = ccalloc::DeviceAllocator::new(0, sim.clone(), config).unwrap();
    (sim, Arc::new(a))
}

/// Runs `f` on a thread of its own (new to every device) and returns its result.
pub fn on_new_thread<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    std::thread::spawn(f).join().unwrap()
}
