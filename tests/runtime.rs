//! The process-wide runtime over several simulated devices: lazy device start, wrong-device
//! frees, and shutdown that is all or nothing.
#![cfg(feature = "sim")]

mod common;

use ccalloc::SimDriver;
use ccalloc::{Config, ErrorKind, Runtime, StreamId};
use common::{Gate, GatedDriver};
use std::sync::Arc;

fn runtime(devices: usize) -> (Arc<SimDriver>, Runtime) {
    let sim = Arc::new(SimDriver::new(devices, 1 << 30));
    (sim.clone(), Runtime::with_sim(sim, Config::default()))
}

#[test]
fn devices_start_on_first_use_and_frees_name_the_owner() {
    let (_sim, rt) = runtime(2);
    assert_eq!(rt.started_devices().count(), 0);
    let p = rt.malloc(4096, 1, StreamId(0)).unwrap();
    assert_eq!(rt.started_devices().count(), 1);
    rt.device(0).unwrap();
    assert_eq!(rt.free(p, 0).unwrap_err().kind, ErrorKind::WrongDevice);
    assert_eq!(rt.device_holding(p), Some(1));
    assert_eq!(
        rt.malloc(1, 2, StreamId(0)).unwrap_err().kind,
        ErrorKind::InvalidDevice
    );
    assert_eq!(
        rt.malloc(1, -1, StreamId(0)).unwrap_err().kind,
        ErrorKind::InvalidDevice
    );
    rt.free(p, 1).unwrap();
}

#[test]
fn shutdown_is_refused_while_live_and_final_after() {
    let (sim, rt) = runtime(2);
    let p = rt.malloc(4096, 1, StreamId(0)).unwrap();
    let q = rt.malloc(4096, 0, StreamId(0)).unwrap();
    rt.free(q, 0).unwrap();
    assert_eq!(rt.shutdown().unwrap_err().kind, ErrorKind::Busy);
    // Refused as a whole: device 0 kept its cache and still works.
    assert!(sim.counters(0).bytes_in_use > 0);
    let q = rt.malloc(4096, 0, StreamId(0)).unwrap();
    rt.free(q, 0).unwrap();
    rt.free(p, 1).unwrap();
    rt.shutdown().unwrap();
    assert_eq!(
        sim.counters(0).bytes_in_use + sim.counters(1).bytes_in_use,
        0
    );
    assert_eq!(
        rt.malloc(1, 0, StreamId(0)).unwrap_err().kind,
        ErrorKind::ShutDown
    );
    // A device never started before the shutdown is not started after it either.
    let (_sim, rt) = runtime(2);
    rt.device(0).unwrap();
    rt.shutdown().unwrap();
    assert_eq!(
        rt.device(1).err().map(|e| e.kind),
        Some(ErrorKind::ShutDown)
    );
}

#[test]
fn config_applies_to_started_and_later_devices() {
    let (_sim, rt) = runtime(2);
    rt.device(0).unwrap().set_memory_fraction(0.5).unwrap();
    rt.set_config("max_split_size_mb:64").unwrap();
    assert_eq!(
        rt.device(0).unwrap().memory_fraction().unwrap(),
        0.5,
        "named keys only"
    );
    assert_eq!(rt.device(1).unwrap().max_split_size().unwrap(), 64 << 20);
    assert_eq!(
        rt.set_config("no_such_key:1").unwrap_err().kind,
        ErrorKind::Config
    );
    rt.reset_config().unwrap();
    assert_eq!(rt.device(1).unwrap().max_split_size().unwrap(), u64::MAX);
}

#[test]
fn per_stream_shards_is_refused_everywhere_once_any_device_allocates() {
    let (_sim, rt) = runtime(2);
    rt.device(0).unwrap();
    let p = rt.malloc(4096, 1, StreamId(0)).unwrap();
    let err = rt
        .set_config("max_split_size_mb:64,per_stream_shards:True")
        .unwrap_err();
    assert_eq!(err.kind, ErrorKind::Config);
    // All or nothing: device 0 (started, no allocation yet) did not take it either.
    for d in 0..2 {
        assert_eq!(rt.device(d).unwrap().max_split_size().unwrap(), u64::MAX);
    }
    rt.free(p, 1).unwrap();
}

/// `set_config` checks every device before it changes any: a device whose first allocation
/// races the call must not end up changed by a call that was refused (it holds each device's
/// settings from its check to its change). Many tries at different offsets, since the race
/// window is short.
#[test]
fn a_refused_set_config_changes_no_device_even_racing_a_first_allocation() {
    let (mut refused, mut changed_anyway) = (0, 0);
    for i in 0..1500u32 {
        let (_, rt) = runtime(2);
        rt.device(0).unwrap();
        rt.device(1).unwrap();
        let barrier = std::sync::Barrier::new(2);
        let result = std::thread::scope(|s| {
            let first_use = s.spawn(|| {
                barrier.wait();
                for _ in 0..(i % 300) * 4 {
                    std::hint::spin_loop();
                }
                let p = rt.malloc(4096, 1, StreamId(0)).unwrap();
                rt.free(p, 1).unwrap();
            });
            barrier.wait();
            let result = rt.set_config("per_stream_shards:True");
            first_use.join().unwrap();
            result
        });
        if result.is_err() {
            refused += 1;
            // Device 0 allocates now: turning sharding off is then refused only if it is on.
            let d0 = rt.device(0).unwrap();
            let p = d0.malloc(4096, StreamId(0)).unwrap();
            d0.free(p).unwrap();
            if d0.check_config("per_stream_shards:False").is_err() {
                changed_anyway += 1;
            }
            assert!(!rt.config().unwrap().per_stream_shards);
        }
    }
    assert_eq!(
        changed_anyway, 0,
        "{changed_anyway} of {refused} refused calls changed device 0"
    );
}

/// A device first used while `shutdown` runs (here: waits on device 0's GPU) is not missed:
/// either the shutdown sees it (and is refused while it has a live block) or it does not
/// start. Before, the shutdown succeeded and left device 1 running with its memory.
#[test]
fn a_device_first_used_during_shutdown_is_not_left_running() {
    let sim = Arc::new(SimDriver::new(2, 1 << 30));
    let slow = GatedDriver::new(sim.clone(), Gate::Synchronize(0));
    let rt = Runtime::new(slow.clone(), Config::default());
    let p = rt.malloc(4096, 0, StreamId(0)).unwrap();
    rt.free(p, 0).unwrap();
    slow.arm();
    std::thread::scope(|s| {
        let shutdown = s.spawn(|| rt.shutdown());
        slow.wait_until_held();
        let first_use = s.spawn(|| rt.malloc(4096, 1, StreamId(0)));
        std::thread::sleep(std::time::Duration::from_millis(50));
        slow.open();
        let shut = shutdown.join().unwrap();
        let live = first_use.join().unwrap();
        assert!(
            !(live.is_ok() && shut.is_ok()),
            "shutdown succeeded while device 1 holds a live block"
        );
        if shut.is_ok() {
            assert_eq!(live.unwrap_err().kind, ErrorKind::ShutDown);
            assert_eq!(sim.counters(1).bytes_in_use, 0);
        }
    });
}
