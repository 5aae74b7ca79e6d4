//! Small CPU kernels for the fast paths: dot products and friends, with AVX-512 and
//! AVX2+FMA versions picked at run time and a plain fallback.
//!
//! Summation order differs from candle's, so results agree with the reference to
//! float rounding (~1e-6 relative), not bit for bit.

/// sum_i a[i] * b[i].
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // Safety: the CPU has AVX-512F.
            return unsafe { x86::dot_avx512(a, b) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // Safety: the CPU has AVX2 and FMA.
            return unsafe { x86::dot_avx2(a, b) };
        }
    }
    dot_plain(a, b)
}

fn dot_plain(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums: lets the compiler keep several lanes busy.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8 * 8;
    for (ca, cb) in a[..chunks].chunks_exact(8).zip(b[..chunks].chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += ca[k] * cb[k];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

/// y += alpha * x.
#[inline]
pub fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    debug_assert_eq!(y.len(), x.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// out[o] = dot(w[o, :], x) (+ bias[o]) for a row-major w of shape (out.len(), x.len()).
pub fn matvec(w: &[f32], bias: Option<&[f32]>, x: &[f32], out: &mut [f32]) {
    let n = x.len();
    debug_assert_eq!(w.len(), out.len() * n);
    for (o, y) in out.iter_mut().enumerate() {
        *y = dot(&w[o * n..(o + 1) * n], x) + bias.map_or(0.0, |b| b[o]);
    }
}

/// LayerNorm of one row: (x - mean) / sqrt(var + eps) * w (+ b).
pub fn layer_norm(x: &[f32], w: &[f32], b: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    for i in 0..x.len() {
        out[i] = (x[i] - mean) * inv * w[i] + b.map_or(0.0, |b| b[i]);
    }
}

/// Exact GELU, x * Phi(x), in place (the same erf as candle's reference).
pub fn gelu_erf(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v = 0.5 * *v * (1.0 + libm::erff(*v * std::f32::consts::FRAC_1_SQRT_2));
    }
}

/// Softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                let off = i + 16 * k;
                *acc = _mm512_fmadd_ps(
                    _mm512_loadu_ps(pa.add(off)),
                    _mm512_loadu_ps(pb.add(off)),
                    *acc,
                );
            }
            i += 64;
        }
        while i + 16 <= n {
            acc[0] = _mm512_fmadd_ps(
                _mm512_loadu_ps(pa.add(i)),
                _mm512_loadu_ps(pb.add(i)),
                acc[0],
            );
            i += 16;
        }
        let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(
            _mm512_add_ps(acc[0], acc[1]),
            _mm512_add_ps(acc[2], acc[3]),
        ));
        while i < n {
            sum += a[i] * b[i];
            i += 1;
        }
        sum
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                let off = i + 8 * k;
                *acc = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(off)),
                    _mm256_loadu_ps(pb.add(off)),
                    *acc,
                );
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i)),
                _mm256_loadu_ps(pb.add(i)),
                acc[0],
            );
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
        let mut sum: f32 = lanes.iter().sum();
        while i < n {
            sum += a[i] * b[i];
            i += 1;
        }
        sum
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
            let got = dot(&a, &b) as f64;
            assert!(
                (got - exact).abs() <= 1e-4 * (1.0 + exact.abs()),
                "n={n}: {got} vs {exact}"
            );
            assert!((dot_plain(&a, &b) as f64 - exact).abs() <= 1e-4 * (1.0 + exact.abs()));
        }
    }

    #[test]
    fn softmax_and_layer_norm() {
        let mut x = [1.0f32, 2.0, 3.0];
        softmax(&mut x);
        let e: Vec<f32> = [1.0f32, 2.0, 3.0].iter().map(|v| v.exp()).collect();
        let s: f32 = e.iter().sum();
        for i in 0..3 {
            assert!((x[i] - e[i] / s).abs() < 1e-7);
        }
        let mut out = [0f32; 4];
        layer_norm(
            &[1.0, 2.0, 3.0, 4.0],
            &[1.0; 4],
            Some(&[0.5; 4]),
            0.0,
            &mut out,
        );
        let sd = 1.25f32.sqrt();
        assert!((out[0] - (-1.5 / sd + 0.5)).abs() < 1e-6);
    }
}
