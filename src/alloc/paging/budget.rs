//! The slack controller: how many cached pages growth may keep beyond the live high-water
//! mark, and how `page_move_budget` raises that slack while page moves take too much time.

use std::time::{Duration, Instant};

/// Growth may keep `page_slack` (config) times the live high-water mark as cached pages
/// before reclaiming, but never fewer than this many pages.
const MIN_SLACK_PAGES: u64 = 4;
/// The window over which the share of time spent moving pages is measured: long enough that
/// one burst of growth (a new batch shape: tens of moves of a few ms in all) does not look
/// like a trend.
const MOVE_WINDOW: Duration = Duration::from_secs(1);
/// A window closes early when moves took at least this long in it (`closes_early`) ...
const EARLY_MOVES: Duration = Duration::from_millis(5);
/// ... and it has lasted this long. Two such windows over budget in a row raise the slack
/// (`next_extra_slack`): a job that does little but move pages adapts within about 25 ms.
const EARLY_WINDOW: Duration = Duration::from_millis(12);
/// Windows in a row with moves under a quarter of the budget before the extra slack halves.
/// Halving lets later growth release spares and move pages again, so it waits for a phase
/// change (several seconds quiet), not for the quiet the extra slack itself bought.
const QUIET_WINDOWS_BEFORE_DECAY: u32 = 5;
/// The extra slack's growth per window over budget: small steps, so that it stops near the
/// least slack that keeps moves within the budget (moves fall steeply with slack) ...
const EXTRA_SLACK_STEP: f64 = 1.5;
/// ... and larger ones where moves take more than this many times the budget.
const SEVERE_OVERRUN: f64 = 8.0;
const SEVERE_EXTRA_SLACK_STEP: f64 = 3.0;
/// The job's share of time spent moving pages (the gate on a window over budget, see
/// `MoveClock::account`) is taken over at most this span: long enough to hold a warm-up's
/// bursts among the work around them, short enough that an hour of quiet does not hide a
/// phase that moves pages all the time for more than a few seconds.
const JOB_SPAN: Duration = Duration::from_secs(30);
/// Extra slack that `page_move_budget` may add: reserved stays within twice peak live.
const MAX_EXTRA_SLACK: f64 = 1.0;
/// The first step of extra slack when `page_slack` is smaller.
const MIN_EXTRA_SLACK: f64 = 1.0 / 32.0;

/// Bytes of cached pages growth may keep beyond the live high-water mark `high`, with
/// `share` the slack (a fraction of `high`) and `page` the page size.
pub fn slack_bytes(high: u64, share: f64, page: u64) -> u64 {
    ((high as f64 * share) as u64).max(MIN_SLACK_PAGES * page)
}

/// Time spent moving pages over a window of wall time, and the extra slack it bought.
///
/// A move's cost is the host time of the growth that made it, less the host's waits for
/// the device (`note_wait`). A wait blocks the host until the device has run the work
/// queued before the pages were freed; the device keeps running that work meanwhile, so
/// the wait delays the job by no more than the device's idle time after it (until the host
/// queues the next kernel), not by its length. On a job the device limits, waits are long
/// and nearly free; counted as move time, they would buy extra slack (memory) that saves
/// nothing. The driver calls of a move (unmap, map, grant access) hold the host, and the
/// device starves once its queue runs dry: that is the cost the budget bounds.
#[derive(Default)]
pub struct MoveClock {
    window_start: Option<Instant>,
    moving: Duration,
    /// Set when a reclaim moves chunks: only growth that moved counts as moving time.
    reclaimed: bool,
    /// The host's waits for the device during the growth under way.
    waited: Duration,
    /// Added to `page_slack` while moves take more than `page_move_budget` of the time.
    extra_slack: f64,
    /// Windows in a row with moves well under the budget (see `next_extra_slack`).
    quiet_windows: u32,
    /// The last window closed with moves over the budget.
    over_budget: bool,
    /// Where the job's span starts (its first growth, or `JOB_SPAN` back), and the moving
    /// time in it: the job's share.
    first_growth: Option<Instant>,
    moved_in_all: Duration,
}

impl MoveClock {
    /// Added to `page_slack` while moves take more than the budget.
    pub fn extra_slack(&self) -> f64 {
        self.extra_slack
    }

    /// A growth starts: it has moved nothing and waited for nothing yet.
    pub fn start_growth(&mut self) {
        self.reclaimed = false;
        self.waited = Duration::ZERO;
    }

    /// The growth under way waited `waited` for the device (see `MoveClock`).
    pub fn note_wait(&mut self, waited: Duration) {
        self.waited += waited;
    }

    /// The growth under way unmapped chunks to reuse their memory (`moved`).
    pub fn note_moved(&mut self, moved: bool) {
        self.reclaimed |= moved;
    }

    /// Whether the growth under way moved chunks.
    pub fn moved(&self) -> bool {
        self.reclaimed
    }

