//! The fused attention, in the FlashAttention-2 manner: `O = softmax(c q kᵀ + bias + window +
//! key_bias) v` by tiles of queries and keys with an online softmax, so that no `t × t` tensor
//! is ever made; the backward recomputes each tile's weights from the rows' statistics (their
//! largest score `m` and the sum `l` of `e^(s - m)`, kept apart: a padded query whose window
//! holds only padding has scores near the masked score, -1e9, where f32's unit is 64 and
//! `m + ln l` would lose `ln l`).
//!
//! With attention dropout ([`SeededDropout`]) each weight's multiplier is drawn where the
//! weight is, from its index in the `(b, h, t, t)` weights: the sum `l` is of the weights
//! before dropout, `acc` of the dropped ones, and the backward draws the same multipliers
//! (`dp_ij = (dO_i·v_j) m_ij`; `D_i = dO_i·o_i` still, as `o` is the dropped output).
//!
//! The scores' additions are read per tile ([`FlashBias`]): a bias given by offsets (one value
//! per head and offset `j - i`, the `2t - 1` of them: ALiBi's slopes, T5's buckets, KERPLE and
//! FIRE as tables by offset), FoX's running sums (`f[i] - f[j]` for `j <= i`, `g[j] - g[i]`
//! after), the key padding and the window. Key tiles a query tile's window cannot reach are
//! skipped (a causal layer does about half the work).
//!
//! ```text
//! forward, per (batch, head) and query tile Q (rows i):
//!     m_i = -inf, l_i = 0, acc_i = 0
//!     for each key tile K (columns j) the window reaches:
//!         s_ij = c q_i·k_j + bias(i, j) + window(i, j) + key_bias_j
//!         m'_i = max(m_i, max_j s_ij);  p_ij = e^(s_ij - m'_i)
//!         l_i = l_i e^(m_i - m'_i) + Σ_j p_ij;  acc_i = acc_i e^(m_i - m'_i) + Σ_j p_ij v_j
//!         m_i = m'_i
//!     o_i = acc_i / l_i;  kept: m_i and l_i
//! backward, from dO:  D_i = dO_i·o_i;  p_ij = e^(s_ij - m_i) / l_i;  dp_ij = dO_i·v_j
//!     ds_ij = p_ij (dp_ij - D_i)
//!     dv_j = Σ_i p_ij dO_i;  dk_j = c Σ_i ds_ij q_i;  dq_i = c Σ_j ds_ij k_j
//!     d(bias by offset o) = Σ_{b, j - i = o} ds_ij;  the running sums' gradient as `sided_back`
//! ```
//!
//! The twin runs this tile loop as a GPU's blocks would: over (batch, head, key tile) for `dk`,
//! `dv` and the column parts of the bias's gradient, then over (batch, head, query tile) for
//! `dq` and the row parts, each part summed in a fixed order. Its CUDA kernels (`flash.cu`,
//! launched by `flash/cuda.rs`) take the same loop a thread a row; until [`against_twin`] has held
//! them to the twin on a GPU, a CUDA stream answers `fuses_attention` with false and its layers
//! take the softmax path.

use candle::Result;

use super::host::{load, rows_par, store, Store};
use super::*;
use crate::spec::SeededDropout;
use crate::Real;

#[cfg(feature = "cuda")]
pub mod cuda;

/// Queries, and keys, per tile.
pub const TILE: usize = 64;

/// The CUDA kernels' rows a block, one a thread (`FQ` in `flash.cu`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const FQ: usize = 64;

/// The widest head the CUDA kernels take (`FDH` in `flash.cu`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const FDH: usize = 128;

/// The launches of one backward: `D = dO·o`, the key blocks, the query blocks, and for a bias
/// by offset owed a gradient its sum by offset (as the CUDA kernels go; the twin counts the
/// same).
pub fn back_launches(f: &Flash, bias_grad: bool) -> usize {
    3 + usize::from(bias_grad && matches!(f.bias, FlashBias::Offsets { .. }))
}

impl Heads {
    /// Where row `i` of (batch, head) `bh` starts in a tensor of the heads side by side
    /// `(b, t, h dh)`.
    pub fn token_row(&self, bh: usize, i: usize) -> usize {
        let (bi, hd) = (bh / self.h, bh % self.h);
        ((bi * self.t + i) * self.h + hd) * self.dh
    }
}

/// Rows `rows` of (batch, head) `bh` from `x` `(b, t, h dh)`, one after another.
fn load_rows<S: Store<C>, C: Real + Store<C>>(
    n: Heads,
    x: Mem,
    bh: usize,
    rows: std::ops::Range<usize>,
) -> Vec<C> {
    let mut out = Vec::with_capacity(rows.len() * n.dh);
    for i in rows {
        let at = n.token_row(bh, i);
        out.extend(load::<S, C>(x, at..at + n.dh));
    }
    out
}

/// The score bias the fused attention reads per tile.
#[derive(Clone, Copy, Debug)]
pub enum FlashBias {
    None,
    /// `(h, 2t - 1)` in the compute dtype: head `hd`'s bias at offset `j - i` is
    /// `values[hd (2t - 1) + j - i + t - 1]`.
    Offsets {
        values: Mem,
    },
    /// FoX's running sums `(2, b, h, t)` in the compute dtype, as [`ScoreBias::Sided`].
    Sided {
        sums: Mem,
    },
}

/// One fused attention: the heads `q`, `k`, `v` `(b, h, t, dh)` each and what is added to the
/// scores. Its output, and the output's gradient, are the heads side by side `(b, t, h dh)`:
/// row `i` of head `hd` at [`Heads::token_row`].
#[derive(Clone, Copy, Debug)]
pub struct Flash {
    pub heads: Heads,
    pub q: Mem,
    pub k: Mem,
    pub v: Mem,
    /// What `q kᵀ` is multiplied by.
    pub scale: f64,
    /// `(b, t)`, compute dtype: 0 for real keys, the masked score for padding.
    pub key_bias: Mem,
    pub bias: FlashBias,
    pub window: Window,
    /// Attention dropout, drawn in the tile loop.
    pub dropout: Option<SeededDropout>,
}

