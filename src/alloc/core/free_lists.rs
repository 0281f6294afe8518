//! Where free blocks are cached: per pool a `FreeList` finding the best fit per (stream,
//! size), the general small/large lists, and private pools (PyTorch's CUDA-graph memory
//! pools) whose blocks serve only allocations routed to them.

pub use super::blocks::PoolId;
use super::blocks::{Block, BlockId};
use super::size_index::SizeIndex;
use super::sizing::PoolKind;
use crate::driver::StreamId;
use std::collections::HashMap;

/// The cached free blocks of one pool: per stream, a `SizeIndex` ordered by (size, address)
/// for best fit.
#[derive(Default)]
pub struct FreeList {
    /// The streams' indexes, each at the position `positions` names. Boxed: an index holds
    /// its class bitmaps inline (about 1 KiB), and `prune` keeps this vector's capacity, so
    /// a job that made a stream per request would otherwise keep that much per slot ever
    /// used.
    indexes: Vec<(StreamId, Box<SizeIndex>)>,
    positions: rustc_hash::FxHashMap<StreamId, usize>,
    /// The position last looked up: a shard's frees and fits mostly name one stream, which
    /// then costs a compare instead of a hash lookup (several per alloc and free).
    last: std::cell::Cell<usize>,
    /// Counts lookups; a cached block's age is `lookups - block.cached_at()`.
    lookups: u64,
}

impl FreeList {
    /// Lookups so far: the clock of cached blocks' ages.
    #[inline]
    pub fn lookups(&self) -> u64 {
        self.lookups
    }

    /// Counts one lookup.
    #[inline]
    pub fn count_lookup(&mut self) {
        self.lookups += 1;
    }

    /// Where `stream`'s index is, if it has one.
    #[inline]
    fn position(&self, stream: StreamId) -> Option<usize> {
        let last = self.last.get();
        if self.indexes.get(last).is_some_and(|(s, _)| *s == stream) {
            return Some(last);
        }
        self.look_up_position(stream)
    }

    /// `position` for a stream other than the last one looked up.
    #[cold]
    #[inline(never)]
    fn look_up_position(&self, stream: StreamId) -> Option<usize> {
        let at = *self.positions.get(&stream)?;
        self.last.set(at);
        Some(at)
    }

    /// A fresh, empty index for `stream` (which has none); returns its position.
    #[cold]
    #[inline(never)]
    fn add_index(&mut self, stream: StreamId) -> usize {
        self.indexes.push((stream, Box::default()));
        let at = self.indexes.len() - 1;
        self.positions.insert(stream, at);
        at
    }

    #[inline]
    fn index(&self, stream: StreamId) -> Option<&SizeIndex> {
        self.position(stream).map(|at| &*self.indexes[at].1)
    }

    #[inline]
    pub fn insert(&mut self, block: &Block, id: BlockId) {
        let stream = block.stream();
        let at = match self.position(stream) {
            Some(at) => at,
            None => self.add_index(stream),
        };
        let fresh = self.indexes[at].1.insert(block.size(), block.addr(), id);
        debug_assert!(fresh, "block cached twice");
    }

    #[inline]
    pub fn remove(&mut self, block: &Block) {
        let removed = self
            .position(block.stream())
            .and_then(|at| self.indexes[at].1.remove(block.size(), block.addr()));
        debug_assert!(removed.is_some(), "removed a block that was not cached");
    }

    /// The smallest cached block on `stream` of at least `size` bytes.
    #[inline]
    pub fn best_fit(&self, stream: StreamId, size: u64) -> Option<(u64, BlockId)> {
        self.index(stream)?.best_fit(size)
    }

    /// The smallest cached block on `stream` of at least `size` bytes, taken off the list
    /// if `keep(size, id)` says so (`Ok`), else left listed (`Err`; `None`: nothing fits).
    #[inline]
    pub fn take_best_fit(
        &mut self,
        stream: StreamId,
        size: u64,
        keep: impl FnOnce(u64, BlockId) -> bool,
    ) -> Result<(u64, BlockId), Option<(u64, BlockId)>> {
        match self.position(stream) {
            Some(at) => self.indexes[at].1.take_best_fit(size, keep),
            None => Err(None),
        }
    }

