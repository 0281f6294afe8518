//! Regression tests for error paths and corner cases found in review: driver failures in the
//! middle of moving pages, private pools released while their window is open, captures, and
//! configuration changes between an allocation and its free.
#![cfg(feature = "sim")]

use ccalloc::{CallCosts, SimDriver};
use ccalloc::{Config, DeviceAllocator, ErrorKind, StreamId};
use ccalloc::{DevicePtr, Driver, DriverError, DriverResult, EventId, PhysHandle};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

mod common;

const MIB: u64 = 1 << 20;

/// The sim device, with the n-th `unmap`, or the n-th wait (`synchronize` or `wait_event`),
/// failing on demand; it counts recorded events and may space fences like a GPU driver.
struct Faulty {
    sim: Arc<SimDriver>,
    unmaps: AtomicU64,
    fail_unmap_at: AtomicU64,
    waits: AtomicU64,
    fail_wait_at: AtomicU64,
    events: AtomicU64,
    fence_interval: Duration,
    maps: AtomicU64,
    fail_map_at: AtomicU64,
    set_access_fails: std::sync::atomic::AtomicBool,
    /// Each map takes this long and page moves are timed, as on a GPU.
    slow_map: Option<Duration>,
    /// Each host wait for the device (`wait_event`, `synchronize`) takes this long, as
    /// when the device is busy with work queued earlier.
    slow_wait: Duration,
    releases_fail: std::sync::atomic::AtomicBool,
    allocate_panics: std::sync::atomic::AtomicBool,
    /// Physical memory runs out past this many bytes in use (0: at the sim's capacity), as
    /// on a GPU whose context and other processes hold part of what it reports.
    physical_limit: AtomicU64,
}

impl Faulty {
    fn wait_fails(&self) -> bool {
        self.waits.fetch_add(1, SeqCst) + 1 == self.fail_wait_at.load(SeqCst)
    }
}

fn injected(call: &'static str) -> DriverError {
    DriverError::Failed {
        call,
        detail: "injected failure".into(),
    }
}

impl Driver for Faulty {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn device_count(&self) -> usize {
        self.sim.device_count()
    }
    fn total_memory(&self, d: usize) -> DriverResult<u64> {
        self.sim.total_memory(d)
    }
    fn allocate(&self, d: usize, s: u64) -> DriverResult<DevicePtr> {
        if self.allocate_panics.load(SeqCst) {
            panic!("injected panic in allocate");
        }
        self.sim.allocate(d, s)
    }
    fn release(&self, d: usize, p: DevicePtr, s: u64) -> DriverResult<()> {
        self.sim.release(d, p, s)
    }
    fn record_event(&self, d: usize, s: StreamId) -> DriverResult<EventId> {
        self.events.fetch_add(1, SeqCst);
        self.sim.record_event(d, s)
    }
    fn event_done(&self, d: usize, e: EventId) -> DriverResult<bool> {
        self.sim.event_done(d, e)
    }
    fn wait_event(&self, d: usize, e: EventId) -> DriverResult<()> {
        if self.wait_fails() {
            return Err(injected("wait_event"));
        }
        std::thread::sleep(self.slow_wait);
        self.sim.wait_event(d, e)
    }
    fn destroy_event(&self, d: usize, e: EventId) {
        self.sim.destroy_event(d, e)
    }
    fn synchronize(&self, d: usize) -> DriverResult<()> {
        if self.wait_fails() {
            return Err(injected("synchronize"));
        }
        std::thread::sleep(self.slow_wait);
        self.sim.synchronize(d)
    }
    fn synchronize_stream(&self, d: usize, s: StreamId) -> DriverResult<()> {
        self.sim.synchronize_stream(d, s)
    }
    fn min_free_fence_interval(&self) -> Duration {
        self.fence_interval
    }
    fn times_page_moves(&self) -> bool {
        self.slow_map.is_some()
    }
    fn vmm_granularity(&self, d: usize) -> Option<u64> {
        self.sim.vmm_granularity(d)
    }
    fn reserve_address(&self, d: usize, s: u64) -> DriverResult<DevicePtr> {
        self.sim.reserve_address(d, s)
    }
    fn free_address(&self, d: usize, p: DevicePtr, s: u64) -> DriverResult<()> {
        self.sim.free_address(d, p, s)
    }
    fn create_physical(&self, d: usize, s: u64) -> DriverResult<PhysHandle> {
        let limit = self.physical_limit.load(SeqCst);
        if limit > 0 && self.sim.counters(d).bytes_in_use + s > limit {
            return Err(DriverError::OutOfMemory);
        }
        self.sim.create_physical(d, s)
    }
    fn release_physical(&self, d: usize, h: PhysHandle, s: u64) -> DriverResult<()> {
        if self.releases_fail.load(SeqCst) {
            return Err(injected("release_physical"));
        }
        self.sim.release_physical(d, h, s)
    }
    fn map(&self, d: usize, va: DevicePtr, s: u64, h: PhysHandle) -> DriverResult<()> {
        if self.maps.fetch_add(1, SeqCst) + 1 == self.fail_map_at.load(SeqCst) {
            return Err(injected("map"));
        }
        if let Some(delay) = self.slow_map {
            std::thread::sleep(delay);
        }
        self.sim.map(d, va, s, h)
    }
    fn set_access(&self, d: usize, va: DevicePtr, s: u64) -> DriverResult<()> {
        if self.set_access_fails.load(SeqCst) {
            return Err(injected("set_access"));
        }
        self.sim.set_access(d, va, s)
    }
    fn unmap(&self, d: usize, va: DevicePtr, s: u64) -> DriverResult<()> {
        if self.unmaps.fetch_add(1, SeqCst) + 1 == self.fail_unmap_at.load(SeqCst) {
            return Err(injected("unmap"));
        }
        self.sim.unmap(d, va, s)
    }
}

