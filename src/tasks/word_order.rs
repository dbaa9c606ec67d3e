//! `word_order`: which entity of a generated sentence did the action? The words alone do not
//! say: every sentence has a twin with the roles swapped.

use serde::{Deserialize, Serialize};

use super::{grammar, Example, Generator, Label, Objective, OrderBlindCeiling};
use crate::rng::Rng;

/// Sentences from the [`grammar`]; the label is the entity that did the action.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WordOrder {}

impl Generator for WordOrder {
    fn check(&self, shortest: usize, _longest: usize) -> Result<(), String> {
        if shortest < grammar::SHORTEST {
            return Err(format!(
                "word_order sentences have at least {} words: a length of {shortest} is too short",
                grammar::SHORTEST
            ));
        }
        Ok(())
    }

    fn objective(&self) -> (Objective, Vec<String>) {
        (
            Objective::Classify {
                labels: grammar::ENTITIES.iter().map(|s| s.to_string()).collect(),
            },
            grammar::vocabulary(),
        )
    }

    fn example(&self, rng: &mut Rng, len: usize) -> Example {
        let (words, agent) = grammar::sentence(rng, len);
        Example::new(
            words.into_iter().map(String::from).collect(),
            Label::Class(agent),
        )
    }

    fn order_blind_ceiling(&self) -> Option<OrderBlindCeiling> {
        Some(OrderBlindCeiling {
            accuracy: 0.5,
            reason: "every sentence has an equally likely twin with the same words and the \
                     roles swapped"
                .into(),
        })
    }
}
