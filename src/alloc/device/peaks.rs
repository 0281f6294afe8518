//! Exact peaks with several shards: the device's peak book, and how a shard's lift of its
//! ceilings is settled.
//
// A device's peak is the high-water mark of the sum of its shards' counts. Updating one
// device-wide count on every call would make every stream's thread write the same line,
// which is what shards avoid. Instead, once a device has several shards, a shard's peak
// fields are its *ceilings*: the device's peak P (kept in `PeakBook`) is split so that the
// ceilings sum to at most P, and a shard whose counts stay under its ceilings cannot have
// lifted the device past P. The rest of the headroom below P is assigned to no shard: the
// book keeps it, in atomics (`Unassigned`). A call that lifts a ceiling
// (`stats::take_lifted`) settles once its shard's lock is released: the unassigned headroom
// covers the lift if it can, taken with only the lifter's own lock held
// (`settle_from_unassigned`); else the other shards give unused headroom to the unassigned
// headroom, one locked at a time and still without the book (`pool_spare_headroom`), and
// the lifter tries again; else, with the book locked (`settle`), the others give up what
// they have left. Either way the lifter keeps some more (a share of the unassigned
// headroom, or half of what the last giver had left), so that its next increase does not
// lift again. A lift that no headroom covers may be a new high: then every
// shard is locked at once (`balance_peaks`), their counts are summed, P rises to the sum if
// it is higher, and the headroom left is split: half shared equally, half kept unassigned.
// Blocks held in thread fronts count as live in their shard, so before P rises the fronts
// are drained and the sum taken again: P is then the true high-water mark. Lock order:
// the book, then shards; no path takes the book while holding a shard.
//
// The unassigned headroom changes under a shard's lock (a lift takes from it, a giver adds
// to it) and is set anew only with every shard locked (a balance, a reset), so no take
// straddles a new split. A shard's copy of its assignment (`State::set_book_assigned`) is
// the true one: takes and gifts change it without the book, whose `assigned` is then stale.
// Every book path reads a shard's copy under that shard's lock before using it, so the
// ceilings and the unassigned headroom still sum to at most P.
//
// The cost falls on calls that lift a ceiling: in a steady job, those that take the device
// to a new high, and those of a shard whose headroom ran out (threads churning on their
// own streams each settle when their counts wander past their share). Only the first need
// the book: with 8 threads churning on their own streams, settlements through the book
// came every 150 steps or so before gifts, and the threads spent about a third of their
// time queued on it (docs/benchmarks.md, session 25).

use super::{DeviceAllocator, MAX_SHARDS};
use crate::alloc::state::State;
use crate::alloc::stats::{self, Peaks, PEAKED};
use crate::alloc::Shard;
use crate::error::Result;
use crate::sync::{lock, Guard};
use crate::DeviceStats;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Mutex;

/// The device's peaks with several shards (see above). Inactive with one shard, whose
/// peaks are the device's.
#[derive(Default)]
pub(super) struct PeakBook {
    /// Set when the second shard is made; never cleared.
    active: AtomicBool,
    inner: Mutex<Book>,
    unassigned: Unassigned,
}

/// Headroom below the device's peaks that no shard is assigned, per peaked counter: any
/// shard's lift may take it with no other lock than its own. Lifts come from every
/// thread's random walk; with the book's lock for each, 8 threads churning on their own
/// streams settled once every 61-115 steps, each settlement queueing on that one lock and
/// locking other shards to find the headroom their counts left (docs/benchmarks.md,
/// session 24). On lines of its own: every lift writes it.
#[repr(align(64))]
#[derive(Default)]
struct Unassigned([AtomicI64; PEAKED]);

