//! Experiments side by side: a sweep runs every point once, is a no-op when run again,
//! resumes after an interruption; compare reads run folders (finished or not) into a
//! table named by what differs, and a picture.

use std::path::{Path, PathBuf};

use tinygpt::compare::{self, XAxis};
use tinygpt::config::Config;
use tinygpt::error::InterruptedError;
use tinygpt::sweep::{self, Grid, Outcome};
use tinygpt::train::{Reporter, Silent, StepLog};
use tinygpt::util::Stop;

fn tiny_experiment(dir: &Path) -> PathBuf {
    let text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"
        .repeat(60);
    std::fs::write(dir.join("corpus.txt"), text).unwrap();
    let path = dir.join("exp.toml");
    std::fs::write(
        &path,
        format!(
            "[run]\nout_dir = {:?}\n[data]\ncorpus = {:?}\ncache_dir = {:?}\n[tokenizer]\nkind = \"char\"\n\
             [model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n\
             [train]\nbatch_size = 4\nmax_iters = 6\nwarmup_iters = 1\neval_interval = 3\n\
             eval_iters = 1\nlog_interval = 1\ncheckpoint_interval = 3\n",
            dir.join("checkpoints").display().to_string(),
            dir.join("corpus.txt").display().to_string(),
            dir.join("cache").display().to_string(),
        ),
    )
    .unwrap();
    path
}

/// Asks training to stop (as Ctrl-C does) once the run it reports reaches `at`.
struct StopAt {
    at: usize,
    stop: Stop,
}

impl Reporter for StopAt {
    fn step(&mut self, log: &StepLog) {
        if log.step == self.at {
            self.stop.request(2);
        }
    }
}

#[test]
fn a_sweep_runs_each_point_once_and_resumes_after_an_interruption() {
    let dir = tempfile::tempdir().unwrap();
    let exp = tiny_experiment(dir.path());
    let grids = [Grid::parse("model.n_layer=1,2").unwrap()];
    let points = sweep::points(&exp, &[], &grids).unwrap();
    let names: Vec<String> = points.iter().map(|p| p.config.run.name.clone()).collect();
    assert_eq!(names, ["exp-n_layer-1", "exp-n_layer-2"]);

    // Interrupted at step 4 (of 6) of the first point.
    let stop = Stop::new();
    let mut stop_at = StopAt {
        at: 4,
        stop: stop.clone(),
    };
    let first = sweep::run(&points, stop, &mut stop_at);
    let err = first.expect_err("stopped by the flag");
    let stopped = err
        .downcast_ref::<InterruptedError>()
        .expect("an interruption");
    assert_eq!(
        stopped.run_dir,
        points[0].run_dir(),
        "stopped in the first run"
    );
    assert_eq!(stopped.step, 4);
    assert!(stopped.continue_with.contains("same sweep command"));

    // Run again: the interrupted run resumes, the other starts.
    let outcomes = sweep::run(&points, Stop::new(), &mut Silent).unwrap();
    assert_eq!(outcomes, [Outcome::Resumed, Outcome::Trained]);
    for p in &points {
        let state = tinygpt::checkpoint::RunDir::new(p.run_dir())
            .state()
            .unwrap();
        assert_eq!(state.step, 6, "{}", p.run_dir().display());
    }

    // And again: nothing to do, nothing written.
    let state_file = points[1].run_dir().join("state.json");
    let before = std::fs::read(&state_file).unwrap();
    let modified = std::fs::metadata(&state_file).unwrap().modified().unwrap();
    let outcomes = sweep::run(&points, Stop::new(), &mut Silent).unwrap();
    assert_eq!(
        outcomes,
        [Outcome::AlreadyComplete, Outcome::AlreadyComplete]
    );
    assert_eq!(std::fs::read(&state_file).unwrap(), before);
    assert_eq!(
        std::fs::metadata(&state_file).unwrap().modified().unwrap(),
        modified
    );

    // The comparison names the runs by what the sweep varied.
    let runs = compare::read_runs(&sweep::existing_runs(&points)).unwrap();
    let rows = compare::rows(&runs);
    assert_eq!(rows[0].differs, ["n_layer=1"]);
    assert_eq!(rows[1].differs, ["n_layer=2"]);
    assert!(rows
        .iter()
        .all(|r| r.steps == 6 && r.best_val_loss.is_some()));
    assert!(rows[0].parameters.unwrap() < rows[1].parameters.unwrap());
}

