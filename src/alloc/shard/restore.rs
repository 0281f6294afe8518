//! Restoring a private pool to a saved layout, as PyTorch's CUDA graph trees ask when a
//! recorded path diverges after a partial replay (`setCheckpointPoolState`): every block of
//! the pool handed out now is freed, then the saved blocks are made again at their exact
//! addresses and sizes, and those saved as handed out stay handed out.

// Invariant relied on: a private pool's segments are plain and never released while the
// pool is held, and once none of its blocks is handed out each segment is one free block
// (frees merge). Carving the saved blocks from each segment's start, in address order,
// then gives back the saved addresses. A pool with a block still awaiting another
// stream's work cannot be restored now: the call fails and the pool's blocks stay freed.

use super::super::core::blocks::{BlockId, BlockState};
use super::super::core::free_lists::PoolId;
use super::super::state::State;
use super::{FreedAt, Shard};
use crate::driver::{DevicePtr, StreamId};
use crate::error::{Error, ErrorKind, Result};

/// One saved block: its address, size, and whether it was handed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SavedBlock {
    pub addr: DevicePtr,
    pub size: u64,
    pub allocated: bool,
}

/// A block a restore made again as handed out: where, its size, and its stream (the
/// allocation history records it as an allocation there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MadeBlock {
    pub ptr: DevicePtr,
    pub size: u64,
    pub stream: StreamId,
}

/// What a restore did: the blocks it freed, and those it made again as handed out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Restored {
    pub freed: Vec<DevicePtr>,
    pub allocated: Vec<MadeBlock>,
    /// Saved segments this shard holds (the device checks every saved one was found).
    pub segments_found: usize,
}

fn refused(message: String) -> Error {
    Error::new(
        ErrorKind::InvalidArgument,
        format!("restore_pool: {message}"),
    )
}

impl Shard {
    /// Restores `pool`'s blocks in the segments of this shard to `saved` (every block of
    /// those segments, in address order; blocks of other shards' segments are skipped).
    pub(in crate::alloc) fn restore_pool(
        &self,
        pool: PoolId,
        saved: &[SavedBlock],
    ) -> Result<Restored> {
        let mut st = self.lock()?;
        self.drain_fronts(&mut st);
        let mut done = Restored::default();
        for (addr, id) in st.live_blocks_of(pool) {
            self.free_block(&mut st, id, FreedAt::CallersFree)?;
            done.freed.push(addr);
        }
        // Every block carved so far, with whether it stays handed out. Until the layout is
        // carved in full they are all handed out; on a failure they are freed again, so that
        // a refused restore leaves none of the pool's blocks handed out (what the caller is
        // told), none unreported in the statistics.
        let mut made: Vec<(BlockId, bool)> = Vec::new();
        // A carved block freed here was never the caller's: no stream known alive, one free.
        const CARVED_UNUSED: FreedAt = FreedAt::Later {
            alive: None,
            frees: 1,
        };
        let carved = self.carve(&mut st, pool, saved, &mut made, &mut done.segments_found);
        if let Err(e) = carved {
            for (id, _) in made {
                self.free_block(&mut st, id, CARVED_UNUSED)?;
            }
            return Err(e);
        }
        for (id, allocated) in made {
            if allocated {
                let b = st.block(id);
                done.allocated.push(MadeBlock {
                    ptr: b.addr(),
                    size: b.size(),
                    stream: b.stream(),
                });
            } else {
                self.free_block(&mut st, id, CARVED_UNUSED)?;
            }
        }
        Ok(done)
    }

    /// Carves `saved` from this shard's segments of `pool` (all free), pushing each block
    /// made to `made`; stops at the first saved block that does not fit.
    fn carve(
        &self,
        st: &mut State,
        pool: PoolId,
        saved: &[SavedBlock],
        made: &mut Vec<(BlockId, bool)>,
        segments_found: &mut usize,
    ) -> Result<()> {
        let mut cursor: Option<BlockId> = None;
        for b in saved {
            if b.size == 0 {
                // Every block has a size: a zero-size one would share its address with
                // the next, which the live table (keyed by address) cannot hold.
                return Err(refused(format!(
                    "the saved block at {:#x} has size 0",
                    b.addr
                )));
            }
            if let Some(seg) = st.segment_at(b.addr) {
                cursor = Some(seg.first);
                *segments_found += 1;
            }
            let Some(id) = cursor else {
                continue; // a segment of another shard
            };
            let block = st.block(id);
            if block.owner() != Some(pool) || block.addr() != b.addr || block.size() < b.size {
                return Err(refused(format!(
                    "the pool's memory at {:#x} no longer matches its saved layout",
                    b.addr
                )));
            }
            if block.state() != BlockState::Free {
                return Err(refused(format!(
                    "the pool's block at {:#x} is still in use by another stream's work",
                    b.addr
                )));
            }
            st.unlist(id);
            st.hand_out_exact(id, b.size);
            made.push((id, b.allocated));
            cursor = st.block(id).next();
        }
        Ok(())
    }
}