fn faulty(capacity: u64) -> (Arc<SimDriver>, Arc<Faulty>, DeviceAllocator) {
    faulty_spacing_fences(capacity, Duration::ZERO)
}

fn faulty_spacing_fences(
    capacity: u64,
    fence_interval: Duration,
) -> (Arc<SimDriver>, Arc<Faulty>, DeviceAllocator) {
    // Frees through the shard (a thread front keeps same-size blocks without one).
    faulty_with(capacity, "thread_cache:False", fence_interval, None)
}

fn faulty_with(
    capacity: u64,
    conf: &str,
    fence_interval: Duration,
    slow_map: Option<Duration>,
) -> (Arc<SimDriver>, Arc<Faulty>, DeviceAllocator) {
    faulty_on(
        SimDriver::new(1, capacity),
        conf,
        fence_interval,
        slow_map,
        Duration::ZERO,
    )
}

fn faulty_on(
    sim: SimDriver,
    conf: &str,
    fence_interval: Duration,
    slow_map: Option<Duration>,
    slow_wait: Duration,
) -> (Arc<SimDriver>, Arc<Faulty>, DeviceAllocator) {
    let sim = Arc::new(sim);
    let f = Arc::new(Faulty {
        sim: sim.clone(),
        unmaps: 0.into(),
        fail_unmap_at: 0.into(),
        waits: 0.into(),
        fail_wait_at: 0.into(),
        events: 0.into(),
        fence_interval,
        maps: 0.into(),
        fail_map_at: 0.into(),
        set_access_fails: false.into(),
        slow_map,
        slow_wait,
        releases_fail: false.into(),
        allocate_panics: false.into(),
        physical_limit: 0.into(),
    });
    let mut config = Config::default();
    config.apply(conf).unwrap();
    let a = DeviceAllocator::new(0, f.clone(), config).unwrap();
    (sim, f, a)
}

/// Reserved must always equal what the device holds; after empty_cache both are 0.
fn assert_accounted(sim: &SimDriver, a: &DeviceAllocator) {
    let reserved = a.stats().unwrap().reserved_bytes.all().current as u64;
    assert_eq!(
        reserved,
        sim.counters(0).bytes_in_use,
        "reserved drifted from the device"
    );
}

#[test]
fn a_failing_unmap_while_moving_pages_loses_no_memory() {
    let (sim, f, a) = faulty(64 * MIB);
    let p = a.malloc(40 * MIB, StreamId(0)).unwrap();
    a.free(p).unwrap();
    f.fail_unmap_at.store(3, SeqCst);
    let err = a.malloc(50 * MIB, StreamId(1)).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Driver);
    assert_accounted(&sim, &a);
    a.empty_cache().unwrap();
    assert_accounted(&sim, &a);
    assert_eq!(sim.counters(0).bytes_in_use, 0, "pages leaked");
    // And the allocator still works.
    let q = a.malloc(50 * MIB, StreamId(1)).unwrap();
    a.free(q).unwrap();
}

