//! `per_stream_shards`: one allocator per stream under one device. What stays device-wide
//! (the memory limit, the OOM retry, statistics, settings, private-pool windows, shutdown)
//! and what each shard keeps to itself.
#![cfg(feature = "sim")]

mod common;

use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, ErrorKind, StreamId};
use common::{Gate, GatedDriver};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);

fn sharded(capacity: u64, conf: &str) -> (Arc<SimDriver>, DeviceAllocator) {
    let sim = Arc::new(SimDriver::new(1, capacity));
    let mut config = Config::default();
    config
        .apply(&format!("per_stream_shards:True,{conf}"))
        .unwrap();
    (sim.clone(), DeviceAllocator::new(0, sim, config).unwrap())
}

#[test]
fn statistics_sum_over_streams_and_blocks_free_from_anywhere() {
    let (sim, a) = sharded(1 << 30, "");
    let p = a.malloc(3 * MIB, S1).unwrap();
    let q = a.malloc(5 * MIB, S2).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 2);
    assert_eq!(s.allocated_bytes.all().current as u64, 8 * MIB);
    assert_eq!(
        s.reserved_bytes.all().current as u64,
        sim.counters(0).bytes_in_use
    );
    let streams: Vec<_> = a.segments().unwrap().iter().map(|s| s.stream).collect();
    assert!(
        streams.contains(&S1) && streams.contains(&S2),
        "{streams:?}"
    );
    // A wrong stream hint, and none: both find the block's shard.
    a.free_on(p, S2).unwrap();
    a.free(q).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(s.allocation.all().allocated, 2);
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn bad_pointers_are_diagnosed_by_the_shard_that_held_them() {
    let (_sim, a) = sharded(1 << 30, "");
    let keep = a.malloc(4096, S1).unwrap();
    let p = a.malloc(4096, S2).unwrap();
    a.free(p).unwrap();
    assert_eq!(a.free(p).unwrap_err().kind, ErrorKind::DoubleFree);
    assert_eq!(a.free_on(p, S2).unwrap_err().kind, ErrorKind::DoubleFree);
    assert_eq!(
        a.free(keep + 512).unwrap_err().kind,
        ErrorKind::UnknownPointer
    );
    assert_eq!(
        a.free(0xdead_0000).unwrap_err().kind,
        ErrorKind::UnknownPointer
    );
    assert_eq!(
        a.record_stream(p, S1).unwrap_err().kind,
        ErrorKind::DoubleFree
    );
    // Nothing else changed.
    assert_eq!(a.stats().unwrap().allocation.all().current, 1);
    a.free(keep).unwrap();
}

#[test]
fn the_memory_limit_counts_every_stream() {
    let (sim, a) = sharded(100 * MIB, "per_process_memory_fraction:0.5");
    let p = a.malloc(30 * MIB, S1).unwrap();
    let err = a.malloc(30 * MIB, S2).unwrap_err();
    assert_eq!(err.kind, ErrorKind::OutOfMemory);
    assert!(err.message.contains("for other streams"), "{}", err.message);
    assert!(err.message.contains("30.00 MiB live"), "{}", err.message);
    let s = a.stats().unwrap();
    assert_eq!(s.num_ooms, 1);
    assert!(sim.counters(0).bytes_in_use <= 50 * MIB);
    a.free(p).unwrap();
    // S1's cache goes back when S2 needs the room.
    let q = a.malloc(30 * MIB, S2).unwrap();
    assert_eq!(a.stats().unwrap().num_ooms, 1);
    a.free(q).unwrap();
}

#[test]
fn an_oom_empties_the_other_streams_caches_before_it_fails() {
    // Plain segments: another stream's cached segment goes back only whole (paged memory
    // would be lent instead, before any OOM: see the lending tests below).
    let (sim, a) = sharded(64 * MIB, "expandable_segments:False");
    let p = a.malloc(40 * MIB, S1).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(50 * MIB, S2).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.num_ooms, s.num_alloc_retries), (0, 1));
    assert_eq!(
        s.reserved_bytes.all().current as u64,
        sim.counters(0).bytes_in_use
    );
    // Past the device: fails at once, nothing emptied or counted as a retry.
    let r = a.malloc(10 * MIB, S1).unwrap();
    a.free(r).unwrap();
    let before = a.stats().unwrap();
    assert_eq!(
        a.malloc(1 << 40, S1).unwrap_err().kind,
        ErrorKind::OutOfMemory
    );
    let after = a.stats().unwrap();
    assert_eq!(after.num_ooms, before.num_ooms + 1);
    assert_eq!(after.num_alloc_retries, before.num_alloc_retries);
    assert_eq!(after.reserved_bytes, before.reserved_bytes);
    a.free(q).unwrap();
}

