//! A sweep: one config, run at every combination of a few settings' values, one run
//! after another, each in its own run folder named from its values.
//!
//! Running the same sweep again continues it: complete runs are skipped, a run that was
//! interrupted resumes from its checkpoint, the rest start. Every point's config is
//! loaded and checked before anything trains, so a bad value fails at once.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::checkpoint::RunDir;
use crate::config::Config;
use crate::error::{DivergedError, InterruptedError};
use crate::train::{Reporter, Start, Trainer};
use crate::user_bail;
use crate::util::Stop;

/// One setting's values: `--grid model.n_layer=2,4,6`.
#[derive(Debug, Clone, PartialEq)]
pub struct Grid {
    pub key: String,
    pub values: Vec<String>,
}

impl Grid {
    pub fn parse(arg: &str) -> Result<Self> {
        let Some((key, values)) = arg.split_once('=') else {
            user_bail!("--grid {arg}: expected section.key=value1,value2,... (e.g. --grid model.n_layer=2,4)");
        };
        let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
        if key.trim().is_empty() || values.iter().any(String::is_empty) {
            user_bail!("--grid {arg}: expected section.key=value1,value2,... with no empty value");
        }
        Ok(Self {
            key: key.trim().to_string(),
            values,
        })
    }
}

/// One combination of the grids' values, and the run it makes.
#[derive(Debug, Clone)]
pub struct Point {
    /// `(key, value)` per grid, in grid order.
    pub values: Vec<(String, String)>,
    pub config: Config,
}

impl Point {
    pub fn run_dir(&self) -> PathBuf {
        self.config.run_dir()
    }
}

/// Every combination of `grids` (the first grid varies slowest), each point's config
/// loaded from `config_path` with `overrides` and then the point's values, and named
/// `<run.name>-<key>-<value>...` (a sweep from before names without `=` keeps its
/// folders: a point whose `<key>=<value>` folder holds a run continues there).
pub fn points(config_path: &Path, overrides: &[String], grids: &[Grid]) -> Result<Vec<Point>> {
    if grids.is_empty() {
        user_bail!(
            "sweep: no --grid given; e.g. --grid model.n_layer=2,4 --grid train.lr=1e-3,3e-4"
        );
    }
    check_keys(overrides, grids)?;
    let base = Config::load(config_path, overrides)?.run.name;
    // Each grid's values checked alone first, so a mistake is told as the --grid it is.
    for grid in grids {
        for value in &grid.values {
            let item = format!("{}={value}", grid.key);
            let all: Vec<String> = overrides.iter().cloned().chain([item.clone()]).collect();
            Config::load(config_path, &all).map_err(|e| {
                let grid_arg = format!("--grid {}={}", grid.key, grid.values.join(","));
                let told = format!("{e:#}").replace(&format!("--set {item}"), &grid_arg);
                // A rule broken with the config file's other settings ("n_embd = 17 is
                // not divisible by n_head = 2"): the file holds neither value.
                match told.contains(&grid_arg) {
                    true => crate::error::user_error(told),
                    false => {
                        crate::error::user_error(format!("{grid_arg}: the value {value}: {told}"))
                    }
                }
            })?;
        }
    }
    let mut combos: Vec<Vec<(String, String)>> = vec![vec![]];
    for grid in grids {
        combos = combos
            .into_iter()
            .flat_map(|combo| {
                grid.values.iter().map(move |v| {
                    let mut c = combo.clone();
                    c.push((grid.key.clone(), v.clone()));
                    c
                })
            })
            .collect();
    }
    let keys: Vec<&str> = grids.iter().map(|g| g.key.as_str()).collect();
    let points = combos
        .into_iter()
        .map(|values| {
            let mut all = overrides.to_vec();
            all.extend(values.iter().map(|(k, v)| format!("{k}={v}")));
            let mut named = all.clone();
            named.push(format!("run.name={:?}", run_name(&base, &keys, &values)));
            let mut config = Config::load(config_path, &named).map_err(|e| at_point(&values, e))?;
            let legacy = legacy_run_name(&base, &keys, &values);
            let old = config.run.out_dir.join(&legacy);
            if !config.run_dir().exists() && old.join(crate::checkpoint::METRICS_FILE).exists() {
                all.push(format!("run.name={legacy:?}"));
                config = Config::load(config_path, &all).map_err(|e| at_point(&values, e))?;
            } else if !config.run_dir().exists() {
                if let Some(name) = same_run_elsewhere(&config, &base, &values) {
                    all.push(format!("run.name={name:?}"));
                    config = Config::load(config_path, &all).map_err(|e| at_point(&values, e))?;
                } else if let Some((name, differences)) =
                    same_point_other_settings(&config, &base, &keys, &values)
                {
                    user_bail!(
                        "sweep: {} holds this point ({}) with other settings than this sweep gives it: {}; give this sweep another run.out_dir or run.name, or remove that folder",
                        config.run.out_dir.join(name).display(),
                        describe(&values),
                        differences.join(", ")
                    );
                }
            }
            Ok(Point { values, config })
        })
        .collect::<Result<Vec<Point>>>()?;
    check_distinct(&points)?;
    for point in &points {
        check_existing_run(point)?;
        preflight(point).map_err(|e| at_point(&point.values, e))?;
    }
    Ok(points)
}

