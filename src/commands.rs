//! The subcommands behind the CLI: load, call the library, print (human or JSON).

use std::io::{IsTerminal, Read, Write};

use anyhow::{Context, Result};
use candle_core::Device;
use serde_json::json;
use tinygpt::checkpoint::Loaded;
use tinygpt::config::{PositionKind, Precision};
use tinygpt::cpu::{KvPrecision, WeightFormat};
use tinygpt::device::{first_cuda, Choice};
use tinygpt::device::{is_auto, parse_device};
use tinygpt::engine::race::{fastest_device, Work};
use tinygpt::error::user_error;
use tinygpt::generate::race::fastest_decoder;
use tinygpt::generate::sample::{Sampler, SamplingParams};
use tinygpt::generate::{generate as sample_text, unescape, DecodeMode, GenerateOptions, Model};
use tinygpt::mapped::{open_for_decoding, ForDecoding, Hold};
use tinygpt::user_bail;
use tinygpt::util::{check_output_file, plural};

use crate::{
    AttentionArgs, BenchArgs, CacheAction, CacheArgs, CheckpointArgs, CompareArgs, DoctorArgs,
    EvalArgs, ExportArgs, GenerateArgs, ImportArgs, InfoArgs, PlotArgs, ServeArgs, SweepArgs,
};

/// `println!` that hands back a failed write (a full disk behind `> file`: one line
/// naming it, exit 2) instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout(), $($arg)*).context(STDOUT)
    }};
}

/// What a failed write to standard output is told as (`error::out_of_storage` reads it).
const STDOUT: &str = tinygpt::error::WRITING_STDOUT;

fn load(args: &CheckpointArgs) -> Result<Loaded> {
    Loaded::load(&args.checkpoint, &parse_device(&args.device)?)
}

/// `--device auto` for decoding: the checkpoint loads on the CPU, both decoders are
/// timed on it, and it moves to CUDA only if CUDA decodes faster. Says which and why.
fn load_for_decoding(dir: &std::path::Path, batch: usize, products: Precision) -> Result<Loaded> {
    let on_cpu = Loaded::load_with(dir, &Device::Cpu, products)?;
    let weights = on_cpu.model.params().to_flat()?;
    let choice = fastest_decoder(on_cpu.model.spec(), &weights, batch, products)?;
    tinygpt::errln!("device auto: {choice}");
    if choice.device.is_cpu() {
        return Ok(on_cpu);
    }
    Loaded::load_with(dir, &choice.device, products)
}

/// A checkpoint opened for `generate`: as a candle model, or mapped for the fused CPU
/// decoder.
enum Opened {
    Candle(Box<Loaded>),
    Mapped(Box<ForDecoding>),
}

/// What `generate` reads of an opened checkpoint.
struct Parts<'a> {
    config: &'a tinygpt::config::Config,
    tokenizer: &'a tinygpt::tokenizer::Tokenizer,
    model: Model<'a>,
}

impl Opened {
    fn parts(&self) -> Parts<'_> {
        match self {
            Opened::Candle(l) => Parts {
                config: &l.config,
                tokenizer: &l.tokenizer,
                model: Model::Candle(&l.model),
            },
            Opened::Mapped(m) => Parts {
                config: &m.config,
                tokenizer: &m.tokenizer,
                model: Model::Cpu(&m.weights),
            },
        }
    }
}

/// The text file a flag names, read whole as UTF-8 (`-`: standard input).
fn read_text_arg(flag: &str, path: &std::path::Path) -> Result<String> {
    let bytes = if path.as_os_str() == "-" {
        let mut bytes = Vec::new();
        std::io::stdin()
            .lock()
            .read_to_end(&mut bytes)
            .map_err(|e| user_error(format!("cannot read {flag} - (standard input): {e}")))?;
        bytes
    } else {
        std::fs::read(path)
            .map_err(|e| user_error(format!("cannot read {flag} {}: {e}", path.display())))?
    };
    let mut text = String::from_utf8(bytes).map_err(|e| {
        let bad = e.utf8_error().valid_up_to();
        let bytes = e.as_bytes();
        user_error(format!(
            "{flag} {} {}",
            path.display(),
            tinygpt::corpus::text::not_text(path, bytes, (bad as u64, bytes[bad]), flag)
        ))
    })?;
    // A byte-order mark (Windows editors write one) is not text: training drops it too.
    if text.starts_with('\u{feff}') {
        text.drain(..'\u{feff}'.len_utf8());
    }
    Ok(text)
}

fn read_prompt(args: &GenerateArgs) -> Result<String> {
    if let Some(p) = &args.prompt {
        return Ok(unescape(p));
    }
    if let Some(path) = &args.prompt_file {
        return read_text_arg("--prompt-file", path);
    }
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Ok(String::new());
    }
    let mut text = String::new();
    stdin
        .lock()
        .read_to_string(&mut text)
        .map_err(|e| user_error(format!("cannot read the prompt from stdin: {e}")))?;
    // `echo "To be" | tinygpt generate`: the newline is echo's, not the prompt's (as a
    // shell's $(...) drops it).
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}

/// Text for a terminal: the control characters a model may write (an undertrained one
/// does: escape sequences would drive the terminal) shown as `\x1b`-style escapes;
/// newlines, tabs and carriage returns kept. (Bytes that are not UTF-8 reach here as
/// U+FFFD, as every decoder shows them.)
fn for_terminal(text: &str) -> std::borrow::Cow<'_, str> {
    let hidden = |c: char| c.is_control() && !matches!(c, '\n' | '\t' | '\r');
    if !text.chars().any(hidden) {
        return text.into();
    }
    text.chars()
        .map(|c| match hidden(c) {
            true if (c as u32) < 0x100 => format!("\\x{:02x}", c as u32),
            true => format!("\\u{{{:x}}}", c as u32),
            false => c.to_string(),
        })
        .collect::<String>()
        .into()
}

