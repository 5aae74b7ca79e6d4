//! Pictures: the loss curve of a run, and attention maps of a prompt.
//!
//! Drawn with plotters into PNG files. The font (DejaVu Sans) is compiled in, so
//! nothing depends on the fonts a machine happens to have.

use std::path::Path;
use std::sync::Once;

use anyhow::{Context, Result};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;

use crate::user_bail;

/// The picture files plotters writes, told by their extension.
pub const PICTURE_EXTENSIONS: &[&str] = &["png", "jpg", "jpeg", "bmp"];

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .unwrap_or_else(|_| panic!("the bundled DejaVu font is valid"));
    });
}

fn plot_error<E: std::fmt::Display>(path: &Path) -> impl FnOnce(E) -> anyhow::Error + '_ {
    move |e| anyhow::anyhow!("drawing {}: {e}", path.display())
}

/// A white picture of `size` pixels, to be written to `out`.
fn canvas(out: &Path, size: (u32, u32)) -> Result<DrawingArea<BitMapBackend<'_>, Shift>> {
    let root = BitMapBackend::new(out, size).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error(out))?;
    Ok(root)
}

/// A chart filling `root` to be built, titled `title`, with room for the axes' labels.
fn chart_builder<'a, 'b>(
    root: &'a DrawingArea<BitMapBackend<'b>, Shift>,
    title: &str,
) -> ChartBuilder<'a, 'b, BitMapBackend<'b>> {
    let mut builder = ChartBuilder::on(root);
    builder
        .caption(title, ("sans-serif", 26))
        .margin(18)
        .x_label_area_size(45)
        .y_label_area_size(60);
    builder
}

/// A chart in a PNG with both axes in f64.
type Chart<'a> = ChartContext<'a, BitMapBackend<'a>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Evaluations: a thick line through `points` with a dot of `radius` at each (they are
/// readings, not a continuous curve), named `label` in the legend.
fn draw_readings(
    chart: &mut Chart<'_>,
    points: &[(f64, f64)],
    (color, radius): (RGBColor, i32),
    label: &str,
    out: &Path,
) -> Result<()> {
    chart
        .draw_series(LineSeries::new(
            points.iter().copied(),
            color.stroke_width(3),
        ))
        .map_err(plot_error(out))?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3)));
    chart
        .draw_series(
            points
                .iter()
                .map(|&p| Circle::new(p, radius, color.filled())),
        )
        .map_err(plot_error(out))?;
    Ok(())
}

/// The legend, top right over a light background.
fn draw_legend(chart: &mut Chart<'_>, out: &Path) -> Result<()> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error(out))?;
    Ok(())
}

/// The points of a run's metrics.jsonl.
#[derive(Debug, Default, Clone)]
pub struct Curves {
    /// (step, training loss of that step)
    pub train: Vec<(f64, f64)>,
    /// (step, mean train loss at evaluation)
    pub eval_train: Vec<(f64, f64)>,
    /// (step, mean val loss at evaluation)
    pub eval_val: Vec<(f64, f64)>,
    /// (step, learning rate)
    pub lr: Vec<(f64, f64)>,
}

impl Curves {
    pub fn from_metrics(text: &str) -> Self {
        let mut c = Curves::default();
        for v in text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        {
            let Some(step) = v["step"].as_f64() else {
                continue;
            };
            if let Some(loss) = v["loss"].as_f64() {
                c.train.push((step, loss));
            }
            if let (Some(t), Some(val)) = (v["train_loss"].as_f64(), v["val_loss"].as_f64()) {
                c.eval_train.push((step, t));
                c.eval_val.push((step, val));
            }
            if let Some(lr) = v["lr"].as_f64() {
                c.lr.push((step, lr));
            }
        }
        c.lr.sort_by(|a, b| a.0.total_cmp(&b.0));
        c
    }
}

/// Draws train and val loss against step, with the learning rate on a second axis.
pub fn loss_curve(metrics: &Path, out: &Path, title: &str) -> Result<()> {
    drawn_atomically(out, |drawing| draw_loss_curve(metrics, drawing, title))
}

