//! The bookkeeping of one shard, changed only under its lock and only through methods: its
//! settings, the core bookkeeping (`Book`), paging state, parked blocks, events and stats.
//! Nothing here talks to the driver.

mod fit;
mod free;
mod live;
mod parked;
mod segments;

use super::core::blocks::PoolId;
use super::core::blocks::{Block, BlockArena, BlockId, BlockState};
use super::core::free_lists::Caches;
use super::front::FRONT_MAX_BLOCK;
use super::paging::budget::{Allowance, MoveClock};
use super::paging::fences::Fences;
use super::paging::plan::DirtyKeys;
use super::paging::table::{PagedSegments, Spare};
use super::sizing::PoolKind;
use super::stats::{DeviceReserved, DeviceStats, Peaks, PEAKED};
use super::SegmentView;
use crate::config::Config;
use crate::driver::{DevicePtr, EventId, StreamId};
pub use free::TakenBack;
use parked::Parked;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

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
    /// Blocks handed out, by address.
    live: live::LiveMap,
    segments: BTreeMap<DevicePtr, Segment>,
    /// The memory blocks handed out have covered, as disjoint ranges start → end (adjacent
    /// ones joined; a segment's part is dropped when it goes back to the device): tells a
    /// double free from a pointer ccalloc never handed out (`diagnose_not_live`).
    used: BTreeMap<DevicePtr, DevicePtr>,
    /// A range lying inside one of `used`'s (empty when none is known): most hand-outs
    /// fall inside the range the last one found or made, and skip the B-tree. Ranges
    /// there only grow and join while handing out, so it stays inside until a range is cut
    /// (`forget_used` empties it).
    used_hint: (DevicePtr, DevicePtr),
}

/// The paging state: paged segments' page tables, spare chunks, fences and the move clock.
#[derive(Default)]
struct Paging {
    /// Paged segments by base address, and how many serve each (stream, pool).
    segments: PagedSegments,
    serving: HashMap<(StreamId, PoolKind), usize>,
    /// The (stream, pool)s whose free lists may hold a chunk wholly under a free paged
    /// block (`mark_reclaim_dirty`); the search for chunks to unmap looks only there.
    reclaim_dirty: DirtyKeys,
    /// Unmapped physical chunks kept for growth (counted as reserved, large pool).
    idle_chunks: Vec<Spare>,
    /// The most bytes ever live at a page mapping (not reset with the peak stats): growth
    /// may cache pages up to this plus the slack before it moves pages under free blocks.
    live_high_water: u64,
    /// Counts frees into the cache: the clock of `Chunk::last_free` and fences.
    free_seq: u64,
    /// The time page moves may still take (see `Shard::account_growth`).
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

/// Lifts that settlements through the book (`DeviceAllocator::settle`) have taken into a
/// shard's assignment before finding headroom for them. Until one finds it, or balances,
/// the shard's count may have fallen below the high it reached, and that gap is not
/// headroom below the device's peak yet: a gift (`pool_spare_headroom`) must not give it,
/// or the book would pay the lift with it and never raise the peak.
#[derive(Default)]
pub struct BookHighs {
    /// Settlements under way that took a lift of this shard.
    settling: u32,
    /// Their highs, counter by counter (the largest).
    highs: Peaks,
}

impl BookHighs {
    /// A settlement takes this shard's lift to `highs`.
    pub fn take(&mut self, highs: &Peaks) {
        self.settling += 1;
        for (h, &n) in self.highs.iter_mut().zip(highs) {
            *h = (*h).max(n);
        }
    }

    /// A settlement that took one is done (its lift backed, or in the peaks).
    pub fn done(&mut self) {
        self.settling = self.settling.saturating_sub(1);
        if self.settling == 0 {
            self.highs = [0; PEAKED];
        }
    }

    fn high(&self, q: usize) -> i64 {
        self.highs[q]
    }
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
    /// What the device's other shards hold, when an OOM now is final (counted, and reported
    /// with their figures); `None` when the device may still avoid it by emptying their
    /// caches (`DeviceAllocator::malloc` retries then).
    oom_final: Option<Elsewhere>,
    /// What the device's `PeakBook` has assigned this shard (its `assigned` entry, kept
    /// equal under this shard's lock): a ceiling above it is a lift not settled yet.
    book_assigned: Peaks,
    /// Lifts of this shard that settlements through the book have taken into its
    /// assignment before finding headroom for them (`BookHighs`).
    book_highs: BookHighs,
    /// Handed-out blocks that thread fronts (`front`) hold, and of those, the ones over
    /// `front::FRONT_MAX_BLOCK`.
    front_blocks: usize,
    front_large_blocks: usize,
    /// Some block over `front::FRONT_MAX_BLOCK` has joined a front: until then no thread's
    /// front can hold one or have handed one out, and a visit skips looking
    /// (`Shard::return_large_held`).
    front_large_joined: bool,
}

impl State {
    /// A shard's state; its page moves spend the device's `moves` allowance.
    pub fn new(
        config: Config,
        limit: u64,
        device_reserved: Arc<DeviceReserved>,
        moves: Arc<Mutex<Allowance>>,
    ) -> Self {
        Self {
            config,
            limit,
            book: Book {
                blocks: BlockArena::default(),
                caches: Caches::default(),
                live: Default::default(),
                segments: BTreeMap::new(),
                used: BTreeMap::new(),
                used_hint: (0, 0),
            },
            paging: Paging {
                moves: MoveClock::sharing(&moves),
                ..Paging::default()
            },
            parked: Parked::default(),
            events: Events::default(),
            stats: DeviceStats::default(),
            book_assigned: [0; PEAKED],
            book_highs: BookHighs::default(),
            device_reserved,
            oom_final: Some(Elsewhere::default()),
            front_blocks: 0,
            front_large_blocks: 0,
            front_large_joined: false,
        }
    }

