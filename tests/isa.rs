//! Every CPU level this machine supports (AMX, AVX-512, AVX2, scalar: `TINYGPT_CPU_ISA`'s
//! values) gives the same results: the f32 and bf16 GEMMs against an f64 oracle, vector kernels
//! against the scalar level, and the whole fused engine against the reference engine.
//! So the AVX2 paths are tested on AVX-512 machines too.
//!
//! The level is process-wide: one test here forces it, level after level; the other
//! only runs the binary.

use std::process::Command;

use candle_core::Device;
use tinygpt::config::{MlpKind, ModelConfig, NormKind, Precision};
use tinygpt::cpu::gemm::{matmul, matmul_serial};
use tinygpt::cpu::isa::{self, Isa};
use tinygpt::cpu::matrix::{Product, Strided};
use tinygpt::cpu::ops::activation::Activation;
use tinygpt::cpu::ops::attention::causal_softmax_rows;
use tinygpt::cpu::ops::norm::{NormStats, NormWeights};
use tinygpt::data::Batch;
use tinygpt::engine::{self, EngineOptions};
use tinygpt::model::spec::Shapes;
use tinygpt::model::ModelSpec;

mod common;
use common::gpt2_and_llama;

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            ((i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 1000) as f32 / 500.0 - 1.0
        })
        .collect()
}

