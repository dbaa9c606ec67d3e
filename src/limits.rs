//! How large a model and its batches may be: checked once, before anything is allocated, so
//! that a size typed wrong (`d_model = 1e9`, `n_layers = 1e8`, a 10 MB line of text) is an error
//! with the figure, not an abort of the allocator or a machine out of memory.
//!
//! The limits are generous for a lab (a BERT-large has 3.4e8 parameters) and can be raised:
//! `POSLAB_MAX_PARAMS` (a number of parameters) and `POSLAB_MAX_MEMORY` (bytes, with an optional
//! `K`, `M`, `G` or `T` suffix, powers of 1024).

use crate::io::human_bytes;

/// The sizes of a model that its limits are checked on.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Width of the feed-forward hidden layer.
    pub ffn_dim: usize,
    /// Attention heads per layer.
    pub n_heads: usize,
    /// Encoder layers.
    pub n_layers: usize,
    /// Token ids of the embedding table.
    pub vocab_size: usize,
    /// Longest sequence the position tables are built for.
    pub max_len: usize,
}

/// Default most parameters: 2^31 (8 GiB of f32 weights; with gradients and AdamW's two
/// moments, 32 GiB).
pub const DEFAULT_MAX_PARAMS: u64 = 1 << 31;
/// Default most memory a batch's activations may take: 32 GiB.
pub const DEFAULT_MAX_MEMORY: u64 = 32 << 30;

/// The most parameters a model may have (`POSLAB_MAX_PARAMS`, else [`DEFAULT_MAX_PARAMS`]); an
/// unreadable value is an error saying the accepted forms.
pub fn max_params() -> std::result::Result<u64, String> {
    Ok(crate::env::size_var("POSLAB_MAX_PARAMS")?.unwrap_or(DEFAULT_MAX_PARAMS))
}

/// The most memory a batch's activations may take (`POSLAB_MAX_MEMORY`, else
/// [`DEFAULT_MAX_MEMORY`]); an unreadable value is an error saying the accepted forms.
pub fn max_memory() -> std::result::Result<u64, String> {
    Ok(crate::env::size_var("POSLAB_MAX_MEMORY")?.unwrap_or(DEFAULT_MAX_MEMORY))
}

/// Bytes a batch of `batch` sequences of `t` tokens needs at its peak: in training, what every
/// layer keeps for the backward pass (about `8 d + 2 ffn` values per token and the `h t²`
/// attention weights); in inference, one layer's worth. f32 values.
pub fn activation_bytes(config: &Sizes, batch: usize, t: usize, training: bool) -> u128 {
    let (b, t) = (batch as u128, t as u128);
    let (d, f, h) = (
        config.d_model as u128,
        config.ffn_dim as u128,
        config.n_heads as u128,
    );
    let per_layer = b * t * (8 * d + 2 * f) + b * h * t * t;
    let layers = if training { config.n_layers as u128 } else { 2 };
    4 * per_layer * layers
}

/// Refuses a model of `n` parameters, more than [`max_params`]: the message gives the count.
pub fn check_params(n: u128, config: &Sizes) -> std::result::Result<(), String> {
    let max = max_params()?;
    if n > max as u128 {
        return Err(format!(
            "this model would have {n} parameters ({} of f32 weights), more than the limit of \
             {max}: check d_model = {}, ffn_dim = {}, n_layers = {}, vocab_size = {} and max_len \
             = {} (set POSLAB_MAX_PARAMS to raise the limit)",
            human(4 * n),
            config.d_model,
            config.ffn_dim,
            config.n_layers,
            config.vocab_size,
            config.max_len
        ));
    }
    Ok(())
}

/// Refuses a batch whose activations would need more than [`max_memory`]; `what` says where
/// the batch comes from, for the message.
pub fn check_batch(
    config: &Sizes,
    batch: usize,
    t: usize,
    training: bool,
    what: &str,
) -> std::result::Result<(), String> {
    let need = activation_bytes(config, batch, t, training);
    let max = max_memory()?;
    if need > max as u128 {
        return Err(format!(
            "{what}: a batch of {batch} x {t} tokens needs about {} of activations ({} \
             attention weights per layer grow with the square of the length), more than the \
             limit of {}: shorten the inputs (max_tokens, --truncate), lower the batch size, or \
             set POSLAB_MAX_MEMORY",
            human(need),
            human(4 * batch as u128 * config.n_heads as u128 * (t as u128).pow(2)),
            human_bytes(max)
        ));
    }
    Ok(())
}

/// Bytes a generated word costs until its task is tokenized (the word, its token id and its
/// label), generously.
pub const BYTES_PER_GENERATED_WORD: u128 = 64;

/// Refuses a generated task whose examples would hold more than [`max_memory`]: `words` is the
/// most words its splits can have.
pub fn check_generated(words: u128, what: &str) -> std::result::Result<(), String> {
    let need = words * BYTES_PER_GENERATED_WORD;
    let max = max_memory()?;
    if need > max as u128 {
        return Err(format!(
            "{what}: up to {words} generated words need about {} of memory, more than the limit \
             of {}: lower train_examples or eval_examples, shorten the lengths, or set \
             POSLAB_MAX_MEMORY",
            human(need),
            human_bytes(max)
        ));
    }
    Ok(())
}

/// The longest input of which a batch of `batch` fits [`max_memory`] (at least 1).
pub fn longest_fitting(config: &Sizes, batch: usize, training: bool) -> usize {
    let (mut lo, mut hi) = (1usize, 1usize << 24);
    let max = max_memory().unwrap_or(DEFAULT_MAX_MEMORY) as u128;
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if activation_bytes(config, batch, mid, training) <= max {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

fn human(n: u128) -> String {
    human_bytes(u64::try_from(n).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    #[test]
    fn limits_refuse_an_environment_they_cannot_read() {
        // A name of its own: the tests run in parallel threads of one process.
        std::env::set_var("POSLAB_TEST_LIMIT", "1.5G");
        let err = crate::env::size_var("POSLAB_TEST_LIMIT").unwrap_err();
        assert!(
            err.contains("POSLAB_TEST_LIMIT=\"1.5G\" cannot be read"),
            "{err}"
        );
        std::env::set_var("POSLAB_TEST_LIMIT", "3G");
        assert_eq!(crate::env::size_var("POSLAB_TEST_LIMIT"), Ok(Some(3 << 30)));
        std::env::remove_var("POSLAB_TEST_LIMIT");
        assert_eq!(crate::env::size_var("POSLAB_TEST_LIMIT"), Ok(None));
    }
}