/// `model.n_head=2, model.n_embd=33`: a point as its grids' values.
fn describe(values: &[(String, String)]) -> String {
    values
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A user's mistake found at one point, told as that point's (the config file alone
/// holds another value): other errors pass as they are.
fn at_point(values: &[(String, String)], error: anyhow::Error) -> anyhow::Error {
    match crate::error::find_user_error(&error) {
        Some(user) => {
            crate::error::user_error(format!("sweep point {}: {}", describe(values), user.0))
        }
        None => error,
    }
}

/// Every point its own run: two points in one folder (values that differ only in
/// characters a folder name turns into `_`), or two points that are the same run
/// (`train.lr=1e-3,0.001`), would train one of them and show it twice.
fn check_distinct(points: &[Point]) -> Result<()> {
    for (i, later) in points.iter().enumerate() {
        for earlier in &points[..i] {
            if later.run_dir() == earlier.run_dir() {
                user_bail!(
                    "sweep points {} and {} would share the run folder {} (a folder name turns `/`, `\\`, spaces, quotes and `=` into `_`); list values whose names differ",
                    describe(&earlier.values),
                    describe(&later.values),
                    later.run_dir().display()
                );
            }
            if same_settings(&later.config, &earlier.config) {
                user_bail!(
                    "sweep points {} and {} are the same run (their settings are equal); list each value once",
                    describe(&earlier.values),
                    describe(&later.values)
                );
            }
        }
    }
    Ok(())
}

/// Whether two points' configs train the same run: every setting equal but the name.
fn same_settings(a: &Config, b: &Config) -> bool {
    let (mut a_flat, mut b_flat) = (crate::compare::flatten(a), crate::compare::flatten(b));
    for flat in [&mut a_flat, &mut b_flat] {
        flat.remove("run.name");
        flat.remove("data.corpus");
    }
    a_flat == b_flat && same_path(&a.data.corpus, &b.data.corpus)
}

/// What a point's run would otherwise find wrong only when the sweep reaches it,
/// perhaps hours in: a corpus that is not there, a model this machine cannot hold.
/// (The tokenizer is not trained here: a vocabulary still to be learned is taken as
/// its bound, or as 256 characters.)
fn preflight(point: &Point) -> Result<()> {
    let config = &point.config;
    crate::corpus::Corpus::open(&config.data.corpus, &config.data.text_field)?;
    // Where the run will be on this machine's memory: the CPU, or `auto` in a build
    // with no GPU to choose.
    let device = config.run.device.trim().to_ascii_lowercase();
    let gpu_build = cfg!(any(feature = "cuda", feature = "metal"));
    if device == "cpu" || (device == "auto" && !gpu_build) {
        let mut sized = config.clone();
        if sized.model.vocab_size == 0 {
            sized.model.vocab_size = match config.tokenizer.kind {
                crate::config::TokenizerKind::Char => 256,
                crate::config::TokenizerKind::Bpe => config.tokenizer.vocab_size,
            };
        }
        crate::train::check_memory(&sized, &candle_core::Device::Cpu, 1)?;
    }
    Ok(())
}

/// The run folder beside this point's (named `<base>-...`) that holds its run under
/// another name: the sweep written with a value spelled otherwise (`0.001` for `1e-3`)
/// or its grids in another order. Its settings are this point's, the grids' values
/// equal as numbers (a grid over `train.max_iters` keeps its points apart), and only
/// one folder is so: it is continued there rather than trained again.
fn same_run_elsewhere(config: &Config, base: &str, values: &[(String, String)]) -> Option<String> {
    let out_dir = &config.run.out_dir;
    let want = crate::compare::flatten(config);
    let same_point = |saved: &Config| {
        let have = crate::compare::flatten(saved);
        setting_differences(config, saved).is_empty()
            && values.iter().all(|(key, _)| match key.as_str() {
                "data.corpus" => same_path(&config.data.corpus, &saved.data.corpus),
                _ => want.get(key) == have.get(key),
            })
    };
    let prefix = format!("{base}-");
    let mut found = std::fs::read_dir(out_dir)
        .ok()?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| name.starts_with(&prefix))
        .filter(|name| {
            let run = RunDir::new(out_dir.join(name));
            run.has_checkpoint() && run.saved_config().is_ok_and(|saved| same_point(&saved))
        });
    match (found.next(), found.next()) {
        (Some(one), None) => Some(one),
        _ => None,
    }
}

/// A run folder beside this point's, named by the same grids, that holds this point
/// (its grids' values equal as numbers: `1e-3` spelled `0.001`) with other settings:
/// the sweep run again with another `--set` and its values spelled otherwise. Its
/// points would train beside the old ones in one out_dir, two experiments mixed, and
/// the first sweep could not be finished.
fn same_point_other_settings(
    config: &Config,
    base: &str,
    keys: &[&str],
    values: &[(String, String)],
) -> Option<(String, Vec<String>)> {
    let out_dir = &config.run.out_dir;
    let want = crate::compare::flatten(config);
    let short = |k: &str| k.rsplit('.').next().unwrap_or(k).to_string();
    // Named by these grids (a sweep over other keys beside it is another experiment).
    let by_these_grids = |name: &str| {
        let parts = format!("-{}-", name.strip_prefix(base).unwrap_or_default());
        keys.iter().all(|k| {
            parts.contains(&format!("-{}-", short(k))) || parts.contains(&format!("-{k}-"))
        })
    };
    std::fs::read_dir(out_dir)
        .ok()?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| name.starts_with(&format!("{base}-")) && by_these_grids(name))
        .find_map(|name| {
            let saved = RunDir::new(out_dir.join(&name)).saved_config().ok()?;
            let have = crate::compare::flatten(&saved);
            let same_values = values.iter().all(|(key, _)| match key.as_str() {
                "data.corpus" => same_path(&config.data.corpus, &saved.data.corpus),
                _ => want.get(key) == have.get(key),
            });
            let differences = setting_differences(config, &saved);
            (same_values && !differences.is_empty()).then_some((name, differences))
        })
}

