//! Thread fronts (`alloc::front`): each thread's cache of blocks it freed, served without
//! the device lock. What must hold: statistics exact (peaks included) against a model,
//! no block handed out twice, double frees refused from any thread, cross-stream use still
//! waited for, captures never served from a front, and held memory given back by
//! `empty_cache` and by threads that exit.
#![cfg(feature = "sim")]

use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, DeviceStats, ErrorKind, StreamId};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::Arc;

mod common;

use common::figures::{rounded, PoolFigures};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);
/// The settings the single-stream tests run under: one shard, and a shard per stream.
const CONFS: [&str; 2] = ["", "per_stream_shards:True"];

fn allocator(capacity: u64, conf: &str) -> (Arc<SimDriver>, DeviceAllocator) {
    let sim = Arc::new(SimDriver::new(1, capacity));
    let mut config = Config::default();
    config.apply(conf).unwrap();
    let a = DeviceAllocator::new(0, sim.clone(), config).unwrap();
    (sim, a)
}

/// A 4 KiB block on S0 that this thread's front hands out: allocated, freed (the front
/// holds it), and allocated again.
fn from_front(a: &DeviceAllocator) -> u64 {
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(4096, S0).unwrap();
    assert_eq!(q, p, "handed out by the front");
    q
}

/// The model's figures: per pool (`common::figures`), and the allocations ever made.
#[derive(Clone, Copy, Default, Debug)]
struct Figures {
    pools: PoolFigures,
    allocations: i64,
}

impl Figures {
    fn change(&mut self, size: u64, sign: i64) {
        self.change_stats(size, sign, &[0, 1, 2]);
    }

    /// Changes only the listed statistics (0 count, 1 bytes, 2 requested).
    fn change_stats(&mut self, size: u64, sign: i64, stats: &[usize]) {
        self.pools.change(size, rounded(size), sign, stats);
        if sign > 0 && stats.contains(&0) {
            self.allocations += 1;
        }
    }

    fn check(&self, s: &DeviceStats, what: &str) {
        self.pools.check(s, what);
        assert_eq!(s.allocation.all().allocated, self.allocations);
        assert!(s.active_bytes.all().current >= s.allocated_bytes.all().current);
        assert!(s.active_bytes.all().peak >= s.active_bytes.all().current);
    }
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: u64,
        stream: bool,
    },
    Free {
        pick: usize,
    },
    /// The free comes from another thread (with a front of its own).
    FreeElsewhere {
        pick: usize,
    },
    /// A pointer freed earlier and not handed out again: refused, nothing changes.
    DoubleFree {
        pick: usize,
    },
    RecordStream {
        pick: usize,
    },
    EmptyCache,
    ResetPeaks,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    // Few sizes, so that frees are often followed by a request of the same size.
    let size = prop::sample::select(vec![700, 4096, 4096 * 3, MIB + 1, 3 * MIB, 40 * MIB]);
    prop_oneof![
        8 => (size, any::<bool>()).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        6 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => any::<usize>().prop_map(|pick| Op::FreeElsewhere { pick }),
        1 => any::<usize>().prop_map(|pick| Op::DoubleFree { pick }),
        1 => any::<usize>().prop_map(|pick| Op::RecordStream { pick }),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::ResetPeaks),
    ]
}

