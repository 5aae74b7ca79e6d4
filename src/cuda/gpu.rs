//! Where the fused CUDA engine's buffers live and its kernels run: a CUDA device, or,
//! with the feature `cuda-emulator`, the same kernels compiled for the CPU
//! (`emulator/`), so tests hold the whole engine to the reference on machines without
//! a GPU. The engine is written once against [`Gpu`]; only launching a kernel, a
//! matrix product and moving bytes differ.

use std::ffi::c_void;
#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use anyhow::Context;
use anyhow::Result;
#[cfg(feature = "cuda")]
use candle_core::cuda::cudarc::{
    cublas::{self, sys, CudaBlas},
    driver::{result, CudaFunction, CudaStream},
};

use super::calls::{Arg, ColumnMajor, Kernel, Launch, MAX_ARGS};
use crate::config::Math;
use crate::profile::{self, Cost, Group};

/// The thread that built an engine or decoder. Its work goes to that thread's stream
/// (candle's per-thread default stream on CUDA), so work sent from another thread
/// would not be ordered after it: uploads racing kernels, buffers freed under them.
/// Refused instead, in one line.
#[derive(Debug, Clone, Copy)]
pub struct OwnerThread(std::thread::ThreadId);

impl OwnerThread {
    pub fn here() -> Self {
        Self(std::thread::current().id())
    }

    /// An error unless this is the owner's thread; `what` names the engine or decoder.
    pub fn check(&self, what: &str) -> Result<()> {
        let here = std::thread::current().id();
        anyhow::ensure!(
            here == self.0,
            "{what} was built on thread {:?} and used on {here:?}: its CUDA work is ordered on the stream of the thread that built it, so drive it from that thread",
            self.0
        );
        Ok(())
    }
}

/// The device the engine runs on.
pub enum Gpu {
    #[cfg(feature = "cuda")]
    Cuda(CudaGpu),
    /// The kernels run as C++ on the CPU, one block after another.
    #[cfg(feature = "cuda-emulator")]
    Emulated,
}

/// A CUDA device's stream (candle's, so candle's tensors and ours are ordered), a
/// cuBLAS handle of ours on it with its own work space, and our kernels loaded on it.
#[cfg(feature = "cuda")]
pub struct CudaGpu {
    pub stream: Arc<CudaStream>,
    /// Ours, not candle's: it gets a work space (`BLAS_WORKSPACE`) that lives exactly
    /// as long as it (fields drop in order: the handle before its work space).
    pub blas: Arc<CudaBlas>,
    _blas_workspace: candle_core::cuda::cudarc::driver::CudaSlice<u8>,
    /// cuBLASLt, for products with an epilogue (none where its handle could not be
    /// made: the engine keeps its kernels then). It shares cuBLAS's work space: both
    /// queue on the one stream, so their uses never overlap.
    lt: Option<super::lt::Lt>,
    /// The work space's address.
    workspace: u64,
    /// Indexed by `Kernel as usize`.
    functions: Vec<CudaFunction>,
    /// Timing events a profile has finished with, reused (creating two a launch would
    /// add its cost to what is timed).
    events: Arc<std::sync::Mutex<Vec<candle_core::cuda::cudarc::driver::CudaEvent>>>,
}

