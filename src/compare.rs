//! Runs side by side: what differs between their configs, and how each went.
//!
//! A run folder is read as it is, finished or still training: its `config.toml` (all
//! settings, defaults filled in) and its `metrics.jsonl` (a line being written is
//! skipped). Each run is named by the settings in which it differs from the others, as
//! `n_layer=6 lr=0.0003`, so a legend says what the experiment varied.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::Serialize;

use crate::config::Config;
use crate::model::ModelSpec;
use crate::plot::Curves;
use crate::user_bail;

/// Settings that name or place a run rather than change it.
const NOT_SETTINGS: [&str; 2] = ["run.name", "run.out_dir"];

/// One run as read from its folder.
#[derive(Debug, Clone)]
pub struct Run {
    pub dir: PathBuf,
    /// Every setting as `section.key` -> value, from config.toml (empty if none yet),
    /// and [`RANKS`] from state.json.
    pub settings: BTreeMap<String, String>,
    pub parameters: Option<usize>,
    pub tokens_per_step: Option<usize>,
    pub curves: Curves,
    /// (step, elapsed seconds) of each logged training step.
    pub elapsed: Vec<(f64, f64)>,
    /// tokens/s of each logged training step.
    pub tokens_per_s: Vec<f64>,
    /// The step of its checkpoint (state.json), if it has one.
    pub checkpoint_step: Option<usize>,
    /// Each resume that changed a setting, as [`resume_note`] words it.
    pub resumes: Vec<String>,
    /// Why its config.toml could not be read, where it could not.
    pub config_error: Option<String>,
}

/// A row of the comparison table.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Row {
    /// The run folder's name (its path where two runs share a name).
    pub run: String,
    /// The run folder as given (none on the server's dashboard, which never shows its
    /// own paths).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    /// The settings in which this run differs from the others: `key=value`.
    pub differs: Vec<String>,
    pub parameters: Option<usize>,
    pub steps: usize,
    pub best_val_loss: Option<f64>,
    pub best_val_step: Option<usize>,
    /// Median over the logged steps.
    pub tokens_per_s: Option<f64>,
    pub wall_s: Option<f64>,
}

/// Sequences in one optimiser step over all ranks, as the run's state.json records it
/// (None before its first checkpoint, or in one from before it was kept).
fn sequences_per_step(dir: &Path) -> Option<usize> {
    saved_state(dir)?["sequences_per_step"]
        .as_u64()
        .filter(|&n| n > 0)
        .map(|n| n as usize)
}

/// The pseudo-setting a run's row shows its process count by (`ranks=2`).
pub const RANKS: &str = "run.ranks";

/// Processes that trained the run's last steps, as its state.json records them (one in
/// a checkpoint from before it was kept).
pub fn ranks_in(state: &serde_json::Value) -> usize {
    state["ranks"].as_u64().map_or(1, |n| n.max(1) as usize)
}

/// The run's state.json as JSON, if it has a readable one.
fn saved_state(dir: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join(crate::checkpoint::STATE_FILE)).ok()?;
    serde_json::from_str(&text).ok()
}

