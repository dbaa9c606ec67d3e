//! `sorted`: is a sequence of number words ascending? It needs the relative order of
//! neighbours; a bag of words cannot beat chance.

use rand::seq::SliceRandom;
use rand::Rng as _;
use serde::{Deserialize, Serialize};

use super::{Example, Generator, Label, Objective, OrderBlindCeiling};
use crate::rng::Rng;

/// The largest `max_number` the number words spell.
pub const NUMBER_WORDS_LIMIT: usize = 1000;

fn default_max_number() -> usize {
    64
}

/// Number words below `max_number`; label 1 if ascending. Half the negatives differ from a
/// sorted sequence by one adjacent swap.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sorted {
    /// Numbers are drawn from `0..max_number` (default 64).
    #[serde(default = "default_max_number")]
    pub max_number: usize,
}

impl Generator for Sorted {
    fn check(&self, shortest: usize, longest: usize) -> Result<(), String> {
        let max_number = self.max_number;
        if max_number < longest.max(2) || max_number > NUMBER_WORDS_LIMIT {
            return Err(format!(
                "sorted draws distinct numbers, so max_number = {max_number} must be at least the \
                 longest test length {longest} (and at most {NUMBER_WORDS_LIMIT})"
            ));
        }
        if shortest < 2 {
            return Err("sorted needs sequences of at least 2 numbers".into());
        }
        Ok(())
    }

    fn objective(&self) -> (Objective, Vec<String>) {
        (
            Objective::Classify {
                labels: vec!["not_ascending".into(), "ascending".into()],
            },
            (0..self.max_number).map(number_word).collect(),
        )
    }

    fn example(&self, rng: &mut Rng, len: usize) -> Example {
        let mut numbers: Vec<usize> =
            rand::seq::index::sample(rng, self.max_number, len).into_vec();
        numbers.sort_unstable();
        let ascending = rng.random_bool(0.5);
        if !ascending {
            if rng.random_bool(0.5) {
                // Hard negative: one adjacent pair swapped.
                let i = rng.random_range(0..len - 1);
                numbers.swap(i, i + 1);
            } else {
                while numbers.windows(2).all(|w| w[0] < w[1]) {
                    numbers.shuffle(rng);
                }
            }
        }
        Example::new(
            numbers.into_iter().map(number_word).collect(),
            Label::Class(usize::from(ascending)),
        )
    }

    fn order_blind_ceiling(&self) -> Option<OrderBlindCeiling> {
        Some(OrderBlindCeiling {
            accuracy: 0.5,
            reason: "each set of numbers is ascending in half the examples and shuffled or \
                     swapped in the other half"
                .into(),
        })
    }
}

/// English number words with underscores: `twenty_one`, `one_hundred_five`.
pub fn number_word(n: usize) -> String {
    const ONES: [&str; 20] = [
        "zero",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
        "thirteen",
        "fourteen",
        "fifteen",
        "sixteen",
        "seventeen",
        "eighteen",
        "nineteen",
    ];
    const TENS: [&str; 10] = [
        "", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
    ];
    match n {
        0..=19 => ONES[n].to_string(),
        20..=99 if n.is_multiple_of(10) => TENS[n / 10].to_string(),
        20..=99 => format!("{}_{}", TENS[n / 10], ONES[n % 10]),
        _ if n.is_multiple_of(100) => format!("{}_hundred", ONES[n / 100]),
        _ => format!("{}_hundred_{}", ONES[n / 100], number_word(n % 100)),
    }
}
