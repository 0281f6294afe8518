//! A simulated device: real host memory behind every segment (so tests can write canaries and
//! catch overlapping blocks), a capacity and allocation granularity, and streams whose
//! completion tests control (a paused stream leaves its events pending until resumed or waited on).
//!
//! A poisoned lock: the `Driver` calls fail as every lock in ccalloc does (`super::lock`,
//! the policy in `crate::sync`). The test controls (`counters`, `set_stream_paused`, ...)
//! have no error channel and panic instead: only tests call them, and a test whose device
//! state a panic poisoned has failed already.

use super::{
    Advice, DevicePtr, Driver, DriverError, DriverResult, EventId, HostKind, Location, PhysHandle,
    StreamId,
};
use dashmap::DashMap;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A simulated device's state for a `Driver` call (`call` names it in the error).
fn held<'a, T>(state: &'a Mutex<T>, call: &'static str) -> DriverResult<MutexGuard<'a, T>> {
    super::lock(state, call, "the simulated device's state")
}

/// A simulated device's state for a test control.
fn control<T>(state: &Mutex<T>) -> MutexGuard<'_, T> {
    state
        .lock()
        .expect("the simulated device's state: poisoned by a panic in an earlier call")
}

/// cudaMalloc hands out whole 2 MiB pages; capacity is charged the same way here.
pub(crate) const SIM_GRANULARITY: u64 = 2 << 20;
pub(crate) const DEFAULT_CAPACITY: u64 = 80 << 30;
/// Host memory of the simulated machine (`CCALLOC_SIM_HOST_CAPACITY`).
pub(crate) const DEFAULT_HOST_CAPACITY: u64 = 64 << 30;
/// Host allocations are charged in whole pages.
pub(crate) const SIM_HOST_PAGE: u64 = 4 << 10;
/// Managed memory migrates in pages of this size (as CUDA's prefetches do, at least).
pub(crate) const SIM_MIGRATION_PAGE: u64 = 64 << 10;

/// Pinned host and managed memory of the simulated machine, as counted by the sim.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimHostCounters {
    pub pinned_bytes: u64,
    pub peak_pinned_bytes: u64,
    pub live_pinned: u64,
    pub pinned_allocate_calls: u64,
    pub pinned_release_calls: u64,
    pub managed_bytes: u64,
    pub peak_managed_bytes: u64,
    pub live_managed: u64,
    pub managed_allocate_calls: u64,
    pub managed_release_calls: u64,
    /// Host allocations refused for want of memory.
    pub failed_allocations: u64,
    /// Prefetch calls by destination (-1: the host).
    pub prefetches: BTreeMap<i64, u64>,
    /// Bytes prefetches moved, by destination: pages already there move nothing. Managed
    /// memory starts on the host.
    pub migrated_bytes: BTreeMap<i64, u64>,
    /// Advice calls by CUDA's advice value.
    pub advice: BTreeMap<u32, u64>,
}

#[derive(Default)]
struct SimHost {
    /// Live host allocations: address → (kind, charged size).
    mappings: HashMap<DevicePtr, (HostKind, u64)>,
    /// Where each managed page is, by page number, when not on the host.
    away: HashMap<u64, Location>,
    counters: SimHostCounters,
}

fn location_index(location: Location) -> i64 {
    match location {
        Location::Host => -1,
        Location::Device(d) => d as i64,
    }
}

/// Counters a test or the replay tool reads back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimCounters {
    pub bytes_in_use: u64,
    pub peak_bytes_in_use: u64,
    pub live_allocations: u64,
    pub allocate_calls: u64,
    pub release_calls: u64,
    pub failed_allocations: u64,
    pub synchronize_calls: u64,
    pub stream_synchronize_calls: u64,
    /// `wait_event` calls: the host blocked on one event.
    pub event_waits: u64,
    /// Virtual memory management calls.
    pub reserve_calls: u64,
    pub live_reservations: u64,
    pub physical_creates: u64,
    pub physical_releases: u64,
    /// Calls of `map` and `unmap` (the driver's cost is per call), and the granules they
    /// covered.
    pub maps: u64,
    pub unmaps: u64,
    pub granules_mapped: u64,
    pub granules_unmapped: u64,
    /// Calls on a stream after `destroy_stream` (each one refused): the allocator must make
    /// none, since a destroyed CUDA stream's handle may be reused or fault.
    pub destroyed_stream_calls: u64,
}

#[derive(Default)]
struct StreamState {
    paused: bool,
    /// `destroy_stream` was called: later calls on it fail, as on a destroyed CUDA stream.
    destroyed: bool,
    /// Sequence number of the last piece of work queued (one per recorded event).
    queued: u64,
    /// Work up to this sequence number has finished.
    finished: u64,
}

#[derive(Default)]
struct SimMemory {
    /// Host mappings standing in for device segments: address → charged size.
    mappings: HashMap<DevicePtr, u64>,
    /// Reserved address ranges (virtual memory management): start → size.
    reservations: HashMap<DevicePtr, u64>,
    /// Physical allocations: runs of granule slots in the device's memory file. A handle is
    /// the first slot of its run; freed runs (first slot → slots) are reused first fit.
    physical: Option<host::PhysicalFile>,
    free_runs: BTreeMap<u64, u64>,
    next_slot: u64,
    /// Live handles: (slots, the address the handle is mapped at, if any).
    live_slots: HashMap<u64, (u64, Option<DevicePtr>)>,
    /// Mapped granules: address → the address where their mapping starts.
    mapped: HashMap<DevicePtr, DevicePtr>,
    /// Mappings: start address → (handle, size).
    vmm_maps: HashMap<DevicePtr, (u64, u64)>,
    /// Granule address → (stream, its queue position) of work that used it, as tests report
    /// with `note_use`; unmapping before such work has finished is refused.
    uses: HashMap<DevicePtr, Vec<(StreamId, u64)>>,
    counters: SimCounters,
}

struct SimDeviceState {
    capacity: u64,
    memory: Mutex<SimMemory>,
    streams: Mutex<HashMap<StreamId, StreamState>>,
}

impl SimDeviceState {
    /// Counts and refuses a call on a destroyed stream.
    fn destroyed_stream_call(&self, call: &'static str, stream: StreamId) -> DriverError {
        if let Ok(mut memory) = self.memory.lock() {
            memory.counters.destroyed_stream_calls += 1;
        }
        sim_error(call, format!("stream {:#x} was destroyed", stream.0))
    }
}

fn sim_error(call: &'static str, detail: impl Into<String>) -> DriverError {
    DriverError::Failed {
        call,
        detail: detail.into(),
    }
}

