//! `tinygpt bench`: how fast a config trains and decodes on this machine.
//!
//! Training: `warmup` steps, then the median of `steps` timed steps on random tokens
//! (speed does not depend on the data), split into forward (loss), backward, and
//! optimiser (clip + AdamW). Decoding: prefill a prompt of random tokens (time to
//! first token), then greedy-decode new tokens through the same path `generate` uses.
//! FLOPs count matmuls only, training = 3x forward, as is usual.
//!
//! With a profile (`--profile`), a few more steps are run with every piece of the
//! engine's work recorded (`crate::profile`): each phase's groups, their time, share,
//! achieved rates and floor on the device's peak, the gaps between them, and MFU.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::config::{Config, ModelConfig, TokenizerKind};
use crate::data::Batch;
use crate::engine;
use crate::generate::sample::{Sampler, SamplingParams};
use crate::generate::{DecodeMode, Decoder};
use crate::model::named::flat_from_named;
use crate::model::{Dropout, Gpt, ModelSpec};
use crate::optim::AdamWStep;
use crate::profile::{self, Phase, Profile, Profiled};
use crate::train::engine_options;
use crate::util::peak_rss_mb;
use crate::util::Stop;

pub struct BenchOptions {
    pub steps: usize,
    pub warmup: usize,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    /// Sequences decoded together (as `generate --num-samples`).
    pub decode_batch: usize,
    pub decode_mode: DecodeMode,
    /// How the fused CPU decoder holds its weights.
    pub decode_weights: crate::cpu::WeightFormat,
    /// Profile a few more training steps after the timed ones.
    pub profile: bool,
    /// Benchmarking gives up (`Stopped`) between steps and tokens once this asks.
    pub stop: Stop,
}

/// Steps a profile records (at most; no more than the timed steps).
const PROFILE_STEPS: usize = 5;

/// The CPU a bench ran on, given with every CPU figure: its model name and SIMD
/// features, the vector level our kernels ran at (the CPU's best, capped by
/// TINYGPT_CPU_ISA), the order decoding's mat-vecs read their weights in (by the
/// CPU's maker, or TINYGPT_MATVEC_ORDER) and whether they ask for the weights ahead in
/// software (`cpu::kernels::asks_ahead`), whether the decoder's weights lie on huge
/// pages (`cpu::lines::huge_pages_lent`), and the threads they had.
#[derive(Debug, Clone, Serialize)]
pub struct CpuInfo {
    pub cpu_model: Option<String>,
    pub cpu_features: Vec<&'static str>,
    pub cpu_isa: crate::cpu::isa::Isa,
    pub matvec_order: String,
    pub matvec_asks_ahead: bool,
    pub huge_pages: bool,
    pub threads: usize,
}

impl CpuInfo {
    fn with_threads(threads: usize) -> Self {
        Self {
            cpu_model: crate::cpu::isa::cpu_model(),
            cpu_features: crate::cpu::isa::cpu_features(),
            cpu_isa: crate::cpu::isa::active(),
            matvec_order: crate::cpu::matvec::orders_named(),
            matvec_asks_ahead: crate::cpu::kernels::asks_ahead(),
            huge_pages: crate::cpu::lines::huge_pages_lent(),
            threads,
        }
    }
}

