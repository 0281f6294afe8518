//! The allocator of one device: a shard per stream.

// Blocks are never shared between streams anyway (free lists are per stream, as in
// PyTorch), so each stream gets a `Shard`, a whole caching allocator with its own lock and
// its own data. Threads that work on different streams then share neither: on a many-core
// host, most of a shared allocator's time under contention goes to cache misses on data
// another core wrote last, not to the lock itself.
//
// What stays device-wide:
// - the memory limit: shards take device memory through one `driver::layers::limit::Limit`,
//   which claims it from one count before the driver below is asked;
// - the reserved bytes and their peaks (`DeviceReserved`);
// - the OOM retry: before an allocation fails, the other shards' caches are emptied;
// - settings and private-pool windows: applied to every shard, and to shards made later;
// - statistics: the sum over shards, and exact peaks over them (`peaks`).
//
// Each shard has thread fronts of its own (`front`, `Shard::fronts`): it alone hands their
// blocks out and drains them, under its own lock.
//
// Finding a stream's shard takes no lock: shards fill a fixed array of slots in order, and a
// lookup reads the filled ones. A process with more streams than slots shares the last
// slots' shards among the extra streams (a shard serves any number of streams).

pub mod breakdown;
mod peaks;
mod windows;

use super::core::free_lists::{PoolId, RouteFilter};
use super::front::{self, FrontOf, Fronts, GiveBack};
use super::paging::budget::Allowance;
use super::shard::DeviceWide;
use super::state::Elsewhere;
use super::stats::{DeviceReserved, LockCounters};
use super::{limit_for, SegmentView, Shard};
use crate::config::Config;
use crate::driver::layers::limit::Limit;
use crate::driver::{DevicePtr, Driver, StreamId};
use crate::error::{Error, ErrorKind, Result};
use crate::sync::{lock, poisoned};
use crate::DeviceStats;
use breakdown::{MemoryBreakdown, PeakRecorder};
use once_cell::sync::OnceCell;
use peaks::PeakBook;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use windows::route_to;

/// Streams with a shard of their own; more share.
const MAX_SHARDS: usize = 32;

/// A shard on lines of its own (128 bytes: adjacent-line prefetch pairs lines), boxed, so
/// that what other threads read (the slot array, the directory) shares no line with what
/// the shard's thread writes on every call.
#[repr(align(128))]
struct Slot {
    shard: Shard,
}

/// Which stream each filled slot serves, apart from the slots: every call looks a stream
/// up here, and a slot's lines are written by its shard's thread on every call. Read
/// beside them, a lookup would pull a line another core is writing (on an H100 host, 8
/// threads on their own shards each ran 2.3x slower than one alone). Written only when a
/// slot fills, so these lines stay shared in every core's cache.
#[repr(align(128))]
#[derive(Default)]
struct Directory {
    /// Slots filled: each is set, its stream written here, and then this count raised
    /// (release), so that a reader that sees the count sees the slot.
    filled: AtomicUsize,
    streams: [AtomicU64; MAX_SHARDS],
}

/// The device's live high-water mark, on a line of its own: growths on any shard raise it.
#[repr(align(128))]
#[derive(Default)]
struct HighWater(AtomicU64);

/// A device's shards. Each shard holds it too (weakly: the device owns the shards), so
/// that a growing shard can weigh the whole device's memory and take idle memory from
/// the others (`Shard::borrow_idle`) instead of reserving more.
#[derive(Default)]
pub(in crate::alloc) struct Shards {
    directory: Directory,
    slots: [OnceCell<Box<Slot>>; MAX_SHARDS],
    /// The most bytes the device's shards have held live at once, as growths saw it.
    live_high_water: HighWater,
}

impl Shards {
    /// The shards made so far, in slot order.
    pub(in crate::alloc) fn iter(&self) -> impl Iterator<Item = &Shard> {
        self.slots[..self.filled()]
            .iter()
            .filter_map(OnceCell::get)
            .map(|slot| &slot.shard)
    }

    /// Slots filled so far.
    fn filled(&self) -> usize {
        self.directory.filled.load(Ordering::Acquire)
    }

    /// The filled slot serving `stream`, looked up in the directory.
    fn slot_of(&self, stream: StreamId) -> Option<usize> {
        let filled = self.filled();
        self.directory.streams[..filled]
            .iter()
            .position(|s| s.load(Ordering::Relaxed) == stream.0)
    }

    /// The stream of the first slot (filled).
    #[inline]
    fn first_stream(&self) -> StreamId {
        StreamId(self.directory.streams[0].load(Ordering::Relaxed))
    }

    /// The shard in filled slot `i`.
    fn filled_shard(&self, i: usize) -> &Shard {
        &self.slots[i]
            .get()
            .expect("slots below `filled` are set")
            .shard
    }

    /// Fills the next slot with `shard`, serving `stream`; callers hold the device's setup
    /// lock, so slots fill one at a time and in order. Returns the slot.
    fn fill(&self, stream: StreamId, shard: Shard) -> usize {
        let i = self.directory.filled.load(Ordering::Relaxed);
        let _ = self.slots[i].set(Box::new(Slot { shard }));
        self.directory.streams[i].store(stream.0, Ordering::Relaxed);
        self.directory.filled.store(i + 1, Ordering::Release);
        i
    }

    /// Whether the device has more than one shard.
    pub(in crate::alloc) fn several(&self) -> bool {
        self.filled() > 1
    }

    /// Raises the device's live high-water mark to `live`; returns the mark.
    pub(in crate::alloc) fn raise_live_high_water(&self, live: u64) -> u64 {
        self.live_high_water
            .0
            .fetch_max(live, Ordering::Relaxed)
            .max(live)
    }
}

/// What a shard made later must start with. Held while a shard is made and while either
/// changes, so that no shard misses a change.
struct Setup {
    config: Config,
    /// Open `begin_allocate_to_pool` windows (shared by every shard's route).
    windows: Vec<(PoolId, Arc<Mutex<RouteFilter>>)>,
    /// Private pools and their holders (begins not yet released).
    pools: HashMap<PoolId, u32>,
}

/// A device's settings, held (`DeviceAllocator::lock_settings`): while held, the device
/// neither changes its settings nor makes its first shard, so that several devices can be
/// checked and changed as one (`Runtime::set_config`).
pub struct SettingsLock<'a>(MutexGuard<'a, Setup>);