/// Why a kernel did not load, for the user: a driver older than the toolkit that built
/// the PTX, or a GPU older than the architecture it targets, is one line saying what
/// to install or how to rebuild (exit 2); anything else names the kernel.
#[cfg(feature = "cuda")]
fn kernel_load_error(name: &str, e: candle_core::Error) -> anyhow::Error {
    let text = e.to_string();
    let mismatch = [
        "UNSUPPORTED_PTX_VERSION",
        "NO_BINARY_FOR_GPU",
        "INVALID_PTX",
        "JIT_COMPILER_NOT_FOUND",
    ];
    if mismatch.iter().any(|code| text.contains(code)) {
        let arch = env!("TINYGPT_PTX_ARCH");
        let (major, minor) = arch.split_at(arch.len().saturating_sub(1));
        let toolkit = match env!("TINYGPT_NVCC_VERSION") {
            "" => "this build's CUDA toolkit".to_string(),
            v => format!("CUDA {v}"),
        };
        return crate::error::user_error(format!(
            "the GPU cannot load tinygpt's CUDA kernels ({text}): they are PTX for compute capability {major}.{minor} from {toolkit}; install an NVIDIA driver for {toolkit} or newer, or rebuild with the toolkit this driver supports (and CUDA_COMPUTE_CAP=<the GPU's capability> for a GPU older than {major}.{minor}); `tinygpt doctor` shows the driver"
        ));
    }
    anyhow::Error::new(e).context(format!("loading the CUDA kernel {name}"))
}

/// The work space given to our cuBLAS handle. cuBLAS documents setting one with
/// `cublasSetWorkspace` before products are captured into a CUDA graph: otherwise it
/// may allocate during capture, or a replayed graph may use a work space it has freed.
/// 32 MiB is its recommendation for Hopper (4 MiB would do before).
#[cfg(feature = "cuda")]
const BLAS_WORKSPACE: usize = 32 << 20;