    /// Cached blocks on `stream` of at least `size` bytes, smallest first.
    pub fn fits(&self, stream: StreamId, size: u64) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.index(stream)
            .into_iter()
            .flat_map(move |index| index.fits(size))
    }

    /// The largest cached block on `stream`, if it holds at least `size` bytes.
    pub fn largest_fit(&self, stream: StreamId, size: u64) -> Option<BlockId> {
        self.index(stream)?.largest_fit(size)
    }

    /// Cached blocks on `stream` of at least `min_size`, largest first.
    pub fn largest_first(&self, stream: StreamId, min_size: u64) -> Vec<BlockId> {
        self.index(stream)
            .map(|index| index.largest_first(min_size))
            .unwrap_or_default()
    }

    /// Drops the indexes of streams with no block cached.
    pub fn prune(&mut self) {
        self.indexes.retain(|(_, index)| !index.is_empty());
        self.positions.clear();
        for (at, (stream, _)) in self.indexes.iter().enumerate() {
            self.positions.insert(*stream, at);
        }
        self.last.set(0);
    }

    /// Streams with an index (tests).
    #[cfg(test)]
    pub fn indexed_streams(&self) -> usize {
        self.indexes.len()
    }

    /// The cached blocks of `stream`, by size, then address.
    pub fn ids_of(&self, stream: StreamId) -> impl Iterator<Item = BlockId> + '_ {
        self.index(stream).into_iter().flat_map(|index| index.ids())
    }

    /// Every cached block, by stream, then size, then address.
    pub fn ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut streams: Vec<_> = self
            .indexes
            .iter()
            .filter(|(_, index)| !index.is_empty())
            .collect();
        streams.sort_unstable_by_key(|(stream, _)| *stream);
        streams.into_iter().flat_map(|(_, index)| index.ids())
    }
}

/// Decides, per allocation stream, whether an allocation goes to a private pool.
pub type RouteFilter = Box<dyn Fn(StreamId) -> bool + Send>;

struct PrivatePool {
    lists: [FreeList; 2],
    /// Graphs (or other users) holding the pool; at 0 its cache may be released.
    users: u32,
    segments: u32,
}

impl PrivatePool {
    fn new(users: u32) -> Self {
        Self {
            lists: Default::default(),
            users,
            segments: 0,
        }
    }
}

/// An open "allocate to pool" window (a graph capture in progress).
pub struct Route {
    pool: PoolId,
    filter: RouteFilter,
}

/// What dropping a hold on a private pool left (`Caches::drop_user`).
#[derive(Debug, PartialEq, Eq)]
pub enum Unheld {
    /// No such pool.
    Unknown,
    /// Others still hold it.
    StillHeld,
    /// Nobody holds it and it had no memory: forgotten.
    Forgotten,
    /// Nobody holds it: its whole segments may be released.
    Releasable,
}

#[derive(Default)]
pub struct Caches {
    general: [FreeList; 2],
    private: HashMap<PoolId, PrivatePool>,
    /// Open windows; while any is open, no events are polled and nothing is released.
    routes: Vec<Route>,
}

impl Caches {
    /// The general cache's free list of `pool`.
    #[inline]
    pub fn general(&self, pool: PoolKind) -> &FreeList {
        &self.general[pool as usize]
    }

