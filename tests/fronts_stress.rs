//! Thread fronts under concurrency: short-lived threads allocating, freeing (also each
//! other's blocks) and recording streams while settings, captures, resets, drains and
//! snapshots run; at the end no overlap, exact totals, nothing left on the device.
#![cfg(feature = "sim")]
use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, StreamId};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One shard for every thread.
#[test]
fn fronts_under_concurrent_slow_paths() {
    under_concurrent_slow_paths("thread_shards:False");
}

/// Thread shards made at once: threads that start on a stream no shard holds may get shards
/// of their own, made while the others run.
#[test]
fn fronts_of_thread_shards_under_concurrent_slow_paths() {
    under_concurrent_slow_paths("thread_shards_on_contention:False");
}

/// The default: the same threads, with what shards contention brings. Few: short-lived
/// threads share the two streams, so only a thread whose first stream no other thread had
/// used can get a shard (`tests/thread_shards.rs` tests how many).
#[test]
fn fronts_of_thread_shards_made_on_contention_under_concurrent_slow_paths() {
    under_concurrent_slow_paths("");
}

/// The same with a shard per stream: each shard's fronts alike.
#[test]
fn fronts_of_several_shards_under_concurrent_slow_paths() {
    under_concurrent_slow_paths("per_stream_shards:True");
}

fn under_concurrent_slow_paths(conf: &str) {
    let sim = Arc::new(SimDriver::new(1, 1 << 32));
    let mut config = Config::default();
    config.apply(conf).unwrap();
    let a = DeviceAllocator::new(0, sim.clone(), config).unwrap();
    let live = LiveBlocks::default();
    let handoff: Mutex<Vec<u64>> = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    let allocs = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let (a, stop, live, handoff, allocs) = (&a, &stop, &live, &handoff, &allocs);
            s.spawn(move || {
                let mut seed = t + 1;
                while !stop.load(Ordering::Relaxed) {
                    // Short-lived threads: fronts orphaned, folded later.
                    std::thread::scope(|s2| {
                        s2.spawn(|| {
                            let mut mine: Vec<u64> = Vec::new();
                            for _ in 0..200 {
                                let r = draw(&mut seed);
                                match r % 6 {
                                    0..=2 => {
                                        let size = 512 * (1 + r % 5);
                                        let stream = StreamId(r % 2);
                                        let p = a.malloc(size, stream).unwrap();
                                        allocs.fetch_add(1, Ordering::Relaxed);
                                        live.insert(p, size);
                                        mine.push(p);
                                    }
                                    3 | 4 if !mine.is_empty() => {
                                        let p = mine.swap_remove((r as usize / 7) % mine.len());
                                        live.remove(p);
                                        a.free(p).unwrap();
                                    }
                                    5 if !mine.is_empty() => {
                                        hand_off(a, handoff, mine.swap_remove(0), r);
                                    }
                                    _ => free_handed_off(a, live, handoff),
                                }
                            }
                            for p in mine {
                                handoff.lock().unwrap().push(p);
                            }
                        });
                    });
                }
            });
        }
        // Slow paths.
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut i = 0u64;
        // Ends after a whole round, so that no capture window is left open (`empty_cache`
        // waits for the end of a capture).
        while Instant::now() < deadline || !i.is_multiple_of(8) {
            match i % 8 {
                0 => a.apply_config("thread_cache:False").unwrap(),
                1 => a.apply_config("thread_cache:True").unwrap(),
                2 => a
                    .begin_allocate_to_pool((1, 1), Box::new(|s| s == StreamId(5)))
                    .unwrap(),
                3 => {
                    a.end_allocate_to_pool((1, 1)).unwrap();
                    a.release_pool((1, 1)).unwrap();
                }
                4 => a.reset_peak_stats().unwrap(),
                5 => a.empty_cache().unwrap(),
                6 => {
                    a.segments().unwrap();
                }
                _ => {
                    let st = a.stats().unwrap();
                    let c = st.allocation.all();
                    assert!(c.current >= 0 && c.peak >= c.current, "{c:?}");
                }
            }
            i += 1;
            std::thread::sleep(Duration::from_micros(200));
        }
        stop.store(true, Ordering::Relaxed);
    });
    live.free_all(&a, &mut handoff.lock().unwrap());
    all_counted_and_given_back(&a, &sim, allocs.load(Ordering::Relaxed));
}

