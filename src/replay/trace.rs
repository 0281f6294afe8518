//! Allocator traces: the CSV format of shared/traces (`action,addr,size,stream`, optionally
//! gzip'd) and PyTorch's own snapshot pickles (`torch.cuda.memory._dump_snapshot()`).

use crate::error::{Error, ErrorKind, Result};
use serde_pickle::value::{HashableValue, Value};
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

fn action_of(name: &str) -> Option<Action> {
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

/// Reads one file: a CSV trace (plain or .gz) or a PyTorch snapshot pickle (one trace per
/// device that has events).
pub fn load(path: &Path) -> Result<Vec<Trace>> {
    let mut raw = Vec::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_end(&mut raw))
        .map_err(|e| bad(path, e))?;
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut plain = Vec::new();
        // Every member: `cat a.gz b.gz`, pigz and bgzip write several.
        flate2::read::MultiGzDecoder::new(&raw[..])
            .read_to_end(&mut plain)
            .map_err(|e| bad(path, format!("gzip: {e}")))?;
        raw = plain;
    }
    let name = trace_name(path);
    if raw.first() == Some(&0x80) {
        return load_pickle(path, &name, &raw);
    }
    Ok(vec![load_csv(path, name, &raw)?])
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

fn load_csv(path: &Path, name: String, raw: &[u8]) -> Result<Trace> {
    let mut events = Vec::new();
    let mut lines = BufReader::new(raw).lines();
    let header = lines
        .next()
        .transpose()
        .map_err(|e| bad(path, e))?
        .unwrap_or_default();
    if header.trim() != "action,addr,size,stream" {
        return Err(bad(
            path,
            format!("expected the header action,addr,size,stream, found {header:?}"),
        ));
    }
    for (i, line) in lines.enumerate() {
        let line = line.map_err(|e| bad(path, e))?;
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
                    bad(path, format!("line {}: {text:?} is not {what}", i + 2))
                })
        };
        if fields.len() != 4 {
            return Err(bad(path, format!("line {}: expected 4 fields", i + 2)));
        }
        let Some(action) = action_of(fields[0]) else {
            // PyTorch's other trace actions carry no allocation; anything else is a
            // damaged trace, not something to skip quietly.
            if NON_ALLOCATION_ACTIONS.contains(&fields[0]) {
                continue;
            }
            return Err(bad(
                path,
                format!("line {}: unknown action {:?}", i + 2, fields[0]),
            ));
        };
        events.push(Event {
            action,
            addr: parse(1, true)?,
            size: parse(2, false)?,
            stream: parse(3, true)?,
        });
    }
    Ok(Trace { name, events })
}

fn key(name: &str) -> HashableValue {
    HashableValue::String(name.to_string())
}

fn as_u64(value: Option<&Value>) -> Option<u64> {
    match value? {
        Value::I64(v) => Some(*v as u64),
        Value::Int(big) => u64::try_from(big).ok(),
        Value::None => Some(0),
        _ => None,
    }
}

/// Deeper than any memory snapshot nests (about six levels), shallow enough that decoding
/// it cannot overflow a thread's stack.
const MAX_PICKLE_DEPTH: usize = 64;

fn load_pickle(path: &Path, name: &str, raw: &[u8]) -> Result<Vec<Trace>> {
    // The decoder builds and drops values recursively: a small file of nested lists would
    // overflow the stack and abort. Measured first, without decoding.
    let depth = super::pickle_depth::pickle_depth(raw).map_err(|e| bad(path, e))?;
    if depth > MAX_PICKLE_DEPTH {
        return Err(bad(
            path,
            format!("not a memory snapshot: containers nested {depth} deep (a snapshot nests a few levels; at most {MAX_PICKLE_DEPTH} are read)"),
        ));
    }
    let options = serde_pickle::DeOptions::new()
        .replace_unresolved_globals()
        .replace_recursive_structures();
    let value = serde_pickle::value_from_slice(raw, options)
        .map_err(|e| bad(path, format!("pickle: {e}")))?;
    let Value::Dict(snapshot) = value else {
        return Err(bad(path, "not a memory snapshot (expected a dict)"));
    };
    let Some(Value::List(devices)) = snapshot.get(&key("device_traces")) else {
        return Err(bad(path, "no device_traces: record with torch.cuda.memory._record_memory_history() before _dump_snapshot()"));
    };
    let mut traces = Vec::new();
    for (device, entries) in devices.iter().enumerate() {
        let Value::List(entries) = entries else {
            continue;
        };
        let mut events = Vec::with_capacity(entries.len());
        for entry in entries {
            let Value::Dict(e) = entry else { continue };
            let Some(Value::String(action)) = e.get(&key("action")) else {
                continue;
            };
            let Some(action) = action_of(action) else {
                continue;
            };
            let (Some(addr), Some(size)) =
                (as_u64(e.get(&key("addr"))), as_u64(e.get(&key("size"))))
            else {
                continue;
            };
            let stream = as_u64(e.get(&key("stream"))).unwrap_or(0);
            events.push(Event {
                action,
                addr,
                size,
                stream,
            });
        }
        if !events.is_empty() {
            let name = if devices.len() > 1 {
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
