//! Private pools, as PyTorch uses them for CUDA graphs: between `begin_allocate_to_pool` and
//! `end_allocate_to_pool`, allocations on streams the filter accepts come from (and return
//! to) the pool alone, so a captured graph's memory is never handed to anyone else. The pool's
//! cache is released once every holder has called `release_pool`.

use super::super::core::blocks::PoolId;
use super::super::core::free_lists::{RouteFilter, Unheld};
use super::super::sizing::PoolKind;
use super::Shard;
use crate::error::{Error, ErrorKind, Result};

impl Shard {
    /// Opens a window routing allocations on streams accepted by `filter` to `pool`
    /// (created on first use; each begin holds it once more).
    pub fn begin_allocate_to_pool(&self, pool: PoolId, filter: RouteFilter) -> Result<()> {
        self.lock()?.caches_mut().open_window(pool, filter);
        Ok(())
    }

    /// Holds `pool` `users` times, as the device does (for a shard made after the pool's
    /// windows opened: `DeviceAllocator::make_shard`).
    pub(in crate::alloc) fn set_pool_users(&self, pool: PoolId, users: u32) -> Result<()> {
        self.lock()?.caches_mut().set_pool_users(pool, users);
        Ok(())
    }

    /// Closes the window opened for `pool`. Events deferred during the capture are recorded
    /// once no window is open.
    pub fn end_allocate_to_pool(&self, pool: PoolId) -> Result<()> {
        let mut st = self.lock()?;
        // Dropped after the lock: dropping runs the caller's release callback, which may
        // call back into ccalloc.
        let Some(route) = st.caches_mut().close_window(pool) else {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("end_allocate_to_pool: no open window for pool {pool:?}"),
            ));
        };
        // Those still deferred after a failure are retried at the next window's close,
        // empty_cache or OOM.
        let result = self.retry_deferred(&mut st);
        drop(st);
        drop(route);
        result
    }

    /// Drops one hold on `pool`; with none left, its unused segments are released now (if no
    /// capture is open) and the rest as their blocks are freed and the cache is emptied.
    pub fn release_pool(&self, pool: PoolId) -> Result<()> {
        let mut st = self.lock()?;
        match st.caches_mut().drop_user(pool) {
            Unheld::Unknown => {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("release_pool: unknown pool {pool:?}"),
                ))
            }
            Unheld::StillHeld | Unheld::Forgotten => return Ok(()),
            Unheld::Releasable => {}
        }
        if !st.capturing() {
            self.sync_device(&mut st)?;
            self.release_whole_segments(
                &mut st,
                &[(Some(pool), PoolKind::Large), (Some(pool), PoolKind::Small)],
            )?;
        }
        Ok(())
    }
}
