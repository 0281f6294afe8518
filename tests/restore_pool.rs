//! Restoring a private pool to a saved layout (PyTorch's `setCheckpointPoolState`, asked by
//! CUDA graph trees when a recorded path diverges).

use ccalloc::alloc::blocks::BlockState;
use ccalloc::alloc::SavedBlock;
use ccalloc::driver::sim::SimDriver;
use ccalloc::{Config, DeviceAllocator, ErrorKind, StreamId};
use std::sync::Arc;

const POOL: (u64, u64) = (0, 7);
const S: StreamId = StreamId(1);
const MIB: u64 = 1 << 20;

fn allocator(conf: &str) -> DeviceAllocator {
    let sim = Arc::new(SimDriver::new(1, 8 << 30));
    let mut config = Config::default();
    config.apply(conf).unwrap();
    DeviceAllocator::new(0, sim, config).unwrap()
}

/// The pool's layout, as graph trees save it (`getCheckpointState`).
fn layout(a: &DeviceAllocator) -> Vec<SavedBlock> {
    a.segments()
        .unwrap()
        .into_iter()
        .filter(|s| s.private_pool == Some(POOL))
        .flat_map(|s| s.blocks)
        .map(|(addr, size, state)| SavedBlock {
            addr,
            size,
            allocated: state == BlockState::Allocated,
        })
        .collect()
}

fn in_pool(a: &DeviceAllocator, sizes: &[u64]) -> Vec<u64> {
    a.begin_allocate_to_pool(POOL, Box::new(|_| true)).unwrap();
    let ptrs = sizes.iter().map(|&n| a.malloc(n, S).unwrap()).collect();
    a.end_allocate_to_pool(POOL).unwrap();
    ptrs
}

#[test]
fn a_restored_pool_has_its_saved_blocks_at_their_addresses() {
    for conf in ["", "expandable_segments:False"] {
        let a = allocator(conf);
        let first = in_pool(&a, &[MIB + 512, 3 * MIB, 600 * 1024, 4096, 700]);
        a.free(first[2]).unwrap(); // a hole inside a segment, saved as free
        a.free(first[4]).unwrap();
        let saved = layout(&a);
        let outside = a.malloc(2 * MIB, S).unwrap();

        // The path diverges: other blocks in the pool, the saved ones partly freed.
        a.free(first[1]).unwrap();
        let later = in_pool(&a, &[5 * MIB, 100 * 1024, 512]);
        let allocated_before = a.stats().unwrap().allocated_bytes.all().current;

        let done = a.restore_pool(POOL, &saved).unwrap();
        let mut freed = done.freed.clone();
        freed.sort();
        let mut expected_freed: Vec<u64> = [first[0], first[3]].into_iter().chain(later).collect();
        expected_freed.sort();
        assert_eq!(
            freed, expected_freed,
            "{conf}: every live block of the pool is freed"
        );
        let mut made = done.allocated.clone();
        made.sort();
        let mut expected: Vec<u64> = saved
            .iter()
            .filter(|b| b.allocated)
            .map(|b| b.addr)
            .collect();
        expected.sort();
        assert_eq!(
            made, expected,
            "{conf}: the saved live blocks are made again"
        );
        assert_eq!(layout(&a), saved, "{conf}: the layout is the saved one");

        let stats = a.stats().unwrap();
        let saved_live: u64 = saved.iter().filter(|b| b.allocated).map(|b| b.size).sum();
        assert_eq!(
            stats.allocated_bytes.all().current as u64,
            saved_live + 2 * MIB,
            "{conf}"
        );
        assert!(allocated_before > 0);

        // The blocks made again are ordinary live blocks: they free, and the pool goes.
        for p in done.allocated {
            a.free(p).unwrap();
        }
        a.free(outside).unwrap();
        a.release_pool(POOL).unwrap(); // each window held the pool once
        a.release_pool(POOL).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.stats().unwrap().reserved_bytes.all().current, 0, "{conf}");
    }
}

#[test]
fn a_layout_that_no_longer_matches_is_refused() {
    let a = allocator("");
    let ptrs = in_pool(&a, &[MIB]);
    let mut saved = layout(&a);
    saved[0].addr += 512; // not where any segment starts
    saved[0].size -= 512;
    let err = a.restore_pool(POOL, &saved).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    assert!(err.message.contains("saved segments"), "{}", err.message);
    let _ = ptrs;
}
