//! A model of PyTorch's caching allocator with `expandable_segments:True`, driven by the same
//! trace as the replay, so that a replay puts ccalloc beside expandable segments on every
//! trace, not only on the workloads that were also run live with PyTorch.
//!
//! It models what sets that allocator's reservation when nothing is released (no
//! `empty_cache`, no OOM, no memory fraction): one segment of address space per (stream,
//! pool), mapped from its start in steps of 2 MiB (small pool) or 20 MiB (large pool); a
//! request takes the smallest free mapped block that fits (the lowest address among equal
//! sizes), except that the one ending where the mapping does ranks by what it could grow
//! to, so any other that fits comes first; split to size when at least 512 bytes remain;
//! when none fits, the segment maps
//! what the request lacks at its end, joined to the free block that ends there; a freed block
//! merges with its free neighbours. Sizes round to 512 bytes; requests of at most 1 MiB use
//! the small pool. Stream semantics are the trace's: a block is reusable from its
//! `free_completed` event.
//!
//! What it leaves out: `empty_cache` and the OOM path (which unmap free pages; the traces
//! here call neither), `max_split_size_mb` and `roundup_power2_divisions` (off by default),
//! and graph pools. Checked against live runs on an H200 (docs/replay.md): within 0.003
//! of the live figure on 17 of 20 workloads.

use super::trace::{self, Action, Trace};
use std::collections::{BTreeMap, BTreeSet, HashMap};

const MIN_BLOCK: u64 = 512;
const SMALL_REQUEST: u64 = 1 << 20;
const SMALL_STEP: u64 = 2 << 20;
const LARGE_STEP: u64 = 20 << 20;

/// One (stream, pool)'s segment: blocks over `[0, mapped)`; the rest is unmapped.
#[derive(Default)]
struct Segment {
    /// Block start → (size, in use).
    blocks: BTreeMap<u64, (u64, bool)>,
    /// Free blocks by (size, start): the best fit is the first at or above a size.
    free: BTreeSet<(u64, u64)>,
    mapped: u64,
}

impl Segment {
    /// The free block that ends where the mapped range does, if any: (start, size).
    fn free_tail(&self) -> Option<(u64, u64)> {
        self.blocks
            .range(..self.mapped)
            .next_back()
            .filter(|(&start, &(len, used))| !used && start + len == self.mapped)
            .map(|(&start, &(len, _))| (start, len))
    }

    /// The free block a request of `size` takes, if one fits: the smallest, except that
    /// `tail` (the block ending at the mapped range's end) ranks by what it could grow to
    /// (PyTorch's `get_free_block`), so any other that fits comes first.
    fn best_fit(&self, size: u64, tail: Option<(u64, u64)>) -> Option<(u64, u64)> {
        let mut fits = self.free.range((size, 0)..);
        let first = *fits.next()?;
        match (
            Some(first) == tail.map(|(start, len)| (len, start)),
            fits.next(),
        ) {
            (true, Some(&next)) => Some(next),
            _ => Some(first),
        }
    }

    /// Hands out `size` bytes, mapping at most `room` more in steps of `step` if no free
    /// block fits: (start, bytes mapped), or `None` (nothing changed) if it needs more.
    fn take(&mut self, size: u64, step: u64, room: u64) -> Option<(u64, u64)> {
        let tail = self.free_tail();
        let (start, added) = match self.best_fit(size, tail) {
            Some((found, start)) => {
                self.free.remove(&(found, start));
                (start, 0)
            }
            None => {
                let have = tail.map_or(0, |(_, len)| len);
                let added = (size - have)
                    .checked_next_multiple_of(step)
                    .filter(|&added| added <= room)?;
                (self.grow(tail, added), added)
            }
        };
        let (found, _) = self.blocks[&start];
        if found - size >= MIN_BLOCK {
            self.blocks.insert(start, (size, true));
            self.add_free(start + size, found - size);
        } else {
            self.blocks.insert(start, (found, true));
        }
        Some((start, added))
    }

    /// Maps `added` bytes at the segment's end, joined to `tail` (the free block that ends
    /// there, `free_tail`); returns the start of the grown free block, unlisted.
    fn grow(&mut self, tail: Option<(u64, u64)>, added: u64) -> u64 {
        let (start, have) = match tail {
            Some((start, len)) => {
                self.free.remove(&(len, start));
                (start, len)
            }
            None => (self.mapped, 0),
        };
        self.mapped += added;
        self.blocks.insert(start, (have + added, false));
        start
    }

