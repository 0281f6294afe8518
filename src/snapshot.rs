//! Memory snapshots: every segment with its blocks, plus the recorded history, in the shape
//! of PyTorch's `torch.cuda.memory._snapshot()`, so that PyTorch's viewer
//! (`python -m torch.cuda._memory_viz`) and `ccalloc replay` read what ccalloc writes.
//!
//! A paged segment is one address range per stream with memory mapped only where blocks
//! need it; it is shown as one segment per mapped run, each holding the parts of blocks
//! that lie in it, so that segment sizes add up to the reserved bytes, as PyTorch's do.

use crate::alloc::blocks::BlockState;
use crate::alloc::sizing::PoolKind;
use crate::alloc::SegmentView;
use crate::driver::DevicePtr;
use crate::error::{Error, ErrorKind, Result};
use crate::history::{self, Entry};
use crate::runtime::Runtime;
use serde_pickle::{HashableValue, Value};
use std::collections::BTreeMap;

/// A block's state with PyTorch's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum BlockStatus {
    /// Free (cached).
    Inactive = 0,
    /// Handed out.
    ActiveAllocated = 1,
    /// Freed, but other streams it was recorded on may still use it.
    ActivePendingFree = 2,
}

impl BlockStatus {
    fn of(state: BlockState) -> Self {
        match state {
            BlockState::Allocated => BlockStatus::ActiveAllocated,
            BlockState::AwaitingEvents => BlockStatus::ActivePendingFree,
            BlockState::Free | BlockState::Parked => BlockStatus::Inactive,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            BlockStatus::Inactive => "inactive",
            BlockStatus::ActiveAllocated => "active_allocated",
            BlockStatus::ActivePendingFree => "active_pending_free",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub address: DevicePtr,
    pub size: u64,
    pub requested_size: u64,
    pub status: BlockStatus,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    pub device: i32,
    pub address: DevicePtr,
    pub total_size: u64,
    pub stream: u64,
    pub is_large: bool,
    pub is_expandable: bool,
    pub private_pool: (u64, u64),
    pub blocks: Vec<Block>,
}

impl Segment {
    fn sum(&self, keep: impl Fn(&Block) -> bool, size: impl Fn(&Block) -> u64) -> u64 {
        self.blocks.iter().filter(|b| keep(b)).map(size).sum()
    }

    pub(crate) fn allocated_size(&self) -> u64 {
        self.sum(|b| b.status == BlockStatus::ActiveAllocated, |b| b.size)
    }

    pub(crate) fn active_size(&self) -> u64 {
        self.sum(|b| b.status != BlockStatus::Inactive, |b| b.size)
    }

    pub(crate) fn requested_size(&self) -> u64 {
        self.sum(|_| true, |b| b.requested_size)
    }
}

/// One moment's segments, and the history recorded up to it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Snapshot {
    pub segments: Vec<Segment>,
    pub trace: Vec<Entry>,
    pub device_count: usize,
}

/// Takes a snapshot of `device` (every started device with `None`). Devices never used
/// have no segments. With `include_trace`, the history recorded so far comes with it and
/// the snapshot is itself recorded; without, the history is left untouched (a pool check
/// needs segments only, and copying a ring of up to 2^24 events would dwarf it).
pub(crate) fn take(rt: &Runtime, device: Option<usize>, include_trace: bool) -> Result<Snapshot> {
    let device_count = rt.device_count();
    if let Some(d) = device {
        if d >= device_count {
            return Err(Error::new(
                ErrorKind::InvalidDevice,
                format!("device {d} does not exist ({device_count} devices)"),
            ));
        }
    }
    let mut segments = Vec::new();
    for allocator in rt.started_devices() {
        if device.is_some_and(|d| d != allocator.device()) {
            continue;
        }
        for view in allocator.segments()? {
            segments.extend(split(allocator.device() as i32, &view));
        }
    }
    let trace = if include_trace {
        let snapshot = history::Action::Snapshot;
        history::record(snapshot, device.unwrap_or(0) as i32, 0, 0, 0);
        history::entries(device.map(|d| d as i32))?
    } else {
        Vec::new()
    };
    Ok(Snapshot {
        segments,
        trace,
        device_count,
    })
}

/// The segments a view shows: itself for a plain segment, each mapped run for a paged one.
fn split(device: i32, view: &SegmentView) -> Vec<Segment> {
    let runs = match &view.mapped {
        None => vec![(view.addr, view.size)],
        Some(runs) => runs.clone(),
    };
    runs.into_iter()
        .map(|(start, len)| {
            let end = start + len;
            let blocks = view
                .blocks
                .iter()
                .zip(&view.requested)
                .filter(|((addr, size, _), _)| *addr < end && addr + size > start)
                .map(|(&(addr, size, state), &requested)| {
                    let (from, to) = (addr.max(start), (addr + size).min(end));
                    Block {
                        address: from,
                        size: to - from,
                        requested_size: requested,
                        status: BlockStatus::of(state),
                    }
                })
                .collect();
            Segment {
                device,
                address: start,
                total_size: len,
                stream: view.stream.0,
                is_large: view.pool == PoolKind::Large,
                is_expandable: view.mapped.is_some(),
                private_pool: view.private_pool.unwrap_or((0, 0)),
                blocks,
            }
        })
        .collect()
}

fn key(name: &str) -> HashableValue {
    HashableValue::String(name.to_string())
}

fn int(v: u64) -> Value {
    Value::I64(v.min(i64::MAX as u64) as i64)
}

fn dict(items: Vec<(&str, Value)>) -> Value {
    Value::Dict(
        items
            .into_iter()
            .map(|(k, v)| (key(k), v))
            .collect::<BTreeMap<_, _>>(),
    )
}

impl Snapshot {
    /// The snapshot as PyTorch's pickled dict (`_dump_snapshot`): `segments`,
    /// `device_traces` (one list per device) and `allocator_settings`. Frames are empty:
    /// only a host that records them (PyTorch's adapter) has them.
    pub(crate) fn to_pickle(&self) -> Result<Vec<u8>> {
        let segments = self
            .segments
            .iter()
            .map(|s| {
                let blocks = s
                    .blocks
                    .iter()
                    .map(|b| {
                        dict(vec![
                            ("address", int(b.address)),
                            ("size", int(b.size)),
                            ("requested_size", int(b.requested_size)),
                            ("state", Value::String(b.status.name().into())),
                            ("frames", Value::List(vec![])),
                        ])
                    })
                    .collect();
                dict(vec![
                    ("device", Value::I64(s.device as i64)),
                    ("address", int(s.address)),
                    ("total_size", int(s.total_size)),
                    ("allocated_size", int(s.allocated_size())),
                    ("active_size", int(s.active_size())),
                    ("requested_size", int(s.requested_size())),
                    ("stream", int(s.stream)),
                    (
                        "segment_type",
                        Value::String(if s.is_large { "large" } else { "small" }.into()),
                    ),
                    (
                        "segment_pool_id",
                        Value::Tuple(vec![int(s.private_pool.0), int(s.private_pool.1)]),
                    ),
                    ("is_expandable", Value::Bool(s.is_expandable)),
                    ("frames", Value::List(vec![])),
                    ("blocks", Value::List(blocks)),
                ])
            })
            .collect();
        let devices = self.device_count.max(1);
        let mut traces = vec![Vec::new(); devices];
        for e in &self.trace {
            let Some(list) = traces.get_mut(e.device.max(0) as usize) else {
                continue;
            };
            list.push(dict(vec![
                ("action", Value::String(e.action.name().into())),
                ("addr", int(e.addr)),
                ("size", int(e.size)),
                ("stream", int(e.stream)),
                ("time_us", Value::I64(e.time_us)),
                ("frames", Value::List(vec![])),
            ]));
        }
        let snapshot = dict(vec![
            ("segments", Value::List(segments)),
            (
                "device_traces",
                Value::List(traces.into_iter().map(Value::List).collect()),
            ),
            ("allocator_settings", dict(vec![])),
            ("external_annotations", Value::List(vec![])),
        ]);
        serde_pickle::value_to_vec(&snapshot, serde_pickle::SerOptions::new())
            .map_err(|e| Error::new(ErrorKind::Internal, format!("snapshot pickle: {e}")))
    }
}
