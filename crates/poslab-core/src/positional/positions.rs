//! The position of every token of a batch, and randomized positions (Ruoss et al. 2023).
//!
//! Every scheme reads positions from here instead of assuming `0..t`: table rows, sinusoids,
//! RoPE angles and the distances of the attention biases. Usually every sequence of a batch has
//! the same positions `start..start + t`, kept once (`rows = 1`); randomized positions give each
//! sequence its own (`rows = b`).

use candle::{DType, Device, Tensor};
use rand::seq::index;

use crate::error::{Error, Result};
use crate::rng::Rng;

/// Positions above this are refused: tables and angles are built for every position up to the
/// largest, and no model here has a use for more.
pub const MAX_POSITION: usize = 1 << 24;

/// Per-token positions `(rows, t)`, `rows` 1 (shared by the whole batch) or the batch size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Positions {
    /// Row-major `(rows, t)`.
    ids: Vec<u32>,
    rows: usize,
    t: usize,
}

impl Positions {
    /// `start..start + t` for every sequence.
    pub fn range(start: usize, t: usize) -> Result<Self> {
        let end = start.checked_add(t).filter(|&e| e <= MAX_POSITION + 1);
        if t == 0 || end.is_none() {
            return Err(Error::Input(format!(
                "positions {start}..{start} + {t}: need at least one position and at most \
                 position {MAX_POSITION}"
            )));
        }
        Ok(Self {
            ids: (start..start + t).map(|p| p as u32).collect(),
            rows: 1,
            t,
        })
    }