impl Flash {
    /// The dropout multiplier of query `i` and key `j` of (batch, head) `bh` in the compute
    /// dtype, from `drop` (the dropout and its scale in the heads' dtype); 1 without dropout.
    fn kept<C: Real>(&self, drop: Option<(SeededDropout, C)>, bh: usize, i: usize, j: usize) -> C {
        match drop {
            None => C::one(),
            Some((d, scale)) => {
                let t = self.heads.t as u64;
                match d.keeps((bh as u64 * t + i as u64) * t + j as u64) {
                    true => scale,
                    false => C::zero(),
                }
            }
        }
    }

    /// The dropout and its kept entries' multiplier, as [`Flash::kept`] takes them.
    fn drop<C: Real>(&self) -> Result<Option<(SeededDropout, C)>> {
        self.dropout
            .map(|d| Ok((d, C::lit(d.scale(self.q.dtype)?))))
            .transpose()
    }

    /// The bias's values (and its gradient's): `(h, 2t - 1)` by offset, `(2, b, h, t)` for
    /// running sums.
    fn bias_len(&self) -> usize {
        let n = self.heads;
        match self.bias {
            FlashBias::None => 0,
            FlashBias::Offsets { .. } => n.h * (2 * n.t - 1),
            FlashBias::Sided { .. } => 2 * n.b * n.h * n.t,
        }
    }

    /// Checks every span the forward reads and writes (the output `out` and the rows'
    /// statistics `lse`): the heads and the output in the heads' dtype, the rest in its compute
    /// dtype. The twin and the CUDA launches both check here.
    fn check_forward(&self, out: Mem, lse: Mem) -> Result<()> {
        let n = self.heads;
        let (dt, cd) = (self.q.dtype, compute_dtype(self.q.dtype));
        for (m, what) in [
            (self.q, "q"),
            (self.k, "k"),
            (self.v, "v"),
            (out, "the attention's output"),
        ] {
            m.holds(n.one(), dt, what)?;
        }
        self.key_bias.holds(n.b * n.t, cd, "the key bias")?;
        lse.holds(2 * n.b * n.h * n.t, cd, "the rows' statistics")?;
        match self.bias {
            FlashBias::None => Ok(()),
            FlashBias::Offsets { values } => {
                values.holds(self.bias_len(), cd, "the bias by offset")
            }
            FlashBias::Sided { sums } => sums.holds(self.bias_len(), cd, "the running sums"),
        }
    }

    /// [`Flash::check_forward`], and the spans the backward reads and writes besides: the
    /// output's gradient `dout` and the gradients `g`.
    fn check_backward(&self, out: Mem, lse: Mem, dout: Mem, g: &FlashGrads) -> Result<()> {
        self.check_forward(out, lse)?;
        let n = self.heads;
        for (m, what) in [
            (dout, "the output's gradient"),
            (g.dq, "dq"),
            (g.dk, "dk"),
            (g.dv, "dv"),
        ] {
            m.holds(n.one(), self.q.dtype, what)?;
        }
        match g.dbias {
            Some(d) => d.holds(
                self.bias_len(),
                compute_dtype(self.q.dtype),
                "the bias's gradient",
            ),
            None => Ok(()),
        }
    }
}

/// The gradients [`Stream::flash_back`] writes: `dq`, `dk`, `dv` `(b, h, t, dh)` in the heads' dtype,
/// and the bias's, `(h, 2t - 1)` by offset or `(2, b, h, t)` for running sums, in the compute
/// dtype (`None`: owed none).
#[derive(Clone, Copy, Debug)]
pub struct FlashGrads {
    pub dq: Mem,
    pub dk: Mem,
    pub dv: Mem,
    pub dbias: Option<Mem>,
}

/// One (batch, head)'s view of a [`Flash`], values of the compute dtype.
struct Block<C> {
    q: Vec<C>,
    k: Vec<C>,
    v: Vec<C>,
    key_bias: Vec<C>,
    /// By offset `j - i + t - 1`, or the running sums `f` then `g`.
    bias: Vec<C>,
}

impl<C: Real + Store<C>> Block<C> {
    fn of<S: Store<C>>(f: &Flash, bh: usize) -> Self {
        let n = f.heads;
        let (bi, hd, span) = (bh / n.h, bh % n.h, n.t * n.dh);
        let rows = bh * span..(bh + 1) * span;
        let bias = match f.bias {
            FlashBias::None => Vec::new(),
            FlashBias::Offsets { values } => {
                let w = 2 * n.t - 1;
                load::<C, C>(values, hd * w..(hd + 1) * w)
            }
            FlashBias::Sided { sums } => {
                let half = n.b * n.h * n.t;
                let mut both = load::<C, C>(sums, bh * n.t..(bh + 1) * n.t);
                both.extend(load::<C, C>(sums, half + bh * n.t..half + (bh + 1) * n.t));
                both
            }
        };
        Self {
            q: load::<S, C>(f.q, rows.clone()),
            k: load::<S, C>(f.k, rows.clone()),
            v: load::<S, C>(f.v, rows),
            key_bias: load::<C, C>(f.key_bias, bi * n.t..(bi + 1) * n.t),
            bias,
        }
    }

    /// The score of query `i` and key `j`, everything added.
    fn score(&self, f: &Flash, i: usize, j: usize) -> C {
        let (t, dh) = (f.heads.t, f.heads.dh);
        let (qi, kj) = (&self.q[i * dh..(i + 1) * dh], &self.k[j * dh..(j + 1) * dh]);
        let dot = qi.iter().zip(kj).fold(C::zero(), |s, (a, b)| s + *a * *b);
        let mut s = C::lit(f.scale) * dot + self.key_bias[j];
        s += match f.bias {
            FlashBias::None => C::zero(),
            FlashBias::Offsets { .. } => self.bias[j + t - 1 - i],
            FlashBias::Sided { .. } if j <= i => self.bias[i] - self.bias[j],
            FlashBias::Sided { .. } => self.bias[t + j] - self.bias[t + i],
        };
        if f.window.hides(i, j) {
            s += C::lit(crate::spec::MASKED_SCORE);
        }
        s
    }
}