#[test]
fn peaks_stay_exact_across_streams() {
    let (_sim, a) = sharded(1 << 30, "");
    let p = a.malloc(8 * MIB, S1).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(4 * MIB, S1).unwrap();
    let peak = |a: &DeviceAllocator| a.stats().unwrap().allocated_bytes.all().peak as u64;
    assert_eq!(peak(&a), 8 * MIB, "one stream");
    a.free(q).unwrap();
    // Never live at once: the device's peak is the high of the sum, not the sum of highs.
    let r = a.malloc(2 * MIB, S2).unwrap();
    assert_eq!(peak(&a), 8 * MIB, "each stream's own peak must not add");
    let t = a.malloc(7 * MIB, S1).unwrap();
    assert_eq!(peak(&a), 9 * MIB, "live at once: they add");
    a.free(r).unwrap();
    a.free(t).unwrap();
    a.reset_peak_stats().unwrap();
    assert_eq!(peak(&a), 0);
    let u = a.malloc(MIB, S2).unwrap();
    assert_eq!(peak(&a), MIB, "after a reset, from the new moment");
    a.free(u).unwrap();
}

/// One thread allocating and freeing on several streams (PyTorch's side streams): the
/// device's peaks of requested bytes and of live blocks, counted here from the calls
/// alone, match the statistics exactly, whether or not they are read in between (a read
/// settles the peaks too). Sizes repeat, so thread fronts hold freed blocks, which are not
/// live.
#[test]
fn one_thread_on_many_streams_gets_exact_peaks() {
    for (conf, read_every) in [("", 0), ("", 7), ("thread_cache:False", 0), ("", 1)] {
        let (_sim, a) = sharded(8 << 30, conf);
        let mut seed = 0x2545F4914F6CDD1Du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let sizes = [512, 4096, 100_000, MIB, 3 * MIB + 512, 20 * MIB];
        let mut live: Vec<(u64, u64)> = Vec::new();
        let (mut requested, mut peak_requested, mut peak_blocks) = (0u64, 0u64, 0usize);
        for step in 0..4000 {
            let grow = live.is_empty() || (next() % 100) < 52 - (live.len() as u64 / 8).min(40);
            if grow {
                let size = sizes[(next() % sizes.len() as u64) as usize];
                let stream = StreamId(1 + next() % 5);
                live.push((a.malloc(size, stream).unwrap(), size));
                requested += size;
            } else {
                let (ptr, size) = live.swap_remove((next() % live.len() as u64) as usize);
                a.free(ptr).unwrap();
                requested -= size;
            }
            peak_requested = peak_requested.max(requested);
            peak_blocks = peak_blocks.max(live.len());
            if read_every > 0 && step % read_every == 0 {
                let s = a.stats().unwrap();
                assert_eq!(s.requested_bytes.all().current as u64, requested);
            }
        }
        let s = a.stats().unwrap();
        assert_eq!(
            s.requested_bytes.all().peak as u64,
            peak_requested,
            "{conf}, read every {read_every}: peak requested bytes"
        );
        assert_eq!(
            s.allocation.all().peak as usize,
            peak_blocks,
            "{conf}, read every {read_every}: peak live blocks"
        );
        for (ptr, _) in live {
            a.free(ptr).unwrap();
        }
    }
}

