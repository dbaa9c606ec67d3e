//! The encoder's checks of its inputs: shapes, then values, with the reason and the fix.

use candle::{DType, Tensor};

use crate::error::{Error, Result};

use super::Encoder;

impl Encoder {
    /// Rejects inputs the model cannot take, with the reason and the fix: their shapes, then
    /// their values (read back from the device).
    pub(super) fn check_input(&self, ids: &Tensor, mask: &Tensor) -> Result<(usize, usize)> {
        let (b, t) = self.check_shapes(ids, mask)?;
        self.check_values(ids, mask, t)?;
        Ok((b, t))
    }

    /// The checks of [`Encoder::check_input`] that read nothing back: shapes and dtypes.
    pub(super) fn check_shapes(&self, ids: &Tensor, mask: &Tensor) -> Result<(usize, usize)> {
        let (b, t) = ids.dims2().map_err(|_| {
            Error::Input(format!(
                "input_ids must be (batch, seq_len), got shape {:?}",
                ids.shape()
            ))
        })?;
        if mask.dims() != ids.dims() {
            return Err(Error::Input(format!(
                "attention_mask has shape {:?} but input_ids has {:?}: they must match",
                mask.shape(),
                ids.shape()
            )));
        }
        if b == 0 || t == 0 {
            return Err(Error::Input(format!(
                "empty batch: input_ids has shape {:?}",
                ids.shape()
            )));
        }
        if !matches!(ids.dtype(), DType::U8 | DType::U32 | DType::I64) {
            return Err(Error::Input(format!(
                "input_ids must hold integer ids (u8, u32 or i64), got {:?}",
                ids.dtype()
            )));
        }
        Ok((b, t))
    }

    /// The checks of [`Encoder::check_input`] on values: ids within the vocabulary, a mask of
    /// 0 and 1 with a real token in every sequence.
    fn check_values(&self, ids: &Tensor, mask: &Tensor, t: usize) -> Result<()> {
        let vocab = self.config.vocab_size as i64;
        let flat = ids.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
        if let Some((i, &id)) = flat
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id >= vocab)
        {
            return Err(Error::Input(format!(
                "token id {id} at (sequence {}, position {}) is outside the vocabulary of \
                 {vocab} ids: the tokenizer and the model's vocab_size disagree",
                i / t,
                i % t
            )));
        }
        let mask_rows = mask.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        for (i, row) in mask_rows.iter().enumerate() {
            if let Some(v) = row.iter().find(|&&v| v != 0.0 && v != 1.0) {
                return Err(Error::Input(format!(
                    "attention_mask holds {v} in sequence {i}: use 1 for real tokens and 0 for padding"
                )));
            }
            if row.iter().all(|&v| v == 0.0) {
                return Err(Error::Input(format!(
                    "sequence {i} of the batch has no real tokens (its attention_mask is all 0): \
                     drop empty sequences before encoding"
                )));
            }
        }
        Ok(())
    }
}