impl Gpu {
    /// The candle device `device`, which must be a CUDA one, with our kernels loaded
    /// (PTX from build.rs); `what` names the caller in the error.
    #[cfg(feature = "cuda")]
    pub fn cuda(device: &candle_core::Device, what: &str) -> Result<Self> {
        let candle_core::Device::Cuda(dev) = device else {
            anyhow::bail!("{what} runs on a CUDA device, not {device:?}");
        };
        let functions = Kernel::ALL
            .iter()
            .map(|k| {
                let module = k.module();
                let name = k.name();
                let func = dev
                    .get_or_load_custom_func(name, &format!("tinygpt_{module}"), ptx(module))
                    .map_err(|e| kernel_load_error(name, e))?;
                Ok(func.into_cuda_function())
            })
            .collect::<Result<Vec<_>>>()?;
        let stream = dev.cuda_stream();
        let blas = CudaBlas::new(stream.clone()).context("creating a cuBLAS handle")?;
        let workspace = stream
            .alloc_zeros::<u8>(BLAS_WORKSPACE)
            .context("allocating cuBLAS's work space")?;
        let workspace_ptr = {
            use candle_core::cuda::cudarc::driver::DevicePtr;
            let ptr = workspace.device_ptr(&stream).0;
            // SAFETY: the handle is live and the work space outlives it (field order).
            unsafe {
                sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut c_void, BLAS_WORKSPACE)
            }
            .result()
            .context("setting cuBLAS's work space")?;
            ptr
        };
        Ok(Self::Cuda(CudaGpu {
            stream,
            blas: Arc::new(blas),
            _blas_workspace: workspace,
            lt: super::lt::Lt::new().ok(),
            workspace: workspace_ptr,
            functions,
            events: Arc::default(),
        }))
    }

    /// Makes the device's context current on this thread (cuBLAS and raw driver calls
    /// need it). The work goes to the stream of the thread that made the engine, so one
    /// thread drives it.
    pub fn bind(&self) -> Result<()> {
        match self {
            #[cfg(feature = "cuda")]
            Gpu::Cuda(gpu) => Ok(gpu.stream.context().bind_to_thread()?),
            #[cfg(feature = "cuda-emulator")]
            Gpu::Emulated => Ok(()),
        }
    }

    /// Launches `kernel` with `args` in cuLaunchKernel's convention (each the address
    /// of parameter i's value); a profile counts it in `group` as doing `cost`.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and
    /// every pointer among them must address live memory of this device as long as the
    /// kernel reads it.
    pub unsafe fn launch(
        &self,
        kernel: Kernel,
        cfg: Launch,
        (group, cost): (Group, Cost),
        args: &[Arg],
    ) -> Result<()> {
        anyhow::ensure!(
            args.len() <= MAX_ARGS,
            "{}: too many arguments",
            kernel.name()
        );
        let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for (p, a) in ptrs.iter_mut().zip(args) {
            *p = a.ptr;
        }
        let ptrs = &mut ptrs[..args.len()];
        match self {
            #[cfg(feature = "cuda")]
            Gpu::Cuda(gpu) => {
                let func = gpu.functions[kernel as usize].cu_function();
                let block = (cfg.threads, 1, 1);
                gpu.timed(group, cost, || {
                    // SAFETY: as the caller promises; the stream is the engine's.
                    unsafe {
                        result::launch_kernel(
                            func,
                            cfg.grid,
                            block,
                            0,
                            gpu.stream.cu_stream(),
                            ptrs,
                        )
                    }
                    .with_context(|| format!("launching {}", kernel.name()))
                })
            }
            #[cfg(feature = "cuda-emulator")]
            Gpu::Emulated => {
                let kept = super::emulator::record(|| super::emulator::Recorded::Launch {
                    name: kernel.name(),
                    cfg,
                    args: args
                        .iter()
                        // SAFETY: each argument's value is `size` bytes at `ptr`.
                        .map(|a| unsafe { std::slice::from_raw_parts(a.ptr.cast::<u8>(), a.size) })
                        .map(<[u8]>::to_vec)
                        .collect(),
                });
                if kept {
                    return Ok(());
                }
                profile::record(group, cost, None);
                if super::emulator::costs_only() {
                    return Ok(());
                }
                let mut sizes = [0usize; MAX_ARGS];
                for (s, a) in sizes.iter_mut().zip(args) {
                    *s = a.size;
                }
                let sizes = &sizes[..args.len()];
                unsafe { super::emulator::launch(kernel.name(), cfg, ptrs, sizes) }
            }
        }
    }

    /// The column-major product `g`, f32, or with operands rounded to bf16 on the
    /// tensor cores (cuBLAS's 32F_FAST_16BF; f32 sums, data f32 in memory), or with an
    /// epilogue (cuBLASLt; bf16 operands); a profile counts it in `group`.
    ///
    /// # Safety
    /// Its addresses are into live buffers of this device holding the matrices it
    /// describes.
    pub unsafe fn gemm(&self, g: &ColumnMajor, math: Math, group: Group) -> Result<()> {
        match self {
            #[cfg(feature = "cuda")]
            Gpu::Cuda(gpu) if g.epilogue != super::calls::Epilogue::None => {
                let lt = gpu
                    .lt
                    .as_ref()
                    .context("a fused product without cuBLASLt")?;
                let stream = gpu.stream.cu_stream() as _;
                let workspace = (gpu.workspace, BLAS_WORKSPACE);
                gpu.timed(group, g.cost(), || unsafe {
                    lt.matmul(g, stream, workspace)
                })
            }
            #[cfg(feature = "cuda")]
            Gpu::Cuda(gpu) => gpu.timed(group, g.cost(), || unsafe {
                cublas_gemm(&gpu.blas, g, math)
            }),
            #[cfg(feature = "cuda-emulator")]
            Gpu::Emulated => {
                let g = *g;
                if !super::emulator::record(|| super::emulator::Recorded::Gemm { g, math }) {
                    profile::record(group, g.cost(), None);
                    if !super::emulator::costs_only() {
                        unsafe { super::emulator::gemm(&g, math) };
                    }
                }
                Ok(())
            }
        }
    }

    /// Records the launches and products `work` makes, without running them, to run
    /// later as one (`replay`): a CUDA graph, in the emulator the calls kept with their
    /// arguments. Nothing recorded may depend on values that change between replays
    /// except through device memory (arguments are fixed when recorded), and `work`
    /// copies nothing between host and device (an error in the emulator, in capture on
    /// CUDA).
    pub fn record(&self, work: impl FnOnce() -> Result<()>) -> Result<Recording> {
        match self {
            #[cfg(feature = "cuda")]
            Gpu::Cuda(gpu) => {
                use candle_core::cuda::cudarc::driver::sys;
                // Relaxed: cuBLAS may allocate its work space at its first product.
                let relaxed = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
                gpu.stream.begin_capture(relaxed)?;
                // Capture ends whatever `work` did, even a panic, so the stream (candle's
                // too) runs work again.
                let worked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
                let graph = gpu.stream.end_capture(sys::CUgraphInstantiate_flags(0));
                let worked = worked.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                worked?;
                let graph = graph?.context("the CUDA graph recorded nothing")?;
                graph.upload()?;
                Ok(Recording::Cuda(graph))
            }
            #[cfg(feature = "cuda-emulator")]
            Gpu::Emulated => {
                super::emulator::start_recording()?;
                let worked = work();
                let calls = super::emulator::stop_recording();
                worked?;
                Ok(Recording::Emulated(calls))
            }
        }
    }

    /// Runs what `record` recorded on this device.
    pub fn replay(&self, recording: &Recording) -> Result<()> {
        match (self, recording) {
            #[cfg(feature = "cuda")]
            (Gpu::Cuda(_), Recording::Cuda(graph)) => Ok(graph.launch()?),
            // SAFETY: the recording's buffers belong to its owner, which replays it.
            #[cfg(feature = "cuda-emulator")]
            (Gpu::Emulated, Recording::Emulated(calls)) => unsafe {
                super::emulator::replay(calls)
            },
            #[allow(unreachable_patterns)]
            _ => anyhow::bail!("a recording replays on the device that recorded it"),
        }
    }

    /// Whether the product `g`, with its epilogue, can run here: one cuBLASLt documents
    /// (`ColumnMajor::documented_epilogue`), and on CUDA one its heuristic has an
    /// algorithm for.
    pub fn fuses(&self, g: &ColumnMajor) -> bool {
        if !g.documented_epilogue() {
            return false;
        }
        match self {
            #[cfg(feature = "cuda")]
            Gpu::Cuda(gpu) => gpu
                .lt
                .as_ref()
                .is_some_and(|lt| lt.supports(g, BLAS_WORKSPACE)),
            #[cfg(feature = "cuda-emulator")]
            Gpu::Emulated => true,
        }
    }

    /// Whether calls are being recorded, not run (copies are refused then).
    pub fn is_recording(&self) -> bool {
        match self {
            // The driver refuses what capture cannot hold itself.
            #[cfg(feature = "cuda")]
            Gpu::Cuda(_) => false,
            #[cfg(feature = "cuda-emulator")]
            Gpu::Emulated => super::emulator::is_recording(),
        }
    }
}

