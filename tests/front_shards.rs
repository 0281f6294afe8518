//! Thread fronts (`alloc::front`) with `per_stream_shards`: each shard has its own fronts.
//! What must hold: the same-size loop on each stream is served by the fronts, statistics
//! stay exact across shards, a block out in one thread's front may be freed by another
//! thread, and every path that must see free memory (empty_cache, the OOM retry, threads
//! that exit) takes held blocks back in every shard.
//!
//! Whether a call reached its shard is seen through the driver: a shard whose freed block
//! waits for a paused stream's event asks the driver about that event (`event_done`) on
//! every allocation it serves, while a front's hand-out never reaches the shard.
#![cfg(feature = "sim")]

mod common;

use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, DeviceStats, ErrorKind, StatArray, StreamId};
use common::{Call, FaultDriver};
use proptest::prelude::*;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(1);
const S1: StreamId = StreamId(2);
/// The stream the waiting blocks are recorded on: paused, so its events never complete.
const PAUSED: StreamId = StreamId(9);

fn sharded(capacity: u64, conf: &str) -> (Arc<FaultDriver>, DeviceAllocator) {
    let driver = FaultDriver::new(Arc::new(SimDriver::new(1, capacity)), &[]);
    let mut config = Config::default();
    config
        .apply(&format!("per_stream_shards:True,{conf}"))
        .unwrap();
    let a = DeviceAllocator::new(0, driver.clone(), config).unwrap();
    (driver, a)
}

/// Makes `stream`'s shard hold a freed block waiting for `PAUSED`: from then on, each
/// allocation that shard serves asks the driver about that block's event.
fn make_shard_visible(driver: &FaultDriver, a: &DeviceAllocator, stream: StreamId) {
    driver.sim.set_stream_paused(0, PAUSED, true);
    let p = a.malloc(2 * MIB, stream).unwrap();
    a.record_stream(p, PAUSED).unwrap();
    a.free(p).unwrap();
}

/// Allocations that reached a shard since the shards were made visible.
fn shard_visits(driver: &FaultDriver) -> u64 {
    driver.count(Call::EventDone)
}

/// Runs `f` and asserts that no shard was visited meanwhile.
fn in_fronts<R>(driver: &FaultDriver, what: &str, f: impl FnOnce() -> R) -> R {
    let before = shard_visits(driver);
    let r = f();
    assert_eq!(shard_visits(driver), before, "{what}: a shard served it");
    r
}

/// The statistics a front moves, every figure of each.
fn moved(s: &DeviceStats) -> [StatArray; 5] {
    [
        s.allocation,
        s.allocated_bytes,
        s.active,
        s.active_bytes,
        s.requested_bytes,
    ]
}

/// The settings that make a new thread's stream its shard at once (the default waits for
/// contention, `thread_shards_on_contention`).
fn at_once() -> Config {
    Config {
        thread_shards_on_contention: false,
        ..Config::default()
    }
}

#[test]
fn same_size_loops_on_two_streams_are_served_by_the_fronts() {
    let (driver, a) = sharded(1 << 30, "");
    for s in [S0, S1] {
        make_shard_visible(&driver, &a, s);
    }
    // The shards do see allocations they serve.
    for s in [S0, S1] {
        let before = shard_visits(&driver);
        let p = a.malloc(8192, s).unwrap();
        assert!(shard_visits(&driver) > before);
        a.free(p).unwrap();
    }
    // The first blocks reach their shards, both out at once; each free leaves its block in
    // this thread's front for that shard. Out at once first: held blocks count as live in
    // their shard, and peaks are the device's, so had the two never been live together,
    // each stream's next allocation would pass the device's peak and take the other's
    // held block back (as with one shard).
    let first = [S0, S1].map(|s| a.malloc(4096, s).unwrap());
    for p in first {
        a.free(p).unwrap();
    }
    in_fronts(&driver, "pairs on each stream in turn", || {
        for _ in 0..100 {
            for s in [S0, S1] {
                let p = a.malloc(4096, s).unwrap();
                a.free(p).unwrap();
            }
        }
    });
    // Interleaved: both blocks out at once, freed in allocation order.
    in_fronts(&driver, "interleaved pairs", || {
        for _ in 0..100 {
            let p = a.malloc(4096, S0).unwrap();
            let q = a.malloc(4096, S1).unwrap();
            a.free(p).unwrap();
            a.free(q).unwrap();
        }
    });
    let s = a.stats().unwrap();
    // Two waiting blocks, two 8 KiB ones, two first pairs, 200 + 200 from the fronts.
    assert_eq!(s.allocation.all().allocated, 2 + 2 + 2 + 400);
    assert_eq!(s.allocation.all().freed, 2 + 2 + 2 + 400);
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(s.allocated_bytes.all().current, 0);
}

