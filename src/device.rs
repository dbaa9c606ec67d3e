//! Choosing where tensors live: `cpu`, `cuda`, `cuda:N` or `auto`.

use candle::Device;

use crate::error::{Error, Result};

/// Parses a device name. `auto` is the first CUDA GPU when this build has the `cuda` feature and
/// a GPU is present, else the CPU. Asking for CUDA from a CPU-only build says how to get it.
pub fn parse_device(spec: &str) -> Result<Device> {
    let spec = spec.trim().to_ascii_lowercase();
    let ordinal = match spec.as_str() {
        "cpu" => return Ok(Device::Cpu),
        "auto" => {
            return Ok(
                if cfg!(feature = "cuda") && candle::utils::cuda_is_available() {
                    Device::new_cuda(0).unwrap_or(Device::Cpu)
                } else {
                    Device::Cpu
                },
            )
        }
        "cuda" | "gpu" => 0,
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => n,
            _ => {
                return Err(Error::Config(format!(
                    "unknown device `{spec}`: use cpu, cuda, cuda:N or auto"
                )))
            }
        },
    };
    if !cfg!(feature = "cuda") {
        return Err(Error::Config(format!(
            "`{spec}` asks for CUDA, but this poslab was built without it: rebuild with \
             `cargo build --release --features cuda` (needs the CUDA toolkit; see the README), \
             or use --device cpu"
        )));
    }
    Device::new_cuda(ordinal).map_err(|e| {
        Error::Config(format!(
            "cannot open CUDA device {ordinal} ({}); check `nvidia-smi`, or use --device cpu",
            crate::error::without_backtrace(e)
        ))
    })
}

/// A short name for reports.
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle::DeviceLocation::Cpu => "cpu".into(),
        candle::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle::DeviceLocation::Metal { .. } => "metal".into(),
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
                    e.contains("--features cuda") && e.contains("--device cpu"),
                    "{e}"
                );
            }
        }
        let e = parse_device("tpu").unwrap_err().to_string();
        assert!(e.contains("cpu, cuda, cuda:N or auto"), "{e}");
        assert!(parse_device("cuda:x").is_err());
    }
}
