//! Random symbols tagged by position: `prev_token` (the symbol `k` before, a relative position)
//! and `position_index` (the position modulo `m`, an absolute one).

use rand::Rng as _;
use serde::{Deserialize, Serialize};

use super::{check_vocabulary, Example, Generator, Label, Objective};
use crate::rng::Rng;

fn default_k() -> usize {
    1
}
fn default_modulus() -> usize {
    4
}
fn default_symbols() -> usize {
    16
}

/// Random symbols; each token is tagged with the symbol `k` positions before it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrevToken {
    /// How far back the tagged symbol is (default 1).
    #[serde(default = "default_k")]
    pub k: usize,
    /// How many distinct symbols (default 16).
    #[serde(default = "default_symbols")]
    pub symbols: usize,
}

/// Random symbols; each token is tagged with its position modulo `modulus`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PositionIndex {
    /// The modulus of the tagged position (default 4).
    #[serde(default = "default_modulus")]
    pub modulus: usize,
    /// How many distinct symbols (default 16).
    #[serde(default = "default_symbols")]
    pub symbols: usize,
}

impl Generator for PrevToken {
    fn check(&self, shortest: usize, _longest: usize) -> Result<(), String> {
        let Self { k, symbols } = *self;
        check_vocabulary("prev_token", "symbols", symbols)?;
        if k == 0 || k >= shortest || symbols < 2 {
            return Err(format!(
                "prev_token needs 1 <= k < the shortest length (k = {k}, shortest = {shortest}) \
                 and at least 2 symbols"
            ));
        }
        Ok(())
    }

    fn objective(&self) -> (Objective, Vec<String>) {
        (
            Objective::Tag {
                labels: symbol_words(self.symbols),
            },
            symbol_words(self.symbols),
        )
    }

    fn example(&self, rng: &mut Rng, len: usize) -> Example {
        let ids: Vec<usize> = (0..len)
            .map(|_| rng.random_range(0..self.symbols))
            .collect();
        let tags = (0..len)
            .map(|i| i.checked_sub(self.k).map(|j| ids[j]))
            .collect();
        Example::new(
            ids.iter().map(|&i| symbol_word(i)).collect(),
            Label::Tags(tags),
        )
    }
}

impl Generator for PositionIndex {
    fn check(&self, _shortest: usize, _longest: usize) -> Result<(), String> {
        let Self { modulus, symbols } = *self;
        check_vocabulary("position_index", "symbols", symbols)?;
        check_vocabulary("position_index", "modulus", modulus)?;
        if modulus < 2 || symbols < 1 {
            return Err(format!(
                "position_index needs modulus >= 2 (got {modulus}) and at least 1 symbol"
            ));
        }
        Ok(())
    }

    fn objective(&self) -> (Objective, Vec<String>) {
        (
            Objective::Tag {
                labels: (0..self.modulus).map(|m| m.to_string()).collect(),
            },
            symbol_words(self.symbols),
        )
    }

    fn example(&self, rng: &mut Rng, len: usize) -> Example {
        Example::new(
            (0..len)
                .map(|_| symbol_word(rng.random_range(0..self.symbols)))
                .collect(),
            Label::Tags((0..len).map(|i| Some(i % self.modulus)).collect()),
        )
    }
}

/// The word for symbol `i`: `s0`, `s1`, ...
pub fn symbol_word(i: usize) -> String {
    format!("s{i}")
}

fn symbol_words(n: usize) -> Vec<String> {
    (0..n).map(symbol_word).collect()
}
