//! Memory statistics with `torch.cuda.memory_stats()`'s names and meanings.

use super::sizing::PoolKind;
use crate::error::Result;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// One counter: its current value, high-water mark, and the totals ever added and removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

std::thread_local! {
    /// Whether a counter's peak rose on this thread since `take_lifted` last looked. With
    /// several shards a shard's peaks are its ceilings (`PeakBook`), and a rise means the
    /// device's peaks must be settled (`DeviceAllocator::settle_lifts`).
    static LIFTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Notes that a peak rose on this thread.
#[inline]
fn note_lift() {
    let _ = LIFTED.try_with(|l| l.set(true));
}

/// Whether a peak rose on this thread since the last call (and forgets it).
#[inline]
pub(crate) fn take_lifted() -> bool {
    LIFTED.try_with(|l| l.replace(false)).unwrap_or(false)
}

impl Stat {
    pub fn increase(&mut self, amount: u64) {
        let amount = amount as i64;
        self.current += amount;
        self.allocated += amount;
        if self.current > self.peak {
            self.peak = self.current;
            note_lift();
        }
    }

    pub fn decrease(&mut self, amount: u64) {
        let amount = amount as i64;
        self.current -= amount;
        self.freed += amount;
    }

    /// Adds a signed change (used for net changes in inactive splits).
    pub fn adjust(&mut self, delta: i64) {
        if delta >= 0 {
            self.increase(delta as u64);
        } else {
            self.decrease(delta.unsigned_abs());
        }
    }

    fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// Another shard's counter added in. Peaks add too: with one shard in use that is its
    /// peak; with several, the sum of their ceilings, which `DeviceAllocator::stats`
    /// replaces with the device's peaks.
    fn add(&mut self, other: &Stat) {
        self.current += other.current;
        self.peak += other.peak;
        self.allocated += other.allocated;
        self.freed += other.freed;
    }
}

/// A stat kept for all blocks and for each pool: index 0 = all, 1 = small pool, 2 = large pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray(pub [Stat; 3]);

pub const STAT_TYPE_NAMES: [&str; 3] = ["all", "small_pool", "large_pool"];

impl StatArray {
    pub fn increase(&mut self, pool: PoolKind, amount: u64) {
        self.0[0].increase(amount);
        self.0[1 + pool as usize].increase(amount);
    }

    pub fn decrease(&mut self, pool: PoolKind, amount: u64) {
        self.0[0].decrease(amount);
        self.0[1 + pool as usize].decrease(amount);
    }

    pub fn adjust(&mut self, pool: PoolKind, delta: i64) {
        self.0[0].adjust(delta);
        self.0[1 + pool as usize].adjust(delta);
    }

    pub fn all(&self) -> Stat {
        self.0[0]
    }

    fn for_each(&mut self, f: impl Fn(&mut Stat)) {
        self.0.iter_mut().for_each(f);
    }

    fn add(&mut self, other: &StatArray) {
        self.0.iter_mut().zip(&other.0).for_each(|(s, o)| s.add(o));
    }
}

/// Reserved bytes of a whole device, every shard's, with their peaks (all, small, large as in
/// `StatArray`). Shards change it only when they map or release memory (the slow path), so
/// it can be shared: the memory limit holds for the device, and the reserved peaks stay
/// exact with several shards. (The memory limit counts memory taken from the driver, mapped
/// or not: `driver::layers::limit`.)
#[derive(Debug, Default)]
pub struct DeviceReserved {
    /// Reserved bytes (all, small, large: current, peak and totals) of every shard. Changed
    /// only where memory is mapped or released, under this lock, so that a read sees one
    /// moment: all = small + large and allocated - freed = current, whatever the shards do.
    bytes: Mutex<StatArray>,
    /// All reserved bytes now, as the counters last said: read without their lock, by a
    /// check that may be a moment late (`DeviceAllocator`'s peak breakdown).
    all_now: AtomicU64,
}

impl DeviceReserved {
    /// The counters; a panic while they were held is the `sync::poisoned` error.
    fn bytes(&self) -> Result<MutexGuard<'_, StatArray>> {
        crate::sync::lock(&self.bytes, "the device's reserved-byte counters")
    }

    /// Counts memory a shard just mapped or took from the driver. No way to report: the
    /// memory is the shard's already. With the counters poisoned it changes nothing; every
    /// later read of them (statistics, the OOM path, garbage collection) reports the
    /// poisoning.
    pub fn increase(&self, pool: PoolKind, bytes: u64) {
        if let Ok(mut counts) = self.bytes() {
            counts.increase(pool, bytes);
            self.all_now
                .store(counts.all().current as u64, Ordering::Relaxed);
        }
    }

    /// All reserved bytes, without taking the counters' lock: exact when no shard is
    /// changing them, a moment late otherwise.
    pub fn all_hint(&self) -> u64 {
        self.all_now.load(Ordering::Relaxed)
    }

    /// Counts memory a shard just released (as `increase`, nothing with the counters
    /// poisoned).
    pub fn decrease(&self, pool: PoolKind, bytes: u64) {
        if let Ok(mut counts) = self.bytes() {
            counts.decrease(pool, bytes);
            self.all_now
                .store(counts.all().current as u64, Ordering::Relaxed);
        }
    }

    pub fn all(&self) -> Result<u64> {
        Ok(self.bytes()?.all().current as u64)
    }

    /// The device's reserved bytes, all read at one moment.
    pub fn read(&self) -> Result<StatArray> {
        Ok(*self.bytes()?)
    }

    pub fn reset_peaks(&self) -> Result<()> {
        self.bytes()?.for_each(Stat::reset_peak);
        Ok(())
    }

    pub fn reset_accumulated(&self) -> Result<()> {
        self.bytes()?.for_each(Stat::reset_accumulated);
        Ok(())
    }

    /// Runs `f` with the counters locked (tests: a panic in `f` poisons them).
    #[cfg(test)]
    pub fn hold_while(&self, f: impl FnOnce()) {
        let _held = self.bytes.lock();
        f();
    }
}

