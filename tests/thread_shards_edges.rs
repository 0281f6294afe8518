//! `thread_shards` at its edges, on the sim: streams past the 32 slots, threads on many
//! devices, settings changed late, frees and `record_stream` across threads' shards,
//! private-pool windows, OOMs, statistics, shutdown and memory kept per exited thread.
#![cfg(feature = "sim")]

mod common;

use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, ErrorKind, StreamId};
use common::{on_new_thread, sim_allocator};
use std::sync::{Arc, Barrier};

const MIB: u64 = 1 << 20;
/// `MAX_SHARDS` in src/alloc/device/mod.rs.
const MAX_SHARDS: u64 = 32;

/// These tests pin down how thread shards are made and used, so they make them at once
/// (`thread_shards_on_contention:False`); `tests/thread_shards.rs` covers the default's wait
/// for contention.
const AT_ONCE: &str = "thread_shards_on_contention:False";

fn allocator(conf: &str) -> Arc<DeviceAllocator> {
    sim_allocator(1 << 30, &format!("{AT_ONCE},{conf}")).1
}

/// The slot a stream past `MAX_SHARDS` shares (`shared_slot` in src/alloc/device/mod.rs).
fn shared_slot(stream: u64) -> u64 {
    stream.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - MAX_SHARDS.trailing_zeros())
}

/// A stream handle (64-byte aligned, as cudaStream_t values are) whose shared slot is not
/// the first one.
fn stream_not_sharing_slot_0() -> StreamId {
    let s = (1..)
        .map(|k| 0x7f00_0000_0000u64 + k * 0x40)
        .find(|&s| shared_slot(s) != 0)
        .unwrap();
    StreamId(s)
}

/// Segments of `stream` (each shard makes its own for a stream it serves).
fn segments_of(a: &DeviceAllocator, stream: StreamId) -> usize {
    a.segments()
        .unwrap()
        .iter()
        .filter(|s| s.stream == stream)
        .count()
}

/// Fills every slot but the first with new threads each on a stream of its own.
fn fill_the_slots(a: &Arc<DeviceAllocator>) {
    for t in 1..MAX_SHARDS {
        let b = a.clone();
        on_new_thread(move || {
            let p = b.malloc(4096, StreamId(5000 + t)).unwrap();
            b.free(p).unwrap();
        });
    }
    assert_eq!(a.shards_made(), MAX_SHARDS as usize);
}

// ---------------------------------------------------------------------------------------
// Streams past the 32 slots.

/// A thread that has allocated keeps its later new streams in the first shard, also once
/// every slot is taken: a stream no slot names is the first shard's for every thread, so
/// its memory is never split over two shards (its cached blocks and fronts there unused).
#[test]
fn a_home_threads_stream_stays_in_the_first_shard_after_the_slots_fill() {
    let a = allocator("");
    let x = stream_not_sharing_slot_0();
    let main = a.malloc(4096, StreamId(0)).unwrap();
    let before = a.malloc(4096, x).unwrap();
    assert_eq!(a.shards_made(), 1);
    assert_eq!(segments_of(&a, x), 1);
    fill_the_slots(&a);
    // The same thread, the same stream: its blocks belong with the first ones.
    let after = a.malloc(4096, x).unwrap();
    assert_eq!(
        segments_of(&a, x),
        1,
        "stream {x:?} split over two shards once the slots filled"
    );
    for p in [main, before, after] {
        a.free(p).unwrap();
    }
}

/// A new thread on a stream the first shard holds memory of (the autograd case) joins that
/// shard, also once every slot is taken.
#[test]
fn a_new_thread_joins_the_first_shards_stream_after_the_slots_fill() {
    let a = allocator("");
    let x = stream_not_sharing_slot_0();
    let main = a.malloc(4096, StreamId(0)).unwrap();
    let forward = a.malloc(4096, x).unwrap();
    fill_the_slots(&a);
    let b = a.clone();
    let backward = on_new_thread(move || b.malloc(4096, x).unwrap());
    assert_eq!(
        segments_of(&a, x),
        1,
        "stream {x:?} split over two shards once the slots filled"
    );
    for p in [main, forward, backward] {
        a.free(p).unwrap();
    }
}

