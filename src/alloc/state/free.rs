//! Taking blocks back from callers and caching them: merged with free neighbours, listed,
//! and marked for the reclaim search.

use super::{Book, Segment, State};
use crate::alloc::core::blocks::{BlockArena, BlockId, BlockState};
use crate::alloc::core::free_lists::FreeList;
use crate::driver::{DevicePtr, StreamId};
use std::collections::BTreeMap;

/// A block just taken back (`State::take_back`), as the rest of its free needs it.
pub struct TakenBack {
    /// The other streams it was recorded on.
    pub uses: Vec<StreamId>,
    /// The stream it was allocated for.
    pub stream: StreamId,
    /// A paged block of the general cache: `State::park` may set it aside.
    pub parkable: bool,
}

impl State {
    /// The caller gave the block back: it stops counting as allocated (it stays active until
    /// cached). Returns what the rest of its free needs to know of it.
    #[inline]
    pub fn take_back(&mut self, id: BlockId) -> TakenBack {
        let block = self.book.blocks.get_mut(id);
        let (pool, size, oversize) = (block.pool(), block.size(), block.counted_oversize());
        let (stream, parkable) = (block.stream(), block.paged() && block.owner().is_none());
        let uses = block.mark_awaiting();
        let listed = self.book.live.remove(block.addr(), id);
        debug_assert!(listed, "a block taken back was live");
        let s = &mut self.stats;
        s.allocation.decrease(pool, 1);
        s.allocated_bytes.decrease(pool, size);
        if oversize {
            s.oversize_allocations.decrease(1);
        }
        TakenBack {
            uses,
            stream,
            parkable,
        }
    }

    /// Returns a no-longer-used block to its free list, merging free neighbours.
    /// Returns whether a fence is due on the block's stream (see `PagedSegment::note_free`).
    pub fn cache(&mut self, id: BlockId) -> bool {
        self.cache_freed(id, 1)
    }

    /// `cache` for a block that stands for `frees` frees not yet stamped on its pages: 0
    /// when they carry its free already (`stamp_free`; no fence is due then either).
    pub fn cache_freed(&mut self, id: BlockId, frees: u32) -> bool {
        let block = self.book.blocks.get(id);
        let (pool, paged) = (block.pool(), block.paged());
        let fence_due = self.end_use(id, frees);
        let (net_blocks, net_bytes) = self.merge_and_list(id);
        if !paged {
            self.stats.inactive_split.adjust(pool, net_blocks);
            self.stats.inactive_split_bytes.adjust(pool, net_bytes);
        }
        fence_due
    }

    /// A freed block stops being active, and a paged one notes its free on its pages (the
    /// clock of fences), as `frees` frees (0: they carry it already). Returns whether a
    /// fence is due (see `PagedSegment::note_free`).
    #[inline]
    pub(super) fn end_use(&mut self, id: BlockId, frees: u32) -> bool {
        let block = self.book.blocks.get(id);
        let (size, pool) = (block.size(), block.pool());
        let (paged, requested) = (block.paged(), block.requested());
        let s = &mut self.stats;
        s.active.decrease(pool, 1);
        s.active_bytes.decrease(pool, size);
        s.requested_bytes.decrease(pool, requested);
        paged && frees > 0 && self.stamp_frees(id, frees)
    }

    /// Notes on paged block `id`'s pages that it is freed now: the device's last use of
    /// them comes before this free (`free_seq`), which a fence recorded on its stream from
    /// now on covers. Returns whether a fence is due (see `PagedSegment::note_free`). A
    /// thread front calls it when it adopts a block that it may keep past the caller's
    /// free (`Shard::adopt`): only then is the block's stream known to be alive for the
    /// fence.
    pub fn stamp_free(&mut self, id: BlockId) -> bool {
        self.stamp_frees(id, 1)
    }

