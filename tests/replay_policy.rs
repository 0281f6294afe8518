//! The paging policy on the two workload families where it reserved the most (issue #17),
//! replayed on the simulated device from traces recorded on an H100 or H200 (docs/paging.md):
//! small-footprint inference with a batch size varying per call, and generation with a KV
//! cache growing token by token. Each test bounds peak reserved / peak live and the count
//! of page maps and unmaps (the driver calls a page move costs), at the default GPU lag and
//! with the GPU at once done (lag 0) or far behind (lag 16). The bounds are the figures the
//! policy reaches today, rounded up: a change that reserves more, or buys memory with more
//! moves, fails here.
#![cfg(feature = "replay")]

use ccalloc::{replay, trace, ReplayOptions, ReplayReport};
use std::path::Path;

fn replay_trace(name: &str, gpu_lag: u64) -> ReplayReport {
    replay_with(name, gpu_lag, "")
}

fn replay_with(name: &str, gpu_lag: u64, conf: &str) -> ReplayReport {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("benches/traces")
        .join(format!("{name}.trace.csv.gz"));
    let traces = trace::load(&path).unwrap();
    assert_eq!(traces.len(), 1, "{name}: one device");
    let options = ReplayOptions {
        gpu_lag,
        conf: conf.to_string(),
        timeline_points: 1,
        check_unmaps: true,
        ..ReplayOptions::default()
    };
    let r = replay(&traces[0], &options, |_, _| {}).unwrap();
    assert!(r.oom.is_none(), "{name} at lag {gpu_lag}: {:?}", r.oom);
    assert_eq!(r.unmatched_frees, 0, "{name}");
    assert!(r.peak_reserved_bytes >= r.peak_live_bytes, "{name}");
    r
}

/// Checks each (trace, ratio, maps + unmaps) bound at lags 0, 2 and 16.
fn within_at_every_lag(bounds: &[(&str, f64, u64)]) {
    for &(name, ratio, calls) in bounds {
        for lag in [0, 2, 16] {
            within(&replay_trace(name, lag), lag, ratio, calls);
        }
    }
}

/// Checks one replay against its bounds: ratio, and maps + unmaps.
fn within(r: &ReplayReport, gpu_lag: u64, ratio: f64, moves: u64) {
    let calls = r.maps + r.unmaps;
    println!(
        "{} lag {gpu_lag}: ratio {:.3} (PyTorch {:.3}), maps {} unmaps {}",
        r.trace,
        r.ratio,
        r.pytorch_ratio.unwrap_or(f64::NAN),
        r.maps,
        r.unmaps
    );
    assert!(
        r.ratio <= ratio,
        "{} lag {gpu_lag}: peak reserved / peak live {:.4} > {ratio}",
        r.trace,
        r.ratio
    );
    assert!(
        calls <= moves,
        "{} lag {gpu_lag}: {} maps + {} unmaps > {moves}",
        r.trace,
        r.maps,
        r.unmaps
    );
    // Every unmap is half of a page move; a chunk maps at least once before it can move.
    assert!(r.maps >= r.unmaps, "{}", r.trace);
    // PyTorch's native allocator, recorded on the same run, reserved far more.
    let torch = r
        .pytorch_ratio
        .expect("the trace records PyTorch's segments");
    assert!(
        r.ratio < torch,
        "{}: {} vs PyTorch {torch}",
        r.trace,
        r.ratio
    );
}

const RESNET: &str = "resnet18_infer_varbatch";
const GPT2: &str = "gpt2_generate_dynamic";

/// Small footprint (about 300 MiB), batch size changing every call: the free blocks'
/// layout changes every step, so growth keeps moving chunks (most maps are remaps), in
/// chunks of one page: larger ones, a sizeable share of the footprint, stayed pinned
/// (1.095 with chunks of a quarter of the run, at least 8 MiB).
#[test]
fn variable_batch_inference_at_the_default_lag() {
    let r = replay_trace(RESNET, 2);
    // Today: 1.047, 675 maps + 528 unmaps.
    within(&r, 2, 1.05, 1250);
    assert!(r.unmaps > 100, "the batch changes every call: pages move");
}

