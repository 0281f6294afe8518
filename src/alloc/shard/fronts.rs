//! The shard's side of the thread fronts (`front`): detaching a block a front holds,
//! adopting a freed block into the caller's front, and draining held blocks back.

use super::super::blocks::{Block, BlockId};
use super::super::state::State;
use super::super::{already_freed, front};
use super::{FreedAt, Shard};
use crate::driver::{DevicePtr, StreamId};
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
        let held = self.fronts.detach(front, ptr)?;
        if held == Some(true) {
            return Err(already_freed(self.device, ptr));
        }
        st.leave_front(id);
        Ok(())
    }

    /// Whether live block `id`, freed now, may wait in a front: a paged block of the general
    /// cache, used on its own stream only, not oversize, outside captures; one over
    /// `front::FRONT_MAX_BLOCK` only while parking does not pause. A large block waits
    /// only until its thread's next visit to the device: to this shard, which returns it
    /// (`return_large_held`), or to another, which returns it here first
    /// (`DeviceAllocator::return_large_held_elsewhere`).
    #[inline]
    pub(in crate::alloc) fn fits_front(&self, st: &State, b: &Block) -> bool {
        let large = b.size() > front::FRONT_MAX_BLOCK;
        b.paged()
            && b.owner().is_none()
            && b.stream_uses().is_empty()
            && !b.counted_oversize()
            && !st.capturing()
            // A large block stands in for a parked one: not while parking pauses.
            && (!large || !st.parking_paused())
    }

    /// Gives a freed block that fits a front (`fits_front`) to `cell` (see `front`). Returns
    /// the front's census, or `None` when the block stays here (the fronts are closed).
    #[inline(never)]
    pub(in crate::alloc) fn adopt(
        &self,
        st: &mut State,
        id: BlockId,
        cell: &front::FrontCell,
    ) -> Option<front::Census> {
        let b = st.block(id);
        let large = b.size() > front::FRONT_MAX_BLOCK;
        debug_assert!(self.fits_front(st, b));
        let stream = b.stream();
        let mut entry = front::Entry::new(b.addr(), b.size(), b.requested(), stream, b.pool(), id);
        // A large block goes back to the shard later, when its stream may be gone: its
        // free is stamped on its pages now, with the fence that would be recorded for it,
        // as parking it would (`FreedAt::Stamped`).
        if large {
            entry.unstamped_frees = 0;
        }
        let (evicted, census) = cell.adopt(&self.fronts, entry)?;
        st.join_front(id, cell.id);
        if large && st.stamp_free(id) && self.free_fence_allowed(st, stream) {
            self.record_fence(st, stream);
        }
        match evicted {
            front::Evicted::None => {}
            front::Evicted::Held(old) => self.free_drained(st, old, None),
            front::Evicted::Out(old) => {
                debug_assert_eq!(st.live_block(old.ptr), Some(old.id), "an out block is live");
                debug_assert_eq!(st.front_of(old.id), cell.id, "in the front it left");
                st.leave_front(old.id);
            }
        }
        Some(census)
    }

    /// The calling thread's held blocks over `front::FRONT_MAX_BLOCK` are freed here, as it
    /// begins a visit (`malloc`, `free`) on stream `alive(st)` (if known): before this visit
    /// could have used them, so the shard ends as if they had been freed here in the first
    /// place. Returns whether any came back (live bytes fell).
    #[inline]
    pub(in crate::alloc) fn return_large_held(
        &self,
        st: &mut State,
        alive: impl FnOnce(&State) -> Option<StreamId>,
    ) -> bool {
        // Every visit asks; in most jobs no large block ever joins a front. Checked here,
        // inlined, so that such a visit does not pay for the call below (nor for `alive`).
        if !st.front_large_joined() {
            return false;
        }
        let alive = alive(st);
        self.return_large_held_now(st, alive)
    }

    /// `return_large_held` for a visit of the calling thread to another shard of the device
    /// (its stream unknown here). Without the shard's check that any large block joined a
    /// front: the caller's front says it holds one, and if another thread's drain took it
    /// meanwhile, looking refreshes that front's count, so the next visit does not ask again.
    pub(in crate::alloc) fn return_callers_large_held(&self) -> Result<()> {
        let mut st = self.lock()?;
        if self.return_large_held_now(&mut st, None) {
            self.publish_live(&st);
        }
        Ok(())
    }

    /// `return_large_held` once a large block has joined a front.
    #[inline(never)]
    fn return_large_held_now(&self, st: &mut State, alive: Option<StreamId>) -> bool {
        let (returned, reused) = front::take_large_held(&self.fronts);
        // Each reuse in the front stands for a park and its reuse here.
        st.note_parked_reuses(reused);
        let any = !returned.is_empty();
        for entry in returned {
            self.free_drained(st, entry, alive);
        }
        any
    }

    /// The shard's one drain of its fronts (`front::Fronts::drain`): every held block is
    /// freed here, and exited threads' fronts are folded into the statistics.
    ///
    /// The invariant: a block held by a front is live to the shard (allocated, in no free
    /// list), so nothing else can take it and a double free of it is still refused. Before
    /// any operation that needs every free block visible, or figures without held blocks,
    /// the fronts drain; each situation calls this from one place:
    /// - slow paths that must see all free memory (growth, mapping pages, a second look for
    ///   a fit, the OOM report, releasing the cache: `empty_cache`, the OOM retry,
    ///   shutdown): `merge_set_aside`;
    /// - an allocation that would pass a peak (`malloc`), a peak reset, new settings (held
    ///   blocks were sized under the old ones), a snapshot (`segments`), restoring a pool's
    ///   layout: the operation itself.
    pub(in crate::alloc) fn drain_fronts(&self, st: &mut State) {
        if st.front_blocks() == 0 && !self.fronts.has_orphans() {
            return;
        }
        self.fronts.drain(|drained| match drained {
            front::Drained::Held(entry) => self.free_drained(st, entry, None),
            front::Drained::Folded(counts) => counts.add_to(st.stats_mut(), false),
        });
    }

    /// Frees a block that left a front (drained, evicted or returned), during a visit on
    /// stream `alive` (if known): the front no longer counts it.
    pub(in crate::alloc) fn free_drained(
        &self,
        st: &mut State,
        entry: front::Entry,
        alive: Option<StreamId>,
    ) {
        let Some(id) = st.live_block(entry.ptr) else {
            debug_assert!(false, "a front held {:#x}, not live", entry.ptr);
            return;
        };
        debug_assert_eq!(id, entry.id);
        st.leave_front(id);
        // Never recorded on another stream (record_stream takes blocks out of fronts).
        let at = match entry.unstamped_frees {
            0 => FreedAt::Stamped,
            frees => FreedAt::Later { alive, frees },
        };
        if let Err(e) = self.free_block(st, id, at) {
            tracing::warn!(device = self.device, "freeing a front's block: {e}");
        }
    }
}