    /// `stamp_free` for `frees` frees of the block (a front served all but the last without
    /// the shard): each counts in the sequence and the fences' cadence, as if stamped one
    /// by one; the fence due among them is recorded (if at all) after the last.
    fn stamp_frees(&mut self, id: BlockId, frees: u32) -> bool {
        let block = self.book.blocks.get(id);
        let (addr, size) = (block.addr(), block.size());
        debug_assert!(block.paged() && frees > 0);
        self.paging.free_seq += frees as u64;
        let seq = self.paging.free_seq;
        self.paged_segment_mut(addr)
            .note_free(addr, size, seq, frees)
    }

    /// Puts back a paged block taken from the cache but never handed out. Its neighbours may
    /// have been freed meanwhile: they merge, so no two free blocks stay side by side.
    pub fn return_untouched(&mut self, id: BlockId) {
        debug_assert!(
            self.book.blocks.get(id).paged(),
            "only paged blocks skip split stats"
        );
        self.merge_and_list(id);
    }

    /// Merges free neighbours into `id`, marks it free and lists it in its cache. Returns the
    /// net change in free split pieces (count, bytes).
    pub(super) fn merge_and_list(&mut self, id: BlockId) -> (i64, i64) {
        let Book {
            blocks,
            caches,
            segments,
            ..
        } = &mut self.book;
        let block = blocks.get(id);
        let (pool, owner) = (block.pool(), block.owner());
        let (prev, next) = (block.prev(), block.next());
        // A segment's blocks share its pool and owner: one list holds the block and its
        // free neighbours.
        let list = caches.list(owner, pool);
        let (mut net_blocks, mut net_bytes) = (0i64, 0i64);
        let mut merge = |neighbour: Option<BlockId>| {
            let Some(neighbour) = neighbour else { return };
            if blocks.get(neighbour).state() != BlockState::Free {
                return;
            }
            let absorbed = absorb_listed(blocks, list, segments, id, neighbour);
            net_blocks -= 1;
            net_bytes -= absorbed as i64;
        };
        merge(prev);
        merge(next);
        let block = blocks.get_mut(id);
        block.mark_free(list.lookups());
        list.insert(block, id);
        if block.is_split() {
            net_blocks += 1;
            net_bytes += block.size() as i64;
        }
        self.mark_reclaim_dirty(id);
        (net_blocks, net_bytes)
    }

    /// The free block `id` grew (freed, merged): a chunk may now lie wholly under it, so
    /// its (stream, pool) is searched at the next reclaim. Only this makes such chunks:
    /// chunks are mapped under the block being handed out, and splits only shrink free
    /// blocks.
    pub(super) fn mark_reclaim_dirty(&mut self, id: BlockId) {
        let b = self.book.blocks.get(id);
        if b.paged() && b.owner().is_none() {
            self.paging.reclaim_dirty.insert((b.stream(), b.pool()));
        }
    }

    /// Merges the free `neighbour` into `id`; returns the bytes taken over. The caller marks
    /// `id` for the reclaim search (`mark_reclaim_dirty`) once it is done merging.
    pub(super) fn absorb(&mut self, id: BlockId, neighbour: BlockId) -> u64 {
        let Book {
            blocks,
            caches,
            segments,
            ..
        } = &mut self.book;
        let other = blocks.get(neighbour);
        let list = caches.list(other.owner(), other.pool());
        absorb_listed(blocks, list, segments, id, neighbour)
    }
}

/// `State::absorb` on the book's parts, `list` being the free neighbour's free list.
#[inline]
fn absorb_listed(
    blocks: &mut BlockArena,
    list: &mut FreeList,
    segments: &mut BTreeMap<DevicePtr, Segment>,
    id: BlockId,
    neighbour: BlockId,
) -> u64 {
    let (other, starts_segment) = blocks.absorb(id, neighbour);
    list.remove(&other);
    if starts_segment {
        let segment = segments.get_mut(&other.addr());
        segment
            .expect("a chain's first block starts a segment")
            .first = id;
    }
    other.size()
}
