//! User data files: sentence labels (TSV, CSV with a header, JSONL), per-word labels (JSONL),
//! and plain text (one document per line). Every problem is reported with the file and line.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How a data file is written; `auto` goes by the extension (`.tsv`, `.csv`, `.jsonl`/`.json`,
/// `.txt`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataFormat {
    /// By the file's extension (the default).
    #[default]
    Auto,
    /// `text<TAB>label` per line; a first line naming the two fields is a header.
    Tsv,
    /// Comma-separated with a header row naming the fields (RFC 4180 quoting).
    Csv,
    /// One JSON object per line.
    Jsonl,
    /// One document per line (MLM).
    Text,
}

/// What a record holds besides its words.
#[derive(Clone, Debug, PartialEq)]
pub enum RecordLabel {
    /// A sentence label.
    Class(String),
    /// One label per word.
    Tags(Vec<String>),
    /// No label (MLM text).
    Unlabelled,
}

/// What to read from each record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// A sentence label per record.
    Class,
    /// A label per word.
    Tags,
    /// Text alone.
    Text,
}

/// A record and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// Where the record is.
    pub source: Source,
    /// Its words, split on whitespace (or as given, for tags).
    pub words: Vec<String>,
    /// Its label.
    pub label: RecordLabel,
}

/// A file and a 1-based line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// The file.
    pub path: Arc<Path>,
    /// The line, from 1.
    pub line: usize,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.path.display(), self.line)
    }
}

impl Source {
    /// A data error at this file and line.
    pub fn error(&self, message: impl Into<String>) -> Error {
        Error::Data {
            path: self.path.to_path_buf(),
            line: Some(self.line),
            message: message.into(),
        }
    }
}

fn file_error(path: &Path, message: impl Into<String>) -> Error {
    Error::Data {
        path: path.to_path_buf(),
        line: None,
        message: message.into(),
    }
}

/// The format of `path`: `format` unless `auto`, else by extension.
pub fn resolve_format(path: &Path, format: DataFormat) -> Result<DataFormat> {
    if format != DataFormat::Auto {
        return Ok(format);
    }
    match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
        Some("tsv") => Ok(DataFormat::Tsv),
        Some("csv") => Ok(DataFormat::Csv),
        Some("jsonl" | "json" | "ndjson") => Ok(DataFormat::Jsonl),
        Some("txt" | "text") => Ok(DataFormat::Text),
        _ => Err(file_error(
            path,
            "cannot tell the format from the extension: name it .tsv, .csv, .jsonl or .txt, or set \
             format = \"tsv\" | \"csv\" | \"jsonl\" | \"text\"",
        )),
    }
}

/// The longest line a data file may have: 4 MiB.
const MAX_LINE_BYTES: usize = 4 << 20;

/// The UTF-8 byte-order mark some editors write at the start of a file.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// The file's lines as UTF-8 (a leading byte-order mark and a trailing `\r` removed), each
/// with its 1-based number.
fn lines(path: &Path) -> Result<Vec<(usize, String)>> {
    let bytes = crate::io::read_bounded(path, crate::io::MAX_DATA_BYTES, "data")?;
    let bytes = bytes.strip_prefix(BOM).unwrap_or(&bytes);
    let mut out = Vec::new();
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        if raw.len() > MAX_LINE_BYTES {
            return Err(Error::Data {
                path: path.into(),
                line: Some(i + 1),
                message: format!(
                    "the line is {} long, more than the {} a line may be: one example per \
                     line; split it, or check that this is the right file",
                    crate::io::human_bytes(raw.len() as u64),
                    crate::io::human_bytes(MAX_LINE_BYTES as u64)
                ),
            });
        }
        match std::str::from_utf8(raw) {
            Ok(line) => out.push((i + 1, line.to_string())),
            Err(e) => {
                return Err(Error::Data {
                    path: path.into(),
                    line: Some(i + 1),
                    message: format!(
                        "invalid UTF-8 at byte {} of the line: convert the file to UTF-8",
                        e.valid_up_to()
                    ),
                })
            }
        }
    }
    Ok(out)
}

fn words_of(text: &str) -> Vec<String> {
    text.split_whitespace().map(String::from).collect()
}