/// Many short-lived threads, each on a new stream, well past the slots: 32 shards and no
/// more, every block found, every byte back after `empty_cache`, and no memory kept per
/// exited thread's stream.
#[test]
fn short_lived_threads_past_the_slots_share_shards_and_give_everything_back() {
    let (sim, a) = sim_allocator(1 << 30, AT_ONCE);
    let keep = a.malloc(MIB, StreamId(0)).unwrap();
    let mut blocks = Vec::new();
    for t in 0..80u64 {
        let b = a.clone();
        let (p, q) = on_new_thread(move || {
            let p = b.malloc(4096 + t, StreamId(0x1000 + t * 0x40)).unwrap();
            let q = b.malloc(3 * MIB, StreamId(0x1000 + t * 0x40)).unwrap();
            b.free(q).unwrap();
            (p, b.malloc(3 * MIB, StreamId(0x1000 + t * 0x40)).unwrap())
        });
        blocks.push(p);
        blocks.push(q);
    }
    assert_eq!(a.shards_made(), MAX_SHARDS as usize);
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 161);
    assert!(s.allocated_bytes.all().current <= s.reserved_bytes.all().current);
    // Freed from this thread (none of these blocks is its own).
    for p in blocks {
        a.free(p).unwrap();
    }
    a.free(keep).unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert_eq!(s.allocated_bytes.all().current, 0);
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
    assert_eq!(a.stats().unwrap().reserved_bytes.all().current, 0);
}

// ---------------------------------------------------------------------------------------
// The thread-local list of homes.

/// A thread remembers the devices it allocated on well past one per GPU (here 9 allocators,
/// as 8 GPUs and the pinned host cache): its next new stream on the first stays in the
/// first shard.
#[test]
fn a_thread_on_nine_devices_keeps_its_new_streams_in_the_first_shard() {
    on_new_thread(|| {
        let devices: Vec<Arc<DeviceAllocator>> = (0..9).map(|_| allocator("")).collect();
        let blocks: Vec<u64> = devices
            .iter()
            .map(|a| a.malloc(4096, StreamId(0)).unwrap())
            .collect();
        // A new stream on the first device, from the same thread.
        let p = devices[0].malloc(4096, StreamId(5)).unwrap();
        assert_eq!(
            devices[0].shards_made(),
            1,
            "this thread has allocated on device 0: its new stream stays in the first shard"
        );
        devices[0].free(p).unwrap();
        for (a, p) in devices.iter().zip(blocks) {
            a.free(p).unwrap();
        }
    });
}

/// Eight devices: no shard is made for a home thread's new stream.
#[test]
fn a_thread_on_eight_devices_keeps_its_new_streams_in_the_first_shard() {
    on_new_thread(|| {
        let devices: Vec<Arc<DeviceAllocator>> = (0..8).map(|_| allocator("")).collect();
        let blocks: Vec<u64> = devices
            .iter()
            .map(|a| a.malloc(4096, StreamId(0)).unwrap())
            .collect();
        for a in &devices {
            let p = a.malloc(4096, StreamId(5)).unwrap();
            assert_eq!(a.shards_made(), 1);
            a.free(p).unwrap();
        }
        for (a, p) in devices.iter().zip(blocks) {
            a.free(p).unwrap();
        }
    });
}

// ---------------------------------------------------------------------------------------
// Settings.

/// Replacing every setting (`set_config`, behind `ccalloc_reset_config`) after the first
/// allocation keeps `thread_shards`: a new thread's stream still gets a shard of its own.
#[test]
fn set_config_after_the_first_allocation_keeps_thread_shards() {
    let a = allocator("");
    let p = a.malloc(4096, StreamId(0)).unwrap();
    let off = Config {
        thread_shards: false,
        thread_shards_on_contention: true,
        max_split_size: 64 * MIB,
        ..Config::default()
    };
    a.set_config(off).unwrap();
    assert_eq!(
        a.max_split_size().unwrap(),
        64 * MIB,
        "other settings change"
    );
    let b = a.clone();
    let q = on_new_thread(move || b.malloc(4096, StreamId(1)).unwrap());
    assert_eq!(a.shards_made(), 2, "thread_shards kept on");
    // And per_stream_shards stays off: this thread's new stream stays in the first shard.
    let r = a.malloc(4096, StreamId(2)).unwrap();
    assert_eq!(a.shards_made(), 2);
    // thread_shards is still refused as a change.
    assert_eq!(
        a.apply_config("thread_shards:False").unwrap_err().kind,
        ErrorKind::Config
    );
    assert_eq!(
        a.apply_config("per_stream_shards:True").unwrap_err().kind,
        ErrorKind::Config
    );
    for x in [p, q, r] {
        a.free(x).unwrap();
    }
}

/// Set before the first allocation, each combination maps streams as documented:
/// `per_stream_shards` overrides `thread_shards`.
#[test]
fn settings_before_the_first_allocation_choose_the_sharding() {
    for (conf, one_thread, new_threads) in [
        ("thread_shards:False", 1, 1),
        ("thread_shards:True", 1, 3),
        ("per_stream_shards:True,thread_shards:False", 3, 5),
        ("per_stream_shards:True,thread_shards:True", 3, 5),
    ] {
        let a = allocator("");
        a.apply_config(conf).unwrap();
        let mut blocks: Vec<u64> = (0..3)
            .map(|s| a.malloc(4096, StreamId(s)).unwrap())
            .collect();
        assert_eq!(a.shards_made(), one_thread, "{conf}");
        for t in 10..12 {
            let b = a.clone();
            blocks.push(on_new_thread(move || b.malloc(4096, StreamId(t)).unwrap()));
        }
        assert_eq!(a.shards_made(), new_threads, "{conf}");
        for p in blocks {
            a.free(p).unwrap();
        }
        assert_eq!(a.stats().unwrap().allocation.all().current, 0);
    }
}