/// `reserved_bytes`' place in `ARRAY_NAMES`.
const RESERVED_BYTES: usize = 5;

/// How many counters have a peak the device keeps with several shards: every per-pool
/// counter but reserved bytes (8 x 3), and the two oversize counters.
pub const PEAKED: usize = 8 * 3 + 2;

/// One value per peaked counter (`DeviceStats::peaked`'s order).
pub type Peaks = [i64; PEAKED];

/// The PyTorch names of the per-pool counters (`DeviceStats` and the C `ccalloc_stats` list
/// them in this order).
pub const ARRAY_NAMES: [&str; 9] = [
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
];

/// The per-pool counters of `$stats` (a `DeviceStats`, or the C `ccalloc_stats`, whose
/// fields are named alike), each borrowed with `$borrow` (`&` or `&mut`), in `ARRAY_NAMES`'
/// order: the one list of those fields.
macro_rules! per_pool_arrays {
    ($stats:expr, $($borrow:tt)+) => {
        [
            $($borrow)+ $stats.allocation,
            $($borrow)+ $stats.segment,
            $($borrow)+ $stats.active,
            $($borrow)+ $stats.inactive_split,
            $($borrow)+ $stats.allocated_bytes,
            $($borrow)+ $stats.reserved_bytes,
            $($borrow)+ $stats.active_bytes,
            $($borrow)+ $stats.inactive_split_bytes,
            $($borrow)+ $stats.requested_bytes,
        ]
    };
}
pub(crate) use per_pool_arrays;

/// Everything PyTorch's `memory_stats()` reports for one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Blocks handed to callers and not yet freed.
    pub allocation: StatArray,
    /// Device allocations (segments) held.
    pub segment: StatArray,
    /// Blocks in use: allocated, or freed but awaiting other streams' events.
    pub active: StatArray,
    /// Free blocks that are pieces of a split segment.
    pub inactive_split: StatArray,
    pub allocated_bytes: StatArray,
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    /// Bytes callers asked for, before rounding.
    pub requested_bytes: StatArray,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    pub num_sync_all_streams: u64,
    pub num_device_alloc: u64,
    pub num_device_free: u64,
    /// Allocations and segments of at least `max_split_size`.
    pub oversize_allocations: Stat,
    pub oversize_segments: Stat,
    /// What keeping reserved ≈ live costs (paged segments only; not PyTorch's).
    pub paging: PagingCounters,
}

/// A change to each statistic a thread front moves when it hands out or takes back a block
/// (`front::FrontCounts` keeps one per pool and kind of count).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrontMoved {
    pub allocation: i64,
    pub allocated_bytes: i64,
    pub active: i64,
    pub active_bytes: i64,
    pub requested_bytes: i64,
}

impl std::ops::AddAssign for FrontMoved {
    fn add_assign(&mut self, o: Self) {
        self.allocation += o.allocation;
        self.allocated_bytes += o.allocated_bytes;
        self.active += o.active;
        self.active_bytes += o.active_bytes;
        self.requested_bytes += o.requested_bytes;
    }
}

