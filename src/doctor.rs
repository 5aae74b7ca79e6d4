//! `tinygpt doctor`: whether this build computes right on this machine, in seconds.
//!
//! The test suite holds every engine and decoder to the reference, but it runs where
//! we build; a user's CPU (another vector level) or GPU (real cuBLAS, real graphs,
//! another driver) is where a wrong number would first appear. So the same comparisons
//! run here, small: per CPU level the kernels against f64 sums, then per place (the
//! CPU, the CUDA engine under its emulator in such builds, each GPU) a few training
//! steps of the fused engine against the reference engine (loss, every gradient, the
//! weights after AdamW) and the fused decoder against the reference one (every step's
//! logits), and on CUDA that one-token steps really replay their recorded graph.
//!
//! Each check reports its error (relative to the largest value it compares) and the
//! bound it is held to, the same bounds the tests use.
//!
//! The first time the fused CUDA engine is built on a GPU (a given GPU, driver and
//! binary), the CUDA part runs by itself (`cuda_first_use`) and its verdict is
//! remembered in the cache folder; a failure is said in one line and the caller falls
//! back to the reference (candle's ops), so a wrong kernel on new hardware costs speed,
//! not a silently wrong model.

use anyhow::Result;
use candle_core::Device;
use serde::Serialize;

use crate::config::{ModelConfig, PositionKind, Precision, TrainConfig};
use crate::cpu::isa::{self, Isa};
use crate::data::Batch;
use crate::engine::{self, Engine, EngineOptions};
use crate::model::named::NamedTensors;
use crate::model::ModelSpec;
use crate::optim::AdamWStep;

/// One comparison: `error` against `bound`.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Where it ran: "cpu (avx2)", "cuda (emulated)", "cuda:0".
    pub place: String,
    pub name: String,
    pub error: f64,
    pub bound: f64,
    pub passed: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// What each place is (CPU model and features; GPU name, compute capability,
    /// memory, driver).
    pub devices: Vec<(String, String)>,
    pub checks: Vec<Check>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }

    fn check(&mut self, place: &str, name: &str, error: f64, bound: f64) {
        self.checks.push(Check {
            place: place.into(),
            name: name.into(),
            error,
            bound,
            // NaN fails.
            passed: error <= bound,
        });
    }
}

/// A fault to inject on purpose (for testing that a wrong result fails): the name of a
/// check whose fused result is perturbed before it is compared.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    pub perturb: Option<String>,
}

impl Faults {
    /// From `TINYGPT_DOCTOR_FAULT` (a check name, e.g. "engine gradients").
    pub fn from_env() -> Self {
        Self {
            perturb: std::env::var("TINYGPT_DOCTOR_FAULT").ok(),
        }
    }

    fn applies(&self, name: &str) -> bool {
        self.perturb.as_deref() == Some(name)
    }

    /// `x` as computed, or off by 1% where this check is the one to break.
    fn apply(&self, name: &str, x: f64) -> f64 {
        if self.applies(name) {
            x * 1.01 + 0.01
        } else {
            x
        }
    }
}

/// Runs every check this build and machine allow.
pub fn run(faults: &Faults) -> Result<Report> {
    let mut report = Report {
        devices: vec![("cpu".into(), cpu_description())],
        checks: Vec::new(),
    };
    let best = isa::active();
    for level in Isa::supported() {
        isa::force(Some(level));
        let place = format!("cpu ({})", level.name());
        let kernels = kernel_errors(faults);
        isa::force(None);
        for (name, error, bound) in kernels? {
            report.check(&place, name, error, bound);
        }
    }
    isa::force(None);
    let place = format!("cpu ({})", best.name());
    let cpu = Device::Cpu;
    engine_checks(&mut report, &place, faults, &|spec, values, batch| {
        let options = EngineOptions::f32(batch, true);
        engine::build(spec, values, &cpu, options)
    })?;
    cpu_decoder_check(&mut report, &place, faults)?;
    #[cfg(feature = "cuda-emulator")]
    cuda_checks(&mut report, "cuda (emulated)", None, faults)?;
    #[cfg(feature = "cuda")]
    if let Some(gpu) = crate::device::first_cuda() {
        report
            .devices
            .push((crate::device::name(&gpu), gpu_description(&gpu)));
        cuda_checks(&mut report, &crate::device::name(&gpu), Some(&gpu), faults)?;
    }
    #[cfg(feature = "metal")]
    if let Some(gpu) = crate::device::first_metal() {
        report
            .devices
            .push((crate::device::name(&gpu), metal_description(&gpu)));
        metal_checks(&mut report, &crate::device::name(&gpu), &gpu, faults)?;
    }
    Ok(report)
}

