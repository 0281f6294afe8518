//! A thread whose last call used a runtime that was since shut down (and replaced by a new
//! one) must not be handed the old one again: its hazard slot still names the old runtime,
//! which keeps it allocated, but only the running one may be used.
#![cfg(feature = "sim")]

use ccalloc::capi::ccalloc_status::*;
use ccalloc::capi::*;
use std::sync::mpsc;

const GIB: u64 = 1 << 30;

/// What the caller thread is asked to do, and answers.
enum Ask {
    AllocFree,
    Malloc,
    TotalMemory,
}

#[test]
fn a_thread_uses_the_runtime_started_after_the_one_it_used_last() {
    std::env::set_var("CCALLOC_BACKEND", "sim");
    std::env::set_var("CCALLOC_SIM_CAPACITY", "1GiB");
    assert_eq!(ccalloc_init(), CCALLOC_OK);
    let (ask, asked) = mpsc::channel::<Ask>();
    let (answer, answers) = mpsc::channel::<String>();
    let caller = std::thread::spawn(move || {
        for what in asked {
            let said = match what {
                Ask::AllocFree => {
                    let p = ccalloc_torch_alloc(4096, 0, std::ptr::null_mut());
                    ccalloc_torch_free(p, 4096, 0, std::ptr::null_mut());
                    format!("{}", !p.is_null())
                }
                Ask::Malloc => {
                    let mut p = std::ptr::null_mut();
                    let status = ccalloc_malloc(4096, 0, std::ptr::null_mut(), &mut p);
                    if status == CCALLOC_OK {
                        assert_eq!(ccalloc_free(p, 0), CCALLOC_OK);
                    }
                    format!("{status:?}")
                }
                Ask::TotalMemory => {
                    let mut bytes = 0;
                    let status = ccalloc_device_total_memory(0, &mut bytes);
                    format!("{status:?} {bytes}")
                }
            };
            answer.send(said).unwrap();
        }
    });
    let call = |what| {
        ask.send(what).unwrap();
        answers.recv().unwrap()
    };
    // The caller's slot now names the first runtime.
    assert_eq!(call(Ask::AllocFree), "true");
    assert_eq!(call(Ask::TotalMemory), format!("CCALLOC_OK {GIB}"));

    assert_eq!(ccalloc_shutdown(), CCALLOC_OK);
    assert_eq!(call(Ask::Malloc), "CCALLOC_SHUT_DOWN");
    assert_eq!(call(Ask::TotalMemory), "CCALLOC_SHUT_DOWN 0");

    std::env::set_var("CCALLOC_SIM_CAPACITY", "2GiB");
    assert_eq!(ccalloc_init(), CCALLOC_OK);
    assert_eq!(call(Ask::TotalMemory), format!("CCALLOC_OK {}", 2 * GIB));
    assert_eq!(call(Ask::Malloc), "CCALLOC_OK");
    assert_eq!(call(Ask::AllocFree), "true");

    // Again without a call in between: the slot still names the first runtime's successor.
    assert_eq!(ccalloc_shutdown(), CCALLOC_OK);
    std::env::set_var("CCALLOC_SIM_CAPACITY", "3GiB");
    assert_eq!(ccalloc_init(), CCALLOC_OK);
    assert_eq!(call(Ask::TotalMemory), format!("CCALLOC_OK {}", 3 * GIB));
    assert_eq!(call(Ask::AllocFree), "true");

    drop(ask);
    caller.join().unwrap();
    assert_eq!(ccalloc_shutdown(), CCALLOC_OK);
}
