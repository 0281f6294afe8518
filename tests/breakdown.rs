//! The breakdown of reserved memory, now and at its peak (`record_peak_breakdown`), on the
//! simulated device.
#![cfg(feature = "replay")]

use ccalloc::{trace, Config, DeviceAllocator, SimDriver, StreamId};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);

fn device(conf: &str) -> DeviceAllocator {
    let mut config = Config::default();
    config.apply(conf).unwrap();
    DeviceAllocator::new(0, Arc::new(SimDriver::new(1, 8 << 30)), config).unwrap()
}

fn reserved(a: &DeviceAllocator) -> (u64, u64) {
    let r = a.stats().unwrap().reserved_bytes.all();
    (r.current as u64, r.peak as u64)
}

/// A short spike (one large block, freed before anyone could look) sets the peak: the
/// recorded breakdown holds it, while the breakdown now does not.
#[test]
fn a_spike_between_two_looks_is_recorded() {
    let a = device("record_peak_breakdown:True");
    let kept: Vec<u64> = (0..40)
        .map(|i| a.malloc((i % 7 + 1) * 300 * 1024, S0).unwrap())
        .collect();
    let spike = a.malloc(900 * MIB, S0).unwrap();
    let at_spike = a.stats().unwrap().allocated_bytes.all().current as u64;
    a.free(spike).unwrap();
    let after = a.malloc(MIB, S0).unwrap();

    let peak = a.peak_breakdown().unwrap().expect("recording");
    assert_eq!(peak.reserved_bytes, reserved(&a).1, "{peak:?}");
    assert_eq!(peak.live_bytes, at_spike, "{peak:?}");
    assert_eq!(peak.accounted_bytes(), peak.reserved_bytes, "{peak:?}");
    let now = a.memory_breakdown().unwrap();
    assert_eq!(now.reserved_bytes, reserved(&a).0);
    assert!(now.live_bytes < 100 * MIB, "{now:?}");
    assert_eq!(now.accounted_bytes(), now.reserved_bytes, "{now:?}");

    for p in kept.into_iter().chain([after]) {
        a.free(p).unwrap();
    }
}

/// Off by default; set at run time, it starts from the memory then, whatever peak came
/// before. A reset of the peaks restarts it from the memory at the reset, which a lower
/// moment after it does not replace.
#[test]
fn recording_starts_when_set_and_restarts_at_a_reset() {
    let a = device("");
    let big = a.malloc(600 * MIB, S0).unwrap();
    a.free(big).unwrap();
    assert_eq!(a.peak_breakdown().unwrap(), None);
    a.empty_cache().unwrap();

    a.apply_config("record_peak_breakdown:True").unwrap();
    let started = a.peak_breakdown().unwrap().unwrap();
    assert_eq!((started.reserved_bytes, started.live_bytes), (0, 0));
    let small = a.malloc(4 * MIB, S0).unwrap();
    let first = a.peak_breakdown().unwrap().unwrap();
    assert_eq!(first.live_bytes, 4 * MIB, "{first:?}");
    // Under the 600 MiB of before recording: the highest since it began all the same.
    let mid = a.malloc(300 * MIB, S0).unwrap();
    a.free(mid).unwrap();
    let since = a.peak_breakdown().unwrap().unwrap();
    assert_eq!(since.live_bytes, 304 * MIB, "{since:?}");

    let big = a.malloc(700 * MIB, S0).unwrap();
    a.free(big).unwrap();
    let peak = a.peak_breakdown().unwrap().unwrap();
    assert_eq!(peak.live_bytes, 704 * MIB, "{peak:?}");
    assert_eq!(peak.reserved_bytes, reserved(&a).1);

    a.reset_peak_stats().unwrap();
    let reset = a.peak_breakdown().unwrap().unwrap();
    assert_eq!(reset, a.memory_breakdown().unwrap());
    assert_eq!(reset.reserved_bytes, reserved(&a).1, "{reset:?}");
    a.empty_cache().unwrap();
    let again = a.malloc(2 * MIB, S0).unwrap();
    assert_eq!(
        a.peak_breakdown().unwrap().unwrap(),
        reset,
        "lower than at the reset"
    );
    assert_eq!(
        reset.reserved_bytes,
        reserved(&a).1,
        "the device's peak too"
    );

    a.apply_config("record_peak_breakdown:False").unwrap();
    assert_eq!(a.peak_breakdown().unwrap(), None);
    a.free(small).unwrap();
    a.free(again).unwrap();
    a.shutdown().unwrap();
    assert!(a.peak_breakdown().is_err(), "after shutdown");
}

