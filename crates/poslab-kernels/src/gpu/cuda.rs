//! The device operations on CUDA: cuBLAS for every matrix product (strided-batched, the
//! transposes folded into each call's layout), and poslab's kernels (`kernels.cu`) for the
//! rest, all on candle's stream for the device.
//!
//! The kernels are compiled by NVRTC the first time a process needs them (about a second), not
//! by nvcc at build time: candle's CUDA build already needs NVRTC at run time, the source is
//! one file of templates instantiated per dtype, and a run-time compile keeps poslab free of a
//! build script (the `cuda` feature builds as before). A compile error names the kernel file
//! and NVRTC's log.

use std::sync::{Arc, OnceLock};

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc;
use candle::cuda_backend::cudarc::cublas::sys as blas;
use candle::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle::cuda_backend::{CudaDevice, CudaStorage, WrapErr};
use candle::{DType, Layout, Result};

use super::*;

/// The kernels' source.
pub const SOURCE: &str = include_str!("kernels.cu");

/// A program of kernels NVRTC compiles the first time a process launches one of them.
pub(super) struct Program {
    /// candle's name for the loaded module.
    module: &'static str,
    /// The source files, compiled one after another as one program.
    files: &'static [(&'static str, &'static str)],
    ptx: OnceLock<std::result::Result<String, String>>,
}

impl Program {
    pub(super) const fn new(
        module: &'static str,
        files: &'static [(&'static str, &'static str)],
    ) -> Self {
        Self {
            module,
            files,
            ptx: OnceLock::new(),
        }
    }

    /// The program compiled to PTX, once per process (or NVRTC's error, naming the files).
    fn ptx(&self) -> Result<&str> {
        self.ptx
            .get_or_init(|| {
                let source: String = self.files.iter().map(|f| f.1).collect();
                cudarc::nvrtc::compile_ptx_with_opts(
                    source,
                    cudarc::nvrtc::CompileOptions {
                        name: Some(format!("{}.cu", self.module)),
                        ..Default::default()
                    },
                )
                .map(|p| p.to_src())
                .map_err(|e| format!("{e:?}"))
            })
            .as_ref()
            .map(String::as_str)
            .map_err(|e| {
                let names: Vec<&str> = self.files.iter().map(|f| f.0).collect();
                candle::Error::Msg(format!(
                    "NVRTC could not compile crates/poslab-kernels/src/gpu/{}: {e}",
                    names.join(" + ")
                ))
            })
    }
}

/// The device path's kernels (`kernels.cu`).
static KERNELS_PROGRAM: Program = Program::new("poslab_device", &[("kernels.cu", SOURCE)]);

/// The kernels every storage dtype has, as [`CudaStream`] launches them.
const KERNELS: [&str; 22] = [
    "gates",
    "fill",
    "mul",
    "dropout_mask",
    "layer_norm",
    "residual",
    "norm_back",
    "bias_act",
    "heads",
    "transpose12",
    "softmax",
    "softmax_back",
    "softmax_rows",
    "softmax_back_rows",
    "sided_back",
    "adamw",
    "sum_squares",
    "embedding_back",
    "pool_mean",
    "xent",
    "weighted_sum",
    "xent_back",
];

/// Compiles the kernels with NVRTC (no GPU needed) and checks that the PTX holds every kernel
/// the stream launches, for every dtype: how a build machine checks them. Returns the number
/// of kernels.
pub fn compile_check() -> Result<usize> {
    let dtypes = [DType::F64, DType::F32, DType::BF16, DType::F16];
    let (mut names, mut flash): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    for dt in dtypes {
        let s = suffix(dt)?;
        names.extend(KERNELS.iter().map(|k| format!("{k}_{s}")));
        for to in dtypes {
            names.push(format!("convert_{s}_{}", suffix(to)?));
        }
        flash.extend(
            super::flash::cuda::KERNELS
                .iter()
                .map(|k| format!("{k}_{s}")),
        );
    }
    for (program, names) in [
        (&KERNELS_PROGRAM, &names),
        (&super::flash::cuda::PROGRAM, &flash),
    ] {
        let ptx = program.ptx()?;
        for name in names {
            if !ptx.contains(&format!(".entry {name}(")) {
                candle::bail!("the compiled kernels lack `{name}`");
            }
        }
    }
    Ok(names.len() + flash.len())
}

/// The name suffix of a storage dtype's kernels.
fn suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F64 => "f64",
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        dt => candle::bail!("device path: no {dt:?} kernels (f64, f32, bf16 or f16)"),
    })
}