pub struct DeviceAllocator {
    device: usize,
    total_memory: u64,
    /// The driver as the shards see it: under `limit`.
    driver: Arc<dyn Driver>,
    /// The memory limit, a layer over the driver given (see `driver::layers::limit`).
    limit: Arc<Limit>,
    device_reserved: Arc<DeviceReserved>,
    /// The time page moves may still take on the device (`paging::budget`), from its
    /// creation: its shards spend it together.
    moves: Arc<Mutex<Allowance>>,
    shards: Arc<Shards>,
    setup: Mutex<Setup>,
    /// Whether `shutdown` has run: the device's one record of it (see `Lifecycle`).
    lifecycle: Arc<Lifecycle>,
    /// Whether a `begin_allocate_to_pool` window is open: allocations then run the windows'
    /// filters before taking any lock (`malloc_routed`).
    routing: AtomicBool,
    /// Held by a shard's second try after an OOM (`malloc_in_shard`), so that one such try
    /// runs at a time.
    oom_retry: Mutex<()>,
    /// How streams map to shards (`Sharding`, from the settings); may change only while
    /// no shard exists.
    sharding: AtomicU8,
    /// The device's peaks once it has several shards.
    peak_book: PeakBook,
    /// This allocator's key in the threads' lists of their fronts (each shard has fronts of
    /// its own, `Shard::fronts`; a free finds the thread's fronts for the device by this key).
    pub(super) key: u64,
    /// Whether a front of this device has ever adopted a block (`Fronts::adopted`). Until
    /// one has, no thread has a block in a front of the device: the fast paths (`malloc`,
    /// `free`) skip looking in the thread's fronts.
    fronts_adopted: Arc<AtomicBool>,
    /// The breakdown of reserved memory at its peak, with `record_peak_breakdown`.
    peak_breakdown: PeakRecorder,
}

impl DeviceAllocator {
    pub fn new(device: usize, driver: Arc<dyn Driver>, config: Config) -> Result<Self> {
        // Capped at 2^56 bytes (64 PiB) so that size arithmetic can never overflow.
        let total_memory = driver
            .total_memory(device)
            .map_err(|e| super::driver_error(device, e))?
            .min(1 << 56);
        let limit = Arc::new(Limit::new(
            driver,
            limit_for(&config, total_memory),
            total_memory,
        ));
        let sharding = AtomicU8::new(Sharding::of(&config) as u8);
        let peak_breakdown = PeakRecorder::default();
        if config.record_peak_breakdown {
            // Nothing is reserved yet.
            peak_breakdown.restart(MemoryBreakdown::default());
        }
        Ok(Self {
            peak_breakdown,
            sharding,
            peak_book: PeakBook::default(),
            key: front::new_key(),
            fronts_adopted: Arc::default(),
            oom_retry: Mutex::new(()),
            device,
            total_memory,
            driver: limit.clone(),
            limit,
            device_reserved: Arc::default(),
            moves: Allowance::started_at(std::time::Instant::now()),
            shards: Arc::default(),
            setup: Mutex::new(Setup {
                config,
                windows: Vec::new(),
                pools: HashMap::new(),
            }),
            lifecycle: Arc::default(),
            routing: AtomicBool::new(false),
        })
    }

    pub fn device(&self) -> usize {
        self.device
    }

    pub fn total_memory(&self) -> u64 {
        self.total_memory
    }

    fn shards(&self) -> impl Iterator<Item = &Shard> {
        self.shards.iter()
    }

