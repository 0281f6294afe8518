//! Fuzzing the config parser (`Config::apply`, which `CCALLOC_CONF`, the C API and the
//! runtime's settings all use) with random and mutated `key:value,...` strings.
//!
//! Long run (cases default to 3,000, a few seconds):
//! `CCALLOC_FUZZ_CASES=1000000 cargo test --release --test fuzz_config`
//!
//! Every input must give Ok or a clean config error (no panic, a message of bounded
//! length, the config unchanged); every accepted config must read back from its own
//! display to the same config.

use ccalloc::testing::KEYS;
use ccalloc::{Config, ErrorKind};
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("CCALLOC_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3000)
}

/// Values of the kinds the keys take, good and bad.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("True".to_string()),
        Just("False".to_string()),
        Just("-0".to_string()),
        Just("+100".to_string()),
        Just("nan".to_string()),
        Just("inf".to_string()),
        Just(String::new()),
        any::<u64>().prop_map(|n| n.to_string()),
        (0u32..40).prop_map(|n| (1u64 << n).to_string()),
        (0u32..2000).prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| f.to_string()),
        (0.0f64..1.5).prop_map(|f| f.to_string()),
        prop::collection::vec(
            (
                prop_oneof![
                    Just(">".to_string()),
                    (0u32..20).prop_map(|n| (1u64 << n).to_string()),
                    (0u32..3000).prop_map(|n| n.to_string()),
                ],
                prop_oneof![
                    (0u32..18).prop_map(|n| (1u64 << n).to_string()),
                    Just("0".to_string()),
                    (0u32..100).prop_map(|n| n.to_string()),
                ],
            ),
            0..6
        )
        .prop_map(|entries| {
            let inner: Vec<String> = entries.iter().map(|(k, v)| format!("{k}:{v}")).collect();
            format!("[{}]", inner.join(","))
        }),
        "[ -~]{0,12}",
    ]
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => prop::sample::select(KEYS.to_vec()).prop_map(str::to_string),
        1 => "[a-z_]{0,20}",
    ]
}

/// A string of `key:value` items.
fn structured() -> impl Strategy<Value = String> {
    prop::collection::vec((key(), value()), 0..5).prop_map(|items| {
        items
            .iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect::<Vec<_>>()
            .join(",")
    })
}

#[derive(Clone, Debug)]
enum Edit {
    Insert(usize, char),
    Delete(usize),
    Replace(usize, char),
}

fn edit() -> impl Strategy<Value = Edit> {
    let c = prop_oneof![
        prop::sample::select(vec![
            ',', ':', '[', ']', '>', '-', '+', '.', ' ', '0', '1', 'e'
        ]),
        any::<char>(),
    ];
    prop_oneof![
        (any::<usize>(), c.clone()).prop_map(|(i, c)| Edit::Insert(i, c)),
        any::<usize>().prop_map(Edit::Delete),
        (any::<usize>(), c).prop_map(|(i, c)| Edit::Replace(i, c)),
    ]
}

fn mutate(text: &str, edits: &[Edit]) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    for e in edits {
        let n = chars.len();
        match *e {
            Edit::Insert(i, c) => chars.insert(i % (n + 1), c),
            Edit::Delete(i) if n > 0 => {
                chars.remove(i % n);
            }
            Edit::Replace(i, c) if n > 0 => chars[i % n] = c,
            _ => {}
        }
    }
    chars.into_iter().collect()
}

fn input() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => structured(),
        3 => (structured(), prop::collection::vec(edit(), 1..4))
            .prop_map(|(text, edits)| mutate(&text, &edits)),
        1 => "[ -~]{0,60}",
        1 => any::<String>(),
    ]
}

fn check(text: &str) -> Result<(), TestCaseError> {
    let mut config = Config::default();
    match config.apply(text) {
        Ok(()) => {
            let shown = config.to_string();
            let mut back = Config::default();
            back.apply(&shown)
                .map_err(|e| TestCaseError::fail(format!("{shown:?} refused: {e}")))?;
            prop_assert_eq!(back, config, "{:?} displayed as {:?}", text, shown);
        }
        Err(e) => {
            prop_assert_eq!(e.kind, ErrorKind::Config);
            prop_assert!(!e.message.is_empty());
            // Quotes are cut to about 80 characters (each at most 4 bytes, escaped 10).
            prop_assert!(e.message.len() < 1500, "{} bytes", e.message.len());
            prop_assert_eq!(
                config,
                Config::default(),
                "a refused setting changed the config"
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn config_strings_parse_or_fail_cleanly(text in input()) {
        check(&text)?;
    }

    /// Accepted configs applied on top of one another still read back.
    #[test]
    fn applied_in_turn_configs_read_back(texts in prop::collection::vec(structured(), 1..4)) {
        let mut config = Config::default();
        for text in &texts {
            let _ = config.apply(text);
        }
        let mut back = Config::default();
        back.apply(&config.to_string()).unwrap();
        prop_assert_eq!(back, config);
    }
}
