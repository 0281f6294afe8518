//! `thread_shards` (on by default): threads each on their own stream get shards of their
//! own, by default once they are seen contending for the first shard's lock
//! (`thread_shards_on_contention`), at once otherwise; one thread's several streams and a
//! stream several threads share stay in one shard.
#![cfg(feature = "sim")]

mod common;

use ccalloc::{DeviceAllocator, ErrorKind, StreamId};
use common::{on_new_thread, sim_allocator, xorshift};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

fn allocator(conf: &str) -> Arc<DeviceAllocator> {
    sim_allocator(1 << 30, conf).1
}

/// A device under each rule for making thread shards: shards once threads contend (the
/// default; without contention, as here, one shard), and shards at once
/// (`thread_shards_on_contention:False`), whose rules for threads' other streams the
/// default follows once threads have contended.
fn both_rules() -> [Arc<DeviceAllocator>; 2] {
    [
        allocator(""),
        allocator("thread_shards_on_contention:False"),
    ]
}

#[test]
fn threads_on_their_own_streams_get_a_shard_each_at_once() {
    let a = allocator("thread_shards_on_contention:False");
    let first = a.malloc(MIB, StreamId(0)).unwrap();
    assert_eq!(a.shards_made(), 1);
    let blocks: Vec<u64> = (1..=4u64)
        .map(|t| {
            let a = a.clone();
            on_new_thread(move || a.malloc(4096 * t, StreamId(100 + t)).unwrap())
        })
        .collect();
    assert_eq!(a.shards_made(), 5, "one shard per new thread's stream");
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 5);
    assert_eq!(
        s.requested_bytes.all().current as u64,
        MIB + 4096 * (1 + 2 + 3 + 4)
    );
    // Each stream's memory is in its own segments.
    let streams: Vec<u64> = a.segments().unwrap().iter().map(|s| s.stream.0).collect();
    for t in 1..=4u64 {
        assert!(streams.contains(&(100 + t)), "{streams:?}");
    }
    // Blocks are found in their shard from any thread.
    for p in blocks {
        a.free(p).unwrap();
    }
    a.free(first).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(s.requested_bytes.all().peak as u64, MIB + 4096 * 10);
}

#[test]
fn one_thread_on_many_streams_keeps_one_shard() {
    for a in both_rules() {
        let blocks: Vec<u64> = (0..6u64)
            .map(|s| a.malloc(MIB, StreamId(s)).unwrap())
            .collect();
        assert_eq!(a.shards_made(), 1);
        for p in blocks {
            a.free(p).unwrap();
        }
    }
}

#[test]
fn two_threads_on_one_stream_share_its_shard() {
    for a in both_rules() {
        a.free(a.malloc(MIB, StreamId(0)).unwrap()).unwrap();
        let p = a.malloc(MIB, StreamId(7)).unwrap();
        let b = a.clone();
        let q = on_new_thread(move || {
            let q = b.malloc(MIB, StreamId(7)).unwrap();
            b.free(p).unwrap();
            q
        });
        assert_eq!(a.shards_made(), 1);
        a.free(q).unwrap();
    }
}

/// PyTorch's autograd thread runs backward on the streams forward used: a side stream the
/// first thread allocated on stays in the first shard, though the autograd thread has never
/// allocated before.
#[test]
fn a_new_thread_on_a_stream_the_first_shard_holds_memory_of_joins_that_shard() {
    for a in both_rules() {
        let main = a.malloc(MIB, StreamId(0)).unwrap();
        let side = a.malloc(3 * MIB, StreamId(5)).unwrap();
        let b = a.clone();
        let grad = on_new_thread(move || b.malloc(3 * MIB, StreamId(5)).unwrap());
        assert_eq!(a.shards_made(), 1);
        for p in [main, side, grad] {
            a.free(p).unwrap();
        }
    }
}

/// A thread that has allocated (on a stream with a shard already) keeps its later new
/// streams in the first shard: only a thread's first stream can start a shard.
#[test]
fn a_thread_that_has_allocated_keeps_its_new_streams_in_the_first_shard() {
    let a = allocator("thread_shards_on_contention:False");
    let main = a.malloc(MIB, StreamId(0)).unwrap();
    let b = a.clone();
    let (p, q) = on_new_thread(move || {
        let p = b.malloc(MIB, StreamId(0)).unwrap();
        let q = b.malloc(MIB, StreamId(9)).unwrap();
        (p, q)
    });
    assert_eq!(a.shards_made(), 1);
    // A thread whose first stream got a shard: its next new stream goes to the first.
    let b = a.clone();
    let (r, s) = on_new_thread(move || {
        let r = b.malloc(MIB, StreamId(20)).unwrap();
        let s = b.malloc(MIB, StreamId(21)).unwrap();
        (r, s)
    });
    assert_eq!(a.shards_made(), 2);
    for p in [main, p, q, r, s] {
        a.free(p).unwrap();
    }
    assert_eq!(a.stats().unwrap().allocation.all().current, 0);
}

#[test]
fn thread_shards_off_keeps_one_shard() {
    let a = allocator("thread_shards:False");
    let first = a.malloc(MIB, StreamId(0)).unwrap();
    let blocks: Vec<u64> = (1..=3u64)
        .map(|t| {
            let a = a.clone();
            on_new_thread(move || a.malloc(MIB, StreamId(t)).unwrap())
        })
        .collect();
    assert_eq!(a.shards_made(), 1);
    for p in blocks.into_iter().chain([first]) {
        a.free(p).unwrap();
    }
}

