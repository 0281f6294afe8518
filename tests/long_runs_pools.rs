//! Long runs over what earlier long-run tests did not cover: CUDA-graph private pools made
//! and released by the thousand (PyTorch's graph trees), restores of a pool's layout at every
//! replay, more streams than shards, several devices with threads moving between them, and
//! settings changed through a long job with OOM storms between. Each checks, against a model
//! of what the caller holds, that the statistics stay exact, and that what should reach a
//! steady state does: reserved bytes, driver calls, the heap the allocator keeps.
//! Every test is sequential, so each run is the same.
#![cfg(feature = "sim")]

use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, DeviceStats, ErrorKind, Runtime, StreamId};
use std::collections::VecDeque;
use std::sync::Arc;

mod common;

use common::heap::{heap, serial};
use common::live::{driver_calls, free, malloc, sim_allocator as allocator, LiveModel};
use common::pool_layout;
use common::worker::Worker;

#[global_allocator]
static GLOBAL: common::heap::Counting = common::heap::Counting;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
/// The stream graphs are captured on.
const CAP: StreamId = StreamId(0x40);

type Model = LiveModel;

impl Model {
    /// Current and peak over both pools (blocks a restore carves are counted in their
    /// segment's pool, which their size may not tell), and the allocation total.
    fn check_all_pools(&self, s: &DeviceStats, what: &str) {
        for (stat, array) in [s.allocation, s.allocated_bytes, s.requested_bytes]
            .iter()
            .enumerate()
        {
            let got = array.all();
            assert_eq!(
                (got.current, got.peak),
                (self.figures.current[stat][0], self.figures.peak[stat][0]),
                "after {what}: statistic {stat} (0 count, 1 bytes, 2 requested)"
            );
        }
        assert_eq!(s.allocation.all().allocated, self.allocations, "{what}");
    }

    /// The current figures only (several shards: peaks are upper bounds).
    fn check_current(&self, s: &DeviceStats, what: &str) {
        for (name, got, want) in [
            (
                "allocation",
                s.allocation.all().current,
                self.figures.current[0][0],
            ),
            (
                "allocated_bytes",
                s.allocated_bytes.all().current,
                self.figures.current[1][0],
            ),
            (
                "requested_bytes",
                s.requested_bytes.all().current,
                self.figures.current[2][0],
            ),
            (
                "active_bytes",
                s.active_bytes.all().current,
                self.figures.current[1][0],
            ),
        ] {
            assert_eq!(got, want, "{what}: {name}");
        }
        assert_eq!(s.allocation.all().allocated, self.allocations, "{what}");
    }
}

/// Everything freed and the cache emptied: nothing stays reserved, on the device either.
fn all_back(sim: &SimDriver, a: &DeviceAllocator, m: &mut Model) {
    let live: Vec<u64> = m.live.keys().copied().collect();
    for p in live {
        free(a, m, p);
    }
    a.empty_cache().unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(s.reserved_bytes.all().current, 0, "{s:?}");
    assert_eq!(sim.counters(a.device()).bytes_in_use, 0);
}

// ---------------------------------------------------------------------------------------
// Private pools over many captures.
// ---------------------------------------------------------------------------------------

/// How a graph's pool goes away.
#[derive(Clone, Copy, Debug)]
enum Release {
    /// Its blocks are freed, then the pool released (the graph and its outputs die
    /// together).
    AfterFrees,
    /// The pool is released while its outputs are still live; they are freed later.
    BeforeFrees,
    /// Released while the next graph's capture is open (its window routes elsewhere).
    DuringNextCapture,
}

/// Sizes a captured graph allocates in its pool (small, large, oversize-ish).
const GRAPH_SIZES: [u64; 4] = [700, 96 * KIB, 3 * MIB, 20 * MIB];

