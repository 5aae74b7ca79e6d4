//! Our dispatched f32 GEMM (at the active level: `sgemm` on AVX2 cores) against the gemm
//! crate's own entry point, at the shapes of the 6L/384 and baby training steps,
//! interleaved, best of six:
//!
//!     RAYON_NUM_THREADS=1 cargo run --release --example gemm_probe
//!
//! `PROBE_PRECISION=bf16` times our bf16 product instead (the crate's column stays f32);
//! `PROBE_ONLY=<name>` times one shape (e.g. `"qkv fwd"`), ours alone (for `perf`).
use std::time::Instant;
use tinygpt::config::Precision;
use tinygpt::cpu::gemm::matmul;
use tinygpt::cpu::matrix::{Product, Strided};
fn main() {
    let precision = match std::env::var("PROBE_PRECISION").as_deref() {
        Ok("bf16") => Precision::Bf16,
        _ => Precision::F32,
    };
    let threads = tinygpt::cpu::threads::threads();
    let shapes = [
        ("qkv fwd", 4096, 1152, 384, false, true),
        ("proj fwd", 4096, 384, 1536, false, true),
        ("fc dW", 1536, 384, 4096, true, false),
        ("fc dx", 4096, 384, 1536, false, false),
        ("qkv dW", 1152, 384, 4096, true, false),
        ("proj dW", 384, 1536, 4096, true, false),
        ("baby fc", 768, 512, 128, false, true),
        ("baby dx", 768, 128, 512, false, false),
    ];
    let only = std::env::var("PROBE_ONLY").ok();
    for (name, m, n, k, at, bt) in shapes {
        if only.as_ref().is_some_and(|only| only != name) {
            continue;
        }
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
        let reps = (1e9 / (2.0 * (m * n * k) as f64)).max(20.0) as usize;
        let (mut ours, mut crate_) = (f64::MAX, f64::MAX);
        for _ in 0..6 {
            let t = Instant::now();
            for _ in 0..reps {
                matmul(&mut c, n, p, precision);
            }
            ours = ours.min(t.elapsed().as_secs_f64());
            if only.is_some() {
                continue;
            }
            let t = Instant::now();
            for _ in 0..reps {
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        c.as_mut_ptr(),
                        1,
                        n as isize,
                        false,
                        a.as_ptr(),
                        sa.col as isize,
                        sa.row as isize,
                        b.as_ptr(),
                        sb.col as isize,
                        sb.row as isize,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        if threads > 1 {
                            gemm::Parallelism::Rayon(threads)
                        } else {
                            gemm::Parallelism::None
                        },
                    )
                }
            }
            crate_ = crate_.min(t.elapsed().as_secs_f64());
        }
        let g = |s: f64| 2.0 * (m * n * k) as f64 * reps as f64 / s / 1e9;
        if only.is_some() {
            println!("{name:9} ours {:6.1} GFLOP/s", g(ours));
            continue;
        }
        println!(
            "{name:9} ours {:6.1}  crate {:6.1} GFLOP/s",
            g(ours),
            g(crate_)
        );
    }
}