impl std::fmt::Display for CpuInfo {
    /// "MODEL [FEATURES], kernels at ISA, mat-vecs ORDER (asking ahead | on the CPU's
    /// prefetchers), weights on huge | small pages, N threads".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} [{}], kernels at {}, mat-vecs {} ({}), weights on {} pages, {} threads",
            self.cpu_model.as_deref().unwrap_or("unknown CPU"),
            self.cpu_features.join(" "),
            self.cpu_isa.name(),
            self.matvec_order,
            if self.matvec_asks_ahead {
                "asking ahead"
            } else {
                "on the CPU's prefetchers"
            },
            if self.huge_pages { "huge" } else { "small" },
            self.threads
        )
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub model: ModelConfig,
    pub batch_size: usize,
    pub tokens_per_step: usize,
    pub parameters: usize,
    pub device: String,
    #[serde(flatten)]
    pub cpu: CpuInfo,
    pub steps: usize,
    pub train_ms_per_step: f64,
    /// The fastest and the slowest timed step: on a machine shared with others the
    /// median alone hides how far the steps spread.
    pub train_ms_range: (f64, f64),
    pub train_tokens_per_s: f64,
    pub forward_ms: f64,
    pub backward_ms: f64,
    pub optimizer_ms: f64,
    pub gflop_per_step: f64,
    pub gflops: f64,
    pub peak_rss_mb: Option<f64>,
    /// GPU memory in use after the training steps (the device's total less its free),
    /// on CUDA. The fused CUDA engine allocates everything before its first step, so
    /// for it this is its peak; candle's reference engine frees as it goes, so for it
    /// this is less than its peak. Other processes' use is included.
    pub gpu_memory_mb: Option<f64>,
    /// How the engine computes (its first line in `train`).
    pub train_engine: String,
    pub prompt_tokens: usize,
    pub ttft_ms: f64,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens: usize,
    /// Sequences decoded together; `decode_tokens_per_s` counts all of theirs.
    pub decode_batch: usize,
    pub decode_tokens_per_s: f64,
    pub decode_mode: String,
    /// The engine that trained: "fused" or "reference".
    pub train_path: String,
    /// Precision of the training step's matrix products (train.dtype).
    pub train_dtype: crate::config::Precision,
    pub peak_rss_after_decode_mb: Option<f64>,
    /// Where the training step's time goes (`--profile`; None without it, and for the
    /// reference engine, whose work is candle's and not recorded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<Profile>,
}

