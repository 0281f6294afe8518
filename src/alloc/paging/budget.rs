//! How many cached pages growth may keep beyond the live high-water mark (`page_slack`), and
//! how much time page moves may take (`page_move_budget`): the move allowance.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Growth may keep `page_slack` (config) times the live high-water mark as cached pages
/// before reclaiming, but never fewer than this many pages.
const MIN_SLACK_PAGES: u64 = 4;
/// The allowance holds at most the budget's share of this span: long enough for a warm-up's
/// or a new phase's bursts of moves among the work around them, short enough that an hour
/// of quiet does not buy an hour's worth of moves later.
const ALLOWANCE_SPAN: Duration = Duration::from_secs(30);

/// Bytes of cached pages growth may keep beyond the live high-water mark `high`, with
/// `share` the slack (a fraction of `high`) and `page` the page size, among `shards`
/// allocators of the device. Never under a page per shard: a shard's blocks share pages,
/// so with fewer pages of slack than shards every growth would take another shard's page
/// and the pages would go round the shards, a move and a wait per allocation.
pub fn slack_bytes(high: u64, share: f64, page: u64, shards: u64) -> u64 {
    ((high as f64 * share) as u64).max(MIN_SLACK_PAGES.max(shards) * page)
}

// Why an allowance, and not more slack.
//
// Moving pages (unmap chunks under free blocks, map them where growth needs them) keeps
// reserved near the live high-water mark, and its driver calls hold the host. The budget
// says moves may take `page_move_budget` of the job's time. The allowance is that share of
// the wall time since the allocator started, spent by each growth that moved, and refused
// moves while it is spent: growth then maps new memory, and reserved rises by exactly what
// that growth needed. Reserved rises only at moments when moving would overrun the budget
// (in a job that keeps its device busy, throughout the refill that follows: below), and by
// no more than the growth in hand, so a job whose moves fit the budget over its life keeps
// the tight bound, however they bunch.
//
// Raising the slack instead (a share of peak live, in steps, per window of time over
// budget) measured the wrong thing twice. Moves bunch at warm-up and at new shapes, so a
// window over budget is usual even in jobs far under it in all; and the step is a guess at
// how moves fall with slack, which differs per job, so it overshot: bert inference with
// variable shapes rose to 0.17-0.45 of slack, reserving 1.24-1.33× live against 1.03 when
// its 0.2-0.8 s of moves in a 45 s process were allowed. And the slack, once raised, set
// the peak for good, while the allowance grows reserved only by the growth it refused.
//
// A job seen to keep its device busy (some growth ended before the device had run the
// work queued before it) gets, once, a warm-up credit of the budget's share of
// `ALLOWANCE_SPAN`. Moves bunch at warm-up, when the job has run for little time, and the
// peak is set there; a training or inference job runs on for minutes, over which the
// warm-up's moves are within budget. On the H100, with the allowance alone a 40 GiB
// attention job refused 9 growths their moves and reserved 1.59x live, a diffusion
// training job (unet) 14 and 1.15x; with the credit, 1.027x and 1.031x. The price: in a
// run shorter than `ALLOWANCE_SPAN` the credit pays for steady-state moves too (unet's
// loop took 1.14x native's time). A loop of allocations with no kernels behind it (the
// hot-path harness) never shows a busy device: its moves are its time, and it earns only
// the budget's share of it.
//
// Once a job that keeps its device busy has spent its allowance, no growth moves by choice
// until the allowance is full again (`refilling`: the budget's share of `ALLOWANCE_SPAN`,
// at least 30 s at its pace, more after a growth that left it in debt; the hard limit and
// the OOM path still move, uncharged). Refused one growth at a time, moves went on at the
// budget's pace between refusals, and in a job whose phases want their pages in different
// places (unet's training steps and sampling) each move took pages that the other phase
// would want back, so refusals kept adding memory that the next moves scattered again: over
// 80 loops (50 s) on an H200, 2,124 moving growths and 456 refused ones took unet to 1.177x
// live, above native's 1.070x, with its loops still 1-9% over native's. Refusing every move
// for the refill lets such a job map what each phase needs where it needs it and stop
// growing, as a cache that never moves would: the same 80 loops then reserved 1.138x (13
// refused growths), and every loop from the 24th ran within 0.4-1.4% of native's. That is
// still above native's memory: what the job had mapped where it ran out is not where its
// phases want it (Limitations, docs/paging.md). A job whose moves fit the budget (with the
// credit) never runs out, and a loop of allocations with no kernels behind it (never
// credited) is refused one growth at a time as before: its moves are its time, and a refill
// would stop them for its whole run.
//
// What a move costs: nothing if the device was busy throughout, with work queued before
// the growth began (an event recorded then is still pending at its end): the host was
// ahead, and its next launches still come before the device runs dry. Otherwise the host
// time of the growth that moved, less the host's waits for the device (`note_wait`). A
// wait blocks the host until the device has run the work queued before the pages were
// freed; the device keeps running that work meanwhile, so the wait delays the job by no
// more than the device's idle time after it (until the host queues the next kernel), not
// by its length. On a job the device limits, waits are long and nearly free; counted as
// move time, they would refuse moves (and buy memory) to save nothing. The driver calls
// of a move (unmap, map, grant access) hold the host, and the device starves once its
// queue runs dry: that is the cost the budget bounds.

