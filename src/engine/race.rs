//! `--device auto` for training and evaluation: the device whose engine runs this
//! model's step faster, measured rather than assumed (`generate::choose` does the same
//! for decoding). The CUDA engine is timed on a few steps; the CPU is timed too unless
//! its arithmetic alone, at a generous peak, already takes twice the CUDA step (a large
//! model, whose CPU step could take minutes to time).

use std::time::Instant;

use anyhow::Result;
use candle_core::Device;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{build, EngineOptions};
use crate::data::Batch;
use crate::device::{first_cuda, Choice};
use crate::model::ModelSpec;
use crate::optim::AdamWStep;

/// What the engine is raced on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Forward, backward and an AdamW update.
    Training,
    /// Forward only (scoring).
    Evaluation,
}

impl Work {
    fn name(self) -> &'static str {
        match self {
            Work::Training => "training step",
            Work::Evaluation => "forward pass",
        }
    }

    /// Matrix-product FLOPs per token per parameter: 2 forward, 6 with the backward.
    fn flops_per_parameter(self) -> f64 {
        match self {
            Work::Training => 6.0,
            Work::Evaluation => 2.0,
        }
    }
}

/// A CPU core's f32 peak, generously (two AVX-512 FMA units at 3 GHz: 192 GFLOP/s), so
/// the CPU is skipped only when even that cannot keep up.
const CORE_PEAK_FLOPS: f64 = 200e9;

/// Which of the CPU and the first CUDA device runs `work` on batches of
/// `options.batch` sequences of the model `spec` faster; a device `fits` refuses (the
/// run would not fit in its memory) is not raced.
pub fn fastest_device(
    spec: &ModelSpec,
    options: EngineOptions,
    work: Work,
    fits: impl Fn(&Device) -> bool,
) -> Result<Choice> {
    let Some(gpu) = first_cuda() else {
        // Metal has no fused engine to race: it is taken where present, as before.
        let device = crate::device::parse_device("auto")?;
        let why = match device {
            Device::Cpu => "no CUDA device",
            _ => "no CUDA device; Metal by presence",
        };
        return Ok(Choice {
            device,
            why: why.into(),
        });
    };
    let only = |device: Device, why: &str| Choice {
        device,
        why: why.to_string(),
    };
    match (fits(&gpu), fits(&Device::Cpu)) {
        (false, true) => {
            return Ok(only(
                Device::Cpu,
                "the run does not fit in the GPU's memory",
            ))
        }
        (true, false) => return Ok(only(gpu, "the run does not fit in the machine's memory")),
        (false, false) => return Ok(only(gpu, "the run fits in neither memory")),
        (true, true) => {}
    }
    let cuda_ms = match step_ms(spec, &gpu, options, work) {
        Ok(ms) => ms,
        Err(e) => {
            let why = format!("the CUDA engine failed: {e:#}");
            return Ok(Choice::new(Device::Cpu, why));
        }
    };
    let floor_ms = cpu_floor_ms(spec, options.batch, work);
    let (on_cuda, why) = decide(cuda_ms, floor_ms, work, || {
        step_ms(spec, &Device::Cpu, options, work)
    })?;
    Ok(Choice::new(if on_cuda { gpu } else { Device::Cpu }, why))
}

/// The least time the CPU can take for `work` on `batch` sequences: its matrix
/// products at every core's peak.
fn cpu_floor_ms(spec: &ModelSpec, batch: usize, work: Work) -> f64 {
    let tokens = (batch * spec.shapes.block_size) as f64;
    let flops = work.flops_per_parameter() * spec.len() as f64 * tokens;
    let cores = crate::cpu::threads::threads() as f64;
    1e3 * flops / (cores * CORE_PEAK_FLOPS)
}

