//! Plots as SVG and PNG, rendered with plotters and no system libraries.
//!
//! Text is drawn with DejaVu Sans, embedded in the binary (`assets/DejaVuSans.ttf`, license
//! in `assets/LICENSE-DejaVu.txt`) and registered with plotters' `ab_glyph` text backend
//! under the family `sans-serif`. PNGs are rendered into an RGB buffer by plotters' bitmap
//! backend and encoded with the `image` crate; SVGs by plotters' SVG backend.
//!
//! Two kinds of chart cover everything the report and the simulator draw: a line chart
//! ([`LinePlot`], with linear or logarithmic axes; unconnected, a scatter chart, with
//! optional horizontal reference lines) and a horizontal stacked bar chart
//! ([`StackedBars`]). Each is written as `<stem>.svg` and `<stem>.png`.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Once;

use image::ImageEncoder;
use plotters::coord::ranged1d::SegmentValue;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::error::{ReportError, Result};

const FONT: &str = "sans-serif";
static FONT_BYTES: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The font is a fixed, known-good file: failure here would be a build problem,
        // and it would surface as a rendering error on the first text drawn.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES);
    });
}

/// How an axis maps values to positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// Linear.
    Linear,
    /// Logarithmic, base 2 (worker counts); ticks at powers of two.
    Log2,
    /// Logarithmic, base 10 (bytes); ticks at powers of ten.
    Log10,
}

impl Scale {
    fn fwd(self, v: f64) -> Option<f64> {
        match self {
            Scale::Linear => v.is_finite().then_some(v),
            Scale::Log2 => (v > 0.0 && v.is_finite()).then(|| v.log2()),
            Scale::Log10 => (v > 0.0 && v.is_finite()).then(|| v.log10()),
        }
    }

    fn inv(self, v: f64) -> f64 {
        match self {
            Scale::Linear => v,
            Scale::Log2 => v.exp2(),
            Scale::Log10 => 10f64.powf(v),
        }
    }

    /// Transformed range, padded so that it is never empty (and spans at least one
    /// power on log axes, so that there is a tick).
    fn range(self, lo: f64, hi: f64, from_zero: bool) -> (f64, f64) {
        let (mut lo, mut hi) = (lo, hi);
        match self {
            Scale::Linear => {
                if from_zero && lo > 0.0 {
                    lo = 0.0;
                }
                let pad = if hi > lo {
                    (hi - lo) * 0.05
                } else {
                    lo.abs().max(1.0) * 0.1
                };
                if !(from_zero && lo == 0.0) {
                    lo -= pad;
                }
                hi += pad;
            }
            Scale::Log2 | Scale::Log10 => {
                lo = lo.floor();
                hi = hi.ceil();
                if hi <= lo {
                    hi = lo + 1.0;
                }
            }
        }
        (lo, hi)
    }
}

/// Where the legend goes, inside the plotting area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Legend {
    /// Top right corner.
    UpperRight,
    /// Top left corner.
    UpperLeft,
    /// Bottom right corner.
    LowerRight,
    /// Bottom left corner.
    LowerLeft,
}

impl Legend {
    fn position(self) -> SeriesLabelPosition {
        match self {
            Legend::UpperRight => SeriesLabelPosition::UpperRight,
            Legend::UpperLeft => SeriesLabelPosition::UpperLeft,
            Legend::LowerRight => SeriesLabelPosition::LowerRight,
            Legend::LowerLeft => SeriesLabelPosition::LowerLeft,
        }
    }
}

/// One named line.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// `(x, y)` points, in x order.
    pub points: Vec<(f64, f64)>,
}

