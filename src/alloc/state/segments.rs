//! Segments and paged segments: making and forgetting them, what they hold, and telling a
//! double free from a pointer never handed out.

use super::{Segment, State};
use crate::alloc::core::blocks::{Block, BlockId, BlockState, PoolId};
use crate::alloc::paging::budget::MoveClock;
use crate::alloc::paging::fences::Fences;
use crate::alloc::paging::plan::{reclaim_candidates, Victim};
use crate::alloc::paging::table::{pages_of, segment_at, PagedSegment, Spare};
use crate::alloc::sizing::{self, PoolKind};
use crate::driver::{DevicePtr, StreamId};
use crate::error::{Error, ErrorKind};
use std::ops::Range;

impl State {
    /// Registers a fresh segment as one free block (not yet cached).
    pub fn add_segment(
        &mut self,
        addr: DevicePtr,
        size: u64,
        stream: StreamId,
        pool: PoolKind,
        owner: Option<PoolId>,
    ) -> BlockId {
        let id = self.book.blocks.insert(Block::whole_segment(
            addr, size, stream, pool, owner, false, 0,
        ));
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

    /// Forgets a cached whole-segment block whose memory the driver has taken back (its
    /// reserved bytes no longer counted already: `Shard::release_segment`).
    pub fn remove_segment(&mut self, id: BlockId) {
        let block = self.book.blocks.remove(id);
        debug_assert!(!block.is_split() && block.state() == BlockState::Free);
        let segment = self
            .book
            .segments
            .remove(&block.addr())
            .expect("a whole block is its segment");
        self.forget_used(block.addr(), block.end());
        if let Some(owner) = block.owner() {
            self.book.caches.remove_pool_segment(owner);
        }
        let s = &mut self.stats;
        s.segment.decrease(block.pool(), 1);
        if segment.oversize {
            s.oversize_segments.decrease(1);
        }
    }

    /// A segment `[start, end)` went back to the device: nothing in it was handed out.
    pub fn forget_used(&mut self, start: DevicePtr, end: DevicePtr) {
        self.book.used_hint = (0, 0);
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
    pub(super) fn held_bytes(&self, id: BlockId) -> u64 {
        let b = self.book.blocks.get(id);
        if !b.paged() {
            return b.size();
        }
        let (_, seg) = self.paged_segment(b.addr());
        seg.mapped_bytes_in(b.addr(), b.size())
    }

    /// Whether page moves have lately spent their allowance (`MoveClock`): moves here cost
    /// more than `page_move_budget`, so growth makes chunks of at least 4 pages where they
    /// would be smaller (`chunk_pages_for`; larger ones are capped by the slack as before),
    /// and each later move of them takes fewer calls.
    pub fn moves_over_budget(&self) -> bool {
        self.config.page_move_budget > 0.0 && self.paging.moves.spent_lately()
    }

    /// Whether the free block `id`, taken for `rounded` bytes, lacks some of their pages.
    pub fn needs_pages(&self, id: BlockId, rounded: u64) -> bool {
        let block = self.book.blocks.get(id);
        block.paged()
            && !self
                .paged_segment(block.addr())
                .1
                .all_mapped(block.addr(), rounded)
    }

    /// The paged segment holding `addr` (which must lie in one), with its base address.
    pub fn paged_segment(&self, addr: DevicePtr) -> (DevicePtr, &PagedSegment) {
        segment_at(&self.paging.segments, addr)
    }

    pub fn paged_segment_mut(&mut self, addr: DevicePtr) -> &mut PagedSegment {
        self.paging.segments.holding_mut(addr)
    }

    /// Whether some segment here serves `stream` (a segment's blocks are all of its stream).
    pub fn serves_stream(&self, stream: StreamId) -> bool {
        self.book
            .segments
            .values()
            .any(|seg| self.book.blocks.get(seg.first).stream() == stream)
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
                if b.state() == BlockState::Allocated {
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
                    return crate::alloc::already_freed(device, ptr);
                }
                return Error::new(
                    ErrorKind::UnknownPointer,
                    format!(
                        "{ptr:#x} was never handed out by ccalloc on device {device} (it lies in free memory{})",
                        if used { ", not at a block start" } else { " no block has used" }
                    ),
                );
            }
            cursor = b.next();
        }
        Error::new(
            ErrorKind::UnknownPointer,
            format!("{ptr:#x} points inside a ccalloc block on device {device}, not at its start"),
        )
    }
}

