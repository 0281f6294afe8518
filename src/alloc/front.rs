//! Each thread's front cache: the same-size alloc/free loop without the device lock.

// A training loop frees a tensor and soon asks again for one of exactly its size on the
// same stream. The shard serves that from its parked blocks (`State::park`), but every
// visit still takes the shard's lock and its live-block map: two atomic read-modify-writes
// per call, most of a cached call's time. A front keeps up to `FRONT_SLOTS` such blocks per
// thread, behind a `SpinCell` that only its own thread takes on the fast path: one atomic
// per call, and a few word compares.
//
// To the shard, a block in a front stays handed out (live, counted as allocated). A front
// holds two kinds of entry:
// - *held*: freed by the caller, waiting for a request of the same size and stream;
// - *out*: handed out again by the front, so that its free finds it without the shard.
//
// Statistics stay exact. A front counts what it hands out and takes back (`FrontCounts`),
// and a statistics read adds that to the shard's. Peaks need no count of their own: the
// shard's figures include held blocks as allocated, so they never fall below the true
// ones, and the shard keeps its figures at or under the peaks. When an allocation would
// lift the shard's figures past a peak while fronts hold blocks, it first takes the held
// blocks back (a drain), so the new peak is the true one. Every path that must see the
// real free memory drains them too: growth, `empty_cache`, snapshots, peak resets,
// settings, shutdown. While a capture routes allocations, fronts are closed
// (`Fronts::open`): they neither hand out nor take blocks. A statistics read adds the
// fronts' counts under the shard's lock, which every move of counts between a front and
// the shard (a drain, an eviction, the fold of an exited thread's front) also holds.
//
// The boundary with the shard is narrow. The fast path (`take`, `give_back`) never reaches
// the shard. The shard reaches the fronts only from its slow paths, under its lock (lock
// order: shard, then registry, then front), and only through `Fronts`: `drain`, the one way
// held blocks and exited threads' counts go back (called from `Shard::drain_fronts` alone,
// whose comment lists when); `FrontCell::adopt`, a slow free's block taken as held;
// `detach`, a block freed by another path or recorded on a stream; and the statistics'
// `add_counts_to` / `reset_accumulated`.
//
// Each handed-out block names the front holding it (`Block::front`, 0 for none): a block
// handed out by one thread's front may be freed by another thread (or recorded on a
// stream), and that slow free must take it out of exactly that front. Without the name it
// would visit every front's cell, one compare-and-swap each, on every slow free of the
// shard; with it, the free looks once in the shard's block it has already found, and
// visits a cell only when the block is in one.
//
// Each shard has fronts of its own (`Fronts`, one per thread that frees into it): a front
// holds only its shard's blocks, and only that shard drains it, under its lock, so every
// rule above holds per shard. A thread has one front per shard it frees into (per device
// and shard: `Local`). An allocation looks in the front of its stream's shard; a free, whose
// shard is unknown, looks in each of the thread's fronts for the device that has blocks
// out (usually one), and otherwise goes to the shard, which adopts the block into the
// thread's front for that shard. A block names a front of its own shard's registry (only
// that shard adopts it), and front ids are unique for the process (`NEXT_FRONT`).

use super::core::blocks::BlockId;
use super::core::reuse::ReuseGate;
use super::sizing::PoolKind;
use super::stats::{DeviceStats, FrontMoved};
use crate::driver::{DevicePtr, StreamId};
use crate::sync::SpinCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Blocks (held and out) up to `FRONT_MAX_BLOCK` a front keeps ...
pub const FRONT_SLOTS: usize = 8;
/// ... and larger ones, in slots of their own: a large block out for long (a live tensor)
/// must not take the place of small ones, nor a large one held push a small one out.
pub const FRONT_LARGE_SLOTS: usize = 2;
/// Blocks up to this size (the small pool's largest) stay held until reused or drained.
/// A larger block is held only until its thread next visits the device, which then parks
/// it (`Shard::return_large_held`; a visit to another shard returns it first): held longer,
/// unmerged, large blocks change where later blocks go enough to raise peak reserved over
/// peak live (bert's replay: 1.035 → 1.063 with blocks up to 1 GiB held). Returned at the
/// next visit, a large block reaches the shard before anything the shard does could have
/// used it, so a thread's own sequence leaves the shard as parking it at once would, and
/// the same-size loop of large tensors still runs without the shard's lock.
pub const FRONT_MAX_BLOCK: u64 = 1 << 20;
/// Adoptions counted before a front judges its reuse ...
const ADOPTIONS_PER_REVIEW: u64 = 64;
/// ... and if fewer than one in this many were reused, it stops adopting ...
const ADOPTIONS_PER_REUSE: u64 = 4;
/// ... for this many frees (a loop of random sizes then pays nothing for it).
const ADOPTION_PAUSE: u32 = 4096;

