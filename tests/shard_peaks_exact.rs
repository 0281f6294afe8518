//! Exact device peaks with several shards, at the places the peak book changes: each
//! shard's copy of what the book assigned it (`State::book_assigned`, which lets
//! `settle_lifts` skip the book when the named shard shows no ceiling above it), givers,
//! bonuses, reads, resets, fronts and restores. Every test computes the device's true peaks (the high-water mark
//! of the sum over shards) from its own calls and compares them with `stats()`.
#![cfg(feature = "sim")]

mod common;

use ccalloc::{DeviceAllocator, StreamId};
use common::live::CappedChurn;
use common::{sim_allocator, xorshift};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);
const S3: StreamId = StreamId(3);

fn sharded(conf: &str) -> Arc<DeviceAllocator> {
    sim_allocator(
        1 << 30,
        format!("per_stream_shards:True,{conf}").trim_end_matches(','),
    )
    .1
}

/// The live blocks and bytes a test has handed out, and their high-water marks since the
/// last peak reset.
struct Model {
    live: Vec<(u64, u64, StreamId)>,
    bytes: u64,
    peak_bytes: u64,
    peak_blocks: usize,
    /// False once a block recorded on another stream was freed: its requested bytes leave
    /// the count only when that stream's work completes (as PyTorch's `free_block`), so
    /// only live blocks are checked from then on.
    requested_known: bool,
}

impl Default for Model {
    fn default() -> Self {
        Self {
            live: Vec::new(),
            bytes: 0,
            peak_bytes: 0,
            peak_blocks: 0,
            requested_known: true,
        }
    }
}

impl Model {
    fn malloc(&mut self, a: &DeviceAllocator, size: u64, stream: StreamId) -> u64 {
        let p = a.malloc(size, stream).unwrap();
        self.live.push((p, size, stream));
        self.bytes += size;
        self.peak_bytes = self.peak_bytes.max(self.bytes);
        self.peak_blocks = self.peak_blocks.max(self.live.len());
        p
    }

    fn free_at(&mut self, a: &DeviceAllocator, i: usize, on_stream: bool) {
        let (p, size, stream) = self.live.swap_remove(i);
        if on_stream {
            a.free_on(p, stream).unwrap();
        } else {
            a.free(p).unwrap();
        }
        self.bytes -= size;
    }

    fn free(&mut self, a: &DeviceAllocator, p: u64) {
        let i = self.live.iter().position(|e| e.0 == p).unwrap();
        self.free_at(a, i, false);
    }

    fn reset(&mut self, a: &DeviceAllocator) {
        a.reset_peak_stats().unwrap();
        self.peak_bytes = self.bytes;
        self.peak_blocks = self.live.len();
    }

    /// Requested bytes and live blocks, current and peak, against the statistics.
    fn check(&self, a: &DeviceAllocator, what: &str) {
        let s = a.stats().unwrap();
        assert_eq!(
            s.allocation.all().current as usize,
            self.live.len(),
            "{what}: live blocks now"
        );
        if self.requested_known {
            assert_eq!(
                s.requested_bytes.all().current as u64,
                self.bytes,
                "{what}: requested bytes now"
            );
            assert_eq!(
                s.requested_bytes.all().peak as u64,
                self.peak_bytes,
                "{what}: peak requested bytes"
            );
        }
        assert_eq!(
            s.allocation.all().peak as usize,
            self.peak_blocks,
            "{what}: peak live blocks"
        );
    }

    /// With sizes that are whole MiB of the large pool, allocated bytes equal requested.
    fn check_allocated(&self, a: &DeviceAllocator, what: &str) {
        let s = a.stats().unwrap();
        assert_eq!(
            s.allocated_bytes.all().peak as u64,
            self.peak_bytes,
            "{what}: peak allocated bytes"
        );
    }

    fn free_all(&mut self, a: &DeviceAllocator) {
        while !self.live.is_empty() {
            self.free_at(a, 0, false);
        }
    }
}

