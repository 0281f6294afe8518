//! fork() while ccalloc runs: a forked child's calls fail at once with
//! `CCALLOC_DRIVER_UNAVAILABLE` (as CUDA refuses a forked child), never waiting on a lock
//! that a parent thread held at the fork; and the child never shares the sim's device
//! memory with its parent. Children are bounded by `alarm` and waited on with a bound.
#![cfg(feature = "sim")]

use ccalloc::capi::ccalloc_status::*;
use ccalloc::capi::*;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

fn init_sim() {
    std::env::set_var("CCALLOC_BACKEND", "sim");
    std::env::set_var("CCALLOC_SIM_CAPACITY", "4GiB");
    // Driver calls take as long as on an H100: a thread spends most of its time inside them,
    // with its shard locked.
    std::env::set_var("CCALLOC_SIM_COSTS", "h100");
    assert_eq!(ccalloc_init(), CCALLOC_OK);
}

/// Exit codes of a child.
const CHILD_REFUSED: i32 = 0;
const CHILD_ALLOCATED: i32 = 1;
const CHILD_OTHER_STATUS: i32 = 2;
const CHILD_WRONG_MESSAGE: i32 = 3;
const CHILD_SAW_PARENT_WRITE: i32 = 4;

/// In the child: one allocation, which must be refused with the fork message.
fn child_malloc_code() -> i32 {
    let mut p = std::ptr::null_mut();
    match ccalloc_malloc(MIB, 0, std::ptr::null_mut(), &mut p) {
        CCALLOC_DRIVER_UNAVAILABLE => {
            // SAFETY: this thread's NUL-terminated last error.
            let message = unsafe { CStr::from_ptr(ccalloc_last_error()) }.to_string_lossy();
            if message.contains("after fork()") {
                CHILD_REFUSED
            } else {
                CHILD_WRONG_MESSAGE
            }
        }
        CCALLOC_OK => CHILD_ALLOCATED,
        _ => CHILD_OTHER_STATUS,
    }
}

/// The child's exit code, or minus its signal (-14: SIGALRM, it hung); a child still
/// running after the bound is killed and reported as -1000.
fn wait_child(pid: libc::pid_t) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut status = 0;
        // SAFETY: waits for our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                -libc::WTERMSIG(status)
            };
        }
        assert_eq!(r, 0, "waitpid failed");
        if Instant::now() > deadline {
            // SAFETY: our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return -1000;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Forks; the child runs `child` under a 5 s alarm and exits with its code.
fn fork_child(child: impl FnOnce() -> i32) -> libc::pid_t {
    // SAFETY: the child only runs `child` and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: plain calls in the child.
        unsafe {
            libc::alarm(3);
            libc::_exit(child());
        }
    }
    pid
}

#[test]
fn a_child_forked_while_another_thread_is_inside_ccalloc_is_refused_at_once() {
    init_sim();
    let stop = AtomicBool::new(false);
    let codes: Vec<i32> = std::thread::scope(|s| {
        // Busy inside ccalloc: growths and releases, the driver called with locks held.
        s.spawn(|| {
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let mut p = std::ptr::null_mut();
                let size = (1 + i % 40) * MIB;
                assert_eq!(
                    ccalloc_malloc(size, 0, std::ptr::null_mut(), &mut p),
                    CCALLOC_OK
                );
                assert_eq!(ccalloc_free(p, 0), CCALLOC_OK);
                if i.is_multiple_of(2) {
                    assert_eq!(ccalloc_empty_cache(0), CCALLOC_OK);
                }
                i += 1;
            }
        });
        let codes = (0..30)
            .map(|_| {
                std::thread::sleep(Duration::from_millis(3));
                wait_child(fork_child(child_malloc_code))
            })
            .collect();
        stop.store(true, Ordering::Relaxed);
        codes
    });
    let refused = codes.iter().filter(|&&c| c == CHILD_REFUSED).count();
    assert_eq!(
        refused,
        codes.len(),
        "child outcomes (0 refused, 1 allocated, 2 other status, 3 wrong message, \
         -14 hung until the alarm): {codes:?}"
    );
    // The parent goes on as before.
    let mut p = std::ptr::null_mut();
    assert_eq!(
        ccalloc_malloc(MIB, 0, std::ptr::null_mut(), &mut p),
        CCALLOC_OK
    );
    assert_eq!(ccalloc_free(p, 0), CCALLOC_OK);
}

