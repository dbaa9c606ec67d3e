//! What inference gives back: labels with probabilities, tags, mask fills and sentence
//! vectors, one [`Output`] per text. Both kinds of model fill them: one poslab trained
//! ([`crate::infer::Predictor`]) and a pretrained encoder ([`crate::pretrained::Pretrained`]).

use serde::Serialize;

/// A label and its probability.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Scored {
    /// The label.
    pub label: String,
    /// The model's probability for it.
    pub probability: f64,
}

/// The fills proposed for one `[MASK]`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MaskFill {
    /// Index of the masked word in the text.
    pub word: usize,
    /// The most probable fills, best first.
    pub fills: Vec<Scored>,
}

/// What the model says about one text.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Prediction {
    /// The most probable label, then every label by probability.
    Class {
        /// The most probable label.
        label: String,
        /// Every label, most probable first.
        probabilities: Vec<Scored>,
    },
    /// One tag per word.
    Tags {
        /// The text's words.
        words: Vec<String>,
        /// One tag per word.
        tags: Vec<String>,
    },
    /// Top fills for each mask token, in text order.
    Fills {
        /// One entry per mask token.
        masks: Vec<MaskFill>,
    },
}

/// A text, what the model says, how many of its tokens the vocabulary did not know, and a note
/// when the text was cut to fit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Output<T> {
    /// The text as given.
    pub text: String,
    /// What the model says.
    #[serde(flatten)]
    pub value: T,
    /// Tokens read as the unknown token (`[UNK]`): words the model never saw, which it cannot
    /// tell apart. Many of them make any answer a guess.
    pub unknown_tokens: usize,
    /// Set when the text was cut to the model's longest input.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A pooled sentence vector.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Embedding {
    /// The vector, `d_model` wide.
    pub embedding: Vec<f32>,
}

/// The `top_k` most probable tokens of a probability row over the vocabulary, `specials` left
/// out, most probable first.
pub(crate) fn top_fills(
    row: &[f32],
    top_k: usize,
    specials: &[u32],
    tok: &crate::text::TextTokenizer,
) -> Vec<Scored> {
    let mut order: Vec<usize> = (0..row.len())
        .filter(|&i| !specials.contains(&(i as u32)))
        .collect();
    order.sort_by(|&x, &y| row[y].total_cmp(&row[x]));
    // Only ids the tokenizer can write: a model's table may have rows past its tokenizer's
    // ids, and a fill with no text says nothing.
    order
        .into_iter()
        .filter_map(|i| {
            let label = tok.id_to_token(i as u32).filter(|t| !t.trim().is_empty())?;
            Some(Scored {
                label,
                probability: f64::from(row[i]),
            })
        })
        .take(top_k)
        .collect()
}