/// The bonus site: the lifter's book entry and copy rise by half the giver's remaining
/// headroom. Rising into the bonus settles nothing; rising past it must.
/// Stream 2 lifts 4 MiB past its 10, stream 1 (idle, 10 MiB of spare) gives 4 + 3: stream 2
/// may then reach 17 MiB, stream 1 3 MiB. Stream 2 at 17 (no lift) and stream 1 at 4 take the
/// device to 21 MiB.
#[test]
fn rising_into_a_bonus_and_then_past_the_givers_lowered_ceiling() {
    let a = sharded("thread_cache:False");
    let mut m = Model::default();
    let first = m.malloc(&a, 10 * MIB, S1);
    m.malloc(&a, 10 * MIB, S2); // 20
    m.free(&a, first); // 10
    m.malloc(&a, 4 * MIB, S2); // 14: lifted, bonus of 3 MiB
    m.malloc(&a, 3 * MIB, S2); // 17: in the bonus
    m.malloc(&a, 4 * MIB, S1); // 21: past stream 1's 3 MiB
    m.check(&a, "bonus");
    m.check_allocated(&a, "bonus");
    m.free_all(&a);
}

/// The second shard's setup: the first shard's peaks become its book entry and copy. A
/// lift on the first shard up to its old peak is no new high, one past it is.
#[test]
fn the_first_shard_keeps_its_peak_as_its_ceiling_when_a_second_comes() {
    let a = sharded("thread_cache:False");
    let mut m = Model::default();
    let p = m.malloc(&a, 10 * MIB, S1);
    m.free(&a, p); // first shard: peak 10, now 0
    m.malloc(&a, 4 * MIB, S2); // second shard made, lifts 4 MiB: first gives 4 + 3
    m.malloc(&a, 5 * MIB, S1); // 9
    m.malloc(&a, MIB, S1); // 10
    m.check(&a, "at the old peak");
    m.malloc(&a, MIB, S1); // 11: new high
    m.check(&a, "past the old peak");
    m.check_allocated(&a, "past the old peak");
    m.free_all(&a);
}

/// Alternating lifts between three shards, each settled by the lifter with the others
/// giving: the copy must follow each giver's lowering, so each later lift of a giver
/// reaches the book.
#[test]
fn lifts_alternating_over_three_shards_track_the_true_high() {
    let a = sharded("thread_cache:False");
    let mut m = Model::default();
    let streams = [S1, S2, S3];
    // A seesaw: each round, one stream frees its blocks and another rises.
    let mut held: Vec<Vec<u64>> = vec![Vec::new(); 3];
    for round in 0..30usize {
        let up = round % 3;
        let down = (round * 7 + 1) % 3;
        for p in held[down].drain(..) {
            m.free(&a, p);
        }
        for k in 0..(1 + round % 4) {
            let size = MIB * (1 + ((round + k) % 5) as u64);
            held[up].push(m.malloc(&a, size, streams[up]));
        }
        if round % 5 == 4 {
            m.check(&a, &format!("round {round}"));
            m.check_allocated(&a, &format!("round {round}"));
        }
    }
    m.check(&a, "end");
    m.check_allocated(&a, "end");
    m.free_all(&a);
}

/// A read lowers every ceiling to an equal share: then lifts on each shard in turn, each
/// staying under the old ceilings but summing past the peak.
#[test]
fn lifts_in_turn_after_a_read_sum_past_the_peak() {
    let a = sharded("thread_cache:False");
    let mut m = Model::default();
    let p1 = m.malloc(&a, 12 * MIB, S1);
    let p2 = m.malloc(&a, 2 * MIB, S2);
    let p3 = m.malloc(&a, 2 * MIB, S3); // 16
    m.free(&a, p1);
    m.free(&a, p2);
    m.free(&a, p3);
    m.check(&a, "idle"); // ceilings 16/3 each, about 5.3 MiB
    m.malloc(&a, 5 * MIB, S1);
    m.malloc(&a, 5 * MIB, S2);
    m.malloc(&a, 5 * MIB, S3); // 15
    m.malloc(&a, 2 * MIB, S1); // 17
    m.check(&a, "past");
    m.check_allocated(&a, "past");
    m.free_all(&a);
}

