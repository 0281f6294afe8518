//! Property test: random operation sequences against the simulated device, checked against an
//! independent model. Live blocks never overlap, canaries survive, stats match the model, and
//! after freeing everything and `empty_cache` nothing is reserved and the device holds nothing.
#![cfg(feature = "sim")]

use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, ErrorKind, StreamId};
use proptest::prelude::*;
use std::sync::Arc;

const STREAMS: [StreamId; 3] = [StreamId(0), StreamId(7), StreamId(0xabc)];

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: usize },
    Free { pick: usize },
    RecordStream { pick: usize, stream: usize },
    Pause { stream: usize, paused: bool },
    EmptyCache,
    BadFree { pick: usize },
}

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 1u64..4096,
        3 => 4096u64..(1 << 20),
        2 => (1u64 << 20)..(12 << 20),
        1 => (12u64 << 20)..(64 << 20),
        1 => (60u64 << 20)..(200 << 20),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (size_strategy(), 0..STREAMS.len()).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        6 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), 0..STREAMS.len()).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => (0..STREAMS.len(), any::<bool>()).prop_map(|(stream, paused)| Op::Pause { stream, paused }),
        1 => Just(Op::EmptyCache),
        1 => any::<usize>().prop_map(|pick| Op::BadFree { pick }),
    ]
}

struct Live {
    /// The stream it was allocated on, and those `record_stream` added.
    stream: StreamId,
    uses: Vec<StreamId>,
    ptr: u64,
    size: u64,
    rounded: u64,
    canary: u64,
}

/// The model's own rounding (default config): 512-byte multiples, at least 512.
fn rounded(size: u64) -> u64 {
    size.max(1).div_ceil(512) * 512
}

fn canary_slots(b: &Live) -> [u64; 2] {
    // First and last 8 bytes of the request (blocks are at least 512 bytes, so both fit).
    [b.ptr, b.ptr + b.size.max(16) - 8]
}

fn write_canary(b: &Live) {
    for slot in canary_slots(b) {
        // SAFETY: sim memory is host memory; the block spans at least `size` bytes from `ptr`.
        unsafe { std::ptr::write_unaligned(slot as *mut u64, b.canary) };
    }
}

fn canary_intact(b: &Live) -> bool {
    canary_slots(b)
        // SAFETY: as in write_canary; the block is still live.
        .map(|slot| unsafe { std::ptr::read_unaligned(slot as *const u64) })
        .iter()
        .all(|&v| v == b.canary)
}

fn check_invariants(a: &DeviceAllocator, sim: &SimDriver, live: &[Live]) {
    let mut spans: Vec<(u64, u64)> = live.iter().map(|b| (b.ptr, b.ptr + b.rounded)).collect();
    spans.sort();
    for w in spans.windows(2) {
        assert!(
            w[0].1 <= w[1].0,
            "live blocks overlap: {:x?} and {:x?}",
            w[0],
            w[1]
        );
    }
    for b in live {
        assert!(
            canary_intact(b),
            "canary of block {:#x} was overwritten",
            b.ptr
        );
        assert!(
            sim.contains(0, b.ptr, b.size),
            "block {:#x} outside device memory",
            b.ptr
        );
    }
    let segments = a.segments().unwrap();
    for b in live {
        // A block is carved from a segment of its own stream (paged or plain).
        let seg = segments
            .iter()
            .find(|s| b.ptr >= s.addr && b.ptr < s.addr + s.size)
            .expect("a live block lies in a segment");
        assert_eq!(
            seg.stream, b.stream,
            "block {:#x} for {:?} handed out from a segment of {:?}",
            b.ptr, b.stream, seg.stream
        );
    }
    for seg in segments {
        for pair in seg.blocks.windows(2) {
            let both_free = pair.iter().all(|b| b.2 == ccalloc::BlockState::Free);
            assert!(!both_free, "free neighbours left unmerged in {seg:?}");
            assert_eq!(
                pair[0].0 + pair[0].1,
                pair[1].0,
                "blocks do not tile {seg:?}"
            );
        }
    }
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, live.len() as i64);
    let bytes: u64 = live.iter().map(|b| b.rounded).sum();
    assert_eq!(s.allocated_bytes.all().current, bytes as i64);
    let requested: u64 = live.iter().map(|b| b.size).sum();
    assert!(s.requested_bytes.all().current >= requested as i64);
    assert!(s.active_bytes.all().current >= s.allocated_bytes.all().current);
    let c = sim.counters(0);
    assert_eq!(s.reserved_bytes.all().current, c.bytes_in_use as i64);
    assert_eq!(
        s.segment.all().current,
        (c.live_allocations + c.live_reservations) as i64
    );
    assert_eq!(s.num_device_alloc, c.allocate_calls + c.physical_creates);
    assert_eq!(s.num_device_free, c.release_calls + c.physical_releases);
    assert!(
        s.reserved_bytes.all().current
            >= s.active_bytes.all().current + s.inactive_split_bytes.all().current
    );
    for array in [
        s.allocation,
        s.segment,
        s.active,
        s.allocated_bytes,
        s.reserved_bytes,
        s.active_bytes,
        s.inactive_split,
        s.inactive_split_bytes,
        s.requested_bytes,
    ] {
        let [all, small, large] = array.0;
        assert_eq!(all.current, small.current + large.current);
        assert!(all.peak >= all.current);
        assert_eq!(all.allocated - all.freed, all.current);
    }
}

