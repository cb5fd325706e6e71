//! The HTML report: one self-contained page (inline CSS, inline SVG, no script, no
//! external resource), with the tables of the Markdown report and one chart per cell
//! of throughput against IOThread count, native and baseline drawn as horizontal
//! lines, like the seeds' graphs.

use std::fmt::Write as _;

use crate::matrix::Cell;
use crate::merit::CellMerit;
use crate::study::{fmt_mb, Study};
use crate::tables::{facts, noisy_lines, tables, Table};

/// Escapes text for HTML content and attributes.
pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

const CSS: &str = "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#222;background:#fff}\
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em}\
table{border-collapse:collapse;margin:8px 0 4px;font-size:13px}\
th,td{border:1px solid #bbb;padding:3px 8px}th{background:#e8eef6}\
td.n{text-align:right;font-variant-numeric:tabular-nums}tr.total td{font-weight:bold;background:#f3f3f3}\
p.note{color:#555;font-size:13px;margin:2px 0 8px}dl.facts{font-size:13px}\
dl.facts dt{font-weight:bold;float:left;clear:left;width:11em}dl.facts dd{margin-left:12em}\
code{font-size:12px;word-break:break-all}\
.charts{display:flex;flex-wrap:wrap;gap:12px}figure.chart{margin:0;border:1px solid #ddd;padding:4px}\
figure.chart figcaption{font-size:12px;text-align:center}\
.legend span{display:inline-block;margin-right:14px;font-size:13px}\
.sw{display:inline-block;width:18px;height:3px;vertical-align:middle;margin-right:4px}";

/// Colours: IOThread series, baseline, native.
const C_SERIES: &str = "#1f5fbf";
const C_BASE: &str = "#d9730d";
const C_NATIVE: &str = "#2e8b3a";

/// A "nice" axis maximum and tick step for values up to `max`.
fn nice_axis(max: f64) -> (f64, f64) {
    if max.is_nan() || max <= 0.0 {
        return (1.0, 0.25);
    }
    let raw = max / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    ((max / step).ceil() * step, step)
}

/// Where a chart draws: the SVG size, the plot area inside its margins and the
/// y axis scale, with the maps from values to pixels.
#[derive(Debug, Clone, Copy)]
struct Frame {
    w: f64,
    h: f64,
    l: f64,
    t: f64,
    pw: f64,
    ph: f64,
    ymax: f64,
    step: f64,
    n: f64,
}

impl Frame {
    /// The frame for `points` (IOThread count, mean, min, max) and the cell's
    /// reference lines.
    fn new(points: &[(u32, f64, f64, f64)], m: &CellMerit) -> Frame {
        let (w, h) = (340.0, 210.0);
        let (l, r, t, b) = (52.0, 12.0, 14.0, 34.0);
        let mut top = points.iter().map(|p| p.3).fold(0.0, f64::max);
        for x in [&m.baseline, &m.native].into_iter().flatten() {
            top = top.max(x.max);
        }
        let (ymax, step) = nice_axis(top);
        Frame {
            w,
            h,
            l,
            t,
            pw: w - l - r,
            ph: h - t - b,
            ymax,
            step,
            n: points.len().max(1) as f64,
        }
    }

    /// Pixel row of throughput `v`.
    fn y(&self, v: f64) -> f64 {
        self.t + self.ph - v / self.ymax * self.ph
    }

    /// Pixel column of the `i`th IOThread count.
    fn x(&self, i: usize) -> f64 {
        self.l + self.pw * (i as f64 + 0.5) / self.n
    }
}

/// One chart: throughput (y) against IOThread count (x, one category per count),
/// min-max whiskers over the repeats, baseline and native as dashed lines.
pub fn chart(cell: &Cell, m: &CellMerit) -> String {
    let points: Vec<(u32, f64, f64, f64)> = m
        .iothreads
        .iter()
        .map(|(&k, x)| (k, x.mean, x.min, x.max))
        .collect();
    let f = Frame::new(&points, m);
    let Frame { w, h, .. } = f;
    let mut s = String::new();
    let title = format!("{cell}");
    let _ = write!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" role=\"img\" aria-label=\"{}\">",
        esc(&title)
    );
    let _ = write!(
        s,
        "<rect x=\"0\" y=\"0\" width=\"{w}\" height=\"{h}\" fill=\"#ffffff\"/>"
    );
    chart_axes(&mut s, &f);
    chart_reference_lines(&mut s, &f, m);
    chart_series(&mut s, &f, &points);
    s.push_str("</svg>");
    s
}

