//! The device lock: a std `Mutex` that spins a while before it sleeps; and `SpinCell`, the
//! lock of each thread's front cache (see below).
//!
//! The allocator's critical sections are short (a few hundred ns) except for the slow path's
//! driver calls. A plain `Mutex` puts a waiter to sleep after a brief spin, and every hand-off
//! then costs a futex wake and a reschedule: several µs, far more than the section it waited
//! for, so busy threads would spend most of their time handing the lock over. Here a waiter
//! retries with
//! exponential backoff for up to `SPIN_BUDGET` before it blocks, so hand-offs between busy
//! threads stay in user space, and a waiter behind a long driver call still goes to sleep.
//!
//! `SpinThenBlock`'s lock is std's, spun on with `try_lock`, so poisoning (a panic while the
//! lock was held) is reported exactly as std reports it. It also counts how callers met it
//! (`LockCounters`: acquisitions, waits, and handoffs between threads), which its holder
//! writes with plain relaxed stores; the one unsafe line there reads the thread pointer that
//! tells threads apart (`thread_tag`).
//!
//! `lock` and `poisoned` are the one policy for a poisoned lock, everywhere in ccalloc: the
//! call that meets it fails with `ErrorKind::Internal` (`CCALLOC_INTERNAL_ERROR`) naming
//! what the lock guards, and so does every later call that needs it. A panic inside a
//! critical section is a bug in ccalloc and may have left the guarded state half-changed
//! (a block out of one list and not yet in another): going on with it could hand out
//! memory twice, and panicking again would only poison more locks. Calls that have no way
//! to report (a drop, a recording hook) leave the state alone instead.
//!
//! Under `--cfg loom` the protocol
//! (try, then block) runs on loom's mutex for the model in `tests/loom_lock.rs`; the spin's
//! timing (backoff, deadline) is compiled out there, as loom has no clock. `SpinCell` is the
//! one unsafe lock (an `UnsafeCell` behind an acquire/release flag); under loom it runs on
//! loom's cell and atomics, and the same file models it.

use crate::error::{Error, ErrorKind};
#[cfg(loom)]
use loom::sync::{Mutex, MutexGuard};
#[cfg(loom)]
use std::sync::TryLockError;
#[cfg(not(loom))]
use std::sync::{Mutex, MutexGuard, TryLockError};

/// How long a waiter spins before it blocks. About the cost of two sleeps and wake-ups: a
/// waiter that would have slept through a short section gets it sooner, and one behind a
/// driver call (tens of µs and up) wastes at most this much CPU.
#[cfg(not(loom))]
const SPIN_BUDGET: std::time::Duration = std::time::Duration::from_micros(20);
/// Backoff between tries grows to this many pause instructions: enough to keep a few
/// spinners from bouncing the lock's cache line, short next to a critical section.
#[cfg(not(loom))]
const MAX_BACKOFF: u32 = 64;
/// Spinning tries before the first look at the clock (the clock costs ~20 ns).
#[cfg(not(loom))]
const TRIES_BEFORE_CLOCK: u32 = 8;

/// The error of a call that needs `what` after a panic poisoned its lock (see the module's
/// documentation for why this is the one policy).
pub(crate) fn poisoned(what: &str) -> Error {
    Error::new(
        ErrorKind::Internal,
        format!(
            "{what} is unusable: a panic in an earlier call left its lock poisoned \
             (a bug in ccalloc)"
        ),
    )
}

/// Locks a std mutex; a poisoned one is the `poisoned(what)` error.
pub(crate) fn lock<'a, T>(
    mutex: &'a std::sync::Mutex<T>,
    what: &str,
) -> Result<std::sync::MutexGuard<'a, T>, Error> {
    mutex.lock().map_err(|_| poisoned(what))
}

/// A std `Mutex` that spins before it sleeps (see the module's documentation), and counts
/// how callers met it (`LockUse`).
pub struct SpinThenBlock<T> {
    inner: Mutex<T>,
    used: LockUse,
    /// Set, for good, once callers have found the lock held often (`contended_often`).
    contended_often: ContendedOften,
}