/// A block in a front.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    pub ptr: DevicePtr,
    pub size: u64,
    pub requested: u64,
    pub stream: StreamId,
    pub pool: PoolKind,
    pub id: BlockId,
    /// Freed by the caller (else handed out again by the front).
    pub held: bool,
    /// Frees of it not yet stamped on its pages (`FreedAt`). 1 for a block up to
    /// `FRONT_MAX_BLOCK`, which its drain stamps as one free. A larger one's free is stamped
    /// when the front adopts it (0: `Shard::adopt`), and each free the front serves after
    /// that adds one, for the fences' cadence when it goes back.
    pub unstamped_frees: u32,
    /// When it was last freed, for eviction of the oldest.
    stamp: u64,
}

impl Entry {
    pub fn new(
        ptr: DevicePtr,
        size: u64,
        requested: u64,
        stream: StreamId,
        pool: PoolKind,
        id: BlockId,
    ) -> Self {
        Self {
            ptr,
            size,
            requested,
            stream,
            pool,
            id,
            held: false,
            unstamped_frees: 1,
            stamp: 0,
        }
    }

    /// Held only until its thread's next visit to the device (`FRONT_MAX_BLOCK`).
    pub fn is_large(&self) -> bool {
        self.size > FRONT_MAX_BLOCK
    }

    /// Its weight in each statistic a front moves.
    fn amounts(&self) -> FrontMoved {
        let (size, requested) = (self.size as i64, self.requested as i64);
        FrontMoved {
            allocation: 1,
            allocated_bytes: size,
            active: 1,
            active_bytes: size,
            requested_bytes: requested,
        }
    }
}

/// What a front has handed out and taken back, per pool (small, large); a statistics read
/// adds it to the shard's (`add_to`).
#[derive(Clone, Copy, Debug, Default)]
pub struct FrontCounts {
    /// Net change of each statistic's current value: minus what held entries weigh.
    current: [FrontMoved; 2],
    /// Totals handed out and taken back (the statistics' `allocated` and `freed`).
    handed: [FrontMoved; 2],
    returned: [FrontMoved; 2],
}

impl FrontCounts {
    fn hand(&mut self, e: &Entry) {
        let (p, a) = (e.pool as usize, e.amounts());
        self.current[p] += a;
        self.handed[p] += a;
    }

    fn take_back(&mut self, e: &Entry) {
        let (p, a) = (e.pool as usize, e.amounts());
        self.current[p] -= a;
        self.returned[p] += a;
    }

    /// A held entry leaves for the shard, which counts its free from now on.
    fn unreturn(&mut self, e: &Entry) {
        let (p, a) = (e.pool as usize, e.amounts());
        self.current[p] += a;
        self.returned[p] -= a;
    }

    /// Nothing was ever handed out or taken back (since the last reset of the totals),
    /// and nothing is held: folding these counts would change no statistic.
    fn is_unused(&self) -> bool {
        let zero = FrontMoved::default();
        [self.current, self.handed, self.returned]
            .iter()
            .all(|pools| pools.iter().all(|m| *m == zero))
    }

    pub fn reset_accumulated(&mut self) {
        self.handed = Default::default();
        self.returned = Default::default();
    }

    /// Adds these counts to `stats` (a shard's or the device's sum); `with_current` false
    /// adds only the totals (a front folded into its shard has no held entries left).
    pub fn add_to(&self, stats: &mut DeviceStats, with_current: bool) {
        for pool in [PoolKind::Small, PoolKind::Large] {
            let p = pool as usize;
            let current = with_current.then_some(&self.current[p]);
            stats.add_front_counts(pool, current, &self.handed[p], &self.returned[p]);
        }
    }
}

/// Where a free found its block.
#[derive(Debug, PartialEq, Eq)]
pub enum GiveBack {
    /// It was out: now held.
    Held,
    /// It is held already: a double free.
    AlreadyFree,
    /// Not in this front.
    NotHere,
}

/// What made room for a block a front adopted (`Front::adopt`).
#[derive(Debug)]
pub enum Evicted {
    /// A slot was free.
    None,
    /// A held block, for the shard to free.
    Held(Entry),
    /// A block out (live): it leaves the front and is the shard's alone.
    Out(Entry),
}

/// How many entries a front has of each kind (kept as they change: read on every visit).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Census {
    pub held: u32,
    pub out: u32,
    /// Of the held ones, those over `FRONT_MAX_BLOCK` (returned at the next visit).
    pub held_large: u32,
}

/// One thread's front (behind its `FrontCell`).
#[derive(Default)]
pub struct Front {
    /// `FRONT_SLOTS` for small blocks, then `FRONT_LARGE_SLOTS` for large ones.
    slots: [Option<Entry>; FRONT_SLOTS + FRONT_LARGE_SLOTS],
    counts: FrontCounts,
    clock: u64,
    census: Census,
}

impl Front {
    pub fn counts(&self) -> &FrontCounts {
        &self.counts
    }

    pub fn counts_mut(&mut self) -> &mut FrontCounts {
        &mut self.counts
    }

    pub fn census(&self) -> Census {
        self.census
    }