    fn setup(&self) -> Result<MutexGuard<'_, Setup>> {
        self.setup
            .lock()
            .map_err(|_| poisoned(&format!("device {}'s allocator settings", self.device)))
    }

    fn check_open(&self) -> Result<()> {
        self.lifecycle.check_open(self.device)
    }

    /// The shard of `stream` and its slot, made on its first use.
    pub(super) fn shard(&self, stream: StreamId) -> Result<(usize, &Shard)> {
        match self.find_slot(stream) {
            Ok(found) => Ok(found),
            Err(_) => self.make_shard(stream),
        }
    }

    fn sharding(&self) -> Sharding {
        Sharding::from_u8(self.sharding.load(Ordering::Relaxed))
    }

    /// `stream`'s shard and slot, or the first empty slot when `make_shard` must decide.
    /// A stream with a slot in the directory has that shard. Otherwise: with one shard, the
    /// first; with a shard per stream, a new one; with thread shards, the first shard if
    /// this thread has allocated on the device before (its new streams stay with its
    /// others), else `make_shard` decides. Past `MAX_SHARDS` slots, a shared one.
    #[inline]
    fn find_slot(&self, stream: StreamId) -> std::result::Result<(usize, &Shard), usize> {
        let shards = &self.shards;
        let filled = shards.filled();
        // The first slot's stream, or one shard: the first shard, whatever the setting.
        if filled > 0 && (shards.first_stream() == stream || self.sharding() == Sharding::One) {
            return Ok((0, shards.filled_shard(0)));
        }
        self.find_other_slot(stream, filled)
    }

    /// `find_slot` past the first slot's stream, `filled` slots being filled.
    #[inline(never)]
    fn find_other_slot(
        &self,
        stream: StreamId,
        filled: usize,
    ) -> std::result::Result<(usize, &Shard), usize> {
        let shards = &self.shards;
        if filled == 0 {
            return Err(0);
        }
        if let Some(i) = shards.slot_of(stream) {
            return Ok((i, shards.filled_shard(i)));
        }
        if self.sharding() == Sharding::NewThreads {
            // A stream no slot names is the first shard's for every thread, so that none
            // is split across shards; once every slot is taken, a new thread's too.
            if filled == MAX_SHARDS || homes::has_home(self.key) {
                return Ok((0, shards.filled_shard(0)));
            }
            return Err(filled);
        }
        if self.sharding() == Sharding::OnContention {
            // Until threads contend for the first shard, every stream is its; once every
            // slot is taken, too. After: as with `NewThreads`, except that a thread's own
            // stream (one it brought, `homes`) gets a shard although the first shard holds
            // its earlier blocks (their frees find them there). Other streams a thread
            // uses stay in the first shard, with the memory other threads left there.
            if filled == MAX_SHARDS || !shards.filled_shard(0).state.contended_often() {
                return Ok((0, shards.filled_shard(0)));
            }
            return match homes::brought(self.key) {
                Some(Some(own)) if own == stream => Err(filled),
                Some(_) => Ok((0, shards.filled_shard(0))),
                None => Err(filled),
            };
        }
        if filled == MAX_SHARDS {
            let i = shared_slot(stream);
            return Ok((i, shards.filled_shard(i)));
        }
        Err(filled)
    }

    /// `stream`'s shard if it has one (`find_slot`), for the fast path.
    fn front_shard(&self, stream: StreamId) -> Option<&Shard> {
        self.find_slot(stream).ok().map(|(_, shard)| shard)
    }

    fn make_shard(&self, stream: StreamId) -> Result<(usize, &Shard)> {
        let setup = self.setup()?;
        self.check_open()?;
        // Slots fill only under this lock: look again now that it is held.
        let i = match self.find_slot(stream) {
            Ok(found) => return Ok(found),
            Err(empty) => empty,
        };
        let new_thread = match self.sharding() {
            Sharding::NewThreads => true,
            Sharding::OnContention => !homes::has_home(self.key),
            Sharding::One | Sharding::EveryStream => false,
        };
        if i > 0 && new_thread {
            // This thread's first allocation on the device (`malloc_in_shard` notes it
            // next), on a stream with no slot: a new shard, unless the first shard holds
            // memory of the stream (another thread's: PyTorch's autograd thread running
            // backward on a forward's side stream).
            let first = self.shards.filled_shard(0);
            if first.serves_stream(stream)? {
                return Ok((0, first));
            }
        }
        let shard = Shard::new(
            self.device,
            self.total_memory,
            self.driver.clone(),
            setup.config.clone(),
            DeviceWide {
                device_reserved: self.device_reserved.clone(),
                moves: self.moves.clone(),
                lifecycle: self.lifecycle.clone(),
                siblings: Arc::downgrade(&self.shards),
            },
            // Open as every other shard's are now (`set_fronts_open`, also under `setup`).
            Fronts::new(
                self.key,
                self.fronts_open_now(&setup),
                self.fronts_adopted.clone(),
            ),
        );
        // The device's holds, not one per window (a pool may be released while its window
        // is open).
        for (pool, filter) in &setup.windows {
            shard.begin_allocate_to_pool(*pool, route_to(filter))?;
            shard.set_pool_users(*pool, 0)?;
        }
        for (&pool, &users) in &setup.pools {
            shard.set_pool_users(pool, users)?;
        }
        debug_assert_eq!(i, self.shards.filled());
        if i == 1 {
            self.activate_peak_book()?;
        }
        let i = self.shards.fill(stream, shard);
        Ok((i, self.shards.filled_shard(i)))
    }

    fn several_shards(&self) -> bool {
        self.shards.several()
    }

    /// Shards made so far (streams that share one count once): 1 once the device has
    /// allocated with both `per_stream_shards` and `thread_shards` off.
    pub fn shards_made(&self) -> usize {
        self.shards.filled()
    }

    /// Allocates at least `size` bytes for use on `stream`.
    pub fn malloc(&self, size: u64, stream: StreamId) -> Result<DevicePtr> {
        // A block this thread freed, of exactly this size and stream, in its front for the
        // stream's shard (see `front`). Without shards, the thread's one front for the
        // device, found without looking at the shard.
        // Only the calling thread adopts into its fronts, so it sees its own adoption here.
        let front = if !self.fronts_adopted.load(Ordering::Relaxed) {
            None
        } else if self.sharding() == Sharding::EveryStream || self.several_shards() {
            self.front_shard(stream)
                .map(|shard| FrontOf::Shard(&shard.fronts))
        } else {
            // One shard (the device's first and only one, whatever the setting).
            Some(FrontOf::OnlyShard(self.key))
        };
        if let Some(ptr) = front.and_then(|front| front::take(front, size, stream)) {
            return Ok(ptr);
        }
        let result = if self.routing.load(Ordering::Acquire) {
            self.malloc_routed(size, stream)
        } else {
            self.malloc_in_shard(size, stream)
        };
        if result.is_ok()
            && self
                .peak_breakdown
                .wants(|| self.device_reserved.all_hint())
        {
            self.record_peak_breakdown();
        }
        result
    }

    /// Takes the breakdown of reserved memory for `peak_breakdown` (`breakdown`); never
    /// fails the allocation that called it.
    #[cold]
    #[inline(never)]
    fn record_peak_breakdown(&self) {
        let epoch = self.peak_breakdown.epoch();
        match self.memory_breakdown() {
            Ok(b) => self.peak_breakdown.offer(epoch, b),
            Err(e) => tracing::debug!(device = self.device, "peak breakdown not taken: {e}"),
        }
    }

    /// Starts `peak_breakdown`'s record from the memory now.
    fn restart_peak_breakdown(&self) -> Result<()> {
        let now = self.memory_breakdown()?;
        self.peak_breakdown.restart(now);
        Ok(())
    }

    /// What reserved memory is made of now: live bytes, and the excess by cause
    /// (`MemoryBreakdown`), one moment's (every shard held at once, as `stats`). Walks
    /// every block; thread fronts' blocks go back to the cache first.
    pub fn memory_breakdown(&self) -> Result<MemoryBreakdown> {
        self.check_open()?;
        let page = self.driver.vmm_granularity(self.device).unwrap_or(1);
        let taken = (|| {
            let (shards, mut held) = self.lock_every_shard()?;
            let mut segments = Vec::new();
            for (shard, st) in shards.iter().zip(held.iter_mut()) {
                shard.drain_fronts(st);
                segments.extend(st.segment_views());
            }
            // Reserved bytes change only under a shard's lock: every one is held.
            let reserved = self.device_reserved.all()?;
            Ok(MemoryBreakdown::of(&segments, reserved, page))
        })();
        // Held blocks went back to the cache, which can lift a count.
        self.settle_lifts(None);
        taken
    }

    /// The breakdown right after the allocation that took reserved to its highest since
    /// `record_peak_breakdown` was set or peaks were reset, or at that moment if none has
    /// raised it since. Taken once that allocation returns: with other threads allocating
    /// and freeing meanwhile, a later moment (its `reserved_bytes` then falls short of the
    /// peak). `None` when the setting is off.
    pub fn peak_breakdown(&self) -> Result<Option<MemoryBreakdown>> {
        self.check_open()?;
        Ok(self.peak_breakdown.recorded())
    }

    /// `malloc` past the thread's front.
    fn malloc_in_shard(&self, size: u64, stream: StreamId) -> Result<DevicePtr> {
        let (slot, shard) = self.shard(stream)?;
        if self.several_shards() {
            self.return_large_held_elsewhere(shard);
        }
        let sharding = self.sharding();
        if matches!(sharding, Sharding::NewThreads | Sharding::OnContention) {
            // A thread that has allocated keeps its later new streams in the first shard.
            // Its first stream is its own if no other thread had used it: in another shard,
            // or in the first before this block (under `OnContention`, its shard later).
            homes::note_home(self.key, stream, || {
                sharding == Sharding::OnContention
                    && (slot != 0
                        || !self
                            .shards
                            .filled_shard(0)
                            .serves_stream(stream)
                            .unwrap_or(true))
            });
        }
        if !self.several_shards() || size > self.total_memory {
            // One shard, or a size no emptying could make room for: nothing to retry.
            let result = shard.malloc(size, stream, Some(Elsewhere::default()));
            self.settle_lifts(Some(shard));
            return result;
        }
        let result = match shard.malloc(size, stream, None) {
            Err(e) if e.kind == ErrorKind::OutOfMemory && size > self.limit()? => {
                // Past the memory limit: emptying caches could not help. Counted now.
                let elsewhere = self.held_elsewhere(shard, false)?;
                self.settle_lifts(None);
                shard.malloc(size, stream, Some(elsewhere))
            }
            Err(e) if e.kind == ErrorKind::OutOfMemory => {
                // Other streams' caches may hold the memory: they go back first (PyTorch
                // frees every stream's cache before it fails). One second try at a time:
                // two streams that failed together, each holding part of the memory while
                // it grew, would otherwise empty each other's caches and fail together
                // again, where one of them fits.
                let _one_at_a_time = lock(&self.oom_retry, "the device's OOM retry")?;
                let elsewhere = self.held_elsewhere(shard, true);
                // Emptying the other shards' caches can lift their counts.
                self.settle_lifts(None);
                shard.malloc(size, stream, Some(elsewhere?))
            }
            other => other,
        }
        .inspect(|_| LAST_SLOT.set((self as *const Self as usize, slot)));
        self.settle_lifts(Some(shard));
        result
    }

    /// Returns the large blocks the calling thread holds in its fronts for shards other than
    /// `visited` to their shards. A large block waits in a front only until its thread's
    /// next visit to the device (`Shard::fits_front`): a visit to its own shard returns it
    /// there, and one to another shard, here, so that its pages count as free before this
    /// visit's shard weighs the device's live bytes or borrows idle pages. One lookup in the
    /// thread's own fronts when it holds none (nearly always).
    fn return_large_held_elsewhere(&self, visited: &Shard) {
        for _ in 0..self.shards.filled() {
            let Some(fronts) = front::holding_large_elsewhere(self.key, &visited.fronts) else {
                return;
            };
            let Some(holder) = self.shards().find(|s| Arc::ptr_eq(&s.fronts, &fronts)) else {
                return;
            };
            if let Err(e) = holder.return_callers_large_held() {
                tracing::debug!(device = self.device, "large blocks not returned: {e}");
                return;
            }
            self.settle_lifts(Some(holder));
        }
    }

    /// What the shards other than `shard` hold, for its OOM message; with `empty`, after
    /// emptying their caches (the device's second try).
    fn held_elsewhere(&self, shard: &Shard, empty: bool) -> Result<Elsewhere> {
        let mut elsewhere = Elsewhere {
            second_try: empty,
            ..Elsewhere::default()
        };
        for other in self.shards().filter(|s| !std::ptr::eq(*s, shard)) {
            if empty {
                if let Err(e) = other.empty_cache() {
                    tracing::debug!(device = self.device, "cache not emptied: {e}");
                }
            }
            let held = other.holdings()?;
            elsewhere.live += held.live;
            elsewhere.cached += held.cached;
            elsewhere.largest_free = elsewhere.largest_free.max(held.largest_free);
        }
        Ok(elsewhere)
    }

    /// Frees a block handed out by `malloc`. Unknown pointers and double frees are refused
    /// with nothing changed. After this thread's fronts, the shard this thread last
    /// allocated from is asked first: a thread mostly frees what it allocated, and asking a
    /// shard takes its lock.
    pub fn free(&self, ptr: DevicePtr) -> Result<()> {
        if let Some(done) = self.free_in_front(ptr) {
            return done;
        }
        if !self.several_shards() {
            let only = self.shards.slots[0].get().map(|s| &s.shard);
            let freed = self.free_trying(ptr, only, only);
            // (A second shard may be in the making: its peaks book is active already.)
            self.settle_lifts(freed.as_ref().ok().copied());
            return freed.map(drop);
        }
        let first = self.home_shard();
        // A free can lift a count too (inactive splits).
        let freed = self.free_trying(ptr, first, first);
        self.settle_lifts(freed.as_ref().ok().copied());
        freed.map(drop)
    }

    /// `free` for a block allocated on `stream` (as PyTorch's free says): its shard is
    /// asked first.
    pub fn free_on(&self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        if let Some(done) = self.free_in_front(ptr) {
            return done;
        }
        let first = self
            .shards
            .slot_of(stream)
            .map(|i| self.shards.filled_shard(i));
        let freed = self.free_trying(ptr, first, self.home_shard());
        self.settle_lifts(freed.as_ref().ok().copied());
        freed.map(drop)
    }

    /// The fast free: `ptr` was handed out by one of this thread's fronts for this device.
    fn free_in_front(&self, ptr: DevicePtr) -> Option<Result<()>> {
        // Only the calling thread adopts into its fronts, so it sees its own adoption here.
        if !self.fronts_adopted.load(Ordering::Relaxed) {
            return None;
        }
        match front::give_back(self.key, ptr) {
            GiveBack::Held => Some(Ok(())),
            GiveBack::AlreadyFree => Some(Err(super::already_freed(self.device, ptr))),
            GiveBack::NotHere => None,
        }
    }

    /// The shard this thread allocates from: its last allocation's on this device
    /// (`LAST_SLOT`, noted once the device has several shards), else the first, the only
    /// one there was before.
    #[inline]
    fn home_shard(&self) -> Option<&Shard> {
        let (device, slot) = LAST_SLOT.get();
        let slot = if device == self as *const Self as usize {
            slot
        } else {
            0
        };
        self.shards.slots[slot].get().map(|s| &s.shard)
    }

    /// Frees `ptr` in its shard, asking `first` first. The shard that has the block may
    /// give it to this thread's front for that shard (`Shard::free`); a large block only
    /// while the device has one shard or if that shard is `home`, the one this thread
    /// allocates from. Another thread's large block (a prefetcher's batch freed by the
    /// training loop) would wait there for this thread's next visit to the device, while
    /// its own thread, allocating again in that shard, could not reuse it.
    #[inline]
    fn free_trying<'a>(
        &'a self,
        ptr: DevicePtr,
        first: Option<&'a Shard>,
        home: Option<&'a Shard>,
    ) -> Result<&'a Shard> {
        if let Some(shard) = first {
            if shard.free(ptr, self.large_may_wait(shard, home))?.freed() {
                return Ok(shard);
            }
        }
        self.free_in_other_shards(ptr, first, home)
    }

    /// `free_trying` past `first`.
    #[inline(never)]
    fn free_in_other_shards<'a>(
        &'a self,
        ptr: DevicePtr,
        first: Option<&'a Shard>,
        home: Option<&'a Shard>,
    ) -> Result<&'a Shard> {
        for shard in self.shards() {
            if !first.is_some_and(|f| std::ptr::eq(f, shard))
                && shard.free(ptr, self.large_may_wait(shard, home))?.freed()
            {
                return Ok(shard);
            }
        }
        Err(self.not_live(ptr))
    }

    /// Whether a large block freed in `shard` may wait in this thread's front for it
    /// (`free_trying`).
    #[inline]
    fn large_may_wait(&self, shard: &Shard, home: Option<&Shard>) -> bool {
        !self.several_shards() || home.is_some_and(|h| std::ptr::eq(h, shard))
    }

    /// Why `ptr` is not a live block of this device.
    fn not_live(&self, ptr: DevicePtr) -> Error {
        for shard in self.shards() {
            match shard.explain_not_live(ptr) {
                Ok(Some(e)) | Err(e) => return e,
                Ok(None) => {}
            }
        }
        if let Err(shut_down) = self.check_open() {
            return shut_down;
        }
        Error::new(
            ErrorKind::UnknownPointer,
            format!(
                "{ptr:#x} was not allocated by ccalloc on device {}",
                self.device
            ),
        )
    }

    /// Marks a live block as used on `stream` too: on free it is reused only after the work
    /// queued there has completed.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        for shard in self.shards() {
            let recorded = shard.record_stream(ptr, stream);
            // Taking a block back from a front can lift a count.
            self.settle_lifts(Some(shard));
            if recorded? {
                return Ok(());
            }
        }
        Err(self.not_live(ptr))
    }

    /// Whether `ptr` lies in memory this device's allocator holds (live, cached or pending).
    pub fn holds(&self, ptr: DevicePtr) -> bool {
        self.shards().any(|s| s.holds(ptr))
    }

    /// Returns every unused segment to the driver (deferred during a capture: see
    /// `Shard::empty_cache`). Every shard is emptied; the first error is returned.
    pub fn empty_cache(&self) -> Result<()> {
        self.check_open()?;
        self.each_shard(Shard::empty_cache)
    }

    /// Runs `f` on every shard, past failures; returns the first.
    fn each_shard(&self, f: impl Fn(&Shard) -> Result<()>) -> Result<()> {
        let mut first = Ok(());
        for shard in self.shards() {
            let result = f(shard);
            if first.is_ok() {
                first = result;
            }
        }
        // Caching blocks whose events completed can lift a count (inactive splits).
        self.settle_lifts(None);
        first
    }

    /// Settings for every shard, and for those made later.
    fn configure(&self, change: impl FnOnce(&mut Config) -> Result<()>) -> Result<()> {
        let mut setup = self.setup()?;
        self.configure_locked(&mut setup, change)
    }

    /// `configure` with the settings held already.
    fn configure_locked(
        &self,
        setup: &mut MutexGuard<'_, Setup>,
        change: impl FnOnce(&mut Config) -> Result<()>,
    ) -> Result<()> {
        self.check_open()?;
        let mut next = setup.config.clone();
        change(&mut next)?;
        self.check_sharding(&setup.config, &next)?;
        self.sharding
            .store(Sharding::of(&next) as u8, Ordering::Relaxed);
        setup.config = next.clone();
        self.limit.set_limit(limit_for(&next, self.total_memory));
        self.set_fronts_open(setup);
        // Each shard takes its fronts' held blocks back first (sized under the old settings).
        self.each_shard(|s| s.set_config(next.clone()))?;
        match (next.record_peak_breakdown, self.peak_breakdown.recording()) {
            // Settings, then shards: the order `each_shard` above takes them in.
            (true, false) => self.restart_peak_breakdown(),
            (false, true) => {
                self.peak_breakdown.stop();
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Whether fronts may be used now (see `front::Fronts::open`), in every shard; shards
    /// made later start so (`make_shard`, which holds `setup` too). After a close, a
    /// shard's drain (which takes every front's cell) leaves none of its fronts in use.
    fn set_fronts_open(&self, setup: &Setup) {
        let open = self.fronts_open_now(setup);
        for shard in self.shards() {
            shard.fronts.open.store(open, Ordering::Release);
        }
    }

    fn fronts_open_now(&self, setup: &Setup) -> bool {
        fronts_open(
            &setup.config,
            !setup.windows.is_empty(),
            self.lifecycle.is_shut_down(),
        )
    }

    /// `per_stream_shards`, `thread_shards` and `thread_shards_on_contention` may change only
    /// while no shard exists.
    fn check_sharding(&self, now: &Config, next: &Config) -> Result<()> {
        let changed = next.per_stream_shards != now.per_stream_shards
            || next.thread_shards != now.thread_shards
            || next.thread_shards_on_contention != now.thread_shards_on_contention;
        if changed && self.shards.slots[0].get().is_some() {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "per_stream_shards, thread_shards and thread_shards_on_contention can \
                     change only before device {} first allocates",
                    self.device
                ),
            ));
        }
        Ok(())
    }

    /// Whether `apply_config(text)` would succeed (nothing is changed).
    pub fn check_config(&self, text: &str) -> Result<()> {
        self.check_config_locked(&self.lock_settings()?, text)
    }

    /// Holds this device's settings (see `SettingsLock`).
    pub fn lock_settings(&self) -> Result<SettingsLock<'_>> {
        Ok(SettingsLock(self.setup()?))
    }

    /// `check_config` with the settings held: true until they are released.
    pub fn check_config_locked(&self, held: &SettingsLock<'_>, text: &str) -> Result<()> {
        self.check_open()?;
        let mut next = held.0.config.clone();
        next.apply(text)?;
        self.check_sharding(&held.0.config, &next)
    }

    /// `apply_config` with the settings held (after `check_config_locked`).
    pub fn apply_config_locked(&self, held: &mut SettingsLock<'_>, text: &str) -> Result<()> {
        self.configure_locked(&mut held.0, |c| c.apply(text))
    }

    /// Replaces every setting (`ccalloc_reset_config`), except `per_stream_shards` once the
    /// device has allocated: that one is fixed for the device's life.
    pub fn set_config(&self, mut config: Config) -> Result<()> {
        self.configure(|c| {
            if self.shards.slots[0].get().is_some() {
                config.per_stream_shards = c.per_stream_shards;
                config.thread_shards = c.thread_shards;
                config.thread_shards_on_contention = c.thread_shards_on_contention;
            }
            *c = config;
            Ok(())
        })
    }

    /// Applies `key:value,...` to this device's settings; keys not named (such as a memory
    /// fraction set with `set_memory_fraction`) keep their values.
    pub fn apply_config(&self, text: &str) -> Result<()> {
        self.configure(|c| c.apply(text))
    }

    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("memory fraction {fraction} is outside [0, 1]"),
            ));
        }
        self.configure(|c| {
            c.per_process_memory_fraction = Some(fraction);
            Ok(())
        })
    }

    fn config(&self) -> Result<Config> {
        let setup = self.setup()?;
        self.check_open()?;
        Ok(setup.config.clone())
    }

    /// The most this device may reserve (`per_process_memory_fraction`).
    fn limit(&self) -> Result<u64> {
        Ok(super::limit_for(&self.config()?, self.total_memory))
    }

    pub fn memory_fraction(&self) -> Result<f64> {
        Ok(self.config()?.per_process_memory_fraction.unwrap_or(1.0))
    }

    pub fn max_split_size(&self) -> Result<u64> {
        Ok(self.config()?.max_split_size)
    }

    /// The device's statistics, one moment's: a reader never sees more bytes allocated
    /// than reserved. With one shard they are read under its lock, reserved bytes included.
    /// With several (`thread_shards`, `per_stream_shards`), under every shard's lock at
    /// once (`stats_of_shards`; a shard busy in a driver call is waited for alone, with the
    /// others released), the shards' counts summed and reserved bytes taken from the
    /// device-wide count, so that memory moving between shards is never counted twice.
    /// Currents and totals are exact, and so are the peaks: the reserved peak from the
    /// device-wide count, the others from the device's `PeakBook`, settled then.
    pub fn stats(&self) -> Result<DeviceStats> {
        self.check_open()?;
        if self.peak_book.is_active() {
            return self.stats_of_shards();
        }
        // Without the book the device has one shard, or none yet. Reserved bytes change only
        // under a shard's lock, so the device-wide count is read with it held: the same
        // moment as its allocated bytes.
        let mut sum = DeviceStats::default();
        let first = self.shards().next();
        let held = first.map(Shard::lock).transpose()?;
        if let (Some(shard), Some(st)) = (first, &held) {
            // Each shard's fronts move counts only under its lock: read with its figures.
            sum.add(&shard.stats_with_fronts_locked(st)?);
        }
        sum.reserved_bytes = self.device_reserved.read()?;
        drop(held);
        // A second shard's making activates the book before that shard can allocate. Made
        // since the check above, it went unread here while its reservations counted in the
        // device's bytes: read again with every shard held.
        if self.peak_book.is_active() {
            return self.stats_of_shards();
        }
        Ok(sum)
    }

    /// The share of peak live bytes that paged segments may keep beyond it while page moves
    /// are within their budget (the `page_slack` setting).
    pub fn page_slack(&self) -> Result<f64> {
        Ok(self.config()?.page_slack)
    }

    pub fn reset_peak_stats(&self) -> Result<()> {
        self.check_open()?;
        self.device_reserved.reset_peaks()?;
        self.reset_peaks_of_shards()?;
        if self.peak_breakdown.recording() {
            self.restart_peak_breakdown()?;
        }
        Ok(())
    }

    pub fn reset_accumulated_stats(&self) -> Result<()> {
        self.check_open()?;
        self.device_reserved.reset_accumulated()?;
        self.each_shard(Shard::reset_accumulated_stats)
    }

    /// How callers have met the device's locks, summed over its shards (read without them:
    /// counts another thread is updating may be one acquisition apart).
    pub fn lock_counters(&self) -> Result<LockCounters> {
        self.check_open()?;
        let mut sum = LockCounters::default();
        for shard in self.shards() {
            sum.add(&shard.lock_counters());
        }
        Ok(sum)
    }

    /// The largest cached free block over every stream (PyTorch's `cacheInfo`).
    pub fn largest_free_block(&self) -> Result<u64> {
        self.check_open()?;
        let mut largest = 0;
        let mut failed = None;
        for shard in self.shards() {
            match shard.largest_free_block() {
                Ok(l) => largest = largest.max(l),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        // Blocks set aside go back to the cache here, which can lift a count.
        self.settle_lifts(None);
        failed.map_or(Ok(largest), Err)
    }

    /// Takes one hold on private pool `pool`, creating it if new (PyTorch's `MemPool`): its
    /// memory is kept for it until every hold is released (`release_pool`).
    pub fn create_or_incref_pool(&self, pool: PoolId) -> Result<()> {
        let mut setup = self.setup()?;
        self.check_open()?;
        let users = setup.pools.entry(pool).or_insert(0);
        *users += 1;
        let users = *users;
        self.each_shard(|s| s.set_pool_users(pool, users))
    }

    /// Restores private pool `pool` to a saved layout (`restore`): frees every block of it
    /// handed out now, and makes the saved ones again at their addresses.
    pub fn restore_pool(
        &self,
        pool: PoolId,
        saved: &[super::SavedBlock],
    ) -> Result<super::Restored> {
        self.check_open()?;
        let mut all = super::Restored::default();
        let mut failed = None;
        for shard in self.shards() {
            if !shard.knows_pool(pool)? {
                continue;
            }
            // After a shard refused the layout, the others still free their blocks of the
            // pool (an empty layout makes none again): a failed restore leaves none of the
            // pool's blocks handed out, in any shard.
            let layout = if failed.is_none() { saved } else { &[] };
            match shard.restore_pool(pool, layout) {
                Ok(done) => {
                    all.freed.extend(done.freed);
                    all.allocated.extend(done.allocated);
                    all.segments_found += done.segments_found;
                }
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        // Saved segments: runs of contiguous blocks (an address past the end of the address
        // space starts a run of its own).
        let starts = saved
            .windows(2)
            .filter(|w| w[0].addr.checked_add(w[0].size) != Some(w[1].addr))
            .count()
            + usize::from(!saved.is_empty());
        if failed.is_none() && all.segments_found < starts {
            failed = Some(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "restore_pool: {} of the {starts} saved segments of pool {pool:?} are gone",
                    starts - all.segments_found
                ),
            ));
        }
        // Blocks made live again count as allocations (in any shard).
        self.settle_lifts(None);
        if let Some(e) = failed {
            // The blocks other shards made again are freed too: the caller learns of none.
            for made in all.allocated {
                self.free(made.ptr)?;
            }
            return Err(e);
        }
        Ok(all)
    }

    /// The holds on private pool `pool` (0 when unknown).
    pub fn pool_use_count(&self, pool: PoolId) -> Result<u32> {
        let setup = self.setup()?;
        self.check_open()?;
        Ok(setup.pools.get(&pool).copied().unwrap_or(0))
    }

    /// Every segment with its blocks, in address order (parked blocks as they are).
    pub fn segments(&self) -> Result<Vec<SegmentView>> {
        self.check_open()?;
        let mut all = Vec::new();
        let listed = self.shards().try_for_each(|shard| {
            all.extend(shard.segments()?);
            Ok(())
        });
        // Held blocks go back to the cache here, which can lift a count.
        self.settle_lifts(None);
        listed?;
        all.sort_by_key(|s| s.addr);
        Ok(all)
    }

    /// Drops one hold on `pool`, in every shard.
    pub fn release_pool(&self, pool: PoolId) -> Result<()> {
        let mut setup = self.setup()?;
        self.check_open()?;
        let Some(users) = setup.pools.get_mut(&pool) else {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("release_pool: unknown pool {pool:?}"),
            ));
        };
        *users = users.saturating_sub(1);
        if *users == 0 {
            setup.pools.remove(&pool);
        }
        let mut result = Ok(());
        for shard in self.shards() {
            if shard.knows_pool(pool)? {
                result = result.and(shard.release_pool(pool));
            }
        }
        result
    }

    /// Releases everything; refused while blocks are still live or a capture is open.
    pub fn shutdown(&self) -> Result<()> {
        let setup = self.setup()?;
        self.check_open()?;
        if !setup.windows.is_empty() {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "device {}: a CUDA graph capture is in progress",
                    self.device
                ),
            ));
        }
        // Every shard held at once (in slot order; no other path waits for a shard's lock
        // while holding another: a growth only tries them, `lending`), so that no allocation
        // slips in between the check and the release, and a refusal leaves every shard open.
        let shards: Vec<&Shard> = self.shards().collect();
        let mut locked = Vec::with_capacity(shards.len());
        for shard in &shards {
            locked.push(shard.lock()?);
        }
        // Blocks held in fronts are free: taken back, so that only the caller's count.
        for (shard, st) in shards.iter().zip(locked.iter_mut()) {
            shard.drain_fronts(st);
        }
        let count: i64 = locked
            .iter()
            .map(|st| st.stats().allocation.all().current)
            .sum();
        if count > 0 {
            let bytes: i64 = locked
                .iter()
                .map(|st| st.stats().allocated_bytes.all().current)
                .sum();
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "device {}: {count} allocations ({}) are still live; free them before shutdown",
                    self.device,
                    crate::error::human_bytes(bytes as u64)
                ),
            ));
        }
        // Closed only once every cache is released: a driver failure leaves them all open.
        for (shard, st) in shards.iter().zip(locked.iter_mut()) {
            shard.release_all_cached(st)?;
        }
        // Set while every shard is held: a shard's next holder sees it (`Shard::lock`).
        self.lifecycle.set_shut_down(true);
        self.set_fronts_open(&setup);
        Ok(())
    }

    /// Undoes `shutdown` (when shutting down several devices fails part-way).
    pub fn reopen(&self) {
        // No way to report: with the settings poisoned, the fronts stay as they are (every
        // later call that needs the settings reports the poisoning).
        let setup = self.setup.lock();
        self.lifecycle.set_shut_down(false);
        if let Ok(setup) = setup {
            self.set_fronts_open(&setup);
        }
    }
}

