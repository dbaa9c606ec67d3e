//! The CPU twin of every device operation: what each CUDA kernel computes, in the same
//! precision (f64 for f64 storage, else f32, rounded to the storage dtype where the kernel
//! stores), by plain loops over rows; matrix products through gemm.
//!
//! Each operation reads its inputs a row at a time into values of the compute dtype and writes
//! its outputs after, through the addresses of its [`Mem`]s, so an output may be one of its
//! inputs where the operation allows it (as on the GPU, where a thread reads before it writes).

use candle::{CpuStorage, DType, Layout, Result};
use gemm::Parallelism;
use half::{bf16, f16};

use super::host::{holds, holds_c, load, load1, rows_par, store, Store};
use super::*;
use crate::Real;

/// Runs `$body` with `$s` the storage type of `$dtype` and `$c` its compute type.
macro_rules! typed {
    ($dtype:expr, |$s:ident, $c:ident| $body:expr) => {
        match $dtype {
            DType::F64 => {
                type $s = f64;
                type $c = f64;
                $body
            }
            DType::F32 => {
                type $s = f32;
                type $c = f32;
                $body
            }
            DType::BF16 => {
                type $s = bf16;
                type $c = f32;
                $body
            }
            DType::F16 => {
                type $s = f16;
                type $c = f32;
                $body
            }
            dt => candle::bail!("device path: no {dt:?} activations (f64, f32, bf16 or f16)"),
        }
    };
}

/// The CPU twin of a CUDA stream.
#[derive(Clone, Copy, Debug, Default)]
pub struct Twin;

impl Twin {
    /// The memory of a contiguous CPU storage at `layout`.
    pub fn mem(storage: &CpuStorage, layout: &Layout) -> Result<Mem> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle::bail!(
                "device path: an input of shape {:?} is not contiguous",
                layout.dims()
            )
        };
        let (addr, dtype) = match storage {
            CpuStorage::F64(v) => (v.as_ptr() as u64, DType::F64),
            CpuStorage::F32(v) => (v.as_ptr() as u64, DType::F32),
            CpuStorage::BF16(v) => (v.as_ptr() as u64, DType::BF16),
            CpuStorage::F16(v) => (v.as_ptr() as u64, DType::F16),
            CpuStorage::U32(v) => (v.as_ptr() as u64, DType::U32),
            other => candle::bail!(
                "device path: no {:?} inputs",
                candle::backend::BackendStorage::dtype(other)
            ),
        };
        Mem {
            addr,
            len: end,
            dtype,
        }
        .at(start, end - start)
    }
}

impl Twin {
    /// The memory of a contiguous layout over storage at `addr` of `len` values.
    pub fn mem_mut(addr: u64, len: usize, dtype: DType, layout: &Layout) -> Result<Mem> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle::bail!(
                "device path: a tensor of shape {:?} is not contiguous",
                layout.dims()
            )
        };
        Mem { addr, len, dtype }.at(start, end - start)
    }
}

impl Stream for Twin {
    fn alloc(&self, dtype: DType, len: usize) -> Result<Buf> {
        let (storage, addr) = typed!(dtype, |S, C| {
            let v = vec![<S as Store<C>>::nan(); len];
            let addr = v.as_ptr() as u64;
            (<S as candle::WithDType>::to_cpu_storage_owned(v), addr)
        });
        Ok(Buf::new(Mem { addr, len, dtype }, Owner::Cpu(storage)))
    }

    fn gemm(&self, g: &Gemm) -> Result<()> {
        g.check()?;
        count(Kind::Gemm);
        typed!(g.c.mem.dtype, |S, C| gemm_twin::<S, C>(g));
        Ok(())
    }

    fn fill(&self, out: Mem, value: f64) -> Result<()> {
        count(Kind::Kernel);
        typed!(out.dtype, |S, C| store::<S, C>(
            out,
            0,
            &vec![<C as Real>::lit(value); out.len]
        ));
        Ok(())
    }

    fn mul(&self, x: Mem, m: Mem, out: Mem) -> Result<()> {
        count(Kind::Kernel);
        typed!(x.dtype, |S, C| {
            let n = x.len;
            holds::<S, C>(m, n, "a mask")?;
            holds::<S, C>(out, n, "a product")?;
            let chunk = 1 << 14;
            rows_par(n.div_ceil(chunk), chunk, |c| {
                let r = c * chunk..((c + 1) * chunk).min(n);
                let (a, b) = (load::<S, C>(x, r.clone()), load::<S, C>(m, r.clone()));
                let v: Vec<C> = a.iter().zip(&b).map(|(a, b)| *a * *b).collect();
                store::<S, C>(out, r.start, &v);
            });
        });
        Ok(())
    }

    fn dropout_mask(&self, d: crate::spec::SeededDropout, out: Mem) -> Result<()> {
        count(Kind::Kernel);
        let scale = d.scale(out.dtype)?;
        typed!(out.dtype, |S, C| {
            let n = out.len;
            let chunk = 1 << 14;
            rows_par(n.div_ceil(chunk), chunk, |c| {
                let r = c * chunk..((c + 1) * chunk).min(n);
                let v: Vec<C> = r
                    .clone()
                    .map(|i| match d.keeps(i as u64) {
                        true => <C as Real>::lit(scale),
                        false => <C as Real>::lit(0.0),
                    })
                    .collect();
                store::<S, C>(out, r.start, &v);
            });
        });
        Ok(())
    }

