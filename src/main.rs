//! The `tinygpt` command line: parse, call the library, map errors to exit codes.

mod alloc;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};

use tinygpt::config::Config;
use tinygpt::error::{
    exit_code, exit_code_of, find_user_error, DivergedError, InterruptedError, PeerFailed,
};
use tinygpt::parallel::{Launcher, World};
use tinygpt::progress::TerminalReporter;
use tinygpt::train::{Reporter, Silent, Start, Trainer};
use tinygpt::util::{Stop, Stopped};

#[derive(Parser)]
#[command(
    name = "tinygpt",
    version = concat!(env!("CARGO_PKG_VERSION"), " (features: ", env!("TINYGPT_FEATURES"), ")"),
    about = "Train and sample small GPT language models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

const CORPUS_HELP: &str = "\
Corpora (data.corpus): a text file; a .jsonl file (one JSON object per line, text in
data.text_field, default \"text\"); a .parquet file as the Hugging Face hub serves them
(column data.text_field); nanoGPT's train.bin/val.bin or llm.c's .bin shards (used as they
are; set tokenizer.path to the tokenizer they were encoded with); or a folder of those.
Tokenizers and token ids are cached per corpus in data.cache_dir (default: cache/ beside
the corpus).

Examples:
  tinygpt train --config configs/shakespeare-bpe.toml --set data.corpus=stories.jsonl
  tinygpt train --config configs/shakespeare-bpe.toml --set data.corpus=fineweb/ \\
      --set data.text_field=text --set tokenizer.vocab_size=8192
  tinygpt train --config configs/shakespeare-bpe.toml --set data.corpus=data/openwebtext \\
      --set tokenizer.path=gpt2/tokenizer.json";

#[derive(Subcommand)]
enum Command {
    /// Train a tokenizer and a model from a TOML experiment file.
    #[command(after_help = CORPUS_HELP)]
    Train(TrainArgs),
    /// Train one config at every combination of some settings' values, one run after
    /// another; run it again to continue (done runs are skipped, an interrupted one resumes).
    Sweep(SweepArgs),
    /// Compare runs: val/train loss of each in one PNG, and a table (or --json).
    Compare(CompareArgs),
    /// Sample text from a checkpoint, streamed as it is generated.
    ///
    /// The prompt is prefilled once, then tokens come one at a time from a KV cache. The
    /// model never sees more than its block_size positions: when the context is full, the
    /// window slides to its last half and is prefilled again, for every position kind
    /// (learned, RoPE, sinusoidal: none is asked about positions it was not trained on).
    Generate(GenerateArgs),
    /// Serve a checkpoint over OpenAI's HTTP API (completions, chat, streaming), with a
    /// web page: a playground, and a dashboard of training runs (--runs).
    ///
    /// Requests decode together (continuous batching): --parallel sequences at once,
    /// the rest queued; a full queue answers 503.
    Serve(ServeArgs),
    /// Score a text file: mean next-token loss, perplexity, bits per byte.
    Eval(EvalArgs),
    /// Show a checkpoint's config, size, step and losses.
    Info(InfoArgs),
    /// Measure training and decoding speed of a config on this machine.
    Bench(BenchArgs),
    /// Draw a run's loss curve (train, val, learning rate) to a PNG.
    Plot(PlotArgs),
    /// Draw the attention weights of every layer and head over a prompt to a PNG.
    Attention(AttentionArgs),
    /// Write a checkpoint as a Hugging Face model folder (GPT-2 or Llama layout), or as
    /// one GGUF file for llama.cpp, Ollama and LM Studio (--format gguf).
    Export(ExportArgs),
    /// Read a Hugging Face GPT-2 or Llama folder, or a GPT-2 or Llama GGUF file, into a
    /// checkpoint folder.
    Import(ImportArgs),
    /// List what the corpus caches hold (tokenizers, ids) and which runs use it, or
    /// prune what none uses.
    Cache(CacheArgs),
    /// Check that this build computes right on this machine: the kernels at each CPU
    /// level, the fused engines and decoders against the reference, CUDA graph replay;
    /// a table of errors and bounds, exit 1 if any check fails.
    Doctor(DoctorArgs),
    /// Print the shell completion script for bash, zsh, fish, powershell or elvish.
    Completions(CompletionsArgs),
    /// Print the manual page (roff), or write one per command into a folder.
    Man(ManArgs),
}