/// Draws a picture into a file beside `out` and renames it over `out`: a viewer open on
/// it never reads half a picture, and a draw that fails (a full disk) leaves neither a
/// truncated `out` nor its temporary file. A file that cannot be written is the user's
/// to fix: one line naming it.
fn drawn_atomically(out: &Path, draw: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = out.file_name().unwrap_or_default().to_string_lossy();
    // Ends in .png: the backend encodes by the extension.
    let drawing = out.with_file_name(format!(".{name}.tmp{}.png", std::process::id()));
    let drawn = draw(&drawing).and_then(|()| {
        std::fs::rename(&drawing, out).with_context(|| format!("renaming onto {}", out.display()))
    });
    let Err(e) = drawn else {
        return Ok(());
    };
    let _ = std::fs::remove_file(&drawing);
    let said = format!("{e:#}");
    let cause = [
        "No space left on device",
        "Permission denied",
        "Read-only file system",
        "Disk quota exceeded",
    ]
    .into_iter()
    .find(|cause| said.contains(cause));
    let fix = match cause {
        Some("No space left on device" | "Disk quota exceeded") => "free space there or name",
        _ => "name",
    };
    Err(match cause {
        Some(cause) => crate::error::user_error(format!(
            "cannot write {}: {cause}; {fix} another file (--out)",
            out.display()
        )),
        None => e,
    })
}

/// [`loss_curve`] drawn into `out` as it is.
fn draw_loss_curve(metrics: &Path, out: &Path, title: &str) -> Result<()> {
    let bytes = std::fs::read(metrics)
        .map_err(|e| crate::error::user_error(format!("cannot read {}: {e}", metrics.display())))?;
    // Damaged lines (not UTF-8, not JSON) are passed over: the rest still draw.
    let c = Curves::from_metrics(&String::from_utf8_lossy(&bytes));
    if c.train.is_empty() && c.eval_val.is_empty() {
        user_bail!(
            "{} has no losses to plot (none logged yet, or its lines are damaged)",
            metrics.display()
        );
    }
    register_font();
    let all_losses = c
        .train
        .iter()
        .chain(&c.eval_train)
        .chain(&c.eval_val)
        .map(|p| p.1);
    let (mut lo, mut hi) = all_losses.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let pad = ((hi - lo) * 0.05).max(1e-3);
    lo = (lo - pad).max(0.0);
    hi += pad;
    let last_step = c
        .train
        .iter()
        .chain(&c.eval_val)
        .map(|p| p.0)
        .fold(1.0, f64::max);
    let lr_max = c.lr.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-12) * 1.1;

    let err = plot_error(out);
    let root = canvas(out, (1100, 650))?;
    let mut chart = chart_builder(&root, title)
        .right_y_label_area_size(75)
        .build_cartesian_2d(0f64..last_step, lo..hi)
        .map_err(plot_error(out))?
        .set_secondary_coord(0f64..last_step, 0f64..lr_max);
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|v| step_label(*v))
        .y_desc("loss (nats / token)")
        .label_style(("sans-serif", 15))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(plot_error(out))?;
    chart
        .configure_secondary_axes()
        .y_desc("learning rate")
        .label_style(("sans-serif", 15))
        .y_label_formatter(&|v| format!("{v:.1e}"))
        .draw()
        .map_err(plot_error(out))?;

    let light_blue = RGBColor(150, 180, 230);
    let blue = RGBColor(31, 90, 180);
    let orange = RGBColor(230, 110, 20);
    let gray = RGBColor(120, 120, 120);
    chart
        .draw_series(LineSeries::new(
            c.train.iter().copied(),
            light_blue.stroke_width(1),
        ))
        .map_err(plot_error(out))?
        .label("train loss (mean since the last log line)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], light_blue));
    for (points, color, label) in [
        (&c.eval_train, blue, "train loss (eval)"),
        (&c.eval_val, orange, "val loss (eval)"),
    ] {
        draw_readings(&mut chart, points, (color, 4), label, out)?;
    }
    chart
        .draw_secondary_series(LineSeries::new(c.lr.iter().copied(), gray.stroke_width(1)))
        .map_err(plot_error(out))?
        .label("learning rate (right axis)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], gray));
    draw_legend(&mut chart, out)?;
    root.present().map_err(err)?;
    Ok(())
}

/// 1500 -> "1.5k", 2000000 -> "2M", 12 -> "12", 0.5 -> "0.5".
/// A step number on an axis: whole steps only (a tick between two steps has none).
fn step_label(v: f64) -> String {
    if (v - v.round()).abs() < 1e-6 {
        short_number(v.round())
    } else {
        String::new()
    }
}

fn short_number(v: f64) -> String {
    let trim = |s: String| s.trim_end_matches('0').trim_end_matches('.').to_string();
    match v.abs() {
        a if a >= 1e9 => trim(format!("{:.2}", v / 1e9)) + "G",
        a if a >= 1e6 => trim(format!("{:.2}", v / 1e6)) + "M",
        a if a >= 1e4 => trim(format!("{:.1}", v / 1e3)) + "k",
        a if a >= 10.0 || a == 0.0 => format!("{v:.0}"),
        _ => trim(format!("{v:.2}")),
    }
}

/// Colours told apart by most eyes (Okabe and Ito's palette), then repeated.
const PALETTE: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(213, 94, 0),
    RGBColor(240, 228, 66),
    RGBColor(0, 0, 0),
];