/// A lock is `contended_often` once, within a window of `CONTENTION_WINDOW` acquisitions, at
/// least one in `CONTENDED_ONE_IN` found it held. Windows follow one another, each opened by
/// the first contended acquisition after the last one closed. Within a window, not since the
/// start: the threads of a server all load at once and collide a hundred or two times at
/// start-up, then take turns for hours, and they gain nothing from shards of their own,
/// which cost memory (each shard keeps its own pages). Threads that churn at once collide on
/// several percent of acquisitions, in every window.
const CONTENTION_WINDOW: u64 = 1 << 16;
const CONTENDED_ONE_IN: u64 = 64;

/// The judge's state, on lines of its own (128 bytes: adjacent-line prefetch pairs lines):
/// other threads read the flag on their slow paths, and the counts beside the lock are
/// written on every acquisition. Only a holder writes it, after a contended acquisition.
#[repr(align(128))]
#[derive(Default)]
struct ContendedOften {
    /// Set for good once a window has seen enough contended acquisitions.
    often: std::sync::atomic::AtomicBool,
    /// The counts when the current window opened (at a contended acquisition).
    window_acquisitions: StdAtomicU64,
    window_contended: StdAtomicU64,
}

impl ContendedOften {
    /// After a contended acquisition, given the lock's counts so far.
    fn judge(&self, contended: u64, acquisitions: u64) {
        let (opened_at, contended_before) = (
            self.window_acquisitions.load(Ordering::Relaxed),
            self.window_contended.load(Ordering::Relaxed),
        );
        // Counts below the window's start were reset (`reset_use`): a new window opens too.
        let stale = acquisitions < opened_at
            || contended < contended_before
            || acquisitions - opened_at > CONTENTION_WINDOW;
        if stale {
            self.window_acquisitions
                .store(acquisitions, Ordering::Relaxed);
            self.window_contended
                .store(contended.saturating_sub(1), Ordering::Relaxed);
        } else if (contended - contended_before) * CONTENDED_ONE_IN >= CONTENTION_WINDOW {
            self.often.store(true, Ordering::Relaxed);
        }
    }
}

/// How callers met a lock, counted since it was made or `reset_use` (`LockCounters`
/// documents each count). Only the holder writes them, so plain relaxed loads
/// and stores do, no read-modify-write; anyone may read them.
#[derive(Default)]
struct LockUse {
    acquisitions: StdAtomicU64,
    contended: StdAtomicU64,
    blocked: StdAtomicU64,
    wait_ns: StdAtomicU64,
    handoffs: StdAtomicU64,
    /// The last holder's `thread_tag` (0: none yet).
    last_holder: StdAtomicU64,
}

/// How callers met a lock (`SpinThenBlock::use_counts`), or a device's locks summed: whether
/// threads contend, and how often the guarded state moves between threads. For the device's
/// locks (each shard's), a call its thread's front serves takes no lock and counts nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LockCounters {
    /// Times the lock was taken (for a shard: allocations and frees past the fronts,
    /// statistics reads, the device's own settling).
    pub acquisitions: u64,
    /// Of those, the ones that found another thread holding it, and of these the ones that
    /// slept (after spinning for `SPIN_BUDGET`).
    pub contended: u64,
    pub blocked: u64,
    /// Wall time the contended ones waited, in nanoseconds.
    pub wait_ns: u64,
    /// Acquisitions by another thread than the one before (the guarded state then moves
    /// between cores): threads that take turns on a stream, as PyTorch's forward and
    /// autograd threads do, make a few per step; threads that allocate at the same time on
    /// one stream make about one per call.
    pub handoffs: u64,
}

impl LockCounters {
    pub fn add(&mut self, o: &LockCounters) {
        self.acquisitions += o.acquisitions;
        self.contended += o.contended;
        self.blocked += o.blocked;
        self.wait_ns += o.wait_ns;
        self.handoffs += o.handoffs;
    }
}

/// Adds `n` to a count only the lock's holder writes.
#[inline]
fn bump(count: &StdAtomicU64, n: u64) {
    count.store(count.load(Ordering::Relaxed) + n, Ordering::Relaxed);
}

impl LockUse {
    /// The caller just took the lock (on the fast path: at once).
    #[inline]
    fn note(&self) {
        bump(&self.acquisitions, 1);
        let me = thread_tag();
        let last = self.last_holder.load(Ordering::Relaxed);
        if last != me {
            bump(&self.handoffs, (last != 0) as u64);
            self.last_holder.store(me, Ordering::Relaxed);
        }
    }