/// `CCALLOC_SIM_VMM`: whether the simulated device has virtual memory management. Anything
/// but the words below is refused: a typo must not quietly give the paged device.
fn vmm_setting(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "" | "1" | "true" | "on" => Ok(true),
        "0" | "false" | "off" => Ok(false),
        _ => Err(format!(
            "CCALLOC_SIM_VMM={text:?} is not 1/true/on (virtual memory management, the default) \
             or 0/false/off (plain segments only)"
        )),
    }
}

/// Host address space to back `size` bytes of simulated memory, whose own limits the caller
/// has checked: a failure here is the host's (the process's address-space limit, `ulimit -v`,
/// or its count of mappings), not the simulated memory running out, so it is a driver error
/// naming the host rather than `OutOfMemory` (which would tell the allocator to free its cache
/// and the user that the device is full).
fn host_backing(call: &'static str, size: u64) -> DriverResult<u64> {
    host::map(size).ok_or_else(|| {
        // Read at once: nothing between the failed mmap and here touches errno.
        let why = std::io::Error::last_os_error();
        sim_error(
            call,
            format!(
                "the host could not map {} of address space to back simulated memory ({why}); \
                 the simulated memory has room: raise the process's address-space limit \
                 (ulimit -v) or simulate less",
                crate::error::human_bytes(size)
            ),
        )
    })
}

struct SimEvent {
    device: usize,
    stream: StreamId,
    sequence: u64,
}

/// What each driver call costs the host (`SimDriver::with_call_costs`); the range calls
/// (`set_access`, `unmap`) cost this per mapping in the range.
#[derive(Clone, Copy, Debug, Default)]
pub struct CallCosts {
    pub allocate: Duration,
    pub release: Duration,
    pub create_physical: Duration,
    pub release_physical: Duration,
    pub map: Duration,
    pub set_access: Duration,
    pub unmap: Duration,
    pub record_event: Duration,
    pub event_query: Duration,
}

impl CallCosts {
    /// Typical of an H100 (measured by `benches/gpu/vmm_cost.cu`; figures in docs/benchmarks.md):
    /// tens of µs per virtual-memory call (per mapping for access grants and unmaps) whatever
    /// the size, about a µs per event call.
    pub fn h100() -> Self {
        let us = Duration::from_micros;
        Self {
            allocate: us(30),
            release: us(30),
            create_physical: us(25),
            release_physical: us(25),
            map: us(2),
            set_access: us(45),
            unmap: us(22),
            record_event: Duration::from_nanos(800),
            event_query: Duration::from_nanos(900),
        }
    }
}

pub struct SimDriver {
    devices: Vec<SimDeviceState>,
    events: DashMap<u64, SimEvent>,
    next_event: AtomicU64,
    /// Whether the virtual memory management calls are offered (to test the fallback).
    vmm: bool,
    /// A stream's event completes only once this many later events were recorded there:
    /// a device running behind the host, as a busy GPU does.
    event_lag: u64,
    /// Host time each driver call takes, as on a GPU (`with_call_costs`); none by default.
    costs: Option<CallCosts>,
    /// Nanoseconds charged so far under `costs` (`spent`).
    spent_ns: AtomicU64,
    /// Host memory, and how much of it may be pinned.
    host_capacity: u64,
    pinned_limit: u64,
    host: Mutex<SimHost>,
}

impl SimDriver {
    pub fn new(device_count: usize, capacity: u64) -> Self {
        let devices = (0..device_count.max(1))
            .map(|_| SimDeviceState {
                capacity,
                memory: Mutex::new(SimMemory::default()),
                streams: Mutex::new(HashMap::new()),
            })
            .collect();
        Self {
            devices,
            events: DashMap::new(),
            next_event: AtomicU64::new(1),
            vmm: true,
            event_lag: 0,
            costs: None,
            spent_ns: AtomicU64::new(0),
            host_capacity: DEFAULT_HOST_CAPACITY,
            pinned_limit: DEFAULT_HOST_CAPACITY,
            host: Mutex::new(SimHost::default()),
        }
    }

    /// The machine's host memory, and the most of it that may be pinned (at most all).
    pub fn with_host_memory(mut self, capacity: u64, pinned_limit: u64) -> Self {
        self.host_capacity = capacity;
        self.pinned_limit = pinned_limit.min(capacity);
        self
    }

    pub fn host_counters(&self) -> SimHostCounters {
        control(&self.host).counters.clone()
    }

    /// Where the managed page holding `ptr` is now.
    pub fn residence(&self, ptr: DevicePtr) -> Location {
        let host = control(&self.host);
        host.away
            .get(&(ptr / SIM_MIGRATION_PAGE))
            .copied()
            .unwrap_or(Location::Host)
    }

    /// Whether one live managed allocation holds all of `[ptr, ptr+size)`.
    fn managed_range_ok(host: &SimHost, ptr: DevicePtr, size: u64) -> bool {
        let end = ptr.saturating_add(size);
        host.mappings.iter().any(|(&start, &(kind, len))| {
            kind == HostKind::Managed && ptr >= start && end <= start + len
        })
    }

    fn check_location(&self, call: &'static str, location: Location) -> DriverResult<()> {
        match location {
            Location::Device(d) if d >= self.devices.len() => {
                Err(sim_error(call, format!("no simulated device {d}")))
            }
            _ => Ok(()),
        }
    }

    /// Turns the virtual memory management calls off, like a driver without them.
    pub fn without_vmm(mut self) -> Self {
        self.vmm = false;
        self
    }

    /// For tests: work queued on `stream` until now uses `[va, va+len)`. Unmapping any of
    /// those granules fails until that work has finished (the stream has moved past it):
    /// the check that the allocator never unmaps pages the device may still be using.
    pub fn note_use(&self, device: usize, va: DevicePtr, len: u64, stream: StreamId) {
        let Ok(d) = self.device(device) else { return };
        let queued = control(&d.streams).entry(stream).or_default().queued;
        let mut memory = control(&d.memory);
        for g in granules(va, va + len.max(1)) {
            // A stream finishes its work in order: its latest use of a granule covers the
            // earlier ones, so each granule keeps one per stream.
            let uses = memory.uses.entry(g).or_default();
            match uses.iter_mut().find(|(s, _)| *s == stream) {
                Some((_, at)) => *at = (*at).max(queued),
                None => uses.push((stream, queued)),
            }
        }
    }