#[derive(Args)]
struct CacheArgs {
    #[command(subcommand)]
    action: Option<CacheAction>,
    /// A folder of run folders, or a run folder, whose use of the caches counts
    /// (repeatable; default: checkpoints).
    #[arg(long = "runs", global = true, value_name = "DIR")]
    runs: Vec<PathBuf>,
    /// A cache folder to look in besides those the runs use and data/cache
    /// (repeatable; what data.cache_dir names).
    #[arg(long = "cache", global = true, value_name = "DIR")]
    caches: Vec<PathBuf>,
    /// Print JSON.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand)]
enum CacheAction {
    /// Each cache folder's tokenizers and ids, their sizes, when last used, by which
    /// runs (the default).
    List,
    /// Delete what no run uses, what no run read for longer than --older-than, and the
    /// ids old runs keep in their folders; only says what it would delete without --yes.
    /// Never touches a run's checkpoint.
    Prune {
        /// Also what no run has read for this long: 600s, 90m, 12h, 30d, 2w.
        #[arg(long, value_name = "AGE", allow_hyphen_values = true)]
        older_than: Option<String>,
        /// Delete (without it: a dry run).
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Args)]
struct DoctorArgs {
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

#[derive(Args)]
struct ManArgs {
    /// Write tinygpt.1 and a page per command (tinygpt-train.1, ...) into this folder.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct PlotArgs {
    /// A run folder.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Default: loss.png in the run folder.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct AttentionArgs {
    #[command(flatten)]
    ckpt: CheckpointArgs,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value = "attention.png")]
    out: PathBuf,
    /// Only this layer (0-based).
    #[arg(long)]
    layer: Option<usize>,
    /// Only this head (0-based).
    #[arg(long)]
    head: Option<usize>,
    /// Print the weights as JSON instead of drawing.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ExportArgs {
    #[command(flatten)]
    ckpt: CheckpointArgs,
    /// Output: a folder (config.json, model.safetensors, tokenizer.json) for hf, a file
    /// (e.g. model.gguf) for gguf.
    #[arg(long)]
    out: PathBuf,
    /// hf: a Hugging Face model folder; gguf: one GGUF file (llama.cpp's gpt2 or llama).
    /// Default: gguf for an --out ending in .gguf, hf otherwise.
    #[arg(long, value_parser = ["hf", "gguf"])]
    format: Option<String>,
    /// GGUF only: the matrices' format (norms and biases stay f32).
    #[arg(long, value_parser = tinygpt::gguf::GgufDtype::NAMES)]
    dtype: Option<String>,
}

#[derive(Args)]
struct ImportArgs {
    /// A Hugging Face model folder (config.json, model.safetensors or shards,
    /// tokenizer.json), or a GGUF file.
    #[arg(long = "from")]
    from: PathBuf,
    /// The checkpoint folder to create, e.g. checkpoints/gpt2.
    #[arg(long)]
    out: PathBuf,
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
    /// Start from this checkpoint's weights and tokenizer (fine-tuning on the config's corpus).
    #[arg(long, value_name = "CHECKPOINT")]
    init_from: Option<PathBuf>,
    /// cpu, cuda, cuda:N, metal or auto (overrides run.device).
    #[arg(long)]
    device: Option<String>,
    /// Of several ranks (mpirun): end the job when one waits this long for the others
    /// in a collective (a rank stopped, hung or cut off); 0 waits forever. Decimals
    /// allowed.
    #[arg(long, value_name = "SECONDS", default_value = "1800", value_parser = seconds)]
    collective_timeout: std::time::Duration,
}

#[derive(Args)]
struct SweepArgs {
    /// Experiment file (TOML), e.g. configs/shakespeare-char.toml.
    #[arg(long, short)]
    config: PathBuf,
    /// A setting and its values: --grid model.n_layer=2,4,6 (repeatable; every
    /// combination runs, named <run.name>-n_layer-2-...).
    #[arg(long = "grid", value_name = "SECTION.KEY=V1,V2,...", required = true)]
    grids: Vec<String>,
    /// Override a config value for every run: --set train.max_iters=500 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    overrides: Vec<String>,
    /// cpu, cuda, cuda:N, metal or auto (overrides run.device).
    #[arg(long)]
    device: Option<String>,
    /// The comparison plot's x axis.
    #[arg(long, value_enum, default_value = "steps")]
    x: tinygpt::compare::XAxis,
    /// Print the final table as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct CompareArgs {
    /// Run folders (e.g. checkpoints/*), a quoted glob ("checkpoints/lr-*"), or a folder
    /// of run folders (checkpoints).
    #[arg(required = true, value_name = "RUN")]
    runs: Vec<PathBuf>,
    /// The PNG to write (default: compare.png beside the runs; none with --json).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Loss against optimiser steps, tokens seen, or training time.
    #[arg(long, value_enum, default_value = "steps")]
    x: tinygpt::compare::XAxis,
    /// Print the table as JSON.
    #[arg(long)]
    json: bool,
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

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    ckpt: CheckpointArgs,
    /// The prompt text (\n, \t, \r and \\ are understood, as in --stop). Without
    /// --prompt or --prompt-file, stdin is read when it is not a terminal, less one
    /// trailing newline (echo's); an empty prompt starts from <|endoftext|> (BPE) or a
    /// newline (char).
    #[arg(long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from this file as it is, its last newline included (`-`: stdin).
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Keep the last block_size tokens of a prompt longer than the model's context
    /// (without it such a prompt is refused).
    #[arg(long)]
    crop: bool,
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
    /// Decode with the reference model's KV cache instead of the fused CPU decoder.
    #[arg(long, conflicts_with = "no_kv_cache")]
    reference: bool,
    /// Print one JSON object per sample instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Precision of the matrix products: f32; bf16 (operands rounded to bf16, f32 sums:
    /// tensor cores on CUDA; the fused CPU decoder computes in f32); int8 or int4 (the
    /// CPU decoder's weights in eight or four bits, blocks of 32 with a scale, as
    /// llama.cpp's q8_0 and q4_0).
    #[arg(long, default_value = "f32", value_parser = weight_formats(), ignore_case = true)]
    dtype: String,
    /// How the fused CPU decoder holds the keys and values of the tokens seen: f32, bf16
    /// (half the memory and the bytes attention reads; llama.cpp's default is f16) or
    /// int8 (a quarter, a scale per head). By default f32, bf16 or int8 as the weights
    /// are (int8 beside int4 too).
    #[arg(long, value_parser = kv_formats(), ignore_case = true)]
    kv_dtype: Option<String>,
}

