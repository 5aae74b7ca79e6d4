//! The layers of the training fast path, each a forward and its backward side by side
//! (as llm.c lays them out). Shapes: N = B*T rows, C channels, H heads of size d.
//! Backward functions accumulate (+=) into parameter gradients and into the gradient of
//! their input, so residual branches and gradient accumulation need no extra pass.

use rayon::prelude::*;

use super::gemm::{matmul_strided, Causal, Precision, Strided};
use super::kernels::{
    axpy, dot_lanes, erf_approx, exp_approx, gelu, gelu_tanh, multiversion, sum_lanes, sum_lanes3,
};
use super::parallel::{share_len, share_rows, with_partials};

// --- Embedding ----------------------------------------------------------------------

/// x[n] = wte[ids[n]] (+ pos[n % T]).
pub fn embed_forward(
    x: &mut [f32],
    ids: &[u32],
    wte: &[f32],
    pos: Option<&[f32]>,
    t: usize,
    c: usize,
) {
    for (n, (row, &id)) in x.chunks_exact_mut(c).zip(ids).enumerate() {
        let id = id as usize;
        row.copy_from_slice(&wte[id * c..(id + 1) * c]);
        if let Some(pos) = pos {
            let p = n % t;
            for (xi, pi) in row.iter_mut().zip(&pos[p * c..(p + 1) * c]) {
                *xi += pi;
            }
        }
    }
}

/// dwte[ids[n]] += dx[n]; dpos[n % T] += dx[n] (when positions are learned).
pub fn embed_backward(
    dwte: &mut [f32],
    dpos: Option<&mut [f32]>,
    dx: &[f32],
    ids: &[u32],
    t: usize,
    c: usize,
) {
    for (row, &id) in dx.chunks_exact(c).zip(ids) {
        let id = id as usize;
        axpy(&mut dwte[id * c..(id + 1) * c], 1.0, row);
    }
    if let Some(dpos) = dpos {
        for (n, row) in dx.chunks_exact(c).enumerate() {
            let p = n % t;
            axpy(&mut dpos[p * c..(p + 1) * c], 1.0, row);
        }
    }
}

// --- LayerNorm ----------------------------------------------------------------------

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
        for (n, (xr, or)) in x.chunks_exact(c).zip(out.chunks_exact_mut(c)).enumerate() {
            let m = sum_lanes(xr, |v| v) / c as f32;
            let var = sum_lanes(xr, |v| (v - m) * (v - m)) / c as f32;
            let s = 1.0 / (var + eps).sqrt();
            for i in 0..c {
                or[i] = (xr[i] - m) * s * w[i] + b.map_or(0.0, |b| b[i]);
            }
            mean[n] = m;
            rstd[n] = s;
        }
    }
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
/// A norm layer of either kind, with its statistics kept by the caller: `mean` is
/// unused by RMSNorm.
#[derive(Debug, Clone, Copy)]
pub struct NormOp {
    pub kind: crate::config::NormKind,
    pub eps: f32,
}

