//! Blocks (pieces of a device segment) and the arena that owns them, addressed by `BlockId`.

use super::sizing::PoolKind;
use crate::driver::{DevicePtr, StreamId};

pub type BlockId = u32;

/// PyTorch's `MempoolId_t`: a pair of integers naming a private pool.
pub type PoolId = (u64, u64);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed to a caller.
    Allocated,
    /// Freed by the caller, but other streams it was recorded on may still use it.
    AwaitingEvents,
    /// Cached in its pool's free list.
    Free,
    /// Cached unmerged and unlisted, for the next request of its exact size on its stream
    /// (`State::park`).
    Parked,
}

/// `Block::prev`/`next` when there is no neighbour (`BlockArena::insert` never hands it out).
const NO_BLOCK: BlockId = BlockId::MAX;

/// What few blocks carry: a private pool, other streams that used it. Boxed so that the
/// common block (general cache, one stream) stays within a cache line.
#[derive(Clone, Debug, Default)]
struct Extra {
    /// The private pool (CUDA graph) the segment belongs to; `None` = the general cache.
    owner: Option<PoolId>,
    /// Other streams that used the block (`record_stream`); they are waited for on free.
    stream_uses: Vec<StreamId>,
}

/// A piece of a segment: where it lies, whose it is, and its state. Its fields change only
/// through the transitions below and the arena's splits and merges, which keep the chain of
/// a segment's blocks linked in address order.
///
/// Every alloc and free reads and writes several blocks, at random: the fields are packed
/// into 64 bytes (`block_fits_a_cache_line`), the rare ones boxed in `Extra`, and a block
/// starts a line, so that reading one touches one line rather than two (the arena is a
/// vector, which the heap aligns to 16 bytes only).
#[derive(Clone, Debug)]
#[repr(align(64))]
pub struct Block {
    addr: DevicePtr,
    size: u64,
    /// The stream the segment was allocated for; the block is reused only there.
    stream: StreamId,
    /// Handed out or awaiting events: the bytes the caller asked for (before rounding).
    /// Free: the pool's lookup count when the block was cached, its age for garbage
    /// collection. Otherwise (held, parked) 0. One word for both: no state needs both.
    stamp: u64,
    /// The thread front (`front::FrontCell::id`) that holds this handed-out block; 0: none.
    front: u64,
    /// `None` for a general-cache block used on its own stream only.
    extra: Option<Box<Extra>>,
    /// Neighbours inside the same segment, by address (`NO_BLOCK`: none).
    prev: BlockId,
    next: BlockId,
    pool: PoolKind,
    state: BlockState,
    /// Lies in a paged (virtual memory) segment: pages are mapped as blocks need them.
    paged: bool,
    /// Counted in `oversize_allocations` when handed out (so the count comes off exactly
    /// even if `max_split_size` changes meanwhile).
    counted_oversize: bool,
    /// Every byte lies in the ranges handed-out blocks have covered (`State::note_used`):
    /// handing it out again needs no lookup there. Those ranges only grow while the segment
    /// lives, so its pieces keep it, and a merge keeps it only if both parts had it.
    in_used: bool,
}

#[inline]
fn link(id: BlockId) -> Option<BlockId> {
    (id != NO_BLOCK).then_some(id)
}

/// The extension of a block of private pool `owner`, if it needs one.
fn owner_extra(owner: Option<PoolId>) -> Option<Box<Extra>> {
    owner.map(|owner| {
        Box::new(Extra {
            owner: Some(owner),
            stream_uses: Vec::new(),
        })
    })
}

impl Block {
    /// A fresh segment `[addr, addr+size)` as one free block.
    pub fn whole_segment(
        addr: DevicePtr,
        size: u64,
        stream: StreamId,
        pool: PoolKind,
        owner: Option<PoolId>,
        paged: bool,
        cached_at: u64,
    ) -> Self {
        Block {
            addr,
            size,
            stream,
            stamp: cached_at,
            front: 0,
            extra: owner_extra(owner),
            prev: NO_BLOCK,
            next: NO_BLOCK,
            pool,
            state: BlockState::Free,
            paged,
            counted_oversize: false,
            in_used: false,
        }
    }

    #[inline]
    pub fn addr(&self) -> DevicePtr {
        self.addr
    }

    #[inline]
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes the caller asked for (before rounding); 0 while free, parked or held.
    #[inline]
    pub fn requested(&self) -> u64 {
        match self.state {
            BlockState::Allocated | BlockState::AwaitingEvents => self.stamp,
            BlockState::Free | BlockState::Parked => 0,
        }
    }

    #[inline]
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    #[inline]
    pub fn pool(&self) -> PoolKind {
        self.pool
    }

    #[inline]
    pub fn owner(&self) -> Option<PoolId> {
        self.extra.as_ref().and_then(|e| e.owner)
    }

    #[inline]
    pub fn paged(&self) -> bool {
        self.paged
    }

    #[inline]
    pub fn counted_oversize(&self) -> bool {
        self.counted_oversize
    }

    /// Every byte lies in ranges blocks handed out have covered (`State::note_used`).
    #[inline]
    pub fn in_used(&self) -> bool {
        self.in_used
    }

