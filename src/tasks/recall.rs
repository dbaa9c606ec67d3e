//! Recall and state tracking: `mqar` (multi-query associative recall, as Zoology's) and
//! `flip_flop` (flip-flop language modelling, Liu et al. 2023, in encoder form).
//!
//! Both tag tokens, as `prev_token` does, and take their size from the example's length, so a
//! test at 2x or 4x the training lengths holds more pairs, or more instructions, than training
//! ever saw.
//!
//! - `mqar`: `k₁ v₁ k₂ v₂ … kₙ vₙ` then queries `kₐ kᵦ …` of distinct keys of the pairs in a
//!   random order; each query is tagged with its key's value. Keys and values come from
//!   disjoint vocabularies (`k0…`, `v0…`) and are distinct within an example, so every answer is
//!   unique. An example of `len` words holds the most pairs `n` for which `2n` plus its queries
//!   (`round(queries × n)`, at least 1) fit; a word or two left over is filler (`_`) between
//!   the pairs and the queries.
//! - `flip_flop`: instruction-bit pairs `w b` (write `b`), `i b` (ignore), `r ?` (read), the
//!   instructions drawn with probabilities `ignore` and `(1 - ignore) / 2` each for `w` and `r`
//!   (the paper's FFL(p), `p` = `ignore`: `preset = "dense"` is 0.1, the default 0.8,
//!   `"sparse"` 0.98). The first instruction is a write and at least one is a read. Each `r` is
//!   tagged with the last bit written before it; the read's own bit, which the language model
//!   of the paper predicts, is `?`. An encoder also sees the writes after a read, so position
//!   must tell it which write came last.

use rand::seq::SliceRandom;
use rand::Rng as _;
use serde::{Deserialize, Serialize};

use super::{check_vocabulary, Example, Generator, Label, Objective};
use crate::rng::Rng;

fn default_vocabulary() -> usize {
    64
}
fn default_queries() -> f64 {
    1.0
}

/// Multi-query associative recall.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mqar {
    /// Distinct key words (default 64); an example's keys are distinct, so at least its pairs.
    #[serde(default = "default_vocabulary")]
    pub keys: usize,
    /// Distinct value words (default 64); an example's values are distinct too.
    #[serde(default = "default_vocabulary")]
    pub values: usize,
    /// Queries per pair, in (0, 1] (default 1: every key is queried once).
    #[serde(default = "default_queries")]
    pub queries: f64,
}

impl Mqar {
    /// The pairs and queries of an example of `len` words: the most pairs `n` with `2n +
    /// queries(n) <= len`, and their queries.
    pub fn layout(&self, len: usize) -> (usize, usize) {
        let queries = |n: usize| ((self.queries * n as f64).round() as usize).clamp(1, n.max(1));
        // From just above the real solution of 2n + queries n = len, down to the first that fits.
        let mut n = (len / 2).min((len as f64 / (2.0 + self.queries)) as usize + 2);
        while n > 1 && 2 * n + queries(n) > len {
            n -= 1;
        }
        (n, queries(n))
    }
}

impl Generator for Mqar {
    fn check(&self, shortest: usize, longest: usize) -> Result<(), String> {
        check_vocabulary("mqar", "keys", self.keys)?;
        check_vocabulary("mqar", "values", self.values)?;
        if !(self.queries > 0.0 && self.queries <= 1.0) {
            return Err(format!(
                "mqar: queries = {} must be in (0, 1]: the share of the pairs queried",
                self.queries
            ));
        }
        if shortest < 3 {
            return Err(format!(
                "mqar needs examples of at least 3 words (one pair and its query); the \
                 shortest length is {shortest}: raise lengths"
            ));
        }
        let (pairs, _) = self.layout(longest);
        if self.keys < pairs || self.values < pairs {
            return Err(format!(
                "mqar: the longest examples ({longest} words) hold {pairs} pairs of distinct keys \
                 and values, but keys = {} and values = {}: raise both to at least {pairs}, or \
                 shorten the test lengths",
                self.keys, self.values
            ));
        }
        Ok(())
    }