fn cpu_description() -> String {
    format!(
        "{} [{}], kernels at {}, {} threads",
        isa::cpu_model().unwrap_or_else(|| "unknown CPU".into()),
        isa::cpu_features().join(" "),
        isa::active().name(),
        crate::cpu::threads::threads()
    )
}

#[cfg(feature = "cuda")]
fn gpu_description(gpu: &Device) -> String {
    let Device::Cuda(dev) = gpu else {
        return String::new();
    };
    let context = dev.cuda_stream().context().clone();
    let name = context.name().unwrap_or_else(|_| "unknown GPU".into());
    let (major, minor) = context.compute_capability().unwrap_or((0, 0));
    let memory = context.total_mem().unwrap_or(0) as f64 / f64::from(1 << 30);
    let mut driver = 0i32;
    // SAFETY: writes one int.
    let _ = unsafe { candle_core::cuda::cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
    format!(
        "{name}, compute capability {major}.{minor}, {memory:.1} GiB, driver CUDA {}.{}",
        driver / 1000,
        driver % 1000 / 10
    )
}

#[cfg(feature = "metal")]
fn metal_description(gpu: &Device) -> String {
    let Device::Metal(dev) = gpu else {
        return String::new();
    };
    let architecture = dev.device().architecture_name();
    let memory = dev.device().recommended_max_working_set_size() as f64 / f64::from(1 << 30);
    let macos = crate::device::macos_version().map_or("?".into(), |(a, b)| format!("{a}.{b}"));
    format!("Apple GPU {architecture}, macOS {macos}, {memory:.1} GiB working set")
}

/// The largest |a - b| over the largest |b| (1 where b is all zeros).
fn relative(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
    let off = a.iter().zip(b).fold(0f64, |m, (&x, &y)| {
        m.max((f64::from(x) - f64::from(y)).abs())
    });
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    off / scale.max(f64::MIN_POSITIVE)
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// At the active CPU level: the f32 and bf16 GEMMs, the eight- and four-bit products
/// and the few-row products, each against f64 sums of what it multiplies. (name, error, bound).
fn kernel_errors(faults: &Faults) -> Result<Vec<(&'static str, f64, f64)>> {
    use crate::cpu::gemm::{matmul, Precision as P};
    use crate::cpu::kernels::Widen;
    use crate::cpu::matrix::{Product, Strided};
    use crate::cpu::q8::Q8Row;
    use crate::cpu::q8_matrix::Q8Matrix;
    use crate::cpu::weight_rows::{project_rows, Bf16};
    let (m, n, k) = (7, 45, 70);
    let (a, b) = (values(m * k, 1), values(n * k, 2));
    // f64 of a (m, k) times b read as (k, n) from its (n, k) rows.
    let exact = |a: &[f32], b: &dyn Fn(usize, usize) -> f64| -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|p| f64::from(a[i * k + p]) * b(p, j)).sum();
                out[i * n + j] = s as f32;
            }
        }
        out
    };
    let mut checks = Vec::new();

    let mut got = vec![0f32; m * n];
    let p = Product::new(Strided::rows(&a, k), Strided::columns(&b, k), (m, n, k));
    matmul(&mut got, n, p, P::F32);
    got[0] = faults.apply("kernels: f32 gemm", f64::from(got[0])) as f32;
    let want = exact(&a, &|p, j| f64::from(b[j * k + p]));
    checks.push(("kernels: f32 gemm", relative(&got, &want), 1e-5));

    // bf16 training's products (AMX tiles at `amx`): rounded operands, f32 sums.
    let mut got = vec![0f32; m * n];
    matmul(&mut got, n, p, P::Bf16);
    got[0] = faults.apply("kernels: bf16 gemm", f64::from(got[0])) as f32;
    let round = crate::cpu::bf16::round_to_bf16;
    let a_bf16: Vec<f32> = a.iter().map(|&v| round(v)).collect();
    let want = exact(&a_bf16, &|p, j| f64::from(round(b[j * k + p])));
    checks.push(("kernels: bf16 gemm", relative(&got, &want), 1e-5));

    let bits: Vec<Bf16> = b.iter().map(|&v| Bf16::round(v)).collect();
    let mut got = vec![0f32; m * n];
    project_rows(&bits, None, &a, k, &mut got);
    got[0] = faults.apply("kernels: bf16 rows", f64::from(got[0])) as f32;
    let want = exact(&a, &|p, j| f64::from(bits[j * k + p].widen()));
    checks.push(("kernels: bf16 rows", relative(&got, &want), 1e-5));

    // Eight and four bits: both sides quantized, back in f64, is what the kernel sums.
    macro_rules! blocks {
        ($matrix:ty, $name:expr) => {{
            let q = <$matrix>::quantize(&b, n, k);
            let rows: Vec<Q8Row> = a
                .chunks_exact(k)
                .map(|x| {
                    let mut row = Q8Row::default();
                    q.quantize_row(x, &mut row);
                    row
                })
                .collect();
            let mut got = vec![0f32; m * n];
            q.matmat(0, n, &rows, None, &mut got);
            got[0] = faults.apply($name, f64::from(got[0])) as f32;
            let mut a_back = vec![0f32; m * k];
            for (x, back) in rows.iter().zip(a_back.chunks_exact_mut(k)) {
                x.values_into(back);
            }
            let mut w_back = vec![0f32; n * k];
            for (j, row) in w_back.chunks_exact_mut(k).enumerate() {
                q.row_into(j, row);
            }
            let want = exact(&a_back, &|p, j| f64::from(w_back[j * k + p]));
            checks.push(($name, relative(&got, &want), 1e-5));
        }};
    }
    blocks!(Q8Matrix, "kernels: int8 products");
    blocks!(crate::cpu::q4::Q4Matrix, "kernels: int4 products");
    Ok(checks)
}

