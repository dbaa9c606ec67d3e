//! A task prepared once for every model trained on it: generated, tokenized into its
//! training, validation and test sets (by length, shuffled, shifted), with its head; and the
//! tests run on a trained model.

use candle::{DType, Device};

use super::results::{
    base_test_index, shift_column, Evaluation, Examples, Outcome, TaskInfo, TestInfo, SCORE,
    SHUFFLED,
};
use crate::config::ModelConfig;
use crate::data::{Dataset, MlmMasking};
use crate::error::{Error, Result};
use crate::model::{HeadConfig, Pooling, TaskModel};
use crate::params::ParamStore;
use crate::positional::RopeScaling;
use crate::rng::{self, derive_seed};
use crate::tasks::{Objective, TaskData, TaskSpec};
use crate::train::{evaluate_examples, evaluate_tapes, TrainData};

/// A test the model can run: data, position offset, MLM mask seed.
struct Test {
    name: String,
    /// Index into [`Prepared::sets`].
    set: usize,
    start: usize,
    mask_seed: u64,
}

/// A task generated and tokenized once, shared by all of its cells (and by `poslab train`).
pub(crate) struct Prepared<'a> {
    pub(crate) spec: &'a TaskSpec,
    pub(crate) data: TaskData,
    pub(crate) head: HeadConfig,
    pub(crate) masking: Option<MlmMasking>,
    pub(crate) train: Dataset,
    pub(crate) valid: Dataset,
    /// How texts are framed for the model (what a training draw is encoded with).
    framing: crate::data::Framing,
    /// The test sets by length, then the shuffled copy of the base test set if any.
    sets: Vec<Dataset>,
    tests: Vec<Test>,
    pub(crate) info: TaskInfo,
}

/// Tokenizes `data` of `spec` into the splits, the head and the tests (by length, shuffled for
/// sentence labels, shifted by `shift`). With `template`, every text is framed by the
/// tokenizer's special tokens (`[CLS] ... [SEP]`), as a pretrained encoder reads it; first-token
/// pooling then reads its `[CLS]`.
pub(crate) fn prepare(
    spec: &TaskSpec,
    data: TaskData,
    pooling: Pooling,
    shift: usize,
    template: bool,
) -> Result<Prepared<'_>> {
    let tok = &data.tokenizer;
    let head = data.objective.head(pooling);
    let framing = crate::data::Framing::of(tok, template, head.reads_first_token())?;
    let masking = match &data.objective {
        Objective::Mlm { mask_prob } => Some(MlmMasking::new(*mask_prob, tok)?),
        _ => None,
    };
    let train = Dataset::encode(&data.train, tok, framing, data.limit)?;
    let valid = Dataset::encode(&data.valid, tok, framing, data.limit)?;
    let mut sets = data
        .tests
        .iter()
        .map(|t| Dataset::encode(&t.examples, tok, framing, data.limit))
        .collect::<Result<Vec<_>>>()?;
    let notes: Vec<String> = [("training", &train), ("validation", &valid)]
        .into_iter()
        .chain(sets.iter().map(|s| ("test", s)))
        .filter(|(_, set)| set.truncated > 0)
        .map(|(what, set)| {
            format!(
                "{} of {} {what} examples were cut to max_tokens = {} (truncate = true)",
                set.truncated,
                set.samples.len(),
                data.limit.max_tokens.unwrap_or(0)
            )
        })
        .collect();
    // MLM masks (and randomized positions) of a test, the same for every model.
    let mask_seed = |t: &crate::tasks::TestSet| match t.factor {
        Some(factor) => derive_seed(spec.data_seed, "test masks", factor as u64),
        None => derive_seed(spec.data_seed, &format!("test masks {}", t.name), 0),
    };
    let mut tests: Vec<Test> = data
        .tests
        .iter()
        .enumerate()
        .map(|(i, t)| Test {
            name: t.name.clone(),
            set: i,
            start: 0,
            mask_seed: mask_seed(t),
        })
        .collect();
    // The order tests run on the test set at the training lengths (the first of a range list).
    let base = base_test_index(data.tests.iter().map(|t| t.factor));
    let base_seed = mask_seed(&data.tests[base]);
    let shuffle_test = matches!(data.objective, Objective::Classify { .. });
    if shuffle_test {
        let shuffled = sets[base]
            .with_shuffled_tokens(framing, &mut rng::stream(spec.data_seed, "shuffle test"));
        sets.push(shuffled);
        tests.push(Test {
            name: SHUFFLED.into(),
            set: sets.len() - 1,
            start: 0,
            mask_seed: base_seed,
        });
    }
    tests.push(Test {
        name: shift_column(shift),
        set: base,
        start: shift,
        mask_seed: base_seed,
    });
    let info = task_info(spec, &data, shift, shuffle_test, notes);
    Ok(Prepared {
        spec,
        data,
        head,
        masking,
        train,
        valid,
        framing,
        sets,
        tests,
        info,
    })
}

