//! Whether setting freed blocks aside for a same-size request pays: the one heuristic that
//! both the shard's parked blocks and the thread fronts apply, each with its own constants.

/// Counts blocks set aside and reused over a review period; a review that finds reuse rare
/// (a pattern of random sizes, not a loop repeating its sizes) pauses setting aside for a
/// number of frees, so that such a pattern pays nothing for it.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReuseGate {
    set_aside: u64,
    reused: u64,
    /// Frees left before setting aside resumes.
    paused: u32,
}

impl ReuseGate {
    /// Whether setting aside is paused now; each call while paused uses up one free of it.
    #[inline]
    pub fn pausing(&mut self) -> bool {
        if self.paused > 0 {
            self.paused -= 1;
            return true;
        }
        false
    }

    #[inline]
    pub fn note_set_aside(&mut self) {
        self.set_aside += 1;
    }

    #[inline]
    pub fn note_reuse(&mut self) {
        self.reused += 1;
    }

    /// Ends a review period: the counts restart, and when fewer than one in `per_reuse`
    /// blocks set aside was reused, setting aside pauses for `pause` frees. Returns whether
    /// reuse was rare.
    pub fn review(&mut self, per_reuse: u64, pause: u32) -> bool {
        let rarely = self.reused * per_reuse < self.set_aside;
        (self.set_aside, self.reused) = (0, 0);
        if rarely {
            self.paused = pause;
        }
        rarely
    }

    /// Whether a block freed now may be set aside: not while pausing, and after each
    /// `per_review` set aside, only if at least one in `per_reuse` of them was reused (else
    /// a pause of `pause` frees begins).
    pub fn may_set_aside(&mut self, per_review: u64, per_reuse: u64, pause: u32) -> bool {
        if self.pausing() {
            false
        } else if self.set_aside >= per_review {
            !self.review(per_reuse, pause)
        } else {
            true
        }
    }

    /// Whether `may_set_aside` with this `per_review` would change nothing now: no pause to
    /// count down, no review due.
    #[inline]
    pub fn is_idle(&self, per_review: u64) -> bool {
        self.paused == 0 && self.set_aside < per_review
    }

    /// Frees left before setting aside resumes.
    pub fn paused_for(&self) -> u32 {
        self.paused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rare_reuse_pauses_for_the_given_frees_and_frequent_reuse_does_not() {
        let mut gate = ReuseGate::default();
        for _ in 0..8 {
            gate.note_set_aside();
        }
        gate.note_reuse();
        assert!(gate.review(4, 3), "1 reuse in 8 set aside is rare at 4");
        assert_eq!(gate.set_aside, 0);
        assert!(gate.pausing() && gate.pausing() && gate.pausing());
        assert!(!gate.pausing(), "the pause lasts 3 frees");
        for _ in 0..8 {
            gate.note_set_aside();
        }
        gate.note_reuse();
        gate.note_reuse();
        assert!(!gate.review(4, 3), "2 in 8 is not rare");
        assert!(!gate.pausing());
    }

    #[test]
    fn a_review_comes_after_the_given_number_set_aside() {
        let mut gate = ReuseGate::default();
        for _ in 0..4 {
            assert!(gate.may_set_aside(4, 2, 10));
            gate.note_set_aside();
        }
        // 4 set aside, none reused: the review pauses setting aside for 10 frees.
        assert!(!gate.may_set_aside(4, 2, 10));
        assert_eq!(gate.paused_for(), 10);
        for _ in 0..10 {
            assert!(!gate.may_set_aside(4, 2, 10));
        }
        assert!(gate.may_set_aside(4, 2, 10));
    }
}