impl std::ops::SubAssign for FrontMoved {
    fn sub_assign(&mut self, o: Self) {
        self.allocation -= o.allocation;
        self.allocated_bytes -= o.allocated_bytes;
        self.active -= o.active;
        self.active_bytes -= o.active_bytes;
        self.requested_bytes -= o.requested_bytes;
    }
}

/// The peaks of the statistics fronts move (`DeviceStats::front_peaks`).
#[derive(Clone, Copy, Debug)]
pub struct FrontPeaks([[i64; 3]; 5]);

/// Growth of paged segments, counted since the start (or `reset_accumulated`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PagingCounters {
    /// Requests that had to map pages.
    pub growths: u64,
    /// Of those, the ones that moved chunks from under free blocks.
    pub moving_growths: u64,
    pub chunks_mapped: u64,
    pub chunks_unmapped: u64,
    /// Host waits for the device: on a fence before moving pages, or a synchronize.
    pub host_waits: u64,
    /// Wall time spent in growth (gathering, waiting, mapping), and in growth that moved.
    pub growth_ns: u64,
    pub moving_ns: u64,
    /// Of the growth time, the host's waits for the device (`host_waits`).
    pub wait_ns: u64,
    /// Free blocks and chunks that searches for chunks to unmap visited: the work of
    /// reclaiming, which grows with what changed since the last search, not with the
    /// number of streams.
    pub reclaim_steps: u64,
    /// Chunks taken from the device's other shards' idle memory (`shard::lending`).
    pub chunks_borrowed: u64,
    /// Growths refused page moves because moves had spent their share of the time
    /// (`page_move_budget`, `MoveClock`), or, in a job that keeps its device busy, had
    /// spent it and the allowance was not full again: each mapped new memory instead, past
    /// the slack where it needed more than the slack held.
    pub growths_past_slack: u64,
}

impl PagingCounters {
    /// What was counted between `earlier` (a read of the same counters) and these.
    pub fn since(&self, earlier: &PagingCounters) -> PagingCounters {
        PagingCounters {
            growths: self.growths.saturating_sub(earlier.growths),
            moving_growths: self.moving_growths.saturating_sub(earlier.moving_growths),
            chunks_mapped: self.chunks_mapped.saturating_sub(earlier.chunks_mapped),
            chunks_unmapped: self.chunks_unmapped.saturating_sub(earlier.chunks_unmapped),
            host_waits: self.host_waits.saturating_sub(earlier.host_waits),
            growth_ns: self.growth_ns.saturating_sub(earlier.growth_ns),
            moving_ns: self.moving_ns.saturating_sub(earlier.moving_ns),
            wait_ns: self.wait_ns.saturating_sub(earlier.wait_ns),
            reclaim_steps: self.reclaim_steps.saturating_sub(earlier.reclaim_steps),
            chunks_borrowed: self.chunks_borrowed.saturating_sub(earlier.chunks_borrowed),
            growths_past_slack: self
                .growths_past_slack
                .saturating_sub(earlier.growths_past_slack),
        }
    }

    fn add(&mut self, o: &PagingCounters) {
        self.growths += o.growths;
        self.moving_growths += o.moving_growths;
        self.chunks_mapped += o.chunks_mapped;
        self.chunks_unmapped += o.chunks_unmapped;
        self.host_waits += o.host_waits;
        self.growth_ns += o.growth_ns;
        self.moving_ns += o.moving_ns;
        self.wait_ns += o.wait_ns;
        self.reclaim_steps += o.reclaim_steps;
        self.chunks_borrowed += o.chunks_borrowed;
        self.growths_past_slack += o.growths_past_slack;
    }
}

pub use crate::sync::LockCounters;

impl DeviceStats {
    /// Another shard's statistics added in (`DeviceAllocator::stats`).
    pub fn add(&mut self, o: &DeviceStats) {
        self.allocation.add(&o.allocation);
        self.segment.add(&o.segment);
        self.active.add(&o.active);
        self.inactive_split.add(&o.inactive_split);
        self.allocated_bytes.add(&o.allocated_bytes);
        self.reserved_bytes.add(&o.reserved_bytes);
        self.active_bytes.add(&o.active_bytes);
        self.inactive_split_bytes.add(&o.inactive_split_bytes);
        self.requested_bytes.add(&o.requested_bytes);
        self.num_alloc_retries += o.num_alloc_retries;
        self.num_ooms += o.num_ooms;
        self.num_sync_all_streams += o.num_sync_all_streams;
        self.num_device_alloc += o.num_device_alloc;
        self.num_device_free += o.num_device_free;
        self.oversize_allocations.add(&o.oversize_allocations);
        self.oversize_segments.add(&o.oversize_segments);
        self.paging.add(&o.paging);
    }