/// Blocks over 1 MiB held in long-lived threads' fronts while the other threads allocate
/// (needing the held memory: the device has room for little more than the most ever
/// live), free each other's blocks, and slow paths run: never an OOM, never a block
/// handed out twice, exact totals, nothing left on the device.
#[test]
fn large_blocks_held_in_fronts_under_concurrent_slow_paths() {
    large_blocks_under_concurrent_slow_paths("thread_shards:False");
}

/// The same with the default, where a thread starting on stream 1 may make a second shard
/// while large blocks sit in the first one's fronts (they go back when it is made).
#[test]
fn large_blocks_in_fronts_while_thread_shards_are_made() {
    for _ in 0..10 {
        large_blocks_under_concurrent_slow_paths("thread_shards_on_contention:False");
    }
}

fn large_blocks_under_concurrent_slow_paths(conf: &str) {
    const MIB: u64 = 1 << 20;
    const THREADS: u64 = 3;
    /// Blocks a thread keeps live at once, and blocks waiting to be freed by another.
    const MINE: usize = 2;
    const HANDOFF: usize = 3;
    const SIZES: [u64; 5] = [4096, 2 * MIB, 3 * MIB + 512, 24 * MIB, 24 * MIB + 4096];
    let most_live = (THREADS as usize * MINE + HANDOFF + THREADS as usize) as u64 * 25 * MIB;
    let sim = Arc::new(SimDriver::new(1, most_live + 64 * MIB));
    let mut config = Config::default();
    config.apply(conf).unwrap();
    let a = DeviceAllocator::new(0, sim.clone(), config).unwrap();
    let live = LiveBlocks::default();
    let handoff: Mutex<Vec<u64>> = Mutex::new(Vec::new());
    let running = AtomicU64::new(THREADS);
    let allocs = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (a, live, handoff, allocs, running) = (&a, &live, &handoff, &allocs, &running);
            s.spawn(move || {
                let mut seed = t + 11;
                let mut mine: Vec<(u64, u64)> = Vec::new();
                for _ in 0..600 {
                    let r = draw(&mut seed);
                    match r % 7 {
                        // Free and ask again for the same size: the front's loop.
                        0 if !mine.is_empty() => {
                            let (p, size) = mine.swap_remove(0);
                            live.remove(p);
                            a.free(p).unwrap();
                            let q = a.malloc(size, StreamId(0)).unwrap();
                            allocs.fetch_add(1, Ordering::Relaxed);
                            live.insert(q, size);
                            mine.push((q, size));
                        }
                        1..=3 if mine.len() < MINE => {
                            let size = SIZES[(r / 7) as usize % SIZES.len()];
                            let stream = StreamId((r / 64) % 2);
                            let p = a.malloc(size, stream).unwrap_or_else(|e| panic!("{e}"));
                            allocs.fetch_add(1, Ordering::Relaxed);
                            live.insert(p, size);
                            mine.push((p, size));
                        }
                        4 | 5 if !mine.is_empty() => {
                            let (p, _) = mine.swap_remove((r as usize / 7) % mine.len());
                            live.remove(p);
                            a.free(p).unwrap();
                        }
                        6 if !mine.is_empty() && handoff.lock().unwrap().len() < HANDOFF => {
                            hand_off(a, handoff, mine.swap_remove(0).0, r);
                        }
                        _ => free_handed_off(a, live, handoff),
                    }
                }
                for (p, _) in mine {
                    live.remove(p);
                    a.free(p).unwrap();
                }
                running.fetch_sub(1, Ordering::Release);
            });
        }
        // Slow paths, until the threads are done.
        let mut i = 0u64;
        while running.load(Ordering::Acquire) > 0 {
            match i % 6 {
                0 => a.reset_peak_stats().unwrap(),
                1 => a.empty_cache().unwrap(),
                2 => {
                    a.segments().unwrap();
                }
                3 => a.set_memory_fraction(0.9).unwrap(),
                4 => a.set_memory_fraction(1.0).unwrap(),
                _ => {
                    let st = a.stats().unwrap();
                    let c = st.allocation.all();
                    assert!(c.current >= 0 && c.peak >= c.current, "{c:?}");
                    let b = st.allocated_bytes.all();
                    assert!(b.current >= 0 && b.peak >= b.current, "{b:?}");
                }
            }
            i += 1;
            std::thread::yield_now();
        }
    });
    live.free_all(&a, &mut handoff.lock().unwrap());
    all_counted_and_given_back(&a, &sim, allocs.load(Ordering::Relaxed));
}