/// The allowance of a device (see above): shared by its shards, so that with
/// `per_stream_shards` moves on all streams together take the budget's share, not each.
#[derive(Default)]
pub struct Allowance {
    /// When it was last brought up to date; none before the first look.
    as_of: Option<Instant>,
    /// Seconds of moving the job may still spend; below zero by at most one growth's moves.
    seconds: f64,
    /// Whether the job has had its warm-up credit (see above).
    warm_up_credited: bool,
    /// When it last ran out (growth then makes coarser chunks: `MoveClock::spent_lately`).
    ran_out: Option<Instant>,
    /// It ran out and has not been full since: no growth moves until it is (see above).
    refilling: bool,
}

impl Allowance {
    /// An allowance whose clock starts at `now` (the allocator's start: the job's time
    /// counts from there), to share between a device's shards.
    pub fn started_at(now: Instant) -> Arc<Mutex<Allowance>> {
        Arc::new(Mutex::new(Allowance {
            as_of: Some(now),
            ..Allowance::default()
        }))
    }

    /// The most it holds: the budget's share of `ALLOWANCE_SPAN`, which is also the
    /// warm-up credit.
    fn most(budget: f64) -> f64 {
        budget * ALLOWANCE_SPAN.as_secs_f64()
    }

    fn accrue(&mut self, now: Instant, budget: f64) {
        let since = now.saturating_duration_since(*self.as_of.get_or_insert(now));
        // An allowance over the cap (the budget was lowered) comes down to it.
        self.seconds = (self.seconds + budget * since.as_secs_f64()).min(Self::most(budget));
        self.as_of = Some(self.as_of.map_or(now, |t| t.max(now)));
    }

    /// Whether a growth may move now: while it refills after running out, none may.
    fn allows_moves(&mut self, budget: f64) -> bool {
        if self.refilling && self.seconds >= Self::most(budget) {
            self.refilling = false;
        }
        !self.refilling && self.seconds > 0.0
    }

    fn spent_lately(&self) -> bool {
        match (self.ran_out, self.as_of) {
            (Some(out), Some(now)) => now.saturating_duration_since(out) < ALLOWANCE_SPAN,
            _ => false,
        }
    }
}

/// A shard's view of its device's `Allowance`, and the growth under way there.
pub struct MoveClock {
    shared: Arc<Mutex<Allowance>>,
    /// Set when a reclaim moves chunks: only growth that moved spends the allowance ...
    reclaimed: bool,
    /// ... and was not refused moves: what such a growth still moves, the hard limit or
    /// the OOM path forced, and charged, it would put the allowance in debt without bound.
    /// Kept until the next growth starts: freed blocks do not park meanwhile (`State::park`).
    refused: bool,
    /// The host's waits for the device during the growth under way.
    waited: Duration,
}

impl Default for MoveClock {
    /// A clock of its own, started at its first use.
    fn default() -> Self {
        Self::sharing(&Arc::default())
    }
}

