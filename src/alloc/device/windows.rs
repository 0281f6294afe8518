//! Private-pool windows (PyTorch's `begin_allocate_to_pool` / `end_allocate_to_pool`, as a
//! CUDA graph capture opens them): while one is open, allocations on the streams its filter
//! accepts go to its pool, in every shard. A filter is the caller's code and may call back
//! into ccalloc, so it runs before any lock of ours is taken (`malloc_routed`), and shards
//! read its answer (`route_to`).

use super::DeviceAllocator;
use crate::alloc::core::free_lists::{PoolId, RouteFilter};
use crate::driver::{DevicePtr, StreamId};
use crate::error::{Error, ErrorKind, Result};
use crate::sync::lock;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

impl DeviceAllocator {
    /// `malloc` while windows are open. Their filters are the caller's code, which may call
    /// back into ccalloc (a Python filter reading `memory_allocated()`): they run here, with
    /// no lock of ours held, and the shard's routing reads their answers (`route_to`). An
    /// allocation from inside a filter is refused: that filter would route it.
    pub(super) fn malloc_routed(&self, size: u64, stream: StreamId) -> Result<DevicePtr> {
        if IN_FILTER.with(std::cell::Cell::get) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "device {}: allocation from inside a pool stream filter \
                     (ccalloc_begin_allocate_to_pool) is refused: the filter decides where \
                     allocations go while it runs; reading statistics from it is fine",
                    self.device
                ),
            ));
        }
        let windows: Vec<Arc<Mutex<RouteFilter>>> = {
            let setup = self.setup()?;
            setup.windows.iter().map(|(_, f)| f.clone()).collect()
        };
        let answers = windows
            .iter()
            .map(|filter| {
                let _running = InFilter::enter();
                let accepted = lock(filter, "a pool stream filter")?(stream);
                Ok((Arc::as_ptr(filter) as usize, stream, accepted))
            })
            .collect::<Result<_>>()?;
        let result = {
            let _answers = Answers::set(answers);
            self.malloc_in_shard(size, stream)
        };
        // Dropped with no lock held: the last hold on a closed window's filter runs the
        // caller's release callback.
        drop(windows);
        result
    }

    /// Opens a window routing allocations on streams accepted by `filter` to `pool`, in
    /// every shard (a capture may span streams).
    pub fn begin_allocate_to_pool(&self, pool: PoolId, filter: RouteFilter) -> Result<()> {
        let mut setup = self.setup()?;
        self.check_open()?;
        let filter = Arc::new(Mutex::new(filter));
        // No front may hand out or take blocks while a capture routes allocations: closed
        // first, in every shard. Blocks they hold stay held (to the shard, allocated) until
        // a drain: growth drains them as always.
        for shard in self.shards() {
            shard.fronts.open.store(false, Ordering::Release);
        }
        self.routing.store(true, Ordering::Release);
        let opened = self.each_shard(|s| s.begin_allocate_to_pool(pool, route_to(&filter)));
        if opened.is_ok() {
            setup.windows.push((pool, filter));
            *setup.pools.entry(pool).or_insert(0) += 1;
        }
        self.routing
            .store(!setup.windows.is_empty(), Ordering::Release);
        self.set_fronts_open(&setup);
        drop(setup);
        opened
    }

    /// Closes the window opened for `pool`.
    pub fn end_allocate_to_pool(&self, pool: PoolId) -> Result<()> {
        let mut setup = self.setup()?;
        self.check_open()?;
        let Some(i) = setup.windows.iter().position(|(p, _)| *p == pool) else {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("end_allocate_to_pool: no open window for pool {pool:?}"),
            ));
        };
        let window = setup.windows.remove(i);
        self.routing
            .store(!setup.windows.is_empty(), Ordering::Release);
        let closed = self.each_shard(|s| s.end_allocate_to_pool(pool));
        self.set_fronts_open(&setup);
        drop(setup);
        // Dropped last, with no lock held: dropping the filter runs the caller's release
        // callback, which may call back into ccalloc.
        drop(window);
        closed
    }
}

thread_local! {
    /// The open windows' filters' answers for this thread's allocation in progress
    /// (`malloc_routed`): (filter's address, stream, accepted).
    static ANSWERS: std::cell::RefCell<Vec<(usize, StreamId, bool)>> =
        const { std::cell::RefCell::new(Vec::new()) };
    /// Set while this thread runs a window's filter.
    static IN_FILTER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// This thread's filter answers until dropped (also on a panic).
struct Answers;

impl Answers {
    fn set(answers: Vec<(usize, StreamId, bool)>) -> Self {
        ANSWERS.with(|a| *a.borrow_mut() = answers);
        Self
    }
}

impl Drop for Answers {
    fn drop(&mut self) {
        let _ = ANSWERS.try_with(|a| a.borrow_mut().clear());
    }
}

/// Marks this thread as running a filter until dropped.
struct InFilter;

impl InFilter {
    fn enter() -> Self {
        IN_FILTER.with(|f| f.set(true));
        Self
    }
}

impl Drop for InFilter {
    fn drop(&mut self) {
        let _ = IN_FILTER.try_with(|f| f.set(false));
    }
}

/// A shard's view of a window's filter: the answer `malloc_routed` got from it, before any
/// lock was taken. A window with no answer opened after this allocation began: the
/// allocation is not routed to it (it is ordered before the window's opening).
pub(super) fn route_to(filter: &Arc<Mutex<RouteFilter>>) -> RouteFilter {
    let key = Arc::as_ptr(filter) as usize;
    Box::new(move |stream| {
        ANSWERS
            .try_with(|a| {
                a.borrow()
                    .iter()
                    .any(|&(f, s, accepted)| f == key && s == stream && accepted)
            })
            .unwrap_or(false)
    })
}