/// The runtime (`ccalloc_set_config`, `ccalloc_reset_config`): a change of `thread_shards`
/// once any device has allocated is refused and changes no device, nor the settings later
/// devices start with; a reset keeps the allocated device's sharding.
#[test]
fn the_runtime_refuses_thread_shards_changes_once_a_device_allocated() {
    let sim = Arc::new(SimDriver::new(2, 1 << 30));
    let at_once = Config {
        thread_shards_on_contention: false,
        ..Config::default()
    };
    let rt = Arc::new(ccalloc::Runtime::with_sim(sim, at_once));
    // Device 1 started, not allocated; device 0 allocated.
    assert_eq!(rt.device(1).unwrap().shards_made(), 0);
    let p = rt.malloc(4096, 0, StreamId(0)).unwrap();
    let e = rt.set_config("thread_shards:False").unwrap_err();
    assert_eq!(e.kind, ErrorKind::Config);
    assert!(
        rt.config().unwrap().thread_shards,
        "the runtime's settings unchanged"
    );
    // Device 1 kept its setting too: a new thread's stream gets a shard.
    let q = rt.malloc(4096, 1, StreamId(0)).unwrap();
    let r2 = rt.clone();
    let q2 = on_new_thread(move || r2.malloc(4096, 1, StreamId(3)).unwrap());
    assert_eq!(rt.device(1).unwrap().shards_made(), 2);
    // Other settings still change; a reset keeps thread_shards on the allocated devices.
    rt.set_config("max_split_size_mb:64").unwrap();
    rt.reset_config().unwrap();
    let r2 = rt.clone();
    let p2 = on_new_thread(move || r2.malloc(4096, 0, StreamId(9)).unwrap());
    assert_eq!(rt.device(0).unwrap().shards_made(), 2);
    rt.free(p, 0).unwrap();
    rt.free(p2, 0).unwrap();
    rt.free(q, 1).unwrap();
    rt.free(q2, 1).unwrap();
    rt.shutdown().unwrap();
}

// ---------------------------------------------------------------------------------------
// Blocks across threads and shards.

/// A thread on its own shard exits holding blocks, one of them freed into its front:
/// another thread frees the live one once, and both double frees are refused, with the
/// counts unchanged.
#[test]
fn blocks_of_an_exited_thread_free_once_and_double_frees_are_refused() {
    let (sim, a) = sim_allocator(1 << 30, AT_ONCE);
    let main = a.malloc(4096, StreamId(0)).unwrap();
    let b = a.clone();
    let (freed, live, big) = on_new_thread(move || {
        let freed = b.malloc(8192, StreamId(1)).unwrap();
        let live = b.malloc(8192, StreamId(1)).unwrap();
        let big = b.malloc(4 * MIB, StreamId(1)).unwrap();
        b.free(freed).unwrap();
        (freed, live, big)
    });
    assert_eq!(a.shards_made(), 2);
    assert_eq!(a.free(freed).unwrap_err().kind, ErrorKind::DoubleFree);
    let c = a.clone();
    on_new_thread(move || {
        c.free(live).unwrap();
        assert_eq!(c.free(live).unwrap_err().kind, ErrorKind::DoubleFree);
    });
    assert_eq!(a.free(live).unwrap_err().kind, ErrorKind::DoubleFree);
    assert_eq!(
        a.free_on(live, StreamId(1)).unwrap_err().kind,
        ErrorKind::DoubleFree
    );
    let live: u64 = a
        .segments()
        .unwrap()
        .iter()
        .flat_map(|seg| seg.blocks.iter())
        .filter(|b| b.2 == ccalloc::BlockState::Allocated)
        .map(|b| b.1)
        .sum();
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 2);
    assert_eq!(s.allocated_bytes.all().current as u64, live);
    a.free_on(big, StreamId(0)).unwrap();
    assert_eq!(a.free(big).unwrap_err().kind, ErrorKind::DoubleFree);
    a.free(main).unwrap();
    assert_eq!(a.stats().unwrap().allocation.all().current, 0);
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

