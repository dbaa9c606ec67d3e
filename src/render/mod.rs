//! What is drawn, shared by every room that draws: the pictures' toolkit (embedded font,
//! palette, colour scales, PNG rendering, line charts: [`plot`]), aligned text and Markdown
//! tables ([`table`]), and the self-contained HTML page with its embedded chart script
//! ([`html`]). It knows no run, analysis or scheme: a report, an analysis and `bench` pass it
//! their numbers.

pub mod html;
pub mod plot;
pub mod table;
