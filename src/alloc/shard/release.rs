//! The slow path's other half: giving memory back to the driver (cache flushes, garbage
//! collection, the OOM retries) and turning completed cross-stream events into cached blocks.

use super::super::core::blocks::BlockId;
use super::super::core::free_lists::PoolId;
use super::super::driver_error;
use super::super::sizing::PoolKind;
use super::super::state::{AwaitingEvents, State};
use super::Shard;
use crate::driver::StreamId;
use crate::error::Result;

impl Shard {
    /// Returns a cached whole-segment block to the driver.
    pub(in crate::alloc) fn release_segment(&self, st: &mut State, id: BlockId) -> Result<()> {
        let block = st.block(id);
        let (addr, size, pool) = (block.addr(), block.size(), block.pool());
        st.unlist(id);
        st.stats_mut().num_device_free += 1;
        // No longer counted before the driver has it back: another shard may take this
        // memory from the driver the moment it is free, and were it still counted then,
        // the device's reserved bytes (and their peak) would pass what the device has.
        st.sub_reserved(pool, size);
        if let Err(e) = self.driver.release(self.device, addr, size) {
            // Still ours: put it back so the bookkeeping stays whole.
            st.add_reserved(pool, size);
            st.relist(id);
            return Err(driver_error(self.device, e));
        }
        st.remove_segment(id);
        Ok(())
    }

    /// Releases cached oversize segments of the request's pool on `stream` until `rounded`
    /// bytes could fit. As PyTorch's `release_available_cached_blocks`, only the request's
    /// own pool is searched: the small pool has no oversize blocks, so a small request goes
    /// straight to releasing everything (one retry, one synchronize counted).
    pub(in crate::alloc) fn release_oversize_cached(
        &self,
        st: &mut State,
        pool: PoolKind,
        stream: StreamId,
        rounded: u64,
    ) -> Result<bool> {
        let max_split = st.config().max_split_size;
        if max_split == u64::MAX || pool != PoolKind::Large {
            return Ok(false);
        }
        let wanted = rounded.max(max_split);
        let large = st.caches().general(PoolKind::Large);
        let one = large
            .best_fit(stream, wanted)
            .map(|(_, id)| id)
            .filter(|&id| st.block(id).is_whole_plain_segment());
        let chosen = match one {
            Some(id) => vec![id],
            None => {
                let mut total = 0;
                let mut picked = Vec::new();
                for id in large.largest_first(stream, max_split) {
                    if total >= wanted {
                        break;
                    }
                    if st.block(id).is_whole_plain_segment() {
                        total += st.block(id).size();
                        picked.push(id);
                    }
                }
                if picked.is_empty() {
                    return Ok(false);
                }
                picked
            }
        };
        let released: u64 = chosen.iter().map(|&id| st.block(id).size()).sum();
        self.sync_device(st)?;
        for id in chosen {
            self.release_segment(st, id)?;
        }
        Ok(released >= wanted)
    }

    /// Waits for every pending cross-stream event, then returns every unused segment (of the
    /// general cache and of private pools nobody holds).
    pub(in crate::alloc) fn release_all_cached(&self, st: &mut State) -> Result<()> {
        self.merge_set_aside(st);
        st.stats_mut().num_sync_all_streams += 1;
        self.drain_awaiting(st)?;
        self.sync_device(st)?;
        let lists = st.caches().releasable();
        self.release_whole_segments(st, &lists)?;
        let released = self.release_paged_cache(st);
        st.caches_mut().prune();
        released
    }

    /// Releases the cached whole segments of a free list that are smaller than `size`, the
    /// segment about to be made (`Driver::releases_outgrown_segments`).
    pub(in crate::alloc) fn release_outgrown(
        &self,
        st: &mut State,
        owner: Option<PoolId>,
        pool: PoolKind,
        size: u64,
    ) -> Result<()> {
        let Some(list) = st.caches().try_list(owner, pool) else {
            return Ok(());
        };
        let outgrown: Vec<BlockId> = list
            .ids()
            .filter(|&id| {
                let b = st.block(id);
                b.is_whole_plain_segment() && b.size() < size
            })
            .collect();
        if outgrown.is_empty() {
            return Ok(());
        }
        // A free block's own stream may still be reading it: the device finishes first.
        self.sync_device(st)?;
        for id in outgrown {
            self.release_segment(st, id)?;
        }
        Ok(())
    }

    /// Releases every cached block that spans a whole segment in the given free lists.
    pub(in crate::alloc) fn release_whole_segments(
        &self,
        st: &mut State,
        lists: &[(Option<PoolId>, PoolKind)],
    ) -> Result<()> {
        for &(owner, pool) in lists {
            // Releasing a pool's last segment removes the pool.
            let Some(list) = st.caches().try_list(owner, pool) else {
                continue;
            };
            let whole: Vec<BlockId> = list
                .ids()
                .filter(|&id| st.block(id).is_whole_plain_segment())
                .collect();
            for id in whole {
                self.release_segment(st, id)?;
            }
        }
        Ok(())
    }

    /// Cached blocks may still be read by kernels queued before they were freed (frees are
    /// stream-ordered), so the device finishes its work before segments go back. Afterwards
    /// every free so far is done, and so is every fence.
    pub(in crate::alloc) fn sync_device(&self, st: &mut State) -> Result<()> {
        self.driver
            .synchronize(self.device)
            .map_err(|e| driver_error(self.device, e))?;
        self.fences_synced(st);
        Ok(())
    }

