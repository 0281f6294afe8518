//! Trace replay: drives a `DeviceAllocator` on the simulated device with a recorded workload
//! (allocate at `alloc`, free at `free_completed`, same streams) and measures what it reserved.

mod expandable;
mod pickle_depth;
pub mod plot;
mod snapshot;
pub mod trace;

use crate::alloc::{DeviceAllocator, MemoryBreakdown};
use crate::config::Config;
use crate::driver::sim::{SimCounters, SimDriver};
use crate::driver::StreamId;
use crate::error::{ErrorKind, Result};
pub use expandable::peak_reserved as expandable_peak_reserved;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use trace::{Action, Trace};

pub struct ReplayOptions {
    /// Simulated device memory; an allocation that cannot fit is reported as the OOM point.
    pub capacity: u64,
    /// `key:value,...` allocator settings.
    pub conf: String,
    /// Points kept for the live/reserved timeline.
    pub timeline_points: usize,
    /// How far the simulated GPU runs behind: an event completes once this many later
    /// events were recorded on its stream (see `SimDriver::with_event_lag`).
    pub gpu_lag: u64,
    /// Report what reserved memory was made of when it peaked (`ReplayReport::at_peak`).
    pub breakdown: bool,
    /// Each free tells the simulated device that work queued on the block's stream used its
    /// pages, and the device refuses to unmap them before that work has finished: a paging
    /// policy that moves pages too early fails the replay. Costs time in proportion to the
    /// freed blocks' pages, so off for traces of unknown origin.
    pub check_unmaps: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            capacity: crate::driver::sim::DEFAULT_CAPACITY,
            conf: String::new(),
            timeline_points: 2000,
            gpu_lag: 2,
            breakdown: false,
            check_unmaps: false,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct OomPoint {
    /// Index of the event that failed (0-based, among the trace's events as read, its
    /// segment events included); 0 for a block live when recording began.
    pub event: usize,
    pub requested_bytes: u64,
    pub live_bytes: u64,
    pub message: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    pub trace: String,
    /// Allocations and frees replayed.
    pub events: usize,
    pub allocs: usize,
    /// Peak of the bytes the trace asked for and had not freed.
    pub peak_live_bytes: u64,
    /// Peak of what ccalloc held from the device.
    pub peak_reserved_bytes: u64,
    /// peak_reserved / peak_live (1.0 is the floor).
    pub ratio: f64,
    /// What PyTorch's allocator reserved at its peak, where the trace records its segments.
    pub pytorch_peak_reserved_bytes: Option<u64>,
    pub pytorch_ratio: Option<f64>,
    /// What PyTorch's allocator with `expandable_segments:True` would reserve at its peak
    /// for the same trace (`expandable::ExpandableModel`), and that over peak live.
    pub expandable_peak_reserved_bytes: u64,
    pub expandable_ratio: f64,
    /// Plain device allocations and frees (segments).
    pub device_allocs: u64,
    pub device_frees: u64,
    /// Paged segments: physical pages created and released, pages mapped and unmapped.
    pub physical_creates: u64,
    pub physical_releases: u64,
    pub maps: u64,
    pub unmaps: u64,
    /// Waits for the whole device (before memory is released or pages move)…
    pub device_syncs: u64,
    /// …and for one event (a fence covering the frees of pages about to move).
    pub event_waits: u64,
    /// What these driver calls would cost the host on an H100 (`h100_driver_ms`), in ms; waits are not included (they last as long as the GPU's queued work).
    pub est_driver_ms: f64,
    pub ns_per_event: f64,
    pub oom: Option<OomPoint>,
    /// Frees of addresses the trace never allocated (skipped).
    pub unmatched_frees: usize,
    /// With `ReplayOptions::breakdown`: reserved memory by cause at the allocation that
    /// set its peak.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_peak: Option<MemoryBreakdown>,
    /// (event index, live bytes, reserved bytes), evenly sampled; in `--json` only with
    /// `--stats`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub timeline: Vec<(usize, u64, u64)>,
    /// The allocator's statistics after the last event, under `memory_stats()`'s names; in
    /// `--json` only with `--stats`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub final_stats: Vec<(String, i64)>,
}

impl ReplayReport {
    /// Drops what only `--stats` shows (the timeline and the final statistics).
    pub fn without_stats(mut self) -> Self {
        self.timeline = Vec::new();
        self.final_stats = Vec::new();
        self
    }
}

/// What the counted driver calls would cost the host on an H100, in ms (the sim's own calls
/// are host mmaps). Per call, measured by `benches/gpu/vmm_cost.cu` (handles of 1 to 4
/// pages: cuMemMap 1–2 µs plus cuMemSetAccess 45 µs, cuMemUnmap 22–29 µs, cuMemCreate
/// 20–25 µs, cuMemRelease 17–29 µs), and a cudaMalloc+cudaFree pair at 64 µs.
fn h100_driver_ms(c: &SimCounters) -> f64 {
    let us = c.maps as f64 * MAP_AND_GRANT_US
        + c.unmaps as f64 * UNMAP_US
        + (c.physical_creates + c.physical_releases) as f64 * CREATE_OR_RELEASE_US
        + (c.allocate_calls + c.release_calls) as f64 * SEGMENT_ALLOC_OR_FREE_US;
    us / 1000.0
}

const MAP_AND_GRANT_US: f64 = 47.0;
const UNMAP_US: f64 = 25.0;
const CREATE_OR_RELEASE_US: f64 = 23.0;
const SEGMENT_ALLOC_OR_FREE_US: f64 = 32.0;

/// The footnote for `ReplayReport::est_driver_ms`, with the costs it uses, in lines of at
/// most 100 characters.
pub fn driver_ms_note() -> String {
    format!(
        "driver ms: what these calls would cost the host on an H100 (waits excluded); per call:\n  \
         map and access grant {MAP_AND_GRANT_US} µs, unmap {UNMAP_US}, create {CREATE_OR_RELEASE_US}, \
         release {CREATE_OR_RELEASE_US}, cudaMalloc/cudaFree {SEGMENT_ALLOC_OR_FREE_US}"
    )
}

/// Replays `trace`; `progress(done, total)` is called now and then.
pub fn replay(
    trace: &Trace,
    options: &ReplayOptions,
    progress: impl FnMut(usize, usize),
) -> Result<ReplayReport> {
    if !options.breakdown {
        return replay_pass(trace, options, progress, Pass::Plain).map(|(report, _)| report);
    }
    // A breakdown walks every block: taken once, at the allocation that set the peak, found
    // by a first pass (the replay is deterministic), so that its cost stays one walk.
    let (mut report, peak_event) = replay_pass(trace, options, progress, Pass::FindPeak)?;
    if let Some(event) = peak_event {
        let (again, _) = replay_pass(trace, options, |_, _| {}, Pass::BreakdownAt(event))?;
        report.at_peak = again.at_peak;
    }
    Ok(report)
}

/// What a replay pass does besides replaying (`ReplayOptions::breakdown`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Plain,
    /// Notes the allocation after which reserved was highest.
    FindPeak,
    /// Stops after this event, with the breakdown of reserved then in `at_peak`.
    BreakdownAt(usize),
}

