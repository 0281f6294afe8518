//! Recording, polling and waiting on fences (`paging::fences`) through the driver.

use super::super::paging::fences::MAX_FENCES_PER_STREAM;
use super::super::state::State;
use super::super::{driver_error, Shard};
use crate::driver::StreamId;
use crate::error::Result;
use std::time::Instant;

impl Shard {
    /// Records a fence on `stream` (alive: the caller allocates on it, or has just freed a
    /// block of it, as PyTorch does) unless one already covers every free so far, too many
    /// are pending, or a graph is being captured.
    pub(in crate::alloc) fn record_fence(&self, st: &mut State, stream: StreamId) {
        if st.capturing() || st.fences().is_done(stream, st.free_seq()) {
            return;
        }
        if st.fences().covers(stream, st.free_seq()) {
            return;
        }
        // Retire the stream's completed fences once half the queue is pending: otherwise
        // they are noticed only when pages move, and a long run without moves would fill
        // the queue and stop fencing. Not at every record: a query costs about as much as
        // the record itself. (A failed query only leaves them queued.)
        let mut pending = st.fences().pending_on(stream);
        if pending >= MAX_FENCES_PER_STREAM / 2 {
            let _ = self.poll_fences(st, Some(stream));
            pending = st.fences().pending_on(stream);
        }
        if pending >= MAX_FENCES_PER_STREAM || st.fences().is_done(stream, st.free_seq()) {
            return;
        }
        match self.driver.record_event(self.device, stream) {
            Ok(event) => {
                let seq = st.free_seq();
                st.fences_mut().push(stream, seq, event);
            }
            // Only an optimisation: without fences, growth waits instead.
            Err(e) => tracing::debug!(device = self.device, "fence not recorded: {e}"),
        }
    }

    /// Notes the fences that have completed, of `only` that stream or of all.
    pub(in crate::alloc) fn poll_fences(
        &self,
        st: &mut State,
        only: Option<StreamId>,
    ) -> Result<()> {
        st.fences_mut().poll(
            only,
            |event| {
                self.driver
                    .event_done(self.device, event)
                    .map_err(|e| driver_error(self.device, e))
            },
            |event| self.driver.destroy_event(self.device, event),
        )
    }

    /// After a device synchronize (`sync_device`): every free so far and every fence is
    /// done.
    pub(in crate::alloc) fn fences_synced(&self, st: &mut State) {
        let seq = st.free_seq();
        st.fences_mut()
            .synced(seq, |event| self.driver.destroy_event(self.device, event));
    }

    /// Blocks until the device has done `stream`'s work queued before free `seq`: on the
    /// oldest fence covering it; else, on the caller's own stream, on a fence recorded now;
    /// else on the whole device (another stream may have been destroyed since its frees).
    pub(in crate::alloc) fn wait_for_free(
        &self,
        st: &mut State,
        stream: StreamId,
        seq: u64,
        caller: StreamId,
    ) -> Result<()> {
        if st.fences().is_done(stream, seq) {
            return Ok(());
        }
        let i = match st.fences().covering(stream, seq) {
            Some(i) => i,
            None if stream == caller => match self.driver.record_event(self.device, stream) {
                Ok(event) => {
                    let seq = st.free_seq();
                    st.fences_mut().push(stream, seq, event)
                }
                Err(e) => {
                    tracing::warn!(
                        device = self.device,
                        "record_event failed ({e}); synchronizing"
                    );
                    return self.sync_before_moves(st);
                }
            },
            None => return self.sync_before_moves(st),
        };
        let started = Instant::now();
        let waited = self.driver.wait_event(self.device, st.fences().event_at(i));
        self.note_wait(st, started);
        waited.map_err(|e| driver_error(self.device, e))?;
        // It and the stream's older fences are done now.
        self.poll_fences(st, Some(stream))
    }

    /// A device synchronize so that pages may move (a host wait, for the paging stats).
    pub(in crate::alloc) fn sync_before_moves(&self, st: &mut State) -> Result<()> {
        let started = Instant::now();
        let synced = self.sync_device(st);
        self.note_wait(st, started);
        synced
    }

    /// Counts a host wait for the device that began at `started`: in the paging statistics,
    /// and as time the growth under way did not spend moving (`MoveClock`).
    fn note_wait(&self, st: &mut State, started: Instant) {
        let waited = started.elapsed();
        let paging = &mut st.stats_mut().paging;
        paging.host_waits += 1;
        paging.wait_ns += waited.as_nanos() as u64;
        st.moves_mut().note_wait(waited);
    }
}
