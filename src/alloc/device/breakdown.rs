//! What a device's reserved memory is made of: live bytes, and the excess over them split by
//! the cause a paging policy could act on (`DeviceAllocator::memory_breakdown`), now or at
//! the highest reserved since recording began (`record_peak_breakdown`).

// Why at the peak: the figure users and the memory target care about is peak reserved, and
// the moment that sets it is often a spike (one large activation) between two calls a
// user could make. So the device records the breakdown itself, right after an allocation
// that left reserved above the breakdown it keeps: an allocation, not a free, since only
// growth raises reserved. A breakdown is one moment's: every shard is held while it is
// taken, as for `stats`. Taken after the allocation returns, it is exact when one thread
// allocates; with others freeing meanwhile it may be of a slightly later, lower moment,
// and its `reserved_bytes` says so against the reserved peak.
//
// The cost: each walk reads every block and page. A job's reserved rises through its
// warm-up and then stays, so the walks come in the warm-up, one per growth that raises
// the high; a warm-up of thousands of one-page growths over thousands of blocks costs
// seconds (16,000 growths of 2 MiB took 10 s on the sim, 0.16 s without recording). Hence
// a setting, off by default.
//
// The walk hands each shard's thread fronts' blocks back to its cache first (as every
// `segments` does): they are free, and counted so. Growth has just done so for its own
// shard; the other shards' blocks go back a little early.

use crate::alloc::SegmentView;
use crate::BlockState;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The excess of reserved over live bytes at one moment, by cause. Paged segments only: the
/// free memory of plain segments counts as `plain_bytes`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "replay", derive(serde::Serialize))]
pub struct MemoryBreakdown {
    pub reserved_bytes: u64,
    /// Bytes of blocks handed out, or freed while other streams' work on them is pending.
    pub live_bytes: u64,
    /// Mapped chunks holding no live byte: cached memory a later growth may move.
    pub free_chunk_bytes: u64,
    /// Whole pages without a live byte inside chunks that hold some: kept because a chunk is
    /// unmapped only whole.
    pub pinned_bytes: u64,
    /// Chunks with pinned pages.
    pub pinning_chunks: u64,
    /// The free part of pages that hold some live bytes (page granularity).
    pub rounding_bytes: u64,
    /// Reserved but unmapped: chunks parked for later growth.
    pub parked_bytes: u64,
    /// Segments that are not paged (mapped whole), less their live bytes.
    pub plain_bytes: u64,
}

impl MemoryBreakdown {
    /// The bytes the parts account for (live, free chunks, pinned pages, rounding, parked
    /// and plain memory): `reserved_bytes` in every breakdown taken.
    pub fn accounted_bytes(&self) -> u64 {
        self.live_bytes
            + self.free_chunk_bytes
            + self.pinned_bytes
            + self.rounding_bytes
            + self.parked_bytes
            + self.plain_bytes
    }

    /// The breakdown of `segments` (`DeviceAllocator::segments`) with `reserved_bytes`
    /// reserved, paged segments mapping pages of `page` bytes.
    pub fn of(segments: &[SegmentView], reserved_bytes: u64, page: u64) -> Self {
        let page = page.max(1);
        let mut b = Self {
            reserved_bytes,
            ..Self::default()
        };
        let mut mapped = 0u64;
        for seg in segments {
            let live: Vec<(u64, u64)> = seg
                .blocks
                .iter()
                .filter(|&&(_, _, state)| is_live(state))
                .map(|&(addr, size, _)| (addr, size))
                .collect();
            let live_total: u64 = live.iter().map(|l| l.1).sum();
            b.live_bytes += live_total;
            let Some(chunks) = &seg.chunks else {
                b.plain_bytes += seg.size - live_total;
                mapped += seg.size;
                continue;
            };
            for &(start, len) in chunks {
                mapped += len;
                let (mut live_pages, mut live_bytes) = (0, 0);
                let mut p = start;
                while p < start + len {
                    let on_page = overlap(&live, p, p + page);
                    live_pages += (on_page > 0) as u64;
                    live_bytes += on_page;
                    p += page;
                }
                if live_pages == 0 {
                    b.free_chunk_bytes += len;
                } else {
                    let pinned = len - live_pages * page;
                    b.pinned_bytes += pinned;
                    b.pinning_chunks += (pinned > 0) as u64;
                    b.rounding_bytes += live_pages * page - live_bytes;
                }
            }
        }
        b.parked_bytes = reserved_bytes.saturating_sub(mapped);
        b
    }
}

/// Whether a block's bytes are in use: handed out, or freed with other streams' work on it
/// still pending. Free and parked blocks are cache.
fn is_live(state: BlockState) -> bool {
    matches!(state, BlockState::Allocated | BlockState::AwaitingEvents)
}

/// Bytes of the blocks `live` (sorted by address, disjoint) inside `[start, end)`.
fn overlap(live: &[(u64, u64)], start: u64, end: u64) -> u64 {
    let first = live.partition_point(|&(addr, size)| addr + size <= start);
    live[first..]
        .iter()
        .take_while(|&&(addr, _)| addr < end)
        .map(|&(addr, size)| (addr + size).min(end) - addr.max(start))
        .sum()
}

/// The breakdown at the highest reserved since recording began or peaks were reset.
#[derive(Default)]
pub(super) struct PeakRecorder {
    /// `record_peak_breakdown`: read on every allocation that reached a shard.
    recording: AtomicBool,
    /// `reserved_bytes` of the breakdown kept (0 with none): an allocation that leaves
    /// reserved above it takes a new one.
    kept_reserved: AtomicU64,
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    /// Counts starts and resets: a walk begun before one must not be kept after it.
    epoch: u64,
    breakdown: Option<MemoryBreakdown>,
}

