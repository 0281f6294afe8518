//! Fuzzing the C API with call sequences, against a model of what is live.
//!
//! Each case runs a random sequence of C API calls (malloc of any size, including 0 and
//! more than the device; frees of live, freed and foreign pointers; record_stream,
//! empty_cache, memory fractions, set_config with random text, statistics, peak resets,
//! init/shutdown, private-pool windows) and checks each status the model can predict. After
//! the sequence the statistics must agree with the model (live count and requested bytes,
//! every `all` the sum of its small and large pools), and once everything is freed and the
//! cache emptied nothing may stay reserved.
//!
//! The test command runs 500 cases; for a long run:
//!     CCALLOC_FUZZ_CASES=20000 cargo test --release --test fuzz_api
//! (any failure prints the minimal sequence proptest shrank it to).
#![cfg(feature = "sim")]

use ccalloc::capi::ccalloc_status::{self, *};
use ccalloc::capi::*;
use ccalloc::capi::{ccalloc_pool_id, ccalloc_stat_array, ccalloc_stats, cudaStream_t};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_void, CString};

const MIB: usize = 1 << 20;
const CAPACITY: &str = "2GiB";

#[derive(Clone, Debug)]
enum Op {
    Malloc {
        size: usize,
        stream: u64,
    },
    /// The live block at this index (modulo the live count).
    FreeLive(usize),
    /// A block freed earlier (modulo their count).
    FreeAgain(usize),
    FreeForeign(u64),
    FreeInterior(usize),
    RecordStream {
        live: usize,
        stream: u64,
    },
    EmptyCache(i32),
    SetFraction(f64),
    SetConfig(String),
    GetStats,
    ResetPeaks(i32),
    Init,
    Shutdown,
    BeginPool {
        pool: u64,
        all_streams: bool,
    },
    EndPool(u64),
    ReleasePool(u64),
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 1usize..4096,
        4 => 4096usize..(2 * MIB),
        2 => (2 * MIB)..(40 * MIB),
        1 => Just(0usize),
        1 => Just(1usize << 50),
        1 => Just(usize::MAX),
    ]
}

fn config_text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("max_split_size_mb:64".to_string()),
        Just("max_split_size_mb:256".to_string()),
        Just("garbage_collection_threshold:0.8".to_string()),
        Just("roundup_power2_divisions:4".to_string()),
        Just("expandable_segments:False".to_string()),
        Just("expandable_segments:True".to_string()),
        Just("per_stream_shards:True".to_string()),
        "[a-z_:,0-9.]{0,24}",
        any::<String>(),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (size(), 0u64..3).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        8 => any::<usize>().prop_map(Op::FreeLive),
        1 => any::<usize>().prop_map(Op::FreeAgain),
        1 => any::<u64>().prop_map(Op::FreeForeign),
        1 => any::<usize>().prop_map(Op::FreeInterior),
        2 => (any::<usize>(), 0u64..4).prop_map(|(live, stream)| Op::RecordStream { live, stream }),
        2 => prop_oneof![Just(-1), Just(0), Just(5)].prop_map(Op::EmptyCache),
        1 => prop_oneof![0.0..=1.0f64, Just(f64::NAN), Just(1.5), Just(-0.5)].prop_map(Op::SetFraction),
        1 => config_text().prop_map(Op::SetConfig),
        2 => Just(Op::GetStats),
        1 => prop_oneof![Just(-1), Just(0)].prop_map(Op::ResetPeaks),
        1 => Just(Op::Init),
        1 => Just(Op::Shutdown),
        1 => (1u64..3, any::<bool>()).prop_map(|(pool, all_streams)| Op::BeginPool { pool, all_streams }),
        1 => (1u64..3).prop_map(Op::EndPool),
        1 => (1u64..3).prop_map(Op::ReleasePool),
    ]
}