    /// Lists `[start, start+size)` free, merged with its free neighbours.
    fn add_free(&mut self, mut start: u64, mut size: u64) {
        if let Some((&next, &(len, false))) = self.blocks.range(start + size..).next() {
            if next == start + size {
                self.free.remove(&(len, next));
                self.blocks.remove(&next);
                size += len;
            }
        }
        if let Some((&prev, &(len, false))) = self.blocks.range(..start).next_back() {
            if prev + len == start {
                self.free.remove(&(len, prev));
                self.blocks.remove(&start);
                (start, size) = (prev, len + size);
            }
        }
        self.blocks.insert(start, (size, false));
        self.free.insert((size, start));
    }

    fn release(&mut self, start: u64) {
        let (size, _) = self.blocks[&start];
        self.add_free(start, size);
    }
}

/// The modelled allocator's peak reserved bytes over `trace`'s blocks live when recording
/// began and its first `events` events (the replay's, up to where it ran out of memory), on
/// a device of `capacity` bytes.
pub fn peak_reserved(trace: &Trace, capacity: u64, events: usize) -> u64 {
    let mut model = ExpandableModel::with_capacity(capacity);
    for (addr, size, stream) in trace::live_at_start(trace) {
        model.alloc(addr, size, stream);
    }
    for e in trace.events.iter().take(events) {
        match e.action {
            Action::Alloc => model.alloc(e.addr, e.size, e.stream),
            Action::FreeCompleted => model.free(e.addr),
            _ => {}
        }
    }
    model.peak_reserved()
}

/// The modelled allocator: what it has mapped, now and at most.
struct ExpandableModel {
    segments: HashMap<(u64, bool), Segment>,
    /// Trace address → (segment key, block start).
    live: HashMap<u64, ((u64, bool), u64)>,
    mapped: u64,
    peak_mapped: u64,
    /// Device memory: a request that would map past it fails, as PyTorch's would.
    capacity: u64,
}

impl ExpandableModel {
    fn with_capacity(capacity: u64) -> Self {
        Self {
            segments: HashMap::new(),
            live: HashMap::new(),
            mapped: 0,
            peak_mapped: 0,
            capacity,
        }
    }

    /// The trace allocated `size` bytes at `addr` on `stream`. An address still live (its
    /// free was lost) is freed first, as the replay does. A request that does not fit the
    /// device is dropped (PyTorch's would raise): later frees of it are unknown.
    fn alloc(&mut self, addr: u64, size: u64, stream: u64) {
        self.free(addr);
        let rounded = size.max(1).div_ceil(MIN_BLOCK).saturating_mul(MIN_BLOCK);
        let small = rounded <= SMALL_REQUEST;
        let step = if small { SMALL_STEP } else { LARGE_STEP };
        let segment = self.segments.entry((stream, small)).or_default();
        let room = self.capacity.saturating_sub(self.mapped);
        let Some((start, added)) = segment.take(rounded, step, room) else {
            return;
        };
        self.mapped += added;
        self.peak_mapped = self.peak_mapped.max(self.mapped);
        self.live.insert(addr, ((stream, small), start));
    }

    /// The block at `addr` became reusable; an unknown address is ignored.
    fn free(&mut self, addr: u64) {
        if let Some((key, start)) = self.live.remove(&addr) {
            if let Some(segment) = self.segments.get_mut(&key) {
                segment.release(start);
            }
        }
    }

