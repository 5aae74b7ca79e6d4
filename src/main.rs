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