/// The key tiles (as starts) the window lets the queries `rows` reach.
fn key_tiles(f: &Flash, rows: std::ops::Range<usize>) -> impl Iterator<Item = usize> {
    let keys = f.window.keys_of(rows, f.heads.t);
    let first = keys.start / TILE * TILE;
    (first..keys.end).step_by(TILE)
}

/// The query tiles (as starts) that may see any key of `keys`.
fn query_tiles(f: &Flash, keys: std::ops::Range<usize>) -> impl Iterator<Item = usize> {
    let rows = f.window.queries_of(keys, f.heads.t);
    let first = rows.start / TILE * TILE;
    (first..rows.end).step_by(TILE)
}

/// Whether a row whose largest score is `m` saw only masked keys: a padded
/// query whose window holds only padding. The composition spreads such a row's weight over
/// every masked key, inside its window or not, and so does the fused attention: a tile with
/// such a row visits every key tile.
fn dead<C: Real>(m: C) -> bool {
    m < C::lit(crate::spec::MASKED_SCORE / 2.0)
}

/// The twin of the forward kernel: `out` `(b, t, h dh)` in the heads' dtype, and the rows'
/// statistics `stats` `(2, b, h, t)` in the compute dtype: each row's largest score `m`, then
/// its sum `l` of `e^(s - m)`.
pub(super) fn flash_twin<S: Store<C>, C: Real + Store<C>>(
    f: &Flash,
    out: Mem,
    lse: Mem,
) -> Result<()> {
    f.check_forward(out, lse)?;
    let n = f.heads;
    let (t, dh) = (n.t, n.dh);
    let tiles = t.div_ceil(TILE);
    let drop = f.drop::<C>()?;
    rows_par(n.b * n.h * tiles, TILE * t * dh, |task| {
        let (bh, tile) = (task / tiles, task % tiles);
        let block = Block::<C>::of::<S>(f, bh);
        let rows = tile * TILE..((tile + 1) * TILE).min(t);
        let width = rows.len();
        let mut m = vec![<C as num_traits::Float>::neg_infinity(); width];
        let mut l = vec![C::zero(); width];
        let mut acc = vec![C::zero(); width * dh];
        // The reachable key tiles, then, when a row found only masked keys there, every other
        // tile (which leaves the other rows as they are: their weights there are exactly 0).
        let reach = key_tiles(f, rows.clone()).collect::<Vec<_>>();
        let mut order = reach.clone();
        let mut k = 0;
        while k < order.len() {
            let start = order[k];
            k += 1;
            let cols = start..(start + TILE).min(t);
            for (r, i) in rows.clone().enumerate() {
                let s: Vec<C> = cols.clone().map(|j| block.score(f, i, j)).collect();
                let top = s.iter().fold(m[r], |a, b| num_traits::Float::max(a, *b));
                let rescale = (m[r] - top).exp();
                let acc_r = &mut acc[r * dh..(r + 1) * dh];
                for a in acc_r.iter_mut() {
                    *a *= rescale;
                }
                l[r] *= rescale;
                for (s, j) in s.iter().zip(cols.clone()) {
                    let p = (*s - top).exp();
                    l[r] += p;
                    let p = p * f.kept(drop, bh, i, j);
                    for (a, v) in acc_r.iter_mut().zip(&block.v[j * dh..(j + 1) * dh]) {
                        *a += p * *v;
                    }
                }
                m[r] = top;
            }
            if k == reach.len() && m.iter().any(|m| dead(*m)) {
                order.extend((0..t).step_by(TILE).filter(|s| !reach.contains(s)));
            }
        }
        let o: Vec<C> = acc
            .chunks(dh)
            .zip(&l)
            .flat_map(|(a, l)| a.iter().map(move |a| *a / *l))
            .collect();
        for (r, i) in rows.clone().enumerate() {
            store::<S, C>(out, n.token_row(bh, i), &o[r * dh..(r + 1) * dh]);
        }
        store::<C, C>(lse, bh * t + rows.start, &m);
        store::<C, C>(lse, n.b * n.h * t + bh * t + rows.start, &l);
    });
    Ok(())
}

/// What every tile of a (batch, head) reads in the backward: its [`Block`], `dO` by row, the
/// rows' statistics `(m, l)` and `D = dO·o`.
type Prepared<C> = (Block<C>, Vec<C>, Vec<(C, C)>, Vec<C>);