/// Each setting once: a key in two grids, a value twice in one grid, or a grid's key
/// also given by --set would make runs that are not the points they are named for.
fn check_keys(overrides: &[String], grids: &[Grid]) -> Result<()> {
    let mut seen = std::collections::BTreeSet::new();
    for grid in grids {
        if matches!(grid.key.as_str(), "run.name" | "run.out_dir") {
            user_bail!(
                "--grid {}: a sweep's points are named from run.name and their values, under run.out_dir, so these would be one run; name the sweep with --set {}=..., and grid settings that change what is trained",
                grid.key,
                grid.key
            );
        }
        if !seen.insert(grid.key.as_str()) {
            user_bail!(
                "--grid {} is given twice; give each setting one --grid with all its values (--grid {}=a,b,c)",
                grid.key,
                grid.key
            );
        }
        let mut values = std::collections::BTreeSet::new();
        if let Some(twice) = grid.values.iter().find(|v| !values.insert(v.as_str())) {
            user_bail!(
                "--grid {}={}: the value {twice} is listed twice; list each value once",
                grid.key,
                grid.values.join(",")
            );
        }
        let set = overrides
            .iter()
            .find(|o| o.split_once('=').is_some_and(|(k, _)| k.trim() == grid.key));
        if let Some(set) = set {
            user_bail!(
                "--set {set} and --grid {}=... both set {}; drop one (the grid's values are the points' values)",
                grid.key,
                grid.key
            );
        }
    }
    Ok(())
}

/// Settings a run may change between sessions without being another experiment: where
/// it lives and runs, how long it trains (a sweep continued to more steps), and how
/// often it logs, evaluates and saves.
const CONTINUABLE: &[&str] = &[
    "run.name",
    "run.out_dir",
    "run.device",
    "data.cache_dir",
    "data.fingerprint",
    "train.max_iters",
    "train.eval_interval",
    "train.eval_iters",
    "train.log_interval",
    "train.checkpoint_interval",
    "train.fused",
    "train.tf32",
];