    /// Hands out a held block of exactly `requested` bytes on `stream`, and whether it is
    /// large.
    pub fn take(&mut self, requested: u64, stream: StreamId) -> Option<(DevicePtr, bool)> {
        let fits = |e: &&mut Entry| e.held && e.requested == requested && e.stream == stream;
        // A request over FRONT_MAX_BLOCK needs a block over it.
        let large = requested > FRONT_MAX_BLOCK;
        let mut matching = self.slots[Self::slots_for(large)]
            .iter_mut()
            .flatten()
            .filter(fits);
        let first = matching.next()?;
        // A large block goes out newest first, as parking hands them out (its stand-in).
        let entry = match large {
            false => first,
            true => matching.fold(
                first,
                |newest, e| if e.stamp > newest.stamp { e } else { newest },
            ),
        };
        entry.held = false;
        let entry = *entry;
        self.counts.hand(&entry);
        self.census.held -= 1;
        self.census.out += 1;
        self.census.held_large -= entry.is_large() as u32;
        Some((entry.ptr, entry.is_large()))
    }

    /// A free of `ptr`, and whether its block is over `FRONT_MAX_BLOCK`.
    pub fn give_back(&mut self, ptr: DevicePtr) -> (GiveBack, bool) {
        self.clock += 1;
        let stamp = self.clock;
        let Some(entry) = self.slots.iter_mut().flatten().find(|e| e.ptr == ptr) else {
            return (GiveBack::NotHere, false);
        };
        if entry.held {
            return (GiveBack::AlreadyFree, entry.is_large());
        }
        entry.held = true;
        entry.stamp = stamp;
        if entry.is_large() {
            entry.unstamped_frees = entry.unstamped_frees.saturating_add(1);
        }
        let entry = *entry;
        self.counts.take_back(&entry);
        self.census.held += 1;
        self.census.out -= 1;
        self.census.held_large += entry.is_large() as u32;
        (GiveBack::Held, entry.is_large())
    }

    /// The slots for blocks over `FRONT_MAX_BLOCK` (`large`) or up to it.
    fn slots_for(large: bool) -> std::ops::Range<usize> {
        match large {
            false => 0..FRONT_SLOTS,
            true => FRONT_SLOTS..FRONT_SLOTS + FRONT_LARGE_SLOTS,
        }
    }

    /// Takes a block the caller just freed (through the shard) as held. When every slot of
    /// its kind (small or large) is taken, the oldest held entry of that kind makes room
    /// (`Evicted::Held`, for the shard to free); when every one is out, the one freed
    /// longest ago (`Evicted::Out`: the block stays live, the shard's own from now on, as
    /// after `detach`). Out blocks may live for the rest of the job (a weight or optimizer
    /// state allocated where a temporary of its size was just freed): were they never to
    /// give way, a front with all its slots out would never take a block again, and every
    /// same-size loop of that thread would go through the shard's lock from then on.
    pub fn adopt(&mut self, mut entry: Entry) -> Evicted {
        self.clock += 1;
        entry.held = true;
        entry.stamp = self.clock;
        let range = Self::slots_for(entry.is_large());
        let kind = &self.slots[range.clone()];
        let oldest = |held: bool| {
            kind.iter()
                .enumerate()
                .filter_map(|(i, e)| e.filter(|e| e.held == held).map(|e| (e.stamp, i)))
                .min()
                .map(|(_, i)| range.start + i)
        };
        let slot = kind
            .iter()
            .position(Option::is_none)
            .map(|free| range.start + free)
            .or_else(|| oldest(true))
            .or_else(|| oldest(false))
            .expect("a front has slots of each kind");
        let evicted = match self.slots[slot].replace(entry) {
            None => Evicted::None,
            Some(old) if old.held => {
                self.counts.unreturn(&old);
                self.census.held -= 1;
                self.census.held_large -= old.is_large() as u32;
                Evicted::Held(old)
            }
            Some(old) => {
                self.census.out -= 1;
                Evicted::Out(old)
            }
        };
        self.census.held += 1;
        self.census.held_large += entry.is_large() as u32;
        self.counts.take_back(&entry);
        evicted
    }

    /// Removes and returns every held entry (for the shard to free).
    pub fn drain_held(&mut self) -> Vec<Entry> {
        self.drain_held_if(|_| true)
    }

    /// Removes and returns the held entries over `FRONT_MAX_BLOCK` (for the shard to free),
    /// oldest freed first: the shard parks them in that order, as if at each free.
    pub fn drain_held_large(&mut self) -> Vec<Entry> {
        let mut drained = self.drain_held_if(Entry::is_large);
        drained.sort_by_key(|e| e.stamp);
        drained
    }

    fn drain_held_if(&mut self, mut which: impl FnMut(&Entry) -> bool) -> Vec<Entry> {
        let mut drained = Vec::new();
        for slot in &mut self.slots {
            if let Some(e) = slot.take_if(|e| e.held && which(e)) {
                self.counts.unreturn(&e);
                self.census.held -= 1;
                self.census.held_large -= e.is_large() as u32;
                drained.push(e);
            }
        }
        drained
    }

