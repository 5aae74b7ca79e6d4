//! A run resumed from its checkpoint: the optimizer's moments and the batch sampler's
//! position restored, and what the resume changed (the schedule, the batch, the data,
//! the seed) said before it starts and recorded in metrics.jsonl, so that a curve that
//! bends at a resume says why.

use anyhow::Result;
use candle_core::Device;
use serde_json::json;

use super::schedule::learning_rate;
use crate::checkpoint::{RunDir, TrainState, OPTIMIZER_FILE};
use crate::config::{Config, TrainConfig};
use crate::data::BatchSampler;
use crate::engine::Engine;

/// A resumed run, as its checkpoint left it and as it goes on now.
pub(super) struct Resumed<'a> {
    /// The checkpoint's config.
    pub saved: &'a Config,
    /// Its state.json.
    pub state: &'a TrainState,
    /// The config the run goes on with.
    pub now: &'a Config,
    /// The corpus's fingerprint now, as [`TrainState::corpus_fingerprint`] keeps it.
    pub corpus_fingerprint: &'a str,
    /// Sequences in one step now, over all ranks.
    pub sequences_per_step: usize,
    /// Ranks now.
    pub ranks: usize,
}

impl Resumed<'_> {
    /// Whether the corpus at the checkpoint's path holds other text than it trained on
    /// (edited in place, or replaced).
    pub fn corpus_edited(&self) -> bool {
        let kind = |f: &str| f.split(':').next().unwrap_or("").to_string();
        self.state.corpus_fingerprint.as_ref().is_some_and(|saved| {
            self.saved.data.corpus == self.now.data.corpus
                && kind(saved) == kind(self.corpus_fingerprint)
                && saved != self.corpus_fingerprint
        })
    }

    /// What the resume changed of the data, the random streams and the batch, each a
    /// note: these are allowed (fine-tuning on more text is a resume), but the curve
    /// after them is not the one the run was on, and its validation loss may measure
    /// other text.
    pub fn notes(&self) -> Vec<String> {
        let (was, now) = (self.saved, self.now);
        let mut notes = Vec::new();
        if was.data.corpus != now.data.corpus || was.data.text_field != now.data.text_field {
            notes.push(format!(
                "note: the corpus is not the checkpoint's (data.corpus = {:?}, it trained on {:?}): the loss curve goes on over other text",
                now.data.corpus.display().to_string(),
                was.data.corpus.display().to_string()
            ));
        }
        if self.corpus_edited() {
            notes.push(format!(
                "note: corpus {} changed since the checkpoint was written (edited or replaced): training goes on over its new text, and the train/val split is drawn from it",
                now.data.corpus.display()
            ));
        }
        if was.data.val_fraction != now.data.val_fraction {
            notes.push(format!(
                "note: data.val_fraction is {} (the checkpoint's {}): the split moved, so validation now holds text the model trained on, or training text it was tested on",
                now.data.val_fraction, was.data.val_fraction
            ));
        }
        if was.run.seed != now.run.seed {
            notes.push(format!(
                "note: run.seed is {} (the checkpoint's {}): batches and dropout follow another stream from here, so the run is not the one it would have been",
                now.run.seed, was.run.seed
            ));
        }
        let (before, now_sequences) = (self.state.sequences_per_step, self.sequences_per_step);
        if before > 0 && before != now_sequences {
            let (train, ranks) = (&now.train, self.ranks);
            notes.push(format!(
                "note: a step was {before} sequences ({} rank{}) and is now {now_sequences} ({ranks} x train.batch_size {} x train.grad_accum {}); {}",
                self.state.ranks,
                crate::util::plural(self.state.ranks),
                train.batch_size,
                train.grad_accum,
                keep_the_batch(before, ranks, train.batch_size)
            ));
        }
        notes
    }

    /// What the resumed run says of its learning rate: the rate of its first step, and,
    /// where a changed schedule (a longer train.max_iters, say) makes it rise above the
    /// rate the checkpoint's last step had, that it does and why.
    pub fn rate(&self) -> String {
        let (cfg, step) = (&self.now.train, self.state.step);
        let now = learning_rate(step, cfg);
        let mut line = format!("learning rate {now:.3e} at step {step}");
        // Rising, and only because the schedule changed: warmup rises by itself.
        let saved = &self.saved.train;
        let before = Some(step)
            .filter(|&step| step > 0 && now > learning_rate(step, saved) * 1.01)
            .map(|step| learning_rate(step - 1, saved));
        if let Some(before) = before.filter(|&b| now > b * 1.01) {
            // Named by what changed: a doubled train.lr was said to be a longer decay.
            let mut why = Vec::new();
            if cfg.lr != saved.lr {
                why.push(format!(
                    "train.lr is {} (the checkpoint's {})",
                    cfg.lr, saved.lr
                ));
            }
            if cfg.lr_decay_iters() != saved.lr_decay_iters() {
                why.push(format!(
                    "the cosine decay now runs to step {} (train.lr_decay_iters, default train.max_iters), so the rate rises again",
                    cfg.lr_decay_iters()
                ));
            }
            if why.is_empty() {
                why.push("the schedule changed (train.warmup_iters, train.min_lr)".into());
            }
            line.push_str(&format!(
                ", up from {before:.3e} at the checkpoint: {}; the loss may rise too before it falls",
                why.join("; ")
            ));
        }
        line
    }

    /// The [train] settings the resume changed from the checkpoint's, as `train.key` ->
    /// [before, now] (TOML values as `compare` shows them), and what it trains on
    /// (data.corpus, "(edited)" where its text changed; data.text_field,
    /// data.val_fraction, run.seed). How a step is split (batch_size, grad_accum, and
    /// the ranks) counts only as the sequences a step holds, `train.sequences_per_step`:
    /// two ranks resumed as one process with twice the grad_accum train on as before,
    /// bit for bit.
    pub fn changed_settings(&self) -> serde_json::Map<String, serde_json::Value> {
        // A checkpoint from before sequences_per_step was kept (0) shows the keys.
        let split = ["batch_size", "grad_accum"];
        let before_sequences = self.state.sequences_per_step;
        let by_sequences = before_sequences > 0;
        let table = |t: &TrainConfig| toml::Table::try_from(t).unwrap_or_default();
        let (before, now) = (table(&self.saved.train), table(&self.now.train));
        let shown = |v: Option<&toml::Value>| v.map_or("-".to_string(), crate::compare::show);
        let mut changed: serde_json::Map<String, serde_json::Value> = differing_keys(&before, &now)
            .into_iter()
            .filter(|key| !(by_sequences && split.contains(&key.as_str())))
            .map(|key| {
                let pair = json!([shown(before.get(key)), shown(now.get(key))]);
                (format!("train.{key}"), pair)
            })
            .collect();
        if by_sequences && before_sequences != self.sequences_per_step {
            let pair = json!([
                before_sequences.to_string(),
                self.sequences_per_step.to_string()
            ]);
            changed.insert("train.sequences_per_step".into(), pair);
        }
        // What the run trains on, as the resume's notes name it: config.toml keeps
        // only the corpus of the last resume.
        let (was, now) = (self.saved, self.now);
        let corpus = |c: &Config| c.data.corpus.display().to_string();
        let mut now_corpus = corpus(now);
        if self.corpus_edited() {
            now_corpus.push_str(" (edited)");
        }
        let pairs = [
            ("data.corpus", corpus(was), now_corpus),
            (
                "data.text_field",
                was.data.text_field.clone(),
                now.data.text_field.clone(),
            ),
            (
                "data.val_fraction",
                was.data.val_fraction.to_string(),
                now.data.val_fraction.to_string(),
            ),
            (
                "run.seed",
                was.run.seed.to_string(),
                now.run.seed.to_string(),
            ),
        ];
        for (key, before, after) in pairs {
            if before != after {
                changed.insert(key.into(), json!([before, after]));
            }
        }
        changed
    }
}

