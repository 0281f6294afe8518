//! Allocator settings with PyTorch's key names and meanings, parsed from `key:value,key:value`
//! (the `CCALLOC_CONF` environment variable, or at run time through the C API).
#![forbid(unsafe_code)]

use crate::error::{Error, ErrorKind, Result};

const MB: u64 = 1 << 20;
/// Power-of-two intervals from 1 MiB to 64 GiB, each with its own number of divisions.
pub const ROUNDUP_INTERVALS: usize = 16;
const FIRST_INTERVAL_LOG2: u32 = 20;

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Blocks at least this large are never split; `u64::MAX` = no limit.
    pub max_split_size: u64,
    /// An oversize request may take a cached block at most this much larger than itself.
    pub max_non_split_rounding: u64,
    /// Divisions per power-of-two interval (index 0 covers sizes below 2 MiB); 0 or 1 = off.
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// Fraction (0, 1) of the memory limit above which old cached blocks are released; 0 = off.
    pub garbage_collection_threshold: f64,
    /// Fraction [0, 1] of device memory this process may reserve; `None` = all of it.
    pub per_process_memory_fraction: Option<f64>,
    /// Paged segments (virtual memory management) where the driver has it; plain device
    /// allocations otherwise or when false.
    pub expandable_segments: bool,
    /// Paged segments keep up to this share of the live bytes' high-water mark as cached
    /// pages before they move pages under free blocks (memory for time).
    pub page_slack: f64,
    /// Paged segments cache more (up to twice the live bytes) while moving pages takes more
    /// than this share of the time; 0 = never (only `page_slack`).
    pub page_move_budget: f64,
    /// Paged segments may move pages (unmap them under free blocks, map them where growth
    /// needs memory). False: growth always maps new memory, as once the move allowance is
    /// spent (reserved then settles at what the job's layouts need together, with no move
    /// and no wait for the device).
    pub page_moves: bool,
    /// A separate allocator (shard: lock, cache, statistics) per stream, so that threads on
    /// different streams never contend. The cost: pages lent between streams wait for the
    /// lender's work, and one thread's several streams keep separate caches
    /// (`design.md`, Shards). Off by default; may change only before the device's first
    /// allocation.
    pub per_stream_shards: bool,
    /// A shard of its own for a stream first used by a thread that has not allocated on
    /// the device before, when no shard holds memory of that stream: threads each on their
    /// own stream never contend, while one thread's several streams, and a stream that
    /// several threads use (PyTorch's forward and autograd threads), stay in one shard. On
    /// by default; `per_stream_shards` overrides it; may change only before the device's
    /// first allocation.
    pub thread_shards: bool,
    /// With `thread_shards`, make those shards only once threads are seen contending for the
    /// first shard's lock (`SpinThenBlock::contended_often`): until then every stream stays
    /// in the first shard, whose memory needs no lending between shards. After, as with
    /// `thread_shards`, but a thread's own stream (that of its first allocation on the
    /// device, when no other thread had used it) gets its shard at its next allocation. On
    /// by default; `False` gives a new thread's stream its shard at once. May change only
    /// before the device's first allocation.
    pub thread_shards_on_contention: bool,
    /// Each thread keeps up to 8 blocks it freed, for its next request of exactly their
    /// size and stream, and frees them without the device lock (`alloc::front`). Only with
    /// paged segments; with several shards, per shard. On by default.
    pub thread_cache: bool,
    /// Keep the breakdown of reserved memory (live bytes, free chunks, pinned pages, page
    /// rounding) at its highest since set or since peaks were reset: taken then, and right
    /// after each allocation that takes reserved higher, for
    /// `DeviceAllocator::peak_breakdown`. Off by default: each new high walks every block.
    pub record_peak_breakdown: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_split_size: u64::MAX,
            max_non_split_rounding: crate::alloc::core::sizing::LARGE_BUFFER,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: 0.0,
            per_process_memory_fraction: None,
            expandable_segments: true,
            page_slack: DEFAULT_PAGE_SLACK,
            page_move_budget: DEFAULT_PAGE_MOVE_BUDGET,
            page_moves: true,
            per_stream_shards: false,
            thread_shards: true,
            thread_shards_on_contention: true,
            thread_cache: true,
            record_peak_breakdown: false,
        }
    }
}

