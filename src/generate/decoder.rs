//! Stepping a model through growing contexts: the fused CPU decoder where the weights
//! are on the CPU, the CUDA decoder (`crate::cuda::CudaDecoder`) where they are on a
//! CUDA device, the reference model's KV cache elsewhere, or (for checking and
//! benchmarking) the reference model over the whole window every step.
//!
//! The context window: the model was trained on at most `block_size` positions, and it
//! is never asked about later ones. When the window is full it slides: the last half
//! of the tokens become the new window and are prefilled again (positions restart at
//! 0). This holds for every position kind (learned tables end at block_size; RoPE and
//! sinusoidal positions past it were never trained). All modes see identical contexts.

use anyhow::Result;
use candle_core::Tensor;

use crate::cpu::FastDecoder;
use crate::model::{Gpt, KvCache};
use crate::user_bail;

/// How the next logits are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeMode {
    /// The fused CPU decoder (`cpu::FastDecoder`), the CUDA decoder on CUDA; the
    /// reference path elsewhere.
    Fast,
    /// The reference model, one position at a time from its KV cache.
    Cached,
    /// The reference model over the whole window at every step.
    Uncached,
}

enum Backend {
    Fast(Box<FastDecoder>),
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::CudaDecoder>),
    Cached(KvCache),
    Uncached,
}

/// Steps a model through growing contexts, `batch` sequences at once, and returns
/// next-token logits, (batch, V) row-major.
pub struct Decoder<'m> {
    model: &'m Gpt,
    backend: Backend,
    batch: usize,
    /// Per sequence, the tokens the next logits are conditioned on.
    windows: Vec<Vec<u32>>,
    logits: Vec<f32>,
}

impl<'m> Decoder<'m> {
    pub fn new(model: &'m Gpt, batch: usize, mode: DecodeMode) -> Result<Self> {
        let backend = match mode {
            DecodeMode::Fast if model.device().is_cpu() => {
                let weights = model.params().to_flat()?;
                Backend::Fast(Box::new(FastDecoder::new(model.spec(), &weights, batch)?))
            }
            #[cfg(feature = "cuda")]
            DecodeMode::Fast if model.device().is_cuda() => {
                let weights = model.params().to_flat()?;
                let decoder = crate::cuda::CudaDecoder::new(
                    model.spec(),
                    &weights,
                    model.device(),
                    batch,
                    model.products(),
                )?;
                Backend::Cuda(Box::new(decoder))
            }
            DecodeMode::Fast | DecodeMode::Cached => {
                Backend::Cached(KvCache::new(model.config().n_layer))
            }
            DecodeMode::Uncached => Backend::Uncached,
        };
        Ok(Self {
            model,
            backend,
            batch,
            windows: vec![Vec::new(); batch],
            logits: Vec::new(),
        })
    }

    pub fn window(&self, row: usize) -> &[u32] {
        &self.windows[row]
    }

    /// Starts every sequence from `prompt` (1 ..= block_size tokens); returns the logits.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<&[f32]> {
        let block = self.model.config().block_size;
        if prompt.is_empty() || prompt.len() > block {
            user_bail!(
                "the prompt is {} tokens; it must be 1 to {block} (the model's block_size)",
                prompt.len()
            );
        }
        self.windows = vec![prompt.to_vec(); self.batch];
        self.refill()
    }

    /// Appends one token to each sequence (sliding the windows when full); returns the
    /// logits.
    pub fn push(&mut self, ids: &[u32]) -> Result<&[f32]> {
        assert_eq!(ids.len(), self.batch);
        let block = self.model.config().block_size;
        if self.windows[0].len() == block {
            let keep = block / 2;
            for (w, &id) in self.windows.iter_mut().zip(ids) {
                w.drain(..block - keep);
                w.push(id);
            }
            return self.refill();
        }
        for (w, &id) in self.windows.iter_mut().zip(ids) {
            w.push(id);
        }
        let pos = self.windows[0].len() - 1;
        match &mut self.backend {
            Backend::Fast(fast) => {
                let logits = fast.step(ids)?;
                self.logits.clear();
                self.logits.extend_from_slice(logits);
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => {
                let logits = cuda.step(ids)?;
                self.logits.clear();
                self.logits.extend_from_slice(logits);
            }
            Backend::Cached(cache) => {
                let ids = Tensor::from_slice(ids, (self.batch, 1), self.model.device())?;
                let out = self.model.forward(&ids, pos, Some(cache), None)?;
                self.logits = last_logits(&out.logits)?;
            }
            Backend::Uncached => return self.refill(),
        }
        Ok(&self.logits)
    }

    /// Runs the whole windows from position 0.
    fn refill(&mut self) -> Result<&[f32]> {
        match &mut self.backend {
            Backend::Fast(fast) => {
                let logits = fast.prefill(&self.windows)?;
                self.logits.clear();
                self.logits.extend_from_slice(logits);
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => {
                let logits = cuda.prefill(&self.windows)?;
                self.logits.clear();
                self.logits.extend_from_slice(logits);
            }
            Backend::Cached(cache) => {
                cache.clear();
                let ids = windows_tensor(&self.windows, self.model)?;
                let out = self.model.forward(&ids, 0, Some(cache), None)?;
                self.logits = last_logits(&out.logits)?;
            }
            Backend::Uncached => {
                let ids = windows_tensor(&self.windows, self.model)?;
                let out = self.model.forward(&ids, 0, None, None)?;
                self.logits = last_logits(&out.logits)?;
            }
        }
        Ok(&self.logits)
    }
}

fn windows_tensor(windows: &[Vec<u32>], model: &Gpt) -> Result<Tensor> {
    let t = windows[0].len();
    Ok(Tensor::from_vec(
        windows.concat(),
        (windows.len(), t),
        model.device(),
    )?)
}

/// (B, T, V) -> the last position's logits, (B, V) flat on the host.
fn last_logits(logits: &Tensor) -> Result<Vec<f32>> {
    let t = logits.dim(1)?;
    Ok(logits
        .narrow(1, t - 1, 1)?
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1()?)
}