/// Threads allocating and freeing on several streams while another reads: every breakdown
/// is one moment's (its parts add up to its reserved bytes, which never exceed the peak),
/// and the record at the peak is never above the device's peak.
#[test]
fn breakdowns_are_one_moments_while_threads_allocate() {
    for conf in [
        "record_peak_breakdown:True",
        "record_peak_breakdown:True,per_stream_shards:True",
        "record_peak_breakdown:True,thread_shards:False",
    ] {
        let a = Arc::new(device(conf));
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ t;
                    let mut live = Vec::new();
                    for _ in 0..3000 {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        if live.len() < 40 && !seed.is_multiple_of(3) {
                            let size = 4096 + (seed >> 20) % (48 * MIB);
                            live.push(a.malloc(size, StreamId(t % 2)).unwrap());
                        } else if let Some(p) = live.pop() {
                            a.free(p).unwrap();
                        }
                        if seed.is_multiple_of(997) {
                            a.empty_cache().unwrap();
                        }
                    }
                    for p in live {
                        a.free(p).unwrap();
                    }
                })
            })
            .collect();
        let mut looks = 0;
        while looks < 50 || workers.iter().any(|w| !w.is_finished()) {
            let b = a.memory_breakdown().unwrap();
            assert_eq!(b.accounted_bytes(), b.reserved_bytes, "{conf}: {b:?}");
            assert!(b.reserved_bytes <= reserved(&a).1, "{conf}: {b:?}");
            looks += 1;
        }
        for w in workers {
            w.join().unwrap();
        }
        let peak = a.peak_breakdown().unwrap().unwrap();
        assert_eq!(
            peak.accounted_bytes(),
            peak.reserved_bytes,
            "{conf}: {peak:?}"
        );
        assert!(peak.reserved_bytes <= reserved(&a).1, "{conf}: {peak:?}");
        assert!(peak.reserved_bytes > 0, "{conf}");
    }
}

/// Replaying a real trace with recording on, the recorded breakdown is the one at the
/// allocation after which reserved was highest (as the replay tool's two passes find it),
/// with one shard and with a shard per stream.
#[test]
fn the_recorded_peak_is_where_reserved_was_highest() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("samples/mlp_sidestream.trace.csv.gz");
    let t = &trace::load(&path).unwrap()[0];
    for conf in [
        "record_peak_breakdown:True",
        "record_peak_breakdown:True,per_stream_shards:True",
    ] {
        let a = device(conf);
        let mut live: HashMap<u64, u64> = HashMap::new();
        for (addr, size, stream) in trace::live_at_start(t) {
            live.insert(addr, a.malloc(size.max(1), StreamId(stream)).unwrap());
        }
        let (mut highest, mut allocated_then) = (0, 0);
        for e in &t.events {
            match e.action {
                trace::Action::Alloc => {
                    if let Some(old) = live.remove(&e.addr) {
                        a.free(old).unwrap();
                    }
                    live.insert(e.addr, a.malloc(e.size.max(1), StreamId(e.stream)).unwrap());
                    let s = a.stats().unwrap();
                    let now = s.reserved_bytes.all().current as u64;
                    if now > highest {
                        highest = now;
                        allocated_then = s.allocated_bytes.all().current as u64;
                    }
                }
                trace::Action::FreeCompleted => {
                    if let Some(p) = live.remove(&e.addr) {
                        a.free(p).unwrap();
                    }
                }
                _ => {}
            }
        }
        let b = a.peak_breakdown().unwrap().unwrap();
        assert_eq!(b.reserved_bytes, highest, "{conf}: {b:?}");
        assert_eq!(
            b.reserved_bytes,
            reserved(&a).1,
            "{conf}: the device's peak"
        );
        assert_eq!(b.live_bytes, allocated_then, "{conf}: {b:?}");
        assert_eq!(b.accounted_bytes(), b.reserved_bytes, "{conf}: {b:?}");
        assert!(
            b.live_bytes > 1 << 30,
            "{conf}: the trace's 2 GiB of live data"
        );
    }
}