pub fn generate(args: GenerateArgs, stop: tinygpt::util::Stop) -> Result<()> {
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        repetition_penalty: args.repetition_penalty,
    };
    params.validate()?;
    if args.stop.iter().any(String::is_empty) {
        user_bail!(
            "--stop \"\": an empty stop text stops nothing; give the text to stop at (\\n for a newline), or leave --stop out"
        );
    }
    if !(1..=1024).contains(&args.num_samples) {
        user_bail!("--num-samples {} must be 1 to 1024", args.num_samples);
    }
    let prompt_text = read_prompt(&args)?;
    let mode = if args.no_kv_cache {
        DecodeMode::Uncached
    } else if args.reference {
        DecodeMode::Cached
    } else {
        DecodeMode::Fast
    };
    let weights = parse_weight_format("--dtype", &args.dtype)?;
    let kv = KvPrecision::parse(args.kv_dtype.as_deref(), weights)?;
    let products = match weights {
        WeightFormat::Bf16 => Precision::Bf16,
        WeightFormat::F32 | WeightFormat::Int8 | WeightFormat::Int4 => Precision::F32,
    };
    let auto = is_auto(&args.ckpt.device);
    // The fused CPU decoder opens the checkpoint mapped, without a candle model: when
    // the CPU is asked for, when `auto` has no GPU to weigh it against, and for int8 and
    // int4 (CPU only).
    let on_cpu = mode == DecodeMode::Fast
        && match auto {
            true => weights.is_integer() || first_cuda().is_none(),
            false => parse_device(&args.ckpt.device)?.is_cpu(),
        };
    // Told before the prompt is echoed: the decoder would refuse it only after.
    if weights.is_integer() && !on_cpu {
        user_bail!(
            "--dtype {} decodes with the fused CPU decoder only; use --device cpu without --reference or --no-kv-cache, or --dtype f32 / bf16",
            weights.name()
        );
    }
    if args.kv_dtype.is_some() && !on_cpu {
        user_bail!(
            "--kv-dtype sets the fused CPU decoder's keys and values; this generate decodes with candle or on a GPU, which keep their own: drop it, or pass --device cpu without --reference or --no-kv-cache"
        );
    }
    let mut opened = if on_cpu {
        if auto {
            let why = match first_cuda() {
                None => "no CUDA device",
                Some(_) => "integer weights decode on the CPU",
            };
            tinygpt::errln!("device auto: {}", Choice::new(Device::Cpu, why));
        }
        Opened::Mapped(Box::new(open_for_decoding(
            &args.ckpt.checkpoint,
            weights,
            Hold::Streamed,
        )?))
    } else if auto && mode == DecodeMode::Fast && !weights.is_integer() {
        Opened::Candle(Box::new(load_for_decoding(
            &args.ckpt.checkpoint,
            args.num_samples,
            products,
        )?))
    } else {
        let device = match auto {
            true => Device::Cpu,
            false => parse_device(&args.ckpt.device)?,
        };
        Opened::Candle(Box::new(Loaded::load_with(
            &args.ckpt.checkpoint,
            &device,
            products,
        )?))
    };
    // Decoding starts once the weights' hash check (run beside the loading) passed.
    if let Opened::Mapped(m) = &mut opened {
        m.verification.wait()?;
    }
    let loaded = opened.parts();
    let tk = &loaded.tokenizer;
    let (prompt, show_prompt) = if prompt_text.is_empty() {
        let start = tk.empty_prompt().ok_or_else(|| {
            user_error("the prompt is empty and this char vocabulary has no newline to start from; give --prompt")
        })?;
        (start, false)
    } else {
        (tk.encode(&prompt_text)?, true)
    };
    // Checked before anything is printed: a refused prompt is not echoed.
    let block = loaded.config.model.block_size;
    let prompt = match (prompt.len() > block, args.crop) {
        (false, _) => prompt,
        (true, true) => {
            tinygpt::errln!(
                "note: the prompt is {} tokens; the model reads its last {block} (its context)",
                prompt.len()
            );
            prompt[prompt.len() - block..].to_vec()
        }
        (true, false) => user_bail!(
            "the prompt is {} tokens, more than the model's context of {block}; pass --crop to keep its last {block} tokens",
            prompt.len()
        ),
    };
    let seed = args.seed.unwrap_or_else(rand::random);
    // Sample i has its own stream: the same text whatever --num-samples is.
    let mut samplers = (0..args.num_samples as u64)
        .map(|i| Sampler::new(params.clone(), seed.wrapping_add(i)))
        .collect::<Result<Vec<_>>>()?;
    let options = GenerateOptions {
        weights,
        kv,
        max_new_tokens: args.max_new_tokens,
        stop: args.stop.iter().map(|s| unescape(s)).collect(),
        mode,
        cancel: stop,
    };
    let stream = args.num_samples == 1 && !args.json;
    let stdout = std::io::stdout();
    let terminal = stdout.is_terminal();
    let shown = |text: &str| -> String {
        match terminal {
            true => for_terminal(text).into_owned(),
            false => text.to_string(),
        }
    };
    if stream && show_prompt {
        let mut out = stdout.lock();
        write!(out, "{prompt_text}").context(STDOUT)?;
        out.flush().context(STDOUT)?;
    }
    let mut print = |_: usize, piece: &str| -> Result<()> {
        if stream {
            let mut out = stdout.lock();
            out.write_all(shown(piece).as_bytes()).context(STDOUT)?;
            out.flush().context(STDOUT)?;
        }
        Ok(())
    };
    let samples = sample_text(
        loaded.model,
        tk,
        &prompt,
        &mut samplers,
        &options,
        &mut print,
    )?;
    let mut out = stdout.lock();
    for (i, sample) in samples.iter().enumerate() {
        let st = &sample.stats;
        if args.json {
            let record = json!({
                "sample": i + 1, "seed": seed.wrapping_add(i as u64), "prompt": prompt_text,
                "text": sample.text, "token_ids": sample.token_ids, "stats": st,
            });
            writeln!(out, "{record}")?;
            continue;
        }
        if !stream {
            if i > 0 {
                writeln!(out, "---------------")?;
            }
            write!(
                out,
                "{}{}",
                if show_prompt { &prompt_text } else { "" },
                shown(&sample.text)
            )
            .context(STDOUT)?;
        }
        // A terminal's line ends where the sample does (the figures go on the next);
        // piped, one sample is its text alone, byte for byte as the server sends it.
        if terminal || !stream {
            writeln!(out).context(STDOUT)?;
        }
        out.flush().context(STDOUT)?;
        tinygpt::errln!(
            "[sample {}/{}] prompt {}, generated {} ({}), prefill {:.1} ms, decode {:.1} tokens/s, {}",
            i + 1,
            args.num_samples,
            count(st.prompt_tokens, "token"),
            count(st.generated_tokens, "token"),
            st.stopped_by,
            st.prefill_ms,
            st.decode_tokens_per_s,
            // Greedy decoding draws nothing: a seed would suggest another could change it.
            match args.temperature == 0.0 {
                true => "greedy (no seed needed)".to_string(),
                false => format!("seed {}", seed.wrapping_add(i as u64)),
            }
        );
    }
    // Interrupted: the samples so far are shown, and the stop is still the exit's.
    options.cancel.check()?;
    Ok(())
}