/// Asks training to stop once an evaluation starts after step `at`.
struct StopInEvaluation {
    at: usize,
    last_step: usize,
    stop: Stop,
}

impl Reporter for StopInEvaluation {
    fn step(&mut self, log: &StepLog) {
        self.last_step = log.step;
    }
    fn evaluating(&mut self, _done: usize, _total: usize) {
        if self.last_step == self.at {
            self.stop.request(15);
        }
    }
}

#[test]
fn a_run_stopped_in_its_final_evaluation_is_not_complete() {
    let dir = tempfile::tempdir().unwrap();
    let exp = tiny_experiment(dir.path());
    let points = sweep::points(&exp, &[], &[Grid::parse("model.n_layer=1").unwrap()]).unwrap();
    let stop = Stop::new();
    let mut reporter = StopInEvaluation {
        at: 6,
        last_step: 0,
        stop: stop.clone(),
    };
    let err = sweep::run(&points, stop, &mut reporter).expect_err("stopped");
    assert_eq!(err.downcast_ref::<InterruptedError>().unwrap().step, 6);
    let run = tinygpt::checkpoint::RunDir::new(points[0].run_dir());
    assert_eq!(run.state().unwrap().step, 6);
    assert!(!run.has_eval_at(6));
    // Not skipped: resumed, it evaluates step 6 and saves that.
    let outcomes = sweep::run(&points, Stop::new(), &mut Silent).unwrap();
    assert_eq!(outcomes, [Outcome::Resumed]);
    assert!(run.has_eval_at(6));
    assert!(run.state().unwrap().last_val_loss.is_some());
    let outcomes = sweep::run(&points, Stop::new(), &mut Silent).unwrap();
    assert_eq!(outcomes, [Outcome::AlreadyComplete]);
}

#[test]
fn a_diverging_point_does_not_end_the_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let exp = tiny_experiment(dir.path());
    let grids = [Grid::parse("train.lr=1e12,1e-3").unwrap()];
    let points = sweep::points(&exp, &[], &grids).unwrap();
    let outcomes = sweep::run(&points, Stop::new(), &mut Silent).unwrap();
    assert_eq!(outcomes, [Outcome::Diverged, Outcome::Trained]);
}

#[test]
fn a_bad_grid_value_fails_before_anything_trains() {
    let dir = tempfile::tempdir().unwrap();
    let exp = tiny_experiment(dir.path());
    let grids = [Grid::parse("model.n_layer=1,two").unwrap()];
    let err = sweep::points(&exp, &[], &grids).expect_err("two is not a number");
    assert!(format!("{err:#}").contains("model.n_layer"), "{err:#}");
    assert!(!dir.path().join("checkpoints").exists());
}

#[test]
fn a_sweep_run_again_with_other_settings_refuses_its_old_runs() {
    let dir = tempfile::tempdir().unwrap();
    let exp = tiny_experiment(dir.path());
    let grids = [Grid::parse("model.n_layer=1").unwrap()];
    let points = sweep::points(&exp, &[], &grids).unwrap();
    sweep::run(&points, Stop::new(), &mut Silent).unwrap();
    let again = |overrides: &[&str]| {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        sweep::points(&exp, &overrides, &grids)
    };
    // Other settings: the run folder's run is not this point's.
    for (set, told) in [
        ("model.n_embd=32", "model.n_embd = 32 (the run has 16)"),
        ("train.batch_size=2", "train.batch_size = 2 (the run has 4)"),
        ("train.lr=0.01", "train.lr = 0.01 (the run has 0.001)"),
    ] {
        let err = again(&[set]).expect_err(set);
        let said = format!("{err:#}");
        assert!(
            said.contains(told) && said.contains("exp-n_layer-1"),
            "{said}"
        );
        assert!(tinygpt::error::find_user_error(&err).is_some(), "{said}");
    }
    // More steps, another device or evaluation schedule: the same experiment, continued.
    let points = again(&[
        "train.max_iters=8",
        "train.eval_interval=4",
        "run.device=cpu",
    ])
    .unwrap();
    let outcomes = sweep::run(&points, Stop::new(), &mut Silent).unwrap();
    assert_eq!(outcomes, [Outcome::Resumed]);
}

