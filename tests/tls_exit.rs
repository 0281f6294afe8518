//! A failing C call made from a thread-local destructor at thread exit (a C++ `thread_local`
//! holding a tensor, say) after ccalloc's own last-error thread-local was destroyed: the
//! status must come back, and the process must not abort. Each scenario runs in a child
//! process, since an abort would take the test runner with it.
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

#[test]
fn child() {
    if let Ok(order) = std::env::var("CCALLOC_TLS_EXIT_CHILD") {
        scenario(&order);
    }
}

#[test]
fn a_failing_call_from_a_thread_local_destructor_returns_its_status() {
    for order in ["ours_first", "theirs_first"] {
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