/// Whether a device's allocator is shut down: its one record, shared by the device and its
/// shards. The device sets it (`shutdown`, `reopen`) while it holds its settings and, for a
/// shutdown, every shard's lock; shards read it each time they are locked (`Shard::lock`)
/// and the device before each call; the fronts' `open` is derived from it
/// (`set_fronts_open`).
#[derive(Debug, Default)]
pub(in crate::alloc) struct Lifecycle {
    shut_down: AtomicBool,
}

impl Lifecycle {
    pub(in crate::alloc) fn is_shut_down(&self) -> bool {
        self.shut_down.load(Ordering::Acquire)
    }

    fn set_shut_down(&self, shut_down: bool) {
        self.shut_down.store(shut_down, Ordering::Release);
    }

    /// `Ok` until shutdown; then the `ShutDown` error every call of `device` gets.
    pub(in crate::alloc) fn check_open(&self, device: usize) -> Result<()> {
        if self.is_shut_down() {
            return Err(Self::shut_down_error(device));
        }
        Ok(())
    }

    /// The error of a call on `device` after its shutdown (see `check_open`).
    pub(in crate::alloc) fn shut_down_error(device: usize) -> Error {
        Error::new(
            ErrorKind::ShutDown,
            format!("device {device}: the allocator has been shut down"),
        )
    }
}