/// The twin of the backward kernel, from the forward's `out` and statistics `lse` and the
/// output's gradient `dout` (all as [`flash_twin`] wrote them).
pub(super) fn flash_back_twin<S: Store<C>, C: Real + Store<C>>(
    f: &Flash,
    out: Mem,
    lse: Mem,
    dout: Mem,
    g: &FlashGrads,
) -> Result<()> {
    f.check_backward(out, lse, dout, g)?;
    let n = f.heads;
    let (t, dh, bh_all) = (n.t, n.dh, n.b * n.h);
    // Each row's D = dO·O, and what every tile of a (batch, head) reads.
    let prepared = |bh: usize| -> Prepared<C> {
        let block = Block::<C>::of::<S>(f, bh);
        let o = load_rows::<S, C>(n, out, bh, 0..t);
        let d_o = load_rows::<S, C>(n, dout, bh, 0..t);
        let m = load::<C, C>(lse, bh * t..(bh + 1) * t);
        let l = load::<C, C>(lse, (bh_all + bh) * t..(bh_all + bh + 1) * t);
        let stats: Vec<(C, C)> = m.into_iter().zip(l).collect();
        let dd: Vec<C> = (0..t)
            .map(|i| {
                let (a, b) = (&o[i * dh..(i + 1) * dh], &d_o[i * dh..(i + 1) * dh]);
                a.iter().zip(b).fold(C::zero(), |s, (x, y)| s + *x * *y)
            })
            .collect();
        (block, d_o, stats, dd)
    };
    let drop = f.drop::<C>()?;
    // `(p_ij m_ij, ds_ij)` of query `i` and key `j` of (batch, head) `bh`, `m` the dropout's
    // multiplier.
    let weights = |(block, d_o, stats, dd): &Prepared<C>, bh: usize, i: usize, j: usize| {
        let p = (block.score(f, i, j) - stats[i].0).exp() / stats[i].1;
        let m = f.kept(drop, bh, i, j);
        let dp = d_o[i * dh..(i + 1) * dh]
            .iter()
            .zip(&block.v[j * dh..(j + 1) * dh])
            .fold(C::zero(), |s, (a, b)| s + *a * *b);
        (p * m, p * (dp * m - dd[i]))
    };
    let scale = C::lit(f.scale);
    let tiles = t.div_ceil(TILE);
    // `work` of every (batch, head) and tile of positions, in parallel: its results in order.
    let per_tile = |work: &(dyn Fn(usize, std::ops::Range<usize>) -> Vec<C> + Sync)| {
        use rayon::prelude::*;
        (0..bh_all * tiles)
            .into_par_iter()
            .map(|task| {
                let (bh, tile) = (task / tiles, task % tiles);
                work(bh, tile * TILE..((tile + 1) * TILE).min(t))
            })
            .collect::<Vec<Vec<C>>>()
    };
    // Per key tile: dk, dv, and the columns' part of the bias's gradient.
    let column_parts = per_tile(&|bh, cols| {
        let ready = prepared(bh);
        let (block, stats) = (&ready.0, &ready.2);
        let (mut dk, mut dv) = (
            vec![C::zero(); cols.len() * dh],
            vec![C::zero(); cols.len() * dh],
        );
        // Offsets: by offset; sided: the columns' `-Σ_{r >= j}` of df and `Σ_{r < j}` of dg.
        let mut part = match f.bias {
            FlashBias::Offsets { .. } => vec![C::zero(); 2 * t - 1],
            _ => vec![C::zero(); 2 * cols.len()],
        };
        let mut starts: Vec<usize> = query_tiles(f, cols.clone()).collect();
        for start in (0..t).step_by(TILE) {
            let rows = start..(start + TILE).min(t);
            if !starts.contains(&start) && rows.into_iter().any(|i| dead(stats[i].0)) {
                starts.push(start);
            }
        }
        for start in starts {
            for i in start..(start + TILE).min(t) {
                for (c, j) in cols.clone().enumerate() {
                    let (p, ds) = weights(&ready, bh, i, j);
                    for d in 0..dh {
                        dv[c * dh + d] += p * ready.1[i * dh + d];
                        dk[c * dh + d] += scale * ds * block.q[i * dh + d];
                    }
                    match f.bias {
                        FlashBias::None => {}
                        FlashBias::Offsets { .. } => part[j + t - 1 - i] += ds,
                        FlashBias::Sided { .. } if i >= j => part[c] -= ds,
                        FlashBias::Sided { .. } => part[cols.len() + c] += ds,
                    }
                }
            }
        }
        store::<S, C>(g.dk, (bh * t + cols.start) * dh, &dk);
        store::<S, C>(g.dv, (bh * t + cols.start) * dh, &dv);
        part
    });
    // Per query tile: dq, and the rows' part of the sums' gradient.
    let row_parts = per_tile(&|bh, rows| {
        let ready = prepared(bh);
        let (block, stats) = (&ready.0, &ready.2);
        let mut dq = vec![C::zero(); rows.len() * dh];
        // Sided: the rows' `Σ_{j <= i}` of df and `-Σ_{j > i}` of dg.
        let mut part = vec![C::zero(); 2 * rows.len()];
        let starts: Vec<usize> = match rows.clone().any(|i| dead(stats[i].0)) {
            true => (0..t).step_by(TILE).collect(),
            false => key_tiles(f, rows.clone()).collect(),
        };
        for start in starts {
            for j in start..(start + TILE).min(t) {
                for (r, i) in rows.clone().enumerate() {
                    let (_, ds) = weights(&ready, bh, i, j);
                    for d in 0..dh {
                        dq[r * dh + d] += scale * ds * block.k[j * dh + d];
                    }
                    match j <= i {
                        true => part[r] += ds,
                        false => part[rows.len() + r] -= ds,
                    }
                }
            }
        }
        store::<S, C>(g.dq, (bh * t + rows.start) * dh, &dq);
        part
    });
    let Some(dbias) = g.dbias else {
        return Ok(());
    };
    match f.bias {
        FlashBias::None => {}
        FlashBias::Offsets { .. } => {
            // Summed over the batch and the key tiles, per head.
            let w = 2 * t - 1;
            let mut by_head = vec![C::zero(); n.h * w];
            for (task, part) in column_parts.iter().enumerate() {
                let hd = task / tiles % n.h;
                for (acc, v) in by_head[hd * w..(hd + 1) * w].iter_mut().zip(part) {
                    *acc += *v;
                }
            }
            store::<C, C>(dbias, 0, &by_head);
        }
        FlashBias::Sided { .. } => {
            let half = bh_all * t;
            let mut sums = vec![C::zero(); 2 * half];
            for (task, (cols, rows)) in column_parts.iter().zip(&row_parts).enumerate() {
                let (bh, tile) = (task / tiles, task % tiles);
                let at = tile * TILE;
                let width = ((tile + 1) * TILE).min(t) - at;
                for x in 0..width {
                    // df = rows' Σ_{j<=i} - columns' Σ_{r>=j}; dg = columns' Σ_{r<j} - rows' Σ_{j>i}
                    sums[bh * t + at + x] += rows[x] + cols[x];
                    sums[half + bh * t + at + x] += cols[width + x] + rows[width + x];
                }
            }
            store::<C, C>(dbias, 0, &sums);
        }
    }
    Ok(())
}