    /// Events complete only `lag` recorded events later on their stream (or when waited on,
    /// or at a synchronize): models a GPU that runs behind the host.
    pub fn with_event_lag(mut self, lag: u64) -> Self {
        self.event_lag = lag;
        self
    }

    /// Each driver call takes the host as long as it would on a GPU (spinning), and the
    /// allocator times page moves as it does on one (`Driver::times_page_moves`): the
    /// page-move budget can then be studied without a GPU. Replays stay unaffected: they
    /// never ask for this.
    pub fn with_call_costs(mut self, costs: CallCosts) -> Self {
        self.costs = Some(costs);
        self
    }

    /// Host time charged for driver calls so far (`with_call_costs`; zero without).
    pub fn spent(&self) -> Duration {
        Duration::from_nanos(self.spent_ns.load(Ordering::Relaxed))
    }

    fn spend(&self, cost: impl Fn(&CallCosts) -> Duration) {
        if let Some(costs) = &self.costs {
            let cost = cost(costs);
            self.spent_ns
                .fetch_add(cost.as_nanos() as u64, Ordering::Relaxed);
            let until = Instant::now() + cost;
            while Instant::now() < until {
                std::hint::spin_loop();
            }
        }
    }

    /// Reads `CCALLOC_SIM_CAPACITY` (e.g. `80GiB`), `CCALLOC_SIM_DEVICES` (default 1),
    /// `CCALLOC_SIM_COSTS` (`h100`: driver calls take as long as on one, `with_call_costs`),
    /// and the host's memory: `CCALLOC_SIM_HOST_CAPACITY` (default 64GiB) and
    /// `CCALLOC_SIM_PINNED_LIMIT` (how much of it may be pinned; default all), and
    /// `CCALLOC_SIM_VMM` (`0`/`false`/`off`: no virtual memory management; see `vmm_setting`).
    pub fn from_env() -> Result<Self, String> {
        let capacity = match std::env::var("CCALLOC_SIM_CAPACITY") {
            Ok(text) => crate::error::parse_bytes(&text)
                .filter(|&b| b > 0)
                .ok_or_else(|| {
                    format!("CCALLOC_SIM_CAPACITY={text:?} is not a size such as 80GiB")
                })?,
            Err(_) => DEFAULT_CAPACITY,
        };
        let devices = match std::env::var("CCALLOC_SIM_DEVICES") {
            Ok(text) => text
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| (1..=64).contains(&n))
                .ok_or_else(|| {
                    format!("CCALLOC_SIM_DEVICES={text:?} is not a count from 1 to 64")
                })?,
            Err(_) => 1,
        };
        let host_size = |name: &str, default: u64| match std::env::var(name) {
            Ok(text) => crate::error::parse_bytes(&text)
                .filter(|&b| b > 0)
                .ok_or_else(|| format!("{name}={text:?} is not a size such as 64GiB")),
            Err(_) => Ok(default),
        };
        let host_capacity = host_size("CCALLOC_SIM_HOST_CAPACITY", DEFAULT_HOST_CAPACITY)?;
        let pinned_limit = host_size("CCALLOC_SIM_PINNED_LIMIT", host_capacity)?;
        let mut sim = Self::new(devices, capacity).with_host_memory(host_capacity, pinned_limit);
        match std::env::var("CCALLOC_SIM_COSTS").as_deref() {
            Ok("h100") => sim = sim.with_call_costs(CallCosts::h100()),
            Ok("") | Err(_) => {}
            Ok(other) => return Err(format!("CCALLOC_SIM_COSTS={other:?}: only h100 is known")),
        }
        let vmm = match std::env::var("CCALLOC_SIM_VMM") {
            Ok(text) => vmm_setting(&text)?,
            Err(_) => true,
        };
        Ok(if vmm { sim } else { sim.without_vmm() })
    }

    fn device(&self, device: usize) -> DriverResult<&SimDeviceState> {
        self.devices.get(device).ok_or_else(|| DriverError::Failed {
            call: "sim",
            detail: format!("no simulated device {device}"),
        })
    }

    /// Events recorded and not yet destroyed, on every device: what a caller that forgets
    /// `destroy_event` leaks.
    pub fn live_events(&self) -> usize {
        self.events.len()
    }

    /// Events recorded so far, on every device (`record_event` calls that succeeded).
    pub fn events_recorded(&self) -> u64 {
        self.next_event.load(Ordering::Relaxed)
    }

    pub fn counters(&self, device: usize) -> SimCounters {
        self.devices
            .get(device)
            .map(|d| control(&d.memory).counters)
            .unwrap_or_default()
    }

    /// For tests: the caller destroys `stream` (as `cudaStreamDestroy`), after finishing its
    /// work. Later calls on it are refused and counted (`destroyed_stream_calls`).
    pub fn destroy_stream(&self, device: usize, stream: StreamId) {
        let Ok(d) = self.device(device) else { return };
        let mut streams = control(&d.streams);
        let state = streams.entry(stream).or_default();
        state.finished = state.queued;
        state.destroyed = true;
    }

    /// A paused stream's events stay pending until it is resumed (or someone waits on them).
    pub fn set_stream_paused(&self, device: usize, stream: StreamId, paused: bool) {
        if let Some(d) = self.devices.get(device) {
            let mut streams = control(&d.streams);
            let state = streams.entry(stream).or_default();
            state.paused = paused;
            if !paused {
                state.finished = state.queued;
            }
        }
    }

    /// Whether `[ptr, ptr+len)` lies inside one live simulated segment of `device`.
    pub fn contains(&self, device: usize, ptr: DevicePtr, len: u64) -> bool {
        let Some(d) = self.devices.get(device) else {
            return false;
        };
        let memory = control(&d.memory);
        let end = ptr.saturating_add(len);
        let in_segment = memory
            .mappings
            .iter()
            .any(|(&start, &size)| ptr >= start && end <= start + size);
        // Or every granule it spans is mapped.
        let in_pages = len > 0 && granules(ptr, end).all(|va| memory.mapped.contains_key(&va));
        in_segment || in_pages
    }
}

/// The (2 MiB-aligned) addresses of the granules that `[start, end)` touches.
fn granules(start: DevicePtr, end: DevicePtr) -> impl Iterator<Item = DevicePtr> + Clone {
    (start / SIM_GRANULARITY * SIM_GRANULARITY..end).step_by(SIM_GRANULARITY as usize)
}

/// How many mappings (`map` calls) cover some of `va..va + size`: the driver's
/// virtual-memory calls on a range cost per mapping.
fn mappings_in(memory: &SimMemory, va: DevicePtr, size: u64) -> u32 {
    // Granules in address order: a mapping's granules come together.
    let mut last = None;
    granules(va, va + size)
        .filter_map(|g| memory.mapped.get(&g))
        .filter(|&&start| last.replace(start) != Some(start))
        .count() as u32
}

