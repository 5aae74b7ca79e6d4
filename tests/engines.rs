//! Every engine against the reference, through the one `Engine` interface the trainer
//! uses: the same loss, the same gradient for every parameter, the same weights after
//! AdamW from the same gradients (f32 to 1e-5 relative), the same dropout masks, at odd
//! sizes, for every model option. A new engine joins by being built in `engines()`.
//!
//! Every test runs on each device of `devices()`: the CPU, and, in a build with the
//! `cuda` feature on a machine with a GPU, CUDA, where the reference engine (candle's
//! CUDA ops) is the oracle for the fused CUDA engine on the same GPU (f32 to 1e-4: the
//! GPU sums in other orders). Without a GPU the CUDA half is skipped, loudly.

use candle_core::{Device, Tensor};
use tinygpt::config::{MlpKind, ModelConfig, NormKind, PositionKind, Precision, TrainConfig};
use tinygpt::data::Batch;
use tinygpt::engine::{self, Engine, EngineOptions};
use tinygpt::model::named::NamedTensors;
use tinygpt::model::{Dropout, ModelSpec};
use tinygpt::optim::AdamWStep;

mod common;
use common::gpt2_and_llama;

fn cfg(positions: PositionKind, bias: bool) -> ModelConfig {
    ModelConfig {
        n_layer: 2,
        n_head: 3,
        n_embd: 12,
        block_size: 7,
        positions,
        bias,
        vocab_size: 11,
        ..ModelConfig::default()
    }
}

/// Where a pair of engines runs: on a candle device (the reference and the fused
/// engine there), or the fused CUDA engine under the CPU emulator beside the CPU
/// reference (feature `cuda-emulator`).
#[derive(Debug)]
enum Place {
    Device(Device),
    #[allow(dead_code)] // built with the feature `cuda-emulator`
    EmulatedGpu,
}

/// The CPU; the emulated CUDA engine in a `cuda-emulator` build; and the first GPU
/// where the build and the machine have one.
fn devices() -> Vec<Place> {
    let mut places = vec![Place::Device(Device::Cpu)];
    if cfg!(feature = "cuda-emulator") {
        places.push(Place::EmulatedGpu);
    } else {
        eprintln!(
            "SKIPPED: the fused CUDA engine under the emulator (build with \
             --features cuda-emulator, as tools/test.sh does)"
        );
    }
    if cfg!(feature = "cuda") {
        match Device::new_cuda(0) {
            Ok(gpu) => places.push(Place::Device(gpu)),
            Err(e) => eprintln!(
                "SKIPPED: the fused CUDA engine was not tested on a GPU (no CUDA device: \
                 {e})"
            ),
        }
    }
    places
}

/// How close f32 engines at `place` must be to the reference (relative to each
/// tensor's largest entry): the GPU sums in other orders.
fn tol(place: &Place) -> f64 {
    match place {
        Place::Device(d) if !d.is_cpu() => 1e-4,
        _ => 1e-5,
    }
}

/// The reference engine and the fused one at `place`, initialised from the same seed.
fn engines(
    place: &Place,
    cfg: &ModelConfig,
    batch: usize,
    precision: Precision,
) -> [Box<dyn Engine>; 2] {
    let spec = ModelSpec::new(cfg);
    let values = spec.initial_values(5);
    let build = |device: &Device, fused: bool| {
        let options = EngineOptions {
            precision,
            ..EngineOptions::f32(batch, fused)
        };
        engine::build(&spec, &values, device, options).unwrap()
    };
    match place {
        Place::Device(device) => [build(device, false), build(device, true)],
        Place::EmulatedGpu => [
            build(&Device::Cpu, false),
            emulated(
                &spec,
                &values,
                EngineOptions::f32(batch, true).with(precision),
            ),
        ],
    }
}

#[cfg(feature = "cuda-emulator")]
fn emulated(spec: &ModelSpec, values: &[f32], options: EngineOptions) -> Box<dyn Engine> {
    let (batch, precision) = (options.batch, options.precision);
    let engine = tinygpt::cuda::FusedCuda::emulated(spec, values, batch, precision).unwrap();
    Box::new(engine.with_tf32(options.tf32))
}

/// The CUDA engine at `place` (emulated or on a GPU) in bf16 with attention through
/// the (T, T) weights and batched products; none on the CPU.
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
fn products_path(place: &Place, cfg: &ModelConfig, batch: usize) -> Option<Box<dyn Engine>> {
    use tinygpt::cuda::{Attention, FusedCuda, Gpu};
    let spec = ModelSpec::new(cfg);
    let values = spec.initial_values(5);
    let (precision, products) = (Precision::Bf16, Attention::Products);
    let gpu = match place {
        Place::Device(d) if d.is_cpu() => return None,
        #[cfg(feature = "cuda")]
        Place::Device(d) => Gpu::cuda(d, "the products path").unwrap(),
        #[cfg(feature = "cuda-emulator")]
        Place::EmulatedGpu => Gpu::Emulated,
        #[allow(unreachable_patterns)]
        _ => return None,
    };
    let engine = FusedCuda::with_attention(gpu, &spec, &values, batch, precision, products);
    Some(Box::new(engine.unwrap()))
}

#[cfg(not(any(feature = "cuda", feature = "cuda-emulator")))]
fn products_path(_: &Place, _: &ModelConfig, _: usize) -> Option<Box<dyn Engine>> {
    None
}