/// A line chart.
#[derive(Debug, Clone)]
pub struct LinePlot {
    /// Caption.
    pub title: String,
    /// x axis description.
    pub x_label: String,
    /// y axis description.
    pub y_label: String,
    /// x axis scale.
    pub x_scale: Scale,
    /// y axis scale.
    pub y_scale: Scale,
    /// Whether a linear y axis starts at zero.
    pub y_from_zero: bool,
    /// Draw a marker at every point (for short series).
    pub markers: bool,
    /// Join each series' points with a line; `false` draws markers only (a scatter chart,
    /// whose legend, one marker per series, is drawn beside the chart: `legend` is then
    /// unused).
    pub connect: bool,
    /// Horizontal reference lines: legend text and y value, drawn dashed across the chart.
    pub references: Vec<(String, f64)>,
    /// Tick label format of the y axis (values in data units).
    pub y_format: fn(f64) -> String,
    /// Legend placement.
    pub legend: Legend,
    /// The lines.
    pub series: Vec<Series>,
}

/// A horizontal stacked bar chart: one bar per category, one colour per segment.
#[derive(Debug, Clone)]
pub struct StackedBars {
    /// Caption.
    pub title: String,
    /// Value axis description.
    pub x_label: String,
    /// Bar names, top to bottom.
    pub categories: Vec<String>,
    /// Segment name and its value for every category, stacked left to right.
    pub segments: Vec<(String, Vec<f64>)>,
}

/// Distinct colours (the "tab10" palette).
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The colour of series `i`.
fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

const W: u32 = 960;
const H: u32 = 600;

