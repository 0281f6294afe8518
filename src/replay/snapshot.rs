//! The parts of a PyTorch memory snapshot that the replay reads (`device_traces`: per device,
//! entries with action, addr, size and stream), decoded through serde so that the rest
//! (frames, segments) is visited one value at a time and dropped: the decoder copies a
//! memoized value at each reference to it, which building the whole snapshot as one value
//! would keep, once per reference. What is kept is bounded: an entry costs a fixed size
//! (its action is read into `Action`, not kept as text), and at most `EntryBudget`'s count
//! of entries are kept, all devices together, however often one memoized entry is referenced.

use super::trace::{action_of, Action};
use serde::de::{
    self, Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor,
};
use std::cell::Cell;
use std::fmt;

/// The snapshot's top level: a dict (with its device traces, if any) or something else.
pub(super) enum Top {
    NotDict,
    Snapshot(Option<Vec<Option<Vec<Entry>>>>),
}

/// One trace entry's fields; those missing, or of another type, are None (as is an action
/// the replay does not know).
#[derive(Default)]
pub(super) struct Entry {
    pub action: Option<Action>,
    pub addr: Option<i64>,
    pub size: Option<i64>,
    pub stream: Option<i64>,
}

/// Visitor methods for the values a visitor does not read: each gives `$value` (containers
/// are drained).
macro_rules! otherwise {
    ($value:expr; $($kind:ident),*) => { $( otherwise!(@ $kind, $value); )* };
    (@ unit, $v:expr) => {
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> { Ok($v) }
    };
    (@ bool, $v:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> { Ok($v) }
    };
    (@ i64, $v:expr) => {
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> { Ok($v) }
    };
    (@ f64, $v:expr) => {
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> { Ok($v) }
    };
    (@ str, $v:expr) => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> { Ok($v) }
    };
    (@ bytes, $v:expr) => {
        fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Self::Value, E> { Ok($v) }
    };
    (@ seq, $v:expr) => {
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok($v)
        }
    };
    (@ map, $v:expr) => {
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok($v)
        }
    };
}

/// The trace entries the decoder may still keep, all devices together, and whether a snapshot
/// held more: the decoder then stops with an error of its own, which `load_pickle` replaces
/// by one naming the limit.
pub(super) struct EntryBudget {
    left: Cell<u64>,
    exceeded: Cell<bool>,
}

impl EntryBudget {
    pub fn new(most: u64) -> Self {
        Self {
            left: Cell::new(most),
            exceeded: Cell::new(false),
        }
    }

    pub fn exceeded(&self) -> bool {
        self.exceeded.get()
    }

    /// Takes one entry (a device's list counts as one too): an error, and noted, once none
    /// is left.
    fn take<E: de::Error>(&self) -> Result<(), E> {
        match self.left.get() {
            0 => {
                self.exceeded.set(true);
                Err(E::custom("more trace entries than the most read"))
            }
            left => {
                self.left.set(left - 1);
                Ok(())
            }
        }
    }
}

/// Implements DeserializeSeed for `$seed` (holding the `EntryBudget`) through `$visitor` (the
/// same), which expects `$what`.
macro_rules! seeded {
    ($seed:ident, $ty:ty, $visitor:ident, $what:literal) => {
        impl<'de> DeserializeSeed<'de> for $seed<'_> {
            type Value = $ty;
            fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<$ty, D::Error> {
                d.deserialize_any($visitor(self.0))
            }
        }

        impl $visitor<'_> {
            fn expecting(f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str($what)
            }
        }
    };
}

/// Implements Deserialize for `$ty` through `$visitor`, which expects `$what`.
macro_rules! through {
    ($ty:ty, $visitor:ident, $what:literal) => {
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_any($visitor)
            }
        }

        impl $visitor {
            fn expecting(f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str($what)
            }
        }
    };
}

/// Decodes a snapshot, keeping no more trace entries than its budget allows.
pub(super) struct TopSeed<'a>(pub &'a EntryBudget);
struct TopVisitor<'a>(&'a EntryBudget);
seeded!(TopSeed, Top, TopVisitor, "a memory snapshot");