#[test]
fn thread_shards_is_fixed_once_the_device_allocates() {
    let a = allocator("");
    a.apply_config("thread_shards:False").unwrap();
    a.apply_config("thread_shards:True").unwrap();
    let p = a.malloc(MIB, StreamId(0)).unwrap();
    let e = a.apply_config("thread_shards:False").unwrap_err();
    assert_eq!(e.kind, ErrorKind::Config);
    assert!(e.message.contains("thread_shards"), "{}", e.message);
    // So is when they are made; restating today's value is no change.
    let e = a
        .apply_config("thread_shards_on_contention:False")
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Config);
    assert!(
        e.message.contains("thread_shards_on_contention"),
        "{}",
        e.message
    );
    a.apply_config("thread_shards_on_contention:True").unwrap();
    // Other settings still change.
    a.apply_config("page_slack:0.05").unwrap();
    a.free(p).unwrap();
}

/// Threads churning on their own shards while the first thread reads statistics: every
/// read is one moment's (no more allocated than reserved), and the peaks, read once the
/// threads are done, are exact (each thread's blocks live together at most once).
#[test]
fn statistics_stay_exact_while_thread_shards_churn() {
    let a = allocator("thread_shards_on_contention:False");
    let base = a.malloc(MIB, StreamId(0)).unwrap();
    let workers: Vec<_> = (1..=3u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                for step in 0..2_000u64 {
                    let p = a.malloc(((step % 7) + 1) * 64 * 1024, StreamId(t)).unwrap();
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    let mut reads = 0;
    while !workers.iter().all(|w| w.is_finished()) {
        let s = a.stats().unwrap();
        assert!(s.allocated_bytes.all().current <= s.reserved_bytes.all().current);
        assert!(s.allocation.all().current <= 4);
        reads += 1;
    }
    for w in workers {
        w.join().unwrap();
    }
    assert!(reads > 0);
    assert_eq!(a.shards_made(), 4);
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 1);
    // Peak blocks live: at most the base and one per thread, and at least the base and one.
    let peak = s.allocation.all().peak;
    assert!((2..=4).contains(&peak), "{peak}");
    assert!(s.requested_bytes.all().peak as u64 <= MIB + 3 * 7 * 64 * 1024);
    a.free(base).unwrap();
}

/// The default (`thread_shards_on_contention`): threads on streams of their own share the
/// first shard until they are seen contending for its lock; then each of their streams
/// gets a shard of its own, and every block, wherever it lies, is found by its free.
#[test]
fn the_default_makes_thread_shards_only_once_threads_contend() {
    // Contention needs threads running at once; one CPU only ever preempts a holder.
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        eprintln!("skipped: one CPU");
        return;
    }
    let a = allocator("");
    let first = a.malloc(MIB, StreamId(0)).unwrap();
    // Threads that allocate one after another never contend: one shard.
    for t in 1..=4u64 {
        let worker = a.clone();
        let p = on_new_thread(move || worker.malloc(4096 * t, StreamId(100 + t)).unwrap());
        a.free(p).unwrap();
    }
    assert_eq!(a.shards_made(), 1);
    assert_eq!(a.lock_counters().unwrap().contended, 0);
    // Four threads churning at once, each on a stream of its own that no thread has used
    // (a new thread on a stream the first shard holds memory of joins the first shard),
    // until shards appear (or 20 s).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let workers: Vec<_> = (1..=4u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let mut held = Vec::new();
                let mut next = xorshift(t);
                while a.shards_made() < 5 && std::time::Instant::now() < deadline {
                    let k = next();
                    // Random sizes, so that the thread caches do not serve them.
                    held.push(
                        a.malloc(512 + (k >> 40) % (1 << 18), StreamId(200 + t))
                            .unwrap(),
                    );
                    if held.len() > 64 {
                        a.free(held.swap_remove((k >> 20) as usize % held.len()))
                            .unwrap();
                    }
                }
                for p in held {
                    a.free(p).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let locks = a.lock_counters().unwrap();
    // The rule's threshold: one in 64 of a window of 65,536 acquisitions.
    assert!(locks.contended >= 1024, "{locks:?}");
    assert_eq!(
        a.shards_made(),
        5,
        "each contending thread's stream in a shard of its own"
    );
    a.free(first).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(
        s.allocation.all().current,
        0,
        "every block freed, in whichever shard"
    );
}

/// Threads that take turns never contend, and keep one shard with the default: two threads
/// on one stream (PyTorch's forward and autograd threads), and a server's threads each on a
/// stream of its own, serving one after another (which the immediate rule would shard).
#[test]
fn threads_taking_turns_keep_one_shard() {
    for conf in ["", "thread_shards_on_contention:False"] {
        let a = allocator(conf);
        let (to_other, from_main) = std::sync::mpsc::channel::<Vec<u64>>();
        let (to_main, from_other) = std::sync::mpsc::channel::<()>();
        let other = {
            let a = a.clone();
            std::thread::spawn(move || {
                while let Ok(blocks) = from_main.recv() {
                    for p in blocks {
                        a.free(p).unwrap();
                    }
                    // Its own request, on a stream of its own.
                    a.free(a.malloc(4096 * 3, StreamId(300)).unwrap()).unwrap();
                    to_main.send(()).unwrap();
                }
            })
        };
        for step in 0..200u64 {
            let blocks = (0..16u64)
                .map(|i| {
                    a.malloc(4096 * (1 + (step * 7 + i) % 50), StreamId(0))
                        .unwrap()
                })
                .collect();
            to_other.send(blocks).unwrap();
            from_other.recv().unwrap();
        }
        drop(to_other);
        other.join().unwrap();
        let locks = a.lock_counters().unwrap();
        assert_eq!(locks.contended, 0, "{conf}: {locks:?}");
        assert!(locks.handoffs >= 200, "{conf}: {locks:?}");
        let expected = if conf.is_empty() { 1 } else { 2 };
        assert_eq!(a.shards_made(), expected, "{conf}");
    }
}