impl NormOp {
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        x: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
    ) {
        let c = w.len();
        let share = share_rows(rstd.len(), c);
        out.par_chunks_mut(share * c)
            .zip(mean.par_chunks_mut(share))
            .zip(rstd.par_chunks_mut(share))
            .zip(x.par_chunks(share * c))
            .for_each(|(((out, mean), rstd), x)| match self.kind {
                crate::config::NormKind::LayerNorm => {
                    layernorm_forward(out, mean, rstd, x, w, b, self.eps)
                }
                crate::config::NormKind::RmsNorm => rmsnorm_forward(out, rstd, x, w, self.eps),
            });
    }

    /// The forward's output again, from the kept statistics.
    pub fn apply(
        &self,
        out: &mut [f32],
        x: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        mean: &[f32],
        rstd: &[f32],
    ) {
        let c = w.len();
        let share = share_rows(rstd.len(), c);
        out.par_chunks_mut(share * c)
            .zip(mean.par_chunks(share))
            .zip(rstd.par_chunks(share))
            .zip(x.par_chunks(share * c))
            .for_each(|(((out, mean), rstd), x)| match self.kind {
                crate::config::NormKind::LayerNorm => layernorm_apply(out, x, w, b, mean, rstd),
                crate::config::NormKind::RmsNorm => {
                    for (n, (xr, or)) in x.chunks_exact(c).zip(out.chunks_exact_mut(c)).enumerate()
                    {
                        for i in 0..c {
                            or[i] = xr[i] * rstd[n] * w[i];
                        }
                    }
                }
            });
    }

    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        dx: &mut [f32],
        dw: &mut [f32],
        db: Option<&mut [f32]>,
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        mean: &[f32],
        rstd: &[f32],
    ) {
        // Each share of rows sums its weight (and bias) gradients into its own partial
        // (dw | db), added in share order afterwards.
        let c = w.len();
        let share = share_rows(rstd.len(), c);
        let has_bias = db.is_some();
        with_partials(rstd.len().div_ceil(share) * 2 * c, |partials| {
            partials
                .par_chunks_mut(2 * c)
                .zip(dx.par_chunks_mut(share * c))
                .zip(dout.par_chunks(share * c))
                .zip(x.par_chunks(share * c))
                .zip(mean.par_chunks(share))
                .zip(rstd.par_chunks(share))
                .for_each(|(((((partial, dx), dout), x), mean), rstd)| {
                    let (dw, db) = partial.split_at_mut(c);
                    match self.kind {
                        crate::config::NormKind::LayerNorm => {
                            let db = has_bias.then_some(db);
                            layernorm_backward(dx, dw, db, dout, x, w, mean, rstd)
                        }
                        crate::config::NormKind::RmsNorm => {
                            rmsnorm_backward(dx, dw, dout, x, w, rstd)
                        }
                    }
                });
            let mut db = db;
            for partial in partials.chunks_exact(2 * c) {
                axpy(dw, 1.0, &partial[..c]);
                if let Some(db) = db.as_deref_mut() {
                    axpy(db, 1.0, &partial[c..]);
                }
            }
        });
    }
}

// --- Bias ---------------------------------------------------------------------------

/// Adds `b` to every row of `out`.
pub fn add_bias(out: &mut [f32], b: &[f32]) {
    for row in out.chunks_exact_mut(b.len()) {
        axpy(row, 1.0, b);
    }
}

/// db += sum over rows of dout.
pub fn bias_backward(db: &mut [f32], dout: &[f32]) {
    for row in dout.chunks_exact(db.len()) {
        axpy(db, 1.0, row);
    }
}

// --- GELU ---------------------------------------------------------------------------

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

/// The MLP's non-linearity between c_fc (fc_out wide) and c_proj (hidden wide).
#[derive(Debug, Clone, Copy)]
pub struct Activation {
    pub kind: crate::config::MlpKind,
    pub hidden: usize,
    /// c_fc's width: `hidden`, or twice that for SwiGLU's gate | up.
    pub fc_out: usize,
}

impl Activation {
    /// out (N, hidden) from fc (N, fc_out).
    pub fn forward(&self, out: &mut [f32], fc: &[f32]) {
        let (hidden, fc_out) = (self.hidden, self.fc_out);
        let share = share_rows(out.len() / hidden, fc_out);
        out.par_chunks_mut(share * hidden)
            .zip(fc.par_chunks(share * fc_out))
            .for_each(|(out, fc)| match self.kind {
                crate::config::MlpKind::Gelu => gelu_forward(out, fc),
                crate::config::MlpKind::GeluTanh => gelu_tanh_forward(out, fc),
                crate::config::MlpKind::Swiglu => swiglu_forward(out, fc, hidden),
            });
    }

