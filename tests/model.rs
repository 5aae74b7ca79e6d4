//! The model checked against math: the attention worked example, causality, RoPE's
//! relative positions, sinusoidal positions, grouped K/V heads, and gradients against
//! finite differences.

use candle_core::{DType, Device, IndexOp, Tensor};
use tinygpt::config::{MlpKind, ModelConfig, NormKind, PositionKind, Precision};
use tinygpt::model::attention::{causal_mask, scaled_dot_product_attention};
use tinygpt::model::position::{sinusoidal_table, Rope};
use tinygpt::model::Gpt;

fn tiny_cfg(positions: PositionKind) -> ModelConfig {
    ModelConfig {
        n_layer: 2,
        n_head: 4,
        n_kv_head: None,
        n_embd: 16,
        block_size: 12,
        positions,
        rope_theta: 10000.0,
        dropout: 0.0,
        bias: true,
        vocab_size: 11,
        ..ModelConfig::default()
    }
}

fn round2(rows: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
    rows.into_iter()
        .map(|r| r.into_iter().map(|x| (x * 100.0).round() / 100.0).collect())
        .collect()
}

/// The lecture's three-token example, through the project's attention function.
#[test]
fn attention_worked_example() {
    let dev = Device::Cpu;
    let q = Tensor::new(&[[1f32, 0.], [0., 1.], [1., 0.]], &dev)
        .unwrap()
        .reshape((1, 1, 3, 2))
        .unwrap();
    let k = Tensor::new(&[[1f32, 0.], [0., 1.], [0.5, 0.5]], &dev)
        .unwrap()
        .reshape((1, 1, 3, 2))
        .unwrap();
    let v = Tensor::new(&[[2f32, 0.], [0., 2.], [1.5, 0.5]], &dev)
        .unwrap()
        .reshape((1, 1, 3, 2))
        .unwrap();

    // Unscaled, unmasked.
    let (out, w) =
        scaled_dot_product_attention(&q, &k, &v, 1.0, false, None, Precision::F32).unwrap();
    let w = round2(w.i((0, 0)).unwrap().to_vec2::<f32>().unwrap());
    assert_eq!(
        w,
        vec![
            vec![0.51, 0.19, 0.31],
            vec![0.19, 0.51, 0.31],
            vec![0.51, 0.19, 0.31]
        ]
    );
    let out0 = out.i((0, 0, 0)).unwrap().to_vec1::<f32>().unwrap();
    assert!(
        (out0[0] - 1.48).abs() < 0.01 && (out0[1] - 0.53).abs() < 0.01,
        "{out0:?}"
    );

    // Causal: token i sees tokens 0..=i only.
    let (_, w) = scaled_dot_product_attention(&q, &k, &v, 1.0, true, None, Precision::F32).unwrap();
    let w = round2(w.i((0, 0)).unwrap().to_vec2::<f32>().unwrap());
    assert_eq!(
        w,
        vec![
            vec![1.0, 0.0, 0.0],
            vec![0.27, 0.73, 0.0],
            vec![0.51, 0.19, 0.31]
        ]
    );
}

#[test]
fn causal_mask_with_cached_keys() {
    // Two new queries after three cached keys: they sit at positions 3 and 4.
    let m = causal_mask(2, 5, &Device::Cpu)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(&m[0][..4], &[0.0; 4]);
    assert_eq!(m[0][4], f32::NEG_INFINITY);
    assert_eq!(m[1], vec![0.0; 5]);
}

fn logits(model: &Gpt, ids: &[u32]) -> Vec<Vec<f32>> {
    let idx = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let out = model.forward(&idx, 0, None, None).unwrap();
    out.logits.i(0).unwrap().to_vec2::<f32>().unwrap()
}

/// Changing tokens after position t never changes the logits at positions <= t.
#[test]
fn causality_for_every_position_kind() {
    for positions in [
        PositionKind::Learned,
        PositionKind::Rope,
        PositionKind::Sinusoidal,
    ] {
        let model = Gpt::new(&tiny_cfg(positions), 3, &Device::Cpu).unwrap();
        let a: Vec<u32> = vec![1, 5, 2, 9, 0, 3, 7, 7, 4, 10];
        let t = 4;
        let mut b = a.clone();
        for (i, id) in b.iter_mut().enumerate().skip(t + 1) {
            *id = (*id + 1 + i as u32) % 11;
        }
        let (la, lb) = (logits(&model, &a), logits(&model, &b));
        for pos in 0..=t {
            assert_eq!(
                la[pos], lb[pos],
                "{positions:?}: position {pos} saw the future"
            );
        }
        assert_ne!(
            la[t + 1],
            lb[t + 1],
            "{positions:?}: later positions must change"
        );
    }
}

