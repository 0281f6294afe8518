//! Long runs with PyTorch-like patterns: what may degrade only after a job has run a while.
//! A training loop whose forward and backward run on two threads (autograd's pattern), thread
//! pools whose threads come and go, peak resets mid-loop, streams made per request. Each
//! checks, against a model kept here, that the statistics stay exact (peaks included), and
//! that once in steady state nothing grows: reserved bytes, driver calls per step, the heap
//! the allocator keeps.
//! Every test is sequential (threads take turns through `Worker`), so each run is the same.
#![cfg(feature = "sim")]

use ccalloc::{DeviceAllocator, DeviceStats, StreamId};
use std::sync::{Arc, Mutex};

mod common;

use common::heap::{heap, serial};
use common::live::{driver_calls, sim_allocator as allocator, LiveModel};
use common::worker::Worker;

#[global_allocator]
static GLOBAL: common::heap::Counting = common::heap::Counting;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);

type Model = LiveModel;

impl Model {
    /// `check`, and with no `record_stream`, every live block active and nothing else.
    fn check_active(&self, s: &DeviceStats, what: &str) {
        self.check(s, what);
        for (name, got, want) in [
            ("active", s.active.all(), s.allocation.all()),
            (
                "active_bytes",
                s.active_bytes.all(),
                s.allocated_bytes.all(),
            ),
        ] {
            assert_eq!(
                (got.current, got.peak),
                (want.current, want.peak),
                "{what}: {name}"
            );
        }
    }
}

/// A shared model (jobs on workers update it).
type Shared = Arc<Mutex<Model>>;

fn malloc(a: &DeviceAllocator, m: &Shared, size: u64, stream: StreamId) -> u64 {
    let p = a.malloc(size, stream).unwrap();
    m.lock().unwrap().alloc(p, size);
    p
}

fn free(a: &DeviceAllocator, m: &Shared, p: u64) {
    m.lock().unwrap().free(p);
    a.free(p).unwrap();
}

/// A small network's sizes: parameters (weights and biases, small and large), and the
/// activations each layer keeps for backward.
const PARAMS: [u64; 10] = [
    4 * KIB,
    3 * MIB,
    2 * KIB,
    768 * KIB,
    1024,
    6 * MIB,
    4 * KIB,
    256 * KIB,
    300,
    12 * MIB + 4096,
];
const ACTIVATIONS: [u64; 8] = [
    512 * KIB,
    2 * MIB,
    2 * MIB,
    128 * KIB,
    MIB,
    64 * KIB,
    5 * MIB,
    16 * KIB,
];

/// One training step: forward on the main thread keeps activations; backward on autograd's
/// thread frees them (last first) and makes the gradients, with temporaries of activation
/// sizes; the optimizer (main thread) makes its state at the first step, with the sizes of
/// the gradients, and per parameter a temporary of its size; `zero_grad` (main thread)
/// frees the gradients backward made.
struct Training {
    a: Arc<DeviceAllocator>,
    m: Shared,
    main: Worker,
    autograd: Worker,
    stream: StreamId,
    state: Vec<u64>,
    steps: u64,
    /// Extras of a long job (bits): `RESETS` peaks reset each step between forward and
    /// backward (fronts then hold blocks), `RECORDS` an activation used on a side stream too
    /// (`record_stream`, as a collective does), `EMPTIES` `empty_cache` every 50 steps.
    extras: u8,
    /// Backward runs on a new thread each step (which exits, its front holding blocks).
    fresh_autograd: bool,
}

impl Training {
    fn new(a: Arc<DeviceAllocator>, stream: StreamId, extras: u8, fresh_autograd: bool) -> Self {
        let m: Shared = Arc::default();
        let main = Worker::new();
        let (a2, m2) = (a.clone(), m.clone());
        // The parameters, allocated once, on the main thread.
        main.run(move || {
            for size in PARAMS {
                malloc(&a2, &m2, size, stream);
            }
        });
        Self {
            a,
            m,
            main,
            autograd: Worker::new(),
            stream,
            state: Vec::new(),
            steps: 0,
            extras,
            fresh_autograd,
        }
    }

