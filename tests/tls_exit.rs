//! A failing C call made from a thread-local destructor at thread exit (a C++ `thread_local`
//! holding a tensor, say) after ccalloc's own last-error thread-local was destroyed: the
//! status must come back, and the process must not abort; a call that can succeed there (a
//! running ccalloc, after this thread's hazard slot was given back) does. Each scenario runs
//! in a child process, since an abort would take the test runner with it.
use std::process::Command;

struct FreesAtExit;

impl Drop for FreesAtExit {
    fn drop(&mut self) {
        let status = ccalloc::capi::ccalloc_free(0x1234 as *mut _, 0);
        // Not initialized in this process: the call fails cleanly whatever the TLS state.
        assert_ne!(status, ccalloc::capi::ccalloc_status::CCALLOC_OK);
        // The message pointer stays readable even once the thread's storage is gone.
        let message = unsafe { std::ffi::CStr::from_ptr(ccalloc::capi::ccalloc_last_error()) };
        assert!(!message.to_bytes().is_empty());
    }
}

thread_local! {
    static AT_EXIT: FreesAtExit = const { FreesAtExit };
}

/// `ours_first`: ccalloc's thread-local is made after ours, so it is destroyed before ours
/// runs its destructor (the C call must then not touch the destroyed storage);
/// `theirs_first`: the other order.
fn scenario(order: &str) {
    let order = order.to_string();
    std::thread::spawn(move || {
        if order == "ours_first" {
            AT_EXIT.with(|_| {});
            let _ = ccalloc::capi::ccalloc_free(0x1234 as *mut _, 0);
        } else {
            let _ = ccalloc::capi::ccalloc_free(0x1234 as *mut _, 0);
            AT_EXIT.with(|_| {});
        }
    })
    .join()
    .unwrap();
}

struct AllocatesAtExit;

impl Drop for AllocatesAtExit {
    fn drop(&mut self) {
        // Running, and this thread's hazard slot is given back by now: the call still works.
        let p = ccalloc::capi::ccalloc_torch_alloc(4096, 0, std::ptr::null_mut());
        assert!(!p.is_null());
        let status = ccalloc::capi::ccalloc_free(p, 0);
        assert_eq!(status, ccalloc::capi::ccalloc_status::CCALLOC_OK);
    }
}

thread_local! {
    static ALLOCATES_AT_EXIT: AllocatesAtExit = const { AllocatesAtExit };
}

/// A thread that used the running ccalloc, then calls it again from a destructor that runs
/// after ccalloc's thread-locals are destroyed.
fn running_scenario() {
    std::env::set_var("CCALLOC_BACKEND", "sim");
    assert_eq!(
        ccalloc::capi::ccalloc_init(),
        ccalloc::capi::ccalloc_status::CCALLOC_OK
    );
    std::thread::spawn(|| {
        ALLOCATES_AT_EXIT.with(|_| {});
        let p = ccalloc::capi::ccalloc_torch_alloc(4096, 0, std::ptr::null_mut());
        assert!(!p.is_null());
        ccalloc::capi::ccalloc_torch_free(p, 4096, 0, std::ptr::null_mut());
    })
    .join()
    .unwrap();
    assert_eq!(
        ccalloc::capi::ccalloc_shutdown(),
        ccalloc::capi::ccalloc_status::CCALLOC_OK
    );
}

#[test]
fn child() {
    match std::env::var("CCALLOC_TLS_EXIT_CHILD").as_deref() {
        Ok("running") => running_scenario(),
        Ok(order) => scenario(order),
        Err(_) => {}
    }
}

#[test]
fn a_failing_call_from_a_thread_local_destructor_returns_its_status() {
    for order in ["ours_first", "theirs_first", "running"] {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child", "--nocapture", "--test-threads=1"])
            .env("CCALLOC_TLS_EXIT_CHILD", order)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{order}: the process died ({:?}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