/// A point whose run folder already holds a run must be that run: a sweep run again
/// with another setting (`--set model.n_embd=64`) would otherwise skip or resume runs
/// of the old setting and show them as the new one's.
fn check_existing_run(point: &Point) -> Result<()> {
    let run = RunDir::new(point.run_dir());
    if !run.has_checkpoint() {
        return Ok(());
    }
    let saved = run.saved_config()?;
    let differences = setting_differences(&point.config, &saved);
    if !differences.is_empty() {
        user_bail!(
            "sweep: {} holds a run with other settings than this sweep gives it: {}; give this sweep another run.out_dir or run.name, or remove that folder",
            run.path().display(),
            differences.join(", ")
        );
    }
    Ok(())
}

/// `key = wanted (the run has saved)` for each setting that makes `wanted` another
/// experiment than the run `saved` describes.
fn setting_differences(wanted: &Config, saved: &Config) -> Vec<String> {
    // A char vocabulary is the corpus's characters, whatever tokenizer.vocab_size and
    // train_bytes say: those are left out of a char run's settings.
    use crate::compare::{flatten, without_unused};
    let (want, have) = (
        without_unused(flatten(wanted)),
        without_unused(flatten(saved)),
    );
    let keys: std::collections::BTreeSet<&String> = want.keys().chain(have.keys()).collect();
    keys.into_iter()
        .filter(|key| !CONTINUABLE.contains(&key.as_str()))
        // Filled in from the tokenizer when a run starts.
        .filter(|key| !(*key == "model.vocab_size" && wanted.model.vocab_size == 0))
        .filter(|key| match key.as_str() {
            "data.corpus" => !same_path(&wanted.data.corpus, &saved.data.corpus),
            "tokenizer.path" => match (&wanted.tokenizer.path, &saved.tokenizer.path) {
                (Some(a), Some(b)) => !same_path(a, b),
                (a, b) => a != b,
            },
            _ => want.get(*key) != have.get(*key),
        })
        .map(|key| crate::compare::difference(key, &want, &have, "the run"))
        .collect()
}

/// The same file, however the two paths spell it (a sweep run from another folder).
fn same_path(a: &Path, b: &Path) -> bool {
    a == b
        || matches!(
            (a.canonicalize(), b.canonicalize()),
            (Ok(a), Ok(b)) if a == b
        )
}

/// `<base>-n_layer-2-lr-1e-3`: keys by their last part unless two grids share it;
/// characters a file name cannot hold (or a shell or `make` reads apart: `=`) become
/// `_`.
pub fn run_name(base: &str, keys: &[&str], values: &[(String, String)]) -> String {
    named(base, keys, values, "-").replace('=', "_")
}

/// The names sweeps gave before: `<base>-n_layer=2-lr=1e-3`.
fn legacy_run_name(base: &str, keys: &[&str], values: &[(String, String)]) -> String {
    named(base, keys, values, "=")
}

fn named(base: &str, keys: &[&str], values: &[(String, String)], between: &str) -> String {
    let short = |k: &str| k.rsplit('.').next().unwrap_or(k).to_string();
    let mut name = base.to_string();
    for (key, value) in values {
        let clash = keys.iter().filter(|k| short(k) == short(key)).count() > 1;
        let key = if clash { key.clone() } else { short(key) };
        name.push_str(&format!("-{key}{between}{value}"));
    }
    name.chars()
        .map(|c| {
            if c == '/' || c == '\\' || c.is_whitespace() || c == '"' {
                '_'
            } else {
                c
            }
        })
        .collect()
}

/// What the sweep did with a point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Complete before this sweep ran: left as it was.
    AlreadyComplete,
    /// Trained from the start.
    Trained,
    /// Continued from an interrupted run's checkpoint.
    Resumed,
    /// Stopped by a non-finite loss or gradient; its last checkpoint is kept (a later
    /// sweep resumes it, and it diverges again where it did).
    Diverged,
}