    /// All its bytes were just noted as used.
    #[inline]
    pub fn set_in_used(&mut self) {
        self.in_used = true;
    }

    #[inline]
    pub fn prev(&self) -> Option<BlockId> {
        link(self.prev)
    }

    #[inline]
    pub fn next(&self) -> Option<BlockId> {
        link(self.next)
    }

    #[inline]
    pub fn state(&self) -> BlockState {
        self.state
    }

    #[inline]
    pub fn stream_uses(&self) -> &[StreamId] {
        self.extra.as_ref().map_or(&[], |e| &e.stream_uses)
    }

    /// The pool's lookup count when the block was cached (the block being free).
    #[inline]
    pub fn cached_at(&self) -> u64 {
        debug_assert_eq!(self.state, BlockState::Free, "only a free block has an age");
        self.stamp
    }

    #[inline]
    pub fn front(&self) -> u64 {
        self.front
    }

    /// Handed to a caller who asked for `requested` bytes; `oversize`: counted in
    /// `oversize_allocations`.
    #[inline]
    pub fn mark_handed_out(&mut self, requested: u64, oversize: bool) {
        self.state = BlockState::Allocated;
        self.stamp = requested;
        self.counted_oversize = oversize;
    }

    /// Taken from the cache but not yet handed out (its pages are being mapped): not free,
    /// so that no merge or reclaim touches it meanwhile.
    pub fn hold(&mut self) {
        self.state = BlockState::Allocated;
        self.stamp = 0;
    }

    /// Given back by its caller: waits for the streams it was used on, which it returns.
    #[inline]
    pub fn mark_awaiting(&mut self) -> Vec<StreamId> {
        self.state = BlockState::AwaitingEvents;
        self.take_stream_uses()
    }

    /// Cached in its pool's free list at lookup count `cached_at`.
    #[inline]
    pub fn mark_free(&mut self, cached_at: u64) {
        self.state = BlockState::Free;
        self.stamp = cached_at;
    }

    /// Parked, unmerged and unlisted.
    #[inline]
    pub fn mark_parked(&mut self) {
        self.state = BlockState::Parked;
        self.stamp = 0;
    }

    /// The other streams it is used on, kept while their events wait.
    pub fn set_stream_uses(&mut self, uses: Vec<StreamId>) {
        if uses.is_empty() && self.extra.is_none() {
            return;
        }
        self.extra.get_or_insert_default().stream_uses = uses;
    }

    pub fn take_stream_uses(&mut self) -> Vec<StreamId> {
        match &mut self.extra {
            None => Vec::new(),
            Some(e) => std::mem::take(&mut e.stream_uses),
        }
    }

    /// Used on `stream` too (nothing changes for its own stream or one already noted).
    pub fn add_stream_use(&mut self, stream: StreamId) {
        if self.stream != stream && !self.stream_uses().contains(&stream) {
            self.extra.get_or_insert_default().stream_uses.push(stream);
        }
    }

    /// Held by thread front `front` (0: none).
    pub fn set_front(&mut self, front: u64) {
        self.front = front;
    }

    #[inline]
    pub fn is_split(&self) -> bool {
        self.prev != NO_BLOCK || self.next != NO_BLOCK
    }

    /// A free block spanning a whole plain (not paged) segment: releasable to the driver.
    pub fn is_whole_plain_segment(&self) -> bool {
        !self.is_split() && !self.paged
    }

    #[inline]
    pub fn end(&self) -> DevicePtr {
        self.addr + self.size
    }

    /// A free piece `[addr, addr+size)` of this block's segment, linked between `prev` and
    /// `next` (the caller fixes the neighbours' links).
    fn free_piece(
        &self,
        addr: DevicePtr,
        size: u64,
        prev: BlockId,
        next: BlockId,
        cached_at: u64,
    ) -> Block {
        Block {
            addr,
            size,
            stream: self.stream,
            stamp: cached_at,
            front: 0,
            extra: owner_extra(self.owner()),
            prev,
            next,
            pool: self.pool,
            state: BlockState::Free,
            paged: self.paged,
            counted_oversize: false,
            in_used: self.in_used,
        }
    }
}

/// Owns every block; ids stay valid until `remove`, and freed slots are reused.
#[derive(Default)]
pub struct BlockArena {
    slots: Vec<Option<Block>>,
    vacant: Vec<BlockId>,
}

impl BlockArena {
    pub fn insert(&mut self, block: Block) -> BlockId {
        match self.vacant.pop() {
            Some(id) => {
                self.slots[id as usize] = Some(block);
                id
            }
            None => {
                let id = BlockId::try_from(self.slots.len())
                    .ok()
                    .filter(|&id| id != NO_BLOCK)
                    .expect("fewer than 2^32 - 1 blocks");
                self.slots.push(Some(block));
                id
            }
        }
    }

    pub fn remove(&mut self, id: BlockId) -> Block {
        let block = self.slots[id as usize].take().expect("block id is live");
        self.vacant.push(id);
        block
    }

    #[inline]
    pub fn get(&self, id: BlockId) -> &Block {
        self.slots[id as usize].as_ref().expect("block id is live")
    }