/// The model the engine and decoder checks run: small, with every part (learned
/// positions, biases, grouped K/V heads) and odd sizes.
fn small_model() -> ModelSpec {
    ModelSpec::new(&ModelConfig {
        n_layer: 2,
        n_head: 4,
        n_kv_head: Some(2),
        n_embd: 24,
        block_size: 9,
        vocab_size: 37,
        positions: PositionKind::Learned,
        bias: true,
        ..ModelConfig::default()
    })
}

type BuildEngine<'a> = dyn Fn(&ModelSpec, &[f32], usize) -> Result<Box<dyn Engine>> + 'a;

/// Three training steps of the engine `build` makes against the reference engine on
/// the CPU, each on another batch: every step's loss and gradients (the worst of the
/// three: an engine that replays recorded passes must replay them with each new batch),
/// the weights after the third (each step's update made from the reference's gradients
/// on both).
fn engine_checks(
    report: &mut Report,
    place: &str,
    faults: &Faults,
    build: &BuildEngine,
) -> Result<()> {
    let spec = small_model();
    let init = spec.initial_values(3);
    let batch = 3;
    let reference_options = EngineOptions::f32(batch, false);
    let mut reference = engine::build(&spec, &init, &Device::Cpu, reference_options)?;
    let mut fused = build(&spec, &init, batch)?;
    let t = spec.shapes.block_size;
    let mut data = Batch::empty(batch, t);
    let train = TrainConfig::default();
    let (mut loss_error, mut grad_error) = (0.0, 0.0);
    for step in 0..3 {
        // More distinct tokens each step: what a recorded backward launches for them
        // must follow the batch.
        let tokens = spec.shapes.vocab_size >> (2 - step);
        for (i, id) in data.x.iter_mut().chain(data.y.iter_mut()).enumerate() {
            *id = ((i * 7 + step * 3) % tokens) as u32;
        }
        let mut losses = [0.0; 2];
        for (engine, loss) in [&mut reference, &mut fused].into_iter().zip(&mut losses) {
            engine.zero_grads()?;
            engine.forward(&data, None)?;
            engine.backward(1.0)?;
            *loss = engine.take_loss()?;
        }
        let fused_loss = faults.apply("engine loss", losses[1]);
        loss_error = f64::max(loss_error, (fused_loss - losses[0]).abs() / losses[0].abs());
        let grads = max_error(
            &fused.grads()?,
            &reference.grads()?,
            faults.applies("engine gradients"),
        )?;
        grad_error = f64::max(grad_error, grads);
        // AdamW's first steps divide each gradient by its own magnitude, so gradients
        // equal to rounding would update the near-zero ones differently: the update is
        // checked from the same gradients (as tests/engines.rs does).
        fused.set_grads(&reference.grads()?, "the reference engine")?;
        let update = AdamWStep::new(&train, step + 1, 1e-2);
        for engine in [&mut reference, &mut fused] {
            engine.clip_grads(train.grad_clip)?;
            engine.adamw(&update)?;
        }
    }
    let weights_error = max_error(
        &fused.weights()?,
        &reference.weights()?,
        faults.applies("engine weights after AdamW"),
    )?;
    let bound = if on_gpu(place) { 1e-4 } else { 1e-5 };
    report.check(place, "engine loss", loss_error, bound);
    report.check(place, "engine gradients", grad_error, bound);
    report.check(place, "engine weights after AdamW", weights_error, bound);
    Ok(())
}