    pub fn reserved(&self) -> u64 {
        self.stats.reserved_bytes.all().current as u64
    }

    /// Reserved on the whole device: this shard's and its other shards'.
    pub fn device_reserved(&self) -> crate::error::Result<u64> {
        self.device_reserved.all()
    }

    /// What the device's other shards reserve.
    pub fn reserved_elsewhere(&self) -> crate::error::Result<u64> {
        Ok(self.device_reserved()?.saturating_sub(self.reserved()))
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
}

/// What the shard reads and tells, part by part.
impl State {
    #[inline]
    pub fn config(&self) -> &Config {
        &self.config
    }

    #[inline]
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// New settings, and the memory limit they give.
    pub fn set_config(&mut self, config: Config, limit: u64) {
        self.limit = limit;
        self.config = config;
    }

    #[inline]
    pub fn oom_final(&self) -> Option<Elsewhere> {
        self.oom_final
    }

    #[inline]
    pub fn set_oom_final(&mut self, oom_final: Option<Elsewhere>) {
        self.oom_final = oom_final;
    }

    #[inline]
    pub fn stats(&self) -> &DeviceStats {
        &self.stats
    }

    #[inline]
    pub fn stats_mut(&mut self) -> &mut DeviceStats {
        &mut self.stats
    }

    /// What the device's peak book assigns this shard (the true figure: the book's own may
    /// be lower, see `device::peaks`).
    #[inline]
    pub fn book_assigned(&self) -> Peaks {
        self.book_assigned
    }

    /// Notes what the device's peak book now assigns this shard.
    #[inline]
    pub fn set_book_assigned(&mut self, assigned: Peaks) {
        self.book_assigned = assigned;
    }

    /// Takes the book's new assignment `assigned` (it was `before`): the ceilings move to
    /// it except where a lift is not settled yet (`DeviceStats::assign_ceilings`), and the
    /// copy follows.
    pub fn assign_ceilings(&mut self, before: &Peaks, assigned: Peaks) {
        self.stats.assign_ceilings(before, &assigned);
        self.book_assigned = assigned;
    }

    /// Whether some ceiling stands above what the book assigned: a lift the device's peaks
    /// have not settled (one another thread's settling took in has none).
    pub fn has_unsettled_lift(&self) -> bool {
        self.stats
            .peaked_peaks()
            .iter()
            .zip(&self.book_assigned)
            .any(|(ceiling, assigned)| ceiling > assigned)
    }

    /// The highs of lifts the book is still settling (`BookHighs`).
    pub fn book_highs(&mut self) -> &mut BookHighs {
        &mut self.book_highs
    }

    /// What this shard's counts leave below its assignment and may give away: nothing of a
    /// lift not settled yet, nor of one the book is still settling (`BookHighs`).
    pub fn spare_headroom(&self) -> Peaks {
        let (ceilings, currents) = (self.stats.peaked_peaks(), self.stats.peaked_currents());
        let mut spare = [0; PEAKED];
        for q in 0..PEAKED {
            if ceilings[q] <= self.book_assigned[q] {
                let floor = currents[q].max(self.book_highs.high(q));
                spare[q] = (self.book_assigned[q] - floor).max(0);
            }
        }
        spare
    }