#[test]
fn variable_batch_inference_with_the_gpu_at_once_done_or_far_behind() {
    // Today: lag 0: 1.047, 769 + 622; lag 16: 1.047, 736 + 588.
    within(&replay_trace(RESNET, 0), 0, 1.05, 1400);
    within(&replay_trace(RESNET, 16), 16, 1.05, 1650);
}

/// A KV cache grown token by token: each step allocates the cache one token longer before
/// the old one is freed, so live memory ratchets up and the growth is mostly new chunks,
/// few moves.
#[test]
fn kv_cache_generation_at_the_default_lag() {
    let r = replay_trace(GPT2, 2);
    // Today: 1.027, 266 maps + 30 unmaps (1.078 with chunks of a quarter of the run: a
    // shorter cache left on a chunk of the longer one pinned it).
    within(&r, 2, 1.03, 310);
}

#[test]
fn kv_cache_generation_with_the_gpu_at_once_done_or_far_behind() {
    // Today: as at lag 2 (1.027, 266 + 30) at both.
    within(&replay_trace(GPT2, 0), 0, 1.03, 310);
    within(&replay_trace(GPT2, 16), 16, 1.03, 310);
}

/// Inference on 43.5 GiB (batch 4-40 x 1-4K tokens, eager attention): single tensors of
/// up to 20 GiB, so live blocks scattered over a paged segment's address range (the
/// device's size) can leave no free range that fits the next one. Another paged segment
/// serves it from the same pages; a plain segment would reserve it anew and keep it, 1.46x
/// at any slack below 1/32 (the lower the slack, the fewer pages stay mapped to fit it).
#[test]
fn large_footprint_inference_reserves_no_more_as_the_slack_shrinks() {
    const EAGER: &str = "eager_attn_infer_40g";
    // Today: up to 1.019 at 1/32, 1.019 at 0.02, 1.0022 at 0, at lags 0, 2, 64, with up to
    // 3,290 maps + 2,176 unmaps (at 0: chunks are at most a sixteenth of the slack, so a
    // 256th of each 20 GiB block).
    for lag in [0, 2, 64] {
        let mut last = f64::INFINITY;
        for (slack, bound) in [("0.03125", 1.025), ("0.02", 1.02), ("0", 1.003)] {
            let r = replay_with(EAGER, lag, &format!("page_slack:{slack}"));
            within(&r, lag, bound, 5600);
            assert_eq!(
                r.device_allocs, 0,
                "{EAGER} lag {lag} slack {slack}: plain segments"
            );
            // Within one growth's placement and the chunk sizes each slack caps (lag 0:
            // 1.0146 at 1/32, 1.0193 at 0.02); a plain segment's fallback is 1.46.
            assert!(
                r.ratio <= last + 0.005,
                "{EAGER} lag {lag}: less slack, more reserved"
            );
            last = r.ratio;
        }
    }
}

/// Long-context training with activation checkpointing (4-16K tokens a step): recomputed
/// activations free and take memory in pieces of every size, and the free memory ends up
/// in chunks of one or two pages among larger ones. Moves release such chunks and make
/// their pages anew in the chunk size growth uses (`release_chunks_cheaper_made_anew`):
/// before, every one of them was mapped again on its own (lag 2: 2,895 maps + 2,156
/// unmaps; lags 0 and 16: 5,339 and 4,524 in all).
#[test]
fn long_context_training_moves_its_small_chunks_in_few_calls() {
    const LONGCTX: &str = "llama_longctx_ckpt_train";
    // Today: lag 0: 1.0212, 2,508 + 1,281; lag 2: 1.0298, 2,967 + 1,715; lag 16: 1.0298,
    // 2,544 + 1,322. (1.043-1.045 and 2,800-2,900 calls with chunks of up to a sixteenth
    // of the run: 62 MiB chunks pinned by edges of live blocks, against a slack of 281 MiB;
    // 1.030 and 3,300-3,600 calls with chunks of up to an eighth of the slack. Chunks are
    // now a sixteenth of it: live on an H200, 1.020-1.021 against 1.030-1.040.)
    for lag in [0, 2, 16] {
        within(&replay_trace(LONGCTX, lag), lag, 1.031, 4800);
    }
}

