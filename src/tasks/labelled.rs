//! `classify` and `tag`: the user's labelled files (TSV, CSV or JSONL), split into train,
//! valid and test, with the label names taken from the training data.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use rand::seq::SliceRandom;

use super::files::{read_records, FileOptions, Record, RecordKind, RecordLabel};
use super::{Example, Label, Objective, Splits, TestSet};
use crate::error::{Error, Result};
use crate::rng;

/// The records of `o`'s files split into train / valid / test: given files stand, the rest are
/// held out of train by the fractions, shuffled by `data_seed`; at most `train_examples` kept
/// for training.
pub(super) fn splits(
    o: &FileOptions,
    kind: RecordKind,
    data_seed: u64,
    train_examples: Option<usize>,
) -> Result<Splits> {
    let (text_field, label_field) = o.fields(kind);
    let read = |p: &PathBuf| read_records(p, o.format, kind, &text_field, &label_field);
    let mut train = read(&o.train)?;
    train.shuffle(&mut rng::stream(data_seed, "task/files/split"));
    // Both fractions are of the whole training file.
    let total = train.len();
    let mut hold_out = |fraction: f64, file: &Option<PathBuf>, what: &str| -> Result<Vec<Record>> {
        match file {
            Some(p) => read(p),
            None => {
                let n = ((total as f64 * fraction).round() as usize).max(1);
                if n >= train.len() {
                    return Err(Error::Data {
                        path: o.train.clone(),
                        line: None,
                        message: format!(
                            "{total} examples are too few to hold out a {what} split: give a \
                                 {what} file"
                        ),
                    });
                }
                Ok(train.split_off(train.len() - n))
            }
        }
    };
    let test = hold_out(o.test_fraction, &o.test, "test")?;
    let valid = hold_out(o.valid_fraction, &o.valid, "valid")?;
    if let Some(n) = train_examples {
        train.truncate(n);
    }
    let labels = label_names(&train, kind, o)?;
    let index: BTreeMap<&str, usize> = labels
        .iter()
        .enumerate()
        .map(|(i, l)| (l.as_str(), i))
        .collect();
    let convert = |records: Vec<Record>| -> Result<Vec<Example>> {
        records.into_iter().map(|r| example(r, &index)).collect()
    };
    let (train, valid, test) = (convert(train)?, convert(valid)?, convert(test)?);
    let objective = match kind {
        RecordKind::Class => Objective::Classify { labels },
        _ => Objective::Tag { labels },
    };
    Ok(Splits {
        train,
        valid,
        tests: vec![TestSet::of_file(test)],
        objective,
        vocabulary: None,
        tokenizer: None,
    })
}

/// The training data's labels, sorted: valid and test may not bring new ones.
fn label_names(train: &[Record], kind: RecordKind, o: &FileOptions) -> Result<Vec<String>> {
    let mut names = BTreeSet::new();
    for r in train {
        match &r.label {
            RecordLabel::Class(c) => {
                names.insert(c.clone());
            }
            RecordLabel::Tags(t) => names.extend(t.iter().cloned()),
            RecordLabel::Unlabelled => {}
        }
    }
    let labels: Vec<String> = names.into_iter().collect();
    if kind != RecordKind::Text && labels.len() < 2 {
        return Err(Error::Data {
            path: o.train.clone(),
            line: None,
            message: format!(
                "the training data has {} label{}{}: a model of one class learns nothing and \
                 scores 100%; give examples of at least two labels",
                labels.len(),
                if labels.len() == 1 { "" } else { "s" },
                labels
                    .first()
                    .map_or(String::new(), |l| format!(" (`{l}`)"))
            ),
        });
    }
    Ok(labels)
}

/// A record as an example, its labels as ids of `index`.
fn example(r: Record, index: &BTreeMap<&str, usize>) -> Result<Example> {
    let id = |l: &str| {
        index.get(l).copied().ok_or_else(|| {
            r.source.error(format!(
                "label `{l}` does not occur in the training data (which has {}): a model cannot \
                 learn it",
                index.len()
            ))
        })
    };
    let label = match &r.label {
        RecordLabel::Class(c) => Label::Class(id(c)?),
        RecordLabel::Tags(t) => {
            Label::Tags(t.iter().map(|l| id(l).map(Some)).collect::<Result<_>>()?)
        }
        RecordLabel::Unlabelled => Label::Masked,
    };
    Ok(Example {
        words: r.words,
        label,
        source: Some(r.source),
    })
}
