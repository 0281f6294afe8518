//! Calls racing a shutdown/init cycle: once init has succeeded, every call either works or
//! fails with `CCALLOC_SHUT_DOWN` (or is refused with `CCALLOC_BUSY`, for shutdown itself),
//! never `CCALLOC_NOT_INITIALIZED`.
#![cfg(feature = "sim")]

use ccalloc::capi::ccalloc_stats;
use ccalloc::capi::ccalloc_status::{self, *};
use ccalloc::capi::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

#[test]
fn calls_racing_shutdown_and_init_never_see_not_initialized() {
    std::env::set_var("CCALLOC_BACKEND", "sim");
    std::env::set_var("CCALLOC_SIM_CAPACITY", "4GiB");
    assert_eq!(ccalloc_init(), CCALLOC_OK);
    let done = AtomicBool::new(false);
    let calls = AtomicU64::new(0);
    let tally = |seen: &mut BTreeMap<String, u64>, what: &str, s: ccalloc_status| {
        *seen.entry(format!("{what}: {s:?}")).or_default() += 1;
        s
    };
    let (cycler, callers) = std::thread::scope(|s| {
        let callers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let mut seen = BTreeMap::new();
                    while !done.load(Ordering::Relaxed) {
                        let mut p = std::ptr::null_mut();
                        let st = ccalloc_malloc(4096, 0, std::ptr::null_mut(), &mut p);
                        if tally(&mut seen, "malloc", st) == CCALLOC_OK {
                            tally(&mut seen, "free", ccalloc_free(p, 0));
                        }
                        let mut stats = std::mem::MaybeUninit::<ccalloc_stats>::uninit();
                        tally(
                            &mut seen,
                            "get_stats",
                            ccalloc_get_stats(0, stats.as_mut_ptr()),
                        );
                        tally(&mut seen, "empty_cache", ccalloc_empty_cache(-1));
                        calls.fetch_add(1, Ordering::Relaxed);
                    }
                    seen
                })
            })
            .collect();
        let mut seen = BTreeMap::new();
        while calls.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        // Bounded by counts: 300 whole cycles, or 20,000 tries.
        let mut cycles = 0;
        for _ in 0..20_000 {
            if tally(&mut seen, "shutdown", ccalloc_shutdown()) == CCALLOC_OK {
                cycles += 1;
                std::thread::yield_now();
                tally(&mut seen, "init", ccalloc_init());
                if cycles == 300 {
                    break;
                }
            }
        }
        done.store(true, Ordering::Relaxed);
        (
            seen,
            callers
                .into_iter()
                .map(|c| c.join().unwrap())
                .collect::<Vec<_>>(),
        )
    });
    let mut all = cycler;
    for seen in callers {
        for (k, v) in seen {
            *all.entry(k).or_default() += v;
        }
    }
    let unexpected: Vec<_> = all
        .iter()
        .filter(|(k, _)| {
            !(k.ends_with("CCALLOC_OK")
                || k.ends_with("CCALLOC_SHUT_DOWN")
                || k.as_str() == "shutdown: CCALLOC_BUSY")
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "unexpected statuses: {unexpected:?} (all: {all:?})"
    );
    assert!(all.contains_key("init: CCALLOC_OK"));
}