#[test]
fn a_failing_wait_after_taking_parked_pages_loses_no_memory() {
    let (sim, f, a) = faulty(1 << 30);
    let big = a.malloc(200 * MIB, StreamId(0)).unwrap();
    let keep = a.malloc(8 * MIB, StreamId(0)).unwrap();
    a.free(big).unwrap();
    // Moves pages from big's hole, and parks a batch of them.
    let q = a.malloc(20 * MIB, StreamId(1)).unwrap();
    // Stream 0 is still busy with `mid` when it is freed: moving its pages means a wait
    // (on its fence, or on the device), and that wait fails.
    let mid = a.malloc(100 * MIB, StreamId(0)).unwrap();
    sim.set_stream_paused(0, StreamId(0), true);
    a.free(mid).unwrap();
    f.fail_wait_at.store(f.waits.load(SeqCst) + 1, SeqCst);
    let err = a.malloc(150 * MIB, StreamId(2)).unwrap_err();
    assert_eq!(err.kind, ErrorKind::Driver, "{err:?}");
    assert_accounted(&sim, &a);
    sim.set_stream_paused(0, StreamId(0), false);
    a.free(keep).unwrap();
    a.free(q).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0, "pages leaked");
}

fn sim_allocator(capacity: u64, conf: &str) -> (Arc<SimDriver>, DeviceAllocator) {
    let sim = Arc::new(SimDriver::new(1, capacity));
    let mut config = Config::default();
    config.apply(conf).unwrap();
    (sim.clone(), DeviceAllocator::new(0, sim, config).unwrap())
}

#[test]
fn releasing_a_pool_during_its_window_keeps_the_window_working() {
    let (sim, a) = sim_allocator(1 << 30, "");
    a.begin_allocate_to_pool((1, 1), Box::new(|_| true))
        .unwrap();
    a.release_pool((1, 1)).unwrap();
    let p = a.malloc(4096, StreamId(0)).unwrap();
    a.empty_cache().unwrap();
    let q = a.malloc(4096, StreamId(0)).unwrap();
    a.end_allocate_to_pool((1, 1)).unwrap();
    a.free(p).unwrap();
    a.free(q).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn nothing_waits_for_the_device_while_a_graph_is_captured() {
    let (sim, a) = sim_allocator(1 << 30, "");
    let s2 = StreamId(2);
    let first = a.malloc(64 * MIB, s2).unwrap();
    let _second = a.malloc(64 * MIB, s2).unwrap();
    a.free(first).unwrap();
    a.begin_allocate_to_pool((7, 7), Box::new(|s| s == StreamId(1)))
        .unwrap();
    let before = sim.counters(0).synchronize_calls;
    let _third = a.malloc(128 * MIB, s2).unwrap();
    assert_eq!(
        sim.counters(0).synchronize_calls,
        before,
        "a capture would be invalidated"
    );
    a.end_allocate_to_pool((7, 7)).unwrap();
}

#[test]
fn oversize_counts_survive_a_max_split_size_change() {
    let (_sim, a) = sim_allocator(1 << 30, "expandable_segments:False");
    let p = a.malloc(30 * MIB, StreamId(0)).unwrap();
    a.apply_config("max_split_size_mb:20").unwrap();
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.oversize_allocations.current, 0);
    assert_eq!(s.oversize_segments.current, 0);
}

#[test]
fn a_refused_plain_block_does_not_hide_the_paged_segment() {
    let (sim, a) = sim_allocator(1 << 30, "expandable_segments:False,max_split_size_mb:64");
    let p = a.malloc(100 * MIB, StreamId(0)).unwrap();
    a.free(p).unwrap();
    a.apply_config("expandable_segments:True").unwrap();
    let first = a.malloc(30 * MIB, StreamId(0)).unwrap();
    let plain_segments = sim.counters(0).allocate_calls;
    for _ in 0..3 {
        let q = a.malloc(30 * MIB, StreamId(0)).unwrap();
        a.free(q).unwrap();
    }
    assert_eq!(
        sim.counters(0).allocate_calls,
        plain_segments,
        "no new plain segments"
    );
    a.free(first).unwrap();
}

#[test]
fn absurd_sizes_on_an_absurd_device_fail_cleanly() {
    for conf in [
        "expandable_segments:False",
        "roundup_power2_divisions:4",
        "",
    ] {
        let (_sim, a) = sim_allocator(u64::MAX / 2, conf);
        for size in [u64::MAX - 10, (1 << 63) + 12345, (1 << 62) + 1] {
            assert_eq!(
                a.malloc(size, StreamId(0)).unwrap_err().kind,
                ErrorKind::OutOfMemory
            );
        }
    }
}