impl Run {
    /// Reads the run folder `dir`.
    pub fn read(dir: &Path) -> Result<Self> {
        let metrics = dir.join(crate::checkpoint::METRICS_FILE);
        let config = dir.join(crate::checkpoint::CONFIG_FILE);
        if !dir.exists() {
            user_bail!(
                "run folder {} does not exist; check the path (runs are folders under checkpoints/)",
                dir.display()
            );
        }
        if !metrics.exists() && !config.exists() {
            user_bail!(
                "{} is not a run folder (no metrics.jsonl or config.toml); pass folders under checkpoints/",
                dir.display()
            );
        }
        let mut config_error = None;
        let read = std::fs::read_to_string(&config).map(|text| Config::from_run_toml(&text));
        let (settings, parameters, tokens_per_step) = match read {
            // A damaged config.toml takes this run's settings out of the comparison,
            // not the comparison of the others.
            Ok(Err(e)) => {
                config_error = Some(format!(
                    "{}: {e:#}; its settings are left out of the comparison",
                    config.display()
                ));
                (BTreeMap::new(), None, None)
            }
            Ok(Ok(config)) => {
                // A step of a data-parallel run is every rank's: state.json says how
                // many sequences (config.toml holds one rank's batch).
                let block = config.model.block_size;
                let tokens = match sequences_per_step(dir) {
                    Some(sequences) => sequences * block,
                    None => config.train.tokens_per_step(block),
                };
                let mut settings = flatten(&config);
                // How many processes trained it is not in config.toml (the launcher
                // chose it), yet two runs differing only in it are an experiment: a
                // step of 2 ranks is twice the batch.
                if let Some(ranks) = saved_state(dir).as_ref().map(ranks_in) {
                    settings.insert(RANKS.to_string(), ranks.to_string());
                }
                (
                    settings,
                    Some(ModelSpec::new(&config.model).len()),
                    Some(tokens),
                )
            }
            // Still before its first checkpoint: only the metrics tell.
            Err(_) => (BTreeMap::new(), None, None),
        };
        // Damaged lines (not UTF-8, not JSON) are passed over, as in `plot`.
        let text =
            String::from_utf8_lossy(&std::fs::read(&metrics).unwrap_or_default()).into_owned();
        let mut elapsed = Vec::new();
        let mut tokens_per_s = Vec::new();
        let mut resumes = Vec::new();
        for record in text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        {
            if let Some(note) = resume_note(&record).filter(|_| resumes.len() < MAX_RESUMES) {
                resumes.push(note);
            }
            let (Some(step), Some(seconds)) =
                (record["step"].as_f64(), record["elapsed_s"].as_f64())
            else {
                continue;
            };
            elapsed.push((step, seconds));
            if let Some(rate) = record["tokens_per_s"].as_f64() {
                tokens_per_s.push(rate);
            }
        }
        elapsed.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(Self {
            dir: dir.to_path_buf(),
            settings,
            parameters,
            tokens_per_step,
            curves: Curves::from_metrics(&text),
            elapsed,
            tokens_per_s,
            checkpoint_step: saved_state(dir)
                .and_then(|state| state["step"].as_u64())
                .map(|step| step as usize),
            resumes,
            config_error,
        })
    }

    pub fn name(&self) -> String {
        self.dir.file_name().map_or_else(
            || self.dir.display().to_string(),
            |n| n.to_string_lossy().into(),
        )
    }

    /// The last step logged (training or evaluation).
    pub fn steps(&self) -> usize {
        let c = &self.curves;
        c.train
            .iter()
            .chain(&c.eval_val)
            .map(|p| p.0 as usize)
            .max()
            .unwrap_or(0)
    }

    /// The seconds the run had trained at `step`, interpolated between logged steps.
    pub fn seconds_at(&self, step: f64) -> Option<f64> {
        let e = &self.elapsed;
        let after = e.iter().position(|p| p.0 >= step)?;
        if after == 0 || e[after].0 == step {
            return Some(e[after].1 * (step / e[after].0.max(1.0)).min(1.0));
        }
        let (a, b) = (e[after - 1], e[after]);
        Some(a.1 + (b.1 - a.1) * (step - a.0) / (b.0 - a.0))
    }
}

/// Resumes with changed settings a run's row lists at most (a metrics.jsonl is the
/// run's to write, and the dashboard reads any).
pub const MAX_RESUMES: usize = 8;