/// A graph tree that captures a new graph, in a pool of its own, every step (new shapes:
/// PyTorch's graph trees and `torch.cuda.graph` make a pool per capture unless shared),
/// while eager work goes on in the general cache. The 3 newest graphs stay alive; the one
/// before goes, in one of the ways of `Release` (each in turn). `empty_cache` every 100
/// steps, as a job under memory pressure would reach the OOM path.
///
/// Checks: statistics exact every step (peaks too with one shard); after each
/// `empty_cache`, reserved bytes, the segments' count, the device's bytes and the heap are
/// the same as after the first ones (the pools of dead graphs are forgotten, whatever way
/// they went); and no pool is known past its release (`pool_use_count`).
fn graphs_with_a_pool_each(conf: &str) {
    let _one = serial();
    let (sim, a) = allocator(8 << 30, conf);
    let sharded = conf.contains("per_stream_shards:True");
    let mut m = Model::default();
    let weights: Vec<u64> = (0..3).map(|_| malloc(&a, &mut m, 4 * MIB, S0)).collect();
    // Each graph: its pool, its outputs (live until it goes).
    let mut graphs: VecDeque<((u64, u64), Vec<u64>)> = VecDeque::new();
    let mut released_early: Vec<Vec<u64>> = Vec::new();
    let mut marks = Vec::new();
    const STEPS: u64 = 1500;
    for step in 0..STEPS {
        let pool = (0, step + 1);
        let how = [
            Release::AfterFrees,
            Release::BeforeFrees,
            Release::DuringNextCapture,
        ][step as usize % 3];
        // Eager work before the capture.
        let x = malloc(&a, &mut m, 256 * KIB, S0);
        a.begin_allocate_to_pool(pool, Box::new(|s| s == CAP))
            .unwrap();
        // Outputs of released-early graphs die during some capture (tensors outliving
        // their graph).
        for p in released_early.drain(..).flatten() {
            free(&a, &mut m, p);
        }
        let mut outs = Vec::new();
        for &size in &GRAPH_SIZES {
            let t = malloc(&a, &mut m, size, CAP);
            outs.push(malloc(&a, &mut m, size, CAP));
            free(&a, &mut m, t);
        }
        // Eager work on another stream during the capture: not routed.
        let e = malloc(&a, &mut m, 64 * KIB, S0);
        free(&a, &mut m, e);
        if graphs.len() > 3 {
            let (old, old_outs) = graphs.pop_front().unwrap();
            match how {
                Release::DuringNextCapture => {
                    for p in old_outs {
                        free(&a, &mut m, p);
                    }
                    a.release_pool(old).unwrap();
                }
                _ => graphs.push_front((old, old_outs)),
            }
        }
        a.end_allocate_to_pool(pool).unwrap();
        graphs.push_back((pool, outs));
        free(&a, &mut m, x);
        if graphs.len() > 3 {
            let (old, old_outs) = graphs.pop_front().unwrap();
            match how {
                Release::AfterFrees | Release::DuringNextCapture => {
                    for p in old_outs {
                        free(&a, &mut m, p);
                    }
                    a.release_pool(old).unwrap();
                }
                Release::BeforeFrees => {
                    a.release_pool(old).unwrap();
                    released_early.push(old_outs);
                }
            }
            assert_eq!(a.pool_use_count(old).unwrap(), 0, "step {step}");
        }
        let s = a.stats().unwrap();
        if sharded {
            m.check_current(&s, &format!("step {step} ({conf:?})"));
        } else {
            m.check(&s, &format!("step {step} ({conf:?})"));
        }
        if step % 100 == 99 {
            a.empty_cache().unwrap();
            let s = a.stats().unwrap();
            let c = sim.counters(0);
            marks.push((
                step,
                heap(),
                s.reserved_bytes.all().current,
                s.segment.all().current,
                c.bytes_in_use,
            ));
        }
    }
    let what = format!(
        "{conf:?}: (step, heap, reserved, segments, device bytes) after each empty_cache: \
         {marks:?}"
    );
    let (first, last) = (marks[2], *marks.last().unwrap());
    assert!(last.2 <= first.2, "reserved grew: {what}");
    assert!(last.3 <= first.3, "segments grew: {what}");
    assert!(last.4 <= first.4, "device bytes grew: {what}");
    assert!(
        last.1 - first.1 < 64 << 10,
        "the heap grew by {} bytes over {} captures: {what}",
        last.1 - first.1,
        STEPS - 300
    );
    for (pool, outs) in graphs {
        for p in outs {
            free(&a, &mut m, p);
        }
        a.release_pool(pool).unwrap();
    }
    for p in released_early.drain(..).flatten() {
        free(&a, &mut m, p);
    }
    for w in weights {
        free(&a, &mut m, w);
    }
    all_back(&sim, &a, &mut m);
}

