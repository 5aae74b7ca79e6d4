//! Small CPU kernels: dot products and friends, with AVX-512 and AVX2+FMA versions
//! picked at run time and a plain fallback.
//!
//! Summation order differs from candle's, so results agree with the reference to
//! float rounding (~1e-6 relative), not bit for bit.

/// Compiles `$body` three times: for AVX-512, for AVX2+FMA, and for any x86-64 (or
/// other architecture), and picks at run time by the active level (`cpu::isa`: the CPU's
/// best, capped by `TINYGPT_CPU_ISA`). The body is plain Rust loops; the compiler
/// vectorises them for the wider registers.
macro_rules! multiversion {
    ($(#[$m:meta])* pub fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        pub fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn portable($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? { portable($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? { portable($($arg),*) }
                match $crate::cpu::isa::active() {
                    // Safety: the active level never exceeds what the CPU has.
                    $crate::cpu::isa::Isa::Avx512 | $crate::cpu::isa::Isa::Amx => return unsafe { v4($($arg),*) },
                    $crate::cpu::isa::Isa::Avx2 => return unsafe { v3($($arg),*) },
                    $crate::cpu::isa::Isa::Scalar => {}
                }
            }
            portable($($arg),*)
        }
    };
}

pub(crate) use multiversion;

/// A number as stored (f32, or bf16: `bf16::Bf16`), widened to f32 as it is read.
pub trait Widen: Copy + Send + Sync {
    fn widen(self) -> f32;
}

impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

/// int8 keys and values (their scales applied apart).
impl Widen for i8 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from(self)
    }
}

/// sum_i a[i] * b[i] (b f32, or bf16 widened as it is read), with 32 partial sums the
/// compiler keeps in vector registers (two of 16 lanes: two AVX-512 or four AVX2
/// registers), folded in halves at the end (16 + 16, 8 + 8, 4 + 4, then (0 + 2) +
/// (1 + 3)): a few vector adds where adding the 32 one after another was 31 dependent
/// scalar adds, most of a 64-wide head's dot product. Inlined into the multiversioned
/// kernels below; the same operations in the same order at every level (and in
/// `decode`'s AVX-512 head scores), so the same bits.
#[inline(always)]
pub fn dot_lanes<T: Widen>(a: &[f32], b: &[T]) -> f32 {
    const HALF: usize = 16;
    debug_assert_eq!(a.len(), b.len());
    let n = a.len() / (2 * HALF) * (2 * HALF);
    let (mut low, mut high) = ([0f32; HALF], [0f32; HALF]);
    for (ca, cb) in a[..n]
        .chunks_exact(2 * HALF)
        .zip(b[..n].chunks_exact(2 * HALF))
    {
        for k in 0..HALF {
            low[k] += ca[k] * cb[k].widen();
            high[k] += ca[HALF + k] * cb[HALF + k].widen();
        }
    }
    for k in 0..HALF {
        low[k] += high[k];
    }
    for k in 0..8 {
        low[k] += low[k + 8];
    }
    for k in 0..4 {
        low[k] += low[k + 4];
    }
    let mut sum = (low[0] + low[2]) + (low[1] + low[3]);
    for i in n..a.len() {
        sum += a[i] * b[i].widen();
    }
    sum
}

/// sum_i f(a[i], b[i], c[i]) over equal-length slices, in 16 interleaved partial sums:
/// one running sum is a serial chain the compiler may not reorder, so it would not
/// vectorise. Inlined into the multiversioned kernels. (Pass `a` again for fewer
/// operands.)
#[inline(always)]
pub fn sum_lanes3(a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32) -> f32 {
    const LANES: usize = 16;
    debug_assert!(a.len() == b.len() && a.len() == c.len());
    let whole = a.len() / LANES * LANES;
    let mut acc = [0f32; LANES];
    for ((ca, cb), cc) in a[..whole]
        .chunks_exact(LANES)
        .zip(b[..whole].chunks_exact(LANES))
        .zip(c[..whole].chunks_exact(LANES))
    {
        for k in 0..LANES {
            acc[k] += f(ca[k], cb[k], cc[k]);
        }
    }
    let mut sum = 0.0;
    for v in acc {
        sum += v;
    }
    for i in whole..a.len() {
        sum += f(a[i], b[i], c[i]);
    }
    sum
}

/// sum_i f(x[i]), vectorisable (see `sum_lanes3`).
#[inline(always)]
pub fn sum_lanes(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    sum_lanes3(x, x, x, |v, _, _| f(v))
}

