//! The training fast path against the reference model (plain candle ops + autograd):
//! same loss, same gradient for every parameter, same weights after AdamW steps, to
//! 1e-5 relative, at odd sizes, for every position kind, with and without biases.

use candle_core::{Device, Tensor};
use tinygpt::config::{MlpKind, ModelConfig, NormKind, PositionKind, Precision, TrainConfig};
use tinygpt::fast::train::FastGpt;
use tinygpt::model::{Dropout, Gpt};
use tinygpt::train::optim::AdamW;

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

fn batch(b: usize, t: usize, v: u32, seed: u32) -> Vec<u32> {
    (0..b * t)
        .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) % v)
        .collect()
}

/// max |a - b| relative to max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12) as f64;
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) as f64;
    diff / scale
}

#[test]
fn fast_path_matches_the_reference() {
    let dev = Device::Cpu;
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
    for (positions, bias, kv, norm, mlp) in variants {
        let mut cfg = cfg(positions, bias);
        cfg.n_kv_head = Some(kv);
        cfg.norm = norm;
        cfg.mlp = mlp;
        let reference = Gpt::new(&cfg, 5, &dev).unwrap();
        let mut fast = FastGpt::new(&cfg, reference.params(), b, Precision::F32).unwrap();
        let train = TrainConfig {
            weight_decay: 0.1,
            ..TrainConfig::default()
        };
        let mut adamw = AdamW::new(reference.params(), &train).unwrap();
        let what = format!("{positions:?} bias={bias} kv={kv} {norm:?} {mlp:?}");

        for step in 1..=3 {
            let ids = batch(b, t, 11, step as u32);
            let targets = batch(b, t, 11, 100 + step as u32);
            let x = Tensor::from_slice(&ids, (b, t), &dev).unwrap();
            let y = Tensor::from_slice(&targets, (b, t), &dev).unwrap();
            let loss = reference.loss(&x, &y, None).unwrap();
            let ref_loss = loss.to_scalar::<f32>().unwrap() as f64;
            let grads = loss.backward().unwrap();

            // Gradients at the same weights.
            fast.read_params(reference.params()).unwrap();
            fast.zero_grads();
            let fast_loss = fast.forward(&ids, &targets, None);
            fast.backward(1.0);
            assert!(
                (fast_loss - ref_loss).abs() <= 1e-5 * ref_loss,
                "{what} step {step}: loss {fast_loss} vs {ref_loss}"
            );

            let fast_grads = fast.grads_by_name();
            let mut ordered = Vec::new();
            for (param, var) in reference.params().iter() {
                let name = param.name.as_str();
                let g = grads.get(var.as_tensor()).unwrap();
                let expected: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
                let err = rel_err(&fast_grads[name], &expected);
                assert!(
                    err <= 1e-5,
                    "{what} step {step}: gradient of {name} off by {err:e}"
                );
                ordered.push(g.clone());
            }

            // The same update from the same gradients on both sides (the moments carry
            // over from step to step).
            for ((param, _), g) in reference.params().iter().zip(&ordered) {
                fast.set_grad(
                    &param.name,
                    &g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
            }
            let lr = 1e-2;
            adamw.step(&ordered, lr).unwrap();
            fast.adamw(step, lr, &train);
            let check = Gpt::new(&cfg, 99, &dev).unwrap();
            fast.write_params(check.params()).unwrap();
            for ((param, a), (_, b)) in reference.params().iter().zip(check.params().iter()) {
                let name = &param.name;
                let a: Vec<f32> = a.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                let b: Vec<f32> = b.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
                let err = rel_err(&b, &a);
                assert!(
                    err <= 1e-5,
                    "{what}: {name} after AdamW step {step} off by {err:e}"
                );
            }
        }
    }
}

#[test]
fn gradient_scale_and_accumulation_add_up() {
    let cfg = cfg(PositionKind::Learned, true);
    let reference = Gpt::new(&cfg, 5, &Device::Cpu).unwrap();
    let mut fast = FastGpt::new(&cfg, reference.params(), 2, Precision::F32).unwrap();
    let (a_ids, a_t) = (batch(2, 7, 11, 1), batch(2, 7, 11, 2));
    let (b_ids, b_t) = (batch(2, 7, 11, 3), batch(2, 7, 11, 4));
    fast.zero_grads();
    fast.forward(&a_ids, &a_t, None);
    fast.backward(0.5);
    fast.forward(&b_ids, &b_t, None);
    fast.backward(0.5);
    let together = fast.grads.clone();
    fast.zero_grads();
    fast.forward(&a_ids, &a_t, None);
    fast.backward(1.0);
    let a = fast.grads.clone();
    fast.zero_grads();
    fast.forward(&b_ids, &b_t, None);
    fast.backward(1.0);
    let mean: Vec<f32> = a
        .iter()
        .zip(&fast.grads)
        .map(|(x, y)| 0.5 * (x + y))
        .collect();
    assert!(rel_err(&together, &mean) < 1e-6);
}

#[test]
fn the_fast_path_runs_on_the_cpu_only() {
    assert!(FastGpt::unsupported(&Device::Cpu).is_none());
}

/// With dropout, both paths draw their masks from the same stream in the same order:
/// same loss, same gradients.
#[test]
fn dropout_masks_are_the_reference_masks() {
    let dev = Device::Cpu;
    let (b, t) = (3, 7);
    for (positions, norm, mlp) in [
        (PositionKind::Learned, NormKind::LayerNorm, MlpKind::Gelu),
        (PositionKind::Rope, NormKind::RmsNorm, MlpKind::Swiglu),
    ] {
        let mut cfg = cfg(positions, true);
        cfg.dropout = 0.2;
        cfg.norm = norm;
        cfg.mlp = mlp;
        let reference = Gpt::new(&cfg, 5, &dev).unwrap();
        let mut fast = FastGpt::new(&cfg, reference.params(), b, Precision::F32).unwrap();
        let ids = batch(b, t, 11, 1);
        let targets = batch(b, t, 11, 2);
        let x = Tensor::from_slice(&ids, (b, t), &dev).unwrap();
        let y = Tensor::from_slice(&targets, (b, t), &dev).unwrap();
        let loss = reference
            .loss(&x, &y, Dropout::in_pass(0.2, 9, 3, 0).as_ref())
            .unwrap();
        let ref_loss = loss.to_scalar::<f32>().unwrap() as f64;
        let grads = loss.backward().unwrap();
        fast.zero_grads();
        let fast_loss = fast.forward(&ids, &targets, Dropout::in_pass(0.2, 9, 3, 0).as_ref());
        fast.backward(1.0);
        assert!(
            (fast_loss - ref_loss).abs() <= 1e-5 * ref_loss,
            "{positions:?}: loss {fast_loss} vs {ref_loss}"
        );
        let no_dropout = fast.forward(&ids, &targets, None);
        assert!(
            (no_dropout - fast_loss).abs() > 1e-3,
            "dropout must change the loss"
        );
        let fast_grads = fast.grads_by_name();
        for (param, var) in reference.params().iter() {
            let name = param.name.as_str();
            let expected: Vec<f32> = grads
                .get(var.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let err = rel_err(&fast_grads[name], &expected);
            assert!(
                err <= 1e-5,
                "{positions:?}: gradient of {name} off by {err:e}"
            );
        }
    }
}

/// The reference model's loss on one batch and each parameter's gradient, in
/// parameter order.
fn reference_loss_and_grads(
    model: &Gpt,
    ids: &[u32],
    targets: &[u32],
    (b, t): (usize, usize),
) -> (f64, Vec<(String, Vec<f32>)>) {
    let dev = Device::Cpu;
    let x = Tensor::from_slice(ids, (b, t), &dev).unwrap();
    let y = Tensor::from_slice(targets, (b, t), &dev).unwrap();
    let loss = model.loss(&x, &y, None).unwrap();
    let grads = loss.backward().unwrap();
    let by_name = model
        .params()
        .iter()
        .map(|(param, var)| {
            let g = grads.get(var.as_tensor()).unwrap();
            (
                param.name.clone(),
                g.flatten_all().unwrap().to_vec1().unwrap(),
            )
        })
        .collect();
    (loss.to_scalar::<f32>().unwrap() as f64, by_name)
}

/// The fast path's loss and gradients (by name) on one batch.
fn fast_loss_and_grads(
    fast: &mut FastGpt,
    ids: &[u32],
    targets: &[u32],
) -> (f64, std::collections::HashMap<String, Vec<f32>>) {
    fast.zero_grads();
    let loss = fast.forward(ids, targets, None);
    fast.backward(1.0);
    (loss, fast.grads_by_name())
}

/// bf16 matrix products (f32 sums, f32 everything else) against the f32 reference: the
/// loss and every gradient within what rounding operands to 8 significant bits allows,
/// and measurably different from f32 (so the products really are rounded). Sizes past
/// the GEMM's 6 x 64 tiles and its k pairs (odd head size, odd widths).
#[test]
fn bf16_products_stay_within_bf16_rounding_of_the_reference() {
    let (b, t) = (3, 37);
    for (positions, kv, norm, mlp) in [
        (PositionKind::Learned, 4, NormKind::LayerNorm, MlpKind::Gelu),
        (PositionKind::Rope, 2, NormKind::RmsNorm, MlpKind::Swiglu),
    ] {
        let cfg = ModelConfig {
            n_layer: 2,
            n_head: 4,
            n_kv_head: Some(kv),
            n_embd: 72, // head size 18
            block_size: t,
            positions,
            norm,
            mlp,
            vocab_size: 67,
            ..ModelConfig::default()
        };
        let reference = Gpt::new(&cfg, 5, &Device::Cpu).unwrap();
        let (ids, targets) = (batch(b, t, 67, 1), batch(b, t, 67, 2));
        let (ref_loss, ref_grads) = reference_loss_and_grads(&reference, &ids, &targets, (b, t));
        let mut f32_path = FastGpt::new(&cfg, reference.params(), b, Precision::F32).unwrap();
        let mut bf16_path = FastGpt::new(&cfg, reference.params(), b, Precision::Bf16).unwrap();
        let (f32_loss, f32_grads) = fast_loss_and_grads(&mut f32_path, &ids, &targets);
        let (bf16_loss, bf16_grads) = fast_loss_and_grads(&mut bf16_path, &ids, &targets);
        let what = format!("{positions:?} kv={kv}");
        assert!(
            (bf16_loss - ref_loss).abs() <= 2e-4 * ref_loss,
            "{what}: bf16 loss {bf16_loss} vs {ref_loss}"
        );
        assert!(
            (bf16_loss - f32_loss).abs() > 1e-7,
            "{what}: bf16 gave exactly the f32 loss"
        );
        for (name, expected) in &ref_grads {
            let f32_err = rel_err(&f32_grads[name], expected);
            let bf16_err = rel_err(&bf16_grads[name], expected);
            assert!(
                f32_err <= 1e-5,
                "{what}: f32 gradient of {name} off by {f32_err:e}"
            );
            // Each operand carries a relative error up to 2^-9 (0.2%); through the
            // layers' products that stays under 2% of each gradient's largest entry
            // (measured: under 0.75%).
            assert!(
                bf16_err <= 2e-2,
                "{what}: bf16 gradient of {name} off by {bf16_err:e}"
            );
            assert!(
                bf16_err > 0.0,
                "{what}: bf16 gradient of {name} is the f32 one"
            );
        }
    }
}

/// Past one 64-row causal block and the bf16 GEMM's 96-row blocks (T = 150): the f32
/// fast path still equals the reference to 1e-5, and bf16 stays within its rounding.
#[test]
fn long_contexts_match_the_reference() {
    let (b, t) = (2, 150);
    let cfg = ModelConfig {
        n_layer: 1,
        n_head: 2,
        n_embd: 16,
        block_size: t,
        vocab_size: 11,
        ..ModelConfig::default()
    };
    let reference = Gpt::new(&cfg, 5, &Device::Cpu).unwrap();
    let (ids, targets) = (batch(b, t, 11, 1), batch(b, t, 11, 2));
    let (ref_loss, ref_grads) = reference_loss_and_grads(&reference, &ids, &targets, (b, t));
    for (precision, tol) in [(Precision::F32, 1e-5), (Precision::Bf16, 2e-2)] {
        let mut fast = FastGpt::new(&cfg, reference.params(), b, precision).unwrap();
        let (loss, grads) = fast_loss_and_grads(&mut fast, &ids, &targets);
        assert!(
            (loss - ref_loss).abs() <= tol * ref_loss,
            "{precision:?}: loss {loss} vs {ref_loss}"
        );
        for (name, expected) in &ref_grads {
            let err = rel_err(&grads[name], expected);
            assert!(
                err <= tol,
                "{precision:?}: gradient of {name} off by {err:e}"
            );
        }
    }
}

/// The reference model's bf16 products (autocast's recipe, for GPUs) land within bf16
/// rounding of its f32 products and of the fused bf16 path, and really are rounded.
#[test]
fn reference_bf16_products_track_f32() {
    let (b, t) = (2, 19);
    let cfg = ModelConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: t,
        vocab_size: 23,
        ..ModelConfig::default()
    };
    let (ids, targets) = (batch(b, t, 23, 1), batch(b, t, 23, 2));
    let f32_model = Gpt::with_products(&cfg, 5, &Device::Cpu, Precision::F32).unwrap();
    let bf16_model = Gpt::with_products(&cfg, 5, &Device::Cpu, Precision::Bf16).unwrap();
    let (f32_loss, f32_grads) = reference_loss_and_grads(&f32_model, &ids, &targets, (b, t));
    let (bf16_loss, bf16_grads) = reference_loss_and_grads(&bf16_model, &ids, &targets, (b, t));
    assert!(
        bf16_loss != f32_loss,
        "bf16 products gave the f32 loss exactly"
    );
    assert!(
        (bf16_loss - f32_loss).abs() <= 5e-4 * f32_loss,
        "loss {bf16_loss} vs {f32_loss}"
    );
    for ((name, g), (_, want)) in bf16_grads.iter().zip(&f32_grads) {
        let err = rel_err(g, want);
        assert!(err <= 2e-2, "gradient of {name} off by {err:e}");
    }
    let mut fast = FastGpt::new(&cfg, bf16_model.params(), b, Precision::Bf16).unwrap();
    let fast_loss = fast.forward(&ids, &targets, None);
    assert!(
        (fast_loss - bf16_loss).abs() <= 5e-4 * f32_loss,
        "fused bf16 loss {fast_loss} vs reference bf16 {bf16_loss}"
    );
}