/// Whether thread fronts may serve a device with these settings, with a private-pool window
/// open or not, shut down or not.
fn fronts_open(config: &Config, windows_open: bool, shut_down: bool) -> bool {
    config.thread_cache && config.expandable_segments && !windows_open && !shut_down
}

/// How a device's streams map to its shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Sharding {
    /// One shard for every stream (both settings off).
    One = 0,
    /// A shard of its own for a stream that a thread new to the device allocates on first
    /// (`Config::thread_shards`); every other stream in the first shard.
    NewThreads = 1,
    /// A shard per stream (`Config::per_stream_shards`).
    EveryStream = 2,
    /// Every stream in the first shard until its lock is `contended_often`; then as
    /// `NewThreads`, except that a thread's own stream (`homes::brought`) gets a shard
    /// although the first shard holds memory of it (`Config::thread_shards_on_contention`).
    OnContention = 3,
}

impl Sharding {
    fn of(config: &Config) -> Self {
        match (
            config.per_stream_shards,
            config.thread_shards,
            config.thread_shards_on_contention,
        ) {
            (true, _, _) => Self::EveryStream,
            (false, true, true) => Self::OnContention,
            (false, true, false) => Self::NewThreads,
            (false, false, _) => Self::One,
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::NewThreads,
            2 => Self::EveryStream,
            3 => Self::OnContention,
            _ => Self::One,
        }
    }
}

