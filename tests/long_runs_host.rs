//! Long runs of pinned host memory, managed memory, the allocation history, snapshots and
//! init/shutdown cycles: what may degrade only after a job has run a while. Each test keeps
//! a model of what the caller holds, checks the statistics exactly, and watches the process
//! heap through a counting global allocator once in steady state.
//! Every test runs alone (`serial`): heap figures and the history are the process's.
#![cfg(feature = "sim")]

use ccalloc::capi::ccalloc_status::*;
use ccalloc::capi::*;
use ccalloc::{DeviceStats, HostKind, Runtime, StreamId};
use std::collections::BTreeMap;

mod common;

use common::heap::{heap, serial};
use common::sim_runtime as runtime;

#[global_allocator]
static GLOBAL: common::heap::Counting = common::heap::Counting;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const PINNED: HostKind = HostKind::Pinned;
const MANAGED: HostKind = HostKind::Managed;

fn rounded(size: u64) -> u64 {
    size.max(1).div_ceil(512) * 512
}

/// What the caller holds of one host-side cache, and the statistics that follow.
#[derive(Default)]
struct HostModel {
    /// Address → (requested size, block size).
    live: BTreeMap<u64, (u64, u64)>,
    /// (count, allocated bytes, requested bytes): current and peak.
    current: [i64; 3],
    peak: [i64; 3],
    allocations: i64,
}

impl HostModel {
    /// `p` handed out for `size` bytes, in a block of `block` bytes (at least `size` rounded
    /// to 512; more when the rest of a segment was too small to split off).
    fn alloc(&mut self, p: u64, size: u64, block: u64) {
        assert!(
            block >= rounded(size),
            "{p:#x}: a block of {block} for {size}"
        );
        assert!(
            self.live.insert(p, (size, block)).is_none(),
            "{p:#x} handed out twice"
        );
        if let Some((&q, &(_, b))) = self.live.range(..p).next_back() {
            assert!(q + b <= p, "{p:#x} overlaps {q:#x}");
        }
        if let Some((&q, _)) = self.live.range(p + 1..).next() {
            assert!(p + block <= q, "{p:#x} overlaps {q:#x}");
        }
        self.change(size, block, 1);
        self.allocations += 1;
    }

    fn free(&mut self, p: u64) {
        let (size, block) = self.live.remove(&p).expect("freeing a live block");
        self.change(size, block, -1);
    }

    fn change(&mut self, size: u64, block: u64, sign: i64) {
        for (i, amount) in [1, block as i64, size as i64].into_iter().enumerate() {
            self.current[i] += sign * amount;
            self.peak[i] = self.peak[i].max(self.current[i]);
        }
    }

    /// Allocation count and allocated bytes, current and peak (requested bytes too when no
    /// freed block may still await a stream's work).
    fn check(&self, s: &DeviceStats, requested: bool, what: &str) {
        let mut stats = vec![
            ("allocation", s.allocation.all()),
            ("allocated_bytes", s.allocated_bytes.all()),
        ];
        if requested {
            stats.push(("requested_bytes", s.requested_bytes.all()));
        }
        for (i, (name, got)) in stats.into_iter().enumerate() {
            assert_eq!(
                (got.current, got.peak),
                (self.current[i], self.peak[i]),
                "{what}: {name}"
            );
        }
        assert_eq!(
            s.allocation.all().allocated,
            self.allocations,
            "{what}: allocations"
        );
        assert_eq!(
            s.segment.all().current,
            s.num_device_alloc as i64 - s.num_device_free as i64,
            "{what}: segments against driver calls"
        );
    }
}

/// The size of the live block at `p` of a host-side cache.
fn block_size(rt: &Runtime, kind: HostKind, p: u64) -> u64 {
    let segments = rt.host_side(kind).unwrap().allocator().segments().unwrap();
    segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .find(|b| b.0 == p)
        .map(|b| b.1)
        .unwrap_or_else(|| panic!("{p:#x} is no block"))
}