    fn step(&mut self) {
        let (a, m, s) = (self.a.clone(), self.m.clone(), self.stream);
        let acts: Vec<u64> = self.main.run(move || {
            ACTIVATIONS
                .iter()
                .map(|&size| {
                    // Each layer also makes and drops a temporary of its output's size.
                    let t = malloc(&a, &m, size, s);
                    let out = malloc(&a, &m, size, s);
                    free(&a, &m, t);
                    out
                })
                .collect()
        });
        if self.extras & RECORDS != 0 {
            self.a.record_stream(acts[3], StreamId(9)).unwrap();
        }
        if self.extras & RESETS != 0 {
            // Fronts hold the forward's temporaries: the new peaks are what is live now.
            self.a.reset_peak_stats().unwrap();
            self.m.lock().unwrap().figures.reset_peaks();
            self.check(&format!("peak reset at step {}", self.steps));
        }
        if self.fresh_autograd {
            self.autograd = Worker::new();
        }
        let (a, m) = (self.a.clone(), self.m.clone());
        let grads: Vec<u64> = self.autograd.run(move || {
            let mut grads = Vec::new();
            for (i, &p) in acts.iter().enumerate().rev() {
                // The gradient of this layer's input, a temporary of its size.
                let g = malloc(&a, &m, ACTIVATIONS[i], s);
                free(&a, &m, p);
                free(&a, &m, g);
            }
            for size in PARAMS {
                grads.push(malloc(&a, &m, size, s));
            }
            grads
        });
        let (a, m) = (self.a.clone(), self.m.clone());
        let first = self.state.is_empty();
        let new_state: Vec<u64> = self.main.run(move || {
            let mut state = Vec::new();
            for &size in &PARAMS {
                if first {
                    // exp_avg and exp_avg_sq.
                    state.push(malloc(&a, &m, size, s));
                    state.push(malloc(&a, &m, size, s));
                }
                let t = malloc(&a, &m, size, s);
                free(&a, &m, t);
            }
            // zero_grad(set_to_none=True): the gradients go, from this thread.
            for g in grads {
                free(&a, &m, g);
            }
            state
        });
        self.state.extend(new_state);
        self.steps += 1;
        if self.extras & EMPTIES != 0 && self.steps.is_multiple_of(50) {
            self.a.empty_cache().unwrap();
        }
    }

    fn check(&self, what: &str) {
        let s = self.a.stats().unwrap();
        self.m.lock().unwrap().check_active(&s, what);
    }
}

/// Runs a training loop under `conf`; after every step the statistics match the model; once
/// warm, reserved bytes stay as they were and no step makes a driver call.
const RESETS: u8 = 1;
const RECORDS: u8 = 2;
const EMPTIES: u8 = 4;

