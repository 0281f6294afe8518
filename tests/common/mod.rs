//! Shared by the integration tests that include it (`mod common;`); each uses only part.
#![allow(dead_code)]

use ccalloc::driver::sim::SimDriver;
use ccalloc::driver::{DevicePtr, Driver, DriverResult, EventId};
use ccalloc::StreamId;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};

/// The driver call a `GatedDriver` holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// The next `allocate` (a growth, holding its shard's lock meanwhile).
    Allocate,
    /// The next `synchronize` of this device (a GPU still finishing its work).
    Synchronize(usize),
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
        self.sim.release(d, p, size)
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