#[cfg(not(feature = "cuda-emulator"))]
fn emulated(_: &ModelSpec, _: &[f32], _: EngineOptions) -> Box<dyn Engine> {
    unreachable!("no emulator in this build")
}

fn batch(b: usize, t: usize, v: u32, seed: u32) -> Batch {
    let ids = |seed: u32| -> Vec<u32> {
        (0..b * t)
            .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) % v)
            .collect()
    };
    Batch {
        x: ids(seed),
        y: ids(seed + 1000),
        batch: b,
        block: t,
    }
}

/// `train.tf32`: the CUDA engine's f32 products on TF32 tensor cores (in the emulator,
/// operands rounded to 10-bit mantissas) stay within TF32's rounding of f32 training
/// and are not f32 training; the CPU engines have no TF32 and give the same bits.
#[test]
fn tf32_products_stay_within_their_rounding_and_the_cpu_ignores_them() {
    let cfg = cfg(PositionKind::Learned, true);
    let spec = ModelSpec::new(&cfg);
    let values = spec.initial_values(5);
    let b = 3;
    let batch = batch(b, 7, 11, 2);
    let options = |tf32| EngineOptions {
        tf32,
        ..EngineOptions::f32(b, true)
    };
    for place in &devices() {
        let build = |tf32| match place {
            Place::Device(d) => engine::build(&spec, &values, d, options(tf32)).unwrap(),
            Place::EmulatedGpu => emulated(&spec, &values, options(tf32)),
        };
        let (mut exact, mut tf32) = (build(false), build(true));
        let (loss, grads) = loss_and_grads(exact.as_mut(), &batch, None);
        let (tf32_loss, tf32_grads) = loss_and_grads(tf32.as_mut(), &batch, None);
        let what = format!("{place:?}");
        if matches!(place, Place::Device(d) if d.is_cpu()) {
            assert_eq!(tf32_loss, loss, "{what}: the CPU has no TF32");
            assert_all_close(&tf32_grads, &grads, 0.0, &what);
        } else {
            assert!(tf32.describe().contains("TF32"), "{}", tf32.describe());
            assert!(tf32_loss != loss, "{what}: TF32 gave f32's loss exactly");
            assert!(
                (tf32_loss - loss).abs() <= 1e-3 * loss,
                "{what}: TF32 loss {tf32_loss} vs f32 {loss}"
            );
            assert_all_close(&tf32_grads, &grads, 1e-2, &what);
        }
    }
}

/// Loss and gradients of one batch from zeroed gradients.
fn loss_and_grads(
    e: &mut dyn Engine,
    batch: &Batch,
    dropout: Option<&Dropout>,
) -> (f64, NamedTensors) {
    e.zero_grads().unwrap();
    let loss = e.loss(batch, dropout).unwrap();
    e.backward(1.0).unwrap();
    (loss, e.grads().unwrap())
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// max |a - b| relative to max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12) as f64;
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) as f64;
    diff / scale
}

/// Every tensor of `got` within `tol` (relative to its largest entry) of `want`'s.
fn assert_all_close(got: &NamedTensors, want: &NamedTensors, tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: the same tensors");
    for (name, w) in want {
        let err = rel_err(&values(&got[name]), &values(w));
        assert!(err <= tol, "{what}: {name} off by {err:e}");
    }
}

#[test]
fn fused_matches_the_reference() {
    for device in &devices() {
        let (b, t) = (3, 7);
        // (positions, bias, K/V heads, norm, mlp): the default blocks, GPT-2's and Llama's.
        let variants = [
            (
                PositionKind::Learned,
                true,
                3,
                NormKind::LayerNorm,
                MlpKind::Gelu,
            ),
            (
                PositionKind::Learned,
                false,
                3,
                NormKind::LayerNorm,
                MlpKind::Gelu,
            ),
            (
                PositionKind::Rope,
                false,
                3,
                NormKind::LayerNorm,
                MlpKind::Gelu,
            ),
            (
                PositionKind::Sinusoidal,
                true,
                3,
                NormKind::LayerNorm,
                MlpKind::Gelu,
            ),
            (
                PositionKind::Learned,
                true,
                3,
                NormKind::LayerNorm,
                MlpKind::GeluTanh,
            ),
            (
                PositionKind::Rope,
                false,
                1,
                NormKind::RmsNorm,
                MlpKind::Swiglu,
            ),
            (
                PositionKind::Learned,
                false,
                1,
                NormKind::LayerNorm,
                MlpKind::Gelu,
            ),
        ];
        let train = TrainConfig {
            weight_decay: 0.1,
            ..TrainConfig::default()
        };
        for (positions, bias, kv, norm, mlp) in variants {
            let mut cfg = cfg(positions, bias);
            cfg.n_kv_head = Some(kv);
            cfg.norm = norm;
            cfg.mlp = mlp;
            let [mut reference, mut fused] = engines(device, &cfg, b, Precision::F32);
            let what = format!("{positions:?} bias={bias} kv={kv} {norm:?} {mlp:?}");
            assert_all_close(
                &fused.weights().unwrap(),
                &reference.weights().unwrap(),
                0.0,
                &what,
            );
            for step in 1..=3 {
                let batch = batch(b, t, 11, step);
                let (ref_loss, ref_grads) = loss_and_grads(reference.as_mut(), &batch, None);
                let (loss, grads) = loss_and_grads(fused.as_mut(), &batch, None);
                let what = format!("{what} step {step}");
                assert!(
                    (loss - ref_loss).abs() <= tol(device) * ref_loss,
                    "{what}: loss {loss} vs {ref_loss}"
                );
                assert_all_close(
                    &grads,
                    &ref_grads,
                    tol(device),
                    &format!("{what}: gradient"),
                );
                // Each position's loss, whose mean is the loss.
                let (positions, ref_positions) = (
                    fused.position_losses().unwrap(),
                    reference.position_losses().unwrap(),
                );
                assert_eq!(positions.len(), b * t);
                for (p, r) in positions.iter().zip(&ref_positions) {
                    assert!(
                        (p - r).abs() <= tol(device) * (1.0 + r.abs()),
                        "{what}: position loss {p} vs {r}"
                    );
                }
                let mean = positions.iter().sum::<f64>() / positions.len() as f64;
                assert!(
                    (mean - loss).abs() < 1e-9,
                    "{what}: positions' mean is the loss"
                );

                // The same update from the same gradients on both sides (the moments carry
                // over from step to step).
                fused.set_grads(&ref_grads, "test").unwrap();
                let update = AdamWStep::new(&train, step as usize, 1e-2);
                reference.adamw(&update).unwrap();
                fused.adamw(&update).unwrap();
                let what = format!("{what}: after AdamW");
                assert_all_close(
                    &fused.weights().unwrap(),
                    &reference.weights().unwrap(),
                    tol(device),
                    &what,
                );
                // Keep both on identical weights, so the next step compares gradients only.
                fused
                    .load_weights(&reference.weights().unwrap(), "test")
                    .unwrap();
            }
            assert_all_close(
                &fused.moments().unwrap(),
                &reference.moments().unwrap(),
                tol(device),
                &what,
            );
        }
    }
}

