//! Normalisation over each row, LayerNorm or RMSNorm, forward and backward.
//!
//! LayerNorm: (x - mean) rstd w (+ b), with rstd = 1 / sqrt(var + eps). RMSNorm:
//! x rstd w, with rstd = 1 / sqrt(mean(x^2) + eps). The forward keeps each row's mean
//! and rstd (`NormStats`), so the backward, and `apply` (the output again, for the
//! backward of the layer after), need nothing else.

use rayon::prelude::*;

use crate::config::NormKind;
use crate::cpu::kernels::{axpy, multiversion, sum_lanes, sum_lanes3};
use crate::cpu::threads::{share_rows, summed_share_rows, with_partials};
use crate::profile::{self, Cost, Group};

/// A norm's gain (and bias), with its kind and epsilon.
#[derive(Clone, Copy)]
pub struct NormWeights<'a> {
    pub kind: NormKind,
    pub eps: f32,
    pub w: &'a [f32],
    pub b: Option<&'a [f32]>,
}

/// The gradients of a norm's gain (and bias).
pub struct NormGrads<'a> {
    pub w: &'a mut [f32],
    pub b: Option<&'a mut [f32]>,
}

/// Per row, what a forward leaves for its backward: the mean (LayerNorm only) and
/// 1 / std.
pub struct NormStats {
    pub mean: Vec<f32>,
    pub rstd: Vec<f32>,
}

impl NormStats {
    /// Room for `rows` rows.
    pub fn new(rows: usize) -> Self {
        Self {
            mean: vec![0.0; rows],
            rstd: vec![0.0; rows],
        }
    }
}

impl NormWeights<'_> {
    /// out = the norm of each row of x; keeps the rows' statistics in `stats`.
    pub fn forward(&self, out: &mut [f32], stats: &mut NormStats, x: &[f32]) {
        let c = self.w.len();
        let rows = x.len() / c;
        let _span = profile::span(Group::Norm, || {
            Cost::f32s_and_flops(2 * rows * c, 8 * rows * c)
        });
        let share = share_rows(rows, c);
        let (w, b, eps) = (self.w, self.b, self.eps);
        out[..rows * c]
            .par_chunks_mut(share * c)
            .zip(stats.mean[..rows].par_chunks_mut(share))
            .zip(stats.rstd[..rows].par_chunks_mut(share))
            .zip(x.par_chunks(share * c))
            .for_each(|(((out, mean), rstd), x)| match self.kind {
                NormKind::LayerNorm => layernorm_forward(out, mean, rstd, x, w, b, eps),
                NormKind::RmsNorm => rmsnorm_forward(out, rstd, x, w, eps),
            });
    }

    /// The forward's output again, from x and the kept statistics.
    pub fn apply(&self, out: &mut [f32], x: &[f32], stats: &NormStats) {
        let c = self.w.len();
        let rows = x.len() / c;
        let _span = profile::span(Group::Norm, || {
            Cost::f32s_and_flops(2 * rows * c, 4 * rows * c)
        });
        let share = share_rows(rows, c);
        let (w, b) = (self.w, self.b);
        out[..rows * c]
            .par_chunks_mut(share * c)
            .zip(stats.mean[..rows].par_chunks(share))
            .zip(stats.rstd[..rows].par_chunks(share))
            .zip(x.par_chunks(share * c))
            .for_each(|(((out, mean), rstd), x)| match self.kind {
                NormKind::LayerNorm => layernorm_apply(out, x, w, b, mean, rstd),
                NormKind::RmsNorm => rmsnorm_apply(out, x, w, rstd),
            });
    }

    /// dx += d(norm)/dx · dout; the gain's (and bias's) gradients += theirs.
    pub fn backward(
        &self,
        dx: &mut [f32],
        grads: NormGrads,
        dout: &[f32],
        x: &[f32],
        stats: &NormStats,
    ) {
        // Each share of rows sums its weight (and bias) gradients into its own partial
        // (dw | db), added in share order afterwards: the shares depend on the shape
        // alone, so the result depends neither on thread timing nor on the thread count.
        let c = self.w.len();
        let rows = x.len() / c;
        // dout and x read, dx read and written.
        let _span = profile::span(Group::Norm, || {
            Cost::f32s_and_flops(4 * rows * c, 12 * rows * c)
        });
        let share = summed_share_rows(rows, c);
        let has_bias = grads.b.is_some();
        let w = self.w;
        with_partials(rows.div_ceil(share) * 2 * c, |partials| {
            partials
                .par_chunks_mut(2 * c)
                .zip(dx.par_chunks_mut(share * c))
                .zip(dout.par_chunks(share * c))
                .zip(x.par_chunks(share * c))
                .zip(stats.mean[..rows].par_chunks(share))
                .zip(stats.rstd[..rows].par_chunks(share))
                .for_each(|(((((partial, dx), dout), x), mean), rstd)| {
                    let (dw, db) = partial.split_at_mut(c);
                    match self.kind {
                        NormKind::LayerNorm => {
                            let db = has_bias.then_some(db);
                            layernorm_backward(dx, dw, db, dout, x, w, mean, rstd)
                        }
                        NormKind::RmsNorm => rmsnorm_backward(dx, dw, dout, x, w, rstd),
                    }
                });
            let NormGrads { w: dw, mut b } = grads;
            for partial in partials.chunks_exact(2 * c) {
                axpy(dw, 1.0, &partial[..c]);
                if let Some(db) = b.as_deref_mut() {
                    axpy(db, 1.0, &partial[c..]);
                }
            }
        });
    }
}