/// What `eval --text` scores: its token ids and the bytes of text they predict. A
/// .jsonl or .parquet file, or a folder, is read as training reads it
/// (`eval::documents`); anything else as one UTF-8 text, as training reads a text file
/// (a leading byte-order mark dropped, a compressed file named as such).
fn eval_input(
    path: &std::path::Path,
    (tokenizer, text_field): (&tinygpt::tokenizer::Tokenizer, &str),
    stop: &tinygpt::util::Stop,
) -> Result<(Vec<u32>, usize)> {
    let (ids, bytes) = match tinygpt::eval::documents(path, tokenizer, text_field, stop)? {
        Some(documents) => documents,
        None => {
            let text = read_text_arg("--text", path)?;
            let ids = tokenizer.encode(&text)?;
            let bytes = tinygpt::eval::predicted_bytes(tokenizer, &ids, text.len())?;
            (ids, bytes)
        }
    };
    if ids.len() < 2 {
        user_bail!(
            "--text {} is {} token{}; evaluation needs at least 2 (one to predict from, one to predict)",
            path.display(),
            ids.len(),
            if ids.len() == 1 { "" } else { "s" }
        );
    }
    Ok((ids, bytes))
}

pub fn eval(args: EvalArgs, stop: tinygpt::util::Stop) -> Result<()> {
    let format = parse_weight_format("--dtype", &args.dtype)?;
    if format != WeightFormat::F32 || args.kv_dtype.is_some() {
        let kv = KvPrecision::parse(args.kv_dtype.as_deref(), format)?;
        return eval_decoding(&args, (format, kv), &stop);
    }
    let auto = is_auto(&args.ckpt.device);
    let mut loaded = Loaded::load(
        &args.ckpt.checkpoint,
        &if auto {
            Device::Cpu
        } else {
            parse_device(&args.ckpt.device)?
        },
    )?;
    let parts = (&loaded.tokenizer, loaded.config.data.text_field.as_str());
    let (ids, bytes) = eval_input(&args.text, parts, &stop)?;
    let window = tinygpt::eval::window(args.context, loaded.config.model.block_size, ids.len())?;
    if auto {
        // Raced on the CPU copy, at the window's length; moved only if CUDA scores faster.
        let spec = tinygpt::model::ModelSpec::new(&tinygpt::config::ModelConfig {
            block_size: window,
            ..loaded.config.model.clone()
        });
        let options = tinygpt::eval::engine_options(ids.len(), window);
        let choice = fastest_device(&spec, options, Work::Evaluation, |_| true)?;
        tinygpt::errln!("device auto: {choice}");
        if !choice.device.is_cpu() {
            loaded = Loaded::load(&args.ckpt.checkpoint, &choice.device)?;
        }
    }
    let bar = tinygpt::util::bars::count_bar(0, "scoring windows");
    let r = tinygpt::eval::evaluate_until(&loaded.model, &ids, bytes, window, &bar, &stop)?;
    bar.finish_and_clear();
    print_eval(&args, &r)
}

/// `eval --dtype bf16|int8|int4` or `--kv-dtype`: the checkpoint mapped for the CPU
/// decoder in `format`, its keys and values in `kv`.
fn eval_decoding(
    args: &EvalArgs,
    (format, kv): (WeightFormat, KvPrecision),
    stop: &tinygpt::util::Stop,
) -> Result<()> {
    if !is_auto(&args.ckpt.device) && !parse_device(&args.ckpt.device)?.is_cpu() {
        user_bail!(
            "--dtype {} and --kv-dtype score with the CPU decoder; use --device cpu (or auto), or --dtype f32 without --kv-dtype",
            format.name()
        );
    }
    let mut opened = open_for_decoding(&args.ckpt.checkpoint, format, Hold::Streamed)?;
    opened.verification.wait()?;
    let parts = (&opened.tokenizer, opened.config.data.text_field.as_str());
    let (ids, bytes) = eval_input(&args.text, parts, stop)?;
    let block_size = opened.weights.spec.shapes.block_size;
    let window = tinygpt::eval::window(args.context, block_size, ids.len())?;
    let bar = tinygpt::util::bars::count_bar(0, "scoring windows");
    let r =
        tinygpt::eval::evaluate_decoding(&opened.weights, &ids, bytes, (window, kv), &bar, stop)?;
    bar.finish_and_clear();
    print_eval(args, &r)
}

fn print_eval(args: &EvalArgs, r: &tinygpt::eval::EvalResult) -> Result<()> {
    if args.json {
        outln!("{}", serde_json::to_string(&r)?)?;
    } else {
        outln!(
            "{}: {} tokens, loss {:.4} nats/token, perplexity {:.3}, {:.4} bits/byte",
            args.text.display(),
            r.tokens,
            r.loss,
            r.perplexity,
            r.bits_per_byte
        )?;
    }
    Ok(())
}