/// The keys whose values two TOML tables give differently (a key in one only counts),
/// in key order: what a resume changed of a config section.
pub(super) fn differing_keys<'a>(before: &'a toml::Table, now: &'a toml::Table) -> Vec<&'a String> {
    let keys: std::collections::BTreeSet<&String> = before.keys().chain(now.keys()).collect();
    keys.into_iter()
        .filter(|key| before.get(*key) != now.get(*key))
        .collect()
}

/// How a resumed run on `ranks` ranks keeps steps of `sequences`: the smallest
/// gradient accumulation whose micro-batch is at most `batch_size`.
pub(super) fn keep_the_batch(sequences: usize, ranks: usize, batch_size: usize) -> String {
    if !sequences.is_multiple_of(ranks) {
        return format!(
            "no train.batch_size x train.grad_accum on {ranks} ranks makes {sequences} sequences: resume on a number of ranks that divides {sequences} to keep them"
        );
    }
    let per_rank = sequences / ranks;
    let accum = (1..=per_rank)
        .find(|a| per_rank.is_multiple_of(*a) && per_rank / a <= batch_size)
        .unwrap_or(per_rank);
    match per_rank / accum {
        b if b == batch_size => format!("set train.grad_accum={accum} to keep them"),
        b => format!("set train.batch_size={b} and train.grad_accum={accum} to keep them"),
    }
}