    /// Every free list, the general ones first.
    pub fn all_lists(&self) -> impl Iterator<Item = &FreeList> + '_ {
        let private = self.private.values().flat_map(|p| p.lists.iter());
        self.general.iter().chain(private)
    }

    /// Whether private pool `id` is known here.
    pub fn knows_pool(&self, id: PoolId) -> bool {
        self.private.contains_key(&id)
    }

    /// Opens a window routing allocations on streams `filter` accepts to `pool`, created on
    /// first use; each window holds it once more.
    pub fn open_window(&mut self, pool: PoolId, filter: RouteFilter) {
        self.private
            .entry(pool)
            .and_modify(|p| p.users += 1)
            .or_insert_with(|| PrivatePool::new(1));
        self.routes.push(Route { pool, filter });
    }

    /// Closes the window opened for `pool`, returning it (dropping it runs the caller's
    /// callback: the caller drops it outside its lock); `None` when none is open. A pool
    /// released while its window was open (a capture that raised) and left without memory
    /// is forgotten here: no later release or segment's return would come to forget it.
    pub fn close_window(&mut self, pool: PoolId) -> Option<Route> {
        let i = self.routes.iter().position(|r| r.pool == pool)?;
        let route = self.routes.remove(i);
        if self.pool_removable(pool) {
            self.private.remove(&pool);
        }
        Some(route)
    }

    /// Holds `pool` exactly `users` times (created if unknown).
    pub fn set_pool_users(&mut self, pool: PoolId, users: u32) {
        self.private
            .entry(pool)
            .or_insert_with(|| PrivatePool::new(users))
            .users = users;
    }

    /// Drops one hold on `pool`; a pool nobody holds and without memory is forgotten.
    pub fn drop_user(&mut self, pool: PoolId) -> Unheld {
        let Some(p) = self.private.get_mut(&pool) else {
            return Unheld::Unknown;
        };
        p.users = p.users.saturating_sub(1);
        if p.users > 0 {
            return Unheld::StillHeld;
        }
        if self.pool_removable(pool) {
            self.private.remove(&pool);
            return Unheld::Forgotten;
        }
        Unheld::Releasable
    }

    /// A segment of private pool `owner` was made.
    pub fn add_pool_segment(&mut self, owner: PoolId) {
        if let Some(p) = self.private.get_mut(&owner) {
            p.segments += 1;
        }
    }

    /// A segment of private pool `owner` went back to the device; a pool left without
    /// holders, memory or window is forgotten.
    pub fn remove_pool_segment(&mut self, owner: PoolId) {
        let pool = self.private.get_mut(&owner).expect("owner pool exists");
        pool.segments -= 1;
        if self.pool_removable(owner) {
            self.private.remove(&owner);
        }
    }

    #[inline]
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

    #[inline]
    pub fn list_ref(&self, owner: Option<PoolId>, pool: PoolKind) -> &FreeList {
        self.try_list(owner, pool)
            .expect("a block's private pool exists while it has segments")
    }

    /// Like `list_ref`, for a private pool that may have gone away meanwhile.
    #[inline]
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
    fn pool_removable(&self, id: PoolId) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Lookups by stream find each stream's own blocks, whichever stream was looked up last,
    /// and still after `prune` moved the indexes.
    #[test]
    fn each_stream_finds_its_blocks_across_prunes() {
        let mut list = FreeList::default();
        let block = |stream: u64, size: u64| {
            Block::whole_segment(
                stream << 30,
                size,
                StreamId(stream),
                PoolKind::Small,
                None,
                false,
                0,
            )
        };
        for stream in 0..5u64 {
            list.insert(&block(stream, 512 * (stream + 1)), stream as BlockId);
        }
        for round in 0..3 {
            for stream in (0..5u64).rev().chain(0..5) {
                let want = (stream % 2 == 1 || round == 0).then_some(stream as BlockId);
                assert_eq!(list.best_fit(StreamId(stream), 1).map(|f| f.1), want);
            }
            // The even streams empty out; pruning drops their indexes.
            for stream in (0..5u64).filter(|s| s % 2 == 0 && round == 0) {
                list.remove(&block(stream, 512 * (stream + 1)));
            }
            list.prune();
        }
        assert_eq!(list.indexed_streams(), 2);
        list.insert(&block(4, 512), 40);
        assert_eq!(list.best_fit(StreamId(4), 1), Some((512, 40)));
        assert_eq!(list.best_fit(StreamId(3), 1), Some((2048, 3)));
        assert_eq!(list.ids().collect::<Vec<_>>(), vec![1, 3, 40]);
    }
}