    fn convert(&self, x: Mem, out: Mem) -> Result<()> {
        count(Kind::Copy);
        if out.len < x.len {
            candle::bail!("device path: {} values converted into {}", x.len, out.len)
        }
        let values: Vec<f64> = typed!(x.dtype, |S, C| load::<S, C>(x, 0..x.len)
            .into_iter()
            .map(|v| num_traits::ToPrimitive::to_f64(&v).unwrap_or(f64::NAN))
            .collect());
        typed!(out.dtype, |S, C| {
            let v: Vec<C> = values.iter().map(|v| <C as Real>::lit(*v)).collect();
            store::<S, C>(out, 0, &v)
        });
        Ok(())
    }

    fn layer_norm(&self, x: Mem, rows: usize, width: usize, norm: &Norm) -> Result<()> {
        count(Kind::Kernel);
        typed!(x.dtype, |S, C| {
            holds::<S, C>(x, rows * width, "a LayerNorm's input")?;
            norm_rows::<S, C>(x, rows, width, norm)
        })
    }

    fn residual(&self, r: &Residual) -> Result<()> {
        count(Kind::Kernel);
        typed!(r.sum.dtype, |S, C| residual_twin::<S, C>(r))
    }

    fn norm_back(&self, n: &NormBack) -> Result<()> {
        count(Kind::Kernel);
        typed!(n.g.dtype, |S, C| norm_back_twin::<S, C>(n))
    }

    fn bias_act(
        &self,
        u: Mem,
        bias: Mem,
        grad: Mem,
        rows: usize,
        width: usize,
        act: Act,
    ) -> Result<()> {
        count(Kind::Kernel);
        typed!(u.dtype, |S, C| {
            holds::<S, C>(u, rows * width, "the activation's input")?;
            holds::<S, C>(bias, width, "the activation's bias")?;
            holds::<S, C>(grad, rows * width, "the activation's derivative")?;
            let b = load::<S, C>(bias, 0..width);
            rows_par(rows, width, |r| {
                let v = load::<S, C>(u, r * width..(r + 1) * width);
                let (mut y, mut d) = (Vec::with_capacity(width), Vec::with_capacity(width));
                for (v, b) in v.iter().zip(&b) {
                    let x = *v + *b;
                    let (a, s) = activation(x, act);
                    y.push(a);
                    d.push(s);
                }
                store::<S, C>(u, r * width, &y);
                store::<S, C>(grad, r * width, &d);
            });
        });
        Ok(())
    }

    fn heads_in(
        &self,
        qkv: Mem,
        bias: Mem,
        rope: Option<&Rope>,
        heads: Heads,
        out: Mem,
    ) -> Result<()> {
        count(Kind::Kernel);
        typed!(qkv.dtype, |S, C| heads_twin::<S, C>(
            qkv,
            Some(bias),
            rope,
            heads,
            out,
            false
        ))
    }

    fn heads_back(&self, g: Mem, rope: Option<&Rope>, heads: Heads, out: Mem) -> Result<()> {
        count(Kind::Kernel);
        typed!(g.dtype, |S, C| heads_twin::<S, C>(
            g, None, rope, heads, out, true
        ))
    }

    fn transpose12(&self, x: Mem, [a, b, c, d]: [usize; 4], out: Mem) -> Result<()> {
        count(Kind::Copy);
        typed!(x.dtype, |S, C| {
            let n = a * b * c * d;
            holds::<S, C>(x, n, "a transpose's input")?;
            holds::<S, C>(out, n, "a transpose's output")?;
            rows_par(a * b * c, d, |row| {
                let (ai, rest) = (row / (b * c), row % (b * c));
                let (bi, ci) = (rest / c, rest % c);
                let v = load::<S, C>(x, row * d..(row + 1) * d);
                store::<S, C>(out, ((ai * c + ci) * b + bi) * d, &v);
            });
        });
        Ok(())
    }

    fn softmax(&self, s: &Softmax) -> Result<()> {
        count(Kind::Kernel);
        typed!(s.sp.dtype, |S, C| softmax_twin::<S, C>(s))
    }

    fn fuses_attention(&self) -> bool {
        true
    }

    fn flash(&self, f: &flash::Flash, out: Mem, lse: Mem) -> Result<()> {
        count(Kind::Kernel);
        typed!(f.q.dtype, |S, C| flash::flash_twin::<S, C>(f, out, lse))
    }

    fn flash_back(
        &self,
        f: &flash::Flash,
        out: Mem,
        lse: Mem,
        dout: Mem,
        g: &flash::FlashGrads,
    ) -> Result<()> {
        for _ in 0..flash::back_launches(f, g.dbias.is_some()) {
            count(Kind::Kernel);
        }
        typed!(f.q.dtype, |S, C| flash::flash_back_twin::<S, C>(
            f, out, lse, dout, g
        ))
    }

    fn softmax_back(
        &self,
        p: Mem,
        dp: Mem,
        mask: Option<Mem>,
        rows: usize,
        t: usize,
    ) -> Result<()> {
        count(Kind::Kernel);
        typed!(p.dtype, |S, C| {
            for (m, what) in [
                (Some(p), "weights"),
                (Some(dp), "their gradient"),
                (mask, "mask"),
            ] {
                if let Some(m) = m {
                    holds::<S, C>(m, rows * t, what)?;
                }
            }
            rows_par(rows, t, |r| {
                let range = r * t..(r + 1) * t;
                let pr = load::<S, C>(p, range.clone());
                let mut g = load::<S, C>(dp, range.clone());
                if let Some(m) = mask {
                    for (g, m) in g.iter_mut().zip(load::<S, C>(m, range.clone())) {
                        *g *= m;
                    }
                }
                let dot = g
                    .iter()
                    .zip(&pr)
                    .fold(<C as num_traits::Zero>::zero(), |s, (g, p)| s + *g * *p);
                let ds: Vec<C> = g.iter().zip(&pr).map(|(g, p)| *p * (*g - dot)).collect();
                store::<S, C>(dp, range.start, &ds);
            });
        });
        Ok(())
    }

