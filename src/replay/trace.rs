//! Allocator traces: the CSV format of shared/traces (`action,addr,size,stream`, optionally
//! gzip'd) and PyTorch's own snapshot pickles (`torch.cuda.memory._dump_snapshot()`).

use crate::error::{Error, ErrorKind, Result};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Alloc,
    FreeRequested,
    /// The block became reusable: replay frees here.
    FreeCompleted,
    /// PyTorch's own device allocations, for the side-by-side figure.
    SegmentAlloc,
    SegmentFree,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub action: Action,
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
}

#[derive(Clone, Debug)]
pub struct Trace {
    pub name: String,
    pub events: Vec<Event>,
}

fn bad(path: &Path, why: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::InvalidArgument,
        format!("{}: {why}", path.display()),
    )
}

pub(super) fn action_of(name: &str) -> Option<Action> {
    Some(match name {
        "alloc" => Action::Alloc,
        "free_requested" => Action::FreeRequested,
        "free_completed" => Action::FreeCompleted,
        "segment_alloc" | "segment_map" => Action::SegmentAlloc,
        "segment_free" | "segment_unmap" => Action::SegmentFree,
        _ => return None,
    })
}

/// PyTorch's trace actions that allocate and free nothing.
const NON_ALLOCATION_ACTIONS: [&str; 2] = ["snapshot", "oom"];

/// Bounds on what a trace file can make the loader hold or do: every file is read as if it
/// were hostile. A CSV trace is read a line at a time (memory grows with its events, not its
/// bytes); a pickle is read whole, then measured before it is decoded.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Longest CSV line; a real one is under 100 bytes.
    pub max_line_bytes: usize,
    /// Largest pickle read (after gzip).
    pub max_pickle_bytes: u64,
    /// Elements a pickle may decode to (memo references counted in full): this many per
    /// byte of pickle, plus `pickle_elements_floor`. A snapshot's frame references decode
    /// to a few elements per byte.
    pub pickle_elements_per_byte: u64,
    pub pickle_elements_floor: u64,
    /// Events read from one file, all its traces together (`ccalloc replay --max-events`;
    /// `DEFAULT_MAX_EVENTS`).
    pub max_events: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_line_bytes: 4096,
            max_pickle_bytes: 1 << 30,
            pickle_elements_per_byte: 16,
            pickle_elements_floor: 1 << 22,
            max_events: DEFAULT_MAX_EVENTS,
        }
    }
}

/// The most events read from one file (all its traces together) unless the caller says
/// otherwise (`ccalloc replay --max-events`): what a file can make the loader hold is bounded
/// by this, not by how well it compresses (100 M CSV lines gzip to under 3 MB; one memoized
/// pickle entry referenced 50 M times, to under 100 KB). A real trace holds far fewer: the
/// largest shipped one (benches/traces/llm_serve_contbatch) about 490,000. An event costs
/// 32 bytes here, a pickle entry about twice that while decoding.
pub const DEFAULT_MAX_EVENTS: u64 = 20_000_000;

/// A file with more events than the most read: names the limit and how to raise it.
fn too_many_events(path: &Path, max_events: u64, found: &str) -> Error {
    bad(
        path,
        format!(
            "{found}: more than {max_events} events, the most read from one file \
             (raise it with ccalloc replay --max-events N)"
        ),
    )
}

/// Input echoed in an error message: its first 80 characters, quoted.
fn clip(text: &str) -> String {
    const MAX: usize = 80;
    match text.char_indices().nth(MAX) {
        Some((end, _)) => format!("{:?}…", &text[..end]),
        None => format!("{text:?}"),
    }
}

/// A message that may quote the input, cut to a readable length.
fn clip_message(message: &str) -> String {
    const MAX: usize = 160;
    match message.char_indices().nth(MAX) {
        Some((end, _)) => format!("{}…", &message[..end]),
        None => message.to_string(),
    }
}

/// Reads one file: a CSV trace (plain or .gz) or a PyTorch snapshot pickle (one trace per
/// device that has events), within the default `Limits`.
pub fn load(path: &Path) -> Result<Vec<Trace>> {
    load_within(path, &Limits::default())
}

/// `load`, within `limits`.
pub fn load_within(path: &Path, limits: &Limits) -> Result<Vec<Trace>> {
    let file = std::fs::File::open(path).map_err(|e| bad(path, e))?;
    load_from(path, file, limits)
}

