//! A live-vs-reserved memory timeline as a self-contained SVG, one panel per trace.

use super::ReplayReport;
use std::fmt::Write;

const WIDTH: f64 = 900.0;
const PANEL: f64 = 260.0;
const MARGIN_LEFT: f64 = 80.0;
const MARGIN_TOP: f64 = 40.0;
/// Below each panel: the x ticks' labels and the axis title.
const PANEL_BOTTOM: f64 = 46.0;

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Renders every report's timeline, stacked.
pub fn svg(reports: &[ReplayReport]) -> String {
    let height = reports.len() as f64 * (PANEL + MARGIN_TOP + PANEL_BOTTOM) + 20.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for (i, r) in reports.iter().enumerate() {
        let top = 20.0 + i as f64 * (PANEL + MARGIN_TOP + PANEL_BOTTOM);
        panel(&mut out, r, top);
    }
    out.push_str("</svg>\n");
    out
}

fn panel(out: &mut String, r: &ReplayReport, top: f64) {
    let plot_w = WIDTH - MARGIN_LEFT - 20.0;
    let (x0, y0) = (MARGIN_LEFT, top + MARGIN_TOP);
    let max_x = r.timeline.last().map(|p| p.0).unwrap_or(1).max(1) as f64;
    let max_y = r
        .timeline
        .iter()
        .map(|p| p.1.max(p.2))
        .max()
        .unwrap_or(1)
        .max(1);
    let scale_y = gib(max_y) * 1.05;
    let _ = writeln!(
        out,
        r#"<text x="{x0}" y="{}" font-weight="bold">{} — peak reserved / peak live = {:.3}</text>"#,
        top + 14.0,
        escape(&r.trace),
        r.ratio
    );
    let _ = writeln!(
        out,
        r##"<rect x="{x0}" y="{y0}" width="{plot_w}" height="{PANEL}" fill="none" stroke="#999"/>"##
    );
    for tick in 0..=4 {
        let value = scale_y * tick as f64 / 4.0;
        let y = y0 + PANEL - PANEL * tick as f64 / 4.0;
        let _ = writeln!(
            out,
            r##"<text x="{}" y="{:.1}" text-anchor="end">{value:.2} GiB</text><line x1="{x0}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#eee"/>"##,
            x0 - 6.0,
            y + 4.0,
            x0 + plot_w
        );
    }
    for (series, color, label) in [(1usize, "#1f77b4", "live"), (2, "#d62728", "reserved")] {
        let mut points = String::new();
        for p in &r.timeline {
            let value = if series == 1 { p.1 } else { p.2 };
            let x = x0 + plot_w * p.0 as f64 / max_x;
            let y = y0 + PANEL - PANEL * gib(value) / scale_y;
            let _ = write!(points, "{x:.1},{y:.1} ");
        }
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>"#
        );
        let lx = x0 + 10.0 + if series == 1 { 0.0 } else { 70.0 };
        let _ = writeln!(
            out,
            r#"<text x="{lx}" y="{}" fill="{color}">■ {label}</text>"#,
            y0 + 16.0
        );
    }
    let bottom = y0 + PANEL;
    let step = tick_step(max_x);
    let mut tick = 0.0;
    while tick <= max_x {
        let x = x0 + plot_w * tick / max_x;
        let _ = writeln!(
            out,
            r##"<g class="xtick"><line x1="{x:.1}" x2="{x:.1}" y1="{bottom}" y2="{}" stroke="#999"/><text x="{x:.1}" y="{}" text-anchor="middle">{tick}</text></g>"##,
            bottom + 5.0,
            bottom + 18.0
        );
        tick += step;
    }
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">trace event (index)</text>"#,
        x0 + plot_w / 2.0,
        bottom + 34.0
    );
}

/// A round step (1, 2 or 5 times a power of ten) that puts four to nine ticks on 0..=max.
fn tick_step(max: f64) -> f64 {
    let rough = (max / 8.0).max(1.0);
    let power = 10f64.powf(rough.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&step| step >= rough)
        .unwrap_or(10.0 * power)
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