/// A block of a thread's own shard used on the first shard's stream: once freed, it is not
/// handed out again until that stream's work is done.
#[test]
fn record_stream_across_shards_waits_for_the_other_stream() {
    let (sim, a) = sim_allocator(1 << 30, AT_ONCE);
    let s0 = StreamId(0);
    let s1 = StreamId(1);
    let main = a.malloc(4096, s0).unwrap();
    let b = a.clone();
    let p = on_new_thread(move || b.malloc(MIB, s1).unwrap());
    assert_eq!(a.shards_made(), 2);
    a.record_stream(p, s0).unwrap();
    sim.set_stream_paused(0, s0, true);
    a.free(p).unwrap();
    let b = a.clone();
    let q = on_new_thread(move || b.malloc(MIB, s1).unwrap());
    assert_ne!(p, q, "reused while stream 0 may still use it");
    sim.set_stream_paused(0, s0, false);
    a.free(q).unwrap();
    a.free(main).unwrap();
    assert_eq!(a.stats().unwrap().allocation.all().current, 0);
}

// ---------------------------------------------------------------------------------------
// Private pools.

/// A window opened before a new thread's first allocation routes it (in its new shard) to
/// the pool; a thread new after the window closed is not routed; releasing the pool gives
/// its memory back.
#[test]
fn a_window_routes_a_new_threads_first_allocation_in_its_new_shard() {
    let (sim, a) = sim_allocator(1 << 30, AT_ONCE);
    let pool = (7, 1);
    let main = a.malloc(4096, StreamId(0)).unwrap();
    a.begin_allocate_to_pool(pool, Box::new(|s| s == StreamId(2)))
        .unwrap();
    let b = a.clone();
    let routed = on_new_thread(move || b.malloc(4096, StreamId(2)).unwrap());
    let b = a.clone();
    let not_routed = on_new_thread(move || b.malloc(4096, StreamId(3)).unwrap());
    a.end_allocate_to_pool(pool).unwrap();
    let b = a.clone();
    let after = on_new_thread(move || b.malloc(4096, StreamId(4)).unwrap());
    assert_eq!(a.shards_made(), 4);
    let owner = |ptr: u64| {
        a.segments()
            .unwrap()
            .into_iter()
            .find(|s| s.addr <= ptr && ptr < s.addr + s.size)
            .unwrap()
            .private_pool
    };
    assert_eq!(owner(routed), Some(pool));
    assert_eq!(owner(not_routed), None);
    assert_eq!(owner(after), None);
    assert_eq!(a.pool_use_count(pool).unwrap(), 1);
    a.release_pool(pool).unwrap();
    for p in [main, routed, not_routed, after] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

/// Windows opened and closed while new threads make shards: nothing hangs, every block is
/// freed, and the pool's memory goes back once released.
#[test]
fn windows_racing_new_threads_making_shards() {
    let (sim, a) = sim_allocator(1 << 30, AT_ONCE);
    let pool = (9, 9);
    a.create_or_incref_pool(pool).unwrap();
    let main = a.malloc(4096, StreamId(0)).unwrap();
    let barrier = Arc::new(Barrier::new(9));
    let workers: Vec<_> = (1..=8u64)
        .map(|t| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut blocks = Vec::new();
                for i in 0..50u64 {
                    blocks.push(a.malloc(4096 * (1 + i % 5), StreamId(t)).unwrap());
                    if i % 3 == 0 {
                        a.free(blocks.swap_remove(0)).unwrap();
                    }
                }
                blocks
            })
        })
        .collect();
    barrier.wait();
    for _ in 0..20 {
        a.begin_allocate_to_pool(pool, Box::new(|s| s.0 % 2 == 0))
            .unwrap();
        let _ = a.stats().unwrap();
        a.end_allocate_to_pool(pool).unwrap();
    }
    let blocks: Vec<u64> = workers
        .into_iter()
        .flat_map(|w| w.join().unwrap())
        .collect();
    assert_eq!(a.shards_made(), 9);
    for p in blocks {
        a.free(p).unwrap();
    }
    a.free(main).unwrap();
    // One hold from the create, one from each begin (as PyTorch's graphs release theirs).
    assert_eq!(a.pool_use_count(pool).unwrap(), 21);
    for _ in 0..21 {
        a.release_pool(pool).unwrap();
    }
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 0);
    assert!(s.allocated_bytes.all().current == 0);
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

// ---------------------------------------------------------------------------------------
// Memory limits and OOM.

/// A small device: a thread new to it fits by taking memory another thread's shard cached,
/// and an allocation that cannot fit fails with OutOfMemory, changing no count.
#[test]
fn an_oom_on_a_thread_shard_empties_the_other_shards_first() {
    for conf in ["", "expandable_segments:False"] {
        let (sim, a) = sim_allocator(64 * MIB, &format!("{AT_ONCE},{conf}"));
        let main = a.malloc(4 * MIB, StreamId(0)).unwrap();
        let b = a.clone();
        on_new_thread(move || {
            let p = b.malloc(40 * MIB, StreamId(1)).unwrap();
            b.free(p).unwrap();
        });
        let b = a.clone();
        let q = on_new_thread(move || b.malloc(40 * MIB, StreamId(2)).unwrap());
        assert_eq!(a.shards_made(), 3, "{conf}");
        let b = a.clone();
        let e = on_new_thread(move || b.malloc(40 * MIB, StreamId(3)).unwrap_err());
        assert_eq!(e.kind, ErrorKind::OutOfMemory, "{conf}");
        let s = a.stats().unwrap();
        assert_eq!(s.allocation.all().current, 2, "{conf}");
        assert_eq!(s.allocated_bytes.all().current as u64, 44 * MIB, "{conf}");
        assert!(s.reserved_bytes.all().current as u64 <= 64 * MIB, "{conf}");
        a.free(q).unwrap();
        a.free(main).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(sim.counters(0).bytes_in_use, 0, "{conf}");
    }
}

