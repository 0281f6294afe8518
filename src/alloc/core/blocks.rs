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

#[derive(Clone, Debug)]
pub struct Block {
    pub addr: DevicePtr,
    pub size: u64,
    /// Bytes the caller asked for (before rounding); 0 while free.
    pub requested: u64,
    /// The stream the segment was allocated for; the block is reused only there.
    pub stream: StreamId,
    pub pool: PoolKind,
    /// The private pool (CUDA graph) the segment belongs to; `None` = the general cache.
    pub owner: Option<PoolId>,
    /// Lies in a paged (virtual memory) segment: pages are mapped as blocks need them.
    pub paged: bool,
    /// Counted in `oversize_allocations` when handed out (so the count comes off exactly
    /// even if `max_split_size` changes meanwhile).
    pub counted_oversize: bool,
    /// Neighbours inside the same segment, by address.
    pub prev: Option<BlockId>,
    pub next: Option<BlockId>,
    pub state: BlockState,
    /// Other streams that used the block (`record_stream`); they are waited for on free.
    pub stream_uses: Vec<StreamId>,
    /// The pool's lookup count when the block was cached; its age for garbage collection.
    pub cached_at: u64,
    /// The thread front (`front::FrontCell::id`) that holds this handed-out block; 0: none.
    pub front: u64,
}

impl Block {
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }

    /// A free block spanning a whole plain (not paged) segment: releasable to the driver.
    pub fn is_whole_plain_segment(&self) -> bool {
        !self.is_split() && !self.paged
    }

    pub fn end(&self) -> DevicePtr {
        self.addr + self.size
    }

    /// A free piece `[addr, addr+size)` of this block's segment, linked between `prev` and
    /// `next` (the caller fixes the neighbours' links).
    pub fn free_piece(
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

    pub fn get(&self, id: BlockId) -> &Block {
        self.slots[id as usize].as_ref().expect("block id is live")
    }

    pub fn get_mut(&mut self, id: BlockId) -> &mut Block {
        self.slots[id as usize].as_mut().expect("block id is live")
    }
}
