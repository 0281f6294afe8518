//! Fuzzing the replay's two parsers (CSV traces, gzip'd or not, and snapshot pickles) with
//! random inputs and mutations of valid ones: byte flips, truncations, inserted bytes,
//! opcodes and huge numbers. Each input must load to a trace or a clean error, never a
//! panic, and what loads must be replayable; memory and time stay bounded by construction:
//! inputs are a few KiB, a line or pickle larger than the limits is refused, and a loaded
//! trace holds no more events than the element bound allows.
//!
//! 256 cases per target by default; a long run:
//!   CCALLOC_FUZZ_CASES=1000000 cargo test --release --features replay --test fuzz_replay

use ccalloc::{replay, trace, ReplayOptions};
use proptest::prelude::*;
use std::io::Write;
use std::path::Path;

fn cases() -> u32 {
    std::env::var("CCALLOC_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

/// Limits small enough that any input here that loads decodes to few elements.
const LIMITS: trace::Limits = trace::Limits {
    max_line_bytes: 4096,
    max_pickle_bytes: 1 << 20,
    pickle_elements_per_byte: 16,
    pickle_elements_floor: 10_000,
    max_events: trace::DEFAULT_MAX_EVENTS,
};

const CSV: &str = "action,addr,size,stream\n\
alloc,140000000,4096,0\n\
alloc,140010000,1048576,7\n\
segment_alloc,150000000,2097152,0\n\
free_requested,140000000,4096,0\n\
free_completed,140000000,4096,0\n\
snapshot,0,0,0\n\
free_completed,140010000,1048576,7\n\
segment_free,150000000,2097152,0\n";

fn pickle() -> Vec<u8> {
    std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/snapshot_p4.pickle"
    ))
    .unwrap()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// What a mutation inserts: random bytes, a pickle opcode with an argument, or a number
/// (decimal, or as a pickle's LONG, LONG4 or BINGET).
fn insertion() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 1..8),
        (
            prop::sample::select(b"().0123456789abcdeghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ]}\x80\x81\x85\x86\x87\x88\x89\x8a\x8b\x8c\x8d\x8e\x8f\x90\x91\x92\x93\x94\x95\x96".to_vec()),
            prop::collection::vec(any::<u8>(), 0..9),
        )
            .prop_map(|(op, arg)| [vec![op], arg].concat()),
        prop_oneof![
            Just(u64::MAX.to_string()),
            Just("-1".to_string()),
            Just("99999999999999999999999999999999".to_string()),
            "[0-9]{1,30}",
        ]
        .prop_map(String::into_bytes),
        (1usize..200).prop_map(|n| [b"L".to_vec(), vec![b'9'; n], b"L\n".to_vec()].concat()),
        any::<u32>().prop_map(|n| [b"\x8b".to_vec(), n.to_le_bytes().to_vec()].concat()),
        any::<u32>().prop_map(|n| [b"j".to_vec(), n.to_le_bytes().to_vec()].concat()),
    ]
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Repeat(usize, usize, u16),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, x)| Mutation::Flip(at, x)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), insertion()).prop_map(|(at, b)| Mutation::Insert(at, b)),
        (any::<usize>(), 1usize..16, 2u16..200).prop_map(|(at, n, k)| Mutation::Repeat(at, n, k)),
    ]
}

fn mutate(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        let len = bytes.len();
        match m {
            Mutation::Flip(at, x) if len > 0 => bytes[at % len] ^= x,
            Mutation::Truncate(at) => bytes.truncate(at % (len + 1)),
            Mutation::Insert(at, b) => {
                let at = at % (len + 1);
                bytes.splice(at..at, b.iter().copied());
            }
            // A run of the input repeated k times (repeated opcodes, memo references).
            Mutation::Repeat(at, n, k) if len > 0 => {
                let at = at % len;
                let run = bytes[at..(at + n).min(len)].to_vec();
                let copies: Vec<u8> = (0..*k).flat_map(|_| run.iter().copied()).collect();
                bytes.splice(at..at, copies);
            }
            _ => {}
        }
    }
    bytes
}

/// Loads `bytes` (gzip'd first when asked) and replays what loads; panics only on a broken
/// bound.
fn check(name: &str, bytes: &[u8], gzipped: bool) {
    let input = if gzipped { gzip(bytes) } else { bytes.to_vec() };
    let Ok(traces) = trace::load_from(Path::new(name), &input[..], &LIMITS) else {
        return;
    };
    let events: usize = traces.iter().map(|t| t.events.len()).sum();
    let most = LIMITS.pickle_elements_floor as usize
        + bytes.len() * LIMITS.pickle_elements_per_byte as usize;
    assert!(events <= most, "{events} events from {} bytes", bytes.len());
    let options = ReplayOptions {
        capacity: 1 << 30,
        ..ReplayOptions::default()
    };
    for t in &traces {
        let r = replay(t, &options, |_, _| {});
        // Errors are clean (a driver error on the sim would be one); they must not panic.
        if let Ok(r) = r {
            assert!(r.events <= t.events.len() + trace::live_at_start(t).len());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn mutated_csv_traces(mutations in prop::collection::vec(mutation(), 1..6), gz in any::<bool>()) {
        check("fuzz.csv", &mutate(CSV.as_bytes().to_vec(), &mutations), gz);
    }

    #[test]
    fn mutated_pickles(mutations in prop::collection::vec(mutation(), 1..6), gz in any::<bool>()) {
        check("fuzz.pickle", &mutate(pickle(), &mutations), gz);
    }

    #[test]
    fn random_inputs(
        head in prop::sample::select(vec![&b""[..], b"\x80\x02", b"\x80\x04", b"action,addr,size,stream\n"]),
        body in prop::collection::vec(any::<u8>(), 0..2048),
        gz in any::<bool>(),
    ) {
        check("random", &[head, &body[..]].concat(), gz);
    }
}

/// The mutation base inputs load and replay (the fuzzing starts from valid traces).
#[test]
fn the_seeds_load() {
    for (name, bytes) in [
        ("seed.csv", CSV.as_bytes().to_vec()),
        ("seed.pickle", pickle()),
    ] {
        let traces = trace::load_from(Path::new(name), &bytes[..], &LIMITS).unwrap();
        assert!(!traces[0].events.is_empty(), "{name}");
    }
}