#[test]
fn empty_cache_and_shutdown_wait_for_a_capture_to_end() {
    let (sim, a) = sim_allocator(1 << 30, "");
    let p = a.malloc(8 * MIB, StreamId(0)).unwrap();
    a.free(p).unwrap();
    a.begin_allocate_to_pool((3, 3), Box::new(|s| s == StreamId(9)))
        .unwrap();
    let syncs = sim.counters(0).synchronize_calls;
    a.empty_cache().unwrap();
    assert_eq!(
        sim.counters(0).synchronize_calls,
        syncs,
        "no wait during the capture"
    );
    assert!(
        sim.counters(0).bytes_in_use > 0,
        "released after the capture, not during it"
    );
    assert_eq!(a.shutdown().unwrap_err().kind, ErrorKind::Busy);
    a.end_allocate_to_pool((3, 3)).unwrap();
    a.release_pool((3, 3)).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
    a.shutdown().unwrap();
}

#[test]
fn fences_at_frees_are_spaced_by_the_drivers_interval() {
    let events_for = |interval: Duration| {
        let (_sim, f, a) = faulty_spacing_fences(1 << 30, interval);
        for _ in 0..64 {
            let p = a.malloc(4 * MIB, StreamId(0)).unwrap();
            a.free(p).unwrap();
        }
        f.events.load(SeqCst)
    };
    // Unspaced (the sim): the first free and every 16th after it record one.
    assert_eq!(events_for(Duration::ZERO), 4);
    // An hour apart: the first free's only.
    assert_eq!(events_for(Duration::from_secs(3600)), 1);
    // The spacing is per stream: another stream's first free still records its fence.
    let (_sim, f, a) = faulty_spacing_fences(1 << 30, Duration::from_secs(3600));
    for stream in [StreamId(0), StreamId(1)] {
        let p = a.malloc(4 * MIB, stream).unwrap();
        let before = f.events.load(SeqCst);
        a.free(p).unwrap();
        assert_eq!(f.events.load(SeqCst), before + 1, "{stream:?}'s first free");
    }
}

#[test]
fn a_failing_map_or_grant_in_the_middle_of_growth_loses_no_memory() {
    for failing_grant in [false, true] {
        let (sim, f, a) = faulty(1 << 30);
        let keep = a.malloc(8 * MIB, StreamId(0)).unwrap();
        // 40 MiB: five chunks; the third map fails, or the grant of access after all five.
        if failing_grant {
            f.set_access_fails.store(true, SeqCst);
        } else {
            f.fail_map_at.store(f.maps.load(SeqCst) + 3, SeqCst);
        }
        let err = a.malloc(40 * MIB, StreamId(0)).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Driver, "{}", err.message);
        assert_accounted(&sim, &a);
        assert_eq!(
            sim.counters(0).bytes_in_use,
            8 * MIB,
            "only `keep`'s pages stay (failing grant: {failing_grant})"
        );
        f.set_access_fails.store(false, SeqCst);
        let q = a.malloc(40 * MIB, StreamId(0)).unwrap();
        a.free(q).unwrap();
        a.free(keep).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(sim.counters(0).bytes_in_use, 0);
    }
}

/// Sizes of 4-64 MiB, whole MiB, from `seed`: most such requests move pages in a churn of
/// a few live blocks.
fn sizes_of_4_to_64_mib(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (4 + (seed >> 33) % 61) * MIB
    }
}

#[test]
fn slow_page_moves_buy_a_larger_cache_within_the_budget() {
    // Random sizes of 4-64 MiB, 8 live, one replaced per step: most steps move pages. Each
    // map takes 300 µs, so moving takes nearly all the time.
    let run = |conf: &str| {
        let (sim, _f, a) = faulty_with(
            1 << 32,
            conf,
            Duration::ZERO,
            Some(Duration::from_micros(300)),
        );
        let mut size = sizes_of_4_to_64_mib(7);
        let mut live: Vec<(u64, u64)> = (0..8)
            .map(|_| {
                let n = size();
                (a.malloc(n, StreamId(0)).unwrap(), n)
            })
            .collect();
        let (mut peak_live, mut late_moves) = (0u64, 0u64);
        let start = std::time::Instant::now();
        let mut step = 0usize;
        while start.elapsed() < Duration::from_millis(1500) {
            let i = step % live.len();
            a.free(live[i].0).unwrap();
            let n = size();
            live[i] = (a.malloc(n, StreamId(0)).unwrap(), n);
            peak_live = peak_live.max(live.iter().map(|l| l.1).sum());
            if step == 0 || start.elapsed() < Duration::from_millis(1000) {
                late_moves = sim.counters(0).unmaps;
            }
            step += 1;
        }
        let late_moves = sim.counters(0).unmaps - late_moves;
        let reserved = a.stats().unwrap().reserved_bytes.all().peak as u64;
        for (p, _) in live {
            a.free(p).unwrap();
        }
        (reserved as f64 / peak_live as f64, late_moves, step)
    };
    let (tight_ratio, tight_moves, tight_steps) = run("page_move_budget:0");
    let (loose_ratio, loose_moves, loose_steps) = run("page_move_budget:0.02");
    eprintln!(
        "ratio {tight_ratio:.3} / {loose_ratio:.3}, steps {tight_steps} / {loose_steps}, \
         late unmaps {tight_moves} / {loose_moves} (budget 0 / 2%)"
    );
    // Without a budget the bound holds and pages keep moving; with it, the cache grows (at
    // most to twice the live bytes), moves become rare and steps many times faster.
    assert!(tight_ratio < 1.1, "{tight_ratio}");
    assert!(
        loose_ratio > tight_ratio && loose_ratio <= 2.1,
        "{loose_ratio} vs {tight_ratio}"
    );
    assert!(
        loose_steps > 4 * tight_steps,
        "steps in 1.5 s: {loose_steps} with the budget, {tight_steps} without; \
         unmaps in the last 0.5 s: {loose_moves} and {tight_moves}"
    );
}