/// Reads a trace from `input` (named `path` in messages and the trace's name), within
/// `limits`. What it is (gzip, pickle, CSV) is decided by its first bytes.
pub fn load_from(path: &Path, input: impl Read, limits: &Limits) -> Result<Vec<Trace>> {
    let (head, input) = peek(input).map_err(|e| bad(path, e))?;
    if head.starts_with(&[0x1f, 0x8b]) {
        // Every member: `cat a.gz b.gz`, pigz and bgzip write several.
        let plain = Gunzip(flate2::read::MultiGzDecoder::new(input));
        let (head, plain) = peek(plain).map_err(|e| bad(path, e))?;
        return load_plain(path, &head, plain, limits);
    }
    load_plain(path, &head, input, limits)
}

/// The first two bytes of `input` (fewer if it is shorter) and `input` read from its start.
fn peek<R: Read>(mut input: R) -> std::io::Result<(Vec<u8>, impl Read)> {
    let mut head = Vec::with_capacity(2);
    (&mut input).take(2).read_to_end(&mut head)?;
    Ok((head.clone(), std::io::Cursor::new(head).chain(input)))
}

/// A gzip stream's errors, named as such.
struct Gunzip<R: Read>(flate2::read::MultiGzDecoder<R>);

impl<R: Read> Read for Gunzip<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0
            .read(buf)
            .map_err(|e| std::io::Error::new(e.kind(), format!("gzip: {e}")))
    }
}

fn load_plain(path: &Path, head: &[u8], input: impl Read, limits: &Limits) -> Result<Vec<Trace>> {
    let name = trace_name(path);
    // Protocol 2 and later open with PROTO; a CSV trace opens with its header.
    if head.first() == Some(&0x80) {
        let mut raw = Vec::new();
        input
            .take(limits.max_pickle_bytes.saturating_add(1))
            .read_to_end(&mut raw)
            .map_err(|e| bad(path, e))?;
        if raw.len() as u64 > limits.max_pickle_bytes {
            return Err(bad(
                path,
                format!(
                    "a pickle larger than {} (the most read)",
                    crate::error::human_bytes(limits.max_pickle_bytes)
                ),
            ));
        }
        return load_pickle(path, &name, &raw, limits);
    }
    Ok(vec![load_csv(path, name, BufReader::new(input), limits)?])
}

fn trace_name(path: &Path) -> String {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut name = file.as_str();
    for suffix in [".gz", ".csv", ".trace", ".pickle", ".pkl"] {
        name = name.strip_suffix(suffix).unwrap_or(name);
    }
    for suffix in [".csv", ".trace"] {
        name = name.strip_suffix(suffix).unwrap_or(name);
    }
    name.to_string()
}

