//! Multi-threaded stress on the simulated device: threads on their own streams allocate,
//! write canaries, hand blocks across streams with record_stream, and free, while another
//! thread pauses and resumes streams and empties the cache.
#![cfg(feature = "sim")]

use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, StreamId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const THREADS: u64 = 4;
const STEPS: usize = 20_000;

/// xorshift: deterministic per thread, no dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn fill(ptr: u64, size: u64, tag: u8) {
    // SAFETY: sim memory is host memory and the block spans `size` bytes.
    unsafe { std::ptr::write_bytes(ptr as *mut u8, tag, size.min(256) as usize) };
}

fn intact(ptr: u64, size: u64, tag: u8) -> bool {
    // SAFETY: as in `fill`; the block is still live.
    let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, size.min(256) as usize) };
    bytes.iter().all(|&b| b == tag)
}

/// The threads share one shard (`thread_shards:False`; by default each, new to the device,
/// would get a shard for its stream): they contend for its lock and its pages.
#[test]
fn threads_on_their_own_streams_never_share_memory() {
    stress(Arc::new(SimDriver::new(1, 8 << 30)));
}

/// The same with a GPU running behind the host: every free reports the block's streams to
/// the sim, which refuses to unmap pages whose work has not run (so page moves must wait
/// on the right fences, across threads; a run moves about 2,900 pages).
#[test]
fn threads_with_a_gpu_behind_the_host_never_unmap_pages_in_use() {
    stress(Arc::new(SimDriver::new(1, 8 << 30).with_event_lag(2)));
}

/// Each thread's stream in a shard of its own, blocks handed across shards by record_stream
/// and freed through the shard-less `free`, while the controller empties every shard.
#[test]
fn threads_on_their_own_shards_never_share_memory() {
    stress_with(
        Arc::new(SimDriver::new(1, 8 << 30).with_event_lag(2)),
        "per_stream_shards:True",
        STEPS,
    );
}

/// Thread shards made at once (`thread_shards_on_contention:False`): each thread, new to the
/// device, gets a shard for its stream as it starts, while the others already allocate and
/// hand blocks over.
/// Shorter: the shards are made in the first steps.
#[test]
fn threads_on_their_own_streams_with_the_default_settings_never_share_memory() {
    let sim = Arc::new(SimDriver::new(1, 8 << 30).with_event_lag(2));
    let alloc = stress_with(sim, "thread_shards_on_contention:False", STEPS / 4);
    assert_eq!(alloc.shards_made(), THREADS as usize);
}

fn stress(sim: Arc<SimDriver>) {
    let alloc = stress_with(sim, "thread_shards:False", STEPS);
    assert_eq!(alloc.shards_made(), 1);
}

