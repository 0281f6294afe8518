//! A simulated device: real host memory behind every segment (so tests can write canaries and
//! catch overlapping blocks), a capacity and allocation granularity, and streams whose
//! completion tests control (a paused stream leaves its events pending until resumed or waited on).

use super::{DevicePtr, Driver, DriverError, DriverResult, EventId, StreamId};
use dashmap::DashMap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// cudaMalloc hands out whole 2 MiB pages; capacity is charged the same way here.
pub const SIM_GRANULARITY: u64 = 2 << 20;
pub const DEFAULT_CAPACITY: u64 = 80 << 30;

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
}

#[derive(Default)]
struct StreamState {
    paused: bool,
    /// Sequence number of the last piece of work queued (one per recorded event).
    queued: u64,
    /// Work up to this sequence number has finished.
    finished: u64,
}

#[derive(Default)]
struct SimMemory {
    /// Host mappings standing in for device segments: address → charged size.
    mappings: HashMap<DevicePtr, u64>,
    counters: SimCounters,
}

struct SimDeviceState {
    capacity: u64,
    memory: Mutex<SimMemory>,
    streams: Mutex<HashMap<StreamId, StreamState>>,
}

struct SimEvent {
    device: usize,
    stream: StreamId,
    sequence: u64,
}

pub struct SimDriver {
    devices: Vec<SimDeviceState>,
    events: DashMap<u64, SimEvent>,
    next_event: AtomicU64,
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
        }
    }

    /// Reads `CCALLOC_SIM_CAPACITY` (e.g. `80GiB`) and `CCALLOC_SIM_DEVICES` (default 1).
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
        Ok(Self::new(devices, capacity))
    }

    fn device(&self, device: usize) -> DriverResult<&SimDeviceState> {
        self.devices.get(device).ok_or(DriverError::Failed {
            call: "sim",
            detail: format!("no simulated device {device}"),
        })
    }

    pub fn counters(&self, device: usize) -> SimCounters {
        self.devices
            .get(device)
            .map(|d| d.memory.lock().unwrap().counters)
            .unwrap_or_default()
    }

    /// A paused stream's events stay pending until it is resumed (or someone waits on them).
    pub fn set_stream_paused(&self, device: usize, stream: StreamId, paused: bool) {
        if let Some(d) = self.devices.get(device) {
            let mut streams = d.streams.lock().unwrap();
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
        let memory = d.memory.lock().unwrap();
        memory
            .mappings
            .iter()
            .any(|(&start, &size)| ptr >= start && ptr.saturating_add(len) <= start + size)
    }
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
        let d = self.device(device)?;
        let charged = round_up(size.max(1), SIM_GRANULARITY);
        let mut memory = d.memory.lock().unwrap();
        if memory.counters.bytes_in_use + charged > d.capacity {
            memory.counters.failed_allocations += 1;
            return Err(DriverError::OutOfMemory);
        }
        let ptr = host::map(charged).ok_or(DriverError::OutOfMemory)?;
        memory.mappings.insert(ptr, charged);
        let c = &mut memory.counters;
        c.bytes_in_use += charged;
        c.peak_bytes_in_use = c.peak_bytes_in_use.max(c.bytes_in_use);
        c.live_allocations += 1;
        c.allocate_calls += 1;
        Ok(ptr)
    }

    fn release(&self, device: usize, ptr: DevicePtr, _size: u64) -> DriverResult<()> {
        let d = self.device(device)?;
        let mut memory = d.memory.lock().unwrap();
        let charged = memory.mappings.remove(&ptr).ok_or(DriverError::Failed {
            call: "sim release",
            detail: format!("{ptr:#x} is not a live simulated allocation"),
        })?;
        host::unmap(ptr, charged);
        let c = &mut memory.counters;
        c.bytes_in_use -= charged;
        c.live_allocations -= 1;
        c.release_calls += 1;
        Ok(())
    }

    fn record_event(&self, device: usize, stream: StreamId) -> DriverResult<EventId> {
        let d = self.device(device)?;
        let mut streams = d.streams.lock().unwrap();
        let state = streams.entry(stream).or_default();
        state.queued += 1;
        if !state.paused {
            state.finished = state.queued;
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
        let streams = d.streams.lock().unwrap();
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
        let mut streams = d.streams.lock().unwrap();
        let state = streams.entry(stream).or_default();
        state.finished = state.finished.max(sequence);
        Ok(())
    }

    fn destroy_event(&self, _device: usize, event: EventId) {
        self.events.remove(&event.0);
    }

    fn synchronize(&self, device: usize) -> DriverResult<()> {
        let d = self.device(device)?;
        for state in d.streams.lock().unwrap().values_mut() {
            state.finished = state.queued;
        }
        d.memory.lock().unwrap().counters.synchronize_calls += 1;
        Ok(())
    }
}

impl Drop for SimDriver {
    fn drop(&mut self) {
        for d in &self.devices {
            let memory = d.memory.lock().unwrap();
            for (&ptr, &size) in &memory.mappings {
                host::unmap(ptr, size);
            }
        }
    }
}

/// Host address space standing in for device memory. Mappings are lazily backed
/// (MAP_NORESERVE): replaying a 16 GB trace touches no pages, a canary touches one.
mod host {
    pub fn map(size: u64) -> Option<u64> {
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
        (ptr != libc::MAP_FAILED).then_some(ptr as u64)
    }

    pub fn unmap(ptr: u64, size: u64) {
        // SAFETY: `ptr`/`size` describe a mapping made by `map` and removed from the table first.
        unsafe {
            libc::munmap(ptr as *mut libc::c_void, size as usize);
        }
    }
}