    /// The backward's first half: the output again (into `out`) and, where the kind
    /// allows, the slope d out / d fc (into `slope`, then dfc = dout * slope). Returns
    /// whether the slope was written; otherwise use `backward`.
    pub fn recompute(&self, out: &mut [f32], slope: &mut [f32], fc: &[f32]) -> bool {
        match self.kind {
            crate::config::MlpKind::Gelu => {
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

    /// dfc (N, fc_out) = the gradient at fc, from dout (N, hidden); overwritten.
    pub fn backward(&self, dfc: &mut [f32], fc: &[f32], dout: &[f32]) {
        let (hidden, fc_out) = (self.hidden, self.fc_out);
        let share = share_rows(dout.len() / hidden, fc_out);
        dfc.par_chunks_mut(share * fc_out)
            .zip(fc.par_chunks(share * fc_out))
            .zip(dout.par_chunks(share * hidden))
            .for_each(|((dfc, fc), dout)| match self.kind {
                crate::config::MlpKind::Gelu => {
                    dfc.fill(0.0);
                    gelu_backward(dfc, fc, dout)
                }
                crate::config::MlpKind::GeluTanh => {
                    dfc.fill(0.0);
                    gelu_tanh_backward(dfc, fc, dout)
                }
                crate::config::MlpKind::Swiglu => swiglu_backward(dfc, fc, dout, hidden),
            });
    }
}

// --- RoPE ---------------------------------------------------------------------------

/// Rotates the q and k heads (the first `rotated` values) of every qkv row (`width`
/// wide) in place, split-halves pairing, by the angles of position n % T. With
/// `inverse`, rotates back (the backward: a rotation's transpose is its inverse).
#[allow(clippy::too_many_arguments)]
pub fn rope(
    qkv: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    t: usize,
    width: usize,
    rotated: usize,
    d: usize,
    inverse: bool,
) {
    let half = d / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    for (n, row) in qkv.chunks_exact_mut(width).enumerate() {
        let p = n % t;
        let (cos, sin) = (
            &cos[p * half..(p + 1) * half],
            &sin[p * half..(p + 1) * half],
        );
        for head in row[..rotated].chunks_exact_mut(d) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x, y) = (a[i], b[i]);
                let s = sign * sin[i];
                a[i] = x * cos[i] - y * s;
                b[i] = y * cos[i] + x * s;
            }
        }
    }
}

// --- Causal self-attention ----------------------------------------------------------

/// Shapes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub h: usize,
    /// K/V heads; each serves h / kv query heads.
    pub kv: usize,
}

impl AttnShape {
    fn d(&self) -> usize {
        self.c / self.h
    }

    /// Width of a qkv row: H query heads, then kv key heads, then kv value heads.
    pub fn width(&self) -> usize {
        self.c + 2 * self.kv * self.d()
    }

    /// Offsets in a qkv row of the key and value head query head `head` reads.
    fn kv_offsets(&self, head: usize) -> (usize, usize) {
        let g = head / (self.h / self.kv);
        let d = self.d();
        (self.c + g * d, self.c + self.kv * d + g * d)
    }
}

/// Work space `attention_forward` and `attention_backward` need for `b` sequences of
/// `t` positions: three T x T matrices (weights, their gradient, the dropped weights)
/// per share of sequences, one share per thread. The weights are recomputed in the
/// backward rather than kept per layer, which would cost B H T T values per layer
/// (150 MiB at 6 layers, T = 256).
pub fn attention_scratch_len(b: usize, t: usize) -> usize {
    b.div_ceil(sequences_per_share(b)) * 3 * t * t
}

/// Sequences each thread takes in the attention passes.
fn sequences_per_share(b: usize) -> usize {
    b.div_ceil(super::gemm::threads()).max(1)
}

/// y (N, C) from qkv (N, width: q | k | v heads side by side), sequences in parallel.
/// With a dropout `mask` (B, H, T, T; 0 or 1/(1-p)), Y = (P * mask) V.
pub fn attention_forward(
    precision: Precision,
    y: &mut [f32],
    qkv: &[f32],
    mask: Option<&[f32]>,
    scratch: &mut [f32],
    s: AttnShape,
) {
    let (t, c, h, w) = (s.t, s.c, s.h, s.width());
    let per_seq = h * t * t;
    let share = sequences_per_share(s.b);
    y.par_chunks_mut(share * t * c)
        .zip(qkv.par_chunks(share * t * w))
        .zip(scratch.par_chunks_mut(3 * t * t))
        .enumerate()
        .for_each(|(i, ((y, qkv), scratch))| {
            let (p, dropped) = scratch.split_at_mut(t * t);
            let dropped = &mut dropped[..t * t];
            for (j, (y, qkv)) in y.chunks_mut(t * c).zip(qkv.chunks(t * w)).enumerate() {
                let b = i * share + j;
                let mask = mask.map(|m| &m[b * per_seq..(b + 1) * per_seq]);
                attention_forward_one(precision, y, qkv, mask, p, dropped, s)
            }
        });
}

