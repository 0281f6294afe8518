//! What reserved memory is made of at the growth that set a replay's peak: live bytes, and
//! the excess split into what a paging policy can act on (`ccalloc replay --breakdown`).

use crate::alloc::DeviceAllocator;
use crate::error::Result;
use crate::BlockState;
use serde::Serialize;

/// The excess of reserved over live bytes at one moment, by cause. Paged segments only:
/// memory of plain segments counts as `plain`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PeakBreakdown {
    pub reserved_bytes: u64,
    pub live_bytes: u64,
    /// Mapped chunks holding no live byte: cached memory a later growth may move.
    pub free_chunk_bytes: u64,
    /// Whole pages without a live byte inside chunks that hold some: kept because a chunk is
    /// unmapped only whole.
    pub pinned_bytes: u64,
    /// Chunks with pinned pages.
    pub pinning_chunks: u64,
    /// The free part of pages that hold some live bytes (2 MiB granularity).
    pub rounding_bytes: u64,
    /// Reserved but unmapped: chunks parked for later growth.
    pub parked_bytes: u64,
    /// Segments that are not paged (mapped whole), less their live bytes.
    pub plain_bytes: u64,
}

/// The breakdown of `a`'s memory now, `reserved_bytes` reserved, paged segments mapping
/// pages of `page` bytes.
pub fn breakdown(a: &DeviceAllocator, reserved_bytes: u64, page: u64) -> Result<PeakBreakdown> {
    let segments = a.segments()?;
    let mut b = PeakBreakdown {
        reserved_bytes,
        ..PeakBreakdown::default()
    };
    let mut mapped = 0u64;
    for seg in &segments {
        let live: Vec<(u64, u64)> = seg
            .blocks
            .iter()
            .filter(|&&(_, _, state)| state != BlockState::Free)
            .map(|&(addr, size, _)| (addr, size))
            .collect();
        let live_total: u64 = live.iter().map(|l| l.1).sum();
        b.live_bytes += live_total;
        let Some(chunks) = &seg.chunks else {
            b.plain_bytes += seg.size - live_total;
            mapped += seg.size;
            continue;
        };
        for &(start, len) in chunks {
            mapped += len;
            let mut live_pages = 0;
            let mut live_bytes = 0;
            for p in (start..start + len).step_by(page as usize) {
                let on_page = overlap(&live, p, p + page);
                live_pages += (on_page > 0) as u64;
                live_bytes += on_page;
            }
            if live_pages == 0 {
                b.free_chunk_bytes += len;
            } else {
                let pinned = len - live_pages * page;
                b.pinned_bytes += pinned;
                b.pinning_chunks += (pinned > 0) as u64;
                b.rounding_bytes += live_pages * page - live_bytes;
            }
        }
    }
    b.parked_bytes = reserved_bytes.saturating_sub(mapped);
    Ok(b)
}

/// Bytes of the blocks `live` (sorted by address, disjoint) inside `[start, end)`.
fn overlap(live: &[(u64, u64)], start: u64, end: u64) -> u64 {
    let first = live.partition_point(|&(addr, size)| addr + size <= start);
    live[first..]
        .iter()
        .take_while(|&&(addr, _)| addr < end)
        .map(|&(addr, size)| (addr + size).min(end) - addr.max(start))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_counts_only_the_bytes_inside() {
        let live = [(0, 10), (20, 10), (40, 100)];
        assert_eq!(overlap(&live, 5, 25), 10);
        assert_eq!(overlap(&live, 30, 40), 0);
        assert_eq!(overlap(&live, 100, 200), 40);
    }
}