/// What the report says of a task: its lengths, its tests and its notes.
fn task_info(
    spec: &TaskSpec,
    data: &TaskData,
    shift: usize,
    shuffle_test: bool,
    notes: Vec<String>,
) -> TaskInfo {
    // Tapes (the length suite's, next-token prediction's) are scored by length, their outcomes
    // stratified by it; other tests record each example's length. The length suite has a
    // score over the lengths past the training ones.
    use crate::tasks::TaskKind;
    let suite = matches!(spec.kind, TaskKind::Algorithmic(_));
    let tapes = suite || matches!(spec.kind, TaskKind::Lm(_));
    TaskInfo {
        name: spec.name.clone(),
        kind: spec.kind.name().into(),
        metric: data.objective.metric().into(),
        train_lengths: spec.lengths.unwrap_or_else(|| data.train_lengths()),
        tests: data
            .tests
            .iter()
            .map(|t| TestInfo {
                name: t.name.clone(),
                factor: t.factor,
                lengths: t.tested_lengths(),
                examples: t.examples.len(),
                example_lengths: (!tapes).then(|| {
                    TestInfo::pack_lengths(t.examples.iter().map(crate::tasks::Example::length))
                }),
            })
            .collect(),
        shift: Some(shift),
        shuffle_test,
        order_blind_ceiling: data.order_blind_ceiling.clone(),
        vocab_size: data.tokenizer.vocab_size(),
        notes,
        score_above: suite.then(|| spec.lengths.map_or(0, |l| l[1])),
    }
}

/// How many of a split's tokens are the tokenizer's unknown token ([`Prepared::unknown_tokens`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct UnknownTokens {
    /// `training`, `validation` or a test set's name.
    pub split: String,
    /// Tokens that are `[UNK]`.
    pub unknown: usize,
    /// Tokens in all.
    pub tokens: usize,
}