/// One line of `input` into `line` (without its newline), reading at most `max + 1` bytes:
/// Ok(None) at the end of the input, Ok(Some(false)) for a line longer than `max` (`line`
/// holds its start).
fn next_line(
    input: &mut impl BufRead,
    line: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Option<bool>> {
    line.clear();
    let read = input.take(max as u64 + 1).read_until(b'\n', line)?;
    if read == 0 {
        return Ok(None);
    }
    if line.last() == Some(&b'\n') {
        line.pop();
    } else if line.len() > max {
        return Ok(Some(false));
    }
    Ok(Some(true))
}

fn load_csv(path: &Path, name: String, mut input: impl BufRead, limits: &Limits) -> Result<Trace> {
    let max_events = limits.max_events;
    const HEADER: &str = "action,addr,size,stream";
    let mut events = Vec::new();
    let mut raw = Vec::new();
    let max = limits.max_line_bytes;
    let whole = next_line(&mut input, &mut raw, max).map_err(|e| bad(path, e))?;
    let header = String::from_utf8_lossy(&raw);
    if whole != Some(true) || header.trim() != HEADER {
        let found = match whole {
            Some(false) => format!("{} (a line longer than {max} bytes)", clip(&header)),
            _ => clip(&header),
        };
        return Err(bad(
            path,
            format!("expected the header {HEADER}, found {found}"),
        ));
    }
    for number in 2usize.. {
        match next_line(&mut input, &mut raw, max).map_err(|e| bad(path, e))? {
            None => break,
            Some(true) => {}
            Some(false) => {
                return Err(bad(path, format!("line {number}: longer than {max} bytes")));
            }
        }
        let Ok(line) = std::str::from_utf8(&raw) else {
            return Err(bad(path, format!("line {number}: not UTF-8")));
        };
        if line.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.trim().split(',').collect();
        // Addresses and stream handles may be written signed (their bits are what counts);
        // a size may not.
        let parse = |k: usize, signed: bool| -> Result<u64> {
            let text = fields.get(k).copied().unwrap_or("");
            text.parse::<u64>()
                .or_else(|e| match signed {
                    true => text.parse::<i64>().map(|v| v as u64),
                    false => Err(e),
                })
                .map_err(|_| {
                    let what = if signed { "a number" } else { "a size" };
                    bad(path, format!("line {number}: {} is not {what}", clip(text)))
                })
        };
        if fields.len() != 4 {
            return Err(bad(path, format!("line {number}: expected 4 fields")));
        }
        let Some(action) = action_of(fields[0]) else {
            // PyTorch's other trace actions carry no allocation; anything else is a
            // damaged trace, not something to skip quietly.
            if NON_ALLOCATION_ACTIONS.contains(&fields[0]) {
                continue;
            }
            return Err(bad(
                path,
                format!("line {number}: unknown action {}", clip(fields[0])),
            ));
        };
        let event = Event {
            action,
            addr: parse(1, true)?,
            size: parse(2, false)?,
            stream: parse(3, true)?,
        };
        if events.len() as u64 >= max_events {
            return Err(too_many_events(path, max_events, &format!("line {number}")));
        }
        if events.len() == events.capacity() {
            // Doubling, but never past the most that may be held.
            let room = usize::try_from(max_events).unwrap_or(usize::MAX) - events.len();
            events.reserve_exact(events.len().max(1024).min(room));
        }
        events.push(event);
    }
    Ok(Trace { name, events })
}

/// Deeper than any memory snapshot nests (about six levels), shallow enough that decoding
/// it cannot overflow a thread's stack.
const MAX_PICKLE_DEPTH: usize = 64;

fn load_pickle(path: &Path, name: &str, raw: &[u8], limits: &Limits) -> Result<Vec<Trace>> {
    let max_events = limits.max_events;
    // The decoder builds and drops values recursively, and copies a memoized value at each
    // reference to it: a small file of nested lists would overflow the stack and abort, one
    // of many references would take time and memory far beyond its size. Measured first,
    // without decoding.
    let shape = super::pickle_depth::scan(raw).map_err(|e| bad(path, clip_message(&e)))?;
    if shape.depth > MAX_PICKLE_DEPTH {
        return Err(bad(
            path,
            format!("not a memory snapshot: containers nested {} deep (a snapshot nests a few levels; at most {MAX_PICKLE_DEPTH} are read)", shape.depth),
        ));
    }
    let most = (raw.len() as u64)
        .saturating_mul(limits.pickle_elements_per_byte)
        .saturating_add(limits.pickle_elements_floor);
    if shape.elements > most {
        return Err(bad(
            path,
            format!(
                "not a memory snapshot: it decodes to {} elements, memo references counted in full (at most {most} are read from {} bytes)",
                shape.elements,
                raw.len()
            ),
        ));
    }
    // The elements allowed above still let one memoized entry, referenced every few bytes,
    // decode to an entry per reference, each kept: the entries of the lists under the key
    // device_traces are counted before decoding too, memo references in full.
    if shape.trace_entries > max_events {
        return Err(too_many_events(
            path,
            max_events,
            &format!(
                "device_traces hold {} lists and entries, memo references counted in full",
                shape.trace_entries
            ),
        ));
    }
    let options = serde_pickle::DeOptions::new()
        .replace_unresolved_globals()
        .replace_recursive_structures();
    // Decoded into only what the replay reads: what else the snapshot holds (frames,
    // segments) is visited a value at a time and dropped, memo references included. The
    // entries kept are also counted as they are decoded (the scan above knows the key
    // device_traces only as picklers write it, not spelled with escapes).
    let budget = super::snapshot::EntryBudget::new(max_events);
    let mut decoder = serde_pickle::Deserializer::new(std::io::Cursor::new(raw), options);
    let top =
        serde::de::DeserializeSeed::deserialize(super::snapshot::TopSeed(&budget), &mut decoder)
            .and_then(|top| decoder.end().map(|()| top));
    let top = match top {
        Ok(top) => top,
        Err(_) if budget.exceeded() => {
            return Err(too_many_events(path, max_events, "device_traces"));
        }
        Err(e) => return Err(bad(path, clip_message(&format!("pickle: {e}")))),
    };
    let super::snapshot::Top::Snapshot(devices) = top else {
        return Err(bad(path, "not a memory snapshot (expected a dict)"));
    };
    let Some(devices) = devices else {
        return Err(bad(path, "no device_traces: record with torch.cuda.memory._record_memory_history() before _dump_snapshot()"));
    };
    let count = devices.len();
    let mut traces = Vec::new();
    for (device, entries) in devices.into_iter().enumerate() {
        let Some(entries) = entries else { continue };
        let mut events = Vec::with_capacity(entries.len());
        for (index, e) in entries.into_iter().enumerate() {
            let Some(action) = e.action else {
                continue;
            };
            let (Some(addr), Some(size)) = (e.addr, e.size) else {
                continue;
            };
            // As in a CSV trace: addresses and streams may be signed (their bits count), a
            // size may not.
            let Ok(size) = u64::try_from(size) else {
                return Err(bad(
                    path,
                    format!("device_traces[{device}][{index}]: {size} is not a size"),
                ));
            };
            events.push(Event {
                action,
                addr: addr as u64,
                size,
                stream: e.stream.unwrap_or(0) as u64,
            });
        }
        if !events.is_empty() {
            let name = if count > 1 {
                format!("{name}:cuda{device}")
            } else {
                name.to_string()
            };
            traces.push(Trace { name, events });
        }
    }
    if traces.is_empty() {
        return Err(bad(path, "the snapshot holds no allocator events"));
    }
    Ok(traces)
}

/// Addresses freed in the trace before any allocation or free of them: live when recording
/// began. A later free of an address that is not live (a double free in the trace) is not
/// one: the replay counts it as unmatched. Returns (addr, size, stream) in order of first
/// appearance.
pub fn live_at_start(trace: &Trace) -> Vec<(u64, u64, u64)> {
    let mut seen = std::collections::HashSet::new();
    let mut found = Vec::new();
    for e in &trace.events {
        match e.action {
            Action::Alloc => {
                seen.insert(e.addr);
            }
            Action::FreeCompleted if seen.insert(e.addr) => {
                found.push((e.addr, e.size, e.stream));
            }
            _ => {}
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// {KEY: [[e, e, e]]} for one memoized entry e (alloc of 512 bytes at 1).
    fn snapshot(key_line: &[u8]) -> Vec<u8> {
        let mut raw = b"\x80\x02}(V".to_vec();
        raw.extend(key_line);
        raw.extend(b"\n]](}(X\x06\x00\x00\x00actionX\x05\x00\x00\x00allocX\x04\x00\x00\x00");
        raw.extend(b"addrK\x01X\x04\x00\x00\x00sizeM\x00\x02uq\x01h\x01h\x01eau.");
        raw
    }

    fn load(raw: &[u8], max_events: u64) -> Result<Vec<Trace>> {
        let limits = Limits {
            max_events,
            ..Limits::default()
        };
        load_from(Path::new("t.pickle"), raw, &limits)
    }

    #[test]
    fn empty_device_lists_count_against_the_most_read() {
        // {'device_traces': [[], [], ...]}: one memoized empty list referenced 10,000 times
        // (20 KB). Each is kept as a device's trace, so each counts as an event would.
        let n = 10_000;
        let mut raw = b"\x80\x02}(X\x0d\x00\x00\x00device_traces](]q\x01".to_vec();
        raw.extend(b"h\x01".repeat(n - 1));
        raw.extend(b"eu.");
        let err = load(&raw, 1000).unwrap_err();
        assert!(
            err.message
                .contains("device_traces hold 10000 lists and entries"),
            "{}",
            err.message
        );
        // Within the limit it is read, and refused only for holding no events.
        let err = load(&raw, n as u64).unwrap_err();
        assert!(!err.message.contains("--max-events"), "{}", err.message);
    }

    #[test]
    fn entries_past_the_most_read_are_refused_while_decoding_too() {
        // Spelled with an escape, the key is not one the scan counts entries under; the
        // decoder still keeps no more than the most read.
        let raw = snapshot(br"device\u005ftraces");
        assert_eq!(
            super::super::pickle_depth::scan(&raw)
                .unwrap()
                .trace_entries,
            0
        );
        let err = load(&raw, 2).unwrap_err();
        assert!(
            err.message
                .contains("t.pickle: device_traces: more than 2 events"),
            "{}",
            err.message
        );
        assert!(err.message.contains("--max-events"), "{}", err.message);
        // Three entries and their device's list.
        let traces = load(&raw, 4).unwrap();
        assert_eq!(traces[0].events.len(), 3);
        assert_eq!(traces[0].events[2].size, 512);
        // As picklers write it, the scan refuses it before decoding.
        let err = load(&snapshot(b"device_traces"), 2).unwrap_err();
        assert!(
            err.message
                .contains("device_traces hold 4 lists and entries"),
            "{}",
            err.message
        );
    }

    #[test]
    fn csv_events_past_the_most_read_are_refused_at_their_line() {
        let csv =
            "action,addr,size,stream\nalloc,1,512,0\nsnapshot,0,0,0\nfree_completed,1,512,0\n";
        let load = |max_events| {
            let limits = Limits {
                max_events,
                ..Limits::default()
            };
            load_from(Path::new("t.csv"), csv.as_bytes(), &limits)
        };
        assert_eq!(
            load(2).unwrap()[0].events.len(),
            2,
            "a snapshot line is no event"
        );
        let err = load(1).unwrap_err();
        assert!(
            err.message.contains("t.csv: line 4: more than 1 events"),
            "{}",
            err.message
        );
    }
}