/// One replay; with `Pass::FindPeak`, also the index of the allocation event after which
/// reserved was highest.
fn replay_pass(
    trace: &Trace,
    options: &ReplayOptions,
    mut progress: impl FnMut(usize, usize),
    pass: Pass,
) -> Result<(ReplayReport, Option<usize>)> {
    let mut config = Config::default();
    config.apply(&options.conf)?;
    let sim = Arc::new(SimDriver::new(1, options.capacity).with_event_lag(options.gpu_lag));
    let allocator = DeviceAllocator::new(0, sim.clone(), config)?;

    let total = trace.events.len();
    let every = (total / options.timeline_points.max(1)).max(1);
    let mut live: HashMap<u64, (u64, u64)> = HashMap::new();
    let (mut live_bytes, mut peak_live) = (0u64, 0u64);
    let (mut torch_reserved, mut torch_peak, mut torch_seen) = (0u64, 0u64, false);
    let (mut events, mut allocs, mut unmatched) = (0usize, 0usize, 0usize);
    let mut timeline = Vec::new();
    let mut oom = None;

    let started = Instant::now();
    for (addr, size, stream) in trace::live_at_start(trace) {
        match allocator.malloc(size.max(1), StreamId(stream)) {
            Ok(ptr) => {
                live.insert(addr, (ptr, size));
                live_bytes = live_bytes.saturating_add(size);
            }
            Err(err) if err.kind == ErrorKind::OutOfMemory => {
                oom = Some(OomPoint {
                    event: 0,
                    requested_bytes: size,
                    live_bytes,
                    message: format!(
                        "a block live when recording began does not fit: {}",
                        err.message
                    ),
                });
                break;
            }
            Err(err) => return Err(err),
        }
    }
    peak_live = peak_live.max(live_bytes);
    let events_to_replay = if oom.is_some() {
        &[][..]
    } else {
        &trace.events[..]
    };
    let mut peak_breakdown: Option<MemoryBreakdown> = None;
    let (mut highest, mut peak_event) = (0u64, None);
    for (i, e) in events_to_replay.iter().enumerate() {
        match e.action {
            Action::Alloc => {
                if let Some((old, size)) = live.remove(&e.addr) {
                    // The trace lost this block's free: release it before reusing the address.
                    allocator.free(old)?;
                    live_bytes -= size;
                }
                match allocator.malloc(e.size.max(1), StreamId(e.stream)) {
                    Ok(ptr) => {
                        live.insert(e.addr, (ptr, e.size));
                        live_bytes += e.size;
                        peak_live = peak_live.max(live_bytes);
                        allocs += 1;
                        events += 1;
                    }
                    Err(err) if err.kind == ErrorKind::OutOfMemory => {
                        oom = Some(OomPoint {
                            event: i,
                            requested_bytes: e.size,
                            live_bytes,
                            message: err.message,
                        });
                        break;
                    }
                    Err(err) => return Err(err),
                }
            }
            Action::FreeCompleted => match live.remove(&e.addr) {
                Some((ptr, size)) => {
                    if options.check_unmaps {
                        sim.note_use(0, ptr, size.max(1), StreamId(e.stream));
                    }
                    allocator.free(ptr)?;
                    live_bytes -= size;
                    events += 1;
                }
                None => unmatched += 1,
            },
            Action::FreeRequested => {}
            // Saturating: a trace's sizes are whatever it says.
            Action::SegmentAlloc => {
                torch_seen = true;
                torch_reserved = torch_reserved.saturating_add(e.size);
                torch_peak = torch_peak.max(torch_reserved);
            }
            Action::SegmentFree => torch_reserved = torch_reserved.saturating_sub(e.size),
        }
        match pass {
            Pass::FindPeak if e.action == Action::Alloc => {
                let reserved = allocator.stats()?.reserved_bytes.all().current as u64;
                if reserved > highest {
                    (highest, peak_event) = (reserved, Some(i));
                }
            }
            Pass::BreakdownAt(event) if event == i => {
                peak_breakdown = Some(allocator.memory_breakdown()?);
                break;
            }
            _ => {}
        }
        if i % every == 0 {
            let reserved = allocator.stats()?.reserved_bytes.all().current as u64;
            timeline.push((i, live_bytes, reserved));
            if i % (every * 64) == 0 {
                progress(i, total);
            }
        }
    }
    let elapsed = started.elapsed();
    progress(total, total);
    let stats = allocator.stats()?;
    timeline.push((total, live_bytes, stats.reserved_bytes.all().current as u64));
    let peak_reserved = stats.reserved_bytes.all().peak as u64;
    let ratio = |reserved: u64| {
        if peak_live == 0 {
            0.0
        } else {
            reserved as f64 / peak_live as f64
        }
    };
    let torch_peak = torch_seen.then_some(torch_peak);
    // Over the events the replay got through (all of them unless it ran out of memory).
    let modelled = oom.as_ref().map_or(trace.events.len(), |o| o.event);
    let expandable_peak = expandable_peak_reserved(trace, options.capacity, modelled);
    let counters = sim.counters(0);
    let report = ReplayReport {
        trace: trace.name.clone(),
        events,
        allocs,
        peak_live_bytes: peak_live,
        peak_reserved_bytes: peak_reserved,
        ratio: ratio(peak_reserved),
        pytorch_peak_reserved_bytes: torch_peak,
        pytorch_ratio: torch_peak.map(ratio),
        expandable_peak_reserved_bytes: expandable_peak,
        expandable_ratio: ratio(expandable_peak),
        device_allocs: counters.allocate_calls,
        device_frees: counters.release_calls,
        physical_creates: counters.physical_creates,
        physical_releases: counters.physical_releases,
        maps: counters.maps,
        unmaps: counters.unmaps,
        device_syncs: counters.synchronize_calls,
        event_waits: counters.event_waits,
        est_driver_ms: h100_driver_ms(&counters),
        ns_per_event: elapsed.as_nanos() as f64 / events.max(1) as f64,
        oom,
        unmatched_frees: unmatched,
        at_peak: peak_breakdown,
        timeline,
        final_stats: stats.flat(),
    };
    Ok((report, peak_event))
}