impl Prepared<'_> {
    /// For a task read from files, how many of the tokens each split's inputs hold (training,
    /// validation, each test set; as the model reads them, framing included) are the
    /// tokenizer's unknown token: words the training texts did not have (or had too rarely).
    /// Empty for a generated task (whose vocabulary is its own) and for a tokenizer without an
    /// unknown token.
    pub(crate) fn unknown_tokens(&self) -> Vec<UnknownTokens> {
        let Some(unk) = self.data.tokenizer.unk_id() else {
            return Vec::new();
        };
        if self.data.kind.generator().is_some() {
            return Vec::new();
        }
        let count = |split: String, set: &Dataset| UnknownTokens {
            split,
            unknown: set
                .samples
                .iter()
                .map(|s| s.ids.iter().filter(|&&id| id == unk).count())
                .sum(),
            tokens: set.samples.iter().map(|s| s.ids.len()).sum(),
        };
        // The test sets come first in `sets`, in the order of the task's tests.
        [
            ("training".to_string(), &self.train),
            ("validation".into(), &self.valid),
        ]
        .into_iter()
        .chain(
            self.data
                .tests
                .iter()
                .zip(&self.sets)
                .map(|(t, set)| (format!("test `{}`", t.name), set)),
        )
        .map(|(split, set)| count(split, set))
        .collect()
    }

    /// One line on [`Prepared::unknown_tokens`] where any split has some, with the fix when the
    /// task's tokenizer could lowercase and does not: `None` where all is known.
    pub(crate) fn unknown_tokens_note(&self) -> Option<String> {
        let counts = self.unknown_tokens();
        if counts.iter().all(|c| c.unknown == 0) {
            return None;
        }
        let parts: Vec<String> = counts
            .iter()
            .filter(|c| c.tokens > 0)
            .map(|c| {
                format!(
                    "{} of {} {} tokens ({:.1}%)",
                    c.unknown,
                    c.tokens,
                    c.split,
                    100.0 * c.unknown as f64 / c.tokens as f64
                )
            })
            .collect();
        let fix = match self.spec.tokenizer {
            crate::text::TokenizerSpec::WordLevel {
                lowercase: false, ..
            } => {
                "; word_level keeps capitals apart (\"Dog\" is not \"dog\"): set `tokenizer = { \
                 kind = \"word_level\", lowercase = true }` in [task] if they are the cause"
            }
            _ => "",
        };
        Some(format!(
            "task `{}`: [UNK] (a word the training texts did not have, or had too rarely) is {}{fix}",
            self.data.name,
            parts.join(", ")
        ))
    }

    /// Rows a learned table gets: the longest training input, or `max_tokens` when set.
    pub(crate) fn table_rows(&self) -> usize {
        self.train
            .max_len()
            .max(self.data.limit.max_tokens.unwrap_or(0))
    }

    /// The longest input of any split (training, validation, every test).
    pub(crate) fn longest_input(&self) -> usize {
        [&self.train, &self.valid]
            .into_iter()
            .chain(&self.sets)
            .map(Dataset::max_len)
            .max()
            .unwrap_or(0)
    }

    /// Refuses randomized positions drawn from fewer than the longest input's positions.
    pub(crate) fn check_random_positions(
        &self,
        random_positions: Option<usize>,
        what: &str,
    ) -> Result<()> {
        match random_positions {
            Some(n) if n < self.longest_input() => Err(Error::Config(format!(
                "{what}: random_positions = {n}, but task `{}` has inputs of {} tokens, which \
                 need as many distinct positions: set random_positions to at least {}",
                self.spec.name,
                self.longest_input(),
                self.longest_input()
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses a model whose training batches (`at_once` models training at a time) or test
    /// batches would not fit the memory limit (see [`crate::limits`]), before anything trains.
    ///
    /// Only training shares the limit among the models at once. Its estimate is what the
    /// backward pass keeps (the paper shape: 252 MB estimated, 307 MiB peak measured), while
    /// the test estimate counts every head's `t x t` weights at once, which the fused CPU
    /// kernels never hold together (64 x 1500 tokens at the paper shape: 9.3 GiB estimated,
    /// 384 MiB measured): shared, it would refuse test lengths that run.
    pub(crate) fn check_memory(
        &self,
        sizes: &crate::limits::Sizes,
        train_batch: usize,
        eval_batch: usize,
        what: &str,
        at_once: usize,
        limits: &crate::limits::Limits,
    ) -> Result<()> {
        let training = [&self.train, &self.valid]
            .map(|s| s.max_len())
            .into_iter()
            .max()
            .unwrap_or(0);
        limits
            .check_batches(
                sizes,
                train_batch,
                training,
                true,
                &format!("{what}: training"),
                at_once,
            )
            .map_err(Error::Config)?;
        let testing = self.sets.iter().map(Dataset::max_len).max().unwrap_or(0);
        limits
            .check_batch(
                sizes,
                eval_batch,
                testing,
                false,
                &format!("{what}: testing"),
            )
            .map_err(Error::Config)
    }

    /// The set of every test run (in the order the tests run; a set tested twice, shifted,
    /// appears twice), and the validation set.
    pub(crate) fn eval_sets(&self) -> (Vec<&Dataset>, &Dataset) {
        (
            self.tests.iter().map(|t| &self.sets[t.set]).collect(),
            &self.valid,
        )
    }

    /// The data `train` needs.
    pub(crate) fn train_data(&self) -> TrainData<'_> {
        self.train_data_on(&self.train)
    }

    /// The data `train` needs, with `train` as the training set (a seed's own draw).
    pub(crate) fn train_data_on<'a>(&'a self, train: &'a Dataset) -> TrainData<'a> {
        TrainData {
            train,
            valid: &self.valid,
            pad_id: self.data.tokenizer.pad_id(),
            masking: self.masking.as_ref(),
        }
    }

    /// The training set of training seed `seed` where each seed draws its own
    /// ([`crate::tasks::TaskSpec::training_draw`]), tokenized as the task's own.
    pub(crate) fn training_draw(&self, seed: u64) -> Result<Dataset> {
        let examples = self.spec.training_draw(&self.data, seed)?;
        Dataset::encode(
            &examples,
            &self.data.tokenizer,
            self.framing,
            self.data.limit,
        )
    }

    /// Every test of the task on `model`; a test whose inputs a learned table cannot hold is
    /// marked unavailable with the reason.
    pub(crate) fn evaluate(&self, model: &TaskModel, eval_batch: usize) -> Result<Vec<Evaluation>> {
        let evaluations = (0..self.tests.len())
            .map(|i| self.evaluate_test(model, i, eval_batch))
            .collect::<Result<Vec<_>>>()?;
        Ok(self.with_score(evaluations))
    }

    /// `evaluations` with the length suite's score inserted after the tests by length: the
    /// mean over every tested length above the training maximum (each length weighs the same,
    /// and counts once: where test sets overlap, as `eval_factors` 2 and 4 do, a length is
    /// scored by the first test that has it).
    fn with_score(&self, mut evaluations: Vec<Evaluation>) -> Vec<Evaluation> {
        let Some(above) = self.info.score_above else {
            return evaluations;
        };
        let mut lengths = std::collections::BTreeMap::new();
        // The examples of each length counted, from the test that scores it.
        let mut strata: std::collections::BTreeMap<usize, Vec<(u32, u32)>> = Default::default();
        let mut unavailable = None;
        for e in evaluations.iter().take(self.info.tests.len()) {
            match &e.outcome {
                Outcome::Scored { by_length, .. } => {
                    let unpacked = e.examples.as_ref().and_then(|x| x.unpack().ok());
                    for s in by_length.iter().filter(|s| s.length > above) {
                        if lengths.contains_key(&s.length) {
                            continue;
                        }
                        lengths.insert(s.length, *s);
                        if let Some(u) = &unpacked {
                            let k = e.examples.as_ref().map_or(&[][..], |x| &x.strata[..]);
                            if let Some(i) = k.iter().position(|[len, _]| *len == s.length) {
                                strata.insert(s.length, u.strata[i].clone());
                            }
                        }
                    }
                }
                Outcome::Unavailable { reason } if reaches_above(&self.info, &e.name, above) => {
                    unavailable = Some(format!("test {}: {reason}", e.name));
                }
                Outcome::Unavailable { .. } => {}
            }
        }
        let (outcome, examples) = match unavailable {
            Some(reason) => (Outcome::Unavailable { reason }, None),
            None if lengths.is_empty() => (
                Outcome::Unavailable {
                    reason: format!("no test length is above the training lengths (up to {above})"),
                },
                None,
            ),
            None => {
                let examples = (strata.len() == lengths.len())
                    .then(|| Examples::pack(&strata.into_iter().collect::<Vec<_>>()));
                (
                    Outcome::by_length(lengths.into_values().collect()),
                    examples,
                )
            }
        };
        evaluations.insert(
            self.info.tests.len(),
            Evaluation {
                name: SCORE.into(),
                outcome,
                examples,
            },
        );
        evaluations
    }

    /// The largest position (plus one) test `i` reads without randomized positions.
    fn reach(&self, i: usize) -> usize {
        let test = &self.tests[i];
        test.start + self.sets[test.set].max_len()
    }

    /// Test `i` on `model`.
    fn evaluate_test(&self, model: &TaskModel, i: usize, eval_batch: usize) -> Result<Evaluation> {
        let table_rows = model.encoder().max_positions();
        let pad = self.data.tokenizer.pad_id();
        let test = &self.tests[i];
        {
            {
                let set = &self.sets[test.set];
                // Randomized positions may reach any position below N.
                let reach = match model.encoder().config().random_positions {
                    Some(n) => test.start + n,
                    None => self.reach(i),
                };
                let (outcome, examples) = match table_rows {
                    Some(rows) if reach > rows => (Outcome::Unavailable {
                        reason: format!("the learned table has {rows} rows; these inputs reach position {reach}"),
                    }, None),
                    _ if set.samples.iter().any(|s| s.tape.is_some()) => {
                        let (scores, tapes) = evaluate_tapes(model, set, pad, test.mask_seed, eval_batch, test.start)?;
                        (Outcome::by_length(scores), Some(Examples::pack(&by_stratum(&tapes))))
                    }
                    _ => {
                        let (s, examples) = evaluate_examples(model, set, pad, self.masking.as_ref(), test.mask_seed, eval_batch, test.start)?;
                        (Outcome::scored(s.accuracy, s.loss), Some(Examples::pack(&[(0, examples)])))
                    }
                };
                Ok(Evaluation {
                    name: test.name.clone(),
                    outcome,
                    examples,
                })
            }
        }
    }

    /// Every test of a trained `rope` model re-scored under `scaling`, without retraining: the
    /// same weights, the frequencies rescaled per test (`factor = "auto"`: the test's largest
    /// position plus one over the training's longest input).
    pub(crate) fn evaluate_scaled(
        &self,
        model_config: &ModelConfig,
        params: &ParamStore,
        scaling: &RopeScaling,
        eval_batch: usize,
        backend: crate::nn::Backend,
    ) -> Result<Vec<Evaluation>> {
        let refused = || {
            Error::Config(format!(
                "rope scaling applies to rope models, not `{}`",
                model_config.positional.name()
            ))
        };
        if !model_config.positional.rescales() {
            return Err(refused());
        }
        let trained = self.train.max_len().max(1);
        let device = params
            .vars()
            .first()
            .map_or(Device::Cpu, |(_, v)| v.device().clone());
        (0..self.tests.len())
            .map(|i| {
                let auto = self.reach(i) as f64 / trained as f64;
                let scaled = ModelConfig {
                    positional: model_config
                        .positional
                        .with_scaling(Some(scaling.resolved(auto, trained)))
                        .ok_or_else(refused)?,
                    ..model_config.clone()
                };
                // Built from the same store: the trained variables, shared.
                let model =
                    TaskModel::new(&scaled, &self.head, params.var_builder(DType::F32, &device))?
                        .with_backend(backend);
                self.evaluate_test(&model, i, eval_batch)
            })
            .collect::<Result<Vec<_>>>()
            .map(|e| self.with_score(e))
    }
}

/// Whether test `name` of `info` holds lengths above `above` (so the score needs it).
fn reaches_above(info: &TaskInfo, name: &str, above: usize) -> bool {
    info.tests
        .iter()
        .any(|t| t.name == name && t.lengths[1] > above)
}

/// Tape results grouped by input length, in increasing order, each length's examples in the
/// data set's order: the strata of a by-length test's [`Examples`].
fn by_stratum(tapes: &[crate::train::TapeResult]) -> Vec<(usize, Vec<(u32, u32)>)> {
    let mut strata: std::collections::BTreeMap<usize, Vec<(u32, u32)>> = Default::default();
    for t in tapes {
        strata
            .entry(t.length)
            .or_default()
            .push((t.right as u32, t.counted as u32));
    }
    strata.into_iter().collect()
}