// ---------------------------------------------------------------------------------------
// Statistics.

/// Peaks across the move from one shard to several, and a reset with several.
#[test]
fn peaks_stay_exact_when_new_threads_add_shards() {
    let a = allocator("");
    let big = a.malloc(8 * MIB, StreamId(0)).unwrap();
    let main = a.malloc(MIB, StreamId(0)).unwrap();
    a.free(big).unwrap();
    let b = a.clone();
    let p = on_new_thread(move || b.malloc(2 * MIB, StreamId(1)).unwrap());
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().current as u64, 3 * MIB);
    assert_eq!(s.allocated_bytes.all().peak as u64, 9 * MIB);
    a.reset_peak_stats().unwrap();
    assert_eq!(
        a.stats().unwrap().allocated_bytes.all().peak as u64,
        3 * MIB
    );
    let b = a.clone();
    on_new_thread(move || {
        let q = b.malloc(4 * MIB, StreamId(2)).unwrap();
        b.free(q).unwrap();
    });
    let b = a.clone();
    on_new_thread(move || {
        let q = b.malloc(5 * MIB, StreamId(3)).unwrap();
        b.free(q).unwrap();
    });
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().current as u64, 3 * MIB);
    assert_eq!(s.allocated_bytes.all().peak as u64, 8 * MIB);
    assert_eq!(s.allocation.all().peak, 3);
    a.free(p).unwrap();
    a.free(main).unwrap();
}

/// Statistics reads, peak resets and cache emptying racing new threads making shards:
/// every read is one moment's, nothing hangs, and everything comes back.
#[test]
fn stats_resets_and_empty_cache_race_shard_creation() {
    for round in 0..10 {
        let (sim, a) = sim_allocator(1 << 30, AT_ONCE);
        let barrier = Arc::new(Barrier::new(7));
        let workers: Vec<_> = (1..=6u64)
            .map(|t| {
                let (a, barrier) = (a.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    for i in 0..100u64 {
                        let p = a
                            .malloc((1 + (i * t) % 9) * 256 * 1024, StreamId(t))
                            .unwrap();
                        a.free(p).unwrap();
                    }
                })
            })
            .collect();
        barrier.wait();
        while !workers.iter().all(|w| w.is_finished()) {
            let s = a.stats().unwrap();
            assert!(
                s.allocated_bytes.all().current <= s.reserved_bytes.all().current,
                "round {round}"
            );
            assert!(s.allocation.all().current <= 6, "round {round}");
            assert!(s.allocation.all().peak <= 6, "round {round}");
            a.reset_peak_stats().unwrap();
            a.empty_cache().unwrap();
        }
        for w in workers {
            w.join().unwrap();
        }
        let s = a.stats().unwrap();
        assert_eq!(s.allocation.all().current, 0);
        assert_eq!(s.allocated_bytes.all().current, 0);
        a.empty_cache().unwrap();
        assert_eq!(sim.counters(0).bytes_in_use, 0, "round {round}");
        assert_eq!(a.stats().unwrap().reserved_bytes.all().current, 0);
    }
}

/// Shutdown racing new threads making shards: refused while blocks are live, then once
/// it succeeds every call is refused and every byte is back.
#[test]
fn shutdown_racing_new_threads() {
    let (sim, a) = sim_allocator(1 << 30, AT_ONCE);
    let barrier = Arc::new(Barrier::new(7));
    let workers: Vec<_> = (1..=6u64)
        .map(|t| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..10_000u64 {
                    match a.malloc(4096 * (1 + i % 3), StreamId(t)) {
                        Ok(p) => a.free(p).unwrap(),
                        Err(e) => {
                            assert_eq!(e.kind, ErrorKind::ShutDown);
                            return;
                        }
                    }
                }
            })
        })
        .collect();
    barrier.wait();
    loop {
        match a.shutdown() {
            Ok(()) => break,
            Err(e) => assert_eq!(e.kind, ErrorKind::Busy, "{}", e.message),
        }
        std::thread::yield_now();
    }
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(sim.counters(0).bytes_in_use, 0);
    let b = a.clone();
    let e = on_new_thread(move || b.malloc(4096, StreamId(99)).unwrap_err());
    assert_eq!(e.kind, ErrorKind::ShutDown);
    assert_eq!(a.stats().unwrap_err().kind, ErrorKind::ShutDown);
}