/// Puts a resumed run back where its checkpoint left it (the engine has its weights
/// already): AdamW moments, the batch sampler's position; metrics logged after the
/// checkpoint are dropped (by the `leader`, rank 0, which writes the run folder).
pub(super) fn restore(
    run: &RunDir,
    state: &TrainState,
    engine: &mut dyn Engine,
    sampler: &mut BatchSampler,
    leader: bool,
) -> Result<()> {
    let moments = run.load_tensors(state, OPTIMIZER_FILE, &Device::Cpu)?;
    engine.load_moments(&moments, &run.file(OPTIMIZER_FILE).display().to_string())?;
    sampler.set_position(parse_position(&state.sampler_position)?);
    if leader {
        run.truncate_metrics(state.step)?;
    }
    Ok(())
}

fn parse_position(s: &str) -> Result<u128> {
    if s.is_empty() {
        return Ok(0);
    }
    s.parse()
        .map_err(|_| crate::error::user_error(format!("state.json: bad RNG position {s:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resumed rate above the checkpoint's is said to rise for what changed: a larger
    /// train.lr, a decay that now ends later, or both (a doubled lr was said to be a
    /// longer decay).
    #[test]
    fn a_rising_rate_names_its_cause() {
        let mut saved = Config::default();
        saved.train.max_iters = 40;
        saved.train.warmup_iters = 2;
        let state = TrainState {
            step: 20,
            ..TrainState::default()
        };
        let rate = |now: &Config| {
            Resumed {
                saved: &saved,
                state: &state,
                now,
                corpus_fingerprint: "",
                sequences_per_step: 0,
                ranks: 1,
            }
            .rate()
        };
        let mut lr = saved.clone();
        lr.train.lr = 2.0 * saved.train.lr;
        let said = rate(&lr);
        assert!(
            said.contains("up from") && said.contains("train.lr is 0.002 (the checkpoint's 0.001)"),
            "{said}"
        );
        assert!(!said.contains("cosine decay"), "{said}");
        let mut longer = saved.clone();
        longer.train.max_iters = 80;
        let said = rate(&longer);
        assert!(
            said.contains("the cosine decay now runs to step 80") && !said.contains("train.lr is"),
            "{said}"
        );
        assert!(!rate(&saved).contains("up from"), "{}", rate(&saved));
    }

    #[test]
    fn a_resumed_step_is_kept_where_the_ranks_allow() {
        // 8 sequences a step (2 ranks x 4), resumed on 1, 4 and 3 ranks of 4 each.
        assert_eq!(
            keep_the_batch(8, 1, 4),
            "set train.grad_accum=2 to keep them"
        );
        assert_eq!(
            keep_the_batch(8, 4, 4),
            "set train.batch_size=2 and train.grad_accum=1 to keep them"
        );
        assert!(keep_the_batch(8, 3, 4)
            .starts_with("no train.batch_size x train.grad_accum on 3 ranks"));
        // A micro-batch no larger than the one that fitted.
        assert_eq!(
            keep_the_batch(24, 1, 8),
            "set train.grad_accum=3 to keep them"
        );
        assert_eq!(
            keep_the_batch(10, 1, 4),
            "set train.batch_size=2 and train.grad_accum=5 to keep them"
        );
    }
}
