//! A linear layer, `out = x Wᵀ + b` with W stored [d_out, d_in]: two GEMMs and a bias
//! pass forward, three backward.

use crate::config::Precision;
use crate::cpu::gemm::matmul;
use crate::cpu::kernels::axpy;
use crate::cpu::matrix::{Product, Strided};
use crate::model::spec::Projection;
use crate::profile::{self, Cost, Group};

/// A layer's weight (and bias) in the flat parameter buffer.
#[derive(Clone, Copy)]
pub struct LinearWeights<'a> {
    pub w: &'a [f32],
    pub b: Option<&'a [f32]>,
    pub d_in: usize,
    pub d_out: usize,
    pub role: Projection,
}

/// The gradients of a layer's weight (and bias).
pub struct LinearGrads<'a> {
    pub w: &'a mut [f32],
    pub b: Option<&'a mut [f32]>,
}

impl LinearWeights<'_> {
    /// out (N x d_out) = x (N x d_in) · Wᵀ + b.
    pub fn forward(&self, out: &mut [f32], x: &[f32], precision: Precision) {
        let (d_in, d_out) = (self.d_in, self.d_out);
        let n = x.len() / d_in;
        let _span = profile::span(Group::Product(self.role), || {
            Cost::f32s_and_flops(n * d_in + d_in * d_out + n * d_out, 2 * n * d_in * d_out)
        });
        let wt = Strided::columns(self.w, d_in);
        let p = Product::new(Strided::rows(x, d_in), wt, (n, d_out, d_in));
        matmul(out, d_out, p, precision);
        if let Some(b) = self.b {
            for row in out[..n * d_out].chunks_exact_mut(d_out) {
                axpy(row, 1.0, b);
            }
        }
    }

    /// For out = x Wᵀ + b: dx = dout · W (overwritten); dW += doutᵀ · x; db += the sum of
    /// dout's rows.
    pub fn backward(
        &self,
        dx: &mut [f32],
        grads: LinearGrads,
        dout: &[f32],
        x: &[f32],
        precision: Precision,
    ) {
        let (d_in, d_out) = (self.d_in, self.d_out);
        let n = x.len() / d_in;
        // dx: dout and W read, dx written; dW: dout and x read, dW read and written.
        let _span = profile::span(Group::Product(self.role), || {
            let values = 2 * n * d_out + 2 * n * d_in + 3 * d_in * d_out;
            Cost::f32s_and_flops(values, 4 * n * d_in * d_out)
        });
        let dout = &dout[..n * d_out];
        let p = Product::new(
            Strided::rows(dout, d_out),
            Strided::rows(self.w, d_in),
            (n, d_in, d_out),
        );
        matmul(dx, d_in, p, precision);
        let doutt = Strided::columns(dout, d_out);
        let p = Product::new(doutt, Strided::rows(x, d_in), (d_out, d_in, n)).accumulating();
        matmul(grads.w, d_in, p, precision);
        if let Some(db) = grads.b {
            for row in dout.chunks_exact(d_out) {
                axpy(db, 1.0, row);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ops::testing::{all, assert_gradient, probe_loss, values};

    /// dx, dW and db of sum((x Wᵀ + b) * probe) against central differences; the
    /// weight gradients accumulate onto what was there.
    #[test]
    fn backward_matches_differences() {
        let (n, d_in, d_out) = (4, 5, 3);
        let (x, w, b, probe) = (
            values(n * d_in, 1),
            values(d_out * d_in, 2),
            values(d_out, 3),
            values(n * d_out, 4),
        );
        let loss = |x: &[f32], w: &[f32], b: &[f32]| -> f64 {
            let mut out = vec![0.0; n * d_out];
            let b = Some(b);
            LinearWeights {
                w,
                b,
                d_in,
                d_out,
                role: Projection::MlpUp,
            }
            .forward(&mut out, x, Precision::F32);
            probe_loss(&out, &probe)
        };
        let (mut dx, mut dw, mut db) = (
            vec![0.0; n * d_in],
            vec![1.0; d_out * d_in],
            vec![1.0; d_out],
        );
        let grads = LinearGrads {
            w: &mut dw,
            b: Some(&mut db),
        };
        let layer = LinearWeights {
            role: Projection::MlpUp,
            w: &w,
            b: Some(&b),
            d_in,
            d_out,
        };
        layer.backward(&mut dx, grads, &probe, &x, Precision::F32);
        let less_one = |g: &[f32]| g.iter().map(|v| v - 1.0).collect::<Vec<_>>();
        assert_gradient("dx", &dx, &mut |x| loss(x, &w, &b), &x, &all(x.len()));
        assert_gradient(
            "dw",
            &less_one(&dw),
            &mut |w| loss(&x, w, &b),
            &w,
            &all(w.len()),
        );
        assert_gradient(
            "db",
            &less_one(&db),
            &mut |b| loss(&x, &w, b),
            &b,
            &all(b.len()),
        );
    }
}