    /// For a shard path that frees `ptr` or records it on a stream: removes it if it is out
    /// (`Some(false)`, the shard takes it from here); `Some(true)` if it is held (freed
    /// already; left as it is); `None` if it is not here.
    pub fn detach(&mut self, ptr: DevicePtr) -> Option<bool> {
        let slot = self
            .slots
            .iter_mut()
            .find(|s| s.is_some_and(|e| e.ptr == ptr))?;
        if slot.is_some_and(|e| e.held) {
            return Some(true);
        }
        *slot = None;
        self.census.out -= 1;
        Some(false)
    }

    pub fn is_empty(&self) -> bool {
        self.slots.iter().all(Option::is_none)
    }
}

/// A front shared between its thread (the fast path) and the shard's slow paths.
pub struct FrontCell {
    pub id: u64,
    front: SpinCell<Front>,
    /// Its thread has exited: drained and folded into the shard once empty.
    orphaned: AtomicBool,
}

impl FrontCell {
    /// Takes `entry`, a block its thread just freed through the shard, as held, while
    /// `fronts` are open. Returns what made room (for the shard to free or take back) and
    /// the front's census; `None` (nothing changed) when closed.
    pub fn adopt(&self, fronts: &Fronts, entry: Entry) -> Option<(Evicted, Census)> {
        self.front.with(|f| {
            if !fronts.open.load(Ordering::Relaxed) {
                return None;
            }
            if !fronts.adopted.load(Ordering::Relaxed) {
                fronts.adopted.store(true, Ordering::Relaxed);
            }
            let evicted = f.adopt(entry);
            Some((evicted, f.census()))
        })
    }
}

/// What a drain (`Fronts::drain`) gives the shard.
pub enum Drained {
    /// A held block: the shard frees it (to the shard it was live until now).
    Held(Entry),
    /// The counts of an exited thread's front that holds nothing: the shard adds them to
    /// its statistics, and the front is dropped.
    Folded(FrontCounts),
}

/// A shard's fronts, and whether they may be used now.
pub struct Fronts {
    /// Unique for the process's life (never 0): `IDLE_ADOPTER` names them by it.
    id: u64,
    /// The device's key (`new_key`): a thread's fronts for the device are found by it.
    device: u64,
    cells: Mutex<Vec<Arc<FrontCell>>>,
    /// False while a capture routes allocations to a private pool, after shutdown, and
    /// with `thread_cache:False` (the device sets every shard's alike): fronts neither hand
    /// out nor adopt. Read inside the front's cell, so that a drain that follows a change
    /// sees no later use.
    pub open: AtomicBool,
    /// Fronts whose thread exited (or gave them up), not yet folded into the statistics.
    orphans: AtomicUsize,
    /// Set by the first adoption into any front of the device (shared by its shards' fronts)
    /// and never cleared: a front gets blocks only by adopting them, so until then every
    /// front of the device is empty.
    adopted: Arc<AtomicBool>,
}

static NEXT_FRONT: AtomicU64 = AtomicU64::new(1);
static NEXT_FRONTS: AtomicU64 = AtomicU64::new(1);
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// A key unique for the process's life, for a device.
pub fn new_key() -> u64 {
    NEXT_KEY.fetch_add(1, Ordering::Relaxed)
}

impl Fronts {
    /// The fronts of a new shard of the device whose key is `device`; `adopted`: the device's
    /// record of an adoption into any of its fronts.
    pub fn new(device: u64, open: bool, adopted: Arc<AtomicBool>) -> Self {
        Self {
            id: NEXT_FRONTS.fetch_add(1, Ordering::Relaxed),
            device,
            cells: Mutex::default(),
            open: AtomicBool::new(open),
            orphans: AtomicUsize::new(0),
            adopted,
        }
    }

    /// The registered fronts (a copy: the registry lock is not held while they are used).
    fn all(&self) -> crate::error::Result<Vec<Arc<FrontCell>>> {
        Ok(self.cells()?.clone())
    }