/// What a metrics.jsonl record of a resume with changed settings says, as a run's row
/// adds it to what differs: `resumed at 1000: max_iters 1000->2000`. A run resumed to a
/// longer max_iters (its learning rate decayed toward the old end first) is then told
/// from one trained to the new one from the start, whose config.toml is the same.
pub fn resume_note(record: &serde_json::Value) -> Option<String> {
    const MAX_CHANGES: usize = 6;
    let clip = |s: &str| -> String {
        match s.char_indices().nth(32) {
            Some((end, _)) => format!("{}...", &s[..end]),
            None => s.to_string(),
        }
    };
    let step = record["step"].as_u64()?;
    let changed = record["resumed"].as_object().filter(|c| !c.is_empty())?;
    let mut parts: Vec<String> = changed
        .iter()
        .take(MAX_CHANGES)
        .map(|(key, pair)| {
            let value = |i: usize| pair[i].as_str().map_or("-".to_string(), clip);
            let short = key.rsplit('.').next().unwrap_or(key);
            format!("{} {}->{}", clip(short), value(0), value(1))
        })
        .collect();
    if changed.len() > MAX_CHANGES {
        parts.push(format!("{} more", changed.len() - MAX_CHANGES));
    }
    Some(format!("resumed at {step}: {}", parts.join(", ")))
}

/// A config as `section.key` -> value, every setting present.
pub fn flatten(config: &Config) -> BTreeMap<String, String> {
    // Defaults spelled out: a model imported from Hugging Face (n_kv_head = 4) is the
    // run it was exported from (n_kv_head left out).
    let config = Config {
        model: config.model.resolved(),
        ..config.clone()
    };
    let table = toml::Table::try_from(&config).expect("a Config serialises to a table");
    let mut out = BTreeMap::new();
    for (section, value) in table {
        match value {
            toml::Value::Table(keys) => {
                for (key, value) in keys {
                    out.insert(format!("{section}.{key}"), show(&value));
                }
            }
            other => {
                out.insert(section, show(&other));
            }
        }
    }
    out
}

/// `key = wanted (the <other> has had)`: one setting two flattened configs give
/// differently, for a refusal or a note to name.
pub fn difference(
    key: &str,
    wanted: &BTreeMap<String, String>,
    had: &BTreeMap<String, String>,
    other: &str,
) -> String {
    let shown = |v: Option<&String>| v.map_or("none", String::as_str).to_string();
    format!(
        "{key} = {} ({other} has {})",
        shown(wanted.get(key)),
        shown(had.get(key))
    )
}

