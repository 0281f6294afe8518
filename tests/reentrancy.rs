//! A pool stream filter (`ccalloc_begin_allocate_to_pool`) that calls back into ccalloc, as
//! a Python filter logging `memory_allocated()` does: it must not deadlock. Reading
//! statistics works; an allocation from inside the filter is refused with a clear error
//! (it would be routed by the very filter that is running). Each scenario runs on its own
//! thread, joined with a bound.
#![cfg(feature = "sim")]

use ccalloc::capi::ccalloc_status::*;
use ccalloc::capi::*;
use ccalloc::capi::{
    ccalloc_pool_id, ccalloc_stats, ccalloc_status, ccalloc_trace_entry, cudaStream_t,
};
use std::ffi::{c_void, CStr};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Duration;

const MIB: usize = 1 << 20;

/// What the filter saw when it called back in.
#[derive(Debug, Default, Clone)]
struct Seen {
    calls: u32,
    stats: Vec<ccalloc_status>,
    allocated_bytes: Vec<i64>,
    mallocs: Vec<(ccalloc_status, String)>,
}

static SEEN: Mutex<Option<Seen>> = Mutex::new(None);

unsafe extern "C" fn logging_filter(_ctx: *mut c_void, _stream: cudaStream_t) -> bool {
    let mut stats = std::mem::MaybeUninit::<ccalloc_stats>::zeroed();
    let status = ccalloc_get_stats(0, stats.as_mut_ptr());
    let mut p = std::ptr::null_mut();
    let malloc = ccalloc_malloc(MIB, 0, std::ptr::null_mut(), &mut p);
    let message = unsafe { CStr::from_ptr(ccalloc_last_error()) }
        .to_string_lossy()
        .into_owned();
    if malloc == CCALLOC_OK {
        ccalloc_free(p, 0);
    }
    let mut seen = SEEN.lock().unwrap();
    let seen = seen.get_or_insert_with(Seen::default);
    seen.calls += 1;
    seen.stats.push(status);
    // SAFETY: written by a successful get_stats (zeroed otherwise).
    seen.allocated_bytes
        .push(unsafe { stats.assume_init() }.allocated_bytes.all.current);
    seen.mallocs.push((malloc, message));
    true
}

/// Runs `f` on a thread; fails if it has not finished within a generous bound (a deadlock).
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{what}: no answer: the call deadlocked"))
}

#[test]
fn a_filter_calling_back_into_ccalloc_neither_deadlocks_nor_allocates() {
    std::env::set_var("CCALLOC_BACKEND", "sim");
    std::env::set_var("CCALLOC_SIM_CAPACITY", "4GiB");
    assert_eq!(ccalloc_init(), CCALLOC_OK);
    let pool = ccalloc_pool_id {
        first: 7,
        second: 1,
    };
    // A block live before the window: the filter's statistics see it.
    let mut before = std::ptr::null_mut();
    assert_eq!(
        ccalloc_malloc(3 * MIB, 0, std::ptr::null_mut(), &mut before),
        CCALLOC_OK
    );
    let before = before as usize;
    assert_eq!(
        ccalloc_begin_allocate_to_pool(0, pool, Some(logging_filter), std::ptr::null_mut(), None),
        CCALLOC_OK
    );
    let (status, ptr) = bounded("malloc with a re-entrant filter", || {
        let mut p = std::ptr::null_mut();
        let s = ccalloc_malloc(2 * MIB, 0, std::ptr::null_mut(), &mut p);
        (s, p as usize)
    });
    assert_eq!(status, CCALLOC_OK);
    let seen = SEEN.lock().unwrap().clone().expect("the filter ran");
    assert!(seen.calls >= 1);
    assert!(seen.stats.iter().all(|&s| s == CCALLOC_OK), "{seen:?}");
    assert!(
        seen.allocated_bytes.iter().all(|&b| b >= 3 * MIB as i64),
        "{seen:?}"
    );
    for (status, message) in &seen.mallocs {
        assert_eq!(*status, CCALLOC_INVALID_ARGUMENT, "{message}");
        assert!(message.contains("filter"), "{message}");
    }
    assert_eq!(ccalloc_free(ptr as *mut c_void, 0), CCALLOC_OK);
    assert_eq!(ccalloc_end_allocate_to_pool(0, pool), CCALLOC_OK);
    assert_eq!(ccalloc_release_pool(0, pool), CCALLOC_OK);
    assert_eq!(ccalloc_free(before as *mut c_void, 0), CCALLOC_OK);
    // After the window, allocation from this thread works as usual.
    let (status, ptr) = bounded("malloc after the window", || {
        let mut p = std::ptr::null_mut();
        (
            ccalloc_malloc(MIB, 0, std::ptr::null_mut(), &mut p),
            p as usize,
        )
    });
    assert_eq!(status, CCALLOC_OK);
    assert_eq!(ccalloc_free(ptr as *mut c_void, 0), CCALLOC_OK);
}

/// What the segment observer saw when it called back in.
static OBSERVED: Mutex<Vec<(ccalloc_status, ccalloc_status, String)>> = Mutex::new(Vec::new());

unsafe extern "C" fn calling_observer(_ctx: *mut c_void, _entry: *const ccalloc_trace_entry) {
    let mut stats = std::mem::MaybeUninit::<ccalloc_stats>::zeroed();
    let stats_status = ccalloc_get_stats(0, stats.as_mut_ptr());
    let mut p = std::ptr::null_mut();
    let malloc = ccalloc_malloc(MIB, 0, std::ptr::null_mut(), &mut p);
    let message = unsafe { CStr::from_ptr(ccalloc_last_error()) }
        .to_string_lossy()
        .into_owned();
    OBSERVED
        .lock()
        .unwrap()
        .push((stats_status, malloc, message));
}

/// A segment observer runs with ccalloc's locks held (its contract: it must not call
/// ccalloc). One that does anyway, as a Python callback reading `memory_allocated()` might,
/// hung on its first event; its calls are now refused with a message, and the call that
/// made the event completes.
#[test]
fn a_segment_observer_calling_back_into_ccalloc_is_refused_not_deadlocked() {
    std::env::set_var("CCALLOC_BACKEND", "sim");
    std::env::set_var("CCALLOC_SIM_CAPACITY", "4GiB");
    assert_eq!(ccalloc_init(), CCALLOC_OK);
    assert_eq!(
        ccalloc_add_segment_observer(Some(calling_observer), std::ptr::null_mut()),
        CCALLOC_OK
    );
    let (status, ptr) = bounded("malloc with a re-entrant segment observer", || {
        let mut p = std::ptr::null_mut();
        // Larger than anything cached: new pages, so segment events.
        let s = ccalloc_malloc(64 * MIB, 0, std::ptr::null_mut(), &mut p);
        (s, p as usize)
    });
    assert_eq!(status, CCALLOC_OK);
    let seen = OBSERVED.lock().unwrap().clone();
    assert!(!seen.is_empty(), "the observer ran");
    for (stats, malloc, message) in &seen {
        assert_eq!(
            (*stats, *malloc),
            (CCALLOC_INVALID_ARGUMENT, CCALLOC_INVALID_ARGUMENT)
        );
        assert!(message.contains("segment observer"), "{message}");
    }
    assert_eq!(ccalloc_free(ptr as *mut c_void, 0), CCALLOC_OK);
    // Outside the observer, this thread's calls work as usual.
    let mut stats = std::mem::MaybeUninit::<ccalloc_stats>::zeroed();
    assert_eq!(ccalloc_get_stats(0, stats.as_mut_ptr()), CCALLOC_OK);
}
