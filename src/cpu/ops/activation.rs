//! The MLP's non-linearity, between its two projections: exact GELU, GPT-2's tanh GELU,
//! or SwiGLU (silu(gate) * up, on the two halves of the first projection's rows).

use rayon::prelude::*;

use crate::config::MlpKind;
use crate::cpu::kernels::{erf_approx, exp_approx, gelu, gelu_tanh, multiversion};
use crate::cpu::threads::{share_len, share_rows};
use crate::model::spec::Shapes;
use crate::profile::{self, Cost, Group};

/// The non-linearity between the MLP's c_fc (`fc_width` wide rows) and c_proj
/// (`hidden` wide rows).
#[derive(Debug, Clone, Copy)]
pub struct Activation {
    pub kind: MlpKind,
    pub hidden: usize,
    /// c_fc's width: `hidden`, or twice that for SwiGLU's gate | up.
    pub fc_width: usize,
}

impl Activation {
    pub fn new(kind: MlpKind, shapes: &Shapes) -> Self {
        Self {
            kind,
            hidden: shapes.mlp_hidden,
            fc_width: shapes.mlp_fc_width,
        }
    }

    /// out (N, hidden) from fc (N, fc_width).
    pub fn forward(&self, out: &mut [f32], fc: &[f32]) {
        let (hidden, fc_width) = (self.hidden, self.fc_width);
        let rows = fc.len() / fc_width;
        let _span = profile::span(Group::Activation, || {
            Cost::f32s_and_flops(rows * (fc_width + hidden), 10 * rows * hidden)
        });
        let share = share_rows(rows, fc_width);
        out[..rows * hidden]
            .par_chunks_mut(share * hidden)
            .zip(fc.par_chunks(share * fc_width))
            .for_each(|(out, fc)| match self.kind {
                MlpKind::Gelu => gelu_forward(out, fc),
                MlpKind::GeluTanh => gelu_tanh_forward(out, fc),
                MlpKind::Swiglu => swiglu_forward(out, fc, hidden),
            });
    }

    /// The backward's first half: the output again (into `out`) and, where the kind
    /// allows, the slope d out / d fc (into `slope`, then dfc = dout * slope). Returns
    /// whether the slope was written; otherwise use `backward`.
    pub fn recompute(&self, out: &mut [f32], slope: &mut [f32], fc: &[f32]) -> bool {
        match self.kind {
            MlpKind::Gelu => {
                let _span = profile::span(Group::Activation, || {
                    Cost::f32s_and_flops(3 * out.len(), 20 * out.len())
                });
                let share = share_len(out.len());
                out.par_chunks_mut(share)
                    .zip(slope.par_chunks_mut(share))
                    .zip(fc.par_chunks(share))
                    .for_each(|((out, slope), fc)| gelu_with_slope(out, slope, fc));
                true
            }
            _ => {
                self.forward(out, fc);
                false
            }
        }
    }

    /// dfc (N, fc_width) = the gradient at fc, from dout (N, hidden); overwritten.
    pub fn backward(&self, dfc: &mut [f32], fc: &[f32], dout: &[f32]) {
        let (hidden, fc_width) = (self.hidden, self.fc_width);
        let _span = profile::span(Group::Activation, || {
            Cost::f32s_and_flops(2 * dfc.len() + dout.len(), 20 * dout.len())
        });
        let share = share_rows(dout.len() / hidden, fc_width);
        dfc.par_chunks_mut(share * fc_width)
            .zip(fc.par_chunks(share * fc_width))
            .zip(dout.par_chunks(share * hidden))
            .for_each(|((dfc, fc), dout)| match self.kind {
                MlpKind::Gelu => {
                    dfc.fill(0.0);
                    gelu_backward(dfc, fc, dout)
                }
                MlpKind::GeluTanh => {
                    dfc.fill(0.0);
                    gelu_tanh_backward(dfc, fc, dout)
                }
                MlpKind::Swiglu => swiglu_backward(dfc, fc, dout, hidden),
            });
    }
}

multiversion! {
    /// out = x Phi(x) (exact GELU).
    pub fn gelu_forward(out: &mut [f32], x: &[f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = gelu(v);
        }
    }
}

multiversion! {
    /// dx += dout * (Phi(x) + x phi(x)), phi the standard normal density.
    pub fn gelu_backward(dx: &mut [f32], x: &[f32], dout: &[f32]) {
        const INV_SQRT_2PI: f32 = 0.398_942_3;
        for ((d, &v), &g) in dx.iter_mut().zip(x).zip(dout) {
            let cdf = 0.5 * (1.0 + erf_approx(v * std::f32::consts::FRAC_1_SQRT_2));
            let pdf = INV_SQRT_2PI * exp_approx(-0.5 * v * v);
            *d += g * (cdf + v * pdf);
        }
    }
}