    fn gates(&self, z: Mem, bias: Mem, n: Heads, sums: Mem) -> Result<()> {
        count(Kind::Kernel);
        typed!(z.dtype, |S, C| gates_twin::<S, C>(z, bias, n, Err(sums)))
    }

    fn gates_back(&self, z: Mem, bias: Mem, dsums: Mem, n: Heads, dz: Mem) -> Result<()> {
        count(Kind::Kernel);
        typed!(z.dtype, |S, C| gates_twin::<S, C>(
            z,
            bias,
            n,
            Ok((dsums, dz))
        ))
    }

    fn embedding_back(&self, ids: Mem, g: Mem, out: Mem, vocab: usize, d: usize) -> Result<()> {
        count(Kind::Kernel);
        let n = ids.len;
        ids.holds(n, DType::U32, "the token ids")?;
        typed!(g.dtype, |S, C| {
            holds::<S, C>(g, n * d, "the lookup's gradient")?;
            holds::<S, C>(out, vocab * d, "the embedding's gradient")?;
            // SAFETY: `ids` spans n live u32 values (checked above).
            let ids = unsafe { std::slice::from_raw_parts(ids.addr as *const u32, n) };
            let mut acc = vec![<C as num_traits::Zero>::zero(); vocab * d];
            for (i, &id) in ids.iter().enumerate() {
                let id = id as usize;
                if id < vocab {
                    let row = load::<S, C>(g, i * d..(i + 1) * d);
                    for (a, v) in acc[id * d..(id + 1) * d].iter_mut().zip(row) {
                        *a += v;
                    }
                }
            }
            store::<S, C>(out, 0, &acc);
        });
        Ok(())
    }

    fn pool_mean(
        &self,
        x: Mem,
        mask: Mem,
        (b, t, d): (usize, usize, usize),
        out: Mem,
        back: bool,
    ) -> Result<()> {
        count(Kind::Kernel);
        mask.holds(b * t, DType::U32, "the attention mask")?;
        // SAFETY: `mask` spans b t live u32 values (checked above).
        let mask = unsafe { std::slice::from_raw_parts(mask.addr as *const u32, b * t) };
        typed!(x.dtype, |S, C| {
            let (x_len, out_len) = if back {
                (b * d, b * t * d)
            } else {
                (b * t * d, b * d)
            };
            holds::<S, C>(x, x_len, "the pooling's input")?;
            holds::<S, C>(out, out_len, "the pooling's output")?;
            let zero = <C as num_traits::Zero>::zero();
            for (s, m) in mask.chunks(t.max(1)).enumerate().take(b) {
                let count = m.iter().fold(zero, |c, &v| c + C::lit(v as f64));
                if back {
                    let g = load::<S, C>(x, s * d..(s + 1) * d);
                    for (j, &v) in m.iter().enumerate() {
                        let row: Vec<C> = g.iter().map(|&g| g / count * C::lit(v as f64)).collect();
                        store::<S, C>(out, (s * t + j) * d, &row);
                    }
                } else {
                    let mut acc = vec![zero; d];
                    for (j, &v) in m.iter().enumerate() {
                        let row = load::<S, C>(x, (s * t + j) * d..(s * t + j + 1) * d);
                        for (a, r) in acc.iter_mut().zip(row) {
                            *a += r * C::lit(v as f64);
                        }
                    }
                    let mean: Vec<C> = acc.iter().map(|&a| a / count).collect();
                    store::<S, C>(out, s * d, &mean);
                }
            }
        });
        Ok(())
    }

    fn xent(&self, x: &Xent, bias: Mem, nll: Mem) -> Result<()> {
        count(Kind::Kernel);
        x.check(x.logits.dtype)?;
        typed!(x.logits.dtype, |S, C| {
            holds::<S, C>(bias, x.classes, "the head's bias")?;
            holds::<S, C>(nll, x.rows, "the rows' losses")?;
            let c = x.classes;
            let b = load::<S, C>(bias, 0..c);
            let targets = targets(x);
            for (r, &target) in targets.iter().enumerate() {
                let v: Vec<C> = load::<S, C>(x.logits, r * c..(r + 1) * c)
                    .iter()
                    .zip(&b)
                    .map(|(v, b)| *v + *b)
                    .collect();
                store::<S, C>(x.logits, r * c, &v);
                // The stored (rounded) values, as the kernel reads them back.
                let v = load::<S, C>(x.logits, r * c..(r + 1) * c);
                let m = v
                    .iter()
                    .fold(<C as num_traits::Float>::neg_infinity(), |m, &v| m.max(v));
                let sum = v
                    .iter()
                    .fold(<C as num_traits::Zero>::zero(), |s, &v| s + (v - m).exp_());
                let lse = m + sum.ln();
                store::<C, C>(x.lse, r, &[lse]);
                let loss = match v.get(target as usize) {
                    Some(&t) => lse - t,
                    None => <C as num_traits::Float>::nan(),
                };
                store::<S, C>(nll, r, &[loss]);
            }
        });
        Ok(())
    }

