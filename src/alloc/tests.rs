//! Unit tests of the allocator's behaviour on the simulated device.

use super::core::blocks::BlockState;
use super::sizing::{LARGE_BUFFER, SMALL_BUFFER};
use super::stats::{DeviceStats, LockCounters};
use super::*;
use crate::driver::sim::SimDriver;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(0x51de);

/// Plain segments: these tests pin down the PyTorch-compatible behaviour.
fn setup(capacity: u64, conf: &str) -> (Arc<SimDriver>, DeviceAllocator) {
    paged(capacity, &format!("expandable_segments:False,{conf}"))
}

fn stats(a: &DeviceAllocator) -> DeviceStats {
    a.stats().unwrap()
}

#[test]
fn small_requests_share_a_two_mib_segment() {
    let (sim, a) = setup(1 << 30, "");
    let p = a.malloc(1000, S0).unwrap();
    let q = a.malloc(1000, S0).unwrap();
    assert_eq!(q, p + 1024, "second block is carved right after the first");
    let s = stats(&a);
    assert_eq!(s.segment.0[1].current, 1);
    assert_eq!(s.reserved_bytes.all().current, SMALL_BUFFER as i64);
    assert_eq!(s.allocated_bytes.0[1].current, 2048);
    assert_eq!(s.requested_bytes.all().current, 2000);
    assert_eq!(s.inactive_split.all().current, 1);
    assert_eq!(
        s.inactive_split_bytes.all().current,
        (SMALL_BUFFER - 2048) as i64
    );
    assert_eq!(sim.counters(0).allocate_calls, 1);
    a.free(p).unwrap();
    a.free(q).unwrap();
    let s = stats(&a);
    assert_eq!(s.inactive_split.all().current, 0, "everything merged back");
    assert_eq!(s.active.all().current, 0);
    assert_eq!(s.requested_bytes.all().current, 0);
    assert_eq!(a.segments().unwrap()[0].blocks.len(), 1);
}

#[test]
fn parked_blocks_serve_their_exact_size_and_stream_and_are_bounded() {
    let (sim, a) = paged(1 << 30, "");
    let p = a.malloc(1000, S0).unwrap();
    let keep = a.malloc(1000, S0).unwrap();
    a.free(p).unwrap();
    // Another stream, or another size, does not get it.
    let other_stream = a.malloc(1000, S1).unwrap();
    assert_ne!(other_stream, p);
    let other_size = a.malloc(3000, S0).unwrap();
    assert_ne!(other_size, p);
    // The same rounded size on the same stream does, counted as any reuse.
    let again = a.malloc(900, S0).unwrap();
    assert_eq!(again, p);
    let s = stats(&a);
    assert_eq!(s.allocation.all().current, 4);
    assert_eq!(s.requested_bytes.all().current, 1000 + 1000 + 3000 + 900);
    // A double free of a parked block is caught, and changes nothing.
    a.free(again).unwrap();
    assert_eq!(a.free(again).unwrap_err().kind, ErrorKind::DoubleFree);
    // Bounded: past 64 blocks the parked ones go to the free lists.
    let many: Vec<_> = (0..100).map(|_| a.malloc(512, S0).unwrap()).collect();
    for b in many {
        a.free(b).unwrap();
    }
    {
        let st = a.state_of(S0);
        let (count, small_bytes, _) = st.parked_figures();
        assert!(count <= 64 && small_bytes <= 4 << 20);
    }
    for b in [keep, other_stream, other_size] {
        a.free(b).unwrap();
    }
    // Nothing is allocated any more: every block is free or parked.
    let listed = a.segments().unwrap();
    assert!(listed
        .iter()
        .flat_map(|s| s.blocks.iter())
        .all(|b| matches!(b.2, BlockState::Free | BlockState::Parked)));
    a.empty_cache().unwrap();
    assert_eq!(
        sim.counters(0).bytes_in_use,
        0,
        "parked memory is released too"
    );
}

#[test]
fn large_requests_get_twenty_mib_segments_or_their_own() {
    let (_sim, a) = setup(1 << 30, "");
    let q = a.malloc(11 * MIB + 1, S0).unwrap();
    assert_eq!(
        stats(&a).reserved_bytes.0[2].current,
        (12 * MIB) as i64,
        "a large request's segment is rounded to 2 MiB"
    );
    let p = a.malloc(3 * MIB, S0).unwrap();
    assert_eq!(
        stats(&a).reserved_bytes.0[2].current,
        (LARGE_BUFFER + 12 * MIB) as i64
    );
    a.free(p).unwrap();
    a.free(q).unwrap();
}

#[test]
fn cached_blocks_are_reused_only_on_their_stream() {
    let (sim, a) = setup(1 << 30, "");
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(4096, S1).unwrap();
    assert_ne!(p, q);
    assert_eq!(
        sim.counters(0).allocate_calls,
        2,
        "other stream gets its own segment"
    );
    let r = a.malloc(4096, S0).unwrap();
    assert_eq!(r, p, "same stream reuses the cached block");
    a.free(q).unwrap();
    a.free(r).unwrap();
}

#[test]
fn record_stream_delays_reuse_until_the_other_stream_finishes() {
    let (sim, a) = setup(1 << 30, "");
    let p = a.malloc(8192, S0).unwrap();
    a.record_stream(p, S1).unwrap();
    sim.set_stream_paused(0, S1, true);
    a.free(p).unwrap();
    let s = stats(&a);
    assert_eq!(s.allocation.all().current, 0, "no longer allocated");
    assert_eq!(
        s.active.all().current,
        1,
        "still active until its event completes"
    );
    let q = a.malloc(8192, S0).unwrap();
    assert_ne!(q, p, "the block is not handed out while S1 may use it");
    sim.set_stream_paused(0, S1, false);
    let r = a.malloc(8192, S0).unwrap();
    assert_eq!(r, p, "reused once S1's event completed");
    a.free(q).unwrap();
    a.free(r).unwrap();
    assert_eq!(stats(&a).active.all().current, 0);
}

#[test]
fn empty_cache_waits_for_pending_events_and_returns_everything() {
    let (sim, a) = setup(1 << 30, "");
    let p = a.malloc(5 * MIB, S0).unwrap();
    a.record_stream(p, S1).unwrap();
    sim.set_stream_paused(0, S1, true);
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    let s = stats(&a);
    assert_eq!(s.reserved_bytes.all().current, 0);
    assert_eq!(s.active.all().current, 0);
    assert_eq!(s.num_sync_all_streams, 1);
    assert_eq!(sim.counters(0).bytes_in_use, 0);
    assert_eq!(s.num_device_alloc, s.num_device_free);
}

#[test]
fn oom_frees_the_cache_then_retries() {
    let (sim, a) = setup(64 * MIB, "");
    let p = a.malloc(30 * MIB, S0).unwrap();
    a.free(p).unwrap();
    // 30 MiB cached + 40 MiB new would exceed 64 MiB: the cache must go first.
    let q = a.malloc(40 * MIB, S0).unwrap();
    let s = stats(&a);
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(s.reserved_bytes.all().current, (40 * MIB) as i64);
    assert_eq!(sim.counters(0).bytes_in_use, 40 * MIB);
    a.free(q).unwrap();
}

#[test]
fn oom_message_states_reserved_live_and_largest_free_block() {
    let (_sim, a) = setup(64 * MIB, "");
    let live = a.malloc(30 * MIB, S0).unwrap();
    let split = a.malloc(2 * MIB, S0).unwrap();
    let err = a.malloc(40 * MIB, S0).unwrap_err();
    assert_eq!(err.kind, ErrorKind::OutOfMemory);
    for needle in [
        "Tried to allocate 40.00 MiB",
        "50.00 MiB reserved",
        "32.00 MiB live",
        "largest free block 18.00 MiB",
    ] {
        assert!(
            err.message.contains(needle),
            "{needle:?} not in {}",
            err.message
        );
    }
    assert_eq!(stats(&a).num_ooms, 1);
    // Nothing live was lost.
    a.free(live).unwrap();
    a.free(split).unwrap();
}

#[test]
fn impossible_sizes_fail_without_flushing_the_cache() {
    let (_sim, a) = setup(64 * MIB, "");
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    for size in [u64::MAX, 65 * MIB] {
        assert_eq!(a.malloc(size, S0).unwrap_err().kind, ErrorKind::OutOfMemory);
    }
    assert_eq!(stats(&a).segment.all().current, 1, "cache kept");
    assert_eq!(a.malloc(0, S0).unwrap_err().kind, ErrorKind::InvalidSize);
}

#[test]
fn memory_fraction_limits_reserved_bytes() {
    let (_sim, a) = setup(100 * MIB, "per_process_memory_fraction:0.5");
    let p = a.malloc(30 * MIB, S0).unwrap();
    let err = a.malloc(30 * MIB, S0).unwrap_err();
    assert!(
        err.message.contains("per_process_memory_fraction"),
        "{}",
        err.message
    );
    a.set_memory_fraction(1.0).unwrap();
    let q = a.malloc(30 * MIB, S0).unwrap();
    assert_eq!(
        a.set_memory_fraction(1.5).unwrap_err().kind,
        ErrorKind::InvalidArgument
    );
    assert_eq!(a.memory_fraction().unwrap(), 1.0);
    a.free(p).unwrap();
    a.free(q).unwrap();
}

#[test]
fn oversize_blocks_are_not_split_and_serve_only_close_sizes() {
    let (sim, a) = setup(1 << 30, "max_split_size_mb:64");
    let big = a.malloc(100 * MIB, S0).unwrap();
    a.free(big).unwrap();
    let s = stats(&a);
    assert_eq!(s.oversize_segments.current, 1);
    assert_eq!(s.oversize_allocations.allocated, 1);
    // A small-ish request may not take the oversize block.
    let small = a.malloc(4 * MIB, S0).unwrap();
    assert_ne!(small, big);
    // An oversize request within max_non_split_rounding (20 MiB) reuses it whole.
    let close = a.malloc(90 * MIB, S0).unwrap();
    assert_eq!(close, big);
    let seg = a.segments().unwrap();
    assert!(seg.iter().any(|s| s.addr == big && s.blocks.len() == 1));
    a.free(close).unwrap();
    // Far smaller oversize request: not reused, new segment.
    let far = a.malloc(70 * MIB, S0).unwrap();
    assert_ne!(far, big);
    a.free(far).unwrap();
    a.free(small).unwrap();
    let before = sim.counters(0).release_calls;
    a.empty_cache().unwrap();
    assert!(sim.counters(0).release_calls > before);
}

#[test]
fn oom_releases_oversize_cache_first() {
    let (_sim, a) = setup(180 * MIB, "max_split_size_mb:64");
    let p = a.malloc(100 * MIB, S0).unwrap();
    let keep = a.malloc(4 * MIB, S0).unwrap();
    a.free(p).unwrap();
    // 100 MiB cached is too big to serve 70 MiB (max_non_split_rounding), and 20 + 100 + 70
    // exceeds the device: the cached oversize block is released, no full flush needed.
    let q = a.malloc(70 * MIB, S0).unwrap();
    let s = stats(&a);
    assert_eq!(
        s.num_alloc_retries, 0,
        "freeing the oversize block was enough"
    );
    assert_eq!(s.segment.all().current, 2);
    a.free(q).unwrap();
    a.free(keep).unwrap();
}