/// A reset, then a giver that lifts in the same settle pass as another shard.
#[test]
fn resets_between_lifts_on_two_shards() {
    let a = sharded("thread_cache:False");
    let mut m = Model::default();
    let p = m.malloc(&a, 8 * MIB, S1);
    let q = m.malloc(&a, 8 * MIB, S2);
    m.free(&a, p);
    m.reset(&a); // peak 8 (stream 2's)
    m.malloc(&a, 3 * MIB, S1); // 11
    m.free(&a, q); // 3
    m.reset(&a); // 3
    m.malloc(&a, 2 * MIB, S2); // 5
    m.malloc(&a, 2 * MIB, S1); // 7
    m.check(&a, "after two resets");
    m.check_allocated(&a, "after two resets");
    m.free_all(&a);
}

/// Random single-thread sequences on several streams, with reads, resets, cache releases,
/// snapshots, `free_on`, `record_stream` and thread fronts: the peaks of requested bytes
/// and live blocks must be the high-water marks of the calls' own counts at every read.
#[test]
fn random_single_thread_sequences_keep_exact_peaks() {
    let confs = [
        "per_stream_shards:True,thread_cache:False",
        "per_stream_shards:True",
    ];
    for (conf, with_records) in confs.iter().flat_map(|c| [(*c, false), (*c, true)]) {
        for (seed, read_every) in [(1u64, 0u64), (2, 1), (3, 5), (4, 13), (5, 3)] {
            let (_sim, a) = sim_allocator(8 << 30, conf);
            let mut next = xorshift(0x9E37_79B9_7F4A_7C15 ^ seed.wrapping_mul(0x1234_5678_9ABC));
            let sizes = [512, 4096, 65_536, 100_000, MIB, 3 * MIB + 512, 12 * MIB];
            let mut m = Model::default();
            for step in 0..3000u64 {
                let what = format!(
                    "{conf}, records {with_records}, seed {seed}, read every {read_every}, \
                     step {step}"
                );
                let r = next() % 1000;
                let grow = m.live.is_empty() || r < 520 - (m.live.len() as u64 * 4).min(400);
                if grow {
                    let size = sizes[(next() % sizes.len() as u64) as usize];
                    let stream = StreamId(1 + next() % 4);
                    m.malloc(&a, size, stream);
                } else if r < 900 {
                    let i = (next() % m.live.len() as u64) as usize;
                    m.free_at(&a, i, next().is_multiple_of(3));
                } else if r < 920 {
                    // Used on another stream too, then freed: awaits that stream's work.
                    let i = (next() % m.live.len() as u64) as usize;
                    let other = StreamId(1 + next() % 4);
                    let other = if with_records { other } else { m.live[i].2 };
                    a.record_stream(m.live[i].0, other).unwrap();
                    if other != m.live[i].2 {
                        m.requested_known = false;
                    }
                    m.free_at(&a, i, false);
                } else if r < 935 {
                    m.reset(&a);
                } else if r < 950 {
                    a.empty_cache().unwrap();
                } else if r < 965 {
                    a.segments().unwrap();
                } else if r < 980 {
                    a.largest_free_block().unwrap();
                } else {
                    m.check(&a, &what);
                }
                if read_every > 0 && step % read_every == 0 {
                    m.check(&a, &what);
                }
            }
            m.check(&a, &format!("{conf}, seed {seed}: end"));
            m.free_all(&a);
        }
    }
}

/// Same-size loops through thread fronts on two streams, held blocks and all: the shard
/// holding blocks lifts past its ceiling only after its drain (`settle_front_peaks`), and
/// the device's peaks must count live blocks only.
#[test]
fn front_loops_on_two_streams_keep_exact_peaks() {
    let a = sharded("");
    let mut m = Model::default();
    let warm = m.malloc(&a, 4096, S2);
    m.free(&a, warm);
    for round in 0..200u64 {
        let (mine, other) = if round % 2 == 0 { (S1, S2) } else { (S2, S1) };
        let n = 1 + round % 6;
        let mut ps = Vec::new();
        for k in 0..n {
            ps.push(m.malloc(&a, 256 * 1024 * (1 + k % 2), mine));
        }
        if round % 7 == 0 {
            m.malloc(&a, 512 * 1024, other);
        }
        for p in ps.into_iter().rev() {
            m.free(&a, p);
        }
        if round % 11 == 0 {
            m.check(&a, &format!("round {round}"));
        }
        if round % 37 == 0 {
            m.reset(&a);
        }
    }
    m.check(&a, "end");
    m.free_all(&a);
}