// ---------------------------------------------------------------------------------------
// Thread fronts on thread shards.

/// A block handed out from a thread's front (its shard's) and freed by another thread: the
/// first thread's second free is a double free, and a block held in a front (freed) is
/// refused by `record_stream` and `free` from other threads.
#[test]
fn front_blocks_freed_across_threads_are_freed_once() {
    let a = allocator("");
    let main = a.malloc(4096, StreamId(0)).unwrap();
    let (to_main, from_worker) = std::sync::mpsc::channel();
    let (to_worker, from_main) = std::sync::mpsc::channel::<()>();
    let b = a.clone();
    let worker = std::thread::spawn(move || {
        // Freed and taken again: out of this thread's front.
        let p = b.malloc(8192, StreamId(1)).unwrap();
        b.free(p).unwrap();
        let q = b.malloc(8192, StreamId(1)).unwrap();
        // A block held in the front (freed).
        let h = b.malloc(16384, StreamId(1)).unwrap();
        b.free(h).unwrap();
        to_main.send((q, h)).unwrap();
        from_main.recv().unwrap();
        // Main freed q meanwhile.
        assert_eq!(b.free(q).unwrap_err().kind, ErrorKind::DoubleFree);
        let r = b.malloc(8192, StreamId(1)).unwrap();
        b.free(r).unwrap();
    });
    let (q, h) = from_worker.recv().unwrap();
    assert_eq!(a.shards_made(), 2);
    assert_eq!(a.free(h).unwrap_err().kind, ErrorKind::DoubleFree);
    assert_eq!(
        a.record_stream(h, StreamId(0)).unwrap_err().kind,
        ErrorKind::DoubleFree
    );
    a.free(q).unwrap();
    assert_eq!(a.free(q).unwrap_err().kind, ErrorKind::DoubleFree);
    to_worker.send(()).unwrap();
    worker.join().unwrap();
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 1);
    assert_eq!(s.allocated_bytes.all().current as u64, 4096);
    a.free(main).unwrap();
}

/// A home thread's stream with no slot (in the first shard): its blocks free with a hint
/// naming that stream, and its front serves it.
#[test]
fn a_home_threads_unslotted_stream_frees_with_a_hint_and_reuses_its_front() {
    let a = allocator("");
    let main = a.malloc(4096, StreamId(0)).unwrap();
    let b = a.clone();
    let other = on_new_thread(move || b.malloc(4096, StreamId(1)).unwrap());
    let p = a.malloc(8192, StreamId(7)).unwrap();
    a.free_on(p, StreamId(7)).unwrap();
    let q = a.malloc(8192, StreamId(7)).unwrap();
    assert_eq!(p, q, "the freed block comes back");
    assert_eq!(a.shards_made(), 2);
    assert_eq!(segments_of(&a, StreamId(7)), 1);
    a.free_on(q, StreamId(1)).unwrap();
    assert_eq!(
        a.free_on(q, StreamId(7)).unwrap_err().kind,
        ErrorKind::DoubleFree
    );
    a.free(other).unwrap();
    a.free(main).unwrap();
    assert_eq!(a.stats().unwrap().allocation.all().current, 0);
}

/// The settings' text names thread_shards and reads back.
#[test]
fn thread_shards_round_trips_through_the_settings_text() {
    let mut c = Config::default();
    c.apply("thread_shards:False").unwrap();
    let text = c.to_string();
    assert!(text.contains("thread_shards:False"), "{text}");
    let mut d = Config::default();
    d.apply(&text).unwrap();
    assert!(!d.thread_shards);
    assert!(Config::default().thread_shards);
    assert_eq!(
        d.clone().apply("thread_shards:maybe").unwrap_err().kind,
        ErrorKind::Config
    );
}

/// Short-lived threads one after another on one stream (its own shard), each exiting with a
/// freed block held in its front: memory stays bounded (held blocks of exited threads come
/// back), and the counts add up.
#[test]
fn short_lived_threads_exiting_with_front_blocks_do_not_grow_memory() {
    let (sim, a) = sim_allocator(1 << 30, AT_ONCE);
    let main = a.malloc(4096, StreamId(0)).unwrap();
    let mut reserved = Vec::new();
    for _ in 0..200 {
        let b = a.clone();
        on_new_thread(move || {
            let p = b.malloc(256 * 1024, StreamId(1)).unwrap();
            let q = b.malloc(3 * MIB, StreamId(1)).unwrap();
            b.free(p).unwrap();
            b.free(q).unwrap();
        });
        reserved.push(sim.counters(0).bytes_in_use);
    }
    assert_eq!(a.shards_made(), 2);
    let max = *reserved.iter().max().unwrap();
    assert!(
        max <= 16 * MIB,
        "reserved grew to {max} bytes: {reserved:?}"
    );
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 1);
    assert_eq!(s.allocation.all().allocated, 401);
    assert_eq!(s.allocation.all().freed, 400);
    assert!(s.allocation.all().peak <= 3, "{}", s.allocation.all().peak);
    a.free(main).unwrap();
}