/// Forward FLOPs of one sequence of `t` tokens: 2 per multiply-add in every matmul,
/// attention's two (T x T) products included, the tied output layer included.
pub fn forward_flops(cfg: &ModelConfig, t: usize) -> f64 {
    let s = crate::model::spec::Shapes::new(cfg);
    let c = s.n_embd as f64;
    let weights = (s.n_layer * s.block_matrix_weights()) as f64 + s.vocab_size as f64 * c;
    let t = t as f64;
    let attention = s.n_layer as f64 * 2.0 * 2.0 * t * t * c;
    2.0 * t * weights + attention
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Refuses a config whose training step would not fit in memory, as `train` does
/// (`run` asks first; the CLI also before it prints what it benches).
pub fn check_memory(config: &Config, device: &Device) -> Result<()> {
    let mut sized = config.clone();
    sized.model.vocab_size = bench_vocab(config);
    crate::train::check_memory(&sized, device, 1)
}

/// The vocabulary size a bench uses when the config leaves it to the tokenizer: that
/// tokenizer's where it is there already (tokenizer.path, or trained on data.corpus),
/// else a guess.
pub fn bench_vocab(config: &Config) -> usize {
    if config.model.vocab_size == 0 {
        if let Some(known) = crate::corpus::cache::known_vocab(config) {
            return known;
        }
    }
    match (config.model.vocab_size, config.tokenizer.kind) {
        (0, TokenizerKind::Bpe) => config.tokenizer.vocab_size,
        (0, TokenizerKind::Char) => 65, // tinyshakespeare's characters
        (v, _) => v,
    }
}

pub fn run(config: &Config, device: &Device, opts: &BenchOptions) -> Result<BenchReport> {
    let mut cfg = config.model.clone();
    cfg.vocab_size = bench_vocab(config);
    let (train, seed) = (&config.train, config.run.seed);
    let (b, t) = (train.batch_size, cfg.block_size);
    check_memory(config, device)?;
    let spec = ModelSpec::new(&cfg);
    let mut engine = engine::build(
        &spec,
        &spec.initial_values(seed),
        device,
        engine_options(train),
    )?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut batch = Batch::empty(b, t);

    // One training step on random tokens: when each phase ended on the device (with
    // `phases`; else only the step's end waits for it, as the trainer's steps do).
    let mut step_at =
        |engine: &mut dyn engine::Engine, step: usize, phases: bool| -> Result<[Instant; 4]> {
            let sync = |done: bool| match done || phases {
                true => device.synchronize(),
                false => Ok(()),
            };
            opts.stop.check()?;
            for id in batch.x.iter_mut().chain(batch.y.iter_mut()) {
                *id = rng.random_range(0..cfg.vocab_size as u32);
            }
            let dropout = Dropout::in_pass(cfg.dropout, seed, step, 0);
            // Each phase ends when the device has finished it.
            let t0 = Instant::now();
            profile::set_phase(Phase::Forward);
            engine.zero_grads()?;
            engine.forward(&batch, dropout.as_ref())?;
            sync(false)?;
            let t1 = Instant::now();
            profile::set_phase(Phase::Backward);
            engine.backward(1.0)?;
            sync(false)?;
            let t2 = Instant::now();
            profile::set_phase(Phase::Optimizer);
            engine.clip_grads(train.grad_clip)?;
            engine.adamw(&AdamWStep::new(train, step + 1, train.lr))?;
            sync(true)?;
            let t3 = Instant::now();
            engine.take_loss()?; // read outside the timing, so the losses do not pile up
            Ok([t0, t1, t2, t3])
        };
    let (mut fwd, mut bwd, mut opt, mut total) = (vec![], vec![], vec![], vec![]);
    for step in 0..opts.warmup + opts.steps {
        let [t0, t1, t2, t3] = step_at(&mut *engine, step, true)?;
        if step >= opts.warmup {
            let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
            fwd.push(ms(t0, t1));
            bwd.push(ms(t1, t2));
            opt.push(ms(t2, t3));
            total.push(ms(t0, t3));
        }
    }
    let step_range = total
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &ms| {
            (lo.min(ms), hi.max(ms))
        });
    let step_ms = median(total);
    let gflop = 3.0 * b as f64 * forward_flops(&cfg, t) / 1e9;
    // The profile's steps come after the timed ones, so its timers cost them nothing;
    // they wait for the device only at their end, so the host stays ahead of it (the
    // gaps are then the device waiting for the host), and their own time is what the
    // groups' times are shares of.
    let profile = match opts.profile {
        true => match engine.profiled()? {
            Some(profiled) => {
                let recording = profile::Recording::start();
                let first = opts.warmup + opts.steps;
                let mut walls = Vec::new();
                for step in first..first + opts.steps.min(PROFILE_STEPS) {
                    let [t0, .., t3] = step_at(&mut *engine, step, false)?;
                    walls.push((t3 - t0).as_secs_f64() * 1e3);
                    profile::end_step()?;
                }
                let recorded = recording.finish();
                let Profiled { timing, peak } = profiled;
                let steps = (step_ms, median(walls));
                Some(Profile::new(&recorded, timing, peak, steps, gflop * 1e9))
            }
            None => None,
        },
        false => None,
    };
    let peak_train = peak_rss_mb();
    let gpu_memory_mb = crate::device::gpu_memory(device)
        .map(|(free, total)| total.saturating_sub(free) as f64 / f64::from(1 << 20));
    // Decode with the trained weights.
    let weights = flat_from_named(spec.params(), &engine.weights()?, "", "bench")?;
    // Decoding computes its products as training did (train.dtype).
    let model = Gpt::from_flat(&spec, &weights, device, DType::F32, train.dtype)?;

    // Decoding.
    let prompt_len = opts.prompt_tokens.clamp(1, t);
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|_| rng.random_range(0..cfg.vocab_size as u32))
        .collect();
    let rows = opts.decode_batch.max(1);
    let mut decoder = Decoder::with_format(&model, rows, opts.decode_mode, opts.decode_weights)?;
    // Greedy tokens, chosen as `generate --temperature 0` chooses them (on the GPU by the
    // CUDA decoder).
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let mut samplers = (0..rows)
        .map(|_| Sampler::new(greedy.clone(), 0))
        .collect::<Result<Vec<_>>>()?;
    let (vocab, active) = (cfg.vocab_size, vec![true; rows]);
    // Time to first token: the median of 5 prefills after one untimed (as for steps).
    let mut prefills = Vec::new();
    let mut next = Vec::new();
    for i in 0..6 {
        let t0 = Instant::now();
        decoder.prefill(&prompt)?;
        next = decoder.draw(&mut samplers, &active, vocab)?.to_vec();
        if i > 0 {
            prefills.push(t0.elapsed().as_secs_f64());
        }
    }
    let ttft = median(prefills);
    let t0 = Instant::now();
    for i in 0..opts.decode_tokens {
        if i % 64 == 0 {
            opts.stop.check()?;
        }
        decoder.push(&next)?;
        next.copy_from_slice(decoder.draw(&mut samplers, &active, vocab)?);
    }
    let decode_s = t0.elapsed().as_secs_f64();

    Ok(BenchReport {
        model: cfg.clone(),
        batch_size: b,
        tokens_per_step: b * t,
        parameters: engine.spec().len(),
        device: format!("{device:?}"),
        cpu: CpuInfo::with_threads(candle_core::utils::get_num_threads()),
        steps: opts.steps,
        train_ms_per_step: step_ms,
        train_ms_range: step_range,
        train_tokens_per_s: (b * t) as f64 / (step_ms / 1e3),
        forward_ms: median(fwd),
        backward_ms: median(bwd),
        optimizer_ms: median(opt),
        gflop_per_step: gflop,
        gflops: gflop / (step_ms / 1e3),
        peak_rss_mb: peak_train,
        gpu_memory_mb,
        train_engine: engine.describe(),
        prompt_tokens: prompt_len,
        ttft_ms: ttft * 1e3,
        prefill_tokens_per_s: (prompt_len * rows) as f64 / ttft,
        decode_tokens: opts.decode_tokens,
        decode_batch: rows,
        decode_tokens_per_s: (opts.decode_tokens * rows) as f64 / decode_s.max(1e-9),
        decode_mode: format!("{:?}", opts.decode_mode).to_lowercase(),
        train_path: engine.name().into(),
        train_dtype: train.dtype,
        peak_rss_after_decode_mb: peak_rss_mb(),
        profile,
    })
}

