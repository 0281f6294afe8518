//! The process-wide runtime over several simulated devices: lazy device start, wrong-device
//! frees, and shutdown that is all or nothing.

use ccalloc::driver::sim::SimDriver;
use ccalloc::{Config, ErrorKind, Runtime, StreamId};
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
