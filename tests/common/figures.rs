//! A model of the statistics a thread front moves (allocation count, allocated bytes,
//! requested bytes), shared by the fronts' property tests.

use ccalloc::DeviceStats;

const MIB: u64 = 1 << 20;

/// A request's size as blocks round it (512 bytes).
pub fn rounded(size: u64) -> u64 {
    size.max(1).div_ceil(512) * 512
}

/// The pool index in the statistics of a request of `size`: 1 small (rounded to at most
/// 1 MiB), 2 large.
pub fn pool_of(size: u64) -> usize {
    if rounded(size) <= MIB {
        1
    } else {
        2
    }
}

/// Per statistic (0 count, 1 allocated bytes, 2 requested bytes) and pool (all, small,
/// large): current and peak, and the current values at the last reset of the totals.
#[derive(Clone, Copy, Default, Debug)]
pub struct PoolFigures {
    pub current: [[i64; 3]; 3],
    pub peak: [[i64; 3]; 3],
    /// `current` at the last `reset_accumulated_stats`: the totals count from there.
    pub current_at_reset: [[i64; 3]; 3],
    /// Requested bytes are not modelled while freed blocks wait for another stream's events
    /// (they leave when the shard next sees them done).
    pub requested_unknown: bool,
}

impl PoolFigures {
    /// A block of `block` bytes for a request of `size` handed out (`sign` 1) or taken back
    /// (-1): the listed statistics change.
    pub fn change(&mut self, size: u64, block: u64, sign: i64, stats: &[usize]) {
        let amounts = [1, block as i64, size as i64];
        for &stat in stats {
            for index in [0, pool_of(size)] {
                self.current[stat][index] += sign * amounts[stat];
                let now = self.current[stat][index];
                let peak = &mut self.peak[stat][index];
                *peak = (*peak).max(now);
            }
        }
    }

    pub fn reset_peaks(&mut self) {
        self.peak = self.current;
    }

    /// After `reset_accumulated_stats`: the totals count from the allocator's figures now
    /// (`s`; they include requested bytes still awaiting events, which the model cannot know).
    pub fn reset_totals(&mut self, s: &DeviceStats) {
        for (stat, array) in [s.allocation, s.allocated_bytes, s.requested_bytes]
            .iter()
            .enumerate()
        {
            self.current_at_reset[stat] = array.0.map(|got| got.current);
        }
    }

    /// `s` agrees with the model in every pool: current, peak, and the totals since the last
    /// reset (requested bytes only while known).
    pub fn check(&self, s: &DeviceStats, what: &str) {
        for (stat, array) in [s.allocation, s.allocated_bytes, s.requested_bytes]
            .iter()
            .enumerate()
        {
            if stat == 2 && self.requested_unknown {
                continue;
            }
            for index in 0..3 {
                let got = array.0[index];
                assert_eq!(
                    (got.current, got.peak),
                    (self.current[stat][index], self.peak[stat][index]),
                    "after {what}: statistic {stat} (0 count, 1 bytes, 2 requested), pool \
                     {index}: {s:?}"
                );
                let since = got.current - self.current_at_reset[stat][index];
                assert_eq!(
                    got.allocated - got.freed,
                    since,
                    "after {what}: totals of {stat}, pool {index}"
                );
            }
        }
    }
}