/// What `tinygpt bench --checkpoint` measures: a trained model decoded as `generate`
/// decodes it on the CPU, in one precision (one per process, so the peak RSS is the
/// precision's own).
#[derive(Debug, Clone, Serialize)]
pub struct DecodeReport {
    pub checkpoint: String,
    pub parameters: usize,
    pub dtype: &'static str,
    /// How the decoder held its keys and values.
    pub kv_dtype: &'static str,
    #[serde(flatten)]
    pub cpu: CpuInfo,
    /// Bytes of weights the decoder holds, in MiB.
    pub weights_mb: f64,
    /// Opening the checkpoint (mapping, converting) until decoding may start.
    pub load_ms: f64,
    /// Whether the load hashed the weights file (else `.verified` had it).
    pub hashed: bool,
    /// (prompt tokens, time to first token in ms: the prefill and the first draw, the
    /// median of 5 after one untimed).
    pub ttft_ms: Vec<(usize, f64)>,
    pub decode_tokens: usize,
    /// Sequences decoded together (each `decode_tokens` long), as a server's batch or
    /// `generate --num-samples` decodes them.
    pub decode_batch: usize,
    /// Greedy decoding after a 16-token prompt: tokens of all the sequences a second.
    pub decode_tokens_per_s: f64,
    /// The weights' bytes read a second while decoding (each pass reads them once, for
    /// all its sequences: `DecodeWeights::bytes_per_pass`), in GB/s.
    pub weights_gb_per_s: f64,
    /// A plain read pass on this machine (`cpu::peak::read_pass_gbs`): the roofline.
    pub read_pass_gb_per_s: f64,
    pub peak_rss_mb: Option<f64>,
}