/// The paging part, as the shard's driver I/O reads and changes it.
impl State {
    /// How many paged segments serve (stream, pool).
    pub fn paged_segments_of(&self, stream: StreamId, pool: PoolKind) -> usize {
        self.paging
            .serving
            .get(&(stream, pool))
            .copied()
            .unwrap_or(0)
    }

    /// The paged segment at base address `base`.
    pub fn paged_at(&self, base: DevicePtr) -> &PagedSegment {
        self.paging
            .segments
            .get(base)
            .expect("a paged segment starts there")
    }

    /// The page size of the paged segments, if there are any.
    pub fn page_size(&self) -> Option<u64> {
        self.paging.segments.iter().next().map(|s| s.page)
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
        let id = self.book.blocks.insert(Block::whole_segment(
            base, size, stream, pool, None, true, cached_at,
        ));
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
            .insert(PagedSegment::new(base, size, page, stream, pool));
        *self.paging.serving.entry((stream, pool)).or_default() += 1;
        self.stats.segment.increase(pool, 1);
    }

    /// Paged segments with nothing mapped and one free block: (base, size).
    pub fn empty_paged_segments(&self) -> Vec<(DevicePtr, u64)> {
        self.paging
            .segments
            .iter()
            .filter(|seg| self.is_empty_paged(seg))
            .map(|seg| (seg.base, seg.size))
            .collect()
    }

    /// The size of the paged segment at `base` if it is empty (as `empty_paged_segments`).
    pub fn empty_paged_size(&self, base: DevicePtr) -> Option<u64> {
        let seg = self.paging.segments.get(base)?;
        self.is_empty_paged(seg).then_some(seg.size)
    }

    fn is_empty_paged(&self, seg: &PagedSegment) -> bool {
        let b = self.book.blocks.get(self.book.segments[&seg.base].first);
        seg.nothing_mapped() && b.state() == BlockState::Free && b.next().is_none()
    }

    /// Forgets the empty paged segment at `base`, whose address range went back.
    pub fn remove_paged_segment(&mut self, base: DevicePtr) {
        let seg = self.paging.segments.remove(base).expect("listed");
        let segment = self
            .book
            .segments
            .remove(&base)
            .expect("paged segments are segments");
        self.forget_used(base, base + seg.size);
        let block = self.book.blocks.remove(segment.first);
        self.book.caches.list(None, seg.pool).remove(&block);
        let key = (seg.stream, seg.pool);
        if let Some(count) = self.paging.serving.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                self.paging.serving.remove(&key);
            }
        }
        self.stats.segment.decrease(seg.pool, 1);
    }

    /// `spare` is now mapped at page `first` of the segment at `base`: reserved.
    pub fn chunk_mapped(&mut self, base: DevicePtr, first: usize, spare: Spare) {
        let seg = self.paging.segments.get_mut(base).expect("segment exists");
        seg.set_chunk(first, spare);
        let (pool, page) = (seg.pool, seg.page);
        self.add_reserved(pool, spare.pages as u64 * page);
        self.stats.paging.chunks_mapped += 1;
    }

    /// The chunk at page `first` of the segment at `base` is unmapped: its memory, no
    /// longer reserved.
    pub fn chunk_unmapped(&mut self, base: DevicePtr, first: usize) -> Spare {
        let seg = self.paging.segments.get_mut(base).expect("segment exists");
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

    /// Bytes of free blocks in plain segments (CUDA graph pools' private memory, and
    /// segments made where paging could not serve): reserved memory that no page move can
    /// reach. Walks the plain segments' blocks, so only growth (the slow path) asks.
    pub fn plain_free_bytes(&self) -> u64 {
        let mut free = 0;
        for segment in self.book.segments.values() {
            let mut next = Some(segment.first);
            while let Some(id) = next {
                let block = self.book.blocks.get(id);
                if block.paged() {
                    break;
                }
                if block.state() == BlockState::Free {
                    free += block.size();
                }
                next = block.next();
            }
        }
        free
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