/// Refuses to give up granule `va` while work that `note_use` reported on it is unfinished.
fn check_unused(
    streams: &HashMap<StreamId, StreamState>,
    memory: &SimMemory,
    va: DevicePtr,
    call: &'static str,
) -> DriverResult<()> {
    for &(stream, queued) in memory.uses.get(&va).into_iter().flatten() {
        if streams.get(&stream).map_or(0, |s| s.finished) < queued {
            return Err(sim_error(
                call,
                format!("{va:#x} is still in use by work queued on stream {stream:?}"),
            ));
        }
    }
    Ok(())
}

fn round_up(value: u64, to: u64) -> u64 {
    value.div_ceil(to) * to
}

impl Driver for SimDriver {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn total_memory(&self, device: usize) -> DriverResult<u64> {
        Ok(self.device(device)?.capacity)
    }

    fn allocate(&self, device: usize, size: u64) -> DriverResult<DevicePtr> {
        self.spend(|c| c.allocate);
        let d = self.device(device)?;
        let charged = round_up(size.max(1), SIM_GRANULARITY);
        let mut memory = held(&d.memory, "allocate")?;
        if memory.counters.bytes_in_use + charged > d.capacity {
            memory.counters.failed_allocations += 1;
            return Err(DriverError::OutOfMemory);
        }
        let ptr = host_backing("sim allocate", charged)?;
        memory.mappings.insert(ptr, charged);
        let c = &mut memory.counters;
        c.bytes_in_use += charged;
        c.peak_bytes_in_use = c.peak_bytes_in_use.max(c.bytes_in_use);
        c.live_allocations += 1;
        c.allocate_calls += 1;
        Ok(ptr)
    }

    fn release(&self, device: usize, ptr: DevicePtr, _size: u64) -> DriverResult<()> {
        self.spend(|c| c.release);
        let d = self.device(device)?;
        let streams = held(&d.streams, "release")?;
        let mut memory = held(&d.memory, "release")?;
        let Some(&charged) = memory.mappings.get(&ptr) else {
            return Err(DriverError::Failed {
                call: "sim release",
                detail: format!("{ptr:#x} is not a live simulated allocation"),
            });
        };
        for g in granules(ptr, ptr + charged) {
            check_unused(&streams, &memory, g, "release")?;
        }
        drop(streams);
        for g in granules(ptr, ptr + charged) {
            memory.uses.remove(&g);
        }
        memory.mappings.remove(&ptr);
        host::unmap(ptr, charged);
        let c = &mut memory.counters;
        c.bytes_in_use -= charged;
        c.live_allocations -= 1;
        c.release_calls += 1;
        Ok(())
    }

    fn record_event(&self, device: usize, stream: StreamId) -> DriverResult<EventId> {
        self.spend(|c| c.record_event);
        let d = self.device(device)?;
        let mut streams = held(&d.streams, "record_event")?;
        let state = streams.entry(stream).or_default();
        if state.destroyed {
            drop(streams);
            return Err(d.destroyed_stream_call("record_event", stream));
        }
        state.queued += 1;
        if !state.paused {
            state.finished = state
                .finished
                .max(state.queued.saturating_sub(self.event_lag));
        }
        let id = self.next_event.fetch_add(1, Ordering::Relaxed);
        self.events.insert(
            id,
            SimEvent {
                device,
                stream,
                sequence: state.queued,
            },
        );
        Ok(EventId(id))
    }

    fn event_done(&self, device: usize, event: EventId) -> DriverResult<bool> {
        self.spend(|c| c.event_query);
        let d = self.device(device)?;
        let (stream, sequence) = match self.events.get(&event.0) {
            Some(e) if e.device == device => (e.stream, e.sequence),
            _ => {
                return Err(DriverError::Failed {
                    call: "sim event query",
                    detail: format!("unknown event {}", event.0),
                })
            }
        };
        let streams = held(&d.streams, "event_done")?;
        Ok(streams.get(&stream).is_some_and(|s| s.finished >= sequence))
    }

    fn wait_event(&self, device: usize, event: EventId) -> DriverResult<()> {
        // Waiting means the device runs the stream's work up to the event, paused or not.
        let d = self.device(device)?;
        let Some((stream, sequence)) = self.events.get(&event.0).map(|e| (e.stream, e.sequence))
        else {
            return Err(DriverError::Failed {
                call: "sim event wait",
                detail: format!("unknown event {}", event.0),
            });
        };
        let mut streams = held(&d.streams, "wait_event")?;
        let state = streams.entry(stream).or_default();
        state.finished = state.finished.max(sequence);
        held(&d.memory, "wait_event")?.counters.event_waits += 1;
        Ok(())
    }

    fn destroy_event(&self, _device: usize, event: EventId) {
        self.events.remove(&event.0);
    }

    fn synchronize(&self, device: usize) -> DriverResult<()> {
        let d = self.device(device)?;
        for state in held(&d.streams, "synchronize")?.values_mut() {
            state.finished = state.queued;
        }
        held(&d.memory, "synchronize")?.counters.synchronize_calls += 1;
        Ok(())
    }

    fn synchronize_stream(&self, device: usize, stream: StreamId) -> DriverResult<()> {
        let d = self.device(device)?;
        let mut streams = held(&d.streams, "synchronize_stream")?;
        let state = streams.entry(stream).or_default();
        if state.destroyed {
            drop(streams);
            return Err(d.destroyed_stream_call("synchronize_stream", stream));
        }
        state.finished = state.queued;
        held(&d.memory, "synchronize_stream")?
            .counters
            .stream_synchronize_calls += 1;
        Ok(())
    }

    fn times_page_moves(&self) -> bool {
        self.costs.is_some()
    }

    fn min_free_fence_interval(&self) -> Duration {
        // As the CUDA driver's, once calls cost what they do on a GPU.
        match self.costs {
            Some(_) => Duration::from_millis(1),
            None => Duration::ZERO,
        }
    }

    fn host_memory(&self, kind: HostKind) -> DriverResult<u64> {
        Ok(match kind {
            HostKind::Pinned => self.pinned_limit,
            // Managed memory may oversubscribe a device: it spills to the host.
            HostKind::Managed => {
                self.host_capacity + self.devices.iter().map(|d| d.capacity).sum::<u64>()
            }
        })
    }