/// The grid with its y labels, the two axes and their titles.
fn chart_axes(s: &mut String, f: &Frame) {
    let Frame {
        h, l, t, pw, ph, ..
    } = *f;
    let mut v = 0.0;
    while v <= f.ymax * 1.0001 {
        let yy = f.y(v);
        let _ = write!(
            s,
            "<line x1=\"{l}\" y1=\"{yy:.1}\" x2=\"{:.1}\" y2=\"{yy:.1}\" stroke=\"#e2e2e2\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"end\" fill=\"#444\">{}</text>",
            l + pw,
            l - 4.0,
            yy + 3.5,
            fmt_mb(v)
        );
        v += f.step;
    }
    let _ = write!(
        s,
        "<line x1=\"{l}\" y1=\"{t}\" x2=\"{l}\" y2=\"{:.1}\" stroke=\"#444\"/><line x1=\"{l}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#444\"/>",
        t + ph,
        t + ph,
        l + pw,
        t + ph
    );
    let _ = write!(
        s,
        "<text x=\"12\" y=\"{:.1}\" font-size=\"10\" fill=\"#444\" transform=\"rotate(-90 12 {:.1})\" text-anchor=\"middle\">MB/s</text>",
        t + ph / 2.0,
        t + ph / 2.0
    );
    let _ = write!(
        s,
        "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" fill=\"#444\" text-anchor=\"middle\">IOThreads</text>",
        l + pw / 2.0,
        h - 4.0
    );
}

/// Native and baseline as dashed horizontal lines at their means.
fn chart_reference_lines(s: &mut String, f: &Frame, m: &CellMerit) {
    let Frame { l, pw, .. } = *f;
    for (meas, colour, name) in [
        (&m.native, C_NATIVE, "native"),
        (&m.baseline, C_BASE, "baseline"),
    ] {
        if let Some(meas) = meas {
            let yy = f.y(meas.mean);
            let _ = write!(
                s,
                "<line class=\"ref-{name}\" x1=\"{l}\" y1=\"{yy:.1}\" x2=\"{:.1}\" y2=\"{yy:.1}\" stroke=\"{colour}\" stroke-width=\"2\" stroke-dasharray=\"6 4\"><title>{name}: {} MB/s</title></line>",
                l + pw,
                fmt_mb(meas.mean)
            );
        }
    }
}

/// The IOThread series: a line through the means, a min-max whisker and a labelled
/// point per count.
fn chart_series(s: &mut String, f: &Frame, points: &[(u32, f64, f64, f64)]) {
    let path: Vec<String> = points
        .iter()
        .enumerate()
        .map(|(i, p)| format!("{:.1},{:.1}", f.x(i), f.y(p.1)))
        .collect();
    if path.len() > 1 {
        let _ = write!(s, "<polyline class=\"series\" points=\"{}\" fill=\"none\" stroke=\"{C_SERIES}\" stroke-width=\"2\"/>", path.join(" "));
    }
    for (i, p) in points.iter().enumerate() {
        let xx = f.x(i);
        if p.3 > p.2 {
            let _ = write!(
                s,
                "<line x1=\"{xx:.1}\" y1=\"{:.1}\" x2=\"{xx:.1}\" y2=\"{:.1}\" stroke=\"{C_SERIES}\" stroke-width=\"1\"/>",
                f.y(p.2),
                f.y(p.3)
            );
        }
        let _ = write!(
            s,
            "<circle class=\"point\" cx=\"{xx:.1}\" cy=\"{:.1}\" r=\"3.5\" fill=\"{C_SERIES}\"><title>{} IOThreads: {} MB/s</title></circle>\
             <text x=\"{xx:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"middle\" fill=\"#444\">{}</text>",
            f.y(p.1),
            p.0,
            fmt_mb(p.1),
            f.t + f.ph + 13.0,
            p.0
        );
    }
}