/// A sinusoidal run records its table's amplitude, which the sweep's config leaves to
/// the default: run again, the sweep finds its runs as they are.
#[test]
fn a_sinusoidal_sweep_run_again_finds_its_runs() {
    let dir = tempfile::tempdir().unwrap();
    let exp = tiny_experiment(dir.path());
    let grids = [Grid::parse("model.n_layer=1,2").unwrap()];
    let sinusoidal = ["model.positions=sinusoidal".to_string()];
    let points = sweep::points(&exp, &sinusoidal, &grids).unwrap();
    sweep::run(&points, Stop::new(), &mut Silent).unwrap();
    let points = sweep::points(&exp, &sinusoidal, &grids).unwrap();
    let outcomes = sweep::run(&points, Stop::new(), &mut Silent).unwrap();
    assert_eq!(
        outcomes,
        [Outcome::AlreadyComplete, Outcome::AlreadyComplete]
    );
    // Asked for another amplitude, they are other runs.
    let other = [
        sinusoidal[0].clone(),
        "model.sinusoidal_scale=1".to_string(),
    ];
    let err = sweep::points(&exp, &other, &grids).expect_err("another table");
    assert!(
        format!("{err:#}").contains("model.sinusoidal_scale = 1.0 (the run has 0.25)"),
        "{err:#}"
    );
}

#[test]
fn a_setting_given_twice_fails_before_anything_trains() {
    let dir = tempfile::tempdir().unwrap();
    let exp = tiny_experiment(dir.path());
    let grid = |arg: &str| Grid::parse(arg).unwrap();
    for (overrides, grids, told) in [
        (
            vec![],
            vec![grid("model.n_layer=1,2"), grid("model.n_layer=3")],
            "given twice",
        ),
        (
            vec![],
            vec![grid("model.n_layer=1,1")],
            "the value 1 is listed twice",
        ),
        (
            vec!["model.n_layer=3".to_string()],
            vec![grid("model.n_layer=1,2")],
            "both set model.n_layer",
        ),
        (
            vec![],
            vec![grid("run.name=a,b")],
            "--grid run.name: a sweep's points are named from run.name and their values, under run.out_dir, so these would be one run; name the sweep with --set run.name=...",
        ),
    ] {
        let err = sweep::points(&exp, &overrides, &grids).expect_err(told);
        assert!(format!("{err:#}").contains(told), "{err:#}");
    }
    assert!(!dir.path().join("checkpoints").exists());
}