pub fn info(args: InfoArgs) -> Result<()> {
    parse_device(&args.ckpt.device)?;
    // Every file is checked (sizes, hashes, tensor names and shapes), but nothing is
    // computed with the weights: they are mapped, not copied or built into a model.
    let mut loaded = open_for_decoding(&args.ckpt.checkpoint, WeightFormat::F32, Hold::InPlace)?;
    loaded.verification.wait()?;
    let spec = &loaded.weights.spec;
    let (total, embeddings) = (spec.len(), spec.embedding_len());
    let st = &loaded.state;
    let cfg = &loaded.config;
    // The val loss is the last evaluation's, which may be steps before the checkpoint.
    let val_step =
        tinygpt::checkpoint::RunDir::new(&args.ckpt.checkpoint).last_eval_at_or_before(st.step);
    if args.json {
        let record = json!({
            "checkpoint": args.ckpt.checkpoint, "config": cfg,
            "parameters": total, "parameters_without_embeddings": total - embeddings,
            "step": st.step, "tokens_seen": st.tokens_seen, "ranks": st.ranks,
            "train_loss": st.last_train_loss, "val_loss": st.last_val_loss, "val_step": val_step, "best_val_loss": st.best_val_loss,
            "tokenizer": loaded.tokenizer.kind_name(), "vocab_size": loaded.tokenizer.vocab_size(),
        });
        outln!("{record}")?;
    } else {
        let m = &cfg.model;
        let fmt = |l: Option<f64>| l.map_or("-".to_string(), |l| format!("{l:.4}"));
        outln!("checkpoint  {}", args.ckpt.checkpoint.display())?;
        outln!(
            "model       {}, {} ({} K/V), width {}, context {}, {} positions, {}",
            count(m.n_layer, "layer"),
            count(m.n_head, "head"),
            m.kv_heads(),
            m.n_embd,
            m.block_size,
            format!("{:?}", m.positions).to_lowercase(),
            if m.bias { "biases" } else { "no biases" }
        )?;
        outln!(
            "parameters  {total} ({:.2}M); {} ({:.2}M) without embeddings",
            total as f64 / 1e6,
            total - embeddings,
            (total - embeddings) as f64 / 1e6
        )?;
        outln!(
            "tokenizer   {} with {} tokens (model vocabulary {})",
            loaded.tokenizer.kind_name(),
            loaded.tokenizer.vocab_size(),
            m.vocab_size
        )?;
        let on = match st.ranks {
            0 | 1 => String::new(),
            n => format!(" (last on {n} ranks)"),
        };
        outln!(
            "trained     {} steps, {} tokens, {:.0} s{on}",
            st.step,
            st.tokens_seen,
            st.elapsed_s
        )?;
        let at = |step: Option<usize>| step.map_or(String::new(), |s| format!(" at step {s}"));
        outln!(
            "loss        train {}{}, val {}{} (best val {})",
            fmt(st.last_train_loss),
            at(st.last_train_loss.map(|_| st.step)),
            fmt(st.last_val_loss),
            at(val_step.filter(|_| st.last_val_loss.is_some())),
            fmt(st.best_val_loss)
        )?;
        // Step 0 is an imported model's (training saves no step-0 checkpoint).
        if cfg.data.corpus.as_os_str().is_empty() || st.step == 0 {
            outln!("corpus      none: imported (tinygpt import), not trained here")?;
        } else {
            outln!("corpus      {}", cfg.data.corpus.display())?;
        }
    }
    Ok(())
}

fn parse_weight_format(flag: &str, value: &str) -> Result<WeightFormat> {
    Ok(match value.trim().to_ascii_lowercase().as_str() {
        "f32" => WeightFormat::F32,
        "bf16" => WeightFormat::Bf16,
        "int8" => WeightFormat::Int8,
        "int4" => WeightFormat::Int4,
        other => user_bail!("{flag} {other:?}: use f32, bf16, int8 or int4"),
    })
}

pub fn bench(args: BenchArgs, stop: tinygpt::util::Stop) -> Result<()> {
    let format = parse_weight_format("--decode-dtype", &args.decode_dtype)?;
    for (flag, value) in [
        ("--decode-tokens", args.decode_tokens),
        ("--decode-batch", args.decode_batch),
        ("--prompt-tokens", args.prompt_tokens),
    ] {
        if value == 0 {
            user_bail!("{flag} 0: pass at least 1");
        }
    }
    if let Some(dir) = &args.checkpoint {
        if let Some(device) = args.device.as_deref().filter(|d| *d != "cpu") {
            user_bail!(
                "--device {device}: bench --checkpoint measures the CPU decoder, as generate runs it; drop --device (or bench a config on {device}: --config FILE --device {device})"
            );
        }
        return bench_checkpoint(dir, format, &args, &stop);
    }
    let Some(config_path) = &args.config else {
        user_bail!("bench needs --config FILE or --checkpoint DIR");
    };
    let mut overrides = args.overrides;
    if let Some(device) = args.device {
        overrides.push(format!("run.device={device:?}"));
    }
    let config = tinygpt::config::Config::load(config_path, &overrides)?;
    let device = parse_device(&config.run.device)?;
    if args.steps == 0 {
        user_bail!("--steps 0: pass at least 1");
    }
    tinygpt::bench::check_memory(&config, &device)?;
    let opts = tinygpt::bench::BenchOptions {
        steps: args.steps,
        warmup: args.warmup,
        prompt_tokens: args.prompt_tokens,
        decode_tokens: args.decode_tokens,
        decode_batch: args.decode_batch,
        decode_mode: if args.reference {
            DecodeMode::Cached
        } else {
            DecodeMode::Fast
        },
        decode_weights: format,
        profile: args.profile,
        stop,
    };
    let m = &config.model;
    if !args.json {
        let guessed = m.vocab_size == 0 && tinygpt::corpus::cache::known_vocab(&config).is_none();
        tinygpt::errln!(
            "bench {}: {} layer{}, {} heads, width {}, context {}, batch {}, vocab {}{}; {} step{} after {} warm-up",
            config_path.display(),
            m.n_layer,
            plural(m.n_layer),
            m.n_head,
            m.n_embd,
            m.block_size,
            config.train.batch_size,
            tinygpt::bench::bench_vocab(&config),
            match guessed {
                true => " (a guess: no tokenizer trained on data.corpus yet)",
                false => "",
            },
            opts.steps,
            plural(opts.steps),
            opts.warmup
        );
    }
    let r = tinygpt::bench::run(&config, &device, &opts)?;
    if args.json {
        outln!("{}", serde_json::to_string(&r)?)?;
        return Ok(());
    }
    let mb = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0} MiB"));
    outln!("cpu     {}", r.cpu)?;
    outln!(
        "train   {:.1} ms/step (median of {}, {:.1}-{:.1}; {} {:?}: forward {:.1}, backward {:.1}, optimizer {:.1}), {:.0} tokens/s, {:.2} GFLOP/step, {:.1} GFLOP/s, peak RSS {}{}",
        r.train_ms_per_step,
        r.steps,
        r.train_ms_range.0,
        r.train_ms_range.1,
        r.train_path,
        r.train_dtype,
        r.forward_ms,
        r.backward_ms,
        r.optimizer_ms,
        r.train_tokens_per_s,
        r.gflop_per_step,
        r.gflops,
        mb(r.peak_rss_mb),
        r.gpu_memory_mb
            .map_or(String::new(), |m| format!(", GPU memory in use {m:.0} MiB"))
    )?;
    outln!("engine  {}", r.train_engine)?;
    match &r.profile {
        Some(profile) => outln!("{profile}")?,
        None if args.profile => outln!(
            "profile not recorded: the reference engine's work is candle's ops (train.fused = true profiles the fused engines)"
        )?,
        None => {}
    }
    outln!(
        "decode  {:.0} tokens/s ({}, {}), prefill {} tokens in {:.1} ms ({:.0} tokens/s), peak RSS {}",
        r.decode_tokens_per_s,
        r.decode_mode,
        match r.decode_batch {
            1 => "1 sequence".to_string(),
            n => format!("{n} sequences together"),
        },
        r.prompt_tokens,
        r.ttft_ms,
        r.prefill_tokens_per_s,
        mb(r.peak_rss_after_decode_mb)
    )?;
    Ok(())
}