impl Unassigned {
    /// Takes `need` of counter `q` and, if there is more, a `1/shares` share of the rest
    /// (the lifter's margin); returns what was taken, or `None` (nothing taken) if less
    /// than `need` is there.
    fn take(&self, q: usize, need: i64, shares: i64) -> Option<i64> {
        let counter = &self.0[q];
        let mut have = counter.load(Ordering::Acquire);
        loop {
            if have < need {
                return None;
            }
            let take = need + (have - need) / shares.max(1);
            match counter.compare_exchange_weak(
                have,
                have - take,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(take),
                Err(now) => have = now,
            }
        }
    }

    fn add(&self, q: usize, bytes: i64) {
        self.0[q].fetch_add(bytes, Ordering::AcqRel);
    }

    fn get(&self, q: usize) -> i64 {
        self.0[q].load(Ordering::Acquire)
    }

    /// Only with every shard locked (or none able to take: the book's activation).
    fn set(&self, values: &Peaks) {
        for (counter, &v) in self.0.iter().zip(values) {
            counter.store(v, Ordering::Release);
        }
    }
}

/// The device's peaks and the ceilings they are split into, per slot (at most each
/// shard's own copy: see above). A shard's own peak fields equal its ceilings, or stand
/// above them after a lift not yet settled.
struct Book {
    peaks: Peaks,
    assigned: [Peaks; MAX_SHARDS],
}

impl Default for Book {
    fn default() -> Self {
        Self {
            peaks: [0; PEAKED],
            assigned: [[0; PEAKED]; MAX_SHARDS],
        }
    }
}

impl PeakBook {
    /// Whether the device has several shards, whose peaks the book then keeps.
    #[inline]
    pub(super) fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }
}

impl DeviceAllocator {
    /// Settles the device's peaks if this thread's last calls into a shard lifted one of
    /// its ceilings (see `PeakBook`); `lifted`: the shard that did, if known (else every
    /// shard is looked at). Called with no shard locked. A failure (a lock poisoned, the
    /// device shut down) leaves the peaks to the next settling: the call that lifted them
    /// succeeded. Only the check is inline: every call of a one-shard device makes it.
    #[inline(always)]
    pub(super) fn settle_lifts(&self, lifted: Option<&Shard>) {
        // With one shard its peaks are the device's: the flag is left as it is (a stale one
        // costs one settling when a second shard comes).
        if self.peak_book.active.load(Ordering::Acquire) {
            self.settle_lifts_of_shards(lifted);
        }
    }

    /// `settle_lifts` once the device has several shards.
    #[inline(never)]
    fn settle_lifts_of_shards(&self, lifted: Option<&Shard>) {
        if !stats::take_lifted() {
            return;
        }
        // A lift another thread's settling took in meanwhile (`balance_peaks` gives every
        // shard its ceilings) needs nothing more: seen under the shard's own lock, without
        // the book. Most other lifts are covered by the unassigned headroom, under the same
        // lock, and most of the rest once other shards have given it theirs.
        if let Some(shard) = lifted {
            let mut need = None;
            let settled =
                |st: &mut State| !st.has_unsettled_lift() || self.settle_from_unassigned(st);
            if shard.lock().is_ok_and(|mut st| {
                settled(&mut st) || {
                    need = Some(st.unsettled_need());
                    false
                }
            }) {
                return;
            }
            if need.is_some_and(|need| self.pool_spare_headroom(shard, &need))
                && shard.lock().is_ok_and(|mut st| settled(&mut st))
            {
                return;
            }
        }
        if let Err(e) = self.settle(lifted) {
            tracing::debug!(device = self.device, "peaks not settled: {e}");
        }
    }

    /// Runs `f` with the peak book locked, as a settlement that needs it would find it.
    #[cfg(test)]
    pub(in crate::alloc) fn with_peak_book_held<R>(&self, f: impl FnOnce() -> R) -> R {
        let _book = self.peak_book.inner.lock();
        f()
    }