/// Six workloads recorded after the policy's constants were set (session 27: ViT training,
/// T5 with dynamic padding, DiT sampling at varying resolutions, a GCN on graphs of varying
/// size, DLRM with dense embedding gradients, serving with per-request KV caches grown by
/// concatenation). Each ends within the slack's bound, the 3% target. Bounds per trace:
/// (name, ratio, maps + unmaps), today's figures rounded up, over lags 0, 2 and 16.
#[test]
fn held_out_workloads_stay_within_the_target() {
    // Today, worst over the lags: vit 1.0299, 2,034 calls; t5 1.0239, 3,234; dit 1.0069,
    // 876; gnn 1.0246 (lag 16), 3,290; dlrm 1.0188 (lag 2), 1,601; llm_serve 1.0278, 435.
    // With chunks of up to a sixteenth of the run (uncapped by the slack), gnn's pinned
    // pages took it to 1.0325 for 967 calls, and dlrm was at 1.0167 for 1,217; with chunks
    // of up to an eighth of the slack, gnn 1.0176 for 2,366 and dlrm 1.0268 for 1,402.
    // (Live on an H200, gnn reserves 1.023-1.028 with a sixteenth, 1.030 with an eighth.)
    let bounds = [
        ("vit_train_amp", 1.03, 2200),
        ("t5_train_varlen", 1.025, 3300),
        ("dit_infer_varres", 1.008, 950),
        ("gnn_train_varsize", 1.025, 3400),
        ("dlrm_train_varbatch", 1.019, 1650),
        ("llm_serve_contbatch", 1.029, 480),
    ];
    within_at_every_lag(&bounds);
}

/// Three more workloads held out in session 31, written and first run after the policy's
/// constants last changed (session 29), and nothing tuned on them since: an LSTM language model on
/// packed variable-length batches, a latent-diffusion VAE decoder at resolutions varying per
/// request, and R(2+1)D video training on clips of varying length. Live on an H200 they
/// reserved 1.027, 1.019 and 1.025 (expandable_segments 1.191, 1.181 and 1.034; native
/// 1.321, 2.239 and 1.367). Bounds per trace, today's figures rounded up over lags 0, 2 and
/// 16, as above.
#[test]
fn workloads_held_out_in_session_31_stay_within_the_target() {
    // Today, worst over the lags: lstm 1.0270 (lags 0 and 2), 1,730 calls; vae 1.0296 (lag
    // 16; 1.0063 at lags 0 and 2), 2,134; video 1.0246, 724.
    let bounds = [
        ("lstm_lm_train_varlen", 1.028, 1900),
        ("vae_decode_varres", 1.03, 2350),
        ("video_r2plus1d_train_varlen", 1.025, 800),
    ];
    within_at_every_lag(&bounds);
}

/// A workload held out in session 32, written and first run after the policy last changed:
/// a server that swaps models (BERT-base, ViT-B/16, ResNet-50, each made in fp32 on the GPU,
/// cast to fp16, served, dropped), so each model's weights come while the last one's blocks
/// sit freed in other sizes. Live on an H200 it reserved 1.030 (expandable_segments 1.050,
/// native 1.676). Bounds as above.
#[test]
fn a_server_swapping_models_stays_within_the_target() {
    // Today: 1.0296 at lags 0, 2 and 16; 340, 380 and 397 calls.
    within_at_every_lag(&[("model_swap_serve", 1.03, 440)]);
}

