//! The fast path: the best cached fit for a request (on paged segments, the place needing
//! the fewest new pages), and handing a block out, split to size.

use super::State;
use crate::alloc::core::blocks::{BlockId, BlockState, PoolId};
use crate::alloc::sizing::{self, PoolKind};
use crate::driver::{DevicePtr, StreamId};

/// A paged request may take any of this many fitting blocks (smallest first), whichever
/// needs the fewest new pages.
const FIT_CANDIDATES: usize = 32;
/// Paged requests at least this large are placed from the top of the address range down.
const HUGE_BLOCK: u64 = 64 << 20;

impl State {
    /// Fast path: the best cached fit, obeying the oversize rules. With it, whether every
    /// page it needs is known to be mapped already (a paged block placed on mapped pages; a
    /// plain block needs none), so that the caller skips looking again.
    pub fn take_cached(
        &mut self,
        owner: Option<PoolId>,
        pool: PoolKind,
        stream: StreamId,
        rounded: u64,
    ) -> Option<(BlockId, bool)> {
        let max_split = self.config.max_split_size;
        let max_rounding = self.config.max_non_split_rounding;
        // Oversize blocks serve only oversize requests, and only ones close to their size
        // (paged blocks are exempt: their unused pages are not held).
        let refused_oversize = |found: u64| {
            (rounded < max_split && found >= max_split)
                || (rounded >= max_split && found >= rounded.saturating_add(max_rounding))
        };
        let list = self.book.caches.list(owner, pool);
        list.count_lookup();
        let (found, mut id) = if self.config.expandable_segments {
            // A plain block that is not refused as oversize serves as it is: taken off the
            // list as it is found. Otherwise it stays listed for the choices below.
            let blocks = &self.book.blocks;
            let serves_as_is = |found, id| !blocks.get(id).paged() && !refused_oversize(found);
            match list.take_best_fit(stream, rounded, serves_as_is) {
                Ok((_, id)) => return Some((id, true)),
                Err(fit) => fit?,
            }
        } else {
            // Turned off at run time: paged blocks (a stream's paged segment is one free
            // block as large as the device) serve no new request, as PyTorch's expandable
            // segments then serve none; they go back as they are freed and released.
            let list = self.book.caches.list_ref(owner, pool);
            list.fits(stream, rounded)
                .find(|&(_, b)| !self.book.blocks.get(b).paged())?
        };
        let mut carve_at = None;
        let mut pages_ready = true;
        if self.book.blocks.get(id).paged() {
            // The place chosen is in a paged block too.
            let (chosen, at, missing) = self.fewest_new_pages(owner, pool, stream, rounded, id);
            id = chosen;
            carve_at = (at != self.book.blocks.get(id).addr()).then_some(at);
            pages_ready = missing == 0;
        } else if refused_oversize(found) {
            if !self.config.expandable_segments {
                return None;
            }
            // Plain and paged blocks share a list only after `expandable_segments` changed:
            // a paged block that fits may still serve.
            let list = self.book.caches.list_ref(owner, pool);
            id = list
                .fits(stream, rounded)
                .map(|(_, b)| b)
                .find(|&b| self.book.blocks.get(b).paged())?;
            pages_ready = false;
        }
        self.book
            .caches
            .list(owner, pool)
            .remove(self.book.blocks.get(id));
        if let Some(at) = carve_at {
            self.split_front(id, at);
        }
        Some((id, pages_ready))
    }

    /// Among the smallest paged blocks that fit, the place that needs the fewest new pages
    /// (ties: the first found, so the smallest block's start): growth then reuses pages
    /// already mapped instead of moving them, which costs driver calls and may wait on a
    /// fence. A larger block, or a place inside one, costs nothing here: unused pages are not
    /// held. Returns the block, where in it to carve, and how many pages are missing there.
    pub(super) fn fewest_new_pages(
        &self,
        owner: Option<PoolId>,
        pool: PoolKind,
        stream: StreamId,
        rounded: u64,
        best: BlockId,
    ) -> (BlockId, DevicePtr, usize) {
        let huge = rounded >= HUGE_BLOCK;
        let place = |id: BlockId| {
            let b = self.book.blocks.get(id);
            let (_, seg) = self.paged_segment(b.addr());
            seg.best_place(b.addr(), b.end(), rounded)
        };
        let (missing, at) = place(best);
        let mut choice = (missing, best, at);
        if missing == 0 {
            return (best, at, 0);
        }
        for (_, id) in self
            .book
            .caches
            .list_ref(owner, pool)
            .fits(stream, rounded)
            .take(FIT_CANDIDATES)
            .skip(1)
        {
            if !self.book.blocks.get(id).paged() {
                continue;
            }
            let (missing, at) = place(id);
            if missing < choice.0 {
                choice = (missing, id, at);
                if missing == 0 {
                    break;
                }
            }
        }
        // Huge blocks stack down from the top of the largest free block (a paged segment's
        // unused end) unless a place needs fewer pages: they then meet the pages the last
        // huge blocks left mapped there, whatever sizes the smaller blocks below took.
        if huge && choice.0 > 0 {
            if let Some(top) = self
                .book
                .caches
                .list_ref(owner, pool)
                .largest_fit(stream, rounded)
            {
                let b = self.book.blocks.get(top);
                if b.paged() {
                    let at = b.end() - rounded;
                    let (_, seg) = self.paged_segment(b.addr());
                    let missing = seg.unmapped_pages(at, rounded);
                    if missing <= choice.0 {
                        choice = (missing, top, at);
                    }
                }
            }
        }
        (choice.1, choice.2, choice.0)
    }