/// Thread shards (the default): threads run one at a time, each new to the device on its
/// own stream, so each gets a shard; blocks are freed by other threads (the free settles
/// the shard that had them). The peaks are the high of the sum.
#[test]
fn threads_taking_turns_on_their_own_shards_keep_exact_peaks() {
    let (_sim, a) = sim_allocator(
        8 << 30,
        "thread_shards_on_contention:False,thread_cache:False",
    );
    let model = Arc::new(std::sync::Mutex::new(Model::default()));
    for t in 0..6u64 {
        let (a, model) = (a.clone(), model.clone());
        std::thread::spawn(move || {
            let mut m = model.lock().unwrap();
            let stream = StreamId(10 + t);
            let mut next = xorshift(0xABCD_EF01 + t);
            // Frees some of the earlier threads' blocks (another shard), then allocates.
            for _ in 0..(m.live.len() / 2) {
                let i = (next() % m.live.len() as u64) as usize;
                m.free_at(&a, i, false);
            }
            for k in 0..(3 + t) {
                m.malloc(&a, MIB * (1 + (k + t) % 4), stream);
            }
            if t % 2 == 1 {
                m.check(&a, &format!("thread {t}"));
                m.check_allocated(&a, &format!("thread {t}"));
            }
            if t == 3 {
                m.reset(&a);
            }
        })
        .join()
        .unwrap();
    }
    let mut m = model.lock().unwrap();
    assert!(a.shards_made() > 1);
    m.check(&a, "end");
    m.check_allocated(&a, "end");
    m.free_all(&a);
}

/// One random sequence on four streams (records, resets, cache releases included), with a
/// statistics read after every call or only every `read_every` calls (0: at the end). Without
/// thread fronts a read changes no count, and a read after every call sees every shard's
/// counts at each call's end (and settles each lift's ceiling), so every peak must come out
/// the same whatever the reads: inactive splits, active blocks and segments included.
fn peaks_of_sequence(seed: u64, read_every: u64) -> Vec<(String, i64)> {
    let (_sim, a) = sim_allocator(8 << 30, "per_stream_shards:True,thread_cache:False");
    let mut next = xorshift(0x2545_F491_4F6C_DD1D ^ seed.wrapping_mul(0x9E37_79B9));
    let sizes = [
        512,
        4096,
        65_536,
        100_000,
        MIB,
        3 * MIB + 512,
        12 * MIB,
        30 * MIB,
    ];
    let mut live: Vec<(u64, StreamId)> = Vec::new();
    for step in 0..1500u64 {
        let r = next() % 1000;
        let grow = live.is_empty() || r < 520 - (live.len() as u64 * 4).min(400);
        if grow {
            let size = sizes[(next() % sizes.len() as u64) as usize];
            let stream = StreamId(1 + next() % 4);
            live.push((a.malloc(size, stream).unwrap(), stream));
        } else if r < 900 {
            let i = (next() % live.len() as u64) as usize;
            let (p, stream) = live.swap_remove(i);
            if next().is_multiple_of(3) {
                a.free_on(p, stream).unwrap();
            } else {
                a.free(p).unwrap();
            }
        } else if r < 940 {
            let i = (next() % live.len() as u64) as usize;
            let other = StreamId(1 + next() % 4);
            a.record_stream(live[i].0, other).unwrap();
            let (p, _) = live.swap_remove(i);
            a.free(p).unwrap();
        } else if r < 950 {
            a.reset_peak_stats().unwrap();
        } else if r < 965 {
            a.empty_cache().unwrap();
        } else if r < 980 {
            a.largest_free_block().unwrap();
        } else {
            a.segments().unwrap();
        }
        if read_every > 0 && step % read_every == 0 {
            a.stats().unwrap();
        }
    }
    let peaks = a
        .stats()
        .unwrap()
        .flat()
        .into_iter()
        .filter(|(name, _)| name.ends_with(".peak"))
        .collect();
    for (p, _) in live {
        a.free(p).unwrap();
    }
    peaks
}