/// `bench --checkpoint`: one precision's load, first-token and decode figures.
fn bench_checkpoint(
    dir: &std::path::Path,
    format: WeightFormat,
    args: &BenchArgs,
    stop: &tinygpt::util::Stop,
) -> Result<()> {
    if args.prompts.is_empty() || args.prompts.contains(&0) {
        user_bail!(
            "--prompts {:?}: give prompt lengths of 1 or more, e.g. 1,16,128,512",
            args.prompts
        );
    }
    let decode = (args.decode_tokens, args.decode_batch);
    let kv = KvPrecision::parse(args.kv_dtype.as_deref(), format)?;
    let r = tinygpt::bench::decode_checkpoint(dir, (format, kv), &args.prompts, decode, stop)?;
    if args.json {
        outln!("{}", serde_json::to_string(&r)?)?;
        return Ok(());
    }
    outln!("cpu     {}", r.cpu)?;
    outln!(
        "load    {:.0} ms ({}), {} weights: {} of {} parameters; keys and values in {}",
        r.load_ms,
        if r.hashed {
            "weights hashed"
        } else {
            "hash noted before"
        },
        r.dtype,
        match r.weights_mb {
            mb if mb < 1.0 => format!("{:.0} KiB", mb * 1024.0),
            mb => format!("{mb:.0} MiB"),
        },
        r.parameters,
        r.kv_dtype
    )?;
    let ttft: Vec<String> = r
        .ttft_ms
        .iter()
        .map(|(n, ms)| format!("{} {ms:.1} ms", count(*n, "token")))
        .collect();
    // Asked lengths past the model's context were cut to it (and timed once).
    let beyond: Vec<String> = args
        .prompts
        .iter()
        .filter(|&&n| r.ttft_ms.iter().all(|&(len, _)| len != n))
        .map(ToString::to_string)
        .collect();
    let cut = match beyond.is_empty() {
        true => String::new(),
        false => format!(" ({}: past the model's context)", beyond.join(", ")),
    };
    outln!("first   {}{cut}", ttft.join(", "))?;
    let together = match r.decode_batch {
        1 => String::new(),
        n => format!(" in each of {n} sequences together"),
    };
    // The context (block_size) bounds the decode: said, where it cut what was asked.
    let capped = match r.decode_tokens < args.decode_tokens {
        true => format!(
            " of the {} asked: the context holds no more",
            args.decode_tokens
        ),
        false => String::new(),
    };
    outln!(
        "decode  {:.1} tokens/s ({}{capped}{together}, timed after a 16-token prompt), peak RSS {}",
        r.decode_tokens_per_s,
        count(r.decode_tokens, "token"),
        r.peak_rss_mb
            .map_or("-".to_string(), |m| format!("{m:.0} MiB"))
    )?;
    outln!(
        "memory  weights read at {:.1} GB/s while decoding, {:.0}% of a plain read pass here ({:.1} GB/s)",
        r.weights_gb_per_s,
        100.0 * r.weights_gb_per_s / r.read_pass_gb_per_s.max(1e-9),
        r.read_pass_gb_per_s
    )?;
    Ok(())
}

pub fn export(args: ExportArgs) -> Result<()> {
    // No --format: the name says (`--out model.gguf` is one file, not a folder).
    let gguf = match args.format.as_deref() {
        Some(format) => format == "gguf",
        None => args
            .out
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf")),
    };
    if gguf {
        let dtype = tinygpt::gguf::GgufDtype::parse(args.dtype.as_deref().unwrap_or("f32"))?;
        tinygpt::gguf::check_export_file(&args.out)?;
        let loaded = load(&args.ckpt)?;
        let done = tinygpt::gguf::export(&loaded, &args.out, dtype)?;
        let fallbacks = fallback_counts(&done.fallbacks, args.dtype.as_deref().unwrap_or("f32"));
        // llama-completion continues a prompt (llama-cli is a chat); a char vocabulary
        // has no end-of-text token for it to stop at.
        let until = match loaded.tokenizer.end_of_text() {
            Some(_) => "",
            None => " --ignore-eos",
        };
        // llama.cpp's gpt2 cannot go past its learned positions: a prompt and its new
        // tokens together must fit (its assertion ends the process otherwise).
        let m = &loaded.config.model;
        let (new_tokens, fit) = match m.positions {
            PositionKind::Learned => (
                (m.block_size / 2).min(200),
                format!(
                    " (prompt and new tokens together at most {}: its learned positions end there)",
                    m.block_size
                ),
            ),
            _ => (200, String::new()),
        };
        let size = match done.bytes {
            b if b < 1 << 20 => format!("{:.0} KiB", b as f64 / 1024.0),
            b => format!("{:.1} MiB", b as f64 / (1 << 20) as f64),
        };
        tinygpt::errln!(
            "wrote {} ({}, {size}){fallbacks}: run it with llama-completion -m {} -p <prompt> -n {new_tokens}{until}{fit}",
            args.out.display(),
            done.arch.name(),
            args.out.display()
        );
        return Ok(());
    }
    if args.dtype.is_some() {
        user_bail!(
            "--dtype applies to --format gguf (or an --out ending in .gguf); a Hugging Face export is f32"
        );
    }
    tinygpt::interop::check_export_folder(&args.out)?;
    let bar = tinygpt::util::bars::spinner(&format!("exporting to {}", args.out.display()));
    let loaded = load(&args.ckpt)?;
    let layout = tinygpt::interop::export(&loaded, &args.out)?;
    bar.finish_and_clear();
    tinygpt::errln!(
        "wrote {} ({} layout): load it with transformers.AutoModelForCausalLM.from_pretrained({:?})",
        args.out.display(),
        layout.name(),
        args.out.display().to_string()
    );
    Ok(())
}

