//! The CUDA decoder against the fused CPU decoder: the same logits after a prefill and
//! after every step, and so the same greedy tokens, for each model option, with several
//! sequences at once, up to the end of the context. Runs the CUDA decoder under the CPU
//! emulator (feature `cuda-emulator`) and on a GPU (feature `cuda`, a machine with one);
//! says SKIPPED for each that is missing.

use tinygpt::config::{MlpKind, ModelConfig, NormKind, PositionKind, Precision};
use tinygpt::cpu::FastDecoder;
use tinygpt::model::ModelSpec;

mod common;
use common::model;

/// A decoder under test: prefill and step, logits (batch, V) back.
trait Decode {
    fn prefill(&mut self, windows: &[Vec<u32>]) -> Vec<f32>;
    fn step(&mut self, ids: &[u32]) -> Vec<f32>;
}

impl Decode for FastDecoder {
    fn prefill(&mut self, windows: &[Vec<u32>]) -> Vec<f32> {
        FastDecoder::prefill(self, windows).unwrap().to_vec()
    }
    fn step(&mut self, ids: &[u32]) -> Vec<f32> {
        FastDecoder::step(self, ids).unwrap().to_vec()
    }
}

#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
impl Decode for tinygpt::cuda::CudaDecoder {
    fn prefill(&mut self, windows: &[Vec<u32>]) -> Vec<f32> {
        tinygpt::cuda::CudaDecoder::prefill(self, windows)
            .unwrap()
            .to_vec()
    }
    fn step(&mut self, ids: &[u32]) -> Vec<f32> {
        tinygpt::cuda::CudaDecoder::step(self, ids)
            .unwrap()
            .to_vec()
    }
}

/// The CUDA decoders this build and machine can make for `spec`, products in
/// `precision`: (where, decoder).
fn cuda_decoders(
    spec: &ModelSpec,
    values: &[f32],
    batch: usize,
    precision: Precision,
) -> Vec<(String, Box<dyn Decode>)> {
    #[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
    return cuda_decoders_as_built(spec, values, batch, precision)
        .into_iter()
        .map(|(place, d)| (place, Box::new(d) as Box<dyn Decode>))
        .collect();
    #[cfg(not(any(feature = "cuda", feature = "cuda-emulator")))]
    {
        eprintln!("SKIPPED: the CUDA decoder (build with --features cuda-emulator or cuda)");
        let _ = (spec, values, batch, precision);
        Vec::new()
    }
}

/// The CUDA decoders themselves (not behind `Decode`).
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
#[allow(clippy::vec_init_then_push)] // which pushes there are depends on the features
fn cuda_decoders_as_built(
    spec: &ModelSpec,
    values: &[f32],
    batch: usize,
    precision: Precision,
) -> Vec<(String, tinygpt::cuda::CudaDecoder)> {
    use tinygpt::cuda::CudaDecoder;
    #[allow(unused_mut)]
    let mut out = Vec::new();
    #[cfg(feature = "cuda-emulator")]
    out.push((
        "emulated".to_string(),
        CudaDecoder::emulated(spec, values, batch, precision).unwrap(),
    ));
    #[cfg(not(feature = "cuda-emulator"))]
    eprintln!("SKIPPED: the CUDA decoder under the emulator (build with --features cuda-emulator)");
    #[cfg(feature = "cuda")]
    match candle_core::Device::new_cuda(0) {
        Ok(gpu) => out.push((
            "cuda".to_string(),
            CudaDecoder::new(spec, values, &gpu, batch, precision).unwrap(),
        )),
        Err(e) => eprintln!("SKIPPED: the CUDA decoder on a GPU (no CUDA device: {e})"),
    }
    out
}