#[derive(Args)]
struct ServeArgs {
    /// The run folder (or imported model folder) to serve.
    #[arg(long, short)]
    checkpoint: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Sequences decoded at once (each choice of a request is one); the rest wait.
    #[arg(long, default_value_t = 8)]
    parallel: usize,
    /// Requests that may wait for a slot once every slot is taken; beyond them the
    /// server answers 503 (0: none wait).
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// The most tokens a request may ask for (max_tokens).
    #[arg(long, default_value_t = 4096)]
    max_tokens: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health and the page's
    /// files (the page asks for the key).
    #[arg(long, env = "TINYGPT_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Allow browsers on this origin (e.g. http://localhost:3000) to call the API.
    #[arg(long, value_name = "ORIGIN")]
    cors: Option<String>,
    /// A folder of run folders (checkpoints/) to chart on the page, live.
    #[arg(long, value_name = "DIR")]
    runs: Option<PathBuf>,
    /// The decoder's weights: f32, bf16, int8 or int4 (as generate --dtype; int8 and
    /// int4 on the CPU).
    #[arg(long, default_value = "f32", value_parser = weight_formats(), ignore_case = true)]
    dtype: String,
    /// How the CPU decoder holds the keys and values of every sequence: f32, bf16 or
    /// int8 (as generate --kv-dtype: bf16 half the memory per slot, int8 a quarter; by
    /// default f32, bf16 or int8 as the weights are, int8 beside int4 too).
    #[arg(long, value_parser = kv_formats(), ignore_case = true)]
    kv_dtype: Option<String>,
    /// Where to decode: cpu, cuda[:N], or auto (a CUDA GPU where the build and machine
    /// have one, else the CPU).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Seconds a connection may stay open without sending a request.
    #[arg(long, default_value_t = 30)]
    idle_timeout: u64,
    /// Connections open at once; a newcomer closes the one idle longest (and is
    /// closed itself only when every one is busy).
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
}

#[derive(Args)]
struct EvalArgs {
    #[command(flatten)]
    ckpt: CheckpointArgs,
    /// The text file to score (`-`: stdin); a .jsonl or .parquet file, or a folder of
    /// corpus files, is read as training reads it (its documents' data.text_field, the
    /// run's; separated as in training).
    #[arg(long)]
    text: PathBuf,
    /// The weights' precision: f32 (the engines), or bf16 / int8 / int4 (scored through the
    /// CPU decoder holding its weights so, as generate --dtype decodes: what the
    /// precision costs in loss).
    #[arg(long, default_value = "f32", value_parser = weight_formats(), ignore_case = true)]
    dtype: String,
    /// How the CPU decoder holds its keys and values, f32, bf16 or int8 (as generate
    /// --kv-dtype; scored through the CPU decoder whatever --dtype is: what they cost in
    /// loss).
    #[arg(long, value_parser = kv_formats(), ignore_case = true)]
    kv_dtype: Option<String>,
    /// Tokens a window holds (default: the model's context, block_size); a text longer
    /// than one window is scored in windows advancing by half of one. Shorter windows
    /// for a model whose context would not fit in memory.
    #[arg(long, value_name = "TOKENS")]
    context: Option<usize>,
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

#[derive(Args)]
// One of the two, and a bare `bench` names both (it named --config alone).
#[command(group(clap::ArgGroup::new("measured").required(true).args(["config", "checkpoint"])))]
struct BenchArgs {
    /// Experiment file (TOML); only [model], [train] and run.seed matter.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Instead of a config: decode this run folder as `generate` does on the CPU (load
    /// time, time to first token per --prompts length, decode speed, peak RSS), in one
    /// --decode-dtype.
    #[arg(long, conflicts_with = "config")]
    checkpoint: Option<PathBuf>,
    /// With --checkpoint: the prompt lengths whose time to first token is measured.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,16,128,512",
        conflicts_with = "config"
    )]
    prompts: Vec<usize>,
    #[arg(
        long = "set",
        value_name = "SECTION.KEY=VALUE",
        conflicts_with = "checkpoint"
    )]
    overrides: Vec<String>,
    /// Timed training steps (the median is reported).
    #[arg(long, default_value_t = 20, conflicts_with = "checkpoint")]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 3, conflicts_with = "checkpoint")]
    warmup: usize,
    /// Prompt length for time-to-first-token (capped at block_size).
    #[arg(long, default_value_t = 256, conflicts_with = "checkpoint")]
    prompt_tokens: usize,
    /// New tokens to decode, after a 16-token prompt (with --checkpoint: at most what
    /// the model's context holds after it).
    #[arg(long, default_value_t = 500)]
    decode_tokens: usize,
    /// Sequences decoded together, as `generate --num-samples` or a server's batch
    /// decodes them (with a config or --checkpoint); the decode tokens/s counts all of
    /// theirs.
    #[arg(long, default_value_t = 1)]
    decode_batch: usize,
    /// Decode with the reference model's KV cache instead of the fused CPU decoder.
    #[arg(long, conflicts_with = "checkpoint")]
    reference: bool,
    /// How the fused CPU decoder holds its weights: f32, bf16, int8 or int4 (as generate
    /// --dtype).
    #[arg(long, default_value = "f32", value_parser = weight_formats(), ignore_case = true)]
    decode_dtype: String,
    /// With --checkpoint: how the decoder holds its keys and values, f32, bf16 or int8
    /// (as generate --kv-dtype; by default f32, bf16 or int8 as the weights are, int8
    /// beside int4 too).
    #[arg(long, value_parser = kv_formats(), ignore_case = true)]
    kv_dtype: Option<String>,
    #[arg(long)]
    device: Option<String>,
    /// After the timed steps, profile up to 5 more: per phase and group of work
    /// (products by layer, attention, norms, ...) the time a step, its share, the
    /// TFLOP/s or GB/s achieved, the floor on the device's peak, the gaps, and MFU.
    /// On CUDA timed by events; under the emulator (TINYGPT_EMULATE_CUDA=1) untimed,
    /// with the floor on an H100.
    #[arg(long, conflicts_with = "checkpoint")]
    profile: bool,
    #[arg(long)]
    json: bool,
}