/// For a GPU's tests: the fused attention's forward and every gradient on `device`'s stream
/// against its CPU twin on the same values, for every dtype, bias, window (padded queries whose
/// window holds only padding among them) and with and without dropout, at head widths 8, 64 and
/// 128, over a length the tiles do not divide. Returns the worst error of each dtype, relative
/// to each output's largest value, over the rows with a real key (a row with none has the
/// weights of the rounding, as in the twin's own test). On the CPU it runs the twin twice.
pub fn against_twin(device: &candle::Device) -> Result<Vec<(DType, f64)>> {
    use candle::Tensor;

    let stream = stream_for(device)?;
    let twin = twin::Twin;
    let mut worst: Vec<(DType, f64)> = Vec::new();
    for dh in [8, 64, 128] {
        let n = Heads {
            b: 2,
            h: 3,
            t: 150,
            dh,
        };
        let key_bias = padded_key_bias(n);
        let qkv = [values(n.one(), 1), values(n.one(), 2), values(n.one(), 3)];
        let biases = [
            vec![0.0],
            values(n.h * (2 * n.t - 1), 5),
            values(2 * n.b * n.h * n.t, 6)
                .iter()
                .map(|x| 3.0 * x)
                .collect(),
        ];
        let windows = [
            Window::ALL,
            Window::new(Some(20), false),
            Window::new(None, true),
        ];
        for (dtype, window, kind, dropout) in [DType::F64, DType::F32, DType::BF16, DType::F16]
            .into_iter()
            .flat_map(|d| windows.map(|w| (d, w)))
            .flat_map(|(d, w)| (0..3).map(move |k| (d, w, k)))
            .flat_map(|(d, w, k)| {
                [None, Some(SeededDropout { seed: 9, p: 0.25 })].map(|p| (d, w, k, p))
            })
        {
            let cd = compute_dtype(dtype);
            // Rows whose window holds only padding: zero in dO and left out of the output.
            let dead = |bh: usize, i: usize| {
                let bi = bh / n.h;
                (0..n.t).all(|j| window.hides(i, j) || key_bias[bi * n.t + j] != 0.0)
            };
            let live = |x: &mut [f64]| {
                for bh in 0..n.b * n.h {
                    for i in (0..n.t).filter(|i| dead(bh, *i)) {
                        let at = n.token_row(bh, i);
                        x[at..at + dh].iter_mut().for_each(|v| *v = 0.0);
                    }
                }
            };
            let mut dout = values(n.one(), 4);
            live(&mut dout);
            let bias_len = match kind {
                1 => n.h * (2 * n.t - 1),
                2 => 2 * n.b * n.h * n.t,
                _ => 0,
            };
            let mut results: Vec<Vec<Vec<f64>>> = Vec::new();
            for (d, s) in [
                (device, &*stream),
                (&candle::Device::Cpu, &twin as &dyn Stream),
            ] {
                let on = |v: &[f64], dt: DType| -> Result<Tensor> {
                    Tensor::new(v, &candle::Device::Cpu)?
                        .to_dtype(dt)?
                        .to_device(d)
                };
                let inputs = [
                    on(&qkv[0], dtype)?,
                    on(&qkv[1], dtype)?,
                    on(&qkv[2], dtype)?,
                    on(&dout, dtype)?,
                    on(&key_bias, cd)?,
                    on(&biases[kind], cd)?,
                ];
                let held: Vec<Held> = inputs.iter().map(Held::of).collect();
                let m = |x: usize| held[x].mem();
                let f = Flash {
                    heads: n,
                    q: m(0)?,
                    k: m(1)?,
                    v: m(2)?,
                    scale: 1.0 / (dh as f64).sqrt(),
                    key_bias: m(4)?,
                    bias: match kind {
                        1 => FlashBias::Offsets { values: m(5)? },
                        2 => FlashBias::Sided { sums: m(5)? },
                        _ => FlashBias::None,
                    },
                    window,
                    dropout,
                };
                let (o, lse) = (s.alloc(dtype, n.one())?, s.alloc(cd, 2 * n.b * n.h * n.t)?);
                s.flash(&f, o.mem(), lse.mem())?;
                let (dq, dk, dv) = (
                    s.alloc(dtype, n.one())?,
                    s.alloc(dtype, n.one())?,
                    s.alloc(dtype, n.one())?,
                );
                let db = (bias_len > 0).then(|| s.alloc(cd, bias_len)).transpose()?;
                let grads = FlashGrads {
                    dq: dq.mem(),
                    dk: dk.mem(),
                    dv: dv.mem(),
                    dbias: db.as_ref().map(Buf::mem),
                };
                s.flash_back(&f, o.mem(), lse.mem(), m(3)?, &grads)?;
                drop(held);
                let mut o = read(o)?;
                live(&mut o);
                let db = db.map(read).transpose()?.unwrap_or_default();
                results.push(vec![o, read(dq)?, read(dk)?, read(dv)?, db]);
            }
            let e = results[0]
                .iter()
                .zip(&results[1])
                .map(|(got, want)| {
                    let top = want.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
                    got.iter()
                        .zip(want)
                        .fold(0.0f64, |m, (g, w)| m.max((g - w).abs()))
                        / top
                })
                .fold(0.0f64, f64::max);
            match worst.iter_mut().find(|w| w.0 == dtype) {
                Some(w) => w.1 = w.1.max(e),
                None => worst.push((dtype, e)),
            }
        }
    }
    Ok(worst)
}

/// Values in (-1, 1) from a fixed stream (xorshift), for the checks.
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect()
}

