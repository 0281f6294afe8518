//! Review: `restore_pool` must leave no block of the pool handed out when it fails, and must
//! refuse saved layouts that could not have come from the pool.

use ccalloc::alloc::blocks::BlockState;
use ccalloc::alloc::SavedBlock;
use ccalloc::driver::sim::SimDriver;
use ccalloc::{Config, DeviceAllocator, ErrorKind, StreamId};
use std::sync::Arc;

const POOL: (u64, u64) = (0, 9);
const S: StreamId = StreamId(1);
const MIB: u64 = 1 << 20;

fn allocator(conf: &str) -> DeviceAllocator {
    let sim = Arc::new(SimDriver::new(1, 8 << 30));
    let mut config = Config::default();
    config.apply(conf).unwrap();
    DeviceAllocator::new(0, sim, config).unwrap()
}

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
