//! `lm`: next-token prediction, the decoder's task, on a generated corpus. Valid only in a
//! causal model (`[model] causal = true`): without the mask each position reads the token it
//! is asked for.
//!
//! # The corpus
//! A document is a run of `word_order` sentences ([`grammar`]), each of 5 to 12 words (drawn
//! uniformly) and closed by `.`, cut to the example's length plus one. Its sentences draw their
//! two entities from a cast of `cast` of the eight, chosen per document: which entities come
//! next is predictable only from the document's earlier sentences, so a model that reads its
//! context lowers its perplexity as the document goes on. Within a sentence the grammar binds
//! the words to each other (a passive's `was` then its participle then `by`; an adjective
//! before its noun), and its position in the sentence decides what can come.
//!
//! # The tape
//! An example of length `L` is the document's first `L` words, each labelled with the word
//! after it ([`Label::Outputs`] with every position an output): the loss and the accuracy
//! cover all `L`, and the scores come by length like the length suite's. Perplexity is the
//! exponential of the loss: at the training lengths and, on the test sets at 2x and 4x them,
//! past them, the standard extrapolation curve.

use rand::seq::index::sample;
use rand::Rng as _;
use serde::{Deserialize, Serialize};

use super::{grammar, Example, Generator, Label, Objective};
use crate::rng::Rng;

/// The word that closes a sentence.
pub const STOP: &str = ".";

/// The shortest and longest sentence of the corpus, in words (without its `.`).
const SENTENCE_WORDS: [usize; 2] = [grammar::SHORTEST, 12];

fn default_cast() -> usize {
    3
}

/// Next-token prediction on generated documents (see the module).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lm {
    /// The entities a document's sentences draw from, 2 to 8 (default 3).
    #[serde(default = "default_cast")]
    pub cast: usize,
}

impl Default for Lm {
    fn default() -> Self {
        Self {
            cast: default_cast(),
        }
    }
}

impl Lm {
    /// The first `n` words of a document.
    pub fn document(&self, rng: &mut Rng, n: usize) -> Vec<&'static str> {
        let mut cast: Vec<usize> = sample(rng, grammar::ENTITIES.len(), self.cast).into_vec();
        cast.sort_unstable();
        let mut words = Vec::with_capacity(n + SENTENCE_WORDS[1] + 1);
        while words.len() < n {
            let len = rng.random_range(SENTENCE_WORDS[0]..=SENTENCE_WORDS[1]);
            words.extend(grammar::sentence_among(rng, len, &cast).0);
            words.push(STOP);
        }
        words.truncate(n);
        words
    }

    /// Every word of the corpus, in a fixed order: the labels, and the vocabulary.
    fn words() -> Vec<String> {
        let mut words = grammar::vocabulary();
        words.push(STOP.into());
        words
    }
}

impl Generator for Lm {
    fn check(&self, shortest: usize, _longest: usize) -> std::result::Result<(), String> {
        if !(2..=grammar::ENTITIES.len()).contains(&self.cast) {
            return Err(format!(
                "lm: cast = {} must be 2 to {} (the entities a document draws from)",
                self.cast,
                grammar::ENTITIES.len()
            ));
        }
        if shortest == 0 {
            return Err("lm: lengths start at 1: an example predicts at least one token".into());
        }
        Ok(())
    }

    fn objective(&self) -> (Objective, Vec<String>) {
        let words = Self::words();
        (
            Objective::Lm {
                labels: words.clone(),
            },
            words,
        )
    }

    fn example(&self, rng: &mut Rng, len: usize) -> Example {
        let words = self.document(rng, len + 1);
        let labels = Self::words();
        let index = |w: &str| {
            labels
                .iter()
                .position(|l| l == w)
                .expect("the corpus's words are its labels")
        };
        let targets = words[1..].iter().map(|w| index(w)).collect();
        Example::new(
            words[..len].iter().map(|w| w.to_string()).collect(),
            Label::Outputs {
                length: len,
                targets,
                counted: len,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_position_is_labelled_with_the_word_after_it() {
        let lm = Lm::default();
        let labels = Lm::words();
        let mut a = crate::rng::stream(3, "lm test");
        let mut b = crate::rng::stream(3, "lm test");
        for len in [1, 5, 13, 40, 97] {
            let example = lm.example(&mut a, len);
            let document = lm.document(&mut b, len + 1);
            assert_eq!(example.words, document[..len]);
            let Label::Outputs {
                length,
                targets,
                counted,
            } = &example.label
            else {
                panic!("an lm example is a tape");
            };
            assert_eq!((*length, *counted, targets.len()), (len, len, len));
            for (i, t) in targets.iter().enumerate() {
                assert_eq!(labels[*t], document[i + 1]);
            }
        }
    }

    #[test]
    fn documents_are_sentences_of_a_cast_closed_by_stops() {
        let lm = Lm { cast: 2 };
        let mut rng = crate::rng::stream(0, "lm test");
        for _ in 0..50 {
            let words = lm.document(&mut rng, 200);
            assert_eq!(words.len(), 200);
            let named: std::collections::BTreeSet<&str> = words
                .iter()
                .copied()
                .filter(|w| grammar::ENTITIES.contains(w))
                .collect();
            assert_eq!(named.len(), 2, "{words:?}");
            // Sentences of 5 to 12 words between the stops.
            let stops: Vec<usize> = (0..words.len()).filter(|&i| words[i] == STOP).collect();
            let mut start = 0;
            for s in stops {
                assert!((5..=12).contains(&(s - start)), "{words:?}");
                start = s + 1;
            }
        }
    }

    #[test]
    fn the_corpus_is_far_from_one_word_at_a_time() {
        // The unigram perplexity, which a model blind to context reaches at best: measured
        // 26.8 over 20,000 words at the default cast.
        let lm = Lm::default();
        let mut rng = crate::rng::stream(1, "lm test");
        let mut counts = std::collections::HashMap::new();
        for _ in 0..200 {
            for w in lm.document(&mut rng, 100) {
                *counts.entry(w).or_insert(0usize) += 1;
            }
        }
        let n = counts.values().sum::<usize>() as f64;
        let entropy: f64 = counts
            .values()
            .map(|&c| -(c as f64 / n) * (c as f64 / n).ln())
            .sum();
        let perplexity = entropy.exp();
        assert!(perplexity > 15.0, "unigram perplexity {perplexity}");
    }

    #[test]
    fn bad_options_are_refused_naming_them() {
        assert!(Lm { cast: 1 }
            .check(1, 10)
            .unwrap_err()
            .contains("cast = 1"));
        assert!(Lm { cast: 9 }
            .check(1, 10)
            .unwrap_err()
            .contains("cast = 9"));
        assert!(Lm::default().check(0, 10).unwrap_err().contains("lengths"));
        assert!(Lm::default().check(1, 10).is_ok());
    }
}