/// Weights that give every position distinct, confident logits: the initial values
/// with the embeddings scaled up (so greedy choices are not near-ties).
fn weights(spec: &ModelSpec) -> Vec<f32> {
    let mut values = spec.initial_values(3);
    let wte = spec[spec.wte].range();
    values[wte].iter_mut().for_each(|v| *v *= 20.0);
    values
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// max |a - b| over max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Asserts the logits `got` are within `tol` of `want` (relative to the largest |want|).
fn assert_close(got: &[f32], want: &[f32], tol: f32, what: impl std::fmt::Display) {
    let err = rel_err(got, want);
    assert!(err < tol, "{what}: logits off by {err:e}");
}

type Boxed = Box<dyn Decode>;

/// Each CUDA decoder this build and machine can make for `spec`, beside a CPU decoder
/// of the same model: (where, cpu, cuda).
fn beside_the_cpu(
    spec: &ModelSpec,
    values: &[f32],
    batch: usize,
    precision: Precision,
) -> Vec<(String, Boxed, Boxed)> {
    cuda_decoders(spec, values, batch, precision)
        .into_iter()
        .map(|(place, cuda)| {
            let cpu: Boxed = Box::new(FastDecoder::new(spec, values, batch).unwrap());
            (place, cpu, cuda)
        })
        .collect()
}

#[test]
fn cuda_decoder_matches_the_cpu_decoder() {
    let variants = [
        (
            PositionKind::Learned,
            true,
            4,
            NormKind::LayerNorm,
            MlpKind::Gelu,
        ),
        (
            PositionKind::Rope,
            false,
            2,
            NormKind::RmsNorm,
            MlpKind::Swiglu,
        ),
        (
            PositionKind::Sinusoidal,
            true,
            4,
            NormKind::LayerNorm,
            MlpKind::GeluTanh,
        ),
    ];
    for (positions, bias, kv, norm, mlp) in variants {
        let cfg = ModelConfig {
            n_kv_head: Some(kv),
            positions,
            bias,
            norm,
            mlp,
            ..model(2, 4, 32, 12, 29)
        };
        let spec = ModelSpec::new(&cfg);
        let values = weights(&spec);
        let batch = 3;
        let windows: Vec<Vec<u32>> = (0..batch as u32)
            .map(|b| (0..5).map(|i| (7 * i + 3 * b + 1) % 29).collect())
            .collect();
        for (place, mut cpu, mut cuda) in beside_the_cpu(&spec, &values, batch, Precision::F32) {
            let what = format!("{place} {positions:?} kv={kv} {norm:?} {mlp:?}");
            let (want, got) = (cpu.prefill(&windows), cuda.prefill(&windows));
            assert_close(&got, &want, 1e-4, format!("{what}: prefill"));
            let mut logits = want;
            // Greedy to the end of the context: positions 5 .. 11.
            for step in 0..cfg.block_size - windows[0].len() {
                let ids: Vec<u32> = logits.chunks(cfg.vocab_size).map(argmax).collect();
                let (want, got) = (cpu.step(&ids), cuda.step(&ids));
                assert_close(&got, &want, 1e-4, format!("{what}: step {step}"));
                // The same greedy token, or (where the GPU's sums, in another order,
                // tip a near tie) one whose CPU logit is within the logits' own bound
                // of the CPU's choice: reported, not demanded identical.
                for (b, (g, w)) in got
                    .chunks(cfg.vocab_size)
                    .zip(want.chunks(cfg.vocab_size))
                    .enumerate()
                {
                    let (tg, tw) = (argmax(g) as usize, argmax(w) as usize);
                    if tg != tw {
                        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
                        let margin = (w[tw] - w[tg]) / scale;
                        eprintln!(
                            "{what}: step {step} row {b}: greedy {tg} vs {tw}, margin {margin:e}"
                        );
                        assert!(
                            margin < 1e-4,
                            "{what}: step {step} row {b}: greedy token {tg}, the CPU's {tw} is {margin:e} above it"
                        );
                    }
                }
                logits = want;
            }
        }
    }
}

/// Caches longer than one chunk of attention (64 positions): each row's chunks are
/// combined into the softmax over all its positions: the CPU decoder's logits after a
/// prefill across chunk boundaries and every step to the end of a 150-position context
/// (three chunks, the last partly full), grouped K/V heads.
#[test]
fn attention_over_long_caches_combines_its_chunks() {
    let cfg = ModelConfig {
        n_kv_head: Some(2),
        positions: PositionKind::Rope,
        ..model(1, 4, 16, 150, 17)
    };
    let spec = ModelSpec::new(&cfg);
    let values = weights(&spec);
    let batch = 2;
    let windows: Vec<Vec<u32>> = (0..batch as u32)
        .map(|b| (0..100).map(|i| (i * 5 + b * 3) % 17).collect())
        .collect();
    for (place, mut cpu, mut cuda) in beside_the_cpu(&spec, &values, batch, Precision::F32) {
        let (want, got) = (cpu.prefill(&windows), cuda.prefill(&windows));
        assert_close(&got, &want, 1e-4, format!("{place}: prefill of 100"));
        for step in 100..150u32 {
            let ids = [step % 17, (step * 7) % 17];
            let (want, got) = (cpu.step(&ids), cuda.step(&ids));
            assert_close(&got, &want, 1e-4, format!("{place}: position {step}"));
        }
    }
}

/// A step replayed from its recording (a CUDA graph on a GPU) computes exactly what
/// launching its kernels one by one does, at every position: the recording reads the
/// position from device memory, not from its fixed arguments.
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
#[test]
fn replayed_steps_are_launched_steps() {
    let cfg = model(2, 2, 16, 10, 13);
    let spec = ModelSpec::new(&cfg);
    let values = weights(&spec);
    let windows = vec![vec![1u32, 2], vec![7, 3]];
    let built = cuda_decoders_as_built(&spec, &values, 2, Precision::F32);
    let again = cuda_decoders_as_built(&spec, &values, 2, Precision::F32);
    for ((place, mut replayed), (_, mut launched)) in built.into_iter().zip(again) {
        launched.set_replays(false);
        let (a, b) = (
            replayed.prefill(&windows).unwrap().to_vec(),
            launched.prefill(&windows).unwrap().to_vec(),
        );
        assert_eq!(a, b, "{place}: prefill");
        for step in 0..8u32 {
            let ids = [step % 13, (step * 5 + 1) % 13];
            let a = replayed.step(&ids).unwrap().to_vec();
            let b = launched.step(&ids).unwrap().to_vec();
            assert_eq!(a, b, "{place}: step {step}");
        }
        // Else this compared launches with launches: recording or a replay failed and
        // the decoder fell back (it says so on stderr).
        assert!(
            replayed.is_replaying(),
            "{place}: the steps replayed their recording"
        );
        assert!(!launched.is_replaying());
    }
}

/// Decoding sequences together gives each the logits it gets alone.
#[test]
fn batched_decoding_is_each_sequence_alone() {
    let cfg = ModelConfig {
        positions: PositionKind::Rope,
        ..model(2, 2, 16, 9, 13)
    };
    let spec = ModelSpec::new(&cfg);
    let values = weights(&spec);
    let windows: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![4, 0, 7], vec![12, 12, 5]];
    let steps: Vec<Vec<u32>> = vec![vec![3, 9, 1], vec![0, 2, 11], vec![6, 6, 6]];
    let mut together = cuda_decoders(&spec, &values, 3, Precision::F32);
    for (place, batched) in together.iter_mut() {
        let mut logits = vec![batched.prefill(&windows)];
        logits.extend(steps.iter().map(|ids| batched.step(ids)));
        for (b, window) in windows.iter().enumerate() {
            let (_, alone) = &mut cuda_decoders(&spec, &values, 1, Precision::F32)
                .into_iter()
                .find(|(p, _)| p == place)
                .expect("the same place again");
            let mut mine = vec![alone.prefill(std::slice::from_ref(window))];
            mine.extend(steps.iter().map(|ids| alone.step(&[ids[b]])));
            let v = cfg.vocab_size;
            for (step, (all, one)) in logits.iter().zip(&mine).enumerate() {
                // On a GPU, cuBLAS may pick another algorithm for 1 row than for 3.
                let tol = if place == "emulated" { 1e-5 } else { 1e-4 };
                let err = rel_err(one, &all[b * v..(b + 1) * v]);
                assert!(err < tol, "{place}: sequence {b} step {step}: off by {err}");
            }
        }
    }
}

