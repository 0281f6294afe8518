//! Many streams with paged segments: each stream's segments span the whole device, so any
//! work or memory per page of a segment grows with the number of streams times the device's
//! size. Work is counted (reclaim steps, driver calls) and host memory measured with a
//! counting allocator; nothing is timed.
#![cfg(feature = "sim")]

use ccalloc::SimDriver;
use ccalloc::{Config, DeviceAllocator, StreamId};
use std::sync::Arc;

mod common;

use common::heap::heap;

#[global_allocator]
static GLOBAL: common::heap::Counting = common::heap::Counting;

const MIB: u64 = 1 << 20;
const STREAMS: u64 = 2000;

#[test]
fn work_and_memory_per_stream_do_not_grow_with_the_stream_count() {
    // 16 GiB: 8,192 pages per segment, a paged segment for each of 2,000 streams.
    let sim = Arc::new(SimDriver::new(1, 16 << 30));
    let config = Config {
        expandable_segments: true,
        ..Config::default()
    };
    let a = DeviceAllocator::new(0, sim.clone(), config).unwrap();
    let stream = |s: u64| StreamId(s + 1);
    let heap_before = heap();
    let ptrs: Vec<_> = (0..STREAMS)
        .map(|s| a.malloc(1, stream(s)).unwrap())
        .collect();
    let per_stream = (heap() - heap_before) / STREAMS as i64;
    // The page tables are proportional to what is mapped (a bitmap of one bit a page
    // aside: 1 KiB here); a table entry per page would be hundreds of KiB per stream.
    assert!(per_stream < 16 << 10, "{per_stream} heap bytes per stream");
    let st = a.stats().unwrap();
    assert_eq!(
        st.paging.reclaim_steps, 0,
        "nothing was ever free to reclaim"
    );
    // One page each: reserved is linear in the streams, one chunk mapped per stream.
    assert_eq!(st.reserved_bytes.all().current as u64, STREAMS * 2 * MIB);
    assert_eq!(sim.counters(0).maps, STREAMS);

    // Each stream in turn maps a large block and frees it: reserved (a page per stream
    // under 1 live byte) is far over live + slack, so each growth moves the chunk the
    // previous stream left under its free block. A search visits the free lists changed
    // since the last one (that stream's), not every stream's free space.
    for s in 0..STREAMS {
        let p = a.malloc(3 * MIB, stream(s)).unwrap();
        a.free(p).unwrap();
    }
    let st = a.stats().unwrap();
    let c = sim.counters(0);
    assert!(
        st.paging.reclaim_steps <= 8 * STREAMS,
        "{} reclaim steps for {STREAMS} growths",
        st.paging.reclaim_steps
    );
    assert!(c.unmaps >= STREAMS - 1, "chunks moved: {c:?}");
    // A page mapped per stream at first, then per growth two one-page chunks mapped (3 MiB
    // spans two pages) and the ones under the last free block unmapped: a constant per
    // stream.
    assert!(c.maps + c.unmaps <= 5 * STREAMS, "{c:?}");
    // Reserved stays linear: a page per stream and the one moving block's.
    assert!(st.reserved_bytes.all().current as u64 <= (STREAMS + 8) * 2 * MIB);
    for p in ptrs {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.stats().unwrap().reserved_bytes.all().current, 0);
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}