fn run(ops: Vec<Op>) {
    let (sim, a) = allocator(1 << 30, "");
    let mut model = Figures::default();
    // Live blocks by address: (end, requested size).
    let mut live: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    let mut freed: Vec<u64> = Vec::new();
    // Blocks recorded on another stream; freed ones keep their requested bytes until their
    // events are seen done (at the next allocation, or empty_cache).
    let mut recorded: Vec<u64> = Vec::new();
    let mut awaiting: Vec<u64> = Vec::new();
    let pick =
        |live: &BTreeMap<u64, (u64, u64)>, i: usize| live.keys().nth(i % live.len()).copied();
    for (i, op) in ops.into_iter().enumerate() {
        let what = format!("op {i} {op:?}");
        match op {
            Op::Alloc { size, stream } => {
                let ptr = a.malloc(size, if stream { S1 } else { S0 }).unwrap();
                let end = ptr + rounded(size);
                // Never a block that overlaps a live one (a front handing out twice would).
                let before = live.range(..end).next_back();
                assert!(
                    before.is_none_or(|(_, &(e, _))| e <= ptr),
                    "{ptr:#x} overlaps a live block"
                );
                live.insert(ptr, (end, size));
                freed.retain(|&f| f != ptr);
                model.change(size, 1);
            }
            Op::Free { pick: i } | Op::FreeElsewhere { pick: i } if !live.is_empty() => {
                let ptr = pick(&live, i).unwrap();
                let (_, size) = live.remove(&ptr).unwrap();
                if matches!(op, Op::Free { .. }) {
                    a.free(ptr).unwrap();
                } else {
                    std::thread::scope(|s| s.spawn(|| a.free(ptr).unwrap()).join().unwrap());
                }
                freed.push(ptr);
                if recorded.contains(&ptr) {
                    recorded.retain(|&r| r != ptr);
                    awaiting.push(size);
                    model.pools.requested_unknown = true;
                    model.change_stats(size, -1, &[0, 1]);
                } else {
                    model.change(size, -1);
                }
            }
            Op::DoubleFree { pick } if !freed.is_empty() => {
                let ptr = freed[pick % freed.len()];
                let before = a.stats().unwrap();
                let kind = a.free(ptr).unwrap_err().kind;
                assert!(
                    matches!(kind, ErrorKind::DoubleFree | ErrorKind::UnknownPointer),
                    "{kind:?}"
                );
                assert_eq!(
                    a.stats().unwrap(),
                    before,
                    "a refused free changed the stats"
                );
            }
            Op::RecordStream { pick: i } if !live.is_empty() => {
                let ptr = pick(&live, i).unwrap();
                a.record_stream(ptr, StreamId(9)).unwrap();
                recorded.push(ptr);
            }
            Op::EmptyCache => {
                a.empty_cache().unwrap();
                for size in awaiting.drain(..) {
                    model.change_stats(size, -1, &[2]);
                }
            }
            Op::ResetPeaks => {
                a.reset_peak_stats().unwrap();
                model.pools.reset_peaks();
                // Known again once nothing waits (from empty_cache) and the peaks restart.
                model.pools.requested_unknown &= !awaiting.is_empty();
            }
            _ => {}
        }
        model.check(&a.stats().unwrap(), &what);
    }
    for (ptr, _) in std::mem::take(&mut live) {
        a.free(ptr).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(
        sim.counters(0).bytes_in_use,
        0,
        "held blocks were given back"
    );
    assert_eq!(a.stats().unwrap().allocation.all().current, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn statistics_and_peaks_stay_exact(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run(ops);
    }
}

#[test]
fn a_same_size_loop_reuses_one_block_and_peaks_stay_true() {
    for conf in CONFS {
        let (sim, a) = allocator(1 << 30, conf);
        let p = a.malloc(4096, S0).unwrap();
        a.free(p).unwrap();
        let calls = sim.counters(0);
        for _ in 0..1000 {
            let q = a.malloc(4096, S0).unwrap();
            assert_eq!(q, p);
            a.free(q).unwrap();
        }
        assert_eq!(sim.counters(0).maps, calls.maps);
        // The held 4 KiB block counts as free: a larger request now peaks at its own size.
        let big = a.malloc(8192, S0).unwrap();
        let s = a.stats().unwrap();
        assert_eq!(s.allocated_bytes.all().peak, 8192);
        assert_eq!(s.allocated_bytes.all().current, 8192);
        assert_eq!(s.allocation.all().allocated, 1002);
        a.free(big).unwrap();
    }
}

#[test]
fn double_frees_through_a_front_are_refused_from_any_thread() {
    for conf in CONFS {
        let (_sim, a) = allocator(1 << 30, conf);
        let q = from_front(&a);
        a.free(q).unwrap();
        let before = a.stats().unwrap();
        assert_eq!(a.free(q).unwrap_err().kind, ErrorKind::DoubleFree);
        let elsewhere =
            std::thread::scope(|s| s.spawn(|| a.free(q).unwrap_err().kind).join().unwrap());
        assert_eq!(elsewhere, ErrorKind::DoubleFree);
        assert_eq!(
            a.record_stream(q, S1).unwrap_err().kind,
            ErrorKind::DoubleFree
        );
        assert_eq!(a.stats().unwrap(), before);
    }
}

#[test]
fn a_block_handed_out_by_a_front_may_be_freed_by_another_thread() {
    for conf in CONFS {
        let (_sim, a) = allocator(1 << 30, conf);
        let q = from_front(&a);
        std::thread::scope(|s| s.spawn(|| a.free(q).unwrap()).join().unwrap());
        // Freed for good: this thread's front no longer has it.
        assert_eq!(a.free(q).unwrap_err().kind, ErrorKind::DoubleFree);
        let s = a.stats().unwrap();
        assert_eq!(s.allocation.all().current, 0);
        assert_eq!(s.allocated_bytes.all().current, 0);
        assert_eq!(s.requested_bytes.all().current, 0);
    }
}

#[test]
fn a_block_recorded_on_another_stream_waits_for_it_after_a_front_served_it() {
    for conf in CONFS {
        let (sim, a) = allocator(1 << 30, conf);
        let q = from_front(&a);
        a.record_stream(q, S1).unwrap();
        sim.set_stream_paused(0, S1, true);
        a.free(q).unwrap();
        // S1 has not run: the block must not come back yet.
        let r = a.malloc(4096, S0).unwrap();
        assert_ne!(r, q);
        sim.set_stream_paused(0, S1, false);
        a.free(r).unwrap();
    }
}

#[test]
fn empty_cache_and_exiting_threads_give_held_blocks_back() {
    for conf in CONFS {
        let (sim, a) = allocator(1 << 30, conf);
        std::thread::scope(|s| {
            s.spawn(|| {
                for _ in 0..3 {
                    let p = a.malloc(40 * MIB, S0).unwrap();
                    a.free(p).unwrap();
                }
            });
        });
        // The thread is gone; its front still held the block.
        a.empty_cache().unwrap();
        assert_eq!(sim.counters(0).bytes_in_use, 0);
        let s = a.stats().unwrap();
        assert_eq!(s.allocation.all().allocated, 3);
        assert_eq!(s.allocation.all().freed, 3);
        assert_eq!(s.allocated_bytes.all().current, 0);
        // This thread's held block goes back too.
        let p = a.malloc(40 * MIB, S0).unwrap();
        a.free(p).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(sim.counters(0).bytes_in_use, 0);
        a.shutdown().unwrap();
    }
}

/// A worker frees its blocks on its own stream, destroys the stream and exits; its front
/// still holds the blocks. Freeing them later (another thread's growth drains the fronts)
/// must make no driver call on the destroyed stream: without fronts none is made either.
/// With one shard (`thread_shards:False`) the worker's front is for the shard that grows;
/// with the default the worker, new to the device, gets a shard of its own for its stream.
#[test]
fn blocks_left_in_a_front_are_freed_without_touching_their_destroyed_stream() {
    for conf in [
        "thread_shards_on_contention:False,thread_cache:False",
        "thread_shards:False",
        "thread_shards_on_contention:False",
        "per_stream_shards:True",
    ] {
        let (sim, a) = allocator(1 << 30, conf);
        let keep = a.malloc(MIB, S1).unwrap();
        let worker = StreamId(0x7000);
        std::thread::scope(|s| {
            s.spawn(|| {
                let p = a.malloc(4096, worker).unwrap();
                let q = a.malloc(8192, worker).unwrap();
                a.free(p).unwrap();
                a.free(q).unwrap();
                sim.destroy_stream(0, worker);
            });
        });
        let one_shard = conf == "thread_shards:False";
        assert_eq!(a.shards_made() == 1, one_shard, "{conf:?}");
        let big = a.malloc(64 * MIB, S1).unwrap();
        a.free(big).unwrap();
        a.free(keep).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(
            sim.counters(0).destroyed_stream_calls,
            0,
            "{conf:?}: a driver call on the destroyed stream"
        );
        let s = a.stats().unwrap();
        assert_eq!(s.allocated_bytes.all().current, 0, "{conf:?}");
        assert_eq!(s.allocation.all().allocated, 4, "{conf:?}");
        a.shutdown().unwrap();
    }
}

#[test]
fn a_capture_is_never_served_from_a_front() {
    for conf in CONFS {
        let (_sim, a) = allocator(1 << 30, conf);
        let p = a.malloc(4096, S0).unwrap();
        a.free(p).unwrap();
        a.begin_allocate_to_pool((1, 1), Box::new(|s| s == S0))
            .unwrap();
        let q = a.malloc(4096, S0).unwrap();
        assert_ne!(q, p, "the capture's block comes from its private pool");
        let segment = a
            .segments()
            .unwrap()
            .into_iter()
            .find(|s| s.blocks.iter().any(|b| b.0 == q))
            .unwrap();
        assert_eq!(segment.private_pool, Some((1, 1)));
        a.free(q).unwrap();
        a.end_allocate_to_pool((1, 1)).unwrap();
        a.release_pool((1, 1)).unwrap();
        // Open again after the capture.
        let r = a.malloc(4096, S0).unwrap();
        a.free(r).unwrap();
        assert_eq!(a.malloc(4096, S0).unwrap(), r);
    }
}

#[test]
fn shutdown_counts_only_the_callers_blocks() {
    for conf in CONFS {
        let (_sim, a) = allocator(1 << 30, conf);
        let q = from_front(&a);
        // Handed out by the front: live, so shutdown is refused.
        assert_eq!(a.shutdown().unwrap_err().kind, ErrorKind::Busy);
        a.free(q).unwrap();
        // Held by the front: free, so shutdown goes ahead.
        a.shutdown().unwrap();
        assert_eq!(a.malloc(4096, S0).unwrap_err().kind, ErrorKind::ShutDown);
    }
}

#[test]
fn a_same_size_loop_of_large_blocks_is_served_by_the_front() {
    for conf in CONFS {
        for size in [32 * MIB, 512 * MIB] {
            let (sim, a) = allocator(4 << 30, conf);
            let p = a.malloc(size, S0).unwrap();
            a.free(p).unwrap();
            let calls = sim.counters(0);
            for _ in 0..1000 {
                let q = a.malloc(size, S0).unwrap();
                assert_eq!(q, p);
                a.free(q).unwrap();
            }
            assert_eq!(sim.counters(0).maps, calls.maps);
            let s = a.stats().unwrap();
            assert_eq!(s.allocated_bytes.all().current, 0, "{conf} {size}");
            assert_eq!(s.allocated_bytes.all().peak, size as i64);
            assert_eq!(s.allocation.all().allocated, 1001);
            // Held in the front, it is still freed once only.
            assert_eq!(a.free(p).unwrap_err().kind, ErrorKind::DoubleFree);
            let other =
                std::thread::scope(|s| s.spawn(|| a.free(p).unwrap_err().kind).join().unwrap());
            assert_eq!(other, ErrorKind::DoubleFree);
        }
    }
}

/// A large block waits in its thread's front only until that thread next visits the shard:
/// then it is the shard's, as if freed there at once, and a smaller request is cut from it
/// instead of mapping more.
#[test]
fn a_large_block_held_by_a_front_goes_back_at_its_threads_next_visit() {
    for conf in CONFS {
        let (sim, a) = allocator(4 << 30, conf);
        let p = a.malloc(32 * MIB, S0).unwrap();
        a.free(p).unwrap();
        let maps = sim.counters(0).maps;
        let q = a.malloc(16 * MIB, S0).unwrap();
        assert_eq!(q, p, "{conf}: cut from the returned block");
        assert_eq!(sim.counters(0).maps, maps, "{conf}: nothing mapped");
        a.free(q).unwrap();
    }
}

/// Another thread's request never waits on memory a front holds: a large request that the
/// cache cannot serve takes held blocks back first, so it gets a block some thread keeps
/// as it is (PyTorch's autograd thread frees, the main thread allocates), with no driver
/// call and no more reserved memory.
#[test]
fn a_large_block_another_thread_holds_does_not_cost_memory() {
    for conf in CONFS {
        let (sim, a) = allocator(4 << 30, conf);
        let p = a.malloc(256 * MIB, S0).unwrap();
        a.free(p).unwrap();
        let reserved = a.stats().unwrap().reserved_bytes.all().current;
        let before = sim.counters(0);
        let q =
            std::thread::scope(|s| s.spawn(|| a.malloc(256 * MIB, S0).unwrap()).join().unwrap());
        let after = sim.counters(0);
        assert_eq!(
            a.stats().unwrap().reserved_bytes.all().current,
            reserved,
            "{conf}"
        );
        assert_eq!(q, p, "{conf}: the held block, as it is");
        assert_eq!(
            (after.maps, after.unmaps, after.allocate_calls),
            (before.maps, before.unmaps, before.allocate_calls),
            "{conf}"
        );
        a.free(q).unwrap();
    }
}

/// Growth that takes the pages of a large block a front held waits for the device no more
/// than if the block had been parked at its free: the front stamps the block's free on its
/// pages when it adopts it, with the fence a free records, while its stream is known to be
/// alive; frees the front served after that count in the fences' cadence when the block
/// goes back. `reuses`: same-size pairs served before the growth (by the front, or by
/// parking). (Not covered: a block reused in the front and taken back by a visit on
/// another stream, where no fence can be recorded for the frees the front served.)
#[test]
fn growth_waits_for_a_large_block_a_front_held_as_for_a_parked_one() {
    // (stream of the freed block, stream of the growth, whether the first is busy, reuses).
    let cases = [
        (S0, S0, false, 0),
        (S0, S0, false, 3),
        // The 17th free is due a fence (one in 16 per segment).
        (S0, S0, false, 16),
        (S1, S0, false, 0),
        (S1, S0, true, 0),
        (S1, S0, true, 3),
    ];
    for (freed_on, grown_on, busy, reuses) in cases {
        let waits = ["", "thread_cache:False"].map(|conf| {
            let (sim, a) = allocator(1 << 30, conf);
            let hole = a.malloc(40 * MIB, freed_on).unwrap();
            let keep = a.malloc(4 * MIB, freed_on).unwrap();
            sim.set_stream_paused(0, freed_on, busy);
            a.free(hole).unwrap();
            for _ in 0..reuses {
                let again = a.malloc(40 * MIB, freed_on).unwrap();
                assert_eq!(again, hole);
                a.free(again).unwrap();
            }
            let big = a.malloc(60 * MIB, grown_on).unwrap();
            let c = sim.counters(0);
            assert!(c.granules_unmapped >= 10, "pages moved from the hole");
            sim.set_stream_paused(0, freed_on, false);
            a.free(big).unwrap();
            a.free(keep).unwrap();
            (c.synchronize_calls, c.event_waits)
        });
        let case = format!("freed on {freed_on:?}, grown on {grown_on:?}, busy {busy}");
        assert_eq!(waits[0], waits[1], "{case}, {reuses} reuses");
        if reuses == 0 || reuses == 16 {
            // A fence recorded at the last free covers it: never the whole device.
            assert_eq!(waits[0].0, 0, "{case}");
        }
    }
}

/// Runs `then` on the calling thread while another thread, alive throughout, holds in its
/// front one freed block of each of `sizes` (on S0); the holder then exits.
fn while_held<R>(a: &DeviceAllocator, sizes: &[u64], then: impl FnOnce(&[u64]) -> R) -> R {
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let (done, done_rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            let ptrs: Vec<u64> = sizes.iter().map(|&n| a.malloc(n, S0).unwrap()).collect();
            for &p in &ptrs {
                a.free(p).unwrap();
            }
            ready_tx.send(ptrs).unwrap();
            let _ = done_rx.recv();
        });
        let held = ready.recv().unwrap();
        let result = then(&held);
        drop(done);
        result
    })
}

