//! Parked blocks: freed paged blocks waiting, unmerged and unlisted, for the next request of
//! exactly their size on their stream.

use super::State;
use crate::alloc::core::blocks::BlockId;
use crate::alloc::core::reuse::ReuseGate;
use crate::driver::{DevicePtr, StreamId};

/// Parked blocks (see `State::park`): at most this many per device; those of up to
/// `SMALL_PARKED_SIZE` (the small pool's) hold at most `PARKED_MAX_SMALL_BYTES` in all, many
/// of them, since they are what a training step frees and asks for most often. Larger ones
/// need no byte bound: any request that would map pages flushes them first.
const PARKED_MAX_BLOCKS: usize = 64;
const PARKED_MAX_SMALL_BYTES: u64 = 4 << 20;
const SMALL_PARKED_SIZE: u64 = 1 << 20;

/// When a full set of parked blocks saw fewer than one reuse per this many parks, the
/// pattern is not same-size reuse (random sizes): parking pauses for `PARKING_PAUSE` frees.
const PARKS_PER_REUSE: u64 = 4;
const PARKING_PAUSE: u32 = 1024;

/// Freed paged blocks by (stream, size), each list newest last.
#[derive(Default)]
pub(super) struct Parked {
    by_size: rustc_hash::FxHashMap<(StreamId, u64), Vec<BlockId>>,
    /// Bytes in parked blocks of at most `SMALL_PARKED_SIZE`.
    small_bytes: u64,
    count: usize,
    /// Parks and reuses since the parked blocks last filled up, and the pause they may set.
    gate: ReuseGate,
}

impl Parked {
    pub(super) fn count(&self) -> usize {
        self.count
    }

    /// (count, small bytes, frees before parking resumes).
    #[cfg(test)]
    pub(super) fn figures(&self) -> (usize, u64, u32) {
        (self.count, self.small_bytes, self.gate.paused_for())
    }
}

impl State {
    /// Caches a freed block the fast way when it may be: a paged block of the general cache
    /// waits unmerged and unlisted for the next request of exactly its size on its stream,
    /// the common case of a training loop, skipping the free lists and split/merge both
    /// ways. Returns `None` when the block is not eligible (the caller then `cache`s it),
    /// else whether a fence is due (as `cache`). Bounded: when full, every parked block is
    /// flushed to the free lists first. With page moves, a parked block never costs memory:
    /// any request that would map pages flushes them all first (`malloc`), as does every
    /// slow path. Without them (the last growth was refused its moves, `MoveClock::refused`:
    /// `page_moves` off, or the allowance refilling) blocks do not park: going back to its
    /// old place, a block decides where later growth maps pages for good (docs/paging.md).
    /// Only paged blocks park: they count no inactive splits, so the statistics read exactly
    /// as if the block had merged; plain segments keep PyTorch's figures for those.
    /// `frees`: as `cache_freed`. `parkable`: the block is paged and of the general cache
    /// (`TakenBack::parkable`).
    #[inline]
    pub fn park(&mut self, id: BlockId, parkable: bool, frees: u32) -> Option<bool> {
        // Checked inlined: most frees of a pattern that parks nothing stop here.
        if !parkable || self.parked.gate.pausing() || self.paging.moves.refused() {
            return None;
        }
        debug_assert!({
            let block = self.book.blocks.get(id);
            block.paged() && block.owner().is_none()
        });
        self.park_eligible(id, frees)
    }

    /// `park` for a paged block of the general cache while parking does not pause.
    #[inline(never)]
    fn park_eligible(&mut self, id: BlockId, frees: u32) -> Option<bool> {
        let block = self.book.blocks.get(id);
        let (size, stream) = (block.size(), block.stream());
        let small = size <= SMALL_PARKED_SIZE;
        if (small && self.parked.small_bytes + size > PARKED_MAX_SMALL_BYTES)
            || self.parked.count == PARKED_MAX_BLOCKS
        {
            let reused_rarely = self.parked.gate.review(PARKS_PER_REUSE, PARKING_PAUSE);
            self.flush_parked();
            if reused_rarely {
                return None;
            }
        }
        self.parked.gate.note_set_aside();
        let fence_due = self.end_use(id, frees);
        self.book.blocks.get_mut(id).mark_parked();
        self.parked
            .by_size
            .entry((stream, size))
            .or_default()
            .push(id);
        if small {
            self.parked.small_bytes += size;
        }
        self.parked.count += 1;
        Some(fence_due)
    }

    /// Whether parking pauses now (blocks were rarely reused).
    pub fn parking_paused(&self) -> bool {
        self.parked.gate.paused_for() > 0
    }

    /// Counts `n` blocks a thread front reused where parking would have: each as a park
    /// and its reuse, so that the parking's reuse record reads as without the front.
    pub fn note_parked_reuses(&mut self, n: u32) {
        for _ in 0..n {
            self.parked.gate.note_set_aside();
            self.parked.gate.note_reuse();
        }
    }

    /// Hands out a parked block of exactly `rounded` bytes on `stream`, if there is one.
    /// Inline, so that a job that parks nothing pays one compare per allocation.
    #[inline]
    pub fn take_parked(
        &mut self,
        stream: StreamId,
        rounded: u64,
        requested: u64,
    ) -> Option<DevicePtr> {
        if self.parked.count == 0 {
            return None;
        }
        self.take_parked_block(stream, rounded, requested)
    }

    /// `take_parked` with some block parked.
    #[inline(never)]
    fn take_parked_block(
        &mut self,
        stream: StreamId,
        rounded: u64,
        requested: u64,
    ) -> Option<DevicePtr> {
        // A size's entry goes with its last block: a job that parks each size once (new
        // sizes every batch, a stream per request) would otherwise keep one per size ever
        // parked whenever its parked blocks are all taken before a flush.
        let std::collections::hash_map::Entry::Occupied(mut entry) =
            self.parked.by_size.entry((stream, rounded))
        else {
            return None;
        };
        let id = entry.get_mut().pop()?;
        if entry.get().is_empty() {
            entry.remove();
        }
        if rounded <= SMALL_PARKED_SIZE {
            self.parked.small_bytes -= rounded;
        }
        self.parked.count -= 1;
        self.parked.gate.note_reuse();
        Some(self.mark_handed_out(id, requested))
    }

    /// Moves every parked block into the free lists, merged with its free neighbours.
    pub fn flush_parked(&mut self) {
        if self.parked.count == 0 {
            return;
        }
        let ids: Vec<BlockId> = self
            .parked
            .by_size
            .drain()
            .flat_map(|(_, ids)| ids)
            .collect();
        self.parked.small_bytes = 0;
        self.parked.count = 0;
        for id in ids {
            // Paged: no inactive-split counts to adjust.
            self.merge_and_list(id);
        }
    }
}