#[test]
fn graphs_captured_in_a_pool_each_leave_nothing_behind() {
    graphs_with_a_pool_each("");
}

#[test]
fn graphs_captured_in_a_pool_each_leave_nothing_behind_with_plain_segments() {
    graphs_with_a_pool_each("expandable_segments:False");
}

#[test]
fn graphs_captured_in_a_pool_each_leave_nothing_behind_with_shards() {
    graphs_with_a_pool_each("per_stream_shards:True");
}

/// A capture whose graph is dropped before its capture ends (a capture that raised: the
/// graph object goes, releasing its pool, and `capture_end` then closes the window), some
/// allocating in the pool and some not (a graph of in-place work), in turn, thousands of
/// times. A pool nobody holds, with no memory and no window, is forgotten: the heap the
/// allocator keeps and its reserved bytes must stay flat, and the statistics exact.
fn pools_released_inside_their_window(conf: &str) {
    let _one = serial();
    let (sim, a) = allocator(8 << 30, conf);
    let sharded = conf.contains("per_stream_shards:True");
    let mut m = Model::default();
    let w = malloc(&a, &mut m, 4 * MIB, S0);
    // A stream of its own for other work, so that with shards there are three.
    let side = StreamId(0x80);
    let mut marks = Vec::new();
    const STEPS: u64 = 3000;
    for step in 0..STEPS {
        let pool = (1, step + 1);
        a.begin_allocate_to_pool(pool, Box::new(|s| s == CAP))
            .unwrap();
        let allocates = step % 2 == 0;
        let t = allocates.then(|| malloc(&a, &mut m, 96 * KIB, CAP));
        let e = malloc(&a, &mut m, 64 * KIB, side);
        a.release_pool(pool).unwrap();
        if let Some(t) = t {
            free(&a, &mut m, t);
        }
        a.end_allocate_to_pool(pool).unwrap();
        free(&a, &mut m, e);
        assert_eq!(a.pool_use_count(pool).unwrap(), 0);
        let s = a.stats().unwrap();
        if sharded {
            m.check_current(&s, &format!("step {step}"));
        } else {
            m.check(&s, &format!("step {step}"));
        }
        if step % 500 == 499 {
            a.empty_cache().unwrap();
            let s = a.stats().unwrap();
            marks.push((step, heap(), s.reserved_bytes.all().current));
        }
    }
    let what = format!("{conf:?}: (step, heap, reserved) after each empty_cache: {marks:?}");
    let (first, last) = (marks[0], *marks.last().unwrap());
    assert!(last.2 <= first.2, "reserved grew: {what}");
    assert!(
        last.1 - first.1 < 64 << 10,
        "the heap grew by {} bytes over {} captures: {what}",
        last.1 - first.1,
        STEPS - 500
    );
    free(&a, &mut m, w);
    all_back(&sim, &a, &mut m);
}

#[test]
fn pools_released_inside_their_own_capture_are_forgotten() {
    pools_released_inside_their_window("");
}

#[test]
fn pools_released_inside_their_own_capture_are_forgotten_with_shards() {
    pools_released_inside_their_window("per_stream_shards:True");
}

