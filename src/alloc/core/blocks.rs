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

/// A piece of a segment: where it lies, whose it is, and its state. Its fields change only
/// through the transitions below and the arena's splits and merges, which keep the chain of
/// a segment's blocks linked in address order.
#[derive(Clone, Debug)]
pub struct Block {
    addr: DevicePtr,
    size: u64,
    /// Bytes the caller asked for (before rounding); 0 while free.
    requested: u64,
    /// The stream the segment was allocated for; the block is reused only there.
    stream: StreamId,
    pool: PoolKind,
    /// The private pool (CUDA graph) the segment belongs to; `None` = the general cache.
    owner: Option<PoolId>,
    /// Lies in a paged (virtual memory) segment: pages are mapped as blocks need them.
    paged: bool,
    /// Counted in `oversize_allocations` when handed out (so the count comes off exactly
    /// even if `max_split_size` changes meanwhile).
    counted_oversize: bool,
    /// Neighbours inside the same segment, by address.
    prev: Option<BlockId>,
    next: Option<BlockId>,
    state: BlockState,
    /// Other streams that used the block (`record_stream`); they are waited for on free.
    stream_uses: Vec<StreamId>,
    /// The pool's lookup count when the block was cached; its age for garbage collection.
    cached_at: u64,
    /// The thread front (`front::FrontCell::id`) that holds this handed-out block; 0: none.
    front: u64,
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
            requested: 0,
            stream,
            pool,
            owner,
            paged,
            counted_oversize: false,
            prev: None,
            next: None,
            state: BlockState::Free,
            stream_uses: Vec::new(),
            cached_at,
            front: 0,
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

    #[inline]
    pub fn requested(&self) -> u64 {
        self.requested
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
        self.owner
    }

    #[inline]
    pub fn paged(&self) -> bool {
        self.paged
    }

    #[inline]
    pub fn counted_oversize(&self) -> bool {
        self.counted_oversize
    }

    #[inline]
    pub fn prev(&self) -> Option<BlockId> {
        self.prev
    }

    #[inline]
    pub fn next(&self) -> Option<BlockId> {
        self.next
    }

    #[inline]
    pub fn state(&self) -> BlockState {
        self.state
    }

    #[inline]
    pub fn stream_uses(&self) -> &[StreamId] {
        &self.stream_uses
    }

    #[inline]
    pub fn cached_at(&self) -> u64 {
        self.cached_at
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
        self.requested = requested;
        self.counted_oversize = oversize;
    }

    /// Taken from the cache but not yet handed out (its pages are being mapped): not free,
    /// so that no merge or reclaim touches it meanwhile.
    pub fn hold(&mut self) {
        self.state = BlockState::Allocated;
    }

    /// Given back by its caller: waits for the streams it was used on, which it returns.
    #[inline]
    pub fn mark_awaiting(&mut self) -> Vec<StreamId> {
        self.state = BlockState::AwaitingEvents;
        std::mem::take(&mut self.stream_uses)
    }

    /// Cached in its pool's free list at lookup count `cached_at`.
    #[inline]
    pub fn mark_free(&mut self, cached_at: u64) {
        self.state = BlockState::Free;
        self.requested = 0;
        self.cached_at = cached_at;
    }

    /// Parked, unmerged and unlisted.
    #[inline]
    pub fn mark_parked(&mut self) {
        self.state = BlockState::Parked;
        self.requested = 0;
    }

    /// The other streams it is used on, kept while their events wait.
    pub fn set_stream_uses(&mut self, uses: Vec<StreamId>) {
        self.stream_uses = uses;
    }

    pub fn take_stream_uses(&mut self) -> Vec<StreamId> {
        std::mem::take(&mut self.stream_uses)
    }

    /// Used on `stream` too (nothing changes for its own stream or one already noted).
    pub fn add_stream_use(&mut self, stream: StreamId) {
        if self.stream != stream && !self.stream_uses.contains(&stream) {
            self.stream_uses.push(stream);
        }
    }

    /// Held by thread front `front` (0: none).
    pub fn set_front(&mut self, front: u64) {
        self.front = front;
    }

    #[inline]
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
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
        prev: Option<BlockId>,
        next: Option<BlockId>,
        cached_at: u64,
    ) -> Block {
        Block {
            addr,
            size,
            requested: 0,
            stream: self.stream,
            pool: self.pool,
            owner: self.owner,
            paged: self.paged,
            counted_oversize: false,
            prev,
            next,
            state: BlockState::Free,
            stream_uses: Vec::new(),
            cached_at,
            front: 0,
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
                self.slots.push(Some(block));
                (self.slots.len() - 1) as BlockId
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
        let rest = block.free_piece(
            block.addr + size,
            block.size - size,
            Some(id),
            block.next,
            cached_at,
        );
        let rest_id = self.insert(rest);
        if let Some(next) = self.get(rest_id).next {
            self.get_mut(next).prev = Some(rest_id);
        }
        let block = self.get_mut(id);
        block.next = Some(rest_id);
        block.size = size;
        rest_id
    }

    /// Cuts block `id` at `at`: the part before becomes a new free block (unlisted) linked
    /// before it, and `id` keeps the rest. Returns the new block, and whether it now starts
    /// its segment (the caller's segment table names its first block).
    pub fn split_off_front(&mut self, id: BlockId, at: DevicePtr) -> (BlockId, bool) {
        let block = self.get(id);
        let addr = block.addr;
        debug_assert!(at > addr && at < block.end());
        let front = block.free_piece(addr, at - addr, block.prev, Some(id), block.cached_at);
        let front_id = self.insert(front);
        let starts_segment = match self.get(front_id).prev {
            Some(p) => {
                self.get_mut(p).next = Some(front_id);
                false
            }
            None => true,
        };
        let block = self.get_mut(id);
        block.size -= at - addr;
        block.addr = at;
        block.prev = Some(front_id);
        (front_id, starts_segment)
    }

    /// Merges `neighbour` (adjacent, before or after) into `id`, which takes over its bytes
    /// and links. Returns the neighbour as it was, and whether `id` now starts its segment.
    pub fn absorb(&mut self, id: BlockId, neighbour: BlockId) -> (Block, bool) {
        let other = self.remove(neighbour);
        let block = self.get_mut(id);
        block.size += other.size;
        let mut starts_segment = false;
        if other.addr < block.addr {
            block.addr = other.addr;
            block.prev = other.prev;
            match other.prev {
                Some(p) => self.get_mut(p).next = Some(id),
                None => starts_segment = true,
            }
        } else {
            block.next = other.next;
            if let Some(n) = other.next {
                self.get_mut(n).prev = Some(id);
            }
        }
        (other, starts_segment)
    }
}