#[test]
fn gradient_scale_and_accumulation_add_up() {
    for device in &devices() {
        let cfg = cfg(PositionKind::Learned, true);
        for mut e in engines(device, &cfg, 2, Precision::F32) {
            let (a, b) = (batch(2, 7, 11, 1), batch(2, 7, 11, 3));
            e.zero_grads().unwrap();
            for micro in [&a, &b] {
                e.forward(micro, None).unwrap();
                e.backward(0.5).unwrap();
            }
            let together = e.grads().unwrap();
            let (_, ga) = loss_and_grads(e.as_mut(), &a, None);
            let (_, gb) = loss_and_grads(e.as_mut(), &b, None);
            let mean: NamedTensors = ga
                .iter()
                .map(|(name, g)| (name.clone(), ((g + &gb[name]).unwrap() * 0.5).unwrap()))
                .collect();
            assert_all_close(&together, &mean, 1e-6, e.name());
        }
    }
}

/// The global L2 norm of gradients by name, in f64.
fn global_norm(grads: &NamedTensors) -> f64 {
    let squares = grads.values().flat_map(values).map(|x| (x as f64).powi(2));
    squares.sum::<f64>().sqrt()
}

/// What the trainer reads only when it reports (the CUDA engine keeps it on the
/// device): the mean loss of the forwards since the last read, and the gradient norm
/// the last clip measured, with the gradients scaled to the max norm on the device.
#[test]
fn losses_and_the_gradient_norm_are_read_when_asked() {
    for device in &devices() {
        let cfg = cfg(PositionKind::Rope, true);
        for mut e in engines(device, &cfg, 2, Precision::F32) {
            let what = format!("{} on {device:?}", e.describe());
            let (a, b) = (batch(2, 7, 11, 1), batch(2, 7, 11, 2));
            let (loss_a, loss_b) = (e.loss(&a, None).unwrap(), e.loss(&b, None).unwrap());
            assert!(
                (loss_a - loss_b).abs() > 1e-3,
                "{what}: two different batches"
            );
            e.forward(&a, None).unwrap();
            e.forward(&b, None).unwrap();
            let mean = e.take_loss().unwrap();
            assert!(
                (mean - (loss_a + loss_b) / 2.0).abs() <= 1e-6 * mean,
                "{what}: {mean} is not the mean of {loss_a} and {loss_b}"
            );
            assert!(e.take_loss().is_err(), "{what}: read twice");

            let (_, grads) = loss_and_grads(e.as_mut(), &a, None);
            let norm = global_norm(&grads);
            e.clip_grads(0.0).unwrap();
            let measured = e.grad_norm().unwrap();
            assert!(
                (measured - norm).abs() <= 1e-5 * norm,
                "{what}: norm {measured} vs {norm}"
            );
            assert_all_close(&e.grads().unwrap(), &grads, 0.0, "max_norm 0 clips nothing");
            e.clip_grads(2.0 * norm).unwrap();
            assert_all_close(&e.grads().unwrap(), &grads, 0.0, "under the max norm");
            let max_norm = norm / 4.0;
            e.clip_grads(max_norm).unwrap();
            let clipped = global_norm(&e.grads().unwrap());
            assert!(
                (clipped - max_norm).abs() <= 1e-5 * max_norm,
                "{what}: clipped to {clipped}, not {max_norm}"
            );
            assert!(
                (e.grad_norm().unwrap() - norm).abs() <= 1e-5 * norm,
                "{what}: the norm before this clip"
            );
        }
    }
}