/// Runs every point in order. Once `stop` holds a signal number the run in progress
/// checkpoints and the sweep stops (an [`InterruptedError`] saying how to continue).
pub fn run(points: &[Point], stop: Stop, reporter: &mut dyn Reporter) -> Result<Vec<Outcome>> {
    let mut outcomes = Vec::with_capacity(points.len());
    for (i, point) in points.iter().enumerate() {
        let dir = point.run_dir();
        let run = RunDir::new(&dir);
        let start = if run.has_checkpoint() {
            let state = run.state()?;
            // Complete: trained to the end and evaluated there (a stop in the final
            // evaluation leaves the last step saved but not evaluated).
            if state.step >= point.config.train.max_iters && run.has_eval_at(state.step) {
                // Trained further than this sweep asks (max_iters lowered since): its
                // learning rate followed the longer schedule, which the table hides.
                let past = match state.step > point.config.train.max_iters {
                    true => format!(
                        "; it trained past this sweep's train.max_iters = {}, on the schedule of a longer run",
                        point.config.train.max_iters
                    ),
                    false => String::new(),
                };
                reporter.note(&format!(
                    "sweep {}/{}: {} is complete (step {}), skipped{past}",
                    i + 1,
                    points.len(),
                    dir.display(),
                    state.step
                ));
                outcomes.push(Outcome::AlreadyComplete);
                continue;
            }
            Start::Resume
        } else {
            Start::Fresh
        };
        if let Some(signal) = stop.signal() {
            return Err(interrupted(signal, 0, dir));
        }
        reporter.note(&format!(
            "sweep {}/{}: {} ({})",
            i + 1,
            points.len(),
            dir.display(),
            if start == Start::Resume {
                "resuming"
            } else {
                "new"
            }
        ));
        let outcome = if start == Start::Resume {
            Outcome::Resumed
        } else {
            Outcome::Trained
        };
        let mut trainer = Trainer::start_until(point.config.clone(), start, stop.clone())?;
        match trainer.run(reporter) {
            Ok(_) => outcomes.push(outcome),
            // One point's divergence (a learning rate too high, say) is a result of the
            // sweep, not the end of it.
            Err(e) if e.is::<DivergedError>() => {
                reporter.note(&format!(
                    "sweep {}/{}: {} diverged ({e}); going on",
                    i + 1,
                    points.len(),
                    dir.display()
                ));
                outcomes.push(Outcome::Diverged);
            }
            Err(e) => {
                return Err(match e.downcast::<InterruptedError>() {
                    Ok(stopped) => interrupted(stopped.signal, stopped.step, stopped.run_dir),
                    Err(other) => other,
                })
            }
        }
    }
    Ok(outcomes)
}

fn interrupted(signal: i32, step: usize, run_dir: PathBuf) -> anyhow::Error {
    let saved = crate::checkpoint::RunDir::new(&run_dir).has_checkpoint();
    let continue_with = match saved {
        true => "the same sweep command (done runs are skipped, this one resumes)",
        false => "the same sweep command (done runs are skipped)",
    };
    InterruptedError {
        signal,
        step,
        saved,
        run_dir,
        continue_with: continue_with.into(),
    }
    .into()
}

/// The run folders of the points that have one, in sweep order.
pub fn existing_runs(points: &[Point]) -> Vec<PathBuf> {
    points
        .iter()
        .map(Point::run_dir)
        .filter(|d| d.join(crate::checkpoint::METRICS_FILE).exists())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_parse_and_name_runs() {
        let g = Grid::parse("model.n_layer=2,4, 6").unwrap();
        assert_eq!(g.key, "model.n_layer");
        assert_eq!(g.values, ["2", "4", "6"]);
        assert!(Grid::parse("model.n_layer").is_err());
        assert!(Grid::parse("model.n_layer=2,,4").is_err());
        let values = [
            ("model.n_layer".to_string(), "2".to_string()),
            ("train.lr".to_string(), "1e-3".to_string()),
        ];
        assert_eq!(
            run_name("exp", &["model.n_layer", "train.lr"], &values),
            "exp-n_layer-2-lr-1e-3"
        );
        assert_eq!(
            legacy_run_name("exp", &["model.n_layer", "train.lr"], &values),
            "exp-n_layer=2-lr=1e-3"
        );
        let clash = [
            ("model.dropout".to_string(), "0.1".to_string()),
            ("train.dropout".to_string(), "a/b".to_string()),
        ];
        assert_eq!(
            run_name("x", &["model.dropout", "train.dropout"], &clash),
            "x-model.dropout-0.1-train.dropout-a_b"
        );
    }
}