impl PeakRecorder {
    #[inline]
    pub(super) fn recording(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    /// Whether an allocation that left `reserved()` bytes reserved should take a
    /// breakdown; `reserved` is read only while recording.
    #[inline]
    pub(super) fn wants(&self, reserved: impl FnOnce() -> u64) -> bool {
        self.recording() && reserved() > self.kept_reserved.load(Ordering::Relaxed)
    }

    fn kept(&self) -> Option<MutexGuard<'_, Kept>> {
        self.kept.lock().ok()
    }

    /// The epoch a walk starts in, for `offer`.
    pub(super) fn epoch(&self) -> u64 {
        self.kept().map_or(0, |k| k.epoch)
    }

    /// Keeps `b`, taken in `epoch`, unless a start or reset came since or a breakdown
    /// with more reserved is kept (a slower walk of an earlier peak may end later).
    pub(super) fn offer(&self, epoch: u64, b: MemoryBreakdown) {
        if let Some(mut kept) = self.kept() {
            let higher = kept
                .breakdown
                .is_none_or(|k| b.reserved_bytes > k.reserved_bytes);
            if kept.epoch == epoch && higher {
                kept.breakdown = Some(b);
                self.kept_reserved
                    .store(b.reserved_bytes, Ordering::Relaxed);
            }
        }
    }

    /// Records from now on, starting from `now` (the memory when recording starts or
    /// peaks are reset): later allocations replace it only with more reserved.
    pub(super) fn restart(&self, now: MemoryBreakdown) {
        if let Some(mut kept) = self.kept() {
            kept.epoch += 1;
            kept.breakdown = Some(now);
            self.kept_reserved
                .store(now.reserved_bytes, Ordering::Relaxed);
            self.recording.store(true, Ordering::Relaxed);
        }
    }

    pub(super) fn stop(&self) {
        if let Some(mut kept) = self.kept() {
            kept.epoch += 1;
            kept.breakdown = None;
            self.kept_reserved.store(0, Ordering::Relaxed);
            self.recording.store(false, Ordering::Relaxed);
        }
    }

    pub(super) fn recorded(&self) -> Option<MemoryBreakdown> {
        self.kept().and_then(|k| k.breakdown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::sizing::PoolKind;
    use crate::StreamId;

    #[test]
    fn overlap_counts_only_the_bytes_inside() {
        let live = [(0, 10), (20, 10), (40, 100)];
        assert_eq!(overlap(&live, 5, 25), 10);
        assert_eq!(overlap(&live, 30, 40), 0);
        assert_eq!(overlap(&live, 100, 200), 40);
    }

    fn paged(blocks: Vec<(u64, u64, BlockState)>, chunks: Vec<(u64, u64)>) -> SegmentView {
        SegmentView {
            addr: 0,
            size: 1 << 20,
            stream: StreamId(0),
            pool: PoolKind::Large,
            private_pool: None,
            requested: vec![0; blocks.len()],
            blocks,
            mapped: Some(chunks.clone()),
            chunks: Some(chunks),
        }
    }

    /// Pages of 100 bytes; a chunk of pages 0-3 with one live block on page 1, a chunk of
    /// pages 4-5 with none, and a parked block on page 6 of a third chunk.
    #[test]
    fn each_excess_byte_has_one_cause() {
        use BlockState::*;
        let seg = paged(
            vec![
                (0, 150, Free),
                (150, 30, Allocated),
                (180, 420, Free),
                (600, 40, Parked),
                (640, 60, AwaitingEvents),
                (700, 324, Free),
            ],
            vec![(0, 400), (400, 200), (600, 100)],
        );
        let b = MemoryBreakdown::of(&[seg], 900, 100);
        assert_eq!(
            b.live_bytes, 90,
            "allocated and awaiting events, not parked"
        );
        assert_eq!(b.pinned_bytes, 300);
        assert_eq!(b.pinning_chunks, 1);
        assert_eq!(b.rounding_bytes, 70 + 40);
        assert_eq!(b.free_chunk_bytes, 200);
        assert_eq!(b.parked_bytes, 200, "reserved but not mapped");
        assert_eq!(b.accounted_bytes(), b.reserved_bytes);
    }

    #[test]
    fn a_plain_segment_is_live_or_plain() {
        let mut seg = paged(vec![(0, 300, BlockState::Allocated)], vec![]);
        seg.chunks = None;
        let b = MemoryBreakdown::of(&[seg], 1 << 20, 100);
        assert_eq!((b.live_bytes, b.plain_bytes), (300, (1 << 20) - 300));
    }

    fn with_reserved(reserved_bytes: u64) -> MemoryBreakdown {
        MemoryBreakdown {
            reserved_bytes,
            ..Default::default()
        }
    }

    #[test]
    fn a_walk_is_kept_only_if_higher_and_of_this_epoch() {
        let r = PeakRecorder::default();
        assert!(!r.wants(|| 10), "off");
        r.restart(with_reserved(5));
        assert!(r.wants(|| 6) && !r.wants(|| 5));
        let before = r.epoch();
        r.offer(before, with_reserved(9));
        r.offer(before, with_reserved(7));
        assert_eq!(r.recorded(), Some(with_reserved(9)), "a slower, lower walk");
        r.restart(with_reserved(3));
        r.offer(before, with_reserved(20));
        assert_eq!(
            r.recorded(),
            Some(with_reserved(3)),
            "begun before the reset"
        );
        r.stop();
        assert!(r.recorded().is_none() && !r.wants(|| 100));
    }
}
