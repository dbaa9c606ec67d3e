//! What is drawn, shared by every room that draws: pictures as values ([`chart`]: charts,
//! marks, legends, pages of panels) and their PNG rendering ([`png`], the one caller of the
//! drawing library), CSV files ([`csv`]), aligned text and Markdown tables ([`table`]), and
//! the self-contained HTML page with its embedded chart script ([`html`]). It knows no run,
//! analysis or scheme: a report, an analysis and `bench` describe what to show and pass it
//! their numbers.

pub mod chart;
pub mod csv;
pub mod html;
pub mod png;
pub mod table;