fn run(cli: Cli, world: &World) -> anyhow::Result<()> {
    // Commands with long loops stop politely on the first Ctrl-C, SIGTERM, SIGHUP or
    // SIGUSR1/2 (the loops check; a second signal exits at once). The others keep the
    // default, which ends them at once: everything they write is written atomically.
    let polite = matches!(
        cli.command,
        Command::Train(_)
            | Command::Sweep(_)
            | Command::Generate(_)
            | Command::Serve(_)
            | Command::Eval(_)
            | Command::Bench(_)
    );
    // Training's output read by a pipe that closes (`tinygpt train ... | head`) stops
    // it as a signal does, with its checkpoint, rather than ending it unsaved.
    let pipe = matches!(cli.command, Command::Train(_) | Command::Sweep(_));
    let stop = if polite {
        stop_on_signals(pipe)?
    } else {
        Stop::new()
    };
    match cli.command {
        Command::Train(args) => train(args, stop, world),
        Command::Sweep(mut args) => {
            if let Some(device) = args.device.take() {
                args.overrides.push(format!("run.device={device:?}"));
            }
            commands::sweep(args, stop)
        }
        Command::Compare(args) => commands::compare(args),
        Command::Generate(args) => commands::generate(args, stop),
        Command::Serve(args) => commands::serve(args, stop),
        Command::Eval(args) => commands::eval(args, stop),
        Command::Info(args) => commands::info(args),
        Command::Bench(args) => commands::bench(args, stop),
        Command::Plot(args) => commands::plot(args),
        Command::Attention(args) => commands::attention(args),
        Command::Export(args) => commands::export(args),
        Command::Import(args) => commands::import(args),
        Command::Cache(args) => commands::cache(args),
        Command::Doctor(args) => commands::doctor(args),
        Command::Completions(args) => {
            let mut cli = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(args.shell, &mut cli, "tinygpt", &mut std::io::stdout());
            Ok(())
        }
        Command::Man(args) => {
            let cli = <Cli as clap::CommandFactory>::command();
            match args.out {
                Some(dir) => {
                    if dir.is_file() {
                        tinygpt::user_bail!(
                            "--out {} is a file; man writes a page per command into a folder: pass a folder's path",
                            dir.display()
                        );
                    }
                    let failed = |e: std::io::Error| {
                        tinygpt::error::user_error(format!(
                            "cannot write the manual pages into {}: {e}",
                            dir.display()
                        ))
                    };
                    std::fs::create_dir_all(&dir).map_err(failed)?;
                    clap_mangen::generate_to(cli, &dir).map_err(failed)?;
                    tinygpt::errln!("wrote the manual pages into {}", dir.display());
                }
                None => clap_mangen::Man::new(cli).render(&mut std::io::stdout())?,
            }
            Ok(())
        }
    }
}

mod commands;

/// `tinygpt train`, as one process or as one rank of several. Starting is agreed among
/// the ranks stage by stage (a rank that fails stops the others, and alone says why).
/// In training the ranks meet at every step, so a stop or a divergence is seen by all
/// at the same step; any other failure of one rank ends the whole job at once (MPI
/// abort), as the others could not know and would wait for it forever.
fn train(args: TrainArgs, stop: Stop, world: &World) -> anyhow::Result<()> {
    let comm: std::sync::Arc<dyn tinygpt::parallel::Collective> =
        match (world.size(), args.collective_timeout) {
            (1, _) => std::sync::Arc::clone(&world.comm),
            (_, limit) if limit.is_zero() => std::sync::Arc::clone(&world.comm),
            (_, limit) => std::sync::Arc::new(tinygpt::parallel::Watched::new(
                std::sync::Arc::clone(&world.comm),
                limit,
            )),
        };
    let config = tinygpt::parallel::agree(comm.as_ref(), train_config(&args, world.rank()));
    let mut trainer =
        config.and_then(|(config, start)| Trainer::start_on(config, start, stop, comm))?;
    let mut reporter: Box<dyn Reporter> = match world.rank() {
        0 => Box::new(TerminalReporter::new()),
        _ => Box::new(Silent),
    };
    let trained = trainer
        .run(reporter.as_mut())
        .map_err(|e| with_resume_command(e, world.size()));
    match trained {
        Err(err) if world.size() > 1 && !ends_every_rank(&err) => {
            print_error(&err, world);
            world.comm.abort(exit_code_of(&err))
        }
        trained => trained.map(drop),
    }
}