/// Reads every record of `path`. `text_field` and `label_field` name the CSV columns or JSON keys
/// (for tags: the word list, or a text split on whitespace, and the label list).
pub fn read_records(
    path: &Path,
    format: DataFormat,
    kind: RecordKind,
    text_field: &str,
    label_field: &str,
) -> Result<Vec<Record>> {
    let file = DataFile {
        path: Arc::from(path),
        kind,
        text_field,
        label_field,
    };
    let records = match resolve_format(path, format)? {
        DataFormat::Auto => unreachable!("resolve_format picks a format"),
        DataFormat::Text => file.read_text()?,
        DataFormat::Tsv => file.read_tsv()?,
        DataFormat::Csv => file.read_csv()?,
        DataFormat::Jsonl => file.read_jsonl()?,
    };
    if records.is_empty() {
        return Err(file_error(
            path,
            "no examples: the file is empty (or holds only blank lines and a header)",
        ));
    }
    Ok(records)
}

/// A data file being read: where, what its records hold, and the fields that hold it.
struct DataFile<'a> {
    path: Arc<Path>,
    kind: RecordKind,
    text_field: &'a str,
    label_field: &'a str,
}

impl DataFile<'_> {
    /// Line `line` of the file.
    fn at(&self, line: usize) -> Source {
        Source {
            path: self.path.clone(),
            line,
        }
    }

    /// Refuses per-word labels in a format other than JSONL.
    fn text_only(&self, what: &str) -> Result<()> {
        if self.kind == RecordKind::Tags {
            return Err(file_error(
                &self.path,
                format!("per-word labels are read from JSONL only, not {what}: write one {{\"words\": [...], \"labels\": [...]}} per line"),
            ));
        }
        Ok(())
    }

    /// Plain text: one unlabelled example per non-blank line.
    fn read_text(&self) -> Result<Vec<Record>> {
        Ok(lines(&self.path)?
            .into_iter()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(n, line)| Record {
                source: self.at(n),
                words: words_of(&line),
                label: RecordLabel::Unlabelled,
            })
            .collect())
    }

    /// `text<TAB>label` per line, an optional header line naming the two fields.
    fn read_tsv(&self) -> Result<Vec<Record>> {
        self.text_only("TSV")?;
        let header = format!("{}\t{}", self.text_field, self.label_field);
        let mut records = Vec::new();
        let mut first = true;
        for (n, line) in lines(&self.path)? {
            if line.trim().is_empty() {
                continue;
            }
            if std::mem::take(&mut first) && line.trim().eq_ignore_ascii_case(&header) {
                continue;
            }
            let source = self.at(n);
            let tabs = line.matches('\t').count();
            let (text, label) = match (self.kind, line.rsplit_once('\t')) {
                (RecordKind::Text, _) => (line.as_str(), ""),
                (_, Some(_)) if tabs > 1 => {
                    return Err(source.error(format!(
                        "{} fields where `text<TAB>label` has 2: remove the tabs inside the \
                         text, or write the file as CSV or JSONL",
                        tabs + 1
                    )))
                }
                (_, Some((t, l))) => (t, l.trim()),
                (_, None) => {
                    return Err(
                        source.error("missing label: expected `text<TAB>label`, found no tab")
                    )
                }
            };
            records.push(labelled(source, text, label, self.kind)?);
        }
        Ok(records)
    }

    /// CSV with a header row naming the text (and label) columns.
    fn read_csv(&self) -> Result<Vec<Record>> {
        self.text_only("CSV")?;
        let path = &*self.path;
        let text = lines(path)?
            .into_iter()
            .map(|(_, l)| l)
            .collect::<Vec<_>>()
            .join("\n");
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(true)
            .flexible(false)
            .from_reader(text.as_bytes());
        let header = reader
            .headers()
            .map_err(|e| file_error(path, format!("cannot read the header row: {e}")))?
            .clone();
        if header.is_empty() {
            return Err(file_error(path, "no examples: the file is empty"));
        }
        let column = |name: &str| {
            header.iter().position(|h| h.trim() == name).ok_or_else(|| {
                let names: Vec<String> = header.iter().map(|h| format!("`{h}`")).collect();
                Error::Data {
                    path: path.into(),
                    line: Some(1),
                    message: format!(
                        "unknown column `{name}`: the header has {}; set text_field / label_field",
                        names.join(", ")
                    ),
                }
            })
        };
        let text_col = column(self.text_field)?;
        let label_col = match self.kind {
            RecordKind::Class => Some(column(self.label_field)?),
            _ => None,
        };
        let mut records = Vec::new();
        for row in reader.records() {
            let row = row.map_err(|e| Error::Data {
                path: path.into(),
                line: e.position().map(|p| p.line() as usize),
                message: format!("malformed CSV row: {e}"),
            })?;
            let n = row.position().map_or(0, |p| p.line() as usize);
            let label = label_col.and_then(|c| row.get(c)).unwrap_or("").trim();
            let text = row.get(text_col).unwrap_or("");
            records.push(labelled(self.at(n), text, label, self.kind)?);
        }
        Ok(records)
    }

    /// One JSON object per line.
    fn read_jsonl(&self) -> Result<Vec<Record>> {
        let mut records = Vec::new();
        for (n, line) in lines(&self.path)? {
            if line.trim().is_empty() {
                continue;
            }
            let source = self.at(n);
            let value: serde_json::Value = serde_json::from_str(&line)
                .map_err(|e| source.error(format!("not a JSON object: {e}")))?;
            let object = value
                .as_object()
                .ok_or_else(|| source.error("each line must be a JSON object"))?;
            let line = JsonLine { object, source };
            records.push(match self.kind {
                RecordKind::Tags => self.json_tags(line)?,
                RecordKind::Class | RecordKind::Text => self.json_text(line)?,
            });
        }
        Ok(records)
    }

    /// A line's words (a list, or a string split on whitespace) and one label per word.
    fn json_tags(&self, line: JsonLine) -> Result<Record> {
        let (text_field, label_field) = (self.text_field, self.label_field);
        let words = match line.object.get(text_field) {
            Some(serde_json::Value::Array(a)) => line.scalars(a, text_field, "strings")?,
            Some(serde_json::Value::String(t)) => words_of(t),
            Some(_) => {
                return Err(line.error(format!(
                    "`{text_field}` must be a list of words or a string"
                )))
            }
            None => return Err(line.missing(text_field)),
        };
        let labels = match line.object.get(label_field) {
            Some(serde_json::Value::Array(a)) => {
                line.scalars(a, label_field, "strings or numbers")?
            }
            Some(_) => {
                return Err(line.error(format!(
                    "`{label_field}` must be a list, one label per word"
                )))
            }
            None => return Err(line.missing(label_field)),
        };
        if words.is_empty() {
            return Err(line.error("empty text"));
        }
        if words.len() != labels.len() {
            return Err(line.error(format!(
                "{} words but {} labels: give one label per word",
                words.len(),
                labels.len()
            )));
        }
        Ok(Record {
            source: line.source,
            words,
            label: RecordLabel::Tags(labels),
        })
    }

    /// A line's text, and its label for a classification.
    fn json_text(&self, line: JsonLine) -> Result<Record> {
        let (text_field, label_field) = (self.text_field, self.label_field);
        let text = line
            .object
            .get(text_field)
            .ok_or_else(|| line.missing(text_field))?;
        let text = text
            .as_str()
            .ok_or_else(|| line.error(format!("`{text_field}` must be a string")))?;
        let label = match self.kind {
            RecordKind::Class => {
                let l = line
                    .object
                    .get(label_field)
                    .ok_or_else(|| line.missing(label_field))?;
                scalar(l).ok_or_else(|| {
                    line.error(format!("`{label_field}` must be a string or a number"))
                })?
            }
            _ => String::new(),
        };
        labelled(line.source, text, &label, self.kind)
    }
}

