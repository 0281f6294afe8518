//! Fences: events recorded on a stream after a count of frees, and what is known to be done
//! on the device. A page moves only once the device is past the last free on it.

use crate::driver::{EventId, StreamId};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Fences kept pending per stream; beyond this none are recorded until some complete.
pub const MAX_FENCES_PER_STREAM: usize = 64;
/// Streams whose completed fences (and last fence's time) are remembered: a job that makes
/// a stream per request must not leave an entry per stream it ever used. Past it, a page
/// last freed on a forgotten stream costs a wait or a device synchronize to move; a job with
/// this many streams at work at once is rare.
const MAX_DONE_STREAMS: usize = 1024;

/// An event recorded on `stream` after `seq` frees: once it completes, pages of that
/// stream's segments last used by blocks freed up to then can be unmapped without waiting.
pub struct Fence {
    pub stream: StreamId,
    pub seq: u64,
    pub event: EventId,
}

/// The pending fences and what completed ones (and device synchronizes) have shown done.
#[derive(Default)]
pub struct Fences {
    /// Fences not yet seen complete, oldest first (in order per stream).
    pending: VecDeque<Fence>,
    /// Per stream, the newest free whose work is known to be done on the device.
    done_seq: rustc_hash::FxHashMap<StreamId, u64>,
    /// Every free up to this one is done on the device (it was synchronized after it).
    synced_seq: u64,
    /// Per stream, when a free last recorded a fence (`allow_free_fence`).
    last_free_fence: rustc_hash::FxHashMap<StreamId, Instant>,
}

impl Fences {
    /// Whether the device is known to be done with page work of `stream` freed at `seq`.
    pub fn is_done(&self, stream: StreamId, seq: u64) -> bool {
        seq <= self.synced_seq || seq <= self.done_seq.get(&stream).copied().unwrap_or(0)
    }

    /// Whether a pending fence of `stream` covers free `seq`.
    pub fn covers(&self, stream: StreamId, seq: u64) -> bool {
        self.covering(stream, seq).is_some()
    }

    /// The oldest pending fence of `stream` covering free `seq`, by position.
    pub fn covering(&self, stream: StreamId, seq: u64) -> Option<usize> {
        self.pending
            .iter()
            .position(|f| f.stream == stream && f.seq >= seq)
    }

    /// The event of the pending fence at position `i`.
    pub fn event_at(&self, i: usize) -> EventId {
        self.pending[i].event
    }

    /// Fences of `stream` pending.
    pub fn pending_on(&self, stream: StreamId) -> usize {
        self.pending.iter().filter(|f| f.stream == stream).count()
    }

    /// Queues a fence recorded on `stream` after free `seq`; returns its position.
    pub fn push(&mut self, stream: StreamId, seq: u64, event: EventId) -> usize {
        self.pending.push_back(Fence { stream, seq, event });
        self.pending.len() - 1
    }

    /// Notes the fences that have completed, of `only` that stream or of all, asking
    /// `query` whether each event is done (a stream's complete in order, so each is asked
    /// only up to its first pending one) and handing each completed event to `retire`.
    pub fn poll<E>(
        &mut self,
        only: Option<StreamId>,
        mut query: impl FnMut(EventId) -> Result<bool, E>,
        mut retire: impl FnMut(EventId),
    ) -> Result<(), E> {
        let mut blocked: Vec<StreamId> = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            let stream = self.pending[i].stream;
            if only.is_some_and(|s| s != stream) {
                i += 1;
                continue;
            }
            let done = !blocked.contains(&stream) && query(self.pending[i].event)?;
            if done {
                let fence = self.pending.remove(i).expect("in range");
                retire(self.retire(fence));
            } else {
                blocked.push(stream);
                i += 1;
            }
        }
        Ok(())
    }

    /// After a device synchronize that followed free `free_seq`: every free so far and every
    /// fence is done; each fence's event goes to `retire`.
    pub fn synced(&mut self, free_seq: u64, mut retire: impl FnMut(EventId)) {
        self.synced_seq = free_seq;
        while let Some(fence) = self.pending.pop_front() {
            retire(self.retire(fence));
        }
        // `synced_seq` now answers for every free these name (`is_done`).
        self.done_seq.retain(|_, done| *done > free_seq);
    }

    fn retire(&mut self, fence: Fence) -> EventId {
        if self.done_seq.len() >= MAX_DONE_STREAMS && !self.done_seq.contains_key(&fence.stream) {
            self.forget_oldest_done();
        }
        let done = self.done_seq.entry(fence.stream).or_insert(0);
        *done = (*done).max(fence.seq);
        fence.event
    }

    /// Makes room in `done_seq` for one more stream (a job that makes streams as it goes
    /// would otherwise keep one entry per stream it ever used): the one done longest ago
    /// goes. Forgetting is safe: `is_done` then says no, and the caller waits for a fence or
    /// synchronizes the device.
    fn forget_oldest_done(&mut self) {
        let oldest = self
            .done_seq
            .iter()
            .min_by_key(|(_, d)| **d)
            .map(|(s, _)| *s);
        if let Some(oldest) = oldest {
            self.done_seq.remove(&oldest);
        }
    }

    /// Whether a fence due at a free on `stream` may be recorded now: at most one per
    /// `interval` and stream (the clock is read only when one is due).
    pub fn allow_free_fence(&mut self, stream: StreamId, interval: Duration) -> bool {
        if interval.is_zero() {
            return true;
        }
        let now = Instant::now();
        if self.last_free_fence.len() >= MAX_DONE_STREAMS {
            // An entry older than `interval` allows the next fence as no entry does; if the
            // streams are all recent, forgetting them costs at most one early fence each.
            self.last_free_fence
                .retain(|_, last| now.duration_since(*last) < interval);
            if self.last_free_fence.len() >= MAX_DONE_STREAMS {
                self.last_free_fence.clear();
            }
        }
        let last = self.last_free_fence.entry(stream).or_insert(now);
        if *last != now && now.duration_since(*last) < interval {
            return false;
        }
        *last = now;
        true
    }

    /// The newest free a pending fence covers (0: none pending).
    #[cfg(test)]
    pub fn newest_seq(&self) -> u64 {
        self.pending.iter().map(|f| f.seq).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job that makes a stream per request: what is remembered per stream stays bounded,
    /// and forgetting never makes `is_done` say yes where it would have said no.
    #[test]
    fn streams_done_with_are_forgotten_and_answers_stay_safe() {
        let mut f = Fences::default();
        let mut seq = 0;
        for s in 0..10 * MAX_DONE_STREAMS as u64 {
            seq += 1;
            f.push(StreamId(s), seq, EventId(s));
            f.poll(Some(StreamId(s)), |_| Ok::<_, ()>(true), |_| {})
                .unwrap();
            assert!(f.is_done(StreamId(s), seq), "its own fence completed");
            assert!(f.done_seq.len() <= MAX_DONE_STREAMS);
            f.allow_free_fence(StreamId(s), Duration::from_nanos(1));
            assert!(f.last_free_fence.len() <= MAX_DONE_STREAMS + 1);
        }
        // The streams done longest ago were forgotten: their frees are no longer known
        // done (the caller then waits or synchronizes), never wrongly known done.
        assert!(!f.is_done(StreamId(0), 1));
        assert!(!f.is_done(StreamId(1), 2));
        // A synchronize answers for every free up to it, and clears what it answers for.
        f.synced(seq, |_| {});
        assert!(f.done_seq.is_empty());
        assert!(f.is_done(StreamId(0), 1) && f.is_done(StreamId(7), seq));
        assert!(!f.is_done(StreamId(7), seq + 1));
    }
}