    /// Settles the lift of the shard whose state is `st` from the unassigned headroom alone:
    /// each lifted counter is settled at its new ceiling and given a margin (as `settle`
    /// gives). False, with nothing changed, where the headroom does not cover every lifted
    /// counter.
    fn settle_from_unassigned(&self, st: &mut State) -> bool {
        let unassigned = &self.peak_book.unassigned;
        let shares = self.shards.filled() as i64;
        let ceilings = st.stats().peaked_peaks();
        let before = st.book_assigned();
        let need = st.unsettled_need();
        let mut took = [0; PEAKED];
        for q in 0..PEAKED {
            if need[q] == 0 {
                continue;
            }
            match unassigned.take(q, need[q], shares) {
                Some(t) => took[q] = t,
                None => {
                    for (r, &t) in took.iter().enumerate().take(q) {
                        if t > 0 {
                            unassigned.add(r, t);
                        }
                    }
                    return false;
                }
            }
        }
        let (mut settled, mut assigned) = (before, before);
        for q in (0..PEAKED).filter(|&q| took[q] > 0) {
            settled[q] = ceilings[q];
            assigned[q] = before[q] + took[q];
        }
        st.set_book_assigned(settled);
        st.assign_ceilings(&settled, assigned);
        true
    }

    /// Moves other shards' unused headroom below their ceilings, in the counters `need`
    /// names, to the unassigned headroom, one shard locked at a time and never `lifter`,
    /// until the unassigned headroom holds `need`; true if it does. Each shard gives half
    /// of what its count left below its ceiling (its own count wanders too), or more where
    /// the need still wants it; shards busy for long (a driver call) are passed over.
    /// Without the book: each move lowers a ceiling by what the unassigned headroom gains,
    /// under that shard's lock, so their sum stays at most the peak. Only a new high of
    /// the device, which no headroom covers, is left for the book.
    #[cold]
    #[inline(never)]
    fn pool_spare_headroom(&self, lifter: &Shard, need: &Peaks) -> bool {
        let unassigned = &self.peak_book.unassigned;
        let wanting = |q: usize| need[q] - unassigned.get(q);
        for shard in self.shards().filter(|s| !std::ptr::eq(*s, lifter)) {
            if (0..PEAKED).all(|q| wanting(q) <= 0) {
                return true;
            }
            let Ok(Some(mut st)) = shard.lock_soon() else {
                continue;
            };
            let spare = st.spare_headroom();
            let before = st.book_assigned();
            let mut assigned = before;
            for q in 0..PEAKED {
                let wants = wanting(q);
                if wants <= 0 {
                    continue;
                }
                let give = spare[q].min((spare[q] / 2).max(wants));
                if give > 0 {
                    assigned[q] -= give;
                    unassigned.add(q, give);
                }
            }
            if assigned != before {
                st.assign_ceilings(&before, assigned);
            }
        }
        (0..PEAKED).all(|q| wanting(q) <= 0)
    }

    /// `settle_lifts`' work: the lifts are covered by other shards' unused headroom where
    /// they have it (one shard locked at a time), and only what is left needs every shard
    /// at once (`balance_peaks`).
    #[cold]
    #[inline(never)]
    fn settle(&self, lifted: Option<&Shard>) -> Result<()> {
        let mut took_highs = Vec::new();
        let settled = self.settle_noting_highs(lifted, &mut took_highs);
        for shard in took_highs {
            if let Ok(mut st) = shard.lock() {
                st.book_highs().done();
            }
        }
        settled
    }