/// 3%: the memory target itself (issue 17: peak reserved within 3% of peak requested). The
/// slack bounds everything reserved beyond the live high-water mark (cached chunks, pinned
/// pages, page rounding), so a job whose growth may move pages ends within it; a larger
/// slack would overshoot the target, a smaller one would move pages to save memory no one
/// asked for. (Until session 27 it was 1/32, which is 1.031: over the target by itself.)
pub const DEFAULT_PAGE_SLACK: f64 = 0.03;

/// 2% of the time: keeping reserved ≈ live may cost a job about that much at most. (In
/// steady state on an H100, varlen BERT inference ran 3-5% slower than under PyTorch's own
/// allocator at reserved ≈ live, and 13% faster with a quarter more cache.) A job whose
/// moves take more gets more cache instead.
pub const DEFAULT_PAGE_MOVE_BUDGET: f64 = 0.02;

/// The keys `apply` accepts, for messages and documentation.
pub const KEYS: [&str; 14] = [
    "expandable_segments",
    "page_slack",
    "page_move_budget",
    "page_moves",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "per_process_memory_fraction",
    "per_stream_shards",
    "thread_shards",
    "thread_shards_on_contention",
    "thread_cache",
    "record_peak_breakdown",
];

fn config_error(message: String) -> Error {
    Error::new(ErrorKind::Config, message)
}

/// The most characters of a setting that an error message quotes: a setting read from the
/// environment or passed through the C API may be any length.
const QUOTED_CHARS: usize = 80;

/// `text` quoted for an error message, cut to `QUOTED_CHARS` characters.
fn quoted(text: &str) -> String {
    match text.char_indices().nth(QUOTED_CHARS) {
        None => format!("{text:?}"),
        Some((cut, _)) => format!("{:?}... ({} bytes in all)", &text[..cut], text.len()),
    }
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value {
        "True" | "true" | "1" => Ok(true),
        "False" | "false" | "0" => Ok(false),
        _ => Err(config_error(format!(
            "{key} must be True or False (got {})",
            quoted(value)
        ))),
    }
}

impl Config {
    /// Divisions that apply to a request of `size` bytes.
    pub fn roundup_power2_divisions_for(&self, size: u64) -> u64 {
        let log2 = 63 - size.max(1).leading_zeros();
        let index = log2.saturating_sub(FIRST_INTERVAL_LOG2) as usize;
        self.roundup_power2_divisions[index.min(ROUNDUP_INTERVALS - 1)]
    }

    /// Reads `CCALLOC_CONF` on top of the defaults.
    pub fn from_env() -> Result<Self> {
        let mut config = Self::default();
        if let Ok(text) = std::env::var("CCALLOC_CONF") {
            config
                .apply(&text)
                .map_err(|e| config_error(format!("CCALLOC_CONF: {}", e.message)))?;
        }
        Ok(config)
    }