/// The chooser gives the fused engine on the CPU (the reference when asked), and each
/// learns a batch by heart.
#[test]
fn both_engines_train() {
    for device in &devices() {
        let cfg = cfg(PositionKind::Rope, false);
        let train = TrainConfig {
            weight_decay: 0.0,
            ..TrainConfig::default()
        };
        let [mut reference, mut fused] = engines(device, &cfg, 2, Precision::F32);
        assert!(
            fused.describe().starts_with("fused"),
            "{}",
            fused.describe()
        );
        assert!(reference
            .describe()
            .starts_with("reference (train.fused = false)"));
        for e in [&mut reference, &mut fused] {
            let batch = batch(2, 7, 11, 9);
            let first = e.loss(&batch, None).unwrap();
            let mut last = first;
            for step in 1..=60 {
                e.zero_grads().unwrap();
                last = e.loss(&batch, None).unwrap();
                e.backward(1.0).unwrap();
                e.clip_grads(1.0).unwrap();
                e.adamw(&AdamWStep::new(&train, step, 1e-2)).unwrap();
            }
            assert!(first > 2.0, "{}: starts near ln 11: {first}", e.name());
            assert!(
                last < 0.2 * first,
                "{}: {first} -> {last} after 60 steps",
                e.name()
            );
        }
    }
}

/// With dropout, both engines drop the same elements (masks are a function of the
/// step): the same loss and gradients, and not the loss without dropout.
#[test]
fn dropout_masks_are_the_same_in_every_engine() {
    for device in &devices() {
        let (b, t) = (3, 7);
        for (positions, norm, mlp) in [
            (PositionKind::Learned, NormKind::LayerNorm, MlpKind::Gelu),
            (PositionKind::Rope, NormKind::RmsNorm, MlpKind::Swiglu),
        ] {
            let mut cfg = cfg(positions, true);
            cfg.dropout = 0.2;
            cfg.norm = norm;
            cfg.mlp = mlp;
            let [mut reference, mut fused] = engines(device, &cfg, b, Precision::F32);
            let batch = batch(b, t, 11, 1);
            for (step, micro) in [(0, 0), (5, 1)] {
                let dropout = Dropout::in_pass(0.2, 9, step, micro);
                let (ref_loss, ref_grads) =
                    loss_and_grads(reference.as_mut(), &batch, dropout.as_ref());
                let (loss, grads) = loss_and_grads(fused.as_mut(), &batch, dropout.as_ref());
                let what = format!("{positions:?} step {step} micro {micro}");
                assert!(
                    (loss - ref_loss).abs() <= tol(device) * ref_loss,
                    "{what}: {loss} vs {ref_loss}"
                );
                assert_all_close(&grads, &ref_grads, tol(device), &what);
                let without = fused.loss(&batch, None).unwrap();
                assert!(
                    (without - loss).abs() > 1e-3,
                    "{what}: dropout must change the loss"
                );
            }
        }
    }
}

/// bf16 matrix products (f32 sums, f32 everything else) against the f32 reference: the
/// loss and every gradient within what rounding operands to 8 significant bits allows,
/// and measurably different from f32 (so the products really are rounded). Sizes past
/// the GEMM's 6 x 64 tiles and its k pairs (odd head size, odd widths).
#[test]
fn bf16_products_stay_within_bf16_rounding_of_the_reference() {
    for device in &devices() {
        let (b, t) = (3, 37);
        // GPT-2's family with biases and its tanh GELU too, as `arch = "gpt2"` has it:
        // the MLP's bias and GELU in its expansion's epilogue on CUDA.
        let [gpt2, llama] = gpt2_and_llama(t);
        let with_biases = ModelConfig {
            bias: true,
            mlp: MlpKind::GeluTanh,
            ..gpt2.clone()
        };
        for cfg in [gpt2, llama, with_biases] {
            let batch = batch(b, t, 67, 1);
            let [mut reference, mut f32_fused] = engines(device, &cfg, b, Precision::F32);
            let [_, mut bf16_fused] = engines(device, &cfg, b, Precision::Bf16);
            let (ref_loss, ref_grads) = loss_and_grads(reference.as_mut(), &batch, None);
            let (f32_loss, f32_grads) = loss_and_grads(f32_fused.as_mut(), &batch, None);
            let (bf16_loss, bf16_grads) = loss_and_grads(bf16_fused.as_mut(), &batch, None);
            let what = format!(
                "{:?} kv={} bias={}",
                cfg.positions,
                cfg.kv_heads(),
                cfg.bias
            );
            assert!(
                (bf16_loss - ref_loss).abs() <= 2e-4 * ref_loss,
                "{what}: bf16 loss {bf16_loss} vs {ref_loss}"
            );
            assert!(
                (bf16_loss - f32_loss).abs() > 1e-7,
                "{what}: bf16 gave the f32 loss"
            );
            assert_all_close(&f32_grads, &ref_grads, tol(device), &format!("{what} f32"));
            // Each operand carries a relative error up to 2^-9 (0.2%); through the layers'
            // products that stays under 2% of each gradient's largest entry (measured: under
            // 0.75%).
            assert_all_close(&bf16_grads, &ref_grads, 2e-2, &format!("{what} bf16"));
            for (name, g) in &bf16_grads {
                assert!(
                    rel_err(&values(g), &values(&ref_grads[name])) > 0.0,
                    "{what}: bf16 gradient of {name} is the f32 one"
                );
            }
        }
    }
}