#[test]
fn waits_for_a_busy_device_do_not_count_as_page_move_time() {
    // The churn above, with driver calls that cost nothing but each wait for the device
    // 10 ms long (a device busy with work queued before the frees): growth spends most of
    // its time waiting, but moving costs little, so moves must stay within their allowance
    // (counted as move time, each wait would spend 10 ms of it, and a 10% budget would
    // refuse nine moves in ten). What is left of a move here is the allocator's and the
    // sim's own bookkeeping, a few % of the time in a debug build on a loaded host.
    let sim = SimDriver::new(1, 1 << 32).with_event_lag(2);
    let (_sim, _f, a) = faulty_on(
        sim,
        "page_move_budget:0.1",
        Duration::ZERO,
        Some(Duration::ZERO),
        Duration::from_millis(10),
    );
    let mut size = sizes_of_4_to_64_mib(11);
    let mut live: Vec<u64> = (0..8)
        .map(|_| a.malloc(size(), StreamId(0)).unwrap())
        .collect();
    let start = std::time::Instant::now();
    let mut step = 0;
    while start.elapsed() < Duration::from_millis(1200) {
        let i = step % live.len();
        a.free(live[i]).unwrap();
        live[i] = a.malloc(size(), StreamId(0)).unwrap();
        step += 1;
    }
    let paging = a.stats().unwrap().paging;
    for p in live {
        a.free(p).unwrap();
    }
    eprintln!("{step} steps, {paging:?}");
    assert!(
        paging.host_waits > 20,
        "the device was waited on: {paging:?}"
    );
    assert!(
        paging.wait_ns * 2 > paging.moving_ns,
        "waits took most of the moving growths' time: {paging:?}"
    );
    assert!(
        paging.growths_past_slack * 10 < paging.moving_growths,
        "moves were refused: {paging:?}"
    );
}

/// The hot-path harness's mixed sizes: log-uniform over 256 B-256 MiB, from a fixed seed.
fn mixed_sizes() -> impl FnMut() -> u64 {
    let mut seed = 11u64;
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let unit = (seed >> 11) as f64 / (1u64 << 53) as f64;
        (256f64.ln() + unit * ((256 * MIB) as f64 / 256.0).ln()).exp() as u64
    }
}

/// The harness's churn mixed (random sizes of 256 B-256 MiB, one of `live` replaced per
/// step) for `steps` steps on `a`, after `pause` (the job's time so far); returns the
/// paging counters of the steps.
fn churn_mixed(
    a: &DeviceAllocator,
    live: usize,
    pause: Duration,
    steps: usize,
) -> ccalloc::PagingCounters {
    let mut size = mixed_sizes();
    let mut blocks: Vec<u64> = (0..live)
        .map(|_| a.malloc(size(), StreamId(0)).unwrap())
        .collect();
    std::thread::sleep(pause);
    let before = a.stats().unwrap().paging;
    for step in 0..steps {
        let i = step % blocks.len();
        a.free(blocks[i]).unwrap();
        blocks[i] = a.malloc(size(), StreamId(0)).unwrap();
    }
    let paging = a.stats().unwrap().paging.since(&before);
    for p in blocks {
        a.free(p).unwrap();
    }
    paging
}