    /// Waits for every pending event and caches its block.
    /// Deferred blocks get their events first (`retry_deferred`).
    fn drain_awaiting(&self, st: &mut State) -> Result<()> {
        self.retry_deferred(st)?;
        while let Some(mut pending) = st.pop_awaiting() {
            while let Some(&event) = pending.events.last() {
                if let Err(e) = self.driver.wait_event(self.device, event) {
                    // The block stays unusable rather than risk reuse while in use, and
                    // awaiting with the events not yet waited for: the next drain tries
                    // again.
                    st.push_awaiting(pending);
                    return Err(driver_error(self.device, e));
                }
                self.driver.destroy_event(self.device, event);
                pending.events.pop();
            }
            let addr = st.block(pending.block).addr();
            crate::history::reusable(self.device as i32, addr);
            let _ = st.cache(pending.block);
        }
        Ok(())
    }

    /// Caches blocks whose cross-stream events have all completed.
    pub(in crate::alloc) fn poll_events(&self, st: &mut State) -> Result<()> {
        let mut i = 0;
        while let Some(events) = st.awaiting_events(i) {
            let mut done = true;
            for &event in events {
                if !self
                    .driver
                    .event_done(self.device, event)
                    .map_err(|e| driver_error(self.device, e))?
                {
                    done = false;
                    break;
                }
            }
            if done {
                let pending = st.take_awaiting(i);
                for event in pending.events {
                    self.driver.destroy_event(self.device, event);
                }
                let addr = st.block(pending.block).addr();
                crate::history::reusable(self.device as i32, addr);
                let _ = st.cache(pending.block);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Records an event on each stream that used the block; it becomes reusable when all
    /// have completed. Without events (recording failed) the device is synchronized instead.
    /// Should neither events nor the synchronize fallback work, the block is deferred
    /// (`State::defer`, its streams kept): unusable, not lost; `retry_deferred` tries
    /// again at the next empty_cache or OOM.
    pub(in crate::alloc) fn await_streams(
        &self,
        st: &mut State,
        id: BlockId,
        uses: Vec<StreamId>,
    ) -> Result<()> {
        let result = self.record_or_sync(st, id, &uses);
        if result.is_err() {
            st.defer(id, uses);
        }
        result
    }

    /// Blocks whose events could not be recorded (or that were freed during a capture) get
    /// their events now; on a failure, the rest stay deferred.
    pub(in crate::alloc) fn retry_deferred(&self, st: &mut State) -> Result<()> {
        if st.capturing() {
            return Ok(());
        }
        while let Some((id, uses)) = st.pop_deferred() {
            self.await_streams(st, id, uses)?;
        }
        Ok(())
    }

    fn record_or_sync(&self, st: &mut State, id: BlockId, uses: &[StreamId]) -> Result<()> {
        let mut events = Vec::with_capacity(uses.len());
        for &stream in uses {
            match self.driver.record_event(self.device, stream) {
                Ok(event) => events.push(event),
                Err(e) => {
                    tracing::warn!(
                        device = self.device,
                        "record_event failed ({e}); synchronizing"
                    );
                    for event in events.drain(..) {
                        self.driver.destroy_event(self.device, event);
                    }
                    self.sync_device(st)?;
                    // A stream of another device is not covered by this device's
                    // synchronize: each recorded one is waited for itself (the events
                    // already made for some of them were just dropped).
                    for &other in uses {
                        self.driver
                            .synchronize_stream(self.device, other)
                            .map_err(|e| super::super::driver_error(self.device, e))?;
                    }
                    break;
                }
            }
        }
        if events.is_empty() {
            crate::history::reusable(self.device as i32, st.block(id).addr());
            let _ = st.cache(id);
        } else {
            st.push_awaiting(AwaitingEvents { block: id, events });
        }
        Ok(())
    }

    /// Above `garbage_collection_threshold` × limit (the fraction's, else the device's;
    /// PyTorch collects only under a fraction), releases the oldest cached whole segments of
    /// the large pool (at least average age) until back under it.
    pub(in crate::alloc) fn collect_garbage(&self, st: &mut State) -> Result<()> {
        let threshold =
            (st.config().garbage_collection_threshold * self.hard_limit(st) as f64) as u64;
        let reserved = st.device_reserved()?;
        if reserved <= threshold {
            return Ok(());
        }
        let target = reserved - threshold;
        let large = st.caches().general(PoolKind::Large);
        let now = large.lookups();
        let mut candidates: Vec<(u64, BlockId)> = large
            .ids()
            .filter(|&id| st.block(id).is_whole_plain_segment())
            .map(|id| (now - st.block(id).cached_at(), id))
            .collect();
        let mut chosen = Vec::new();
        let mut reclaimed = 0;
        while reclaimed < target && !candidates.is_empty() {
            let average =
                candidates.iter().map(|c| c.0 as f64).sum::<f64>() / candidates.len() as f64;
            let (old, young): (Vec<_>, Vec<_>) =
                candidates.into_iter().partition(|c| c.0 as f64 >= average);
            if old.is_empty() {
                break;
            }
            reclaimed += old.iter().map(|&(_, id)| st.block(id).size()).sum::<u64>();
            chosen.extend(old.into_iter().map(|(_, id)| id));
            candidates = young;
        }
        if chosen.is_empty() {
            return Ok(());
        }
        self.sync_device(st)?;
        for id in chosen {
            self.release_segment(st, id)?;
        }
        Ok(())
    }
}