/// The fused CUDA engine at `place` (None on the CPU).
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
fn fused_cuda(
    place: &Place,
    spec: &ModelSpec,
    init: &[f32],
    b: usize,
    precision: Precision,
) -> Option<tinygpt::cuda::FusedCuda> {
    use tinygpt::cuda::FusedCuda;
    let engine = match place {
        Place::Device(d) if d.is_cpu() => return None,
        #[cfg(feature = "cuda")]
        Place::Device(d) => FusedCuda::new(spec, init, d, b, precision),
        #[cfg(feature = "cuda-emulator")]
        Place::EmulatedGpu => FusedCuda::emulated(spec, init, b, precision),
        #[allow(unreachable_patterns)]
        _ => return None,
    };
    Some(engine.unwrap())
}

/// GPT-2's block with its work in the products' epilogues (cuBLASLt's on a GPU; `arch =
/// "gpt2"`: learned positions, tanh GELU, biases; heads of 32, so flash attention reads
/// q | k | v in bf16): with and without biases, and with dropout, the bf16 engine
/// stays within bf16 rounding of the f32 reference, as the same engine with that work
/// in its kernels does (there the qkv bias is added to the rounded rows); the two
/// differ (the epilogue takes the GELU of the f32 sum, the kernel of its bf16
/// rounding), and the epilogues' gradients are no further from the reference than
/// twice the kernels'.
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
#[test]
fn epilogues_stay_within_bf16_rounding_of_the_reference() {
    use tinygpt::cuda::Epilogues;
    for place in &devices() {
        let (t, b) = (37, 2);
        for (bias, dropout) in [(false, 0.0), (true, 0.0), (true, 0.1)] {
            let cfg = ModelConfig {
                n_layer: 2,
                n_head: 2,
                n_embd: 64,
                block_size: t,
                vocab_size: 67,
                positions: PositionKind::Learned,
                bias,
                dropout,
                mlp: MlpKind::GeluTanh,
                ..ModelConfig::default()
            };
            let spec = ModelSpec::new(&cfg);
            let mut init = spec.initial_values(5);
            // Biases start at zero: give the MLP's and qkv's some values, so the
            // epilogues add something.
            let biases = spec
                .blocks
                .iter()
                .flat_map(|b| [b.mlp_fc.bias, b.attn_qkv.bias]);
            for p in biases.flatten() {
                let at = spec[p].offset;
                for (i, v) in init[at..at + spec[p].len()].iter_mut().enumerate() {
                    *v = 0.05 * ((i as f32) * 0.9).sin();
                }
            }
            let Some(fused) = fused_cuda(place, &spec, &init, b, Precision::Bf16) else {
                continue;
            };
            let what = format!("{place:?} bias={bias} dropout={dropout}");
            let on = fused.epilogues();
            let all = Epilogues {
                gelu: true,
                gelu_gradient: true,
                qkv_bias: bias,
            };
            if matches!(place, Place::EmulatedGpu) {
                assert_eq!(on, all, "{what}");
            } else if on != all {
                eprintln!("{what}: cuBLASLt runs only {on:?} of {all:?}");
            }
            let mut epilogues: Box<dyn Engine> = Box::new(fused);
            assert!(
                epilogues.describe().contains("epilogue"),
                "{}",
                epilogues.describe()
            );
            let kernels = fused_cuda(place, &spec, &init, b, Precision::Bf16).unwrap();
            let mut kernels: Box<dyn Engine> = Box::new(kernels.without_epilogues());
            let options = EngineOptions::f32(b, false);
            let mut reference = engine::build(&spec, &init, &Device::Cpu, options).unwrap();
            let data = batch(b, t, 67, 4);
            let mask = Dropout::in_pass(dropout, 3, 2, 0);
            let (ref_loss, ref_grads) = loss_and_grads(reference.as_mut(), &data, mask.as_ref());
            let (loss, grads) = loss_and_grads(epilogues.as_mut(), &data, mask.as_ref());
            let (k_loss, k_grads) = loss_and_grads(kernels.as_mut(), &data, mask.as_ref());
            assert!(
                loss != k_loss,
                "{what}: the epilogues gave the kernels' loss"
            );
            for (l, name) in [(loss, "epilogues"), (k_loss, "kernels")] {
                assert!(
                    (l - ref_loss).abs() <= 2e-4 * ref_loss,
                    "{what}: {name}' loss {l} vs {ref_loss}"
                );
            }
            assert_all_close(&grads, &ref_grads, 2e-2, &what);
            assert_all_close(&k_grads, &ref_grads, 2e-2, &format!("{what}, kernels"));
            let (mut worst, mut worst_kernels) = (0f64, 0f64);
            for (name, want) in &ref_grads {
                worst = worst.max(rel_err(&values(&grads[name]), &values(want)));
                worst_kernels = worst_kernels.max(rel_err(&values(&k_grads[name]), &values(want)));
            }
            eprintln!("{what}: gradients off the reference by {worst:e} (kernels {worst_kernels:e}); loss {loss} vs {k_loss} vs {ref_loss}");
            assert!(
                worst <= 2.0 * worst_kernels,
                "{what}: the epilogues' gradients off by {worst:e}, the kernels' by {worst_kernels:e}"
            );
        }
    }
}