/// The config and how the run starts, from `train`'s arguments.
fn train_config(args: &TrainArgs, rank: usize) -> anyhow::Result<(Config, Start)> {
    let mut overrides = args.overrides.clone();
    if let Some(device) = &args.device {
        overrides.push(format!("run.device={device:?}"));
    }
    if let Some(dir) = &args.init_from {
        overrides.push(format!("train.init_from={:?}", dir.display().to_string()));
    }
    let config = Config::load(&args.config, &overrides)?;
    // With --resume, --init-from only tells which run it is (its model section came
    // from the other checkpoint); the weights come from this run's folder.
    let start = match (args.resume, &config.train.init_from) {
        (true, _) => Start::Resume,
        (false, Some(from)) => {
            let given = Config::keys_given(&args.config, &overrides)?;
            Start::InitFrom {
                from: from.clone(),
                context: given
                    .contains("model.block_size")
                    .then_some(config.model.block_size),
            }
        }
        (false, None) => Start::Fresh,
    };
    if let (Start::InitFrom { from, .. }, 0) = (&start, rank) {
        unused_model_settings(&args.config, &overrides, &config, from);
    }
    if start == Start::Resume {
        check_resumed_tokenizer(&overrides, &config)?;
    }
    Ok((config, start))
}

/// A resumed run keeps the tokenizer it started with (its ids are the model's rows),
/// whatever the config file says; a `--set tokenizer.*` that asks for another one
/// would otherwise be dropped without a word.
fn check_resumed_tokenizer(overrides: &[String], config: &Config) -> anyhow::Result<()> {
    let run = tinygpt::checkpoint::RunDir::new(config.run_dir());
    // No checkpoint, or one that cannot be read: the resume that follows says so.
    let Ok(saved) = run.saved_config() else {
        return Ok(());
    };
    let t = &saved.tokenizer;
    // Sizes mean something only for a BPE tokenizer trained by the run.
    let sized = t.kind == tinygpt::config::TokenizerKind::Bpe && t.path.is_none();
    let (wanted, has) = (
        tinygpt::compare::flatten(config),
        tinygpt::compare::flatten(&saved),
    );
    let differing: Vec<String> = overrides
        .iter()
        .filter_map(|o| o.split_once('='))
        .map(|(key, _)| key.trim())
        .filter(|key| key.starts_with("tokenizer."))
        .filter(|key| sized || !matches!(*key, "tokenizer.vocab_size" | "tokenizer.train_bytes"))
        .filter(|key| wanted.get(*key) != has.get(*key))
        .map(|key| tinygpt::compare::difference(key, &wanted, &has, "the checkpoint"))
        .collect();
    if !differing.is_empty() {
        tinygpt::user_bail!(
            "--resume keeps the run's tokenizer, and --set asks for another: {}; drop it, or start a new run under another run.name",
            differing.join(", ")
        );
    }
    Ok(())
}

/// Says which [model] settings the config or --set gives that fine-tuning does not use:
/// the model (and tokenizer) come from the --init-from checkpoint, dropout aside. A
/// longer block_size, say, cannot be had this way, and would otherwise pass unseen.
fn unused_model_settings(
    path: &std::path::Path,
    overrides: &[String],
    config: &Config,
    from: &std::path::Path,
) {
    let run = tinygpt::checkpoint::RunDir::new(from);
    // A source that cannot be read is told by the loading that follows.
    let (Ok(given), Ok(source)) = (Config::keys_given(path, overrides), run.saved_config()) else {
        return;
    };
    let (wanted, has) = (
        tinygpt::compare::flatten(config),
        tinygpt::compare::flatten(&source),
    );
    // A shorter context is taken: the run trains on shorter sequences.
    let (context, source_context) = (config.model.block_size, source.model.block_size);
    let shortened = given.contains("model.block_size") && context < source_context;
    if shortened {
        tinygpt::errln!(
            "note: training {} at a context of {context} tokens (model.block_size; it has {source_context}{})",
            from.display(),
            match source.model.positions {
                tinygpt::config::PositionKind::Learned => ": its first learned positions kept",
                _ => "",
            }
        );
    }
    let unused: Vec<String> = given
        .iter()
        .filter(|key| {
            key.starts_with("model.")
                && !matches!(key.as_str(), "model.dropout" | "model.vocab_size")
                && !(shortened && key.as_str() == "model.block_size")
        })
        .filter(|key| wanted.get(*key) != has.get(*key))
        .map(|key| tinygpt::compare::difference(key, &wanted, &has, "it"))
        .collect();
    if !unused.is_empty() {
        tinygpt::errln!(
            "note: --init-from takes the model and tokenizer from {}; not used: {}",
            from.display(),
            unused.join(", ")
        );
    }
}

