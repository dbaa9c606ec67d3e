//! Text tables for the terminal and Markdown: each column as wide as its widest cell, text
//! columns aligned left and numbers right. `report`, `bench`, `compare`'s estimate and
//! `inspect` print through it.

/// A table: a header, optionally a second header line (units), rows, and which columns align
/// right.
///
/// ```
/// use poslab::render::table::TextTable;
/// let mut t = TextTable::new(["variant", "tok/s"], [false, true]);
/// t.push(["rope", "1200"]);
/// t.push(["sin_add", "980"]);
/// assert_eq!(t.text(), "variant  tok/s\nrope      1200\nsin_add    980\n");
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TextTable {
    /// The column names.
    pub header: Vec<String>,
    /// A second header line under the names (units, what a figure is), if any.
    pub units: Option<Vec<String>>,
    /// The rows, a cell per column.
    pub rows: Vec<Vec<String>>,
    /// Per column: aligned right (numbers) rather than left.
    pub right: Vec<bool>,
}

impl TextTable {
    /// A table with these columns, `right[c]` for the columns aligned right.
    pub fn new<S: Into<String>>(
        header: impl IntoIterator<Item = S>,
        right: impl IntoIterator<Item = bool>,
    ) -> Self {
        Self {
            header: header.into_iter().map(Into::into).collect(),
            units: None,
            rows: Vec::new(),
            right: right.into_iter().collect(),
        }
    }

    /// The table with a second header line.
    pub fn with_units<S: Into<String>>(mut self, units: impl IntoIterator<Item = S>) -> Self {
        self.units = Some(units.into_iter().map(Into::into).collect());
        self
    }

    /// Appends a row.
    ///
    /// # Panics
    /// If the row does not have a cell per column (a bug of the caller).
    pub fn push<S: Into<String>>(&mut self, row: impl IntoIterator<Item = S>) {
        let row: Vec<String> = row.into_iter().map(Into::into).collect();
        assert_eq!(row.len(), self.header.len(), "a cell per column");
        self.rows.push(row);
    }

    /// Each column's widest cell, of the headers too when they are printed.
    fn widths(&self, headers: bool) -> Vec<usize> {
        let headers = std::iter::once(&self.header)
            .chain(&self.units)
            .filter(|_| headers);
        (0..self.header.len())
            .map(|c| {
                headers
                    .clone()
                    .chain(&self.rows)
                    .map(|r| r[c].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect()
    }

    fn line(&self, widths: &[usize], indent: usize, r: &[String]) -> String {
        let cells: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(c, v)| {
                if self.right[c] {
                    format!("{v:>w$}", w = widths[c])
                } else {
                    format!("{v:<w$}", w = widths[c])
                }
            })
            .collect();
        format!("{}{}", " ".repeat(indent), cells.join("  "))
            .trim_end()
            .to_string()
            + "\n"
    }

    /// The table as aligned text: the header, its units line, then the rows; columns two
    /// spaces apart, no trailing spaces.
    pub fn text(&self) -> String {
        let widths = self.widths(true);
        std::iter::once(&self.header)
            .chain(&self.units)
            .chain(&self.rows)
            .map(|r| self.line(&widths, 0, r))
            .collect()
    }

    /// The rows alone, aligned and indented by `indent` spaces (a list under a sentence that
    /// names the columns).
    pub fn list(&self, indent: usize) -> String {
        let widths = self.widths(false);
        self.rows
            .iter()
            .map(|r| self.line(&widths, indent, r))
            .collect()
    }

    /// The table in Markdown (the units line, if any, is not part of it).
    pub fn markdown(&self) -> String {
        let mut out = format!("| {} |\n", self.header.join(" | "));
        let rule: Vec<&str> = self
            .right
            .iter()
            .map(|&r| if r { "---:" } else { "---" })
            .collect();
        out.push_str(&format!("| {} |\n", rule.join(" | ")));
        for r in &self.rows {
            out.push_str(&format!("| {} |\n", r.join(" | ")));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_take_their_widest_cell_and_lists_indent() {
        let mut t = TextTable::new(["a", "number"], [false, true]).with_units(["", "ms"]);
        t.push(["long name", "1"]);
        t.push(["b", "22.5"]);
        assert_eq!(
            t.text(),
            "a          number\n               ms\nlong name       1\nb            22.5\n"
        );
        assert_eq!(t.list(2), "  long name     1\n  b          22.5\n");
        assert_eq!(
            t.markdown(),
            "| a | number |\n| --- | ---: |\n| long name | 1 |\n| b | 22.5 |\n"
        );
    }
}