/// The same calls on a device with fronts and one without give the same statistics: every
/// current value, total and peak of what a front moves.
#[test]
fn statistics_stay_exact_with_blocks_in_two_shards_fronts() {
    let (driver, a) = sharded(1 << 30, "");
    let (plain_driver, plain) = sharded(1 << 30, "thread_cache:False");
    let both = [(&*driver, &a), (&*plain_driver, &plain)];
    for (d, x) in both {
        for s in [S0, S1] {
            make_shard_visible(d, x, s);
        }
    }
    let same = |what: &str| {
        let (s, p) = (a.stats().unwrap(), plain.stats().unwrap());
        assert_eq!(moved(&s), moved(&p), "{what}");
        s
    };
    // Two blocks per shard, out at once, then freed: each held in its shard's front (one
    // at a time, the second would lift the shard's count past its peak of one, which
    // takes the held block back first).
    let sizes = [(S0, 4096), (S0, 700), (S1, 8192), (S1, MIB)];
    let out_and_back = |x: &DeviceAllocator| {
        for p in sizes.map(|(s, size)| x.malloc(size, s).unwrap()) {
            x.free(p).unwrap();
        }
    };
    out_and_back(&a);
    out_and_back(&plain);
    let s = same("blocks held in two shards' fronts");
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(s.allocated_bytes.all().current, 0);
    assert_eq!(s.allocation.all().allocated, 2 + 4);
    // The two waiting 2 MiB blocks were never allocated at once: the device's peak is one.
    assert_eq!(s.allocated_bytes.all().peak, (2 * MIB) as i64);
    let held = in_fronts(&driver, "hand-outs from two shards' fronts", || {
        sizes.map(|(s, size)| a.malloc(size, s).unwrap())
    });
    let plain_held = sizes.map(|(s, size)| plain.malloc(size, s).unwrap());
    let s = same("blocks out of two shards' fronts");
    assert_eq!(s.allocation.all().current, 4);
    assert_eq!(s.allocation.all().allocated, 2 + 4 + 4);
    // The waiting blocks' requested bytes leave when their events complete.
    assert_eq!(
        s.requested_bytes.all().current,
        (2 * (2 * MIB) + 4096 + 700 + 8192 + MIB) as i64
    );
    in_fronts(&driver, "frees into two shards' fronts", || {
        for p in held {
            a.free(p).unwrap();
        }
    });
    for p in plain_held {
        plain.free(p).unwrap();
    }
    same("held again");
    a.reset_peak_stats().unwrap();
    plain.reset_peak_stats().unwrap();
    let s = same("peaks reset");
    assert_eq!(s.allocated_bytes.all().peak, 0);
    a.reset_accumulated_stats().unwrap();
    plain.reset_accumulated_stats().unwrap();
    same("totals reset");
    // After the resets (which took the held blocks back) the fronts fill again; then
    // every block is out at once, from the fronts.
    out_and_back(&a);
    out_and_back(&plain);
    same("after the resets");
    for x in [&a, &plain] {
        let out = in_fronts(&driver, "hand-outs after the resets", || {
            sizes.map(|(s, size)| x.malloc(size, s).unwrap())
        });
        let s = x.stats().unwrap();
        assert_eq!(
            s.allocated_bytes.all().peak,
            (4096 + 1024 + 8192 + MIB) as i64
        );
        for p in out {
            x.free(p).unwrap();
        }
    }
    same("every block out at once");
}

