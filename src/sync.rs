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
//! `SpinThenBlock` has no unsafe code: the lock is std's, spun on with `try_lock`, so
//! poisoning (a panic while the lock was held) is reported exactly as std reports it.
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
//! one unsafe piece (an `UnsafeCell` behind an acquire/release flag); under loom it runs on
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

pub struct SpinThenBlock<T> {
    inner: Mutex<T>,
}

/// The guard `lock` returns (std's, or loom's under `--cfg loom`).
pub(crate) type Guard<'a, T> = MutexGuard<'a, T>;

/// What `lock` returns when a panic poisoned the lock: the guard, as `std` gives it.
pub(crate) type Poisoned<'a, T> = std::sync::PoisonError<MutexGuard<'a, T>>;

impl<T> SpinThenBlock<T> {
    pub fn new(value: T) -> Self {
        Self {
            inner: Mutex::new(value),
        }
    }

    /// Locks, spinning first. Errs (with the guard) when a panic poisoned the lock.
    #[inline]
    pub fn lock(&self) -> Result<MutexGuard<'_, T>, Poisoned<'_, T>> {
        match self.inner.try_lock() {
            Ok(guard) => Ok(guard),
            Err(TryLockError::Poisoned(poisoned)) => Err(poisoned),
            Err(TryLockError::WouldBlock) => self.lock_contended(),
        }
    }

    #[cold]
    #[inline(never)]
    fn lock_contended(&self) -> Result<MutexGuard<'_, T>, Poisoned<'_, T>> {
        match self.lock_soon()? {
            Some(guard) => Ok(guard),
            None => self.inner.lock(),
        }
    }

    /// Locks if the lock comes free within the spin `lock` does before it blocks; `Ok(None)`
    /// when it does not: for callers that hold other locks of the kind, which must not
    /// keep them while a holder of this one waits on the driver.
    pub fn lock_soon(&self) -> Result<Option<MutexGuard<'_, T>>, Poisoned<'_, T>> {
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
        self.inner.try_lock().ok()
    }

    /// Locks without spinning (for callers that do not mind waiting: shutdown, reopen).
    pub fn lock_blocking(&self) -> Result<MutexGuard<'_, T>, Poisoned<'_, T>> {
        self.inner.lock()
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
use std::sync::atomic::Ordering;
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