    fn weighted_sum(&self, x: Mem, w: Option<Mem>, scale: f64, out: Mem) -> Result<()> {
        count(Kind::Kernel);
        let n = x.len;
        if let Some(w) = w {
            w.holds(n, DType::F32, "the weights of a sum")?;
        }
        let w = w.map(|w| load::<f32, f32>(w, 0..n));
        typed!(x.dtype, |S, C| {
            holds::<S, C>(out, 1, "a sum")?;
            let v = load::<S, C>(x, 0..n);
            let sum = v
                .iter()
                .enumerate()
                .fold(<C as num_traits::Zero>::zero(), |s, (i, &v)| {
                    s + match &w {
                        Some(w) => v * C::lit(w[i] as f64),
                        None => v,
                    }
                });
            store::<S, C>(out, 0, &[sum * C::lit(scale)]);
        });
        Ok(())
    }

    fn xent_back(&self, x: &Xent, g: Mem, scale: f64) -> Result<()> {
        count(Kind::Kernel);
        x.check(x.logits.dtype)?;
        let w = x.weights.map(|w| load::<f32, f32>(w, 0..x.rows));
        typed!(x.logits.dtype, |S, C| {
            holds::<S, C>(g, 1, "the loss's gradient")?;
            let c = x.classes;
            let k = load1::<S, C>(g, 0) * C::lit(scale);
            let lse = load::<C, C>(x.lse, 0..x.rows);
            for (r, &target) in targets(x).iter().enumerate() {
                let f = match &w {
                    Some(w) => k * C::lit(w[r] as f64),
                    None => k,
                };
                let d: Vec<C> = load::<S, C>(x.logits, r * c..(r + 1) * c)
                    .iter()
                    .enumerate()
                    .map(|(j, &v)| {
                        let p = (v - lse[r]).exp_();
                        f * if j == target as usize {
                            p - C::lit(1.0)
                        } else {
                            p
                        }
                    })
                    .collect();
                store::<S, C>(x.logits, r * c, &d);
            }
        });
        Ok(())
    }

    fn sum_squares(&self, parts: &[Mem], with: Option<Mem>) -> Result<Squares> {
        count(Kind::Copy);
        count(Kind::Kernel);
        let with = match with {
            Some(w) => {
                if w.len != 1 {
                    candle::bail!("device path: {} values read with the squares, not 1", w.len)
                }
                let mut v = [0.0f64];
                let slot = Mem {
                    addr: v.as_mut_ptr() as u64,
                    len: 1,
                    dtype: DType::F64,
                };
                self.convert(w, slot)?;
                Some(v[0])
            }
            None => None,
        };
        count(Kind::Copy);
        Ok(Squares {
            sums: sum_squares_twin(parts)?,
            with,
        })
    }

    fn adamw(&self, parts: &[AdamWPart], step: &AdamWStep) -> Result<()> {
        count(Kind::Copy);
        count(Kind::Kernel);
        for p in parts {
            match p.w.dtype {
                DType::F64 => adamw_part::<f64>(p, step)?,
                DType::F32 => adamw_part::<f32>(p, step)?,
                dt => candle::bail!("device path: AdamW updates f32 or f64 weights, not {dt:?}"),
            }
        }
        Ok(())
    }

    fn sided_back(&self, ds: Mem, n: Heads, out: Mem) -> Result<()> {
        count(Kind::Kernel);
        typed!(ds.dtype, |S, C| {
            let t = n.t;
            holds::<S, C>(ds, n.scores(), "the scores' gradient")?;
            holds::<S, C>(out, 2 * n.b * n.h * t, "the running sums' gradient")?;
            let half = n.b * n.h * t;
            let zero = <C as num_traits::Zero>::zero();
            rows_par(n.b * n.h, t * t, |bh| {
                let block = load::<S, C>(ds, bh * t * t..(bh + 1) * t * t);
                let at = |i: usize, j: usize| block[i * t + j];
                let (mut df, mut dg) = (vec![zero; t], vec![zero; t]);
                for i in 0..t {
                    let row_le = (0..=i).fold(zero, |s, j| s + at(i, j));
                    let row_gt = (i + 1..t).fold(zero, |s, j| s + at(i, j));
                    let col_ge = (i..t).fold(zero, |s, r| s + at(r, i));
                    let col_lt = (0..i).fold(zero, |s, r| s + at(r, i));
                    df[i] = row_le - col_ge;
                    dg[i] = col_lt - row_gt;
                }
                store::<S, C>(out, bh * t, &df);
                store::<S, C>(out, half + bh * t, &dg);
            });
        });
        Ok(())
    }
}

/// `(act(x), act'(x))`.
fn activation<C: Real>(x: C, act: Act) -> (C, C) {
    match act {
        Act::Gelu => {
            let (cdf, pdf) = x.normal_cdf_pdf();
            (x * cdf, cdf + x * pdf)
        }
        Act::Relu if x > C::zero() => (x, C::one()),
        Act::Relu => (C::zero(), C::zero()),
    }
}