#[test]
fn page_moves_while_the_device_is_busy_cost_no_allowance() {
    // The churn below moves pages on most steps, each call as slow as on an H100. On an idle
    // device (events complete at once) moves soon spend their allowance; on a busy one (an
    // event completes only once 8 later ones were recorded on its stream: the device is
    // that far behind) every growth ends before the device has run the work queued before
    // it, so moves delay nothing and are not refused. (Where growth has to synchronize
    // the stream, the device does run dry, and those moves do count.) The job has run
    // 0.5 s first: 10 ms of moves allowed at 2%.
    let run = |lag: u64| {
        let sim = SimDriver::new(1, 64 << 30)
            .with_call_costs(CallCosts::h100())
            .with_event_lag(lag);
        let sim = Arc::new(sim);
        let a = DeviceAllocator::new(0, sim.clone(), Config::default()).unwrap();
        let paging = churn_mixed(&a, 128, Duration::from_millis(500), 600);
        // Each growth's probe of the device is destroyed; only fences stay pending.
        assert!(sim.live_events() <= 64, "{} events", sim.live_events());
        paging
    };
    let (idle, busy) = (run(0), run(8));
    eprintln!("idle: {idle:?}\nbusy: {busy:?}");
    assert!(idle.growths_past_slack > 0, "{idle:?}");
    assert!(
        busy.growths_past_slack * 4 < idle.growths_past_slack,
        "{busy:?}"
    );
    assert!(busy.moving_growths > idle.moving_growths, "{busy:?}");
}

#[test]
fn streams_with_shards_of_their_own_share_one_move_budget() {
    // One thread churns mixed sizes on 8 streams, each with a shard of its own, every
    // driver call as slow as on an H100, for 1.5 s. The budget is the job's: moves on all
    // streams together must stay near 2% of the time, not 2% per shard (16.5% before the
    // shards shared one allowance).
    let sim = Arc::new(SimDriver::new(1, 64 << 30).with_call_costs(CallCosts::h100()));
    let mut config = Config::default();
    config.apply("per_stream_shards:True").unwrap();
    let a = DeviceAllocator::new(0, sim, config).unwrap();
    let mut size = mixed_sizes();
    let streams: Vec<StreamId> = (1..=8).map(StreamId).collect();
    let mut live: Vec<(u64, StreamId)> = (0..64)
        .map(|i| {
            let s = streams[i % streams.len()];
            (a.malloc(size() / 8, s).unwrap(), s)
        })
        .collect();
    let start = std::time::Instant::now();
    let mut step = 0;
    while start.elapsed() < Duration::from_millis(1500) {
        let i = step % live.len();
        a.free(live[i].0).unwrap();
        live[i].0 = a.malloc(size() / 8, live[i].1).unwrap();
        step += 1;
    }
    let took = start.elapsed();
    let paging = a.stats().unwrap().paging;
    for (p, _) in live {
        a.free(p).unwrap();
    }
    let moving = Duration::from_nanos(paging.moving_ns.saturating_sub(paging.wait_ns));
    let share = moving.as_secs_f64() / took.as_secs_f64();
    eprintln!(
        "{step} steps; moving {moving:?} = {:.1}% of {took:?}; {paging:?}",
        share * 100.0
    );
    assert!(
        paging.growths_past_slack > 0,
        "moves were refused: {paging:?}"
    );
    assert!(share < 0.06, "moves took {:.1}% of the time", share * 100.0);
}