/// A graph tree replaying two paths that diverge after a shared prefix, thousands of times:
/// each divergence restores the pool to the checkpoint saved after the prefix
/// (`setCheckpointPoolState`), then the path's own blocks are made in the pool (a replay
/// makes none: the path's first recording did, and a restore frees them). Once warm, a
/// restore and the path after it must make no driver call and leave reserved bytes as they
/// were; the statistics stay exact (a restore's frees and remade blocks counted as the
/// caller's), and the heap flat.
fn restores_at_every_divergence(conf: &str) {
    let _one = serial();
    let (sim, a) = allocator(8 << 30, conf);
    let mut m = Model::default();
    let pool = (2, 1);
    let eager = malloc(&a, &mut m, 2 * MIB, S0);
    // The shared prefix.
    a.begin_allocate_to_pool(pool, Box::new(|s| s == CAP))
        .unwrap();
    let prefix: Vec<u64> = [MIB + 512, 3 * MIB, 600 * KIB, 4096, 700]
        .iter()
        .map(|&n| malloc(&a, &mut m, n, CAP))
        .collect();
    a.end_allocate_to_pool(pool).unwrap();
    free(&a, &mut m, prefix[2]);
    let saved = pool_layout(&a, pool);
    let paths: [&[u64]; 2] = [
        &[5 * MIB, 100 * KIB, 512],
        &[2 * MIB, 2 * MIB, 33 * KIB, 9 * MIB],
    ];
    let mut reserved = Vec::new();
    let mut calls = Vec::new();
    let mut heaps = Vec::new();
    const ROUNDS: usize = 2000;
    for round in 0..ROUNDS {
        let done = a.restore_pool(pool, &saved).unwrap();
        for p in &done.freed {
            m.free(*p);
        }
        // As PyTorch's `setSegmentStateToCheckpoint`: every saved block is carved (handed
        // out, counted), then those saved as free are freed.
        for b in &saved {
            m.alloc(b.addr, b.size);
        }
        for b in saved.iter().filter(|b| !b.allocated) {
            m.free(b.addr);
        }
        let mut made: Vec<u64> = done.allocated.iter().map(|b| b.ptr).collect();
        made.sort();
        let want: Vec<u64> = saved
            .iter()
            .filter(|b| b.allocated)
            .map(|b| b.addr)
            .collect();
        assert_eq!(
            made, want,
            "round {round}: the saved live blocks are made again"
        );
        // The path's own blocks, recorded in the pool; eager work meanwhile.
        a.begin_allocate_to_pool(pool, Box::new(|s| s == CAP))
            .unwrap();
        for &n in paths[round % 2] {
            malloc(&a, &mut m, n, CAP);
        }
        let t = malloc(&a, &mut m, 128 * KIB, S0);
        a.end_allocate_to_pool(pool).unwrap();
        // The capture's hold (each begin takes one) goes with the path's graph; the tree
        // keeps its own.
        a.release_pool(pool).unwrap();
        assert_eq!(a.pool_use_count(pool).unwrap(), 1);
        free(&a, &mut m, t);
        m.check_all_pools(&a.stats().unwrap(), &format!("round {round} ({conf:?})"));
        reserved.push(a.stats().unwrap().reserved_bytes.all().current);
        calls.push(driver_calls(&sim.counters(0)));
        if round % 500 == 499 {
            heaps.push(heap());
        }
    }
    let warm = 10;
    assert!(
        reserved[warm..].iter().all(|&r| r == reserved[warm]),
        "{conf:?}: reserved moved after round {warm}: {:?}",
        &reserved[..40]
    );
    let late = calls[ROUNDS - 1] - calls[warm];
    assert_eq!(
        late,
        0,
        "{conf:?}: driver calls after round {warm}: {:?}",
        &calls[..40]
    );
    let grew = heaps.last().unwrap() - heaps[0];
    assert!(
        grew < 64 << 10,
        "{conf:?}: the heap grew by {grew}: {heaps:?}"
    );
    free(&a, &mut m, eager);
    let live: Vec<u64> = m.live.keys().copied().collect();
    for p in live {
        free(&a, &mut m, p);
    }
    a.release_pool(pool).unwrap();
    all_back(&sim, &a, &mut m);
}

#[test]
fn restoring_a_pool_at_every_divergence_settles() {
    restores_at_every_divergence("");
}

