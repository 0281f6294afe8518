//! Restoring a private pool to a saved layout (PyTorch's `setCheckpointPoolState`, asked by
//! CUDA graph trees when a recorded path diverges): the layout comes back, and a restore that
//! fails leaves no block of the pool handed out and refuses layouts the pool could not have.
#![cfg(feature = "sim")]

use ccalloc::BlockState;
use ccalloc::SavedBlock;
use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, ErrorKind, StreamId};
use std::sync::Arc;

mod common;

const POOL: (u64, u64) = (0, 7);
const S: StreamId = StreamId(1);
const MIB: u64 = 1 << 20;

fn allocator(conf: &str) -> DeviceAllocator {
    let sim = Arc::new(SimDriver::new(1, 8 << 30));
    let mut config = Config::default();
    config.apply(conf).unwrap();
    DeviceAllocator::new(0, sim, config).unwrap()
}

/// The pool's layout, as graph trees save it.
fn layout(a: &DeviceAllocator) -> Vec<SavedBlock> {
    common::pool_layout(a, POOL)
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
        for b in &done.allocated {
            let saved_size = saved.iter().find(|s| s.addr == b.ptr).map(|s| s.size);
            assert_eq!(Some(b.size), saved_size, "{conf}: made at its saved size");
        }
        let mut made: Vec<u64> = done.allocated.iter().map(|b| b.ptr).collect();
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
        for b in done.allocated {
            a.free(b.ptr).unwrap();
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

fn pool_allocated(a: &DeviceAllocator) -> usize {
    a.segments()
        .unwrap()
        .into_iter()
        .filter(|s| s.private_pool == Some(POOL))
        .flat_map(|s| s.blocks)
        .filter(|b| b.2 != BlockState::Free)
        .count()
}

/// A layout matching the pool's first segment but not its second: the restore fails, and
/// (as documented) the pool's blocks are then all freed: none made again for the first
/// segment stays handed out, unreported, in the statistics.
#[test]
fn a_failed_restore_leaves_no_block_of_the_pool_handed_out() {
    let a = allocator("");
    // A large segment and a small one.
    let _ptrs = in_pool(&a, &[3 * MIB, 4096]);
    let mut saved = layout(&a);
    assert!(saved.len() >= 3, "two segments: {saved:?}");
    // The last saved block (of the second segment) is now larger than its segment.
    saved.last_mut().unwrap().size += 512;
    let err = a.restore_pool(POOL, &saved).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument, "{}", err.message);
    assert_eq!(
        pool_allocated(&a),
        0,
        "no block of the pool stays handed out"
    );
    assert_eq!(a.stats().unwrap().allocated_bytes.all().current, 0);
    a.release_pool(POOL).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().unwrap().reserved_bytes.all().current, 0);
}

/// A saved block of size 0 could not come from a snapshot: refused, with the pool's blocks
/// freed and the statistics consistent.
#[test]
fn a_saved_block_of_size_zero_is_refused() {
    let a = allocator("");
    let _ptrs = in_pool(&a, &[3 * MIB]);
    let saved = layout(&a);
    let mut bad = vec![SavedBlock {
        addr: saved[0].addr,
        size: 0,
        allocated: true,
    }];
    bad.extend(saved.iter().copied());
    let err = a.restore_pool(POOL, &bad).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument, "{}", err.message);
    assert_eq!(pool_allocated(&a), 0);
    assert_eq!(a.stats().unwrap().allocated_bytes.all().current, 0);
    // The pool is still whole: the saved layout restores.
    let done = a.restore_pool(POOL, &saved).unwrap();
    assert_eq!(done.allocated.len(), 1);
    assert_eq!(layout(&a), saved);
}

/// Absurd addresses and sizes from the C API are refused, not a panic.
#[test]
fn absurd_saved_blocks_are_refused() {
    let a = allocator("");
    let _ptrs = in_pool(&a, &[3 * MIB]);
    let bad = [
        SavedBlock {
            addr: u64::MAX - 10,
            size: 100,
            allocated: true,
        },
        SavedBlock {
            addr: 0,
            size: u64::MAX,
            allocated: false,
        },
    ];
    let err = a.restore_pool(POOL, &bad).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument, "{}", err.message);
}

/// A layout naming a segment that is gone: refused after the other segments were carved;
/// the blocks made again for them are freed too.
#[test]
fn a_restore_refused_for_a_gone_segment_leaves_no_block_handed_out() {
    let a = allocator("");
    let _ptrs = in_pool(&a, &[3 * MIB]);
    let mut saved = layout(&a);
    let end = saved.last().map(|b| b.addr + b.size).unwrap();
    saved.push(SavedBlock {
        addr: end + 64 * MIB, // no segment starts there
        size: 2 * MIB,
        allocated: true,
    });
    let err = a.restore_pool(POOL, &saved).unwrap_err();
    assert!(err.message.contains("are gone"), "{}", err.message);
    assert_eq!(pool_allocated(&a), 0);
    assert_eq!(a.stats().unwrap().allocated_bytes.all().current, 0);
}