/// A number of seconds, 0 or more, decimals allowed (`--collective-timeout 2.5`).
fn seconds(value: &str) -> Result<std::time::Duration, String> {
    value
        .trim()
        .parse::<f64>()
        .ok()
        .and_then(|s| std::time::Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| {
            format!("{value:?} is not a number of seconds (0 or more, e.g. 1800 or 2.5)")
        })
}

/// A stopped run that kept a checkpoint says the command that continues it: this
/// one's, with `--resume`.
fn with_resume_command(err: anyhow::Error, ranks: usize) -> anyhow::Error {
    match err.downcast::<InterruptedError>() {
        Ok(mut stopped) if stopped.continue_with.ends_with("--resume") => {
            let mut args: Vec<String> = argv().into_iter().skip(1).collect();
            if !args.iter().any(|a| a == "--resume") {
                args.push("--resume".into());
            }
            // The binary as it was started (`./tinygpt-mpi`, a cargo target path).
            let program = argv()
                .into_iter()
                .next()
                .unwrap_or_else(|| "tinygpt".into());
            let line: Vec<String> = std::iter::once(shell_quoted(&program))
                .chain(args.iter().map(|a| shell_quoted(a)))
                .collect();
            stopped.continue_with = match ranks {
                1 => line.join(" "),
                n => format!("{} (under the same launcher, {n} ranks)", line.join(" ")),
            };
            stopped.into()
        }
        Ok(stopped) => stopped.into(),
        Err(err) => err,
    }
}

/// The command line as text, bytes that are not UTF-8 shown as U+FFFD
/// (`std::env::args` panics on them, and they are a user's to give).
fn argv() -> Vec<String> {
    std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

/// `arg` as a POSIX shell reads it back: bare where it is plain, else in single quotes.
fn shell_quoted(arg: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c);
    if !arg.is_empty() && arg.chars().all(plain) {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', "'\\''"))
    }
}

/// Whether every rank of a run meets `err` at the same step: a stop and a divergence
/// are decided on what the ranks agreed (the signal, the reduced loss).
fn ends_every_rank(err: &anyhow::Error) -> bool {
    err.downcast_ref::<InterruptedError>().is_some()
        || err.downcast_ref::<DivergedError>().is_some()
        || err.downcast_ref::<PeerFailed>().is_some()
}

/// Prints `err`'s one line (on stderr). Of several ranks, rank 0 speaks for the
/// outcomes all share; another rank speaks only of its own failure, naming itself.
fn print_error(err: &anyhow::Error, world: &World) {
    let rank = world.rank();
    if let (Some(stopped), true) = (err.downcast_ref::<InterruptedError>(), rank > 0) {
        // Each rank's step, so a log shows they stopped together.
        tinygpt::errln!("rank {rank}: interrupted at step {}", stopped.step);
        return;
    }
    if world.size() > 1
        && (err.downcast_ref::<PeerFailed>().is_some() || rank > 0 && ends_every_rank(err))
    {
        return;
    }
    let who = match world.size() {
        1 => String::new(),
        _ => format!("rank {rank}: "),
    };
    if let Some(user) = find_user_error(err) {
        tinygpt::errln!("{who}error: {user}");
    } else if let Some(fix) = tinygpt::error::out_of_storage(err) {
        tinygpt::errln!("{who}error: {err:#}: {fix}");
    } else if let Some(stopped) = err.downcast_ref::<InterruptedError>() {
        tinygpt::errln!("{stopped}");
    } else if err.chain().any(|e| e.downcast_ref::<Stopped>().is_some()) {
        // What was given up and what was kept, in one line.
        tinygpt::errln!("{who}{err:#}");
    } else if let Some(diverged) = err.downcast_ref::<DivergedError>() {
        tinygpt::errln!("error: {diverged}");
    } else {
        tinygpt::errln!("{who}internal error: {err:#}");
    }
}

