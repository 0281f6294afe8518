//! Long runs that hunt for COSTS that grow with a job's history: work per call (searches,
//! driver calls, page moves) and memory kept per thing ever seen (sizes, streams, segments,
//! empty_cache calls), not per thing alive. Each run compares the same stretch of work early
//! and late: paging counters (`reclaim_steps`, growths, chunks moved), driver calls, events
//! alive in the sim, and the process heap through the counting allocator. Statistics are
//! checked exact against a model of what the caller holds.
//! Every test is sequential (one thread), so each run is the same.
#![cfg(feature = "sim")]

use ccalloc::{DeviceAllocator, PagingCounters, SimDriver, StreamId};

mod common;

use common::heap::{heap, serial};
use common::live::{driver_calls, free, malloc, sim_allocator as allocator, LiveModel};

#[global_allocator]
static GLOBAL: common::heap::Counting = common::heap::Counting;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const SIDE: StreamId = StreamId(0x77);

/// The figures that stay exact under every setting: blocks live and ever allocated, and the
/// bytes requested live (with shards peaks are sums of the shards', and oversize plain
/// blocks are handed out whole: `LiveModel::check` covers the rest where it applies).
fn check_current(a: &DeviceAllocator, m: &LiveModel, what: &str) {
    let s = a.stats().unwrap();
    assert_eq!(s.allocation.all().current, m.live.len() as i64, "{what}");
    assert_eq!(s.allocation.all().allocated, m.allocations, "{what}");
    let requested: u64 = m.live.values().sum();
    assert_eq!(s.requested_bytes.all().current, requested as i64, "{what}");
}

/// What one stretch of a run cost: driver calls, paging work, events alive at its end, and
/// the heap at its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cost {
    calls: u64,
    growths: u64,
    moving_growths: u64,
    chunks_moved: u64,
    reclaim_steps: u64,
    host_waits: u64,
    live_events: usize,
    heap: i64,
    reserved: i64,
}

/// Counters at a point, to subtract.
struct Mark {
    calls: u64,
    paging: PagingCounters,
}

fn mark(sim: &SimDriver, a: &DeviceAllocator) -> Mark {
    Mark {
        calls: driver_calls(&sim.counters(0)),
        paging: a.stats().unwrap().paging,
    }
}

fn cost_since(sim: &SimDriver, a: &DeviceAllocator, m: &Mark) -> Cost {
    let s = a.stats().unwrap();
    let p = s.paging.since(&m.paging);
    Cost {
        calls: driver_calls(&sim.counters(0)) - m.calls,
        growths: p.growths,
        moving_growths: p.moving_growths,
        chunks_moved: p.chunks_unmapped,
        reclaim_steps: p.reclaim_steps,
        host_waits: p.host_waits,
        live_events: sim.live_events(),
        heap: heap(),
        reserved: s.reserved_bytes.all().current,
    }
}

/// Stretches summed: counters added, the rest as at the last one's end.
fn sum(costs: &[Cost]) -> Cost {
    let mut total = *costs.last().unwrap();
    total.calls = costs.iter().map(|c| c.calls).sum();
    total.growths = costs.iter().map(|c| c.growths).sum();
    total.moving_growths = costs.iter().map(|c| c.moving_growths).sum();
    total.chunks_moved = costs.iter().map(|c| c.chunks_moved).sum();
    total.reclaim_steps = costs.iter().map(|c| c.reclaim_steps).sum();
    total.host_waits = costs.iter().map(|c| c.host_waits).sum();
    total.live_events = costs.iter().map(|c| c.live_events).max().unwrap();
    total.reserved = costs.iter().map(|c| c.reserved).max().unwrap();
    total
}

/// Late work must not cost more than early work of the same kind (each counter, with
/// `slack` added for noise-free counters that may differ by a rounding), and the heap must
/// not grow between the two stretches' ends by more than `heap_slack` bytes.
fn assert_no_growth(early: &Cost, late: &Cost, heap_slack: i64, what: &str) {
    let pairs = [
        ("driver calls", early.calls, late.calls),
        ("growths", early.growths, late.growths),
        ("moving growths", early.moving_growths, late.moving_growths),
        ("chunks moved", early.chunks_moved, late.chunks_moved),
        ("reclaim steps", early.reclaim_steps, late.reclaim_steps),
        ("host waits", early.host_waits, late.host_waits),
        (
            "live events",
            early.live_events as u64,
            late.live_events as u64,
        ),
    ];
    for (name, e, l) in pairs {
        assert!(
            l <= e + e / 10 + 2,
            "{what}: {name} grew with history: early {e}, late {l}\n early {early:?}\n late {late:?}"
        );
    }
    assert!(
        late.reserved <= early.reserved,
        "{what}: reserved grew: early {early:?}, late {late:?}"
    );
    assert!(
        late.heap - early.heap < heap_slack,
        "{what}: the heap grew by {} bytes between the early and late stretch\n early \
         {early:?}\n late {late:?}",
        late.heap - early.heap
    );
}