/// The fused CUDA engine replays its passes from recordings (CUDA graphs) after their
/// first call: three passes of different batches, dropout masks and loss scales give
/// the losses and gradients of the same engine launching every kernel, bit for bit, in
/// f32 and in bf16 (flash attention, q | k | v in bf16), on the emulator and on a GPU.
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
#[test]
fn replayed_passes_give_the_launched_bits() {
    for place in &devices() {
        let (t, b) = (37, 2);
        let cfg = ModelConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 64,
            block_size: t,
            vocab_size: 67,
            dropout: 0.1,
            ..ModelConfig::default()
        };
        let spec = ModelSpec::new(&cfg);
        let init = spec.initial_values(9);
        for precision in [Precision::F32, Precision::Bf16] {
            let build = || fused_cuda(place, &spec, &init, b, precision);
            let (Some(replayed), Some(launched)) = (build(), build()) else {
                continue;
            };
            assert!(replayed.graphs(), "{place:?}: graphs on by default");
            let mut replayed: Box<dyn Engine> = Box::new(replayed);
            let mut launched: Box<dyn Engine> = Box::new(launched.without_graphs());
            for (pass, (seed, mask, scale)) in [(4, true, 1.0), (5, true, 1.0), (6, false, 0.5)]
                .into_iter()
                .enumerate()
            {
                let data = batch(b, t, 67, seed);
                let mask = mask
                    .then(|| Dropout::in_pass(0.1, 3, pass, pass % 2))
                    .flatten();
                let run = |e: &mut dyn Engine| {
                    e.zero_grads().unwrap();
                    let loss = e.loss(&data, mask.as_ref()).unwrap();
                    e.backward(scale).unwrap();
                    (loss, e.grads().unwrap())
                };
                let (want_loss, want) = run(launched.as_mut());
                let (loss, got) = run(replayed.as_mut());
                let what = format!("{place:?} {precision:?} pass {pass}");
                assert_eq!(loss.to_bits(), want_loss.to_bits(), "{what}: loss");
                for (name, w) in &want {
                    assert!(values(&got[name]) == values(w), "{what}: {name}'s gradient");
                }
            }
        }
    }
}

/// Past one 64-row causal block and the bf16 GEMM's 96-row blocks (T = 150): the f32
/// fused engine still equals the reference to 1e-5, and bf16 stays within its rounding.
#[test]
fn long_contexts_match_the_reference() {
    for device in &devices() {
        let (b, t) = (2, 150);
        let cfg = ModelConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 16,
            block_size: t,
            vocab_size: 11,
            ..ModelConfig::default()
        };
        let batch = batch(b, t, 11, 1);
        let [mut reference, _] = engines(device, &cfg, b, Precision::F32);
        let (ref_loss, ref_grads) = loss_and_grads(reference.as_mut(), &batch, None);
        for (precision, tol) in [(Precision::F32, tol(device)), (Precision::Bf16, 2e-2)] {
            let [_, mut fused] = engines(device, &cfg, b, precision);
            let (loss, grads) = loss_and_grads(fused.as_mut(), &batch, None);
            assert!(
                (loss - ref_loss).abs() <= tol * ref_loss,
                "{precision:?}: loss {loss} vs {ref_loss}"
            );
            assert_all_close(&grads, &ref_grads, tol, &format!("{precision:?}"));
        }
    }
}

/// The reference engine's bf16 products (autocast's recipe, for GPUs) land within bf16
/// rounding of its f32 products and of the fused bf16 engine, and really are rounded.
#[test]
fn reference_bf16_products_track_f32() {
    for device in &devices() {
        let (b, t) = (2, 19);
        let cfg = ModelConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 32,
            block_size: t,
            vocab_size: 23,
            ..ModelConfig::default()
        };
        let batch = batch(b, t, 23, 1);
        let [mut f32_ref, _] = engines(device, &cfg, b, Precision::F32);
        let [mut bf16_ref, mut bf16_fused] = engines(device, &cfg, b, Precision::Bf16);
        let (f32_loss, f32_grads) = loss_and_grads(f32_ref.as_mut(), &batch, None);
        let (bf16_loss, bf16_grads) = loss_and_grads(bf16_ref.as_mut(), &batch, None);
        assert!(
            bf16_loss != f32_loss,
            "bf16 products gave the f32 loss exactly"
        );
        assert!(
            (bf16_loss - f32_loss).abs() <= 5e-4 * f32_loss,
            "loss {bf16_loss} vs {f32_loss}"
        );
        assert_all_close(&bf16_grads, &f32_grads, 2e-2, "reference bf16");
        let fused_loss = bf16_fused.loss(&batch, None).unwrap();
        assert!(
            (fused_loss - bf16_loss).abs() <= 5e-4 * f32_loss,
            "fused bf16 loss {fused_loss} vs reference bf16 {bf16_loss}"
        );
    }
}