    /// The caller took the lock after waiting `waited` for another holder, `blocked` if it
    /// slept: an acquisition (`note`) that was contended.
    fn note_wait(&self, waited: std::time::Duration, blocked: bool) {
        self.note();
        bump(&self.contended, 1);
        bump(&self.blocked, blocked as u64);
        bump(&self.wait_ns, waited.as_nanos() as u64);
    }
}

/// A number for the calling thread, never 0: its thread pointer (the address of its
/// thread control block, which the platform's ABI keeps in a register). Threads alive at
/// once have distinct ones; a thread started after another exited may get that one's again.
/// One instruction, where a call (`pthread_self`, or a thread-local's `__tls_get_addr` in a
/// shared library) cost 5 ns a lock.
#[inline]
fn thread_tag() -> u64 {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        let tcb: u64;
        // SAFETY: the x86-64 Linux ABI keeps the thread control block's own address at
        // %fs:0 in every thread; reading it has no side effect.
        unsafe {
            std::arch::asm!("mov {}, qword ptr fs:[0]", out(reg) tcb, options(nostack, readonly, preserves_flags));
        }
        tcb
    }
    #[cfg(all(target_arch = "aarch64", target_os = "linux"))]
    {
        let tcb: u64;
        // SAFETY: TPIDR_EL0 holds the thread pointer in every thread; reading it has no
        // side effect.
        unsafe {
            std::arch::asm!("mrs {}, tpidr_el0", out(reg) tcb, options(nostack, nomem, preserves_flags));
        }
        tcb
    }
    #[cfg(not(all(
        any(target_arch = "x86_64", target_arch = "aarch64"),
        target_os = "linux"
    )))]
    {
        // SAFETY: pthread_self has no preconditions and cannot fail.
        unsafe { libc::pthread_self() as u64 }
    }
}

/// The guard `lock` returns (std's, or loom's under `--cfg loom`).
pub(crate) type Guard<'a, T> = MutexGuard<'a, T>;

/// What `lock` returns when a panic poisoned the lock: the guard, as `std` gives it.
pub(crate) type Poisoned<'a, T> = std::sync::PoisonError<MutexGuard<'a, T>>;

impl<T> SpinThenBlock<T> {
    pub fn new(value: T) -> Self {
        Self {
            inner: Mutex::new(value),
            used: LockUse::default(),
            contended_often: ContendedOften::default(),
        }
    }

    /// Locks, spinning first. Errs (with the guard) when a panic poisoned the lock.
    #[inline]
    pub fn lock(&self) -> Result<MutexGuard<'_, T>, Poisoned<'_, T>> {
        match self.inner.try_lock() {
            Ok(guard) => {
                self.used.note();
                Ok(guard)
            }
            Err(TryLockError::Poisoned(poisoned)) => Err(poisoned),
            Err(TryLockError::WouldBlock) => self.lock_contended(),
        }
    }

    #[cold]
    #[inline(never)]
    fn lock_contended(&self) -> Result<MutexGuard<'_, T>, Poisoned<'_, T>> {
        let started = std::time::Instant::now();
        let (guard, blocked) = match self.spin_for_lock()? {
            Some(guard) => (guard, false),
            None => (self.inner.lock()?, true),
        };
        self.used.note_wait(started.elapsed(), blocked);
        self.judge_contention();
        Ok(guard)
    }

    /// After a contended acquisition: whether the lock is now `contended_often`.
    fn judge_contention(&self) {
        self.contended_often.judge(
            self.used.contended.load(Ordering::Relaxed),
            self.used.acquisitions.load(Ordering::Relaxed),
        );
    }

    /// Whether callers have found the lock held often (see `CONTENTION_WINDOW`); once
    /// set, it stays set (a reset of the counts does not clear it).
    #[inline]
    pub fn contended_often(&self) -> bool {
        self.contended_often.often.load(Ordering::Relaxed)
    }

    /// Marks the lock `contended_often`, as a window of contention would (tests of what
    /// follows from it, without racing threads for it).
    #[cfg(test)]
    pub(crate) fn mark_contended_often(&self) {
        self.contended_often.often.store(true, Ordering::Relaxed);
    }

