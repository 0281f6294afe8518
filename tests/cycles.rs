//! init/shutdown cycles of the global runtime give back what each cycle took: file
//! descriptors (the sim's memory file) and memory stay flat over 2,000 cycles.
#![cfg(feature = "sim")]

use ccalloc::capi::ccalloc_status::*;
use ccalloc::capi::*;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Resident set size in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn cycle() {
    assert_eq!(ccalloc_init(), CCALLOC_OK);
    for size in [1usize << 20, 512, 30 << 20] {
        let mut p = std::ptr::null_mut();
        assert_eq!(
            ccalloc_malloc(size, 0, std::ptr::null_mut(), &mut p),
            CCALLOC_OK
        );
        assert_eq!(ccalloc_free(p, 0), CCALLOC_OK);
    }
    let status = ccalloc_shutdown();
    assert_eq!(status, CCALLOC_OK, "{:?}", unsafe {
        std::ffi::CStr::from_ptr(ccalloc_last_error())
    });
}

#[test]
fn init_shutdown_cycles_leak_neither_descriptors_nor_memory() {
    std::env::set_var("CCALLOC_BACKEND", "sim");
    std::env::set_var("CCALLOC_SIM_CAPACITY", "4GiB");
    for _ in 0..20 {
        cycle();
    }
    let (fds, rss_before) = (open_fds(), rss());
    const CYCLES: u64 = 2000;
    for _ in 0..CYCLES {
        cycle();
    }
    let grown_fds = open_fds().saturating_sub(fds);
    let grown_rss = rss().saturating_sub(rss_before);
    assert!(
        grown_fds <= 4,
        "{grown_fds} descriptors more after {CYCLES} cycles"
    );
    // Under 2 KiB a cycle (one leaked runtime cost about 75 KiB).
    assert!(
        grown_rss < CYCLES * 2048,
        "{grown_rss} bytes more resident after {CYCLES} cycles"
    );
}