    /// `settle`, which notes in `took_highs` the shards whose lifts it took into their
    /// assignments (`BookHighs`), for `settle` to release once they are backed.
    fn settle_noting_highs<'a>(
        &'a self,
        lifted: Option<&Shard>,
        took_highs: &mut Vec<&'a Shard>,
    ) -> Result<()> {
        let mut book = lock(&self.peak_book.inner, "the device's peaks")?;
        let shards: Vec<&Shard> = self.shards().collect();
        // What the lifts took past the ceilings the book gave: each lifted shard keeps its
        // new ceiling, so the others must give up as much.
        let mut need = [0; PEAKED];
        // Each lifted shard's new highs: its count reached them, though it may have fallen
        // since (a restore's carve counts its whole segment for a moment).
        let mut highs = vec![[0; PEAKED]; shards.len()];
        let mut gather = |only: Option<&Shard>, book: &mut Book, need: &mut Peaks| -> Result<()> {
            for (i, shard) in shards.iter().enumerate() {
                if only.is_some_and(|l| !std::ptr::eq(l, *shard)) {
                    continue;
                }
                let mut st = shard.lock()?;
                // The shard's copy is the true one (see above).
                book.assigned[i] = st.book_assigned();
                let ceilings = st.stats().peaked_peaks();
                for q in 0..PEAKED {
                    let (c, a) = (ceilings[q], &mut book.assigned[i][q]);
                    if c > *a {
                        need[q] += c - *a;
                        highs[i][q] = c;
                        *a = c;
                    }
                }
                if highs[i].iter().any(|&h| h > 0) {
                    st.book_highs().take(&highs[i]);
                    took_highs.push(*shard);
                }
                st.set_book_assigned(book.assigned[i]);
            }
            Ok(())
        };
        // Every path that can lift a shard other than the one it names settles with `None`
        // (`each_shard`, the OOM retry, `segments`...). Looking at every shard whenever the
        // named one shows no lift would do the same, but a lift settled meanwhile by
        // another thread's `balance_peaks` shows none either, and 8 churning threads then
        // each locked every shard after each such balance (mt8 154 -> 260 ns).
        gather(lifted, &mut book, &mut need)?;
        // The shard that lifted also gets more headroom where its need was met: at its new
        // ceiling exactly, its next increase would lift again. From the book's unassigned
        // headroom, a share as large as an equal split's; from a giver, half of what it has
        // left.
        let mut bonus = [0; PEAKED];
        let unassigned = &self.peak_book.unassigned;
        // (Without a lifter named, the margin would go to no one: `shares` takes none.)
        let shares = if lifted.is_some() {
            shards.len() as i64
        } else {
            i64::MAX
        };
        for q in 0..PEAKED {
            if need[q] > 0 {
                if let Some(took) = unassigned.take(q, need[q], shares) {
                    bonus[q] = took - need[q];
                    need[q] = 0;
                }
            }
        }
        for (j, shard) in shards.iter().enumerate() {
            if need.iter().all(|&n| n == 0) {
                break;
            }
            if lifted.is_some_and(|l| std::ptr::eq(l, *shard)) {
                continue;
            }
            // A giver busy for long (a driver call) is passed over: the book is held, and
            // every other lift would wait behind it.
            let Some(mut st) = shard.lock_soon()? else {
                continue;
            };
            // A shard whose own lift is not settled yet keeps its ceiling there, and one
            // whose lift a settlement took (this one included) gives none of it back.
            let spares = st.spare_headroom();
            book.assigned[j] = st.book_assigned();
            let before = book.assigned[j];
            let assigned = &mut book.assigned[j];
            for q in 0..PEAKED {
                if need[q] > 0 {
                    let spare = spares[q];
                    let mut take = spare.min(need[q]);
                    need[q] -= take;
                    if need[q] == 0 && lifted.is_some() {
                        bonus[q] = (spare - take) / 2;
                        take += bonus[q];
                        // Half of what the giver has left goes to the book, for the next
                        // lifts to take without locking a giver.
                        let pooled = (spare - take) / 2;
                        unassigned.add(q, pooled);
                        take += pooled;
                    }
                    assigned[q] -= take;
                }
            }
            st.assign_ceilings(&before, *assigned);
        }
        if let Some((i, shard)) = shards
            .iter()
            .enumerate()
            .find(|(_, s)| lifted.is_some_and(|l| std::ptr::eq(l, **s)))
            .filter(|_| bonus.iter().any(|&b| b > 0))
        {
            // Its copy, which another thread of the shard may have raised meanwhile.
            let mut st = shard.lock()?;
            let before = st.book_assigned();
            let mut assigned = before;
            for (a, b) in assigned.iter_mut().zip(&bonus) {
                *a += b;
            }
            st.assign_ceilings(&before, assigned);
            book.assigned[i] = assigned;
        }
        if need.iter().all(|&n| n == 0) {
            return Ok(());
        }
        drop(book);
        self.balance_peaks(&highs).map(drop)
    }

    /// Every shard locked at once, in slot order, so that their counts are one moment's.
    /// A shard whose lock does not come free within a short spin (its thread may be in a
    /// driver call for milliseconds) is waited for alone, with the others released, and
    /// then all are taken again: holding them meanwhile would stall every stream behind
    /// that one call. No other path holds a shard's lock while waiting for another's.
    pub(super) fn lock_every_shard(&self) -> Result<(Vec<&Shard>, Vec<Guard<'_, State>>)> {
        let shards: Vec<&Shard> = self.shards().collect();
        'again: loop {
            let mut held = Vec::with_capacity(shards.len());
            for shard in &shards {
                match shard.lock_soon()? {
                    Some(st) => held.push(st),
                    None => {
                        drop(held);
                        drop(shard.lock()?);
                        continue 'again;
                    }
                }
            }
            return Ok((shards, held));
        }
    }

    /// Settles the device's peaks (see `PeakBook`) with every shard locked at once, and
    /// returns them: the peaks rise to the sum of the shards' counts if it is higher (the
    /// fronts drained first), and the headroom left below them is shared equally. Each
    /// shard counts at least at its `highs` (by slot; none past their end): lifts no
    /// headroom covered, which the peaks must include though the counts may have fallen
    /// since.
    #[cold]
    #[inline(never)]
    fn balance_peaks(&self, highs: &[Peaks]) -> Result<Peaks> {
        let mut book = lock(&self.peak_book.inner, "the device's peaks")?;
        let (shards, mut held) = self.lock_every_shard()?;
        Ok(balance_held(
            &mut book,
            &self.peak_book.unassigned,
            &shards,
            &mut held,
            highs,
        ))
    }

    /// What `stats` returns, with several shards: their counts and the device's reserved
    /// bytes read at one moment (every shard locked), and the peaks settled then.
    #[cold]
    #[inline(never)]
    pub(super) fn stats_of_shards(&self) -> Result<DeviceStats> {
        let mut book = lock(&self.peak_book.inner, "the device's peaks")?;
        let (shards, mut held) = self.lock_every_shard()?;
        let peaks = balance_held(
            &mut book,
            &self.peak_book.unassigned,
            &shards,
            &mut held,
            &[],
        );
        let mut sum = DeviceStats::default();
        for (shard, st) in shards.iter().zip(&held) {
            sum.add(&shard.stats_with_fronts_locked(st)?);
        }
        // Reserved bytes change only under a shard's lock: every one is held.
        sum.reserved_bytes = self.device_reserved.read()?;
        sum.set_device_peaks(&peaks);
        Ok(sum)
    }

    /// Makes the book the keeper of the device's peaks as the second shard is made: the
    /// first shard's peaks are the device's so far, and from now on its ceilings. Called
    /// before the second shard's slot fills, so that a rise on the first shard meanwhile is
    /// settled into the book. Its fronts are drained first, so that the ceilings start from
    /// true counts.
    pub(super) fn activate_peak_book(&self) -> Result<()> {
        let mut book = lock(&self.peak_book.inner, "the device's peaks")?;
        let first_shard = self.shards.filled_shard(0);
        let mut first = first_shard.lock()?;
        first_shard.drain_fronts(&mut first);
        // Other shards' growths read its live bytes: the drained blocks are not.
        first_shard.publish_live(&first);
        book.peaks = first.stats().peaked_peaks();
        book.assigned[0] = book.peaks;
        self.peak_book.unassigned.set(&[0; PEAKED]);
        first.set_book_assigned(book.peaks);
        self.peak_book.active.store(true, Ordering::Release);
        Ok(())
    }

    /// `reset_peak_stats` for the shards. The book is taken first, even with one shard: a
    /// second shard made meanwhile takes the first one's peaks into the book under it,
    /// before or after this reset.
    pub(super) fn reset_peaks_of_shards(&self) -> Result<()> {
        let mut book = lock(&self.peak_book.inner, "the device's peaks")?;
        if !self.peak_book.is_active() {
            return self.each_shard(Shard::reset_peak_stats);
        }
        // Every shard at once, as `balance_peaks`: the new peaks are one moment's sum, taken
        // with the fronts drained (held blocks are not live).
        let (shards, mut held) = self.lock_every_shard()?;
        let mut sum = [0; PEAKED];
        for (j, (shard, st)) in shards.iter().zip(held.iter_mut()).enumerate() {
            shard.reset_peaks_locked(st);
            let currents = st.stats().peaked_currents();
            book.assigned[j] = currents;
            st.set_book_assigned(currents);
            for (s, c) in sum.iter_mut().zip(&currents) {
                *s += c;
            }
        }
        book.peaks = sum;
        self.peak_book.unassigned.set(&[0; PEAKED]);
        Ok(())
    }
}