/// A pool filter that reads the device's statistics (several shards, so every shard is
/// locked) while new threads route their first allocations through it: no deadlock.
#[test]
fn a_filter_reading_statistics_with_several_shards_does_not_deadlock() {
    let a = allocator("");
    let main = a.malloc(4096, StreamId(0)).unwrap();
    let b = a.clone();
    let other = on_new_thread(move || b.malloc(4096, StreamId(1)).unwrap());
    let pool = (3, 3);
    let weak = Arc::downgrade(&a);
    a.begin_allocate_to_pool(
        pool,
        Box::new(move |s| {
            if let Some(a) = weak.upgrade() {
                let st = a.stats().unwrap();
                assert!(st.allocated_bytes.all().current <= st.reserved_bytes.all().current);
            }
            s == StreamId(2)
        }),
    )
    .unwrap();
    let blocks: Vec<u64> = (2..6u64)
        .map(|t| {
            let b = a.clone();
            on_new_thread(move || b.malloc(4096, StreamId(t)).unwrap())
        })
        .collect();
    a.end_allocate_to_pool(pool).unwrap();
    assert_eq!(a.shards_made(), 6);
    for p in blocks.into_iter().chain([main, other]) {
        a.free(p).unwrap();
    }
    a.release_pool(pool).unwrap();
    assert_eq!(a.stats().unwrap().allocation.all().current, 0);
}

/// Threads on their own shards of a small device, growing at once past what fits: only
/// OutOfMemory errors, no hang, and every byte back at the end.
#[test]
fn thread_shards_racing_ooms_on_a_small_device() {
    for conf in ["", "expandable_segments:False"] {
        let (sim, a) = sim_allocator(64 * MIB, &format!("{AT_ONCE},{conf}"));
        let main = a.malloc(MIB, StreamId(0)).unwrap();
        let barrier = Arc::new(Barrier::new(4));
        let workers: Vec<_> = (1..=4u64)
            .map(|t| {
                let (a, barrier) = (a.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let mut held = Vec::new();
                    let mut ooms = 0;
                    for i in 0..200u64 {
                        match a.malloc((1 + (i * t) % 12) * MIB, StreamId(t)) {
                            Ok(p) => held.push(p),
                            Err(e) => {
                                assert_eq!(e.kind, ErrorKind::OutOfMemory, "{}", e.message);
                                ooms += 1;
                            }
                        }
                        if held.len() > 2 || i % 5 == 0 {
                            for p in held.drain(..) {
                                a.free(p).unwrap();
                            }
                        }
                    }
                    for p in held {
                        a.free(p).unwrap();
                    }
                    ooms
                })
            })
            .collect();
        let _ooms: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
        let s = a.stats().unwrap();
        assert_eq!(s.allocation.all().current, 1, "{conf}");
        assert!(s.reserved_bytes.all().peak as u64 <= 64 * MIB, "{conf}");
        a.free(main).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(sim.counters(0).bytes_in_use, 0, "{conf}");
    }
}

/// A segment one shard gives back is no longer in the device's reserved bytes by the time
/// another shard can take its memory from the driver: counted until the release call
/// returned, the two shards' segments were both counted for a moment, and the reserved
/// peak passed the device's size (about 1 run in 70 of the racing test above).
#[test]
fn a_released_segment_is_uncounted_before_another_shard_can_take_its_memory() {
    let sim = Arc::new(ccalloc::SimDriver::new(1, 64 * MIB));
    let gated = common::GatedDriver::new(sim.clone(), common::Gate::AfterRelease);
    let mut config = ccalloc::Config::default();
    config
        .apply("per_stream_shards:True,expandable_segments:False")
        .unwrap();
    let a = Arc::new(DeviceAllocator::new(0, gated.clone(), config).unwrap());
    a.free(a.malloc(40 * MIB, StreamId(1)).unwrap()).unwrap();
    // Stream 2's shard made beforehand (a small block: a 2 MiB segment of its own).
    let small = a.malloc(512, StreamId(2)).unwrap();
    gated.arm();
    let emptier = {
        let a = a.clone();
        std::thread::spawn(move || a.empty_cache().unwrap())
    };
    // Held in the driver with stream 1's 40 MiB already the device's again, and its shard
    // locked: stream 2's allocation takes the memory, then its new peak waits for that lock
    // (every shard's) until the gate opens.
    gated.wait_until_held();
    let opener = {
        let gated = gated.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            gated.open();
        })
    };
    let p = a.malloc(40 * MIB, StreamId(2)).unwrap();
    opener.join().unwrap();
    emptier.join().unwrap();
    let reserved = a.stats().unwrap().reserved_bytes.all();
    assert_eq!(reserved.current as u64, 42 * MIB);
    assert_eq!(
        reserved.peak as u64,
        42 * MIB,
        "never both large segments at once"
    );
    a.free(p).unwrap();
    a.free(small).unwrap();
}

