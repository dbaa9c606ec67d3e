//! `mlm`: masked language modelling on generated sentences, or on the user's text file (one
//! document per line).

use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};

use super::files::{read_records, DataFormat, RecordKind};
use super::{grammar, Example, Generator, Label, Objective, Splits, TestSet};
use crate::error::{Error, Result};
use crate::rng::{self, Rng};

fn default_mask_prob() -> f64 {
    0.15
}

/// Masked language modelling on generated sentences, or on `text_file` (one document per
/// line, words split on whitespace).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mlm {
    /// The share of tokens masked (default 0.15).
    #[serde(default = "default_mask_prob")]
    pub mask_prob: f64,
    /// A text file to mask instead of generated sentences.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_file: Option<PathBuf>,
}

impl Mlm {
    /// Checks the options that do not depend on lengths.
    pub fn check_options(&self) -> std::result::Result<(), String> {
        if self.mask_prob > 0.0 && self.mask_prob < 1.0 {
            Ok(())
        } else {
            Err(format!(
                "mlm: mask_prob = {} must be in (0, 1)",
                self.mask_prob
            ))
        }
    }

    fn objective_only(&self) -> Objective {
        Objective::Mlm {
            mask_prob: self.mask_prob,
        }
    }

    /// The user's text file, its lines shuffled by `data_seed`, then split train / valid /
    /// test (`eval_examples` each, at most a fifth of the lines; at most `train_examples` kept
    /// for training).
    pub(super) fn split_text_file(
        &self,
        path: &Path,
        data_seed: u64,
        eval_examples: usize,
        train_examples: Option<usize>,
    ) -> Result<Splits> {
        let mut lines: Vec<Example> =
            read_records(path, DataFormat::Text, RecordKind::Text, "text", "label")?
                .into_iter()
                .map(|r| Example {
                    words: r.words,
                    label: Label::Masked,
                    source: Some(r.source),
                })
                .collect();
        if lines.len() < 3 {
            return Err(Error::Data {
                path: path.into(),
                line: None,
                message: format!(
                    "{} non-empty lines; an MLM split needs at least 3",
                    lines.len()
                ),
            });
        }
        lines.shuffle(&mut rng::stream(data_seed, "task/text_file/shuffle"));
        let n_eval = eval_examples.min(lines.len() / 5).max(1);
        let test = lines.split_off(lines.len() - n_eval);
        let valid = lines.split_off(lines.len() - n_eval);
        if let Some(n) = train_examples {
            lines.truncate(n);
        }
        Ok(Splits {
            train: lines,
            valid,
            tests: vec![TestSet::of_file(test)],
            objective: self.objective_only(),
            vocabulary: None,
            tokenizer: None,
        })
    }
}

impl Generator for Mlm {
    fn check(&self, _shortest: usize, _longest: usize) -> std::result::Result<(), String> {
        self.check_options()
    }

    fn objective(&self) -> (Objective, Vec<String>) {
        (self.objective_only(), grammar::vocabulary())
    }

    fn example(&self, rng: &mut Rng, len: usize) -> Example {
        let (words, _) = grammar::sentence(rng, len.max(grammar::SHORTEST));
        Example::new(words.into_iter().map(String::from).collect(), Label::Masked)
    }
}