#[test]
fn restoring_a_pool_at_every_divergence_settles_with_plain_segments() {
    restores_at_every_divergence("expandable_segments:False");
}

// ---------------------------------------------------------------------------------------
// More streams than shards, on several threads.
// ---------------------------------------------------------------------------------------

use std::sync::Mutex;

/// A stream handle as CUDA gives them (heap pointers, 64-byte aligned).
fn handle(k: u64) -> StreamId {
    StreamId(0x7f00_0000_0000 + k * 0x40)
}

/// Sizes each stream allocates per round, in turn.
const STREAM_SIZES: [u64; 5] = [4 * KIB, 192 * KIB, 700, 2 * MIB + 512, 48 * KIB];

/// 40 streams live at a time, on 4 threads, with a shard per stream (`per_stream_shards`):
/// the first 32 streams ever made get a shard each, later ones share. Each round every
/// stream gets a block from one thread, which another thread frees a round later (half with
/// `free_on`); every 50 rounds the 8 oldest streams go (destroyed once their blocks are
/// freed) and 8 new ones come. Checks: the current statistics exact every round (peaks are
/// bounds with shards); no driver call on a destroyed stream; after each `empty_cache`,
/// reserved bytes and the heap stay as after the first few hundred streams.
#[test]
fn more_streams_than_shards_coming_and_going_on_several_threads() {
    let _one = serial();
    let (sim, a) = allocator(4 << 30, "per_stream_shards:True");
    let m: Arc<Mutex<Model>> = Arc::default();
    const ROUNDS: u64 = 600;
    const LIVE: u64 = 40;
    let total = LIVE + ROUNDS / 50 * 8;
    for k in 0..total {
        sim.set_stream_paused(0, handle(k), false);
    }
    let workers: Vec<Worker> = (0..4).map(|_| Worker::new()).collect();
    let mut streams: VecDeque<u64> = (0..LIVE).collect();
    let mut next = LIVE;
    // Blocks made last round: (ptr, stream, index of the thread that made it).
    let mut pending: Vec<(u64, StreamId, usize)> = Vec::new();
    let mut marks = Vec::new();
    for round in 0..ROUNDS {
        // Last round's blocks, freed by the thread after the one that made them.
        for (w, worker) in workers.iter().enumerate() {
            let mine: Vec<(u64, StreamId)> = pending
                .iter()
                .filter(|&&(_, _, by)| (by + 1) % 4 == w)
                .map(|&(p, s, _)| (p, s))
                .collect();
            let (a2, m2) = (a.clone(), m.clone());
            worker.run(move || {
                for (i, (p, s)) in mine.into_iter().enumerate() {
                    m2.lock().unwrap().free(p);
                    if i % 2 == 0 {
                        a2.free_on(p, s).unwrap();
                    } else {
                        a2.free(p).unwrap();
                    }
                }
            });
        }
        pending.clear();
        if round % 50 == 49 {
            for _ in 0..8 {
                let k = streams.pop_front().unwrap();
                sim.destroy_stream(0, handle(k));
                streams.push_back(next);
                next += 1;
            }
        }
        for (w, worker) in workers.iter().enumerate() {
            let mine: Vec<(usize, StreamId)> = streams
                .iter()
                .enumerate()
                .filter(|&(i, _)| i % 4 == w)
                .map(|(i, &k)| (i, handle(k)))
                .collect();
            let (a2, m2) = (a.clone(), m.clone());
            let made: Vec<(u64, StreamId)> = worker.run(move || {
                mine.into_iter()
                    .map(|(i, s)| {
                        let size = STREAM_SIZES[(i + round as usize) % STREAM_SIZES.len()];
                        // A temporary of the same size first: fronts see reuse.
                        let t = a2.malloc(size, s).unwrap();
                        m2.lock().unwrap().alloc(t, size);
                        m2.lock().unwrap().free(t);
                        a2.free(t).unwrap();
                        let p = a2.malloc(size, s).unwrap();
                        m2.lock().unwrap().alloc(p, size);
                        (p, s)
                    })
                    .collect()
            });
            pending.extend(made.into_iter().map(|(p, s)| (p, s, w)));
        }
        m.lock()
            .unwrap()
            .check_current(&a.stats().unwrap(), &format!("round {round}"));
        if round % 50 == 48 {
            a.empty_cache().unwrap();
            let s = a.stats().unwrap();
            marks.push((round, heap(), s.reserved_bytes.all().current));
        }
    }
    let c = sim.counters(0);
    assert_eq!(c.destroyed_stream_calls, 0, "{c:?}");
    let what = format!("(round, heap, reserved) after each empty_cache: {marks:?}");
    let (first, last) = (marks[3], *marks.last().unwrap());
    assert!(last.2 <= first.2, "reserved grew: {what}");
    assert!(last.1 - first.1 < 64 << 10, "the heap grew: {what}");
    for (p, _, _) in pending {
        m.lock().unwrap().free(p);
        a.free(p).unwrap();
    }
    drop(workers);
    let mut model = std::mem::take(&mut *m.lock().unwrap());
    all_back(&sim, &a, &mut model);
}