/// Varlen inference whose output goes to a collective: every batch has a new size; its
/// scratch block is freed and asked for again at once (parked, then taken back), and the
/// output, used on a side stream too (`record_stream`), is freed after it. Parking
/// (`thread_cache:False`: the shard's parked blocks serve the same-size reuse) must keep
/// nothing per size it has seen, though this loop never has a parked block when it flushes
/// (nor needs to: every size fits mapped pages), so only taking a size's last parked block
/// can drop its entry. Checks the heap, read after batch 2,000 and after batch 20,000,
/// stays within 64 KiB, and that the statistics stay exact.
#[test]
fn varlen_batches_reusing_each_size_once_keep_nothing_per_size() {
    let _one = serial();
    for conf in [
        "thread_cache:False",
        "thread_cache:False,per_stream_shards:True",
    ] {
        let (sim, a) = allocator(4 << 30, conf);
        let mut m = LiveModel::default();
        // Pages for every size below, mapped once.
        let w = malloc(&a, &mut m, 64 * MIB, S0);
        free(&a, &mut m, w);
        const BATCHES: u64 = 20_000;
        let mut early = None;
        let mut at_early = None;
        for b in 0..BATCHES {
            if b == 2_000 {
                at_early = Some(mark(&sim, &a));
            }
            let size = 2 * MIB + 512 * (b % 60_000) + 100;
            let scratch = malloc(&a, &mut m, size, S0);
            free(&a, &mut m, scratch);
            let out = malloc(&a, &mut m, size, S0);
            a.record_stream(out, SIDE).unwrap();
            free(&a, &mut m, out);
            if b == 3_999 {
                early = Some(cost_since(&sim, &a, at_early.as_ref().unwrap()));
                at_early = Some(mark(&sim, &a));
            }
        }
        let late = cost_since(&sim, &a, at_early.as_ref().unwrap());
        let s = a.stats().unwrap();
        assert_eq!(s.allocation.all().current, 0, "{conf}");
        assert_eq!(s.allocation.all().allocated, m.allocations, "{conf}");
        assert_no_growth(&early.unwrap(), &late, 64 << 10, conf);
        a.empty_cache().unwrap();
        assert_eq!(sim.counters(0).bytes_in_use, 0, "{conf}");
    }
}

/// Generation with a KV cache per layer that grows one token at a time: each step every
/// layer's cache is made anew one token longer and the old one freed (`torch.cat`), with a
/// temporary of the step's activations; nine sequences of 1,500 tokens, one after another.
/// The work of sequences 6-9 (driver calls, growths, page moves, reclaim steps, host waits)
/// must be within 10% of sequences 2-5's, reserved bytes no higher, and the heap must not
/// grow between their ends by more than 64 KiB.
fn kv_cache_generation(conf: &str) {
    let (sim, a) = allocator(8 << 30, conf);
    let mut m = LiveModel::default();
    const LAYERS: usize = 6;
    const TOKENS: u64 = 1_500;
    const TOKEN_BYTES: u64 = 4 * KIB + 512;
    let weights: Vec<u64> = (0..LAYERS)
        .map(|_| malloc(&a, &mut m, 7 * MIB, S0))
        .collect();
    let mut costs = Vec::new();
    for sequence in 0..9 {
        let start = mark(&sim, &a);
        let mut kv: Vec<u64> = (0..LAYERS)
            .map(|_| malloc(&a, &mut m, TOKEN_BYTES * 16, S0))
            .collect();
        for t in 1..TOKENS {
            for cache in kv.iter_mut() {
                let grown = malloc(&a, &mut m, TOKEN_BYTES * (16 + t), S0);
                let tmp = malloc(&a, &mut m, 96 * KIB, S0);
                free(&a, &mut m, *cache);
                free(&a, &mut m, tmp);
                *cache = grown;
            }
        }
        for cache in kv {
            free(&a, &mut m, cache);
        }
        check_current(&a, &m, &format!("{conf}: sequence {sequence}"));
        costs.push(cost_since(&sim, &a, &start));
    }
    // Page moves vary from one sequence to the next (where blocks land shifts): four
    // sequences summed against the next four.
    assert_no_growth(
        &sum(&costs[1..5]),
        &sum(&costs[5..9]),
        64 << 10,
        &format!("{conf}: {costs:?}"),
    );
    for w in weights {
        free(&a, &mut m, w);
    }
}