/// Points that would be one run (one folder, or equal settings), and a point whose
/// run this machine could not hold or whose corpus is not there, fail before anything
/// trains, named as the point they are.
#[test]
fn points_that_cannot_all_train_fail_before_anything_trains() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let exp = tiny_experiment(d);
    std::fs::create_dir_all(d.join("d")).unwrap();
    let text = std::fs::read_to_string(d.join("corpus.txt")).unwrap();
    std::fs::write(d.join("d/x.txt"), &text).unwrap();
    std::fs::write(d.join("d_x.txt"), &text).unwrap();
    let corpus = |name: &str| d.join(name).display().to_string();
    let grid = |arg: &str| Grid::parse(arg).unwrap();
    for (grids, told) in [
        (
            vec![grid(&format!(
                "data.corpus={},{}",
                corpus("d/x.txt"),
                corpus("d_x.txt")
            ))],
            "would share the run folder",
        ),
        (
            vec![grid("train.lr=1e-3,0.001")],
            "sweep points train.lr=1e-3 and train.lr=0.001 are the same run",
        ),
        (
            vec![grid(&format!(
                "data.corpus={},{}",
                corpus("corpus.txt"),
                corpus("nowhere.txt")
            ))],
            "nowhere.txt",
        ),
        (
            vec![grid("train.batch_size=4,100000000")],
            "sweep point train.batch_size=100000000: config: training this model needs about",
        ),
        (
            vec![grid("model.n_head=2,4"), grid("model.n_embd=16,18")],
            "sweep point model.n_head=4, model.n_embd=18: config: model.n_embd = 18",
        ),
        (
            vec![grid("model.n_embd=16,17")],
            "--grid model.n_embd=16,17: the value 17: config: model.n_embd = 17",
        ),
    ] {
        let err = sweep::points(&exp, &[], &grids).expect_err(told);
        let said = format!("{err:#}");
        assert!(said.contains(told), "{said}");
        assert!(tinygpt::error::find_user_error(&err).is_some(), "{said}");
    }
    assert!(!d.join("checkpoints").exists());
}

/// A sweep run again with a value spelled otherwise, or its grids in another order,
/// finds its runs under the names they have (it trained them all again, in new folders);
/// a grid over the run's length keeps its points apart.
#[test]
fn a_sweep_written_otherwise_finds_its_runs() {
    let dir = tempfile::tempdir().unwrap();
    let exp = tiny_experiment(dir.path());
    let grid = |arg: &str| Grid::parse(arg).unwrap();
    let first = [grid("model.n_layer=1"), grid("train.lr=1e-3,2e-3")];
    let points = sweep::points(&exp, &[], &first).unwrap();
    sweep::run(&points, Stop::new(), &mut Silent).unwrap();
    let again = [grid("train.lr=0.001,0.002"), grid("model.n_layer=1")];
    let points = sweep::points(&exp, &[], &again).unwrap();
    let names: Vec<String> = points.iter().map(|p| p.config.run.name.clone()).collect();
    assert_eq!(names, ["exp-n_layer-1-lr-1e-3", "exp-n_layer-1-lr-2e-3"]);
    let outcomes = sweep::run(&points, Stop::new(), &mut Silent).unwrap();
    assert_eq!(
        outcomes,
        [Outcome::AlreadyComplete, Outcome::AlreadyComplete]
    );
    // Points apart in a continuable setting are not one old run.
    let longer = [grid("train.lr=0.001"), grid("train.max_iters=6,8")];
    let points = sweep::points(&exp, &[], &longer).unwrap();
    let names: Vec<String> = points.iter().map(|p| p.config.run.name.clone()).collect();
    assert_eq!(names, ["exp-n_layer-1-lr-1e-3", "exp-lr-0.001-max_iters-8"]);
    // Spelled otherwise and with another setting: the old folders hold these points
    // with other settings, refused as the same spelling is (two experiments were
    // trained side by side in one out_dir).
    let overrides = ["train.batch_size=2".to_string()];
    let err = sweep::points(&exp, &overrides, &again).expect_err("refused");
    let said = format!("{err:#}");
    assert!(
        said.contains("exp-n_layer-1-lr-1e-3 holds this point (train.lr=0.001, model.n_layer=1) with other settings")
            && said.contains("train.batch_size = 2 (the run has 4)"),
        "{said}"
    );
    assert!(tinygpt::error::find_user_error(&err).is_some(), "{said}");
}

/// A run folder written by hand: its config and metrics.
fn fixture_run(root: &Path, name: &str, overrides: &[&str], metrics: &str) -> PathBuf {
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    let config = Config::from_toml_str("", &overrides).unwrap();
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.toml"), config.to_toml_string()).unwrap();
    std::fs::write(dir.join("metrics.jsonl"), metrics).unwrap();
    dir
}