/// Whether a place is a real GPU: its products sum in other orders (cuBLAS, Metal's
/// fast math), so it is held to 1e-4 where the CPU and the emulator are held to 1e-5.
fn on_gpu(place: &str) -> bool {
    place.starts_with("cuda:") || place.starts_with("metal")
}

/// The bf16 path of the engine `build` makes (bf16 operands; flash attention reading
/// q, k, v where the qkv projection wrote them, f32 under rotary positions and bf16
/// under learned ones, on heads of 16, grouped and not; GPT-2's MLP, whose GELU its
/// products' epilogues compute)
/// against the f32 reference engine on the CPU: one step's loss and every gradient,
/// within what rounding the products' operands to bf16 moves them (tests/engines.rs's
/// bounds).
#[cfg(any(feature = "cuda", feature = "cuda-emulator", feature = "metal"))]
fn bf16_checks(
    report: &mut Report,
    place: &str,
    faults: &Faults,
    build: &BuildEngine,
) -> Result<()> {
    let (mut loss_error, mut grad_error) = (0f64, 0f64);
    // Rotary positions keep q | k | v in f32 (grouped or not); learned ones let the
    // qkv product write them in bf16 for flash attention to read. GPT-2's tanh GELU
    // and biases run the MLP's GELU in its products' epilogues (cuBLASLt).
    for (kv, positions, gpt2) in [
        (2, PositionKind::Rope, false),
        (1, PositionKind::Rope, false),
        (2, PositionKind::Learned, false),
        (2, PositionKind::Learned, true),
    ] {
        let spec = ModelSpec::new(&ModelConfig {
            n_layer: 2,
            n_head: 2,
            n_kv_head: Some(kv),
            n_embd: 32,
            block_size: 20,
            vocab_size: 37,
            positions,
            mlp: match gpt2 {
                true => crate::config::MlpKind::GeluTanh,
                false => crate::config::MlpKind::Gelu,
            },
            bias: gpt2,
            ..ModelConfig::default()
        });
        let init = spec.initial_values(5);
        let batch = 2;
        let options = EngineOptions::f32(batch, false);
        let mut reference = engine::build(&spec, &init, &Device::Cpu, options)?;
        let mut fused = build(&spec, &init, batch)?;
        let mut data = Batch::empty(batch, spec.shapes.block_size);
        for (i, id) in data.x.iter_mut().chain(data.y.iter_mut()).enumerate() {
            *id = ((i * 11 + 5) % spec.shapes.vocab_size) as u32;
        }
        let mut losses = [0.0; 2];
        for (engine, loss) in [&mut reference, &mut fused].into_iter().zip(&mut losses) {
            engine.zero_grads()?;
            engine.forward(&data, None)?;
            engine.backward(1.0)?;
            *loss = engine.take_loss()?;
        }
        let fused_loss = faults.apply("engine bf16 loss", losses[1]);
        loss_error = loss_error.max((fused_loss - losses[0]).abs() / losses[0].abs());
        let perturb = faults.applies("engine bf16 gradients");
        grad_error = grad_error.max(max_error(&fused.grads()?, &reference.grads()?, perturb)?);
    }
    report.check(place, "engine bf16 loss", loss_error, 2e-3);
    report.check(place, "engine bf16 gradients", grad_error, 2e-2);
    Ok(())
}