    fn host_allocate(&self, kind: HostKind, size: u64) -> DriverResult<DevicePtr> {
        let charged = round_up(size.max(1), SIM_HOST_PAGE);
        let limit = self.host_memory(kind)?;
        let mut host = held(&self.host, "host_allocate")?;
        let c = &mut host.counters;
        // Pinned memory cannot be paged out: what is pinned is gone for managed memory.
        let (used, limit) = match kind {
            HostKind::Pinned => (c.pinned_bytes, limit),
            HostKind::Managed => (c.managed_bytes, limit.saturating_sub(c.pinned_bytes)),
        };
        if used + charged > limit {
            c.failed_allocations += 1;
            return Err(DriverError::OutOfMemory);
        }
        let ptr = host_backing("sim host_allocate", charged)?;
        host.mappings.insert(ptr, (kind, charged));
        let c = &mut host.counters;
        match kind {
            HostKind::Pinned => {
                c.pinned_bytes += charged;
                c.peak_pinned_bytes = c.peak_pinned_bytes.max(c.pinned_bytes);
                c.live_pinned += 1;
                c.pinned_allocate_calls += 1;
            }
            HostKind::Managed => {
                c.managed_bytes += charged;
                c.peak_managed_bytes = c.peak_managed_bytes.max(c.managed_bytes);
                c.live_managed += 1;
                c.managed_allocate_calls += 1;
            }
        }
        Ok(ptr)
    }

    fn host_release(&self, kind: HostKind, ptr: DevicePtr, _size: u64) -> DriverResult<()> {
        let mut host = held(&self.host, "host_release")?;
        let charged = match host.mappings.get(&ptr) {
            Some(&(k, charged)) if k == kind => charged,
            _ => {
                return Err(sim_error(
                    "sim host release",
                    format!("{ptr:#x} is not a live simulated {kind:?} allocation"),
                ))
            }
        };
        host.mappings.remove(&ptr);
        for page in ptr / SIM_MIGRATION_PAGE..(ptr + charged).div_ceil(SIM_MIGRATION_PAGE) {
            host.away.remove(&page);
        }
        host::unmap(ptr, charged);
        let c = &mut host.counters;
        match kind {
            HostKind::Pinned => {
                c.pinned_bytes -= charged;
                c.live_pinned -= 1;
                c.pinned_release_calls += 1;
            }
            HostKind::Managed => {
                c.managed_bytes -= charged;
                c.live_managed -= 1;
                c.managed_release_calls += 1;
            }
        }
        Ok(())
    }

    fn prefetch(
        &self,
        ptr: DevicePtr,
        size: u64,
        to: Location,
        stream_device: usize,
        stream: StreamId,
    ) -> DriverResult<()> {
        self.check_location("prefetch", to)?;
        let d = self.device(stream_device)?;
        if d.streams
            .lock()
            .unwrap()
            .get(&stream)
            .is_some_and(|s| s.destroyed)
        {
            return Err(d.destroyed_stream_call("prefetch", stream));
        }
        let mut host = held(&self.host, "prefetch")?;
        if size == 0 || !Self::managed_range_ok(&host, ptr, size) {
            return Err(sim_error(
                "prefetch",
                format!("{ptr:#x}+{size} is not inside one managed allocation"),
            ));
        }
        let mut moved = 0;
        for page in ptr / SIM_MIGRATION_PAGE..(ptr + size).div_ceil(SIM_MIGRATION_PAGE) {
            let now = host.away.get(&page).copied().unwrap_or(Location::Host);
            if now != to {
                moved += SIM_MIGRATION_PAGE;
                match to {
                    Location::Host => host.away.remove(&page),
                    Location::Device(_) => host.away.insert(page, to),
                };
            }
        }
        let c = &mut host.counters;
        *c.prefetches.entry(location_index(to)).or_default() += 1;
        *c.migrated_bytes.entry(location_index(to)).or_default() += moved;
        Ok(())
    }

    fn advise(
        &self,
        ptr: DevicePtr,
        size: u64,
        advice: Advice,
        location: Location,
    ) -> DriverResult<()> {
        self.check_location("advise", location)?;
        let mut host = held(&self.host, "advise")?;
        if size == 0 || !Self::managed_range_ok(&host, ptr, size) {
            return Err(sim_error(
                "advise",
                format!("{ptr:#x}+{size} is not inside one managed allocation"),
            ));
        }
        *host.counters.advice.entry(advice as u32).or_default() += 1;
        Ok(())
    }

    fn vmm_granularity(&self, device: usize) -> Option<u64> {
        (self.vmm && device < self.devices.len()).then_some(SIM_GRANULARITY)
    }

    fn reserve_address(&self, device: usize, size: u64) -> DriverResult<DevicePtr> {
        let d = self.device(device)?;
        if !self.vmm || size == 0 || !size.is_multiple_of(SIM_GRANULARITY) {
            return Err(sim_error("reserve_address", format!("bad size {size}")));
        }
        let ptr = host::reserve(size).ok_or_else(|| sim_error("reserve_address", "mmap failed"))?;
        let mut memory = held(&d.memory, "reserve_address")?;
        memory.reservations.insert(ptr, size);
        memory.counters.reserve_calls += 1;
        memory.counters.live_reservations += 1;
        Ok(ptr)
    }

    fn free_address(&self, device: usize, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        let d = self.device(device)?;
        let mut memory = held(&d.memory, "free_address")?;
        if memory.reservations.get(&ptr) != Some(&size) {
            return Err(sim_error(
                "free_address",
                format!("{ptr:#x}+{size} is not a reservation"),
            ));
        }
        if memory.mapped.keys().any(|&va| va >= ptr && va < ptr + size) {
            return Err(sim_error(
                "free_address",
                format!("{ptr:#x} still has mapped granules"),
            ));
        }
        memory.reservations.remove(&ptr);
        memory.counters.live_reservations -= 1;
        host::unmap(ptr, size);
        Ok(())
    }