/// `attention_forward` for one sequence: per head, the weights P (into `p`), then
/// Y = P V (a GEMM on strided views of qkv).
pub fn attention_forward_one(
    precision: Precision,
    y: &mut [f32],
    qkv: &[f32],
    mask: Option<&[f32]>,
    p: &mut [f32],
    dropped: &mut [f32],
    s: AttnShape,
) {
    let (t, c, h, d, w) = (s.t, s.c, s.h, s.d(), s.width());
    for head in 0..h {
        attention_weights(precision, p, qkv, head, s);
        let (_, vo) = s.kv_offsets(head);
        let v = Strided {
            data: &qkv[vo..],
            row: w,
            col: 1,
        };
        let p: &[f32] = match mask {
            Some(mask) => {
                let m = &mask[head * t * t..(head + 1) * t * t];
                for ((o, a), k) in dropped.iter_mut().zip(p.iter()).zip(m) {
                    *o = a * k;
                }
                dropped
            }
            None => p,
        };
        let p = Strided {
            data: p,
            row: t,
            col: 1,
        };
        let y = &mut y[head * d..];
        matmul_strided(y, c, p, v, (t, d, t), false, 1.0, Causal::LowerA, precision);
    }
}

/// One head's attention weights for one sequence into `p` (T x T): S = Q Kᵀ / sqrt(d),
/// then the causal softmax of each row (zeros above the diagonal).
fn attention_weights(precision: Precision, p: &mut [f32], qkv: &[f32], head: usize, s: AttnShape) {
    let (t, d, w) = (s.t, s.d(), s.width());
    let (ko, _) = s.kv_offsets(head);
    let q = Strided {
        data: &qkv[head * d..],
        row: w,
        col: 1,
    };
    let kt = Strided {
        data: &qkv[ko..],
        row: 1,
        col: w,
    };
    let scale = 1.0 / (d as f32).sqrt();
    // Scores above the diagonal are never read: the softmax writes zeros there.
    matmul_strided(
        p,
        t,
        q,
        kt,
        (t, t, d),
        false,
        scale,
        Causal::LowerDst,
        precision,
    );
    causal_softmax_rows(p, t);
}

multiversion! {
    /// Row i of the (t x t) scores: softmax over columns 0..=i, zeros after.
    pub fn causal_softmax_rows(p: &mut [f32], t: usize) {
        for (i, row) in p.chunks_exact_mut(t).enumerate() {
            let max = max_lanes(&row[..=i]);
            for a in row[..=i].iter_mut() {
                *a = exp_approx(*a - max);
            }
            let inv = 1.0 / sum_lanes(&row[..=i], |a| a);
            for a in row[..=i].iter_mut() {
                *a *= inv;
            }
            row[i + 1..].fill(0.0);
        }
    }
}

/// Backward of `attention_forward`: dqkv += d(q | k | v) from dy.
/// With p = P[i, :], dp_j = dy_i . v_j, ds_j = p_j (dp_j - sum_k p_k dp_k):
/// dv_j += p_j dy_i; dq_i += scale sum_j ds_j k_j; dk_j += scale ds_j q_i.
pub fn attention_backward(
    precision: Precision,
    dqkv: &mut [f32],
    dy: &[f32],
    qkv: &[f32],
    mask: Option<&[f32]>,
    scratch: &mut [f32],
    s: AttnShape,
) {
    let (t, c, h, w) = (s.t, s.c, s.h, s.width());
    let per_seq = h * t * t;
    let share = sequences_per_share(s.b);
    dqkv.par_chunks_mut(share * t * w)
        .zip(dy.par_chunks(share * t * c))
        .zip(qkv.par_chunks(share * t * w))
        .zip(scratch.par_chunks_mut(3 * t * t))
        .enumerate()
        .for_each(|(i, (((dqkv, dy), qkv), scratch))| {
            let (p, rest) = scratch.split_at_mut(t * t);
            let (ds, dropped) = rest.split_at_mut(t * t);
            let sequences = dqkv
                .chunks_mut(t * w)
                .zip(dy.chunks(t * c))
                .zip(qkv.chunks(t * w));
            for (j, ((dqkv, dy), qkv)) in sequences.enumerate() {
                let b = i * share + j;
                let mask = mask.map(|m| &m[b * per_seq..(b + 1) * per_seq]);
                let work = AttnWork {
                    p: &mut *p,
                    ds: &mut *ds,
                    dropped: &mut dropped[..t * t],
                };
                attention_backward_one(precision, dqkv, dy, qkv, mask, s, work)
            }
        });
}