/// " (13 matrices in q5_0 and 2 in f16, ...)": the matrices a GGUF export wrote in
/// another format than `dtype` (their rows do not fill its blocks), counted per format.
fn fallback_counts(fallbacks: &[(String, String)], dtype: &str) -> String {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for (_, format) in fallbacks {
        match counts.iter_mut().find(|(f, _)| f == format) {
            Some((_, n)) => *n += 1,
            None => counts.push((format, 1)),
        }
    }
    let Some(((first, n), rest)) = counts.split_first() else {
        return String::new();
    };
    let mut told = format!(
        "{n} {} in {first}",
        if *n == 1 { "matrix" } else { "matrices" }
    );
    for (format, n) in rest {
        told.push_str(&format!(" and {n} in {format}"));
    }
    format!(" ({told}: rows that do not fill {dtype}'s blocks, as llama.cpp's quantizer does)")
}

pub fn import(args: ImportArgs) -> Result<()> {
    tinygpt::interop::check_import_source(&args.from)?;
    let bar = tinygpt::util::bars::spinner(&format!("importing {}", args.from.display()));
    let config = match args.from.is_file() {
        true => tinygpt::gguf::import(&args.from, &args.out)?,
        false => tinygpt::interop::import(&args.from, &args.out)?,
    };
    bar.finish_and_clear();
    let m = &config.model;
    tinygpt::errln!(
        "imported {} into {}: {} layer{}, {} heads, width {}, context {}, vocabulary {}",
        args.from.display(),
        args.out.display(),
        m.n_layer,
        plural(m.n_layer),
        m.n_head,
        m.n_embd,
        m.block_size,
        m.vocab_size
    );
    Ok(())
}

pub fn plot(args: PlotArgs) -> Result<()> {
    let metrics = args.checkpoint.join(tinygpt::checkpoint::METRICS_FILE);
    if !metrics.is_file() {
        let dir = args.checkpoint.display();
        if !args.checkpoint.exists() {
            user_bail!("run folder {dir} does not exist; check the path (runs are folders under checkpoints/)");
        }
        let run = tinygpt::checkpoint::RunDir::new(&args.checkpoint);
        match run.state() {
            // `tinygpt import` (or an --init-from run's start) writes step 0.
            Ok(state) if state.step == 0 => user_bail!(
                "{dir} holds weights not trained here (imported, or saved before a first step), so it has no losses to draw"
            ),
            Ok(_) => user_bail!(
                "{dir} holds a checkpoint but no metrics.jsonl (removed?), so no curve can be drawn; `tinygpt info --checkpoint {dir}` shows its last losses"
            ),
            Err(_) => {}
        }
        user_bail!("{dir} has no metrics.jsonl; is it a run folder?");
    }
    let out = args.out.unwrap_or_else(|| args.checkpoint.join("loss.png"));
    check_output_file("--out", &out, tinygpt::plot::PICTURE_EXTENSIONS)?;
    let title = args.checkpoint.file_name().map_or_else(
        || args.checkpoint.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    tinygpt::plot::loss_curve(&metrics, &out, &title)?;
    tinygpt::errln!("wrote {}", out.display());
    Ok(())
}

pub fn attention(args: AttentionArgs) -> Result<()> {
    if !args.json {
        check_output_file("--out", &args.out, tinygpt::plot::PICTURE_EXTENSIONS)?;
    }
    let loaded = load(&args.ckpt)?;
    let m = &loaded.config.model;
    let pick = |chosen: Option<usize>, count: usize, what: &str| -> Result<Vec<usize>> {
        match chosen {
            Some(i) if i >= count => user_bail!(
                "--{what} {i} is out of range: the model has {count} ({what}s 0 to {})",
                count - 1
            ),
            Some(i) => Ok(vec![i]),
            None => Ok((0..count).collect()),
        }
    };
    let layers = pick(args.layer, m.n_layer, "layer")?;
    let heads = pick(args.head, m.n_head, "head")?;
    let maps = tinygpt::plot::AttentionMaps::compute(
        &loaded.model,
        &loaded.tokenizer,
        &unescape(&args.prompt),
    )?;
    if args.json {
        let weights: Vec<Vec<&Vec<Vec<f32>>>> = layers
            .iter()
            .map(|&l| heads.iter().map(|&h| &maps.weights[l][h]).collect())
            .collect();
        outln!(
            "{}",
            json!({"tokens": maps.tokens, "layers": layers, "heads": heads, "weights": weights})
        )?;
        return Ok(());
    }
    tinygpt::plot::attention_grid(&maps, &layers, &heads, &args.out)?;
    tinygpt::errln!(
        "wrote {} ({} x {}, {})",
        args.out.display(),
        count(layers.len(), "layer"),
        count(heads.len(), "head"),
        count(maps.tokens.len(), "token")
    );
    Ok(())
}

pub fn sweep(args: SweepArgs, stop: tinygpt::util::Stop) -> Result<()> {
    use tinygpt::sweep::{self, Grid};
    let grids = args
        .grids
        .iter()
        .map(|g| Grid::parse(g))
        .collect::<Result<Vec<_>>>()?;
    let points = sweep::points(&args.config, &args.overrides, &grids)?;
    let mut reporter = tinygpt::progress::TerminalReporter::new();
    let result = sweep::run(&points, stop, &mut reporter);
    // What exists is compared, finished or not, before an interruption is reported.
    let runs = sweep::existing_runs(&points);
    if !runs.is_empty() {
        // sweep-<run.name>.png, after the name the runs' names start with (two sweeps
        // of one config under other names keep their own); a glob of the runs
        // (<run.name>-*) passes it by.
        let name = tinygpt::config::Config::load(&args.config, &args.overrides)?
            .run
            .name;
        let base = points[0]
            .config
            .run
            .out_dir
            .join(format!("sweep-{name}.png"));
        report_comparison(&runs, Some(&base), args.x, args.json)?;
    }
    result.map(|_| ())
}

pub fn compare(args: CompareArgs) -> Result<()> {
    if let Some(out) = &args.out {
        check_output_file("--out", out, tinygpt::plot::PICTURE_EXTENSIONS)?;
    }
    let runs = expand_runs(&args.runs)?;
    // The picture goes where asked, else beside the runs; with --json, only when asked.
    let out = match (&args.out, args.json) {
        (Some(out), _) => Some(out.clone()),
        (None, true) => None,
        (None, false) => Some(beside(&runs).join("compare.png")),
    };
    report_comparison(&runs, out.as_deref(), args.x, args.json)
}

/// The folder the runs are in (the first run's, where they are in several).
fn beside(runs: &[std::path::PathBuf]) -> std::path::PathBuf {
    runs.first()
        .and_then(|r| r.parent())
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(|| ".".into(), std::path::Path::to_path_buf)
}

/// Run folders from the arguments: folders as given, quoted globs expanded, a folder
/// of run folders opened (in name order).
fn expand_runs(args: &[std::path::PathBuf]) -> Result<Vec<std::path::PathBuf>> {
    let is_run = |p: &std::path::Path| {
        p.join(tinygpt::checkpoint::METRICS_FILE).exists()
            || p.join(tinygpt::checkpoint::CONFIG_FILE).exists()
    };
    let mut runs = Vec::new();
    for arg in args {
        let text = arg.to_string_lossy();
        if !arg.exists() && text.contains(['*', '?', '[']) {
            let matches = glob::glob(&text)
                .map_err(|e| user_error(format!("{text}: not a valid pattern ({e})")))?
                .filter_map(|p| p.ok())
                .filter(|p| is_run(p))
                .collect::<Vec<_>>();
            if matches.is_empty() {
                user_bail!("{text} matches no run folder");
            }
            runs.extend(matches);
        } else if arg.is_dir() && !is_run(arg) {
            let mut inside: Vec<_> = std::fs::read_dir(arg)
                .map_err(|e| user_error(format!("cannot list {}: {e}", arg.display())))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| is_run(p))
                .collect();
            if inside.is_empty() {
                user_bail!(
                    "{} is neither a run folder nor a folder of run folders",
                    arg.display()
                );
            }
            inside.sort();
            runs.extend(inside);
        } else if arg.is_file() {
            // A shell's glob brings the files beside the runs too (the pictures compare
            // and sweep write there): they are not runs, and are passed over.
            tinygpt::errln!("skipped {}: a file, not a run folder", arg.display());
        } else {
            runs.push(arg.clone());
        }
    }
    if runs.is_empty() {
        user_bail!("no run folder among the paths given; pass folders under checkpoints/");
    }
    // One run named twice (`r`, `r/`, `./r`, or a folder and a glob over it) is shown
    // once.
    let mut seen = std::collections::HashSet::new();
    runs.retain(|run| seen.insert(run.canonicalize().unwrap_or_else(|_| run.clone())));
    Ok(runs)
}

