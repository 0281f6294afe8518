//! The shard's side of the thread fronts (`front`): detaching a block a front holds,
//! adopting a freed block into the caller's front, and draining held blocks back.

use super::super::blocks::BlockId;
use super::super::state::State;
use super::super::{already_freed, front};
use super::Shard;
use crate::driver::DevicePtr;
use crate::error::Result;

impl Shard {
    /// A live block that a front holds is taken from it, for a free or `record_stream` on
    /// another path (another thread's, or one the front did not see). A block the front
    /// holds as freed is not live for the caller: the double free is refused, nothing
    /// changed.
    pub(in crate::alloc) fn detach_from_front(
        &self,
        st: &mut State,
        id: BlockId,
        ptr: DevicePtr,
    ) -> Result<()> {
        let front = st.front_of(id);
        if front == 0 {
            return Ok(());
        }
        let held = self
            .fronts
            .find(front)?
            .and_then(|cell| cell.front.with(|f| f.detach(ptr)));
        if held == Some(true) {
            return Err(already_freed(self.device, ptr));
        }
        st.leave_front(id);
        Ok(())
    }

    /// Gives a freed block to `cell` (see `front`) when it may wait there: a paged block of
    /// the general cache, used on its own stream only, not oversize, outside captures.
    /// Returns the front's (held, out) census, or `None` when the block stays here.
    pub(in crate::alloc) fn adopt(
        &self,
        st: &mut State,
        id: BlockId,
        cell: &front::FrontCell,
    ) -> Option<(u32, u32)> {
        let b = st.block(id);
        let eligible = b.paged()
            && b.owner().is_none()
            && b.stream_uses().is_empty()
            && !b.counted_oversize()
            && b.size() <= front::FRONT_MAX_BLOCK
            && !st.capturing();
        if !eligible {
            return None;
        }
        let entry = front::Entry::new(b.addr(), b.size(), b.requested(), b.stream(), b.pool(), id);
        let open = &self.fronts.open;
        let adopted = cell.front.with(|f| {
            if !open.load(std::sync::atomic::Ordering::Relaxed) {
                return None;
            }
            let evicted = f.adopt(entry).ok()?;
            Some((evicted, f.census()))
        });
        let (evicted, census) = adopted?;
        st.join_front(id, cell.id);
        if let Some(old) = evicted {
            self.free_drained(st, old);
        }
        Some(census)
    }

    /// Frees blocks that fronts held, in the shard: every front's held blocks (and folds
    /// fronts of exited threads into the statistics once they hold nothing). Every path
    /// that must see the real free memory calls this first.
    pub(in crate::alloc) fn drain_fronts(&self, st: &mut State) {
        use std::sync::atomic::Ordering;
        let orphans = self.fronts.orphans.load(Ordering::Acquire);
        if st.front_blocks() == 0 && orphans == 0 {
            return;
        }
        // No way to report (the slow paths drain as they go): with the registry poisoned the
        // fronts keep their blocks, which stay live to the shard, so nothing is handed out
        // twice; the next call that needs the registry reports the poisoning.
        let Ok(cells) = self.fronts.all() else { return };
        let mut gone = Vec::new();
        for cell in cells {
            let (drained, empty, counts) = cell
                .front
                .with(|f| (f.drain_held(), f.is_empty(), *f.counts()));
            for entry in drained {
                self.free_drained(st, entry);
            }
            if empty && cell.orphaned.load(Ordering::Acquire) {
                counts.add_to(st.stats_mut(), false);
                gone.push(cell.id);
            }
        }
        self.fronts.retire(&gone);
    }

    /// Frees a block that left a front (drained or evicted): the front no longer counts it.
    pub(in crate::alloc) fn free_drained(&self, st: &mut State, entry: front::Entry) {
        let Some(id) = st.live_block(entry.ptr) else {
            debug_assert!(false, "a front held {:#x}, not live", entry.ptr);
            return;
        };
        debug_assert_eq!(id, entry.id);
        st.leave_front(id);
        // Never recorded on another stream (record_stream takes blocks out of fronts).
        if let Err(e) = self.free_block(st, id, false) {
            tracing::warn!(device = self.device, "freeing a front's block: {e}");
        }
    }
}