/// The largest relative error over the tensors of `got` against `want` (each
/// relative to its own largest entry); `perturb` adds 1% to the first tensor.
fn max_error(got: &NamedTensors, want: &NamedTensors, perturb: bool) -> Result<f64> {
    let mut worst = 0f64;
    let mut names: Vec<&String> = want.keys().collect();
    names.sort();
    for (i, name) in names.into_iter().enumerate() {
        let Some(g) = got.get(name) else {
            return Ok(f64::INFINITY);
        };
        let mut g: Vec<f32> = g.flatten_all()?.to_vec1()?;
        if perturb && i == 0 {
            g[0] = g[0] * 1.01 + 0.01;
        }
        let w: Vec<f32> = want[name].flatten_all()?.to_vec1()?;
        worst = worst.max(relative(&g, &w));
    }
    Ok(worst)
}

/// Prompts of two sequences and six steps after them.
fn decode_script(spec: &ModelSpec) -> (Vec<Vec<u32>>, Vec<[u32; 2]>) {
    let v = spec.shapes.vocab_size as u32;
    let windows = vec![vec![1, 5, 2], vec![7, 3, 11 % v]];
    let steps = (0..6).map(|s| [(s * 5 + 1) % v, (s * 3 + 2) % v]).collect();
    (windows, steps)
}

/// The fused CPU decoder against the reference model's KV cache: every step's logits.
fn cpu_decoder_check(report: &mut Report, place: &str, faults: &Faults) -> Result<()> {
    use crate::generate::{DecodeMode, Decoder};
    let spec = small_model();
    let values = spec.initial_values(4);
    let model = crate::model::Gpt::from_flat(
        &spec,
        &values,
        &Device::Cpu,
        candle_core::DType::F32,
        Precision::F32,
    )?;
    let mut fast = crate::cpu::FastDecoder::new(&spec, &values, 2)?;
    let mut reference = Decoder::new(&model, 2, DecodeMode::Cached)?;
    let (windows, steps) = decode_script(&spec);
    // The reference decoder takes one prompt for every sequence.
    let prompt = windows[0].clone();
    let same = vec![prompt.clone(); 2];
    let mut worst = relative(fast.prefill(&same)?, {
        reference.prefill(&prompt)?;
        reference.logits()?
    });
    for ids in steps {
        let mut a = fast.step(&ids)?.to_vec();
        reference.push(&ids)?;
        if faults.applies("decoder logits") {
            a[0] = a[0] * 1.01 + 0.01;
        }
        worst = worst.max(relative(&a, reference.logits()?));
    }
    report.check(place, "decoder logits", worst, 1e-5);
    Ok(())
}