#[test]
fn a_block_from_one_threads_front_is_freed_by_another_thread() {
    let (driver, a) = sharded(1 << 30, "");
    for s in [S0, S1] {
        make_shard_visible(&driver, &a, s);
    }
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    let q = in_fronts(&driver, "the hand-out", || a.malloc(4096, S0).unwrap());
    assert_eq!(q, p);
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // This thread works on the other stream (its fronts and last shard are S1's).
                let r = a.malloc(4096, S1).unwrap();
                a.free(r).unwrap();
                a.free(q).unwrap();
                assert_eq!(a.free(q).unwrap_err().kind, ErrorKind::DoubleFree);
            })
            .join()
            .unwrap();
    });
    // Freed for good: this thread's front no longer has it.
    assert_eq!(a.free(q).unwrap_err().kind, ErrorKind::DoubleFree);
    assert_eq!(
        a.record_stream(q, S1).unwrap_err().kind,
        ErrorKind::DoubleFree
    );
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(s.allocated_bytes.all().current, 0);
    assert_eq!(s.allocation.all().allocated, 2 + 3);
    // The other thread's front holds the block now: this thread's next one is new.
    let r = a.malloc(4096, S0).unwrap();
    assert_ne!(r, q);
    a.free(r).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(driver.sim.counters(0).bytes_in_use, 0);
}

#[test]
fn a_block_from_a_front_recorded_on_another_stream_waits_for_it() {
    let (driver, a) = sharded(1 << 30, "");
    make_shard_visible(&driver, &a, S0);
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    let q = in_fronts(&driver, "the hand-out", || a.malloc(4096, S0).unwrap());
    assert_eq!(q, p);
    a.record_stream(q, S1).unwrap();
    driver.sim.set_stream_paused(0, S1, true);
    a.free_on(q, S0).unwrap();
    // S1 has not run: the block must not come back yet.
    let r = a.malloc(4096, S0).unwrap();
    assert_ne!(r, q);
    driver.sim.set_stream_paused(0, S1, false);
    a.free(r).unwrap();
}

/// Runs `f` and asserts that a shard was visited meanwhile (the fronts are closed).
fn in_shards<R>(driver: &FaultDriver, what: &str, f: impl FnOnce() -> R) -> R {
    let before = shard_visits(driver);
    let r = f();
    assert!(shard_visits(driver) > before, "{what}: a front served it");
    r
}

#[test]
fn a_capture_closes_every_shards_fronts() {
    let (driver, a) = sharded(1 << 30, "");
    // Out at once, then freed into the fronts: neither is then past the device's peak.
    let held = [S0, S1].map(|s| a.malloc(4096, s).unwrap());
    for p in held {
        a.free(p).unwrap();
    }
    a.begin_allocate_to_pool((1, 1), Box::new(|s| s == S1))
        .unwrap();
    // Neither the captured stream nor the other is served from its front (which holds
    // its 4 KiB block: to the shard, still handed out).
    let p = a.malloc(4096, S0).unwrap();
    assert_ne!(p, held[0], "the other stream was served from its front");
    a.free(p).unwrap();
    let q = a.malloc(4096, S1).unwrap();
    assert_ne!(q, held[1]);
    // (A snapshot takes the held blocks back.)
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
    // Open again in every shard.
    for s in [S0, S1] {
        make_shard_visible(&driver, &a, s);
    }
    for s in [S0, S1] {
        let p = a.malloc(4096, s).unwrap();
        a.free(p).unwrap();
        let q = in_fronts(&driver, "after the capture", || a.malloc(4096, s).unwrap());
        assert_eq!(q, p);
        a.free(q).unwrap();
    }
}