/// A shard that gave headroom away lifts past its lowered ceiling, though not past what it
/// was assigned before: that lift must still reach the device's peak. Stream 1's shard
/// gives 7.5 MiB of its 10 MiB of spare to stream 2's (what stream 2 needs, and half of the
/// rest), so 6 MiB on stream 1 then takes the device to 21 MiB, one MiB past its peak.
#[test]
fn a_giver_lifting_past_its_lowered_ceiling_raises_the_device_peak() {
    let (_sim, a) = sharded(1 << 30, "thread_cache:False");
    let (s1, s2) = (StreamId(1), StreamId(2));
    let first = a.malloc(10 * MIB, s1).unwrap();
    let second = a.malloc(10 * MIB, s2).unwrap(); // device peak 20 MiB, no spare anywhere
    a.free(first).unwrap(); // stream 1's shard: 10 MiB of spare
    let third = a.malloc(5 * MIB, s2).unwrap(); // takes 5 + 2.5 MiB of it
    let fourth = a.malloc(6 * MIB, s1).unwrap(); // 15 + 6 = 21 MiB live
    a.free(fourth).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().current as u64, 15 * MIB);
    assert_eq!(s.allocated_bytes.all().peak as u64, 21 * MIB);
    assert_eq!(s.requested_bytes.all().peak as u64, 21 * MIB);
    for p in [second, third] {
        a.free(p).unwrap();
    }
}

/// A statistics read shares the device's spare headroom equally, lowering a shard's
/// ceiling that stood high: a lift past the lowered one must still reach the device's
/// peak once another shard has used the headroom it was given. Stream 1's shard goes from
/// 10 MiB of spare to 5, stream 2's from 0 to 5 and uses it (its block count unchanged, so
/// that nothing else lifts), and 8 MiB on stream 1 then takes the device to 23 MiB.
#[test]
fn a_lift_past_a_ceiling_a_read_lowered_raises_the_device_peak() {
    let (_sim, a) = sharded(1 << 30, "thread_cache:False");
    let (s1, s2) = (StreamId(1), StreamId(2));
    let first = a.malloc(10 * MIB, s1).unwrap();
    let second = a.malloc(10 * MIB, s2).unwrap(); // device peak 20 MiB
    a.free(first).unwrap();
    assert_eq!(
        a.stats().unwrap().allocated_bytes.all().peak as u64,
        20 * MIB
    );
    a.free(second).unwrap();
    let third = a.malloc(15 * MIB, s2).unwrap(); // stream 2's new ceiling exactly
    let fourth = a.malloc(8 * MIB, s1).unwrap(); // 15 + 8 = 23 MiB live
    a.free(fourth).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().peak as u64, 23 * MIB);
    assert_eq!(s.requested_bytes.all().peak as u64, 23 * MIB);
    a.free(third).unwrap();
}

/// After a peak reset every shard's ceiling is its current count: a shard that stood high
/// before the reset lifts as soon as it rises again, and the device's new peak counts it.
#[test]
fn a_lift_after_a_peak_reset_raises_the_device_peak() {
    let (_sim, a) = sharded(1 << 30, "thread_cache:False");
    let (s1, s2) = (StreamId(1), StreamId(2));
    let first = a.malloc(10 * MIB, s1).unwrap();
    let second = a.malloc(10 * MIB, s2).unwrap();
    a.free(first).unwrap();
    a.reset_peak_stats().unwrap(); // the device's peak is 10 MiB now
    let third = a.malloc(6 * MIB, s1).unwrap(); // 16 MiB live
    a.free(third).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().peak as u64, 16 * MIB);
    assert_eq!(s.allocation.all().peak, 2);
    a.free(second).unwrap();
}

/// A block freed into a thread front stays counted in its shard; when another stream's
/// allocation would raise the device's peak, the held block must not count.
#[test]
fn blocks_held_in_fronts_do_not_raise_the_device_peak() {
    let (_sim, a) = sharded(1 << 30, "");
    // Both shards first (making the second drains the first one's fronts).
    let r = a.malloc(4096, S2).unwrap();
    a.free(r).unwrap();
    // Sizes a front keeps: repeat a pair so that the gate stays open.
    for _ in 0..8 {
        let p = a.malloc(256 * 1024, S1).unwrap();
        a.free(p).unwrap();
    }
    let q = a.malloc(512 * 1024, S2).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().peak as u64, 512 * 1024);
    assert_eq!(s.allocation.all().peak, 1);
    a.free(q).unwrap();
}