    /// How callers have met the lock. Read without it: counts a holder is updating may be
    /// one acquisition apart.
    pub fn use_counts(&self) -> LockCounters {
        let u = &self.used;
        let read = |c: &StdAtomicU64| c.load(Ordering::Relaxed);
        LockCounters {
            acquisitions: read(&u.acquisitions),
            contended: read(&u.contended),
            blocked: read(&u.blocked),
            wait_ns: read(&u.wait_ns),
            handoffs: read(&u.handoffs),
        }
    }

    /// Zeroes the counts (the last holder stays known); the caller holds the lock, through
    /// `_held`, so that no acquisition is counted meanwhile.
    pub fn reset_use(&self, _held: &MutexGuard<'_, T>) {
        let u = &self.used;
        for c in [
            &u.acquisitions,
            &u.contended,
            &u.blocked,
            &u.wait_ns,
            &u.handoffs,
        ] {
            c.store(0, Ordering::Relaxed);
        }
    }

    /// Locks if the lock comes free within the spin `lock` does before it blocks; `Ok(None)`
    /// when it does not: for callers that hold other locks of the kind, which must not
    /// keep them while a holder of this one waits on the driver.
    pub fn lock_soon(&self) -> Result<Option<MutexGuard<'_, T>>, Poisoned<'_, T>> {
        if let Ok(guard) = self.inner.try_lock() {
            self.used.note();
            return Ok(Some(guard));
        }
        let started = std::time::Instant::now();
        let guard = self.spin_for_lock()?;
        if guard.is_some() {
            self.used.note_wait(started.elapsed(), false);
            self.judge_contention();
        }
        Ok(guard)
    }