    /// Applies `key:value,key:value`; on any error nothing is changed.
    pub fn apply(&mut self, text: &str) -> Result<()> {
        let mut next = self.clone();
        for item in split_items(text)? {
            let (key, value) = item.split_once(':').ok_or_else(|| {
                config_error(format!(
                    "{} is not key:value (keys: {})",
                    quoted(item),
                    KEYS.join(", ")
                ))
            })?;
            next.set(key.trim(), value.trim())?;
        }
        *self = next;
        Ok(())
    }

    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "max_split_size_mb" => {
                self.max_split_size = parse_megabytes_at_least_large_buffer(key, value)?;
            }
            "max_non_split_rounding_mb" => {
                self.max_non_split_rounding = parse_megabytes_at_least_large_buffer(key, value)?;
            }
            "garbage_collection_threshold" => {
                let t = parse_number::<f64>(key, value)?;
                if !(t > 0.0 && t < 1.0) {
                    return Err(config_error(format!(
                        "garbage_collection_threshold must be between 0 and 1, exclusive (got {})",
                        quoted(value)
                    )));
                }
                self.garbage_collection_threshold = t;
            }
            "per_process_memory_fraction" => {
                self.per_process_memory_fraction = Some(parse_within(key, value, 1.0, "")?);
            }
            "roundup_power2_divisions" => self.set_roundup(value)?,
            "page_slack" => {
                self.page_slack = parse_within(key, value, 16.0, "a share of peak live bytes; ")?;
            }
            "page_move_budget" => {
                self.page_move_budget = parse_within(key, value, 1.0, "a share of the time; ")?;
            }
            "page_moves" => self.page_moves = parse_bool(key, value)?,
            "expandable_segments" => self.expandable_segments = parse_bool(key, value)?,
            "per_stream_shards" => self.per_stream_shards = parse_bool(key, value)?,
            "thread_shards" => self.thread_shards = parse_bool(key, value)?,
            "thread_shards_on_contention" => {
                self.thread_shards_on_contention = parse_bool(key, value)?
            }
            "thread_cache" => self.thread_cache = parse_bool(key, value)?,
            "record_peak_breakdown" => self.record_peak_breakdown = parse_bool(key, value)?,
            _ => {
                return Err(config_error(format!(
                    "unknown config key {} (known keys: {})",
                    quoted(key),
                    KEYS.join(", ")
                )))
            }
        }
        Ok(())
    }

    /// `4` (every interval) or `[256:1,512:2,>:8]`: a key is a size in MiB (a power of two)
    /// naming its interval; earlier intervals take the first value; `>` covers all after the last.
    fn set_roundup(&mut self, value: &str) -> Result<()> {
        let Some(list) = value.strip_prefix('[') else {
            let d = parse_divisions(value)?;
            if d == 0 {
                return Err(config_error(
                    "roundup_power2_divisions: a single value must be a power of two (0 only inside [...])".into(),
                ));
            }
            self.roundup_power2_divisions = [d; ROUNDUP_INTERVALS];
            return Ok(());
        };
        let list = list.strip_suffix(']').ok_or_else(|| {
            config_error(format!(
                "roundup_power2_divisions: missing ']' in {}",
                quoted(value)
            ))
        })?;
        let mut table = [0u64; ROUNDUP_INTERVALS];
        // Intervals are named in increasing order, each once, `>` last: a table whose entries
        // overlapped or came out of order would mean whichever came last, silently.
        let mut last: Option<usize> = None;
        let mut rest_given = false;
        for entry in list.split(',') {
            let (size, divisions) = entry.split_once(':').ok_or_else(|| {
                config_error(format!(
                    "roundup_power2_divisions: {} is not SIZE_MB:DIVISIONS or >:DIVISIONS",
                    quoted(entry)
                ))
            })?;
            if rest_given {
                return Err(config_error(format!(
                    "roundup_power2_divisions: '>' must be the last entry (found {} after it)",
                    quoted(entry)
                )));
            }
            let divisions = parse_divisions(divisions.trim())?;
            let size = size.trim();
            if size == ">" {
                let from = last.map_or(0, |i| i + 1);
                table[from..].fill(divisions);
                rest_given = true;
                continue;
            }
            let mb = parse_number::<u64>("roundup_power2_divisions", size)?;
            if !mb.is_power_of_two() {
                return Err(config_error(format!(
                    "roundup_power2_divisions: interval key {mb} must be a power of two (MiB)"
                )));
            }
            let index = (mb.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
            if last.is_some_and(|l| index <= l) {
                let top = 1u64 << (ROUNDUP_INTERVALS - 1);
                return Err(config_error(format!(
                    "roundup_power2_divisions: interval keys must increase, each interval named once ({mb} MiB after {} MiB; keys from {top} MiB up all name the last interval)",
                    1u64 << last.expect("checked")
                )));
            }
            if last.is_none() {
                table[..index].fill(divisions);
            }
            table[index] = divisions;
            last = Some(index);
        }
        self.roundup_power2_divisions = table;
        Ok(())
    }
}

