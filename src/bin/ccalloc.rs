//! `ccalloc replay FILE…`: replays allocator traces through ccalloc on the simulated device
//! and reports what it reserved against what the trace kept live.

use ccalloc::{driver_ms_note, plot, replay, trace, ReplayOptions, ReplayReport};
use ccalloc::{human_bytes, parse_bytes};
use clap::{Parser, Subcommand};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "ccalloc",
    version,
    about = "ccalloc: a caching CUDA memory allocator"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay allocator traces (shared/traces CSV, gzip'd or not, or PyTorch snapshot pickles
    /// from torch.cuda.memory._dump_snapshot()) on the simulated device. Exit status: 0, 1 on
    /// an error, 2 on a bad option, 3 when a trace ran out of --capacity (the report is
    /// printed).
    Replay {
        /// Trace files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Simulated device memory, e.g. 80GiB; reports where the trace would run out.
        #[arg(long, default_value = "80GiB")]
        capacity: String,
        /// Allocator settings, e.g. "max_split_size_mb:256".
        #[arg(long, default_value = "")]
        conf: String,
        /// One JSON object per trace (a JSON array) instead of the table.
        #[arg(long)]
        json: bool,
        /// With --json: add each trace's sampled live/reserved timeline and the allocator's
        /// final statistics (`memory_stats()` names), to compare builds.
        #[arg(long, requires = "json")]
        stats: bool,
        /// Write a live-vs-reserved timeline (SVG).
        #[arg(long)]
        plot: Option<PathBuf>,
        /// How far the simulated GPU runs behind the host: an event completes once this many
        /// later events were recorded on its stream (0: at once).
        #[arg(long, default_value_t = 2)]
        gpu_lag: u64,
        /// What reserved memory was made of when it peaked: chunks with no live byte,
        /// pinned pages (no live byte, in a chunk that has some), page rounding, parked
        /// chunks. The trace is replayed twice: the second pass stops there.
        #[arg(long)]
        breakdown: bool,
        /// Fail a trace whose replay unmaps pages while work queued before their last free
        /// may still use them (a check of the paging policy; slower for large blocks).
        #[arg(long)]
        check_unmaps: bool,
        /// The most events read from one file, all its devices' traces together; a file with
        /// more is refused (exit status 1) before its events are held (20 M take about 640
        /// MB). The default is far above real traces (the largest shipped: ~490,000).
        #[arg(
            long,
            value_name = "N",
            default_value_t = trace::DEFAULT_MAX_EVENTS,
            value_parser = clap::value_parser!(u64).range(1..)
        )]
        max_events: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Replay {
            files,
            capacity,
            conf,
            json,
            stats,
            plot: plot_path,
            gpu_lag,
            breakdown,
            check_unmaps,
            max_events,
        } => {
            let Some(capacity) = parse_bytes(&capacity).filter(|&c| c > 0) else {
                eprintln!("error: --capacity {capacity:?} is not a size such as 80GiB");
                return ExitCode::from(2);
            };
            // Settings are checked before any trace is read: their error is theirs.
            if let Err(e) = ccalloc::Config::default().apply(&conf) {
                eprintln!("error: --conf {conf:?}: {e}");
                return ExitCode::from(2);
            }
            let options = ReplayOptions {
                capacity,
                conf,
                gpu_lag,
                breakdown,
                check_unmaps,
                ..ReplayOptions::default()
            };
            let limits = trace::Limits {
                max_events,
                ..trace::Limits::default()
            };
            let mut reports = Vec::new();
            for file in &files {
                let traces = match trace::load_within(file, &limits) {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("error: {e}");
                        return ExitCode::from(1);
                    }
                };
                for t in traces {
                    match replay(&t, &options, progress(&t.name)) {
                        Ok(r) => reports.push(r),
                        Err(e) => {
                            eprintln!("error: {}: {e}", t.name);
                            return ExitCode::from(1);
                        }
                    }
                }
            }
            let printed = if json {
                let text = if stats {
                    serde_json::to_string_pretty(&reports)
                } else {
                    let shown: Vec<ReplayReport> = reports
                        .iter()
                        .cloned()
                        .map(ReplayReport::without_stats)
                        .collect();
                    serde_json::to_string_pretty(&shown)
                };
                text.map_err(std::io::Error::other)
                    .and_then(|text| writeln!(std::io::stdout().lock(), "{text}"))
            } else {
                print_table(&mut std::io::stdout().lock(), &reports)
            };
            if let Err(e) = printed.and_then(|()| std::io::stdout().lock().flush()) {
                eprintln!("error: writing the report: {e}");
                return ExitCode::from(1);
            }
            if let Some(path) = plot_path {
                if let Err(e) = std::fs::write(&path, plot::svg(&reports)) {
                    eprintln!("error: writing {}: {e}", path.display());
                    return ExitCode::from(1);
                }
                eprintln!("timeline written to {}", path.display());
            }
            if reports.iter().any(|r| r.oom.is_some()) {
                return ExitCode::from(3);
            }
            ExitCode::SUCCESS
        }
    }
}