/// f32 and bf16 products (bf16 training's: the AMX tiles at the `amx` level,
/// `vdpbf16ps` or portable Rust below it) at odd sizes past the tiles' edges and past
/// one k block, every layout of both operands, plain and split over threads, against
/// the same sums in f64 (of the operands rounded to bf16, for bf16).
fn check_gemm(level: Isa) {
    use tinygpt::cpu::bf16::round_to_bf16;
    for precision in [Precision::F32, Precision::Bf16] {
        let round = |x: f32| match precision {
            Precision::F32 => x,
            Precision::Bf16 => round_to_bf16(x),
        };
        for (m, n, k) in [
            (1, 1, 1),
            (7, 19, 5),
            (33, 17, 70),
            (96, 130, 257),
            (300, 200, 100),
            (70, 40, 1100),
        ] {
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            let want: Vec<f64> = (0..m * n)
                .map(|i| {
                    (0..k)
                        .map(|p| round(a[(i / n) * k + p]) as f64 * round(b[p * n + i % n]) as f64)
                        .sum()
                })
                .collect();
            let at: Vec<f32> = (0..m * k).map(|i| a[(i % m) * k + i / m]).collect(); // (k x m)
            let bt: Vec<f32> = (0..k * n).map(|i| b[(i % k) * n + i / k]).collect(); // (n x k)
            for (sa, a_t) in [
                (Strided::rows(&a, k), false),
                (Strided::columns(&at, m), true),
            ] {
                for (sb, b_t) in [
                    (Strided::rows(&b, n), false),
                    (Strided::columns(&bt, k), true),
                ] {
                    let p = Product::new(sa, sb, (m, n, k));
                    let (mut par, mut serial) = (vec![0f32; m * n], vec![0f32; m * n]);
                    matmul(&mut par, n, p, precision);
                    matmul_serial(&mut serial, n, p, precision);
                    for (got, what) in [(&par, "matmul"), (&serial, "serial")] {
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            let tol = 1e-5 * (1.0 + k as f64).sqrt() * (1.0 + w.abs());
                            assert!(
                                (*g as f64 - w).abs() <= tol,
                                "{level:?} {precision:?} {what} {m}x{n}x{k} a_t={a_t} b_t={b_t} [{i}]: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Vector kernels' outputs at `level` (their sums run in another order per level, so
/// they are compared to the scalar level to float rounding).
fn kernel_outputs() -> Vec<Vec<f32>> {
    let cfg = ModelConfig {
        n_embd: 40,
        n_head: 4,
        vocab_size: 5,
        ..ModelConfig::default()
    };
    let s = Shapes::new(&cfg);
    let rows = 9;
    let x = values(rows * s.n_embd, 3);
    let (w, b) = (values(s.n_embd, 4), values(s.n_embd, 5));
    let mut norm = vec![0f32; x.len()];
    let mut stats = NormStats::new(rows);
    let weights = NormWeights {
        kind: NormKind::LayerNorm,
        eps: 1e-5,
        w: &w,
        b: Some(&b),
    };
    weights.forward(&mut norm, &mut stats, &x);
    let fc = values(rows * s.mlp_fc_width, 6);
    let mut outputs = vec![norm, stats.rstd.clone()];
    for kind in [MlpKind::Gelu, MlpKind::GeluTanh] {
        let mut act = vec![0f32; rows * s.mlp_hidden];
        Activation::new(kind, &s).forward(&mut act, &fc);
        outputs.push(act);
    }
    let t = 37;
    let mut scores: Vec<f32> = values(t * t, 7).iter().map(|v| v * 8.0).collect();
    causal_softmax_rows(&mut scores, t);
    outputs.push(scores);
    outputs
}

/// The fused engine's loss and gradients at `level` against the reference engine's.
fn check_engine(level: Isa) {
    for cfg in gpt2_and_llama(37) {
        let cfg = ModelConfig {
            dropout: 0.1,
            ..cfg
        };
        let spec = ModelSpec::new(&cfg);
        let weights = spec.initial_values(3);
        let batch = Batch {
            x: values(3 * 37, 8)
                .iter()
                .map(|v| ((v + 1.0) * 33.0) as u32)
                .collect(),
            y: values(3 * 37, 9)
                .iter()
                .map(|v| ((v + 1.0) * 33.0) as u32)
                .collect(),
            batch: 3,
            block: 37,
        };
        let dropout = tinygpt::model::Dropout::in_pass(0.1, 1, 2, 0);
        let run = |fused| {
            let options = EngineOptions::f32(3, fused);
            let mut e = engine::build(&spec, &weights, &Device::Cpu, options).unwrap();
            let loss = e.loss(&batch, dropout.as_ref()).unwrap();
            e.backward(1.0).unwrap();
            (loss, e.grads().unwrap())
        };
        let (ref_loss, ref_grads) = run(false);
        let (loss, grads) = run(true);
        let what = format!("{level:?} {:?} {:?} {:?}", cfg.positions, cfg.norm, cfg.mlp);
        assert!(
            (loss - ref_loss).abs() <= 1e-5 * ref_loss,
            "{what}: {loss} vs {ref_loss}"
        );
        for (name, want) in &ref_grads {
            let want: Vec<f32> = want.flatten_all().unwrap().to_vec1().unwrap();
            let got: Vec<f32> = grads[name].flatten_all().unwrap().to_vec1().unwrap();
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
            let err = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                / scale;
            assert!(err <= 1e-5, "{what}: gradient of {name} off by {err:e}");
        }
    }
}

/// Eight- and four-bit products (one row and many) against the same dequantized
/// numbers in f64: each block's integer sum is exact at every level, only the f32 adds
/// of the scaled blocks round. Widths of whole and partial blocks, values at the ends
/// of the range.
fn check_q8(level: Isa) {
    check_blocks!(level, tinygpt::cpu::q8_matrix::Q8Matrix);
    check_blocks!(level, tinygpt::cpu::q4::Q4Matrix);
}

/// The block-quantized matrix type `$matrix` at `level` (see `check_q8`).
macro_rules! check_blocks {
    ($level:expr, $matrix:ty) => {{
        use tinygpt::cpu::q8::{Q8Row, BLOCK};
        let level = $level;
        let kind = stringify!($matrix);
        for (rows, cols, n) in [
            (1, 1, 1),
            (5, 32, 3),
            (3, 70, 6),
            (17, 100, 4),
            (64, 768, 5),
            // Rows of x in more than one of the products' L2-sized chunks (64 rows
            // at this width), the last chunk not a whole call of eight rows; a group
            // of sixteen weight rows padded from 9.
            (9, 4096, 70),
        ] {
            let mut w = values(rows * cols, 7);
            w[0] = -1.0; // the block's largest magnitude, on the negative side
            let xs: Vec<Vec<f32>> = (0..n).map(|r| values(cols, 11 + r as u32)).collect();
            let q = <$matrix>::quantize(&w, rows, cols);
            let quantized: Vec<Q8Row> = xs
                .iter()
                .map(|x| {
                    let mut row = Q8Row::default();
                    q.quantize_row(x, &mut row);
                    row
                })
                .collect();
            let bias = values(rows, 3);
            let mut many = vec![0f32; n * rows];
            q.matmat(0, rows, &quantized, Some(&bias), &mut many);
            let mut wrow = vec![0f32; cols];
            for r in 0..n {
                let mut one = vec![0f32; rows];
                q.matvec(0, &quantized[r], Some(&bias), &mut one);
                assert_eq!(
                    one,
                    many[r * rows..(r + 1) * rows],
                    "{kind} {level:?}: one row = many"
                );
                // x as the kernel sees it: quantized and back.
                let mut x_back = vec![0f32; cols];
                quantized[r].values_into(&mut x_back);
                for o in 0..rows {
                    q.row_into(o, &mut wrow);
                    let want: f64 = wrow
                        .iter()
                        .zip(&x_back)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum::<f64>()
                        + f64::from(bias[o]);
                    let blocks = cols.div_ceil(BLOCK) as f64;
                    assert!(
                        (f64::from(one[o]) - want).abs() <= 1e-6 * blocks * (1.0 + want.abs()),
                        "{kind} {level:?} ({rows}, {cols}) output {o}: {} vs {want}",
                        one[o]
                    );
                }
            }
        }
    }};
}
use check_blocks;

/// The products that read each weight row once for a few rows (f32 and bf16 weights),
/// against f64 sums of the weights as stored, for every row count up to 9 (the
/// four-row blocks and the rest; from 8 rows the sixteen-row groups of AVX2 and
/// AVX-512, padded) and 16, 17, 33 and 80 (those groups, a padded last one, several at
/// once; whole tiles of outputs and the rest), small
/// matrices and ones split over the threads; the one-row mat-vec in both orders (`matvec`), on rows shorter than its lines of 64,
/// of whole lines and of lines and a rest.
fn check_weight_rows(level: Isa) {
    use tinygpt::cpu::matvec::{self, Order};
    for order in Order::ALL {
        matvec::force(Some(order));
        check_weight_rows_in(level, order);
    }
    matvec::force(None);
}

fn check_weight_rows_in(level: Isa, order: tinygpt::cpu::matvec::Order) {
    use tinygpt::cpu::kernels::Widen;
    use tinygpt::cpu::weight_rows::{project_rows, Bf16};
    // (13, 4096) at 80 rows: five groups of sixteen for AVX2 and AVX-512's broadcasts,
    // taken two at a time at this width.
    for (d_out, d_in) in [
        (1, 1),
        (7, 33),
        (13, 64),
        (40, 100),
        (512, 300),
        (9, 768),
        (13, 4096),
    ] {
        let w = values(d_out * d_in, 5);
        let bits: Vec<Bf16> = w.iter().map(|&v| Bf16::round(v)).collect();
        let bias = values(d_out, 6);
        for rows in (1..=9).chain([16, 17, 33, 80]) {
            let x = values(rows * d_in, 9 + rows as u32);
            let mut out = vec![0f32; rows * d_out];
            let mut out_bf16 = vec![0f32; rows * d_out];
            project_rows(&w, Some(&bias), &x, d_in, &mut out);
            project_rows(&bits, Some(&bias), &x, d_in, &mut out_bf16);
            if level == Isa::Avx2 && rows >= 8 {
                // There bf16 takes f32's groups of sixteen rows on tiles widened first:
                // the same sums as f32 weights holding the widened values.
                let widened: Vec<f32> = bits.iter().map(|b| b.widen()).collect();
                let mut out_widened = vec![0f32; rows * d_out];
                project_rows(&widened, Some(&bias), &x, d_in, &mut out_widened);
                let same = out_bf16
                    .iter()
                    .zip(&out_widened)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "bf16 ({d_out}, {d_in}) x {rows} rows: not f32's sums of the widened weights"
                );
            }
            for r in 0..rows {
                for o in 0..d_out {
                    let xr = &x[r * d_in..(r + 1) * d_in];
                    let want = |row: &mut dyn Iterator<Item = f32>| {
                        row.zip(xr)
                            .map(|(a, &b)| f64::from(a) * f64::from(b))
                            .sum::<f64>()
                            + f64::from(bias[o])
                    };
                    let exact = want(&mut w[o * d_in..(o + 1) * d_in].iter().copied());
                    let widened =
                        want(&mut bits[o * d_in..(o + 1) * d_in].iter().map(|b| b.widen()));
                    let tolerance = 1e-6 * d_in as f64;
                    let (got, got_bf16) = (out[r * d_out + o], out_bf16[r * d_out + o]);
                    assert!(
                        (f64::from(got) - exact).abs() <= tolerance,
                        "{level:?} {order:?} f32 ({d_out}, {d_in}) x {rows} rows, [{r}, {o}]: {got} vs {exact}"
                    );
                    assert!(
                        (f64::from(got_bf16) - widened).abs() <= tolerance,
                        "{level:?} {order:?} bf16 ({d_out}, {d_in}) x {rows} rows, [{r}, {o}]: {got_bf16} vs {widened}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_supported_level_gives_the_same_results() {
    let levels = Isa::supported();
    eprintln!("levels this CPU supports: {levels:?}");
    isa::force(Some(Isa::Scalar));
    let scalar = kernel_outputs();
    for &level in &levels {
        isa::force(Some(level));
        assert_eq!(isa::active(), level);
        check_gemm(level);
        for (got, want) in kernel_outputs().iter().zip(&scalar) {
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= 2e-6 * (1.0 + w.abs()),
                    "{level:?}: {g} vs scalar {w}"
                );
            }
        }
        check_engine(level);
        check_q8(level);
        check_weight_rows(level);
    }
    isa::force(None);
    if levels.len() < Isa::ALL.len() {
        eprintln!(
            "note: this CPU lacks {:?}; those levels were not run",
            &Isa::ALL[levels.len()..]
        );
    }
}

/// `TINYGPT_CPU_ISA` caps what the binary runs (bench reports it), and a value that is
/// not a level is refused in one line, exit 2; `TINYGPT_MATVEC_ORDER` the same for the
/// mat-vecs' order, and `TINYGPT_MATVEC_AHEAD` for their software prefetches.
#[test]
fn the_environment_caps_the_level() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tiny.toml");
    std::fs::write(
        &config,
        "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 8\nvocab_size = 11\n[train]\nbatch_size = 2\n",
    )
    .unwrap();
    let bench_env = |isa: &str, order: &str, ahead: &str| {
        Command::new(env!("CARGO_BIN_EXE_tinygpt"))
            .args([
                "bench",
                "--config",
                config.to_str().unwrap(),
                "--steps",
                "1",
                "--warmup",
                "0",
            ])
            .args(["--decode-tokens", "2", "--prompt-tokens", "2", "--json"])
            .env("TINYGPT_CPU_ISA", isa)
            .env("TINYGPT_MATVEC_ORDER", order)
            .env("TINYGPT_MATVEC_AHEAD", ahead)
            .output()
            .unwrap()
    };
    let bench_with = |isa: &str, order: &str| bench_env(isa, order, "");
    let bench = |isa: &str| bench_with(isa, "");
    // A run that succeeds gives its JSON report; a refused one, one line naming the
    // variable and a value it takes, exit 2.
    let report = |out: std::process::Output| -> serde_json::Value {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let refused = |out: std::process::Output, variable: &str, value: &str| {
        assert_eq!(out.status.code(), Some(2));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains(variable) && stderr.contains(value),
            "{stderr}"
        );
    };
    assert_eq!(report(bench("scalar"))["cpu_isa"], "scalar");
    refused(bench("sse9"), "TINYGPT_CPU_ISA", "avx2");
    for order in ["side-by-side", "in-order"] {
        assert_eq!(report(bench_with("", order))["matvec_order"], order);
    }
    for (ahead, asks) in [("on", true), ("off", false)] {
        assert_eq!(
            report(bench_env("", "in-order", ahead))["matvec_asks_ahead"],
            asks
        );
    }
    refused(
        bench_env("", "", "sometimes"),
        "TINYGPT_MATVEC_AHEAD",
        "off",
    );
    refused(
        bench_with("", "diagonal"),
        "TINYGPT_MATVEC_ORDER",
        "in-order",
    );
}