#[test]
fn a_short_burst_of_page_moves_stops_moving_within_tens_of_ms() {
    // The GPU harness's churn mixed: random sizes of 256 B-256 MiB, one of the live blocks
    // replaced per step, each driver call as slow as on an H100. Moves would take most of
    // the time, so the allowance must run out, and growth map new memory instead, well
    // within the 0.2 s such a burst lasts.
    let sim = Arc::new(SimDriver::new(1, 64 << 30).with_call_costs(CallCosts::h100()));
    let a = DeviceAllocator::new(0, sim.clone(), Config::default()).unwrap();
    let mut size = mixed_sizes();
    let mut live: Vec<u64> = (0..128)
        .map(|_| a.malloc(size(), StreamId(0)).unwrap())
        .collect();
    let start = std::time::Instant::now();
    let (mut raised_after, mut step) = (None, 0usize);
    while start.elapsed() < Duration::from_millis(300) {
        let i = step % live.len();
        a.free(live[i]).unwrap();
        live[i] = a.malloc(size(), StreamId(0)).unwrap();
        if raised_after.is_none() && a.stats().unwrap().paging.growths_past_slack > 0 {
            raised_after = Some(start.elapsed());
        }
        step += 1;
    }
    let paging = a.stats().unwrap().paging;
    eprintln!("moves refused after {raised_after:?}; {step} steps; {paging:?}");
    let raised_after = raised_after.expect("moves were refused within 0.3 s");
    assert!(
        raised_after < Duration::from_millis(200),
        "{raised_after:?}"
    );
    // Moves have cost more than their budget: new memory comes in chunks of a quarter of
    // the run, at least 4 pages (20 MiB = 10 pages: 4 + 4 + 2, not ten of one page), so
    // that moving it later costs fewer calls. (Cached memory goes first: the request must
    // make new chunks.)
    a.empty_cache().unwrap();
    let before = sim.counters(0);
    let fresh = a.malloc(20 * MIB, StreamId(9)).unwrap();
    let after = sim.counters(0);
    assert_eq!(
        after.granules_mapped - before.granules_mapped,
        10,
        "{after:?}"
    );
    assert_eq!(
        after.physical_creates - before.physical_creates,
        3,
        "{after:?}"
    );
    live.push(fresh);
    for p in live {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
}

#[test]
fn a_refused_move_on_a_full_device_moves_what_it_lacks_not_everything() {
    // Page moves are timed against a budget of a millionth of the time: the first move
    // spends more than the job earns in minutes, and later growth is refused moves. The
    // device reports 1 GiB but has no physical memory past what is in use: the growth must
    // move what it lacks from under the free 200 MiB block, and leave the rest cached
    // there, not take the OOM path (which takes every reclaimable chunk and gives back the
    // ones it does not need).
    let (sim, f, a) = faulty_with(
        1 << 30,
        "page_move_budget:0.000001",
        Duration::ZERO,
        Some(Duration::ZERO),
    );
    let x = a.malloc(64 * MIB, StreamId(2)).unwrap();
    a.free(x).unwrap();
    let y = a.malloc(96 * MIB, StreamId(3)).unwrap();
    assert!(
        a.stats().unwrap().paging.moving_growths > 0,
        "the first move"
    );
    a.free(y).unwrap();
    a.empty_cache().unwrap();
    let big = a.malloc(200 * MIB, StreamId(0)).unwrap();
    let keep = a.malloc(8 * MIB, StreamId(0)).unwrap();
    a.free(big).unwrap();
    let before = sim.counters(0);
    f.physical_limit.store(before.bytes_in_use, SeqCst);
    let p = a.malloc(100 * MIB + 1, StreamId(1)).unwrap();
    let after = sim.counters(0);
    let paging = a.stats().unwrap().paging;
    eprintln!("{paging:?}\n{after:?}");
    assert!(
        paging.growths_past_slack > 0,
        "moves were refused: {paging:?}"
    );
    // The OOM path would synchronize the device and give back all of the free block's
    // 200 MiB that the request does not use; moving what was lacking gives back at most
    // one chunk that fit nowhere (a quarter of the block: moves had overrun their budget).
    assert_eq!(
        after.synchronize_calls, before.synchronize_calls,
        "{after:?}"
    );
    assert!(
        after.bytes_in_use + 50 * MIB >= before.bytes_in_use,
        "{} of {} MiB still held",
        after.bytes_in_use / MIB,
        before.bytes_in_use / MIB
    );
    assert_eq!(a.stats().unwrap().num_alloc_retries, 0);
    assert_accounted(&sim, &a);
    for q in [p, keep] {
        a.free(q).unwrap();
    }
    f.physical_limit.store(0, SeqCst);
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn a_refused_release_keeps_the_memory_accounted_and_retries_later() {
    let (sim, f, a) = faulty(1 << 30);
    let big = a.malloc(200 * MIB, StreamId(0)).unwrap();
    let keep = a.malloc(8 * MIB, StreamId(0)).unwrap();
    a.free(big).unwrap();
    // Moves chunks from big's hole and parks a batch of them.
    let q = a.malloc(20 * MIB, StreamId(1)).unwrap();
    for p in [keep, q] {
        a.free(p).unwrap();
    }
    f.releases_fail.store(true, SeqCst);
    let err = a.empty_cache().unwrap_err();
    assert_eq!(err.kind, ErrorKind::Driver, "{}", err.message);
    assert_accounted(&sim, &a);
    assert!(sim.counters(0).bytes_in_use > 0);
    f.releases_fail.store(false, SeqCst);
    a.empty_cache().unwrap();
    assert_accounted(&sim, &a);
    assert_eq!(
        sim.counters(0).bytes_in_use,
        0,
        "the refused chunks were released later"
    );
}

#[test]
fn a_panic_inside_the_allocator_poisons_it_and_is_reported() {
    let (_sim, f, a) = faulty_with(1 << 30, "expandable_segments:False", Duration::ZERO, None);
    let kept = a.malloc(1 << 20, StreamId(0)).unwrap();
    f.allocate_panics.store(true, SeqCst);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = a.malloc(64 << 20, StreamId(0));
    }));
    assert!(caught.is_err(), "the driver panicked under the lock");
    f.allocate_panics.store(false, SeqCst);
    for result in [
        a.malloc(4096, StreamId(0)).map(|_| ()),
        a.free(kept),
        a.empty_cache(),
    ] {
        let e = result.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Internal, "{e}");
        assert!(e.message.contains("poisoned"), "{e}");
    }
    assert!(a.stats().is_err());
}