#[test]
fn kv_cache_generation_costs_the_same_each_sequence() {
    let _one = serial();
    kv_cache_generation("");
}

#[test]
fn kv_cache_generation_costs_the_same_each_sequence_without_fronts() {
    let _one = serial();
    kv_cache_generation("thread_cache:False");
}

#[test]
fn kv_cache_generation_costs_the_same_each_sequence_with_plain_segments() {
    let _one = serial();
    kv_cache_generation("expandable_segments:False");
}

/// A stream per request, destroyed once its blocks are freed, with no `empty_cache` ever
/// (the case `long_runs::stream_per_request` leaves out). Fences recorded on each request's
/// stream stay pending until something polls them; with nothing but new chunks and moves
/// growth polls only on some paths. Checks that events alive in the sim (the pending
/// fences and awaiting events) stay flat from request 500 to request 3,000, and that each
/// later stretch of 500 requests costs no more driver calls, reclaim steps and moves than
/// the first: what the allocator keeps per stream it has seen (paged segments' address
/// ranges aside, as PyTorch keeps them) must not make each request dearer.
#[test]
fn streams_per_request_without_empty_cache_cost_the_same() {
    let _one = serial();
    for conf in ["", "thread_cache:False"] {
        let (sim, a) = allocator(4 << 30, conf);
        let mut m = LiveModel::default();
        let weights: Vec<u64> = (0..4).map(|_| malloc(&a, &mut m, 3 * MIB, S0)).collect();
        const ROUNDS: u64 = 3_000;
        let stream = |round: u64| StreamId(0x1000 + round * 0x40);
        for round in 0..ROUNDS {
            sim.set_stream_paused(0, stream(round), false);
        }
        let mut stretches = Vec::new();
        let mut start = mark(&sim, &a);
        for round in 0..ROUNDS {
            let s = stream(round);
            let x = malloc(&a, &mut m, 64 * KIB, s);
            let y = malloc(&a, &mut m, 3 * MIB, s);
            for _ in 0..40 {
                let t = malloc(&a, &mut m, 64 * KIB, s);
                free(&a, &mut m, t);
            }
            free(&a, &mut m, y);
            free(&a, &mut m, x);
            sim.destroy_stream(0, s);
            if round % 500 == 499 {
                let c = cost_since(&sim, &a, &start);
                stretches.push((round, c));
                start = mark(&sim, &a);
            }
        }
        check_current(&a, &m, conf);
        assert_eq!(sim.counters(0).destroyed_stream_calls, 0, "{conf}");
        let (first, last) = (stretches[1].1, stretches.last().unwrap().1);
        let what = format!("{conf:?}: per 500 requests {stretches:?}");
        for (name, e, l) in [
            ("driver calls", first.calls, last.calls),
            ("reclaim steps", first.reclaim_steps, last.reclaim_steps),
            ("chunks moved", first.chunks_moved, last.chunks_moved),
            ("host waits", first.host_waits, last.host_waits),
            (
                "live events",
                first.live_events as u64,
                last.live_events as u64,
            ),
        ] {
            assert!(l <= e + e / 10 + 2, "{name} grew: {what}");
        }
        for w in weights {
            free(&a, &mut m, w);
        }
    }
}

/// One job alternating between 24 streams, each with small and large blocks (48 (stream,
/// pool) pairs, each with its paged segments), for 300 rounds: a round's work (driver calls,
/// reclaim steps, moves) late in the run must be no more than early, reserved no higher,
/// the heap flat.
#[test]
fn many_stream_and_pool_pairs_in_turn_cost_the_same() {
    let _one = serial();
    for conf in ["", "thread_cache:False", "per_stream_shards:True"] {
        let (sim, a) = allocator(4 << 30, conf);
        let mut m = LiveModel::default();
        let streams: Vec<StreamId> = (1..=24).map(|i| StreamId(i * 0x10)).collect();
        let mut costs = Vec::new();
        let mut start = mark(&sim, &a);
        let mut kept: Vec<u64> = Vec::new();
        for round in 0..300u64 {
            for (i, &s) in streams.iter().enumerate() {
                let k = round as usize + i;
                let small = malloc(&a, &mut m, 8 * KIB * (1 + (k % 5) as u64), s);
                let large = malloc(&a, &mut m, 3 * MIB + MIB * (k % 3) as u64, s);
                let t = malloc(&a, &mut m, 200 * KIB, s);
                free(&a, &mut m, t);
                free(&a, &mut m, large);
                kept.push(small);
                if kept.len() > 30 {
                    let p = kept.remove(0);
                    free(&a, &mut m, p);
                }
            }
            if round % 100 == 99 {
                costs.push(cost_since(&sim, &a, &start));
                start = mark(&sim, &a);
            }
        }
        check_current(&a, &m, conf);
        assert_no_growth(
            &costs[1],
            &costs[2],
            64 << 10,
            &format!("{conf:?}: {costs:?}"),
        );
        for p in kept {
            free(&a, &mut m, p);
        }
    }
}

