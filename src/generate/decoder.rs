//! Stepping a model through growing contexts: the fused CPU decoder where the weights
//! are on the CPU, the CUDA decoder (`crate::cuda::CudaDecoder`) where they are on a
//! CUDA device, the reference model's KV cache elsewhere, or (for checking and
//! benchmarking) the reference model over the whole window every step.
//!
//! The context window: the model was trained on at most `block_size` positions, and it
//! is never asked about later ones. When the window is full it slides: the last
//! block_size / 2 tokens and the new one become the window and are prefilled again
//! (positions restart at 0). This holds for every position kind (learned tables end at block_size; RoPE and
//! sinusoidal positions past it were never trained). All modes see identical contexts.
//!
//! The next tokens are drawn where the logits are: on the host by each sequence's
//! sampler (on every core), or on the GPU by the CUDA decoder with the same samplers'
//! uniform draws, so only the ids cross back (`draw`).

use anyhow::Result;
use candle_core::Tensor;
use rayon::prelude::*;

use super::sample::Sampler;
use crate::cpu::{DecodeWeights, FastDecoder, KvPrecision, WeightFormat};
use crate::model::{Gpt, TensorKvCache};
use crate::user_bail;
use std::sync::Arc;

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

enum Backend<'m> {
    Fast(Box<FastDecoder>),
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::CudaDecoder>),
    Cached(TensorKvCache, &'m Gpt),
    Uncached(&'m Gpt),
}

/// Steps a model through growing contexts, `batch` sequences at once, and returns
/// next-token logits, (batch, V) row-major.
pub struct Decoder<'m> {
    backend: Backend<'m>,
    block_size: usize,
    #[cfg(feature = "cuda")]
    vocab_size: usize,
    batch: usize,
    /// Per sequence, the tokens the next logits are conditioned on.
    windows: Vec<Vec<u32>>,
    /// The next logits (batch, V), on the host (the CUDA decoder's once asked for).
    logits: Vec<f32>,
    /// A copy of them that `draw` masks past the tokenizer's ids and each sampler
    /// penalises in place.
    scratch: Vec<f32>,
    /// The samplers' uniform draws, for the CUDA decoder to draw with.
    #[cfg(feature = "cuda")]
    uniforms: Vec<f64>,
    chosen: Vec<u32>,
}

impl<'m> Decoder<'m> {
    pub fn new(model: &'m Gpt, batch: usize, mode: DecodeMode) -> Result<Self> {
        Self::with_format(model, batch, mode, WeightFormat::F32)
    }

    /// [`Decoder::new`], the fused CPU decoder holding its weights as `format` says
    /// (int8 and int4 weights decode on the CPU only; elsewhere bf16 is the model's own
    /// products' precision, `Gpt::products`).
    pub fn with_format(
        model: &'m Gpt,
        batch: usize,
        mode: DecodeMode,
        format: WeightFormat,
    ) -> Result<Self> {
        let fast_cpu = mode == DecodeMode::Fast && model.device().is_cpu();
        if format.is_integer() && !fast_cpu {
            user_bail!(
                "--dtype {} decodes with the fused CPU decoder only; use --device cpu without --reference or --no-kv-cache, or --dtype f32 / bf16",
                format.name()
            );
        }
        let backend = match mode {
            DecodeMode::Fast if model.device().is_cpu() => {
                let weights = model.params().to_flat()?;
                let decoder = FastDecoder::with_format(model.spec(), &weights, batch, format)?;
                Backend::Fast(Box::new(decoder))
            }
            #[cfg(feature = "cuda")]
            DecodeMode::Fast if model.device().is_cuda() && gpu_passed(model)? => {
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
            // candle's Metal ops failed their first-use check: the CPU decodes.
            #[cfg(feature = "metal")]
            DecodeMode::Fast if model.device().is_metal() && !gpu_passed(model)? => {
                let weights = model.params().to_flat()?;
                let decoder = FastDecoder::with_format(model.spec(), &weights, batch, format)?;
                Backend::Fast(Box::new(decoder))
            }
            DecodeMode::Fast | DecodeMode::Cached => {
                Backend::Cached(TensorKvCache::new(model.config().n_layer), model)
            }
            DecodeMode::Uncached => Backend::Uncached(model),
        };
        Ok(Self::around(backend, model.config(), batch))
    }

    /// The fused CPU decoder over `weights` (shared with other decoders), `batch`
    /// sequences, keys and values held in `kv`.
    pub fn fused(weights: Arc<DecodeWeights>, batch: usize, kv: KvPrecision) -> Result<Self> {
        let config = weights.spec.config.clone();
        let decoder = FastDecoder::with_kv(weights, batch, kv)?;
        Ok(Self::around(
            Backend::Fast(Box::new(decoder)),
            &config,
            batch,
        ))
    }

    fn around(backend: Backend<'m>, config: &crate::config::ModelConfig, batch: usize) -> Self {
        Self {
            backend,
            block_size: config.block_size,
            #[cfg(feature = "cuda")]
            vocab_size: config.vocab_size,
            batch,
            windows: vec![Vec::new(); batch],
            logits: Vec::new(),
            scratch: Vec::new(),
            #[cfg(feature = "cuda")]
            uniforms: Vec::with_capacity(batch),
            chosen: vec![0; batch],
        }
    }

    pub fn window(&self, row: usize) -> &[u32] {
        &self.windows[row]
    }

    /// Starts every sequence from `prompt` (1 ..= block_size tokens).
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<()> {
        let block = self.block_size;
        if prompt.is_empty() || prompt.len() > block {
            user_bail!(
                "the prompt is {} tokens; it must be 1 to {block} (the model's block_size)",
                prompt.len()
            );
        }
        self.windows = vec![prompt.to_vec(); self.batch];
        self.refill()
    }

    /// Appends one token to each sequence (sliding the windows when full).
    pub fn push(&mut self, ids: &[u32]) -> Result<()> {
        assert_eq!(ids.len(), self.batch);
        let block = self.block_size;
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
            Backend::Cuda(cuda) => cuda.run_step(ids)?,
            Backend::Cached(cache, model) => {
                let ids = Tensor::from_slice(ids, (self.batch, 1), model.device())?;
                let out = model.forward(&ids, pos, Some(cache), None)?;
                self.logits = last_logits(&out.logits)?;
            }
            Backend::Uncached(_) => return self.refill(),
        }
        Ok(())
    }