/// Progress on stderr, only when it is a terminal.
fn progress(name: &str) -> impl FnMut(usize, usize) + '_ {
    let tty = std::io::stderr().is_terminal();
    move |done, total| {
        if tty {
            let pct = (done * 100).checked_div(total).unwrap_or(100);
            let end = if done >= total { "\r\x1b[K" } else { "" };
            eprint!("\r{name}: {pct:3}% ({done}/{total} events){end}");
            let _ = std::io::stderr().flush();
        }
    }
}

/// The table, at most 100 columns wide (for trace names up to 20 characters); `--json` has
/// every figure.
fn print_table(out: &mut impl Write, reports: &[ReplayReport]) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<20} {:>7} {:>10} {:>10} {:>6} {:>7} {:>7} {:>11} {:>7}",
        "trace",
        "events",
        "peak live",
        "peak rsv",
        "ratio",
        "native",
        "expand.",
        "maps/unmaps",
        "drv ms*",
    )?;
    for r in reports {
        let torch_ratio = r
            .pytorch_ratio
            .map(|x| format!("{x:.3}"))
            .unwrap_or_else(|| "-".into());
        writeln!(
            out,
            "{:<20} {:>7} {:>10} {:>10} {:>6.3} {:>7} {:>7.3} {:>11} {:>7.1}",
            r.trace,
            r.events,
            human_bytes(r.peak_live_bytes),
            human_bytes(r.peak_reserved_bytes),
            r.ratio,
            torch_ratio,
            r.expandable_ratio,
            format!("{}/{}", r.maps, r.unmaps),
            r.est_driver_ms,
        )?;
        if r.device_allocs + r.device_frees > 0 {
            writeln!(
                out,
                "  segments allocated/freed: {}/{}",
                r.device_allocs, r.device_frees
            )?;
        }
        if let Some(b) = &r.at_peak {
            writeln!(
                out,
                "  at peak: {} over {} live: free chunks {}, pinned {} ({} chunks),\n    \
                 page rounding {}, parked {}, plain segments {}",
                human_bytes(b.reserved_bytes.saturating_sub(b.live_bytes)),
                human_bytes(b.live_bytes),
                human_bytes(b.free_chunk_bytes),
                human_bytes(b.pinned_bytes),
                b.pinning_chunks,
                human_bytes(b.rounding_bytes),
                human_bytes(b.parked_bytes),
                human_bytes(b.plain_bytes),
            )?;
        }
        if let Some(o) = &r.oom {
            writeln!(
                out,
                "  OUT OF MEMORY at event {} ({} live, asked {})",
                o.event,
                human_bytes(o.live_bytes),
                human_bytes(o.requested_bytes)
            )?;
        }
    }
    writeln!(
        out,
        "native, expand.: peak reserved / peak live of PyTorch's allocator, native as the trace\n  \
         recorded its segments, expandable_segments:True as modelled (docs/replay.md)"
    )?;
    writeln!(out, "* {}", driver_ms_note())
}
