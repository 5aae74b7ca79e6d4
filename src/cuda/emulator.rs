//! The CUDA engine's device, emulated on the CPU (feature `cuda-emulator`): our kernels
//! compiled as C++ (`emulator/`, see cuda_shim.h) and launched by name, and cuBLAS's
//! column-major product written out plainly. For tests on machines without a GPU: the
//! engine's every step, index and formula runs as on the GPU, slowly.

use std::ffi::{c_char, c_void, CString};

use anyhow::{bail, Result};

use super::calls::{ColumnMajor, Epilogue, Launch, Operands};
use crate::config::Math;

extern "C" {
    fn tinygpt_emulate_launch(
        name: *const c_char,
        grid: *const u32,
        block: *const u32,
        args: *mut *mut c_void,
        sizes: *const usize,
        count: usize,
    ) -> i32;
}

/// Whether `TINYGPT_EMULATE_CUDA=costs` asks the emulator to count what the launches
/// and products would do (a profile) without running them: for the cost of shapes too
/// large to emulate (GPT-2's step), whose results are then meaningless.
pub fn costs_only() -> bool {
    static ONLY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ONLY.get_or_init(|| std::env::var_os("TINYGPT_EMULATE_CUDA").is_some_and(|v| v == "costs"))
}

/// Runs kernel `name` over `cfg`'s grid, block after block, once the number of
/// arguments and each one's size (`sizes`) match the kernel's parameters.
///
/// # Safety
/// As `Gpu::launch`: the arguments match the kernel's parameters, and every address
/// among them is into live host memory of the length the kernel reads.
pub unsafe fn launch(
    name: &str,
    cfg: Launch,
    args: &mut [*mut c_void],
    sizes: &[usize],
) -> Result<()> {
    let c_name = CString::new(name)?;
    let grid = [cfg.grid.0, cfg.grid.1, cfg.grid.2];
    let block = [cfg.threads, 1, 1];
    // SAFETY: as the caller promises; the name, grid, block and sizes outlive the call.
    let status = unsafe {
        tinygpt_emulate_launch(
            c_name.as_ptr(),
            grid.as_ptr(),
            block.as_ptr(),
            args.as_mut_ptr(),
            sizes.as_ptr(),
            sizes.len(),
        )
    };
    match status {
        0 => Ok(()),
        1 => bail!("the emulator has no kernel {name}"),
        3 => bail!(
            "{name} takes another number of arguments than {}",
            sizes.len()
        ),
        s if s >= 100 => bail!(
            "{name}: argument {} has another size than the kernel's parameter",
            s - 100
        ),
        _ => bail!(
            "{name}: {} threads is not a whole number of warps",
            cfg.threads
        ),
    }
}

/// cuBLAS's strided-batched product, column-major: C = alpha op(A) op(B) + beta C
/// (beta 0 ignores C, as cuBLAS does). Under `Math::Tf32` and `Math::Bf16` each f32
/// operand is rounded first and the sums stay f32, as the tensor cores do; bf16
/// operands in memory (`Operands::Bf16`) are read as they are. An epilogue takes each
/// f32 sum times alpha as cuBLASLt's documentation says (`finish`).
///
/// # Safety
/// The addresses are into live host buffers holding the matrices `g` describes: f32
/// ones, or A and B of bf16 bits; an epilogue's bias (bf16, m values) and aux (bf16,
/// C's shape and spacing).
pub unsafe fn gemm(g: &ColumnMajor, math: Math) {
    let round = |x: f32| match math {
        Math::F32 => x,
        Math::Tf32 => super::calls::round_to_tf32(x),
        Math::Bf16 => crate::cpu::bf16::round_to_bf16(x),
    };
    // SAFETY (each read): in the matrices the caller describes.
    let operand = |base: usize, i: usize| match g.operands {
        Operands::F32 => round(unsafe { *(base as *const f32).add(i) }),
        Operands::Bf16 => f32::from_bits(u32::from(unsafe { *(base as *const u16).add(i) }) << 16),
    };
    let width = match g.operands {
        Operands::F32 => 4,
        Operands::Bf16 => 2,
    };
    let at = |base: u64, i: usize, width: usize| base as usize + width * i;
    for batch in 0..g.batch {
        let (a, b, c) = (
            at(g.a, batch * g.stride_a, width),
            at(g.b, batch * g.stride_b, width),
            at(g.c, batch * g.stride_c, if g.c16 { 2 } else { 4 }),
        );
        for col in 0..g.n {
            for row in 0..g.m {
                let mut sum = 0f32;
                for k in 0..g.k {
                    let ai = if g.transa {
                        k + row * g.lda
                    } else {
                        row + k * g.lda
                    };
                    let bi = if g.transb {
                        col + k * g.ldb
                    } else {
                        k + col * g.ldb
                    };
                    sum += operand(a, ai) * operand(b, bi);
                }
                let at = row + col * g.ldc;
                // SAFETY: as above, the epilogue's buffers too.
                let value = unsafe { finish(g.epilogue, g.alpha * sum, row, at) };
                if g.c16 {
                    // SAFETY: as above; C of bf16 bits.
                    let out = unsafe { &mut *(c as *mut u16).add(at) };
                    *out = crate::cpu::bf16::to_bf16_bits(value);
                    continue;
                }
                // SAFETY: as above.
                let out = unsafe { &mut *(c as *mut f32).add(at) };
                *out = if g.beta == 0.0 {
                    value
                } else {
                    value + g.beta * *out
                };
            }
        }
    }
}