/// Several runs in one picture: each run's val loss (thick, with points) and train loss
/// (thin, pale) in its own colour, against `x_label`'s unit. `runs`: (legend label, val
/// points, train points).
#[allow(clippy::type_complexity)]
pub fn comparison(
    runs: &[(String, Vec<(f64, f64)>, Vec<(f64, f64)>)],
    x_label: &str,
    out: &Path,
    title: &str,
) -> Result<()> {
    drawn_atomically(out, |drawing| {
        draw_comparison(runs, x_label, drawing, title)
    })
}

/// [`comparison`] drawn into `out` as it is.
#[allow(clippy::type_complexity)]
fn draw_comparison(
    runs: &[(String, Vec<(f64, f64)>, Vec<(f64, f64)>)],
    x_label: &str,
    out: &Path,
    title: &str,
) -> Result<()> {
    let points = || runs.iter().flat_map(|r| r.1.iter().chain(&r.2));
    if points().next().is_none() {
        user_bail!("none of the runs has losses to plot yet");
    }
    register_font();
    let (mut lo, mut hi) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    // Early training losses dwarf the differences that matter: the y range is set by
    // the val curves and the second half of the train curves.
    let focus = runs.iter().flat_map(|r| {
        let half = r.2.len() / 2;
        r.1.iter().chain(&r.2[half..])
    });
    let focus_hi = focus.map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    if focus_hi.is_finite() {
        hi = hi.min(focus_hi + (focus_hi - lo) * 0.3);
    }
    let pad = ((hi - lo) * 0.05).max(1e-3);
    lo = (lo - pad).max(0.0);
    hi += pad;
    let x_max = points().map(|p| p.0).fold(0.0, f64::max).max(1e-9);

    let root = canvas(out, (1100, 650))?;
    let mut chart = chart_builder(&root, title)
        .build_cartesian_2d(0f64..x_max, lo..hi)
        .map_err(plot_error(out))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc("loss (nats / token)")
        .x_label_formatter(&|v| short_number(*v))
        .label_style(("sans-serif", 15))
        .light_line_style(RGBColor(245, 245, 245))
        .draw()
        .map_err(plot_error(out))?;
    let in_range = |p: &&(f64, f64)| p.1 <= hi;
    for (i, (label, val, train)) in runs.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(
                train.iter().filter(in_range).copied(),
                color.mix(0.35).stroke_width(1),
            ))
            .map_err(plot_error(out))?;
        draw_readings(&mut chart, val, (color, 3), label, out)?;
    }
    draw_legend(&mut chart, out)?;
    root.present().map_err(plot_error(out))?;
    Ok(())
}

/// Attention weights of one prompt: `weights[layer][head][query][key]`.
pub struct AttentionMaps {
    pub tokens: Vec<String>,
    pub weights: Vec<Vec<Vec<Vec<f32>>>>,
}

/// A token as a row or column label: its text, or where it is part of a character
/// (byte-level BPE splits `é` in two) its bytes in hex, `<C3><A9>`, so that tokens
/// stay apart (each was one `�`).
fn token_label(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| {
        e.into_bytes()
            .iter()
            .map(|b| format!("<{b:02X}>"))
            .collect()
    })
}