/// Five workloads held out in session 35, written before any ran under any allocator and
/// nothing tuned on them since: beam-search and assisted (speculative) generation, CLIP-style
/// contrastive training, ResNet-50 training with a larger-batch evaluation every third step,
/// and `torch.compile(mode="reduce-overhead")` inference (its CUDA graph pool is not in the
/// trace). Live on an H200 they reserved 1.030, 1.030, 1.019, 1.029 and 1.281 (expandable
/// segments 1.049, 1.048, 1.011, 1.015, 1.634). Bounds as above.
#[test]
fn workloads_held_out_in_session_35_stay_within_the_target() {
    // Today, worst over the lags: beam 1.0296, 476 calls; assisted 1.0300, 506; clip 1.0142,
    // 1,899; train_with_eval 1.0294, 1,012; compiled 1.0283, 728.
    let bounds = [
        ("beam_search_generate", 1.03, 530),
        ("assisted_generate", 1.03, 560),
        ("clip_contrastive_train", 1.0145, 2100),
        ("train_with_eval", 1.0295, 1120),
        ("compiled_cudagraph_infer", 1.029, 800),
    ];
    within_at_every_lag(&bounds);
}

/// A workload held out in session 32 and first traced in session 33: a 12-layer GPT trained
/// under `torch.compile` with dynamic shapes (sequence lengths varying per step), so the
/// compiled graphs' buffers come in sizes eager mode never asks for. Live on an H200 it
/// reserved 1.026-1.03 (expandable_segments 1.144, native 1.380). Bounds as above.
#[test]
fn compiled_training_with_dynamic_shapes_stays_within_the_target() {
    // Today: 1.0103 at lags 0 and 2, 1.0155 at lag 16; 3,215-3,227 calls.
    within_at_every_lag(&[("compiled_gpt_train", 1.016, 3400)]);
}

/// Four threads serving BERT-base, each on a stream of its own (session 31's held-out
/// server), traced in session 33. It is over the 3% target, live (1.036-1.051) and here
/// (1.0459 at every lag): each stream's blocks lie on pages of its own, and at the peak the
/// excess is all the free parts of partly live pages, 23.8 MiB over four streams
/// (docs/paging.md, Limitations). The bound is today's figure, so that the excess cannot
/// grow unnoticed; it is not the goal. Letting one stream's request onto another stream's
/// mapped pages once the device is done with them (session 33, not kept) left it at 1.0459.
#[test]
fn threads_on_their_own_streams_keep_todays_page_rounding() {
    // Today: 1.0459 at lags 0, 2 and 16; 5,194, 5,255 and 5,313 calls.
    within_at_every_lag(&[("bert_serve_threads", 1.046, 5500)]);
}

/// With `page_moves:False` growth never moves pages: each maps new memory, as once a busy
/// job's move allowance is spent, and reserved settles at what the job's layouts need
/// together. Nothing is unmapped, fewer pages are mapped, and the reservation is at least
/// the default's. unet's training steps and sampling want their pages in different places:
/// without moves it reserves 1.108 here (native 1.070), the regime a long unet run enters
/// once its allowance is spent (1.138 live after 80 loops, docs/paging.md).
#[test]
fn without_moves_growth_maps_new_memory_and_never_unmaps() {
    const UNET: &str = "unet_diffusion_train";
    for lag in [0, 2, 16] {
        let moving = replay_trace(UNET, lag);
        let fixed = replay_with(UNET, lag, "page_moves:False");
        println!(
            "{UNET} lag {lag}: {:.4} with moves ({} maps, {} unmaps), {:.4} without ({} maps)",
            moving.ratio, moving.maps, moving.unmaps, fixed.ratio, fixed.maps
        );
        assert_eq!(fixed.unmaps, 0, "lag {lag}");
        assert!(moving.unmaps > 0, "lag {lag}: the default moves pages here");
        assert!(fixed.maps < moving.maps, "lag {lag}");
        assert!(fixed.ratio >= moving.ratio, "lag {lag}");
        // Today 1.105 at every lag (1.1083 while blocks parked without moves).
        assert!(fixed.ratio <= 1.107, "lag {lag}: {:.4}", fixed.ratio);
    }
}