fn gemm_twin<S: Store<C>, C: Real + Store<C>>(g: &Gemm) {
    let same = std::any::TypeId::of::<S>() == std::any::TypeId::of::<C>();
    let strides = |x: &Mat| -> (isize, isize) {
        if x.trans {
            (1, x.ld as isize)
        } else {
            (x.ld as isize, 1)
        }
    };
    let (ars, acs) = strides(&g.a);
    let (brs, bcs) = strides(&g.b);
    let crs = g.c.ld as isize;
    let par = if g.m * g.n * g.k >= 1 << 18 {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    let run =
        |a: *const C, b: *const C, c: *mut C, i: usize, (sa, sb, sc): (usize, usize, usize)| {
            // SAFETY: `Gemm::check` bounded every operand's span; the pointers are the operands'
            // (or copies of them), offset to batch entry `i`.
            unsafe {
                gemm::gemm(
                    g.m,
                    g.n,
                    g.k,
                    c.add(i * sc),
                    1,
                    crs,
                    g.beta != 0.0,
                    a.add(i * sa),
                    acs,
                    ars,
                    b.add(i * sb),
                    bcs,
                    brs,
                    C::one(),
                    C::lit(g.alpha),
                    false,
                    false,
                    false,
                    par,
                )
            }
        };
    let strides = (g.a.stride, g.b.stride, g.c.stride);
    if same {
        for i in 0..g.batch {
            run(
                g.a.mem.addr as *const C,
                g.b.mem.addr as *const C,
                g.c.mem.addr as *mut C,
                i,
                strides,
            );
        }
    } else {
        // Half storage: the operands in f32, the product summed in f32, rounded once.
        let a = load::<S, C>(g.a.mem, 0..g.a.mem.len);
        let b = load::<S, C>(g.b.mem, 0..g.b.mem.len);
        let mut c = load::<S, C>(g.c.mem, 0..g.c.mem.len);
        for i in 0..g.batch {
            run(a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), i, strides);
        }
        // Only the values the product wrote are stored back: rows of `n` in rows of `ld`.
        for i in 0..g.batch {
            for r in 0..g.m {
                let at = i * g.c.stride + r * g.c.ld;
                store::<S, C>(g.c.mem, at, &c[at..at + g.n]);
            }
        }
    }
}

/// `[mean, rstd]` of a row, and the row normalised and scaled.
fn normalise<C: Real + Store<C>>(x: &[C], w: &[C], b: &[C], eps: f64) -> (C, C, Vec<C>) {
    let width = C::lit(x.len() as f64);
    let mean = x.iter().fold(C::zero(), |s, v| s + *v) / width;
    let var = x
        .iter()
        .fold(C::zero(), |s, v| s + (*v - mean) * (*v - mean))
        / width;
    let rstd = C::one() / (var + C::lit(eps)).sqrt();
    let y = x
        .iter()
        .zip(w)
        .zip(b)
        .map(|((v, w), b)| (*v - mean) * rstd * *w + *b)
        .collect();
    (mean, rstd, y)
}

fn norm_rows<S: Store<C>, C: Real + Store<C>>(
    x: Mem,
    rows: usize,
    width: usize,
    n: &Norm,
) -> Result<()> {
    holds::<S, C>(n.w, width, "a LayerNorm's weight")?;
    holds::<S, C>(n.b, width, "a LayerNorm's bias")?;
    holds::<S, C>(n.out, rows * width, "a LayerNorm's output")?;
    holds_c::<C>(n.stats, 2 * rows, "a LayerNorm's statistics")?;
    let (w, b) = (load::<S, C>(n.w, 0..width), load::<S, C>(n.b, 0..width));
    rows_par(rows, width, |r| {
        let v = load::<S, C>(x, r * width..(r + 1) * width);
        let (mean, rstd, y) = normalise::<C>(&v, &w, &b, n.eps);
        store::<S, C>(n.out, r * width, &y);
        store::<C, C>(n.stats, 2 * r, &[mean, rstd]);
    });
    Ok(())
}

fn residual_twin<S: Store<C>, C: Real + Store<C>>(r: &Residual) -> Result<()> {
    let (rows, width) = (r.rows, r.width);
    let n = rows * width;
    holds::<S, C>(r.res, n, "a residual")?;
    holds::<S, C>(r.z, n, "a branch")?;
    holds::<S, C>(r.bias, width, "a branch's bias")?;
    holds::<S, C>(r.sum, n, "a residual sum")?;
    if let Some(m) = r.mask {
        holds::<S, C>(m, n, "a dropout mask")?;
    }
    let bias = load::<S, C>(r.bias, 0..width);
    let norm = match &r.norm {
        Some(nm) => {
            holds::<S, C>(nm.w, width, "a LayerNorm's weight")?;
            holds::<S, C>(nm.b, width, "a LayerNorm's bias")?;
            holds::<S, C>(nm.out, n, "a LayerNorm's output")?;
            holds_c::<C>(nm.stats, 2 * rows, "a LayerNorm's statistics")?;
            Some((
                load::<S, C>(nm.w, 0..width),
                load::<S, C>(nm.b, 0..width),
                nm,
            ))
        }
        None => None,
    };
    rows_par(rows, width, |row| {
        let range = row * width..(row + 1) * width;
        let res = load::<S, C>(r.res, range.clone());
        let z = load::<S, C>(r.z, range.clone());
        let mut branch: Vec<C> = z.iter().zip(&bias).map(|(z, b)| *z + *b).collect();
        if let Some(m) = r.mask {
            for (v, m) in branch.iter_mut().zip(load::<S, C>(m, range.clone())) {
                *v *= m;
            }
        }
        // rounded to the storage dtype as stored, so that the LayerNorm reads what is kept
        let sum: Vec<C> = res
            .iter()
            .zip(&branch)
            .map(|(a, b)| S::put(*a + *b).get())
            .collect();
        store::<S, C>(r.sum, range.start, &sum);
        if let Some((w, b, nm)) = &norm {
            let (mean, rstd, y) = normalise::<C>(&sum, w, b, nm.eps);
            store::<S, C>(nm.out, range.start, &y);
            store::<C, C>(nm.stats, 2 * row, &[mean, rstd]);
        }
    });
    Ok(())
}