/// y += alpha * x (x f32, or bf16 widened as it is read).
#[inline(always)]
pub fn axpy<T: Widen>(y: &mut [f32], alpha: f32, x: &[T]) {
    debug_assert_eq!(y.len(), x.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi.widen();
    }
}

/// The sum of 16 lanes as a tree of halves (which vectorises; a running sum would be
/// 15 dependent adds).
#[inline(always)]
pub fn fold16(mut v: [f32; 16]) -> f32 {
    for half in [8, 4, 2, 1] {
        for i in 0..half {
            v[i] += v[i + half];
        }
    }
    v[0]
}

/// How far ahead of its reads a mat-vec asks for the weights' cache lines. Decoding
/// one token reads every weight once, straight from memory: rows read side by side
/// plus these requests keep more lines in flight than the hardware prefetcher does
/// alone (`weight_rows` ; measured on an Intel Xeon, AVX-512, 2 threads, f32: one
/// row at a time 16 GB/s, four side by side 19-20, with lines asked 16 KiB ahead 21-23).
pub const AHEAD_BYTES: usize = 16 << 10;

const AHEAD_ENV: &str = "TINYGPT_MATVEC_AHEAD";

/// Whether `TINYGPT_MATVEC_AHEAD` sets the one-row mat-vecs' software prefetches: `on`
/// or `off`, `Ok(None)` when unset, `Err` (naming the variable and its values) otherwise.
pub fn asks_ahead_from_env() -> Result<Option<bool>, String> {
    match std::env::var(AHEAD_ENV) {
        Err(_) => Ok(None),
        Ok(value) if value.trim().is_empty() => Ok(None),
        Ok(value) => match value.trim().to_ascii_lowercase().as_str() {
            "on" => Ok(Some(true)),
            "off" => Ok(Some(false)),
            _ => Err(format!(
                "{AHEAD_ENV}={value:?} is neither on nor off (the mat-vecs' software prefetches; or unset it)"
            )),
        },
    }
}

/// Whether the one-row mat-vecs that read a row after the other (bf16 in address order;
/// the int8 and int4 products, a group of sixteen rows after the other, follow it too,
/// at any number of rows) ask for their weights' lines ahead in software
/// (`TINYGPT_MATVEC_AHEAD`, else by CPU). Yes, but on Zen 4: there its own prefetchers
/// stream those rows faster alone. GPT-2 124M decoded on one Zen 4 core (EPYC, family 25
/// with AVX-512), interleaved: bf16 68-72 tokens/s asking nothing ahead, 52-59 asking
/// 8 KiB ahead (two threads 74-84 against 61-70); int8 87-88 against 70-89 asking 16
/// KiB ahead; int4 level (with row-major int8 and int4 blocks, since grouped). A Zen 5 measured the other way (bf16 one thread 130-136
/// alone, 154-161 asking ahead), so the rest keep asking.
pub fn asks_ahead() -> bool {
    static CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| {
        asks_ahead_from_env()
            .ok()
            .flatten()
            .unwrap_or_else(|| !zen4())
    })
}

/// An AMD core of family 25 (Zen 3 and Zen 4) with AVX-512: Zen 4.
fn zen4() -> bool {
    #[cfg(target_arch = "x86_64")]
    let avx512 = std::arch::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    let avx512 = false;
    super::isa::amd_family() == Some(25) && avx512
}

/// Asks for the cache line holding `p` without waiting for it; a hint only, so an
/// address past the end of its buffer is harmless (nothing is read from it).
#[inline(always)]
pub fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // Safety: prefetching never faults and reads nothing into the program.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Asks for every cache line of `values` (see [`prefetch`]).
#[inline(always)]
pub fn prefetch_all<T>(values: &[T]) {
    let bytes = std::mem::size_of_val(values);
    let start = values.as_ptr().cast::<u8>();
    for offset in (0..bytes).step_by(64) {
        prefetch(start.wrapping_add(offset));
    }
}

/// e^x for x <= 88, branch-free so loops over it vectorise (Cephes' expf: range
/// reduction by ln 2, a degree-6 polynomial, 2^n from the exponent bits). Relative error
/// ~1e-7; inputs below -87 give ~1e-38 instead of 0; NaN stays NaN.
///
/// Written with min/max, floor and an unchecked float-to-int conversion: `clamp` and
/// `as i32` (which saturates and maps NaN to 0) make the compiler fall back to scalar
/// code with compares and branches. The polynomial is one chain of dependent steps, so
/// its multiply-adds are fused (`mul_add`: one FMA instead of a multiply and an add,
/// half the chain; at the portable level, compiled without FMA, a call to libm's
/// `fmaf`, which gives the same bits).
#[inline(always)]
pub fn exp_approx(input: f32) -> f32 {
    // Not `clamp`: that keeps NaN, which must not reach the conversion below.
    #[allow(clippy::manual_clamp)]
    let x = input.max(-87.0).min(88.0);
    let nf = (x * std::f32::consts::LOG2_E + 0.5).floor();
    // Safety: x is clamped above, so nf is within [-126, 128]; an i32 holds it.
    let n: i32 = unsafe { nf.to_int_unchecked() };
    let r = nf.mul_add(2.121_944_4e-4, nf.mul_add(-0.693_359_4, x));
    let z = r * r;
    let mut p = 1.987_569_1e-4f32.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = p.mul_add(z, r) + 1.0;
    let e = y * f32::from_bits(((n + 127) as u32) << 23);
    if input.is_nan() {
        input
    } else {
        e
    }
}