/// Threads churning on their own streams while others read and reset the statistics: no
/// deadlock, and every read is consistent (peak at or above current, all = small + large
/// for currents). Peaks under racing threads are not checked against a figure: any order
/// of the racing calls is a right answer.
#[test]
fn peaks_settle_while_threads_churn_and_readers_read() {
    let (_sim, a) = sharded(8 << 30, "");
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let a = &a;
            scope.spawn(move || {
                let stream = StreamId(10 + t);
                let mut seed = 0x9E3779B97F4A7C15u64 ^ t;
                let mut live = Vec::new();
                for _ in 0..3000 {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    if live.len() < 50 || seed.is_multiple_of(2) {
                        live.push(a.malloc(512 + (seed % 4096) * 512, stream).unwrap());
                    }
                    if live.len() > 50 {
                        a.free(live.swap_remove((seed % 50) as usize)).unwrap();
                    }
                }
                for p in live {
                    a.free(p).unwrap();
                }
            });
        }
        let a = &a;
        scope.spawn(move || {
            for i in 0..200 {
                let s = a.stats().unwrap();
                for array in [
                    s.allocation,
                    s.allocated_bytes,
                    s.requested_bytes,
                    s.active_bytes,
                ] {
                    for stat in array.0 {
                        assert!(stat.current <= stat.peak, "read {i}: {stat:?}");
                    }
                }
                if i % 50 == 49 {
                    a.reset_peak_stats().unwrap();
                }
            }
        });
    });
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert!(
        s.allocation.all().peak <= 4 * 51,
        "{:?}",
        s.allocation.all()
    );
}

#[test]
fn reserved_peaks_stay_exact_across_streams() {
    let (_sim, a) = sharded(1 << 30, "expandable_segments:False");
    let reserved = |a: &DeviceAllocator| a.stats().unwrap().reserved_bytes;
    let p = a.malloc(30 * MIB, S1).unwrap();
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    let q = a.malloc(30 * MIB, S2).unwrap();
    let r = reserved(&a);
    assert_eq!(r.all().current as u64, 30 * MIB);
    assert_eq!(r.all().peak as u64, 30 * MIB, "never both at once");
    assert_eq!(r.0[2].peak as u64, 30 * MIB, "large pool");
    let s = a.malloc(4096, S1).unwrap();
    assert_eq!(
        reserved(&a).all().peak as u64,
        32 * MIB,
        "with S1's small segment"
    );
    a.free(q).unwrap();
    a.free(s).unwrap();
    a.empty_cache().unwrap();
    a.reset_peak_stats().unwrap();
    assert_eq!(reserved(&a).all().peak, 0);
}

