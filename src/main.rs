//! The `tinygpt` command line: parse, call the library, map errors to exit codes.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use tinygpt::config::Config;
use tinygpt::error::{exit_code, find_user_error, DivergedError};
use tinygpt::progress::TerminalReporter;

#[derive(Parser)]
#[command(
    name = "tinygpt",
    version,
    about = "Train and sample small GPT language models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a tokenizer and a model from a TOML experiment file.
    Train(TrainArgs),
    /// Sample text from a checkpoint, streamed as it is generated.
    Generate(GenerateArgs),
    /// Score a text file: mean next-token loss, perplexity, bits per byte.
    Eval(EvalArgs),
    /// Show a checkpoint's config, size, step and losses.
    Info(InfoArgs),
}

#[derive(Args)]
struct TrainArgs {
    /// Experiment file (TOML), e.g. configs/shakespeare-char.toml.
    #[arg(long, short)]
    config: PathBuf,
    /// Override a config value: --set model.n_layer=6 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    overrides: Vec<String>,
    /// Continue the checkpoint in the run folder.
    #[arg(long)]
    resume: bool,
    /// cpu, cuda, cuda:N, metal or auto (overrides run.device).
    #[arg(long)]
    device: Option<String>,
}

#[derive(Args)]
struct CheckpointArgs {
    /// A run folder, e.g. checkpoints/shakespeare-char.
    #[arg(long)]
    checkpoint: PathBuf,
    /// cpu, cuda, cuda:N, metal or auto.
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// Sampling: the prompt is prefilled once, then tokens come one at a time from a KV
/// cache. The model never sees more than its block_size: when the context is full the
/// window slides to its last half and is prefilled again, for every position kind
/// (learned, RoPE, sinusoidal).
#[derive(Args)]
#[command(verbatim_doc_comment)]
struct GenerateArgs {
    #[command(flatten)]
    ckpt: CheckpointArgs,
    /// The prompt text. Without --prompt or --prompt-file, stdin is read when it is not
    /// a terminal; an empty prompt starts from <|endoftext|> (BPE) or a newline (char).
    #[arg(long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    #[arg(long, default_value_t = 500)]
    max_new_tokens: usize,
    /// 0 = greedy (always the most likely token).
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f64,
    /// Sample among the k most likely tokens only (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sample among the smallest set of tokens whose probability reaches p (1 = all).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f64,
    /// Above 1 discourages tokens already in the context.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repetition_penalty: f64,
    /// Stop when this text appears (repeatable; \n and \t are understood).
    #[arg(long)]
    stop: Vec<String>,
    /// Same seed, same text. Default: a fresh one, printed with the stats.
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long, default_value_t = 1)]
    num_samples: usize,
    /// Recompute the whole window for every token (for checking and benchmarking).
    #[arg(long)]
    no_kv_cache: bool,
    /// Print one JSON object per sample instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct EvalArgs {
    #[command(flatten)]
    ckpt: CheckpointArgs,
    /// The text file to score.
    #[arg(long)]
    text: PathBuf,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct InfoArgs {
    #[command(flatten)]
    ckpt: CheckpointArgs,
    #[arg(long)]
    json: bool,
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(args) => {
            let mut overrides = args.overrides;
            if let Some(device) = args.device {
                overrides.push(format!("run.device={device:?}"));
            }
            let config = Config::load(&args.config, &overrides)?;
            tinygpt::train::train(config, args.resume, &mut TerminalReporter::new())?;
            Ok(())
        }
        Command::Generate(args) => commands::generate(args),
        Command::Eval(args) => commands::eval(args),
        Command::Info(args) => commands::info(args),
    }
}

mod commands {
    use std::io::{IsTerminal, Read, Write};

    use anyhow::Result;
    use serde_json::json;
    use tinygpt::checkpoint::Loaded;
    use tinygpt::device::parse_device;
    use tinygpt::error::user_error;
    use tinygpt::generate::{generate as sample_text, unescape, GenerateOptions};
    use tinygpt::sample::{Sampler, SamplingParams};
    use tinygpt::user_bail;

    use super::{CheckpointArgs, EvalArgs, GenerateArgs, InfoArgs};

    fn load(args: &CheckpointArgs) -> Result<Loaded> {
        Loaded::load(&args.checkpoint, &parse_device(&args.device)?)
    }