#[cfg(feature = "cuda")]
impl CudaGpu {
    /// Runs `work` (queued on the stream), between two events when a profile is on:
    /// their interval is its time on the GPU, read once the step has run.
    fn timed(&self, group: Group, cost: Cost, work: impl FnOnce() -> Result<()>) -> Result<()> {
        if !profile::is_on() {
            return work();
        }
        use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
        let event = || -> Result<_> {
            let reused = self.events.lock().ok().and_then(|mut free| free.pop());
            let event = match reused {
                Some(event) => event,
                None => self
                    .stream
                    .context()
                    .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
            };
            event
                .record(&self.stream)
                .context("recording a profile's CUDA event")?;
            Ok(event)
        };
        let start = event()?;
        work()?;
        let end = event()?;
        let pool = self.events.clone();
        let pair = EventPair {
            events: Some((start, end)),
            pool,
        };
        profile::record_later(group, cost, Box::new(pair));
        Ok(())
    }
}

/// A piece of work's start and end on a stream, given back to the pool once read.
#[cfg(feature = "cuda")]
struct EventPair {
    /// (start, end); taken back into the pool when dropped.
    events: Option<(
        candle_core::cuda::cudarc::driver::CudaEvent,
        candle_core::cuda::cudarc::driver::CudaEvent,
    )>,
    pool: Arc<std::sync::Mutex<Vec<candle_core::cuda::cudarc::driver::CudaEvent>>>,
}

