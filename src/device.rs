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
            if let Some(n) = other.strip_prefix("metal:") {
                match n.parse::<usize>() {
                    Ok(ordinal) => metal(ordinal),
                    Err(_) => user_bail!(
                        "device {other:?}: the Metal ordinal must be a number, e.g. metal:0"
                    ),
                }
            } else if let Some(n) = other.strip_prefix("cuda:") {
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
/// cuMemGetInfo; Metal's recommended working set, less what this process holds of it.
/// `None` for the CPU (see `util::available_memory_bytes`).
pub fn gpu_memory(device: &Device) -> Option<(u64, u64)> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => {
            let (free, total) = cuda.cuda_stream().context().mem_get_info().ok()?;
            Some((free as u64, total as u64))
        }
        #[cfg(feature = "metal")]
        Device::Metal(metal) => {
            let gpu = metal.device();
            let total = gpu.recommended_max_working_set_size() as u64;
            let used = gpu.current_allocated_size() as u64;
            Some((total.saturating_sub(used), total))
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
        // Metal: a buffer the device would not make (past its largest or its memory).
        "failed to create metal resource",
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

/// The first Metal device, where the build and the Mac have one that candle can open.
pub fn first_metal() -> Option<Device> {
    if !cfg!(feature = "metal") {
        return None;
    }
    metal(0).ok()
}

fn auto() -> Result<Device> {
    if cfg!(feature = "cuda") && candle_core::utils::cuda_is_available() {
        return cuda(0);
    }
    Ok(first_metal().unwrap_or(Device::Cpu))
}

fn cuda(ordinal: usize) -> Result<Device> {
    if !cfg!(feature = "cuda") {
        // A build for ranks keeps them: NCCL between GPUs, MPI to start them.
        let (features, needs) = if cfg!(feature = "mpi") {
            ("cuda,nccl,mpi", "a CUDA toolkit and NCCL")
        } else {
            ("cuda", "a CUDA toolkit")
        };
        user_bail!("this tinygpt was built without CUDA; install the CUDA build with `cargo install --path . --features {features}` (needs {needs}), or use --device cpu");
    }
    Device::new_cuda(ordinal)
        .map_err(|e| crate::error::user_error(format!("cannot open CUDA device {ordinal}: {e}")))
}

fn metal(ordinal: usize) -> Result<Device> {
    if !cfg!(feature = "metal") {
        user_bail!("this tinygpt was built without Metal; install the Metal build with `cargo install --path . --features metal`, or use --device cpu");
    }
    if let Some(version) = macos_version().filter(|v| v.0 < METAL_MACOS.0) {
        user_bail!(
            "Metal in this build needs macOS {}.0 or later (candle's Metal backend asks for its residency sets); this Mac runs {}.{}: use --device cpu, or update macOS",
            METAL_MACOS.0,
            version.0,
            version.1
        );
    }
    // candle's Metal backend panics, rather than failing, where the machine has no
    // Metal device or its Metal lacks a class it uses: said here as an error.
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let opened = std::panic::catch_unwind(|| Device::new_metal(ordinal));
    std::panic::set_hook(quiet);
    let opened = opened.unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("candle's Metal backend panicked");
        Err(candle_core::Error::Msg(why.to_string()))
    });
    opened.map_err(|e| {
        crate::error::user_error(format!(
            "cannot open Metal device {ordinal}: {e}; use --device cpu"
        ))
    })
}

/// Refuses bf16 on a Metal device whose candle kernels lack it, in one line: candle
/// compiles its bf16 kernels only where the Metal language has `bfloat` (macOS 14 on,
/// the binary built for it: `.cargo/config.toml` sets MACOSX_DEPLOYMENT_TARGET).
pub fn require_metal_bf16(device: &Device) -> Result<()> {
    use candle_core::{DType, Tensor};
    let probe = || -> candle_core::Result<Vec<f32>> {
        let a = Tensor::new(&[[1.5f32, -2.0], [0.25, 4.0]], device)?.to_dtype(DType::BF16)?;
        a.matmul(&a)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
    };
    match probe() {
        // [[1.5, -2], [0.25, 4]]² = [[1.75, -11], [1.375, 15.5]], exact in bf16.
        Ok(v) if v == [1.75, -11.0, 1.375, 15.5] => Ok(()),
        Ok(v) => user_bail!(
            "bf16 on {} computes wrong ({v:?} for a worked 2x2 product); use f32 (train.dtype = \"f32\", --dtype f32) or --device cpu",
            name(device)
        ),
        Err(e) => user_bail!(
            "bf16 on {} is not available ({e}); use f32 (train.dtype = \"f32\", --dtype f32) or --device cpu",
            name(device)
        ),
    }
}

/// The oldest macOS whose Metal candle's backend runs on: it makes
/// MTLResidencySetDescriptor objects, which came with macOS 15.
const METAL_MACOS: (u32, u32) = (15, 0);

/// This Mac's macOS version (sysctl kern.osproductversion), `None` elsewhere.
pub fn macos_version() -> Option<(u32, u32)> {
    #[cfg(target_os = "macos")]
    {
        let mut buf = [0u8; 32];
        let mut len = buf.len();
        // Safety: the name is NUL-terminated; sysctl writes at most `len` bytes to buf.
        let status = unsafe {
            libc::sysctlbyname(
                c"kern.osproductversion".as_ptr(),
                buf.as_mut_ptr().cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        if status != 0 {
            return None;
        }
        let text = std::str::from_utf8(&buf[..len])
            .ok()?
            .trim_end_matches('\0');
        let mut parts = text.split('.').map(|p| p.parse::<u32>().ok());
        let major = parts.next()??;
        let minor = parts.next().flatten().unwrap_or(0);
        Some((major, minor))
    }
    #[cfg(not(target_os = "macos"))]
    None
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
            crate::errln!("SKIPPED: this machine has a GPU; the race runs instead");
            return;
        }
        let spec = ModelSpec::new(&ModelConfig {
            vocab_size: 11,
            ..ModelConfig::default()
        });
        let options = EngineOptions::f32(2, true);
        let training =
            crate::engine::race::fastest_device(&spec, options, Work::Training, |_| true).unwrap();
        let decoding = crate::generate::race::fastest_decoder(
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
            // A Metal build on a Mac adds why it took Metal.
            assert!(choice.why.starts_with("no CUDA device"), "{}", choice.why);
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
        let e = parse_device("metal:x").unwrap_err();
        assert!(format!("{e}").contains("metal:0"), "{e}");
        if !cfg!(feature = "metal") {
            let e = parse_device("metal:1").unwrap_err();
            assert!(format!("{e}").contains("--features metal"), "{e}");
        }
        if !cfg!(feature = "cuda") {
            let e = parse_device("cuda").unwrap_err();
            assert!(format!("{e}").contains("--features cuda"));
        }
        if !cfg!(any(feature = "cuda", feature = "metal")) {
            assert!(parse_device("auto").unwrap().is_cpu());
        }
    }
}