    /// Every per-pool counter with its PyTorch name (`ARRAY_NAMES`' order).
    pub fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        let arrays = per_pool_arrays!(self, &);
        std::array::from_fn(|i| (ARRAY_NAMES[i], arrays[i]))
    }

    /// The counters whose peaks the device keeps with several shards (`PeakBook`): every
    /// one with a peak but reserved bytes, which are counted device-wide already.
    fn peaked(&self) -> impl Iterator<Item = &Stat> {
        let arrays = per_pool_arrays!(self, &);
        arrays
            .into_iter()
            .enumerate()
            .filter(|&(i, _)| i != RESERVED_BYTES)
            .flat_map(|(_, array)| array.0.iter())
            .chain([&self.oversize_allocations, &self.oversize_segments])
    }

    fn peaked_mut(&mut self) -> impl Iterator<Item = &mut Stat> {
        let arrays = per_pool_arrays!(self, &mut);
        arrays
            .into_iter()
            .enumerate()
            .filter(|&(i, _)| i != RESERVED_BYTES)
            .flat_map(|(_, array)| array.0.iter_mut())
            .chain([&mut self.oversize_allocations, &mut self.oversize_segments])
    }

    /// Adds this shard's current values of the peaked counters to `sum`.
    pub fn add_peaked_currents(&self, sum: &mut Peaks) {
        sum.iter_mut()
            .zip(self.peaked())
            .for_each(|(s, stat)| *s += stat.current);
    }

    /// The peaks of the peaked counters.
    pub fn peaked_peaks(&self) -> Peaks {
        let mut peaks = [0; PEAKED];
        peaks
            .iter_mut()
            .zip(self.peaked())
            .for_each(|(p, stat)| *p = stat.peak);
        peaks
    }

    /// The current values of the peaked counters.
    pub fn peaked_currents(&self) -> Peaks {
        let mut currents = [0; PEAKED];
        self.add_peaked_currents(&mut currents);
        currents
    }

    /// Sets the peaked counters' peaks (a shard's ceilings) to `assigned`, except where a
    /// peak stands above `before`, the assignment it was given: a lift not settled yet,
    /// which keeps its ceiling until it is.
    pub fn assign_ceilings(&mut self, before: &Peaks, assigned: &Peaks) {
        self.peaked_mut()
            .zip(before.iter().zip(assigned))
            .filter(|(stat, (&b, _))| stat.peak <= b)
            .for_each(|(stat, (_, &a))| stat.peak = a);
    }

    /// Sets the peaked counters' peaks to each current value plus `headroom` (a shard's
    /// ceilings: it may rise that far without the device settling its peaks).
    pub fn set_ceilings(&mut self, headroom: &Peaks) {
        self.peaked_mut()
            .zip(headroom)
            .for_each(|(stat, &h)| stat.peak = stat.current + h);
    }

    /// Takes the device's peaks (`peaks`) for the peaked counters, each at least its current
    /// value (a rise not yet settled).
    pub fn set_device_peaks(&mut self, peaks: &Peaks) {
        self.peaked_mut()
            .zip(peaks)
            .for_each(|(stat, &p)| stat.peak = p.max(stat.current));
    }

    /// The statistics a thread front moves, in the order of `FrontPeaks`.
    fn front_moved(&self) -> [&StatArray; 5] {
        [
            &self.allocation,
            &self.allocated_bytes,
            &self.active,
            &self.active_bytes,
            &self.requested_bytes,
        ]
    }

    fn front_moved_mut(&mut self) -> [&mut StatArray; 5] {
        [
            &mut self.allocation,
            &mut self.allocated_bytes,
            &mut self.active,
            &mut self.active_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// Adds a thread front's counts for `pool`: the totals it handed out and took back, and
    /// with `current` its net change of the current values.
    pub fn add_front_counts(
        &mut self,
        pool: PoolKind,
        current: Option<&FrontMoved>,
        handed: &FrontMoved,
        returned: &FrontMoved,
    ) {
        let by_name = [
            (
                &mut self.allocation,
                current.map(|c| c.allocation),
                handed.allocation,
                returned.allocation,
            ),
            (
                &mut self.allocated_bytes,
                current.map(|c| c.allocated_bytes),
                handed.allocated_bytes,
                returned.allocated_bytes,
            ),
            (
                &mut self.active,
                current.map(|c| c.active),
                handed.active,
                returned.active,
            ),
            (
                &mut self.active_bytes,
                current.map(|c| c.active_bytes),
                handed.active_bytes,
                returned.active_bytes,
            ),
            (
                &mut self.requested_bytes,
                current.map(|c| c.requested_bytes),
                handed.requested_bytes,
                returned.requested_bytes,
            ),
        ];
        for (array, current, handed, returned) in by_name {
            for index in [0, 1 + pool as usize] {
                let stat = &mut array.0[index];
                if let Some(current) = current {
                    stat.current += current;
                }
                stat.allocated += handed;
                stat.freed += returned;
            }
        }
    }

    /// The peaks of the statistics that thread fronts move, to compare with after a
    /// hand-out (`front_peaks_passed`).
    pub fn front_peaks(&self) -> FrontPeaks {
        FrontPeaks(
            self.front_moved()
                .map(|array| array.0.map(|stat| stat.peak)),
        )
    }

    /// Whether any of those statistics now stands above its peak in `before`.
    pub fn front_peaks_passed(&self, before: &FrontPeaks) -> bool {
        self.front_moved()
            .iter()
            .zip(&before.0)
            .any(|(array, peaks)| array.0.iter().zip(peaks).any(|(s, &p)| s.current > p))
    }

    /// Sets those peaks to the larger of `before` and the current value (after the fronts'
    /// held blocks were taken back: the true high-water mark).
    pub fn settle_front_peaks(&mut self, before: &FrontPeaks) {
        for (array, peaks) in self.front_moved_mut().into_iter().zip(&before.0) {
            for (stat, &peak) in array.0.iter_mut().zip(peaks) {
                if stat.current > peak {
                    note_lift();
                }
                stat.peak = peak.max(stat.current);
            }
        }
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        per_pool_arrays!(self, &mut)
    }

    /// Zeroes every `allocated`/`freed` total and the event counters, as PyTorch does.
    pub fn reset_accumulated(&mut self) {
        for array in self.arrays_mut() {
            array.for_each(Stat::reset_accumulated);
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.paging = PagingCounters::default();
    }

    /// Sets every peak to its current value.
    pub fn reset_peak(&mut self) {
        for array in self.arrays_mut() {
            array.for_each(Stat::reset_peak);
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// The flat `name.type.metric` → value pairs of `torch.cuda.memory_stats()`.
    pub fn flat(&self) -> Vec<(String, i64)> {
        let mut out = Vec::with_capacity(128);
        for (name, array) in self.arrays() {
            for (type_name, stat) in STAT_TYPE_NAMES.iter().zip(array.0.iter()) {
                push_stat(&mut out, &format!("{name}.{type_name}"), stat);
            }
        }
        push_stat(&mut out, "oversize_allocations", &self.oversize_allocations);
        push_stat(&mut out, "oversize_segments", &self.oversize_segments);
        for (name, value) in [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_sync_all_streams", self.num_sync_all_streams),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
        ] {
            out.push((name.to_string(), value as i64));
        }
        out.sort();
        out
    }
}

fn push_stat(out: &mut Vec<(String, i64)>, prefix: &str, stat: &Stat) {
    out.push((format!("{prefix}.current"), stat.current));
    out.push((format!("{prefix}.peak"), stat.peak));
    out.push((format!("{prefix}.allocated"), stat.allocated));
    out.push((format!("{prefix}.freed"), stat.freed));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.increase(10);
        s.decrease(4);
        s.adjust(-2);
        s.adjust(3);
        assert_eq!(
            s,
            Stat {
                current: 7,
                peak: 10,
                allocated: 13,
                freed: 6
            }
        );
        s.reset_peak();
        s.reset_accumulated();
        assert_eq!(
            s,
            Stat {
                current: 7,
                peak: 7,
                allocated: 0,
                freed: 0
            }
        );
    }

    #[test]
    fn flat_keys_follow_pytorch_naming() {
        let mut stats = DeviceStats::default();
        stats.allocated_bytes.increase(PoolKind::Large, 4096);
        let flat: std::collections::HashMap<_, _> = stats.flat().into_iter().collect();
        assert_eq!(flat["allocated_bytes.all.current"], 4096);
        assert_eq!(flat["allocated_bytes.large_pool.peak"], 4096);
        assert_eq!(flat["allocated_bytes.small_pool.current"], 0);
        assert!(flat.contains_key("num_device_free"));
        assert!(flat.contains_key("oversize_segments.peak"));
        assert_eq!(flat.len(), 9 * 3 * 4 + 2 * 4 + 5);
    }
}