    /// Counts a growth that ran from `started` to `now` on a GPU (its waits left out: see
    /// `MoveClock`), and every `MOVE_WINDOW`
    /// (or sooner, see `closes_early`) adjusts the extra slack to the share of time moves
    /// took (`next_extra_slack`). Growth that only mapped new memory is not a move (more
    /// slack would not spare it), but it still closes windows, so that extra slack decays
    /// once moves stop. Returns the window's (share, length) when the extra slack changed.
    pub fn account(
        &mut self,
        started: Instant,
        now: Instant,
        budget: f64,
        page_slack: f64,
    ) -> Option<(f64, Duration)> {
        let base = page_slack.max(MIN_EXTRA_SLACK);
        if self.reclaimed {
            let moved = (now - started).saturating_sub(self.waited);
            self.moving += moved;
            self.moved_in_all += moved;
        }
        let mut since_first = now - *self.first_growth.get_or_insert(started);
        if since_first > JOB_SPAN {
            // Older time counts in proportion: the span keeps its share, now JOB_SPAN long.
            let keep = JOB_SPAN.as_secs_f64() / since_first.as_secs_f64();
            self.moved_in_all = self.moved_in_all.mul_f64(keep);
            self.first_growth = Some(now - JOB_SPAN);
            since_first = JOB_SPAN;
        }
        let window = now - *self.window_start.get_or_insert(started);
        let early = closes_early(window, self.moving, budget);
        if window < MOVE_WINDOW && !early {
            return None;
        }
        let mut share = self.moving.as_secs_f64() / window.as_secs_f64();
        // A window over budget counts only while the job as a whole is too (over its last
        // `JOB_SPAN`): moves come in bursts (warm-up, a new batch shape), and a burst that
        // takes 20% of a few ms costs a job that has run for seconds nothing near its
        // budget. A job that does little but move pages is over budget in all, and adapts
        // as fast as before.
        let in_all = self.moved_in_all.as_secs_f64() / since_first.as_secs_f64().max(1e-9);
        if in_all <= budget {
            share = share.min(budget);
        }
        let before = self.extra_slack;
        // Windows close only at growth: a long quiet gap counts for the windows it spans.
        let spans = (window.as_secs_f64() / MOVE_WINDOW.as_secs_f64()) as u32;
        (self.extra_slack, self.quiet_windows) = next_extra_slack(
            before,
            self.quiet_windows,
            spans,
            share,
            budget,
            base,
            self.over_budget,
        );
        self.over_budget = share > budget;
        self.window_start = Some(now);
        self.moving = Duration::ZERO;
        (self.extra_slack != before).then_some((share, window))
    }
}

/// Whether a move window (`MoveClock::account`) that has lasted `window`, of which page moves
/// took `moving`, closes before `MOVE_WINDOW`: once moves have plainly overrun the budget,
/// for at least `EARLY_MOVES` and more than `SEVERE_OVERRUN` times the budget's share of at
/// least `EARLY_WINDOW`. A job that does little but move pages (random sizes up to hundreds
/// of MiB) then adapts within tens of ms instead of a second; a new batch shape's burst
/// closes one such window at most, which alone raises nothing.
pub fn closes_early(window: Duration, moving: Duration, budget: f64) -> bool {
    window >= EARLY_WINDOW
        && moving >= EARLY_MOVES
        && moving.as_secs_f64() > window.as_secs_f64() * SEVERE_OVERRUN * budget
}

/// The extra slack after a window (`spans` times `MOVE_WINDOW` long) in which page moves
/// took `share` of the time, and the count of quiet windows in a row: over `budget` in this
/// window and the one before (`over_before`) it grows by `EXTRA_SLACK_STEP`, or
/// `SEVERE_EXTRA_SLACK_STEP` past `SEVERE_OVERRUN` times the budget (starting from `base`,
/// up to `MAX_EXTRA_SLACK`), so that a job adapts within a few windows; after
/// `QUIET_WINDOWS_BEFORE_DECAY` windows' worth of time under a quarter of the budget it
/// halves (to 0 below `base / 2`). One window over budget alone is a burst, not a trend:
/// bursts of growth (a new batch shape) on a slow host close windows over budget now and
/// then, and must not raise the slack for good. A budget of 0 (perhaps set at run time)
/// drops it.
pub fn next_extra_slack(
    extra: f64,
    quiet_windows: u32,
    spans: u32,
    share: f64,
    budget: f64,
    base: f64,
    over_before: bool,
) -> (f64, u32) {
    if budget == 0.0 {
        return (0.0, 0);
    }
    if share > budget {
        if !over_before {
            return (extra, 0);
        }
        let step = if share > SEVERE_OVERRUN * budget {
            SEVERE_EXTRA_SLACK_STEP
        } else {
            EXTRA_SLACK_STEP
        };
        return ((extra.max(base) * step).min(MAX_EXTRA_SLACK), 0);
    }
    if share >= budget / 4.0 || extra == 0.0 {
        return (extra, 0);
    }
    // A window closed early (`spans` 0) does not count towards the quiet spell.
    let quiet = quiet_windows.saturating_add(spans);
    if quiet < QUIET_WINDOWS_BEFORE_DECAY {
        return (extra, quiet);
    }
    let halved = extra / 2.0;
    (if halved < base / 2.0 { 0.0 } else { halved }, 0)
}