const METRICS_A: &str = r#"{"step":0,"train_loss":4.2,"val_loss":4.3,"lr":0.0,"elapsed_s":0.5}
{"step":10,"loss":3.0,"lr":0.001,"grad_norm":1.0,"tokens_per_s":1000.0,"elapsed_s":2.0}
{"step":20,"loss":2.5,"lr":0.001,"grad_norm":1.0,"tokens_per_s":3000.0,"elapsed_s":3.0}
{"step":20,"train_loss":2.4,"val_loss":2.45,"lr":0.001,"elapsed_s":3.5}
{"step":30,"loss":2.2,"lr":0.001,"grad_norm":1.0,"tokens_per_s":2000.0,"elapsed_s":4.0}
{"step":40,"train_loss":2.1,"val_loss":2.6,"lr":0.001,"elapsed_s":5.0}
"#;

#[test]
fn the_table_reads_metrics_as_they_are() {
    let dir = tempfile::tempdir().unwrap();
    let a = fixture_run(
        dir.path(),
        "a",
        &["model.n_layer=6", "train.lr=3e-4"],
        METRICS_A,
    );
    // Still training: a line half written.
    let b = fixture_run(
        dir.path(),
        "b",
        &["model.n_layer=4", "train.lr=3e-4"],
        "{\"step\":0,\"train_loss\":4.1,\"val_loss\":4.0,\"lr\":0.0,\"elapsed_s\":0.1}\n{\"step\":5,\"loss\":3.",
    );
    let runs = compare::read_runs(&[a, b]).unwrap();
    let rows = compare::rows(&runs);
    let ra = &rows[0];
    assert_eq!(ra.run, "a");
    assert_eq!(ra.differs, ["n_layer=6"]);
    assert_eq!(ra.steps, 40);
    assert_eq!(ra.best_val_loss, Some(2.45));
    assert_eq!(ra.best_val_step, Some(20));
    assert_eq!(
        ra.tokens_per_s,
        Some(2000.0),
        "the median of 1000, 3000, 2000"
    );
    assert_eq!(ra.wall_s, Some(5.0));
    let rb = &rows[1];
    assert_eq!(
        (rb.steps, rb.best_val_loss, rb.tokens_per_s),
        (0, Some(4.0), None)
    );
    let table = compare::table(&rows);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3);
    assert!(
        lines[1].starts_with("a ") && lines[1].contains("2.4500"),
        "{table}"
    );
    assert!(lines[2].contains("n_layer=4"), "{table}");

    // Against tokens: steps times batch x block x accumulation.
    let (series, skipped) = compare::series(&runs, &rows, XAxis::Tokens);
    assert!(skipped.is_empty());
    let per_step = (12 * 64) as f64; // the default batch_size x block_size
    assert_eq!(series[0].1[1], (20.0 * per_step, 2.45));
    // Against time: evaluations placed at their seconds.
    let (series, _) = compare::series(&runs, &rows, XAxis::Time);
    assert_eq!(series[0].1[1], (3.0, 2.45));
}

#[test]
fn a_run_without_a_config_yet_does_not_make_every_setting_differ() {
    let dir = tempfile::tempdir().unwrap();
    let a = fixture_run(dir.path(), "a", &["train.lr=1e-3"], METRICS_A);
    let b = fixture_run(dir.path(), "b", &["train.lr=2e-3"], METRICS_A);
    // Still before its first checkpoint: metrics, no config.toml.
    let c = dir.path().join("c");
    std::fs::create_dir(&c).unwrap();
    std::fs::write(c.join("metrics.jsonl"), METRICS_A).unwrap();
    let rows = compare::rows(&compare::read_runs(&[a, b, c]).unwrap());
    assert_eq!(rows[0].differs, ["lr=0.001"]);
    assert_eq!(rows[1].differs, ["lr=0.002"]);
    assert!(rows[2].differs.is_empty() && rows[2].parameters.is_none());
    assert_eq!(compare::label(&rows[2]), "c");
    assert_eq!(rows[2].best_val_loss, Some(2.45));
}