/// The devices (by `DeviceAllocator::key`) this thread has allocated on, for thread shards:
/// such a thread's new streams go to the device's first shard. Each with the stream the
/// thread brought to the device, if any: the stream of its first allocation there, when the
/// first shard held no memory of it (no other thread had used it). After threads are seen
/// contending (`Sharding::OnContention`), that stream is the one that gets a shard.
mod homes {
    use crate::driver::StreamId;
    use std::cell::Cell;

    /// Devices remembered per thread, newest first. A forgotten one (a thread that used
    /// more devices' allocators since, such as one per GPU, re-made after each shutdown)
    /// makes the thread's next new stream on it look new: a shard of its own, if slots are
    /// left and the first shard holds no memory of it.
    const HOMES: usize = 64;

    /// (device key, stream brought, whether one was): key 0 is none.
    type Home = (u64, u64, bool);

    std::thread_local! {
        /// The device this thread last noted (every allocation notes one: one compare).
        static LAST: Cell<u64> = const { Cell::new(0) };
        /// The devices noted, newest first.
        static ALL: [Cell<Home>; HOMES] = const { [const { Cell::new((0, 0, false)) }; HOMES] };
    }

    fn find(key: u64) -> Option<Home> {
        ALL.try_with(|all| all.iter().map(Cell::get).find(|home| home.0 == key))
            .ok()
            .flatten()
    }