/// What the model knows.
#[derive(Default)]
struct Model {
    running: bool,
    /// Live blocks: pointer → (requested size, size as ccalloc rounds it, stream).
    live: BTreeMap<usize, (usize, u64, u64)>,
    /// Requested bytes of blocks freed while recorded on another stream: still counted
    /// (as in PyTorch, `requested_bytes` drops once the other streams' work is done).
    pending: i64,
    freed: BTreeSet<usize>,
    /// Live blocks recorded on a stream other than their own.
    recorded: BTreeSet<usize>,
    fraction: f64,
    /// Pools with an open window, and every pool's holds (begins not released).
    windows: BTreeSet<u64>,
    holds: BTreeMap<u64, u32>,
}

fn stream(s: u64) -> cudaStream_t {
    (s * 0x100) as cudaStream_t
}

fn pool_id(pool: u64) -> ccalloc_pool_id {
    ccalloc_pool_id {
        first: 0xF00D,
        second: pool,
    }
}

unsafe extern "C" fn only_stream_0(_ctx: *mut c_void, s: cudaStream_t) -> bool {
    s.is_null()
}

fn last_error() -> String {
    // SAFETY: this thread's NUL-terminated last error.
    unsafe { std::ffi::CStr::from_ptr(ccalloc_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn stats() -> ccalloc_stats {
    let mut out = std::mem::MaybeUninit::<ccalloc_stats>::uninit();
    assert_eq!(
        ccalloc_get_stats(0, out.as_mut_ptr()),
        CCALLOC_OK,
        "{}",
        last_error()
    );
    // SAFETY: written by the successful call.
    unsafe { out.assume_init() }
}

fn check_pools_add_up(name: &str, a: &ccalloc_stat_array) -> Result<(), TestCaseError> {
    for (what, all, small, large) in [
        (
            "current",
            a.all.current,
            a.small_pool.current,
            a.large_pool.current,
        ),
        (
            "peak",
            a.all.peak,
            a.small_pool.peak.min(a.all.peak),
            a.large_pool.peak.min(a.all.peak),
        ),
        (
            "allocated",
            a.all.allocated,
            a.small_pool.allocated,
            a.large_pool.allocated,
        ),
        ("freed", a.all.freed, a.small_pool.freed, a.large_pool.freed),
    ] {
        if what == "peak" {
            // Peaks are each reached at their own time: all's peak is at most the sum.
            prop_assert!(all <= a.small_pool.peak + a.large_pool.peak, "{name} peak");
            prop_assert!(all >= small.max(large), "{name} peak {all} below a pool's");
            continue;
        }
        prop_assert_eq!(
            all,
            small + large,
            "{} {}: all != small + large",
            name,
            what
        );
    }
    prop_assert!(
        a.all.current >= 0 && a.all.peak >= a.all.current,
        "{} current/peak",
        name
    );
    Ok(())
}

fn check_stats(model: &Model) -> Result<(), TestCaseError> {
    let s = stats();
    let live = model.live.len() as i64;
    let requested: i64 = model.live.values().map(|v| v.0 as i64).sum();
    let rounded: i64 = model.live.values().map(|v| v.1 as i64).sum();
    prop_assert_eq!(s.allocation.all.current, live, "live blocks");
    let r = s.requested_bytes.all.current;
    prop_assert!(
        (requested..=requested + model.pending).contains(&r),
        "requested bytes {} outside {}..={}",
        r,
        requested,
        requested + model.pending
    );
    prop_assert!(
        s.allocated_bytes.all.current >= rounded,
        "allocated bytes {} below the rounded sizes' sum {}",
        s.allocated_bytes.all.current,
        rounded
    );
    if live == 0 {
        prop_assert_eq!(s.allocated_bytes.all.current, 0);
    }
    prop_assert!(s.reserved_bytes.all.current >= s.allocated_bytes.all.current);
    for (name, a) in s.arrays() {
        check_pools_add_up(name, a)?;
    }
    Ok(())
}

fn expect(
    what: &str,
    got: ccalloc_status,
    allowed: &[ccalloc_status],
) -> Result<ccalloc_status, TestCaseError> {
    prop_assert!(
        allowed.contains(&got),
        "{}: got {:?} ({}), expected one of {:?}",
        what,
        got,
        last_error(),
        allowed
    );
    Ok(got)
}

fn run(model: &mut Model, op: &Op) -> Result<(), TestCaseError> {
    let down = [CCALLOC_SHUT_DOWN];
    match op {
        Op::Malloc { size, stream: s } => {
            let mut p = std::ptr::null_mut();
            let got = ccalloc_malloc(*size, 0, stream(*s), &mut p);
            let allowed: &[ccalloc_status] = if !model.running {
                &down
            } else if *size == 0 {
                &[CCALLOC_INVALID_SIZE]
            } else if *size == 1 << 50 {
                &[CCALLOC_OUT_OF_MEMORY]
            } else if *size == usize::MAX {
                &[CCALLOC_OUT_OF_MEMORY, CCALLOC_INVALID_SIZE]
            } else if model.fraction < 1.0
                || model.live.values().map(|v| v.0).sum::<usize>() > 1 << 30
            {
                &[CCALLOC_OK, CCALLOC_OUT_OF_MEMORY]
            } else {
                &[CCALLOC_OK]
            };
            if expect("malloc", got, allowed)? == CCALLOC_OK {
                let p = p as usize;
                prop_assert!(!model.live.contains_key(&p), "{p:#x} handed out twice");
                model.freed.remove(&p);
                let config = ccalloc::testing::global().unwrap().config().unwrap();
                let rounded = ccalloc::testing::round_size(*size as u64, &config);
                model.live.insert(p, (*size, rounded, *s));
                model.recorded.remove(&p);
            }
        }
        Op::FreeLive(i) => {
            let Some(&p) = model.live.keys().nth(i % model.live.len().max(1)) else {
                return Ok(());
            };
            let allowed: &[ccalloc_status] = if model.running { &[CCALLOC_OK] } else { &down };
            if expect("free", ccalloc_free(p as *mut c_void, 0), allowed)? == CCALLOC_OK {
                let (size, _, _) = model.live.remove(&p).expect("live");
                if model.recorded.remove(&p) {
                    model.pending += size as i64;
                }
                model.freed.insert(p);
            }
        }
        Op::FreeAgain(i) => {
            let Some(&p) = model.freed.iter().nth(i % model.freed.len().max(1)) else {
                return Ok(());
            };
            // Still cached: a double free; its segment gone back to the driver: unknown.
            let allowed: &[ccalloc_status] = if model.running {
                &[CCALLOC_DOUBLE_FREE, CCALLOC_UNKNOWN_POINTER]
            } else {
                &down
            };
            expect("double free", ccalloc_free(p as *mut c_void, 0), allowed)?;
        }
        Op::FreeForeign(v) => {
            // Odd addresses below the sim's mappings' alignment: never a block.
            let p = (v % (1 << 40)) | 1;
            let allowed: &[ccalloc_status] = if model.running {
                &[CCALLOC_UNKNOWN_POINTER]
            } else {
                &down
            };
            expect("foreign free", ccalloc_free(p as *mut c_void, 0), allowed)?;
        }
        Op::FreeInterior(i) => {
            let Some((&p, &size)) = model.live.iter().nth(i % model.live.len().max(1)) else {
                return Ok(());
            };
            if size.0 < 2 {
                return Ok(());
            }
            let allowed: &[ccalloc_status] = if model.running {
                &[CCALLOC_UNKNOWN_POINTER]
            } else {
                &down
            };
            expect(
                "interior free",
                ccalloc_free((p + 1) as *mut c_void, 0),
                allowed,
            )?;
        }
        Op::RecordStream { live, stream: s } => {
            let Some(&p) = model.live.keys().nth(live % model.live.len().max(1)) else {
                return Ok(());
            };
            let allowed: &[ccalloc_status] = if model.running { &[CCALLOC_OK] } else { &down };
            let got = ccalloc_record_stream(p as *mut c_void, 0, stream(*s));
            if expect("record_stream", got, allowed)? == CCALLOC_OK && model.live[&p].2 != *s {
                model.recorded.insert(p);
            }
        }
        Op::EmptyCache(d) => {
            let allowed: &[ccalloc_status] = match (model.running, *d) {
                (false, _) => &down,
                (true, 5) => &[CCALLOC_INVALID_DEVICE],
                _ => &[CCALLOC_OK],
            };
            expect("empty_cache", ccalloc_empty_cache(*d), allowed)?;
        }
        Op::SetFraction(f) => {
            let valid = (0.0..=1.0).contains(f);
            let allowed: &[ccalloc_status] = match (model.running, valid) {
                // Checked before anything else.
                _ if f.is_nan() => &[CCALLOC_INVALID_ARGUMENT],
                (false, _) => &down,
                (true, true) => &[CCALLOC_OK],
                (true, false) => &[CCALLOC_INVALID_ARGUMENT],
            };
            if expect(
                "set_memory_fraction",
                ccalloc_set_memory_fraction(*f, 0),
                allowed,
            )? == CCALLOC_OK
            {
                model.fraction = *f;
            }
        }
        Op::SetConfig(text) => {
            let Ok(text) = CString::new(text.as_str()) else {
                return Ok(());
            };
            let allowed: &[ccalloc_status] = if model.running {
                &[CCALLOC_OK, CCALLOC_CONFIG_ERROR]
            } else {
                &down
            };
            // SAFETY: a NUL-terminated string.
            let got = unsafe { ccalloc_set_config(text.as_ptr()) };
            expect("set_config", got, allowed)?;
        }
        Op::GetStats => {
            if model.running {
                check_stats(model)?;
            } else {
                let mut out = std::mem::MaybeUninit::<ccalloc_stats>::uninit();
                expect("get_stats", ccalloc_get_stats(0, out.as_mut_ptr()), &down)?;
            }
        }
        Op::ResetPeaks(d) => {
            let allowed: &[ccalloc_status] = if model.running { &[CCALLOC_OK] } else { &down };
            expect("reset_peak_stats", ccalloc_reset_peak_stats(*d), allowed)?;
        }
        Op::Init => {
            expect("init", ccalloc_init(), &[CCALLOC_OK])?;
            if !model.running {
                // A fresh runtime: settings from the environment, nothing held.
                model.running = true;
                model.fraction = 1.0;
                model.holds.clear();
                model.freed.clear();
                model.pending = 0;
            }
        }
        Op::Shutdown => {
            if !model.windows.is_empty() {
                return Ok(());
            }
            let allowed: &[ccalloc_status] = if !model.running {
                &down
            } else if !model.live.is_empty() {
                &[CCALLOC_BUSY]
            } else {
                &[CCALLOC_OK]
            };
            if expect("shutdown", ccalloc_shutdown(), allowed)? == CCALLOC_OK {
                model.running = false;
                model.pending = 0;
            }
        }
        Op::BeginPool { pool, all_streams } => {
            if model.windows.contains(pool) {
                return Ok(());
            }
            let filter = if *all_streams {
                None
            } else {
                Some(only_stream_0 as _)
            };
            let allowed: &[ccalloc_status] = if model.running { &[CCALLOC_OK] } else { &down };
            let got = ccalloc_begin_allocate_to_pool(
                0,
                pool_id(*pool),
                filter,
                std::ptr::null_mut(),
                None,
            );
            if expect("begin_allocate_to_pool", got, allowed)? == CCALLOC_OK {
                model.windows.insert(*pool);
                *model.holds.entry(*pool).or_default() += 1;
            }
        }
        Op::EndPool(pool) => {
            let allowed: &[ccalloc_status] = match (model.running, model.windows.contains(pool)) {
                (false, _) => &down,
                (true, true) => &[CCALLOC_OK],
                (true, false) => &[CCALLOC_INVALID_ARGUMENT],
            };
            if expect(
                "end_allocate_to_pool",
                ccalloc_end_allocate_to_pool(0, pool_id(*pool)),
                allowed,
            )? == CCALLOC_OK
            {
                model.windows.remove(pool);
            }
        }
        Op::ReleasePool(pool) => {
            let held = model.holds.get(pool).copied().unwrap_or(0) > 0;
            let allowed: &[ccalloc_status] = match (model.running, held) {
                (false, _) => &down,
                (true, true) => &[CCALLOC_OK],
                (true, false) => &[CCALLOC_INVALID_ARGUMENT],
            };
            if expect(
                "release_pool",
                ccalloc_release_pool(0, pool_id(*pool)),
                allowed,
            )? == CCALLOC_OK
            {
                let h = model.holds.get_mut(pool).expect("held");
                *h -= 1;
                if *h == 0 {
                    model.holds.remove(pool);
                }
            }
        }
    }
    Ok(())
}

/// What the last case left behind, if it failed (proptest then reruns shrunk sequences).
static LEFT: std::sync::Mutex<Option<Model>> = std::sync::Mutex::new(None);

/// Puts the global runtime back to a known state: running, defaults, nothing live.
fn fresh() -> Model {
    std::env::set_var("CCALLOC_BACKEND", "sim");
    std::env::set_var("CCALLOC_SIM_CAPACITY", CAPACITY);
    std::env::remove_var("CCALLOC_CONF");
    assert_eq!(ccalloc_init(), CCALLOC_OK, "{}", last_error());
    if let Some(left) = LEFT.lock().unwrap().take() {
        for pool in left.windows {
            ccalloc_end_allocate_to_pool(0, pool_id(pool));
        }
        for (pool, holds) in left.holds {
            for _ in 0..holds {
                ccalloc_release_pool(0, pool_id(pool));
            }
        }
        for p in left.live.keys() {
            ccalloc_free(*p as *mut c_void, 0);
        }
    }
    assert_eq!(ccalloc_shutdown(), CCALLOC_OK, "{}", last_error());
    assert_eq!(ccalloc_init(), CCALLOC_OK, "{}", last_error());
    Model {
        running: true,
        fraction: 1.0,
        ..Model::default()
    }
}

/// Frees everything, closes every window and releases every pool; then nothing may stay
/// reserved once the cache is emptied.
fn drain(model: &mut Model) -> Result<(), TestCaseError> {
    if !model.running {
        run(model, &Op::Init)?;
    }
    check_stats(model)?;
    while let Some(pool) = model.windows.pop_first() {
        let got = ccalloc_end_allocate_to_pool(0, pool_id(pool));
        expect("end", got, &[CCALLOC_OK])?;
    }
    while let Some((pool, holds)) = model.holds.pop_first() {
        for _ in 0..holds {
            expect(
                "release",
                ccalloc_release_pool(0, pool_id(pool)),
                &[CCALLOC_OK],
            )?;
        }
    }
    while let Some((p, _)) = model.live.pop_first() {
        expect("free", ccalloc_free(p as *mut c_void, 0), &[CCALLOC_OK])?;
    }
    expect("empty_cache", ccalloc_empty_cache(-1), &[CCALLOC_OK])?;
    let s = stats();
    prop_assert_eq!(s.requested_bytes.all.current, 0);
    prop_assert_eq!(s.allocation.all.current, 0);
    prop_assert_eq!(s.allocated_bytes.all.current, 0);
    prop_assert_eq!(
        s.reserved_bytes.all.current,
        0,
        "reserved after emptying everything"
    );
    expect("shutdown", ccalloc_shutdown(), &[CCALLOC_OK])?;
    Ok(())
}

fn cases() -> u32 {
    std::env::var("CCALLOC_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn c_api_call_sequences_match_the_model(ops in prop::collection::vec(op(), 1..80)) {
        let mut model = fresh();
        let result = ops.iter().try_for_each(|op| run(&mut model, op)).and_then(|()| drain(&mut model));
        if result.is_err() {
            *LEFT.lock().unwrap() = Some(model);
        }
        result?;
    }
}
