//! Idle memory shared between a device's shards: a growing shard weighs the whole device's
//! live and reserved bytes, and takes the idle pages other shards hold before it reserves
//! more.

// Shards keep their own caches so that streams on different threads share no data
// (`device`). Left at that, each shard would also keep its own reserve: a page its stream
// freed stays mapped under a free block until that shard grows again, and the device
// reserves the sum of the shards' peaks instead of the peak of their sum. A pipeline whose
// stages peak one after another then reserves up to one peak per stage.
//
// So a growth with several shards weighs the device:
// - its budget is the device's live high-water mark plus the page slack, less what the
//   other shards reserve now: reserved memory anywhere counts, live memory anywhere raises
//   the mark;
// - past the budget, after the shard's own free pages (`Shard::reclaim`), it takes pages
//   from the other shards: first their parked chunks, then chunks wholly under their free
//   blocks that their fences show the device is done with. The physical memory changes
//   hands (unmapped there, mapped here) without being released and made again.
//
// The lending shard's lock is only tried, never waited for: two shards growing at once
// would otherwise each wait for the other's lock while holding its own. A busy shard is
// passed over, and the growth makes new memory instead (the budget is a target, not a
// limit). The device may be waited for, as a growth in one shard does: a chunk is lent
// once the lender's fences show the device past its free, or after the host waits on the
// oldest fence covering it (a device synchronize when none does, since the lender's stream
// may be gone).
//
// Each shard publishes its live bytes in an atomic of its own, written after each of its
// allocations and frees and read only by other shards' growths. A growth may so read
// another shard's live bytes an operation late; the mark then lags by that operation,
// which the next growth corrects.
//
// Limitations: only paged segments lend (a plain segment's memory goes back only whole, on
// the OOM path and `empty_cache`); and a shard whose lock is held at the moment of a
// growth lends nothing to it.

use super::super::paging::table::{pages_of, Spare};
use super::super::state::State;
use super::paging::Pending;
use super::Shard;
use crate::driver::StreamId;
use crate::error::Result;
use std::sync::atomic::Ordering;
use std::time::Duration;

impl Shard {
    /// The live high-water mark and the bytes reserved elsewhere that a growth of `len` more
    /// live bytes weighs: this shard's mark and nothing else while the device has one shard;
    /// with several, the device's mark and what the other shards reserve.
    pub(super) fn weighed_high_water(&self, st: &mut State, len: u64) -> Result<(u64, u64)> {
        let own = st.raise_live_high_water(len);
        let Some(shards) = self.siblings.upgrade().filter(|s| s.several()) else {
            return Ok((own, 0));
        };
        let others: u64 = shards
            .iter()
            .filter(|s| !std::ptr::eq(*s, self))
            .map(|s| s.live.load(Ordering::Relaxed))
            .sum();
        let live = (st.stats().active_bytes.all().current.max(0) as u64)
            .saturating_add(len)
            .saturating_add(others);
        Ok((shards.raise_live_high_water(live), st.reserved_elsewhere()?))
    }

    /// Shards the device has made so far (1 without `per_stream_shards`).
    pub(super) fn shards_made(&self) -> u64 {
        self.siblings
            .upgrade()
            .map_or(1, |shards| shards.iter().count() as u64)
    }

    /// Takes up to about `pages` pages of idle memory from the device's other shards for a
    /// growth on `stream`, as unmapped chunks; chunks of at most `fit` pages first. Busy
    /// shards are passed over.
    pub(super) fn borrow_idle(
        &self,
        st: &mut State,
        stream: StreamId,
        pages: usize,
        fit: usize,
        page: u64,
    ) -> Vec<Spare> {
        let Some(shards) = self.siblings.upgrade() else {
            return Vec::new();
        };
        let mut borrowed = Vec::new();
        for other in shards.iter().filter(|s| !std::ptr::eq(*s, self)) {
            let short = pages.saturating_sub(pages_of(&borrowed));
            if short == 0 {
                break;
            }
            let (lent, waited) = other.lend_idle(stream, short, fit, page);
            // The lender waited for the device on this growth's behalf: time this growth
            // did not spend moving pages (`MoveClock`).
            st.moves_mut().note_wait(waited);
            match lent {
                Ok(lent) => borrowed.extend(lent),
                // The lender keeps what it could not unmap (`reclaim` parks it).
                Err(e) => tracing::debug!(device = self.device, "no idle memory lent: {e}"),
            }
        }
        if !borrowed.is_empty() {
            st.stats_mut().paging.chunks_borrowed += borrowed.len() as u64;
        }
        st.moves_mut().note_moved(!borrowed.is_empty());
        borrowed
    }

    /// Gives up to about `pages` pages of this shard's idle memory to a growth on stream
    /// `borrower`: parked chunks, then chunks under free blocks (waiting for the device as
    /// `reclaim` does). Nothing while this shard is busy, shut down or capturing a graph
    /// (nothing may move then). Also returns how long it waited for the device.
    fn lend_idle(
        &self,
        borrower: StreamId,
        pages: usize,
        fit: usize,
        page: u64,
    ) -> (Result<Vec<Spare>>, Duration) {
        let Some(mut st) = self.state.try_lock() else {
            return (Ok(Vec::new()), Duration::ZERO);
        };
        if self.lifecycle.is_shut_down() || st.capturing() || st.page_size() != Some(page) {
            return (Ok(Vec::new()), Duration::ZERO);
        }
        // Waits are counted under this lock (`note_wait`), which no reset can take meanwhile.
        let waited_before = st.stats().paging.wait_ns;
        let lent = self.lend_locked(&mut st, borrower, pages, fit, page);
        let waited = st.stats().paging.wait_ns.saturating_sub(waited_before);
        (lent, Duration::from_nanos(waited))
    }

    /// `lend_idle` with this shard's state held.
    fn lend_locked(
        &self,
        st: &mut State,
        borrower: StreamId,
        pages: usize,
        fit: usize,
        page: u64,
    ) -> Result<Vec<Spare>> {
        // Blocks parked for reuse at their exact size go back to the free lists first, so
        // that their pages can be found.
        self.merge_set_aside(st);
        let mut parked = self.unpark_all(st, page);
        // Largest first; what is not wanted stays parked here.
        parked.sort_by_key(|s| std::cmp::Reverse(s.pages));
        let mut lent = Vec::new();
        for spare in parked {
            if pages_of(&lent) < pages {
                lent.push(spare);
            } else {
                self.park(st, spare, page);
            }
        }
        let short = pages.saturating_sub(pages_of(&lent));
        if short > 0 {
            match self.reclaim(st, short, 0, fit, 0..0, Pending::WaitOn(borrower)) {
                Ok(unmapped) => lent.extend(unmapped),
                Err(e) => {
                    for spare in lent {
                        self.park(st, spare, page);
                    }
                    return Err(e);
                }
            }
        }
        self.publish_live(st);
        Ok(lent)
    }
}