    fn objective(&self) -> (Objective, Vec<String>) {
        let values: Vec<String> = (0..self.values).map(|v| format!("v{v}")).collect();
        let mut words: Vec<String> = (0..self.keys).map(|k| format!("k{k}")).collect();
        words.extend(values.iter().cloned());
        words.push(FILLER.into());
        (Objective::Tag { labels: values }, words)
    }

    fn example(&self, rng: &mut Rng, len: usize) -> Example {
        let (pairs, queries) = self.layout(len);
        let keys = rand::seq::index::sample(rng, self.keys, pairs).into_vec();
        let values = rand::seq::index::sample(rng, self.values, pairs).into_vec();
        let mut asked: Vec<usize> = (0..pairs).collect();
        asked.shuffle(rng);
        asked.truncate(queries);
        let mut words = Vec::with_capacity(len);
        let mut tags = Vec::with_capacity(len);
        for (k, v) in keys.iter().zip(&values) {
            words.extend([format!("k{k}"), format!("v{v}")]);
            tags.extend([None, None]);
        }
        while words.len() + queries < len {
            words.push(FILLER.into());
            tags.push(None);
        }
        for &p in &asked {
            words.push(format!("k{}", keys[p]));
            tags.push(Some(values[p]));
        }
        Example::new(words, Label::Tags(tags))
    }
}

/// The word between an example's pairs and its queries where the length leaves room.
const FILLER: &str = "_";

/// The paper's settings of the ignore probability.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlipFlopPreset {
    /// FFL(0.1): nine instructions in ten write or read.
    Dense,
    /// FFL(0.98): one in fifty.
    Sparse,
}

impl FlipFlopPreset {
    fn ignore(self) -> f64 {
        match self {
            Self::Dense => 0.1,
            Self::Sparse => 0.98,
        }
    }
}

/// Flip-flop language modelling in encoder form.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlipFlop {
    /// The probability of an ignore instruction, in [0, 1) (default 0.8, the paper's main
    /// setting); writes and reads share the rest equally.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore: Option<f64>,
    /// One of the paper's settings instead of `ignore`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<FlipFlopPreset>,
}

impl FlipFlop {
    /// The ignore probability in force.
    pub fn ignore_probability(&self) -> f64 {
        match (self.ignore, self.preset) {
            (Some(p), _) => p,
            (None, Some(preset)) => preset.ignore(),
            (None, None) => 0.8,
        }
    }
}

impl Generator for FlipFlop {
    fn check(&self, shortest: usize, _longest: usize) -> Result<(), String> {
        if self.ignore.is_some() && self.preset.is_some() {
            return Err(
                "flip_flop: give ignore or preset, not both (preset = \"dense\" is ignore = 0.1, \
                 \"sparse\" is 0.98)"
                    .into(),
            );
        }
        let p = self.ignore_probability();
        if !(0.0..1.0).contains(&p) {
            return Err(format!(
                "flip_flop: ignore = {p} must be in [0, 1): writes and reads need a chance"
            ));
        }
        if shortest < 3 {
            return Err(format!(
                "flip_flop needs examples of at least 3 words (a write and a read); the shortest \
                 length is {shortest}: raise lengths"
            ));
        }
        Ok(())
    }

    fn objective(&self) -> (Objective, Vec<String>) {
        let words = ["w", "r", "i", "0", "1", "?"].map(String::from).to_vec();
        (
            Objective::Tag {
                labels: vec!["0".into(), "1".into()],
            },
            words,
        )
    }