/// A same-size pair on `s`, then another: served by the front (`open`) or by the shard.
fn pairs_served(driver: &FaultDriver, a: &DeviceAllocator, s: StreamId, open: bool) {
    let p = a.malloc(4096, s).unwrap();
    a.free(p).unwrap();
    let what = format!("{s:?}, fronts open: {open}");
    let q = if open {
        in_fronts(driver, &what, || a.malloc(4096, s).unwrap())
    } else {
        in_shards(driver, &what, || a.malloc(4096, s).unwrap())
    };
    a.free(q).unwrap();
}

#[test]
fn thread_cache_reaches_every_shard_and_those_made_later() {
    let (driver, a) = sharded(1 << 30, "thread_cache:False");
    let streams = [S0, S1, StreamId(3), StreamId(4)];
    for s in &streams[..2] {
        make_shard_visible(&driver, &a, *s);
        pairs_served(&driver, &a, *s, false);
    }
    a.apply_config("thread_cache:True").unwrap();
    make_shard_visible(&driver, &a, streams[2]);
    for s in &streams[..3] {
        pairs_served(&driver, &a, *s, true);
    }
    a.apply_config("thread_cache:False").unwrap();
    make_shard_visible(&driver, &a, streams[3]);
    for s in streams {
        pairs_served(&driver, &a, s, false);
    }
}

#[test]
fn empty_cache_takes_back_every_shards_held_blocks() {
    let (driver, a) = sharded(1 << 30, "");
    for s in [S0, S1] {
        make_shard_visible(&driver, &a, s);
    }
    for s in [S0, S1] {
        let p = a.malloc(4096, s).unwrap();
        a.free(p).unwrap();
        in_fronts(&driver, "the loop", || {
            let p = a.malloc(4096, s).unwrap();
            a.free(p).unwrap();
        });
    }
    a.empty_cache().unwrap();
    assert_eq!(driver.sim.counters(0).bytes_in_use, 0);
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().allocated, 2 + 4);
    assert_eq!(s.allocation.all().freed, 2 + 4);
    assert_eq!(s.active_bytes.all().current, 0);
    a.shutdown().unwrap();
}

#[test]
fn an_oom_takes_back_the_blocks_other_shards_fronts_hold() {
    let (driver, a) = sharded(64 * MIB, "");
    make_shard_visible(&driver, &a, S1);
    // Eight 1 MiB blocks held in this thread's front for S1's shard.
    let first: Vec<_> = (0..8).map(|_| a.malloc(MIB, S1).unwrap()).collect();
    for p in first {
        a.free(p).unwrap();
    }
    let again = in_fronts(&driver, "the hand-outs", || {
        (0..8)
            .map(|_| a.malloc(MIB, S1).unwrap())
            .collect::<Vec<_>>()
    });
    for p in again {
        a.free(p).unwrap();
    }
    // Only with S1's memory back does this fit.
    let big = a.malloc(60 * MIB, S0).unwrap();
    a.free(big).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(driver.sim.counters(0).bytes_in_use, 0);
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().allocated, 1 + 16 + 1);
    assert_eq!(s.allocation.all().current, 0);
}

#[test]
fn a_thread_that_exits_gives_back_its_fronts_in_every_shard() {
    let (driver, a) = sharded(1 << 30, "");
    for s in [S0, S1] {
        make_shard_visible(&driver, &a, s);
    }
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for s in [S0, S1] {
                let p = a.malloc(4096, s).unwrap();
                a.free(p).unwrap();
                in_fronts(&driver, "the worker's loop", || {
                    for _ in 0..10 {
                        let p = a.malloc(4096, s).unwrap();
                        a.free(p).unwrap();
                    }
                });
            }
        });
    });
    // The thread is gone; its fronts still hold a block in each shard.
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().allocated, 2 + 22);
    assert_eq!(s.allocation.all().freed, 2 + 22);
    assert_eq!(s.allocated_bytes.all().current, 0);
    a.empty_cache().unwrap();
    assert_eq!(driver.sim.counters(0).bytes_in_use, 0);
    // Folded: the totals stay (the waiting blocks have left, so only what they do not
    // weigh in is compared).
    let after = a.stats().unwrap();
    assert_eq!(
        [after.allocation, after.allocated_bytes],
        [s.allocation, s.allocated_bytes]
    );
    a.shutdown().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: bool },
    Free { pick: usize },
    FreeElsewhere { pick: usize },
    EmptyCache,
    ResetPeaks,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let size = prop::sample::select(vec![700, 4096, 4096 * 3, MIB, 3 * MIB]);
    prop_oneof![
        8 => (size, any::<bool>()).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        6 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => any::<usize>().prop_map(|pick| Op::FreeElsewhere { pick }),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::ResetPeaks),
    ]
}