/// Allocates `size` bytes of `kind`, in the model too.
fn host_alloc(rt: &Runtime, m: &mut HostModel, kind: HostKind, size: u64) -> u64 {
    let p = rt.host_malloc(kind, size).unwrap();
    m.alloc(p, size, block_size(rt, kind, p));
    p
}

/// A data loader that copies each batch on a stream of its own (a stream per request, as a
/// server that makes one per client does), destroyed once the copy is done: the pinned
/// batch is recorded on the stream, freed, and the stream destroyed. `empty_cache` every
/// 100 batches. What the pinned cache keeps per stream must not pile up: the heap, read just
/// after each `empty_cache`, stays flat after the first 500 streams; statistics stay exact.
fn stream_per_batch(kind: HostKind) {
    let _one = serial();
    let (sim, rt) = runtime(1);
    const ROUNDS: u64 = 3000;
    let stream = |round: u64| StreamId(0x1000 + round * 0x40);
    // The sim keeps a record of every stream it saw: made up front, so that the heap figures
    // below are the allocator's.
    for round in 0..ROUNDS {
        sim.set_stream_paused(0, stream(round), false);
    }
    let mut m = HostModel::default();
    let keep = host_alloc(&rt, &mut m, kind, 3 * MIB);
    let mut marks = Vec::new();
    for round in 0..ROUNDS {
        let s = stream(round);
        let size = [64 * KIB, 300 * KIB, 2 * MIB + 512][round as usize % 3];
        let p = host_alloc(&rt, &mut m, kind, size);
        match kind {
            HostKind::Pinned => rt.host_record_stream(kind, p, 0, s).unwrap(),
            HostKind::Managed => rt.prefetch(p, size, 0, s).unwrap(),
        }
        m.free(p);
        rt.host_free(kind, p).unwrap();
        sim.destroy_stream(0, s);
        if round % 100 == 99 {
            let host = rt.host_side(kind).unwrap().allocator();
            host.empty_cache().unwrap();
            let st = host.stats().unwrap();
            m.check(&st, true, &format!("{kind:?}, round {round}"));
            marks.push((round, heap(), st.reserved_bytes.all().current));
        }
    }
    let c = sim.counters(0);
    assert_eq!(c.destroyed_stream_calls, 0, "{c:?}");
    let (first, last) = (marks[4], *marks.last().unwrap());
    let what = format!("{kind:?}: (round, heap, reserved) after each empty_cache: {marks:?}");
    assert!(last.2 <= first.2, "reserved grew: {what}");
    assert!(
        last.1 - first.1 < 32 << 10,
        "the heap grew by {}: {what}",
        last.1 - first.1
    );
    rt.host_free(kind, keep).unwrap();
}

#[test]
fn pinned_batches_copied_on_a_stream_each_leave_nothing_behind() {
    stream_per_batch(PINNED);
}

#[test]
fn managed_blocks_prefetched_on_a_stream_each_leave_nothing_behind() {
    stream_per_batch(MANAGED);
}