fn norm_back_twin<S: Store<C>, C: Real + Store<C>>(nb: &NormBack) -> Result<()> {
    let (rows, width) = (nb.rows, nb.width);
    let n = rows * width;
    holds::<S, C>(nb.x, n, "a LayerNorm's input")?;
    holds_c::<C>(nb.stats, 2 * rows, "a LayerNorm's statistics")?;
    holds::<S, C>(nb.w, width, "a LayerNorm's weight")?;
    holds::<S, C>(nb.g, n, "a LayerNorm's output gradient")?;
    holds::<S, C>(nb.out, n, "a LayerNorm's input gradient")?;
    holds::<S, C>(nb.params, 2 * n, "a LayerNorm's parameter rows")?;
    if let Some(add) = nb.add {
        holds::<S, C>(add, n, "a residual gradient")?;
    }
    if let Some((m, out)) = nb.mask {
        holds::<S, C>(m, n, "a dropout mask")?;
        holds::<S, C>(out, n, "a masked gradient")?;
    }
    let w = load::<S, C>(nb.w, 0..width);
    let wf = C::lit(width as f64);
    rows_par(rows, width, |r| {
        let range = r * width..(r + 1) * width;
        let x = load::<S, C>(nb.x, range.clone());
        let g = load::<S, C>(nb.g, range.clone());
        let (mean, rstd) = (
            load1::<C, C>(nb.stats, 2 * r),
            load1::<C, C>(nb.stats, 2 * r + 1),
        );
        let xhat: Vec<C> = x.iter().map(|v| (*v - mean) * rstd).collect();
        let (mut m1, mut m2) = (C::zero(), C::zero());
        for ((g, w), xh) in g.iter().zip(&w).zip(&xhat) {
            let gw = *g * *w;
            m1 += gw;
            m2 += gw * *xh;
        }
        let (m1, m2) = (m1 / wf, m2 / wf);
        let add = nb.add.map(|a| load::<S, C>(a, range.clone()));
        let dx: Vec<C> = (0..width)
            .map(|j| {
                let d = rstd * (g[j] * w[j] - m1 - xhat[j] * m2);
                match &add {
                    Some(a) => a[j] + d,
                    None => d,
                }
            })
            .collect();
        let mut params: Vec<C> = g.iter().zip(&xhat).map(|(g, x)| *g * *x).collect();
        params.extend_from_slice(&g);
        store::<S, C>(nb.params, 2 * r * width, &params);
        if let Some((m, out)) = nb.mask {
            let masked: Vec<C> = dx
                .iter()
                .zip(load::<S, C>(m, range.clone()))
                .map(|(d, m)| *d * m)
                .collect();
            store::<S, C>(out, range.start, &masked);
        }
        store::<S, C>(nb.out, range.start, &dx);
    });
    Ok(())
}

/// `heads_in` (forward) or `heads_back` (`back`): between `(n, 3d)` rows and heads
/// `(3, b, h, t, dh)`, q and k rotated (forward) or rotated back.
fn heads_twin<S: Store<C>, C: Real + Store<C>>(
    src: Mem,
    bias: Option<Mem>,
    rope: Option<&Rope>,
    n: Heads,
    out: Mem,
    back: bool,
) -> Result<()> {
    let (d, dh) = (n.d(), n.dh);
    holds::<S, C>(src, 3 * n.one(), "the projections")?;
    holds::<S, C>(out, 3 * n.one(), "the heads")?;
    let bias = match bias {
        Some(b) => {
            holds::<S, C>(b, 3 * d, "the projections' bias")?;
            load::<S, C>(b, 0..3 * d)
        }
        None => vec![C::zero(); 3 * d],
    };
    if let Some(r) = rope {
        holds_c::<C>(r.cos, r.rows * n.t * r.width, "RoPE's cos table")?;
        holds_c::<C>(r.sin, r.rows * n.t * r.width, "RoPE's sin table")?;
        if r.width > dh || r.width % 2 == 1 || !(r.rows == 1 || r.rows == n.b) {
            candle::bail!(
                "device path: RoPE's tables ({}, t, {}) for heads {dh} wide",
                r.rows,
                r.width
            )
        }
    }
    let sign = if back { -C::one() } else { C::one() };
    // One task per (which, batch, head, token): a head row of dh values.
    let tasks = 3 * n.b * n.h * n.t;
    rows_par(tasks, dh, |task| {
        let (which, rest) = (task / (n.b * n.h * n.t), task % (n.b * n.h * n.t));
        let (bi, rest) = (rest / (n.h * n.t), rest % (n.h * n.t));
        let (hd, ti) = (rest / n.t, rest % n.t);
        let token = (bi * n.t + ti) * 3 * d + which * d + hd * dh;
        let head = task * dh;
        // forward reads a projection row and writes a head row; back the other way round
        let (from, to) = if back { (head, token) } else { (token, head) };
        let mut x = load::<S, C>(src, from..from + dh);
        if !back {
            for (j, v) in x.iter_mut().enumerate() {
                *v = S::put(*v + bias[which * d + hd * dh + j]).get();
            }
        }
        let y = match rope.filter(|_| which < 2) {
            Some(r) => {
                let row = if r.rows == 1 { ti } else { bi * n.t + ti };
                let c = load::<C, C>(r.cos, row * r.width..(row + 1) * r.width);
                let s = load::<C, C>(r.sin, row * r.width..(row + 1) * r.width);
                rotate(&x, &c, &s, r.interleaved, sign)
            }
            None => x,
        };
        store::<S, C>(out, to, &y);
    });
    Ok(())
}

