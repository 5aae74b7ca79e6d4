//! The device a profile measures the fused CUDA engine against: on a GPU, CUDA events
//! time each launch and product, and the step is held to the GPU's published peak (a
//! product and a streaming pass are also timed here, and stand in for a GPU the
//! table does not know); in the emulator nothing is timed, and the FLOPs and bytes
//! are held to an H100's published peak: the floor a design would have there.

use anyhow::Result;

use super::gpu::Gpu;
use crate::config::Math;
use crate::profile::{published_gpu_peak, Peak, Profiled, Timing};

/// How the engine's work on `gpu`, products in `precision`, is profiled.
pub fn profiled(gpu: &Gpu, math: Math) -> Result<Profiled> {
    match gpu {
        #[cfg(feature = "cuda")]
        Gpu::Cuda(g) => {
            let name = g.stream.context().name()?;
            // Measured beside the engine's buffers: where memory is too short for the
            // few hundred MB it takes, the published figures stand alone.
            let measured = measure(gpu, g, math);
            let peak = match (published_gpu_peak(&name, math), measured) {
                (Some(published), measured) => Peak {
                    measured: measured.ok(),
                    ..published
                },
                (None, measured) => Peak::measured(name, measured?),
            };
            Ok(Profiled {
                timing: Timing::CudaEvents,
                peak,
            })
        }
        #[cfg(feature = "cuda-emulator")]
        Gpu::Emulated => {
            let h100 = published_gpu_peak("H100 SXM", math).expect("the table has the H100");
            Ok(Profiled {
                timing: Timing::Untimed,
                peak: Peak {
                    device: "an H100 SXM (the kernels emulated)".into(),
                    ..h100
                },
            })
        }
    }
}

/// Ten large products in `precision` (4096³, bf16 or f32 operands in memory) and ten
/// streaming passes (a residual add over 16M values: 192 MB moved each), each the best
/// of five after one untimed: about 320 MB beside the engine.
#[cfg(feature = "cuda")]
fn measure(gpu: &Gpu, g: &super::gpu::CudaGpu, math: Math) -> Result<crate::profile::Measured> {
    use super::buffers::Buf;
    use super::calls::{ColumnMajor, Epilogue, Operands};
    use super::kernels::DropoutArgs;
    use crate::profile::Group;

    const REPEATS: usize = 10;
    // Seconds of one `work`: the best of five rounds of REPEATS.
    let best_of_five = |work: &dyn Fn() -> Result<()>| -> Result<f64> {
        work()?;
        g.stream.synchronize()?;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = std::time::Instant::now();
            for _ in 0..REPEATS {
                work()?;
            }
            g.stream.synchronize()?;
            best = best.min(t.elapsed().as_secs_f64() / REPEATS as f64);
        }
        Ok(best)
    };
    let n = 4096;
    let operands = match math {
        Math::Bf16 => Operands::Bf16,
        Math::F32 | Math::Tf32 => Operands::F32,
    };
    // Operands of ones (bf16 1.0 is 0x3f80): zeros would spare the units' power.
    let (a, b): (u64, u64);
    let (_a16, _b16, _a32, _b32);
    match operands {
        Operands::Bf16 => {
            _a16 = Buf::<u16>::from_host(gpu, &vec![0x3f80; n * n])?;
            _b16 = Buf::<u16>::from_host(gpu, &vec![0x3f80; n * n])?;
            (a, b) = (_a16.ptr(), _b16.ptr());
        }
        Operands::F32 => {
            _a32 = Buf::<f32>::from_host(gpu, &vec![1.0; n * n])?;
            _b32 = Buf::<f32>::from_host(gpu, &vec![1.0; n * n])?;
            (a, b) = (_a32.ptr(), _b32.ptr());
        }
    }
    let c = Buf::<f32>::zeros(gpu, n * n)?;
    let product = ColumnMajor {
        operands,
        transa: false,
        transb: false,
        m: n,
        n,
        k: n,
        alpha: 1.0,
        a,
        lda: n,
        stride_a: 0,
        b,
        ldb: n,
        stride_b: 0,
        beta: 0.0,
        c: c.ptr(),
        ldc: n,
        stride_c: 0,
        batch: 1,
        c16: false,
        epilogue: Epilogue::None,
    };
    // SAFETY: the three buffers are live and n x n.
    let seconds = best_of_five(&|| unsafe { gpu.gemm(&product, math, Group::Copy) })?;
    let matrix_tflops = 2.0 * (n as f64).powi(3) / seconds / 1e12;

    let len = 1 << 24;
    let (x, y, out) = (
        Buf::<f32>::zeros(gpu, len)?,
        Buf::<f32>::zeros(gpu, len)?,
        Buf::<f32>::zeros(gpu, len)?,
    );
    let seconds =
        best_of_five(&|| gpu.residual(out.ptr(), x.ptr(), y.ptr(), len, DropoutArgs::NONE))?;
    Ok(crate::profile::Measured {
        matrix_tflops,
        one_thread_tflops: None,
        bandwidth_gbs: 12.0 * len as f64 / seconds / 1e9,
    })
}
