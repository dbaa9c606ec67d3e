//! Choosing where tensors live: `cpu`, `cuda`, `cuda:N` or `auto`.

use candle::Device;

use crate::error::{Error, Result};

/// A device as the command line names it: `cpu`, `cuda`, `cuda:N` or `auto`. Parsing checks
/// the name; [`DeviceSpec::open`] opens the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The CPU.
    Cpu,
    /// CUDA GPU number N (`cuda` is `cuda:0`).
    Cuda(usize),
    /// The first CUDA GPU when this build has the `cuda` feature and a GPU is present, else the
    /// CPU.
    #[default]
    Auto,
}

impl std::str::FromStr for DeviceSpec {
    type Err = Error;

    fn from_str(spec: &str) -> Result<Self> {
        let spec = spec.trim().to_ascii_lowercase();
        Ok(match spec.as_str() {
            "cpu" => Self::Cpu,
            "auto" => Self::Auto,
            "cuda" | "gpu" => Self::Cuda(0),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Self::Cuda(n),
                _ => {
                    return Err(Error::Config(format!(
                        "unknown device `{spec}`: use cpu, cuda, cuda:N or auto"
                    )))
                }
            },
        })
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
            Self::Auto => f.write_str("auto"),
        }
    }
}

impl DeviceSpec {
    /// Opens the device. Asking for CUDA from a CPU-only build says how to get it. A GPU is
    /// opened without cudarc's per-tensor events, which a single stream never reads.
    pub fn open(self) -> Result<Device> {
        let ordinal = match self {
            Self::Cpu => return Ok(Device::Cpu),
            Self::Auto => {
                return Ok(
                    if cfg!(feature = "cuda") && candle::utils::cuda_is_available() {
                        open_cuda(0).unwrap_or(Device::Cpu)
                    } else {
                        Device::Cpu
                    },
                )
            }
            Self::Cuda(n) => n,
        };
        if !cfg!(feature = "cuda") {
            return Err(Error::Input(format!(
                "`{self}` asks for CUDA, but this poslab was built without it: install one with \
                 CUDA, `cargo install --path . --locked --features cuda` (or build one in place, \
                 `cargo build --release --features cuda`, and run target/release/poslab; both \
                 need the CUDA toolkit: book/src/guide/cuda.md), or use --device cpu"
            )));
        }
        open_cuda(ordinal).map_err(|e| {
            Error::Config(format!(
                "cannot open CUDA device {ordinal} ({}); check `nvidia-smi`, or use --device cpu",
                crate::error::without_backtrace(e)
            ))
        })
    }
}

/// Opens CUDA device `ordinal` as poslab computes on it: candle's device, whose work goes to
/// the calling thread's default stream, with cudarc's event tracking off.
///
/// cudarc gives every allocation two CUDA events, to order its uses across streams. It records
/// and waits on them only once its context has made a stream of its own; candle's device never
/// does, and neither does poslab. On the one stream they are only created with every tensor and
/// destroyed with it: four driver calls (and four context checks) that nothing reads, beside the
/// allocation and the kernel itself. A training step at the default compare's shape makes at
/// most one tensor for each of its 156 operations (`poslab bench --launches`), and its wall time
/// is bound by what the host does for each (the book's Performance chapter, "CUDA events").
/// Turned off before the first allocation, so no tensor holds an event.
fn open_cuda(ordinal: usize) -> candle::Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(gpu) = &device {
        // SAFETY: cudarc asks whoever turns the tracking off to order a tensor's uses across
        // streams themselves. In single-stream mode (checked here: no stream was made on this
        // context) cudarc never records or waits on these events, so no ordering changes: they
        // are only never created.
        if gpu.cuda_stream().context().is_in_multi_stream_mode() {
            return Ok(device);
        }
        unsafe { gpu.disable_event_tracking() };
    }
    Ok(device)
}

/// Parses a device name and opens the device (see [`DeviceSpec`]).
pub fn parse_device(spec: &str) -> Result<Device> {
    spec.parse::<DeviceSpec>()?.open()
}