/// Without moves, freed blocks do not park (docs/paging.md): parked, each went back to its
/// old place, and the layout it left decided where growth mapped pages for good.
#[test]
fn without_moves_blocks_merge_rather_than_park() {
    // Today at every lag: vae 1.175 (1.369 parked), gnn 1.230 (1.352), eager attention
    // 1.064 (1.176), model swapping 1.042 (1.143); expandable segments (modelled) 1.181,
    // 1.145, 1.052, 1.050.
    for (name, bound) in [
        ("vae_decode_varres", 1.18),
        ("gnn_train_varsize", 1.235),
        ("eager_attn_infer_40g", 1.07),
        ("model_swap_serve", 1.05),
    ] {
        for lag in [0, 16] {
            let r = replay_with(name, lag, "page_moves:False");
            println!("{name} lag {lag}: {:.4} without moves", r.ratio);
            assert_eq!(r.unmaps, 0, "{name} lag {lag}");
            assert!(
                r.ratio <= bound,
                "{name} lag {lag}: {:.4} > {bound}",
                r.ratio
            );
        }
    }
}

/// Issue 17's peer: PyTorch with `expandable_segments:True`, modelled on each trace
/// (`expandable_peak_reserved`, docs/replay.md). The model reproduces the live runs' figures
/// (H200, PyTorch 2.11, docs/benchmarks.md) of these workloads within 0.0025, four of them
/// recorded after it was written; a change to
/// the model that loses that fails here.
#[test]
fn the_expandable_segments_model_matches_the_live_runs() {
    for (name, live) in [
        ("vae_decode_varres", 1.181),
        ("resnet18_infer_varbatch", 1.394),
        ("wav2vec2_ctc_train_varlen", 1.245),
        ("eager_attn_infer_40g", 1.052),
        ("maskrcnn_train_varsize", 1.078),
        ("llama_longctx_ckpt_train", 1.148),
        ("fcn_segment_infer_varsize", 1.174),
        ("gnn_train_varsize", 1.145),
        ("unet_diffusion_train", 1.052),
        ("video_r2plus1d_train_varlen", 1.034),
        ("whisper_train_varlen", 1.071),
        ("gpt2_generate_dynamic", 1.078),
        ("lstm_lm_train_varlen", 1.191),
        // Held out in session 35: recorded after the model was written.
        ("assisted_generate", 1.0481),
        ("beam_search_generate", 1.0485),
        ("clip_contrastive_train", 1.0105),
        ("train_with_eval", 1.0147),
    ] {
        // The replay's report carries the model's figure over the replay's peak live.
        let model = replay_trace(name, 2).expandable_ratio;
        println!("{name}: model {model:.4}, live {live}");
        assert!(
            (model - live).abs() < 0.0025,
            "{name}: model {model:.4}, live {live}"
        );
    }
}

/// Every shipped trace, at the default lag: ccalloc reserves less than expandable segments
/// (modelled) would, but two of the five held out in session 35, pinned at their figures so
/// that they cannot get worse unseen. There, expandable segments' layout needs less than the
/// 3% slack that ccalloc's growth spends on new chunks before it moves pages (both replay
/// under it with `page_slack:0.01`; docs/paging.md, Limitations). Of the others, the closest
/// are vit_train_amp (1.0299 against 1.0311) and resnet50_train (1.0044 against 1.0068).
#[test]
fn every_trace_reserves_less_than_expandable_segments() {
    const ABOVE: [(&str, f64); 2] = [
        ("clip_contrastive_train", 1.0139),
        ("train_with_eval", 1.0294),
    ];
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/traces");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|f| f.strip_suffix(".trace.csv.gz").map(str::to_string))
        .collect();
    names.sort();
    assert!(names.len() >= 31, "{names:?}");
    for name in &names {
        let r = replay_trace(name, 2);
        println!("{name}: {:.4} against {:.4}", r.ratio, r.expandable_ratio);
        if let Some(&(_, pinned)) = ABOVE.iter().find(|(n, _)| n == name) {
            assert!(
                r.ratio <= pinned && r.ratio < 1.03,
                "{name}: {:.4}, pinned at {pinned}",
                r.ratio
            );
            continue;
        }
        assert!(
            r.ratio < r.expandable_ratio,
            "{name}: {:.4} against expandable segments' {:.4}",
            r.ratio,
            r.expandable_ratio
        );
    }
}