#[test]
fn streams_past_the_slots_share_shards_and_still_work() {
    let (sim, a) = sharded(1 << 30, "");
    let blocks: Vec<_> = (0..80u64)
        .map(|s| (a.malloc(4096 + s, StreamId(1000 + s)).unwrap(), s))
        .collect();
    for &(p, s) in &blocks {
        a.record_stream(p, StreamId(s)).unwrap();
    }
    for (p, _) in blocks {
        a.free(p).unwrap();
    }
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(s.allocation.all().allocated, 80);
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn settings_reach_every_shard_and_sharding_is_fixed_once_in_use() {
    let (_sim, a) = sharded(1 << 30, "");
    let p = a.malloc(4096, S1).unwrap();
    a.apply_config("max_split_size_mb:64").unwrap();
    let q = a.malloc(4096, S2).unwrap();
    assert_eq!(a.max_split_size().unwrap(), 64 * MIB);
    a.set_memory_fraction(0.25).unwrap();
    assert_eq!(a.memory_fraction().unwrap(), 0.25);
    // S2's shard (made before the change) holds to the new limit: 256 MiB of 1 GiB.
    assert_eq!(
        a.malloc(300 * MIB, S2).unwrap_err().kind,
        ErrorKind::OutOfMemory
    );
    let err = a.apply_config("per_stream_shards:False").unwrap_err();
    assert_eq!(err.kind, ErrorKind::Config);
    assert_eq!(a.max_split_size().unwrap(), 64 * MIB, "nothing changed");
    a.free(p).unwrap();
    a.free(q).unwrap();

    // Replacing every setting (reset_config) keeps the sharding the device runs with.
    a.set_config(Config::default()).unwrap();
    assert_eq!(a.max_split_size().unwrap(), u64::MAX);
    a.apply_config("per_stream_shards:True").unwrap();

    // Before the first allocation it may change.
    let (_sim, b) = sharded(1 << 30, "");
    b.apply_config("per_stream_shards:False").unwrap();
    let p = b.malloc(4096, S1).unwrap();
    let q = b.malloc(4096, S2).unwrap();
    let segments = b.segments().unwrap();
    assert_eq!(segments.len(), 2, "per-stream segments, one allocator");
    b.free(p).unwrap();
    b.free(q).unwrap();
}

#[test]
fn a_window_opened_before_a_stream_first_allocates_routes_it_too() {
    let (sim, a) = sharded(1 << 30, "");
    let pool = (4, 2);
    let before = a.malloc(4096, S1).unwrap();
    a.begin_allocate_to_pool(pool, Box::new(|s| s == S2))
        .unwrap();
    let p = a.malloc(4096, S2).unwrap();
    let q = a.malloc(4096, S1).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    let owner = |ptr| {
        a.segments()
            .unwrap()
            .into_iter()
            .find(|s| s.addr <= ptr && ptr < s.addr + s.size)
            .unwrap()
            .private_pool
    };
    assert_eq!(
        owner(p),
        Some(pool),
        "S2's first allocation went to the pool"
    );
    assert_eq!(owner(q), None);
    // Released with the window still held by no one: the pool's memory goes once freed.
    a.release_pool(pool).unwrap();
    assert_eq!(
        a.release_pool(pool).unwrap_err().kind,
        ErrorKind::InvalidArgument
    );
    for x in [before, p, q] {
        a.free(x).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn shutdown_waits_for_every_stream() {
    let (_sim, a) = sharded(1 << 30, "");
    let p = a.malloc(4096, S1).unwrap();
    let q = a.malloc(4096, S2).unwrap();
    a.free(p).unwrap();
    let err = a.shutdown().unwrap_err();
    assert_eq!(err.kind, ErrorKind::Busy);
    assert!(err.message.contains("1 allocations"), "{}", err.message);
    // Still open: S1 allocates again.
    let r = a.malloc(4096, S1).unwrap();
    a.free(r).unwrap();
    a.free(q).unwrap();
    a.shutdown().unwrap();
    for result in [
        a.malloc(4096, S1).map(|_| ()),
        a.malloc(4096, StreamId(77)).map(|_| ()),
        a.free(q),
        a.stats().map(|_| ()),
    ] {
        assert_eq!(result.unwrap_err().kind, ErrorKind::ShutDown);
    }
}

/// Threads racing to make the same streams' shards: each stream must end with exactly one
/// (two shards for one stream would show as two small segments for it), with a shard per
/// stream and with the default's thread shards (the threads are all new to the device).
/// Many fresh devices, so that the race is run many times.
#[test]
fn racing_first_allocations_make_one_shard_per_stream() {
    const THREADS: u64 = 8;
    for conf in ["per_stream_shards:True", ""] {
        for round in 0..100 {
            let sim = Arc::new(SimDriver::new(1, 1 << 30));
            let mut config = Config::default();
            config.apply(conf).unwrap();
            let a = Arc::new(DeviceAllocator::new(0, sim, config).unwrap());
            let barrier = Arc::new(std::sync::Barrier::new(THREADS as usize));
            let workers: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (a, barrier) = (a.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        a.malloc(512, StreamId(t % 3)).unwrap()
                    })
                })
                .collect();
            let blocks: Vec<u64> = workers.into_iter().map(|w| w.join().unwrap()).collect();
            let segments = a.segments().unwrap();
            let mut streams: Vec<_> = segments.iter().map(|s| s.stream).collect();
            streams.sort_by_key(|s| s.0);
            assert_eq!(
                streams,
                [StreamId(0), StreamId(1), StreamId(2)],
                "{conf:?}, round {round}: one small segment per stream"
            );
            assert!(a.shards_made() <= 3, "{conf:?}, round {round}");
            for p in blocks {
                a.free(p).unwrap();
            }
        }
    }
}