multiversion! {
    /// GELU(x) into `out` and its derivative Phi(x) + x phi(x) into `slope`, in one
    /// pass (the backward needs both: the output for the next layer's weight gradient,
    /// the slope once the output's gradient is known).
    pub fn gelu_with_slope(out: &mut [f32], slope: &mut [f32], x: &[f32]) {
        const INV_SQRT_2PI: f32 = 0.398_942_3;
        for ((o, s), &v) in out.iter_mut().zip(slope.iter_mut()).zip(x) {
            let cdf = 0.5 * (1.0 + erf_approx(v * std::f32::consts::FRAC_1_SQRT_2));
            *o = v * cdf;
            *s = cdf + v * INV_SQRT_2PI * exp_approx(-0.5 * v * v);
        }
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;

multiversion! {
    /// out = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3) (GPT-2's GELU).
    pub fn gelu_tanh_forward(out: &mut [f32], x: &[f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = gelu_tanh(v);
        }
    }
}

multiversion! {
    /// dx += dout * (0.5 (1 + t) + 0.5 x (1 - t^2) du/dx).
    pub fn gelu_tanh_backward(dx: &mut [f32], x: &[f32], dout: &[f32]) {
        for ((d, &v), &g) in dx.iter_mut().zip(x).zip(dout) {
            let u = SQRT_2_OVER_PI * (v + 0.044_715 * v * v * v);
            let t = 1.0 - 2.0 / (exp_approx(2.0 * u) + 1.0);
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044_715 * v * v);
            *d += g * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * du);
        }
    }
}

multiversion! {
    /// Rows of fc = (gate | up), each `hidden` wide: out = silu(gate) * up.
    pub fn swiglu_forward(out: &mut [f32], fc: &[f32], hidden: usize) {
        for (o, row) in out.chunks_exact_mut(hidden).zip(fc.chunks_exact(2 * hidden)) {
            let (gate, up) = row.split_at(hidden);
            for i in 0..hidden {
                let sig = 1.0 / (1.0 + exp_approx(-gate[i]));
                o[i] = gate[i] * sig * up[i];
            }
        }
    }
}

multiversion! {
    /// dgate = dout * up * sig (1 + gate (1 - sig)); dup = dout * silu(gate). Written,
    /// not accumulated, into dfc's (gate | up) rows.
    pub fn swiglu_backward(dfc: &mut [f32], fc: &[f32], dout: &[f32], hidden: usize) {
        for ((d, row), g) in dfc.chunks_exact_mut(2 * hidden).zip(fc.chunks_exact(2 * hidden)).zip(dout.chunks_exact(hidden)) {
            let (gate, up) = row.split_at(hidden);
            let (dgate, dup) = d.split_at_mut(hidden);
            for i in 0..hidden {
                let sig = 1.0 / (1.0 + exp_approx(-gate[i]));
                dgate[i] = g[i] * up[i] * sig * (1.0 + gate[i] * (1.0 - sig));
                dup[i] = g[i] * gate[i] * sig;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ops::testing::{all, assert_gradient, probe_loss, values};

    /// The gradient at fc of sum(activation(fc) * probe), by both backward routes
    /// (`recompute`'s slope where the kind has one, `backward` always), against central
    /// differences, for every kind.
    #[test]
    fn backward_matches_differences() {
        let (rows, hidden) = (3, 4);
        for kind in [MlpKind::Gelu, MlpKind::GeluTanh, MlpKind::Swiglu] {
            let fc_width = if kind == MlpKind::Swiglu {
                2 * hidden
            } else {
                hidden
            };
            let act = Activation {
                kind,
                hidden,
                fc_width,
            };
            let fc = values(rows * fc_width, 5);
            let probe = values(rows * hidden, 6);
            let mut loss = |fc: &[f32]| -> f64 {
                let mut out = vec![0.0; rows * hidden];
                act.forward(&mut out, fc);
                probe_loss(&out, &probe)
            };
            let mut dfc = vec![0.0; rows * fc_width];
            act.backward(&mut dfc, &fc, &probe);
            assert_gradient(&format!("{kind:?}"), &dfc, &mut loss, &fc, &all(fc.len()));

            let (mut out, mut slope) = (vec![0.0; rows * hidden], vec![0.0; rows * fc_width]);
            if act.recompute(&mut out, &mut slope, &fc) {
                let from_slope: Vec<f32> = slope.iter().zip(&probe).map(|(s, g)| s * g).collect();
                let what = format!("{kind:?} slope");
                assert_gradient(&what, &from_slope, &mut loss, &fc, &all(fc.len()));
            }
            let mut forward = vec![0.0; rows * hidden];
            act.forward(&mut forward, &fc);
            assert_eq!(
                out, forward,
                "{kind:?}: recompute gives the forward's output"
            );
        }
    }
}