/// A data loader's steady state: batches of varying sizes (a fixed cycle of sizes, so the
/// largest is seen early), four in flight, each copied on one copy stream (recorded) and
/// freed when its step is done; the copy stream is paused every other step, so frees await
/// their events. Over 4,000 batches the statistics match the model of what is live after
/// every step; after the first 400 batches the cache makes no driver call (docs/host-memory.md:
/// "a steady loader stops growing after its largest batches have been seen"), reserved
/// bytes stay flat, and so does the heap.
fn steady_loader(kind: HostKind) {
    let _one = serial();
    let (sim, rt) = runtime(1);
    let copy = StreamId(0x5151);
    const SIZES: [u64; 6] = [
        700 * KIB,
        3 * MIB + 100,
        12 * MIB,
        5 * MIB,
        96 * KIB,
        9 * MIB + 4096,
    ];
    let mut m = HostModel::default();
    let mut in_flight = std::collections::VecDeque::new();
    let mut marks = Vec::new();
    const BATCHES: u64 = 4000;
    for batch in 0..BATCHES {
        let paused = batch % 2 == 1;
        sim.set_stream_paused(0, copy, paused);
        // A batch is a few tensors of one of the sizes (a pattern of period 42).
        let size = SIZES[batch as usize % SIZES.len()] + (batch % 7) * 512;
        let tensors: Vec<u64> = (0..3)
            .map(|i| {
                let s = size >> i;
                let p = host_alloc(&rt, &mut m, kind, s);
                match kind {
                    HostKind::Pinned => rt.host_record_stream(kind, p, 0, copy).unwrap(),
                    HostKind::Managed => rt.prefetch(p, s, 0, copy).unwrap(),
                }
                p
            })
            .collect();
        in_flight.push_back(tensors);
        if in_flight.len() > 4 {
            for p in in_flight.pop_front().unwrap() {
                m.free(p);
                rt.host_free(kind, p).unwrap();
            }
        }
        let host = rt.host_side(kind).unwrap().allocator();
        let st = host.stats().unwrap();
        // Requested bytes leave an awaiting block when its events are seen done: unknown here.
        m.check(&st, false, &format!("{kind:?}, batch {batch}"));
        let c = sim.host_counters();
        let (calls, bytes) = match kind {
            HostKind::Pinned => (
                c.pinned_allocate_calls + c.pinned_release_calls,
                c.pinned_bytes,
            ),
            HostKind::Managed => (
                c.managed_allocate_calls + c.managed_release_calls,
                c.managed_bytes,
            ),
        };
        assert_eq!(
            st.reserved_bytes.all().current as u64,
            bytes,
            "batch {batch}: reserved against the driver"
        );
        if batch % 400 == 399 {
            marks.push((batch, calls, st.reserved_bytes.all().current, heap()));
        }
    }
    let what =
        format!("{kind:?}: (batch, driver calls, reserved, heap) every 400 batches: {marks:?}");
    let (first, last) = (marks[0], *marks.last().unwrap());
    assert_eq!(first.1, last.1, "driver calls after warm-up: {what}");
    assert!(last.2 <= first.2, "reserved grew: {what}");
    assert!(last.3 - first.3 < 16 << 10, "the heap grew: {what}");
    for tensors in in_flight {
        for p in tensors {
            m.free(p);
            rt.host_free(kind, p).unwrap();
        }
    }
    let host = rt.host_side(kind).unwrap().allocator();
    host.empty_cache().unwrap();
    let st = host.stats().unwrap();
    m.check(&st, true, "the end");
    assert_eq!(st.reserved_bytes.all().current, 0);
    assert_eq!(st.active.all().current, 0);
    assert_eq!(st.active_bytes.all().current, 0);
}

#[test]
fn a_steady_pinned_loader_stops_asking_the_driver_and_stays_exact() {
    steady_loader(PINNED);
}

#[test]
fn a_steady_managed_loader_stops_asking_the_driver_and_stays_exact() {
    steady_loader(MANAGED);
}

// ------------------------------------------------------------------------------------------
// The global runtime (C API): the history, snapshots, init/shutdown cycles
// ------------------------------------------------------------------------------------------

fn ok(status: ccalloc_status, what: &str) {
    assert_eq!(status, CCALLOC_OK, "{what}: {:?}", unsafe {
        std::ffi::CStr::from_ptr(ccalloc_last_error())
    });
}

fn sim_env() {
    std::env::set_var("CCALLOC_BACKEND", "sim");
    std::env::set_var("CCALLOC_SIM_CAPACITY", "4GiB");
}

fn dev_malloc(size: usize, stream: usize) -> *mut std::ffi::c_void {
    let mut p = std::ptr::null_mut();
    ok(
        ccalloc_malloc(size, 0, stream as cudaStream_t, &mut p),
        "ccalloc_malloc",
    );
    p
}

fn dev_stats() -> ccalloc_stats {
    let mut s = std::mem::MaybeUninit::<ccalloc_stats>::zeroed();
    ok(ccalloc_get_stats(0, s.as_mut_ptr()), "ccalloc_get_stats");
    // SAFETY: written by the call above (and zeroed before).
    unsafe { s.assume_init() }
}