/// RoPE's rotation of one head row (see [`crate::cpu::Rotation`]): `sign` -1 rotates back.
fn rotate<C: Real>(x: &[C], c: &[C], s: &[C], interleaved: bool, sign: C) -> Vec<C> {
    let w = c.len();
    let half = w / 2;
    let mut out = x.to_vec();
    for i in 0..half {
        let (ia, ib, it) = if interleaved {
            (2 * i, 2 * i + 1, 2 * i)
        } else {
            (i, half + i, i)
        };
        let (a, b) = (x[ia], x[ib]);
        let (ci, si) = (c[it], sign * s[it]);
        out[ia] = a * ci - b * si;
        out[ib] = b * ci + a * si;
    }
    out
}

fn softmax_twin<S: Store<C>, C: Real + Store<C>>(s: &Softmax) -> Result<()> {
    let n = s.heads;
    let t = n.t;
    holds::<S, C>(s.sp, n.scores(), "the scores")?;
    holds_c::<C>(s.key_bias, n.b * t, "the key bias")?;
    match s.bias {
        ScoreBias::None => {}
        ScoreBias::Table { bias, rows } => {
            holds_c::<C>(bias, rows * n.h * t * t, "the score bias")?;
            if !(rows == 1 || rows == n.b) {
                candle::bail!(
                    "device path: a score bias of {rows} rows for a batch of {}",
                    n.b
                )
            }
        }
        ScoreBias::Sided { sums } => holds_c::<C>(sums, 2 * n.b * n.h * t, "the running sums")?,
        ScoreBias::Offsets { .. } => candle::bail!("{OFFSETS_UNFUSED}"),
    }
    if let Some((m, pm)) = s.dropout {
        holds::<S, C>(m, n.scores(), "the attention dropout mask")?;
        holds::<S, C>(pm, n.scores(), "the dropped weights")?;
    }
    let masked = C::lit(crate::spec::MASKED_SCORE);
    let half = n.b * n.h * t;
    rows_par(n.b * n.h * t, t, |row| {
        let (bh, i) = (row / t, row % t);
        let (bi, hd) = (bh / n.h, bh % n.h);
        let range = row * t..(row + 1) * t;
        let mut v = load::<S, C>(s.sp, range.clone());
        match s.bias {
            ScoreBias::None => {}
            ScoreBias::Table { bias, rows } => {
                let block = if rows == 1 { 0 } else { bi };
                let at = ((block * n.h + hd) * t + i) * t;
                for (x, b) in v.iter_mut().zip(load::<C, C>(bias, at..at + t)) {
                    *x += b;
                }
            }
            ScoreBias::Sided { sums } => {
                let at = bh * t;
                let f = load::<C, C>(sums, at..at + t);
                let g = load::<C, C>(sums, half + at..half + at + t);
                for (j, x) in v.iter_mut().enumerate() {
                    *x += if j <= i { f[i] - f[j] } else { g[j] - g[i] };
                }
            }
            ScoreBias::Offsets { .. } => unreachable!("refused above"),
        }
        if s.window.masks_any(t) {
            for (j, x) in v.iter_mut().enumerate() {
                if s.window.hides(i, j) {
                    *x += masked;
                }
            }
        }
        let kb = load::<C, C>(s.key_bias, bi * t..(bi + 1) * t);
        for (x, k) in v.iter_mut().zip(&kb) {
            *x += *k;
        }
        let max = v
            .iter()
            .fold(<C as num_traits::Float>::neg_infinity(), |m, x| {
                num_traits::Float::max(m, *x)
            });
        let mut sum = C::zero();
        for x in v.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        let p: Vec<C> = v.iter().map(|x| S::put(*x / sum).get()).collect();
        store::<S, C>(s.sp, range.start, &p);
        if let Some((m, pm)) = s.dropout {
            let dropped: Vec<C> = p
                .iter()
                .zip(load::<S, C>(m, range.clone()))
                .map(|(p, m)| *p * m)
                .collect();
            store::<S, C>(pm, range.start, &dropped);
        }
    });
    Ok(())
}

/// The sums of squares of `parts`, by chunks as the kernel's blocks take them (each chunk's in
/// order here, in the kernel's fixed order of threads there).
/// The targets of a cross-entropy's rows (checked to span them by [`Xent::check`]).
fn targets(x: &Xent) -> Vec<u32> {
    // SAFETY: `targets` spans `rows` live u32 values (checked by the caller).
    unsafe { std::slice::from_raw_parts(x.targets.addr as *const u32, x.rows) }.to_vec()
}