/// CUDA (true) or the CPU, and why: the CPU is timed (`time_cpu`) only when its floor
/// is under twice the CUDA time.
fn decide(
    cuda_ms: f64,
    cpu_floor_ms: f64,
    work: Work,
    time_cpu: impl FnOnce() -> Result<f64>,
) -> Result<(bool, String)> {
    let what = work.name();
    if cpu_floor_ms >= 2.0 * cuda_ms {
        return Ok((
            true,
            format!(
                "a {what} took {cuda_ms:.1} ms there; the CPU would need {cpu_floor_ms:.0} ms at least"
            ),
        ));
    }
    let cpu_ms = time_cpu()?;
    let why = |faster: f64, other: &str, slower: f64| {
        format!("a {what} took {faster:.1} ms there, {slower:.1} ms on {other}")
    };
    Ok(if cuda_ms < cpu_ms {
        (true, why(cuda_ms, "the CPU", cpu_ms))
    } else {
        (false, why(cpu_ms, "CUDA", cuda_ms))
    })
}

/// Milliseconds of one `work` step of the engine `build` gives on `device` (random
/// weights and tokens): the fastest of up to three after an untimed one, within about
/// a second.
fn step_ms(spec: &ModelSpec, device: &Device, options: EngineOptions, work: Work) -> Result<f64> {
    let mut engine = build(spec, &spec.initial_values(0), device, options)?;
    let (b, t) = (options.batch, spec.shapes.block_size);
    let mut batch = Batch::empty(b, t);
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    for id in batch.x.iter_mut().chain(batch.y.iter_mut()) {
        *id = rng.random_range(0..spec.shapes.vocab_size as u32);
    }
    let train = crate::config::TrainConfig::default();
    let (started, mut best) = (Instant::now(), f64::INFINITY);
    for step in 0..4 {
        let t0 = Instant::now();
        if work == Work::Training {
            engine.zero_grads()?;
        }
        engine.forward(&batch, None)?;
        if work == Work::Training {
            engine.backward(1.0)?;
            engine.clip_grads(1.0)?;
            engine.adamw(&AdamWStep::new(&train, step + 1, 1e-6))?;
        }
        engine.take_loss()?; // waits for the device
        if step > 0 {
            best = best.min(t0.elapsed().as_secs_f64() * 1e3);
            if started.elapsed().as_secs_f64() > 1.0 {
                break;
            }
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn the_cpu_is_timed_only_when_it_might_win() {
        let never = || -> Result<f64> { panic!("timed a CPU that cannot win") };
        let (cuda, why) = decide(2.0, 500.0, Work::Training, never).unwrap();
        assert!(cuda);
        assert_eq!(
            why,
            "a training step took 2.0 ms there; the CPU would need 500 ms at least"
        );
        let (cuda, why) = decide(2.0, 1.0, Work::Evaluation, || Ok(1.5)).unwrap();
        assert!(!cuda, "the CPU measured faster");
        assert_eq!(why, "a forward pass took 1.5 ms there, 2.0 ms on CUDA");
        let (cuda, _) = decide(2.0, 1.0, Work::Training, || Ok(3.0)).unwrap();
        assert!(cuda, "CUDA measured faster");
    }

    #[test]
    fn a_step_is_timed_and_the_floor_grows_with_the_work() {
        let spec = ModelSpec::new(&ModelConfig {
            n_layer: 1,
            n_head: 2,
            n_embd: 16,
            block_size: 8,
            vocab_size: 11,
            ..ModelConfig::default()
        });
        let options = EngineOptions::f32(2, true);
        for work in [Work::Training, Work::Evaluation] {
            let ms = step_ms(&spec, &Device::Cpu, options, work).unwrap();
            assert!(ms > 0.0 && ms.is_finite(), "{work:?}: {ms}");
        }
        let floor = |batch, work| cpu_floor_ms(&spec, batch, work);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b;
        assert!(close(
            floor(4, Work::Training),
            2.0 * floor(2, Work::Training)
        ));
        assert!(close(
            floor(2, Work::Training),
            3.0 * floor(2, Work::Evaluation)
        ));
    }
}
