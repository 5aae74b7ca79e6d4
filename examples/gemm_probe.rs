// Throwaway: GFLOP/s of cpu::gemm::matmul at the baby model's shapes.
use std::time::Instant;
use tinygpt::config::Precision;
use tinygpt::cpu::gemm::matmul;
use tinygpt::cpu::matrix::{Product, Strided};
fn main() {
    // (name, m, n, k, a transposed?, b transposed?)
    let shapes = [
        ("qkv fwd", 4096, 1152, 384, false, true),
        ("fc fwd", 4096, 1536, 384, false, true),
        ("proj fwd", 4096, 384, 1536, false, true),
        ("fc dx", 4096, 384, 1536, false, false),
        ("fc dW", 1536, 384, 4096, true, false),
        ("qkv dW", 1152, 384, 4096, true, false),
    ];
    for (name, m, n, k, at, bt) in shapes {
        let a = vec![0.5f32; m * k];
        let b = vec![0.25f32; k * n];
        let mut c = vec![0f32; m * n];
        let sa = if at {
            Strided::columns(&a, m)
        } else {
            Strided::rows(&a, k)
        };
        let sb = if bt {
            Strided::columns(&b, k)
        } else {
            Strided::rows(&b, n)
        };
        let p = Product::new(sa, sb, (m, n, k));
        for _ in 0..20 {
            matmul(&mut c, n, p, Precision::F32);
        }
        let reps = (2e9 / (2.0 * (m * n * k) as f64)).max(50.0) as usize;
        let t = Instant::now();
        for _ in 0..reps {
            matmul(&mut c, n, p, Precision::F32);
        }
        let s = t.elapsed().as_secs_f64();
        println!(
            "{name:10} {m}x{n}x{k}: {:.1} GFLOP/s ({:.1} us)",
            2.0 * (m * n * k) as f64 * reps as f64 / s / 1e9,
            s / reps as f64 * 1e6
        );
    }
    // One head of attention, serial, causal: S = Q K^T (T x T x d), Y = P V (T x d x T).
    use tinygpt::cpu::gemm::matmul_serial;
    use tinygpt::cpu::matrix::Causal;
    let (t, d, w) = (256, 64, 1152);
    let qkv = vec![0.1f32; t * w];
    let mut p = vec![0f32; t * t];
    let mut y = vec![0f32; t * 384];
    for (name, causal) in [("plain", Causal::No), ("causal", Causal::LowerDst)] {
        let reps = 2000;
        let t0 = Instant::now();
        for _ in 0..reps {
            let qk = Product::new(
                Strided::rows(&qkv, w),
                Strided::columns(&qkv[384..], w),
                (t, t, d),
            )
            .causal(causal);
            matmul_serial(&mut p, t, qk, Precision::F32);
            let c2 = if causal == Causal::No {
                Causal::No
            } else {
                Causal::LowerA
            };
            let pv = Product::new(
                Strided::rows(&p, t),
                Strided::rows(&qkv[768..], w),
                (t, d, t),
            )
            .causal(c2);
            matmul_serial(&mut y, 384, pv, Precision::F32);
        }
        let s = t0.elapsed().as_secs_f64();
        let flops = 2.0 * 2.0 * (t * t * d) as f64;
        println!(
            "attn head {name}: {:.1} us per head, {:.1} GFLOP/s of the full product",
            s / reps as f64 * 1e6,
            flops * reps as f64 / s / 1e9
        );
    }
}
