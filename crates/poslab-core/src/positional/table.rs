//! A fixed (non-trainable) position table, built once and reused.

use std::sync::RwLock;

use candle::{DType, Device, Tensor};

use super::Positions;
use crate::error::{Error, Result};

/// The most values a fixed table may hold (rows x width): 2^27, 1 GiB as f64 while it is built.
pub const MAX_TABLE_VALUES: usize = 1 << 27;

type RowBuilder = dyn Fn(usize) -> Vec<f64> + Send + Sync;

/// A fixed table of `width` columns, one row per position, held as a computed tensor (never a
/// trainable variable).
///
/// It is built at construction for `initial_rows` positions. A batch asks for rows
/// `start..start + len`, a view into the cached tensor; only a request past the end rebuilds it,
/// once, for the next power of two. Rows never depend on how many were built, so growing leaves
/// every earlier row bit for bit as it was.
pub struct PositionTable {
    width: usize,
    dtype: DType,
    device: Device,
    build: Box<RowBuilder>,
    rows: RwLock<Tensor>,
}

impl std::fmt::Debug for PositionTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PositionTable")
            .field("width", &self.width)
            .field("capacity", &self.capacity())
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl PositionTable {
    /// `build(n)` returns rows `0..n` row-major as f64, `n * width` values.
    pub fn new(
        width: usize,
        initial_rows: usize,
        dtype: DType,
        device: &Device,
        build: impl Fn(usize) -> Vec<f64> + Send + Sync + 'static,
    ) -> Result<Self> {
        let rows = materialize(&build, initial_rows.max(1), width, dtype, device)?;
        Ok(Self {
            width,
            dtype,
            device: device.clone(),
            build: Box::new(build),
            rows: RwLock::new(rows),
        })
    }

    /// The width of a row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// How many rows are built now.
    pub fn capacity(&self) -> usize {
        self.rows.read().map(|t| t.dim(0).unwrap_or(0)).unwrap_or(0)
    }

    /// Rows `start..start + len` as a `[len, width]` tensor.
    pub fn rows(&self, start: usize, len: usize) -> Result<Tensor> {
        let end = start
            .checked_add(len)
            .ok_or_else(|| Error::Input(format!("position range {start} + {len} overflows")))?;
        {
            let rows = self.rows.read().expect("position table lock poisoned");
            if end <= rows.dim(0)? {
                return Ok(rows.narrow(0, start, len)?);
            }
        }
        let mut rows = self.rows.write().expect("position table lock poisoned");
        if end > rows.dim(0)? {
            *rows = materialize(
                &self.build,
                end.next_power_of_two(),
                self.width,
                self.dtype,
                &self.device,
            )?;
        }
        Ok(rows.narrow(0, start, len)?)
    }

    /// The rows of `positions`, `(r, t, width)`: a view of the cached table when the positions
    /// are a shared range, else gathered.
    pub fn at(&self, positions: &Positions) -> Result<Tensor> {
        let t = positions.len();
        if let Some(start) = positions.as_range() {
            return Ok(self.rows(start, t)?.unsqueeze(0)?);
        }
        // Grow to cover the largest position, then gather.
        let table = self.rows(0, positions.max() + 1)?;
        let idx = positions.flat_tensor(table.device())?;
        Ok(table
            .index_select(&idx, 0)?
            .reshape((positions.rows(), t, self.width))?)
    }
}

fn materialize(
    build: &RowBuilder,
    n: usize,
    width: usize,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    if n.saturating_mul(width) > MAX_TABLE_VALUES {
        return Err(Error::Input(format!(
            "positions up to {n} need a fixed table of {n} x {width} values, more than the \
             {MAX_TABLE_VALUES} a table may hold: use shorter inputs or smaller positions"
        )));
    }
    let values = build(n);
    debug_assert_eq!(values.len(), n * width);
    Ok(Tensor::from_vec(values, (n, width), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?)
}