    fn create_physical(&self, device: usize, size: u64) -> DriverResult<PhysHandle> {
        self.spend(|c| c.create_physical);
        let d = self.device(device)?;
        if size == 0 || !size.is_multiple_of(SIM_GRANULARITY) {
            return Err(sim_error(
                "create_physical",
                format!("{size} bytes is not a whole number of granules"),
            ));
        }
        let mut memory = held(&d.memory, "create_physical")?;
        if memory.counters.bytes_in_use + size > d.capacity {
            memory.counters.failed_allocations += 1;
            return Err(DriverError::OutOfMemory);
        }
        if memory.physical.is_none() {
            let file = host::PhysicalFile::new(d.capacity)
                .ok_or_else(|| sim_error("create_physical", "memfd_create failed"))?;
            memory.physical = Some(file);
        }
        let slots = size / SIM_GRANULARITY;
        let fit = memory
            .free_runs
            .iter()
            .find(|&(_, &n)| n >= slots)
            .map(|(&first, &n)| (first, n));
        let slot = match fit {
            Some((first, n)) => {
                memory.free_runs.remove(&first);
                if n > slots {
                    memory.free_runs.insert(first + slots, n - slots);
                }
                first
            }
            None => {
                let first = memory.next_slot;
                let file = memory.physical.as_ref().expect("created above");
                if !file.ensure_len((first + slots) * SIM_GRANULARITY) {
                    return Err(sim_error("create_physical", "ftruncate failed"));
                }
                memory.next_slot += slots;
                first
            }
        };
        memory.live_slots.insert(slot, (slots, None));
        let c = &mut memory.counters;
        c.bytes_in_use += size;
        c.peak_bytes_in_use = c.peak_bytes_in_use.max(c.bytes_in_use);
        c.physical_creates += 1;
        Ok(PhysHandle(slot))
    }

    fn release_physical(&self, device: usize, handle: PhysHandle, size: u64) -> DriverResult<()> {
        self.spend(|c| c.release_physical);
        let d = self.device(device)?;
        let mut memory = held(&d.memory, "release_physical")?;
        match memory.live_slots.get(&handle.0) {
            None => {
                return Err(sim_error(
                    "release_physical",
                    format!("unknown handle {}", handle.0),
                ))
            }
            Some((_, Some(va))) => {
                return Err(sim_error(
                    "release_physical",
                    format!("the handle is still mapped at {va:#x}"),
                ))
            }
            Some(&(slots, None)) if slots * SIM_GRANULARITY != size => {
                return Err(sim_error(
                    "release_physical",
                    format!("handle {} has {slots} granules, not {size} bytes", handle.0),
                ))
            }
            Some(_) => {
                memory.live_slots.remove(&handle.0);
            }
        }
        if let Some(file) = &memory.physical {
            file.discard(handle.0 * SIM_GRANULARITY, size);
        }
        free_run(&mut memory.free_runs, handle.0, size / SIM_GRANULARITY);
        let c = &mut memory.counters;
        c.bytes_in_use -= size;
        c.physical_releases += 1;
        Ok(())
    }

    fn map(&self, device: usize, va: DevicePtr, size: u64, handle: PhysHandle) -> DriverResult<()> {
        self.spend(|c| c.map);
        let d = self.device(device)?;
        let mut memory = held(&d.memory, "map")?;
        let inside = memory
            .reservations
            .iter()
            .any(|(&start, &len)| va >= start && va + size <= start + len);
        let whole_handle = memory.live_slots.get(&handle.0).copied()
            == Some((size / SIM_GRANULARITY, None))
            && size.is_multiple_of(SIM_GRANULARITY);
        if !inside || !whole_handle || !va.is_multiple_of(SIM_GRANULARITY) {
            return Err(sim_error("map", format!("bad mapping of {va:#x}+{size}")));
        }
        if let Some(g) = granules(va, va + size).find(|g| memory.mapped.contains_key(g)) {
            return Err(sim_error("map", format!("{g:#x} is already mapped")));
        }
        let file = memory.physical.as_ref().expect("a live slot has a file");
        if !file.map_at(va, handle.0 * SIM_GRANULARITY, size) {
            return Err(sim_error("map", "mmap failed"));
        }
        for g in granules(va, va + size) {
            memory.mapped.insert(g, va);
        }
        memory.vmm_maps.insert(va, (handle.0, size));
        memory
            .live_slots
            .insert(handle.0, (size / SIM_GRANULARITY, Some(va)));
        memory.counters.maps += 1;
        memory.counters.granules_mapped += size / SIM_GRANULARITY;
        Ok(())
    }

    fn set_access(&self, device: usize, va: DevicePtr, size: u64) -> DriverResult<()> {
        // Mappings are read/write already; check the range is wholly mapped, as CUDA requires.
        let d = self.device(device)?;
        let memory = held(&d.memory, "set_access")?;
        let all_mapped = (va..va + size)
            .step_by(SIM_GRANULARITY as usize)
            .all(|g| memory.mapped.contains_key(&g));
        if size == 0 || !all_mapped {
            return Err(sim_error(
                "set_access",
                format!("{va:#x}+{size} is not wholly mapped"),
            ));
        }
        let mappings = mappings_in(&memory, va, size);
        drop(memory);
        // On a GPU the call costs about as much per mapping in the range as for one alone
        // (`benches/gpu/vmm_cost.cu` measures it).
        self.spend(|c| c.set_access * mappings);
        Ok(())
    }

    fn unmap(&self, device: usize, va: DevicePtr, size: u64) -> DriverResult<()> {
        // Per mapping, as `set_access`.
        let mappings = {
            let d = self.device(device)?;
            let memory = held(&d.memory, "unmap")?;
            mappings_in(&memory, va, size).max(1)
        };
        self.spend(|c| c.unmap * mappings);
        let d = self.device(device)?;
        let streams = held(&d.streams, "unmap")?;
        let mut memory = held(&d.memory, "unmap")?;
        for g in granules(va, va + size.max(1)) {
            check_unused(&streams, &memory, g, "unmap")?;
        }
        drop(streams);
        // As in CUDA, the range may cover several mappings, but each one wholly.
        let mut starts: Vec<DevicePtr> = Vec::new();
        for g in granules(va, va + size.max(1)) {
            match memory.mapped.get(&g) {
                Some(&start) if starts.last() != Some(&start) => starts.push(start),
                Some(_) => {}
                None => return Err(sim_error("unmap", format!("{g:#x} is not mapped"))),
            }
        }
        let whole = starts.iter().all(|start| {
            let (_, len) = memory.vmm_maps[start];
            *start >= va && start + len <= va + size
        });
        if !whole || size == 0 {
            return Err(sim_error(
                "unmap",
                format!("{va:#x}+{size} cuts through a mapping"),
            ));
        }
        for g in granules(va, va + size) {
            memory.uses.remove(&g);
            memory.mapped.remove(&g);
        }
        for start in starts {
            let (slot, _) = memory.vmm_maps.remove(&start).expect("listed");
            let slots = memory.live_slots[&slot].0;
            memory.live_slots.insert(slot, (slots, None));
        }
        host::reserve_at(va, size);
        memory.counters.unmaps += 1;
        memory.counters.granules_unmapped += size / SIM_GRANULARITY;
        Ok(())
    }
}