/// A child forked from a thread with a thread front, while other threads read statistics
/// (which lock the fronts to count their blocks), exits normally: its thread-local fronts
/// are dropped by `exit`, and a front lock held by a parent thread at the fork stays held
/// in the child. Dropping them must not wait for it (it did: 8 of 100 Python children hung
/// at exit).
#[test]
fn a_child_forked_from_a_thread_with_a_front_exits_without_waiting() {
    init_sim();
    let stop = AtomicBool::new(false);
    let codes: Vec<i32> = std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let mut out = std::mem::MaybeUninit::<ccalloc_stats>::uninit();
                    assert_eq!(ccalloc_get_stats(0, out.as_mut_ptr()), CCALLOC_OK);
                }
            });
        }
        // This thread's front: a small block freed on a paged segment goes to it.
        let mut p = std::ptr::null_mut();
        assert_eq!(
            ccalloc_malloc(4096, 0, std::ptr::null_mut(), &mut p),
            CCALLOC_OK
        );
        assert_eq!(ccalloc_free(p, 0), CCALLOC_OK);
        let codes = (0..60)
            .map(|_| {
                // SAFETY: the child leaves at once through `exit`, which runs this thread's
                // thread-local destructors (as Python's sys.exit does), under a 3 s alarm.
                let pid = unsafe { libc::fork() };
                assert!(pid >= 0, "fork failed");
                if pid == 0 {
                    unsafe {
                        libc::alarm(3);
                        libc::exit(0);
                    }
                }
                wait_child(pid)
            })
            .collect();
        stop.store(true, Ordering::Relaxed);
        codes
    });
    assert!(
        codes.iter().all(|&c| c == 0),
        "child exits (0 clean, -14 hung until the alarm): {codes:?}"
    );
}

/// Whether `[ptr, ptr + len)` is mapped in this process (mincore fails with ENOMEM if not).
fn mapped(ptr: usize, len: usize) -> bool {
    let mut pages = vec![0u8; len.div_ceil(4096)];
    // SAFETY: mincore only reads the page tables; `pages` has a byte per page.
    unsafe { libc::mincore(ptr as *mut libc::c_void, len, pages.as_mut_ptr()) == 0 }
}

#[test]
fn a_forked_child_never_sees_the_parents_device_memory() {
    init_sim();
    for conf in ["expandable_segments:True", "expandable_segments:False"] {
        let conf_c = std::ffi::CString::new(conf).unwrap();
        // SAFETY: a NUL-terminated string.
        assert_eq!(unsafe { ccalloc_set_config(conf_c.as_ptr()) }, CCALLOC_OK);
        let mut p = std::ptr::null_mut();
        let size = 8 * MIB;
        assert_eq!(
            ccalloc_malloc(size, 0, std::ptr::null_mut(), &mut p),
            CCALLOC_OK
        );
        let block = p as usize;
        // SAFETY: a live block of `size` bytes of host-backed sim memory.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0xAA, size) };
        let mut fds = [0; 2];
        // SAFETY: a fresh pipe.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let pid = fork_child(|| {
            let mut byte = 0u8;
            // SAFETY: waits until the parent wrote after the fork.
            unsafe { libc::read(fds[0], (&mut byte as *mut u8).cast(), 1) };
            if !mapped(block, size) {
                return CHILD_REFUSED;
            }
            // SAFETY: mapped, per mincore.
            let seen = unsafe { std::ptr::read_volatile((block + 4096) as *const u8) };
            if seen == 0xBB {
                CHILD_SAW_PARENT_WRITE
            } else {
                CHILD_REFUSED
            }
        });
        // SAFETY: still our live block; then wakes the child.
        unsafe {
            std::ptr::write_bytes(p as *mut u8, 0xBB, size);
            libc::write(fds[1], [1u8].as_ptr().cast(), 1);
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        let code = wait_child(pid);
        assert_eq!(
            code, CHILD_REFUSED,
            "{conf}: the child saw the parent's write into its block (exit {code})"
        );
        assert_eq!(ccalloc_free(p, 0), CCALLOC_OK);
    }
}