    fn example(&self, rng: &mut Rng, len: usize) -> Example {
        let ignore = self.ignore_probability();
        let instructions = len.div_ceil(2);
        // 0 write, 1 read, 2 ignore; the first a write.
        let mut ops: Vec<u8> = (0..instructions)
            .map(|i| {
                if i == 0 {
                    return 0;
                }
                let u: f64 = rng.random();
                if u < ignore {
                    2
                } else if u < ignore + (1.0 - ignore) / 2.0 {
                    0
                } else {
                    1
                }
            })
            .collect();
        if !ops.contains(&1) {
            // At least one read: the last instruction (its `r` is in the example even where
            // an odd length cuts its bit).
            *ops.last_mut().expect("at least 2 instructions") = 1;
        }
        let mut words = Vec::with_capacity(2 * instructions);
        let mut tags = Vec::with_capacity(2 * instructions);
        let mut last = 0usize;
        for op in ops {
            let bit = rng.random_range(0..2usize);
            match op {
                0 => {
                    last = bit;
                    words.extend(["w".into(), bit.to_string()]);
                    tags.extend([None, None]);
                }
                1 => {
                    words.extend(["r".into(), "?".into()]);
                    tags.extend([Some(last), None]);
                }
                _ => {
                    words.extend(["i".into(), bit.to_string()]);
                    tags.extend([None, None]);
                }
            }
        }
        words.truncate(len);
        tags.truncate(len);
        Example::new(words, Label::Tags(tags))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng;

    fn tags(e: &Example) -> &[Option<usize>] {
        match &e.label {
            Label::Tags(t) => t,
            other => panic!("not per-token tags: {other:?}"),
        }
    }

    /// Every MQAR example at every length from 3 to 80: exactly `len` words, `n` pairs of
    /// distinct keys and distinct values, `round(queries n)` queries of distinct keys of the
    /// pairs, each tagged with the value that followed its key, and nothing else tagged.
    #[test]
    fn mqar_examples_pair_every_query_with_its_keys_value() {
        for queries in [1.0, 0.5, 0.25] {
            let task = Mqar {
                keys: 48,
                values: 40,
                queries,
            };
            task.check(3, 80).unwrap();
            let mut rng = rng::stream(7, "mqar test");
            for len in 3..=80 {
                let e = task.example(&mut rng, len);
                let (pairs, asked) = task.layout(len);
                assert_eq!(e.words.len(), len, "len {len}");
                // The most pairs that fit: one more, with its queries, would not.
                let more = pairs + 1;
                let more_asked = ((queries * more as f64).round() as usize).clamp(1, more);
                assert!(2 * pairs + asked <= len, "len {len}");
                assert!(pairs == len / 2 || 2 * more + more_asked > len, "len {len}");
                let value_of: std::collections::HashMap<&str, usize> = (0..pairs)
                    .map(|p| {
                        let v = e.words[2 * p + 1].strip_prefix('v').unwrap();
                        (e.words[2 * p].as_str(), v.parse().unwrap())
                    })
                    .collect();
                assert_eq!(value_of.len(), pairs, "distinct keys, len {len}");
                let values: std::collections::HashSet<_> = value_of.values().collect();
                assert_eq!(values.len(), pairs, "distinct values, len {len}");
                let t = tags(&e);
                let mut seen = std::collections::HashSet::new();
                for (i, w) in e.words.iter().enumerate() {
                    match t[i] {
                        Some(v) => {
                            assert!(i >= len - asked, "a tag before the queries, len {len}");
                            assert_eq!(value_of[w.as_str()], v, "len {len}");
                            assert!(seen.insert(w.clone()), "a key asked twice, len {len}");
                        }
                        None => assert!(i < len - asked, "an untagged query, len {len}"),
                    }
                }
                assert_eq!(seen.len(), asked);
                let expected = ((queries * pairs as f64).round() as usize).clamp(1, pairs);
                assert_eq!(asked, expected, "len {len}");
            }
        }
    }

    /// The option checks name the problem: too few keys for the longest examples' pairs, a
    /// share of queries outside (0, 1], examples too short for a pair and its query.
    #[test]
    fn mqar_options_are_checked_against_the_lengths() {
        let task = Mqar {
            keys: 10,
            values: 64,
            queries: 1.0,
        };
        let e = task.check(4, 64).unwrap_err();
        assert!(e.contains("21 pairs") && e.contains("keys = 10"), "{e}");
        task.check(4, 30).unwrap();
        let e = Mqar {
            queries: 0.0,
            ..task.clone()
        }
        .check(4, 30)
        .unwrap_err();
        assert!(e.contains("queries = 0"), "{e}");
        assert!(task.check(2, 30).unwrap_err().contains("at least 3 words"));
        let e = Mqar {
            keys: 4_000_000_000,
            ..task.clone()
        }
        .check(4, 30)
        .unwrap_err();
        assert!(
            e.contains("keys = 4000000000") && e.contains("lower keys"),
            "{e}"
        );
    }

    /// Every flip-flop example at every length from 3 to 60, in the three settings: `len`
    /// words of instruction-bit pairs, the first a write, at least one read, each read's bit
    /// `?`, and each `r` (only) tagged with the last bit written before it, found by walking
    /// the example; the share of ignores near the setting's over many examples.
    #[test]
    fn flip_flop_tags_each_read_with_the_last_write_before_it() {
        for (task, p) in [
            (FlipFlop::default(), 0.8),
            (
                FlipFlop {
                    preset: Some(FlipFlopPreset::Dense),
                    ..Default::default()
                },
                0.1,
            ),
            (
                FlipFlop {
                    ignore: Some(0.5),
                    ..Default::default()
                },
                0.5,
            ),
        ] {
            task.check(3, 60).unwrap();
            let mut rng = rng::stream(3, "flip flop test");
            let (mut ignores, mut instructions) = (0usize, 0usize);
            for _ in 0..20 {
                for len in 3..=60 {
                    let e = task.example(&mut rng, len);
                    let t = tags(&e);
                    assert_eq!(e.words.len(), len);
                    assert_eq!(e.words[0], "w", "len {len}");
                    assert!(e.words.iter().step_by(2).any(|w| w == "r"), "len {len}");
                    let mut last = None;
                    for (i, (word, &tag)) in e.words.iter().zip(t).enumerate() {
                        let w = word.as_str();
                        if i % 2 == 1 {
                            assert!(tag.is_none());
                            let expect_blank = e.words[i - 1] == "r";
                            assert_eq!(w == "?", expect_blank, "len {len} at {i}");
                            continue;
                        }
                        match w {
                            "w" => {
                                last = e.words.get(i + 1).map(|b| b.parse::<usize>().unwrap());
                                assert!(tag.is_none());
                            }
                            "r" => assert_eq!(tag, Some(last.unwrap()), "len {len} at {i}"),
                            "i" => assert!(tag.is_none()),
                            other => panic!("{other} where an instruction belongs"),
                        }
                        // The first 40 instructions of long examples, for the share of
                        // ignores (away from the forced first write and last read).
                        if len == 60 && (2..40).contains(&i) {
                            instructions += 1;
                            ignores += usize::from(w == "i");
                        }
                    }
                }
            }
            let share = ignores as f64 / instructions as f64;
            assert!((share - p).abs() < 0.06, "ignore share {share} for p {p}");
        }
    }

    /// A preset and an explicit probability together, and probabilities outside [0, 1), are
    /// refused by name.
    #[test]
    fn flip_flop_options_are_checked() {
        let both = FlipFlop {
            ignore: Some(0.5),
            preset: Some(FlipFlopPreset::Sparse),
        };
        assert!(both.check(4, 8).unwrap_err().contains("not both"));
        let one = FlipFlop {
            ignore: Some(1.0),
            preset: None,
        };
        assert!(one.check(4, 8).unwrap_err().contains("ignore = 1"));
        assert_eq!(
            FlipFlop {
                preset: Some(FlipFlopPreset::Sparse),
                ignore: None
            }
            .ignore_probability(),
            0.98
        );
    }
}