fn training_loop(conf: &str, extras: u8, fresh_autograd: bool) {
    let _one = serial();
    let (sim, a) = allocator(4 << 30, conf);
    let mut t = Training::new(a.clone(), S0, extras, fresh_autograd);
    let mut reserved = Vec::new();
    let mut calls = Vec::new();
    for step in 0..400 {
        t.step();
        t.check(&format!("step {step} ({conf:?})"));
        reserved.push(a.stats().unwrap().reserved_bytes.all().current);
        calls.push(driver_calls(&sim.counters(0)));
    }
    // Steady state from step 10 at the latest: nothing reserved, nothing asked of the driver.
    let warm = 10;
    if extras & EMPTIES != 0 {
        // empty_cache every 50 steps: after each, the loop warms up again. No window costs
        // more driver calls than the first ones did, nor reserves more. (Some windows settle
        // with no call at all, others move 4-5 chunks a step for good: reserved is over
        // peak live plus the slack in both, and on the sim moves cost no budget.)
        let per_window: Vec<u64> = calls.chunks(50).map(|w| w[w.len() - 1] - w[0]).collect();
        let first = per_window[..4].iter().max().unwrap();
        assert!(
            per_window.iter().all(|c| c <= first),
            "driver calls per 50 steps: {per_window:?}"
        );
        let most = reserved[..100].iter().max().unwrap();
        assert!(
            reserved.iter().all(|r| r <= most),
            "reserved grew past {most}: {reserved:?}"
        );
        return;
    }
    assert_eq!(
        reserved[warm],
        *reserved.last().unwrap(),
        "reserved after step {warm} and at the end ({conf:?}): {:?}",
        &reserved[..40]
    );
    let late: Vec<u64> = calls.windows(2).map(|w| w[1] - w[0]).collect();
    let since_warm: u64 = late[warm..].iter().sum();
    assert_eq!(
        since_warm,
        0,
        "driver calls per step after step {warm} ({conf:?}): {:?}",
        &late[..40.min(late.len())]
    );
    // Reserved over live stays bounded once warm.
    let live = t.m.lock().unwrap().figures.peak[1][0];
    assert!(
        *reserved.last().unwrap() <= 2 * live + (40 << 20),
        "reserved {} for a peak of {live} live",
        reserved.last().unwrap()
    );
}

#[test]
fn a_training_loop_with_autograd_on_its_own_thread_settles() {
    training_loop("", 0, false);
}

#[test]
fn a_training_loop_settles_with_a_shard_per_stream() {
    training_loop("per_stream_shards:True", 0, false);
}

#[test]
fn a_training_loop_settles_without_fronts() {
    training_loop("thread_cache:False", 0, false);
}

#[test]
fn a_training_loop_with_peak_resets_recorded_streams_and_empty_cache_stays_exact() {
    training_loop("", RESETS | RECORDS | EMPTIES, false);
}

#[test]
fn a_training_loop_whose_backward_runs_on_a_new_thread_each_step_settles() {
    training_loop("", 0, true);
}