/// The fused CUDA engine and decoder (on `gpu`, or under the emulator when `None`):
/// the engine against the reference, the decoder against the CPU decoder, and
/// one-token steps that really replay their recorded graph.
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
fn cuda_checks(
    report: &mut Report,
    place: &str,
    gpu: Option<&Device>,
    faults: &Faults,
) -> Result<()> {
    use crate::cuda::{CudaDecoder, FusedCuda};
    let in_precision = |precision: Precision| {
        move |spec: &ModelSpec, values: &[f32], batch: usize| -> Result<Box<dyn Engine>> {
            Ok(Box::new(match gpu {
                #[cfg(feature = "cuda")]
                Some(d) => FusedCuda::new(spec, values, d, batch, precision)?,
                #[cfg(feature = "cuda-emulator")]
                None => FusedCuda::emulated(spec, values, batch, precision)?,
                #[allow(unreachable_patterns)]
                _ => anyhow::bail!("no CUDA place"),
            }))
        }
    };
    engine_checks(report, place, faults, &in_precision(Precision::F32))?;
    bf16_checks(report, place, faults, &in_precision(Precision::Bf16))?;
    let spec = small_model();
    let values = spec.initial_values(4);
    let mut decoder = match gpu {
        #[cfg(feature = "cuda")]
        Some(d) => CudaDecoder::new(&spec, &values, d, 2, Precision::F32)?,
        #[cfg(feature = "cuda-emulator")]
        None => CudaDecoder::emulated(&spec, &values, 2, Precision::F32)?,
        #[allow(unreachable_patterns)]
        _ => anyhow::bail!("no CUDA place"),
    };
    let mut cpu = crate::cpu::FastDecoder::new(&spec, &values, 2)?;
    let (windows, steps) = decode_script(&spec);
    let mut worst = relative(decoder.prefill(&windows)?, cpu.prefill(&windows)?);
    for ids in steps {
        let mut a = decoder.step(&ids)?.to_vec();
        if faults.applies("decoder logits") {
            a[0] = a[0] * 1.01 + 0.01;
        }
        worst = worst.max(relative(&a, cpu.step(&ids)?));
    }
    let bound = if gpu.is_some() { 1e-4 } else { 1e-5 };
    report.check(place, "decoder logits", worst, bound);
    // 0: the steps replayed their graph; 1: they fell back to launching kernels.
    let fell_back = f64::from(u8::from(
        !decoder.is_replaying() || faults.applies("graph replay"),
    ));
    report.check(place, "graph replay", fell_back, 0.0);
    Ok(())
}

