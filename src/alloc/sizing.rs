//! Size classes as the rest of the crate uses them: `core::sizing`, and the rounding of a
//! request under a `Config`.

pub use super::core::sizing::*;
use crate::config::Config;

/// The block size handed out for a request of `size` bytes under `config`.
pub fn round_size(size: u64, config: &Config) -> u64 {
    round_request(size, config.roundup_power2_divisions_for(size))
}
