//! Self-contained HTML pages: `report.html` of a comparison ([`crate::runs::report_page`]) and
//! of an analysis ([`crate::analysis::page`]).
//!
//! A page is its data, embedded as JSON, drawn by an embedded script: the shared pieces
//! (`chart.js`: elements, ticks, a chart of curves with bands and a hover read-out) and the
//! page's own script ([`Script`]: `comparison.js`, `analysis.js`). The rooms that know what the
//! numbers mean build the data; every line that draws is here. Nothing is fetched: the file
//! works offline and from a `file://` URL.
//!
//! **Why poslab draws its own SVG.** A charting library (Plotly, Vega, Chart.js) is 200 KB to
//! 3.5 MB of minified script to vendor, pin and license-check, for what these pages draw: lines,
//! bands, dashed guides, a heatmap, points and a tooltip. `chart.js` is about 170 lines of plain
//! JavaScript with no dependency, and every number a page prints as text comes from poslab's
//! own formatting, carried in the data, so a page cannot disagree with the run's files.

use serde::Serialize;

/// The style every page shares.
const STYLE: &str = include_str!("style.css");

/// The script every page shares: `poslab.el`, `poslab.chart`, ...
const CHART: &str = include_str!("chart.js");

/// Which page a script draws, from the data its room builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Script {
    /// A comparison's `report.html` (`comparison.js`), from [`crate::runs::report_page`]'s data.
    Comparison,
    /// An analysis's `report.html` (`analysis.js`), from [`crate::analysis::page`]'s data.
    Analysis,
}

impl Script {
    /// The script's source.
    fn source(self) -> &'static str {
        match self {
            Script::Comparison => include_str!("comparison.js"),
            Script::Analysis => include_str!("analysis.js"),
        }
    }
}

/// A page titled `title`, drawn by `script` from `data`: one file, with its style and scripts.
pub fn document(title: &str, data: &impl Serialize, script: Script) -> String {
    let script = script.source();
    // `<` only occurs inside JSON strings, where `\u003c` means the same: no `</script>` can
    // end the data early.
    let data = serde_json::to_string(data)
        .expect("a page's data serializes")
        .replace('<', "\\u003c");
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{}</title>\n<style>\n{STYLE}</style>\n</head>\n<body>\n\
         <main id=\"page\"><noscript>This report is drawn by its embedded script: open it in a \
         browser with JavaScript on. Its numbers are also in the run's other files.\
         </noscript></main>\n\
         <script type=\"application/json\" id=\"data\">{data}</script>\n\
         <script>\n{CHART}</script>\n<script>\n{script}</script>\n</body>\n</html>\n",
        escape(title)
    )
}

/// `s` with the characters HTML gives a meaning escaped.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// `v` to 5 significant digits: what a chart can show, in a third of the bytes.
pub fn significant(v: f64) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let scale = 10f64.powi(4 - v.abs().log10().floor() as i32);
    (v * scale).round() / scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_data_cannot_close_its_script() {
        let page = document(
            "a <b> & \"c\"",
            &["</script><script>alert(1)"],
            Script::Analysis,
        );
        assert_eq!(
            page.matches("</script>").count(),
            3,
            "data, chart.js, the page's"
        );
        assert!(page.contains("<title>a &lt;b&gt; &amp; &quot;c&quot;</title>"));
        assert!(page.contains("\\u003c/script>\\u003cscript>alert(1)"));
    }

    #[test]
    fn significant_keeps_five_digits() {
        assert_eq!(significant(123.456789), 123.46);
        assert_eq!(significant(0.000123456789), 0.00012346);
        assert_eq!(significant(-98765.4321), -98765.0);
        assert_eq!(significant(0.0), 0.0);
    }
}