    fn read_prompt(args: &GenerateArgs) -> Result<String> {
        if let Some(p) = &args.prompt {
            return Ok(unescape(p));
        }
        if let Some(path) = &args.prompt_file {
            return std::fs::read_to_string(path).map_err(|e| {
                user_error(format!("cannot read --prompt-file {}: {e}", path.display()))
            });
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
        Ok(text)
    }

    pub fn generate(args: GenerateArgs) -> Result<()> {
        let params = SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            repetition_penalty: args.repetition_penalty,
        };
        params.validate()?;
        if args.num_samples == 0 {
            user_bail!("--num-samples must be at least 1");
        }
        let prompt_text = read_prompt(&args)?;
        let loaded = load(&args.ckpt)?;
        let tk = &loaded.tokenizer;
        let (prompt, show_prompt) = if prompt_text.is_empty() {
            let start = match tk.end_of_text() {
                Some(eot) => vec![eot],
                None => tk.encode("\n").map_err(|_| {
                    user_error("the prompt is empty and this char vocabulary has no newline to start from; give --prompt")
                })?,
            };
            (start, false)
        } else {
            (tk.encode(&prompt_text)?, true)
        };
        let seed = args.seed.unwrap_or_else(rand::random);
        let mut sampler = Sampler::new(params, seed)?;
        let options = GenerateOptions {
            max_new_tokens: args.max_new_tokens,
            stop: args.stop.iter().map(|s| unescape(s)).collect(),
            use_cache: !args.no_kv_cache,
        };
        let stdout = std::io::stdout();
        for i in 0..args.num_samples {
            let mut out = stdout.lock();
            let sample = if args.json {
                sample_text(
                    &loaded.model,
                    tk,
                    &prompt,
                    &mut sampler,
                    &options,
                    &mut |_| Ok(()),
                )?
            } else {
                if i > 0 {
                    writeln!(out, "\n---------------")?;
                }
                if show_prompt {
                    write!(out, "{prompt_text}")?;
                }
                let mut print = |piece: &str| -> Result<()> {
                    out.write_all(piece.as_bytes())?;
                    out.flush()?;
                    Ok(())
                };
                let s = sample_text(
                    &loaded.model,
                    tk,
                    &prompt,
                    &mut sampler,
                    &options,
                    &mut print,
                )?;
                writeln!(out)?;
                out.flush()?;
                s
            };
            let st = &sample.stats;
            if args.json {
                let record = json!({
                    "sample": i, "seed": seed, "prompt": prompt_text, "text": sample.text,
                    "token_ids": sample.token_ids, "stats": st,
                });
                writeln!(out, "{record}")?;
            } else {
                eprintln!(
                    "[sample {}/{}] prompt {} tokens, generated {} tokens ({}), prefill {:.1} ms, decode {:.1} tokens/s, seed {seed}",
                    i + 1,
                    args.num_samples,
                    st.prompt_tokens,
                    st.generated_tokens,
                    st.stopped_by,
                    st.prefill_ms,
                    st.decode_tokens_per_s
                );
            }
        }
        Ok(())
    }

    pub fn eval(args: EvalArgs) -> Result<()> {
        let text = std::fs::read(&args.text)
            .map_err(|e| user_error(format!("cannot read --text {}: {e}", args.text.display())))?;
        let text = String::from_utf8(text)
            .map_err(|_| user_error(format!("--text {} is not UTF-8", args.text.display())))?;
        let loaded = load(&args.ckpt)?;
        let ids = loaded.tokenizer.encode(&text)?;
        let r = tinygpt::eval::evaluate(&loaded.model, &ids, text.len())?;
        if args.json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            println!(
                "{}: {} tokens, loss {:.4} nats/token, perplexity {:.3}, {:.4} bits/byte",
                args.text.display(),
                r.tokens,
                r.loss,
                r.perplexity,
                r.bits_per_byte
            );
        }
        Ok(())
    }

    pub fn info(args: InfoArgs) -> Result<()> {
        let loaded = load(&args.ckpt)?;
        let params = loaded.model.params();
        let total = params.count();
        let embeddings: usize = params
            .iter()
            .filter(|(name, _)| name.starts_with("wte.") || name.starts_with("wpe."))
            .map(|(_, v)| v.elem_count())
            .sum();
        let st = &loaded.state;
        let cfg = &loaded.config;
        if args.json {
            let record = json!({
                "checkpoint": args.ckpt.checkpoint, "config": cfg,
                "parameters": total, "parameters_without_embeddings": total - embeddings,
                "step": st.step, "tokens_seen": st.tokens_seen,
                "train_loss": st.last_train_loss, "val_loss": st.last_val_loss, "best_val_loss": st.best_val_loss,
                "tokenizer": loaded.tokenizer.kind_name(), "vocab_size": loaded.tokenizer.vocab_size(),
            });
            println!("{record}");
        } else {
            let m = &cfg.model;
            let fmt = |l: Option<f64>| l.map_or("-".to_string(), |l| format!("{l:.4}"));
            println!("checkpoint  {}", args.ckpt.checkpoint.display());
            println!(
                "model       {} layers, {} heads ({} K/V), width {}, context {}, {:?} positions, bias {}",
                m.n_layer, m.n_head, m.kv_heads(), m.n_embd, m.block_size, m.positions, m.bias
            );
            println!(
                "parameters  {total} ({:.2}M); {} ({:.2}M) without embeddings",
                total as f64 / 1e6,
                total - embeddings,
                (total - embeddings) as f64 / 1e6
            );
            println!(
                "tokenizer   {} with {} tokens (model vocabulary {})",
                loaded.tokenizer.kind_name(),
                loaded.tokenizer.vocab_size(),
                m.vocab_size
            );
            println!(
                "trained     {} steps, {} tokens, {:.0} s",
                st.step, st.tokens_seen, st.elapsed_s
            );
            println!(
                "loss        train {}, val {} (best val {})",
                fmt(st.last_train_loss),
                fmt(st.last_val_loss),
                fmt(st.best_val_loss)
            );
            println!("corpus      {}", cfg.data.corpus.display());
        }
        Ok(())
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            if let Some(user) = find_user_error(&err) {
                eprintln!("error: {user}");
                ExitCode::from(exit_code::USER as u8)
            } else if let Some(diverged) = err.downcast_ref::<DivergedError>() {
                eprintln!("error: {diverged}");
                ExitCode::from(exit_code::DIVERGED as u8)
            } else {
                eprintln!("internal error: {err:#}");
                ExitCode::from(exit_code::INTERNAL as u8)
            }
        }
    }
}
