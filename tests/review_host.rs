//! Review of pinned host and managed memory on the sim: range checks at block boundaries.
#![cfg(feature = "sim")]

use ccalloc::SimDriver;
use ccalloc::{Advice, HostKind};
use ccalloc::{Config, ErrorKind, Runtime, StreamId};
use std::sync::Arc;

const MANAGED: HostKind = HostKind::Managed;

fn runtime() -> Runtime {
    Runtime::with_sim(Arc::new(SimDriver::new(1, 8 << 30)), Config::default())
}

/// A range starting past the requested end of a live managed block, in what the block's
/// rounding added, is past that block's end: not freed memory.
#[test]
fn a_range_in_a_live_blocks_rounding_is_past_its_end_not_freed() {
    let rt = runtime();
    let s = StreamId(3);
    let m = rt.host_malloc(MANAGED, 700).unwrap();
    // What follows the block is handed out too: the block's rounding is all that is there.
    let next = rt.host_malloc(MANAGED, 700).unwrap();
    rt.prefetch(m + 699, 1, 0, s).unwrap();
    for at in [m + 700, m + 800, m + 1023] {
        let e = rt.prefetch(at, 1, 0, s).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{at:#x}: {}", e.message);
        assert!(e.message.contains("past the end"), "{}", e.message);
        let e = rt.advise(at, 1, Advice::SetReadMostly, 0).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{at:#x}: {}", e.message);
    }
    rt.host_free(MANAGED, m).unwrap();
    // Once freed, the same addresses are freed memory.
    let e = rt.prefetch(m, 1, 0, s).unwrap_err();
    assert_eq!(e.kind, ErrorKind::DoubleFree, "{}", e.message);
    rt.host_free(MANAGED, next).unwrap();
}