/// A sum (times alpha) at `row` of C, C's element `at`, through `epilogue`: BIAS adds
/// the bf16 bias in f32; GELU_AUX adds it so, keeps that rounded to bf16, and gives the GELU of the f32
/// value; DGELU multiplies by the GELU's slope at the bf16 value kept.
///
/// # Safety
/// The epilogue's bias holds `row` and its aux holds `at`.
unsafe fn finish(epilogue: Epilogue, sum: f32, row: usize, at: usize) -> f32 {
    use crate::cpu::bf16::to_bf16_bits;
    match epilogue {
        Epilogue::None => sum,
        // SAFETY: as the caller promises.
        Epilogue::Bias { bias } => sum + unsafe { bf16_at(bias, row) },
        Epilogue::GeluAux { bias, aux } => {
            let x = match bias {
                0 => sum,
                // SAFETY: as the caller promises.
                b => sum + unsafe { bf16_at(b, row) },
            };
            // SAFETY: as the caller promises.
            unsafe { *(aux as *mut u16).add(at) = to_bf16_bits(x) };
            gelu_tanh(x)
        }
        Epilogue::GeluBackward { aux } => {
            // SAFETY: as the caller promises.
            sum * gelu_tanh_slope(unsafe { bf16_at(aux, at) })
        }
    }
}

/// The bf16 value at index `i` of the bf16 buffer at `base`.
///
/// # Safety
/// The buffer holds index `i`.
unsafe fn bf16_at(base: u64, i: usize) -> f32 {
    f32::from_bits(u32::from(unsafe { *(base as *const u16).add(i) }) << 16)
}

/// GPT-2's tanh GELU, as cuBLASLt's GELU epilogues define it and kernels/activation.cu
/// computes it.
fn gelu_tanh(x: f32) -> f32 {
    let u = 0.797_884_6 * (x + 0.044715 * x * x * x);
    0.5 * x * (1.0 + u.tanh())
}

/// d gelu_tanh / dx.
fn gelu_tanh_slope(x: f32) -> f32 {
    let k = 0.797_884_6_f32;
    let t = (k * (x + 0.044715 * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)
}

/// Calls kept while the emulated device records (`Gpu::record`), to run when replayed:
/// each launch with a copy of its arguments' bytes, as a CUDA graph keeps them.
pub enum Recorded {
    Launch {
        name: &'static str,
        cfg: Launch,
        args: Vec<Vec<u8>>,
    },
    Gemm {
        g: ColumnMajor,
        math: Math,
    },
    /// A buffer's `bytes` set to zero.
    Zero {
        at: *mut u8,
        bytes: usize,
    },
}

thread_local! {
    /// The calls recorded so far, while recording.
    static RECORDING: std::cell::RefCell<Option<Vec<Recorded>>> = const { std::cell::RefCell::new(None) };
}

/// Starts keeping calls instead of running them.
pub fn start_recording() -> Result<()> {
    RECORDING.with(|r| {
        let mut r = r.borrow_mut();
        if r.is_some() {
            bail!("already recording");
        }
        *r = Some(Vec::new());
        Ok(())
    })
}

/// The calls kept since `start_recording`; runs calls again from here on.
pub fn stop_recording() -> Vec<Recorded> {
    RECORDING.with(|r| r.borrow_mut().take().unwrap_or_default())
}

pub fn is_recording() -> bool {
    RECORDING.with(|r| r.borrow().is_some())
}

/// Keeps `call` if recording (true), else leaves it to run (false).
pub fn record(call: impl FnOnce() -> Recorded) -> bool {
    RECORDING.with(|r| match r.borrow_mut().as_mut() {
        Some(calls) => {
            calls.push(call());
            true
        }
        None => false,
    })
}

/// Runs recorded calls in order.
///
/// # Safety
/// Every address among their arguments is still into live memory of the length the
/// call reads (the buffers recorded outlive the recording).
pub unsafe fn replay(calls: &[Recorded]) -> Result<()> {
    for call in calls {
        match call {
            Recorded::Launch { name, cfg, args } => {
                let mut bytes = args.clone();
                let mut ptrs: Vec<*mut c_void> =
                    bytes.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
                let sizes: Vec<usize> = args.iter().map(Vec::len).collect();
                // SAFETY: as the caller promises; the bytes are the arguments as recorded.
                unsafe { launch(name, *cfg, &mut ptrs, &sizes) }?;
            }
            // SAFETY: as the caller promises.
            Recorded::Gemm { g, math } => unsafe { gemm(g, *math) },
            // SAFETY: as the caller promises: `bytes` of live memory from `at`.
            Recorded::Zero { at, bytes } => unsafe { std::ptr::write_bytes(*at, 0, *bytes) },
        }
    }
    Ok(())
}
