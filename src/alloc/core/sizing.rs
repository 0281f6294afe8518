//! Size classes and rounding, with PyTorch's constants so fragmentation behaviour is
//! comparable. The settings that tune them come in as plain values.

/// Every block is a multiple of this; smaller requests round up to it.
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Requests up to this size come from the small pool.
pub const SMALL_SIZE: u64 = 1 << 20;
/// Small-pool segments.
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Large-pool segments for requests under `MIN_LARGE_ALLOC`.
pub const LARGE_BUFFER: u64 = 20 << 20;
/// Requests from this size get a segment of their own, rounded to `ROUND_LARGE`.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
pub const ROUND_LARGE: u64 = 2 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PoolKind {
    Small = 0,
    Large = 1,
}

impl PoolKind {
    pub fn for_size(rounded: u64) -> Self {
        if rounded <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }
}

fn round_up(value: u64, to: u64) -> u64 {
    value.div_ceil(to) * to
}

/// The block size handed out for a request of `size` bytes, with `divisions` the
/// power-of-two divisions configured for its size (`Config::roundup_power2_divisions_for`).
pub fn round_request(size: u64, divisions: u64) -> u64 {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    if divisions > 1 && size > MIN_BLOCK_SIZE.saturating_mul(divisions) {
        round_up_to_power2_division(size, divisions)
    } else {
        round_up(size, MIN_BLOCK_SIZE)
    }
}

/// Rounds up to the next of `divisions` equal steps between two powers of two, e.g. with 4
/// divisions 1200 → 1280 (steps of 256 between 1024 and 2048).
pub fn round_up_to_power2_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() || divisions < 2 {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> (63 - divisions.leading_zeros());
    if step == 0 {
        return floor << 1;
    }
    let down = size & !(step - 1);
    if down == size {
        size
    } else {
        down + step
    }
}

/// How much to ask the device for when no cached block fits a `rounded` request.
pub fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        round_up(rounded, ROUND_LARGE)
    }
}

/// Whether a block of `block_size` serving `rounded` leaves a remainder worth keeping apart.
/// Blocks of `max_split_size` or more are never split (the setting of that name).
pub fn should_split(pool: PoolKind, block_size: u64, rounded: u64, max_split_size: u64) -> bool {
    let remaining = block_size - rounded;
    match pool {
        PoolKind::Small => remaining >= MIN_BLOCK_SIZE,
        PoolKind::Large => rounded < max_split_size && remaining > SMALL_SIZE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_pytorch_constants() {
        assert_eq!(round_request(1, 0), 512);
        assert_eq!(round_request(512, 0), 512);
        assert_eq!(round_request(513, 0), 1024);
        assert_eq!(round_request(3000, 4), 3072);
        assert_eq!(segment_size(512), SMALL_BUFFER);
        assert_eq!(segment_size(SMALL_SIZE), SMALL_BUFFER);
        assert_eq!(segment_size(SMALL_SIZE + 512), LARGE_BUFFER);
        assert_eq!(segment_size(MIN_LARGE_ALLOC), MIN_LARGE_ALLOC);
        assert_eq!(
            segment_size(MIN_LARGE_ALLOC + 1),
            MIN_LARGE_ALLOC + ROUND_LARGE
        );
        assert_eq!(PoolKind::for_size(SMALL_SIZE), PoolKind::Small);
        assert_eq!(PoolKind::for_size(SMALL_SIZE + 1), PoolKind::Large);
    }

    #[test]
    fn power2_divisions_round_to_steps() {
        assert_eq!(round_up_to_power2_division(1200, 4), 1280);
        assert_eq!(round_up_to_power2_division(1024, 4), 1024);
        assert_eq!(round_up_to_power2_division(1025, 1), 1025);
        assert_eq!(
            round_up_to_power2_division((1 << 30) + 1, 8),
            (1 << 30) + (1 << 27)
        );
        assert_eq!(round_up_to_power2_division(3 << 20, 2), 3 << 20);
        assert_eq!(round_up_to_power2_division(5 << 20, 2), 6 << 20);
    }

    #[test]
    fn splitting_rules_differ_by_pool() {
        let unlimited = u64::MAX;
        assert!(should_split(PoolKind::Small, SMALL_BUFFER, 1024, unlimited));
        assert!(!should_split(PoolKind::Small, 1024, 1024, unlimited));
        assert!(should_split(
            PoolKind::Large,
            LARGE_BUFFER,
            2 << 20,
            unlimited
        ));
        assert!(!should_split(
            PoolKind::Large,
            LARGE_BUFFER,
            2 << 20,
            2 << 20
        ));
        assert!(!should_split(
            PoolKind::Large,
            (2 << 20) + SMALL_SIZE,
            2 << 20,
            unlimited
        ));
    }
}