fn rotate(rope: &Rope, x: &[f32], pos: usize) -> Vec<f32> {
    let t = Tensor::new(x, &Device::Cpu)
        .unwrap()
        .reshape((1, 1, 1, x.len()))
        .unwrap();
    rope.apply(&t, pos)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[test]
fn rope_scores_depend_only_on_the_offset() {
    let mut cfg = tiny_cfg(PositionKind::Rope);
    cfg.block_size = 64;
    let rope = Rope::new(&cfg, &Device::Cpu, DType::F32).unwrap();
    let q = [0.3f32, -1.2, 0.7, 0.1];
    let k = [-0.5f32, 0.4, 0.9, -0.8];
    for (m, n, s) in [(0, 3, 5), (7, 2, 20), (10, 10, 40)] {
        let a = dot(&rotate(&rope, &q, m), &rotate(&rope, &k, n));
        let b = dot(&rotate(&rope, &q, m + s), &rotate(&rope, &k, n + s));
        assert!((a - b).abs() < 1e-5, "({m},{n}) vs shifted by {s}: {a} {b}");
    }
    // And it really does depend on the offset.
    let near = dot(&rotate(&rope, &q, 0), &rotate(&rope, &k, 1));
    let far = dot(&rotate(&rope, &q, 0), &rotate(&rope, &k, 9));
    assert!((near - far).abs() > 1e-3);
}

/// Split-halves pairing: dimension i turns with i + d/2 by pos * base^(-2i/d).
#[test]
fn rope_rotates_split_halves() {
    let mut cfg = tiny_cfg(PositionKind::Rope);
    cfg.block_size = 8;
    let rope = Rope::new(&cfg, &Device::Cpu, DType::F32).unwrap(); // head size 4
    let x = [1f32, 2.0, 3.0, 4.0];
    let pos = 3;
    let got = rotate(&rope, &x, pos);
    for i in 0..2 {
        let angle = pos as f64 * 10000f64.powf(-2.0 * i as f64 / 4.0);
        let (c, s) = (angle.cos() as f32, angle.sin() as f32);
        let (a, b) = (x[i], x[i + 2]);
        assert!((got[i] - (a * c - b * s)).abs() < 1e-6);
        assert!((got[i + 2] - (b * c + a * s)).abs() < 1e-6);
    }
    assert_eq!(
        rotate(&rope, &x, 0),
        x.to_vec(),
        "position 0 is the identity"
    );
}

/// The paper's table, divided by sqrt(C) (the paper multiplies the embedding by it).
#[test]
fn sinusoidal_table_matches_the_paper() {
    let pe = sinusoidal_table(10, 8, 1.0 / 8f64.sqrt(), &Device::Cpu)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let scale = 1.0 / 8f64.sqrt();
    for pos in [0usize, 1, 9] {
        for i in 0..4 {
            let angle = pos as f64 / 10000f64.powf(2.0 * i as f64 / 8.0);
            assert!((pe[pos][2 * i] as f64 - scale * angle.sin()).abs() < 1e-6);
            assert!((pe[pos][2 * i + 1] as f64 - scale * angle.cos()).abs() < 1e-6);
        }
    }
}

/// Grouped-query attention whose K/V heads are copies is plain multi-head attention:
/// build a GQA model, then an MHA model whose K/V weights repeat each group's head.
#[test]
fn grouped_kv_heads_equal_repeated_heads() {
    let dev = Device::Cpu;
    let mut gqa_cfg = tiny_cfg(PositionKind::Rope);
    gqa_cfg.n_kv_head = Some(2);
    gqa_cfg.bias = false;
    let gqa = Gpt::new(&gqa_cfg, 5, &dev).unwrap();
    let mut mha_cfg = gqa_cfg.clone();
    mha_cfg.n_kv_head = None;
    let mha = Gpt::new(&mha_cfg, 6, &dev).unwrap();

    let d = gqa_cfg.head_dim();
    let (h, h_kv) = (gqa_cfg.n_head, 2);
    let mut weights = gqa.params().to_map();
    for layer in 0..gqa_cfg.n_layer {
        let name = format!("h.{layer}.attn.c_attn.weight");
        let w = &weights[&name]; // ((H + 2 H_kv) d, C)
        let q = w.narrow(0, 0, h * d).unwrap();
        let expand = |start: usize| -> Tensor {
            let heads: Vec<Tensor> = (0..h)
                .map(|i| w.narrow(0, (start + i / (h / h_kv)) * d, d).unwrap())
                .collect();
            Tensor::cat(&heads, 0).unwrap()
        };
        let k = expand(h);
        let v = expand(h + h_kv);
        weights.insert(name, Tensor::cat(&[q, k, v], 0).unwrap());
    }
    mha.params().load(&weights, "test").unwrap();
    let ids = [3u32, 1, 4, 1, 5, 9, 2, 6];
    let (a, b) = (logits(&gqa, &ids), logits(&mha, &ids));
    for (ra, rb) in a.iter().zip(&b) {
        for (x, y) in ra.iter().zip(rb) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }
}

/// Autograd gradients of the whole model agree with central finite differences (f64).
#[test]
fn gradients_match_finite_differences() {
    let dev = Device::Cpu;
    let variants = [
        (PositionKind::Learned, NormKind::LayerNorm, MlpKind::Gelu),
        (PositionKind::Rope, NormKind::LayerNorm, MlpKind::Gelu),
        (PositionKind::Sinusoidal, NormKind::LayerNorm, MlpKind::Gelu),
        (
            PositionKind::Learned,
            NormKind::LayerNorm,
            MlpKind::GeluTanh,
        ),
        (PositionKind::Rope, NormKind::RmsNorm, MlpKind::Swiglu),
    ];
    for (positions, norm, mlp) in variants {
        let mut cfg = tiny_cfg(positions);
        cfg.norm = norm;
        cfg.mlp = mlp;
        cfg.n_layer = 1;
        cfg.n_embd = 8;
        cfg.n_head = 2;
        cfg.n_kv_head = Some(1);
        cfg.block_size = 6;
        cfg.vocab_size = 7;
        let model = Gpt::with_dtype(&cfg, 11, &dev, DType::F64).unwrap();
        let x = Tensor::new(&[[1u32, 4, 2, 6, 0, 3], [5, 5, 1, 2, 3, 4]], &dev).unwrap();
        let y = Tensor::new(&[[4u32, 2, 6, 0, 3, 1], [5, 1, 2, 3, 4, 0]], &dev).unwrap();
        let loss_of = || -> f64 {
            model
                .loss(&x, &y, None)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        let loss = model.loss(&x, &y, None).unwrap();
        let grads = loss.backward().unwrap();
        let eps = 1e-6;
        for (param, var) in model.params().iter() {
            let name = param.name.as_str();
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name} has no gradient"))
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let original = var
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            // A few elements of every tensor, spread over it.
            let n = original.len();
            for &i in &[0, n / 3, n / 2, n - 1] {
                let probe = |delta: f64| -> f64 {
                    let mut v = original.clone();
                    v[i] += delta;
                    var.set(&Tensor::from_vec(v, var.shape(), &dev).unwrap())
                        .unwrap();
                    loss_of()
                };
                let numeric = (probe(eps) - probe(-eps)) / (2.0 * eps);
                var.set(&Tensor::from_vec(original.clone(), var.shape(), &dev).unwrap())
                    .unwrap();
                let err = (numeric - g[i]).abs();
                assert!(
                    err <= 1e-6 + 1e-4 * numeric.abs().max(g[i].abs()),
                    "{positions:?} {name}[{i}]: autograd {} vs finite difference {numeric}",
                    g[i]
                );
            }
        }
    }
}

/// Parameter count of the baby config equals nanoGPT's 0.80M (+ position table).
#[test]
fn baby_parameter_count() {
    let cfg = ModelConfig {
        vocab_size: 65,
        ..ModelConfig::default()
    };
    let model = Gpt::new(&cfg, 0, &Device::Cpu).unwrap();
    let (v, c, t, l) = (65, 128, 64, 4);
    let block = c + 3 * c * c + c * c + c + 4 * c * c + 4 * c * c; // ln_1, qkv, proj, ln_2, mlp
    let expected = v * c + t * c + l * block + c;
    assert_eq!(model.params().scalar_count(), expected);
    // nanoGPT prints 0.80M: it leaves the position table out of its count.
    assert_eq!(format!("{:.2}M", (expected - t * c) as f64 / 1e6), "0.80M");
}