    /// The next logits, (batch, V) row-major.
    pub fn logits(&mut self) -> Result<&[f32]> {
        #[cfg(feature = "cuda")]
        if let Backend::Cuda(cuda) = &mut self.backend {
            return cuda.logits();
        }
        Ok(&self.logits)
    }

    /// Each sequence's next token, drawn by its sampler from the next logits; the
    /// sequences not `active` draw nothing (their samplers untouched) and get 0. Ids
    /// from `text_vocab` on (a vocabulary padded past the tokenizer's) are never drawn.
    pub fn draw(
        &mut self,
        samplers: &mut [Sampler],
        active: &[bool],
        text_vocab: usize,
    ) -> Result<&[u32]> {
        assert!(samplers.len() == self.batch && active.len() == self.batch);
        #[cfg(feature = "cuda")]
        if let Backend::Cuda(cuda) = &mut self.backend {
            if let Some(args) = device_sampling(samplers) {
                let vocab = self.vocab_size;
                self.uniforms.clear();
                self.uniforms
                    .extend(samplers.iter_mut().zip(active).map(|(s, &a)| {
                        let u = if a { s.next_uniform(vocab) } else { None };
                        u.unwrap_or(0.0)
                    }));
                let contexts: Vec<&[u32]> = self.windows.iter().map(Vec::as_slice).collect();
                let ids = cuda.draw(args, &self.uniforms, &contexts, text_vocab)?;
                for ((c, &id), &a) in self.chosen.iter_mut().zip(ids).zip(active) {
                    *c = if a { id } else { 0 };
                }
                return Ok(&self.chosen);
            }
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        scratch.extend_from_slice(self.logits()?);
        let vocab = scratch.len() / self.batch;
        let windows = &self.windows;
        // Each sequence has its own sampler and seed, so the draws do not depend on
        // the threads.
        scratch
            .par_chunks_mut(vocab)
            .zip(samplers.par_iter_mut())
            .zip(self.chosen.par_iter_mut())
            .enumerate()
            .for_each(|(i, ((row, sampler), id))| {
                *id = 0;
                if active[i] {
                    row[text_vocab..].fill(f32::NEG_INFINITY);
                    *id = sampler.sample(row, &windows[i]);
                }
            });
        self.scratch = scratch;
        Ok(&self.chosen)
    }

    /// Runs the whole windows from position 0.
    fn refill(&mut self) -> Result<()> {
        match &mut self.backend {
            Backend::Fast(fast) => {
                let logits = fast.prefill(&self.windows)?;
                self.logits.clear();
                self.logits.extend_from_slice(logits);
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(cuda) => cuda.run_windows(&self.windows)?,
            Backend::Cached(cache, model) => {
                cache.clear();
                let ids = windows_tensor(&self.windows, model)?;
                let out = model.forward(&ids, 0, Some(cache), None)?;
                self.logits = last_logits(&out.logits)?;
            }
            Backend::Uncached(model) => {
                let ids = windows_tensor(&self.windows, model)?;
                let out = model.forward(&ids, 0, None, None)?;
                self.logits = last_logits(&out.logits)?;
            }
        }
        Ok(())
    }
}

/// Whether the GPU code passed its first-use check on the model's GPU
/// (`engine::first_use_failure`): where the fused CUDA code failed, candle's KV-cache
/// path decodes instead; where candle's Metal ops failed, the fused CPU decoder. The
/// failure is said in one line.
#[cfg(any(feature = "cuda", feature = "metal"))]
fn gpu_passed(model: &Gpt) -> Result<bool> {
    Ok(
        match crate::engine::first_use_failure(Some(model.device()))? {
            None => true,
            Some(line) => {
                crate::errln!("{line}");
                false
            }
        },
    )
}

/// How the CUDA decoder draws for these samplers: the same settings for every
/// sequence (as `generate` makes them), else none (each then draws on the host).
#[cfg(feature = "cuda")]
fn device_sampling(samplers: &[Sampler]) -> Option<crate::cuda::SamplingArgs> {
    let p = samplers.first()?.params();
    samplers.iter().all(|s| s.params() == p).then(|| {
        let temperature = (!p.is_greedy()).then_some(p.temperature);
        crate::cuda::SamplingArgs::new(temperature, p.top_k, p.top_p, p.repetition_penalty)
    })
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