/// Flash attention (bf16, heads of 16 to 64): the fused CUDA engine's loss and every
/// gradient within bf16 rounding of the f32 reference, with and without dropout, with
/// grouped K/V heads, for blocks that are not a whole number of 16-row tiles and span
/// several 64-row thread blocks.
#[test]
fn flash_attention_stays_within_bf16_rounding_of_the_reference() {
    for device in &devices() {
        if matches!(device, Place::Device(d) if d.is_cpu()) {
            continue; // no flash attention on the CPU
        }
        // With rotary positions q | k | v stay f32 (rounded as flash stages them);
        // without, the qkv product writes them in bf16 and flash reads them so.
        for (t, n_embd, n_head, kv, dropout, positions) in [
            (37, 64, 4, 4, 0.0, PositionKind::Rope), // head 16, one partial block of rows
            (70, 64, 2, 1, 0.0, PositionKind::Rope), // head 32, grouped K/V, two blocks of rows
            (70, 96, 6, 3, 0.2, PositionKind::Rope), // head 16, dropout
            (70, 64, 2, 2, 0.1, PositionKind::Learned), // head 32, bf16 q | k | v
        ] {
            // Learned positions once more with GPT-2's biases and tanh GELU: flash writes
            // dqkv in bf16, whose column sums are the qkv bias's gradient.
            for gpt2 in [false, positions == PositionKind::Learned] {
                let cfg = ModelConfig {
                    n_layer: 2,
                    n_head,
                    n_kv_head: Some(kv),
                    n_embd,
                    block_size: t,
                    positions,
                    dropout,
                    vocab_size: 29,
                    bias: gpt2,
                    mlp: if gpt2 {
                        MlpKind::GeluTanh
                    } else {
                        MlpKind::Gelu
                    },
                    ..ModelConfig::default()
                };
                let b = 2;
                let batch = batch(b, t, 29, 3);
                let mask = Dropout::in_pass(dropout, 7, 4, 0);
                let [mut reference, _] = engines(device, &cfg, b, Precision::F32);
                let [_, mut flash] = engines(device, &cfg, b, Precision::Bf16);
                assert!(
                    flash.describe().contains("flash attention"),
                    "{}",
                    flash.describe()
                );
                let what = format!(
                "T {t}, head {}, kv {kv}, dropout {dropout}, {positions:?}, GPT-2's biases and MLP {gpt2}",
                n_embd / n_head
            );
                let (ref_loss, ref_grads) =
                    loss_and_grads(reference.as_mut(), &batch, mask.as_ref());
                let (loss, grads) = loss_and_grads(flash.as_mut(), &batch, mask.as_ref());
                assert!(
                    (loss - ref_loss).abs() <= 2e-4 * ref_loss,
                    "{what}: loss {loss} vs {ref_loss}"
                );
                assert_all_close(&grads, &ref_grads, 2e-2, &what);
                // The products path in bf16 rounds P after normalising it, flash (one pass, as
                // FlashAttention-2) before: different numbers rounded alike, so each is held to
                // the f32 reference, flash to within twice the products path's error (measured
                // under the emulator: the loss 0.2-0.9x as far off, gradients up to 1.55x).
                if let Some(mut products) = products_path(device, &cfg, b) {
                    let (p_loss, p_grads) =
                        loss_and_grads(products.as_mut(), &batch, mask.as_ref());
                    // That holds where both round (the emulator always does). On a GPU,
                    // cuBLAS's FAST_16BF products may keep f32 operands (an H200 did: flash
                    // 1.9e-3 off, products 4.2e-4), so there flash is held to the reference's
                    // bounds above and the margins are reported.
                    let rounds_alike = matches!(device, Place::EmulatedGpu);
                    // The loss is one number, its rounding errors of either sign: where the
                    // products path's lands near the reference by chance, flash's is held to
                    // the size both paths' errors take (up to 4e-5 of the loss measured under
                    // the emulator with the MLP's rows in bf16), not to that chance.
                    let loss_bound = 2.0 * (p_loss - ref_loss).abs() + 5e-5 * ref_loss;
                    if rounds_alike {
                        assert!(
                        (loss - ref_loss).abs() <= loss_bound,
                        "{what}: loss {loss}, the products path's {p_loss}, the reference's {ref_loss}"
                    );
                    } else if (loss - ref_loss).abs() > loss_bound {
                        eprintln!(
                            "{what}: loss {loss}, products path {p_loss}, reference {ref_loss}"
                        );
                    }
                    for (name, want) in &ref_grads {
                        let flash_err = rel_err(&values(&grads[name]), &values(want));
                        let products_err = rel_err(&values(&p_grads[name]), &values(want));
                        if rounds_alike {
                            assert!(
                            flash_err <= 2.0 * products_err + 1e-4,
                            "{what}: {name} off by {flash_err:e}, the products path by {products_err:e}"
                        );
                        } else if flash_err > 2.0 * products_err + 1e-4 {
                            eprintln!(
                            "{what}: {name} flash {flash_err:e}, products path {products_err:e}"
                        );
                        }
                    }
                    assert_all_close(&grads, &p_grads, 2e-2, &format!("{what}, products path"));
                }
            }
        }
    }
}

/// State in and out by name: one engine's weights and moments load into the other;
/// a missing or mis-shaped tensor is refused by name; a batch of the wrong shape too.
#[test]
fn state_moves_between_engines_by_name() {
    for device in &devices() {
        let cfg = cfg(PositionKind::Learned, true);
        let [mut reference, mut fused] = engines(device, &cfg, 2, Precision::F32);
        let train = TrainConfig::default();
        let (_, grads) = loss_and_grads(fused.as_mut(), &batch(2, 7, 11, 4), None);
        fused.adamw(&AdamWStep::new(&train, 1, 1e-2)).unwrap();
        reference
            .load_weights(&fused.weights().unwrap(), "fused")
            .unwrap();
        reference
            .load_moments(&fused.moments().unwrap(), "fused")
            .unwrap();
        assert_all_close(
            &reference.weights().unwrap(),
            &fused.weights().unwrap(),
            0.0,
            "weights",
        );
        assert_all_close(
            &reference.moments().unwrap(),
            &fused.moments().unwrap(),
            0.0,
            "moments",
        );

        let mut missing = grads.clone();
        missing.remove("ln_f.bias");
        let err = fused
            .load_weights(&missing, "model.safetensors")
            .unwrap_err();
        assert!(
            format!("{err}").contains("model.safetensors: tensor ln_f.bias is missing"),
            "{err}"
        );
        let mut bent = grads.clone();
        bent.insert(
            "wte.weight".into(),
            Tensor::zeros((3, 3), candle_core::DType::F32, &Device::Cpu).unwrap(),
        );
        let err = reference.load_weights(&bent, "x").unwrap_err();
        assert!(
            format!("{err}").contains("wte.weight has shape [3, 3]"),
            "{err}"
        );
        assert!(
            fused.forward(&batch(3, 7, 11, 1), None).is_err(),
            "3 sequences for an engine of 2"
        );
    }
}