/// `empty_cache` after every step of a loop (as some jobs call it between requests), for
/// 1,600 steps (stretches of 400): each step's work (driver calls, growths) late must equal
/// early's and the heap stay flat: nothing the release path keeps (pruned indexes, fences,
/// segments' used ranges, page tables) may pile up per call.
#[test]
fn empty_cache_every_step_costs_the_same() {
    let _one = serial();
    for conf in [
        "",
        "thread_cache:False",
        "expandable_segments:False",
        "per_stream_shards:True",
    ] {
        let (sim, a) = allocator(4 << 30, conf);
        let mut m = LiveModel::default();
        let keep = malloc(&a, &mut m, 5 * MIB, S0);
        let mut costs = Vec::new();
        let mut start = mark(&sim, &a);
        for step in 0..1_600u64 {
            let s = if step % 2 == 0 { S0 } else { SIDE };
            let x = malloc(&a, &mut m, 40 * MIB + 512 * (step % 7), s);
            let y = malloc(&a, &mut m, 300 * KIB, s);
            let z = malloc(&a, &mut m, 12 * KIB + 512 * (step % 3), s);
            free(&a, &mut m, y);
            free(&a, &mut m, x);
            free(&a, &mut m, z);
            a.empty_cache().unwrap();
            if step % 400 == 399 {
                costs.push(cost_since(&sim, &a, &start));
                start = mark(&sim, &a);
            }
        }
        check_current(&a, &m, conf);
        assert_no_growth(
            &costs[1],
            &costs[3],
            32 << 10,
            &format!("{conf:?}: {costs:?}"),
        );
        free(&a, &mut m, keep);
    }
}

/// Plain segments made and released by the thousand: requests of a new large size each time
/// (over the max split size: a segment each unless a cached one is close enough), the
/// older ones freed and released by an `empty_cache` every five requests. A stretch of
/// 1,000 requests late must cost no more driver calls than early, and the heap stay flat
/// (`segments`, `used` ranges, free-list indexes keep nothing per released segment).
#[test]
fn plain_segments_made_and_released_by_the_thousand_cost_the_same() {
    let _one = serial();
    let (sim, a) = allocator(1 << 30, "expandable_segments:False,max_split_size_mb:20");
    let mut m = LiveModel::default();
    let mut costs = Vec::new();
    let mut start = mark(&sim, &a);
    let mut live = std::collections::VecDeque::new();
    for i in 0..6_000u64 {
        let size = 22 * MIB + 4096 * (i % 977);
        let p = malloc(&a, &mut m, size, S0);
        live.push_back(p);
        if live.len() > 8 {
            let q = live.pop_front().unwrap();
            free(&a, &mut m, q);
        }
        if i % 5 == 4 {
            a.empty_cache().unwrap();
        }
        if i % 1000 == 999 {
            costs.push(cost_since(&sim, &a, &start));
            start = mark(&sim, &a);
        }
    }
    check_current(&a, &m, "plain segments");
    let s = a.stats().unwrap();
    assert!(
        s.num_device_free > 1_000,
        "segments were released by the thousand: {s:?}"
    );
    assert_no_growth(&costs[1], &costs[5], 32 << 10, &format!("{costs:?}"));
    for p in live {
        free(&a, &mut m, p);
    }
    a.empty_cache().unwrap();
    assert_eq!(sim.counters(0).bytes_in_use, 0);
}

/// Sanity for the factor above: a test whose late stretch costs more fails (the check can
/// fail), shown on made-up costs. It runs alone too: with `RUST_BACKTRACE` set, its caught
/// panics load the binary's debug information onto the heap (megabytes, kept), which a
/// long run measuring the heap at the same time would count as its own growth.
#[test]
fn the_no_growth_check_can_fail() {
    let _one = serial();
    let early = Cost {
        calls: 10,
        growths: 1,
        moving_growths: 0,
        chunks_moved: 0,
        reclaim_steps: 100,
        host_waits: 0,
        live_events: 3,
        heap: 1000,
        reserved: 1 << 20,
    };
    let late = Cost {
        reclaim_steps: 1000,
        ..early
    };
    let failed = std::panic::catch_unwind(|| assert_no_growth(&early, &late, 1024, "x"));
    assert!(failed.is_err());
    let late = Cost {
        heap: early.heap + 2048,
        ..early
    };
    let failed = std::panic::catch_unwind(|| assert_no_growth(&early, &late, 1024, "x"));
    assert!(failed.is_err());
}