/// The key bias `(b, t)` of the checks: the last sequence's last 30 keys are padding.
fn padded_key_bias(n: Heads) -> Vec<f64> {
    (0..n.b * n.t)
        .map(|x| match x >= n.b * n.t - 30 {
            true => crate::spec::MASKED_SCORE,
            false => 0.0,
        })
        .collect()
}

/// A stream's buffer's values, as f64.
fn read(b: Buf) -> Result<Vec<f64>> {
    #[allow(clippy::infallible_destructuring_match)] // not so with the `cuda` feature
    let storage = match b.into_owner() {
        Owner::Cpu(s) => s,
        #[cfg(feature = "cuda")]
        Owner::Cuda(s) => {
            use candle::backend::BackendStorage;
            s.to_cpu_storage()?
        }
    };
    Ok(match storage {
        CpuStorage::F64(v) => v,
        CpuStorage::F32(v) => v.into_iter().map(f64::from).collect(),
        CpuStorage::BF16(v) => v.into_iter().map(half::bf16::to_f64).collect(),
        CpuStorage::F16(v) => v.into_iter().map(half::f16::to_f64).collect(),
        _ => candle::bail!("device path: a buffer of no float dtype"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::twin::Twin;

    /// A span over `v` (which must outlive its use).
    fn mem<T: candle::WithDType>(v: &[T]) -> Mem {
        Mem {
            addr: v.as_ptr() as u64,
            len: v.len(),
            dtype: T::DTYPE,
        }
    }

    /// The dense reference in f64: every score, softmax, and the gradients by the chain rule:
    /// `(o, dq, dk, dv, dbias)`.
    #[allow(clippy::type_complexity)]
    fn reference(
        n: Heads,
        (q, k, v): (&[f64], &[f64], &[f64]),
        scale: f64,
        key_bias: &[f64],
        bias: &Bias,
        window: Window,
        dout: &[f64],
        dropout: Option<(SeededDropout, f64)>,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (t, dh) = (n.t, n.dh);
        // The multiplier of query `i` and key `j` of (batch, head) `bh`.
        let kept = |bh: usize, i: usize, j: usize| match dropout {
            None => 1.0,
            Some((d, scale)) => match d.keeps(((bh * t + i) * t + j) as u64) {
                true => scale,
                false => 0.0,
            },
        };
        let size = n.one();
        let (mut o, mut dq, mut dk, mut dv) = (
            vec![0.0; size],
            vec![0.0; size],
            vec![0.0; size],
            vec![0.0; size],
        );
        let mut dbias = vec![0.0; bias.len(n)];
        let half = n.b * n.h * t;
        for bh in 0..n.b * n.h {
            let (bi, hd) = (bh / n.h, bh % n.h);
            let at = |x: &[f64], i: usize, d: usize| x[(bh * t + i) * dh + d];
            let mut p = vec![vec![0.0; t]; t];
            for (i, row) in p.iter_mut().enumerate() {
                for (j, s) in row.iter_mut().enumerate() {
                    let dot: f64 = (0..dh).map(|d| at(q, i, d) * at(k, j, d)).sum();
                    *s = scale * dot + key_bias[bi * t + j] + bias.at(n, bh, hd, i, j);
                    if window.hides(i, j) {
                        *s += crate::spec::MASKED_SCORE;
                    }
                }
                let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = row.iter().map(|s| (s - max).exp()).sum();
                for s in row.iter_mut() {
                    *s = (*s - max).exp() / sum;
                }
            }
            for i in 0..t {
                for d in 0..dh {
                    o[(bh * t + i) * dh + d] =
                        (0..t).map(|j| p[i][j] * kept(bh, i, j) * at(v, j, d)).sum();
                }
            }
            for i in 0..t {
                let dp: Vec<f64> = (0..t)
                    .map(|j| {
                        kept(bh, i, j) * (0..dh).map(|d| at(dout, i, d) * at(v, j, d)).sum::<f64>()
                    })
                    .collect();
                let dot: f64 = (0..t).map(|j| dp[j] * p[i][j]).sum();
                for j in 0..t {
                    let ds = p[i][j] * (dp[j] - dot);
                    for d in 0..dh {
                        dq[(bh * t + i) * dh + d] += scale * ds * at(k, j, d);
                        dk[(bh * t + j) * dh + d] += scale * ds * at(q, i, d);
                        dv[(bh * t + j) * dh + d] += p[i][j] * kept(bh, i, j) * at(dout, i, d);
                    }
                    match bias {
                        Bias::None => {}
                        Bias::Offsets(_) => dbias[hd * (2 * t - 1) + j + t - 1 - i] += ds,
                        Bias::Sided(_) if j <= i => {
                            dbias[bh * t + i] += ds;
                            dbias[bh * t + j] -= ds;
                        }
                        Bias::Sided(_) => {
                            dbias[half + bh * t + j] += ds;
                            dbias[half + bh * t + i] -= ds;
                        }
                    }
                }
            }
        }
        (o, dq, dk, dv, dbias)
    }

    enum Bias {
        None,
        Offsets(Vec<f64>),
        Sided(Vec<f64>),
    }

    impl Bias {
        fn len(&self, n: Heads) -> usize {
            match self {
                Bias::None => 0,
                Bias::Offsets(_) => n.h * (2 * n.t - 1),
                Bias::Sided(_) => 2 * n.b * n.h * n.t,
            }
        }
        fn at(&self, n: Heads, bh: usize, hd: usize, i: usize, j: usize) -> f64 {
            let (t, half) = (n.t, n.b * n.h * n.t);
            match self {
                Bias::None => 0.0,
                Bias::Offsets(v) => v[hd * (2 * t - 1) + j + t - 1 - i],
                Bias::Sided(s) if j <= i => s[bh * t + i] - s[bh * t + j],
                Bias::Sided(s) => s[half + bh * t + j] - s[half + bh * t + i],
            }
        }
    }

    /// The largest difference between `got` and `want`, relative to `want`'s largest value.
    fn error(got: &[f64], want: &[f64]) -> f64 {
        let top = want.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
        got.iter()
            .zip(want)
            .fold(0.0f64, |m, (g, w)| m.max((g - w).abs()))
            / top
    }

    /// The fused attention's forward and every gradient match the dense reference, in f64 to
    /// 1e-12, in f32 to 1e-5, in bf16 to 1e-2 and in f16 to 1e-3 (relative to each output's
    /// largest value; the half types against the reference of their rounded inputs), with padded
    /// keys, every kind of window (padded queries whose window holds only padding among them),
    /// and each bias it takes; over tiles that do not divide the length, at head widths 8, 64
    /// and 128; with and without attention dropout (the reference's multipliers those of
    /// [`SeededDropout::keeps`] at each weight's index).
    #[test]
    fn the_fused_attention_matches_the_dense_reference_forward_and_backward() {
        let mut worst = std::collections::BTreeMap::new();
        for dh in [8, 64, 128] {
            let n = Heads {
                b: 2,
                h: 3,
                t: 150,
                dh,
            };
            matches_the_reference(n, &mut worst);
        }
        eprintln!("fused attention against the dense reference, worst relative error: {worst:?}");
    }

    /// Records the worst error of each dtype (and whether every row was held) in `worst`.
    fn matches_the_reference(n: Heads, worst: &mut std::collections::BTreeMap<String, f64>) {
        let size = n.one();
        let (q, k, v, dout) = (
            values(size, 1),
            values(size, 2),
            values(size, 3),
            values(size, 4),
        );
        let scale = 1.0 / (n.dh as f64).sqrt();
        let key_bias = padded_key_bias(n);
        let windows = [
            Window::ALL,
            Window::new(Some(20), false),
            Window::new(None, true),
        ];
        let biases = [
            Bias::None,
            Bias::Offsets(values(n.h * (2 * n.t - 1), 5)),
            Bias::Sided(
                values(2 * n.b * n.h * n.t, 6)
                    .iter()
                    .map(|x| 3.0 * x)
                    .collect(),
            ),
        ];
        for window in windows {
            // In f32 the scores of a padded query whose window holds only padding all round to
            // the masked score (its unit there is 64), so its weights are those of the rounding,
            // not of the scores: f32 and the half types are held to the rows with a real key,
            // whose gradient alone reaches a loss.
            let dead = |row: usize| {
                let (bi, i) = (row / n.t / n.h, row % n.t);
                (0..n.t).all(|j| window.hides(i, j) || key_bias[bi * n.t + j] != 0.0)
            };
            let live = |x: &[f64]| -> Vec<f64> {
                x.chunks(n.dh)
                    .enumerate()
                    .flat_map(|(row, c)| {
                        let keep = !dead(row);
                        c.iter().map(move |v| if keep { *v } else { 0.0 })
                    })
                    .collect()
            };
            let live_dout = live(&dout);
            for (bias, dropout) in biases.iter().flat_map(|b| {
                [
                    None,
                    Some(SeededDropout {
                        seed: 0x5EED,
                        p: 0.25,
                    }),
                ]
                .map(|d| (b, d))
            }) {
                // With those rows, f64 to 1e-6: their scores sit near the masked score, -1e9,
                // where f64's unit is 1.2e-7, and their weights come from the log-sum-exp there.
                let kinds = [
                    (DType::F64, false, 1e-12),
                    (DType::F64, true, 1e-6),
                    (DType::F32, false, 1e-5),
                    (DType::BF16, false, 1e-2),
                    (DType::F16, false, 1e-3),
                ];
                for (dtype, all, tolerance) in kinds {
                    let dout = if all { dout.clone() } else { live_dout.clone() };
                    // The values as the kernel reads them: the heads in `dtype`, the rest in f32.
                    let round =
                        |x: &[f64]| -> Vec<f64> { x.iter().map(|v| rounded(*v, dtype)).collect() };
                    let (q, k, v, dout) = (round(&q), round(&k), round(&v), round(&dout));
                    let multiplier = dropout.map(|d| (d, d.scale(dtype).unwrap()));
                    let mut want = reference(
                        n,
                        (&q, &k, &v),
                        scale,
                        &key_bias,
                        bias,
                        window,
                        &dout,
                        multiplier,
                    );
                    let mut got = run(
                        n,
                        (&q, &k, &v),
                        scale,
                        &key_bias,
                        (bias, dropout),
                        window,
                        &dout,
                        dtype,
                    );
                    if !all {
                        (want.0, got[0]) = (live(&want.0), live(&got[0]));
                    }
                    let names = ["o", "dq", "dk", "dv", "dbias"];
                    let wanted = [&want.0, &want.1, &want.2, &want.3, &want.4];
                    for ((name, got), want) in names.iter().zip(&got).zip(wanted) {
                        let e = error(got, want);
                        let slot = worst
                            .entry(format!("{dtype:?} all rows {all}"))
                            .or_default();
                        *slot = f64::max(*slot, e);
                        assert!(
                            e <= tolerance,
                            "{name} off by {e:.2e} ({dtype:?}, dh {}, all rows {all}, \
                             {window:?}, bias {}, {dropout:?})",
                            n.dh,
                            bias.len(n)
                        );
                    }
                }
            }
        }
    }

    /// `v` as stored in `dtype` (f64 and f32 exactly; the half types rounded), back in f64.
    fn rounded(v: f64, dtype: DType) -> f64 {
        match dtype {
            DType::BF16 => half::bf16::from_f64(v).to_f64(),
            DType::F16 => half::f16::from_f64(v).to_f64(),
            _ => v,
        }
    }

    /// `x` `(b, h, t, dh)` as the heads side by side `(b, t, h dh)`, or back (`back`).
    fn side_by_side(n: Heads, x: &[f64], back: bool) -> Vec<f64> {
        let mut out = vec![0.0; x.len()];
        for bh in 0..n.b * n.h {
            for i in 0..n.t {
                let (by_head, by_token) = ((bh * n.t + i) * n.dh, n.token_row(bh, i));
                let (from, to) = match back {
                    false => (by_head, by_token),
                    true => (by_token, by_head),
                };
                out[to..to + n.dh].copy_from_slice(&x[from..from + n.dh]);
            }
        }
        out
    }

    /// Runs the twin's fused forward and backward on the values given (`dout` by head, as the
    /// reference's), the heads stored as `dtype` and the rest in its compute dtype:
    /// `[o (by head), dq, dk, dv, dbias]` as f64.
    #[allow(clippy::too_many_arguments)]
    fn run(
        n: Heads,
        (q, k, v): (&[f64], &[f64], &[f64]),
        scale: f64,
        key_bias: &[f64],
        (bias, dropout): (&Bias, Option<SeededDropout>),
        window: Window,
        dout: &[f64],
        dtype: DType,
    ) -> [Vec<f64>; 5] {
        macro_rules! as_types {
            ($s:ty, $c:ty, $to_s:expr, $from_s:expr) => {{
                let heads = |x: &[f64]| x.iter().map(|v| $to_s(*v)).collect::<Vec<$s>>();
                let fixed = |x: &[f64]| x.iter().map(|v| *v as $c).collect::<Vec<$c>>();
                let dout = side_by_side(n, dout, false);
                let (q, k, v, dout) = (heads(q), heads(k), heads(v), heads(&dout));
                let kb = fixed(key_bias);
                let table = match bias {
                    Bias::None => Vec::new(),
                    Bias::Offsets(x) | Bias::Sided(x) => fixed(x),
                };
                let f = Flash {
                    heads: n,
                    q: mem(&q),
                    k: mem(&k),
                    v: mem(&v),
                    scale,
                    key_bias: mem(&kb),
                    bias: match bias {
                        Bias::None => FlashBias::None,
                        Bias::Offsets(_) => FlashBias::Offsets {
                            values: mem(&table),
                        },
                        Bias::Sided(_) => FlashBias::Sided { sums: mem(&table) },
                    },
                    window,
                    dropout,
                };
                let size = n.one();
                let o = heads(&vec![0.0; size]);
                let lse = vec![0 as $c; 2 * n.b * n.h * n.t];
                Twin.flash(&f, mem(&o), mem(&lse)).unwrap();
                let (dq, dk, dv) = (
                    heads(&vec![0.0; size]),
                    heads(&vec![0.0; size]),
                    heads(&vec![0.0; size]),
                );
                let dbias = vec![0 as $c; bias.len(n)];
                let grads = FlashGrads {
                    dq: mem(&dq),
                    dk: mem(&dk),
                    dv: mem(&dv),
                    dbias: (!dbias.is_empty()).then(|| mem(&dbias)),
                };
                Twin.flash_back(&f, mem(&o), mem(&lse), mem(&dout), &grads)
                    .unwrap();
                let back = |x: &[$s]| x.iter().map(|v| $from_s(*v)).collect::<Vec<f64>>();
                let o = side_by_side(n, &back(&o), true);
                let dbias = dbias.iter().map(|v| *v as f64).collect();
                [o, back(&dq), back(&dk), back(&dv), dbias]
            }};
        }
        match dtype {
            DType::F64 => as_types!(f64, f64, |v: f64| v, |v: f64| v),
            DType::F32 => as_types!(f32, f32, |v: f64| v as f32, |v: f32| v as f64),
            DType::BF16 => as_types!(half::bf16, f32, half::bf16::from_f64, half::bf16::to_f64),
            _ => as_types!(half::f16, f32, half::f16::from_f64, half::f16::to_f64),
        }
    }

    /// The GPU's check of its kernels against the twin ([`against_twin`]) runs every case here,
    /// twin against twin, and finds them equal to the bit.
    #[test]
    fn the_check_against_the_twin_runs_and_finds_the_twin_equal_to_itself() {
        let worst = against_twin(&candle::Device::Cpu).unwrap();
        assert_eq!(worst.len(), 4, "{worst:?}");
        assert!(worst.iter().all(|(_, e)| *e == 0.0), "{worst:?}");
    }

    /// The forward allocates nothing of the scores' size: its peak is the inputs' and outputs',
    /// where the composition holds `b h t t` weights.
    #[test]
    fn the_fused_attention_makes_no_t_by_t_tensor() {
        let n = Heads {
            b: 1,
            h: 2,
            t: 512,
            dh: 16,
        };
        let s = Twin;
        let before = crate::gpu::live_bytes();
        crate::gpu::reset_peak_bytes();
        let heads: Vec<Buf> = (0..3)
            .map(|_| s.alloc(DType::F32, n.one()).unwrap())
            .collect();
        for (i, h) in heads.iter().enumerate() {
            s.fill(h.mem(), 0.01 * (i + 1) as f64).unwrap();
        }
        let key_bias = s.alloc(DType::F32, n.b * n.t).unwrap();
        s.fill(key_bias.mem(), 0.0).unwrap();
        let (out, lse) = (
            s.alloc(DType::F32, n.one()).unwrap(),
            s.alloc(DType::F32, 2 * n.b * n.h * n.t).unwrap(),
        );
        let f = Flash {
            heads: n,
            q: heads[0].mem(),
            k: heads[1].mem(),
            v: heads[2].mem(),
            scale: 0.25,
            key_bias: key_bias.mem(),
            bias: FlashBias::None,
            window: Window::ALL,
            dropout: None,
        };
        s.flash(&f, out.mem(), lse.mem()).unwrap();
        let peak = crate::gpu::peak_bytes() - before;
        let scores = n.scores() * 4;
        assert!(
            peak < scores / 4,
            "peak {peak} bytes against {scores} for the scores"
        );
        // Equal inputs: each output is the mean of v's rows.
        let o = super::super::host::load::<f32, f32>(out.mem(), 0..n.one());
        assert!(o.iter().all(|x| (x - 0.03).abs() < 1e-6), "{:?}", &o[..4]);
    }
}
