//! The `word_order` grammar: who did what to whom, in active and passive voice.
//!
//! ```text
//! active:  the ADJ* AGENT [ADV] VERB the ADJ* PATIENT FILLER*
//! passive: the ADJ* PATIENT was [ADV] PARTICIPLE by the ADJ* AGENT FILLER*
//! ```
//!
//! Adjectives attach to an entity, not to a role, and roles are drawn uniformly, so every
//! sentence has an equally likely twin with the same bag of words and the roles swapped
//! ("the red fox chased the dog" / "the dog chased the red fox"). A model blind to order cannot
//! tell the two apart: its accuracy is capped at 50%.

use rand::seq::IndexedRandom;
use rand::Rng as _;

use crate::rng::Rng;

/// The entities, the answers of `word_order`.
pub const ENTITIES: [&str; 8] = ["fox", "dog", "cat", "bear", "wolf", "owl", "hare", "crow"];
/// (past tense, past participle)
pub const VERBS: [(&str, &str); 8] = [
    ("chased", "chased"),
    ("bit", "bitten"),
    ("saw", "seen"),
    ("followed", "followed"),
    ("pushed", "pushed"),
    ("helped", "helped"),
    ("found", "found"),
    ("watched", "watched"),
];
/// Adjectives that may precede an entity.
pub const ADJECTIVES: [&str; 8] = [
    "red", "big", "old", "small", "quick", "lazy", "brown", "young",
];
/// Adverbs that may follow a verb.
pub const ADVERBS: [&str; 4] = ["quickly", "slowly", "quietly", "suddenly"];
/// Prepositional phrases that pad a sentence without naming an entity, by length.
pub const FILLERS_2: [&[&str]; 4] = [
    &["at", "dawn"],
    &["at", "night"],
    &["last", "week"],
    &["every", "day"],
];
/// Prepositional phrases of three words that pad a sentence without naming an entity.
pub const FILLERS_3: [&[&str]; 5] = [
    &["in", "the", "park"],
    &["near", "the", "river"],
    &["under", "the", "bridge"],
    &["across", "the", "field"],
    &["after", "the", "rain"],
];
/// At most this many adjectives on one noun.
const MAX_ADJECTIVES: usize = 3;
/// Words of the shortest sentence, active voice: `the A verb the P`.
pub const SHORTEST: usize = 5;
const SHORTEST_PASSIVE: usize = 7;

/// Every word the grammar can produce, in a fixed order.
pub fn vocabulary() -> Vec<String> {
    let mut words: Vec<&str> = vec!["the", "was", "by"];
    words.extend(ENTITIES);
    for (past, participle) in VERBS {
        words.push(past);
        words.push(participle);
    }
    words.extend(ADJECTIVES);
    words.extend(ADVERBS);
    for filler in FILLERS_2.iter().chain(FILLERS_3.iter()) {
        words.extend(filler.iter());
    }
    let mut seen = std::collections::HashSet::new();
    words
        .into_iter()
        .filter(|w| seen.insert(*w))
        .map(String::from)
        .collect()
}

/// A sentence of exactly `len` words (`len >= SHORTEST`) and the index of its agent in
/// [`ENTITIES`].
pub fn sentence(rng: &mut Rng, len: usize) -> (Vec<&'static str>, usize) {
    sentence_among(rng, len, &[0, 1, 2, 3, 4, 5, 6, 7])
}

/// [`sentence`] with its two entities drawn from `cast` (indices into [`ENTITIES`], at least
/// two, distinct): the same draws as [`sentence`] when `cast` is every entity in order.
pub fn sentence_among(rng: &mut Rng, len: usize, cast: &[usize]) -> (Vec<&'static str>, usize) {
    debug_assert!(len >= SHORTEST && cast.len() >= 2);
    let a = rng.random_range(0..cast.len());
    let (agent, patient) = (
        cast[a],
        cast[(a + rng.random_range(1..cast.len())) % cast.len()],
    );
    let verb = *VERBS.choose(rng).expect("verbs");
    let passive = len >= SHORTEST_PASSIVE && rng.random_bool(0.5);

    // Plan the extra words: a few single-word modifiers (adjectives, one adverb), the rest as
    // fillers of 2 and 3 words (any count but 1 is a sum of 2s and 3s).
    let base = if passive { SHORTEST_PASSIVE } else { SHORTEST };
    let extra = len - base;
    let max_singles = (2 * MAX_ADJECTIVES + 1).min(extra);
    let singles = loop {
        let s = rng.random_range(0..=max_singles);
        if extra - s != 1 {
            break s;
        }
    };
    let mut adjectives: [Vec<&str>; 2] = [Vec::new(), Vec::new()]; // [agent, patient]
    let mut adverb = None;
    for _ in 0..singles {
        let room: Vec<usize> = (0..2)
            .filter(|&n| adjectives[n].len() < MAX_ADJECTIVES)
            .collect();
        if adverb.is_none() && (room.is_empty() || rng.random_bool(0.25)) {
            adverb = Some(*ADVERBS.choose(rng).expect("adverbs"));
            continue;
        }
        let noun = *room.choose(rng).expect("a noun with room for an adjective");
        let free: Vec<&str> = ADJECTIVES
            .iter()
            .copied()
            .filter(|a| !adjectives[noun].contains(a))
            .collect();
        adjectives[noun].push(free.choose(rng).expect("free adjectives"));
    }
    let mut fillers: Vec<&[&str]> = Vec::new();
    let mut rest = extra - singles;
    while rest > 0 {
        let three = rest == 3 || (rest >= 5 && rng.random_bool(0.5));
        let pool: &[&[&str]] = if three { &FILLERS_3 } else { &FILLERS_2 };
        let filler = *pool.choose(rng).expect("fillers");
        rest -= filler.len();
        fillers.push(filler);
    }

    let noun_phrase = |out: &mut Vec<&'static str>, adjs: &[&'static str], noun: usize| {
        out.push("the");
        out.extend(adjs);
        out.push(ENTITIES[noun]);
    };
    let mut words = Vec::with_capacity(len);
    if passive {
        noun_phrase(&mut words, &adjectives[1], patient);
        words.push("was");
        words.extend(adverb);
        words.push(verb.1);
        words.push("by");
        noun_phrase(&mut words, &adjectives[0], agent);
    } else {
        noun_phrase(&mut words, &adjectives[0], agent);
        words.extend(adverb);
        words.push(verb.0);
        noun_phrase(&mut words, &adjectives[1], patient);
    }
    for filler in fillers {
        words.extend(filler.iter());
    }
    debug_assert_eq!(words.len(), len);
    (words, agent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentences_have_the_asked_length_and_name_the_agent() {
        let mut rng = crate::rng::stream(0, "grammar test");
        for len in [5, 6, 7, 8, 9, 12, 30, 48, 97] {
            for _ in 0..50 {
                let (words, agent) = sentence(&mut rng, len);
                assert_eq!(words.len(), len, "{words:?}");
                let passive = words.contains(&"was");
                // The agent is the first entity in active voice, the second in passive.
                let entities: Vec<usize> = words
                    .iter()
                    .filter_map(|w| ENTITIES.iter().position(|e| e == w))
                    .collect();
                assert_eq!(entities.len(), 2, "{words:?}");
                assert_eq!(entities[usize::from(passive)], agent, "{words:?}");
                assert!(words.iter().all(|w| vocabulary().iter().any(|v| v == w)));
            }
        }
    }
}