#[test]
fn one_oom_counts_one_retry_as_without_shards() {
    let counts = |conf: &str| {
        let (_sim, a) = sharded(64 * MIB, conf);
        let keep = a.malloc(4096, S2).unwrap();
        let p = a.malloc(40 * MIB, S1).unwrap();
        assert_eq!(
            a.malloc(30 * MIB, S2).unwrap_err().kind,
            ErrorKind::OutOfMemory
        );
        let s = a.stats().unwrap();
        a.free(p).unwrap();
        a.free(keep).unwrap();
        (s.num_alloc_retries, s.num_ooms)
    };
    assert_eq!(counts(""), (1, 1), "paged");
    assert_eq!(counts("expandable_segments:False"), (1, 1), "plain");
}

#[test]
fn an_oom_past_the_limit_empties_nothing_and_says_so() {
    let (sim, a) = sharded(
        100 * MIB,
        "per_process_memory_fraction:0.5,expandable_segments:False",
    );
    let p = a.malloc(10 * MIB, S1).unwrap();
    a.free(p).unwrap();
    let before = sim.counters(0).bytes_in_use;
    let err = a.malloc(60 * MIB, S2).unwrap_err();
    assert_eq!(err.kind, ErrorKind::OutOfMemory);
    assert_eq!(sim.counters(0).bytes_in_use, before, "S1's cache kept");
    assert!(!err.message.contains("emptied"), "{}", err.message);
    assert!(
        err.message.contains("10.00 MiB cached free"),
        "{}",
        err.message
    );
}

#[test]
fn pool_calls_after_shutdown_are_refused_and_change_nothing() {
    let (sim, a) = sharded(1 << 30, "expandable_segments:False");
    let pool = (7, 7);
    a.begin_allocate_to_pool(pool, Box::new(|_| true)).unwrap();
    let p = a.malloc(4096, S1).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    a.free(p).unwrap();
    a.shutdown().unwrap();
    assert_eq!(a.release_pool(pool).unwrap_err().kind, ErrorKind::ShutDown);
    assert_eq!(
        a.end_allocate_to_pool(pool).unwrap_err().kind,
        ErrorKind::ShutDown
    );
    // Reopened (another device's shutdown failed): the hold is still there to release.
    a.reopen();
    a.release_pool(pool).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn blocks_freed_by_another_thread_are_found_in_their_shard() {
    let (_sim, a) = sharded(1 << 30, "");
    let a = Arc::new(a);
    let p = a.malloc(4096, S1).unwrap();
    let b = a.clone();
    std::thread::spawn(move || {
        // This thread's hint points at S2's shard: the free must search.
        let q = b.malloc(4096, S2).unwrap();
        b.free(p).unwrap();
        assert_eq!(b.free(p).unwrap_err().kind, ErrorKind::DoubleFree);
        b.free(q).unwrap();
    })
    .join()
    .unwrap();
    assert_eq!(a.stats().unwrap().allocation.all().current, 0);
}

/// A statistics read that overlaps memory leaving one shard and arriving in another must not
/// add both moments: reserved bytes (current and peak) are the device's own, never more than
/// it held. Stream 1's growth is held inside the driver (its shard locked) while the reader
/// has read shard 0 and waits for shard 1, and stream 0's cache is released meanwhile.
#[test]
fn a_statistics_read_never_counts_memory_moving_between_shards_twice() {
    let sim = Arc::new(SimDriver::new(1, 1 << 30));
    let gated = GatedDriver::new(sim.clone(), Gate::Allocate);
    let mut config = Config::default();
    config.apply("per_stream_shards:True").unwrap();
    let a = DeviceAllocator::new(0, gated.clone(), config).unwrap();
    for s in [S1, S2] {
        let p = a.malloc(4096, s).unwrap();
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    // Stream 1 caches a 64 MiB segment: the device never holds more than that.
    let p = a.malloc(64 * MIB, S1).unwrap();
    a.free(p).unwrap();
    a.reset_peak_stats().unwrap();
    gated.arm();
    std::thread::scope(|scope| {
        let grower = scope.spawn(|| a.malloc(64 * MIB, S2).unwrap());
        gated.wait_until_held();
        let reader = scope.spawn(|| a.stats().unwrap());
        std::thread::sleep(std::time::Duration::from_millis(100));
        let emptier = scope.spawn(|| a.empty_cache());
        while sim.counters(0).bytes_in_use != 0 {
            std::thread::yield_now();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        gated.open();
        let q = grower.join().unwrap();
        let reserved = reader.join().unwrap().reserved_bytes.all();
        emptier.join().unwrap().unwrap();
        assert!(
            reserved.current <= reserved.peak && reserved.peak <= (64 * MIB) as i64,
            "reserved current {} MiB, peak {} MiB: the device never held more than 64 MiB",
            reserved.current >> 20,
            reserved.peak >> 20
        );
        a.free(q).unwrap();
    });
    let after = a.stats().unwrap().reserved_bytes.all();
    assert_eq!(after.current as u64, sim.counters(0).bytes_in_use);
}

/// Reserved bytes read while shards map and release memory are one moment's: all = small +
/// large and allocated - freed = current in every read, and current never above peak.
#[test]
fn reserved_bytes_read_during_growth_and_release_are_consistent() {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    let (_sim, a) = sharded(8 << 30, "");
    let stop = AtomicBool::new(false);
    /// Stops the workers however the reader ends (a failed check included).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Relaxed);
        }
    }
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let (a, stop) = (&a, &stop);
            s.spawn(move || {
                let mut i = 0u64;
                while !stop.load(Relaxed) {
                    i += 1;
                    let size = if i.is_multiple_of(2) { 4096 } else { 30 * MIB };
                    let p = a.malloc(size, StreamId(10 + t)).unwrap();
                    a.free(p).unwrap();
                    if i.is_multiple_of(4) {
                        a.empty_cache().unwrap();
                    }
                }
            });
        }
        let _stop = StopOnDrop(&stop);
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(1500);
        let mut reads = 0;
        while std::time::Instant::now() < deadline {
            let [all, small, large] = a.stats().unwrap().reserved_bytes.0;
            assert_eq!(all.current, small.current + large.current, "read {reads}");
            for stat in [all, small, large] {
                assert_eq!(stat.allocated - stat.freed, stat.current, "read {reads}");
                assert!(stat.current <= stat.peak, "read {reads}");
            }
            reads += 1;
        }
    });
}

