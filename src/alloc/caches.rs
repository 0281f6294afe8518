//! Where free blocks are cached: the general small/large free lists, and private pools
//! (PyTorch's CUDA-graph memory pools) whose blocks serve only allocations routed to them.

use super::blocks::FreeList;
use super::sizing::PoolKind;
use crate::driver::StreamId;
use std::collections::HashMap;

/// PyTorch's `MempoolId_t`: a pair of integers naming a private pool.
pub type PoolId = (u64, u64);

/// Decides, per allocation stream, whether an allocation goes to a private pool.
pub type RouteFilter = Box<dyn Fn(StreamId) -> bool + Send>;

pub struct PrivatePool {
    pub lists: [FreeList; 2],
    /// Graphs (or other users) holding the pool; at 0 its cache may be released.
    pub users: u32,
    pub segments: u32,
}

/// An open "allocate to pool" window (a graph capture in progress).
pub struct Route {
    pub pool: PoolId,
    pub filter: RouteFilter,
}

#[derive(Default)]
pub struct Caches {
    pub general: [FreeList; 2],
    pub private: HashMap<PoolId, PrivatePool>,
    /// Open windows; while any is open, no events are polled and nothing is released.
    pub routes: Vec<Route>,
}

impl Caches {
    pub fn list(&mut self, owner: Option<PoolId>, pool: PoolKind) -> &mut FreeList {
        match owner {
            None => &mut self.general[pool as usize],
            Some(id) => {
                &mut self
                    .private
                    .get_mut(&id)
                    .expect("a block's private pool exists while it has segments")
                    .lists[pool as usize]
            }
        }
    }

    pub fn list_ref(&self, owner: Option<PoolId>, pool: PoolKind) -> &FreeList {
        self.try_list(owner, pool)
            .expect("a block's private pool exists while it has segments")
    }

    /// Like `list_ref`, for a private pool that may have gone away meanwhile.
    pub fn try_list(&self, owner: Option<PoolId>, pool: PoolKind) -> Option<&FreeList> {
        match owner {
            None => Some(&self.general[pool as usize]),
            Some(id) => self.private.get(&id).map(|p| &p.lists[pool as usize]),
        }
    }

    /// The private pool an allocation on `stream` goes to, if a window routes it.
    pub fn route(&self, stream: StreamId) -> Option<PoolId> {
        self.routes
            .iter()
            .find(|r| (r.filter)(stream))
            .map(|r| r.pool)
    }

    /// A pool may be forgotten once nobody holds it, it has no memory, and no open window
    /// routes to it (a window still allocates into it).
    pub fn pool_removable(&self, id: PoolId) -> bool {
        self.private
            .get(&id)
            .is_some_and(|p| p.users == 0 && p.segments == 0)
            && !self.routes.iter().any(|r| r.pool == id)
    }

    /// Forgets the free-list indexes of streams with nothing cached (a job that makes
    /// streams as it goes would otherwise keep one per stream it ever used).
    pub fn prune(&mut self) {
        let private = self.private.values_mut().flat_map(|p| p.lists.iter_mut());
        for list in self.general.iter_mut().chain(private) {
            list.prune();
        }
    }

    pub fn capturing(&self) -> bool {
        !self.routes.is_empty()
    }

    /// Every free list whose whole-segment blocks may be released now: the general ones and
    /// those of private pools nobody holds.
    pub fn releasable(&self) -> Vec<(Option<PoolId>, PoolKind)> {
        let mut out = vec![(None, PoolKind::Large), (None, PoolKind::Small)];
        for (&id, pool) in &self.private {
            if pool.users == 0 {
                out.push((Some(id), PoolKind::Large));
                out.push((Some(id), PoolKind::Small));
            }
        }
        out
    }
}
