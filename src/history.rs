//! Allocation history for memory snapshots: a bounded ring of events in the form of
//! PyTorch's `device_traces` (`torch.cuda.memory._record_memory_history`), kept only while
//! recording is on.
//!
//! Invariants:
//! - With recording off, every hook costs one relaxed atomic load and nothing else: the
//!   hooks sit on the allocation path.
//! - Entries are kept in the order they were recorded, with a sequence number that only
//!   grows; at most `max_entries` are kept, the oldest dropped first. A host that keeps data
//!   for entries (PyTorch's stack frames, keyed by `context`) may drop what belongs to
//!   sequence numbers below `oldest_seq()`.
//! - A block's `free_completed` follows its `free_requested`: at once unless the allocator
//!   said the free waits for other streams' work (`free_delayed`, called within the
//!   allocator's free, before the caller's `freed`), and then when `reusable` says that work
//!   is done. `record_stream` alone decides nothing: on the block's own stream it adds no
//!   wait.

use crate::error::Result;
use crate::sync::lock;
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// What happened, with PyTorch's action names (`TraceEntry::Action`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Action {
    Alloc = 0,
    FreeRequested = 1,
    FreeCompleted = 2,
    SegmentAlloc = 3,
    SegmentFree = 4,
    SegmentMap = 5,
    SegmentUnmap = 6,
    Snapshot = 7,
    Oom = 8,
}

impl Action {
    fn is_segment_event(self) -> bool {
        matches!(
            self,
            Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap
        )
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Snapshot => "snapshot",
            Action::Oom => "oom",
        }
    }
}

/// One recorded event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub seq: u64,
    pub action: Action,
    pub device: i32,
    /// The block's or range's address; for `Oom`, the bytes the device had free.
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    pub time_us: i64,
    /// The host's tag for this event (`set_thread_context`); 0 when none.
    pub context: u64,
}

/// What recording knows of a live block: its requested size, and whether the allocator
/// made its free wait for other streams (then its free completes at `reusable`).
#[derive(Clone, Copy)]
struct LiveBlock {
    size: u64,
    stream: u64,
    delayed: bool,
}

#[derive(Default)]
struct Recorder {
    entries: VecDeque<Entry>,
    max_entries: usize,
    next_seq: u64,
    /// Blocks allocated while recording, by (device, address); freed ones awaiting their
    /// other streams keep their entry until `free_completed`.
    live: HashMap<(i32, u64), LiveBlock>,
    awaiting: HashMap<(i32, u64), LiveBlock>,
}

static RECORDING: AtomicBool = AtomicBool::new(false);
static RECORDER: Mutex<Option<Recorder>> = Mutex::new(None);

/// Called with every segment event, recording or not (PyTorch's trace trackers: NCCL
/// registers segments as they come and go). It runs under the device's lock: it must not
/// call back into ccalloc.
pub(crate) type SegmentObserver = Box<dyn Fn(&Entry) + Send + Sync>;
static OBSERVED: AtomicBool = AtomicBool::new(false);
static OBSERVERS: Mutex<Vec<SegmentObserver>> = Mutex::new(Vec::new());

/// Adds an observer of segment events (they are never removed: PyTorch has no call for it).
pub(crate) fn observe_segments(observer: SegmentObserver) -> Result<()> {
    lock(&OBSERVERS, "the segment observers")?.push(observer);
    OBSERVED.store(true, Ordering::Release);
    Ok(())
}

thread_local! {
    static CONTEXT: Cell<u64> = const { Cell::new(0) };
}

/// The most entries a recorder keeps, whatever is asked: each costs about 64 bytes.
pub(crate) const MAX_ENTRIES_LIMIT: usize = 1 << 24;

fn recorder() -> Result<std::sync::MutexGuard<'static, Option<Recorder>>> {
    lock(&RECORDER, "the allocation history")
}

/// Runs a recording hook on the recorder, if there is one. The hooks sit on the allocator's
/// paths and have no way to report: with the lock poisoned they record nothing, and the
/// next call that reads or changes the history reports it.
fn with_recorder(hook: impl FnOnce(&mut Recorder)) {
    if let Ok(mut guard) = recorder() {
        if let Some(r) = guard.as_mut() {
            hook(r);
        }
    }
}