/// The CUDA engine's data-parallel path (ZeRO-1 blocks, padded buffers, the tensor table
/// counted from the block; NCCL where the build has it, host memory otherwise) at world
/// size 1 trains as the engine alone, bit for bit: the collectives of one rank are the
/// identity. Emulated, and on a GPU (where it is the NCCL path a single GPU can run).
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
#[test]
fn a_sharded_cuda_engine_of_one_rank_trains_as_the_engine_alone() {
    use std::sync::Arc;
    use tinygpt::cuda::FusedCuda;
    use tinygpt::parallel::Single;

    let cfg = cfg(PositionKind::Rope, true);
    let spec = ModelSpec::new(&cfg);
    let values = spec.initial_values(5);
    let build = |place: &Place| -> Option<FusedCuda> {
        match place {
            #[cfg(feature = "cuda")]
            Place::Device(d) if d.is_cuda() => {
                Some(FusedCuda::new(&spec, &values, d, 2, Precision::F32).unwrap())
            }
            #[cfg(feature = "cuda-emulator")]
            Place::EmulatedGpu => {
                Some(FusedCuda::emulated(&spec, &values, 2, Precision::F32).unwrap())
            }
            _ => None,
        }
    };
    let train = TrainConfig {
        grad_clip: 0.05,
        weight_decay: 0.1,
        ..TrainConfig::default()
    };
    for place in &devices() {
        let (Some(alone), Some(plain)) = (build(place), build(place)) else {
            continue;
        };
        let sharded = plain.sharded(Arc::new(Single)).unwrap();
        let mut engines: [Box<dyn Engine>; 2] = [Box::new(alone), Box::new(sharded)];
        assert!(
            engines[1].describe().contains("ZeRO-1"),
            "{}",
            engines[1].describe()
        );
        for step in 1..=3 {
            for e in &mut engines {
                e.zero_grads().unwrap();
                for micro in 0..2 {
                    e.forward(&batch(2, 7, 11, step * 10 + micro), None)
                        .unwrap();
                    e.backward(0.5).unwrap();
                }
                e.reduce_grads().unwrap();
                e.clip_grads(train.grad_clip).unwrap();
                e.adamw(&AdamWStep::new(&train, step as usize, 1e-2))
                    .unwrap();
            }
            let [a, b] = &mut engines;
            assert_eq!(
                a.grad_norm().unwrap(),
                b.grad_norm().unwrap(),
                "{place:?} step {step}"
            );
            assert_eq!(a.take_losses().unwrap(), b.take_losses().unwrap());
            assert_all_close(&a.weights().unwrap(), &b.weights().unwrap(), 0.0, "weights");
            assert_all_close(&a.moments().unwrap(), &b.moments().unwrap(), 0.0, "moments");
        }
    }
}

/// The fused CUDA engine and decoder are driven only by the thread that built them (their
/// work is ordered on that thread's stream): from another thread, a clear error. They
/// are not `Send`, so safe code cannot get there; a wrapper that claims otherwise (as a
/// server's worker pool might) is what this catches.
#[cfg(feature = "cuda-emulator")]
#[test]
fn cuda_engines_refuse_another_thread() {
    struct Carried<T>(T);
    // SAFETY: the emulator's buffers are host memory; the values come back to the
    // thread that made them before they are dropped.
    unsafe impl<T> Send for Carried<T> {}
    let spec = ModelSpec::new(&cfg(PositionKind::Learned, false));
    let values = spec.initial_values(1);
    let mut engine = tinygpt::cuda::FusedCuda::emulated(&spec, &values, 2, Precision::F32).unwrap();
    let batch = Batch::empty(2, spec.shapes.block_size);
    Engine::forward(&mut engine, &batch, None).unwrap();
    let mut decoder =
        tinygpt::cuda::CudaDecoder::emulated(&spec, &values, 1, Precision::F32).unwrap();
    decoder.prefill(&[vec![1, 2]]).unwrap();
    let carried = Carried((engine, decoder));
    let (carried, engine_error, decoder_error) = std::thread::spawn(move || {
        let mut carried = carried;
        let (engine, decoder) = &mut carried.0;
        let engine_error = Engine::forward(engine, &batch, None)
            .unwrap_err()
            .to_string();
        let decoder_error = decoder.step(&[3]).map(|_| ()).unwrap_err().to_string();
        (carried, engine_error, decoder_error)
    })
    .join()
    .unwrap();
    assert!(engine_error.contains("built on thread"), "{engine_error}");
    assert!(decoder_error.contains("built on thread"), "{decoder_error}");
    // Back on its thread it works again.
    let (mut engine, _) = carried.0;
    Engine::forward(&mut engine, &Batch::empty(2, spec.shapes.block_size), None).unwrap();
}