/// candle's ops on Metal (the reference engine and its K/V-cache decoder, what Metal
/// runs): the engine against the reference on the CPU (f32, and bf16 where this
/// Metal has bf16 kernels), the decoder against the fused CPU decoder, every step's
/// logits (one-row products: Metal's matrix-vector kernels).
#[cfg(feature = "metal")]
fn metal_checks(report: &mut Report, place: &str, gpu: &Device, faults: &Faults) -> Result<()> {
    // Not fused: the reference engine on Metal, built without the first-use check
    // (which is this).
    let reference_on = |precision: Precision| {
        move |spec: &ModelSpec, values: &[f32], batch: usize| -> Result<Box<dyn Engine>> {
            let options = EngineOptions {
                precision,
                ..EngineOptions::f32(batch, false)
            };
            engine::build(spec, values, gpu, options)
        }
    };
    engine_checks(report, place, faults, &reference_on(Precision::F32))?;
    match crate::device::require_metal_bf16(gpu) {
        Ok(()) => bf16_checks(report, place, faults, &reference_on(Precision::Bf16))?,
        // Refused where asked for, in one line: not a wrong number.
        Err(e) => crate::errln!("note: {place}: no bf16 ({e:#})"),
    }
    let spec = small_model();
    let values = spec.initial_values(4);
    let model =
        crate::model::Gpt::from_flat(&spec, &values, gpu, candle_core::DType::F32, Precision::F32)?;
    let mut decoder =
        crate::generate::Decoder::new(&model, 2, crate::generate::DecodeMode::Cached)?;
    let mut cpu = crate::cpu::FastDecoder::new(&spec, &values, 2)?;
    let (windows, steps) = decode_script(&spec);
    // The reference decoder takes one prompt for every sequence.
    let prompt = windows[0].clone();
    decoder.prefill(&prompt)?;
    let mut worst = relative(decoder.logits()?, cpu.prefill(&vec![prompt.clone(); 2])?);
    for ids in steps {
        decoder.push(&ids)?;
        let mut a = decoder.logits()?.to_vec();
        if faults.applies("decoder logits") {
            a[0] = a[0] * 1.01 + 0.01;
        }
        worst = worst.max(relative(&a, cpu.step(&ids)?));
    }
    report.check(place, "decoder logits", worst, 1e-4);
    Ok(())
}

/// candle's Metal ops' checks on `gpu`, once per Mac, macOS and binary, remembered as
/// [`cuda_first_use`]'s are.
#[cfg(feature = "metal")]
pub fn metal_first_use(gpu: &Device) -> Result<FirstUse> {
    let place = crate::device::name(gpu);
    remembered(&metal_description(gpu), |report, faults| {
        metal_checks(report, &place, gpu, faults)
    })
}

/// What the first-use check of the fused CUDA engine and decoder found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum FirstUse {
    Passed,
    /// The line to say: which check failed on which GPU, and `doctor`.
    Failed(String),
}

/// The fused CUDA engine's and decoder's checks on `gpu` (`None`: under the emulator),
/// run once per GPU, driver and binary and remembered in the cache folder
/// (`TINYGPT_CACHE_DIR`, else `$XDG_CACHE_HOME/tinygpt`, else `~/.cache/tinygpt`;
/// nothing is remembered where none can be written).
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
pub fn cuda_first_use(gpu: Option<&Device>) -> Result<FirstUse> {
    let place = match gpu {
        #[cfg(feature = "cuda")]
        Some(d) => crate::device::name(d),
        _ => "cuda (emulated)".to_string(),
    };
    let what = match gpu {
        #[cfg(feature = "cuda")]
        Some(d) => gpu_description(d),
        _ => "the CPU emulator".to_string(),
    };
    remembered(&what, |report, faults| {
        cuda_checks(report, &place, gpu, faults)
    })
}

/// The first-use verdict of the checks `run` makes on the device `what` describes,
/// remembered per device, binary and injected fault (`first_use_with`).
#[cfg(any(feature = "cuda", feature = "cuda-emulator", feature = "metal"))]
fn remembered(
    what: &str,
    run: impl FnOnce(&mut Report, &Faults) -> Result<()>,
) -> Result<FirstUse> {
    let faults = Faults::from_env();
    let key = format!(
        "{what} | {} | fault {:?}",
        binary_identity(),
        faults.perturb
    );
    first_use_with(&key, cache_dir().as_deref(), || {
        let mut report = Report {
            devices: Vec::new(),
            checks: Vec::new(),
        };
        run(&mut report, &faults)?;
        Ok(report)
    })
}