/// A short name for reports.
/// The kind of `device`, `cpu` or `cuda`: what a run folder records, since its results depend
/// on the kind of device but not on which GPU of a machine.
pub fn device_kind(device: &Device) -> String {
    let name = device_name(device);
    name.split(':').next().unwrap_or(&name).to_string()
}

/// The device's name: `cpu`, or `cuda:N`.
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle::DeviceLocation::Cpu => "cpu".into(),
        candle::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle::DeviceLocation::Metal { .. } => "metal".into(),
    }
}

/// The GPU's own name (`NVIDIA H100 80GB HBM3`), or none on the CPU.
pub fn gpu_name(device: &Device) -> Option<String> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(gpu) = device {
        return gpu.cuda_stream().context().name().ok();
    }
    let _ = device;
    None
}

/// Starts a new peak of the device memory poslab's tensors hold (CUDA; see
/// [`peak_memory_mib`]); false where it cannot be measured.
pub fn reset_peak_memory(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(gpu) = device {
        return cuda_pool::reset_peak(gpu).is_some();
    }
    let _ = device;
    false
}

/// The most device memory held by tensors at once since [`reset_peak_memory`], in MiB: the
/// high-water mark of the CUDA memory pool candle allocates from (`cuMemAllocAsync`), as
/// PyTorch's `max_memory_allocated` is of its caching allocator. None on the CPU (see the
/// process's peak RSS there), or where the driver allocates without a pool.
pub fn peak_memory_mib(device: &Device) -> Option<f64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(gpu) = device {
        return cuda_pool::peak_bytes(gpu).map(|b| b as f64 / (1024.0 * 1024.0));
    }
    let _ = device;
    None
}

#[cfg(feature = "cuda")]
mod cuda_pool {
    use candle::cuda_backend::cudarc::driver::sys;
    use candle::CudaDevice;

    /// The pool `cuMemAllocAsync` draws from on this GPU, when the context allocates that way,
    /// once the queued work has run (queued frees count only then).
    fn pool(gpu: &CudaDevice) -> Option<sys::CUmemoryPool> {
        let stream = gpu.cuda_stream();
        let context = stream.context();
        if !context.has_async_alloc() {
            return None;
        }
        context.bind_to_thread().ok()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer and the device handle comes from a live context.
        unsafe { sys::cuDeviceGetMemPool(&mut pool, context.cu_device()) }
            .result()
            .ok()?;
        if pool.is_null() {
            return None;
        }
        stream.synchronize().ok()?;
        Some(pool)
    }

    pub fn reset_peak(gpu: &CudaDevice) -> Option<()> {
        let pool = pool(gpu)?;
        let mut zero: u64 = 0;
        // SAFETY: the attribute takes a cuuint64_t, and only zero is accepted as a reset.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        }
        .result()
        .ok()
    }

    pub fn peak_bytes(gpu: &CudaDevice) -> Option<u64> {
        let pool = pool(gpu)?;
        let mut bytes: u64 = 0;
        // SAFETY: the attribute is a cuuint64_t written to `bytes`.
        unsafe {
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut bytes as *mut u64).cast(),
            )
        }
        .result()
        .ok()?;
        Some(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_cuda_without_the_feature_explains_itself() {
        assert!(parse_device("cpu").unwrap().is_cpu());
        if !cfg!(feature = "cuda") {
            assert!(parse_device("auto").unwrap().is_cpu());
            for spec in ["cuda", "cuda:1", "CUDA:0"] {
                let e = parse_device(spec).unwrap_err().to_string();
                assert!(
                    e.contains("cargo install --path . --locked --features cuda")
                        && e.contains("--device cpu")
                        && !e.contains("config"),
                    "{e}"
                );
            }
        }
        let e = parse_device("tpu").unwrap_err().to_string();
        assert!(e.contains("cpu, cuda, cuda:N or auto"), "{e}");
        assert!(parse_device("cuda:x").is_err());
    }
}