/// Memory held in another (live) thread's front is the cache's: a request that needs it
/// gets it, whether it fits the held block or needs more than it, with a limit or without,
/// plain segments or paged.
#[test]
fn a_request_needing_memory_other_threads_hold_never_fails() {
    for conf in ["", "expandable_segments:False"] {
        // (held sizes, request, capacity).
        let cases: [(&[u64], u64, u64); 4] = [
            (&[40 * MIB], 40 * MIB + 4096, 64 * MIB),
            (&[40 * MIB], 48 * MIB, 64 * MIB),
            (&[40 * MIB], 24 * MIB, 40 * MIB),
            (&[20 * MIB, 20 * MIB], 50 * MIB, 64 * MIB),
        ];
        for (held, request, capacity) in cases {
            let (sim, a) = allocator(capacity, conf);
            let case = format!("{conf:?}: {held:?} held, {request} asked of {capacity}");
            let p = while_held(&a, held, |_| a.malloc(request, S0))
                .unwrap_or_else(|e| panic!("{case}: {e}"));
            let s = a.stats().unwrap();
            assert_eq!(s.allocation.all().current, 1, "{case}");
            assert!(s.reserved_bytes.all().current as u64 <= capacity, "{case}");
            a.free(p).unwrap();
            a.empty_cache().unwrap();
            assert_eq!(sim.counters(0).bytes_in_use, 0, "{case}");
        }
    }
}