#[test]
fn shards_growing_at_once_stay_within_the_limit() {
    // Each map takes 50 ms: both streams' shards grow at once, and only one fits under the
    // limit (50 MiB of 100). The limit must be claimed before the driver is asked, not
    // counted once pages are mapped.
    let (sim, _f, a) = faulty_with(
        100 * MIB,
        "per_stream_shards:True,per_process_memory_fraction:0.5",
        Duration::ZERO,
        Some(Duration::from_millis(50)),
    );
    let a = Arc::new(a);
    let (s1, s2) = (StreamId(1), StreamId(2));
    let keep = [a.malloc(4096, s1).unwrap(), a.malloc(4096, s2).unwrap()];
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let growers: Vec<_> = [s1, s2]
        .into_iter()
        .map(|s| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                a.malloc(30 * MIB, s)
            })
        })
        .collect();
    let results: Vec<_> = growers.into_iter().map(|g| g.join().unwrap()).collect();
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1, "one fits");
    assert!(sim.counters(0).bytes_in_use <= 50 * MIB);
    for p in results.into_iter().flatten().chain(keep) {
        a.free(p).unwrap();
    }
}

#[test]
fn waits_for_a_busy_device_while_a_stream_lends_pages_do_not_count_as_move_time() {
    // Two streams with shards of their own on a device too small for both: each growth
    // takes the pages the other stream freed, waiting (10 ms, a busy device) until the
    // device is past that free. The wait happens in the lending shard, but it is the
    // growing shard's growth that it delays: it is not page-move time there either.
    // A budget of a quarter of the time: each shard grows every other step (20 ms), which
    // earns it 5 ms of moves; counted, its 10 ms wait would spend twice that, and half the
    // moves would be refused.
    let sim = SimDriver::new(1, 256 * MIB).with_event_lag(2);
    let (sim, _f, a) = faulty_on(
        sim,
        "per_stream_shards:True,page_move_budget:0.25",
        Duration::ZERO,
        Some(Duration::ZERO),
        Duration::from_millis(10),
    );
    for step in 0..12u64 {
        let stream = StreamId(1 + step % 2);
        let p = a.malloc((180 + step % 3 * 10) * MIB, stream).unwrap();
        a.free(p).unwrap();
    }
    let paging = a.stats().unwrap().paging;
    eprintln!("{paging:?}");
    assert!(paging.chunks_borrowed > 0, "{paging:?}");
    assert!(
        paging.host_waits > 4,
        "the device was waited on: {paging:?}"
    );
    assert_accounted(&sim, &a);
    assert!(
        paging.growths_past_slack * 10 < paging.moving_growths,
        "moves were refused: {paging:?}"
    );
}

#[test]
fn without_moves_a_job_at_its_memory_limit_still_moves_pages_rather_than_fail() {
    // `page_moves:False` maps new memory for every growth, up to the process's limit; at
    // the limit growth still takes pages from under free blocks (as the OOM path does), so
    // a job whose live bytes fit is not refused for the setting. Two live blocks of 96-200
    // MiB, each freed in turn and replaced by one of another size: at most 400 MiB live
    // under a limit of 512.
    let (sim, a) = sim_allocator(1 << 30, "page_moves:False,per_process_memory_fraction:0.5");
    let mut next = common::xorshift(7);
    let mut size = || (96 + next() % 105) * MIB;
    let s0 = StreamId(0);
    let mut live = [a.malloc(size(), s0).unwrap(), a.malloc(size(), s0).unwrap()];
    for step in 0..400 {
        let i = step % 2;
        a.free(live[i]).unwrap();
        live[i] = a
            .malloc(size(), s0)
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
    }
    let s = a.stats().unwrap();
    assert!(
        s.reserved_bytes.all().peak <= (512 * MIB) as i64,
        "{} MiB reserved at the peak",
        s.reserved_bytes.all().peak >> 20
    );
    assert!(
        s.paging.growths_past_slack > 0,
        "growth was refused its moves"
    );
    assert!(sim.counters(0).unmaps > 0, "at the limit, pages moved");
    for p in live {
        a.free(p).unwrap();
    }
}