/// A JSONL line's object and where it is.
struct JsonLine<'a> {
    object: &'a serde_json::Map<String, serde_json::Value>,
    source: Source,
}

impl JsonLine<'_> {
    fn error(&self, message: impl Into<String>) -> Error {
        self.source.error(message)
    }

    /// A field the line lacks, with the fields it has.
    fn missing(&self, field: &str) -> Error {
        let keys: Vec<String> = self.object.keys().map(|k| format!("`{k}`")).collect();
        self.error(format!(
            "missing field `{field}` (this line has {}); set text_field / label_field",
            if keys.is_empty() {
                "none".to_string()
            } else {
                keys.join(", ")
            }
        ))
    }

    /// A list of scalars as strings; anything else in it is an error naming `field`.
    fn scalars(&self, list: &[serde_json::Value], field: &str, what: &str) -> Result<Vec<String>> {
        list.iter()
            .map(|v| scalar(v).ok_or_else(|| self.error(format!("`{field}` must list {what}"))))
            .collect()
    }
}

/// A string, number or boolean as text.
fn scalar(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(x) => Some(x.to_string()),
        serde_json::Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn labelled(source: Source, text: &str, label: &str, kind: RecordKind) -> Result<Record> {
    let words = words_of(text);
    if words.is_empty() {
        return Err(source.error("empty text"));
    }
    let label = match kind {
        RecordKind::Class if label.is_empty() => {
            return Err(source.error("missing label: the label field is empty"))
        }
        RecordKind::Class => RecordLabel::Class(label.to_string()),
        RecordKind::Tags => unreachable!("tags come from JSONL"),
        RecordKind::Text => RecordLabel::Unlabelled,
    };
    Ok(Record {
        source,
        words,
        label,
    })
}

/// Options of a task read from files, `kind = "classify"` or `kind = "tag"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileOptions {
    /// The training file.
    pub train: PathBuf,
    /// A validation file; without one, `valid_fraction` of `train` is held out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub valid: Option<PathBuf>,
    /// A test file; without one, `test_fraction` of `train` is held out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test: Option<PathBuf>,
    /// The share of `train` held out for validation without a `valid` file (default 0.1).
    #[serde(default = "default_fraction")]
    pub valid_fraction: f64,
    /// The share of `train` held out for testing without a `test` file (default 0.1).
    #[serde(default = "default_fraction")]
    pub test_fraction: f64,
    /// How the files are written (default `auto`, by extension).
    #[serde(default)]
    pub format: DataFormat,
    /// CSV column or JSON key of the text (for tags: the word list, or a string); default
    /// `text` (`words` for tags).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_field: Option<String>,
    /// CSV column or JSON key of the label; default `label` (`labels` for tags).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_field: Option<String>,
}