impl Drop for SimDriver {
    fn drop(&mut self) {
        // A poisoned table is left alone (its mappings leak): a drop cannot report.
        if let Ok(table) = self.host.lock() {
            for (&ptr, &(_, size)) in &table.mappings {
                host::unmap(ptr, size);
            }
        }
        for d in &self.devices {
            let Ok(memory) = d.memory.lock() else {
                continue;
            };
            for (&ptr, &size) in memory.mappings.iter().chain(memory.reservations.iter()) {
                host::unmap(ptr, size);
            }
        }
    }
}

/// Returns `n` slots from `first` to the free runs, merged with their neighbours.
fn free_run(runs: &mut BTreeMap<u64, u64>, mut first: u64, mut n: u64) {
    if let Some((&before, &len)) = runs.range(..first).next_back() {
        if before + len == first {
            runs.remove(&before);
            first = before;
            n += len;
        }
    }
    if let Some(len) = runs.remove(&(first + n)) {
        n += len;
    }
    runs.insert(first, n);
}

/// Host address space standing in for device memory. Mappings are lazily backed
/// (MAP_NORESERVE): replaying a 16 GB trace touches no pages, a canary touches one.
/// Memory standing in for the device is not inherited by a forked child (MADV_DONTFORK), as
/// a GPU's memory is not: the physical file's mappings are shared ones, through which parent
/// and child would otherwise see each other's writes.
mod host {
    /// Leaves `[ptr, ptr+len)` out of a forked child's address space.
    fn dont_fork(ptr: *mut libc::c_void, len: usize) {
        // SAFETY: only changes how fork treats our own mapping.
        unsafe { libc::madvise(ptr, len, libc::MADV_DONTFORK) };
    }

    pub(super) fn map(size: u64) -> Option<u64> {
        let len = usize::try_from(size).ok()?;
        // SAFETY: a fresh anonymous private mapping; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        dont_fork(ptr, len);
        Some(ptr as u64)
    }

    pub(super) fn unmap(ptr: u64, size: u64) {
        // SAFETY: `ptr`/`size` describe a mapping made by `map` and removed from the table first.
        unsafe {
            libc::munmap(ptr as *mut libc::c_void, size as usize);
        }
    }

    /// Address space with no access, standing in for a reserved device range.
    pub(super) fn reserve(size: u64) -> Option<u64> {
        let len = usize::try_from(size).ok()?;
        // SAFETY: a fresh inaccessible mapping; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        (ptr != libc::MAP_FAILED).then_some(ptr as u64)
    }

    /// Puts an inaccessible reservation back over `[ptr, ptr+size)` (an unmapped granule).
    pub(super) fn reserve_at(ptr: u64, size: u64) {
        // SAFETY: the range lies inside a reservation of ours; MAP_FIXED replaces only it.
        unsafe {
            libc::mmap(
                ptr as *mut libc::c_void,
                size as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            );
        }
    }

    /// The device's physical memory: a sparse memory file; granules are offsets in it, so
    /// data follows a granule from one mapping to the next, as on a GPU.
    pub(super) struct PhysicalFile {
        fd: libc::c_int,
    }

    impl PhysicalFile {
        pub(super) fn new(capacity: u64) -> Option<Self> {
            // SAFETY: plain system calls on a fresh file descriptor.
            unsafe {
                let fd = libc::memfd_create(c"ccalloc-sim-physical".as_ptr(), libc::MFD_CLOEXEC);
                if fd < 0 {
                    return None;
                }
                if libc::ftruncate(fd, capacity as libc::off_t) != 0 {
                    libc::close(fd);
                    return None;
                }
                Some(Self { fd })
            }
        }

        /// Grows the file to at least `len` bytes (freed runs that no new handle fits can
        /// leave the slots in use spread wider than the capacity).
        pub(super) fn ensure_len(&self, len: u64) -> bool {
            // SAFETY: fstat/ftruncate on our own descriptor.
            unsafe {
                let mut st: libc::stat = std::mem::zeroed();
                if libc::fstat(self.fd, &mut st) != 0 {
                    return false;
                }
                st.st_size as u64 >= len || libc::ftruncate(self.fd, len as libc::off_t) == 0
            }
        }

        pub(super) fn map_at(&self, va: u64, offset: u64, size: u64) -> bool {
            // SAFETY: `va` is a granule inside one of our reservations; MAP_FIXED replaces it.
            let ptr = unsafe {
                libc::mmap(
                    va as *mut libc::c_void,
                    size as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    self.fd,
                    offset as libc::off_t,
                )
            };
            if ptr as u64 != va {
                return false;
            }
            dont_fork(ptr, size as usize);
            true
        }

        /// Gives a released granule's pages back to the host.
        pub(super) fn discard(&self, offset: u64, size: u64) {
            // SAFETY: punches a hole in our own file.
            unsafe {
                libc::fallocate(
                    self.fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset as libc::off_t,
                    size as libc::off_t,
                );
            }
        }
    }