/// The memory of a contiguous CUDA storage at `layout`.
pub fn mem(s: &CudaStorage, layout: &Layout) -> Result<Mem> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle::bail!(
            "device path: an input of shape {:?} is not contiguous",
            layout.dims()
        )
    };
    let stream = s.device().cuda_stream();
    let addr = match s.dtype() {
        DType::F64 => s.as_cuda_slice::<f64>()?.device_ptr(&stream).0,
        DType::F32 => s.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::BF16 => s.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
        DType::F16 => s.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
        DType::U32 => s.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
        dt => candle::bail!("device path: no {dt:?} inputs"),
    };
    Mem {
        addr,
        len: end,
        dtype: s.dtype(),
    }
    .at(start, end - start)
}

/// The device operations on one CUDA device's stream.
pub struct CudaStream {
    dev: CudaDevice,
    blas: Arc<cudarc::cublas::CudaBlas>,
}

/// Threads per block of the row kernels and of the element-wise ones.
pub(super) const BLOCK: u32 = 256;

/// Rows of a warp-per-row kernel in one block of [`BLOCK`] threads.
const WARPS: usize = BLOCK as usize / 32;

/// The longest row the warp-per-row softmax kernels hold in registers (32 values a lane,
/// `ROW_VALUES` in `kernels.cu`); longer rows take one block each.
///
/// Which of the two each direction takes was measured on an H100 (the book's performance page, "Measurements behind the code's choices"): the forward
/// takes the warp kernel in bf16 and f16, the backward in f32 and f64.
const ROW_KEYS: usize = 32 * 32;

pub(super) fn grid_of(n: usize) -> u32 {
    n.div_ceil(BLOCK as usize).clamp(1, 1 << 30) as u32
}

pub(super) fn rows_of(rows: usize) -> Result<u32> {
    u32::try_from(rows.max(1))
        .map_err(|_| candle::Error::Msg(format!("device path: {rows} rows in one launch")))
}

pub(super) fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| candle::Error::Msg(format!("device path: {what} {v} is too large")))
}

/// A window side's reach as the kernels take it: at most `t`, and -1 for none.
pub(super) fn reach(side: Option<usize>, t: usize) -> Result<i32> {
    match side {
        Some(w) => int(w.min(t), "a window"),
        None => Ok(-1),
    }
}

/// A device address, or null for an absent input.
pub(super) fn ptr(m: Option<Mem>) -> u64 {
    m.map_or(0, |m| m.addr)
}

impl CudaStream {
    pub fn new(dev: &CudaDevice) -> Self {
        Self {
            dev: dev.clone(),
            blas: dev.cublas_handle(),
        }
    }

    /// Launches `name` for `dtype` with `args` over `grid` blocks of [`BLOCK`] threads.
    fn launch(&self, name: &str, dtype: DType, grid: u32, args: &[Arg]) -> Result<()> {
        self.launch_grid(name, dtype, (grid, 1), args)
    }

    /// A multi-tensor launch's table on the device: `table`, then the blocks' `(variable, first
    /// value)` pairs, one pair for each [`ADAMW_CHUNK`] of each variable of `lens`. Returns the
    /// device copy (free it in stream order after the launch), its address, that of the block
    /// pairs, and how many blocks there are.
    fn upload_table(
        &self,
        mut table: Vec<u64>,
        lens: impl Iterator<Item = usize>,
    ) -> Result<(cudarc::driver::CudaSlice<u64>, u64, u64, usize)> {
        let parts_at = table.len();
        for (i, n) in lens.enumerate() {
            table.extend(
                (0..n)
                    .step_by(ADAMW_CHUNK)
                    .flat_map(|s| [i as u64, s as u64]),
            );
        }
        let blocks = (table.len() - parts_at) / 2;
        count(Kind::Copy);
        // SAFETY: written in full by the copy below before any kernel reads it.
        let mut on_device = unsafe { self.dev.alloc::<u64>(table.len())? };
        self.dev.memcpy_htod(&table, &mut on_device)?;
        let base = on_device.device_ptr(&self.dev.cuda_stream()).0;
        Ok((on_device, base, base + 8 * parts_at as u64, blocks))
    }

    /// [`CudaStream::launch`] over a grid of `(x, y)` blocks.
    fn launch_grid(&self, name: &str, dtype: DType, grid: (u32, u32), args: &[Arg]) -> Result<()> {
        self.launch_in(&KERNELS_PROGRAM, name, dtype, (grid, BLOCK), args)
    }