    /// By how much each ceiling stands above what the book assigned (0 where none does).
    pub fn unsettled_need(&self) -> Peaks {
        let mut need = [0; PEAKED];
        let ceilings = self.stats.peaked_peaks();
        for q in 0..PEAKED {
            need[q] = (ceilings[q] - self.book_assigned[q]).max(0);
        }
        need
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

    #[inline]
    pub fn block(&self, id: BlockId) -> &Block {
        self.book.blocks.get(id)
    }

    #[inline]
    pub fn caches(&self) -> &Caches {
        &self.book.caches
    }

    #[inline]
    pub fn caches_mut(&mut self) -> &mut Caches {
        &mut self.book.caches
    }

    /// Whether a capture routes allocations now.
    #[inline]
    pub fn capturing(&self) -> bool {
        self.book.caches.capturing()
    }

    /// The live block at `ptr`.
    #[inline]
    pub fn live_block(&self, ptr: DevicePtr) -> Option<BlockId> {
        self.book.live.get(ptr, &self.book.blocks)
    }

    /// The live blocks of private pool `pool`, with their addresses, in address order.
    pub fn live_blocks_of(&self, pool: PoolId) -> Vec<(DevicePtr, BlockId)> {
        let mut live: Vec<_> = self
            .book
            .live
            .ids()
            .map(|id| (self.book.blocks.get(id), id))
            .filter(|(b, _)| b.owner() == Some(pool))
            .map(|(b, id)| (b.addr(), id))
            .collect();
        live.sort_unstable_by_key(|&(addr, _)| addr);
        live
    }

    /// The segment starting at `addr`.
    pub fn segment_at(&self, addr: DevicePtr) -> Option<Segment> {
        self.book.segments.get(&addr).copied()
    }

    /// A cached block leaves its free list (for release, or to be carved by a restore).
    pub fn unlist(&mut self, id: BlockId) {
        let block = self.book.blocks.get(id);
        self.book
            .caches
            .list(block.owner(), block.pool())
            .remove(block);
    }

    /// A block taken off its free list by `unlist` goes back, as it was.
    pub fn relist(&mut self, id: BlockId) {
        let block = self.book.blocks.get(id);
        self.book
            .caches
            .list(block.owner(), block.pool())
            .insert(block, id);
    }

    /// A free paged block taken for a request while its pages are mapped: not free, so that
    /// no merge or reclaim touches it meanwhile. Returns its address, end and stream.
    pub fn hold_for_mapping(&mut self, id: BlockId) -> (DevicePtr, DevicePtr, StreamId) {
        let block = self.book.blocks.get_mut(id);
        block.hold();
        (block.addr(), block.end(), block.stream())
    }

    /// Marks live block `id` as used on `stream` too (waited for on its free).
    pub fn record_use(&mut self, id: BlockId, stream: StreamId) {
        self.book.blocks.get_mut(id).add_stream_use(stream);
    }

    /// Freed block `id`, used on `uses` too, waits until their events can be recorded.
    pub fn defer(&mut self, id: BlockId, uses: Vec<StreamId>) {
        self.book.blocks.get_mut(id).set_stream_uses(uses);
        self.events.deferred.push(id);
    }

    /// A deferred block and the streams it was used on.
    pub fn pop_deferred(&mut self) -> Option<(BlockId, Vec<StreamId>)> {
        let id = self.events.deferred.pop()?;
        let uses = self.book.blocks.get_mut(id).take_stream_uses();
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
    #[inline]
    pub fn front_blocks(&self) -> usize {
        self.front_blocks
    }

    /// Handed-out blocks up to `front::FRONT_MAX_BLOCK` the fronts hold. Only these may be
    /// held free by the visiting thread's own front: its larger ones went back to the shard
    /// as its visit began (`Shard::return_large_held`).
    #[inline]
    pub fn front_small_blocks(&self) -> usize {
        self.front_blocks - self.front_large_blocks
    }

    /// Handed-out blocks over `front::FRONT_MAX_BLOCK` the fronts hold (out, or held free by
    /// other threads' fronts).
    #[inline]
    pub fn front_large_blocks(&self) -> usize {
        self.front_large_blocks
    }

    /// The front holding handed-out block `id` (0: none).
    pub fn front_of(&self, id: BlockId) -> u64 {
        self.book.blocks.get(id).front()
    }

    /// Front `front` now holds handed-out block `id`.
    pub fn join_front(&mut self, id: BlockId, front: u64) {
        let block = self.book.blocks.get_mut(id);
        block.set_front(front);
        let large = block.size() > FRONT_MAX_BLOCK;
        self.front_blocks += 1;
        self.front_large_blocks += large as usize;
        self.front_large_joined |= large;
    }

    /// Whether a block over `front::FRONT_MAX_BLOCK` has ever joined a front.
    #[inline]
    pub fn front_large_joined(&self) -> bool {
        self.front_large_joined
    }

    /// Handed-out block `id` left its front.
    pub fn leave_front(&mut self, id: BlockId) {
        let block = self.book.blocks.get_mut(id);
        block.set_front(0);
        self.front_blocks -= 1;
        self.front_large_blocks -= (block.size() > FRONT_MAX_BLOCK) as usize;
    }

    /// Parked blocks there are.
    #[inline]
    pub fn parked_count(&self) -> usize {
        self.parked.count()
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
                    blocks.push((b.addr(), b.size(), b.state()));
                    let handed_out = matches!(b.state(), BlockState::Allocated);
                    requested.push(if handed_out { b.requested() } else { 0 });
                    cursor = b.next();
                }
                SegmentView {
                    addr,
                    size: seg.size,
                    stream: first.stream(),
                    pool: first.pool(),
                    private_pool: first.owner(),
                    blocks,
                    requested,
                    mapped: self.paging.segments.get(addr).map(|p| p.mapped_runs()),
                    chunks: self.paging.segments.get(addr).map(|p| p.chunk_ranges()),
                }
            })
            .collect()
    }
}

#[cfg(test)]
impl State {
    /// (count, small bytes, frees before parking resumes) of the parked blocks.
    pub fn parked_figures(&self) -> (usize, u64, u32) {
        self.parked.figures()
    }

    pub fn general_list(&self, pool: PoolKind) -> &super::core::free_lists::FreeList {
        self.book.caches.general(pool)
    }
}