/// Peak reserved bytes over the device since the last reset.
fn peak_reserved(a: &DeviceAllocator) -> u64 {
    a.stats().unwrap().reserved_bytes.all().peak as u64
}

#[test]
fn a_stream_borrows_another_streams_idle_pages_instead_of_failing() {
    let (sim, a) = sharded(64 * MIB, "");
    let p = a.malloc(40 * MIB, S1).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(50 * MIB, S2).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.num_ooms, s.num_alloc_retries), (0, 0));
    assert!(s.paging.chunks_borrowed > 0, "{:?}", s.paging);
    assert_eq!(
        s.reserved_bytes.all().current as u64,
        sim.counters(0).bytes_in_use
    );
    a.free(q).unwrap();
}

#[test]
fn streams_that_peak_in_turn_reserve_one_peak_not_one_each() {
    let (sim, a) = sharded(1 << 30, "");
    // Each stream's shard in turn holds 64 MiB, then frees it (a pipeline's stages).
    let keep = a.malloc(2 * MIB, S1).unwrap();
    for round in 0..3 {
        for s in [S1, S2, StreamId(3)] {
            let p = a.malloc(64 * MIB, s).unwrap();
            a.free(p).unwrap();
            let reserved = a.stats().unwrap().reserved_bytes.all().current as u64;
            assert_eq!(reserved, sim.counters(0).bytes_in_use);
            assert!(
                peak_reserved(&a) <= 66 * MIB + 8 * MIB,
                "round {round}, stream {s:?}: peak reserved {} MiB for 66 MiB live at most",
                peak_reserved(&a) / MIB
            );
        }
    }
    let paging = a.stats().unwrap().paging;
    assert!(paging.chunks_borrowed > 0, "{paging:?}");
    assert_eq!(
        sim.counters(0).live_reservations,
        3,
        "one address range per stream, each still there"
    );
    a.free(keep).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn a_stream_takes_only_pages_no_live_block_of_another_stream_covers() {
    let (_sim, a) = sharded(1 << 30, "");
    // Stream 1: live blocks between free ones, so that its free pages are scattered.
    let mut live = Vec::new();
    let mut free = Vec::new();
    for i in 0..16 {
        let p = a.malloc(6 * MIB, S1).unwrap();
        if i % 2 == 0 {
            live.push(p)
        } else {
            free.push(p)
        }
    }
    for p in free {
        a.free(p).unwrap();
    }
    let q = a.malloc(40 * MIB, S2).unwrap();
    // Every block of stream 1 still lies in mapped memory of its own.
    for &p in &live {
        assert!(a.holds(p));
    }
    let segments = a.segments().unwrap();
    for seg in segments.iter().filter(|s| s.stream == S1) {
        let mapped = seg.mapped.as_ref().expect("paged");
        for &(addr, size, state) in &seg.blocks {
            if state == ccalloc::BlockState::Allocated {
                assert!(
                    mapped
                        .iter()
                        .any(|&(m, len)| m <= addr && addr + size <= m + len),
                    "live block {addr:#x}+{size} lost its pages"
                );
            }
        }
    }
    assert!(a.stats().unwrap().paging.chunks_borrowed > 0);
    a.free(q).unwrap();
    for p in live {
        a.free(p).unwrap();
    }
}

#[test]
fn streams_growing_at_once_on_two_threads_lend_to_each_other_without_deadlock() {
    let (sim, a) = sharded(1 << 30, "");
    std::thread::scope(|scope| {
        for (t, s) in [S1, S2].into_iter().enumerate() {
            let a = &a;
            scope.spawn(move || {
                let mut held = Vec::new();
                for i in 0..300u64 {
                    let size = (4 + (i * 7 + t as u64 * 13) % 29) * MIB;
                    held.push(a.malloc(size, s).unwrap());
                    if held.len() > 3 {
                        a.free(held.remove((i % 3) as usize)).unwrap();
                    }
                }
                for p in held {
                    a.free(p).unwrap();
                }
            });
        }
    });
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(
        s.reserved_bytes.all().current as u64,
        sim.counters(0).bytes_in_use
    );
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn an_oom_past_the_limit_counts_other_streams_parked_blocks_as_cached() {
    let (_sim, a) = sharded(256 * MIB, "per_process_memory_fraction:0.25");
    // Stream 2's freed block stays parked for a request of its size: cached free memory.
    let q = a.malloc(50 * MIB, S2).unwrap();
    a.free(q).unwrap();
    let e = a.malloc(70 * MIB, S1).unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfMemory);
    assert!(e.message.contains("50.00 MiB cached free"), "{}", e.message);
}

/// Peaks raised on paths other than an allocation or a free (here, blocks whose events
/// completed are cached inside `empty_cache`, one more inactive split) are settled too: the
/// same calls give the same peaks with one shard and with a shard per stream.
#[test]
fn peaks_lifted_inside_empty_cache_match_one_shard() {
    const PAUSED: StreamId = StreamId(9);
    let peaks = |conf: &str| {
        let sim = Arc::new(SimDriver::new(1, 1 << 30));
        let mut config = Config::default();
        config.apply(conf).unwrap();
        let a = DeviceAllocator::new(0, sim.clone(), config).unwrap();
        sim.set_stream_paused(0, PAUSED, true);
        let p1 = a.malloc(4096, S1).unwrap();
        let p2 = a.malloc(4096, S1).unwrap();
        a.record_stream(p1, PAUSED).unwrap();
        a.free(p1).unwrap();
        let q1 = a.malloc(4096, S2).unwrap();
        let q2 = a.malloc(4096, S2).unwrap();
        a.free(q1).unwrap();
        sim.set_stream_paused(0, PAUSED, false);
        a.empty_cache().unwrap();
        a.free(q2).unwrap();
        let s = a.stats().unwrap();
        a.free(p2).unwrap();
        (
            s.inactive_split.all().peak,
            s.inactive_split_bytes.all().peak,
        )
    };
    let one = peaks("per_stream_shards:False,expandable_segments:False");
    let sharded = peaks("per_stream_shards:True,expandable_segments:False");
    assert_eq!(sharded, one);
}