    /// Launches `name` of `program` for `dtype` with `args` over a grid of `(x, y)` blocks of
    /// `threads`.
    pub(super) fn launch_in(
        &self,
        program: &Program,
        name: &str,
        dtype: DType,
        (grid, threads): ((u32, u32), u32),
        args: &[Arg],
    ) -> Result<()> {
        let func = self.dev.get_or_load_custom_func(
            &format!("{name}_{}", suffix(dtype)?),
            program.module,
            program.ptx()?,
        )?;
        let mut b = func.builder();
        for a in args {
            match a {
                Arg::Ptr(v) | Arg::I64(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::F64(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.0, grid.1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every kernel's arguments are given in its signature's order and types
        // (pointers as 64-bit addresses of memory holding what the kernel reads or writes:
        // each operation checks its spans before it launches).
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

/// A kernel argument.
#[derive(Clone, Copy)]
pub(super) enum Arg {
    Ptr(u64),
    I64(u64),
    I32(i32),
    F64(f64),
}

pub(super) fn i64_arg(v: usize) -> Arg {
    Arg::I64(v as u64)
}

impl Stream for CudaStream {
    fn alloc(&self, dtype: DType, len: usize) -> Result<Buf> {
        let stream = self.dev.cuda_stream();
        let len1 = len.max(1);
        // SAFETY (each): uninitialised memory, which the operations write before they read.
        let (storage, addr) = match dtype {
            DType::F64 => {
                let s = unsafe { self.dev.alloc::<f64>(len1)? };
                let a = s.device_ptr(&stream).0;
                (CudaStorage::wrap_cuda_slice(s, self.dev.clone()), a)
            }
            DType::F32 => {
                let s = unsafe { self.dev.alloc::<f32>(len1)? };
                let a = s.device_ptr(&stream).0;
                (CudaStorage::wrap_cuda_slice(s, self.dev.clone()), a)
            }
            DType::BF16 => {
                let s = unsafe { self.dev.alloc::<half::bf16>(len1)? };
                let a = s.device_ptr(&stream).0;
                (CudaStorage::wrap_cuda_slice(s, self.dev.clone()), a)
            }
            DType::F16 => {
                let s = unsafe { self.dev.alloc::<half::f16>(len1)? };
                let a = s.device_ptr(&stream).0;
                (CudaStorage::wrap_cuda_slice(s, self.dev.clone()), a)
            }
            dt => candle::bail!("device path: no {dt:?} buffers"),
        };
        Ok(Buf::new(Mem { addr, len, dtype }, Owner::Cuda(storage)))
    }

    fn gemm(&self, g: &Gemm) -> Result<()> {
        g.check()?;
        count(Kind::Gemm);
        if g.m == 0 || g.n == 0 || g.batch == 0 {
            return Ok(());
        }
        let dtype = g.c.mem.dtype;
        let (data, compute) = match dtype {
            DType::F64 => (
                blas::cudaDataType::CUDA_R_64F,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_64F,
            ),
            DType::F32 => (
                blas::cudaDataType::CUDA_R_32F,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            DType::BF16 => (
                blas::cudaDataType::CUDA_R_16BF,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            DType::F16 => (
                blas::cudaDataType::CUDA_R_16F,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            dt => candle::bail!("device path: no {dt:?} products"),
        };
        let op = |t: bool| {
            if t {
                blas::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // Row-major C = A B is column-major Cᵀ = Bᵀ Aᵀ: B's buffer goes first.
        let (alpha64, beta64) = (g.alpha, g.beta);
        let (alpha32, beta32) = (g.alpha as f32, g.beta as f32);
        let (alpha, beta): (*const std::ffi::c_void, *const std::ffi::c_void) =
            if dtype == DType::F64 {
                (&alpha64 as *const f64 as _, &beta64 as *const f64 as _)
            } else {
                (&alpha32 as *const f32 as _, &beta32 as *const f32 as _)
            };
        // One product goes through cublasGemmEx, as PyTorch's linear layers do, and not as a
        // batch of one, whose call is suspected of narrowing cuBLAS's choice to SIMT kernels
        // (the book's performance page, "Measurements behind the code's choices"; `scripts/gpu/session.sh ab-large` measures it).
        if g.batch == 1 {
            // SAFETY: as below, for the batch's one product.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    op(g.b.trans),
                    op(g.a.trans),
                    int(g.n, "a product's width")?,
                    int(g.m, "a product's height")?,
                    int(g.k, "a product's depth")?,
                    alpha,
                    g.b.mem.addr as *const std::ffi::c_void,
                    data,
                    int(g.b.ld, "a leading dimension")?,
                    g.a.mem.addr as *const std::ffi::c_void,
                    data,
                    int(g.a.ld, "a leading dimension")?,
                    beta,
                    g.c.mem.addr as *mut std::ffi::c_void,
                    data,
                    int(g.c.ld, "a leading dimension")?,
                    compute,
                    blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .w()?;
            return Ok(());
        }
        // SAFETY: `check` bounded every operand's span within its buffer; alpha and beta point
        // to host values of the compute type (the handle's pointer mode is the host's).
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                op(g.b.trans),
                op(g.a.trans),
                int(g.n, "a product's width")?,
                int(g.m, "a product's height")?,
                int(g.k, "a product's depth")?,
                alpha,
                g.b.mem.addr as *const std::ffi::c_void,
                data,
                int(g.b.ld, "a leading dimension")?,
                g.b.stride as i64,
                g.a.mem.addr as *const std::ffi::c_void,
                data,
                int(g.a.ld, "a leading dimension")?,
                g.a.stride as i64,
                beta,
                g.c.mem.addr as *mut std::ffi::c_void,
                data,
                int(g.c.ld, "a leading dimension")?,
                g.c.stride as i64,
                int(g.batch, "a batch")?,
                compute,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .w()?;
        Ok(())
    }

    fn fill(&self, out: Mem, value: f64) -> Result<()> {
        count(Kind::Kernel);
        let args = [Arg::Ptr(out.addr), Arg::F64(value), i64_arg(out.len)];
        self.launch("fill", out.dtype, grid_of(out.len), &args)
    }

    fn mul(&self, x: Mem, m: Mem, out: Mem) -> Result<()> {
        count(Kind::Kernel);
        m.holds(x.len, x.dtype, "a mask")?;
        out.holds(x.len, x.dtype, "a product")?;
        let args = [
            Arg::Ptr(x.addr),
            Arg::Ptr(m.addr),
            Arg::Ptr(out.addr),
            i64_arg(x.len),
        ];
        self.launch("mul", x.dtype, grid_of(x.len), &args)
    }

    fn dropout_mask(&self, d: crate::spec::SeededDropout, out: Mem) -> Result<()> {
        count(Kind::Kernel);
        let args = [
            Arg::Ptr(out.addr),
            Arg::I64(d.seed),
            Arg::I64(d.threshold()),
            Arg::F64(d.scale(out.dtype)?),
            i64_arg(out.len),
        ];
        self.launch("dropout_mask", out.dtype, grid_of(out.len), &args)
    }

    fn convert(&self, x: Mem, out: Mem) -> Result<()> {
        count(Kind::Copy);
        if out.len < x.len {
            candle::bail!("device path: {} values converted into {}", x.len, out.len)
        }
        let name = format!("convert_{}", suffix(x.dtype)?);
        let args = [Arg::Ptr(x.addr), Arg::Ptr(out.addr), i64_arg(x.len)];
        self.launch(&name, out.dtype, grid_of(x.len), &args)
    }

    fn layer_norm(&self, x: Mem, rows: usize, width: usize, n: &Norm) -> Result<()> {
        count(Kind::Kernel);
        let (dt, cd) = (x.dtype, compute_dtype(x.dtype));
        x.holds(rows * width, dt, "a LayerNorm's input")?;
        n.w.holds(width, dt, "a LayerNorm's weight")?;
        n.b.holds(width, dt, "a LayerNorm's bias")?;
        n.out.holds(rows * width, dt, "a LayerNorm's output")?;
        n.stats.holds(2 * rows, cd, "a LayerNorm's statistics")?;
        let args = [
            Arg::Ptr(x.addr),
            Arg::Ptr(n.w.addr),
            Arg::Ptr(n.b.addr),
            Arg::F64(n.eps),
            Arg::Ptr(n.out.addr),
            Arg::Ptr(n.stats.addr),
            i64_arg(rows),
            Arg::I32(int(width, "a row's width")?),
        ];
        self.launch("layer_norm", dt, rows_of(rows)?, &args)
    }

    fn residual(&self, r: &Residual) -> Result<()> {
        count(Kind::Kernel);
        let (dt, cd) = (r.sum.dtype, compute_dtype(r.sum.dtype));
        let n = r.rows * r.width;
        r.res.holds(n, dt, "a residual")?;
        r.z.holds(n, dt, "a branch")?;
        r.bias.holds(r.width, dt, "a branch's bias")?;
        r.sum.holds(n, dt, "a residual sum")?;
        if let Some(m) = r.mask {
            m.holds(n, dt, "a dropout mask")?;
        }
        if let Some(nm) = &r.norm {
            nm.w.holds(r.width, dt, "a LayerNorm's weight")?;
            nm.b.holds(r.width, dt, "a LayerNorm's bias")?;
            nm.out.holds(n, dt, "a LayerNorm's output")?;
            nm.stats.holds(2 * r.rows, cd, "a LayerNorm's statistics")?;
        }
        let args = [
            Arg::Ptr(r.res.addr),
            Arg::Ptr(r.z.addr),
            Arg::Ptr(r.bias.addr),
            Arg::Ptr(ptr(r.mask)),
            Arg::Ptr(r.sum.addr),
            Arg::Ptr(ptr(r.norm.map(|n| n.w))),
            Arg::Ptr(ptr(r.norm.map(|n| n.b))),
            Arg::F64(r.norm.map_or(0.0, |n| n.eps)),
            Arg::Ptr(ptr(r.norm.map(|n| n.out))),
            Arg::Ptr(ptr(r.norm.map(|n| n.stats))),
            i64_arg(r.rows),
            Arg::I32(int(r.width, "a row's width")?),
        ];
        self.launch("residual", dt, rows_of(r.rows)?, &args)
    }

    fn norm_back(&self, nb: &NormBack) -> Result<()> {
        count(Kind::Kernel);
        let (dt, cd) = (nb.g.dtype, compute_dtype(nb.g.dtype));
        let n = nb.rows * nb.width;
        nb.x.holds(n, dt, "a LayerNorm's input")?;
        nb.stats
            .holds(2 * nb.rows, cd, "a LayerNorm's statistics")?;
        nb.w.holds(nb.width, dt, "a LayerNorm's weight")?;
        nb.g.holds(n, dt, "a LayerNorm's output gradient")?;
        nb.out.holds(n, dt, "a LayerNorm's input gradient")?;
        nb.params.holds(2 * n, dt, "a LayerNorm's parameter rows")?;
        if let Some(a) = nb.add {
            a.holds(n, dt, "a residual gradient")?;
        }
        if let Some((m, o)) = nb.mask {
            m.holds(n, dt, "a dropout mask")?;
            o.holds(n, dt, "a masked gradient")?;
        }
        let args = [
            Arg::Ptr(nb.x.addr),
            Arg::Ptr(nb.stats.addr),
            Arg::Ptr(nb.w.addr),
            Arg::Ptr(nb.g.addr),
            Arg::Ptr(ptr(nb.add)),
            Arg::Ptr(nb.out.addr),
            Arg::Ptr(ptr(nb.mask.map(|m| m.0))),
            Arg::Ptr(ptr(nb.mask.map(|m| m.1))),
            Arg::Ptr(nb.params.addr),
            i64_arg(nb.rows),
            Arg::I32(int(nb.width, "a row's width")?),
        ];
        self.launch("norm_back", dt, rows_of(nb.rows)?, &args)
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
        let dt = u.dtype;
        u.holds(rows * width, dt, "the activation's input")?;
        bias.holds(width, dt, "the activation's bias")?;
        grad.holds(rows * width, dt, "the activation's derivative")?;
        let args = [
            Arg::Ptr(u.addr),
            Arg::Ptr(bias.addr),
            Arg::Ptr(grad.addr),
            i64_arg(rows),
            Arg::I32(int(width, "a row's width")?),
            Arg::I32(match act {
                Act::Gelu => 0,
                Act::Relu => 1,
            }),
        ];
        self.launch("bias_act", dt, grid_of(rows * width), &args)
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
        bias.holds(3 * heads.d(), qkv.dtype, "the projections' bias")?;
        self.heads(qkv, Some(bias), rope, heads, out, false)
    }

    fn heads_back(&self, g: Mem, rope: Option<&Rope>, heads: Heads, out: Mem) -> Result<()> {
        count(Kind::Kernel);
        self.heads(g, None, rope, heads, out, true)
    }

    fn transpose12(&self, x: Mem, [a, b, c, d]: [usize; 4], out: Mem) -> Result<()> {
        count(Kind::Copy);
        let n = a * b * c * d;
        x.holds(n, x.dtype, "a transpose's input")?;
        out.holds(n, x.dtype, "a transpose's output")?;
        let args = [
            Arg::Ptr(x.addr),
            Arg::Ptr(out.addr),
            i64_arg(a),
            i64_arg(b),
            i64_arg(c),
            i64_arg(d),
        ];
        self.launch("transpose12", x.dtype, grid_of(n), &args)
    }

    fn softmax(&self, s: &Softmax) -> Result<()> {
        count(Kind::Kernel);
        let n = s.heads;
        let (dt, cd) = (s.sp.dtype, compute_dtype(s.sp.dtype));
        s.sp.holds(n.scores(), dt, "the scores")?;
        s.key_bias.holds(n.b * n.t, cd, "the key bias")?;
        let (kind, bias, rows) = match s.bias {
            ScoreBias::None => (0, None, 1),
            ScoreBias::Table { bias, rows } => {
                bias.holds(rows * n.h * n.t * n.t, cd, "the score bias")?;
                (1, Some(bias), rows)
            }
            ScoreBias::Sided { sums } => {
                sums.holds(2 * n.b * n.h * n.t, cd, "the running sums")?;
                (2, Some(sums), 1)
            }
            ScoreBias::Offsets { .. } => candle::bail!("{OFFSETS_UNFUSED}"),
        };
        if let Some((m, pm)) = s.dropout {
            m.holds(n.scores(), dt, "the attention dropout mask")?;
            pm.holds(n.scores(), dt, "the dropped weights")?;
        }
        let before = reach(s.window.before, n.t)?;
        let after = reach(s.window.after, n.t)?;
        let args = [
            Arg::Ptr(s.sp.addr),
            Arg::Ptr(s.key_bias.addr),
            Arg::I32(kind),
            Arg::Ptr(ptr(bias)),
            Arg::I32(int(rows, "a bias's rows")?),
            Arg::I32(before),
            Arg::I32(after),
            Arg::Ptr(ptr(s.dropout.map(|d| d.0))),
            Arg::Ptr(ptr(s.dropout.map(|d| d.1))),
            Arg::I32(int(n.b, "a batch")?),
            Arg::I32(int(n.h, "heads")?),
            Arg::I32(int(n.t, "tokens")?),
        ];
        let rows = n.b * n.h * n.t;
        if n.t <= ROW_KEYS && dt.size_in_bytes() == 2 {
            self.launch("softmax_rows", dt, rows_of(rows.div_ceil(WARPS))?, &args)
        } else {
            self.launch("softmax", dt, rows_of(rows)?, &args)
        }
    }

    fn flash(&self, f: &flash::Flash, out: Mem, lse: Mem) -> Result<()> {
        flash::cuda::forward(self, f, out, lse)
    }

    fn flash_back(
        &self,
        f: &flash::Flash,
        out: Mem,
        lse: Mem,
        dout: Mem,
        g: &flash::FlashGrads,
    ) -> Result<()> {
        flash::cuda::backward(self, f, out, lse, dout, g)
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
        let dt = p.dtype;
        p.holds(rows * t, dt, "the weights")?;
        dp.holds(rows * t, dt, "their gradient")?;
        if let Some(m) = mask {
            m.holds(rows * t, dt, "the attention dropout mask")?;
        }
        let args = [
            Arg::Ptr(p.addr),
            Arg::Ptr(dp.addr),
            Arg::Ptr(ptr(mask)),
            i64_arg(rows),
            Arg::I32(int(t, "tokens")?),
        ];
        if t <= ROW_KEYS && dt.size_in_bytes() >= 4 {
            self.launch(
                "softmax_back_rows",
                dt,
                rows_of(rows.div_ceil(WARPS))?,
                &args,
            )
        } else {
            self.launch("softmax_back", dt, rows_of(rows)?, &args)
        }
    }

    fn gates(&self, z: Mem, bias: Mem, n: Heads, sums: Mem) -> Result<()> {
        count(Kind::Kernel);
        let cd = compute_dtype(z.dtype);
        sums.holds(2 * n.b * n.h * n.t, cd, "the gates' running sums")?;
        self.gate_launch(z, bias, n, (sums.addr, 0, 0), false)
    }

    fn gates_back(&self, z: Mem, bias: Mem, dsums: Mem, n: Heads, dz: Mem) -> Result<()> {
        count(Kind::Kernel);
        let dt = z.dtype;
        dsums.holds(2 * n.b * n.h * n.t, dt, "the running sums' gradient")?;
        dz.holds(n.b * n.t * 2 * n.h, dt, "the gates' gradient")?;
        self.gate_launch(z, bias, n, (0, dsums.addr, dz.addr), true)
    }

    fn adamw(&self, parts: &[AdamWPart], step: &AdamWStep) -> Result<()> {
        let Some(first) = parts.first() else {
            return Ok(());
        };
        let dtype = first.w.dtype;
        // The table of variables, then of blocks (variable, first value), as the kernel reads it.
        let mut table: Vec<u64> = Vec::with_capacity(7 * parts.len());
        for p in parts {
            let n = p.w.len;
            p.w.holds(n, dtype, "a variable")?;
            p.g.holds(n, dtype, "a gradient")?;
            p.mv.holds(2 * n, dtype, "AdamW's moments")?;
            let v = p.mv.at(n, n)?;
            table.extend([
                p.w.addr,
                p.g.addr,
                p.mv.addr,
                v.addr,
                n as u64,
                p.decay_factor.to_bits(),
                // No bound: NaN, which the kernel reads as none.
                p.lower.unwrap_or(f64::NAN).to_bits(),
            ]);
        }
        if parts.iter().all(|p| p.w.len == 0) {
            return Ok(());
        }
        let (on_device, parts_addr, chunks_addr, blocks) =
            self.upload_table(table, parts.iter().map(|p| p.w.len))?;
        count(Kind::Kernel);
        let args = [
            Arg::Ptr(parts_addr),
            Arg::Ptr(chunks_addr),
            Arg::F64(step.beta1),
            Arg::F64(step.beta2),
            Arg::F64(step.eps),
            Arg::F64(step.bias1),
            Arg::F64(step.bias2),
            Arg::F64(step.lr),
            Arg::F64(step.grad_scale),
        ];
        let blocks = rows_of(blocks)?;
        self.launch("adamw", dtype, blocks, &args)?;
        // Freed in stream order, after the kernel has read it.
        drop(on_device);
        Ok(())
    }

    fn sum_squares(&self, parts: &[Mem], with: Option<Mem>) -> Result<Squares> {
        if let Some(w) = with {
            if w.len != 1 {
                candle::bail!("device path: {} values read with the squares, not 1", w.len)
            }
        }
        let dtype = parts.first().map_or(DType::F32, |p| p.dtype);
        // The table of variables (address, length), then of blocks (variable, first value).
        let mut table: Vec<u64> = Vec::with_capacity(2 * parts.len());
        for p in parts {
            p.holds(p.len, dtype, "a gradient")?;
            table.extend([p.addr, p.len as u64]);
        }
        let mut sums = vec![0.0f64; parts.len()];
        // The parts' table on the device where there is anything to sum: its blocks.
        let uploaded = match parts.iter().any(|p| p.len != 0) {
            true => Some(self.upload_table(table, parts.iter().map(|p| p.len))?),
            false => None,
        };
        let blocks = uploaded.as_ref().map_or(0, |u| u.3);
        let slots = blocks + usize::from(with.is_some());
        if slots == 0 {
            return Ok(Squares { sums, with: None });
        }
        // SAFETY: every value is written (one per block by the kernel, the last by the
        // conversion of `with`) before it is read back.
        let partial = unsafe { self.dev.alloc::<f64>(slots)? };
        let out = partial.device_ptr(&self.dev.cuda_stream()).0;
        if let Some((_, parts_addr, chunks_addr, _)) = &uploaded {
            count(Kind::Kernel);
            let args = [Arg::Ptr(*parts_addr), Arg::Ptr(*chunks_addr), Arg::Ptr(out)];
            self.launch("sum_squares", dtype, rows_of(blocks)?, &args)?;
        }
        if let Some(w) = with {
            let slot = Mem {
                addr: out + 8 * blocks as u64,
                len: 1,
                dtype: DType::F64,
            };
            self.convert(w, slot)?;
        }
        count(Kind::Copy);
        let mut chunk_sums = self.dev.clone_dtoh(&partial)?;
        let with = match with {
            Some(_) => chunk_sums.pop(),
            None => None,
        };
        // Each block's sum to its variable, in order: the blocks run variable after variable.
        let owners = parts
            .iter()
            .enumerate()
            .flat_map(|(i, p)| std::iter::repeat_n(i, p.len.div_ceil(ADAMW_CHUNK)));
        for (i, v) in owners.zip(chunk_sums) {
            sums[i] += v;
        }
        Ok(Squares { sums, with })
    }

    fn embedding_back(&self, ids: Mem, g: Mem, out: Mem, vocab: usize, d: usize) -> Result<()> {
        count(Kind::Kernel);
        let (n, dt) = (ids.len, g.dtype);
        ids.holds(n, DType::U32, "the token ids")?;
        g.holds(n * d, dt, "the lookup's gradient")?;
        out.holds(vocab * d, dt, "the embedding's gradient")?;
        // The table's rows a block sums (EMB_BYTES of shared memory in the compute dtype).
        let rows = 32768 / (BLOCK as usize * compute_dtype(dt).size_in_bytes());
        let grid = (
            rows_of(vocab.div_ceil(rows))?,
            rows_of(d.div_ceil(BLOCK as usize))?,
        );
        let args = [
            Arg::Ptr(ids.addr),
            Arg::Ptr(g.addr),
            Arg::Ptr(out.addr),
            i64_arg(n),
            Arg::I32(int(vocab, "a vocabulary")?),
            Arg::I32(int(d, "a width")?),
        ];
        self.launch_grid("embedding_back", dt, grid, &args)
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
        let dt = x.dtype;
        let (x_len, out_len) = if back {
            (b * d, b * t * d)
        } else {
            (b * t * d, b * d)
        };
        mask.holds(b * t, DType::U32, "the attention mask")?;
        x.holds(x_len, dt, "the pooling's input")?;
        out.holds(out_len, dt, "the pooling's output")?;
        let args = [
            Arg::Ptr(x.addr),
            Arg::Ptr(mask.addr),
            Arg::Ptr(out.addr),
            Arg::I32(int(b, "a batch")?),
            Arg::I32(int(t, "tokens")?),
            Arg::I32(int(d, "a width")?),
            Arg::I32(back as i32),
        ];
        self.launch("pool_mean", dt, grid_of(b * d), &args)
    }

    fn xent(&self, x: &Xent, bias: Mem, nll: Mem) -> Result<()> {
        count(Kind::Kernel);
        let dt = x.logits.dtype;
        x.check(dt)?;
        bias.holds(x.classes, dt, "the head's bias")?;
        nll.holds(x.rows, dt, "the rows' losses")?;
        let args = [
            Arg::Ptr(x.logits.addr),
            Arg::Ptr(bias.addr),
            Arg::Ptr(x.targets.addr),
            Arg::Ptr(x.lse.addr),
            Arg::Ptr(nll.addr),
            i64_arg(x.rows),
            Arg::I32(int(x.classes, "classes")?),
        ];
        self.launch("xent", dt, rows_of(x.rows)?, &args)
    }

    fn weighted_sum(&self, x: Mem, w: Option<Mem>, scale: f64, out: Mem) -> Result<()> {
        count(Kind::Kernel);
        let dt = x.dtype;
        if let Some(w) = w {
            w.holds(x.len, DType::F32, "the weights of a sum")?;
        }
        out.holds(1, dt, "a sum")?;
        let args = [
            Arg::Ptr(x.addr),
            Arg::Ptr(ptr(w)),
            Arg::F64(scale),
            Arg::Ptr(out.addr),
            i64_arg(x.len),
        ];
        self.launch("weighted_sum", dt, 1, &args)
    }

    fn xent_back(&self, x: &Xent, g: Mem, scale: f64) -> Result<()> {
        count(Kind::Kernel);
        let dt = x.logits.dtype;
        x.check(dt)?;
        g.holds(1, dt, "the loss's gradient")?;
        let args = [
            Arg::Ptr(x.logits.addr),
            Arg::Ptr(x.lse.addr),
            Arg::Ptr(x.targets.addr),
            Arg::Ptr(ptr(x.weights)),
            Arg::Ptr(g.addr),
            Arg::F64(scale),
            i64_arg(x.rows),
            Arg::I32(int(x.classes, "classes")?),
        ];
        self.launch("xent_back", dt, grid_of(x.rows * x.classes), &args)
    }

    fn sided_back(&self, ds: Mem, n: Heads, out: Mem) -> Result<()> {
        count(Kind::Kernel);
        let dt = ds.dtype;
        ds.holds(n.scores(), dt, "the scores' gradient")?;
        out.holds(2 * n.b * n.h * n.t, dt, "the running sums' gradient")?;
        let args = [
            Arg::Ptr(ds.addr),
            Arg::Ptr(out.addr),
            Arg::I32(int(n.b, "a batch")?),
            Arg::I32(int(n.h, "heads")?),
            Arg::I32(int(n.t, "tokens")?),
        ];
        self.launch("sided_back", dt, rows_of(n.b * n.h * n.t)?, &args)
    }
}

impl CudaStream {
    /// The gates' kernel: `(sums, dsums, dz)` addresses, those not used 0.
    fn gate_launch(
        &self,
        z: Mem,
        bias: Mem,
        n: Heads,
        (sums, dsums, dz): (u64, u64, u64),
        back: bool,
    ) -> Result<()> {
        let dt = z.dtype;
        z.holds(n.b * n.t * 2 * n.h, dt, "the gates' inputs")?;
        bias.holds(2 * n.h, dt, "the gates' bias")?;
        let args = [
            Arg::Ptr(z.addr),
            Arg::Ptr(bias.addr),
            Arg::Ptr(sums),
            Arg::Ptr(dsums),
            Arg::Ptr(dz),
            Arg::I32(int(n.b, "a batch")?),
            Arg::I32(int(n.t, "tokens")?),
            Arg::I32(int(n.h, "heads")?),
            Arg::I32(back as i32),
        ];
        self.launch("gates", dt, grid_of(n.b * 2 * n.h), &args)
    }

    /// `heads_in` (`back` false) or `heads_back`.
    fn heads(
        &self,
        src: Mem,
        bias: Option<Mem>,
        rope: Option<&Rope>,
        n: Heads,
        out: Mem,
        back: bool,
    ) -> Result<()> {
        let (dt, cd) = (src.dtype, compute_dtype(src.dtype));
        src.holds(3 * n.one(), dt, "the projections")?;
        out.holds(3 * n.one(), dt, "the heads")?;
        if let Some(r) = rope {
            r.cos
                .holds(r.rows * n.t * r.width, cd, "RoPE's cos table")?;
            r.sin
                .holds(r.rows * n.t * r.width, cd, "RoPE's sin table")?;
            if r.width > n.dh || r.width % 2 == 1 || !(r.rows == 1 || r.rows == n.b) {
                candle::bail!(
                    "device path: RoPE's tables ({}, t, {}) for heads {} wide",
                    r.rows,
                    r.width,
                    n.dh
                )
            }
        }
        let args = [
            Arg::Ptr(src.addr),
            Arg::Ptr(ptr(bias)),
            Arg::Ptr(ptr(rope.map(|r| r.cos))),
            Arg::Ptr(ptr(rope.map(|r| r.sin))),
            Arg::Ptr(out.addr),
            Arg::I32(int(n.b, "a batch")?),
            Arg::I32(int(n.t, "tokens")?),
            Arg::I32(int(n.h, "heads")?),
            Arg::I32(int(n.dh, "a head's width")?),
            Arg::I32(int(rope.map_or(1, |r| r.rows), "RoPE's rows")?),
            Arg::I32(int(rope.map_or(0, |r| r.width), "RoPE's width")?),
            Arg::I32(rope.is_some_and(|r| r.interleaved) as i32),
            Arg::I32(back as i32),
        ];
        self.launch("heads", dt, grid_of(3 * n.one()), &args)
    }
}