#[test]
fn compare_on_the_command_line_writes_a_table_and_a_picture() {
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs");
    fixture_run(&runs, "lr-1", &["train.lr=1e-3"], METRICS_A);
    fixture_run(&runs, "lr-2", &["train.lr=2e-3"], METRICS_A);
    let png = dir.path().join("c.png");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tinygpt"))
            .args(args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{args:?}: {stderr}");
        String::from_utf8(out.stdout).unwrap()
    };
    // A folder of runs, as JSON.
    let json = run(&["compare", "runs", "--json", "--out", png.to_str().unwrap()]);
    let rows: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 2);
    assert_eq!(rows[1]["differs"][0], "lr=0.002");
    assert!(
        std::fs::metadata(&png).unwrap().len() > 10_000,
        "a real picture"
    );
    // A quoted glob, against time.
    let table = run(&["compare", "runs/lr-*", "--x", "time", "--out", "t.png"]);
    assert_eq!(table.lines().count(), 3, "{table}");
    assert!(dir.path().join("t.png").exists());
    // One run named three ways is one row.
    let table = run(&["compare", "runs/lr-1", "runs/lr-1/", "./runs/lr-1"]);
    assert_eq!(table.lines().count(), 2, "{table}");
}

/// Runs of two tokenizers: a note that their losses per token do not compare, and a
/// char run's unused BPE settings are not a difference; two runs of one name are told
/// apart by their paths.
#[test]
fn compare_says_what_does_not_compare() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fixture_run(&d.join("a"), "r", &["tokenizer.kind=char"], METRICS_A);
    fixture_run(
        &d.join("b"),
        "r",
        &["tokenizer.kind=bpe", "tokenizer.vocab_size=300"],
        METRICS_A,
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tinygpt"))
        .args(["compare", "a/r", "b/r", "--json"])
        .current_dir(d)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("note: these runs tokenize differently")
            && said.contains("`tinygpt eval --checkpoint RUN --text FILE`"),
        "{said}"
    );
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows[0]["run"], "a/r");
    assert_eq!(rows[0]["dir"], "a/r");
    assert_eq!(rows[1]["run"], "b/r");
    assert_eq!(rows[0]["differs"], serde_json::json!(["kind=char"]));
    assert_eq!(rows[1]["differs"], serde_json::json!(["kind=bpe"]));
    // A damaged config.toml leaves that run's settings out, not the comparison; damaged
    // metrics lines are passed over.
    std::fs::write(d.join("b/r/config.toml"), "garbage = [").unwrap();
    let mut metrics = std::fs::read(d.join("a/r/metrics.jsonl")).unwrap();
    metrics.extend_from_slice(b"\xff\xfe not json\n");
    std::fs::write(d.join("a/r/metrics.jsonl"), metrics).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tinygpt"))
        .args(["compare", "a/r", "b/r", "--json"])
        .current_dir(d)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("b/r/config.toml") && said.contains("left out of the comparison"),
        "{said}"
    );
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows[0]["best_val_loss"], 2.45, "{rows}");
}

#[test]
fn a_sweep_named_before_dashes_goes_on_in_its_folders() {
    let dir = tempfile::tempdir().unwrap();
    let exp = tiny_experiment(dir.path());
    let grids = [Grid::parse("model.n_layer=1,2").unwrap()];
    let first = sweep::points(&exp, &[], &grids).unwrap();
    // A run the sweep started under the old name, `<key>=<value>`.
    let old = first[0].config.run.out_dir.join("exp-n_layer=1");
    std::fs::create_dir_all(&old).unwrap();
    std::fs::write(old.join("metrics.jsonl"), "").unwrap();
    let points = sweep::points(&exp, &[], &grids).unwrap();
    let names: Vec<&str> = points.iter().map(|p| p.config.run.name.as_str()).collect();
    assert_eq!(names, ["exp-n_layer=1", "exp-n_layer-2"]);
}