multiversion! {
    /// out = (x - mean) * rstd * w (+ b) per row; keeps mean and rstd for the backward.
    pub fn layernorm_forward(
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        x: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        eps: f32,
    ) {
        let c = w.len();
        let rows = x.len() / c;
        for first in (0..rows).step_by(GROUP) {
            let group: [&[f32]; GROUP] = std::array::from_fn(|k| {
                let r = (first + k).min(rows - 1);
                &x[r * c..(r + 1) * c]
            });
            let here = GROUP.min(rows - first);
            let (m, var) = if here == GROUP {
                let m = row_sums(group, |_, v| v).map(|sum| sum / c as f32);
                let var = row_sums(group, |k, v| (v - m[k]) * (v - m[k]));
                (m, var.map(|sum| sum / c as f32))
            } else {
                // The last few rows (a decoded token's one) alone, in the same order.
                let (mut m, mut var) = ([0f32; GROUP], [0f32; GROUP]);
                for k in 0..here {
                    m[k] = sum_lanes(group[k], |v| v) / c as f32;
                    var[k] = sum_lanes(group[k], |v| (v - m[k]) * (v - m[k])) / c as f32;
                }
                (m, var)
            };
            for k in 0..here {
                let (n, xr) = (first + k, group[k]);
                let s = 1.0 / (var[k] + eps).sqrt();
                let or = &mut out[n * c..(n + 1) * c];
                for i in 0..c {
                    or[i] = (xr[i] - m[k]) * s * w[i] + b.map_or(0.0, |b| b[i]);
                }
                mean[n] = m[k];
                rstd[n] = s;
            }
        }
    }
}

/// Rows whose statistics a forward sums side by side.
const GROUP: usize = 4;

/// Σ f(k, v) over each row k of `rows`, each in `sum_lanes`' order (so its bits), the
/// rows' sums side by side: a row's sum ends in a serial chain of adds, and a norm of
/// rows 128 wide spent two thirds of its time waiting on those chains one row at a time.
#[inline(always)]
fn row_sums(rows: [&[f32]; GROUP], f: impl Fn(usize, f32) -> f32) -> [f32; GROUP] {
    const LANES: usize = 16;
    let c = rows[0].len();
    let whole = c / LANES * LANES;
    let mut acc = [[0f32; LANES]; GROUP];
    for at in (0..whole).step_by(LANES) {
        for (k, acc) in acc.iter_mut().enumerate() {
            let chunk = &rows[k][at..at + LANES];
            for l in 0..LANES {
                acc[l] += f(k, chunk[l]);
            }
        }
    }
    // Lane by lane across the rows: each row's adds in lane order, the rows' chains
    // interleaved.
    let mut sums = [0f32; GROUP];
    #[allow(clippy::needless_range_loop)]
    for l in 0..LANES {
        for k in 0..GROUP {
            sums[k] += acc[k][l];
        }
    }
    for (k, sum) in sums.iter_mut().enumerate() {
        for &v in &rows[k][whole..] {
            *sum += f(k, v);
        }
    }
    sums
}