#[cfg(feature = "cuda")]
impl Drop for EventPair {
    fn drop(&mut self) {
        if let (Some((start, end)), Ok(mut free)) = (self.events.take(), self.pool.lock()) {
            free.extend([start, end]);
        }
    }
}

#[cfg(feature = "cuda")]
impl profile::Elapsed for EventPair {
    fn seconds(&self) -> Result<f64> {
        let (start, end) = self.events.as_ref().context("events already given back")?;
        let ms = start
            .elapsed_ms(end)
            .context("reading a profile's CUDA events")?;
        Ok(f64::from(ms) / 1e3)
    }
}

/// Whether the emulator only counts the engine's work (`TINYGPT_EMULATE_CUDA=costs`):
/// never in builds without it.
pub fn emulator_counts_only() -> bool {
    #[cfg(feature = "cuda-emulator")]
    return super::emulator::costs_only();
    #[cfg(not(feature = "cuda-emulator"))]
    false
}

/// Work recorded once and replayed as one (`Gpu::record`).
pub enum Recording {
    #[cfg(feature = "cuda")]
    Cuda(candle_core::cuda::cudarc::driver::CudaGraph),
    #[cfg(feature = "cuda-emulator")]
    Emulated(Vec<super::emulator::Recorded>),
}

/// The PTX of one kernel file, compiled by build.rs.
#[cfg(feature = "cuda")]
fn ptx(module: &str) -> &'static str {
    macro_rules! ptx {
        ($($module:literal),*) => {
            match module {
                $($module => include_str!(concat!(env!("OUT_DIR"), "/", $module, ".ptx")),)*
                other => unreachable!("no kernel file {other}.cu"),
            }
        };
    }
    super::calls::kernel_files!(ptx)
}

/// cuBLAS's strided-batched product (`Gpu::gemm` on CUDA; same safety contract).
#[cfg(feature = "cuda")]
unsafe fn cublas_gemm(blas: &CudaBlas, g: &ColumnMajor, math: Math) -> Result<()> {
    use sys::cublasComputeType_t::{
        CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_COMPUTE_32F_FAST_TF32,
    };
    use sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_32F};
    // bf16 operands in memory sum in f32; f32 ones stay f32, or are rounded to TF32 or
    // bf16 on the tensor cores.
    use super::calls::Operands;
    let (operands, compute) = match (g.operands, math) {
        (Operands::Bf16, _) => (CUDA_R_16BF, CUBLAS_COMPUTE_32F),
        (Operands::F32, Math::F32) => (CUDA_R_32F, CUBLAS_COMPUTE_32F),
        (Operands::F32, Math::Tf32) => (CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32),
        (Operands::F32, Math::Bf16) => (CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_16BF),
    };
    let op = |t: bool| {
        if t {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let dim = |x: usize| i32::try_from(x).context("a matrix dimension over 2^31");
    // SAFETY: the addresses are as the caller promises, on the handle's stream; alpha
    // and beta are host values that outlive the call.
    unsafe {
        cublas::result::gemm_strided_batched_ex(
            *blas.handle(),
            op(g.transa),
            op(g.transb),
            dim(g.m)?,
            dim(g.n)?,
            dim(g.k)?,
            (&g.alpha) as *const f32 as *const _,
            g.a as *const _,
            operands,
            dim(g.lda)?,
            g.stride_a as i64,
            g.b as *const _,
            operands,
            dim(g.ldb)?,
            g.stride_b as i64,
            (&g.beta) as *const f32 as *const _,
            g.c as *mut _,
            // bf16 results only of bf16 operands: cuBLAS's 32F compute takes that pair.
            if g.c16 { CUDA_R_16BF } else { CUDA_R_32F },
            dim(g.ldc)?,
            g.stride_c as i64,
            dim(g.batch)?,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .context("cuBLAS matmul")
}