/// `ops` on two sharded devices, with fronts and without: the statistics fronts move stay
/// the same after every call.
fn same_as_without_fronts(ops: Vec<Op>) {
    let (d, a) = sharded(1 << 30, "");
    let (plain_d, plain) = sharded(1 << 30, "thread_cache:False");
    let mut live: Vec<(u64, u64)> = Vec::new();
    for op in ops {
        match op {
            Op::Alloc { size, stream } => {
                let s = if stream { S1 } else { S0 };
                live.push((a.malloc(size, s).unwrap(), plain.malloc(size, s).unwrap()));
            }
            Op::Free { pick } | Op::FreeElsewhere { pick } if !live.is_empty() => {
                let (p, q) = live.swap_remove(pick % live.len());
                if matches!(op, Op::Free { .. }) {
                    a.free(p).unwrap();
                } else {
                    std::thread::scope(|s| s.spawn(|| a.free(p).unwrap()).join().unwrap());
                }
                plain.free(q).unwrap();
            }
            Op::EmptyCache => {
                a.empty_cache().unwrap();
                plain.empty_cache().unwrap();
            }
            Op::ResetPeaks => {
                a.reset_peak_stats().unwrap();
                plain.reset_peak_stats().unwrap();
            }
            _ => {}
        }
        assert_eq!(moved(&a.stats().unwrap()), moved(&plain.stats().unwrap()));
    }
    for (p, q) in live {
        a.free(p).unwrap();
        plain.free(q).unwrap();
    }
    a.empty_cache().unwrap();
    plain.empty_cache().unwrap();
    assert_eq!(d.sim.counters(0).bytes_in_use, 0);
    assert_eq!(plain_d.sim.counters(0).bytes_in_use, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn statistics_match_a_device_without_fronts(ops in prop::collection::vec(op_strategy(), 1..200)) {
        same_as_without_fronts(ops);
    }
}

/// A large block freed on one stream is idle memory that the next stream's growth borrows,
/// whichever thread grows: no front keeps it live in its shard, where other shards weigh
/// it as live (their growth budget) until its thread's next visit there, which may never
/// come.
#[test]
fn a_large_block_freed_on_one_stream_is_idle_memory_for_the_next() {
    for other_thread in [false, true] {
        let (driver, a) = sharded(1 << 30, "");
        let p = a.malloc(64 * MIB, S0).unwrap();
        a.free(p).unwrap();
        let q = match other_thread {
            false => a.malloc(64 * MIB, S1).unwrap(),
            true => {
                std::thread::scope(|s| s.spawn(|| a.malloc(64 * MIB, S1).unwrap()).join()).unwrap()
            }
        };
        let s = a.stats().unwrap();
        assert!(
            s.paging.chunks_borrowed > 0,
            "{other_thread}: {:?}",
            s.paging
        );
        let reserved = s.reserved_bytes.all().current as u64;
        assert!(
            reserved <= 72 * MIB,
            "{other_thread}: {} MiB",
            reserved / MIB
        );
        assert_eq!(reserved, driver.sim.counters(0).bytes_in_use);
        a.free(q).unwrap();
    }
}

/// With the default's thread shards, a helper thread on a stream of its own (a batch
/// prefetcher) makes a second shard; the main thread's same-size loop of large tensors still
/// runs in its front.
#[test]
fn a_helper_threads_shard_leaves_the_main_threads_large_pairs_in_its_front() {
    let driver = FaultDriver::new(Arc::new(SimDriver::new(1, 1 << 30)), &[]);
    let a = Arc::new(DeviceAllocator::new(0, driver.clone(), at_once()).unwrap());
    make_shard_visible(&driver, &a, S0);
    let helper = {
        let a = a.clone();
        std::thread::spawn(move || {
            let p = a.malloc(4096, S1).unwrap();
            a.free(p).unwrap();
        })
    };
    helper.join().unwrap();
    assert_eq!(a.shards_made(), 2);
    let p = a.malloc(32 * MIB, S0).unwrap();
    a.free(p).unwrap();
    for _ in 0..3 {
        let q = in_fronts(&driver, "a large pair beside a helper's shard", || {
            a.malloc(32 * MIB, S0).unwrap()
        });
        assert_eq!(q, p);
        a.free(q).unwrap();
    }
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().current, 0);
    assert_eq!(s.allocated_bytes.all().peak as u64, 32 * MIB);
}