/// The table (and the picture) of `runs`. Its writes let a closed pipe go: a sweep
/// piped into `head` stops on the SIGPIPE (its runs saved), never on a panic.
fn report_comparison(
    dirs: &[std::path::PathBuf],
    out: Option<&std::path::Path>,
    x: tinygpt::compare::XAxis,
    as_json: bool,
) -> Result<()> {
    use tinygpt::compare::{self, XAxis};
    let runs = compare::read_runs(dirs)?;
    let rows = compare::rows(&runs);
    for damaged in runs.iter().filter_map(|r| r.config_error.as_ref()) {
        tinygpt::errln!("note: {damaged}");
    }
    if let Some(note) = compare::tokenizers_note(&runs) {
        tinygpt::errln!("{note}");
    }
    if as_json {
        outln!("{}", serde_json::to_string_pretty(&rows)?)?;
    } else {
        write!(std::io::stdout(), "{}", compare::table(&rows)).context(STDOUT)?;
    }
    let Some(out) = out else {
        return Ok(());
    };
    let (series, skipped) = compare::series(&runs, &rows, x);
    for why in skipped {
        let _ = writeln!(std::io::stderr(), "not plotted: {why}");
    }
    let x_label = match x {
        XAxis::Steps => "step",
        XAxis::Tokens => "tokens seen",
        XAxis::Time => "training time (s)",
    };
    let title = match series.len() == rows.len() {
        true => format!("{} runs: val loss (train loss pale)", rows.len()),
        false => format!(
            "{} of {} runs: val loss (train loss pale)",
            series.len(),
            rows.len()
        ),
    };
    match tinygpt::plot::comparison(&series, x_label, out, &title) {
        Ok(()) => {
            let _ = writeln!(std::io::stderr(), "wrote {}", out.display());
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "no plot: {e:#}");
        }
    }
    Ok(())
}

/// "1 layer", "4 layers".
fn count(n: usize, thing: &str) -> String {
    match n {
        1 => format!("1 {thing}"),
        n => format!("{n} {thing}s"),
    }
}