multiversion! {
    /// out = (x - mean) * rstd * w (+ b) with the statistics of an earlier forward.
    pub fn layernorm_apply(
        out: &mut [f32],
        x: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        mean: &[f32],
        rstd: &[f32],
    ) {
        let c = w.len();
        for (n, (xr, or)) in x.chunks_exact(c).zip(out.chunks_exact_mut(c)).enumerate() {
            let (m, s) = (mean[n], rstd[n]);
            for i in 0..c {
                or[i] = (xr[i] - m) * s * w[i] + b.map_or(0.0, |b| b[i]);
            }
        }
    }
}

multiversion! {
    /// With xhat = (x - mean) * rstd and g = dout * w:
    /// dx += rstd * (g - mean(g) - xhat * mean(g * xhat)); dw += dout * xhat; db += dout.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward(
        dx: &mut [f32],
        dw: &mut [f32],
        db: Option<&mut [f32]>,
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        mean: &[f32],
        rstd: &[f32],
    ) {
        let c = w.len();
        let mut db = db;
        for (n, ((dxr, dor), xr)) in dx
            .chunks_exact_mut(c)
            .zip(dout.chunks_exact(c))
            .zip(x.chunks_exact(c))
            .enumerate()
        {
            let (m, s) = (mean[n], rstd[n]);
            let g_mean = sum_lanes3(dor, w, w, |d, w, _| d * w) / c as f32;
            let gx_mean = sum_lanes3(dor, w, xr, |d, w, x| d * w * (x - m) * s) / c as f32;
            for i in 0..c {
                let xhat = (xr[i] - m) * s;
                let g = dor[i] * w[i];
                dxr[i] += s * (g - g_mean - xhat * gx_mean);
                dw[i] += dor[i] * xhat;
            }
            if let Some(db) = db.as_deref_mut() {
                axpy(db, 1.0, dor);
            }
        }
    }
}

multiversion! {
    /// RMSNorm: out = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps); keeps rstd.
    pub fn rmsnorm_forward(out: &mut [f32], rstd: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
        let c = w.len();
        for (n, (xr, or)) in x.chunks_exact(c).zip(out.chunks_exact_mut(c)).enumerate() {
            let s = 1.0 / (sum_lanes(xr, |v| v * v) / c as f32 + eps).sqrt();
            for i in 0..c {
                or[i] = xr[i] * s * w[i];
            }
            rstd[n] = s;
        }
    }
}

multiversion! {
    /// out = x * rstd * w with the statistics of an earlier forward.
    pub fn rmsnorm_apply(out: &mut [f32], x: &[f32], w: &[f32], rstd: &[f32]) {
        let c = w.len();
        for (n, (xr, or)) in x.chunks_exact(c).zip(out.chunks_exact_mut(c)).enumerate() {
            for i in 0..c {
                or[i] = xr[i] * rstd[n] * w[i];
            }
        }
    }
}