/// A prefill longer than one call's rows runs in chunks of positions (350 sequences
/// of 12: chunks of 11 and 1), and prefilling again starts over (a window slide).
#[test]
fn long_prefills_run_in_chunks_and_prefill_starts_over() {
    let cfg = model(1, 2, 8, 12, 13);
    let spec = ModelSpec::new(&cfg);
    let values = weights(&spec);
    let batch = 350;
    let windows: Vec<Vec<u32>> = (0..batch as u32)
        .map(|b| (0..12).map(|i| (b * 7 + i * 3) % 13).collect())
        .collect();
    let short: Vec<Vec<u32>> = windows.iter().map(|w| w[..4].to_vec()).collect();
    for (place, mut cpu, mut cuda) in beside_the_cpu(&spec, &values, batch, Precision::F32) {
        let (want, got) = (cpu.prefill(&windows), cuda.prefill(&windows));
        assert_close(&got, &want, 1e-4, format!("{place}: a chunked prefill"));
        let (want, got) = (cpu.prefill(&short), cuda.prefill(&short));
        assert_close(&got, &want, 1e-4, format!("{place}: prefill again"));
        let ids = vec![5; batch];
        let (want, got) = (cpu.step(&ids), cuda.step(&ids));
        assert_close(&got, &want, 1e-4, format!("{place}: a step after it"));
    }
}