pub fn cache(args: CacheArgs) -> Result<()> {
    use tinygpt::inventory;
    // A folder named that is not there is a typo, not a place with no runs: read so,
    // every cache would look unused, and prune would offer to delete them all.
    // "a file, not a folder" where it is one: "no such folder" sent people looking.
    let not_a_folder = |path: &std::path::Path| match path.exists() {
        true => "a file, not a folder",
        false => "no such folder",
    };
    for runs in &args.runs {
        if !runs.is_dir() {
            user_bail!(
                "--runs {}: {}; pass the folder that holds your run folders (run.out_dir, checkpoints by default) or a run folder",
                runs.display(),
                not_a_folder(runs)
            );
        }
    }
    for cache in &args.caches {
        if !cache.is_dir() {
            user_bail!(
                "--cache {}: {}; pass a folder that data.cache_dir names",
                cache.display(),
                not_a_folder(cache)
            );
        }
    }
    let runs = if args.runs.is_empty() {
        vec![std::path::PathBuf::from("checkpoints")]
    } else {
        args.runs.clone()
    };
    let mut caches = args.caches.clone();
    caches.push("data/cache".into());
    let inv = inventory::survey(&caches, &runs)?;
    let now = std::time::SystemTime::now();
    match args.action.unwrap_or(CacheAction::List) {
        CacheAction::List if args.json => outln!("{}", serde_json::to_string_pretty(&inv)?)?,
        CacheAction::List => print!("{}", inventory::describe(&inv, now)),
        CacheAction::Prune { older_than, yes } => {
            if args.runs.is_empty() && !runs[0].is_dir() {
                user_bail!(
                    "cache prune: there is no checkpoints folder here, so no run's use of the caches is known; pass --runs DIR where your runs live (run.out_dir)"
                );
            }
            let age = older_than
                .as_deref()
                .map(inventory::parse_age)
                .transpose()?;
            let mut removals = inventory::removals(&inv, age, now);
            if yes {
                let left = inventory::remove(&removals)?;
                for path in &left {
                    tinygpt::errln!(
                        "left {}: a process began using it during the prune",
                        path.display()
                    );
                }
                removals.retain(|r| !left.contains(&r.path));
            }
            let total: u64 = removals.iter().map(|r| r.bytes).sum();
            if args.json {
                let record = json!({"deleted": yes, "bytes": total, "removals": removals});
                outln!("{}", serde_json::to_string_pretty(&record)?)?;
                return Ok(());
            }
            for r in &removals {
                outln!(
                    "{}  {}  ({})",
                    r.path.display(),
                    inventory::size(r.bytes),
                    r.why
                )?;
            }
            let verb = if yes { "deleted" } else { "would delete" };
            let more = if yes || removals.is_empty() {
                ""
            } else {
                "; --yes deletes"
            };
            tinygpt::errln!(
                "{verb} {} in {} place(s){more}",
                inventory::size(total),
                removals.len()
            );
        }
    }
    Ok(())
}

pub fn doctor(args: DoctorArgs) -> Result<()> {
    let report = tinygpt::doctor::run(&tinygpt::doctor::Faults::from_env())?;
    if args.json {
        outln!("{}", serde_json::to_string(&report)?)?;
    } else {
        for (place, what) in &report.devices {
            outln!("{place:<16} {what}")?;
        }
        outln!()?;
        outln!(
            "{:<16} {:<28} {:>10} {:>10}  result",
            "where",
            "check",
            "error",
            "bound"
        )?;
        for c in &report.checks {
            outln!(
                "{:<16} {:<28} {:>10.2e} {:>10.0e}  {}",
                c.place,
                c.name,
                c.error,
                c.bound,
                if c.passed { "ok" } else { "FAILED" }
            )?;
        }
        outln!()?;
        let passed = report.checks.iter().filter(|c| c.passed).count();
        outln!(
            "{passed} of {} checks passed{}",
            report.checks.len(),
            match (cfg!(feature = "cuda"), cfg!(feature = "metal")) {
                (false, false) => "; no GPU checks: this build has no GPU feature (cargo build --features cuda or metal)",
                _ => "",
            }
        )?;
    }
    let failed: Vec<String> = report
        .checks
        .iter()
        .filter(|c| !c.passed)
        .map(|c| format!("{} on {}", c.name, c.place))
        .collect();
    if !failed.is_empty() {
        anyhow::bail!(
            "{} check{} failed ({}): this build computes wrong here; please report it with this output",
            failed.len(),
            if failed.len() == 1 { "" } else { "s" },
            failed.join(", ")
        );
    }
    Ok(())
}

pub fn serve(args: ServeArgs, stop: tinygpt::util::Stop) -> Result<()> {
    // An empty key (`--api-key "$KEY"` with KEY unset) would serve every route open.
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        user_bail!(
            "--api-key (or TINYGPT_API_KEY) is empty; give the key clients must send, or leave both unset to serve without one"
        );
    }
    if args.max_tokens == 0 {
        user_bail!("--max-tokens 0 leaves nothing to generate; give the most tokens a request may ask for (4096 by default)");
    }
    let format = parse_weight_format("--dtype", &args.dtype)?;
    let kv = match &args.kv_dtype {
        Some(value) => Some(KvPrecision::parse(Some(value), format)?),
        None => None,
    };
    // Told before the server starts, in the words generate uses: a file, a folder of
    // runs or a Hugging Face folder passed as the run folder.
    tinygpt::checkpoint::RunDir::new(&args.checkpoint).state()?;
    if let Some(runs) = &args.runs {
        // A run folder is not the folder of runs the dashboard lists.
        if runs.join(tinygpt::checkpoint::STATE_FILE).is_file()
            || runs.join(tinygpt::checkpoint::METRICS_FILE).is_file()
        {
            let parent = runs
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map_or(".".into(), |p| p.display().to_string());
            user_bail!(
                "--runs {} is a run folder; pass the folder that holds run folders: --runs {parent}",
                runs.display()
            );
        }
    }
    tinygpt::serve::serve(
        tinygpt::serve::ServeOptions {
            checkpoint: args.checkpoint,
            host: args.host,
            port: args.port,
            parallel: args.parallel,
            max_queue: args.max_queue,
            max_tokens: args.max_tokens,
            api_key: args.api_key,
            cors: args.cors,
            runs: args.runs,
            device: args.device,
            format,
            kv,
            max_body_bytes: args.max_body_bytes,
            idle_timeout: args.idle_timeout,
            max_connections: args.max_connections,
        },
        stop,
    )
}

#[cfg(test)]
mod tests {
    use super::for_terminal;

    #[test]
    fn a_terminal_sees_control_characters_escaped() {
        assert_eq!(for_terminal("ROMEO.\n\tsoft"), "ROMEO.\n\tsoft");
        assert_eq!(for_terminal("a\u{1b}[2Jb\u{7}"), "a\\x1b[2Jb\\x07");
        assert_eq!(for_terminal("\u{85}\u{fffd}"), "\\x85\u{fffd}");
    }
}