/// Ctrl-C or SIGTERM (on Unix also SIGHUP, SIGUSR1, SIGUSR2) asks the command to stop
/// (training finishes its step, writes a checkpoint and stops; other work gives up
/// within about a second). A second signal exits at once, saying so and writing
/// nothing more; on Unix only one a second or more after the first, as a signal within
/// it is the same stop delivered twice (GNU `timeout` signals the process and then its
/// process group; so does a shell's `kill` of a job). On Windows the same through its C
/// runtime's SIGINT (Ctrl-C in a console) and SIGTERM.
fn stop_on_signals(pipe: bool) -> anyhow::Result<Stop> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let flag = Arc::new(AtomicI32::new(0));
    // A closed pipe: every later write raises it again, so it never exits at once (the
    // stop's own messages would end the process before its checkpoint); the writes
    // after it fail quietly (`progress`, `print_error`).
    #[cfg(unix)]
    if pipe {
        let flag = Arc::clone(&flag);
        let sigpipe = signal_hook::consts::SIGPIPE;
        // Safety: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            signal_hook::low_level::register(sigpipe, move || {
                let _ = flag.compare_exchange(0, sigpipe, Ordering::SeqCst, Ordering::SeqCst);
            })?;
        }
    }
    #[cfg(not(unix))]
    let _ = pipe;
    // SIGUSR1/2: what a batch system sends ahead of a job's time limit (Slurm's
    // --signal=USR1@120) and mpirun forwards; SIGHUP: a terminal that closed (an ssh
    // session dropped), unless the run was started to outlive it (nohup ignores it).
    #[cfg(unix)]
    let signals = {
        use signal_hook::consts::{SIGHUP, SIGUSR1, SIGUSR2};
        let mut signals = vec![SIGINT, SIGTERM, SIGUSR1, SIGUSR2];
        if !ignored(SIGHUP) {
            signals.push(SIGHUP);
        }
        signals
    };
    #[cfg(unix)]
    {
        // When the first stop signal came (ms on the monotonic clock; 0: none yet).
        let first = Arc::new(std::sync::atomic::AtomicU64::new(0));
        for signal in signals {
            let (flag, first) = (Arc::clone(&flag), Arc::clone(&first));
            // Safety: the handler calls only async-signal-safe functions
            // (clock_gettime, write, _exit) and atomics.
            unsafe {
                signal_hook::low_level::register(signal, move || {
                    let now = monotonic_ms().max(1);
                    match first.compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst) {
                        Ok(_) => flag.store(signal, Ordering::SeqCst),
                        Err(at) if now.saturating_sub(at) < SAME_STOP_MS => {}
                        Err(_) => {
                            let said = SECOND_STOP.as_bytes();
                            libc::write(2, said.as_ptr().cast(), said.len());
                            libc::_exit(128 + signal);
                        }
                    }
                })?;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let asked = Arc::new(std::sync::atomic::AtomicBool::new(false));
        for signal in [SIGINT, SIGTERM] {
            // Registered first, so it sees `asked` as it was before this signal.
            signal_hook::flag::register_conditional_shutdown(
                signal,
                128 + signal,
                Arc::clone(&asked),
            )?;
            signal_hook::flag::register(signal, Arc::clone(&asked))?;
            let flag = Arc::clone(&flag);
            // Safety: the handler only stores to an atomic, which is async-signal-safe.
            unsafe {
                signal_hook::low_level::register(signal, move || {
                    flag.store(signal, Ordering::SeqCst)
                })?;
            }
        }
    }
    Ok(Stop::from_flag(flag))
}

/// A stop signal this soon after the first is the first delivered again.
#[cfg(unix)]
const SAME_STOP_MS: u64 = 1000;

/// What a second stop signal's exit says (written from the handler: no formatting).
#[cfg(unix)]
const SECOND_STOP: &str = "\nstopped at once by a second signal: what was being written is not (files written before stay whole; a run resumes from its last checkpoint)\n";

/// Milliseconds on the monotonic clock (async-signal-safe).
#[cfg(unix)]
fn monotonic_ms() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // Safety: clock_gettime writes only `now`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1000 + now.tv_nsec as u64 / 1_000_000
}

/// Whether `signal` was set to be ignored when this process started (`nohup` does so
/// for SIGHUP).
#[cfg(unix)]
fn ignored(signal: i32) -> bool {
    // Safety: a null new action only reads the current one into `old`.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, std::ptr::null(), &mut old) == 0
            && old.sa_sigaction == libc::SIG_IGN
    }
}

/// clap's answer to a command line it cannot parse, in one line (its tips and the
/// command's usage folded in, `--help` named); a flag named like a config key
/// (`--max-iters 10`) is told to use `--set`, and a negative count says what is taken.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit()
    }
    if e.kind() == ErrorKind::InvalidUtf8 {
        // clap says only "invalid UTF-8 was detected in one or more arguments".
        if let Some(bad) = std::env::args_os().skip(1).find(|a| a.to_str().is_none()) {
            tinygpt::errln!(
                "error: argument {bad:?} is not UTF-8 text, which --set, --prompt and the other text arguments take; a file named in another encoding can be renamed (e.g. convmv -f latin1 -t utf8)"
            );
            return ExitCode::from(exit_code::USER as u8);
        }
    }
    let args = argv();
    let line = config_key_flag(&e, &args)
        .or_else(|| negative_count(&e, &args))
        .unwrap_or_else(|| one_line(&e, &args));
    tinygpt::errln!("error: {line}");
    ExitCode::from(exit_code::USER as u8)
}

/// `--max-iters 10`: there is no such flag, the config key is set with `--set`.
fn config_key_flag(e: &clap::Error, args: &[String]) -> Option<String> {
    let flag = unknown_argument(e)?;
    let (name, inline) = match flag.split_once('=') {
        Some((name, value)) => (name.to_string(), Some(value.to_string())),
        None => (flag.clone(), None),
    };
    let key = tinygpt::config::key_named(&name)?;
    let value = inline
        .or_else(|| {
            let at = args
                .iter()
                .position(|a| a.split('=').next() == Some(&name))?;
            match args[at].split_once('=') {
                Some((_, value)) => Some(value.to_string()),
                None => args.get(at + 1).filter(|v| !v.starts_with("--")).cloned(),
            }
        })
        .unwrap_or_else(|| "VALUE".into());
    Some(format!(
        "there is no flag {name}; config values are set with --set: --set {key}={value}"
    ))
}