/// The settings as `key:value,...` that `apply` reads back to this config (from the
/// defaults): keys at a value no setting names (no size limit, no garbage collection, no
/// memory fraction) are left out.
impl std::fmt::Display for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let yes_no = |b: bool| if b { "True" } else { "False" };
        write!(
            f,
            "expandable_segments:{},page_slack:{},page_move_budget:{},per_stream_shards:{},thread_shards:{},thread_shards_on_contention:{},thread_cache:{}",
            yes_no(self.expandable_segments),
            self.page_slack,
            self.page_move_budget,
            yes_no(self.per_stream_shards),
            yes_no(self.thread_shards),
            yes_no(self.thread_shards_on_contention),
            yes_no(self.thread_cache),
        )?;
        if self.record_peak_breakdown {
            write!(f, ",record_peak_breakdown:True")?;
        }
        if !self.page_moves {
            write!(f, ",page_moves:False")?;
        }
        if self.max_split_size != u64::MAX {
            write!(f, ",max_split_size_mb:{}", self.max_split_size / MB)?;
        }
        write!(
            f,
            ",max_non_split_rounding_mb:{}",
            self.max_non_split_rounding / MB
        )?;
        if self.garbage_collection_threshold > 0.0 {
            write!(
                f,
                ",garbage_collection_threshold:{}",
                self.garbage_collection_threshold
            )?;
        }
        if let Some(fraction) = self.per_process_memory_fraction {
            write!(f, ",per_process_memory_fraction:{fraction}")?;
        }
        // Every interval by its key (2^i MiB), the last as '>'.
        f.write_str(",roundup_power2_divisions:[")?;
        for (i, d) in self.roundup_power2_divisions.iter().enumerate() {
            if i + 1 < ROUNDUP_INTERVALS {
                write!(f, "{}:{d},", 1u64 << i)?;
            } else {
                write!(f, ">:{d}]")?;
            }
        }
        Ok(())
    }
}

/// PyTorch (2.9+) refuses sizes under its 20 MiB large-segment size for both MiB keys.
fn parse_megabytes_at_least_large_buffer(key: &str, value: &str) -> Result<u64> {
    let mb = parse_number::<u64>(key, value)?;
    let floor = crate::alloc::core::sizing::LARGE_BUFFER / MB;
    if mb < floor {
        return Err(config_error(format!("{key} must be >= {floor} (got {mb})")));
    }
    mb.checked_mul(MB).ok_or_else(|| {
        config_error(format!(
            "{key} must be under {} (got {mb}): larger than any device",
            u64::MAX / MB + 1
        ))
    })
}

/// The most `roundup_power2_divisions` a setting may name.
const MAX_DIVISIONS: u64 = 1 << 16;

fn parse_divisions(text: &str) -> Result<u64> {
    let d = parse_number::<u64>("roundup_power2_divisions", text)?;
    if d != 0 && !d.is_power_of_two() {
        return Err(config_error(format!(
            "roundup_power2_divisions: divisions must be a power of two or 0 (got {d})"
        )));
    }
    // Beyond this a step between two powers of two falls under a byte for every size a
    // device can hold: nothing left to round.
    if d > MAX_DIVISIONS {
        return Err(config_error(format!(
            "roundup_power2_divisions: at most {MAX_DIVISIONS} divisions (got {d})"
        )));
    }
    Ok(d)
}

/// A number within `[0, max]`; `meaning` leads the parenthesis of the error message.
fn parse_within(key: &str, value: &str, max: f64, meaning: &str) -> Result<f64> {
    let f = parse_number::<f64>(key, value)?;
    if !(0.0..=max).contains(&f) {
        return Err(config_error(format!(
            "{key} must be within [0, {max}] ({meaning}got {})",
            quoted(value)
        )));
    }
    // -0 reads as 0, as PyTorch's `std::stod` gives a -0.0 that its checks treat as 0;
    // kept as +0.0 so that no setting reads back as "-0".
    Ok(if f == 0.0 { 0.0 } else { f })
}