/// The same, while the limit is lower than the device: a request over the limit is served
/// from the cache only, held blocks included; one under it grows within it.
#[test]
fn a_request_under_a_lowered_limit_gets_memory_other_threads_hold() {
    for conf in ["", "expandable_segments:False"] {
        let (sim, a) = allocator(128 * MIB, conf);
        let p = while_held(&a, &[40 * MIB], |held| {
            // The new settings take held blocks back; the holder's next free holds one again.
            a.set_memory_fraction(0.25).unwrap();
            let again = std::thread::scope(|s| {
                s.spawn(|| {
                    let q = a.malloc(40 * MIB, S0).unwrap();
                    a.free(q).unwrap();
                    q
                })
                .join()
                .unwrap()
            });
            assert_eq!(again, held[0], "{conf:?}: from the cache, past the limit");
            // Over the 32 MiB limit: only the cache may serve it, and a front holds it.
            a.malloc(36 * MIB, S0)
        })
        .unwrap_or_else(|e| panic!("{conf:?}: {e}"));
        assert!(sim.counters(0).bytes_in_use <= 40 * MIB, "{conf:?}");
        if conf.is_empty() {
            // The pages past the 36 MiB block serve another stream within the limit.
            let q = a
                .malloc(MIB + 1, S1)
                .unwrap_or_else(|e| panic!("{conf:?}: {e}"));
            a.free(q).unwrap();
        }
        a.free(p).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(sim.counters(0).bytes_in_use, 0, "{conf:?}");
    }
}