/// A setting's value as the table shows it (strings without their quotes).
pub fn show(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The settings whose values are not the same in every run (a setting missing from a
/// run counts as a value of its own), in key order.
pub fn differing_keys(runs: &[BTreeMap<String, String>]) -> Vec<String> {
    let keys: BTreeSet<&String> = runs.iter().flat_map(|r| r.keys()).collect();
    keys.into_iter()
        .filter(|k| !NOT_SETTINGS.contains(&k.as_str()))
        .filter(|k| {
            let mut values = runs.iter().map(|r| r.get(*k));
            let first = values.next().flatten();
            values.any(|v| v != first)
        })
        .cloned()
        .collect()
}

/// [`differing_keys`], each compared among the runs that use it: a char run's
/// `tokenizer.vocab_size` (unused, [`without_unused`]) differs from nothing.
pub fn differing_used_keys(runs: &[BTreeMap<String, String>]) -> Vec<String> {
    let used: Vec<BTreeMap<String, String>> =
        runs.iter().map(|r| without_unused(r.clone())).collect();
    differing_keys(runs)
        .into_iter()
        .filter(|key| {
            let values: Vec<Option<&String>> = runs
                .iter()
                .zip(&used)
                .filter(|(all, used)| !all.contains_key(key) || used.contains_key(key))
                .map(|(_, used)| used.get(key))
                .collect();
            values.windows(2).any(|pair| pair[0] != pair[1])
        })
        .collect()
}

/// `key=value` for each differing key, keys shortened to their last part (`n_layer`)
/// unless two differing keys share it.
pub fn describe(settings: &BTreeMap<String, String>, differing: &[String]) -> Vec<String> {
    let short = |k: &str| k.rsplit('.').next().unwrap_or(k).to_string();
    differing
        .iter()
        .map(|key| {
            let clash = differing
                .iter()
                .filter(|other| short(other) == short(key))
                .count()
                > 1;
            let name = if clash { key.clone() } else { short(key) };
            let value = settings.get(key).map_or("-", String::as_str);
            format!("{name}={value}")
        })
        .collect()
}

/// Reads the run folders, in the order given.
pub fn read_runs(dirs: &[PathBuf]) -> Result<Vec<Run>> {
    if dirs.is_empty() {
        user_bail!("no runs to compare; pass run folders, e.g. checkpoints/*");
    }
    dirs.iter().map(|d| Run::read(d)).collect()
}

/// The table's rows, and each run's legend label (what differs, or its name).
pub fn rows(runs: &[Run]) -> Vec<Row> {
    // A run before its first checkpoint has no config yet: it takes no part in what
    // differs (else every setting would), and is named by its folder.
    let settings: Vec<BTreeMap<String, String>> = runs
        .iter()
        .filter(|r| !r.settings.is_empty())
        .map(|r| r.settings.clone())
        .collect();
    let differing = differing_used_keys(&settings);
    let names: Vec<String> = runs.iter().map(Run::name).collect();
    runs.iter()
        .zip(&names)
        .map(|(run, name)| {
            let best = run
                .curves
                .eval_val
                .iter()
                .copied()
                .min_by(|a, b| a.1.total_cmp(&b.1));
            Row {
                run: match names.iter().filter(|n| *n == name).count() {
                    1 => name.clone(),
                    _ => run.dir.display().to_string(),
                },
                dir: Some(run.dir.clone()),
                differs: if run.settings.is_empty() {
                    Vec::new()
                } else {
                    describe(&without_unused(run.settings.clone()), &differing)
                }
                .into_iter()
                .chain(run.resumes.iter().cloned())
                .collect(),
                parameters: run.parameters,
                steps: run.steps().max(run.checkpoint_step.unwrap_or(0)),
                best_val_loss: best.map(|b| b.1),
                best_val_step: best.map(|b| b.0 as usize),
                tokens_per_s: median(&run.tokens_per_s),
                wall_s: run.elapsed.last().map(|p| p.1),
            }
        })
        .collect()
}

/// `settings` without those its run does not use: a char tokenizer's vocabulary is
/// the corpus's characters, whatever `tokenizer.vocab_size` and `train_bytes` say.
pub fn without_unused(mut settings: BTreeMap<String, String>) -> BTreeMap<String, String> {
    if settings.get("tokenizer.kind").map(String::as_str) == Some("char") {
        settings.remove("tokenizer.vocab_size");
        settings.remove("tokenizer.train_bytes");
    }
    settings
}

/// A note where the runs' tokenizers differ: a loss per token of one tokenizer is not
/// a loss per token of another (a char model's 1.5 is not a BPE model's 3.5), so
/// their curves do not compare; bits per byte do.
pub fn tokenizers_note(runs: &[Run]) -> Option<String> {
    let tokenizer = |r: &Run| {
        let get = |k: &str| r.settings.get(k).cloned().unwrap_or_default();
        match get("tokenizer.kind").as_str() {
            "char" => "char".to_string(),
            kind => format!("{kind} {}", get("model.vocab_size")),
        }
    };
    let kinds: BTreeSet<String> = runs
        .iter()
        .filter(|r| !r.settings.is_empty())
        .map(tokenizer)
        .collect();
    (kinds.len() > 1).then(|| {
        format!(
            "note: these runs tokenize differently ({}): a loss per token of one is not one of another; `tinygpt eval --checkpoint RUN --text FILE` gives bits per byte, which compare",
            kinds.into_iter().collect::<Vec<_>>().join(", ")
        )
    })
}

/// The most characters of a legend entry: longer ones (runs that differ in many
/// settings) ran off the picture's right edge, the settings that mattered cut away.
const LEGEND_CHARS: usize = 48;

/// What a legend calls a run: its differing settings where they fit (a sweep's grid
/// values), else its name and as many of them as fit; its name if none differ.
pub fn label(row: &Row) -> String {
    let differs = row.differs.join(" ");
    if differs.is_empty() {
        return row.run.clone();
    }
    if differs.chars().count() <= LEGEND_CHARS {
        return differs;
    }
    let named = format!("{}: {differs}", row.run);
    match named.char_indices().nth(LEGEND_CHARS - 3) {
        Some((end, _)) => format!("{}...", &named[..end]),
        None => named,
    }
}

fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// The rows as an aligned text table. The settings that differ come last, wrapped to
/// lines of at most `DIFFERS_WIDTH` characters under their column, so unrelated runs
/// (which differ in many settings) keep the table readable.
pub fn table(rows: &[Row]) -> String {
    let header = [
        "run", "params", "steps", "best val", "at step", "tok/s", "wall", "differs",
    ];
    let cells: Vec<[String; 7]> = rows
        .iter()
        .map(|r| {
            let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
            [
                r.run.clone(),
                opt(r.parameters.map(parameters)),
                r.steps.to_string(),
                opt(r.best_val_loss.map(|l| format!("{l:.4}"))),
                opt(r.best_val_step.map(|s| s.to_string())),
                opt(r.tokens_per_s.map(|t| format!("{t:.0}"))),
                opt(r.wall_s.map(|s| format!("{s:.1}s"))),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..7)
        .map(|i| {
            cells
                .iter()
                .map(|c| c[i].chars().count())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let aligned = |cells: &[&str]| -> String {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}  "))
            .collect()
    };
    let indent = " ".repeat(widths.iter().map(|w| w + 2).sum());
    let mut out = aligned(&header[..7]) + header[7] + "\n";
    for (c, row) in cells.iter().zip(rows) {
        let mut lines = wrap(&row.differs, DIFFERS_WIDTH).into_iter();
        let first = lines.next().unwrap_or_else(|| "-".into());
        let cells: Vec<&str> = c.iter().map(String::as_str).collect();
        out += &format!("{}{first}\n", aligned(&cells));
        for more in lines {
            out += &format!("{indent}{more}\n");
        }
    }
    out
}

/// A parameter count at a glance: `4.7k`, `0.85M`, `124.44M`.
fn parameters(count: usize) -> String {
    match count {
        n if n >= 100_000 => format!("{:.2}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}k", n as f64 / 1e3),
        n => n.to_string(),
    }
}

/// The longest line of the differs column.
const DIFFERS_WIDTH: usize = 60;

/// `items` joined by spaces into lines of at most `width` characters (an item longer
/// than that has a line of its own).
fn wrap(items: &[String], width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for item in items {
        match lines.last_mut() {
            Some(line) if line.chars().count() + 1 + item.chars().count() <= width => {
                line.push(' ');
                line.push_str(item);
            }
            _ => lines.push(item.clone()),
        }
    }
    lines
}

/// What the comparison plot puts on its x axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum XAxis {
    Steps,
    Tokens,
    Time,
}

/// A run's curves with x in the chosen unit: (label, val points, train points).
pub type Series = (String, Vec<(f64, f64)>, Vec<(f64, f64)>);

/// Each run's val and train loss against `x`; runs that cannot say (tokens without a
/// config, time without step logs) are left out with a reason.
pub fn series(runs: &[Run], rows: &[Row], x: XAxis) -> (Vec<Series>, Vec<String>) {
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    let labels: Vec<String> = rows.iter().map(label).collect();
    for ((run, row), label) in runs.iter().zip(rows).zip(&labels) {
        // Runs alike in every setting would share a legend entry: named apart.
        let label = match labels.iter().filter(|l| *l == label).count() {
            1 => label.clone(),
            _ => format!("{label} ({})", row.run),
        };
        let convert = |points: &[(f64, f64)]| -> Option<Vec<(f64, f64)>> {
            points
                .iter()
                .map(|&(step, loss)| {
                    let x = match x {
                        XAxis::Steps => Some(step),
                        XAxis::Tokens => run.tokens_per_step.map(|t| step * t as f64),
                        XAxis::Time => run.seconds_at(step),
                    }?;
                    Some((x, loss))
                })
                .collect()
        };
        match (convert(&run.curves.eval_val), convert(&run.curves.train)) {
            (Some(val), Some(train)) if !(val.is_empty() && train.is_empty()) => {
                out.push((label, val, train))
            }
            (Some(_), Some(_)) => skipped.push(match run.checkpoint_step {
                // A finished or saved run whose metrics are gone: not "yet".
                Some(step) if step > 0 => format!(
                    "{}: its metrics.jsonl holds no losses (missing, emptied or not JSON lines), though its checkpoint is at step {step}",
                    row.run
                ),
                _ => format!("{}: no losses yet", row.run),
            }),
            _ => skipped.push(format!("{}: cannot place it on that axis", row.run)),
        }
    }
    (out, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model imported from Hugging Face spells out what the run it came from left to
    /// its defaults (a Llama's K/V heads and SwiGLU width): the same settings.
    #[test]
    fn defaults_spelled_out_are_the_same_settings() {
        let run = Config::from_toml_str("[model]\narch = \"llama\"\nn_embd = 64\n", &[]).unwrap();
        let mut imported = run.clone();
        imported.model.n_kv_head = Some(run.model.n_head);
        imported.model.mlp_hidden = Some(176);
        assert_eq!(run.model.mlp_hidden(), 176);
        assert_eq!(flatten(&run), flatten(&imported));
        imported.model.mlp_hidden = Some(192);
        assert_ne!(flatten(&run), flatten(&imported));
    }

    fn settings(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn unrelated_runs_keep_the_table_readable() {
        let many: Vec<String> = (0..30).map(|i| format!("key{i}=value{i}")).collect();
        let row = |run: &str, differs: Vec<String>| Row {
            run: run.into(),
            dir: None,
            differs,
            parameters: Some(800_000),
            steps: 10,
            best_val_loss: Some(2.0),
            best_val_step: Some(10),
            tokens_per_s: None,
            wall_s: None,
        };
        let text = table(&[row("a", many.clone()), row("b", vec![])]);
        let lines: Vec<&str> = text.lines().collect();
        let first = lines[1];
        let column = first.find("key0").expect("the differs column");
        // Wrapped under its column, no line much wider than the column allows.
        for line in &lines[1..lines.len() - 1] {
            assert!(line.chars().count() <= column + DIFFERS_WIDTH, "{line}");
        }
        let continued = &lines[2];
        assert!(continued[..column].trim().is_empty() && continued[column..].starts_with("key"));
        let shown: Vec<&str> = lines[1..lines.len() - 1]
            .iter()
            .flat_map(|l| l[column..].split_whitespace())
            .collect();
        assert_eq!(shown, many.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(lines.last().unwrap().starts_with("b ") && lines.last().unwrap().ends_with('-'));
    }

    /// A resume record's note: its changes in order, long values clipped, at most six
    /// changes named; records that are not resumes with changes give none.
    #[test]
    fn a_resume_is_worded_briefly() {
        use serde_json::json;
        let note = |v: serde_json::Value| resume_note(&v);
        assert_eq!(
            note(
                json!({"step": 40, "resumed": {"train.lr": ["0.001", "0.0003"], "train.max_iters": ["40", "80"]}})
            ),
            Some("resumed at 40: lr 0.001->0.0003, max_iters 40->80".into())
        );
        let long = "x".repeat(100);
        let clipped = note(json!({"step": 1, "resumed": {"train.init_from": [long, 7]}})).unwrap();
        assert_eq!(
            clipped,
            format!("resumed at 1: init_from {}...->-", "x".repeat(32))
        );
        let many: serde_json::Map<String, serde_json::Value> = (0..10)
            .map(|i| (format!("train.k{i}"), json!(["a", "b"])))
            .collect();
        let many = note(json!({"step": 2, "resumed": many})).unwrap();
        assert!(many.ends_with("k5 a->b, 4 more"), "{many}");
        for not in [
            json!({"step": 3, "resumed": {}}),
            json!({"step": 3, "loss": 1.0}),
            json!({"resumed": {"train.lr": ["1", "2"]}}),
        ] {
            assert_eq!(note(not), None);
        }
    }

    #[test]
    fn runs_are_named_by_what_differs() {
        let a = settings(&[
            ("run.name", "a"),
            ("model.n_layer", "4"),
            ("train.lr", "0.001"),
            ("model.dropout", "0.1"),
            ("seed", "1"),
        ]);
        let b = settings(&[
            ("run.name", "b"),
            ("model.n_layer", "6"),
            ("train.lr", "0.0003"),
            ("model.dropout", "0.1"),
            ("seed", "1"),
        ]);
        let keys = differing_keys(&[a.clone(), b.clone()]);
        assert_eq!(keys, ["model.n_layer", "train.lr"]);
        assert_eq!(describe(&b, &keys), ["n_layer=6", "lr=0.0003"]);
        // Two differing keys with the same last part keep their sections.
        let c = settings(&[("model.dropout", "0.2"), ("train.dropout", "1")]);
        let d = settings(&[("model.dropout", "0.0"), ("train.dropout", "2")]);
        let keys = differing_keys(&[c.clone(), d]);
        assert_eq!(
            describe(&c, &keys),
            ["model.dropout=0.2", "train.dropout=1"]
        );
        // A key one run lacks differs.
        let e = settings(&[("model.n_layer", "4")]);
        assert_eq!(differing_keys(&[e, BTreeMap::new()]), ["model.n_layer"]);
        // Identical runs: nothing differs, and the label is the name.
        assert!(differing_keys(&[a.clone(), a]).is_empty());
    }

    #[test]
    fn legend_labels_fit_and_name_the_run_when_cut() {
        let row = |run: &str, differs: &[&str]| Row {
            run: run.into(),
            dir: None,
            differs: differs.iter().map(|d| d.to_string()).collect(),
            parameters: None,
            steps: 0,
            best_val_loss: None,
            best_val_step: None,
            tokens_per_s: None,
            wall_s: None,
        };
        assert_eq!(label(&row("a", &[])), "a");
        assert_eq!(
            label(&row("a", &["n_layer=6", "lr=0.0003"])),
            "n_layer=6 lr=0.0003"
        );
        let many = [
            "corpus=data/shakespeare.txt",
            "arch=custom",
            "block_size=64",
            "n_layer=2",
        ];
        let cut = label(&row("base", &many));
        assert_eq!(cut, "base: corpus=data/shakespeare.txt arch=custom...");
        assert_eq!(cut.chars().count(), LEGEND_CHARS);
    }

    #[test]
    fn parameter_counts_read_at_a_glance() {
        assert_eq!(parameters(4_672), "4.7k");
        assert_eq!(parameters(999), "999");
        assert_eq!(parameters(850_000), "0.85M");
        assert_eq!(parameters(124_439_808), "124.44M");
    }

    #[test]
    fn time_is_interpolated_between_logged_steps() {
        let run = Run {
            dir: PathBuf::from("r"),
            settings: BTreeMap::new(),
            parameters: None,
            tokens_per_step: None,
            curves: Curves::default(),
            elapsed: vec![(10.0, 5.0), (20.0, 7.0)],
            tokens_per_s: vec![],
            checkpoint_step: None,
            resumes: vec![],
            config_error: None,
        };
        assert_eq!(run.seconds_at(15.0), Some(6.0));
        assert_eq!(run.seconds_at(20.0), Some(7.0));
        assert_eq!(run.seconds_at(0.0), Some(0.0));
        assert_eq!(run.seconds_at(5.0), Some(2.5));
        assert_eq!(run.seconds_at(30.0), None);
    }
}