multiversion! {
    /// With xhat = x * rstd and g = dout * w: dx += rstd * (g - xhat * mean(g * xhat));
    /// dw += dout * xhat.
    pub fn rmsnorm_backward(
        dx: &mut [f32],
        dw: &mut [f32],
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
    ) {
        let c = w.len();
        for (n, ((dxr, dor), xr)) in dx
            .chunks_exact_mut(c)
            .zip(dout.chunks_exact(c))
            .zip(x.chunks_exact(c))
            .enumerate()
        {
            let s = rstd[n];
            let gx_mean = sum_lanes3(dor, w, xr, |d, w, x| d * w * x * s) / c as f32;
            for i in 0..c {
                let xhat = xr[i] * s;
                dxr[i] += s * (dor[i] * w[i] - xhat * gx_mean);
                dw[i] += dor[i] * xhat;
            }
        }
    }

}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ops::testing::{all, assert_gradient, probe_loss, values};

    /// The LayerNorm forward (rows' statistics summed four rows side by side) against
    /// its definition in f64, and a row alone (summed by `sum_lanes`) giving the bits it
    /// gives in a group.
    #[test]
    fn layernorm_forward_matches_f64_in_groups_and_alone() {
        // 7 rows: a group of four and a group of three; 37 wide: two vectors and a tail.
        let (n, c) = (7, 37);
        let (x, w, b) = (values(n * c, 5), values(c, 6), values(c, 7));
        let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, Some(&b), 1e-5);
        for r in 0..n {
            let row: Vec<f64> = x[r * c..(r + 1) * c].iter().map(|&v| v as f64).collect();
            let m = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / c as f64;
            let s = 1.0 / (var + 1e-5).sqrt();
            assert!((mean[r] as f64 - m).abs() < 1e-6, "row {r} mean");
            assert!((rstd[r] as f64 - s).abs() < 1e-5 * s, "row {r} rstd");
            for i in 0..c {
                let want = (row[i] - m) * s * w[i] as f64 + b[i] as f64;
                let got = out[r * c + i] as f64;
                assert!((got - want).abs() < 1e-5 * (1.0 + want.abs()), "({r}, {i})");
            }
            // A row alone gives the bits it gives in a group.
            let (mut one, mut m1, mut s1) = (vec![0.0; c], [0.0], [0.0]);
            layernorm_forward(
                &mut one,
                &mut m1,
                &mut s1,
                &x[r * c..(r + 1) * c],
                &w,
                Some(&b),
                1e-5,
            );
            assert_eq!(one, out[r * c..(r + 1) * c], "row {r}");
            assert_eq!((m1[0], s1[0]), (mean[r], rstd[r]));
        }
    }

    /// dx, dw and (LayerNorm) db of loss = sum(norm(x) * probe) against central
    /// differences, for both kinds; `apply` repeats the forward from its statistics.
    #[test]
    fn backward_matches_differences() {
        let (n, c) = (3, 5);
        for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
            let (x, w, b, probe) = (
                values(n * c, 1),
                values(c, 2),
                values(c, 3),
                values(n * c, 4),
            );
            let bias = (kind == NormKind::LayerNorm).then_some(b.as_slice());
            let loss = |x: &[f32], w: &[f32], b: Option<&[f32]>| -> f64 {
                let (mut out, mut stats) = (vec![0.0; n * c], NormStats::new(n));
                let eps = 1e-5;
                NormWeights { kind, eps, w, b }.forward(&mut out, &mut stats, x);
                probe_loss(&out, &probe)
            };
            let (mut out, mut stats) = (vec![0.0; n * c], NormStats::new(n));
            let weights = NormWeights {
                kind,
                eps: 1e-5,
                w: &w,
                b: bias,
            };
            weights.forward(&mut out, &mut stats, &x);
            let mut again = vec![0.0; n * c];
            weights.apply(&mut again, &x, &stats);
            assert_eq!(again, out, "{kind:?}: apply is the forward");

            let (mut dx, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
            let grads = NormGrads {
                w: &mut dw,
                b: bias.is_some().then_some(db.as_mut_slice()),
            };
            weights.backward(&mut dx, grads, &probe, &x, &stats);
            let what = |g: &str| format!("{kind:?} {g}");
            assert_gradient(
                &what("dx"),
                &dx,
                &mut |x| loss(x, &w, bias),
                &x,
                &all(n * c),
            );
            assert_gradient(&what("dw"), &dw, &mut |w| loss(&x, w, bias), &w, &all(c));
            if let Some(b) = bias {
                assert_gradient(&what("db"), &db, &mut |b| loss(&x, &w, Some(b)), b, &all(c));
            }
        }
    }
}