    /// The most it had mapped at once: its peak reserved bytes.
    fn peak_reserved(&self) -> u64 {
        self.peak_mapped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    #[test]
    fn a_segment_grows_in_steps_and_reuses_its_free_tail() {
        let mut m = ExpandableModel::with_capacity(1 << 40);
        m.alloc(1, 3 * MB, 0);
        assert_eq!(m.peak_reserved(), 20 * MB, "a large step is 20 MiB");
        m.alloc(2, 16 * MB, 0);
        assert_eq!(m.peak_reserved(), 20 * MB, "fits the free rest of the step");
        // 1 MiB free at the end: the next request maps only what it lacks, rounded up.
        m.alloc(3, 10 * MB, 0);
        assert_eq!(m.peak_reserved(), 40 * MB);
        m.alloc(4, 1000, 0);
        assert_eq!(
            m.peak_reserved(),
            42 * MB,
            "the small pool has its own 2 MiB steps"
        );
        m.alloc(5, 100, 7);
        assert_eq!(
            m.peak_reserved(),
            44 * MB,
            "and each stream its own segment"
        );
    }

    #[test]
    fn the_best_fit_is_the_smallest_free_block_and_frees_merge() {
        let mut m = ExpandableModel::with_capacity(1 << 40);
        for (addr, size) in [
            (1, 4 * MB),
            (2, 2 * MB),
            (3, 6 * MB),
            (4, 2 * MB),
            (5, 6 * MB),
        ] {
            m.alloc(addr, size, 0);
        }
        assert_eq!(m.peak_reserved(), 20 * MB);
        m.free(1);
        m.free(3);
        // 6 MiB free at 6 MiB beats 4 MiB at 0 for a 5 MiB request; then 4 MiB at 0
        // serves a 4 MiB one: nothing new is mapped.
        m.alloc(6, 5 * MB, 0);
        m.alloc(7, 4 * MB, 0);
        assert_eq!(m.peak_reserved(), 20 * MB);
        let seg = &m.segments[&(0, false)];
        assert_eq!(m.live[&6].1, 6 * MB);
        assert_eq!(m.live[&7].1, 0);
        // Freeing 2 MiB at 4 MiB between the two joins nothing (both neighbours in use);
        // then freeing them makes one block of 0..12 MiB.
        assert!(seg.free.iter().all(|&(size, _)| size < 4 * MB));
        m.free(2);
        m.free(6);
        m.free(7);
        let seg = &m.segments[&(0, false)];
        assert!(seg.free.contains(&(12 * MB, 0)), "{:?}", seg.free);
        m.alloc(8, 12 * MB, 0);
        assert_eq!(m.peak_reserved(), 20 * MB);
    }

    #[test]
    fn a_request_larger_than_any_free_block_joins_the_free_end() {
        let mut m = ExpandableModel::with_capacity(1 << 40);
        m.alloc(1, 15 * MB, 0);
        m.alloc(2, 15 * MB, 0);
        assert_eq!(m.peak_reserved(), 40 * MB);
        m.free(2);
        // 25 MiB free from 15 MiB to the end (40): a 30 MiB request maps 5 MiB more,
        // rounded to a 20 MiB step, and starts where the free block did.
        m.alloc(3, 30 * MB, 0);
        assert_eq!(m.peak_reserved(), 60 * MB);
        assert_eq!(m.live[&3].1, 15 * MB);
        // Unknown and repeated frees change nothing.
        m.free(99);
        m.free(3);
        m.free(3);
        m.alloc(4, 45 * MB, 0);
        assert_eq!(m.peak_reserved(), 60 * MB);
    }

    #[test]
    fn the_free_end_comes_after_any_other_block_that_fits() {
        let mut m = ExpandableModel::with_capacity(1 << 40);
        m.alloc(1, 6 * MB, 0);
        m.alloc(2, 2 * MB, 0);
        m.free(1);
        // Free: 6 MiB at 0 and 12 MiB at the end (8..20). A 5 MiB request takes the smaller.
        m.alloc(3, 5 * MB, 0);
        assert_eq!(m.live[&3].1, 0);
        // Only the end fits 7 MiB.
        m.alloc(4, 7 * MB, 0);
        assert_eq!(m.live[&4].1, 8 * MB);
        // Free: 6 MiB at 0 (after this free) and 5 MiB at the end (15..20): a 4 MiB request
        // passes over the smaller end block.
        m.free(3);
        m.alloc(5, 4 * MB, 0);
        assert_eq!(m.live[&5].1, 0);
        assert_eq!(m.peak_reserved(), 20 * MB);
    }

    #[test]
    fn requests_past_the_device_fail_and_change_nothing() {
        let mut m = ExpandableModel::with_capacity(100 * MB);
        m.alloc(1, 50 * MB, 0);
        for size in [90 * MB, u64::MAX, u64::MAX - 511, 1 << 63] {
            m.alloc(2, size, 0);
            assert_eq!(m.peak_reserved(), 60 * MB, "{size}");
            assert!(!m.live.contains_key(&2));
        }
        m.free(2);
        m.alloc(3, 10 * MB, 0);
        assert_eq!(m.peak_reserved(), 60 * MB, "the free rest still serves");
        m.alloc(4, 30 * MB, u64::MAX);
        assert_eq!(m.peak_reserved(), 100 * MB, "up to the device's size");
    }
}