/// Blocks held in the fronts of threads still running go back to the device at
/// `empty_cache`, and leave the peaks at a reset; while held they stay freed for everyone.
#[test]
fn large_blocks_held_in_several_threads_fronts_are_given_back_and_stay_freed() {
    let (sim, a) = allocator(1 << 30, "");
    while_held(&a, &[40 * MIB, 3 * MIB], |outer| {
        while_held(&a, &[40 * MIB + 4096, 5 * MIB], |inner| {
            for &p in outer.iter().chain(inner) {
                assert_eq!(a.free(p).unwrap_err().kind, ErrorKind::DoubleFree);
                let kind = a.record_stream(p, S1).unwrap_err().kind;
                assert_eq!(kind, ErrorKind::DoubleFree);
            }
            a.reset_peak_stats().unwrap();
            let s = a.stats().unwrap();
            assert_eq!(s.allocated_bytes.all().current, 0);
            assert_eq!(s.allocated_bytes.all().peak, 0, "no held block in the peak");
            assert_eq!(s.active_bytes.all().peak, 0, "no held block in the peak");
            let segments = a.segments().unwrap();
            assert!(segments
                .iter()
                .flat_map(|s| &s.blocks)
                .all(|b| b.2 != ccalloc::BlockState::Allocated));
            a.empty_cache().unwrap();
            assert_eq!(sim.counters(0).bytes_in_use, 0, "held blocks given back");
            assert_eq!(a.stats().unwrap().reserved_bytes.all().current, 0);
        });
    });
    // The holders exited: their fronts are folded, the counts exact.
    let p = a.malloc(40 * MIB, S0).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 1);
    assert_eq!(s.allocation.all().allocated, 5);
    assert_eq!(s.allocation.all().freed, 4);
    a.free(p).unwrap();
}