// ---------------------------------------------------------------------------------------
// Several devices, threads moving between them.
// ---------------------------------------------------------------------------------------

const DEVICES: usize = 4;

/// Four devices behind one `Runtime` (the C API's), three threads that each visit every
/// device in turn (as a data-parallel job's host threads switch `cudaSetDevice`), on three
/// streams a device: each thread allocates a step's tensors there (a temporary of each size
/// first, so fronts see reuse) and frees what another thread made there the step before.
/// With `per_stream_shards`, each thread frees into 12 shards, more than it keeps fronts
/// for. Checks, per device: statistics exact every step (peaks too with one shard); once
/// warm, reserved bytes flat and no driver call that makes memory (segments, address
/// ranges, physical chunks); and the heap flat.
fn threads_moving_between_devices(conf: &str) {
    let _one = serial();
    let sim = Arc::new(SimDriver::new(DEVICES, 2 << 30));
    let mut config = Config::default();
    config.apply(conf).unwrap();
    let rt = Arc::new(Runtime::with_sim(sim.clone(), config));
    let sharded = conf.contains("per_stream_shards:True");
    let models: Arc<Vec<Mutex<Model>>> = Arc::new((0..DEVICES).map(|_| Mutex::default()).collect());
    let workers: Vec<Worker> = (0..3).map(|_| Worker::new()).collect();
    let sizes = [8 * KIB, 300 * KIB, 3 * MIB, 1000];
    // Blocks of the last step: (device, ptr, thread that made it).
    let mut pending: Vec<(usize, u64, usize)> = Vec::new();
    let mut reserved = Vec::new();
    let mut calls = Vec::new();
    let mut heaps = Vec::new();
    const STEPS: usize = 400;
    for step in 0..STEPS {
        for (w, worker) in workers.iter().enumerate() {
            let frees: Vec<(usize, u64)> = pending
                .iter()
                .filter(|&&(_, _, by)| (by + 1) % 3 == w)
                .map(|&(d, p, _)| (d, p))
                .collect();
            let (rt2, m2) = (rt.clone(), models.clone());
            let made: Vec<(usize, u64)> = worker.run(move || {
                let mut made = Vec::new();
                for k in 0..DEVICES {
                    let d = (k + w + step) % DEVICES;
                    let stream = StreamId(1 + ((w + k) % 3) as u64);
                    for &(fd, p) in frees.iter().filter(|&&(fd, _)| fd == d) {
                        m2[fd].lock().unwrap().free(p);
                        rt2.free(p, fd as i64).unwrap();
                    }
                    for &size in &sizes {
                        let t = rt2.malloc(size, d as i64, stream).unwrap();
                        m2[d].lock().unwrap().alloc(t, size);
                        m2[d].lock().unwrap().free(t);
                        rt2.free(t, d as i64).unwrap();
                        let p = rt2.malloc(size, d as i64, stream).unwrap();
                        m2[d].lock().unwrap().alloc(p, size);
                        made.push((d, p));
                    }
                }
                made
            });
            pending.extend(made.into_iter().map(|(d, p)| (d, p, w)));
            pending.retain(|&(_, _, by)| (by + 1) % 3 != w || by == w);
        }
        let mut r = Vec::new();
        for d in 0..DEVICES {
            let s = rt.device(d as i64).unwrap().stats().unwrap();
            let m = models[d].lock().unwrap();
            let what = format!("step {step}, device {d} ({conf:?})");
            if sharded {
                m.check_current(&s, &what);
            } else {
                m.check(&s, &what);
            }
            r.push(s.reserved_bytes.all().current);
        }
        reserved.push(r);
        // Calls that make memory. (Pages still move between a device's streams each step:
        // on the sim moves cost no budget, so the slack stays at its floor; see
        // `training_loop`'s note in long_runs.rs.)
        calls.push(
            (0..DEVICES)
                .map(|d| sim.counters(d))
                .map(|c| c.allocate_calls + c.reserve_calls + c.physical_creates)
                .sum::<u64>(),
        );
        if step % 100 == 99 {
            heaps.push(heap());
        }
    }
    let warm = 20;
    assert_eq!(
        reserved[warm],
        *reserved.last().unwrap(),
        "{conf:?}: reserved per device after step {warm} and at the end"
    );
    let late: Vec<u64> = calls.windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(
        late[warm..].iter().sum::<u64>(),
        0,
        "{conf:?}: driver calls making memory per step: {:?}",
        &late[..60]
    );
    let grew = heaps.last().unwrap() - heaps[0];
    assert!(
        grew < 64 << 10,
        "{conf:?}: the heap grew by {grew}: {heaps:?}"
    );
    for (d, p, _) in pending {
        models[d].lock().unwrap().free(p);
        rt.free(p, d as i64).unwrap();
    }
    drop(workers);
    for d in 0..DEVICES {
        let a = rt.device(d as i64).unwrap();
        let mut m = std::mem::take(&mut *models[d].lock().unwrap());
        all_back(&sim, a, &mut m);
    }
}

