//! The fused attention's launches on CUDA (`flash.cu`, compiled after `kernels.cu` as a program
//! of its own, so that a compile error there leaves the other kernels working).
//!
//! The forward is one launch; the backward is `D = dO·o`, then the key blocks (`dk`, `dv`, the
//! running sums' column parts), then the query blocks (`dq`, the running sums' gradient), and,
//! for a bias by offset owed a gradient, one block an (offset, head) that sums it
//! ([`super::back_launches`]). A CUDA stream does not yet answer [`Stream::fuses_attention`]
//! with true: these kernels are held to the twin on a GPU first (`tests/suite/cuda.rs`,
//! through [`super::against_twin`]).

use candle::Result;

use super::super::cuda::{grid_of, int, ptr, reach, rows_of, Arg, CudaStream, Program, BLOCK};
use super::super::{compute_dtype, count, Kind, Mem, Stream};
use super::{Flash, FlashBias, FlashGrads, FDH, FQ};

/// The kernels `flash.cu` exports for every storage dtype.
pub const KERNELS: [&str; 5] = [
    "flash_fwd",
    "flash_dd",
    "flash_cols",
    "flash_rows",
    "flash_offsets_back",
];

/// `kernels.cu` (its types and helpers), then `flash.cu`.
pub(in crate::gpu) static PROGRAM: Program = Program::new(
    "poslab_flash",
    &[
        ("kernels.cu", super::super::cuda::SOURCE),
        ("flash/flash.cu", include_str!("flash.cu")),
    ],
);

/// The arguments every kernel but `flash_dd` begins with (`FLASH_PARAMS` in `flash.cu`), of a
/// checked `f`.
fn common(f: &Flash) -> Result<Vec<Arg>> {
    let n = f.heads;
    let dt = f.q.dtype;
    if n.dh > FDH {
        candle::bail!(
            "device path: the fused attention takes heads up to {FDH} wide, not {}",
            n.dh
        );
    }
    let (kind, bias) = match f.bias {
        FlashBias::None => (0, None),
        FlashBias::Offsets { values } => (1, Some(values)),
        FlashBias::Sided { sums } => (2, Some(sums)),
    };
    let (dropout, seed, threshold, keep) = match f.dropout {
        None => (0, 0, 0, 1.0),
        Some(d) => (1, d.seed, d.threshold(), d.scale(dt)?),
    };
    Ok(vec![
        Arg::Ptr(f.q.addr),
        Arg::Ptr(f.k.addr),
        Arg::Ptr(f.v.addr),
        Arg::F64(f.scale),
        Arg::Ptr(f.key_bias.addr),
        Arg::I32(kind),
        Arg::Ptr(ptr(bias)),
        Arg::I32(reach(f.window.before, n.t)?),
        Arg::I32(reach(f.window.after, n.t)?),
        Arg::I32(dropout),
        Arg::I64(seed),
        Arg::I64(threshold),
        Arg::F64(keep),
        Arg::I32(int(n.b, "a batch")?),
        Arg::I32(int(n.h, "heads")?),
        Arg::I32(int(n.t, "tokens")?),
        Arg::I32(int(n.dh, "a head's width")?),
    ])
}

/// The grid of a kernel with a block per [`FQ`] rows of each (batch, head): `(b h, blocks)`
/// (a grid's second dimension holds at most 65,535).
fn by_rows(f: &Flash) -> Result<(u32, u32)> {
    let n = f.heads;
    let blocks = n.t.div_ceil(FQ);
    if blocks > 65_535 {
        candle::bail!(
            "device path: the fused attention takes at most {} tokens",
            65_535 * FQ
        );
    }
    Ok((rows_of(n.b * n.h)?, blocks as u32))
}

/// [`Stream::flash`] on CUDA.
pub(in crate::gpu) fn forward(s: &CudaStream, f: &Flash, out: Mem, lse: Mem) -> Result<()> {
    f.check_forward(out, lse)?;
    let dt = f.q.dtype;
    let mut args = common(f)?;
    args.extend([Arg::Ptr(out.addr), Arg::Ptr(lse.addr)]);
    count(Kind::Kernel);
    s.launch_in(&PROGRAM, "flash_fwd", dt, (by_rows(f)?, FQ as u32), &args)
}

/// [`Stream::flash_back`] on CUDA.
pub(in crate::gpu) fn backward(
    s: &CudaStream,
    f: &Flash,
    out: Mem,
    lse: Mem,
    dout: Mem,
    g: &FlashGrads,
) -> Result<()> {
    let n = f.heads;
    let (dt, cd) = (f.q.dtype, compute_dtype(f.q.dtype));
    let rows = n.b * n.h * n.t;
    f.check_backward(out, lse, dout, g)?;
    let common = common(f)?;
    // D = dO·o of every row.
    let dd = s.alloc(cd, rows)?;
    count(Kind::Kernel);
    s.launch_in(
        &PROGRAM,
        "flash_dd",
        dt,
        ((grid_of(rows), 1), BLOCK),
        &[
            Arg::Ptr(out.addr),
            Arg::Ptr(dout.addr),
            Arg::Ptr(dd.mem().addr),
            Arg::I32(int(n.b, "a batch")?),
            Arg::I32(int(n.h, "heads")?),
            Arg::I32(int(n.t, "tokens")?),
            Arg::I32(int(n.dh, "a head's width")?),
        ],
    )?;
    // The running sums' gradient: the columns' parts, then the rows' added to them.
    let (cols, dsums) = match (f.bias, g.dbias) {
        (FlashBias::Sided { .. }, Some(d)) => (Some(s.alloc(cd, 2 * rows)?), Some(d)),
        _ => (None, None),
    };
    let cols_mem = cols.as_ref().map(|c| c.mem());
    let mut args = common.clone();
    args.extend([
        Arg::Ptr(dout.addr),
        Arg::Ptr(lse.addr),
        Arg::Ptr(dd.mem().addr),
        Arg::Ptr(g.dk.addr),
        Arg::Ptr(g.dv.addr),
        Arg::Ptr(ptr(cols_mem)),
    ]);
    count(Kind::Kernel);
    s.launch_in(&PROGRAM, "flash_cols", dt, (by_rows(f)?, FQ as u32), &args)?;
    let mut args = common.clone();
    args.extend([
        Arg::Ptr(dout.addr),
        Arg::Ptr(lse.addr),
        Arg::Ptr(dd.mem().addr),
        Arg::Ptr(g.dq.addr),
        Arg::Ptr(ptr(cols_mem)),
        Arg::Ptr(ptr(dsums)),
    ]);
    count(Kind::Kernel);
    s.launch_in(&PROGRAM, "flash_rows", dt, (by_rows(f)?, FQ as u32), &args)?;
    if let (FlashBias::Offsets { .. }, Some(dbias)) = (f.bias, g.dbias) {
        let mut args = common;
        args.extend([
            Arg::Ptr(dout.addr),
            Arg::Ptr(lse.addr),
            Arg::Ptr(dd.mem().addr),
            Arg::Ptr(dbias.addr),
        ]);
        count(Kind::Kernel);
        if n.h > 65_535 {
            candle::bail!("device path: the fused attention takes at most 65,535 heads");
        }
        let grid = (int(2 * n.t - 1, "offsets")? as u32, n.h as u32);
        s.launch_in(&PROGRAM, "flash_offsets_back", dt, (grid, BLOCK), &args)?;
    }
    drop((dd, cols));
    Ok(())
}