    /// One row of positions per sequence, all of one length.
    pub fn from_rows(rows: &[Vec<usize>]) -> Result<Self> {
        let t = rows.first().map_or(0, Vec::len);
        if t == 0 || rows.iter().any(|r| r.len() != t) {
            return Err(Error::Input(format!(
                "positions: every sequence needs the same number (at least 1) of positions, got \
                 lengths {:?}",
                rows.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        let mut ids = Vec::with_capacity(rows.len() * t);
        for (i, row) in rows.iter().enumerate() {
            for (j, &p) in row.iter().enumerate() {
                if p > MAX_POSITION {
                    return Err(Error::Input(format!(
                        "position {p} (sequence {i}, token {j}) is above the largest supported \
                         position {MAX_POSITION}"
                    )));
                }
                ids.push(p as u32);
            }
        }
        Ok(Self {
            ids,
            rows: rows.len(),
            t,
        })
    }

    /// From a `(b, t)` tensor of non-negative integer positions (`position_ids`).
    pub fn from_tensor(positions: &Tensor) -> Result<Self> {
        let (b, t) = positions.dims2().map_err(|_| {
            Error::Input(format!(
                "position_ids must be (batch, seq_len), got shape {:?}",
                positions.shape()
            ))
        })?;
        if !matches!(positions.dtype(), DType::U8 | DType::U32 | DType::I64) {
            return Err(Error::Input(format!(
                "position_ids must hold integers (u8, u32 or i64), got {:?}",
                positions.dtype()
            )));
        }
        let flat = positions
            .to_dtype(DType::I64)?
            .flatten_all()?
            .to_vec1::<i64>()?;
        let rows: Vec<Vec<usize>> = flat
            .chunks(t.max(1))
            .take(b)
            .enumerate()
            .map(|(i, row)| {
                row.iter()
                    .enumerate()
                    .map(|(j, &p)| {
                        usize::try_from(p).map_err(|_| {
                            Error::Input(format!(
                                "position_ids holds {p} at (sequence {i}, token {j}): positions \
                                 are non-negative"
                            ))
                        })
                    })
                    .collect()
            })
            .collect::<Result<_>>()?;
        Self::from_rows(&rows)
    }

    /// Rows: 1 when every sequence shares the positions, else the batch size.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Positions per sequence.
    pub fn len(&self) -> usize {
        self.t
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.t == 0
    }

    /// The largest position.
    pub fn max(&self) -> usize {
        self.ids.iter().copied().max().unwrap_or(0) as usize
    }

    /// Row `r`'s positions.
    pub fn row(&self, r: usize) -> &[u32] {
        &self.ids[r * self.t..(r + 1) * self.t]
    }

    /// All positions, row-major `(rows, t)`.
    pub fn as_slice(&self) -> &[u32] {
        &self.ids
    }

    /// `Some(start)` when these are `start..start + t` shared by the batch: the common case,
    /// which table lookups serve as a view.
    pub fn as_range(&self) -> Option<usize> {
        let start = *self.ids.first()? as usize;
        (self.rows == 1
            && self
                .ids
                .iter()
                .enumerate()
                .all(|(i, &p)| p as usize == start + i))
        .then_some(start)
    }

    /// Every position moved by `by` (the shift test).
    pub fn shifted(&self, by: usize) -> Result<Self> {
        if self.max().saturating_add(by) > MAX_POSITION {
            return Err(Error::Input(format!(
                "positions up to {} shifted by {by} pass the largest supported position \
                 {MAX_POSITION}: use a smaller shift",
                self.max()
            )));
        }
        Ok(Self {
            ids: self.ids.iter().map(|&p| p + by as u32).collect(),
            ..self.clone()
        })
    }

    /// The positions as a flat `(rows t)` u32 tensor (for `index_select`).
    pub fn flat_tensor(&self, device: &Device) -> Result<Tensor> {
        Ok(Tensor::from_vec(self.ids.clone(), self.ids.len(), device)?)
    }

    /// The positions as a `(rows, t)` u32 tensor.
    pub fn tensor(&self, device: &Device) -> Result<Tensor> {
        Ok(Tensor::from_vec(
            self.ids.clone(),
            (self.rows, self.t),
            device,
        )?)
    }

    /// Refuses positions that do not fit a batch `(b, t)`.
    pub fn check_batch(&self, b: usize, t: usize) -> Result<()> {
        if self.t != t || (self.rows != 1 && self.rows != b) {
            return Err(Error::Input(format!(
                "positions ({}, {}) do not fit a batch of shape ({b}, {t}): give one row per \
                 sequence (or one row for all) and one position per token",
                self.rows, self.t
            )));
        }
        Ok(())
    }

    /// `|p_i - p_j|` for every pair of tokens of each row, `(rows, t, t)` row-major in f64.
    pub fn distances(&self) -> Vec<f64> {
        let t = self.t;
        let mut out = Vec::with_capacity(self.rows * t * t);
        for r in 0..self.rows {
            let row = self.row(r);
            for &pi in row {
                out.extend(
                    row.iter()
                        .map(|&pj| (i64::from(pi) - i64::from(pj)).abs() as f64),
                );
            }
        }
        out
    }
}

/// Randomized positions (Ruoss et al. 2023): `len` distinct positions drawn uniformly from
/// `[0, n)`, sorted, from `rng`.
pub fn random_positions(len: usize, n: usize, rng: &mut Rng) -> Result<Vec<usize>> {
    if len > n {
        return Err(too_long(len, n));
    }
    let mut drawn = index::sample(rng, n, len).into_vec();
    drawn.sort_unstable();
    Ok(drawn)
}

fn too_long(len: usize, n: usize) -> Error {
    Error::Input(format!(
        "an input of {len} tokens needs {len} distinct positions, but random_positions = {n} \
         draws them from [0, {n}): raise random_positions to at least {len}, or shorten the input"
    ))
}

/// Randomized positions for a padded batch whose sequences have `lengths` real tokens and are
/// padded to `t`: each sequence draws its own (see [`random_positions`]); padded slots repeat
/// the sequence's last position, which keeps rows sorted and inside `[0, n)`.
pub fn random_batch_positions(
    lengths: &[usize],
    t: usize,
    n: usize,
    rng: &mut Rng,
) -> Result<Positions> {
    let rows = lengths
        .iter()
        .map(|&len| {
            if len > t {
                return Err(Error::Input(format!(
                    "a sequence of {len} tokens in a batch padded to {t}"
                )));
            }
            let mut row = random_positions(len, n, rng)?;
            let last = row.last().copied().unwrap_or(0);
            row.resize(t, last);
            Ok(row)
        })
        .collect::<Result<Vec<_>>>()?;
    Positions::from_rows(&rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn ranges_are_recognised_and_shift() {
        let p = Positions::range(3, 4).unwrap();
        assert_eq!(p.as_range(), Some(3));
        assert_eq!(p.max(), 6);
        assert_eq!(p.shifted(10).unwrap().as_range(), Some(13));
        let rows = Positions::from_rows(&[vec![0, 1, 2], vec![0, 2, 5]]).unwrap();
        assert_eq!(rows.as_range(), None);
        assert_eq!(
            rows.distances()[9..18],
            [0.0, 2.0, 5.0, 2.0, 0.0, 3.0, 5.0, 3.0, 0.0]
        );
        assert!(Positions::from_rows(&[vec![0, 1], vec![0]]).is_err());
        assert!(Positions::range(MAX_POSITION, 2).is_err());
    }

    #[test]
    fn random_batches_are_sorted_distinct_bounded_and_padded() {
        let mut rng = Rng::seed_from_u64(1);
        let p = random_batch_positions(&[5, 3], 5, 20, &mut rng).unwrap();
        assert_eq!(p.rows(), 2);
        let r1 = p.row(1);
        assert!(r1[0] < r1[1] && r1[1] < r1[2] && r1[3] == r1[2] && r1[4] == r1[2]);
        assert!(p.max() < 20);
        let err = random_batch_positions(&[5], 5, 4, &mut rng).unwrap_err();
        assert!(err
            .to_string()
            .contains("raise random_positions to at least 5"));
    }
}