impl<'de> Visitor<'de> for TopVisitor<'_> {
    type Value = Top;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        Self::expecting(f)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Top, A::Error> {
        let mut devices = None;
        while let Some(Text(key)) = map.next_key::<Text>()? {
            match key.as_deref() {
                Some("device_traces") => devices = map.next_value_seed(DevicesSeed(self.0))?.0,
                _ => drop(map.next_value::<IgnoredAny>()?),
            }
        }
        Ok(Top::Snapshot(devices))
    }
    otherwise!(Top::NotDict; unit, bool, i64, f64, str, bytes, seq);
}

/// `device_traces`: a list (of lists of entries, or other things), or None.
struct Devices(Option<Vec<Option<Vec<Entry>>>>);
struct DevicesSeed<'a>(&'a EntryBudget);
struct DevicesVisitor<'a>(&'a EntryBudget);
seeded!(DevicesSeed, Devices, DevicesVisitor, "device_traces");

impl<'de> Visitor<'de> for DevicesVisitor<'_> {
    type Value = Devices;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        Self::expecting(f)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Devices, A::Error> {
        let mut devices = Vec::new();
        while let Some(Entries(entries)) = seq.next_element_seed(EntriesSeed(self.0))? {
            // A device's list is kept as an entry is (millions of empty ones cost memory).
            self.0.take()?;
            devices.push(entries);
        }
        Ok(Devices(Some(devices)))
    }
    otherwise!(Devices(None); unit, bool, i64, f64, str, bytes, map);
}

/// One device's trace: a list of entries, or None.
struct Entries(Option<Vec<Entry>>);
struct EntriesSeed<'a>(&'a EntryBudget);
struct EntriesVisitor<'a>(&'a EntryBudget);
seeded!(EntriesSeed, Entries, EntriesVisitor, "a device trace");

impl<'de> Visitor<'de> for EntriesVisitor<'_> {
    type Value = Entries;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        Self::expecting(f)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Entries, A::Error> {
        let mut entries = Vec::new();
        while let Some(entry) = seq.next_element::<Entry>()? {
            // Checked as each is kept: a memoized entry referenced many times is decoded
            // (and would be kept) once per reference.
            self.0.take()?;
            entries.push(entry);
        }
        Ok(Entries(Some(entries)))
    }
    otherwise!(Entries(None); unit, bool, i64, f64, str, bytes, map);
}

struct EntryVisitor;
through!(Entry, EntryVisitor, "a trace entry");

impl<'de> Visitor<'de> for EntryVisitor {
    type Value = Entry;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        Self::expecting(f)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entry, A::Error> {
        let mut entry = Entry::default();
        while let Some(Text(key)) = map.next_key::<Text>()? {
            match key.as_deref() {
                Some("action") => {
                    entry.action = map.next_value::<Text>()?.0.as_deref().and_then(action_of)
                }
                Some("addr") => entry.addr = map.next_value::<Int>()?.0,
                Some("size") => entry.size = map.next_value::<Int>()?.0,
                Some("stream") => entry.stream = map.next_value::<Int>()?.0,
                _ => drop(map.next_value::<IgnoredAny>()?),
            }
        }
        Ok(entry)
    }
    otherwise!(Entry::default(); unit, bool, i64, f64, str, bytes, seq);
}

/// A string, or None for any other value.
struct Text(Option<String>);
struct TextVisitor;
through!(Text, TextVisitor, "a string");

impl<'de> Visitor<'de> for TextVisitor {
    type Value = Text;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        Self::expecting(f)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Text, E> {
        Ok(Text(Some(v.to_string())))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Text, E> {
        Ok(Text(Some(v)))
    }
    otherwise!(Text(None); unit, bool, i64, f64, bytes, seq, map);
}

/// An integer (Python's None reads as 0), or None for any other value.
struct Int(Option<i64>);
struct IntVisitor;
through!(Int, IntVisitor, "an integer");

impl<'de> Visitor<'de> for IntVisitor {
    type Value = Int;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        Self::expecting(f)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Int, E> {
        Ok(Int(Some(v)))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Int, E> {
        Ok(Int(Some(0)))
    }
    otherwise!(Int(None); bool, f64, str, bytes, seq, map);
}