/// A large block that another thread allocated in its own shard (a prefetcher's batch)
/// and this thread frees goes back to that shard at once, not to this thread's front for
/// it: the prefetcher's next batch reuses its memory.
#[test]
fn a_large_block_freed_by_another_shards_thread_goes_back_to_its_shard_at_once() {
    let driver = FaultDriver::new(Arc::new(SimDriver::new(1, 1 << 30)), &[]);
    let a = Arc::new(DeviceAllocator::new(0, driver.clone(), at_once()).unwrap());
    let own = a.malloc(4096, S0).unwrap();
    let on_helper = |a: &Arc<DeviceAllocator>| {
        let a = a.clone();
        std::thread::spawn(move || a.malloc(32 * MIB, S1).unwrap())
            .join()
            .unwrap()
    };
    let batch = on_helper(&a);
    assert_eq!(a.shards_made(), 2);
    for _ in 0..3 {
        a.free(batch).unwrap();
        let made = driver.sim.counters(0).physical_creates;
        assert_eq!(on_helper(&a), batch, "the next batch reuses the freed one");
        assert_eq!(driver.sim.counters(0).physical_creates, made);
    }
    a.free(batch).unwrap();
    a.free(own).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().current, 0);
    assert_eq!(s.allocated_bytes.all().peak as u64, 32 * MIB + 4096);
}

/// A large block waits in its thread's front with several shards too, so a same-size loop
/// of large tensors runs without its shard's lock; the thread's next visit to another shard
/// gives it back to its own first, so that the other shard's growth can borrow its pages.
#[test]
fn large_blocks_use_the_front_with_several_shards_until_a_visit_elsewhere() {
    let (driver, a) = sharded(1 << 30, "");
    make_shard_visible(&driver, &a, S0);
    let p = a.malloc(32 * MIB, S0).unwrap();
    a.free(p).unwrap();
    let q = in_fronts(&driver, "a large pair on the only shard", || {
        a.malloc(32 * MIB, S0).unwrap()
    });
    assert_eq!(q, p);
    // The second shard is made while the block is out of the front.
    let r = a.malloc(4096, S1).unwrap();
    a.free(r).unwrap();
    a.free(q).unwrap();
    let x = in_fronts(&driver, "a large pair with two shards", || {
        a.malloc(32 * MIB, S0).unwrap()
    });
    assert_eq!(x, q);
    a.free(x).unwrap();
    assert_eq!(
        a.stats().unwrap().allocated_bytes.all().current,
        0,
        "held is freed"
    );
    // The visit to the other stream's shard gives the held block back to its shard first,
    // so that shard's growth borrows its pages instead of making new ones.
    let borrowed = a.stats().unwrap().paging.chunks_borrowed;
    let y = a.malloc(32 * MIB, S1).unwrap();
    let s = a.stats().unwrap();
    assert!(
        s.paging.chunks_borrowed > borrowed,
        "the large block stayed in a front: {:?}",
        s.paging
    );
    a.free(y).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(s.allocated_bytes.all().peak as u64, 32 * MIB + 4096);
}