/// `--max-new-tokens -5`: clap takes `-5` for a flag; the flag before it takes a count.
fn negative_count(e: &clap::Error, args: &[String]) -> Option<String> {
    let value = unknown_argument(e)?;
    value.parse::<f64>().ok()?;
    let at = args.iter().position(|a| *a == value)?;
    let flag = args[..at].last().filter(|f| f.starts_with("--"))?;
    Some(format!(
        "{flag} {value}: a negative number is not taken here (`{} --help` says what {flag} takes)",
        command_of(args)
    ))
}

fn unknown_argument(e: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    match (e.kind(), e.get(ContextKind::InvalidArg)) {
        (ErrorKind::UnknownArgument, Some(ContextValue::String(arg))) => Some(arg.clone()),
        _ => None,
    }
}

/// `tinygpt generate` when the arguments name a subcommand, else `tinygpt`.
fn command_of(args: &[String]) -> String {
    let cli = <Cli as clap::CommandFactory>::command();
    match args.get(1) {
        Some(sub) if cli.find_subcommand(sub).is_some() => format!("tinygpt {sub}"),
        _ => "tinygpt".into(),
    }
}

/// `--dtype`'s values, for clap's check and the shells' completions.
fn weight_formats() -> clap::builder::PossibleValuesParser {
    ["f32", "bf16", "int8", "int4"].into()
}

/// `--kv-dtype`'s values.
fn kv_formats() -> clap::builder::PossibleValuesParser {
    ["f32", "bf16", "int8"].into()
}

/// clap's message (several lines: the error, a tip, possible values, the usage) as one.
fn one_line(e: &clap::Error, args: &[String]) -> String {
    let text = e.render().to_string();
    let mut line = String::new();
    for part in text.lines().map(str::trim) {
        if part.is_empty() || part.starts_with("For more information") || part.starts_with("Usage:")
        {
            continue;
        }
        let part = part.strip_prefix("error: ").unwrap_or(part);
        let part = part.strip_prefix("tip: ").unwrap_or(part);
        let part = part.trim_start_matches('[').trim_end_matches(']');
        if !line.is_empty() {
            line.push_str(if line.ends_with(':') { " " } else { "; " });
        }
        line.push_str(part);
    }
    format!("{line}; `{} --help` lists what it takes", command_of(args))
}

#[global_allocator]
static ALLOCATOR: alloc::CacheLineAligned = alloc::CacheLineAligned;

fn main() -> ExitCode {
    // The fused CUDA code, and candle's Metal ops, check themselves before their first
    // run on a GPU.
    #[cfg(any(feature = "cuda", feature = "cuda-emulator", feature = "metal"))]
    tinygpt::engine::set_first_use_check(tinygpt::doctor::first_use_check);
    // Like any Unix filter: `tinygpt generate ... | head` ends quietly when the reader
    // goes away, instead of panicking on a closed stdout.
    #[cfg(unix)]
    // Safety: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    // A server keeps serving when whoever reads its log goes away (`tinygpt serve 2>&1 |
    // head`, a supervisor restarted): its log writes then fail, and are let go, instead
    // of the signal ending the process and every request with it.
    #[cfg(unix)]
    if matches!(cli.command, Command::Serve(_)) {
        // Safety: set before any thread starts, as above.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
    }
    for checked in [
        tinygpt::cpu::isa::cap_from_env().map(|_| ()),
        tinygpt::cpu::matvec::order_from_env().map(|_| ()),
        tinygpt::cpu::kernels::asks_ahead_from_env().map(|_| ()),
    ] {
        if let Err(message) = checked {
            tinygpt::errln!("error: {message}");
            return ExitCode::from(exit_code::USER as u8);
        }
    }
    // Only training runs as several ranks: MPI is joined for it alone, and any other
    // command started by a launcher of several ranks is refused.
    let world = match &cli.command {
        Command::Train(_) => tinygpt::parallel::join(),
        _ => match Launcher::detect().filter(Launcher::several) {
            Some(launcher) => Err(tinygpt::error::user_error(format!(
                "started by {} as rank {} of {}: only `tinygpt train` runs as several ranks; run this command as one process",
                launcher.name,
                launcher.rank,
                launcher.size_name()
            ))),
            None => Ok(World::single()),
        },
    };
    let world = match world {
        Ok(world) => world,
        Err(err) => {
            print_error(&err, &World::single());
            return ExitCode::from(exit_code_of(&err) as u8);
        }
    };
    let result = run(cli, &world);
    if let Err(err) = &result {
        print_error(err, &world);
    }
    // MPI ends here (MPI_Finalize), after every rank's last collective.
    drop(world);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => ExitCode::from(exit_code_of(&err) as u8),
    }
}

#[cfg(test)]
mod tests {
    use super::seconds;
    use std::time::Duration;

    #[test]
    fn collective_timeouts_take_decimals() {
        assert_eq!(seconds("2.5"), Ok(Duration::from_millis(2500)));
        assert_eq!(seconds(" 1800 "), Ok(Duration::from_secs(1800)));
        assert_eq!(seconds("0"), Ok(Duration::ZERO));
        for wrong in ["-1", "inf", "nan", "", "5s"] {
            assert!(seconds(wrong).is_err(), "{wrong}");
        }
    }
}