/// One sequence's T x T work space in the attention backward.
pub struct AttnWork<'a> {
    /// The weights, recomputed.
    pub p: &'a mut [f32],
    /// Their gradient.
    pub ds: &'a mut [f32],
    /// The weights after dropout.
    pub dropped: &'a mut [f32],
}

/// `attention_backward` for one sequence. Per head, P recomputed from q and k, and with
/// Pd = P * mask (P without dropout): dPd = dY Vᵀ; dP = dPd * mask;
/// dS = P * (dP - rowsum(P * dP)) * scale; dQ += dS K; dK += dSᵀ Q; dV += Pdᵀ dY.
pub fn attention_backward_one(
    precision: Precision,
    dqkv: &mut [f32],
    dy: &[f32],
    qkv: &[f32],
    mask: Option<&[f32]>,
    s: AttnShape,
    work: AttnWork,
) {
    let (t, c, h, d, w) = (s.t, s.c, s.h, s.d(), s.width());
    let scale = 1.0 / (d as f32).sqrt();
    let AttnWork { p, ds, dropped } = work;
    for head in 0..h {
        let (ko, vo) = s.kv_offsets(head);
        attention_weights(precision, p, qkv, head, s);
        let p: &[f32] = p;
        let dy_h = Strided {
            data: &dy[head * d..],
            row: c,
            col: 1,
        };
        let vt = Strided {
            data: &qkv[vo..],
            row: 1,
            col: w,
        };
        // dPd below the diagonal (the rest stays stale: the softmax backward reads
        // and writes only j <= i).
        let tt = (t, t, d);
        matmul_strided(ds, t, dy_h, vt, tt, false, 1.0, Causal::LowerDst, precision);
        let head_mask = mask.map(|m| &m[head * t * t..(head + 1) * t * t]);
        if let Some(m) = head_mask {
            for (g, k) in ds.iter_mut().zip(m) {
                *g *= k;
            }
        }
        causal_softmax_rows_backward(ds, p, t, scale);
        let ds_m = Strided {
            data: ds,
            row: t,
            col: 1,
        };
        let ds_t = Strided {
            data: ds,
            row: 1,
            col: t,
        };
        let k = Strided {
            data: &qkv[ko..],
            row: w,
            col: 1,
        };
        let q = Strided {
            data: &qkv[head * d..],
            row: w,
            col: 1,
        };
        // dS is zero above the diagonal: query i takes keys j <= i, key j gets
        // gradient from queries i >= j.
        let (dq, td) = (&mut dqkv[head * d..], (t, d, t));
        matmul_strided(dq, w, ds_m, k, td, true, 1.0, Causal::LowerA, precision);
        let dk = &mut dqkv[ko..];
        matmul_strided(dk, w, ds_t, q, td, true, 1.0, Causal::UpperA, precision);
        let p_used: &[f32] = match head_mask {
            Some(m) => {
                for ((o, a), k) in dropped.iter_mut().zip(p).zip(m) {
                    *o = a * k;
                }
                dropped
            }
            None => p,
        };
        let p_t = Strided {
            data: p_used,
            row: 1,
            col: t,
        };
        let dv = &mut dqkv[vo..];
        matmul_strided(dv, w, p_t, dy_h, td, true, 1.0, Causal::UpperA, precision);
    }
}

multiversion! {
    /// dP -> dS in place, row by row: ds_j = p_j (dp_j - sum_k p_k dp_k) * scale for
    /// j <= i; zero above the diagonal (where p is zero and dP need not be set).
    pub fn causal_softmax_rows_backward(ds: &mut [f32], p: &[f32], t: usize, scale: f32) {
        for (i, (row, p)) in ds.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
            let (seen, above) = row.split_at_mut(i + 1);
            let weighted = dot_lanes(seen, &p[..=i]);
            for (a, &pj) in seen.iter_mut().zip(p) {
                *a = pj * (*a - weighted) * scale;
            }
            above.fill(0.0);
        }
    }
}