/// erf(x) as a rational function of x on [-4, 4] (erf is +-1 in f32 beyond): the
/// approximation used by Eigen and XLA, max error a few ulp, branch-free.
#[inline(always)]
pub fn erf_approx(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = x2 * -2.726_142_3e-10 + 2.770_681_4e-8;
    p = x2 * p + -2.101_024e-6;
    p = x2 * p + -5.692_506_4e-5;
    p = x2 * p + -7.349_906_3e-4;
    p = x2 * p + -2.954_6e-3;
    p = x2 * p + -1.609_603_3e-2;
    p *= x;
    let mut q = x2 * -1.456_607_2e-5 + -2.133_740_6e-4;
    q = x2 * q + -1.682_827e-3;
    q = x2 * q + -7.373_329e-3;
    q = x2 * q + -1.426_474e-2;
    p / q
}

/// Exact (erf) GELU: x Phi(x).
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf_approx(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// GPT-2's tanh GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), with
/// tanh(u) = 1 - 2 / (e^(2u) + 1).
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    let tanh = 1.0 - 2.0 / (exp_approx(2.0 * u) + 1.0);
    0.5 * x * (1.0 + tanh)
}

/// Softmax in place, inlined into multiversioned callers.
#[inline(always)]
pub fn softmax_inline(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        *v = exp_approx(*v - max);
    }
    // A separate lane-wise sum: summed inside the loop above, the exps would not
    // vectorise.
    let inv = 1.0 / sum_lanes(x, |v| v);
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_a_plain_sum_at_every_length() {
        for n in [0usize, 1, 7, 8, 15, 16, 17, 63, 64, 65, 128, 200, 1537] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.3).collect();
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let got = dot_lanes(&a, &b) as f64;
            assert!(
                (got - exact).abs() <= 1e-4 * (1.0 + exact.abs()),
                "n={n}: {got} vs {exact}"
            );
        }
    }

    #[test]
    fn exp_and_erf_approximations_are_accurate() {
        let mut worst_exp = 0f64;
        let mut worst_erf = 0f64;
        for i in 0..=200_000 {
            let x = (-87.0 + i as f64 * (87.0 + 10.0) / 200_000.0) as f32;
            let exact = (x as f64).exp();
            let e = (exp_approx(x) as f64 - exact).abs() / exact;
            worst_exp = worst_exp.max(e);
            let y = (-6.0 + i as f64 * 12.0 / 200_000.0) as f32;
            let d = (erf_approx(y) as f64 - libm::erf(y as f64)).abs();
            worst_erf = worst_erf.max(d);
        }
        assert!(worst_exp < 5e-7, "exp relative error {worst_exp}");
        assert!(worst_erf < 5e-7, "erf absolute error {worst_erf}");
        assert!(exp_approx(-1000.0) < 1e-37 && exp_approx(0.0) == 1.0);
    }

    #[test]
    fn softmax_and_layer_norm() {
        let mut x = [1.0f32, 2.0, 3.0];
        softmax_inline(&mut x);
        let e: Vec<f32> = [1.0f32, 2.0, 3.0].iter().map(|v| v.exp()).collect();
        let s: f32 = e.iter().sum();
        for i in 0..3 {
            assert!((x[i] - e[i] / s).abs() < 1e-7);
        }
        let (mut out, mut mean, mut rstd) = ([0f32; 4], [0f32], [0f32]);
        let (x, w, b) = ([1.0, 2.0, 3.0, 4.0], [1.0; 4], [0.5; 4]);
        crate::cpu::ops::norm::layernorm_forward(
            &mut out,
            &mut mean,
            &mut rstd,
            &x,
            &w,
            Some(&b),
            0.0,
        );
        let sd = 1.25f32.sqrt();
        assert!((out[0] - (-1.5 / sd + 0.5)).abs() < 1e-6);
    }
}