/// One training-like step through the C API: a few blocks made and freed on stream 0, one
/// also used on stream 0x77 (`record_stream`, its free completes later).
fn device_step(step: u64) {
    let sizes = [4096usize, 300 << 10, 3 << 20, 512, 64 << 10];
    let ps: Vec<_> = sizes
        .iter()
        .map(|&s| dev_malloc(s + (step % 3) as usize * 512, 0))
        .collect();
    ok(
        ccalloc_record_stream(ps[1], 0, 0x77 as cudaStream_t),
        "record_stream",
    );
    for p in ps.into_iter().rev() {
        ok(ccalloc_free(p, 0), "ccalloc_free");
    }
}

/// Recording on for a long run keeps at most `max_entries` events, and what it holds for
/// the blocks it tracks (live ones, frees awaiting other streams) follows the blocks:
/// after warm-up the heap stays flat while recording (an entry is 56 bytes; the ring's
/// growth by doubling may reserve up to twice the entries).
/// Stopping with `clear` gives the ring back: the heap returns to within 64 KiB of what it
/// was before recording began.
#[test]
fn the_history_stays_bounded_over_a_long_recording_and_gives_back_its_memory() {
    let _one = serial();
    sim_env();
    ok(ccalloc_init(), "init");
    for step in 0..50 {
        device_step(step);
    }
    ok(ccalloc_empty_cache(-1), "empty_cache");
    ok(ccalloc_record_history(false, 0, true), "clear");
    let before = heap();
    const MAX: usize = 200_000;
    ok(ccalloc_record_history(true, MAX, true), "record");
    let mut marks = Vec::new();
    for step in 0..30_000u64 {
        device_step(step);
        if step % 2000 == 1999 {
            marks.push(heap() - before);
        }
    }
    // 30,000 steps of 10-11 events each: the ring is full from about step 18,000.
    let held = *marks.last().unwrap();
    assert!(
        held <= (MAX as i64) * 2 * 56 + (256 << 10),
        "recording {MAX} entries holds {held} bytes: {marks:?}"
    );
    let settled = marks[marks.len() - 4];
    assert!(
        held - settled < 16 << 10,
        "the heap grew by {} bytes over the last 6,000 steps with the ring full: {marks:?}",
        held - settled
    );
    let mut oldest = 0u64;
    ok(ccalloc_history_oldest_seq(&mut oldest), "oldest_seq");
    assert!(oldest > 0, "the oldest entries were dropped");
    ok(ccalloc_record_history(false, MAX, true), "stop and clear");
    // Measured as `before` was, with the caches emptied: the free lists' per-stream indexes
    // are the allocator's, not the history's.
    ok(ccalloc_empty_cache(-1), "empty_cache");
    let after = heap() - before;
    assert!(
        after < 64 << 10,
        "after stopping and clearing a history of {MAX} entries, the process still holds {after} \
         bytes more than before recording began (while recording: {marks:?})"
    );
    ok(ccalloc_shutdown(), "shutdown");
}