/// The largest element, with 16 running maxima the compiler keeps in a vector register.
#[inline(always)]
fn max_lanes(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..16 {
            lanes[k] = if c[k] > lanes[k] { c[k] } else { lanes[k] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for v in lanes.iter().chain(rest) {
        m = if *v > m { *v } else { m };
    }
    m
}

// --- Output layer: softmax + cross-entropy --------------------------------------------

/// Turns each row of `logits` (N, V) into probabilities in place and returns the summed
/// loss -log p[target]. Rows run in parallel, each writing its loss to `row_loss` (N);
/// the sum runs in row order, so the result does not depend on thread timing.
pub fn softmax_cross_entropy(
    logits: &mut [f32],
    targets: &[u32],
    v: usize,
    row_loss: &mut [f64],
) -> f64 {
    logits
        .par_chunks_mut(v)
        .zip(targets.par_iter())
        .zip(row_loss.par_iter_mut())
        .for_each(|((row, &target), loss)| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // -log p = log(sum e^(x - max)) - (x_target - max): finite even when
            // e^(x_target - max) underflows.
            let shifted_target = (row[target as usize] - max) as f64;
            let mut sum = 0.0f64;
            for x in row.iter_mut() {
                *x = (*x - max).exp();
                sum += *x as f64;
            }
            let inv = (1.0 / sum) as f32;
            for x in row.iter_mut() {
                *x *= inv;
            }
            *loss = sum.ln() - shifted_target;
        });
    row_loss.iter().sum()
}

/// probs -> dlogits in place: (p - onehot(target)) * scale.
pub fn cross_entropy_backward(probs: &mut [f32], targets: &[u32], v: usize, scale: f32) {
    for (row, &target) in probs.chunks_exact_mut(v).zip(targets) {
        row[target as usize] -= 1.0;
        for x in row.iter_mut() {
            *x *= scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Central differences of a scalar function of one buffer, at a few indices.
    fn numeric(f: &mut dyn FnMut(&[f32]) -> f64, x: &[f32], at: &[usize]) -> Vec<f64> {
        let eps = 1e-2f32;
        at.iter()
            .map(|&i| {
                let mut p = x.to_vec();
                p[i] += eps;
                let up = f(&p);
                p[i] -= 2.0 * eps;
                let down = f(&p);
                (up - down) / (2.0 * eps as f64)
            })
            .collect()
    }

    /// Analytic gradient `analytic` against central differences of `f` at `at`.
    fn assert_gradient(
        what: &str,
        analytic: &[f32],
        f: &mut dyn FnMut(&[f32]) -> f64,
        x: &[f32],
        at: &[usize],
    ) {
        for (&i, num) in at.iter().zip(numeric(f, x, at)) {
            assert!(
                close(analytic[i] as f64, num),
                "{what}[{i}]: {} vs {num}",
                analytic[i]
            );
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 2e-3 * (1.0 + b.abs())
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn layernorm_backward_matches_differences() {
        let (n, c) = (3, 5);
        let x = values(n * c, 1);
        let w = values(c, 2);
        let bias = values(c, 3);
        let probe = values(n * c, 4); // loss = sum(out * probe)
        let mut f = |x: &[f32]| -> f64 {
            let (mut out, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            layernorm_forward(&mut out, &mut m, &mut r, x, &w, Some(&bias), 1e-5);
            out.iter().zip(&probe).map(|(a, b)| (*a * *b) as f64).sum()
        };
        let (mut out, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut out, &mut m, &mut r, &x, &w, Some(&bias), 1e-5);
        let (mut dx, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
        layernorm_backward(&mut dx, &mut dw, Some(&mut db), &probe, &x, &w, &m, &r);
        let at = [0, 4, 7, 14];
        assert_gradient("dx", &dx, &mut f, &x, &at);
    }

    #[test]
    fn gelu_backward_matches_differences() {
        let x = values(9, 5);
        let probe = values(9, 6);
        let mut f = |x: &[f32]| -> f64 {
            let mut out = vec![0.0; x.len()];
            gelu_forward(&mut out, x);
            out.iter().zip(&probe).map(|(a, b)| (*a * *b) as f64).sum()
        };
        let mut dx = vec![0.0; 9];
        gelu_backward(&mut dx, &x, &probe);
        let at: Vec<usize> = (0..9).collect();
        assert_gradient("dx", &dx, &mut f, &x, &at);
    }

    #[test]
    fn attention_backward_matches_differences() {
        let s = AttnShape {
            b: 2,
            t: 4,
            c: 6,
            h: 2,
            kv: 1,
        };
        let n = s.b * s.t;
        let qkv = values(n * s.width(), 7);
        let probe = values(n * s.c, 8);
        let scratch = attention_scratch_len(s.b, s.t);
        let mut f = |qkv: &[f32]| -> f64 {
            let mut y = vec![0.0; n * s.c];
            let f32s = Precision::F32;
            attention_forward(f32s, &mut y, qkv, None, &mut vec![0.0; scratch], s);
            y.iter().zip(&probe).map(|(a, b)| (*a * *b) as f64).sum()
        };
        let mut dqkv = vec![0.0; n * s.width()];
        attention_backward(
            Precision::F32,
            &mut dqkv,
            &probe,
            &qkv,
            None,
            &mut vec![0.0; scratch],
            s,
        );
        let at: Vec<usize> = (0..n * s.width()).step_by(3).collect();
        assert_gradient("dqkv", &dqkv, &mut f, &qkv, &at);
    }

    #[test]
    fn rmsnorm_gelu_tanh_and_swiglu_backward_match_differences() {
        let (n, c) = (3, 6);
        let x = values(n * c, 11);
        let w = values(c, 12);
        let probe = values(n * c, 13);
        let mut f = |x: &[f32]| -> f64 {
            let (mut out, mut r) = (vec![0.0; n * c], vec![0.0; n]);
            rmsnorm_forward(&mut out, &mut r, x, &w, 1e-5);
            out.iter().zip(&probe).map(|(a, b)| (*a * *b) as f64).sum()
        };
        let (mut out, mut r) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut out, &mut r, &x, &w, 1e-5);
        let (mut dx, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
        rmsnorm_backward(&mut dx, &mut dw, &probe, &x, &w, &r);
        let at: Vec<usize> = (0..n * c).step_by(2).collect();
        assert_gradient("rmsnorm dx", &dx, &mut f, &x, &at);

        let mut f = |x: &[f32]| -> f64 {
            let mut out = vec![0.0; x.len()];
            gelu_tanh_forward(&mut out, x);
            out.iter().zip(&probe).map(|(a, b)| (*a * *b) as f64).sum()
        };
        let mut dx = vec![0.0; n * c];
        gelu_tanh_backward(&mut dx, &x, &probe);
        assert_gradient("gelu_tanh dx", &dx, &mut f, &x, &at);

        let hidden = 3; // x as (n, 2 * hidden) rows of gate | up; probe as (n, hidden)
        let probe_h = values(n * hidden, 14);
        let mut f = |fc: &[f32]| -> f64 {
            let mut out = vec![0.0; n * hidden];
            swiglu_forward(&mut out, fc, hidden);
            out.iter()
                .zip(&probe_h)
                .map(|(a, b)| (*a * *b) as f64)
                .sum()
        };
        let mut dfc = vec![0.0; n * c];
        swiglu_backward(&mut dfc, &x, &probe_h, hidden);
        let all: Vec<usize> = (0..n * c).collect();
        assert_gradient("swiglu dfc", &dfc, &mut f, &x, &all);
    }

    #[test]
    fn rope_inverse_undoes_rope() {
        let (t, c, d) = (3, 8, 4);
        let mut qkv = values(2 * t * 3 * c, 9);
        let original = qkv.clone();
        let cos: Vec<f32> = (0..t * d / 2).map(|i| (i as f32 * 0.3).cos()).collect();
        let sin: Vec<f32> = (0..t * d / 2).map(|i| (i as f32 * 0.3).sin()).collect();
        rope(&mut qkv, &cos, &sin, t, 3 * c, 2 * c, d, false);
        assert_ne!(qkv, original);
        rope(&mut qkv, &cos, &sin, t, 3 * c, 2 * c, d, true);
        for (a, b) in qkv.iter().zip(&original) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