    /// Cuts the free, unlisted paged block `id` at `at`: the part before stays free (listed)
    /// and `id` keeps the rest.
    pub(super) fn split_front(&mut self, id: BlockId, at: DevicePtr) {
        let block = self.book.blocks.get(id);
        let (addr, owner, pool) = (block.addr(), block.owner(), block.pool());
        debug_assert!(block.paged());
        let (front_id, starts_segment) = self.book.blocks.split_off_front(id, at);
        if starts_segment {
            self.book
                .segments
                .get_mut(&addr)
                .expect("a chain's first block starts a segment")
                .first = front_id;
        }
        self.book
            .caches
            .list(owner, pool)
            .insert(self.book.blocks.get(front_id), front_id);
    }

    /// Splits off what `rounded` does not need, marks the block live, and counts it.
    pub fn hand_out(&mut self, id: BlockId, rounded: u64, requested: u64) -> DevicePtr {
        self.hand_out_split(id, rounded, requested, false)
    }

    /// As `hand_out`, but any excess is split off however small: restoring a pool's saved
    /// layout (`Shard::restore_pool`) re-makes its blocks at their exact sizes.
    pub fn hand_out_exact(&mut self, id: BlockId, size: u64) -> DevicePtr {
        self.hand_out_split(id, size, size, true)
    }

    pub(super) fn hand_out_split(
        &mut self,
        id: BlockId,
        rounded: u64,
        requested: u64,
        exact: bool,
    ) -> DevicePtr {
        let block = self.book.blocks.get(id);
        let (pool, owner, paged) = (block.pool(), block.owner(), block.paged());
        // Paged blocks always split (unused pages are not held) and count no inactive
        // splits: a paged segment is one long split by nature.
        let already_split = block.is_split() && !paged;
        let split = if exact {
            block.size() > rounded
        } else if paged {
            block.size() - rounded >= sizing::MIN_BLOCK_SIZE
        } else {
            sizing::should_split(pool, block.size(), rounded, self.config.max_split_size)
        };
        if split {
            let cached_at = self.book.caches.list_ref(owner, pool).lookups();
            let rest_id = self.book.blocks.split_off_back(id, rounded, cached_at);
            let rest = self.book.blocks.get(rest_id);
            let rest_size = rest.size();
            // A paged block waits unlisted while its pages are mapped; a neighbour freed in
            // that time could not merge with it, so the rest merges with it now.
            if let Some(next) = rest.next().filter(|_| paged) {
                if self.book.blocks.get(next).state() == BlockState::Free {
                    self.absorb(rest_id, next);
                    self.mark_reclaim_dirty(rest_id);
                }
            }
            self.book
                .caches
                .list(owner, pool)
                .insert(self.book.blocks.get(rest_id), rest_id);
            if already_split {
                // The inactive piece shrinks by what was handed out.
                self.stats.inactive_split_bytes.decrease(pool, rounded);
            } else if !paged {
                self.stats.inactive_split.increase(pool, 1);
                self.stats.inactive_split_bytes.increase(pool, rest_size);
            }
        } else if already_split {
            self.stats.inactive_split.decrease(pool, 1);
            self.stats.inactive_split_bytes.decrease(pool, block.size());
        }
        if !self.book.blocks.get(id).in_used() {
            self.note_block_used(id, rounded);
        }
        self.mark_handed_out(id, requested)
    }

    /// Notes the first `rounded` bytes of block `id` as used (`note_used`), and the block
    /// as lying in used ranges if that covers it.
    #[cold]
    #[inline(never)]
    fn note_block_used(&mut self, id: BlockId, rounded: u64) {
        let block = self.book.blocks.get(id);
        let (addr, whole) = (block.addr(), block.size() == rounded);
        self.note_used(addr, addr + rounded);
        // Unsplit, a block may hold more than was noted: its tail is not covered.
        if whole {
            self.book.blocks.get_mut(id).set_in_used();
        }
    }

    /// `[start, end)` is handed out: joined to the ranges in `used`. Usually no lookup: a
    /// block reused, or carved next to one, lies in the range the last hand-out found
    /// (`used_hint`), else in or beside a range already noted.
    pub(super) fn note_used(&mut self, start: DevicePtr, end: DevicePtr) {
        let (hint_start, hint_end) = self.book.used_hint;
        if hint_start <= start && end <= hint_end {
            return;
        }
        let (mut lo, mut hi) = (start, end);
        if let Some((&s, &e)) = self.book.used.range(..=start).next_back() {
            if e >= end {
                self.book.used_hint = (s, e);
                return;
            }
            if e >= start {
                (lo, hi) = (s, hi.max(e));
            }
        }
        // Ranges are disjoint and never adjacent: whatever a joined range reaches past `hi`
        // starts no other range.
        while let Some((&s, &e)) = self.book.used.range(lo..=hi).next() {
            self.book.used.remove(&s);
            hi = hi.max(e);
        }
        self.book.used.insert(lo, hi);
        self.book.used_hint = (lo, hi);
    }

    /// Accounts a block leaving the cache for a caller, as it is.
    #[inline(always)]
    pub(super) fn mark_handed_out(&mut self, id: BlockId, requested: u64) -> DevicePtr {
        let max_split = self.config.max_split_size;
        let block = self.book.blocks.get_mut(id);
        let (pool, addr, size) = (block.pool(), block.addr(), block.size());
        let oversize = size >= max_split;
        block.mark_handed_out(requested, oversize);
        self.book.live.insert(addr, id);
        let s = &mut self.stats;
        s.allocation.increase(pool, 1);
        s.allocated_bytes.increase(pool, size);
        s.active.increase(pool, 1);
        s.active_bytes.increase(pool, size);
        s.requested_bytes.increase(pool, requested);
        if oversize {
            s.oversize_allocations.increase(1);
        }
        addr
    }
}