/// Snapshots taken repeatedly while recording (a job that dumps one every N steps): each
/// holds what it copied until freed, and nothing else stays behind. Read 500 times, the
/// heap after freeing each stays flat; the statistics after every snapshot match a model of
/// the live blocks (a snapshot drains fronts, which must not change them).
#[test]
fn snapshots_taken_every_few_steps_leave_nothing_behind() {
    let _one = serial();
    sim_env();
    ok(ccalloc_init(), "init");
    ok(ccalloc_record_history(true, 5_000, true), "record");
    let weights: Vec<_> = (0..4).map(|_| dev_malloc(256 << 10, 0)).collect();
    let mut marks = Vec::new();
    for step in 0..3_000u64 {
        device_step(step);
        if step % 6 == 5 {
            let mut snap = std::ptr::null_mut();
            ok(ccalloc_snapshot_take(-1, true, &mut snap), "snapshot");
            let (mut segments, mut trace) = (0usize, 0usize);
            ok(
                unsafe { ccalloc_snapshot_counts(snap, &mut segments, &mut trace) },
                "counts",
            );
            assert!(trace <= 5_000);
            unsafe { ccalloc_snapshot_free(snap) };
            let s = dev_stats();
            assert_eq!(s.allocation.all.current, 4, "step {step}");
            assert_eq!(
                s.allocated_bytes.all.current,
                4 * (256 << 10),
                "step {step}"
            );
            assert!(
                s.requested_bytes.all.current >= 4 * (256 << 10),
                "step {step}"
            );
            if step % 300 == 299 {
                marks.push(heap());
            }
        }
    }
    let grew = marks.last().unwrap() - marks[2];
    assert!(grew < 16 << 10, "the heap grew by {grew}: {marks:?}");
    for w in weights {
        ok(ccalloc_free(w, 0), "free");
    }
    ok(ccalloc_record_history(false, 0, true), "stop");
    ok(ccalloc_empty_cache(-1), "empty_cache");
    ok(ccalloc_shutdown(), "shutdown");
}

/// One init/shutdown cycle that uses what the cycles test (`tests/cycles.rs`) does not:
/// pinned and managed memory (recorded on a stream, prefetched), a second thread's front,
/// snapshots, settings.
fn rich_cycle(worker: &std::sync::mpsc::Sender<std::sync::mpsc::Sender<()>>) {
    ok(ccalloc_init(), "init");
    for step in 0..3 {
        device_step(step);
    }
    let mut h = std::ptr::null_mut();
    ok(ccalloc_host_malloc(1 << 20, &mut h), "host_malloc");
    ok(
        ccalloc_host_record_stream(h, 0, 0x55 as cudaStream_t),
        "host_record_stream",
    );
    ok(ccalloc_host_free(h), "host_free");
    let mut m = std::ptr::null_mut();
    ok(ccalloc_managed_malloc(3 << 20, &mut m), "managed_malloc");
    ok(
        ccalloc_prefetch(m, 1 << 20, 0, 0x55 as cudaStream_t),
        "prefetch",
    );
    ok(ccalloc_managed_free(m), "managed_free");
    // The worker allocates and frees on its own thread (its front), then waits.
    let (tx, rx) = std::sync::mpsc::channel();
    worker.send(tx).unwrap();
    rx.recv().unwrap();
    let mut snap = std::ptr::null_mut();
    ok(ccalloc_snapshot_take(-1, false, &mut snap), "snapshot");
    unsafe { ccalloc_snapshot_free(snap) };
    ok(ccalloc_shutdown(), "shutdown");
}

/// init/shutdown cycles with host-side memory and a long-lived second thread: each cycle
/// gives back what it took. After 30 warm-up cycles, 400 more leave the heap within
/// 64 bytes a cycle.
#[test]
fn init_shutdown_cycles_with_host_memory_and_a_worker_thread_give_back_what_they_took() {
    let _one = serial();
    sim_env();
    let (worker, jobs) = std::sync::mpsc::channel::<std::sync::mpsc::Sender<()>>();
    let thread = std::thread::spawn(move || {
        for done in jobs {
            for step in 100..102 {
                device_step(step);
            }
            let mut s = std::mem::MaybeUninit::<ccalloc_stats>::zeroed();
            ok(ccalloc_host_get_stats(s.as_mut_ptr()), "host stats");
            done.send(()).unwrap();
        }
    });
    for _ in 0..30 {
        rich_cycle(&worker);
    }
    let before = heap();
    let mut marks = Vec::new();
    const CYCLES: i64 = 400;
    for cycle in 0..CYCLES {
        rich_cycle(&worker);
        if cycle % 50 == 49 {
            marks.push(heap() - before);
        }
    }
    let grew = *marks.last().unwrap();
    assert!(
        grew < CYCLES * 64,
        "the heap grew by {grew} bytes over {CYCLES} cycles: {marks:?}"
    );
    drop(worker);
    thread.join().unwrap();
}
