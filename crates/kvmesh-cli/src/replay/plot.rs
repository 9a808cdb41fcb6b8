//! TTFT CDFs per policy as an SVG (plotters).

use super::Report;
use plotters::prelude::*;
use std::path::Path;

/// Draws each policy's TTFT CDF (first seed) on a log time axis into `path`.
pub fn ttft_cdf(r: &Report, path: &Path) -> anyhow::Result<()> {
    let max = r.results.iter().filter_map(|p| p.ttfts.last().copied()).fold(0.01f64, f64::max);
    let min = r.results.iter().filter_map(|p| p.ttfts.first().copied()).fold(max, f64::min).max(1e-3);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("TTFT CDF — {}", r.source), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((min * 0.9..max * 1.1).log_scale(), 0.0..1.0)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("TTFT (s, log scale)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for (k, p) in r.results.iter().enumerate() {
        let n = p.ttfts.len().max(1) as f64;
        let color = Palette99::pick(k).to_rgba();
        let points = p.ttfts.iter().enumerate().map(|(i, &t)| (t.max(min), (i + 1) as f64 / n));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .label(p.policy.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}