/// A thread that exits holding large blocks leaves them to the cache: another thread that
/// asks for the same size gets one of them, with no new memory, even on a device with no
/// room for another.
#[test]
fn large_blocks_of_an_exited_thread_serve_the_next_thread() {
    for conf in ["", "expandable_segments:False"] {
        let (sim, a) = allocator(64 * MIB, conf);
        let held = while_held(&a, &[40 * MIB], |held| held.to_vec());
        let before = sim.counters(0);
        for size in [40 * MIB, 40 * MIB + 4096, 44 * MIB] {
            let p = std::thread::scope(|s| s.spawn(|| a.malloc(size, S0)).join().unwrap())
                .unwrap_or_else(|e| panic!("{conf:?} {size}: {e}"));
            if size == 40 * MIB {
                assert_eq!(p, held[0], "{conf:?}");
                assert_eq!(sim.counters(0).allocate_calls, before.allocate_calls);
            }
            let s = a.stats().unwrap();
            assert_eq!(s.allocation.all().current, 1, "{conf:?} {size}");
            // Freed by a thread that exits at once: its front holds it from then on.
            std::thread::scope(|s| s.spawn(|| a.free(p).unwrap()).join().unwrap());
            assert_eq!(a.free(p).unwrap_err().kind, ErrorKind::DoubleFree);
        }
        a.empty_cache().unwrap();
        assert_eq!(sim.counters(0).bytes_in_use, 0, "{conf:?}");
    }
}