/// Starts (or, with `enabled` false, stops) recording. `clear` drops what was recorded.
/// `max_entries` bounds the ring (0 keeps none but the live-block table).
pub(crate) fn set_recording(enabled: bool, max_entries: usize, clear: bool) -> Result<()> {
    let mut guard = recorder()?;
    let r = guard.get_or_insert_with(Recorder::default);
    r.max_entries = max_entries.min(MAX_ENTRIES_LIMIT);
    // Dropped, not cleared: a cleared container keeps its capacity, up to twice a million
    // entries of 56 bytes (Python's default ring) held for the rest of the process.
    if clear {
        r.entries = Default::default();
    }
    if !enabled {
        r.live = Default::default();
        r.awaiting = Default::default();
    }
    while r.entries.len() > r.max_entries {
        r.entries.pop_front();
    }
    if r.entries.capacity() > 2 * r.max_entries.max(r.entries.len()) {
        r.entries.shrink_to_fit();
    }
    RECORDING.store(enabled, Ordering::Release);
    Ok(())
}

#[inline]
pub(crate) fn is_recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

/// Tags the calling thread's next recorded event (then cleared): how a host attaches its
/// own data, such as stack frames, to the allocation it is about to make.
pub(crate) fn set_thread_context(context: u64) {
    let _ = CONTEXT.try_with(|c| c.set(context));
}