#[test]
fn garbage_collection_releases_old_cache_above_threshold() {
    let (_sim, a) = setup(100 * MIB, "garbage_collection_threshold:0.3");
    let old = a.malloc(32 * MIB, S0).unwrap();
    a.free(old).unwrap();
    for _ in 0..5 {
        let p = a.malloc(4096, S0).unwrap();
        a.free(p).unwrap();
    }
    // 32 + 2 MiB reserved is above 30 MiB: the old cached segment goes before growing.
    let p = a.malloc(40 * MIB, S0).unwrap();
    let s = stats(&a);
    assert_eq!(s.num_alloc_retries, 0);
    assert_eq!(s.num_device_free, 1);
    assert_eq!(s.reserved_bytes.all().current, (42 * MIB) as i64);
    a.free(p).unwrap();
}

#[test]
fn roundup_power2_divisions_changes_block_sizes() {
    let (_sim, a) = setup(1 << 30, "roundup_power2_divisions:4");
    let p = a.malloc(1200 * 1024, S0).unwrap();
    assert_eq!(stats(&a).allocated_bytes.all().current, 1280 * 1024);
    a.free(p).unwrap();
}

#[test]
fn bad_frees_change_nothing() {
    let (_sim, a) = setup(1 << 30, "");
    let p = a.malloc(4096, S0).unwrap();
    let q = a.malloc(4096, S0).unwrap();
    a.free(q).unwrap();
    let before = stats(&a);
    assert_eq!(a.free(q).unwrap_err().kind, ErrorKind::DoubleFree);
    assert_eq!(a.free(p + 512).unwrap_err().kind, ErrorKind::UnknownPointer);
    assert_eq!(
        a.free(0xdead_0000).unwrap_err().kind,
        ErrorKind::UnknownPointer
    );
    assert_eq!(
        a.record_stream(q, S1).unwrap_err().kind,
        ErrorKind::DoubleFree
    );
    assert_eq!(stats(&a), before);
    a.free(p).unwrap();
}

#[test]
fn config_changes_apply_to_later_requests() {
    let (_sim, a) = setup(1 << 30, "");
    let mut c = Config::default();
    c.apply("roundup_power2_divisions:2").unwrap();
    a.set_config(c).unwrap();
    let p = a.malloc(5 * MIB, S0).unwrap();
    assert_eq!(stats(&a).allocated_bytes.all().current, (6 * MIB) as i64);
    a.free(p).unwrap();
}

#[test]
fn stats_resets() {
    let (_sim, a) = setup(1 << 30, "");
    let p = a.malloc(4096, S0).unwrap();
    a.free(p).unwrap();
    a.reset_peak_stats().unwrap();
    let s = stats(&a);
    assert_eq!(s.allocated_bytes.all().peak, 0);
    assert_eq!(s.reserved_bytes.all().peak, SMALL_BUFFER as i64);
    a.reset_accumulated_stats().unwrap();
    let s = stats(&a);
    assert_eq!(s.allocation.all().allocated, 0);
    assert_eq!(s.num_device_alloc, 0);
    assert_eq!(s.reserved_bytes.all().current, SMALL_BUFFER as i64);
}

#[test]
fn shutdown_refuses_while_live_then_releases_everything() {
    let (sim, a) = setup(1 << 30, "");
    let p = a.malloc(4096, S0).unwrap();
    assert_eq!(a.shutdown().unwrap_err().kind, ErrorKind::Busy);
    a.free(p).unwrap();
    a.shutdown().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
    assert_eq!(a.malloc(4096, S0).unwrap_err().kind, ErrorKind::ShutDown);
}

#[test]
fn private_pool_keeps_its_blocks_to_itself() {
    let (sim, a) = setup(1 << 30, "");
    let pool = (1, 7);
    let general = a.malloc(4096, S0).unwrap();
    a.free(general).unwrap();
    a.begin_allocate_to_pool(pool, Box::new(|s| s == S0))
        .unwrap();
    let captured = a.malloc(4096, S0).unwrap();
    assert_ne!(captured, general, "a capture does not take general cache");
    let outside = a.malloc(4096, S1).unwrap();
    assert!(a
        .segments()
        .unwrap()
        .iter()
        .any(|s| s.private_pool == Some(pool)));
    a.free(captured).unwrap();
    let again = a.malloc(4096, S0).unwrap();
    assert_eq!(again, captured, "freed pool blocks serve the pool");
    a.end_allocate_to_pool(pool).unwrap();
    let after = a.malloc(4096, S0).unwrap();
    assert_eq!(
        after, general,
        "outside the window the general cache serves"
    );
    a.free(again).unwrap();
    a.free(after).unwrap();
    a.free(outside).unwrap();
    // Held pool: empty_cache keeps its segment.
    a.empty_cache().unwrap();
    assert_eq!(stats(&a).segment.all().current, 1);
    a.release_pool(pool).unwrap();
    assert_eq!(stats(&a).segment.all().current, 0);
    assert_eq!(sim.counters(0).bytes_in_use, 0);
    assert_eq!(
        a.release_pool(pool).unwrap_err().kind,
        ErrorKind::InvalidArgument
    );
}

