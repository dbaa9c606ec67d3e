//! A padded batch of token ids on a device, as a model reads it: ids, mask, targets and what
//! was counted where it was built.

use candle::Tensor;

use crate::error::Result;
use crate::positional::{random_batch_positions, Positions};
use crate::rng::Rng;

/// A padded batch on a device.
#[derive(Debug)]
pub struct Batch {
    /// `(b, t)` u32
    pub ids: Tensor,
    /// `(b, t)` u32, 1 for real tokens
    pub mask: Tensor,
    /// `(b,)` u32 for sentence labels; `(b, t)` u32 for token labels (0 where not scored)
    pub targets: Tensor,
    /// `(b, t)` f32, 1 where a token label is scored; `None` for sentence labels
    pub weights: Option<Tensor>,
    /// `(b, t)` f32, 1 where a length-suite answer counts in accuracy (a subset of `weights`:
    /// the outputs up to `end`); `None` when accuracy counts every scored label.
    pub counted: Option<Tensor>,
    /// Real (unpadded) tokens in the batch.
    pub real_tokens: usize,
    /// Real tokens of each sequence.
    pub lengths: Vec<usize>,
    /// Each token's position, when not `0..t` (randomized positions); see
    /// [`Batch::positions`].
    pub positions: Option<Positions>,
    /// Scored labels in the batch.
    pub scored: usize,
    /// The largest token id, counted where the batch was built (the encoder's check reads it
    /// instead of the ids, which may be on a GPU).
    pub max_id: u32,
}

impl Batch {
    /// The tokens' positions: the drawn ones, or `0..t` for every sequence; moved by `shift`
    /// (the shift test).
    pub fn positions(&self, shift: usize) -> Result<Positions> {
        let t = self.ids.dim(1)?;
        match &self.positions {
            Some(p) => p.shifted(shift),
            None => Positions::range(shift, t),
        }
    }

    /// Draws randomized positions (Ruoss et al. 2023) for every sequence from `[0, n)`.
    pub fn randomize_positions(&mut self, n: usize, rng: &mut Rng) -> Result<()> {
        let t = self.ids.dim(1)?;
        self.positions = Some(random_batch_positions(&self.lengths, t, n, rng)?);
        Ok(())
    }
}