/// A worker's next draw: a linear congruential generator's high bits.
fn draw(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *seed >> 33
}

/// Leaves `p` for another thread to free, recorded on another stream first for one draw
/// `r` in three.
fn hand_off(a: &DeviceAllocator, handoff: &Mutex<Vec<u64>>, p: u64, r: u64) {
    if r.is_multiple_of(3) {
        a.record_stream(p, StreamId(7)).unwrap();
    }
    handoff.lock().unwrap().push(p);
}

/// Frees a block another thread left, if any.
fn free_handed_off(a: &DeviceAllocator, live: &LiveBlocks, handoff: &Mutex<Vec<u64>>) {
    let got = handoff.lock().unwrap().pop();
    if let Some(p) = got {
        live.remove(p);
        a.free(p).unwrap();
    }
}

/// The blocks handed out and not yet freed, by address: a block handed out while it
/// overlaps one of them, or freed while not among them, fails the test.
#[derive(Default)]
struct LiveBlocks(Mutex<BTreeMap<u64, u64>>);

impl LiveBlocks {
    fn insert(&self, p: u64, size: u64) {
        let mut live = self.0.lock().unwrap();
        let end = p + size.div_ceil(512) * 512;
        if let Some((&q, &e)) = live.range(..end).next_back() {
            assert!(e <= p, "{p:#x} overlaps live {q:#x}..{e:#x}");
        }
        live.insert(p, end);
    }

    fn remove(&self, p: u64) {
        self.0
            .lock()
            .unwrap()
            .remove(&p)
            .expect("freed a live block");
    }

    /// Frees the blocks left waiting in `handoff`; then none is live.
    fn free_all(&self, a: &DeviceAllocator, handoff: &mut Vec<u64>) {
        for p in std::mem::take(handoff) {
            self.remove(p);
            a.free(p).unwrap();
        }
        assert!(self.0.lock().unwrap().is_empty());
    }
}

/// With every block freed: the statistics count `allocs` allocations and as many frees,
/// nothing is current, and the cache emptied gives every byte back.
fn all_counted_and_given_back(a: &DeviceAllocator, sim: &SimDriver, allocs: u64) {
    a.empty_cache().unwrap();
    let st = a.stats().unwrap();
    let c = st.allocation.all();
    assert_eq!(c.current, 0, "{st:?}");
    assert_eq!(c.allocated, allocs as i64);
    assert_eq!(c.allocated, c.freed);
    assert_eq!(st.allocated_bytes.all().current, 0);
    assert_eq!(st.active_bytes.all().current, 0);
    assert_eq!(st.requested_bytes.all().current, 0);
    assert_eq!(sim.counters(0).bytes_in_use, 0, "memory given back");
    a.shutdown().unwrap();
}