impl AttentionMaps {
    /// Runs `text` through the model and keeps every head's softmax weights.
    pub fn compute(
        model: &crate::model::Gpt,
        tokenizer: &crate::tokenizer::Tokenizer,
        text: &str,
    ) -> Result<Self> {
        let ids = tokenizer.encode(text)?;
        let block = model.config().block_size;
        if ids.is_empty() || ids.len() > block {
            user_bail!(
                "the prompt is {} tokens; attention maps need 1 to {block} (the model's block_size)",
                ids.len()
            );
        }
        let input = candle_core::Tensor::new(ids.as_slice(), model.device())?.unsqueeze(0)?;
        let out = model.forward(&input, 0, None, None)?;
        let weights = out
            .attention
            .iter()
            .map(|w| {
                Ok(w.squeeze(0)?
                    .to_dtype(candle_core::DType::F32)?
                    .to_vec3::<f32>()?)
            })
            .collect::<Result<Vec<_>>>()?;
        let tokens = ids
            .iter()
            .map(|&id| Ok(token_label(tokenizer.token_bytes(id)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { tokens, weights })
    }
}

/// White (0) to dark blue (1).
fn shade(v: f32) -> RGBColor {
    let v = v.clamp(0.0, 1.0).sqrt(); // small weights stay visible
    let mix = |from: f32, to: f32| (from + (to - from) * v) as u8;
    RGBColor(mix(255.0, 8.0), mix(255.0, 48.0), mix(255.0, 120.0))
}

/// Draws each (layer, head) as a T x T heatmap, queries down and keys across, in one
/// grid (layers as rows, heads as columns). Masked (future) cells are hatched gray, so
/// the causal triangle shows.
pub fn attention_grid(
    maps: &AttentionMaps,
    layers: &[usize],
    heads: &[usize],
    out: &Path,
) -> Result<()> {
    drawn_atomically(out, |drawing| {
        draw_attention_grid(maps, layers, heads, drawing)
    })
}

/// [`attention_grid`] drawn into `out` as it is.
fn draw_attention_grid(
    maps: &AttentionMaps,
    layers: &[usize],
    heads: &[usize],
    out: &Path,
) -> Result<()> {
    register_font();
    let t = maps.tokens.len();
    let (rows, cols) = (layers.len(), heads.len());
    let single = rows * cols == 1;
    // Cells big enough to read; labels only where they fit.
    let cell = if single {
        (700 / t.max(1)).clamp(10, 48)
    } else {
        (260 / t.max(1)).clamp(3, 24)
    };
    let label_room = if single || t <= 24 { 90 } else { 20 };
    let panel_w = cell * t + label_room + 20;
    let panel_h = cell * t + label_room + 40;
    // Wide enough for the title (a one-token prompt's panel is not).
    let width = (panel_w * cols).max(560) as u32;
    let height = (panel_h * rows + 50) as u32;
    let root = canvas(out, (width, height))?;
    let root = root
        .titled(
            "attention weights: queries (rows) attend to keys (columns)",
            ("sans-serif", 20),
        )
        .map_err(plot_error(out))?;
    let panels = root.split_evenly((rows, cols));
    let label = |i: usize| -> String {
        let s = maps.tokens.get(i).cloned().unwrap_or_default();
        let s = s.replace('\n', "\\n").replace(' ', "·");
        if s.chars().count() > 8 {
            s.chars().take(7).collect::<String>() + "…"
        } else {
            s
        }
    };
    let font_size = (cell as f64 * 0.7).clamp(9.0, 16.0);
    for (panel, (li, hi)) in panels.iter().zip(
        layers
            .iter()
            .flat_map(|&l| heads.iter().map(move |&h| (l, h))),
    ) {
        let w = &maps.weights[li][hi];
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("layer {li}, head {hi}"), ("sans-serif", 15))
            .margin(6)
            .x_label_area_size(if label_room > 20 {
                label_room as u32
            } else {
                0
            })
            .y_label_area_size(if label_room > 20 {
                label_room as u32
            } else {
                0
            })
            .build_cartesian_2d(0f64..t as f64, t as f64..0f64)
            .map_err(plot_error(out))?;
        chart
            .draw_series((0..t).flat_map(|q| {
                (0..t).map(move |k| {
                    let color = if k > q {
                        RGBColor(225, 225, 225)
                    } else {
                        shade(w[q][k])
                    };
                    Rectangle::new(
                        [(k as f64, q as f64), (k as f64 + 1.0, q as f64 + 1.0)],
                        color.filled(),
                    )
                })
            }))
            .map_err(plot_error(out))?;
        if label_room > 20 {
            // One label per token, centred on its row and column (the mesh's own labels
            // pick "nice" tick values and skip tokens).
            let base = panel.get_base_pixel();
            let at = |x: f64, y: f64| {
                let (px, py) = chart.backend_coord(&(x, y));
                (px - base.0, py - base.1)
            };
            let style = ("sans-serif", font_size).into_font().color(&BLACK);
            for i in 0..t {
                let centre = i as f64 + 0.5;
                let (x, y) = at(0.0, centre);
                panel
                    .draw(&Text::new(
                        label(i),
                        (x - 4, y),
                        style.clone().pos(Pos::new(HPos::Right, VPos::Center)),
                    ))
                    .map_err(plot_error(out))?;
                let (x, y) = at(centre, t as f64);
                let rotated = style
                    .clone()
                    .transform(FontTransform::Rotate90)
                    .pos(Pos::new(HPos::Left, VPos::Center));
                panel
                    .draw(&Text::new(label(i), (x, y + 4), rotated))
                    .map_err(plot_error(out))?;
            }
        }
    }
    root.present().map_err(plot_error(out))?;
    Ok(())
}

/// Writes `loss.png` for a run folder; returns its path.
pub fn run_loss_curve(run_dir: &Path) -> Result<std::path::PathBuf> {
    let out = run_dir.join("loss.png");
    let title = run_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Drawn beside it and renamed over it (a killed draw's file is a run folder's temp
    // file, removed at the next resume).
    loss_curve(&run_dir.join(crate::checkpoint::METRICS_FILE), &out, &title)
        .with_context(|| format!("plotting {}", out.display()))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A picture lands whole or not at all: a draw that fails for want of space leaves
    /// no file and says so in one user's line; one that works replaces the old picture.
    #[test]
    fn a_picture_is_written_whole_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("p.png");
        std::fs::write(&out, b"old").unwrap();
        let full = drawn_atomically(&out, |drawing| {
            std::fs::write(drawing, b"half").unwrap();
            anyhow::bail!("backend error: IoError(No space left on device (os error 28))")
        })
        .unwrap_err();
        assert!(crate::error::find_user_error(&full).is_some(), "{full:#}");
        assert!(
            format!("{full}").contains("cannot write") && format!("{full}").contains("(--out)"),
            "{full}"
        );
        let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(files.len(), 1, "the temporary file is gone");
        assert_eq!(std::fs::read(&out).unwrap(), b"old");
        drawn_atomically(&out, |drawing| Ok(std::fs::write(drawing, b"new")?)).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"new");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_token_that_is_part_of_a_character_is_labelled_by_its_bytes() {
        assert_eq!(token_label("é".as_bytes().to_vec()), "é");
        assert_eq!(token_label(vec![0xC3]), "<C3>");
        assert_eq!(token_label(vec![0xE2, 0x98]), "<E2><98>");
    }

    #[test]
    fn the_step_axis_shows_whole_steps() {
        assert_eq!(step_label(0.0), "0");
        assert_eq!(step_label(5.0), "5");
        assert_eq!(step_label(2.5), "");
        assert_eq!(step_label(20000.0), "20k");
    }

    #[test]
    fn curves_read_both_kinds_of_lines() {
        let text = r#"{"step":0,"train_loss":4.0,"val_loss":4.1,"lr":0.0001}
{"step":10,"loss":3.0,"lr":0.001}
not json
{"step":20,"loss":2.0,"lr":0.0009}
{"step":20,"train_loss":2.1,"val_loss":2.3,"lr":0.0009}"#;
        let c = Curves::from_metrics(text);
        assert_eq!(c.train, vec![(10.0, 3.0), (20.0, 2.0)]);
        assert_eq!(c.eval_val, vec![(0.0, 4.1), (20.0, 2.3)]);
        assert_eq!(c.lr.len(), 4);
    }

    #[test]
    fn pngs_are_written() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        let lines: String = (0..50)
            .map(|s| {
                format!(
                    "{{\"step\":{s},\"loss\":{},\"lr\":{}}}\n",
                    4.0 - s as f64 * 0.05,
                    1e-3
                )
            })
            .collect();
        std::fs::write(
            &metrics,
            lines + "{\"step\":49,\"train_loss\":1.6,\"val_loss\":1.8,\"lr\":0.001}\n",
        )
        .unwrap();
        let out = dir.path().join("loss.png");
        loss_curve(&metrics, &out, "test").unwrap();
        let png = std::fs::read(&out).unwrap();
        assert_eq!(&png[1..4], b"PNG");

        let maps = AttentionMaps {
            tokens: vec!["a".into(), "b".into(), "\n".into()],
            weights: vec![vec![
                vec![
                    vec![1.0, 0.0, 0.0],
                    vec![0.3, 0.7, 0.0],
                    vec![0.2, 0.3, 0.5]
                ];
                2
            ]],
        };
        let out = dir.path().join("attn.png");
        attention_grid(&maps, &[0], &[0, 1], &out).unwrap();
        assert_eq!(&std::fs::read(&out).unwrap()[1..4], b"PNG");
    }
}
