//! Host-side memory as a device of its own, so that the caching allocator core
//! (`DeviceAllocator`: size classes, split/merge, stream-aware reuse, statistics) caches it
//! unchanged: `HostDriver` is a one-device driver whose `allocate`/`release` hand out pinned
//! host memory (`HostKind::Pinned`) or managed memory (`HostKind::Managed`) of the wrapped
//! driver, and whose events are the wrapped driver's, on the devices the streams belong to.
//! It has no virtual memory management: segments are plain.
//!
//! Streams. A host block is used by work on streams of any device, so a stream is named by
//! the pair (device, stream): the allocator core sees a tag per pair (`tag`), and every
//! event or synchronize call is sent to the pair's device. Blocks are allocated on
//! `ALLOCATION_STREAM`, which is no real stream: every stream the caller records with
//! `record_stream` is then "another stream" to the core, whose work must finish before the
//! block is reused (the host's own accesses are not stream-ordered, unlike a device's).

use super::{lock, DevicePtr, Driver, DriverError, DriverResult, EventId, HostKind, StreamId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What the poisoned-lock errors of the two tables name.
const TAGS: &str = "the host memory's table of recorded streams";
const EVENTS: &str = "the host memory's table of events";

/// The stream every host-side block is allocated on: no real stream has this handle.
pub(crate) const ALLOCATION_STREAM: StreamId = StreamId(u64::MAX);

/// A tag names its (device, stream) by value when the stream's handle fits below the top
/// byte and the device in it (plus one, under 0xFF: no tag is `ALLOCATION_STREAM`). Real
/// CUDA stream handles do: user-space addresses (under 2^56 on x86-64 and AArch64) or the
/// special handles 0-2. Such tags need no table, so a job that makes a stream per request
/// keeps nothing per stream. Other pairs get a table entry, for the runtime's life.
const HANDLE_BITS: u32 = 56;
const HANDLE_MASK: u64 = (1 << HANDLE_BITS) - 1;
const MAX_VALUE_DEVICE: usize = 0xFD;

fn tag_by_value(device: usize, stream: StreamId) -> Option<StreamId> {
    (device <= MAX_VALUE_DEVICE && stream.0 <= HANDLE_MASK)
        .then(|| StreamId(((device as u64 + 1) << HANDLE_BITS) | stream.0))
}

fn pair_of_value(tag: StreamId) -> Option<(usize, StreamId)> {
    let top = (tag.0 >> HANDLE_BITS) as usize;
    (1..=MAX_VALUE_DEVICE + 1)
        .contains(&top)
        .then(|| (top - 1, StreamId(tag.0 & HANDLE_MASK)))
}

#[derive(Default)]
struct Tags {
    /// (device, stream) → its tag, for pairs `tag_by_value` cannot name; these tags are
    /// indices into `pairs`, plus one (under 2^56, so apart from tags by value).
    by_pair: HashMap<(usize, StreamId), StreamId>,
    pairs: Vec<(usize, StreamId)>,
    /// Every device a tag has named.
    devices: std::collections::BTreeSet<usize>,
}

pub(crate) struct HostDriver {
    inner: Arc<dyn Driver>,
    kind: HostKind,
    tags: Mutex<Tags>,
    /// Each live event's device.
    events: Mutex<HashMap<u64, usize>>,
}

impl HostDriver {
    pub(crate) fn new(inner: Arc<dyn Driver>, kind: HostKind) -> Self {
        Self {
            inner,
            kind,
            tags: Mutex::new(Tags::default()),
            events: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn kind(&self) -> HostKind {
        self.kind
    }

    /// The stream id the allocator core uses for `stream` of `device`.
    pub(crate) fn tag(&self, device: usize, stream: StreamId) -> crate::error::Result<StreamId> {
        let mut tags = crate::sync::lock(&self.tags, TAGS)?;
        tags.devices.insert(device);
        if let Some(tag) = tag_by_value(device, stream) {
            return Ok(tag);
        }
        if let Some(&tag) = tags.by_pair.get(&(device, stream)) {
            return Ok(tag);
        }
        tags.pairs.push((device, stream));
        let tag = StreamId(tags.pairs.len() as u64);
        tags.by_pair.insert((device, stream), tag);
        Ok(tag)
    }

    /// The (device, stream) a tag stands for.
    fn untag(&self, call: &'static str, tag: StreamId) -> DriverResult<Option<(usize, StreamId)>> {
        if let Some(pair) = pair_of_value(tag) {
            return Ok(Some(pair));
        }
        let tags = lock(&self.tags, call, TAGS)?;
        let index = usize::try_from(tag.0).ok().and_then(|i| i.checked_sub(1));
        Ok(index.and_then(|i| tags.pairs.get(i).copied()))
    }

    fn untag_or_fail(&self, call: &'static str, tag: StreamId) -> DriverResult<(usize, StreamId)> {
        self.untag(call, tag)?.ok_or_else(|| DriverError::Failed {
            call,
            detail: format!(
                "stream {:#x} is not a recorded stream of host memory",
                tag.0
            ),
        })
    }

    fn event_device(&self, call: &'static str, event: EventId) -> DriverResult<usize> {
        let events = lock(&self.events, call, EVENTS)?;
        Ok(events.get(&event.0).copied().unwrap_or(0))
    }

    /// Devices with a recorded stream: the only ones whose work may use these blocks.
    fn used_devices(&self, call: &'static str) -> DriverResult<Vec<usize>> {
        let tags = lock(&self.tags, call, TAGS)?;
        Ok(tags.devices.iter().copied().collect())
    }
}

impl Driver for HostDriver {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn device_count(&self) -> usize {
        1
    }

    fn total_memory(&self, _device: usize) -> DriverResult<u64> {
        self.inner.host_memory(self.kind)
    }

    fn allocate(&self, _device: usize, size: u64) -> DriverResult<DevicePtr> {
        self.inner.host_allocate(self.kind, size)
    }

    fn release(&self, _device: usize, ptr: DevicePtr, size: u64) -> DriverResult<()> {
        self.inner.host_release(self.kind, ptr, size)
    }

    fn record_event(&self, _device: usize, stream: StreamId) -> DriverResult<EventId> {
        let (device, stream) = self.untag_or_fail("record_event", stream)?;
        let event = self.inner.record_event(device, stream)?;
        lock(&self.events, "record_event", EVENTS)?.insert(event.0, device);
        Ok(event)
    }

    fn event_done(&self, _device: usize, event: EventId) -> DriverResult<bool> {
        self.inner
            .event_done(self.event_device("event_done", event)?, event)
    }

    fn wait_event(&self, _device: usize, event: EventId) -> DriverResult<()> {
        self.inner
            .wait_event(self.event_device("wait_event", event)?, event)
    }

    fn destroy_event(&self, _device: usize, event: EventId) {
        // Poisoned, the device is unknown: the event is left alone (leaked), never given to
        // the wrong device.
        let Ok(mut events) = self.events.lock() else {
            return;
        };
        let device = events.remove(&event.0).unwrap_or(0);
        drop(events);
        self.inner.destroy_event(device, event)
    }

    fn synchronize(&self, _device: usize) -> DriverResult<()> {
        for device in self.used_devices("synchronize")? {
            self.inner.synchronize(device)?;
        }
        Ok(())
    }

    fn synchronize_stream(&self, _device: usize, stream: StreamId) -> DriverResult<()> {
        match self.untag("synchronize_stream", stream)? {
            Some((device, stream)) => self.inner.synchronize_stream(device, stream),
            // The allocation stream has no work of its own.
            None => Ok(()),
        }
    }

    fn releases_outgrown_segments(&self) -> bool {
        matches!(self.kind, HostKind::Pinned)
    }

    fn min_free_fence_interval(&self) -> std::time::Duration {
        self.inner.min_free_fence_interval()
    }
}