    /// Whether this thread has allocated on the device keyed `key`.
    #[inline]
    pub(super) fn has_home(key: u64) -> bool {
        LAST.try_with(Cell::get).is_ok_and(|last| last == key) || find(key).is_some()
    }

    /// `None` if this thread has not allocated on the device keyed `key`; else the stream it
    /// brought there, if it brought one.
    pub(super) fn brought(key: u64) -> Option<Option<StreamId>> {
        find(key).map(|(_, stream, some)| some.then_some(StreamId(stream)))
    }

    /// Notes that this thread allocates on the device keyed `key` (keys start at 1). On its
    /// first allocation there, `brings` says whether the stream is one it brings.
    #[inline]
    pub(super) fn note_home(key: u64, stream: StreamId, brings: impl FnOnce() -> bool) {
        if LAST
            .try_with(|last| last.replace(key))
            .is_ok_and(|was| was == key)
        {
            return;
        }
        if find(key).is_none() {
            note_new(key, stream, brings());
        }
    }

    #[cold]
    fn note_new(key: u64, stream: StreamId, brought: bool) {
        let _ = ALL.try_with(|all| {
            for i in (1..HOMES).rev() {
                all[i].set(all[i - 1].get());
            }
            all[0].set((key, stream.0, brought));
        });
    }
}