    impl Drop for PhysicalFile {
        fn drop(&mut self) {
            // SAFETY: closes the descriptor we own.
            unsafe { libc::close(self.fd) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = SIM_GRANULARITY;

    #[test]
    fn vmm_setting_takes_its_words_and_refuses_anything_else() {
        for on in ["", "1", "true", "on", " On "] {
            assert_eq!(vmm_setting(on), Ok(true), "{on:?}");
        }
        for off in ["0", "false", "off", "FALSE"] {
            assert_eq!(vmm_setting(off), Ok(false), "{off:?}");
        }
        for bad in ["7", "2", "yes", "no", "of"] {
            let err = vmm_setting(bad).unwrap_err();
            assert!(err.contains(&format!("CCALLOC_SIM_VMM={bad:?}")), "{err}");
            assert!(err.contains("0/false/off"), "{err}");
        }
    }

    #[test]
    fn host_address_space_running_out_is_a_driver_error_not_out_of_memory() {
        // An EiB: far more than a process's address space (128 TiB on x86-64, 256 TiB on
        // arm64), far less than the simulated memory. The device has room; the host cannot
        // back it, as under `ulimit -v` with a smaller request.
        let huge = 1u64 << 60;
        let sim = SimDriver::new(1, 1 << 62).with_host_memory(1 << 62, 1 << 62);
        for (err, call) in [
            (sim.allocate(0, huge).unwrap_err(), "sim allocate"),
            (
                sim.host_allocate(HostKind::Pinned, huge).unwrap_err(),
                "sim host_allocate",
            ),
            (
                sim.host_allocate(HostKind::Managed, huge).unwrap_err(),
                "sim host_allocate",
            ),
        ] {
            let DriverError::Failed { call: named, .. } = &err else {
                panic!("{call}: not a driver error: {err}");
            };
            assert_eq!(*named, call);
            let text = err.to_string();
            assert!(
                text.contains("could not map 1024.00 PiB of address space"),
                "{text}"
            );
            assert!(
                text.contains("ulimit -v") && !text.contains("out of memory"),
                "{text}"
            );
        }
        // Nothing was charged: the device and the host still hold what they can back.
        assert_eq!(sim.counters(0).bytes_in_use, 0);
        assert_eq!(sim.host_counters().pinned_bytes, 0);
        let ptr = sim.allocate(0, G).unwrap();
        sim.release(0, ptr, G).unwrap();
    }

    #[test]
    fn physical_handles_span_granules_and_unmap_only_whole() {
        let sim = SimDriver::new(1, 64 * G);
        let va = sim.reserve_address(0, 16 * G).unwrap();
        let four = sim.create_physical(0, 4 * G).unwrap();
        let one = sim.create_physical(0, G).unwrap();
        assert!(
            sim.create_physical(0, G / 2).is_err(),
            "not a whole granule"
        );
        sim.map(0, va, 4 * G, four).unwrap();
        sim.map(0, va + 4 * G, G, one).unwrap();
        sim.set_access(0, va, 5 * G).unwrap();
        assert!(
            sim.map(0, va + 8 * G, 2 * G, four).is_err(),
            "mapped already"
        );
        assert!(sim.unmap(0, va, 2 * G).is_err(), "cuts through a mapping");
        assert!(
            sim.release_physical(0, four, 4 * G).is_err(),
            "still mapped"
        );
        // Data follows the handle to a new address.
        unsafe { *((va + 3 * G) as *mut u8) = 7 };
        sim.unmap(0, va, 5 * G).unwrap();
        sim.map(0, va + 8 * G, 4 * G, four).unwrap();
        assert_eq!(unsafe { *((va + 11 * G) as *const u8) }, 7);
        let c = sim.counters(0);
        assert_eq!((c.maps, c.unmaps), (3, 1));
        assert_eq!((c.granules_mapped, c.granules_unmapped), (9, 5));
        sim.unmap(0, va + 8 * G, 4 * G).unwrap();
        assert!(sim.release_physical(0, four, G).is_err(), "wrong size");
        sim.release_physical(0, four, 4 * G).unwrap();
        sim.release_physical(0, one, G).unwrap();
        // Freed runs merge: eight granules fit where the two handles were, and beyond.
        let eight = sim.create_physical(0, 8 * G).unwrap();
        assert_eq!(sim.counters(0).bytes_in_use, 8 * G);
        sim.release_physical(0, eight, 8 * G).unwrap();
        sim.free_address(0, va, 16 * G).unwrap();
    }

    /// As on an H100, access grants and unmaps over a range cost per mapping in it, not per
    /// call: churn that moves small chunks under a large block pays for each chunk.
    #[test]
    fn range_calls_charge_per_mapping_in_the_range() {
        let costs = CallCosts {
            map: Duration::from_micros(1),
            set_access: Duration::from_micros(3),
            unmap: Duration::from_micros(2),
            ..CallCosts::default()
        };
        let sim = SimDriver::new(1, 64 * G).with_call_costs(costs);
        let va = sim.reserve_address(0, 16 * G).unwrap();
        let handles: Vec<_> = [2, 1, 1]
            .iter()
            .map(|&n| sim.create_physical(0, n * G).unwrap())
            .collect();
        let before = sim.spent();
        sim.map(0, va, 2 * G, handles[0]).unwrap();
        sim.map(0, va + 2 * G, G, handles[1]).unwrap();
        sim.map(0, va + 3 * G, G, handles[2]).unwrap();
        let mapped = sim.spent();
        sim.set_access(0, va, 4 * G).unwrap();
        assert_eq!(
            sim.spent() - mapped,
            Duration::from_micros(9),
            "three mappings"
        );
        sim.set_access(0, va + 2 * G, G).unwrap();
        assert_eq!(sim.spent() - mapped, Duration::from_micros(12), "one more");
        let granted = sim.spent();
        sim.unmap(0, va + 2 * G, 2 * G).unwrap();
        assert_eq!(
            sim.spent() - granted,
            Duration::from_micros(4),
            "two mappings"
        );
        assert_eq!(
            mapped - before,
            Duration::from_micros(3),
            "a map is one mapping"
        );
    }

    #[test]
    fn unmap_refuses_while_any_granule_of_the_range_is_in_use() {
        let sim = SimDriver::new(1, 64 * G);
        let va = sim.reserve_address(0, 16 * G).unwrap();
        let h = sim.create_physical(0, 4 * G).unwrap();
        sim.map(0, va, 4 * G, h).unwrap();
        let busy = StreamId(1);
        sim.set_stream_paused(0, busy, true);
        // Work queued on the paused stream uses the chunk's last granule.
        sim.record_event(0, busy).unwrap();
        sim.note_use(0, va + 3 * G, 4096, busy);
        assert!(
            sim.unmap(0, va, 4 * G).is_err(),
            "the last granule is in use"
        );
        sim.set_stream_paused(0, busy, false);
        sim.synchronize(0).unwrap();
        sim.unmap(0, va, 4 * G).unwrap();
        sim.release_physical(0, h, 4 * G).unwrap();
    }

    /// Uses of a granule on one stream are kept as its latest: once work before an earlier
    /// use has finished, a later one still blocks the unmap.
    #[test]
    fn a_granules_latest_use_on_a_stream_is_the_one_that_blocks() {
        let sim = SimDriver::new(1, 64 * G).with_event_lag(1);
        let va = sim.reserve_address(0, 16 * G).unwrap();
        let h = sim.create_physical(0, G).unwrap();
        sim.map(0, va, G, h).unwrap();
        let s = StreamId(1);
        sim.record_event(0, s).unwrap();
        sim.note_use(0, va, 4096, s);
        sim.record_event(0, s).unwrap();
        sim.note_use(0, va, 4096, s);
        // The first use's work has finished (one event later), the second's has not.
        assert!(sim.unmap(0, va, G).is_err(), "the later use blocks");
        sim.record_event(0, s).unwrap();
        sim.unmap(0, va, G).unwrap();
        sim.release_physical(0, h, G).unwrap();
    }
}
