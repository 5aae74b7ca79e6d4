//! `cpu | cuda[:N] | metal | auto` -> a candle device.

use anyhow::Result;
use candle_core::Device;

use crate::user_bail;

/// Parses a device name. CUDA and Metal need the binary built with the cargo feature of
/// the same name; `auto` picks CUDA, then Metal, then the CPU.
pub fn parse_device(name: &str) -> Result<Device> {
    let name = name.trim().to_ascii_lowercase();
    match name.as_str() {
        "cpu" => Ok(Device::Cpu),
        "auto" => auto(),
        "metal" => metal(0),
        "cuda" => cuda(0),
        other => {
            if let Some(n) = other.strip_prefix("cuda:") {
                match n.parse::<usize>() {
                    Ok(ordinal) => cuda(ordinal),
                    Err(_) => user_bail!(
                        "device {other:?}: the CUDA ordinal must be a number, e.g. cuda:0"
                    ),
                }
            } else {
                user_bail!("unknown device {other:?}; use cpu, cuda, cuda:N, metal or auto")
            }
        }
    }
}

/// The device's (free, total) memory in bytes, as its driver counts them: CUDA's
/// cuMemGetInfo. `None` for the CPU (see `util::available_memory_bytes`) and Metal.
pub fn gpu_memory(device: &Device) -> Option<(u64, u64)> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => {
            let (free, total) = cuda.cuda_stream().context().mem_get_info().ok()?;
            Some((free as u64, total as u64))
        }
        _ => None,
    }
}

/// Whether an error from a device says it ran out of memory (CUDA's
/// CUDA_ERROR_OUT_OF_MEMORY, cuBLAS's alloc failure, Metal's).
pub fn is_out_of_memory(error: &anyhow::Error) -> bool {
    let text = format!("{error:#}").to_ascii_lowercase();
    [
        "out_of_memory",
        "out of memory",
        "alloc_failed",
        "outofmemory",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// Whether a `--device` / `run.device` value asks for `auto` (measured where it matters).
pub fn is_auto(name: &str) -> bool {
    name.trim().eq_ignore_ascii_case("auto")
}

/// "cpu", "cuda:N" or "metal:N".
pub fn name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// The device `auto` chose, and the measurement behind it, for the user.
pub struct Choice {
    pub device: Device,
    pub why: String,
}

impl Choice {
    pub fn new(device: Device, why: impl Into<String>) -> Self {
        Self {
            device,
            why: why.into(),
        }
    }
}

impl std::fmt::Display for Choice {
    /// "cuda:0 (a training step took ...)".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", name(&self.device), self.why)
    }
}

/// The first CUDA device, where the build and the machine have one.
pub fn first_cuda() -> Option<Device> {
    if !cfg!(feature = "cuda") || !candle_core::utils::cuda_is_available() {
        return None;
    }
    Device::new_cuda(0).ok()
}

fn auto() -> Result<Device> {
    if cfg!(feature = "cuda") && candle_core::utils::cuda_is_available() {
        return cuda(0);
    }
    if cfg!(feature = "metal") && candle_core::utils::metal_is_available() {
        return metal(0);
    }
    Ok(Device::Cpu)
}

fn cuda(ordinal: usize) -> Result<Device> {
    if !cfg!(feature = "cuda") {
        user_bail!("this tinygpt was built without CUDA; install the CUDA build with `cargo install --path . --features cuda` (needs a CUDA toolkit), or use --device cpu");
    }
    Device::new_cuda(ordinal)
        .map_err(|e| crate::error::user_error(format!("cannot open CUDA device {ordinal}: {e}")))
}

fn metal(ordinal: usize) -> Result<Device> {
    if !cfg!(feature = "metal") {
        user_bail!("this tinygpt was built without Metal; install the Metal build with `cargo install --path . --features metal`, or use --device cpu");
    }
    Device::new_metal(ordinal)
        .map_err(|e| crate::error::user_error(format!("cannot open Metal device {ordinal}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ModelConfig, Precision};
    use crate::engine::{race::Work, EngineOptions};
    use crate::model::ModelSpec;

    /// `--device auto` races the CPU against a GPU; without one it takes the CPU for
    /// training and for decoding, saying why, and times nothing.
    #[test]
    fn without_a_gpu_the_cpu_is_chosen_and_says_why() {
        if first_cuda().is_some() {
            eprintln!("SKIPPED: this machine has a GPU; the race runs instead");
            return;
        }
        let spec = ModelSpec::new(&ModelConfig {
            vocab_size: 11,
            ..ModelConfig::default()
        });
        let options = EngineOptions::f32(2, true);
        let training =
            crate::engine::race::fastest_device(&spec, options, Work::Training, |_| true).unwrap();
        let decoding = crate::generate::choose::fastest_decoder(
            &spec,
            &spec.initial_values(1),
            1,
            Precision::F32,
        )
        .unwrap();
        // Metal has no fused engine to race: training takes it where present.
        if !cfg!(feature = "metal") {
            assert!(training.device.is_cpu());
        }
        assert!(decoding.device.is_cpu());
        for choice in [training, decoding] {
            assert_eq!(choice.why, "no CUDA device");
        }
    }

    #[test]
    fn out_of_memory_is_recognised_in_a_chain() {
        let cuda = anyhow::anyhow!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")")
            .context("matmul");
        assert!(is_out_of_memory(&cuda));
        assert!(is_out_of_memory(&anyhow::anyhow!(
            "CUBLAS_STATUS_ALLOC_FAILED"
        )));
        assert!(!is_out_of_memory(&anyhow::anyhow!(
            "shape mismatch in matmul"
        )));
    }

    #[test]
    fn names() {
        assert!(parse_device("cpu").unwrap().is_cpu());
        assert!(parse_device("CPU").unwrap().is_cpu());
        assert!(parse_device("gpu").is_err());
        assert!(parse_device("cuda:x").is_err());
        if !cfg!(feature = "cuda") {
            let e = parse_device("cuda").unwrap_err();
            assert!(format!("{e}").contains("--features cuda"));
        }
        if !cfg!(any(feature = "cuda", feature = "metal")) {
            assert!(parse_device("auto").unwrap().is_cpu());
        }
    }
}