    /// `lock_soon`'s spin, counting nothing.
    fn spin_for_lock(&self) -> Result<Option<MutexGuard<'_, T>>, Poisoned<'_, T>> {
        let mut tries = 0u32;
        #[cfg(not(loom))]
        let mut deadline = None;
        loop {
            match self.inner.try_lock() {
                Ok(guard) => return Ok(Some(guard)),
                Err(TryLockError::Poisoned(poisoned)) => return Err(poisoned),
                Err(TryLockError::WouldBlock) => {}
            }
            tries += 1;
            #[cfg(loom)]
            {
                // The model explores the spin once, then the caller's next step.
                if tries > 1 {
                    return Ok(None);
                }
                loom::thread::yield_now();
            }
            #[cfg(not(loom))]
            {
                if tries >= TRIES_BEFORE_CLOCK {
                    let now = std::time::Instant::now();
                    let until = *deadline.get_or_insert(now + SPIN_BUDGET);
                    if now >= until {
                        return Ok(None);
                    }
                }
                for _ in 0..(1u32 << tries.min(MAX_BACKOFF.trailing_zeros())) {
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Locks only if no one holds the lock now (`None` when someone does, or when a panic
    /// poisoned it): for callers that hold another lock of the same kind, which may not
    /// wait for this one.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        let guard = self.inner.try_lock().ok()?;
        self.used.note();
        Some(guard)
    }

    /// Locks without spinning (for callers that do not mind waiting: shutdown, reopen).
    pub fn lock_blocking(&self) -> Result<MutexGuard<'_, T>, Poisoned<'_, T>> {
        let guard = self.inner.lock()?;
        self.used.note();
        Ok(guard)
    }
}

/// A cell that one thread uses nearly always and others only now and then: each thread's
/// front cache of freed blocks (`alloc::front`), which its owner takes and fills on every
/// allocation and free while another thread drains it only on a slow path (growth,
/// `empty_cache`, a statistics read).
///
/// Entering costs one compare-and-swap and leaving one plain release store, where a `Mutex`
/// costs two atomic read-modify-writes (its unlock swaps to learn of sleepers): on the
/// same-size alloc/free loop that halves the atomics, which are most of its time. A waiter
/// spins, then yields; it waits only for another thread's few-hundred-ns visit. A panic
/// inside `with` leaves the cell unlocked (the closure's changes are whatever it made).
pub struct SpinCell<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

#[cfg(loom)]
use loom::{cell::UnsafeCell, sync::atomic::AtomicBool};
use std::sync::atomic::{AtomicU64 as StdAtomicU64, Ordering};
#[cfg(not(loom))]
use std::{cell::UnsafeCell, sync::atomic::AtomicBool};

// SAFETY: the value is reached only inside `with`, by one thread at a time (the flag's
// acquire compare-and-swap / release store order each visit after the previous one), so a `Send` value
// may be shared.
unsafe impl<T: Send> Sync for SpinCell<T> {}

impl<T> SpinCell<T> {
    pub fn new(value: T) -> Self {
        Self {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Runs `f` on the value, alone.
    #[inline]
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        if !self.try_enter() {
            self.wait();
        }
        /// Unlocks on the way out, unwinding included.
        struct Leave<'a>(&'a AtomicBool);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _leave = Leave(&self.locked);
        #[cfg(not(loom))]
        // SAFETY: the flag is ours until `_leave` drops, so no other reference exists.
        return f(unsafe { &mut *self.value.get() });
        #[cfg(loom)]
        // SAFETY: as above; loom checks that no two threads are in here at once.
        return self.value.with_mut(|value| f(unsafe { &mut *value }));
    }

    /// One try to take the flag.
    #[inline]
    fn try_enter(&self) -> bool {
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    #[cold]
    #[inline(never)]
    fn wait(&self) {
        #[cfg(not(loom))]
        let mut spins = 0u32;
        loop {
            // Read until free (no write traffic on the owner's line), then try to take it.
            #[cfg(not(loom))]
            while self.locked.load(Ordering::Relaxed) {
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            // Under loom, each failed try yields, so that the model moves on to the holder.
            #[cfg(loom)]
            loom::thread::yield_now();
            if self.try_enter() {
                return;
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Feeds `judge` a lock's counts: `steps` acquisitions of which every `one_in`-th found
    /// the lock held (none if 0), continuing from `at` (acquisitions, contended).
    fn run(w: &ContendedOften, at: &mut (u64, u64), steps: u64, one_in: u64) {
        for _ in 0..steps {
            at.0 += 1;
            if one_in != 0 && at.0.is_multiple_of(one_in) {
                at.1 += 1;
                w.judge(at.1, at.0);
            }
        }
    }

    #[test]
    fn a_burst_at_start_up_then_turns_is_not_contended_often() {
        let w = ContendedOften::default();
        let mut at = (0, 0);
        // Five hundred collisions while four threads load at once...
        run(&w, &mut at, 5000, 10);
        // ...then a long job's rare ones, more than the window's share in total.
        run(&w, &mut at, 4_000_000, 500);
        assert!(at.1 > CONTENTION_WINDOW / CONTENDED_ONE_IN * 5);
        assert!(!w.often.load(Ordering::Relaxed));
    }

    #[test]
    fn threads_churning_at_once_are_contended_often_within_a_window() {
        let w = ContendedOften::default();
        let mut at = (0, 0);
        run(&w, &mut at, 100_000, 0);
        run(&w, &mut at, 2 * CONTENTION_WINDOW, 30);
        assert!(w.often.load(Ordering::Relaxed));
    }

    #[test]
    fn just_under_the_rate_is_not_contended_often_and_a_reset_opens_a_window() {
        let w = ContendedOften::default();
        let mut at = (0, 0);
        run(&w, &mut at, 20 * CONTENTION_WINDOW, CONTENDED_ONE_IN + 2);
        assert!(!w.often.load(Ordering::Relaxed));
        // Counts reset to zero (`reset_use`) while a window is open: a new one opens.
        let mut at = (0, 0);
        run(&w, &mut at, CONTENTION_WINDOW, 0);
        run(&w, &mut at, 2 * CONTENTION_WINDOW, 16);
        assert!(w.often.load(Ordering::Relaxed));
    }

    #[test]
    fn a_reset_early_in_a_window_neither_trips_nor_panics() {
        let w = ContendedOften::default();
        // A second window opens after the first's 65,536 acquisitions, 655 of them contended.
        let mut at = (0, 0);
        run(&w, &mut at, CONTENTION_WINDOW + 1000, 100);
        // The counts are reset, and the next contended acquisition comes just past the
        // window's start, with fewer contended than when it opened.
        let mut at = (0, 0);
        run(&w, &mut at, CONTENTION_WINDOW + 1000, 0);
        run(&w, &mut at, 4 * CONTENTION_WINDOW, 200);
        assert!(!w.often.load(Ordering::Relaxed));
    }
}