#[test]
fn every_peak_is_the_same_whether_or_not_reads_come_between_calls() {
    for seed in 1..=6u64 {
        let truth = peaks_of_sequence(seed, 1);
        for read_every in [0, 2, 7, 31] {
            let got = peaks_of_sequence(seed, read_every);
            let differ: Vec<_> = truth
                .iter()
                .zip(&got)
                .filter(|(t, g)| t != g)
                .map(|(t, g)| {
                    format!(
                        "{}: {} read every call, {} read every {read_every}",
                        t.0, t.1, g.1
                    )
                })
                .collect();
            assert!(differ.is_empty(), "seed {seed}: {differ:#?}");
        }
    }
}

/// A restore carves every saved block as handed out, then frees those saved as free: the
/// pool's shard counts its whole segment as allocated for a moment, as one shard (and
/// PyTorch's checkpoint restore) does. With the device at 12 MiB and stream 1's 20 MiB
/// segment carved whole, the high of the sum over shards is 30 MiB; one shard says 30.
fn restore_peak(conf: &str) -> (i64, i64) {
    const POOL: (u64, u64) = (0, 7);
    let (_sim, a) = sim_allocator(1 << 30, conf);
    a.begin_allocate_to_pool(POOL, Box::new(|_| true)).unwrap();
    let x = a.malloc(2 * MIB, S1).unwrap();
    let y = a.malloc(2 * MIB, S1).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    a.free(y).unwrap();
    let saved = common::pool_layout(&a, POOL);
    let z = a.malloc(10 * MIB, S2).unwrap(); // 12 MiB live
    let done = a.restore_pool(POOL, &saved).unwrap();
    assert_eq!(done.allocated.len(), 1);
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().current as u64, 12 * MIB, "{conf}");
    let peaks = (s.allocated_bytes.all().peak, s.allocation.all().peak);
    a.free(z).unwrap();
    a.free(done.allocated[0].ptr).unwrap();
    let _ = x;
    peaks
}

/// A lift that falls again within its call (a restore's carve) and that no other shard's
/// headroom covers still reaches the device's peak: the settling counts the lifted shard
/// at its high, and a lifted shard gives none of its own lift back.
#[test]
fn a_restore_carving_its_segment_counts_in_the_device_peak_as_with_one_shard() {
    let one = restore_peak("per_stream_shards:False,thread_shards:False,thread_cache:False");
    let sharded = restore_peak("per_stream_shards:True,thread_cache:False");
    assert_eq!(one.0 as u64, 30 * MIB, "one shard: the carve counts");
    assert_eq!(
        sharded, one,
        "several shards: (allocated bytes, blocks) peaks"
    );
}

/// Eight threads churning at once, each on its own stream (a shard each, by default), each
/// keeping its live bytes at most `CAP` while it churns, and at the end of each round
/// topping up to a level above `CAP` that rises from round to round, at a barrier all
/// threads reach holding it. The device's true peak is then 8 x the last round's level,
/// met at that barrier alone; each round's barrier is a new high reached after churn has
/// left headroom below the peak. With lifts settled concurrently (from the unassigned
/// headroom, under each shard's own lock, or by the book), headroom handed out twice
/// would let a rise go unsettled and show as a lower peak. Fronts keep freed blocks live
/// in their shard, so they are on too: a rise is counted only after they are drained.
#[test]
fn threads_churning_at_once_reach_exactly_the_peak_they_hold_together() {
    const THREADS: u64 = 8;
    const CAP: u64 = 4 * MIB;
    let level = |round: u64| CAP + (round + 1) * 64 * 1024;
    let (_sim, a) = sim_allocator(8 << 30, "");
    let barrier = Arc::new(std::sync::Barrier::new(THREADS as usize));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                let stream = StreamId(100 + t);
                let mut next = xorshift(0x5EED_0000 + t);
                let mut churn = CappedChurn::new(stream, CAP, 40);
                for round in 0..20 {
                    for _ in 0..500 {
                        churn.step(&a, 256, &mut next);
                    }
                    let topped = a.malloc(level(round) - churn.bytes, stream).unwrap();
                    barrier.wait();
                    barrier.wait();
                    a.free(topped).unwrap();
                }
                churn.free_all(&a);
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(a.shards_made(), THREADS as usize);
    let s = a.stats().unwrap();
    assert_eq!(s.allocated_bytes.all().peak, (THREADS * level(19)) as i64);
    assert_eq!(s.requested_bytes.all().peak, (THREADS * level(19)) as i64);
    assert_eq!(s.allocated_bytes.all().current, 0);
}