/// A thread per request (Python's `ThreadingHTTPServer`, a pool that recycles its threads):
/// each frees, on its own thread, what the main thread allocated for it, then exits. What a
/// thread leaves behind (its front, or its place in the fronts' registry) must not pile up:
/// after the first few hundred threads, the allocator's heap stays flat, and the statistics
/// and reserved bytes stay exact and flat. `how` picks the request's block:
/// - "small": a 64 KiB block, adopted into the exiting thread's front;
/// - "recorded": a 64 KiB block also used on a side stream (`record_stream`), which no front
///   takes;
/// - "large": a 4 MiB block (no front takes one with a shard per stream).
fn thread_per_request(conf: &str, how: &str) {
    let _one = serial();
    let (sim, a) = allocator(4 << 30, conf);
    let m: Shared = Arc::default();
    let size = if how == "large" { 4 * MIB } else { 64 * KIB };
    // Weights, live throughout.
    let weights: Vec<u64> = (0..4).map(|_| malloc(&a, &m, 256 * KIB, S0)).collect();
    let mut heaps = Vec::new();
    let mut reserved = Vec::new();
    const ROUNDS: usize = 3000;
    for round in 0..ROUNDS {
        let p = malloc(&a, &m, size, S0);
        if how == "recorded" {
            a.record_stream(p, StreamId(7)).unwrap();
        }
        let (a2, m2) = (a.clone(), m.clone());
        std::thread::spawn(move || free(&a2, &m2, p))
            .join()
            .unwrap();
        if round % 500 == 499 {
            let s = a.stats().unwrap();
            // Recorded blocks leave requested bytes when their events are seen done.
            if how != "recorded" {
                m.lock()
                    .unwrap()
                    .check_active(&s, &format!("round {round}"));
            }
            heaps.push(heap());
            reserved.push(s.reserved_bytes.all().current);
        }
    }
    let grew = heaps.last().unwrap() - heaps[0];
    // A snapshot drains the fronts (and folds the exited threads'): what it gives back is
    // what the registry kept.
    let before = heap();
    drop(a.segments().unwrap());
    let drained = before - heap();
    assert!(
        grew < 64 << 10,
        "{conf:?}, {how}: the heap grew by {grew} bytes over {} threads after the first 500 \
         (heap at each 500: {heaps:?}); a drain (segments()) then gave back {drained} bytes",
        ROUNDS - 500
    );
    assert_eq!(reserved[0], *reserved.last().unwrap(), "{reserved:?}");
    for w in weights {
        free(&a, &m, w);
    }
    a.empty_cache().unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(s.reserved_bytes.all().current, 0);
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn threads_that_exit_holding_a_freed_block_leave_nothing_behind() {
    thread_per_request("", "small");
}

/// No front takes a recorded block: each exiting thread's front is empty and never counted
/// a block, and must leave the registry with its thread (nothing in this loop drains).
#[test]
fn threads_that_free_a_recorded_block_and_exit_leave_nothing_behind() {
    thread_per_request("", "recorded");
}

/// `front::with_adopter` registers the thread's front before `Shard::adopt` finds the block
/// ineligible (large, with a shard per stream): the empty front must leave with its thread,
/// since `Shard::drain_fronts` (growth, peak passes, resets, snapshots, `empty_cache`) may
/// never run in a steady state like this one.
#[test]
fn threads_that_free_a_large_block_and_exit_leave_nothing_behind_with_shards() {
    thread_per_request("per_stream_shards:True", "large");
}

#[test]
fn threads_that_free_and_exit_leave_nothing_behind_without_fronts() {
    thread_per_request("thread_cache:False", "recorded");
}

/// A stream per request, destroyed once the request is done (after its blocks are freed),
/// with `empty_cache` every 100 requests (`empty` ones). The allocator never calls the
/// driver on a destroyed stream; reserved bytes stay flat; and what it keeps per stream
/// does not pile up past an `empty_cache`: reservations and heap, read just after one, stay
/// flat after the first few hundred streams. (Between two, each new stream reserves address
/// ranges of its own, as PyTorch's expandable segments do: not checked.)
fn stream_per_request(conf: &str) {
    let _one = serial();
    let (sim, a) = allocator(4 << 30, conf);
    let sharded = conf.contains("per_stream_shards:True");
    let m: Shared = Arc::default();
    let weights: Vec<u64> = (0..4).map(|_| malloc(&a, &m, 3 * MIB, S0)).collect();
    const ROUNDS: u64 = 2000;
    let stream = |round: u64| StreamId(0x1000 + round * 0x40);
    // The sim keeps a record of every stream it saw (destroyed ones too): made up front, so
    // that the heap figures below are the allocator's.
    for round in 0..ROUNDS {
        sim.set_stream_paused(0, stream(round), false);
    }
    let mut marks = Vec::new();
    for round in 0..ROUNDS {
        let s = stream(round);
        let x = malloc(&a, &m, 64 * KIB, s);
        let y = malloc(&a, &m, 3 * MIB, s);
        let t = malloc(&a, &m, 64 * KIB, s);
        free(&a, &m, t);
        let t = malloc(&a, &m, 64 * KIB, s);
        free(&a, &m, t);
        free(&a, &m, y);
        free(&a, &m, x);
        sim.destroy_stream(0, s);
        if round % 100 == 99 {
            a.empty_cache().unwrap();
            let st = a.stats().unwrap();
            let model = m.lock().unwrap();
            if sharded {
                // Peaks with several shards are the sum of theirs (`DeviceAllocator::stats`).
                for (got, want) in [
                    (st.allocation.all().current, model.figures.current[0][0]),
                    (
                        st.allocated_bytes.all().current,
                        model.figures.current[1][0],
                    ),
                    (
                        st.requested_bytes.all().current,
                        model.figures.current[2][0],
                    ),
                ] {
                    assert_eq!(got, want, "round {round}");
                }
            } else {
                model.check_active(&st, &format!("round {round}"));
            }
            drop(model);
            let c = sim.counters(0);
            marks.push((
                round,
                heap(),
                st.reserved_bytes.all().current,
                c.live_reservations,
            ));
        }
    }
    let c = sim.counters(0);
    assert_eq!(c.destroyed_stream_calls, 0, "{conf:?}: {c:?}");
    let (first, last) = (marks[3], *marks.last().unwrap());
    let what = format!(
        "{conf:?}: (round, heap, reserved, reservations) after each empty_cache: {marks:?}"
    );
    assert!(last.2 <= first.2, "reserved grew: {what}");
    assert!(last.3 <= first.3, "reservations grew: {what}");
    assert!(last.1 - first.1 < 64 << 10, "the heap grew: {what}");
    for w in weights {
        free(&a, &m, w);
    }
}

#[test]
fn a_stream_per_request_leaves_nothing_behind() {
    stream_per_request("");
}

/// What fences remember per stream (`paging::fences`: the newest free known done, when a
/// fence was last recorded) must not keep an entry per stream ever seen; with shards,
/// lending waits on other shards' fences, so each stream reaches every shard.
#[test]
fn a_stream_per_request_leaves_nothing_behind_with_shards() {
    stream_per_request("per_stream_shards:True");
}

#[test]
fn a_training_loop_with_peak_resets_recorded_streams_and_empty_cache_stays_exact_without_fronts() {
    training_loop("thread_cache:False", RESETS | RECORDS | EMPTIES, false);
}

/// One thread that frees into more shards than it keeps fronts for (a front per shard, at
/// most 8 a thread): each visit past the eighth gives up the front it used longest ago, and
/// the next visit to that shard makes a new one. Those given up hold blocks, so only a drain
/// of their shard folds them, and a steady loop may never drain: the heap must stay flat all
/// the same, and the current statistics exact (with shards, peaks are upper bounds:
/// docs/design.md, Shards). And with a few KiB live in twelve shards, pages must not go
/// round them: each shard keeps one, whatever the slack.
#[test]
fn a_thread_freeing_into_more_shards_than_it_keeps_fronts_for_leaves_nothing_behind() {
    let _one = serial();
    let (sim, a) = allocator(4 << 30, "per_stream_shards:True");
    let streams: Vec<StreamId> = (1..=12).map(StreamId).collect();
    let round = |k: usize| {
        for (i, &s) in streams.iter().enumerate() {
            let p = a.malloc(4 * KIB * (1 + ((i + k) % 3) as u64), s).unwrap();
            a.free(p).unwrap();
        }
    };
    let mut heaps = Vec::new();
    for k in 0..1500 {
        round(k);
        if k % 500 == 499 {
            let s = a.stats().unwrap();
            for (name, stat) in [
                ("allocation", s.allocation.all()),
                ("allocated_bytes", s.allocated_bytes.all()),
                ("active_bytes", s.active_bytes.all()),
                ("requested_bytes", s.requested_bytes.all()),
            ] {
                assert_eq!(stat.current, 0, "round {k}: {name}");
            }
            assert_eq!(s.allocation.all().allocated, 12 * (k as i64 + 1));
            heaps.push(heap());
        }
    }
    let grew = heaps.last().unwrap() - heaps[0];
    assert!(
        grew < 64 << 10,
        "the heap grew by {grew} bytes over 1,000 rounds (at each 500: {heaps:?})"
    );
    // Each shard keeps its page: once every stream has one, no growth moves another's.
    let paging = a.stats().unwrap().paging;
    assert_eq!(
        (paging.growths, paging.chunks_borrowed, paging.host_waits),
        (12, 0, 0),
        "{paging:?}"
    );
    a.empty_cache().unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(s.reserved_bytes.all().current, 0);
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}
