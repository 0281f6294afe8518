//! The bookkeeping of one shard, changed only under its lock and only through methods: its
//! settings, the core bookkeeping (`Book`), paging state, parked blocks, events and stats.
//! Nothing here talks to the driver.

use super::core::blocks::PoolId;
use super::core::blocks::{Block, BlockArena, BlockId, BlockState};
use super::core::free_lists::Caches;
use super::paging::budget::MoveClock;
use super::paging::fences::Fences;
use super::paging::plan::{reclaim_candidates, Victim};
use super::paging::table::{pages_of, segment_at, PagedSegment, Spare};
use super::sizing::{self, PoolKind};
use super::stats::{DeviceReserved, DeviceStats};
use super::SegmentView;
use crate::config::Config;
use crate::driver::{DevicePtr, EventId, StreamId};
use crate::error::{Error, ErrorKind};
use std::collections::{BTreeMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

/// A block freed while other streams may still use it; reusable once every event completes.
pub struct AwaitingEvents {
    pub block: BlockId,
    pub events: Vec<EventId>,
}

/// A device allocation (or a paged segment's address range) and the first block of its chain.
#[derive(Clone, Copy)]
pub struct Segment {
    pub size: u64,
    pub first: BlockId,
    /// Counted in `oversize_segments` (decided once, when the segment was made).
    pub oversize: bool,
}

/// A paged request may take any of this many fitting blocks (smallest first), whichever
/// needs the fewest new pages.
const FIT_CANDIDATES: usize = 32;
/// Paged requests at least this large are placed from the top of the address range down.
const HUGE_BLOCK: u64 = 64 << 20;
/// Parked blocks (see `State::park`): at most this many per device; those of up to
/// `SMALL_PARKED_SIZE` (the small pool's) hold at most `PARKED_MAX_SMALL_BYTES` in all, many
/// of them, since they are what a training step frees and asks for most often. Larger ones
/// need no byte bound: any request that would map pages flushes them first.
const PARKED_MAX_BLOCKS: usize = 64;
const PARKED_MAX_SMALL_BYTES: u64 = 4 << 20;
const SMALL_PARKED_SIZE: u64 = 1 << 20;

/// When a full set of parked blocks saw fewer than one reuse per this many parks, the
/// pattern is not same-size reuse (random sizes): parking pauses for `PARKING_PAUSE` frees.
const PARKS_PER_REUSE: usize = 4;
const PARKING_PAUSE: u32 = 1024;

/// Freed paged blocks by (stream, size), each list newest last.
#[derive(Default)]
struct Parked {
    by_size: rustc_hash::FxHashMap<(StreamId, u64), Vec<BlockId>>,
    /// Bytes in parked blocks of at most `SMALL_PARKED_SIZE`.
    small_bytes: u64,
    count: usize,
    /// Parks and reuses since the parked blocks last filled up.
    parks: usize,
    reuses: usize,
    /// Frees left before parking resumes.
    paused: u32,
}

/// Memory held by a device's other shards, for OOM messages.
#[derive(Clone, Copy, Debug, Default)]
pub struct Elsewhere {
    pub live: u64,
    pub cached: u64,
    pub largest_free: u64,
    /// This is the device's second try: the first already counted its retry.
    pub second_try: bool,
}

/// The core bookkeeping: every block, the free lists, and what is handed out.
struct Book {
    blocks: BlockArena,
    caches: Caches,
    /// Blocks handed out, by address (FxHash: every alloc and free looks up here, and the
    /// keys are the allocator's own addresses, not attacker-chosen).
    live: rustc_hash::FxHashMap<DevicePtr, BlockId>,
    segments: BTreeMap<DevicePtr, Segment>,
    /// The memory blocks handed out have covered, as disjoint ranges start → end (adjacent
    /// ones joined; a segment's part is dropped when it goes back to the device): tells a
    /// double free from a pointer ccalloc never handed out (`diagnose_not_live`).
    used: BTreeMap<DevicePtr, DevicePtr>,
}

/// The paging state: paged segments' page tables, spare chunks, fences and the move clock.
#[derive(Default)]
struct Paging {
    /// Paged segments by base address, and which one serves each (stream, pool).
    segments: BTreeMap<DevicePtr, PagedSegment>,
    serving: HashSet<(StreamId, PoolKind)>,
    /// The (stream, pool)s whose free lists may hold a chunk wholly under a free paged
    /// block (`mark_reclaim_dirty`); the search for chunks to unmap looks only there.
    reclaim_dirty: rustc_hash::FxHashSet<(StreamId, PoolKind)>,
    /// Unmapped physical chunks kept for growth (counted as reserved, large pool).
    idle_chunks: Vec<Spare>,
    /// The most bytes ever live at a page mapping (not reset with the peak stats): growth
    /// may cache pages up to this plus the slack before it moves pages under free blocks.
    live_high_water: u64,
    /// Counts frees into the cache: the clock of `Chunk::last_free` and fences.
    free_seq: u64,
    /// The time page moves take (see `Shard::account_growth`).
    moves: MoveClock,
    /// Pending fences, and which frees are known done on the device.
    fences: Fences,
}

/// Blocks freed while other streams may still use them.
#[derive(Default)]
struct Events {
    awaiting: Vec<AwaitingEvents>,
    /// Blocks freed during a capture with other streams recorded, or whose events could not
    /// be recorded: their events are recorded once no capture is open (recording then would
    /// become part of the graph).
    deferred: Vec<BlockId>,
}

/// Everything one shard knows, in owned parts; the shard changes it only through methods.
pub struct State {
    config: Config,
    /// Reserved bytes may not exceed this (from `per_process_memory_fraction`).
    limit: u64,
    book: Book,
    paging: Paging,
    /// Freed paged blocks waiting for a request of their exact size (see `park`).
    parked: Parked,
    events: Events,
    stats: DeviceStats,
    /// Reserved bytes on the whole device, every shard's (`add_reserved`): the memory
    /// limit is the device's.
    device_reserved: Arc<DeviceReserved>,
    shut_down: bool,
    /// What the device's other shards hold, when an OOM now is final (counted, and reported
    /// with their figures); `None` when the device may still avoid it by emptying their
    /// caches (`DeviceAllocator::malloc` retries then).
    oom_final: Option<Elsewhere>,
    /// Handed-out blocks that thread fronts (`front`) hold.
    front_blocks: usize,
}

impl State {
    pub fn new(config: Config, limit: u64, device_reserved: Arc<DeviceReserved>) -> Self {
        Self {
            config,
            limit,
            book: Book {
                blocks: BlockArena::default(),
                caches: Caches::default(),
                live: Default::default(),
                segments: BTreeMap::new(),
                used: BTreeMap::new(),
            },
            paging: Paging::default(),
            parked: Parked::default(),
            events: Events::default(),
            stats: DeviceStats::default(),
            device_reserved,
            shut_down: false,
            oom_final: Some(Elsewhere::default()),
            front_blocks: 0,
        }
    }

    pub fn reserved(&self) -> u64 {
        self.stats.reserved_bytes.all().current as u64
    }

    /// Reserved on the whole device: this shard's and its other shards'.
    pub fn device_reserved(&self) -> u64 {
        self.device_reserved.all()
    }

    /// What the device's other shards reserve.
    pub fn reserved_elsewhere(&self) -> u64 {
        self.device_reserved().saturating_sub(self.reserved())
    }

    /// Claims `bytes` of device memory under `limit` before the driver is asked for them
    /// (see `DeviceReserved`); false past it.
    pub fn commit(&self, bytes: u64, limit: u64) -> bool {
        self.device_reserved.try_commit(bytes, limit)
    }

    /// Gives back what `commit` claimed: the memory was released, or never came.
    pub fn uncommit(&self, bytes: u64) {
        self.device_reserved.uncommit(bytes);
    }

    /// Counts `bytes` more reserved in `pool`, here and in the device's total.
    pub fn add_reserved(&mut self, pool: PoolKind, bytes: u64) {
        self.stats.reserved_bytes.increase(pool, bytes);
        self.device_reserved.increase(pool, bytes);
    }

    pub fn sub_reserved(&mut self, pool: PoolKind, bytes: u64) {
        self.stats.reserved_bytes.decrease(pool, bytes);
        self.device_reserved.decrease(pool, bytes);
    }

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
        let list = self.book.caches.list(owner, pool);
        list.count_lookup();
        let (found, mut id) = if self.config.expandable_segments {
            list.best_fit(stream, rounded)?
        } else {
            // Turned off at run time: paged blocks (a stream's paged segment is one free
            // block as large as the device) serve no new request, as PyTorch's expandable
            // segments then serve none; they go back as they are freed and released.
            let list = self.book.caches.list_ref(owner, pool);
            list.fits(stream, rounded)
                .find(|&(_, b)| !self.book.blocks.get(b).paged)?
        };
        let mut carve_at = None;
        let mut pages_ready = true;
        if self.book.blocks.get(id).paged {
            let (chosen, at, missing) = self.fewest_new_pages(owner, pool, stream, rounded, id);
            id = chosen;
            carve_at = (at != self.book.blocks.get(id).addr).then_some(at);
            pages_ready = missing == 0;
        }
        // Oversize blocks serve only oversize requests, and only ones close to their size
        // (paged blocks are exempt: their unused pages are not held).
        let refused = !self.book.blocks.get(id).paged
            && ((rounded < max_split && found >= max_split)
                || (rounded >= max_split && found >= rounded.saturating_add(max_rounding)));
        if refused {
            if !self.config.expandable_segments {
                return None;
            }
            // Plain and paged blocks share a list only after `expandable_segments` changed:
            // a paged block that fits may still serve.
            let list = self.book.caches.list_ref(owner, pool);
            id = list
                .fits(stream, rounded)
                .map(|(_, b)| b)
                .find(|&b| self.book.blocks.get(b).paged)?;
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
    fn fewest_new_pages(
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
            let (_, seg) = self.paged_segment(b.addr);
            seg.best_place(b.addr, b.end(), rounded)
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
            if !self.book.blocks.get(id).paged {
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
                if b.paged {
                    let at = b.end() - rounded;
                    let (_, seg) = self.paged_segment(b.addr);
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
    fn split_front(&mut self, id: BlockId, at: DevicePtr) {
        let block = self.book.blocks.get(id);
        let (addr, owner, pool) = (block.addr, block.owner, block.pool);
        debug_assert!(block.paged && at > addr && at < block.end());
        let front = block.free_piece(addr, at - addr, block.prev, Some(id), block.cached_at);
        let front_id = self.book.blocks.insert(front);
        match self.book.blocks.get(front_id).prev {
            Some(p) => self.book.blocks.get_mut(p).next = Some(front_id),
            None => {
                self.book
                    .segments
                    .get_mut(&addr)
                    .expect("a chain's first block starts a segment")
                    .first = front_id;
            }
        }
        let block = self.book.blocks.get_mut(id);
        block.size -= at - addr;
        block.addr = at;
        block.prev = Some(front_id);
        self.book
            .caches
            .list(owner, pool)
            .insert(self.book.blocks.get(front_id), front_id);
    }

    /// Registers a fresh segment as one free block (not yet cached).
    pub fn add_segment(
        &mut self,
        addr: DevicePtr,
        size: u64,
        stream: StreamId,
        pool: PoolKind,
        owner: Option<PoolId>,
    ) -> BlockId {
        let id = self.book.blocks.insert(Block {
            addr,
            size,
            requested: 0,
            stream,
            pool,
            owner,
            paged: false,
            counted_oversize: false,
            prev: None,
            next: None,
            state: BlockState::Free,
            stream_uses: Vec::new(),
            cached_at: 0,
            front: 0,
        });
        let oversize = size >= self.config.max_split_size;
        self.book.segments.insert(
            addr,
            Segment {
                size,
                first: id,
                oversize,
            },
        );
        if let Some(owner) = owner {
            self.book.caches.add_pool_segment(owner);
        }
        self.add_reserved(pool, size);
        let s = &mut self.stats;
        s.segment.increase(pool, 1);
        s.num_device_alloc += 1;
        if oversize {
            s.oversize_segments.increase(1);
        }
        id
    }

    /// Forgets a cached whole-segment block whose memory the driver has taken back.
    pub fn remove_segment(&mut self, id: BlockId) {
        let block = self.book.blocks.remove(id);
        debug_assert!(!block.is_split() && block.state == BlockState::Free);
        let segment = self
            .book
            .segments
            .remove(&block.addr)
            .expect("a whole block is its segment");
        self.forget_used(block.addr, block.end());
        if let Some(owner) = block.owner {
            self.book.caches.remove_pool_segment(owner);
        }
        self.sub_reserved(block.pool, block.size);
        let s = &mut self.stats;
        s.segment.decrease(block.pool, 1);
        if segment.oversize {
            s.oversize_segments.decrease(1);
        }
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

    fn hand_out_split(
        &mut self,
        id: BlockId,
        rounded: u64,
        requested: u64,
        exact: bool,
    ) -> DevicePtr {
        let block = self.book.blocks.get(id);
        let (pool, owner, paged) = (block.pool, block.owner, block.paged);
        // Paged blocks always split (unused pages are not held) and count no inactive
        // splits: a paged segment is one long split by nature.
        let already_split = block.is_split() && !paged;
        let split = if exact {
            block.size > rounded
        } else if paged {
            block.size - rounded >= sizing::MIN_BLOCK_SIZE
        } else {
            sizing::should_split(pool, block.size, rounded, self.config.max_split_size)
        };
        if split {
            let rest = block.free_piece(
                block.addr + rounded,
                block.size - rounded,
                Some(id),
                block.next,
                self.book.caches.list_ref(owner, pool).lookups(),
            );
            let rest_size = rest.size;
            let rest_id = self.book.blocks.insert(rest);
            if let Some(next) = self.book.blocks.get(rest_id).next {
                self.book.blocks.get_mut(next).prev = Some(rest_id);
            }
            let block = self.book.blocks.get_mut(id);
            block.next = Some(rest_id);
            block.size = rounded;
            // A paged block waits unlisted while its pages are mapped; a neighbour freed in
            // that time could not merge with it, so the rest merges with it now.
            if let Some(next) = self.book.blocks.get(rest_id).next {
                if paged && self.book.blocks.get(next).state == BlockState::Free {
                    self.absorb(rest_id, next);
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
            self.stats.inactive_split_bytes.decrease(pool, block.size);
        }
        let addr = self.book.blocks.get(id).addr;
        self.note_used(addr, addr + rounded);
        self.mark_handed_out(id, requested)
    }

    /// `[start, end)` is handed out: joined to the ranges in `used`. Usually one lookup: a
    /// block reused, or carved next to one, lies in or beside a range already noted.
    fn note_used(&mut self, start: DevicePtr, end: DevicePtr) {
        let (mut lo, mut hi) = (start, end);
        if let Some((&s, &e)) = self.book.used.range(..=start).next_back() {
            if e >= end {
                return;
            }
            if e >= start {
                (lo, hi) = (s, hi.max(e));
            }
        }
        let joined: Vec<(DevicePtr, DevicePtr)> = self
            .book
            .used
            .range(lo..=hi)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in joined {
            self.book.used.remove(&s);
            hi = hi.max(e);
        }
        self.book.used.insert(lo, hi);
    }

    /// A segment `[start, end)` went back to the device: nothing in it was handed out.
    pub fn forget_used(&mut self, start: DevicePtr, end: DevicePtr) {
        let mut cut: Vec<(DevicePtr, DevicePtr)> = self
            .book
            .used
            .range(..end)
            .rev()
            .take_while(|&(_, &e)| e > start)
            .map(|(&s, &e)| (s, e))
            .collect();
        cut.reverse();
        for (s, e) in cut {
            self.book.used.remove(&s);
            if s < start {
                self.book.used.insert(s, start);
            }
            if e > end {
                self.book.used.insert(end, e);
            }
        }
    }

    /// Accounts a block leaving the cache for a caller, as it is.
    fn mark_handed_out(&mut self, id: BlockId, requested: u64) -> DevicePtr {
        let pool = self.book.blocks.get(id).pool;
        let oversize = self.book.blocks.get(id).size >= self.config.max_split_size;
        let block = self.book.blocks.get_mut(id);
        block.state = BlockState::Allocated;
        block.requested = requested;
        block.counted_oversize = oversize;
        let (addr, size) = (block.addr, block.size);
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

    /// The caller gave the block back: it stops counting as allocated (it stays active until
    /// cached). Returns the streams it was recorded on.
    pub fn take_back(&mut self, id: BlockId) -> Vec<StreamId> {
        let block = self.book.blocks.get_mut(id);
        let (pool, size, oversize) = (block.pool, block.size, block.counted_oversize);
        block.state = BlockState::AwaitingEvents;
        let uses = std::mem::take(&mut block.stream_uses);
        self.book.live.remove(&block.addr);
        let s = &mut self.stats;
        s.allocation.decrease(pool, 1);
        s.allocated_bytes.decrease(pool, size);
        if oversize {
            s.oversize_allocations.decrease(1);
        }
        uses
    }

    /// Returns a no-longer-used block to its free list, merging free neighbours.
    /// Returns whether a fence is due on the block's stream (see `PagedSegment::note_free`).
    pub fn cache(&mut self, id: BlockId) -> bool {
        let (pool, paged) = (
            self.book.blocks.get(id).pool,
            self.book.blocks.get(id).paged,
        );
        let fence_due = self.end_use(id);
        let (net_blocks, net_bytes) = self.merge_and_list(id);
        if !paged {
            self.stats.inactive_split.adjust(pool, net_blocks);
            self.stats.inactive_split_bytes.adjust(pool, net_bytes);
        }
        fence_due
    }

    /// A freed block stops being active, and a paged one notes its free on its pages (the
    /// clock of fences). Returns whether a fence is due (see `PagedSegment::note_free`).
    fn end_use(&mut self, id: BlockId) -> bool {
        let block = self.book.blocks.get(id);
        let (addr, size, pool) = (block.addr, block.size, block.pool);
        let (paged, requested) = (block.paged, block.requested);
        let s = &mut self.stats;
        s.active.decrease(pool, 1);
        s.active_bytes.decrease(pool, size);
        s.requested_bytes.decrease(pool, requested);
        if !paged {
            return false;
        }
        self.paging.free_seq += 1;
        let seq = self.paging.free_seq;
        self.paged_segment_mut(addr).note_free(addr, size, seq)
    }

    /// Caches a freed block the fast way when it may be: a paged block of the general cache
    /// waits unmerged and unlisted for the next request of exactly its size on its stream,
    /// the common case of a training loop, skipping the free lists and split/merge both
    /// ways. Returns `None` when the block is not eligible (the caller then `cache`s it),
    /// else whether a fence is due (as `cache`). Bounded: when full, every parked block is
    /// flushed to the free lists first. A parked block never costs memory: any request that
    /// would map pages flushes them all first (`malloc`), as does every slow path. Only
    /// paged blocks park: they count no inactive splits, so the statistics read exactly as
    /// if the block had merged; plain segments keep PyTorch's figures for those.
    pub fn park(&mut self, id: BlockId) -> Option<bool> {
        let block = self.book.blocks.get(id);
        if !block.paged || block.owner.is_some() {
            return None;
        }
        let (size, stream) = (block.size, block.stream);
        if self.parked.paused > 0 {
            self.parked.paused -= 1;
            return None;
        }
        let small = size <= SMALL_PARKED_SIZE;
        if (small && self.parked.small_bytes + size > PARKED_MAX_SMALL_BYTES)
            || self.parked.count == PARKED_MAX_BLOCKS
        {
            let reused_rarely = self.parked.reuses * PARKS_PER_REUSE < self.parked.parks;
            self.flush_parked();
            (self.parked.parks, self.parked.reuses) = (0, 0);
            if reused_rarely {
                self.parked.paused = PARKING_PAUSE;
                return None;
            }
        }
        self.parked.parks += 1;
        let fence_due = self.end_use(id);
        let block = self.book.blocks.get_mut(id);
        block.state = BlockState::Parked;
        block.requested = 0;
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

    /// Hands out a parked block of exactly `rounded` bytes on `stream`, if there is one.
    pub fn take_parked(
        &mut self,
        stream: StreamId,
        rounded: u64,
        requested: u64,
    ) -> Option<DevicePtr> {
        if self.parked.count == 0 {
            return None;
        }
        let id = self.parked.by_size.get_mut(&(stream, rounded))?.pop()?;
        if rounded <= SMALL_PARKED_SIZE {
            self.parked.small_bytes -= rounded;
        }
        self.parked.count -= 1;
        self.parked.reuses += 1;
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

    /// Puts back a paged block taken from the cache but never handed out. Its neighbours may
    /// have been freed meanwhile: they merge, so no two free blocks stay side by side.
    pub fn return_untouched(&mut self, id: BlockId) {
        debug_assert!(
            self.book.blocks.get(id).paged,
            "only paged blocks skip split stats"
        );
        self.merge_and_list(id);
    }

    /// Merges free neighbours into `id`, marks it free and lists it in its cache. Returns the
    /// net change in free split pieces (count, bytes).
    fn merge_and_list(&mut self, id: BlockId) -> (i64, i64) {
        let block = self.book.blocks.get(id);
        let (pool, owner) = (block.pool, block.owner);
        let (mut net_blocks, mut net_bytes) = (0i64, 0i64);
        for neighbour in [block.prev, block.next].into_iter().flatten() {
            if self.book.blocks.get(neighbour).state != BlockState::Free {
                continue;
            }
            let absorbed = self.absorb(id, neighbour);
            net_blocks -= 1;
            net_bytes -= absorbed as i64;
        }
        let list = self.book.caches.list(owner, pool);
        let block = self.book.blocks.get_mut(id);
        block.state = BlockState::Free;
        block.requested = 0;
        block.cached_at = list.lookups();
        list.insert(block, id);
        if block.is_split() {
            net_blocks += 1;
            net_bytes += block.size as i64;
        }
        self.mark_reclaim_dirty(id);
        (net_blocks, net_bytes)
    }

    /// The free block `id` grew (freed, merged): a chunk may now lie wholly under it, so
    /// its (stream, pool) is searched at the next reclaim. Only this makes such chunks:
    /// chunks are mapped under the block being handed out, and splits only shrink free
    /// blocks.
    fn mark_reclaim_dirty(&mut self, id: BlockId) {
        let b = self.book.blocks.get(id);
        if b.paged && b.owner.is_none() {
            self.paging.reclaim_dirty.insert((b.stream, b.pool));
        }
    }

    /// Merges the free `neighbour` into `id`; returns the bytes taken over.
    fn absorb(&mut self, id: BlockId, neighbour: BlockId) -> u64 {
        let other = self.book.blocks.remove(neighbour);
        self.book
            .caches
            .list(other.owner, other.pool)
            .remove(&other);
        let block = self.book.blocks.get_mut(id);
        block.size += other.size;
        if other.addr < block.addr {
            block.addr = other.addr;
            block.prev = other.prev;
            match other.prev {
                Some(p) => self.book.blocks.get_mut(p).next = Some(id),
                None => {
                    let segment = self.book.segments.get_mut(&other.addr);
                    segment
                        .expect("a chain's first block starts a segment")
                        .first = id;
                }
            }
        } else {
            block.next = other.next;
            if let Some(n) = other.next {
                self.book.blocks.get_mut(n).prev = Some(id);
            }
        }
        self.mark_reclaim_dirty(id);
        other.size
    }

    /// Total cached free bytes and the largest cached block.
    pub fn cached_free(&self) -> (u64, u64) {
        self.book
            .caches
            .all_lists()
            .flat_map(|l| l.ids())
            .map(|id| self.held_bytes(id))
            .fold((0, 0), |(sum, max), s| (sum + s, max.max(s)))
    }

    /// Device memory under a block: all of it, or for a paged block its mapped part.
    fn held_bytes(&self, id: BlockId) -> u64 {
        let b = self.book.blocks.get(id);
        if !b.paged {
            return b.size;
        }
        let (_, seg) = self.paged_segment(b.addr);
        seg.mapped_bytes_in(b.addr, b.size)
    }

    /// The share of peak live bytes that paged segments may keep beyond it: `page_slack`
    /// plus the extra that `page_move_budget` added (none while the budget is 0, even if set
    /// to 0 at run time since the extra was last adjusted).
    pub fn page_slack(&self) -> f64 {
        let extra = if self.config.page_move_budget > 0.0 {
            self.paging.moves.extra_slack()
        } else {
            0.0
        };
        self.config.page_slack + extra
    }

    /// Whether the free block `id`, taken for `rounded` bytes, lacks some of their pages.
    pub fn needs_pages(&self, id: BlockId, rounded: u64) -> bool {
        let block = self.book.blocks.get(id);
        block.paged
            && self
                .paged_segment(block.addr)
                .1
                .unmapped_pages(block.addr, rounded)
                > 0
    }

    /// The paged segment holding `addr` (which must lie in one), with its base address.
    pub fn paged_segment(&self, addr: DevicePtr) -> (DevicePtr, &PagedSegment) {
        segment_at(&self.paging.segments, addr)
    }

    pub fn paged_segment_mut(&mut self, addr: DevicePtr) -> &mut PagedSegment {
        self.paging
            .segments
            .range_mut(..=addr)
            .next_back()
            .expect("a paged block has a segment")
            .1
    }

    pub fn segment_of(&self, ptr: DevicePtr) -> Option<(DevicePtr, Segment)> {
        let (&addr, &seg) = self.book.segments.range(..=ptr).next_back()?;
        (ptr < addr + seg.size).then_some((addr, seg))
    }

    /// Why `ptr` cannot be freed here: a double free, an interior pointer, or unknown.
    ///
    /// The rule: a pointer inside free (or freed, not yet cached) memory is a double free
    /// when it lies on the 512-byte grid of block starts (`MIN_BLOCK_SIZE`) in memory that
    /// blocks handed out have covered (`used`): it may have been a block's start. Anything
    /// else was never handed out: off the grid, in free space no block ever covered (a
    /// segment's unused tail, a paged segment's untouched address space), or outside every
    /// segment. Exact starts of freed blocks are not kept (that would cost every free a
    /// record, and blocks merge), so a grid-aligned interior pointer of a freed block also
    /// reads as a double free.
    pub fn diagnose_not_live(&self, device: usize, ptr: DevicePtr) -> Error {
        let Some((_, seg)) = self.segment_of(ptr) else {
            return Error::new(
                ErrorKind::UnknownPointer,
                format!("{ptr:#x} was not allocated by ccalloc on device {device}"),
            );
        };
        let mut cursor = Some(seg.first);
        while let Some(id) = cursor {
            let b = self.book.blocks.get(id);
            if ptr < b.end() {
                if b.state == BlockState::Allocated {
                    break;
                }
                // Inside a free block: freed already (and maybe merged with a neighbour),
                // if it could have been a block's start.
                let used = self
                    .book
                    .used
                    .range(..=ptr)
                    .next_back()
                    .is_some_and(|(_, &end)| ptr < end);
                if used && ptr.is_multiple_of(sizing::MIN_BLOCK_SIZE) {
                    return super::already_freed(device, ptr);
                }
                return Error::new(
                    ErrorKind::UnknownPointer,
                    format!(
                        "{ptr:#x} was never handed out by ccalloc on device {device} (it lies in free memory{})",
                        if used { ", not at a block start" } else { " no block has used" }
                    ),
                );
            }
            cursor = b.next;
        }
        Error::new(
            ErrorKind::UnknownPointer,
            format!("{ptr:#x} points inside a ccalloc block on device {device}, not at its start"),
        )
    }
}

/// What the shard reads and tells, part by part.
impl State {
    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// New settings, and the memory limit they give.
    pub fn set_config(&mut self, config: Config, limit: u64) {
        self.limit = limit;
        self.config = config;
    }

    pub fn is_shut_down(&self) -> bool {
        self.shut_down
    }

    pub fn set_shut_down(&mut self, shut_down: bool) {
        self.shut_down = shut_down;
    }

    pub fn oom_final(&self) -> Option<Elsewhere> {
        self.oom_final
    }

    pub fn set_oom_final(&mut self, oom_final: Option<Elsewhere>) {
        self.oom_final = oom_final;
    }

    pub fn stats(&self) -> &DeviceStats {
        &self.stats
    }

    pub fn stats_mut(&mut self) -> &mut DeviceStats {
        &mut self.stats
    }

    /// Counts a retry after releasing the cache, unless the device's first try counted it.
    pub fn count_alloc_retry(&mut self) {
        if !self.oom_final.is_some_and(|e| e.second_try) {
            self.stats.num_alloc_retries += 1;
        }
    }

    /// Counts an OOM when it is final (see `oom_final`).
    pub fn count_oom(&mut self) {
        if self.oom_final.is_some() {
            self.stats.num_ooms += 1;
        }
    }

    pub fn block(&self, id: BlockId) -> &Block {
        self.book.blocks.get(id)
    }

    pub fn caches(&self) -> &Caches {
        &self.book.caches
    }

    pub fn caches_mut(&mut self) -> &mut Caches {
        &mut self.book.caches
    }

    /// Whether a capture routes allocations now.
    pub fn capturing(&self) -> bool {
        self.book.caches.capturing()
    }

    /// The live block at `ptr`.
    pub fn live_block(&self, ptr: DevicePtr) -> Option<BlockId> {
        self.book.live.get(&ptr).copied()
    }

    /// The live blocks of private pool `pool`, with their addresses.
    pub fn live_blocks_of(&self, pool: PoolId) -> Vec<(DevicePtr, BlockId)> {
        self.book
            .live
            .iter()
            .filter(|(_, &id)| self.book.blocks.get(id).owner == Some(pool))
            .map(|(&addr, &id)| (addr, id))
            .collect()
    }

    /// The segment starting at `addr`.
    pub fn segment_at(&self, addr: DevicePtr) -> Option<Segment> {
        self.book.segments.get(&addr).copied()
    }

    /// A cached block leaves its free list (for release, or to be carved by a restore).
    pub fn unlist(&mut self, id: BlockId) {
        let block = self.book.blocks.get(id);
        self.book.caches.list(block.owner, block.pool).remove(block);
    }

    /// A block taken off its free list by `unlist` goes back, as it was.
    pub fn relist(&mut self, id: BlockId) {
        let block = self.book.blocks.get(id);
        self.book
            .caches
            .list(block.owner, block.pool)
            .insert(block, id);
    }

    /// A free paged block taken for a request while its pages are mapped: not free, so that
    /// no merge or reclaim touches it meanwhile. Returns its address, end and stream.
    pub fn hold_for_mapping(&mut self, id: BlockId) -> (DevicePtr, DevicePtr, StreamId) {
        let block = self.book.blocks.get_mut(id);
        block.state = BlockState::Allocated;
        (block.addr, block.end(), block.stream)
    }

    /// Marks live block `id` as used on `stream` too (waited for on its free).
    pub fn record_use(&mut self, id: BlockId, stream: StreamId) {
        let block = self.book.blocks.get_mut(id);
        if block.stream != stream && !block.stream_uses.contains(&stream) {
            block.stream_uses.push(stream);
        }
    }

    /// Freed block `id`, used on `uses` too, waits until their events can be recorded.
    pub fn defer(&mut self, id: BlockId, uses: Vec<StreamId>) {
        self.book.blocks.get_mut(id).stream_uses = uses;
        self.events.deferred.push(id);
    }

    /// A deferred block and the streams it was used on.
    pub fn pop_deferred(&mut self) -> Option<(BlockId, Vec<StreamId>)> {
        let id = self.events.deferred.pop()?;
        let uses = std::mem::take(&mut self.book.blocks.get_mut(id).stream_uses);
        Some((id, uses))
    }

    pub fn has_awaiting(&self) -> bool {
        !self.events.awaiting.is_empty()
    }

    /// Block `id` becomes reusable once `events` complete.
    pub fn push_awaiting(&mut self, pending: AwaitingEvents) {
        self.events.awaiting.push(pending);
    }

    pub fn pop_awaiting(&mut self) -> Option<AwaitingEvents> {
        self.events.awaiting.pop()
    }

    /// The events the `i`-th awaiting block waits for.
    pub fn awaiting_events(&self, i: usize) -> Option<&[EventId]> {
        self.events.awaiting.get(i).map(|a| a.events.as_slice())
    }

    /// Takes the `i`-th awaiting block (the last one takes its place).
    pub fn take_awaiting(&mut self, i: usize) -> AwaitingEvents {
        self.events.awaiting.swap_remove(i)
    }

    /// Handed-out blocks the fronts hold.
    pub fn front_blocks(&self) -> usize {
        self.front_blocks
    }

    /// The front holding handed-out block `id` (0: none).
    pub fn front_of(&self, id: BlockId) -> u64 {
        self.book.blocks.get(id).front
    }

    /// Front `front` now holds handed-out block `id`.
    pub fn join_front(&mut self, id: BlockId, front: u64) {
        self.book.blocks.get_mut(id).front = front;
        self.front_blocks += 1;
    }

    /// Handed-out block `id` left its front.
    pub fn leave_front(&mut self, id: BlockId) {
        self.book.blocks.get_mut(id).front = 0;
        self.front_blocks -= 1;
    }

    /// Parked blocks there are.
    pub fn parked_count(&self) -> usize {
        self.parked.count
    }

    /// Every segment with its blocks, in address order.
    pub fn segment_views(&self) -> Vec<SegmentView> {
        self.book
            .segments
            .iter()
            .map(|(&addr, seg)| {
                let first = self.book.blocks.get(seg.first);
                let mut blocks = Vec::new();
                let mut requested = Vec::new();
                let mut cursor = Some(seg.first);
                while let Some(id) = cursor {
                    let b = self.book.blocks.get(id);
                    blocks.push((b.addr, b.size, b.state));
                    let handed_out = matches!(b.state, BlockState::Allocated);
                    requested.push(if handed_out { b.requested } else { 0 });
                    cursor = b.next;
                }
                SegmentView {
                    addr,
                    size: seg.size,
                    stream: first.stream,
                    pool: first.pool,
                    private_pool: first.owner,
                    blocks,
                    requested,
                    mapped: self.paging.segments.get(&addr).map(|p| p.mapped_runs()),
                }
            })
            .collect()
    }
}

/// The paging part, as the shard's driver I/O reads and changes it.
impl State {
    /// Whether (stream, pool) has its paged segment.
    pub fn has_paged_segment(&self, stream: StreamId, pool: PoolKind) -> bool {
        self.paging.serving.contains(&(stream, pool))
    }

    /// The paged segment at base address `base`.
    pub fn paged_at(&self, base: DevicePtr) -> &PagedSegment {
        &self.paging.segments[&base]
    }

    /// The page size of the paged segments, if there are any.
    pub fn page_size(&self) -> Option<u64> {
        self.paging.segments.values().next().map(|s| s.page)
    }

    /// Registers a fresh paged segment: address space `[base, base+size)` with nothing
    /// mapped, cached as one free block.
    pub fn add_paged_segment(
        &mut self,
        base: DevicePtr,
        size: u64,
        page: u64,
        stream: StreamId,
        pool: PoolKind,
    ) {
        let cached_at = self.book.caches.list(None, pool).lookups();
        let id = self.book.blocks.insert(Block {
            addr: base,
            size,
            requested: 0,
            stream,
            pool,
            owner: None,
            paged: true,
            counted_oversize: false,
            prev: None,
            next: None,
            state: BlockState::Free,
            stream_uses: Vec::new(),
            cached_at,
            front: 0,
        });
        self.book
            .caches
            .list(None, pool)
            .insert(self.book.blocks.get(id), id);
        self.book.segments.insert(
            base,
            Segment {
                size,
                first: id,
                oversize: false,
            },
        );
        self.paging
            .segments
            .insert(base, PagedSegment::new(base, size, page, stream, pool));
        self.paging.serving.insert((stream, pool));
        self.stats.segment.increase(pool, 1);
    }

    /// Paged segments with nothing mapped and one free block: (base, size).
    pub fn empty_paged_segments(&self) -> Vec<(DevicePtr, u64)> {
        self.paging
            .segments
            .iter()
            .filter(|(base, seg)| {
                let first = self.book.segments[base].first;
                let b = self.book.blocks.get(first);
                seg.mapped.is_empty() && b.state == BlockState::Free && b.next.is_none()
            })
            .map(|(&base, seg)| (base, seg.size))
            .collect()
    }

    /// Forgets the empty paged segment at `base`, whose address range went back.
    pub fn remove_paged_segment(&mut self, base: DevicePtr) {
        let seg = self.paging.segments.remove(&base).expect("listed");
        let segment = self
            .book
            .segments
            .remove(&base)
            .expect("paged segments are segments");
        self.forget_used(base, base + seg.size);
        let block = self.book.blocks.remove(segment.first);
        self.book.caches.list(None, seg.pool).remove(&block);
        self.paging.serving.remove(&(seg.stream, seg.pool));
        self.stats.segment.decrease(seg.pool, 1);
    }

    /// `spare` is now mapped at page `first` of the segment at `base`: reserved.
    pub fn chunk_mapped(&mut self, base: DevicePtr, first: usize, spare: Spare) {
        let seg = self.paging.segments.get_mut(&base).expect("segment exists");
        seg.set_chunk(first, spare);
        let (pool, page) = (seg.pool, seg.page);
        self.add_reserved(pool, spare.pages as u64 * page);
        self.stats.paging.chunks_mapped += 1;
    }

    /// The chunk at page `first` of the segment at `base` is unmapped: its memory, no
    /// longer reserved.
    pub fn chunk_unmapped(&mut self, base: DevicePtr, first: usize) -> Spare {
        let seg = self.paging.segments.get_mut(&base).expect("segment exists");
        let spare = seg.take_chunk(first);
        let (pool, page) = (seg.pool, seg.page);
        self.sub_reserved(pool, spare.pages as u64 * page);
        self.stats.paging.chunks_unmapped += 1;
        spare
    }

    /// Keeps unmapped memory for later growth (it stays reserved).
    pub fn keep_spare(&mut self, spare: Spare, page: u64) {
        self.paging.idle_chunks.push(spare);
        self.add_reserved(PoolKind::Large, spare.pages as u64 * page);
    }

    /// Takes every kept spare (no longer counted until mapped).
    pub fn take_spares(&mut self, page: u64) -> Vec<Spare> {
        let spares = std::mem::take(&mut self.paging.idle_chunks);
        self.sub_reserved(PoolKind::Large, pages_of(&spares) as u64 * page);
        spares
    }

    /// A growth maps pages for `len` more live bytes: the live high-water mark, raised to
    /// what will then be live.
    pub fn raise_live_high_water(&mut self, len: u64) -> u64 {
        let live_after = self.stats.active_bytes.all().current as u64 + len;
        self.paging.live_high_water = self.paging.live_high_water.max(live_after);
        self.paging.live_high_water
    }

    /// Chunks wholly under free paged blocks (`plan::reclaim_candidates`); marks clean the
    /// (stream, pool)s found without any, and counts the work.
    pub fn reclaim_candidates(&mut self, also: Range<DevicePtr>) -> Vec<Victim> {
        let (candidates, clean, steps) = reclaim_candidates(
            &self.book.blocks,
            &self.book.caches,
            &self.paging.segments,
            &self.paging.reclaim_dirty,
            also,
        );
        self.stats.paging.reclaim_steps += steps;
        for key in clean {
            self.paging.reclaim_dirty.remove(&key);
        }
        candidates
    }

    /// Frees into the cache so far: the clock of fences.
    pub fn free_seq(&self) -> u64 {
        self.paging.free_seq
    }

    pub fn fences(&self) -> &Fences {
        &self.paging.fences
    }

    pub fn fences_mut(&mut self) -> &mut Fences {
        &mut self.paging.fences
    }

    pub fn moves(&self) -> &MoveClock {
        &self.paging.moves
    }

    pub fn moves_mut(&mut self) -> &mut MoveClock {
        &mut self.paging.moves
    }
}

#[cfg(test)]
impl State {
    /// (count, small bytes, frees before parking resumes) of the parked blocks.
    pub fn parked_figures(&self) -> (usize, u64, u32) {
        (
            self.parked.count,
            self.parked.small_bytes,
            self.parked.paused,
        )
    }

    pub fn general_list(&self, pool: PoolKind) -> &super::core::free_lists::FreeList {
        self.book.caches.general(pool)
    }
}