fn stress_with(sim: Arc<SimDriver>, conf: &str, steps: usize) -> Arc<DeviceAllocator> {
    let mut config = Config::default();
    config.apply(conf).unwrap();
    let alloc = Arc::new(DeviceAllocator::new(0, sim.clone(), config).unwrap());
    let stop = Arc::new(AtomicBool::new(false));

    let controller = {
        let (sim, alloc, stop) = (sim.clone(), alloc.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = Rng(99);
            while !stop.load(Ordering::Relaxed) {
                let stream = StreamId(100 + rng.next() % THREADS);
                sim.set_stream_paused(0, stream, rng.next().is_multiple_of(2));
                if rng.next().is_multiple_of(16) {
                    alloc.empty_cache().unwrap();
                }
                std::thread::yield_now();
            }
        })
    };

    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (alloc, sim) = (alloc.clone(), sim.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(t + 1);
                let stream = StreamId(100 + t);
                let mut live: Vec<(u64, u64, u8)> = Vec::new();
                for step in 0..steps {
                    if live.len() < 64 && (live.is_empty() || rng.next().is_multiple_of(2)) {
                        let size = match rng.next() % 10 {
                            0 => 1 + rng.next() % (16 << 20),
                            1..=3 => 1 + rng.next() % (2 << 20),
                            _ => 1 + rng.next() % 8192,
                        };
                        let ptr = alloc.malloc(size, stream).unwrap();
                        let tag = (step % 251) as u8 + 1;
                        fill(ptr, size, tag);
                        live.push((ptr, size, tag));
                    } else {
                        let (ptr, size, tag) = live.swap_remove((rng.next() as usize) % live.len());
                        assert!(
                            intact(ptr, size, tag),
                            "thread {t}: block {ptr:#x} was overwritten"
                        );
                        sim.note_use(0, ptr, size, stream);
                        if rng.next().is_multiple_of(4) {
                            let other = StreamId(100 + rng.next() % THREADS);
                            alloc.record_stream(ptr, other).unwrap();
                            sim.note_use(0, ptr, size, other);
                        }
                        alloc.free(ptr).unwrap();
                    }
                }
                for (ptr, size, tag) in live {
                    assert!(intact(ptr, size, tag));
                    alloc.free(ptr).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    controller.join().unwrap();

    for t in 0..THREADS {
        sim.set_stream_paused(0, StreamId(100 + t), false);
    }
    alloc.empty_cache().unwrap();
    let s = alloc.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(s.active.all().current, 0);
    assert_eq!(s.reserved_bytes.all().current, 0);
    assert_eq!(s.allocation.all().allocated, s.allocation.all().freed);
    assert_eq!(sim.counters(0).bytes_in_use, 0);
    alloc
}

/// Thread fronts under contention: blocks of a few sizes (so that fronts serve most
/// requests), half of them freed by the next thread, while another thread empties the
/// cache (draining every front) and reads the statistics (adding every front's counts).
/// On one shard (`thread_shards:False`), whose fronts the threads share.
#[test]
fn threads_freeing_each_others_blocks_through_their_fronts() {
    let alloc = freeing_each_others_blocks("thread_shards:False", STEPS);
    assert_eq!(alloc.shards_made(), 1);
}

/// The same with the default settings: each thread's stream in a shard of its own, so a
/// block freed by the next thread goes into that thread's front for another shard.
/// Shorter, as above.
#[test]
fn threads_on_their_own_shards_freeing_each_others_blocks_through_their_fronts() {
    let alloc = freeing_each_others_blocks("thread_shards_on_contention:False", STEPS / 4);
    assert_eq!(alloc.shards_made(), THREADS as usize);
}

fn freeing_each_others_blocks(conf: &str, steps: usize) -> Arc<DeviceAllocator> {
    let sim = Arc::new(SimDriver::new(1, 1 << 32));
    let mut config = Config::default();
    config.apply(conf).unwrap();
    let alloc = Arc::new(DeviceAllocator::new(0, sim.clone(), config).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let controller = {
        let (alloc, stop) = (alloc.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let s = alloc.stats().unwrap();
                assert!(s.allocation.all().current >= 0, "{s:?}");
                assert!(s.allocated_bytes.all().peak >= s.allocated_bytes.all().current);
                round += 1;
                if round.is_multiple_of(8) {
                    alloc.empty_cache().unwrap();
                }
                std::thread::yield_now();
            }
        })
    };
    let channels: Vec<_> = (0..THREADS)
        .map(|_| std::sync::mpsc::channel::<(u64, u64, u8)>())
        .collect();
    let senders: Vec<_> = channels.iter().map(|(tx, _)| tx.clone()).collect();
    let workers: Vec<_> = channels
        .into_iter()
        .enumerate()
        .map(|(t, (_, inbox))| {
            let alloc = alloc.clone();
            let next = senders[(t + 1) % THREADS as usize].clone();
            std::thread::spawn(move || {
                let mut rng = Rng(t as u64 + 7);
                let stream = StreamId(200 + t as u64);
                let mut live: Vec<(u64, u64, u8)> = Vec::new();
                let free = |(ptr, size, tag): (u64, u64, u8)| {
                    assert!(intact(ptr, size, tag), "block {ptr:#x} was overwritten");
                    alloc.free(ptr).unwrap();
                };
                for step in 0..steps {
                    while let Ok(block) = inbox.try_recv() {
                        free(block);
                    }
                    if live.len() < 32 && (live.is_empty() || rng.next().is_multiple_of(2)) {
                        let size = [512, 4096, 4096 * 3, 1 << 20][(rng.next() % 4) as usize];
                        let ptr = alloc.malloc(size, stream).unwrap();
                        let tag = (step % 251) as u8 + 1;
                        fill(ptr, size, tag);
                        live.push((ptr, size, tag));
                    } else {
                        let block = live.swap_remove((rng.next() as usize) % live.len());
                        if rng.next().is_multiple_of(2) {
                            next.send(block).unwrap();
                        } else {
                            free(block);
                        }
                    }
                }
                live.into_iter().for_each(free);
                drop(next);
                inbox
            })
        })
        .collect();
    drop(senders);
    // Blocks still in flight are freed here, after every worker is done.
    let inboxes: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    for inbox in inboxes {
        for (ptr, size, tag) in inbox.try_iter() {
            assert!(intact(ptr, size, tag));
            alloc.free(ptr).unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    controller.join().unwrap();
    alloc.empty_cache().unwrap();
    let s = alloc.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0, "{s:?}");
    assert_eq!(s.allocated_bytes.all().current, 0);
    assert_eq!(s.requested_bytes.all().current, 0);
    assert_eq!(s.allocation.all().allocated, s.allocation.all().freed);
    assert_eq!(s.reserved_bytes.all().current, 0);
    assert_eq!(sim.counters(0).bytes_in_use, 0);
    alloc
}

/// Reads `a`'s statistics and checks that no more bytes read as allocated than reserved
/// (`what` names the read in the failure).
fn read_allocated_within_reserved(a: &DeviceAllocator, what: &str) -> ccalloc::DeviceStats {
    let s = a.stats().unwrap();
    let (allocated, reserved) = (
        s.allocated_bytes.all().current,
        s.reserved_bytes.all().current,
    );
    assert!(
        allocated <= reserved,
        "{what}: {allocated} bytes allocated, {reserved} reserved"
    );
    s
}

/// Statistics read while other threads make and release segments stay consistent: no more
/// bytes allocated than reserved. On one shard (`thread_shards:False`), read under its lock,
/// and with the default settings, where each thread's stream has a shard of its own and a
/// read locks every shard at once. (Each allocation here needs a new plain segment, and
/// every few steps the cache is emptied, so reserved bytes move all the time.) One shard
/// with paged segments, and the default with them, run fewer steps, to keep the time.
#[test]
fn stats_read_mid_run_never_show_more_allocated_than_reserved() {
    for (conf, steps) in [
        ("expandable_segments:False,thread_shards:False", 4_000),
        ("thread_shards:False", 1_500),
        (
            "expandable_segments:False,thread_shards_on_contention:False",
            4_000,
        ),
        ("thread_shards_on_contention:False", 3_500),
    ] {
        let sim = Arc::new(SimDriver::new(1, 8 << 30));
        let mut config = Config::default();
        config.apply(conf).unwrap();
        let a = Arc::new(DeviceAllocator::new(0, sim, config).unwrap());
        let done = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..3u64)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let mut rng = Rng(0x9e37_79b9 + t);
                    for step in 0..steps {
                        let size = (4 + rng.next() % 60) << 20;
                        let p = a.malloc(size, StreamId(t + 1)).unwrap();
                        a.free(p).unwrap();
                        if step % 4 == 3 {
                            a.empty_cache().unwrap();
                        }
                    }
                })
            })
            .collect();
        let reader = {
            let (a, done) = (a.clone(), done.clone());
            std::thread::spawn(move || {
                let mut reads = 0u64;
                while !done.load(Ordering::Relaxed) {
                    let s = read_allocated_within_reserved(&a, &format!("{conf}: read {reads}"));
                    assert!(
                        s.reserved_bytes.all().peak >= s.reserved_bytes.all().current,
                        "{conf}: peak below current"
                    );
                    reads += 1;
                }
                reads
            })
        };
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
        let shards = if conf.contains("thread_shards:False") {
            1
        } else {
            3
        };
        assert_eq!(a.shards_made(), shards, "{conf}");
    }
}

/// Statistics read while threads new to the device make their shards. A read that found
/// one shard (no peak book yet) but then walked the shards made meanwhile read each at its
/// own moment, and could show more bytes allocated than reserved. Many short runs, so that
/// reads fall into the moments when the second and third shards are made.
#[test]
fn stats_read_while_shards_are_made_never_show_more_allocated_than_reserved() {
    for run in 0..200u64 {
        let sim = Arc::new(SimDriver::new(1, 8 << 30));
        let a = Arc::new(DeviceAllocator::new(0, sim, Config::default()).unwrap());
        let done = Arc::new(AtomicBool::new(false));
        let reader = {
            let (a, done) = (a.clone(), done.clone());
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    read_allocated_within_reserved(&a, &format!("run {run}"));
                }
            })
        };
        let workers: Vec<_> = (0..3u64)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    for step in 0..12u64 {
                        let p = a.malloc((4 + (step * 7 + t) % 40) << 20, StreamId(t + 1));
                        a.free(p.unwrap()).unwrap();
                        a.empty_cache().unwrap();
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        reader.join().unwrap();
    }
}