type DrawResult = std::result::Result<(), String>;

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn draw_lines<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, p: &LinePlot) -> DrawResult {
    let pts: Vec<Vec<(f64, f64)>> = p
        .series
        .iter()
        .map(|s| {
            s.points
                .iter()
                .filter_map(|&(x, y)| Some((p.x_scale.fwd(x)?, p.y_scale.fwd(y)?)))
                .collect()
        })
        .collect();
    let all = pts.iter().flatten();
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    let refs: Vec<(&str, f64)> = p
        .references
        .iter()
        .filter_map(|(l, y)| Some((l.as_str(), p.y_scale.fwd(*y)?)))
        .collect();
    for &(_, y) in &refs {
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    let (x0, x1) = p.x_scale.range(x0, x1, false);
    let (y0, y1) = p.y_scale.range(y0, y1, p.y_from_zero);
    let ticks = |s: Scale, lo: f64, hi: f64| match s {
        Scale::Linear => 10,
        _ => (hi - lo).round() as usize + 1,
    };
    let (xs, ys, yf) = (p.x_scale, p.y_scale, p.y_format);
    // A scatter chart's legend names one point each, often many: it goes beside the chart
    // (the right 40 %) rather than over the points.
    let (area, side) = if p.connect {
        (root.clone(), None)
    } else {
        let (a, b) = root.split_horizontally(root.dim_in_pixel().0 * 60 / 100);
        (a, Some(b))
    };
    let mut chart = ChartBuilder::on(&area)
        .caption(&p.title, (FONT, 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(80)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(p.x_label.as_str())
        .y_desc(p.y_label.as_str())
        .x_labels(ticks(xs, x0, x1))
        .y_labels(ticks(ys, y0, y1))
        .x_label_formatter(&|v| crate::md::tick(xs.inv(*v)))
        .y_label_formatter(&|v| yf(ys.inv(*v)))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(err)?;
    for (i, &(label, y)) in refs.iter().enumerate() {
        let c = REFERENCE_GREYS[i % REFERENCE_GREYS.len()];
        chart
            .draw_series(DashedLineSeries::new(
                [(x0, y), (x1, y)],
                8,
                5,
                c.stroke_width(2),
            ))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    for (i, (s, pts)) in p.series.iter().zip(&pts).enumerate() {
        let c = color(i);
        if p.connect {
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
                .map_err(err)?
                .label(s.label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
        }
        if p.markers || pts.len() == 1 || !p.connect {
            // Beyond ten series the colours repeat: the marker's shape tells them apart.
            chart
                .draw_series(pts.iter().map(|&q| marker(q, i, c)))
                .map_err(err)?;
        }
    }
    if let Some(side) = side {
        return draw_side_legend(&side, &refs, p);
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(p.legend.position())
        .draw()
        .map_err(err)
}

/// The legend of a scatter chart in its own area: the reference lines, then one marker and
/// label per series, from the top.
fn draw_side_legend<DB: DrawingBackend>(
    side: &DrawingArea<DB, Shift>,
    refs: &[(&str, f64)],
    p: &LinePlot,
) -> DrawResult {
    let style = TextStyle::from((FONT, 13).into_font()).color(&BLACK);
    let mut y = 52;
    for (i, &(label, _)) in refs.iter().enumerate() {
        let c = REFERENCE_GREYS[i % REFERENCE_GREYS.len()];
        side.draw(&PathElement::new(vec![(6, y), (28, y)], c.stroke_width(2)))
            .map_err(err)?;
        side.draw_text(label, &style, (36, y - 7)).map_err(err)?;
        y += 20;
    }
    for (i, s) in p.series.iter().enumerate() {
        side.draw(&marker((17, y), i, color(i))).map_err(err)?;
        side.draw_text(&s.label, &style, (36, y - 7)).map_err(err)?;
        y += 20;
    }
    Ok(())
}

/// Greys for the reference lines, darkest first.
const REFERENCE_GREYS: [RGBColor; 3] = [
    RGBColor(60, 60, 60),
    RGBColor(130, 130, 130),
    RGBColor(185, 185, 185),
];

/// The marker of series `i` at `at`: a circle for the first ten series (one colour each),
/// then triangles, then crosses.
fn marker<DB: DrawingBackend, C: Clone + 'static>(
    at: C,
    i: usize,
    c: RGBColor,
) -> DynElement<'static, DB, C> {
    match i / COLORS.len() % 3 {
        0 => Circle::new(at, 3, c.filled()).into_dyn(),
        1 => TriangleMarker::new(at, 5, c.filled()).into_dyn(),
        _ => Cross::new(at, 4, c.stroke_width(2)).into_dyn(),
    }
}

fn draw_bars<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, p: &StackedBars) -> DrawResult {
    root.fill(&WHITE).map_err(err)?;
    let n = p.categories.len();
    let totals: Vec<f64> = (0..n)
        .map(|i| {
            p.segments
                .iter()
                .map(|(_, v)| v.get(i).copied().unwrap_or(0.0).max(0.0))
                .sum()
        })
        .collect();
    // Room on the right for the legend.
    let xmax = totals.iter().copied().fold(0.0, f64::max).max(1e-9) * 1.45;
    let longest = p
        .categories
        .iter()
        .map(|c| c.chars().count())
        .max()
        .unwrap_or(0);
    let label_w = (longest as u32 * 8 + 16).clamp(60, 420);
    let cats = p.categories.clone();
    let mut chart = ChartBuilder::on(root)
        .caption(&p.title, (FONT, 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(label_w)
        // A discrete range includes its end: 0..=n-1 gives n segments.
        .build_cartesian_2d(0f64..xmax, (0..n.saturating_sub(1)).into_segmented())
        .map_err(err)?;
    // Category i is drawn in segment n-1-i so the first one is at the top.
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc(p.x_label.as_str())
        .y_labels(n)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(k) if *k < n => cats[n - 1 - *k].clone(),
            _ => String::new(),
        })
        .x_label_formatter(&|v| crate::md::tick(*v))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(err)?;
    let mut start = vec![0.0f64; n];
    for (j, (name, vals)) in p.segments.iter().enumerate() {
        let c = color(j);
        let bars: Vec<Rectangle<(f64, SegmentValue<usize>)>> = (0..n)
            .map(|i| {
                let v = vals.get(i).copied().unwrap_or(0.0).max(0.0);
                let k = n - 1 - i;
                let mut r = Rectangle::new(
                    [
                        (start[i], SegmentValue::Exact(k)),
                        (start[i] + v, SegmentValue::Exact(k + 1)),
                    ],
                    c.filled(),
                );
                r.set_margin(6, 6, 0, 0);
                start[i] += v;
                r
            })
            .collect();
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Renders with `draw` into `<dir>/<stem>.svg` and `<dir>/<stem>.png`; returns both paths.
fn render_both(
    dir: &Path,
    stem: &str,
    size: (u32, u32),
    draw_svg: impl Fn(&DrawingArea<SVGBackend<'_>, Shift>) -> DrawResult,
    draw_png: impl Fn(&DrawingArea<BitMapBackend<'_>, Shift>) -> DrawResult,
) -> Result<Vec<PathBuf>> {
    register_font();
    fs::create_dir_all(dir).map_err(|e| ReportError::io(dir, e))?;
    let svg_path = dir.join(format!("{stem}.svg"));
    let png_path = dir.join(format!("{stem}.png"));
    let plot_err = |path: &Path, message: String| ReportError::Plot {
        path: path.to_path_buf(),
        message,
    };

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        draw_svg(&root).map_err(|m| plot_err(&svg_path, m))?;
    }
    fs::write(&svg_path, svg).map_err(|e| ReportError::io(&svg_path, e))?;

    let mut buf = vec![0u8; size.0 as usize * size.1 as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut buf, size).into_drawing_area();
        draw_png(&root).map_err(|m| plot_err(&png_path, m))?;
    }
    let file = fs::File::create(&png_path).map_err(|e| ReportError::io(&png_path, e))?;
    image::codecs::png::PngEncoder::new(std::io::BufWriter::new(file))
        .write_image(&buf, size.0, size.1, image::ExtendedColorType::Rgb8)
        .map_err(|e| plot_err(&png_path, e.to_string()))?;
    Ok(vec![svg_path, png_path])
}

fn draw_one<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, p: &LinePlot) -> DrawResult {
    root.fill(&WHITE).map_err(err)?;
    draw_lines(root, p)?;
    root.present().map_err(err)
}

/// Panels side by side, at most three a row, under a common title.
fn draw_grid<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    panels: &[LinePlot],
) -> DrawResult {
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, (FONT, 24)).map_err(err)?;
    let cols = panels.len().clamp(1, 3);
    let rows = panels.len().div_ceil(cols).max(1);
    for (area, p) in root.split_evenly((rows, cols)).iter().zip(panels) {
        draw_lines(area, p)?;
    }
    root.present().map_err(err)
}

/// Writes a line chart as `<dir>/<stem>.svg` and `.png`; returns the paths.
pub fn line_plot(dir: &Path, stem: &str, p: &LinePlot) -> Result<Vec<PathBuf>> {
    render_both(dir, stem, (W, H), |r| draw_one(r, p), |r| draw_one(r, p))
}

/// Writes several line charts as panels of one figure (three a row) titled `title`, as
/// `<dir>/<stem>.svg` and `.png`; returns the paths.
pub fn line_grid(dir: &Path, stem: &str, title: &str, panels: &[LinePlot]) -> Result<Vec<PathBuf>> {
    let cols = panels.len().clamp(1, 3) as u32;
    let rows = panels.len().div_ceil(3).max(1) as u32;
    let size = (cols * 560, rows * 440 + 50);
    render_both(
        dir,
        stem,
        size,
        |r| draw_grid(r, title, panels),
        |r| draw_grid(r, title, panels),
    )
}

/// Writes a stacked bar chart as `<dir>/<stem>.svg` and `.png`; returns the paths.
pub fn stacked_bars(dir: &Path, stem: &str, p: &StackedBars) -> Result<Vec<PathBuf>> {
    let h = (160 + 48 * p.categories.len() as u32).clamp(320, 2400);
    render_both(dir, stem, (W, h), |r| draw_bars(r, p), |r| draw_bars(r, p))
}
