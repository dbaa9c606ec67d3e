//! CSV files, written atomically through `csv::Writer`: typed rows, a key column beside one
//! column per series, or a matrix with labelled rows and columns.

use std::path::Path;

use crate::error::{Error, Result};
use crate::io::write_atomic;

/// Typed rows as a CSV file (a header from the row's fields), written atomically.
pub fn write_rows<R: serde::Serialize>(
    path: &Path,
    rows: impl IntoIterator<Item = R>,
) -> Result<()> {
    write_atomic(path, rows_text(rows).as_bytes())
}

/// Typed rows as CSV text: a header from the row's fields, fields quoted where they must be.
pub fn rows_text<R: serde::Serialize>(rows: impl IntoIterator<Item = R>) -> String {
    let mut w = ::csv::Writer::from_writer(Vec::new());
    for row in rows {
        w.serialize(row)
            .expect("rows of plain fields serialize to memory");
    }
    String::from_utf8(w.into_inner().expect("CSV in memory")).expect("CSV of UTF-8 fields")
}

/// A CSV of a key column (`first`, then `keys`) and one column of numbers per named series,
/// each as long as `keys`.
pub fn write_columns_csv<'a>(
    path: &Path,
    first: &str,
    keys: impl IntoIterator<Item = String>,
    series: impl IntoIterator<Item = (String, &'a [f64])> + Clone,
) -> Result<()> {
    let header = std::iter::once(first.to_string()).chain(series.clone().into_iter().map(|s| s.0));
    let rows = keys.into_iter().enumerate().map(|(i, key)| {
        std::iter::once(key)
            .chain(series.clone().into_iter().map(|s| s.1[i].to_string()))
            .collect()
    });
    write_records_csv(path, header, rows)
}

/// A CSV of a header and rows of cells: the one writer the others go through.
pub fn write_records_csv(
    path: &Path,
    header: impl IntoIterator<Item = String>,
    rows: impl IntoIterator<Item = Vec<String>>,
) -> Result<()> {
    let mut w = ::csv::Writer::from_writer(Vec::new());
    let fail = |e: ::csv::Error| Error::io(path, e.into());
    w.write_record(header).map_err(fail)?;
    for row in rows {
        w.write_record(row).map_err(fail)?;
    }
    write_atomic(path, &w.into_inner().expect("CSV in memory"))
}

/// A row-major `rows x cols` matrix as a CSV: a header of `first` and the column labels, then
/// each row under its label.
pub fn write_matrix_csv(
    path: &Path,
    (rows, cols, data): (usize, usize, &[f64]),
    first: &str,
    row_label: impl Fn(usize) -> String,
    col_label: impl Fn(usize) -> String,
) -> Result<()> {
    let header = std::iter::once(first.to_string()).chain((0..cols).map(col_label));
    assert_eq!(data.len(), rows * cols, "a matrix's data fills its rows");
    let rows = (0..rows).map(|r| {
        std::iter::once(row_label(r))
            .chain(data[r * cols..(r + 1) * cols].iter().map(|v| v.to_string()))
            .collect()
    });
    write_records_csv(path, header, rows)
}