/// The whole page.
pub fn html(study: &Study) -> String {
    let mut o = String::new();
    o.push_str("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">");
    o.push_str("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">");
    o.push_str("<title>vqblk IOThread study</title><style>");
    o.push_str(CSS);
    o.push_str("</style></head><body>\n<h1>vqblk IOThread study</h1>\n");
    page_facts(&mut o, study);
    for (i, t) in tables(study).iter().enumerate() {
        page_table(&mut o, i, t);
    }
    page_charts(&mut o, study);
    page_problems(&mut o, study);
    o.push_str("</body></html>\n");
    o
}

/// The facts of the study as a definition list, and the note on the marks.
fn page_facts(o: &mut String, study: &Study) {
    o.push_str("<dl class=\"facts\">");
    for (k, v) in facts(study) {
        let val = if k.starts_with("command") {
            format!("<code>{}</code>", esc(&v))
        } else {
            esc(&v)
        };
        let _ = write!(o, "<dt>{}</dt><dd>{val}</dd>", esc(&k));
    }
    o.push_str("</dl>\n");
    let _ = writeln!(
        o,
        "<p class=\"note\">~ marks a cell where some column's repeats differ by more than {:.0}% (noisy); n/a = not measured.</p>",
        study.opts.noise * 100.0
    );
}

/// Table number `i`, with its title and note.
fn page_table(o: &mut String, i: usize, t: &Table) {
    let _ = write!(
        o,
        "<h2>{}</h2><p class=\"note\">{}</p><table id=\"table-{i}\"><thead><tr>",
        esc(&t.title),
        esc(&t.note)
    );
    for hd in &t.header {
        let _ = write!(o, "<th>{}</th>", esc(hd));
    }
    o.push_str("</tr></thead><tbody>");
    for (row, total) in &t.rows {
        o.push_str(if *total {
            "<tr class=\"total\">"
        } else {
            "<tr>"
        });
        for (c, val) in row.iter().enumerate() {
            let cls = if t.numeric.get(c).copied().unwrap_or(false) {
                " class=\"n\""
            } else {
                ""
            };
            let _ = write!(o, "<td{cls}>{}</td>", esc(val));
        }
        o.push_str("</tr>");
    }
    o.push_str("</tbody></table>\n");
}

/// The legend and one captioned chart per cell.
fn page_charts(o: &mut String, study: &Study) {
    o.push_str("<h2>Throughput against IOThread count</h2>\n<p class=\"legend\">");
    let _ = write!(o, "<span><i class=\"sw\" style=\"background:{C_SERIES}\"></i>vqblk, N IOThreads (whiskers: min-max of the repeats)</span>");
    if study.has_baseline {
        let _ = write!(
            o,
            "<span><i class=\"sw\" style=\"background:{C_BASE}\"></i>baseline (0)</span>"
        );
    }
    if study.has_native {
        let _ = write!(
            o,
            "<span><i class=\"sw\" style=\"background:{C_NATIVE}\"></i>native</span>"
        );
    }
    o.push_str("</p>\n<div class=\"charts\">\n");
    for (cell, m) in &study.merits {
        let noisy = if m.is_noisy() { " (noisy)" } else { "" };
        let best = m
            .best
            .map(|b| format!(", best {} MB/s", fmt_mb(b)))
            .unwrap_or_default();
        let _ = writeln!(
            o,
            "<figure class=\"chart\">{}<figcaption>{}{best}{noisy}</figcaption></figure>",
            chart(cell, m),
            esc(&cell.to_string())
        );
    }
    o.push_str("</div>\n");
}

/// The noisy cells and the failed run attempts, each list only if not empty.
fn page_problems(o: &mut String, study: &Study) {
    let noisy = noisy_lines(study);
    if !noisy.is_empty() {
        o.push_str("<h2>Noisy cells (relative range of the repeats)</h2><ul>");
        for l in noisy {
            let _ = write!(o, "<li>{}</li>", esc(&l));
        }
        o.push_str("</ul>\n");
    }
    if !study.results.errors.is_empty() {
        o.push_str("<h2>Failed run attempts</h2><ul>");
        for e in &study.results.errors {
            let _ = write!(
                o,
                "<li>{} {}: {}</li>",
                esc(&e.setup),
                esc(&e.cell.to_string()),
                esc(&e.message)
            );
        }
        o.push_str("</ul>\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matrix::{Op, Setup};
    use crate::merit::{cell_merit, Options};
    use std::collections::BTreeMap;

    #[test]
    fn axis_is_nice() {
        assert_eq!(nice_axis(0.0), (1.0, 0.25));
        assert_eq!(nice_axis(95.0), (100.0, 25.0));
        assert_eq!(nice_axis(1234.0), (1500.0, 500.0));
        let (m, s) = nice_axis(7.3);
        assert!(m >= 7.3 && s > 0.0);
    }

    #[test]
    fn chart_has_series_and_reference_lines() {
        let samples = BTreeMap::from([
            (Setup::Native, vec![300.0]),
            (Setup::Baseline, vec![100.0, 110.0]),
            (Setup::IoThreads(1), vec![150.0, 160.0]),
            (Setup::IoThreads(2), vec![200.0, 200.0]),
        ]);
        let m = cell_merit(&samples, Options::default());
        let c = chart(
            &Cell {
                bs: 4096,
                op: Op::Randread,
                jobs: 4,
                iodepth: 16,
            },
            &m,
        );
        assert!(c.starts_with("<svg") && c.ends_with("</svg>"));
        assert_eq!(c.matches("class=\"point\"").count(), 2);
        assert!(c.contains("class=\"series\""));
        assert!(c.contains("class=\"ref-native\"") && c.contains("class=\"ref-baseline\""));
        assert!(c.contains("randread 4k jobs=4 iodepth=16"));
        assert!(
            !c.contains("http://") || c.matches("http://").count() == 1,
            "only the SVG namespace"
        );
    }

    #[test]
    fn escaping() {
        assert_eq!(
            esc("<a href='x'>&\"</a>"),
            "&lt;a href=&#39;x&#39;&gt;&amp;&quot;&lt;/a&gt;"
        );
    }
}