#[test]
fn threads_moving_between_devices_settle() {
    threads_moving_between_devices("");
}

#[test]
fn threads_moving_between_devices_settle_with_shards() {
    threads_moving_between_devices("per_stream_shards:True");
}

// ---------------------------------------------------------------------------------------
// Settings changed through a long job, with OOM storms.
// ---------------------------------------------------------------------------------------

/// A training-like loop on one stream (a temporary and an output of each size, outputs
/// freed the next step) over 12 cycles of 60 steps. Each cycle, in turn: the memory
/// fraction drops to an eighth and an OOM storm follows (64 MiB blocks until refused, then
/// 40 more refused tries, on the loop's stream and a side one), the fraction goes back up,
/// and the settings move through `thread_cache`, `garbage_collection_threshold`,
/// `max_split_size_mb` and `expandable_segments` and back.
/// Checks: statistics exact every step, OOMs counted one per refused call; every refused
/// call is `OutOfMemory` and leaves the statistics as they were; every cycle after the
/// first ends with the same reserved bytes and segments (after the loop's own steps, before
/// any `empty_cache`), makes no more driver calls than the second one, and the heap stays
/// flat.
fn settings_and_oom_storms(conf: &str) {
    let _one = serial();
    let (sim, a) = allocator(1 << 30, conf);
    let sharded = conf.contains("per_stream_shards:True");
    let mut m = Model::default();
    let side = StreamId(0x80);
    let sizes = [512 * KIB, 2 * MIB, 96 * KIB, 6 * MIB + 4096, 3000];
    let weights: Vec<u64> = (0..4).map(|_| malloc(&a, &mut m, 8 * MIB, S0)).collect();
    let mut outs: Vec<u64> = Vec::new();
    let mut ooms = 0i64;
    let mut ends = Vec::new();
    let mut calls = Vec::new();
    let mut heaps = Vec::new();
    let check = |a: &DeviceAllocator, m: &Model, ooms: i64, what: &str| {
        let s = a.stats().unwrap();
        if sharded {
            m.check_current(&s, what);
        } else {
            m.check(&s, what);
        }
        assert_eq!(s.num_ooms as i64, ooms, "{what}: OOMs counted");
    };
    const CYCLES: usize = 12;
    for cycle in 0..CYCLES {
        let before = driver_calls(&sim.counters(0));
        for step in 0..60 {
            let what = format!("cycle {cycle}, step {step} ({conf:?})");
            match step {
                10 => {
                    a.set_memory_fraction(0.125).unwrap();
                    let mut storm = Vec::new();
                    let mut refused = 0;
                    for i in 0..200 {
                        let stream = if i % 2 == 0 { S0 } else { side };
                        let before = a.stats().unwrap();
                        match a.malloc(64 * MIB, stream) {
                            Ok(p) => {
                                m.alloc(p, 64 * MIB);
                                storm.push(p);
                            }
                            Err(e) => {
                                assert_eq!(e.kind, ErrorKind::OutOfMemory, "{what}: {e}");
                                ooms += 1;
                                refused += 1;
                                let after = a.stats().unwrap();
                                assert_eq!(
                                    (
                                        after.allocation.all().current,
                                        after.allocated_bytes.all().current
                                    ),
                                    (
                                        before.allocation.all().current,
                                        before.allocated_bytes.all().current
                                    ),
                                    "{what}: a refused call changed the statistics"
                                );
                                if refused == 40 {
                                    break;
                                }
                            }
                        }
                    }
                    assert!(refused == 40, "{what}: the storm got no OOM");
                    check(&a, &m, ooms, &format!("{what}, storm"));
                    for p in storm {
                        free(&a, &mut m, p);
                    }
                }
                20 => a.set_memory_fraction(1.0).unwrap(),
                25 => a.apply_config("thread_cache:False").unwrap(),
                30 => a
                    .apply_config("garbage_collection_threshold:0.5,max_split_size_mb:64")
                    .unwrap(),
                35 => a.apply_config("thread_cache:True").unwrap(),
                40 => a.apply_config("expandable_segments:False").unwrap(),
                45 => a.apply_config("expandable_segments:True").unwrap(),
                50 => {
                    // Back to the job's own settings (`ccalloc_reset_config`).
                    let mut c = Config::default();
                    c.apply(conf).unwrap();
                    a.set_config(c).unwrap();
                }
                _ => {}
            }
            let mut next = Vec::new();
            for &size in &sizes {
                let t = malloc(&a, &mut m, size, S0);
                next.push(malloc(&a, &mut m, size, S0));
                free(&a, &mut m, t);
            }
            for p in std::mem::replace(&mut outs, next) {
                free(&a, &mut m, p);
            }
            check(&a, &m, ooms, &what);
        }
        let s = a.stats().unwrap();
        ends.push((s.reserved_bytes.all().current, s.segment.all().current));
        calls.push(driver_calls(&sim.counters(0)) - before);
        heaps.push(heap());
    }
    let what = format!(
        "{conf:?}: (reserved, segments) at each cycle's end: {ends:?}; driver calls per \
         cycle: {calls:?}; heap: {heaps:?}"
    );
    assert!(ends[1..].iter().all(|e| *e == ends[1]), "{what}");
    assert!(calls[2..].iter().all(|c| c <= &calls[1]), "{what}");
    assert!(heaps.last().unwrap() - heaps[2] < 64 << 10, "{what}");
    for p in outs.into_iter().chain(weights) {
        free(&a, &mut m, p);
    }
    all_back(&sim, &a, &mut m);
}

#[test]
fn settings_changes_and_oom_storms_through_a_long_job() {
    settings_and_oom_storms("");
}

#[test]
fn settings_changes_and_oom_storms_through_a_long_job_with_shards() {
    settings_and_oom_storms("per_stream_shards:True");
}