    /// The registry, locked; a panic while it was held is the `sync::poisoned` error.
    fn cells(&self) -> crate::error::Result<std::sync::MutexGuard<'_, Vec<Arc<FrontCell>>>> {
        crate::sync::lock(&self.cells, "the thread fronts' registry")
    }

    /// Runs `f` with the registry locked (tests: a panic in `f` poisons it).
    #[cfg(test)]
    pub fn hold_while(&self, f: impl FnOnce()) {
        let _held = self.cells.lock();
        f();
    }

    /// A new front for the calling thread.
    pub fn register(&self) -> crate::error::Result<Arc<FrontCell>> {
        let cell = Arc::new(FrontCell {
            id: NEXT_FRONT.fetch_add(1, Ordering::Relaxed),
            front: SpinCell::new(Front::default()),
            orphaned: AtomicBool::new(false),
        });
        self.cells()?.push(cell.clone());
        Ok(cell)
    }

    /// Whether a drain has work beyond held blocks: fronts of exited threads to fold.
    pub fn has_orphans(&self) -> bool {
        self.orphans.load(Ordering::Acquire) > 0
    }

    /// The one way blocks leave the fronts for the shard: every front gives up its held
    /// blocks, and fronts of exited threads that then hold nothing give up their counts and
    /// are dropped, each through `give`. The shard calls it under its lock (`drain_fronts`).
    /// No way to report: with the registry poisoned it gives nothing, and the fronts keep
    /// their blocks, which stay live to the shard, so nothing is handed out twice; the next
    /// call that needs the registry reports the poisoning.
    pub fn drain(&self, mut give: impl FnMut(Drained)) {
        let Ok(cells) = self.all() else { return };
        let mut gone = Vec::new();
        for cell in cells {
            let (drained, empty, counts) = cell
                .front
                .with(|f| (f.drain_held(), f.is_empty(), *f.counts()));
            for entry in drained {
                give(Drained::Held(entry));
            }
            if empty && cell.orphaned.load(Ordering::Acquire) {
                give(Drained::Folded(counts));
                gone.push(cell.id);
            }
        }
        if gone.is_empty() {
            return;
        }
        // With the registry poisoned the folded fronts stay registered, empty: a later
        // drain would fold them again, but every call that reads them reports the poisoning.
        let Ok(mut cells) = self.cells() else { return };
        cells.retain(|c| !gone.contains(&c.id));
        self.orphans.fetch_sub(gone.len(), Ordering::AcqRel);
    }

    /// For a shard path that frees `ptr` or records it on a stream, in front `id` (the one
    /// its block names): removes it if it is out (`Some(false)`: the shard takes it from
    /// here); `Some(true)` if it is held (freed already); `None` if it is not there.
    pub fn detach(&self, id: u64, ptr: DevicePtr) -> crate::error::Result<Option<bool>> {
        let cell = self.cells()?.iter().find(|c| c.id == id).cloned();
        Ok(cell.and_then(|cell| cell.front.with(|f| f.detach(ptr))))
    }

    /// Adds every front's counts (held entries included) to `stats`.
    pub fn add_counts_to(&self, stats: &mut DeviceStats) -> crate::error::Result<()> {
        for cell in self.all()? {
            cell.front.with(|f| f.counts().add_to(stats, true));
        }
        Ok(())
    }

    /// Clears every front's totals (`reset_accumulated_stats`).
    pub fn reset_accumulated(&self) -> crate::error::Result<()> {
        for cell in self.all()? {
            cell.front.with(|f| f.counts_mut().reset_accumulated());
        }
        Ok(())
    }

    /// `cell`'s thread no longer uses it. A front that holds nothing and never counted a
    /// block (its thread freed only blocks the shard kept: recorded on other streams,
    /// large ones of a shard it does not allocate from) leaves the registry at once: there is nothing
    /// to fold, and the shard's next drain, the only other way out, may never come in a
    /// steady job, while threads that come and go would each leave one. Only its own
    /// thread adds to a front, so an empty one stays empty. Lock order: registry, then
    /// front.
    fn orphan(&self, cell: &FrontCell) {
        if let Ok(mut cells) = self.cells() {
            if cell.front.with(|f| f.is_empty() && f.counts().is_unused()) {
                cells.retain(|c| c.id != cell.id);
                return;
            }
        }
        if !cell.orphaned.swap(true, Ordering::AcqRel) {
            self.orphans.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// What the calling thread knows of its front for one shard, without taking its cell:
/// upper bounds of its census (only this thread adds entries; others only take them away),
/// and its adoption record.
struct Local {
    /// `fronts.device`, copied: read on every free. The `Local` for a shard's fronts is
    /// found by their address, which stays theirs while `fronts` holds them.
    device: u64,
    fronts: Arc<Fronts>,
    cell: Arc<FrontCell>,
    census: Census,
    /// Large blocks handed out since the thread last visited the shard: the shard's
    /// parking counts them as its own reuses (`take_large_held`).
    large_reused: u32,
    /// Adoptions and reuses, and the pause they may set, of blocks up to `FRONT_MAX_BLOCK`
    /// and of larger ones apart: large blocks that go back unused must not stop the small
    /// ones that are reused.
    gate: ReuseGate,
    gate_large: ReuseGate,
}

impl Drop for Local {
    fn drop(&mut self) {
        // In a child forked while another thread of the parent held this front's lock, the
        // lock stays held for good: orphaning would spin at the child's exit. The child can
        // make no ccalloc call (`runtime::check_not_forked`), so nothing reads the front.
        if crate::runtime::is_forked_child() {
            return;
        }
        self.fronts.orphan(&self.cell);
    }
}

/// Shards (of any devices) a thread keeps a front for at once (older ones are orphaned).
const LOCALS: usize = 8;

thread_local! {
    /// The thread's fronts, one `Local` per shard it freed into. Only `with_local_adopter`
    /// adds or drops one, and it resets `IDLE_ADOPTER` when it does: any other code that
    /// drops a `Local` must reset it too, or a free could skip registering a front.
    static LOCALS_OF_THREAD: std::cell::RefCell<Vec<Local>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The `Fronts::id` of the fronts where a slow free of a block that does not fit a
    /// front changes nothing in this thread's `Local` (0: none): the thread has a front
    /// there, and stepping either gate changes nothing (`ReuseGate::is_idle`). Set by each
    /// `with_adopter` that looks at the `Local`s, the one place that adds or drops a `Local`
    /// or moves a gate out of idle (`note_set_aside`).
    static IDLE_ADOPTER: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Where the front an allocation looks in is.
#[derive(Clone, Copy)]
pub enum FrontOf<'a> {
    /// The one shard's of the device keyed so (a device without shards has one front per
    /// thread).
    OnlyShard(u64),
    /// This shard's.
    Shard(&'a Fronts),
}

/// The calling thread's view of its front `which`, if it has one.
fn with_local<R>(which: FrontOf<'_>, f: impl FnOnce(&mut Local) -> R) -> Option<R> {
    LOCALS_OF_THREAD
        .try_with(|locals| {
            let mut locals = locals.try_borrow_mut().ok()?;
            let local = locals.iter_mut().find(|l| match which {
                FrontOf::OnlyShard(device) => l.device == device,
                FrontOf::Shard(fronts) => std::ptr::eq(&*l.fronts, fronts),
            })?;
            Some(f(local))
        })
        .ok()
        .flatten()
}

/// The fast allocation, from the front of the stream's shard: a held block of exactly
/// `requested` bytes on `stream`.
pub fn take(which: FrontOf<'_>, requested: u64, stream: StreamId) -> Option<DevicePtr> {
    with_local(which, |local| {
        if local.census.held == 0 {
            return None;
        }
        let fronts = &local.fronts;
        let (taken, census) = local.cell.front.with(|f| {
            if !fronts.open.load(Ordering::Relaxed) {
                return (None, f.census());
            }
            (f.take(requested, stream), f.census())
        });
        local.census = census;
        let (ptr, large) = taken?;
        match large {
            false => local.gate.note_reuse(),
            true => {
                local.gate_large.note_reuse();
                local.large_reused += 1;
            }
        }
        Some(ptr)
    })
    .flatten()
}

/// Takes out the calling thread's held blocks over `FRONT_MAX_BLOCK` in its front among
/// `fronts`, for the shard to free, and how many such blocks the front handed out since
/// the last call: at the start of each of the thread's visits to the shard, under its lock
/// (see `FRONT_MAX_BLOCK`). Costs a thread-local look when there are none.
pub fn take_large_held(fronts: &Fronts) -> (Vec<Entry>, u32) {
    with_local(FrontOf::Shard(fronts), |local| {
        let reused = std::mem::take(&mut local.large_reused);
        if local.census.held_large == 0 {
            return (Vec::new(), reused);
        }
        let (drained, census) = local
            .cell
            .front
            .with(|f| (f.drain_held_large(), f.census()));
        local.census = census;
        (drained, reused)
    })
    .unwrap_or_default()
}

/// The fronts of another shard of the device keyed `device` than `visited` in which the
/// calling thread holds blocks over `FRONT_MAX_BLOCK`, if any: such a block waits for its
/// thread's next visit to its shard, and a visit to another shard returns it first
/// (`DeviceAllocator::return_large_held_elsewhere`). Reads only the thread's own census.
pub fn holding_large_elsewhere(device: u64, visited: &Fronts) -> Option<Arc<Fronts>> {
    LOCALS_OF_THREAD
        .try_with(|locals| {
            let locals = locals.try_borrow().ok()?;
            locals
                .iter()
                .find(|l| {
                    l.device == device
                        && l.census.held_large > 0
                        && !std::ptr::eq(&*l.fronts, visited)
                })
                .map(|l| l.fronts.clone())
        })
        .ok()
        .flatten()
}

/// The fast free, in this thread's fronts for the device keyed `device` that have blocks
/// out (a block is out in one front at most): `Held` when a front had `ptr` out (now
/// held), `AlreadyFree` when it held it already, `NotHere` when none had it.
pub fn give_back(device: u64, ptr: DevicePtr) -> GiveBack {
    LOCALS_OF_THREAD
        .try_with(|locals| {
            let Ok(mut locals) = locals.try_borrow_mut() else {
                return GiveBack::NotHere;
            };
            for local in locals.iter_mut() {
                if local.device != device || local.census.out == 0 {
                    continue;
                }
                let fronts = &local.fronts;
                let ((found, large), census) = local.cell.front.with(|f| {
                    if !fronts.open.load(Ordering::Relaxed) {
                        return ((GiveBack::NotHere, false), f.census());
                    }
                    (f.give_back(ptr), f.census())
                });
                local.census = census;
                if found == GiveBack::Held && large {
                    // Without the front this free would have reached the shard: the small
                    // blocks' pause, counted in such frees, counts it (see `with_adopter`).
                    local.gate.may_set_aside(
                        ADOPTIONS_PER_REVIEW,
                        ADOPTIONS_PER_REUSE,
                        ADOPTION_PAUSE,
                    );
                }
                if found != GiveBack::NotHere {
                    return found;
                }
            }
            GiveBack::NotHere
        })
        .unwrap_or(GiveBack::NotHere)
}

/// Runs a slow free (`f`) with the calling thread's front among `fronts` (the block's
/// shard's) as the adopter of its block, made on first use; `None` while the fronts are
/// closed, while adoption is paused (blocks were rarely reused), or when the thread can
/// have none (exiting, or a re-entrant call); also `None` when the block `fits` no front
/// (`Shard::fits_front`), a free that still counts in the gates. `large`: the block is over
/// `FRONT_MAX_BLOCK` (its adoptions are judged apart). `f` returns the front's census when
/// it adopted. The shard calls it under its lock, once it has found the block there, so
/// that a thread gets fronts only in shards it frees into (registering one takes the
/// registry: lock order shard, then registry).
#[inline]
pub fn with_adopter<R>(
    fronts: &Arc<Fronts>,
    large: bool,
    fits: bool,
    f: impl FnOnce(Option<&FrontCell>) -> (R, Option<Census>),
) -> R {
    if !fronts.open.load(Ordering::Relaxed) {
        return f(None).0;
    }
    // The common slow free in a job whose blocks do not fit fronts: it would register no
    // front and move no gate, so the list of `Local`s need not be looked at.
    if !fits && IDLE_ADOPTER.get() == fronts.id {
        return f(None).0;
    }
    with_local_adopter(fronts, large, fits, f)
}

/// `with_adopter` through the calling thread's `Local` for `fronts`.
#[inline(never)]
fn with_local_adopter<R>(
    fronts: &Arc<Fronts>,
    large: bool,
    fits: bool,
    f: impl FnOnce(Option<&FrontCell>) -> (R, Option<Census>),
) -> R {
    let mut f = Some(f);
    let done = LOCALS_OF_THREAD.try_with(|locals| {
        let mut locals = locals.try_borrow_mut().ok()?;
        let i = match locals.iter().position(|l| Arc::ptr_eq(&l.fronts, fronts)) {
            Some(i) => i,
            None => {
                // The one named idle may be dropped here, or none registered: named again
                // below once this free is done.
                IDLE_ADOPTER.set(0);
                if locals.len() == LOCALS {
                    locals.remove(0);
                }
                // A poisoned registry gives no front: the free goes to the shard, which
                // reports the poisoning wherever it needs the registry.
                let cell = fronts.register().ok()?;
                locals.push(Local {
                    device: fronts.device,
                    fronts: fronts.clone(),
                    cell,
                    census: Census::default(),
                    large_reused: 0,
                    gate: ReuseGate::default(),
                    gate_large: ReuseGate::default(),
                });
                locals.len() - 1
            }
        };
        let Local {
            cell,
            census: known,
            gate,
            gate_large,
            ..
        } = &mut locals[i];
        // Every slow free steps the small blocks' gate (its pause is counted in frees),
        // a large one's too; a large block is then judged by its own.
        let small_may_adopt =
            gate.may_set_aside(ADOPTIONS_PER_REVIEW, ADOPTIONS_PER_REUSE, ADOPTION_PAUSE);
        let may_adopt = match large {
            false => small_may_adopt,
            true => {
                gate_large.may_set_aside(ADOPTIONS_PER_REVIEW, ADOPTIONS_PER_REUSE, ADOPTION_PAUSE)
            }
        };
        let gate_used = if large { &mut *gate_large } else { &mut *gate };
        let run = f.take()?;
        let (result, census) = run((may_adopt && fits).then_some(&**cell));
        if let Some(census) = census {
            *known = census;
            gate_used.note_set_aside();
        }
        let idle = gate.is_idle(ADOPTIONS_PER_REVIEW) && gate_large.is_idle(ADOPTIONS_PER_REVIEW);
        IDLE_ADOPTER.set(if idle { fronts.id } else { 0 });
        Some(result)
    });
    match (done, f) {
        (Ok(Some(result)), _) => result,
        (_, Some(run)) => run(None).0,
        (_, None) => unreachable!("the free ran but gave no result"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The census by looking at every slot.
    fn recount(f: &Front) -> Census {
        let held = f.slots.iter().flatten().filter(|e| e.held).count() as u32;
        Census {
            held,
            out: f.slots.iter().flatten().count() as u32 - held,
            held_large: f
                .slots
                .iter()
                .flatten()
                .filter(|e| e.held && e.is_large())
                .count() as u32,
        }
    }

    #[test]
    fn the_census_and_counts_match_the_slots_through_every_change() {
        let mut f = Front::default();
        let mut seed = 3u64;
        for step in 0..20_000u64 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let ptr = 512 * ((seed >> 33) % 16 + 1);
            // What a request for the block at `ptr` asks (a large block's, over
            // `FRONT_MAX_BLOCK`).
            let requested = 100 + ptr + ptr.is_multiple_of(3) as u64 * FRONT_MAX_BLOCK;
            let stream = StreamId((seed >> 20) % 2);
            match (seed >> 40) % 5 {
                0 if f.slots.iter().flatten().all(|e| e.ptr != ptr) => {
                    // Every third pointer is a large block; there are more pointers of
                    // each kind than slots, so held and out entries are evicted too.
                    let (size, pool) = match ptr % 3 {
                        0 => (FRONT_MAX_BLOCK * 2, PoolKind::Large),
                        _ => (512, PoolKind::Small),
                    };
                    let e = Entry::new(ptr, size, requested, stream, pool, 0);
                    let _ = f.adopt(e);
                }
                1 => {
                    let _ = f.take(requested, stream);
                }
                2 => {
                    let _ = f.give_back(ptr);
                }
                3 => {
                    let _ = f.detach(ptr);
                }
                _ if step % 7 == 0 => {
                    let _ = f.drain_held();
                }
                _ if step % 3 == 0 => {
                    let large = f.drain_held_large();
                    assert!(large.iter().all(|e| e.held && e.is_large()));
                    assert_eq!(f.census().held_large, 0);
                }
                _ => {}
            }
            assert_eq!(f.census(), recount(&f), "step {step}");
            assert_counts_weigh_the_held_entries(&f, step);
        }
    }

    /// What a front's counts must show whatever it did: each pool's current change is minus
    /// what its held entries weigh (an entry out, or gone out by a detach or an eviction,
    /// weighs nothing), and equals what was handed out less what was taken back.
    fn assert_counts_weigh_the_held_entries(f: &Front, step: u64) {
        let c = f.counts();
        for pool in [PoolKind::Small, PoolKind::Large] {
            let p = pool as usize;
            let mut held = FrontMoved::default();
            for e in f
                .slots
                .iter()
                .flatten()
                .filter(|e| e.held && e.pool == pool)
            {
                held += e.amounts();
            }
            let mut minus_held = FrontMoved::default();
            minus_held -= held;
            assert_eq!(c.current[p], minus_held, "step {step}, {pool:?}");
            let mut net = c.handed[p];
            net -= c.returned[p];
            assert_eq!(c.current[p], net, "step {step}, {pool:?}");
        }
    }

    #[test]
    fn a_front_with_every_slot_out_gives_way_to_the_block_freed_longest_ago() {
        let s = StreamId(0);
        for (size, pool, slots) in [
            (4096, PoolKind::Small, FRONT_SLOTS),
            (4 * FRONT_MAX_BLOCK, PoolKind::Large, FRONT_LARGE_SLOTS),
        ] {
            let mut f = Front::default();
            let entry = |i: u64| {
                Entry::new(
                    i << 30,
                    size + i * 512,
                    size + i * 512,
                    s,
                    pool,
                    i as BlockId,
                )
            };
            for i in 0..slots as u64 {
                assert!(matches!(f.adopt(entry(i)), Evicted::None));
            }
            // All handed out again; entry 0 was freed longest ago.
            for i in (0..slots as u64).rev() {
                assert_eq!(
                    f.take(size + i * 512, s),
                    Some((i << 30, pool == PoolKind::Large))
                );
            }
            let counts = *f.counts();
            match f.adopt(entry(99)) {
                Evicted::Out(old) => assert_eq!(old.ptr, 0, "the one freed longest ago"),
                other => panic!("{other:?}"),
            }
            assert_eq!(f.census(), recount(&f));
            let large = (pool == PoolKind::Large) as u32;
            assert_eq!(
                f.census(),
                Census {
                    held: 1,
                    out: slots as u32 - 1,
                    held_large: large
                }
            );
            // The block that gave way stays counted as handed out (the shard's now); the
            // adopted one is taken back.
            let mut after = counts;
            after.take_back(&entry(99));
            assert_eq!(format!("{:?}", f.counts()), format!("{after:?}"));
            assert_eq!(f.give_back(0), (GiveBack::NotHere, false));
            assert_eq!(
                f.take(size + 99 * 512, s),
                Some((99 << 30, pool == PoolKind::Large))
            );
        }
    }

    /// The small blocks' adoption pause is counted in frees that reach the shard; a large
    /// block's free that the front serves instead counts as one (it would have reached the
    /// shard without the front), so that the pause ends where it did without it.
    #[test]
    fn a_large_free_the_front_serves_counts_in_the_small_blocks_pause() {
        std::thread::spawn(|| {
            let key = new_key();
            let fronts = Arc::new(Fronts::new(key, true, Arc::default()));
            let s = StreamId(0);
            let large = 2 * FRONT_MAX_BLOCK;
            let adopt = |ptr: DevicePtr, size: u64| {
                with_adopter(&fronts, size > FRONT_MAX_BLOCK, true, |cell| {
                    let pool = match size > FRONT_MAX_BLOCK {
                        true => PoolKind::Large,
                        false => PoolKind::Small,
                    };
                    let entry = Entry::new(ptr, size, size, s, pool, 0);
                    match cell.and_then(|cell| cell.adopt(&fronts, entry)) {
                        Some((_, census)) => (true, Some(census)),
                        None => (false, None),
                    }
                })
            };
            assert!(adopt(1 << 40, large));
            // Small blocks never reused: the review after a full period pauses adoption.
            for i in 1..=ADOPTIONS_PER_REVIEW {
                assert!(adopt(i << 20, 4096), "adoption {i}");
            }
            assert!(!adopt(1 << 30, 4096));
            for _ in 0..ADOPTION_PAUSE {
                let p = take(FrontOf::Shard(&fronts), large, s).expect("held");
                assert_eq!(give_back(key, p), GiveBack::Held);
            }
            assert!(adopt(1 << 30, 4096), "the pause is over");
        })
        .join()
        .unwrap();
    }
}