/// A number written without a '+' (Rust's parsers accept one; a setting is plain digits,
/// or for fractions a minus sign that the range check then refuses).
fn parse_number<T: std::str::FromStr>(key: &str, text: &str) -> Result<T> {
    if text.starts_with('+') {
        return Err(config_error(format!(
            "{key}: {} is not a valid number (no '+' sign)",
            quoted(text)
        )));
    }
    text.parse::<T>()
        .map_err(|_| config_error(format!("{key}: {} is not a valid number", quoted(text))))
}

/// Splits on commas outside brackets.
fn split_items(text: &str) -> Result<Vec<&str>> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in text.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if depth < 0 {
            return Err(config_error(format!("unbalanced ']' in {}", quoted(text))));
        }
    }
    if depth != 0 {
        return Err(config_error(format!("unbalanced '[' in {}", quoted(text))));
    }
    items.push(&text[start..]);
    Ok(items
        .into_iter()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_key() {
        let mut c = Config::default();
        c.apply("max_split_size_mb:256, max_non_split_rounding_mb:64,garbage_collection_threshold:0.6,per_process_memory_fraction:0.5,roundup_power2_divisions:4,expandable_segments:False,page_slack:0.25,page_move_budget:0.5,page_moves:False")
            .unwrap();
        assert!(!c.page_moves);
        assert_eq!(c.page_slack, 0.25);
        assert_eq!(c.page_move_budget, 0.5);
        assert_eq!(c.max_split_size, 256 * MB);
        assert_eq!(c.max_non_split_rounding, 64 * MB);
        assert_eq!(c.garbage_collection_threshold, 0.6);
        assert_eq!(c.per_process_memory_fraction, Some(0.5));
        assert_eq!(c.roundup_power2_divisions, [4; ROUNDUP_INTERVALS]);
        assert!(!c.expandable_segments);
    }

    #[test]
    fn bracket_form_fills_intervals() {
        let mut c = Config::default();
        c.apply("roundup_power2_divisions:[256:1,512:2,>:8],max_split_size_mb:100")
            .unwrap();
        assert_eq!(c.roundup_power2_divisions_for(1 << 20), 1);
        assert_eq!(c.roundup_power2_divisions_for(300 << 20), 1);
        assert_eq!(c.roundup_power2_divisions_for(600 << 20), 2);
        assert_eq!(c.roundup_power2_divisions_for(2 << 30), 8);
        assert_eq!(c.roundup_power2_divisions_for(1 << 40), 8);
        assert_eq!(c.max_split_size, 100 * MB);
    }

    /// Past 65,536 divisions nothing is left to round: refused, in either form, rather than
    /// overflowing where sizes are rounded.
    #[test]
    fn divisions_are_bounded() {
        for text in [
            "roundup_power2_divisions:131072",
            "roundup_power2_divisions:[>:36028797018963968]",
        ] {
            let err = Config::default().apply(text).unwrap_err();
            assert!(err.message.contains("at most 65536"), "{text}: {err}");
        }
        let mut c = Config::default();
        c.apply("roundup_power2_divisions:65536").unwrap();
        assert_eq!(crate::alloc::sizing::round_size(1 << 30, &c), 1 << 30);
    }

    #[test]
    fn errors_name_the_key_and_change_nothing() {
        let mut c = Config::default();
        for (bad, needle) in [
            ("max_split_size_mb:10", "max_split_size_mb"),
            ("max_non_split_rounding_mb:19", "max_non_split_rounding_mb"),
            ("roundup_power2_divisions:0", "single value"),
            ("max_split_size_mb:ten", "max_split_size_mb"),
            (
                "garbage_collection_threshold:1.5",
                "garbage_collection_threshold",
            ),
            (
                "per_process_memory_fraction:-0.1",
                "per_process_memory_fraction",
            ),
            ("roundup_power2_divisions:3", "power of two"),
            ("roundup_power2_divisions:[300:2]", "power of two"),
            ("roundup_power2_divisions:[512:2,256:1]", "increase"),
            ("roundup_power2_divisions:[256:1", "'['"),
            ("expandable_segments_typo:True", "expandable_segments_typo"),
            ("max_split_size_mb", "key:value"),
            ("expandable_segments:maybe", "expandable_segments"),
            ("page_slack:-1", "page_slack"),
            ("page_slack:lots", "page_slack"),
            ("page_move_budget:1.5", "page_move_budget"),
            (
                "max_non_split_rounding_mb:17592186044416",
                "larger than any device",
            ),
            (
                "max_split_size_mb:18446744073709551615",
                "larger than any device",
            ),
        ] {
            let err = c
                .apply(&format!("max_non_split_rounding_mb:70,{bad}"))
                .unwrap_err();
            assert_eq!(err.kind, ErrorKind::Config);
            assert!(err.message.contains(needle), "{bad}: {}", err.message);
            assert_eq!(c, Config::default(), "{bad} changed the config");
        }
    }

    /// -0 is 0: PyTorch reads these numbers with `std::stod`, whose -0.0 behaves as 0 and
    /// passes its range checks; ccalloc keeps +0.0 so that nothing reports a negative zero.
    #[test]
    fn negative_zero_is_zero() {
        let mut c = Config::default();
        c.apply("per_process_memory_fraction:-0,page_slack:-0.0,page_move_budget:-0")
            .unwrap();
        for v in [
            c.per_process_memory_fraction.unwrap(),
            c.page_slack,
            c.page_move_budget,
        ] {
            assert!(v == 0.0 && v.is_sign_positive(), "{v}");
        }
    }

    #[test]
    fn signs_overlaps_and_disorder_are_refused() {
        for (bad, needle) in [
            ("max_split_size_mb:+100", "+100"),
            ("per_process_memory_fraction:+0.5", "+0.5"),
            ("roundup_power2_divisions:+4", "+4"),
            ("roundup_power2_divisions:[256:4,256:8]", "increase"),
            ("roundup_power2_divisions:[1024:4,256:8]", "increase"),
            ("roundup_power2_divisions:[256:4,>:2,512:8]", "last"),
            ("roundup_power2_divisions:[>:2,>:8]", "last"),
            ("roundup_power2_divisions:[32768:4,65536:8]", "65536"),
        ] {
            let mut c = Config::default();
            let err = c.apply(bad).unwrap_err();
            assert_eq!(err.kind, ErrorKind::Config);
            assert!(err.message.contains(needle), "{bad}: {}", err.message);
            assert_eq!(c, Config::default());
        }
    }

    /// A bad setting is quoted in its error, but at most about 80 characters of it.
    #[test]
    fn long_input_is_cut_in_messages() {
        let long = "x".repeat(50 << 20);
        for text in [
            long.clone(),
            format!("max_split_size_mb:{long}"),
            format!("expandable_segments:{long}"),
            format!("roundup_power2_divisions:[{long}"),
            format!("roundup_power2_divisions:[{long}]"),
            format!("{long}]"),
            format!("{long}:1"),
            format!("page_slack:{long}"),
        ] {
            let err = Config::default().apply(&text).unwrap_err();
            assert!(err.message.len() < 450, "{} bytes", err.message.len());
            assert!(err.message.contains("xxxx"), "{}", err.message);
        }
    }

    #[test]
    fn display_reads_back() {
        let mut c = Config::default();
        assert_eq!(Config::default().apply(&c.to_string()).map(|_| ()), Ok(()));
        c.apply("max_split_size_mb:256,garbage_collection_threshold:0.6,per_process_memory_fraction:0.25,roundup_power2_divisions:[4:2,>:8],page_slack:0.1,per_stream_shards:True,thread_cache:False,expandable_segments:False,page_moves:False")
            .unwrap();
        let mut back = Config::default();
        back.apply(&c.to_string()).unwrap();
        assert_eq!(back, c, "{c}");
    }
}