fn take_thread_context() -> u64 {
    CONTEXT.try_with(|c| c.replace(0)).unwrap_or(0)
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

fn push(r: &mut Recorder, action: Action, device: i32, addr: u64, size: u64, stream: u64) {
    let context = match action {
        Action::Alloc | Action::FreeRequested => take_thread_context(),
        _ => 0,
    };
    let seq = r.next_seq;
    r.next_seq += 1;
    if r.max_entries == 0 {
        return;
    }
    if r.entries.len() == r.max_entries {
        r.entries.pop_front();
    }
    r.entries.push_back(Entry {
        seq,
        action,
        device,
        addr,
        size,
        stream,
        time_us: now_us(),
        context,
    });
}

/// Records an event that concerns no block (segments, OOMs, snapshots), and hands segment
/// events to the observers.
pub(crate) fn record(action: Action, device: i32, addr: u64, size: u64, stream: u64) {
    if OBSERVED.load(Ordering::Relaxed) && action.is_segment_event() {
        let entry = Entry {
            seq: 0,
            action,
            device,
            addr,
            size,
            stream,
            time_us: now_us(),
            context: 0,
        };
        // Poisoned: no observer is called (see `with_recorder`).
        if let Ok(observers) = lock(&OBSERVERS, "the segment observers") {
            let _refuse_calls = crate::runtime::ObserverScope::enter();
            for observer in observers.iter() {
                observer(&entry);
            }
        }
    }
    if !is_recording() {
        return;
    }
    with_recorder(|r| push(r, action, device, addr, size, stream));
}

/// A block was handed out.
#[inline]
pub(crate) fn allocated(device: i32, addr: u64, size: u64, stream: u64) {
    if is_recording() {
        record_allocated(device, addr, size, stream);
    }
}

#[cold]
#[inline(never)]
fn record_allocated(device: i32, addr: u64, size: u64, stream: u64) {
    with_recorder(|r| {
        let block = LiveBlock {
            size,
            stream,
            delayed: false,
        };
        r.live.insert((device, addr), block);
        push(r, Action::Alloc, device, addr, size, stream);
    });
}

/// The allocator is freeing block `addr`, and its reuse waits for other streams' work: its
/// `free_completed` comes at `reusable`. Called before the caller's `freed`.
pub(crate) fn free_delayed(device: i32, addr: u64) {
    if !is_recording() {
        return;
    }
    with_recorder(|r| {
        if let Some(b) = r.live.get_mut(&(device, addr)) {
            b.delayed = true;
        }
    });
}

/// A block was freed by its caller: `free_requested`, and `free_completed` too unless other
/// streams still use it. A block allocated before recording began is recorded with size 0.
#[inline]
pub(crate) fn freed(device: i32, addr: u64) {
    if is_recording() {
        record_freed(device, addr);
    }
}

#[cold]
#[inline(never)]
fn record_freed(device: i32, addr: u64) {
    with_recorder(|r| {
        let block = r.live.remove(&(device, addr)).unwrap_or(LiveBlock {
            size: 0,
            stream: 0,
            delayed: false,
        });
        push(
            r,
            Action::FreeRequested,
            device,
            addr,
            block.size,
            block.stream,
        );
        if block.delayed {
            r.awaiting.insert((device, addr), block);
        } else {
            push(
                r,
                Action::FreeCompleted,
                device,
                addr,
                block.size,
                block.stream,
            );
        }
    });
}

/// A block freed while other streams used it became reusable. This may come before the
/// caller's `freed` (the allocator synchronized at once, or another thread saw the work
/// done first): the free then completes with its request.
pub(crate) fn reusable(device: i32, addr: u64) {
    if !is_recording() {
        return;
    }
    with_recorder(|r| {
        if let Some(b) = r.live.get_mut(&(device, addr)) {
            b.delayed = false;
        } else if let Some(block) = r.awaiting.remove(&(device, addr)) {
            push(
                r,
                Action::FreeCompleted,
                device,
                addr,
                block.size,
                block.stream,
            );
        }
    });
}

/// The recorded entries (of `device`, or all with `None`), oldest first.
pub(crate) fn entries(device: Option<i32>) -> Result<Vec<Entry>> {
    Ok(recorder()?
        .as_ref()
        .map(|r| {
            r.entries
                .iter()
                .filter(|e| device.is_none_or(|d| e.device == d))
                .cloned()
                .collect()
        })
        .unwrap_or_default())
}

/// The sequence number of the oldest entry kept (the next one's when none is kept).
pub(crate) fn oldest_seq() -> Result<u64> {
    Ok(recorder()?
        .as_ref()
        .map(|r| r.entries.front().map_or(r.next_seq, |e| e.seq))
        .unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the recorder is process-wide.
    #[test]
    fn records_in_order_bounded_and_completes_shared_frees_later() {
        set_recording(true, 6, true).unwrap();
        set_thread_context(42);
        allocated(0, 0x1000, 100, 7);
        allocated(0, 0x2000, 200, 7);
        free_delayed(0, 0x2000);
        freed(0, 0x1000);
        freed(0, 0x2000);
        let names: Vec<_> = entries(Some(0)).unwrap().iter().map(|e| e.action).collect();
        assert_eq!(
            names,
            [
                Action::Alloc,
                Action::Alloc,
                Action::FreeRequested,
                Action::FreeCompleted,
                Action::FreeRequested
            ]
        );
        assert_eq!(entries(Some(0)).unwrap()[0].context, 42);
        assert_eq!(
            entries(Some(0)).unwrap()[1].context,
            0,
            "a context tags one event"
        );
        assert_eq!(entries(Some(0)).unwrap()[4].size, 200);
        reusable(0, 0x2000);
        reusable(0, 0x2000);
        let all = entries(None).unwrap();
        assert_eq!(all.last().unwrap().action, Action::FreeCompleted);
        assert_eq!(all.len(), 6, "a second reusable() records nothing");
        record(Action::SegmentAlloc, 0, 0x9000, 4096, 0);
        let all = entries(None).unwrap();
        assert_eq!(all.len(), 6, "bounded: the oldest was dropped");
        assert_eq!(oldest_seq().unwrap(), all[0].seq);
        assert!(all.windows(2).all(|w| w[0].seq < w[1].seq));
        set_recording(false, 6, false).unwrap();
        allocated(0, 0x3000, 1, 0);
        assert_eq!(
            entries(None).unwrap().len(),
            6,
            "nothing recorded while off"
        );
        set_recording(false, 0, true).unwrap();
        assert!(entries(None).unwrap().is_empty());
    }
}