/// The slot a stream past `MAX_SHARDS` shares. The hash's high bits: stream handles are
/// aligned heap pointers, whose low bits are all alike.
fn shared_slot(stream: StreamId) -> usize {
    (stream.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - MAX_SHARDS.trailing_zeros())) as usize
}

thread_local! {
    /// (device allocator's address, slot) of this thread's last allocation: where its
    /// `free` looks first. A stale entry (a dropped allocator's address reused) only costs
    /// a look in the wrong shard.
    static LAST_SLOT: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 0)) };
}

/// A lock of the device's, for `DeviceAllocator::poison` (tests).
#[cfg(test)]
#[derive(Clone, Copy, Debug)]
pub(crate) enum LockOf {
    Settings,
    ReservedBytes,
    FrontRegistry,
    ShardState,
}

#[cfg(test)]
impl DeviceAllocator {
    /// Poisons one of the device's locks: a thread panics while it holds it.
    pub(crate) fn poison(&self, which: LockOf, stream: StreamId) {
        let (_, shard) = self.shard(stream).unwrap();
        let panicked = std::thread::scope(|s| {
            s.spawn(|| match which {
                LockOf::Settings => {
                    let _held = self.setup.lock();
                    panic!("poisoning the settings");
                }
                LockOf::ReservedBytes => self.device_reserved.hold_while(|| panic!("poisoning")),
                LockOf::FrontRegistry => shard.fronts.hold_while(|| panic!("poisoning")),
                LockOf::ShardState => {
                    let _held = shard.state.lock();
                    panic!("poisoning the shard's state");
                }
            })
            .join()
            .is_err()
        });
        assert!(panicked);
    }

    /// Marks the first shard's lock contended often (`Sharding::OnContention`'s trigger).
    pub(crate) fn mark_first_shard_contended(&self) {
        self.shards.filled_shard(0).state.mark_contended_often();
    }

    /// The locked state of `stream`'s shard.
    pub(crate) fn state_of(&self, stream: StreamId) -> MutexGuard<'_, super::state::State> {
        self.shard(stream).unwrap().1.state.lock().unwrap()
    }

    /// `f` summed over every shard's state.
    pub(crate) fn sum_over_states(&self, f: impl Fn(&super::state::State) -> usize) -> usize {
        self.shards().map(|s| f(&s.state.lock().unwrap())).sum()
    }
}

#[cfg(test)]
mod slot_tests {
    use super::*;

    #[test]
    fn aligned_stream_handles_spread_over_the_shared_slots() {
        // cudaStream_t values are heap pointers: 64-byte aligned here.
        let used: std::collections::BTreeSet<usize> = (0..1000u64)
            .map(|k| shared_slot(StreamId(0x7f00_0000_0000 + k * 0x40)))
            .collect();
        assert_eq!(used.len(), MAX_SHARDS, "{used:?}");
    }
}