impl MoveClock {
    /// A clock of its own, started at `now`.
    #[cfg(test)]
    pub fn started_at(now: Instant) -> Self {
        Self::sharing(&Allowance::started_at(now))
    }

    /// A clock that spends the device's `shared` allowance.
    pub fn sharing(shared: &Arc<Mutex<Allowance>>) -> Self {
        Self {
            shared: shared.clone(),
            reclaimed: false,
            refused: false,
            waited: Duration::ZERO,
        }
    }

    /// The shared allowance; its state is plain figures, whole after any panic elsewhere.
    fn allowance(&self) -> MutexGuard<'_, Allowance> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a growth at `now` may move pages under `budget` (a share of the time; 0 puts
    /// no bound on moves).
    pub fn may_move(&mut self, now: Instant, budget: f64) -> bool {
        if budget == 0.0 {
            return true;
        }
        let mut allowance = self.allowance();
        allowance.accrue(now, budget);
        allowance.allows_moves(budget)
    }

    /// Whether the allowance ran out within the last `ALLOWANCE_SPAN`: moves here cost more
    /// than the budget, so each should take fewer calls.
    pub fn spent_lately(&self) -> bool {
        self.allowance().spent_lately()
    }

    /// A growth starts: it has moved nothing and waited for nothing yet.
    pub fn start_growth(&mut self) {
        self.reclaimed = false;
        self.refused = false;
        self.waited = Duration::ZERO;
    }

    /// The growth under way waited `waited` for the device (see `MoveClock`).
    pub fn note_wait(&mut self, waited: Duration) {
        self.waited += waited;
    }

    /// The growth under way may not move pages by choice (see `refused`).
    pub fn note_refused(&mut self) {
        self.refused = true;
    }

    /// Whether the growth under way, or else the last one, was refused moves
    /// (`note_refused`).
    pub fn refused(&self) -> bool {
        self.refused
    }

    /// The growth under way unmapped chunks to reuse their memory (`moved`).
    pub fn note_moved(&mut self, moved: bool) {
        self.reclaimed |= moved;
    }

    /// Whether the growth under way moved chunks.
    pub fn moved(&self) -> bool {
        self.reclaimed
    }

    /// Counts a growth that ran from `started` to `now` on a GPU: if it moved pages, their
    /// cost (its host time less its waits; none if the device was busy throughout,
    /// `busy`) is spent from the allowance. Returns the cost when this growth spent the
    /// last of it after a span with some left (worth a log line: growth maps new memory
    /// for a while).
    pub fn account(
        &mut self,
        started: Instant,
        now: Instant,
        budget: f64,
        busy: bool,
    ) -> Option<Duration> {
        if budget == 0.0 {
            // No bound, and nothing to keep: a budget of 0 for a while (set at run time)
            // must not cap the allowance at 0 or use up the warm-up credit.
            return None;
        }
        let (reclaimed, refused, waited) = (self.reclaimed, self.refused, self.waited);
        let mut allowance = self.allowance();
        allowance.accrue(now, budget);
        if busy && !allowance.warm_up_credited {
            // The job keeps its device busy: it is the warm-up of a job that runs on
            // (see above), and moves at warm-up set its peak.
            allowance.warm_up_credited = true;
            tracing::debug!(
                "the device was busy through a growth: the move allowance is raised to the warm-up credit of {:.0} ms ({:.0} ms were left)",
                Allowance::most(budget) * 1e3,
                allowance.seconds * 1e3,
            );
            allowance.seconds = allowance.seconds.max(Allowance::most(budget));
        }
        if !reclaimed || refused || busy {
            return None;
        }
        let cost = (now - started).saturating_sub(waited);
        let had = allowance.seconds > 0.0;
        allowance.seconds -= cost.as_secs_f64();
        if !had || allowance.seconds > 0.0 {
            return None;
        }
        let quiet_before = !allowance.spent_lately();
        allowance.ran_out = Some(now);
        // A job that keeps its device busy refills before it moves again; an
        // allocation-bound loop goes on refusing one growth at a time (see above).
        allowance.refilling = allowance.warm_up_credited;
        quiet_before.then_some(cost)
    }
}