/// `generate --dtype bf16`: the CUDA decoder's products take bf16 operands (f32 sums).
/// Its logits stay within bf16 rounding of the f32 CPU decoder's, after the prefill and
/// every step fed the same tokens, and differ from them (so they really are rounded);
/// greedy tokens may part where two logits are within that rounding.
#[test]
fn bf16_decoding_stays_within_bf16_rounding() {
    let cfg = ModelConfig {
        positions: PositionKind::Rope,
        ..model(2, 4, 32, 12, 29)
    };
    let spec = ModelSpec::new(&cfg);
    let values = weights(&spec);
    let batch = 2;
    let windows: Vec<Vec<u32>> = (0..batch as u32)
        .map(|b| (0..5).map(|i| (5 * i + 2 * b + 1) % 29).collect())
        .collect();
    for (place, mut cpu, mut bf16) in beside_the_cpu(&spec, &values, batch, Precision::Bf16) {
        let (mut want, mut got) = (cpu.prefill(&windows), bf16.prefill(&windows));
        for step in 0..6 {
            let err = rel_err(&got, &want);
            assert!(err <= 2e-2, "{place} step {step}: off by {err:e}");
            assert!(err > 0.0, "{place} step {step}: the f32 logits exactly");
            let ids: Vec<u32> = want.chunks(cfg.vocab_size).map(argmax).collect();
            (want, got) = (cpu.step(&ids), bf16.step(&ids));
        }
    }
}

/// `generate` on a GPU draws each token where the logits are, with the uniform draws of
/// each sequence's own sampler: the tokens the host's samplers draw from the same
/// decoder's logits, step for step to the end of the context, for each setting (the
/// repetition penalty reading each sequence's window; the vocabulary's padding never
/// drawn).
#[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
#[test]
fn drawing_on_the_device_follows_the_host_samplers() {
    use tinygpt::cuda::SamplingArgs;
    use tinygpt::generate::sample::{Sampler, SamplingParams};
    let cfg = model(2, 2, 16, 16, 29);
    let (spec, batch, text_vocab) = (ModelSpec::new(&cfg), 3, 27);
    // Initial weights (no scaling): logits close together, so draws really vary.
    let values = spec.initial_values(5);
    let settings = [
        (0.0, 0, 1.0, 1.0),
        (1.0, 0, 1.0, 1.0),
        (0.8, 5, 1.0, 1.3),
        (1.2, 0, 0.9, 1.0),
        (1.0, 10, 0.7, 2.0),
    ];
    for (temperature, top_k, top_p, repetition_penalty) in settings {
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            repetition_penalty,
        };
        let args = SamplingArgs::new(
            (temperature > 0.0).then_some(temperature),
            top_k,
            top_p,
            repetition_penalty,
        );
        let samplers = || -> Vec<Sampler> {
            (0..batch as u64)
                .map(|b| Sampler::new(params.clone(), 40 + b).unwrap())
                .collect()
        };
        for (place, mut cuda) in cuda_decoders_as_built(&spec, &values, batch, Precision::F32) {
            let what = format!("{place} {params:?}");
            let (mut host, mut device) = (samplers(), samplers());
            let mut windows: Vec<Vec<u32>> = vec![vec![3, 1, 4], vec![1, 5, 9], vec![2, 6, 5]];
            cuda.run_windows(&windows).unwrap();
            let mut drawn = std::collections::BTreeSet::new();
            for step in 0..cfg.block_size - 3 {
                let logits = cuda.logits().unwrap().to_vec();
                let want: Vec<u32> = (0..batch)
                    .map(|b| {
                        let mut row = logits[b * 29..(b + 1) * 29].to_vec();
                        row[text_vocab..].fill(f32::NEG_INFINITY);
                        host[b].sample(&mut row, &windows[b])
                    })
                    .collect();
                let uniforms: Vec<f64> = device
                    .iter_mut()
                    .map(|s| s.next_uniform(29).unwrap_or(0.0))
                    .collect();
                let contexts: Vec<&[u32]> = windows.iter().map(Vec::as_slice).collect();
                let got = cuda
                    .draw(args, &uniforms, &contexts, text_vocab)
                    .unwrap()
                    .to_vec();
                // The same tokens, or (where the GPU's sums, in another order, move a
                // draw across a boundary) the token the host picks for a draw within
                // 1e-5 of this one: reported with the margin, not demanded identical.
                for b in 0..batch {
                    if got[b] == want[b] {
                        continue;
                    }
                    let u = uniforms[b];
                    let row = &logits[b * 29..(b + 1) * 29];
                    let scale = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                    // Greedy: a near tie; sampling: a draw within 1e-5.
                    let tie = (row[want[b] as usize] - row[got[b] as usize]) <= 1e-4 * scale;
                    let near = params.is_greedy() && tie
                        || !params.is_greedy()
                            && [u - 1e-5, u + 1e-5].into_iter().any(|v| {
                                let mut row = logits[b * 29..(b + 1) * 29].to_vec();
                                row[text_vocab..].fill(f32::NEG_INFINITY);
                                let mut probe = Sampler::new(params.clone(), 0).unwrap();
                                probe.sample_with(
                                    &mut row,
                                    &windows[b],
                                    Some(v.clamp(0.0, 1.0 - 1e-12)),
                                ) == got[b]
                            });
                    eprintln!(
                        "{what}: step {step} row {b}: drew {} where the host drew {} (u = {u})",
                        got[b], want[b]
                    );
                    assert!(
                        near,
                        "{what}: step {step} row {b}: {} is neither a near tie nor a draw within 1e-5 of u = {u}",
                        got[b]
                    );
                }
                drawn.extend(got.iter().copied());
                for (w, &id) in windows.iter_mut().zip(&got) {
                    w.push(id);
                }
                if step + 4 < cfg.block_size {
                    cuda.run_step(&got).unwrap();
                }
            }
            if temperature > 0.0 {
                assert!(drawn.len() > 3, "{what}: the draws hardly vary: {drawn:?}");
            }
        }
    }
}