/// The C API on the sim: `ccalloc_set_config` refuses a `thread_shards` change once a
/// device has allocated (changing nothing), and `ccalloc_reset_config` keeps it. The only
/// test here on the process's global runtime.
#[test]
fn the_c_api_refuses_thread_shards_changes_once_a_device_allocated() {
    use ccalloc::capi::*;
    use std::ffi::{c_void, CString};
    std::env::set_var("CCALLOC_BACKEND", "sim");
    std::env::remove_var("CCALLOC_CONF");
    assert_eq!(ccalloc_init(), ccalloc_status::CCALLOC_OK);
    let set = |text: &str| {
        let c = CString::new(text).unwrap();
        unsafe { ccalloc_set_config(c.as_ptr()) }
    };
    // Before any allocation: accepted (and back).
    assert_eq!(set("thread_shards:False"), ccalloc_status::CCALLOC_OK);
    assert_eq!(set("thread_shards:True"), ccalloc_status::CCALLOC_OK);
    assert_eq!(set(AT_ONCE), ccalloc_status::CCALLOC_OK);
    let mut p: *mut c_void = std::ptr::null_mut();
    assert_eq!(
        ccalloc_malloc(4096, 0, std::ptr::null_mut(), &mut p),
        ccalloc_status::CCALLOC_OK
    );
    assert_eq!(
        set("thread_shards:False"),
        ccalloc_status::CCALLOC_CONFIG_ERROR
    );
    assert_eq!(
        set("per_stream_shards:True"),
        ccalloc_status::CCALLOC_CONFIG_ERROR
    );
    assert_eq!(
        set("thread_shards_on_contention:True"),
        ccalloc_status::CCALLOC_CONFIG_ERROR
    );
    assert_eq!(ccalloc_reset_config(), ccalloc_status::CCALLOC_OK);
    let rt = ccalloc::testing::global().unwrap();
    assert!(rt.config().unwrap().thread_shards);
    // A new thread's new stream still gets a shard of its own.
    let q = on_new_thread(|| {
        let mut q: *mut c_void = std::ptr::null_mut();
        assert_eq!(
            ccalloc_malloc(4096, 0, 0x40 as _, &mut q),
            ccalloc_status::CCALLOC_OK
        );
        q as usize
    });
    assert_eq!(rt.device(0).unwrap().shards_made(), 2);
    assert_eq!(
        ccalloc_free(q as *mut c_void, 0),
        ccalloc_status::CCALLOC_OK
    );
    assert_eq!(ccalloc_free(p, 0), ccalloc_status::CCALLOC_OK);
    assert_eq!(ccalloc_shutdown(), ccalloc_status::CCALLOC_OK);
}

/// Producers on their own shards hand every block to one consumer thread that frees them
/// (blocks freed by a thread other than the allocating one, across many shards): memory
/// and counts stay bounded, and everything comes back.
#[test]
fn a_consumer_freeing_every_producers_blocks_keeps_memory_bounded() {
    let (sim, a) = sim_allocator(1 << 30, AT_ONCE);
    let main = a.malloc(4096, StreamId(0)).unwrap();
    let (tx, rx) = std::sync::mpsc::sync_channel::<u64>(4);
    let consumer = {
        let a = a.clone();
        std::thread::spawn(move || {
            let mut max_reserved = 0;
            for p in rx {
                a.free(p).unwrap();
                max_reserved = max_reserved.max(sim.counters(0).bytes_in_use);
            }
            max_reserved
        })
    };
    let producers: Vec<_> = (1..=12u64)
        .map(|t| {
            let (a, tx) = (a.clone(), tx.clone());
            std::thread::spawn(move || {
                for i in 0..300u64 {
                    tx.send(a.malloc(64 * 1024 * (1 + i % 4), StreamId(t)).unwrap())
                        .unwrap();
                }
            })
        })
        .collect();
    drop(tx);
    for p in producers {
        p.join().unwrap();
    }
    let max_reserved = consumer.join().unwrap();
    assert_eq!(a.shards_made(), 13);
    assert!(max_reserved <= 128 * MIB, "reserved {max_reserved}");
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, 1);
    assert_eq!(s.allocation.all().allocated, 3601);
    assert!(s.allocated_bytes.all().current <= s.reserved_bytes.all().current);
    a.free(main).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().unwrap().reserved_bytes.all().current, 0);
}
