//! A build without the `sim` feature: `CCALLOC_BACKEND=sim` is refused with a config error
//! whose message says how to get a build with the simulated device.
#![cfg(not(feature = "sim"))]

use ccalloc::capi::ccalloc_status;
use ccalloc::{ErrorKind, Runtime};
use std::ffi::CStr;

#[test]
fn sim_backend_is_refused_with_how_to_get_it() {
    std::env::set_var("CCALLOC_BACKEND", "sim");
    let error = Runtime::from_env()
        .err()
        .expect("no simulated device in this build");
    assert_eq!(error.kind, ErrorKind::Config);
    assert!(
        error.message.contains("built without the simulated device")
            && error.message.contains("--features sim"),
        "{}",
        error.message
    );

    assert_eq!(
        ccalloc::capi::ccalloc_init(),
        ccalloc_status::CCALLOC_CONFIG_ERROR
    );
    let message = unsafe { CStr::from_ptr(ccalloc::capi::ccalloc_last_error()) };
    assert!(
        message.to_str().unwrap().contains("--features sim"),
        "{message:?}"
    );
    assert!(!ccalloc::capi::ccalloc_is_initialized());
}
