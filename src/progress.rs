//! The terminal reporter: an indicatif progress bar with loss, learning rate, tokens/s
//! and ETA, and one line per evaluation.

use std::io::Write;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::train::{EvalLog, Reporter, RunInfo, StepLog, TrainSummary};

pub struct TerminalReporter {
    bar: Option<ProgressBar>,
    /// The last reading's figures, shown until the next (steps between readings have
    /// none, and an evaluation or a save writes over the message meanwhile).
    figures: String,
}

impl Default for TerminalReporter {
    fn default() -> Self {
        Self::new()
    }
}

impl TerminalReporter {
    pub fn new() -> Self {
        Self {
            bar: None,
            figures: String::new(),
        }
    }

    fn println(&self, line: &str) {
        match &self.bar {
            // Printed above the bar; on a non-terminal the bar is hidden and this is a
            // plain line on stderr.
            Some(bar) if !bar.is_hidden() => bar.println(line),
            // A closed stderr (`train ... | head`) is let go: the run stops on the
            // SIGPIPE that came with it, and saves.
            _ => {
                let _ = writeln!(std::io::stderr(), "{line}");
            }
        }
    }
}

impl Reporter for TerminalReporter {
    fn started(&mut self, info: &RunInfo) {
        self.println(&format!(
            "run {}: {:.2}M parameters, {} tokenizer ({} tokens{}), {} train / {} val tokens, {} tokens/step, device {}, {}",
            info.run_dir.display(),
            info.parameters as f64 / 1e6,
            info.tokenizer,
            info.vocab_size,
            match info.model_vocab_size > info.vocab_size {
                true => format!("; the model's {} rows are padded", info.model_vocab_size),
                false => String::new(),
            },
            info.train_tokens,
            info.val_tokens,
            info.tokens_per_step,
            info.device,
            info.engine,
        ));
        if info.start_step > 0 {
            self.println(&format!("resuming at step {}", info.start_step));
        }
        let bar = ProgressBar::with_draw_target(
            Some(info.max_iters as u64),
            ProgressDrawTarget::stderr_with_hz(4),
        );
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30.cyan/blue} step {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        bar.set_position(info.start_step as u64);
        bar.reset_eta();
        self.bar = Some(bar);
        // A sweep's next run shows none of the last run's figures.
        self.figures.clear();
    }

    fn step(&mut self, log: &StepLog) {
        if let Some(bar) = &self.bar {
            bar.set_position(log.step as u64);
            if let Some(m) = &log.measured {
                self.figures = format!(
                    "loss {:.4} lr {:.2e} {:.0} tok/s",
                    m.loss, log.lr, m.tokens_per_s
                );
            }
            bar.set_message(self.figures.clone());
        }
    }

    fn evaluating(&mut self, done: usize, total: usize) {
        // A long evaluation must not look like a hang: it shows on the bar.
        if let Some(bar) = &self.bar {
            bar.set_message(format!("evaluating: batch {done}/{total}"));
        }
    }

    fn saving(&mut self) {
        if let Some(bar) = &self.bar {
            bar.set_message("writing the checkpoint".to_string());
        }
    }

    fn eval(&mut self, log: &EvalLog) {
        self.println(&format!(
            "step {:>6}: train loss {:.4}, val loss {:.4}",
            log.step, log.train_loss, log.val_loss
        ));
        // The evaluation's count leaves the bar with it.
        if let Some(bar) = &self.bar {
            bar.set_message(self.figures.clone());
        }
    }

    fn note(&mut self, message: &str) {
        self.println(message);
    }

    fn finished(&mut self, summary: &TrainSummary) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        let _ = writeln!(
            std::io::stderr(),
            "done: step {}, train loss {}, val loss {}, {:.1} s; checkpoint in {}",
            summary.step,
            summary.train_loss.map_or("-".into(), |l| format!("{l:.4}")),
            summary.val_loss.map_or("-".into(), |l| format!("{l:.4}")),
            summary.elapsed_s,
            summary.run_dir.display()
        );
    }
}