/// Decodes the run folder `dir` with weights in `format` (keys and values in `kv`):
/// load time, time to first token at each of `prompts` (random tokens, one sequence),
/// and `decode_tokens` greedy tokens in each of `batch` sequences decoded together.
pub fn decode_checkpoint(
    dir: &std::path::Path,
    (format, kv): (crate::cpu::WeightFormat, crate::cpu::KvPrecision),
    prompts: &[usize],
    (decode_tokens, batch): (usize, usize),
    stop: &Stop,
) -> Result<DecodeReport> {
    let t0 = Instant::now();
    let mut opened = crate::mapped::open_for_decoding(dir, format, crate::mapped::Hold::Streamed)?;
    let hashed = !opened.verification.checked_before();
    opened.verification.wait()?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let weights = opened.weights;
    let spec = weights.spec.clone();
    let (block, vocab) = (spec.shapes.block_size, spec.shapes.vocab_size);
    let mut decoder = Decoder::fused(weights.clone(), 1, kv)?;
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let mut prompt = |n: usize| -> Vec<u32> {
        (0..n.clamp(1, block))
            .map(|_| rng.random_range(0..vocab as u32))
            .collect()
    };
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let mut samplers = vec![Sampler::new(greedy.clone(), 0)?];
    let active = [true];
    let mut ttft_ms = Vec::new();
    for &n in prompts {
        let ids = prompt(n);
        // Lengths past the context are cut to it: each length is timed once.
        if ttft_ms.iter().any(|&(len, _)| len == ids.len()) {
            continue;
        }
        let mut times = Vec::new();
        for i in 0..6 {
            stop.check()?;
            let t = Instant::now();
            decoder.prefill(&ids)?;
            decoder.draw(&mut samplers, &active, vocab)?;
            if i > 0 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        ttft_ms.push((ids.len(), median(times)));
    }
    // The decode: `batch` sequences from one 16-token prompt, each its own sampler (all
    // greedy, so they stay in step: every pass carries `batch` rows).
    let batch = batch.max(1);
    if batch > 1 {
        decoder = Decoder::fused(weights.clone(), batch, kv)?;
        samplers = (0..batch)
            .map(|_| Sampler::new(greedy.clone(), 0))
            .collect::<Result<_>>()?;
    }
    let active = vec![true; batch];
    decoder.prefill(&prompt(16))?;
    let mut next = decoder.draw(&mut samplers, &active, vocab)?.to_vec();
    let decode_tokens = decode_tokens.min(block.saturating_sub(17)).max(1);
    let t = Instant::now();
    for i in 0..decode_tokens {
        if i % 64 == 0 {
            stop.check()?;
        }
        decoder.push(&next)?;
        next.copy_from_slice(decoder.draw(&mut samplers, &active, vocab)?);
    }
    let decode_s = t.elapsed().as_secs_f64();
    // Before the read pass, whose buffer is not the decoder's memory.
    let peak_rss_mb = peak_rss_mb();
    let passes_per_s = decode_tokens as f64 / decode_s.max(1e-9);
    Ok(DecodeReport {
        checkpoint: dir.display().to_string(),
        parameters: spec.len(),
        dtype: format.name(),
        kv_dtype: kv.name(),
        cpu: CpuInfo::with_threads(crate::cpu::threads::threads()),
        weights_mb: weights.bytes() as f64 / f64::from(1 << 20),
        load_ms,
        hashed,
        ttft_ms,
        decode_tokens,
        decode_batch: batch,
        decode_tokens_per_s: (decode_tokens * batch) as f64 / decode_s.max(1e-9),
        weights_gb_per_s: weights.bytes_per_pass() as f64 * passes_per_s / 1e9,
        read_pass_gb_per_s: crate::cpu::peak::read_pass_gbs(),
        peak_rss_mb,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_of_the_baby_config() {
        let cfg = ModelConfig {
            vocab_size: 65,
            ..ModelConfig::default()
        };
        // 3.96 GFLOP per training step of 12 x 64 tokens (shared/research figure).
        let gflop = 3.0 * 12.0 * forward_flops(&cfg, 64) / 1e9;
        assert!((gflop - 3.964).abs() < 0.001, "{gflop}");
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