#[test]
fn released_pool_returns_memory_when_its_last_block_is_freed() {
    let (sim, a) = setup(1 << 30, "");
    let pool = (2, 0);
    a.begin_allocate_to_pool(pool, Box::new(|_| true)).unwrap();
    let p = a.malloc(3 * MIB, S0).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    a.release_pool(pool).unwrap();
    assert_eq!(stats(&a).segment.all().current, 1, "still live");
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn record_stream_during_capture_is_deferred_to_its_end() {
    let (sim, a) = setup(1 << 30, "");
    let pool = (3, 0);
    a.begin_allocate_to_pool(pool, Box::new(|s| s == S0))
        .unwrap();
    let p = a.malloc(4096, S0).unwrap();
    a.record_stream(p, S1).unwrap();
    sim.set_stream_paused(0, S1, true);
    a.free(p).unwrap();
    assert_eq!(stats(&a).active.all().current, 1);
    let q = a.malloc(4096, S0).unwrap();
    assert_ne!(p, q, "not reusable before its events");
    a.end_allocate_to_pool(pool).unwrap();
    sim.set_stream_paused(0, S1, false);
    a.free(q).unwrap();
    a.malloc(1, S1).map(|x| a.free(x)).unwrap().unwrap();
    assert_eq!(stats(&a).active.all().current, 0, "cached once S1 finished");
    assert_eq!(
        a.end_allocate_to_pool(pool).unwrap_err().kind,
        ErrorKind::InvalidArgument
    );
    a.release_pool(pool).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

/// The default configuration (paged segments where the driver has them) plus `conf`.
fn paged(capacity: u64, conf: &str) -> (Arc<SimDriver>, DeviceAllocator) {
    let sim = Arc::new(SimDriver::new(1, capacity));
    let mut config = Config::default();
    config.apply(conf).unwrap();
    let alloc = DeviceAllocator::new(0, sim.clone(), config).unwrap();
    (sim, alloc)
}

/// The default bound of paged segments: live bytes plus the default slack, with 4 pages
/// (8 MiB) at least.
fn within_default_slack(reserved: u64, live: u64) -> bool {
    let slack = (live as f64 * crate::config::DEFAULT_PAGE_SLACK) as u64;
    reserved <= live + slack + 8 * MIB
}

#[test]
fn paged_segments_map_pages_on_demand_and_reuse_them() {
    let (sim, a) = paged(1 << 30, "");
    let p = a.malloc(4 * MIB + MIB / 2, S0).unwrap();
    assert_eq!(
        stats(&a).reserved_bytes.all().current,
        (6 * MIB) as i64,
        "three 2 MiB pages"
    );
    let c = sim.counters(0);
    assert_eq!(
        (c.maps, c.granules_mapped),
        (3, 3),
        "three chunks of one page"
    );
    assert_eq!(c.reserve_calls, 1);
    a.free(p).unwrap();
    let q = a.malloc(4 * MIB + MIB / 2, S0).unwrap();
    assert_eq!(q, p);
    assert_eq!(
        sim.counters(0).maps,
        3,
        "cached pages are reused without driver calls"
    );
    // A request sharing the last page needs no new page either.
    let r = a.malloc(MIB + 1, S0).unwrap();
    assert_eq!(r, p + 4 * MIB + MIB / 2);
    assert_eq!(sim.counters(0).maps, 3);
    a.free(q).unwrap();
    a.free(r).unwrap();
    a.empty_cache().unwrap();
    let c = sim.counters(0);
    assert_eq!((c.bytes_in_use, c.live_reservations), (0, 0));
    assert_eq!((c.unmaps, c.granules_unmapped), (3, 3));
    assert_eq!(stats(&a).segment.all().current, 0);
}

#[test]
fn growth_reuses_pages_under_free_blocks_instead_of_reserving_more() {
    let (sim, a) = paged(1 << 30, "");
    let hole = a.malloc(40 * MIB, S0).unwrap();
    let keep = a.malloc(4 * MIB, S0).unwrap();
    a.free(hole).unwrap();
    // 60 MiB does not fit the 40 MiB hole: it goes after `keep`, and pages move from the hole.
    let big = a.malloc(60 * MIB, S0).unwrap();
    assert!(big > keep);
    let s = stats(&a);
    let live = 64 * MIB;
    let reserved = s.reserved_bytes.all().current as u64;
    assert!(
        within_default_slack(reserved, live),
        "reserved {reserved} for {live} live"
    );
    assert!(
        sim.counters(0).granules_unmapped >= 10,
        "pages were moved from the hole"
    );
    assert_eq!(reserved, sim.counters(0).bytes_in_use);
    a.free(big).unwrap();
    a.free(keep).unwrap();
}

#[test]
fn paged_oom_reclaims_everything_then_fails_cleanly() {
    let (sim, a) = paged(64 * MIB, "");
    let p = a.malloc(40 * MIB, S0).unwrap();
    a.free(p).unwrap();
    let other_stream = a.malloc(50 * MIB, S1).unwrap();
    assert!(
        sim.counters(0).unmaps > 0,
        "the other stream's cached pages were taken"
    );
    let err = a.malloc(30 * MIB, S0).unwrap_err();
    assert_eq!(err.kind, ErrorKind::OutOfMemory);
    assert!(err.message.contains("50.00 MiB live"), "{}", err.message);
    assert_eq!(stats(&a).num_ooms, 1);
    a.free(other_stream).unwrap();
    let q = a.malloc(30 * MIB, S0).unwrap();
    a.free(q).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn memory_fraction_caps_paged_memory() {
    let (_sim, a) = paged(100 * MIB, "per_process_memory_fraction:0.5");
    let p = a.malloc(40 * MIB, S0).unwrap();
    assert_eq!(
        a.malloc(20 * MIB, S0).unwrap_err().kind,
        ErrorKind::OutOfMemory
    );
    a.free(p).unwrap();
    let q = a.malloc(48 * MIB, S0).unwrap();
    a.free(q).unwrap();
}

#[test]
fn without_vmm_the_driver_gets_plain_segments() {
    let sim = Arc::new(SimDriver::new(1, 1 << 30).without_vmm());
    let a = DeviceAllocator::new(0, sim.clone(), Config::default()).unwrap();
    let p = a.malloc(5 * MIB, S0).unwrap();
    assert_eq!(stats(&a).reserved_bytes.all().current, LARGE_BUFFER as i64);
    assert_eq!(sim.counters(0).allocate_calls, 1);
    assert_eq!(sim.counters(0).maps, 0);
    a.free(p).unwrap();
}

#[test]
fn private_pools_stay_on_plain_segments_under_vmm() {
    let (sim, a) = paged(1 << 30, "");
    a.begin_allocate_to_pool((9, 9), Box::new(|_| true))
        .unwrap();
    let p = a.malloc(4096, S0).unwrap();
    a.end_allocate_to_pool((9, 9)).unwrap();
    assert_eq!(
        sim.counters(0).allocate_calls,
        1,
        "graph memory never moves"
    );
    a.free(p).unwrap();
    a.release_pool((9, 9)).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn a_graph_pools_free_memory_does_not_make_paged_growth_move() {
    // A CUDA graph pool keeps 100 MiB on a plain segment that no move can reach. Paged
    // memory within its own live high-water mark plus the slack must then grow as it would
    // without the pool, not move pages at every growth (torch.compile's CUDA graph trees).
    let (sim, a) = paged(1 << 30, "");
    a.begin_allocate_to_pool((9, 9), Box::new(|_| true))
        .unwrap();
    let graph = a.malloc(100 * MIB, S0).unwrap();
    a.end_allocate_to_pool((9, 9)).unwrap();
    a.free(graph).unwrap();
    let hole = a.malloc(6 * MIB, S0).unwrap();
    let keep = a.malloc(4 * MIB, S0).unwrap();
    a.free(hole).unwrap();
    let before = stats(&a).paging;
    let unmaps = sim.counters(0).unmaps;
    // 10 MiB fits neither the 6 MiB hole nor its pages: new pages at the end, 20 MiB paged
    // for 14 live, within the slack's 4-page floor.
    let grown = a.malloc(10 * MIB, S0).unwrap();
    let after = stats(&a).paging;
    assert_eq!(after.growths, before.growths + 1);
    assert_eq!(
        (
            after.moving_growths - before.moving_growths,
            sim.counters(0).unmaps - unmaps
        ),
        (0, 0),
        "the hole's pages stayed where they were"
    );
    assert_eq!(
        stats(&a).reserved_bytes.all().current as u64,
        120 * MIB,
        "the pool's 100 MiB and 20 MiB paged"
    );
    for p in [keep, grown] {
        a.free(p).unwrap();
    }
    a.release_pool((9, 9)).unwrap();
}

#[test]
fn pages_move_without_any_wait_once_their_fence_has_completed() {
    let (sim, a) = paged(1 << 30, "");
    let hole = a.malloc(40 * MIB, S0).unwrap();
    let keep = a.malloc(4 * MIB, S0).unwrap();
    a.free(hole).unwrap();
    let big = a.malloc(60 * MIB, S0).unwrap();
    let c = sim.counters(0);
    assert!(c.granules_unmapped >= 10, "pages were moved from the hole");
    assert_eq!(
        (c.synchronize_calls, c.event_waits),
        (0, 0),
        "the fence recorded at the free had completed: no wait"
    );
    a.free(big).unwrap();
    a.free(keep).unwrap();
}

#[test]
fn pages_another_stream_may_still_use_move_only_after_its_fence() {
    let (sim, a) = paged(1 << 30, "");
    let hole = a.malloc(40 * MIB, S1).unwrap();
    // S1 is busy: its work queued before the free has not run yet.
    sim.set_stream_paused(0, S1, true);
    a.free(hole).unwrap();
    let big = a.malloc(40 * MIB, S0).unwrap();
    let c = sim.counters(0);
    assert!(
        c.granules_unmapped >= 10,
        "pages moved from S1's segment to S0's"
    );
    assert_eq!(
        (c.synchronize_calls, c.event_waits),
        (0, 1),
        "one wait on S1's fence, not on the whole device"
    );
    let reserved = stats(&a).reserved_bytes.all().current as u64;
    assert!(within_default_slack(reserved, 40 * MIB), "{reserved}");
    sim.set_stream_paused(0, S1, false);
    a.free(big).unwrap();
}

#[test]
fn growth_behind_a_lagging_gpu_waits_once_on_a_fence_never_on_the_device() {
    // Events complete only two recorded events later, like a GPU running behind the host.
    let sim = Arc::new(SimDriver::new(1, 1 << 30).with_event_lag(2));
    let a = DeviceAllocator::new(0, sim.clone(), Config::default()).unwrap();
    let blocks: Vec<_> = (0..4).map(|_| a.malloc(16 * MIB, S0).unwrap()).collect();
    let keep = a.malloc(2 * MIB, S0).unwrap();
    for b in blocks {
        // The first free records a fence (later ones only every FREES_PER_FENCE frees).
        a.free(b).unwrap();
    }
    // Larger than the 64 MiB hole: it goes after `keep`, with pages from the hole that the
    // device may still be using: one wait on a fence, none on the whole device.
    let big = a.malloc(70 * MIB, S0).unwrap();
    let c = sim.counters(0);
    assert!(c.granules_unmapped >= 16, "pages moved: {c:?}");
    assert_eq!((c.synchronize_calls, c.event_waits), (0, 1));
    let reserved = stats(&a).reserved_bytes.all().current as u64;
    assert!(within_default_slack(reserved, 72 * MIB), "{reserved}");
    a.free(big).unwrap();
    a.free(keep).unwrap();
}

#[test]
fn best_place_finds_mapped_runs_inside_a_free_block() {
    use super::paging::table::PagedSegment;
    use crate::driver::PhysHandle;
    let (base, page) = (1u64 << 30, 2 * MIB);
    let mut seg = PagedSegment::new(base, 16 * page, page, S0, sizing::PoolKind::Large);
    seg.set_chunk(
        5,
        super::paging::table::Spare {
            handle: PhysHandle(5),
            pages: 4,
        },
    );
    seg.set_chunk(
        12,
        super::paging::table::Spare {
            handle: PhysHandle(12),
            pages: 1,
        },
    );
    let va = |i: u64| base + i * page;
    // A free block from the middle of page 0 to page 15: 4 pages fit on the mapped run.
    assert_eq!(seg.best_place(base + MIB, va(15), 4 * page), (0, va(5)));
    // 6 pages: no place without new pages; the run start needs 2.
    assert_eq!(seg.best_place(base + MIB, va(15), 6 * page).0, 2);
    // Where the block ends before the run does, its end is the best place.
    assert_eq!(seg.best_place(va(0), va(7), 4 * page), (2, va(3)));
    // Its start, when that is as good as anything.
    assert_eq!(seg.best_place(va(9), va(12), 2 * page), (2, va(9)));
    assert_eq!(seg.unmapped_pages(va(4), 3 * page), 1);
}

#[test]
fn huge_blocks_stack_down_from_the_top_and_reuse_the_pages_left_there() {
    let (sim, a) = paged(1 << 30, "");
    let small = a.malloc(10 * MIB, S0).unwrap();
    let x = a.malloc(100 * MIB, S0).unwrap();
    assert!(
        x > small + 800 * MIB,
        "a huge block goes to the top of the range"
    );
    let maps = sim.counters(0).maps;
    a.free(x).unwrap();
    // Smaller but still huge: it ends where x ended, on pages x left mapped.
    let y = a.malloc(90 * MIB, S0).unwrap();
    assert_eq!(y, x + 10 * MIB);
    assert_eq!(sim.counters(0).maps, maps, "no page was mapped");
    // A smaller block placed where pages are mapped, inside the free space x left.
    a.free(y).unwrap();
    let z = a.malloc(20 * MIB, S0).unwrap();
    assert!(
        z >= x && z + 20 * MIB <= x + 100 * MIB,
        "carved inside x's mapped pages"
    );
    assert_eq!(sim.counters(0).maps, maps);
    for p in [small, z] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn fences_keep_coming_through_a_long_run_without_page_moves() {
    let sim = Arc::new(SimDriver::new(1, 1 << 30).with_event_lag(2));
    let a = DeviceAllocator::new(0, sim.clone(), Config::default()).unwrap();
    for _ in 0..3000 {
        let p = a.malloc(4 * MIB, S0).unwrap();
        a.free(p).unwrap();
    }
    let st = a.state_of(S0);
    let newest = st.fences().newest_seq();
    assert!(
        st.free_seq() - newest <= 16,
        "newest fence covers free {newest} of {}",
        st.free_seq()
    );
}

#[test]
fn page_slack_trades_memory_for_page_moves() {
    // A 40 MiB hole, then a 60 MiB request that does not fit it: with the default slack its
    // pages come from the hole; with page_slack:1 the cache may grow instead.
    let run = |conf: &str| {
        let (sim, a) = paged(1 << 30, conf);
        let hole = a.malloc(40 * MIB, S0).unwrap();
        let keep = a.malloc(4 * MIB, S0).unwrap();
        a.free(hole).unwrap();
        let before = stats(&a).paging;
        let big = a.malloc(60 * MIB, S0).unwrap();
        let reserved = stats(&a).reserved_bytes.all().current as u64;
        let unmaps = sim.counters(0).granules_unmapped;
        let paging = stats(&a).paging;
        assert_eq!(paging.growths, before.growths + 1);
        assert_eq!(paging.chunks_unmapped, sim.counters(0).unmaps);
        assert_eq!(paging.chunks_mapped, sim.counters(0).maps);
        assert!(paging.growth_ns > before.growth_ns && paging.moving_ns <= paging.growth_ns);
        a.free(big).unwrap();
        a.free(keep).unwrap();
        (
            reserved,
            unmaps,
            paging.moving_growths - before.moving_growths,
        )
    };
    let (tight, moved, moving_growths) = run("");
    let (loose, none, no_moving_growth) = run("page_slack:1");
    assert!(
        moved >= 10 && within_default_slack(tight, 64 * MIB),
        "{tight} {moved}"
    );
    assert_eq!(
        moving_growths, 1,
        "the paging stats count the growth that moved"
    );
    assert_eq!((none, no_moving_growth), (0, 0), "nothing moved");
    assert_eq!(loose, 104 * MIB, "the 40 MiB hole stayed mapped");
}

#[test]
fn growth_maps_whole_chunks_and_moves_them_whole() {
    use super::paging::table::chunk_pages_for;
    let (sim, a) = paged(1 << 30, "");
    // 48 MiB = 24 pages: a sixteenth of the run is under a page, so chunks of one page, one
    // create and one map each, and one grant of access for the run.
    assert_eq!(chunk_pages_for(24, 4, false), 1);
    let p = a.malloc(48 * MIB, S0).unwrap();
    let c = sim.counters(0);
    assert_eq!(
        (c.maps, c.physical_creates, c.granules_mapped),
        (24, 24, 24)
    );
    let keep = a.malloc(4 * MIB, S0).unwrap();
    assert_eq!(keep, p + 48 * MIB);
    a.free(p).unwrap();
    // Too large for the hole: its pages come from the hole's chunks, moved whole and
    // reused as they are (no new physical memory beyond the slack).
    let big = a.malloc(60 * MIB, S0).unwrap();
    assert!(big > keep);
    let c = sim.counters(0);
    assert!(c.granules_unmapped >= 20, "most of the hole moved: {c:?}");
    assert_eq!(c.unmaps, c.granules_unmapped, "one unmap per chunk: {c:?}");
    assert!(
        c.physical_creates < 24 + 2 + 30,
        "moved chunks were mapped again: {c:?}"
    );
    let reserved = stats(&a).reserved_bytes.all().current as u64;
    assert!(within_default_slack(reserved, 64 * MIB), "{reserved}");
    all_given_back(&sim, &a, &[big, keep]);
}

/// Reserved is what the device holds; once `blocks` are freed and the cache emptied, the
/// device holds nothing.
fn all_given_back(sim: &SimDriver, a: &DeviceAllocator, blocks: &[DevicePtr]) {
    let reserved = stats(a).reserved_bytes.all().current as u64;
    assert_eq!(reserved, sim.counters(0).bytes_in_use);
    for &b in blocks {
        a.free(b).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn small_chunks_a_move_takes_are_made_anew_in_fewer_larger_ones() {
    use super::paging::table::chunk_pages_for;
    let (sim, a) = paged(1 << 30, "");
    // A 48 MiB hole of 24 one-page chunks, then 256 MiB (128 pages, chunks of 4: a
    // sixteenth of the run is 8, capped at 4 by the small slack): past the slack, so the
    // hole's chunks move. Mapped again they would cost 24 grants; released, their pages
    // come back in 4-page chunks: 32 maps for the whole run instead of 24 + 26.
    assert_eq!(chunk_pages_for(128, 4, false), 4);
    let hole = a.malloc(48 * MIB, S0).unwrap();
    let keep = a.malloc(4 * MIB, S0).unwrap();
    a.free(hole).unwrap();
    let before = sim.counters(0);
    let big = a.malloc(256 * MIB, S0).unwrap();
    let c = sim.counters(0);
    assert_eq!(c.unmaps - before.unmaps, 24, "the hole moved: {c:?}");
    assert_eq!(
        c.physical_releases - before.physical_releases,
        24,
        "released: {c:?}"
    );
    assert_eq!(
        (
            c.maps - before.maps,
            c.physical_creates - before.physical_creates
        ),
        (32, 32),
        "{c:?}"
    );
    let reserved = stats(&a).reserved_bytes.all().current as u64;
    assert_eq!(reserved, 260 * MIB, "{reserved}");
    all_given_back(&sim, &a, &[big, keep]);
}

#[test]
fn a_limit_lowered_below_the_memory_held_still_lets_moved_chunks_map_again() {
    // Two 60 MiB holes of one-page chunks, then a limit of 100 MiB (under the 124 held):
    // a 100 MiB request must reuse the holes' chunks as they are, since new ones would be
    // over the limit; released for larger ones, the request would end in an OOM.
    let (sim, a) = paged(1 << 30, "");
    let first = a.malloc(60 * MIB, S0).unwrap();
    let keep = a.malloc(2 * MIB, S0).unwrap();
    let second = a.malloc(60 * MIB, S0).unwrap();
    let keep2 = a.malloc(2 * MIB, S0).unwrap();
    a.free(first).unwrap();
    a.free(second).unwrap();
    a.set_memory_fraction(100.0 / 1024.0).unwrap();
    let before = sim.counters(0);
    let p = a.malloc(100 * MIB, S0).unwrap();
    let c = sim.counters(0);
    assert_eq!(c.physical_creates, before.physical_creates, "{c:?}");
    assert!(stats(&a).reserved_bytes.all().current as u64 <= 124 * MIB);
    for q in [p, keep, keep2] {
        a.free(q).unwrap();
    }
}

#[test]
fn a_large_jobs_small_requests_get_chunks_of_a_sixteenth_of_its_slack() {
    use super::paging::table::{chunk_pages_for, MAX_CHUNK_PAGES};
    // A slack under 32 pages sets no floor above one page; from there, a sixteenth of it,
    // within the limits.
    assert_eq!(chunk_pages_for(24, 31, false), 1);
    assert_eq!(chunk_pages_for(24, 32, false), 2);
    assert_eq!(chunk_pages_for(24, 64, false), 4);
    assert_eq!(
        chunk_pages_for(128, 64, false),
        4,
        "a sixteenth of the run is larger, but a chunk is at most a sixteenth of the slack"
    );
    assert_eq!(
        chunk_pages_for(1, 64, false),
        4,
        "a one-page gap: `add_new_chunks` makes the smaller of this and the gap"
    );
    assert_eq!(chunk_pages_for(40, 256, true), 16);
    assert_eq!(chunk_pages_for(1, 1 << 20, false), MAX_CHUNK_PAGES);
    // A job with 4 GiB live keeps 3% of it (61 pages) as slack: a 48 MiB block then comes
    // in 8 chunks of 3 pages, not 24 of one.
    let (sim, a) = paged(16 << 30, "");
    let big = a.malloc(4 << 30, S0).unwrap();
    let before = sim.counters(0);
    let small = a.malloc(48 * MIB, S0).unwrap();
    let c = sim.counters(0);
    assert_eq!(
        (
            c.maps - before.maps,
            c.physical_creates - before.physical_creates,
            c.granules_mapped - before.granules_mapped
        ),
        (8, 8, 24),
        "{c:?}"
    );
    all_given_back(&sim, &a, &[big, small]);
}

#[test]
fn a_large_block_is_backed_by_few_large_chunks() {
    use super::paging::table::{chunk_pages_for, CHUNK_PAGES, MAX_CHUNK_PAGES};
    // A sixteenth of the run (a quarter when coarse), within the limits; a slack of 1,024
    // pages neither raises nor caps it.
    assert_eq!(chunk_pages_for(1, 0, false), CHUNK_PAGES);
    assert_eq!(chunk_pages_for(15, 0, false), CHUNK_PAGES);
    assert_eq!(chunk_pages_for(40, 0, false), 2);
    assert_eq!(chunk_pages_for(1 << 20, 1024, false), MAX_CHUNK_PAGES);
    assert_eq!(chunk_pages_for(1, 0, true), 4);
    assert_eq!(chunk_pages_for(40, 160, true), 10);
    assert_eq!(chunk_pages_for(1 << 20, 1024, true), MAX_CHUNK_PAGES);
    // A slack of the live high-water mark: a 512 MiB block's chunks are a sixteenth of its
    // run and of the slack, 16 pages.
    let (sim, a) = paged(4 << 30, "page_slack:1");
    // 512 MiB = 256 pages: sixteen chunks of 16 pages, not 256 of one.
    let p = a.malloc(512 * MIB, S0).unwrap();
    let c = sim.counters(0);
    assert_eq!((c.maps, c.physical_creates), (16, 16), "{c:?}");
    // 20 MiB = 10 pages: a sixteenth of the run is under a page, but a chunk is a sixteenth
    // of the slack (532 MiB, 266 pages), 16 pages: one chunk, ending where the run does.
    let q = a.malloc(20 * MIB, S0).unwrap();
    let c = sim.counters(0);
    assert_eq!((c.maps, c.physical_creates), (16 + 1, 16 + 1), "{c:?}");
    let reserved = stats(&a).reserved_bytes.all().current as u64;
    assert_eq!(reserved, 532 * MIB, "chunks end where the run does");
    a.free(p).unwrap();
    a.free(q).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn a_chunk_is_at_most_a_sixteenth_of_the_slack() {
    use super::paging::table::chunk_pages_for;
    // A large run in a job whose slack is 160 pages: 10-page chunks, not 64.
    assert_eq!(chunk_pages_for(1024, 160, false), 10);
    assert_eq!(chunk_pages_for(1024, 160, true), 10);
    // Never under 4 pages (2 without the floor), and a small job's chunks for runs under
    // 80 pages stay as they were.
    assert_eq!(chunk_pages_for(512, 16, false), 4);
    assert_eq!(chunk_pages_for(64, 16, false), 4);
    assert_eq!(chunk_pages_for(40, 16, false), 2);
    // Nor under a 256th of the run, rounded up: at most 256 chunks for a growth.
    assert_eq!(chunk_pages_for(1279, 0, false), 5);
    // With 4 GiB live, a 1 GiB block (512 pages, a sixteenth of which is 32) takes the live
    // high-water mark to 5 GiB and the slack to 153 MiB (76 pages): chunks of 4 pages.
    let (sim, a) = paged(16 << 30, "");
    let base = a.malloc(4 << 30, S0).unwrap();
    let before = sim.counters(0);
    let big = a.malloc(1 << 30, S0).unwrap();
    let c = sim.counters(0);
    assert_eq!(c.maps - before.maps, 512usize.div_ceil(4) as u64, "{c:?}");
    // What a later, smaller block on its pages pins is at most one such chunk per edge,
    // within the slack: here one 2 MiB block at the far end of the freed run.
    a.free(big).unwrap();
    let rest = a.malloc(1022 * MIB, S0).unwrap();
    let tail = a.malloc(2 * MIB, S0).unwrap();
    a.free(rest).unwrap();
    a.empty_cache().unwrap();
    let reserved = stats(&a).reserved_bytes.all().current as u64;
    let live = (4 << 30) + 2 * MIB;
    assert!(
        reserved <= live + 2 * 4 * 2 * MIB,
        "{} MiB reserved for {} MiB live",
        reserved / MIB,
        live / MIB
    );
    all_given_back(&sim, &a, &[base, tail]);
}

/// A 128 MiB block (64 pages, mapped as 16 chunks of 4) freed, then a 66 MiB one (33
/// pages) in its place: both are huge, so both sit at the top of the address range, and the
/// second covers pages 31..64 of the first: one page of its chunk 28..32.
fn huge_block_replaced_by_a_smaller_one() -> (Arc<SimDriver>, DeviceAllocator, DevicePtr, DevicePtr)
{
    let (sim, a) = paged(1 << 30, "");
    let p = a.malloc(128 * MIB, S0).unwrap();
    a.free(p).unwrap();
    let q = a.malloc(66 * MIB, S0).unwrap();
    assert_eq!(q, p + 62 * MIB);
    (sim, a, p, q)
}

#[test]
fn a_chunk_under_a_live_block_is_never_moved() {
    let (sim, a, _p, q) = huge_block_replaced_by_a_smaller_one();
    sim.note_use(0, q, 66 * MIB, S0);
    // Growth past the slack may move the 7 chunks wholly under the free block below `q`,
    // never the one `q` touches.
    let big = a.malloc(200 * MIB, S0).unwrap();
    let c = sim.counters(0);
    assert!(c.unmaps <= 7 && c.granules_unmapped <= 28, "{c:?}");
    assert!(sim.contains(0, q, 66 * MIB), "its pages are mapped");
    a.free(big).unwrap();
    a.free(q).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

#[test]
fn a_live_block_pins_at_most_a_sixteenth_of_the_block_it_replaced() {
    // Generation's pattern: a large block is freed and a smaller one takes its place. What
    // stays reserved after empty_cache is the smaller block's pages and the rest of the one
    // chunk it shares with free pages: at most a sixteenth of the old block.
    let (sim, a, _p, q) = huge_block_replaced_by_a_smaller_one();
    a.empty_cache().unwrap();
    let reserved = stats(&a).reserved_bytes.all().current as u64;
    assert!(
        reserved <= 66 * MIB + 128 * MIB / 16,
        "{} MiB stay reserved for 66 MiB live",
        reserved / MIB
    );
    assert_eq!(reserved, sim.counters(0).bytes_in_use);
    a.free(q).unwrap();
}

#[test]
fn parking_pauses_when_parked_blocks_are_not_reused() {
    let (_sim, a) = paged(1 << 30, "");
    // 200 distinct sizes, none asked for again: the parked set fills without a reuse.
    let blocks: Vec<_> = (1..=200u64)
        .map(|i| a.malloc(i * 512, S0).unwrap())
        .collect();
    for b in blocks {
        a.free(b).unwrap();
    }
    let st = a.state_of(S0);
    let (count, _, paused) = st.parked_figures();
    assert!(paused > 0, "parking paused");
    assert!(count < 64, "{count} parked");
}

#[test]
fn moves_may_take_the_budgets_share_of_the_time_since_the_start_and_no_more() {
    use super::paging::budget::MoveClock;
    use std::time::{Duration, Instant};
    let ms = Duration::from_millis;
    let budget = 0.02;
    // A growth from `at` that moved pages for `took` (less `waited`, the device's time).
    let growth = |clock: &mut MoveClock, at: Instant, took: Duration, waited: Duration| {
        clock.start_growth();
        clock.note_moved(true);
        clock.note_wait(waited);
        clock.account(at, at + took, budget, false)
    };
    let t0 = Instant::now();
    let mut clock = MoveClock::started_at(t0);
    assert!(
        !clock.may_move(t0, budget),
        "nothing is allowed before any time has passed"
    );
    // After 5 s, 100 ms of moves are allowed, however they bunch: 24 growths of 4 ms fit.
    let mut at = t0 + ms(5000);
    for _ in 0..24 {
        assert!(clock.may_move(at, budget));
        assert_eq!(growth(&mut clock, at, ms(4), ms(0)), None);
        at += ms(4);
    }
    assert!(!clock.spent_lately());
    // The 26th spends the last of it: the one log line, and growth then maps new memory.
    assert!(clock.may_move(at, budget));
    assert_eq!(growth(&mut clock, at, ms(4), ms(0)), None);
    at += ms(4);
    assert!(clock.may_move(at, budget));
    assert_eq!(growth(&mut clock, at, ms(4), ms(0)), Some(ms(4)));
    at += ms(4);
    assert!(!clock.may_move(at, budget));
    assert!(
        clock.spent_lately(),
        "growth makes coarser chunks for a while"
    );
    // Waits for the device cost nothing: 1 s of waits in a 5 ms growth spends 5 ms.
    let later = at + ms(1000);
    assert!(clock.may_move(later, budget), "1 s refills 20 ms");
    assert_eq!(growth(&mut clock, later, ms(1005), ms(1000)), None);
    assert!(clock.may_move(later + ms(1005), budget));
    // An hour of quiet banks no more than the budget's share of 30 s (600 ms).
    let hour = later + Duration::from_secs(3600);
    let mut spent = 0;
    let mut at = hour;
    while clock.may_move(at, budget) {
        growth(&mut clock, at, ms(10), ms(0));
        at += ms(10);
        spent += 10;
    }
    assert!(
        (600..=620).contains(&spent),
        "{spent} ms of moves after an hour's quiet"
    );
    assert!(clock.spent_lately(), "ran out again after the hour");
    // A growth that ends with the device still busy spends nothing, and the first one
    // credits a job that keeps its device busy, once, with 30 s at the budget's share.
    let mut job = MoveClock::started_at(t0);
    job.start_growth();
    job.note_moved(true);
    assert_eq!(job.account(t0 + ms(100), t0 + ms(150), budget, true), None);
    let mut at = t0 + ms(150);
    let mut spent = 0;
    while job.may_move(at, budget) {
        growth(&mut job, at, ms(10), ms(0));
        at += ms(10);
        spent += 10;
    }
    assert!((600..=620).contains(&spent), "{spent} ms after the credit");
    job.start_growth();
    job.account(at, at + ms(1), budget, true);
    assert!(!job.may_move(at + ms(1), budget), "the credit comes once");
    // Having run out, a job that keeps its device busy moves again only once its allowance
    // is full: 1 s brings it 20 ms, which an allocation-bound loop (`clock`, above) may
    // spend at once, but this job waits for the whole 600 ms.
    assert!(!job.may_move(at + ms(1_000), budget), "refilling after 1 s");
    assert!(
        !job.may_move(at + ms(29_000), budget),
        "refilling after 29 s"
    );
    assert!(
        job.may_move(at + ms(31_000), budget),
        "full again after 31 s"
    );
    assert_eq!(growth(&mut job, at + ms(31_000), ms(300), ms(0)), None);
    assert!(
        job.may_move(at + ms(31_300), budget),
        "half spent, it still moves: the refill waits only after running out"
    );
    // Moves a refused growth still makes (forced by the hard limit or the OOM path) are
    // not charged: a phase at the limit must not leave a debt that outlasts it.
    let mut forced = MoveClock::started_at(t0);
    let at = t0 + ms(1000);
    assert!(forced.may_move(at, budget), "20 ms earned");
    for i in 0..20 {
        let at = at + ms(100) * i;
        forced.start_growth();
        forced.note_refused();
        forced.note_moved(true);
        forced.account(at, at + ms(100), budget, false);
    }
    assert!(forced.may_move(at + ms(2000), budget));
    // A while at budget 0 (set at run time) keeps the allowance and the warm-up credit.
    let mut paused = MoveClock::started_at(t0);
    assert!(paused.may_move(t0 + ms(5000), budget), "100 ms earned");
    paused.start_growth();
    paused.account(t0 + ms(5000), t0 + ms(5001), 0.0, true);
    paused.start_growth();
    paused.note_moved(true);
    assert_eq!(
        paused.account(t0 + ms(5001), t0 + ms(5051), budget, false),
        None
    );
    assert!(
        paused.may_move(t0 + ms(5051), budget),
        "the 100 ms were kept"
    );
    paused.start_growth();
    paused.account(t0 + ms(5051), t0 + ms(5052), budget, true);
    let mut spent = 0;
    let mut at = t0 + ms(5052);
    while paused.may_move(at, budget) {
        growth(&mut paused, at, ms(10), ms(0));
        at += ms(10);
        spent += 10;
    }
    assert!(spent >= 600, "{spent} ms: the credit came after the pause");
    // Budget 0 bounds nothing.
    let mut free = MoveClock::started_at(t0);
    assert!(free.may_move(t0, 0.0));
    free.start_growth();
    free.note_moved(true);
    assert_eq!(free.account(t0, t0 + ms(1000), 0.0, false), None);
    assert!(free.may_move(t0 + ms(1000), 0.0));
}

#[test]
fn page_bits_count_and_all_across_words() {
    use super::paging::table::PageBits;
    use std::collections::BTreeSet;
    // Against a set, for ranges cutting words anywhere, over several patterns.
    let mut seed = 11u64;
    for round in 0..200 {
        let pages = 1 + (round * 7) % 300;
        let mut bits = PageBits::new(pages);
        let mut set = BTreeSet::new();
        for _ in 0..pages {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let i = (seed >> 33) as usize % pages;
            if (seed >> 20).is_multiple_of(3) {
                bits.clear(i);
                set.remove(&i);
            } else {
                bits.set(i);
                set.insert(i);
            }
        }
        assert_eq!(bits.is_empty(), set.is_empty());
        for _ in 0..20 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let a = (seed >> 33) as usize % (pages + 1);
            let b = (seed >> 13) as usize % (pages + 1);
            let range = a.min(b)..a.max(b);
            let in_set = set.range(range.clone()).count();
            assert_eq!(bits.count(range.clone()), in_set);
            assert_eq!(bits.all(range.clone()), in_set == range.len(), "{range:?}");
        }
    }
}

#[test]
fn parked_large_blocks_are_reused_and_never_cost_pages() {
    // The shard's parking, under the thread fronts (which take such blocks first).
    let (sim, a) = paged(1 << 30, "thread_cache:False");
    let keep = a.malloc(4 * MIB, S0).unwrap();
    let big = a.malloc(64 * MIB, S0).unwrap();
    a.free(big).unwrap();
    assert_eq!(a.state_of(S0).parked_count(), 1, "the large block parked");
    // The same size on the same stream: the parked block, with no driver call.
    let maps = sim.counters(0).maps;
    let again = a.malloc(64 * MIB, S0).unwrap();
    assert_eq!((again, sim.counters(0).maps), (big, maps));
    a.free(again).unwrap();
    // Another size that would need pages elsewhere: the parked block merges back first, and
    // its mapped pages serve the request (no growth, no new reserved bytes).
    let reserved = stats(&a).reserved_bytes.all().current;
    let paging = stats(&a).paging;
    let smaller = a.malloc(60 * MIB, S0).unwrap();
    assert!(smaller >= big && smaller + 60 * MIB <= big + 64 * MIB);
    assert_eq!(stats(&a).reserved_bytes.all().current, reserved);
    assert_eq!(stats(&a).paging.growths, paging.growths);
    assert_eq!(a.state_of(S0).parked_count(), 0);
    a.free(smaller).unwrap();
    a.free(keep).unwrap();
}

#[test]
fn blocks_do_not_park_while_growth_cannot_move_pages() {
    // Without moves, pages once mapped stay where the layout put them: a block parked for
    // its size goes back to its old place where best fit over merged free space would
    // find a tighter one (docs/paging.md, "Parking").
    let (_sim, a) = paged(1 << 30, "thread_cache:False,page_moves:False");
    let keep = a.malloc(4 * MIB, S0).unwrap();
    let big = a.malloc(64 * MIB, S0).unwrap();
    a.free(big).unwrap();
    assert_eq!(
        a.state_of(S0).parked_count(),
        0,
        "the growth could not move"
    );
    // Moves allowed again at run time: the next growth may move, and blocks park again.
    let mut c = Config::default();
    c.apply("thread_cache:False").unwrap();
    a.set_config(c).unwrap();
    let bigger = a.malloc(128 * MIB, S0).unwrap();
    a.free(bigger).unwrap();
    assert_eq!(a.state_of(S0).parked_count(), 1, "the growth could move");
    a.free(keep).unwrap();
}

#[test]
fn a_parked_large_block_never_hides_the_space_it_would_merge_into() {
    // 900 MiB fit only once the parked 600 MiB block merges with the free space after it:
    // the request must find it there, not release the cache and make a plain segment.
    let (sim, a) = paged(1 << 30, "");
    let keep = a.malloc(4 * MIB, S0).unwrap();
    let big = a.malloc(600 * MIB, S0).unwrap();
    a.free(big).unwrap();
    let p = a.malloc(900 * MIB, S0).unwrap();
    let s = stats(&a);
    assert_eq!(
        (
            s.num_alloc_retries,
            s.num_sync_all_streams,
            sim.counters(0).allocate_calls
        ),
        (0, 0, 0)
    );
    a.free(p).unwrap();
    // The same during a capture of another stream, where the slow path may not release.
    let big = a.malloc(600 * MIB, S0).unwrap();
    a.free(big).unwrap();
    a.begin_allocate_to_pool((9, 9), Box::new(|s| s == S1))
        .unwrap();
    let p = a.malloc(900 * MIB, S0);
    a.end_allocate_to_pool((9, 9)).unwrap();
    a.free(p.expect("fits once the parked block merges"))
        .unwrap();
    a.free(keep).unwrap();
}

#[test]
fn plain_segments_report_no_paging_costs() {
    let (_sim, a) = setup(1 << 30, "");
    let p = a.malloc(4 * MIB, S0).unwrap();
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(stats(&a).paging, Default::default());
}

#[test]
fn a_growth_the_device_refuses_still_counts() {
    let (_sim, a) = paged(1 << 30, "per_process_memory_fraction:0.1");
    let p = a.malloc(60 * MIB, S0).unwrap();
    let before = stats(&a).paging;
    assert_eq!(
        a.malloc(60 * MIB, S0).unwrap_err().kind,
        ErrorKind::OutOfMemory
    );
    let after = stats(&a).paging;
    assert!(after.growths > before.growths, "{before:?} -> {after:?}");
    assert!(after.growth_ns > before.growth_ns);
    a.free(p).unwrap();
}

#[test]
fn empty_cache_forgets_the_free_lists_of_streams_with_nothing_cached() {
    let (sim, a) = paged(1 << 30, "expandable_segments:False");
    for s in 1..=50u64 {
        let p = a.malloc(4096, StreamId(s)).unwrap();
        a.free(p).unwrap();
    }
    let indexed = |a: &DeviceAllocator| {
        a.sum_over_states(|st| {
            [PoolKind::Small, PoolKind::Large]
                .iter()
                .map(|&p| st.general_list(p).indexed_streams())
                .sum::<usize>()
        })
    };
    assert_eq!(indexed(&a), 50, "one small-pool index per stream");
    let keep = a.malloc(4096, StreamId(7)).unwrap();
    a.empty_cache().unwrap();
    // Stream 7's segment keeps its free rest (the segment holds a live block).
    assert_eq!(indexed(&a), 1);
    a.free(keep).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(indexed(&a), 0);
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

/// `expandable_segments:False` set at run time gives plain segments from then on, also on a
/// stream whose paged segment (one free block as large as the device) would fit anything.
#[test]
fn expandable_segments_turned_off_at_run_time_gives_plain_segments() {
    let (sim, a) = paged(1 << 30, "thread_cache:False");
    let p = a.malloc(4 * MIB, S0).unwrap();
    a.free(p).unwrap();
    a.apply_config("expandable_segments:False").unwrap();
    let before = sim.counters(0);
    let q = a.malloc(64 * MIB, S0).unwrap();
    let r = a.malloc(1000, S0).unwrap();
    let after = sim.counters(0);
    assert_eq!(
        after.allocate_calls,
        before.allocate_calls + 2,
        "two plain segments"
    );
    assert_eq!(after.maps, before.maps, "no page mapped");
    let blocks = a.segments().unwrap();
    for ptr in [q, r] {
        let owner = blocks
            .iter()
            .find(|s| ptr >= s.addr && ptr < s.addr + s.size)
            .unwrap();
        assert_ne!(owner.size, 1 << 30, "{ptr:#x} is not in the paged segment");
    }
    a.free(q).unwrap();
    a.free(r).unwrap();
    // Back on: the paged segment serves again (beyond what the cached plain ones hold).
    a.apply_config("expandable_segments:True").unwrap();
    let maps = sim.counters(0).maps;
    let s = a.malloc(200 * MIB, S0).unwrap();
    assert!(sim.counters(0).maps > maps, "paged again");
    a.free(s).unwrap();
}

/// As PyTorch's `release_available_cached_blocks`, an OOM retry frees oversize cached blocks
/// of the request's own pool only: a small request goes straight to releasing everything,
/// counting one retry and one synchronize.
#[test]
fn a_small_request_retries_by_releasing_everything() {
    let (_sim, a) = setup(179 * MIB, "max_split_size_mb:64");
    let big = a.malloc(100 * MIB, S0).unwrap();
    let live = a.malloc(78 * MIB, S0).unwrap();
    a.free(big).unwrap();
    // 178 MiB reserved: a small request's 2 MiB segment fits only once cache is released.
    let small = a.malloc(1024, S0).unwrap();
    let s = stats(&a);
    assert_eq!((s.num_alloc_retries, s.num_sync_all_streams), (1, 1));
    a.free(small).unwrap();
    a.free(live).unwrap();
}

/// A request larger than the memory limit fails at once: no cache released, and no pages
/// mapped up to the limit first (on a shared GPU others could use that memory meanwhile).
#[test]
fn a_request_beyond_the_memory_limit_fails_without_taking_memory() {
    for conf in ["", "expandable_segments:False"] {
        let (sim, a) = paged(
            160 * MIB,
            &format!("per_process_memory_fraction:0.3,{conf}"),
        );
        let cached = a.malloc(MIB, S0).unwrap();
        a.free(cached).unwrap();
        let before = sim.counters(0);
        let err = a.malloc(64 * MIB + 1, S0).unwrap_err();
        assert_eq!(err.kind, ErrorKind::OutOfMemory, "{conf:?}");
        assert!(err.message.contains("Tried to allocate"), "{}", err.message);
        let after = sim.counters(0);
        assert_eq!(
            after.peak_bytes_in_use, before.peak_bytes_in_use,
            "{conf:?}: nothing taken"
        );
        assert_eq!(
            after.bytes_in_use, before.bytes_in_use,
            "{conf:?}: cache kept"
        );
        assert_eq!(stats(&a).num_ooms, 1);
    }
}

/// The memory limit gates reserving new memory, never handing out cached memory (PyTorch
/// checks it only when it must reserve): a request larger than the limit that a cached
/// block can serve is served, in either segment kind.
#[test]
fn the_memory_limit_does_not_refuse_cached_memory() {
    for conf in ["", "expandable_segments:False"] {
        let (sim, a) = paged(2 << 30, conf);
        let big = a.malloc(1 << 30, S0).unwrap();
        a.free(big).unwrap();
        // 819 MiB of the 2 GiB device.
        a.set_memory_fraction(819.0 / 2048.0).unwrap();
        let before = sim.counters(0);
        let p = a.malloc(900 * MIB, S0).unwrap();
        let after = sim.counters(0);
        assert_eq!(
            (after.allocate_calls, after.maps),
            (before.allocate_calls, before.maps),
            "{conf:?}: served from the cache"
        );
        a.free(p).unwrap();
        // Fraction 0: a small request still fits a cached small segment.
        let small = a.malloc(512, S0).unwrap();
        a.free(small).unwrap();
        a.set_memory_fraction(0.0).unwrap();
        let small = a.malloc(512, S0).unwrap();
        a.free(small).unwrap();
        // New memory is refused, at once: a request the cache cannot serve fails.
        let err = a.malloc(1536 * MIB, S0).unwrap_err();
        assert_eq!(err.kind, ErrorKind::OutOfMemory, "{conf:?}");
        assert_eq!(sim.counters(0).peak_bytes_in_use, after.peak_bytes_in_use);
    }
}

/// DOUBLE_FREE is for a pointer once handed out and freed since; a pointer into free space
/// no block ever covered, or off the 512-byte grid of block starts, is UNKNOWN_POINTER.
#[test]
fn pointers_never_handed_out_are_unknown_not_double_frees() {
    for conf in ["", "expandable_segments:False"] {
        let (_sim, a) = paged(1 << 30, conf);
        let p = a.malloc(4096, S0).unwrap();
        let q = a.malloc(4096, S0).unwrap();
        a.free(q).unwrap();
        let kind = |ptr| a.free(ptr).unwrap_err().kind;
        assert_eq!(kind(q), ErrorKind::DoubleFree, "{conf:?}");
        // The segment's free space past every block handed out.
        assert_eq!(kind(p + MIB), ErrorKind::UnknownPointer, "{conf:?}");
        // Not a block start: freed memory, but off the grid.
        assert_eq!(kind(q + 1), ErrorKind::UnknownPointer, "{conf:?}");
        assert_eq!(kind(q + 100), ErrorKind::UnknownPointer, "{conf:?}");
        // A large block placed from the top of a paged segment: the space below it was
        // never handed out either.
        let big = a.malloc(64 * MIB, S0).unwrap();
        a.free(big).unwrap();
        assert_eq!(kind(big), ErrorKind::DoubleFree, "{conf:?}");
        a.free(p).unwrap();
        assert_eq!(kind(p), ErrorKind::DoubleFree, "{conf:?}");
        // After the memory goes back to the device, nothing of it is known.
        a.empty_cache().unwrap();
        assert_eq!(kind(p), ErrorKind::UnknownPointer, "{conf:?}");
    }
}

/// A poisoned lock fails the calls that need it with `Internal` (`CCALLOC_INTERNAL_ERROR`),
/// naming what it guards (`sync::poisoned`), instead of going on with what it guards.
#[test]
fn a_poisoned_lock_fails_the_calls_that_need_it_naming_what_it_guards() {
    use super::device::LockOf;
    type Call = fn(&DeviceAllocator) -> Result<(), Error>;
    let cases: [(LockOf, &str, Call); 5] = [
        (LockOf::Settings, "device 0's allocator settings", |a| {
            a.memory_fraction().map(drop)
        }),
        (
            LockOf::ReservedBytes,
            "the device's reserved-byte counters",
            |a| a.stats().map(drop),
        ),
        (
            LockOf::ReservedBytes,
            "the device's reserved-byte counters",
            |a| a.reset_peak_stats(),
        ),
        (LockOf::FrontRegistry, "the thread fronts' registry", |a| {
            a.stats().map(drop)
        }),
        (LockOf::ShardState, "device 0's allocator state", |a| {
            a.malloc(4096, S0).map(drop)
        }),
    ];
    for (lock, what, call) in cases {
        let (_sim, a) = paged(1 << 30, "");
        // A block in this thread's front, so that statistics read the registry.
        let p = a.malloc(4096, S0).unwrap();
        a.free(p).unwrap();
        call(&a).unwrap();
        a.poison(lock, S0);
        let e = call(&a).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Internal, "{lock:?}: {e:?}");
        assert!(
            e.message.starts_with(&format!("{what} is unusable")),
            "{lock:?}: {}",
            e.message
        );
    }
}

#[test]
fn a_request_no_free_address_range_fits_gets_another_paged_segment_not_new_memory() {
    // Small live blocks scattered over the address range (the device's size), with large
    // blocks between them freed: the memory is there (the freed blocks' pages), but no
    // free range holds 300 MiB. Each 100 MiB block is freed and its range taken again by
    // 96 MiB and 4 MiB blocks (best fit puts both there).
    let (sim, a) = paged(GIB, "");
    let whole: Vec<_> = (0..10).map(|_| a.malloc(100 * MIB, S0).unwrap()).collect();
    let mut small = Vec::new();
    let mut large = Vec::new();
    for p in whole {
        a.free(p).unwrap();
        large.push(a.malloc(96 * MIB, S0).unwrap());
        small.push(a.malloc(4 * MIB, S0).unwrap());
    }
    for p in large {
        a.free(p).unwrap();
    }
    let big = a.malloc(300 * MIB, S0).unwrap();
    let counters = sim.counters(0);
    assert_eq!(counters.allocate_calls, 0, "no plain segment (cudaMalloc)");
    assert_eq!(counters.live_reservations, 2, "a second address range");
    let stats = a.stats().unwrap();
    let reserved = stats.reserved_bytes.all().current as u64;
    let live = stats.allocated_bytes.all().current as u64;
    assert!(
        within_default_slack(reserved, stats.allocated_bytes.all().peak as u64),
        "reserved {reserved} for {live} live"
    );
    a.free(big).unwrap();
    for p in small {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
    assert_eq!(
        sim.counters(0).live_reservations,
        0,
        "both ranges went back"
    );
}

/// On a 1 GiB device, `stream`'s first paged segment scattered: 4 MiB blocks live every
/// 100 MiB with 96 MiB free between them, so that no free range holds 300 MiB (see
/// `a_request_no_free_address_range_fits_...`). Returns the live blocks.
fn scatter(a: &DeviceAllocator, stream: StreamId) -> Vec<DevicePtr> {
    let whole: Vec<_> = (0..10)
        .map(|_| a.malloc(100 * MIB, stream).unwrap())
        .collect();
    let mut small = Vec::new();
    let mut large = Vec::new();
    for p in whole {
        a.free(p).unwrap();
        large.push(a.malloc(96 * MIB, stream).unwrap());
        small.push(a.malloc(4 * MIB, stream).unwrap());
    }
    for p in large {
        a.free(p).unwrap();
    }
    small
}

/// Large segments `segments()` shows, and those `memory_stats` counts.
fn large_segments(a: &DeviceAllocator) -> (usize, i64) {
    let shown = a
        .segments()
        .unwrap()
        .iter()
        .filter(|s| s.pool == PoolKind::Large)
        .count();
    (shown, stats(a).segment.0[2].current)
}

/// A paged segment added for a request that then fails holds nothing: it goes back with
/// the error, not at the next empty_cache, and no OOM shows as one more segment.
#[test]
fn a_request_that_fails_leaves_no_new_paged_segment_behind() {
    let (sim, a) = paged(GIB, "");
    let small = scatter(&a, S0);
    let big = a.malloc(300 * MIB, S0).unwrap();
    assert_eq!(sim.counters(0).live_reservations, 2);
    assert_eq!(large_segments(&a), (2, 2));
    // No free range of either segment holds 900 MiB, nor does the device's memory.
    let err = a.malloc(900 * MIB, S0).unwrap_err();
    assert_eq!(err.kind, ErrorKind::OutOfMemory);
    assert!(err.message.contains("340.00 MiB live"), "{}", err.message);
    assert_eq!(
        sim.counters(0).live_reservations,
        2,
        "the third address range went back"
    );
    assert_eq!(large_segments(&a), (2, 2));
    // A stream's first paged segment too: S1's request fails while S0 holds the memory.
    let hog = a.malloc(600 * MIB, S0).unwrap();
    assert_eq!(
        a.malloc(200 * MIB, S1).unwrap_err().kind,
        ErrorKind::OutOfMemory
    );
    assert_eq!(sim.counters(0).live_reservations, 2);
    assert_eq!(large_segments(&a), (2, 2));
    for p in small.into_iter().chain([big, hog]) {
        a.free(p).unwrap();
    }
    // The memory is back: S1 gets its segment now.
    let p = a.malloc(200 * MIB, S1).unwrap();
    assert_eq!(sim.counters(0).live_reservations, 3);
    a.free(p).unwrap();
    a.empty_cache().unwrap();
    let c = sim.counters(0);
    assert_eq!((c.bytes_in_use, c.live_reservations), (0, 0));
    assert_eq!(large_segments(&a), (0, 0));
}

/// Each stream counts its own paged segments, and one that goes back (empty_cache) is
/// counted no more: the stream may add another. With a shard per stream as without.
#[test]
fn each_stream_counts_its_own_paged_segments_and_those_released_count_no_more() {
    for conf in ["", "per_stream_shards:True"] {
        let (sim, a) = paged(2 * GIB, conf);
        // Scattered as on 1 GiB: 10 x 100 MiB fill only half a 2 GiB range; the other
        // half is taken by a live block first.
        let rest = a.malloc(GIB, S0).unwrap();
        let small = scatter(&a, S0);
        let big = a.malloc(300 * MIB, S0).unwrap();
        assert_eq!(sim.counters(0).live_reservations, 2, "{conf}");
        let other = a.malloc(300 * MIB, S1).unwrap();
        assert_eq!(sim.counters(0).live_reservations, 3, "{conf}: S1's own");
        assert_eq!(large_segments(&a), (3, 3), "{conf}");
        // S0's first segment empties and goes back; its second stays (300 MiB live).
        a.free(rest).unwrap();
        for p in small {
            a.free(p).unwrap();
        }
        a.empty_cache().unwrap();
        assert_eq!(sim.counters(0).live_reservations, 2, "{conf}");
        assert_eq!(large_segments(&a), (2, 2), "{conf}");
        let serving = |s| a.state_of(s).paged_segments_of(s, PoolKind::Large);
        assert_eq!((serving(S0), serving(S1)), (1, 1), "{conf}");
        for p in [big, other] {
            a.free(p).unwrap();
        }
        a.shutdown().unwrap();
        let c = sim.counters(0);
        assert_eq!((c.bytes_in_use, c.live_reservations), (0, 0), "{conf}");
    }
}

#[test]
fn paging_counts_since_a_reset_read_zero() {
    use super::stats::PagingCounters;
    let earlier = PagingCounters {
        growths: 5,
        growths_past_slack: 2,
        ..PagingCounters::default()
    };
    let after_reset = PagingCounters {
        growths: 1,
        ..PagingCounters::default()
    };
    let d = after_reset.since(&earlier);
    assert_eq!((d.growths, d.growths_past_slack), (0, 0));
    assert_eq!(earlier.since(&after_reset).growths, 4);
}

/// Blocks a thread's front handed out that then live on (weights, optimizer state allocated
/// where temporaries of their sizes were just freed) must not close the front for good: a
/// front whose every slot is out gives way to the next block its thread frees.
#[test]
fn a_front_whose_blocks_all_stay_live_still_serves_a_same_size_loop() {
    for (kind, sizes) in [
        ("small", [8 * 1024, 64 * 1024]),
        ("large", [2 * MIB, 16 * MIB]),
    ] {
        let (_sim, a) = paged(1 << 30, "");
        let slots = match kind {
            "small" => front::FRONT_SLOTS,
            _ => front::FRONT_LARGE_SLOTS,
        } as u64;
        // Each kept block comes from the front: freed, then asked for again at its size.
        let kept: Vec<u64> = (0..slots)
            .map(|i| {
                let size = sizes[0] + i * 4096;
                let p = a.malloc(size, S0).unwrap();
                a.free(p).unwrap();
                let q = a.malloc(size, S0).unwrap();
                assert_eq!(q, p, "{kind}: handed out by the front");
                q
            })
            .collect();
        assert_eq!(a.state_of(S0).front_blocks(), slots as usize, "{kind}");
        let loop_size = sizes[1];
        let p = a.malloc(loop_size, S0).unwrap();
        a.free(p).unwrap();
        let key = front::FrontOf::OnlyShard(a.key);
        assert_eq!(
            front::take(key, loop_size, S0),
            Some(p),
            "{kind}: the front took the freed block, the kept block freed longest ago gave way"
        );
        a.free(p).unwrap();
        // The block that gave way is the shard's: its free goes there, once.
        {
            let st = a.state_of(S0);
            assert_eq!(st.front_of(st.live_block(kept[0]).unwrap()), 0, "{kind}");
            assert_eq!(st.front_blocks(), slots as usize, "{kind}");
        }
        // It may be recorded on another stream and freed by another thread, once.
        a.record_stream(kept[0], S1).unwrap();
        std::thread::scope(|t| t.spawn(|| a.free(kept[0]).unwrap()).join().unwrap());
        assert_eq!(a.free(kept[0]).unwrap_err().kind, ErrorKind::DoubleFree);
        for &q in &kept[1..] {
            a.free(q).unwrap();
        }
        a.empty_cache().unwrap();
        let s = stats(&a);
        assert_eq!(s.allocated_bytes.all().current, 0, "{kind}");
        assert_eq!(s.requested_bytes.all().current, 0, "{kind}");
        assert_eq!(s.active.all().current, 0, "{kind}");
        let allocations = s.allocation.all();
        assert_eq!(allocations.allocated, allocations.freed, "{kind}");
        assert_eq!(allocations.allocated, 2 * slots as i64 + 2, "{kind}");
    }
}

/// Other shards weigh a shard's published live bytes in their growth: a free that a front
/// adopts, making room by freeing a block it held, publishes the fall too.
#[test]
fn a_front_adoption_that_frees_a_held_block_publishes_the_live_bytes() {
    let (_sim, a) = paged(1 << 30, "per_stream_shards:True");
    let slots = front::FRONT_SLOTS as u64;
    let blocks: Vec<u64> = (0..=slots)
        .map(|i| a.malloc(4096 * (i + 1), S0).unwrap())
        .collect();
    // The front takes the first `slots` frees; the last makes room by freeing the oldest.
    for &p in &blocks {
        a.free(p).unwrap();
    }
    let (_, shard) = a.shard(S0).unwrap();
    let active = shard.lock().unwrap().stats().active_bytes.all().current as u64;
    assert_eq!(active, (2..=slots + 1).map(|i| 4096 * i).sum::<u64>());
    assert_eq!(shard.published_live(), active);
}

/// With several shards, a large block waits in a front only if its shard is the one the
/// freeing thread allocates from: a training loop's own blocks do, while a prefetcher's
/// batch that the loop frees goes back to the prefetcher's shard at once, where a front of
/// the loop's thread would hold it until the loop's next visit.
#[test]
fn with_several_shards_only_a_threads_own_shard_keeps_its_large_blocks_in_a_front() {
    let (_sim, a) = paged(1 << 30, "thread_shards_on_contention:False");
    let own = a.malloc(32 * MIB, S0).unwrap();
    let batch = std::thread::scope(|t| t.spawn(|| a.malloc(32 * MIB, S1).unwrap()).join()).unwrap();
    assert_eq!(a.shards_made(), 2);
    a.free(batch).unwrap();
    assert_eq!(
        a.state_of(S1).front_blocks(),
        0,
        "the batch went back to its shard"
    );
    a.free(own).unwrap();
    assert_eq!(
        a.state_of(S0).front_blocks(),
        1,
        "the loop's own block waits in its front"
    );
}

/// Per-stream shards where S1's four 16 MiB blocks set the device's peaks (64 MiB in 4
/// blocks) and S0 then caches 48 MiB. A statistics read balances: of the 64 MiB below the
/// peak, half stays unassigned and each shard may rise 16 MiB (unassigned headroom
/// shared whole, S0 would have 32 MiB).
fn peaks_set_on_s1_while_s0_caches() -> (Arc<SimDriver>, DeviceAllocator) {
    let (sim, a) = paged(1 << 30, "per_stream_shards:True,thread_cache:False");
    let blocks: Vec<u64> = (0..4).map(|_| a.malloc(16 * MIB, S1).unwrap()).collect();
    for p in blocks {
        a.free(p).unwrap();
    }
    a.free(a.malloc(48 * MIB, S0).unwrap()).unwrap();
    assert_eq!(
        a.stats().unwrap().allocated_bytes.all().peak,
        64 * MIB as i64
    );
    (sim, a)
}

/// Allocates `size` on S0 from a thread of its own while this one holds the peak book, and
/// returns the block; fails, naming `waited_for`, if the allocation has not returned within
/// 10 s. `release` runs once the wait is over, before any failure, so that an allocation
/// waiting on what the caller holds can finish and its thread end.
fn malloc_on_s0_beside_held_book(
    a: &DeviceAllocator,
    size: u64,
    release: impl FnOnce(),
    waited_for: &str,
) -> u64 {
    std::thread::scope(|t| {
        let (go, went) = std::sync::mpsc::channel();
        let (sent, done) = std::sync::mpsc::channel();
        t.spawn(move || {
            went.recv().unwrap();
            sent.send(a.malloc(size, S0).unwrap()).unwrap();
        });
        let waited = a.with_peak_book_held(|| {
            go.send(()).unwrap();
            done.recv_timeout(std::time::Duration::from_secs(10))
        });
        release();
        waited.unwrap_or_else(|_| {
            a.free(done.recv().unwrap()).unwrap();
            panic!("the lift waited for {waited_for}")
        })
    })
}

/// With several shards, a lift that the unassigned headroom covers settles under the
/// lifter's own lock alone: a shard whose thread is busy (here, its lock held) delays no
/// other stream's lift, nor does another settlement holding the peak book. Before, the
/// lift locked the book, and then found the busy shard's headroom out of reach and locked
/// every shard to balance, waiting for that one.
#[test]
fn a_lift_the_unassigned_headroom_covers_waits_for_no_other_lock() {
    let (_sim, a) = peaks_set_on_s1_while_s0_caches();
    let (_, busy) = a.shard(S1).unwrap();
    let held = busy.lock().unwrap();
    // 40 MiB from S0's cache lifts its ceiling by 24 MiB, which is unassigned.
    let p = malloc_on_s0_beside_held_book(&a, 40 * MIB, || drop(held), "another lock");
    a.free(p).unwrap();
    // The peaks are still exact: nothing was live beside the 40 MiB.
    let after = a.stats().unwrap();
    assert_eq!(after.allocated_bytes.all().peak, 64 * MIB as i64);
    assert_eq!(after.allocation.all().peak, 4);
}

/// A lift that the unassigned headroom does not cover, but another shard's unused headroom
/// does, settles without the peak book: the other shard gives to the unassigned headroom
/// under its own lock, and the lifter takes it under its own. Before, every such lift
/// queued on the book (8 threads churning on their own streams spent about a third of
/// their time there). A new high still settles through the book, and exactly.
#[test]
fn a_lift_another_shards_headroom_covers_waits_for_no_book() {
    let (_sim, a) = peaks_set_on_s1_while_s0_caches();
    // 56 MiB lifts S0's ceiling by 40 MiB: 32 unassigned, 8 more from S1's 16.
    let p = malloc_on_s0_beside_held_book(&a, 56 * MIB, || {}, "the peak book");
    a.free(p).unwrap();
    let after = a.stats().unwrap();
    assert_eq!(after.allocated_bytes.all().peak, 64 * MIB as i64);
    assert_eq!(after.allocation.all().peak, 4);
    // A new high: 72 MiB live at once, over both shards.
    let (p0, p1) = (
        a.malloc(56 * MIB, S0).unwrap(),
        a.malloc(16 * MIB, S1).unwrap(),
    );
    a.free(p0).unwrap();
    a.free(p1).unwrap();
    let after = a.stats().unwrap();
    assert_eq!(after.allocated_bytes.all().peak, 72 * MIB as i64);
    assert_eq!(after.allocation.all().peak, 4);
}

#[test]
fn lock_counters_count_a_wait_for_another_holder_and_each_handoff() {
    let (_sim, a) = paged(1 << 30, "");
    // The first shard holds memory of S0, so another thread's calls on it come here too.
    let kept = a.malloc(MIB, S0).unwrap();
    let before = a.lock_counters().unwrap();
    assert_eq!(before.contended, 0, "one thread alone never waits");
    // The other thread asks for the lock while this one holds it (long past the spin, so
    // it sleeps). It signals just before asking; a scheduler that delays it past the hold
    // leaves nothing to count, so the hold is tried a few times.
    let mut waited = None;
    for _ in 0..5 {
        let seen = a.lock_counters().unwrap();
        std::thread::scope(|s| {
            let held = a.state_of(S0);
            let (asking, asked) = std::sync::mpsc::channel();
            let a = &a;
            let other = s.spawn(move || {
                asking.send(()).unwrap();
                a.free(a.malloc(MIB, S0).unwrap()).unwrap();
            });
            asked.recv().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(100));
            drop(held);
            other.join().unwrap();
        });
        let after = a.lock_counters().unwrap();
        if after.contended > seen.contended {
            waited = Some((seen, after));
            break;
        }
    }
    let (seen, after) = waited.expect("the other thread waited for the lock in 5 tries");
    assert_eq!(a.shards_made(), 1);
    assert_eq!(
        after.contended,
        seen.contended + 1,
        "only the first of its calls waited"
    );
    assert_eq!(
        after.blocked,
        seen.blocked + 1,
        "100 ms is past the spin: it slept"
    );
    assert!(after.wait_ns >= seen.wait_ns + 50_000_000, "{after:?}");
    // This thread's hold, then the other's malloc and free (reads take no lock): the lock
    // changed hands once, and back at the next hold.
    assert_eq!(after.handoffs, seen.handoffs + 1, "{after:?}");
    assert!(after.acquisitions >= seen.acquisitions + 3, "{after:?}");
    drop(a.state_of(S0));
    assert_eq!(a.lock_counters().unwrap().handoffs, after.handoffs + 1);
    a.reset_accumulated_stats().unwrap();
    assert_eq!(a.lock_counters().unwrap(), LockCounters::default());
    a.free(kept).unwrap();
}

/// `thread_shards_on_contention` (the default) once threads have contended: each thread's
/// own stream (its first, which no other thread had used) gets a shard at its next
/// allocation, even though the first shard holds its earlier blocks; everything else stays
/// in the first shard, as under the immediate rule.
#[test]
fn after_contention_a_threads_own_stream_gets_a_shard_and_nothing_else_does() {
    const SIDE: StreamId = StreamId(0x5e1d);
    const OTHER: StreamId = StreamId(0x07e4);
    let (_sim, a) = paged(1 << 30, "");
    let main_block = a.malloc(MIB, S0).unwrap();
    // The main thread also uses a side stream (a forward's side stream).
    let side_block = a.malloc(MIB, SIDE).unwrap();
    std::thread::scope(|s| {
        let (go_on, wait) = std::sync::mpsc::channel::<()>();
        let (started, has_started) = std::sync::mpsc::channel::<()>();
        // Before contention: a thread on a stream of its own (S1), and one whose first
        // stream is the main thread's side stream (PyTorch's autograd thread), stay in the
        // first shard. Each allocates again after contention.
        let a = &a;
        let own = s.spawn(move || {
            let early = a.malloc(MIB, S1).unwrap();
            started.send(()).unwrap();
            wait.recv().unwrap();
            let later = a.malloc(MIB, S1).unwrap();
            (early, later)
        });
        has_started.recv().unwrap();
        let (go_on_borrowed, wait_borrowed) = std::sync::mpsc::channel::<()>();
        let (borrowed_started, borrowed_has_started) = std::sync::mpsc::channel::<()>();
        let borrowed = s.spawn(move || {
            let early = a.malloc(MIB, SIDE).unwrap();
            borrowed_started.send(()).unwrap();
            wait_borrowed.recv().unwrap();
            (early, a.malloc(3 * MIB, SIDE).unwrap())
        });
        borrowed_has_started.recv().unwrap();
        assert_eq!(a.shards_made(), 1);
        a.mark_first_shard_contended();
        // A new thread on the side stream the first shard holds memory of joins it.
        s.spawn(|| a.free(a.malloc(2 * MIB, SIDE).unwrap()).unwrap())
            .join()
            .unwrap();
        assert_eq!(a.shards_made(), 1, "a new thread on a stream in use");
        // The main thread's new streams, and the side stream, stay in the first shard.
        a.free(a.malloc(MIB, OTHER).unwrap()).unwrap();
        a.free(a.malloc(MIB, SIDE).unwrap()).unwrap();
        assert_eq!(a.shards_made(), 1, "the main thread's other streams");
        // The thread that started on the side stream gets no shard for it.
        go_on_borrowed.send(()).unwrap();
        let (b_early, b_later) = borrowed.join().unwrap();
        assert_eq!(
            a.shards_made(),
            1,
            "a thread whose first stream was another's"
        );
        // The thread that started on S1 gets a shard for it; its earlier block, in the
        // first shard, is freed there.
        go_on.send(()).unwrap();
        let (early, later) = own.join().unwrap();
        assert_eq!(a.shards_made(), 2, "S1 in a shard of its own");
        assert_eq!(stats(a).allocation.all().current, 6);
        for p in [early, later, b_early, b_later] {
            a.free(p).unwrap();
        }
    });
    a.free(main_block).unwrap();
    a.free(side_block).unwrap();
    assert_eq!(stats(&a).allocation.all().current, 0);
    assert_eq!(a.shards_made(), 2);
}

/// The same threads, but under the immediate rule (`thread_shards_on_contention:False`):
/// the thread on S1 gets its shard at its first allocation.
#[test]
fn the_immediate_rule_gives_a_new_threads_own_stream_its_shard_at_once() {
    let (_sim, a) = paged(1 << 30, "thread_shards_on_contention:False");
    let kept = a.malloc(MIB, S0).unwrap();
    let p = std::thread::scope(|s| s.spawn(|| a.malloc(MIB, S1).unwrap()).join().unwrap());
    assert_eq!(a.shards_made(), 2);
    a.free(p).unwrap();
    a.free(kept).unwrap();
}