/// A large block handed out by a front and freed after its thread exited (or by another
/// thread) is freed once: a second free, from any thread, is refused.
#[test]
fn a_large_block_from_an_exited_threads_front_is_freed_once() {
    let (_sim, a) = allocator(1 << 30, "");
    let p = std::thread::scope(|s| {
        s.spawn(|| {
            let p = a.malloc(40 * MIB, S0).unwrap();
            a.free(p).unwrap();
            let q = a.malloc(40 * MIB, S0).unwrap();
            assert_eq!(q, p, "from the front");
            q
        })
        .join()
        .unwrap()
    });
    a.record_stream(p, S1).unwrap();
    a.free(p).unwrap();
    assert_eq!(a.free(p).unwrap_err().kind, ErrorKind::DoubleFree);
    let other = std::thread::scope(|s| s.spawn(|| a.free(p).unwrap_err().kind).join().unwrap());
    assert_eq!(other, ErrorKind::DoubleFree);
    a.empty_cache().unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(
        (s.allocation.all().allocated, s.allocation.all().freed),
        (2, 2)
    );
}

/// A capture begun while threads hold large blocks never hands one to the capture's pool,
/// and the blocks stay the general cache's for after it.
#[test]
fn large_blocks_held_before_a_capture_stay_out_of_its_pool() {
    let (sim, a) = allocator(1 << 30, "");
    while_held(&a, &[40 * MIB], |held| {
        a.begin_allocate_to_pool((1, 1), Box::new(|s| s == S0))
            .unwrap();
        let q = a.malloc(40 * MIB, S0).unwrap();
        assert_ne!(
            q, held[0],
            "the capture's block comes from its private pool"
        );
        let r = a.malloc(40 * MIB, S1).unwrap();
        a.free(r).unwrap();
        a.free(q).unwrap();
        a.end_allocate_to_pool((1, 1)).unwrap();
        a.release_pool((1, 1)).unwrap();
        let s = a.stats().unwrap();
        assert_eq!(s.allocation.all().current, 0);
        assert_eq!(s.allocated_bytes.all().peak, 80 * MIB as i64);
    });
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

/// A thread that uses more devices than it keeps fronts for gives up its oldest fronts,
/// large blocks held in them included: those blocks stay freed (a second free refused),
/// serve the next request of their size, and go back to the device at `empty_cache`.
#[test]
fn large_blocks_in_fronts_a_thread_gave_up_stay_freed_and_are_given_back() {
    const DEVICES: usize = 12;
    let sim = Arc::new(SimDriver::new(DEVICES, 1 << 30));
    let allocators: Vec<DeviceAllocator> = (0..DEVICES)
        .map(|d| DeviceAllocator::new(d, sim.clone(), Config::default()).unwrap())
        .collect();
    let held: Vec<u64> = allocators
        .iter()
        .map(|a| {
            let p = a.malloc(40 * MIB, S0).unwrap();
            a.free(p).unwrap();
            p
        })
        .collect();
    for (d, (a, &p)) in allocators.iter().zip(&held).enumerate() {
        assert_eq!(
            a.free(p).unwrap_err().kind,
            ErrorKind::DoubleFree,
            "device {d}"
        );
        let s = a.stats().unwrap();
        assert_eq!(s.allocation.all().current, 0, "device {d}");
        assert_eq!(
            (s.allocation.all().allocated, s.allocation.all().freed),
            (1, 1)
        );
        let q = a.malloc(40 * MIB, S0).unwrap();
        assert_eq!(q, p, "device {d}: the held block");
        a.free(q).unwrap();
        let s = a.stats().unwrap();
        assert_eq!(s.allocation.all().current, 0, "device {d}");
        assert_eq!(s.allocated_bytes.all().peak, 40 * MIB as i64, "device {d}");
    }
    for (d, a) in allocators.iter().enumerate() {
        a.empty_cache().unwrap();
        assert_eq!(sim.counters(d).bytes_in_use, 0, "device {d}");
    }
}

/// The same with large blocks (reused by the front before the stream goes), whether the
/// worker exits or visits the shard again on another stream: the fronts make no more
/// calls on the destroyed stream than the shard alone does, and growth over their pages
/// still works. On one shard (`thread_shards:False`): with two, large blocks skip the
/// fronts. With the default the worker, new to the device, gets a shard of its own for
/// its stream, so its large blocks stay in that shard, and the growth borrows their pages
/// from it: no call on the destroyed stream either.
#[test]
fn large_blocks_left_in_a_front_are_freed_without_touching_their_destroyed_stream() {
    for exits in [true, false] {
        let calls = [
            "thread_shards:False,thread_cache:False",
            "thread_shards:False",
            "thread_shards_on_contention:False",
        ]
        .map(|conf| {
            let (sim, a) = allocator(1 << 30, conf);
            let keep = a.malloc(MIB, S1).unwrap();
            let worker = StreamId(0x7000);
            std::thread::scope(|s| {
                s.spawn(|| {
                    let p = a.malloc(40 * MIB, worker).unwrap();
                    let q = a.malloc(3 * MIB, worker).unwrap();
                    a.free(p).unwrap();
                    for _ in 0..20 {
                        let again = a.malloc(40 * MIB, worker).unwrap();
                        assert_eq!(again, p);
                        a.free(again).unwrap();
                    }
                    a.free(q).unwrap();
                    sim.destroy_stream(0, worker);
                    if !exits {
                        // The next visit, on a live stream, returns the held blocks.
                        let r = a.malloc(5 * MIB, S1).unwrap();
                        a.free(r).unwrap();
                    }
                });
            });
            let one_shard = conf.starts_with("thread_shards:False");
            assert_eq!(a.shards_made() == 1, one_shard, "{conf:?}");
            // Growth over the freed blocks' pages (the device has room for little else).
            let big = a.malloc(600 * MIB, S1).unwrap();
            a.free(big).unwrap();
            a.free(keep).unwrap();
            a.empty_cache().unwrap();
            let s = a.stats().unwrap();
            assert_eq!(s.allocated_bytes.all().current, 0, "{conf:?}");
            assert_eq!(sim.counters(0).bytes_in_use, 0, "{conf:?}");
            sim.counters(0).destroyed_stream_calls
        });
        assert_eq!(
            calls[1], calls[0],
            "exits {exits}: calls on the destroyed stream"
        );
        assert_eq!(calls[1], 0, "exits {exits}");
        assert_eq!(calls[2], 0, "exits {exits}, the default (two shards)");
    }
}
