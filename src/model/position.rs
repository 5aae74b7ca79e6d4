//! How the model knows where a token is: learned, sinusoidal or rotary positions.
//!
//! Learned and sinusoidal positions are vectors added to the token embedding once, at
//! the input. RoPE instead rotates every query and key in every layer by an angle that
//! grows with the position, so that `q_m . k_n` depends only on the offset `n - m`.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};

use super::params::Params;
use super::spec::ModelSpec;
use crate::config::{ModelConfig, PositionKind};

/// Position information added to the embedding at the input, if any.
pub enum InputPositions {
    /// `wpe`: (block_size, C), trained.
    Learned(Tensor),
    /// The fixed table of "Attention Is All You Need": (block_size, C).
    Sinusoidal(Tensor),
    /// Positions enter through RoPE inside attention instead.
    None,
}

impl InputPositions {
    pub fn new(params: &Params, spec: &ModelSpec, device: &Device, dtype: DType) -> Result<Self> {
        let cfg = &spec.config;
        Ok(match (spec.wpe, cfg.positions) {
            (Some(wpe), _) => InputPositions::Learned(params.tensor(wpe).clone()),
            (None, PositionKind::Sinusoidal) => InputPositions::Sinusoidal(
                sinusoidal_table(
                    cfg.block_size,
                    cfg.n_embd,
                    cfg.sinusoidal_amplitude(),
                    device,
                )?
                .to_dtype(dtype)?,
            ),
            (None, _) => InputPositions::None,
        })
    }

    /// Adds the vectors of positions `pos0 .. pos0 + T` to x: (B, T, C).
    pub fn add_to(&self, x: &Tensor, pos0: usize) -> Result<Tensor> {
        let t = x.dim(1)?;
        Ok(match self {
            InputPositions::Learned(table) | InputPositions::Sinusoidal(table) => {
                x.broadcast_add(&table.narrow(0, pos0, t)?)?
            }
            InputPositions::None => x.clone(),
        })
    }
}

/// PE[pos, 2i] = a sin(pos / 10000^(2i/C)), PE[pos, 2i+1] = a cos(...), a the
/// amplitude (`ModelConfig::sinusoidal_amplitude`: 1/sqrt(C) unless a run recorded
/// another).
///
/// "Attention Is All You Need" multiplies the embedding by sqrt(C) before adding the
/// table; here the embedding is also the output layer, initialised at GPT-2's 0.02, so
/// the table is divided by sqrt(C) instead: the same ratio. At full amplitude (a
/// vector of length sqrt(C/2) against a token's of about 0.02 sqrt(C)) the tokens are
/// drowned: the baby model sat at 3.2 after 500 steps where learned positions reach
/// 2.33; scaled, 2.26 (and 1.90 at 2000 steps, learned 1.92). Checkpoints trained
/// before that change are read with amplitude 1, the table they learned.
pub fn sinusoidal_table(
    positions: usize,
    dim: usize,
    amplitude: f64,
    device: &Device,
) -> Result<Tensor> {
    let mut table = vec![0f32; positions * dim];
    for pos in 0..positions {
        for i in 0..dim / 2 {
            let angle = pos as f64 * 10000f64.powf(-2.0 * i as f64 / dim as f64);
            table[pos * dim + 2 * i] = (amplitude * angle.sin()) as f32;
            table[pos * dim + 2 * i + 1] = (amplitude * angle.cos()) as f32;
        }
    }
    Ok(Tensor::from_vec(table, (positions, dim), device)?)
}

/// `spec`'s table as the fused engines and decoders hold it: flat, (block_size, C).
pub fn sinusoidal_values(spec: &ModelSpec) -> Result<Vec<f32>> {
    let s = &spec.shapes;
    let amplitude = spec.config.sinusoidal_amplitude();
    let table = sinusoidal_table(s.block_size, s.n_embd, amplitude, &Device::Cpu)?;
    Ok(table.flatten_all()?.to_vec1()?)
}

/// cos and sin of pos * theta_i, theta_i = base^(-2i/d): two (block_size, d/2) tables.
pub fn rope_tables(cfg: &ModelConfig) -> (Vec<f32>, Vec<f32>) {
    let d = cfg.head_dim();
    let half = d / 2;
    let mut cos = vec![0f32; cfg.block_size * half];
    let mut sin = vec![0f32; cfg.block_size * half];
    for pos in 0..cfg.block_size {
        for i in 0..half {
            let theta = cfg.rope_theta.powf(-2.0 * i as f64 / d as f64);
            let angle = pos as f64 * theta;
            cos[pos * half + i] = angle.cos() as f32;
            sin[pos * half + i] = angle.sin() as f32;
        }
    }
    (cos, sin)
}

/// Rotary position embedding in the split-halves pairing of Hugging Face's Llama:
/// dimension i is rotated together with i + d/2 by the angle pos * theta_i, where
/// theta_i = base^(-2i/d). (The paper pairs (2i, 2i+1); the two differ only by a fixed
/// permutation of the head dimensions.) Cloning shares the tables.
#[derive(Clone)]
pub struct Rope {
    cos: Tensor, // (block_size, d/2)
    sin: Tensor, // (block_size, d/2)
}

impl Rope {
    pub fn new(cfg: &ModelConfig, device: &Device, dtype: DType) -> Result<Self> {
        let (cos, sin) = rope_tables(cfg);
        let shape = (cfg.block_size, cfg.head_dim() / 2);
        Ok(Self {
            cos: Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?,
            sin: Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?,
        })
    }

    /// Rotates x: (B, H, T, d) at positions pos0 .. pos0 + T.
    pub fn apply(&self, x: &Tensor, pos0: usize) -> Result<Tensor> {
        let (_, _, t, d) = x.dims4()?;
        let half = d / 2;
        let cos = self.cos.narrow(0, pos0, t)?; // (T, d/2), broadcast over B and H
        let sin = self.sin.narrow(0, pos0, t)?;
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        let first = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
        let second = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
        Ok(Tensor::cat(&[first, second], D::Minus1)?)
    }
}