    #[inline]
    pub fn get_mut(&mut self, id: BlockId) -> &mut Block {
        self.slots[id as usize].as_mut().expect("block id is live")
    }

    /// Cuts block `id` after its first `size` bytes: the rest becomes a new free block
    /// (unlisted) linked after it, at lookup count `cached_at`. Returns the new block.
    pub fn split_off_back(&mut self, id: BlockId, size: u64, cached_at: u64) -> BlockId {
        let block = self.get(id);
        let next = block.next;
        let rest = block.free_piece(block.addr + size, block.size - size, id, next, cached_at);
        let rest_id = self.insert(rest);
        if next != NO_BLOCK {
            self.get_mut(next).prev = rest_id;
        }
        let block = self.get_mut(id);
        block.next = rest_id;
        block.size = size;
        rest_id
    }

    /// Cuts block `id` at `at`: the part before becomes a new free block (unlisted) linked
    /// before it, and `id` keeps the rest. Returns the new block, and whether it now starts
    /// its segment (the caller's segment table names its first block).
    pub fn split_off_front(&mut self, id: BlockId, at: DevicePtr) -> (BlockId, bool) {
        let block = self.get(id);
        let (addr, prev) = (block.addr, block.prev);
        debug_assert!(at > addr && at < block.end());
        let front = block.free_piece(addr, at - addr, prev, id, block.cached_at());
        let front_id = self.insert(front);
        let starts_segment = prev == NO_BLOCK;
        if !starts_segment {
            self.get_mut(prev).next = front_id;
        }
        let block = self.get_mut(id);
        block.size -= at - addr;
        block.addr = at;
        block.prev = front_id;
        (front_id, starts_segment)
    }

    /// Merges `neighbour` (adjacent, before or after) into `id`, which takes over its bytes
    /// and links. Returns the neighbour as it was, and whether `id` now starts its segment.
    pub fn absorb(&mut self, id: BlockId, neighbour: BlockId) -> (Block, bool) {
        let other = self.remove(neighbour);
        let block = self.get_mut(id);
        block.size += other.size;
        block.in_used &= other.in_used;
        let mut starts_segment = false;
        if other.addr < block.addr {
            block.addr = other.addr;
            block.prev = other.prev;
            match other.prev() {
                Some(p) => self.get_mut(p).next = id,
                None => starts_segment = true,
            }
        } else {
            block.next = other.next;
            if let Some(n) = other.next() {
                self.get_mut(n).prev = id;
            }
        }
        (other, starts_segment)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every alloc and free touches several blocks at random: one fits a cache line.
    #[test]
    fn block_fits_a_cache_line() {
        assert_eq!(std::mem::size_of::<Block>(), 64);
        assert_eq!(std::mem::align_of::<Block>(), 64);
        assert_eq!(
            std::mem::size_of::<Option<Block>>(),
            std::mem::size_of::<Block>()
        );
    }

    /// The word shared by `requested` and `cached_at` reads as each state defines it, and
    /// the rare fields survive splits (the owner) or stay with the block (stream uses).
    #[test]
    fn shared_fields_read_per_state() {
        let owner = Some((7, 9));
        let mut arena = BlockArena::default();
        let id = arena.insert(Block::whole_segment(
            1 << 20,
            8192,
            StreamId(1),
            PoolKind::Small,
            owner,
            false,
            42,
        ));
        assert_eq!(
            (arena.get(id).cached_at(), arena.get(id).requested()),
            (42, 0)
        );
        arena.get_mut(id).mark_handed_out(1000, false);
        assert_eq!(arena.get(id).requested(), 1000);
        arena.get_mut(id).add_stream_use(StreamId(2));
        arena.get_mut(id).add_stream_use(StreamId(1));
        arena.get_mut(id).add_stream_use(StreamId(2));
        assert_eq!(arena.get(id).stream_uses(), &[StreamId(2)]);
        assert_eq!(arena.get_mut(id).mark_awaiting(), vec![StreamId(2)]);
        assert!(arena.get(id).stream_uses().is_empty());
        assert_eq!(arena.get(id).requested(), 1000);
        arena.get_mut(id).mark_parked();
        assert_eq!(arena.get(id).requested(), 0);
        arena.get_mut(id).mark_free(50);
        assert_eq!(
            (arena.get(id).cached_at(), arena.get(id).requested()),
            (50, 0)
        );
        let rest = arena.split_off_back(id, 4096, 60);
        let front = arena.split_off_front(id, (1 << 20) + 512).0;
        for (b, at) in [(id, 50), (rest, 60), (front, 50)] {
            assert_eq!(arena.get(b).owner(), owner);
            assert_eq!(arena.get(b).cached_at(), at);
        }
        assert_eq!(arena.get(front).prev(), None);
        assert_eq!(arena.get(front).next(), Some(id));
        assert_eq!(arena.get(id).next(), Some(rest));
        assert_eq!(arena.get(rest).prev(), Some(id));
        assert_eq!(arena.get(rest).next(), None);
        arena.get_mut(id).hold();
        assert_eq!(arena.get(id).requested(), 0);
    }
}