/// `DeviceAllocator::balance_peaks` with the book and every shard (`shards`, `held`)
/// locked.
fn balance_held(
    book: &mut Book,
    unassigned: &Unassigned,
    shards: &[&Shard],
    held: &mut [Guard<'_, State>],
    highs: &[Peaks],
) -> Peaks {
    let sum_of = |held: &[Guard<'_, State>]| {
        let mut sum = [0; PEAKED];
        for (j, st) in held.iter().enumerate() {
            let currents = st.stats().peaked_currents();
            let high = highs.get(j).copied().unwrap_or([0; PEAKED]);
            // A lift not settled yet (a ceiling above the shard's assignment) is a high its
            // count reached, in a call still under way, though the count may have fallen
            // since: a balance that another thread started (a statistics read, another
            // shard's lift) must count it too, as it sets new ceilings that erase it.
            let (ceilings, assigned) = (st.stats().peaked_peaks(), st.book_assigned());
            for q in 0..PEAKED {
                let pending = if ceilings[q] > assigned[q] {
                    ceilings[q]
                } else {
                    0
                };
                sum[q] += currents[q].max(high[q]).max(pending);
            }
        }
        sum
    };
    let mut sum = sum_of(held);
    let rises = sum.iter().zip(book.peaks.iter()).any(|(s, p)| s > p);
    if rises && held.iter().any(|st| st.front_blocks() > 0) {
        // Held blocks count as live in their shard: the rise must not include them.
        for (shard, st) in shards.iter().zip(held.iter_mut()) {
            shard.drain_fronts(st);
        }
        sum = sum_of(held);
    }
    for (p, s) in book.peaks.iter_mut().zip(&sum) {
        *p = (*p).max(*s);
    }
    let n = held.len() as i64;
    let peaks = book.peaks;
    // Half the headroom stays unassigned (`Unassigned`), half is shared equally.
    let (mut kept, mut shared) = ([0; PEAKED], [0; PEAKED]);
    for q in 0..PEAKED {
        let spare = peaks[q] - sum[q];
        kept[q] = spare / 2;
        shared[q] = spare - kept[q];
    }
    unassigned.set(&kept);
    for (j, st) in held.iter_mut().enumerate() {
        let currents = st.stats().peaked_currents();
        let mut headroom = [0; PEAKED];
        for q in 0..PEAKED {
            headroom[q] = shared[q] / n + if j == 0 { shared[q] % n } else { 0 };
            book.assigned[j][q] = currents[q] + headroom[q];
        }
        st.stats_mut().set_ceilings(&headroom);
        st.set_book_assigned(book.assigned[j]);
    }
    peaks
}