/// A server's pass on the CUDA decoder: rows of several sequences at their own
/// positions (a generating row, prompt pieces, a sequence starting, out of slot
/// order, a prompt scored at every row) give the CPU decoder's logits for the same
/// passes, for learned and RoPE positions and grouped K/V heads.
#[test]
fn rows_at_their_own_positions_match_the_cpu_decoder() {
    use tinygpt::cpu::Place;
    for positions in [PositionKind::Learned, PositionKind::Rope] {
        let cfg = ModelConfig {
            n_kv_head: Some(2),
            positions,
            ..model(2, 4, 16, 9, 13)
        };
        let spec = ModelSpec::new(&cfg);
        let values = weights(&spec);
        let place = |seq, pos| Place { seq, pos };
        let passes: Vec<(Vec<u32>, Vec<Place>, Vec<usize>)> = vec![
            (
                vec![3, 1, 4, 1, 2],
                (0..4).map(|p| place(0, p)).chain([place(1, 0)]).collect(),
                vec![3, 4],
            ),
            (
                vec![6, 6, 5, 7, 1, 8],
                vec![
                    place(2, 0),
                    place(2, 1),
                    place(0, 4),
                    place(1, 1),
                    place(1, 2),
                    place(1, 3),
                ],
                vec![1, 2, 5],
            ),
            (vec![9, 2], vec![place(1, 4), place(2, 2)], vec![]),
            (vec![9], vec![place(0, 5)], vec![0]),
            // A prompt scored at every row: more rows of logits than sequences.
            (
                vec![5, 3, 2, 7, 1],
                (3..8).map(|p| place(2, p)).collect(),
                vec![0, 1, 2, 3, 4],
            ),
        ];
        let mut cpu = FastDecoder::new(&spec, &values, 3).unwrap();
        #[cfg(any(feature = "cuda", feature = "cuda-emulator"))]
        for (where_, mut gpu) in cuda_decoders_as_built(&spec, &values, 3, Precision::F32) {
            for (i, (ids, places, outputs)) in passes.iter().enumerate() {
                let want = cpu.run_rows(ids, places, outputs).unwrap().to_vec();
                let got = gpu.run_rows(ids, places, outputs).unwrap().to_vec();
                assert_eq!(got.len(), want.len(), "{where_}: pass {i}");
                if !want.is_empty() {
                    let err = rel_err(&got, &want);
                    assert!(err < 1e-4, "{where_} {positions:?}: pass {i} off by {err}");
                }
            }
            assert!(gpu.run_rows(&[1], &[place(3, 0)], &[0]).is_err());
            assert!(gpu.run_rows(&[1], &[place(0, 9)], &[0]).is_err());
            cpu = FastDecoder::new(&spec, &values, 3).unwrap();
        }
        let _ = (&mut cpu, &passes);
    }
}