fn sum_squares_twin(parts: &[Mem]) -> Result<Vec<f64>> {
    parts
        .iter()
        .map(|&p| {
            typed!(p.dtype, |S, C| {
                let mut total = 0.0f64;
                for start in (0..p.len).step_by(ADAMW_CHUNK) {
                    let r = start..(start + ADAMW_CHUNK).min(p.len);
                    total += load::<S, C>(p, r)
                        .into_iter()
                        .map(|v| {
                            let v = candle::WithDType::to_f64(v);
                            v * v
                        })
                        .sum::<f64>();
                }
                Ok(total)
            })
        })
        .collect()
}

/// `w` clamped to `[lower, f64::MAX]` as candle's `clamp` does it (its `maximum`, then its
/// `minimum`), in the weights' dtype: what [`AdamWPart::lower`] applies.
fn clamp_below<C: Real>(w: C, lower: C) -> C {
    let high = C::lit(f64::MAX);
    let w = if w < lower { lower } else { w };
    if w > high {
        high
    } else {
        w
    }
}

/// One variable's AdamW update, in chunks as the kernel's blocks take them.
fn adamw_part<C: Real + Store<C>>(p: &AdamWPart, c: &AdamWStep) -> Result<()> {
    let n = p.w.len;
    holds::<C, C>(p.g, n, "a gradient")?;
    holds::<C, C>(p.mv, 2 * n, "AdamW's moments")?;
    let lit = C::lit;
    let (b1, b2, s) = (lit(c.beta1), lit(c.beta2), lit(c.grad_scale));
    let (c1, c2) = (lit(1.0 - c.beta1), lit(1.0 - c.beta2));
    let (lr, keep, eps) = (lit(c.lr), lit(p.decay_factor), lit(c.eps));
    let (bias1, bias2) = (lit(c.bias1), lit(c.bias2));
    let (scaled, decays) = (c.grad_scale != 1.0, p.decay_factor != 1.0);
    let lower = p.lower.map(lit);
    rows_par(n.div_ceil(ADAMW_CHUNK), ADAMW_CHUNK, |chunk| {
        let r = chunk * ADAMW_CHUNK..((chunk + 1) * ADAMW_CHUNK).min(n);
        let g = load::<C, C>(p.g, r.clone());
        let mut m = load::<C, C>(p.mv, r.clone());
        let mut v = load::<C, C>(p.mv, n + r.start..n + r.end);
        let mut w = load::<C, C>(p.w, r.clone());
        for i in 0..r.len() {
            let g = if scaled { g[i] * s } else { g[i] };
            m[i] = m[i] * b1 + g * c1;
            v[i] = v[i] * b2 + g * g * c2;
            let update = (m[i] / bias1) / ((v[i] / bias2).sqrt() + eps);
            let kept = if decays { w[i] * keep } else { w[i] };
            w[i] = kept - update * lr;
            if let Some(lower) = lower {
                w[i] = clamp_below(w[i], lower);
            }
        }
        store::<C, C>(p.mv, r.start, &m);
        store::<C, C>(p.mv, n + r.start, &v);
        store::<C, C>(p.w, r.start, &w);
    });
    Ok(())
}

/// `log σ(x)` and `σ(-x)`, as the fused CPU kernel computes them.
fn log_sigmoid<C: Real>(x: C) -> (C, C) {
    let u = (-x.abs()).exp_();
    let neg = -x;
    let relu = if neg > C::zero() { neg } else { C::zero() };
    let inv = (C::one() + u).recip();
    (
        -(relu + u.ln_1p_()),
        if x >= C::zero() { u * inv } else { inv },
    )
}

/// The gates forward (`Err(sums)`: running sums of `log σ(z + bias)` into `sums`) or backward
/// (`Ok((dsums, dz))`): one task per (batch element, channel), along the tokens.
fn gates_twin<S: Store<C>, C: Real + Store<C>>(
    z: Mem,
    bias: Mem,
    n: Heads,
    dir: std::result::Result<(Mem, Mem), Mem>,
) -> Result<()> {
    let (b, t, h) = (n.b, n.t, n.h);
    let width = 2 * h;
    holds::<S, C>(z, b * t * width, "the gates' inputs")?;
    holds::<S, C>(bias, width, "the gates' bias")?;
    match dir {
        Err(sums) => holds_c::<C>(sums, 2 * b * h * t, "the gates' running sums")?,
        Ok((dsums, dz)) => {
            holds::<S, C>(dsums, 2 * b * h * t, "the running sums' gradient")?;
            holds::<S, C>(dz, b * t * width, "the gates' gradient")?;
        }
    }
    let bias = load::<S, C>(bias, 0..width);
    rows_par(b * width, t, |task| {
        let (bi, ch) = (task / width, task % width);
        let (s, c) = (ch / h, ch % h);
        let at = ((s * b + bi) * h + c) * t; // (2, b, h, t)
        let x: Vec<C> = (0..t)
            .map(|j| load1::<S, C>(z, (bi * t + j) * width + ch) + bias[ch])
            .collect();
        match dir {
            Err(sums) => {
                let mut acc = C::zero();
                let out: Vec<C> = x
                    .iter()
                    .map(|x| {
                        acc += log_sigmoid(*x).0;
                        acc
                    })
                    .collect();
                store::<C, C>(sums, at, &out);
            }
            Ok((dsums, dz)) => {
                let g = load::<S, C>(dsums, at..at + t);
                let mut acc = C::zero();
                for j in (0..t).rev() {
                    acc += g[j];
                    store::<S, C>(dz, (bi * t + j) * width + ch, &[acc * log_sigmoid(x[j]).1]);
                }
            }
        }
    });
    Ok(())
}