/// [`cuda_first_use`] (or [`metal_first_use`] on a Metal device) as
/// `engine::FirstUseCheck`: the line to say where it failed. The binary hands this to
/// `engine::set_first_use_check`.
#[cfg(any(feature = "cuda", feature = "cuda-emulator", feature = "metal"))]
pub fn first_use_check(gpu: Option<&Device>) -> Result<Option<String>> {
    #[cfg(feature = "metal")]
    let verdict = match gpu {
        Some(metal) if metal.is_metal() => metal_first_use(metal)?,
        _ => cuda_first_use_or_pass(gpu)?,
    };
    #[cfg(not(feature = "metal"))]
    let verdict = cuda_first_use_or_pass(gpu)?;
    Ok(match verdict {
        FirstUse::Passed => None,
        FirstUse::Failed(line) => Some(line),
    })
}

/// [`cuda_first_use`] in builds with CUDA code; passed in the others (nothing of
/// ours to check).
#[cfg(any(feature = "cuda", feature = "cuda-emulator", feature = "metal"))]
fn cuda_first_use_or_pass(gpu: Option<&Device>) -> Result<FirstUse> {
    #[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
    return cuda_first_use(gpu);
    #[cfg(not(any(feature = "cuda", feature = "cuda-emulator")))]
    {
        let _ = gpu;
        Ok(FirstUse::Passed)
    }
}

/// The verdict remembered under `key` in `dir`, or `check`'s (then remembered).
pub fn first_use_with(
    key: &str,
    dir: Option<&std::path::Path>,
    check: impl FnOnce() -> Result<Report>,
) -> Result<FirstUse> {
    let file = dir.map(|d| {
        let digest = crate::util::sha256_hex(key.as_bytes());
        d.join(format!("doctor-{}.json", &digest[..16]))
    });
    if let Some(verdict) = file
        .as_ref()
        .and_then(|f| std::fs::read(f).ok())
        .and_then(|b| serde_json::from_slice::<FirstUse>(&b).ok())
    {
        return Ok(verdict);
    }
    let report = check()?;
    let verdict = match report.checks.iter().find(|c| !c.passed) {
        None => FirstUse::Passed,
        Some(c) => {
            let (code, instead) = if c.place.starts_with("metal") {
                (
                    "candle's Metal ops",
                    "training and decoding on the CPU instead (right, maybe slower)",
                )
            } else {
                (
                    "the fused CUDA code",
                    "using candle's reference ops instead (slower, right)",
                )
            };
            FirstUse::Failed(format!(
                "note: {code} failed its first-use check on {} ({}: error {:.1e}, bound {:.0e}); {instead}. `tinygpt doctor` shows every check: please report its output",
                c.place, c.name, c.error, c.bound
            ))
        }
    };
    if let (Some(file), Ok(json)) = (file, serde_json::to_vec(&verdict)) {
        if let Some(dir) = file.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = crate::util::write_atomic(&file, &json);
    }
    Ok(verdict)
}

/// Where first-use verdicts are remembered.
#[cfg(any(feature = "cuda", feature = "cuda-emulator", feature = "metal"))]
fn cache_dir() -> Option<std::path::PathBuf> {
    if let Some(dir) = std::env::var_os("TINYGPT_CACHE_DIR") {
        return Some(dir.into());
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(std::path::Path::new(&dir).join("tinygpt"));
    }
    std::env::var_os("HOME").map(|home| std::path::Path::new(&home).join(".cache/tinygpt"))
}

/// This binary: its path, size and modification time (a rebuilt binary checks again).
#[cfg(any(feature = "cuda", feature = "cuda-emulator", feature = "metal"))]
fn binary_identity() -> String {
    let exe = std::env::current_exe().ok();
    let meta = exe.as_ref().and_then(|e| std::fs::metadata(e).ok());
    let modified = meta
        .as_ref()
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    format!(
        "{} {} {modified}",
        exe.map_or(String::new(), |e| e.display().to_string()),
        meta.map_or(0, |m| m.len())
    )
}