fn block_size_of(a: &DeviceAllocator, ptr: u64) -> u64 {
    let segments = a.segments().unwrap();
    let block = segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .find(|b| b.0 == ptr);
    block.expect("a live block is in a segment").1
}

fn run(ops: Vec<Op>, conf: &str, capacity: u64) {
    run_on(Arc::new(SimDriver::new(1, capacity)), ops, conf);
}

fn run_on(sim: Arc<SimDriver>, ops: Vec<Op>, conf: &str) {
    let mut config = Config::default();
    config.apply(conf).unwrap();
    let a = DeviceAllocator::new(0, sim.clone(), config).unwrap();
    let mut live: Vec<Live> = Vec::new();
    let mut freed: Vec<u64> = Vec::new();
    let mut next_canary = 0x5eed_0000_0000_0001u64;
    let exact_rounding = conf.is_empty() || conf == "expandable_segments:False";
    for op in ops {
        match op {
            Op::Alloc { size, stream } => match a.malloc(size, STREAMS[stream]) {
                Ok(ptr) => {
                    next_canary = next_canary
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1);
                    let block_size = block_size_of(&a, ptr);
                    if exact_rounding {
                        // A large-pool remainder of at most 1 MiB is not split off.
                        let slack = if rounded(size) <= 1 << 20 { 0 } else { 1 << 20 };
                        assert!(
                            block_size >= rounded(size) && block_size <= rounded(size) + slack,
                            "{size} bytes got a {block_size}-byte block"
                        );
                    }
                    let b = Live {
                        stream: STREAMS[stream],
                        uses: Vec::new(),
                        ptr,
                        size,
                        rounded: block_size,
                        canary: next_canary,
                    };
                    write_canary(&b);
                    freed.retain(|&f| f != ptr);
                    live.push(b);
                }
                Err(e) => assert_eq!(e.kind, ErrorKind::OutOfMemory, "{}", e.message),
            },
            Op::Free { pick } if !live.is_empty() => {
                let b = live.swap_remove(pick % live.len());
                // Kernels queued until now on its streams used it: the sim refuses to unmap or
                // release its pages before they have run.
                for &s in std::iter::once(&b.stream).chain(&b.uses) {
                    sim.note_use(0, b.ptr, b.rounded, s);
                }
                a.free(b.ptr).unwrap();
                freed.push(b.ptr);
            }
            Op::RecordStream { pick, stream } if !live.is_empty() => {
                let n = live.len();
                let b = &mut live[pick % n];
                a.record_stream(b.ptr, STREAMS[stream]).unwrap();
                b.uses.push(STREAMS[stream]);
            }
            Op::Pause { stream, paused } => sim.set_stream_paused(0, STREAMS[stream], paused),
            Op::EmptyCache => a.empty_cache().unwrap(),
            Op::BadFree { pick } if !freed.is_empty() => {
                let before = a.stats().unwrap();
                let kind = a.free(freed[pick % freed.len()]).unwrap_err().kind;
                assert!(
                    matches!(kind, ErrorKind::DoubleFree | ErrorKind::UnknownPointer),
                    "{kind:?}"
                );
                assert_eq!(a.stats().unwrap(), before, "a bad free changed the stats");
            }
            _ => {}
        }
        check_invariants(&a, &sim, &live);
    }
    for b in live.drain(..) {
        a.free(b.ptr).unwrap();
    }
    a.empty_cache().unwrap();
    let s = a.stats().unwrap();
    assert_eq!(
        s.reserved_bytes.all().current,
        0,
        "after freeing everything and empty_cache: segments {:?}, device {:?}",
        a.segments().unwrap(),
        sim.counters(0)
    );
    assert_eq!(s.active.all().current, 0);
    assert_eq!(s.requested_bytes.all().current, 0);
    assert_eq!(s.inactive_split_bytes.all().current, 0);
    assert_eq!(
        sim.counters(0).bytes_in_use,
        0,
        "the device still holds memory"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn default_config(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run(ops, "", 512 << 20);
    }

    #[test]
    fn plain_segments(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run(ops, "expandable_segments:False", 512 << 20);
    }

    #[test]
    fn tight_memory_and_tuning_keys(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run(ops, "max_split_size_mb:24,roundup_power2_divisions:[1:2,16:4,>:8],garbage_collection_threshold:0.7", 160 << 20);
    }

    #[test]
    fn tight_memory_plain_segments(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run(ops, "expandable_segments:False,max_split_size_mb:24,garbage_collection_threshold:0.7", 160 << 20);
    }

    /// A GPU running behind the host: pages move only after the work on them has run.
    #[test]
    fn gpu_behind_the_host(ops in prop::collection::vec(op_strategy(), 1..400)) {
        run_on(Arc::new(SimDriver::new(1, 512 << 20).with_event_lag(2)), ops, "");
    }

    #[test]
    fn gpu_far_behind_with_room_for_huge_blocks(ops in prop::collection::vec(op_strategy(), 1..400)) {
        run_on(Arc::new(SimDriver::new(1, 2 << 30).with_event_lag(3)), ops, "");
    }

    #[test]
    fn no_vmm_in_the_driver(ops in prop::collection::vec(op_strategy(), 1..200)) {
        run_on(Arc::new(SimDriver::new(1, 256 << 20).without_vmm()), ops, "");
    }
}