fn default_fraction() -> f64 {
    0.1
}

impl FileOptions {
    /// Checks the fractions; the error says which is wrong and what to give instead.
    pub fn validate(&self) -> std::result::Result<(), String> {
        for (name, f) in [
            ("valid_fraction", self.valid_fraction),
            ("test_fraction", self.test_fraction),
        ] {
            if !(0.0..0.5).contains(&f) {
                return Err(format!("{name} = {f} must be in [0, 0.5)"));
            }
        }
        let held_out = self.valid.is_none() as u8 as f64 * self.valid_fraction
            + self.test.is_none() as u8 as f64 * self.test_fraction;
        if (self.valid.is_none() && self.valid_fraction == 0.0)
            || (self.test.is_none() && self.test_fraction == 0.0)
        {
            return Err("give a valid and a test file, or a positive valid_fraction / test_fraction to hold them out of train".into());
        }
        if held_out >= 0.9 {
            return Err("valid_fraction + test_fraction leave too little to train on".into());
        }
        Ok(())
    }

    /// The text and label field names for `kind`, defaults filled in.
    pub fn fields(&self, kind: RecordKind) -> (String, String) {
        let (text, label) = match kind {
            RecordKind::Tags => ("words", "labels"),
            _ => ("text", "label"),
        };
        (
            self.text_field.clone().unwrap_or_else(|| text.into()),
            self.label_field.clone().unwrap_or_else(|| label.into()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn err(path: &Path, format: DataFormat, kind: RecordKind) -> String {
        let (t, l) = if kind == RecordKind::Tags {
            ("words", "labels")
        } else {
            ("text", "label")
        };
        read_records(path, format, kind, t, l)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn every_format_reads() {
        let d = tempfile::tempdir().unwrap();
        let tsv = write(
            d.path(),
            "a.tsv",
            b"text\tlabel\nthe cat sat\tpos\r\n\n a dog  ran \tneg\n",
        );
        let r = read_records(&tsv, DataFormat::Auto, RecordKind::Class, "text", "label").unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[1].words.clone(), r[1].label.clone()),
            (
                vec!["a".into(), "dog".into(), "ran".into()],
                RecordLabel::Class("neg".into())
            )
        );
        assert_eq!(r[1].source.line, 4);

        let csv = write(
            d.path(),
            "a.csv",
            b"id,review,stars\n1,\"good, really good\",5\n2,bad,1\n",
        );
        let r = read_records(&csv, DataFormat::Auto, RecordKind::Class, "review", "stars").unwrap();
        assert_eq!(r[0].words, vec!["good,", "really", "good"]);
        assert_eq!(
            (r[0].label.clone(), r[1].source.line),
            (RecordLabel::Class("5".into()), 3)
        );

        let jsonl = write(
            d.path(),
            "a.jsonl",
            b"{\"text\": \"yes it is\", \"label\": 1}\n{\"text\": \"no\", \"label\": \"x\"}\n",
        );
        let r = read_records(&jsonl, DataFormat::Auto, RecordKind::Class, "text", "label").unwrap();
        assert_eq!(r[0].label, RecordLabel::Class("1".into()));

        let tags = write(d.path(), "t.jsonl", b"{\"words\": [\"Ann\", \"ran\"], \"labels\": [\"PER\", \"O\"]}\n{\"words\": \"Bo sat\", \"labels\": [\"PER\", 0]}\n");
        let r = read_records(&tags, DataFormat::Auto, RecordKind::Tags, "words", "labels").unwrap();
        assert_eq!(
            r[1].label,
            RecordLabel::Tags(vec!["PER".into(), "0".into()])
        );

        let txt = write(d.path(), "m.txt", b"one doc here\n\nanother one\n");
        assert_eq!(
            read_records(&txt, DataFormat::Auto, RecordKind::Text, "text", "label")
                .unwrap()
                .len(),
            2
        );
    }

    #[test]
    fn every_bad_input_names_file_line_and_fix() {
        let d = tempfile::tempdir().unwrap();
        let cases: Vec<(&str, &[u8], RecordKind, &[&str])> = vec![
            (
                "empty.tsv",
                b"\n\n",
                RecordKind::Class,
                &["empty.tsv", "no examples"],
            ),
            (
                "header_only.csv",
                b"text,label\n",
                RecordKind::Class,
                &["header_only.csv", "no examples"],
            ),
            (
                "nolabel.tsv",
                b"good\tpos\njust text\n",
                RecordKind::Class,
                &["nolabel.tsv:2", "missing label", "no tab"],
            ),
            (
                "blanklabel.tsv",
                b"good\t \n",
                RecordKind::Class,
                &["blanklabel.tsv:1", "missing label"],
            ),
            (
                "blanktext.tsv",
                b" \tpos\n",
                RecordKind::Class,
                &["blanktext.tsv:1", "empty text"],
            ),
            (
                "column.csv",
                b"review,stars\nok,1\n",
                RecordKind::Class,
                &["column.csv:1", "unknown column `text`", "`review`, `stars`"],
            ),
            (
                "ragged.csv",
                b"text,label\nok,1\nbad,1,extra\n",
                RecordKind::Class,
                &["ragged.csv:3", "malformed CSV"],
            ),
            (
                "nolabel.jsonl",
                b"{\"text\": \"ok\"}\n",
                RecordKind::Class,
                &["nolabel.jsonl:1", "missing field `label`", "`text`"],
            ),
            (
                "broken.jsonl",
                b"{\"text\": \"ok\", \"label\": 1}\n{text: ok}\n",
                RecordKind::Class,
                &["broken.jsonl:2", "not a JSON object"],
            ),
            (
                "mismatch.jsonl",
                b"{\"words\": [\"a\", \"b\", \"c\"], \"labels\": [\"X\", \"Y\"]}\n",
                RecordKind::Tags,
                &["mismatch.jsonl:1", "3 words but 2 labels"],
            ),
            (
                "latin1.tsv",
                b"ok\tpos\ncaf\xe9\tpos\n",
                RecordKind::Class,
                &["latin1.tsv:2", "invalid UTF-8", "byte 3"],
            ),
            (
                "tags.tsv",
                b"a\tb\n",
                RecordKind::Tags,
                &["tags.tsv", "JSONL only"],
            ),
        ];
        for (name, bytes, kind, needles) in cases {
            let p = write(d.path(), name, bytes);
            let message = err(&p, DataFormat::Auto, kind);
            for n in needles {
                assert!(message.contains(n), "{name}: {message:?} lacks {n:?}");
            }
        }
        let odd = write(d.path(), "data.dat", b"x\n");
        assert!(err(&odd, DataFormat::Auto, RecordKind::Class).contains("format = "));
        let missing = err(
            &d.path().join("absent.tsv"),
            DataFormat::Tsv,
            RecordKind::Class,
        );
        assert!(missing.contains("absent.tsv"), "{missing}");
    }
}
