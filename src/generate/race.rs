//! `--device auto` for decoding: the device that decodes this model faster, measured
//! rather than assumed. A small model decodes faster on the CPU (one step is a few
//! microseconds of arithmetic) than through a chain of GPU launches; a large one the
//! other way round. Both decoders are built and timed on the same few steps.

use std::time::{Duration, Instant};

use anyhow::Result;
use candle_core::Device;

use super::sample::argmax;
use crate::config::Precision;
use crate::cpu::FastDecoder;
use crate::device::{first_cuda, Choice};
use crate::model::ModelSpec;

/// A decoder to time: prefill, then one token per sequence a step, chosen (greedily)
/// where `generate` chooses it: the time to choose counts.
trait Steps {
    fn prefill(&mut self, windows: &[Vec<u32>]) -> Result<()>;
    fn step(&mut self, ids: &[u32]) -> Result<()>;
}

impl Steps for FastDecoder {
    fn prefill(&mut self, windows: &[Vec<u32>]) -> Result<()> {
        FastDecoder::prefill(self, windows).map(|_| ())
    }
    fn step(&mut self, ids: &[u32]) -> Result<()> {
        let logits = FastDecoder::step(self, ids)?;
        for row in logits.chunks(logits.len() / ids.len()) {
            std::hint::black_box(argmax(row));
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
impl Steps for crate::cuda::CudaDecoder {
    fn prefill(&mut self, windows: &[Vec<u32>]) -> Result<()> {
        self.run_windows(windows)
    }
    fn step(&mut self, ids: &[u32]) -> Result<()> {
        self.run_step(ids)?;
        let greedy = crate::cuda::SamplingArgs::new(None, 0, 1.0, 1.0);
        let vocab = self.vocab_size();
        self.draw(greedy, &vec![0.0; ids.len()], &[], vocab)
            .map(|_| ())
    }
}

/// Tokens a second (all sequences together) over steps after two untimed ones: at
/// least 4 steps and 30 ms, at most 64 steps or 1 s, within the context.
fn tokens_per_s(decoder: &mut dyn Steps, spec: &ModelSpec, batch: usize) -> Result<f64> {
    let windows = vec![vec![0u32]; batch];
    decoder.prefill(&windows)?;
    let ids = vec![0u32; batch];
    let room = spec.shapes.block_size - 1;
    let warm = 2.min(room);
    for _ in 0..warm {
        decoder.step(&ids)?;
    }
    let (start, mut steps) = (Instant::now(), 0usize);
    while warm + steps < room && steps < 64 {
        decoder.step(&ids)?;
        steps += 1;
        let elapsed = start.elapsed();
        if (steps >= 4 && elapsed >= Duration::from_millis(30)) || elapsed >= Duration::from_secs(1)
        {
            break;
        }
    }
    Ok((steps * batch) as f64 / start.elapsed().as_secs_f64().max(1e-9))
}

/// Which of the CPU and the first CUDA device (where the build and the machine have
/// one) decodes `batch` sequences of the model `spec` with `weights` faster.
/// The CUDA decoder computes its products in `precision` (the CPU one in f32).
pub fn fastest_decoder(
    spec: &ModelSpec,
    weights: &[f32],
    batch: usize,
    precision: Precision,
) -> Result<Choice> {
    let gpu = first_cuda();
    let Some(gpu) = gpu else {
        return Ok(Choice::new(Device::Cpu, "no CUDA device"));
    };
    let cpu = tokens_per_s(&mut FastDecoder::new(spec, weights, batch)?, spec, batch)?;
    let cuda = match cuda_tokens_per_s(spec, weights, batch, &gpu, precision) {
        Ok(cuda) => cuda,
        Err(e) => {
            let why = format!("the CUDA decoder failed: {e:#}");
            return Ok(Choice::new(Device::Cpu, why));
        }
    };
    let (device, faster, slower, other) = if cpu >= cuda {
        (Device::Cpu, cpu, cuda, "cuda")
    } else {
        (gpu, cuda, cpu, "cpu")
    };
    let why = format!(
        "it decoded {faster:.0} tokens/s, {other} {slower:.0}, {batch} sequence{} at a time",
        if batch == 1 { "" } else { "s" }
    );
    Ok(Choice::new(device, why))
}

#[cfg(feature = "cuda")]
fn cuda_tokens_per_s(
    spec: &ModelSpec,
    weights: &[f32],
    batch: usize,
    gpu: &Device,
    precision: Precision,
) -> Result<f64> {
    let mut decoder = crate::cuda::CudaDecoder::new(spec, weights, gpu, batch, precision)?;
    tokens_per_s(&mut decoder, spec, batch)
}

#[cfg(not(feature = "cuda"))]
fn cuda_tokens_per_s(_: &ModelSpec, _: &[f32], _: usize, _: &Device, _: Precision) -> Result<f64> {
    unreachable!("no CUDA device without the cuda feature")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn the_cpu_decoder_is_timed_within_its_context() {
        let cfg = ModelConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 16,
            block_size: 6,
            vocab_size: 11,
            ..ModelConfig::default()
        };
        let spec = ModelSpec::new(&cfg);
        let weights = spec.initial_values(1);
        let mut decoder = FastDecoder::new(&spec, &weights, 2).unwrap();
        // 5 steps of room: 2 untimed, then 3 timed, never past the context.
        let tps = tokens_per_s(&mut decoder, &spec, 2).unwrap();
        assert!(tps > 0.0 && tps.is_finite(), "{tps}");
        assert_eq!(decoder.len(), 6);
    }
}
