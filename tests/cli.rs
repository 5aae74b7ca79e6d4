//! The real binary, used as a user would: train from a config file, resume, generate,
//! eval, info. (Mistakes are in tests/mistakes.rs.)

use std::path::Path;
use std::process::Command;

mod common;
use common::{stderr, succeeds, tinygpt, train_args};

fn setup() -> tempfile::TempDir {
    let text =
        "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
            .repeat(40);
    common::char_experiment(
        &text,
        "n_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16",
        "batch_size = 4\nmax_iters = 6\nwarmup_iters = 1\neval_interval = 3\neval_iters = 1\ncheckpoint_interval = 3",
    )
}

#[test]
fn train_then_resume_from_the_command_line() {
    let dir = setup();
    let out = succeeds(
        dir.path(),
        &train_args(&[], &["tokenizer.kind=bpe", "tokenizer.vocab_size=300"]),
    );
    let log = stderr(&out);
    assert!(log.contains("val loss"), "{log}");
    let run = dir.path().join("checkpoints/exp");
    assert!(run.join("model.safetensors").is_file());
    let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(
        config.contains("kind = \"bpe\""),
        "the resolved config records the overrides"
    );

    // Same folder again without --resume: refused, nothing overwritten.
    let before = std::fs::read(run.join("model.safetensors")).unwrap();
    let out = tinygpt(dir.path(), &["train", "--config", "exp.toml"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(
        std::fs::read(run.join("model.safetensors")).unwrap(),
        before
    );

    // Resume to more steps (the model's defaults may be spelled out: 2 K/V heads of 2
    // heads is the checkpoint's model).
    let out = succeeds(
        dir.path(),
        &train_args(
            &["--resume"],
            &["train.max_iters=9", "run.device=auto", "model.n_kv_head=2"],
        ),
    );
    assert!(
        stderr(&out).contains("resuming at step 6"),
        "{}",
        stderr(&out)
    );
    // A longer schedule: the rate it starts at, above the checkpoint's, and why.
    assert!(
        stderr(&out).contains("learning rate ")
            && stderr(&out).contains("at the checkpoint: the cosine decay now runs to step 9"),
        "{}",
        stderr(&out)
    );
    // `auto` says in the run's first line what it chose and why.
    assert!(stderr(&out).contains(" (auto: "), "{}", stderr(&out));
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["step"], 9);

    // Exported for Hugging Face with the end-of-text token a BPE vocabulary has and the
    // chat template `serve` uses; exported again into the same folder, an earlier
    // export is replaced (it was refused as "not an earlier export").
    let export = ["export", "--checkpoint", "checkpoints/exp", "--out", "hf"];
    succeeds(dir.path(), &export);
    let tokenizer_config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("hf/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(tokenizer_config["eos_token"], "<|endoftext|>");
    assert_eq!(
        tokenizer_config["chat_template"],
        tinygpt::serve::chat::JINJA
    );
    succeeds(dir.path(), &export);
}

#[test]
fn generate_eval_and_info_from_a_checkpoint() {
    let dir = setup();
    succeeds(dir.path(), &["train", "--config", "exp.toml"]);
    let ck = "checkpoints/exp";

    // Streamed text starts with the prompt; stats on stderr.
    let generate = [
        "generate",
        "--checkpoint",
        ck,
        "--prompt",
        "To be",
        "--max-new-tokens",
        "20",
        "--seed",
        "3",
    ];
    let out = succeeds(dir.path(), &generate);
    let text = String::from_utf8(out.stdout.clone()).unwrap();
    assert!(text.starts_with("To be"), "{text}");
    assert!(stderr(&out).contains("decode") && stderr(&out).contains("tokens/s"));
    let again = tinygpt(dir.path(), &generate);
    assert_eq!(again.stdout, out.stdout, "same seed, same text");
    // Piped, it is the prompt and the sample, nothing added: as --json has them.
    let json = succeeds(dir.path(), &[&generate[..], &["--json"]].concat());
    let record: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(
        text,
        format!("To be{}", record["text"].as_str().unwrap()),
        "{record}"
    );

    // JSON: one object per sample; prompt from stdin.
    let mut child = Command::new(env!("CARGO_BIN_EXE_tinygpt"))
        .args([
            "generate",
            "--checkpoint",
            ck,
            "--json",
            "--num-samples",
            "2",
            "--max-new-tokens",
            "10",
            "--temperature",
            "0",
        ])
        .current_dir(dir.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    // As `echo Whether |` sends it: the newline is echo's, not the prompt's.
    child.stdin.take().unwrap().write_all(b"Whether\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["prompt"], "Whether");
    assert_eq!(lines[0]["token_ids"].as_array().unwrap().len(), 10);
    assert_eq!(
        lines[0]["text"], lines[1]["text"],
        "greedy samples are equal"
    );
    assert!(lines[0]["stats"]["decode_tokens_per_s"].as_f64().unwrap() > 0.0);

    let out = succeeds(
        dir.path(),
        &["eval", "--checkpoint", ck, "--text", "corpus.txt", "--json"],
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let loss = r["loss"].as_f64().unwrap();
    assert!((r["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-6);
    let eval_auto = [
        "eval",
        "--checkpoint",
        ck,
        "--text",
        "corpus.txt",
        "--json",
        "--device",
        "auto",
    ];
    let out = succeeds(dir.path(), &eval_auto);
    assert!(stderr(&out).contains("device auto: "), "{}", stderr(&out));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!((r["loss"].as_f64().unwrap() - loss).abs() <= 1e-4 * loss);

    // Pictures: the loss curve was drawn at the end of training; plot and attention draw
    // on demand; attention's JSON has one T x T matrix per head, rows summing to 1.
    assert!(dir.path().join(ck).join("loss.png").is_file());
    succeeds(
        dir.path(),
        &["plot", "--checkpoint", ck, "--out", "curve.png"],
    );
    assert_eq!(
        &std::fs::read(dir.path().join("curve.png")).unwrap()[1..4],
        b"PNG"
    );
    let attention = ["attention", "--checkpoint", ck, "--prompt", "To be"];
    succeeds(dir.path(), &[&attention[..], &["--out", "a.png"]].concat());
    assert!(dir.path().join("a.png").is_file());
    let json = [&attention[..], &["--layer", "0", "--json"]].concat();
    let out = succeeds(dir.path(), &json);
    let maps: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(maps["tokens"].as_array().unwrap().len(), 5);
    let head0 = &maps["weights"][0][0];
    for (q, row) in head0.as_array().unwrap().iter().enumerate() {
        let row: Vec<f64> = row
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-5);
        assert!(
            row[q + 1..].iter().all(|&w| w == 0.0),
            "causal: no weight on later tokens"
        );
    }

    let out = succeeds(dir.path(), &["info", "--checkpoint", ck, "--json"]);
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["step"], 6);
    assert_eq!(info["val_step"], 6);
    assert_eq!(info["tokenizer"], "char");
    let out = succeeds(dir.path(), &["info", "--checkpoint", ck]);
    let text = String::from_utf8_lossy(&out.stdout);
    let loss = text.lines().find(|l| l.starts_with("loss")).unwrap();
    assert!(
        loss.contains(" at step 6, val ") && loss.contains(" at step 6 (best val "),
        "{loss}"
    );
    assert!(
        info["parameters"].as_u64().unwrap()
            > info["parameters_without_embeddings"].as_u64().unwrap()
    );
}

#[test]
fn padded_vocabulary_and_fine_tuning_runs() {
    let dir = setup();
    // A model vocabulary larger than the tokenizer's: sampling never picks a padding id.
    succeeds(
        dir.path(),
        &train_args(&[], &["model.vocab_size=128", "run.name=padded"]),
    );
    let out = succeeds(
        dir.path(),
        &[
            "generate",
            "--checkpoint",
            "checkpoints/padded",
            "--prompt",
            "To",
            "--temperature",
            "2",
            "--max-new-tokens",
            "200",
            "--json",
            "--seed",
            "1",
        ],
    );
    let sample: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let distinct_chars = 30; // fewer than the 128 model ids
    assert!(sample["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .all(|id| id.as_u64().unwrap() < distinct_chars + 10));

    // Fine-tune from it, then resume the fine-tuning run with the same command.
    let ft = train_args(
        &["--init-from", "checkpoints/padded"],
        &["run.name=ft", "model.n_layer=3"],
    );
    let out = succeeds(dir.path(), &ft);
    // The setting it does not use is said, with what the model has instead.
    assert!(
        stderr(&out).contains("not used: model.n_layer = 3 (it has 1)"),
        "{}",
        stderr(&out)
    );
    let mut resume = ft.to_vec();
    resume.extend(["--resume", "--set", "train.max_iters=8"]);
    succeeds(dir.path(), &resume);
    let info = tinygpt(
        dir.path(),
        &["info", "--checkpoint", "checkpoints/ft", "--json"],
    );
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["step"], 8);
    assert_eq!(
        info["config"]["model"]["n_layer"], 1,
        "the model came from --init-from"
    );

    // A shorter context trains on shorter sequences (the first learned positions kept);
    // a longer one is not taken: nothing was trained past the checkpoint's 16.
    let out = succeeds(
        dir.path(),
        &train_args(
            &["--init-from", "checkpoints/padded"],
            &["run.name=short", "model.block_size=8"],
        ),
    );
    assert!(
        stderr(&out).contains("at a context of 8 tokens (model.block_size; it has 16: its first learned positions kept)"),
        "{}",
        stderr(&out)
    );
    let info = tinygpt(
        dir.path(),
        &["info", "--checkpoint", "checkpoints/short", "--json"],
    );
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["config"]["model"]["block_size"], 8);
    let out = succeeds(
        dir.path(),
        &train_args(
            &["--init-from", "checkpoints/padded"],
            &["run.name=long", "model.block_size=32"],
        ),
    );
    assert!(
        stderr(&out).contains("not used: model.block_size = 32 (it has 16)"),
        "{}",
        stderr(&out)
    );
}

/// A warmup longer than the run leaves the rate far below train.lr, and says so; a
/// warmup that ends within the run says nothing.
#[test]
fn a_warmup_longer_than_the_run_is_told() {
    let dir = setup();
    let out = succeeds(
        dir.path(),
        &train_args(&[], &["train.max_iters=4", "train.warmup_iters=100"]),
    );
    assert!(
        stderr(&out).contains("train.warmup_iters = 100 is longer than the run (train.max_iters = 4): the learning rate reaches"),
        "{}",
        stderr(&out)
    );
    let out = succeeds(
        dir.path(),
        &train_args(
            &[],
            &[
                "run.name=short",
                "train.max_iters=4",
                "train.warmup_iters=2",
            ],
        ),
    );
    assert!(!stderr(&out).contains("warmup_iters"), "{}", stderr(&out));
}

/// `bench --decode-batch N` decodes N sequences together (as `generate --num-samples`)
/// and counts all their tokens; past the context the windows slide.
#[test]
fn bench_decodes_several_sequences_together() {
    let dir = setup();
    let bench = |batch: &str, json: bool| {
        let mut args = vec![
            "bench",
            "--config",
            "exp.toml",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--prompt-tokens",
            "4",
            "--decode-tokens",
            "20",
            "--decode-batch",
            batch,
        ];
        if json {
            args.push("--json");
        }
        let out = succeeds(dir.path(), &args);
        out.stdout
    };
    let report = |batch| serde_json::from_slice::<serde_json::Value>(&bench(batch, true)).unwrap();
    let (one, three) = (report("1"), report("3"));
    assert_eq!(one["decode_batch"], 1);
    assert_eq!(three["decode_batch"], 3);
    for r in [&one, &three] {
        let rate = r["decode_tokens_per_s"].as_f64().unwrap();
        assert!(rate.is_finite() && rate > 0.0, "{r}");
    }
    let text = String::from_utf8(bench("2", false)).unwrap();
    assert!(text.contains("2 sequences together"), "{text}");
}

/// `bench` gives the fastest and slowest timed step beside their median, in its JSON
/// and on its train line: on a shared machine the spread says how far to trust it.
#[test]
fn bench_gives_the_spread_of_its_steps() {
    let dir = setup();
    let args = [
        "bench", "--config", "exp.toml", "--steps", "3", "--warmup", "0",
    ];
    let out = succeeds(dir.path(), &[&args[..], &["--json"]].concat());
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (lo, hi) = (
        report["train_ms_range"][0].as_f64().unwrap(),
        report["train_ms_range"][1].as_f64().unwrap(),
    );
    let median = report["train_ms_per_step"].as_f64().unwrap();
    assert!(0.0 < lo && lo <= median && median <= hi, "{report}");
    let text = String::from_utf8(succeeds(dir.path(), &args).stdout).unwrap();
    assert!(text.contains("ms/step (median of 3, "), "{text}");
}

/// `bench --checkpoint` gives the bytes of weights read a second beside a plain read
/// pass on this machine, counting what a pass reads whatever its rows: every parameter
/// once but the position table, of which one row (this model's f32 matrices are
/// narrow enough to be held in two layouts too: neither is counted twice).
#[test]
fn bench_of_a_checkpoint_reads_the_weights_once_a_pass() {
    let dir = setup();
    succeeds(dir.path(), &["train", "--config", "exp.toml"]);
    let bench = |batch: &str, json: bool| {
        let mut args = vec!["bench", "--checkpoint", "checkpoints/exp", "--prompts", "4"];
        args.extend(["--decode-tokens", "8", "--decode-batch", batch]);
        if json {
            args.push("--json");
        }
        succeeds(dir.path(), &args).stdout
    };
    let report = |batch| serde_json::from_slice::<serde_json::Value>(&bench(batch, true)).unwrap();
    let (one, three) = (report("1"), report("3"));
    // GB read a pass: the rate of bytes over the rate of passes (tokens / batch).
    let per_pass = |r: &serde_json::Value| {
        let roof = r["read_pass_gb_per_s"].as_f64().unwrap();
        assert!(roof.is_finite() && roof > 0.0, "{r}");
        r["weights_gb_per_s"].as_f64().unwrap() * r["decode_batch"].as_f64().unwrap()
            / r["decode_tokens_per_s"].as_f64().unwrap()
    };
    // setup()'s model: learned positions, context 16, width 16.
    let parameters = one["parameters"].as_f64().unwrap();
    let weights_gb = 4.0 * (parameters - 15.0 * 16.0) / 1e9;
    for r in [&one, &three] {
        let gb = per_pass(r);
        assert!(
            (gb - weights_gb).abs() <= 1e-6 * weights_gb,
            "{gb} GB a pass: {r}"
        );
    }
    let text = String::from_utf8(bench("1", false)).unwrap();
    assert!(
        text.contains("weights read at") && text.contains("read pass here"),
        "{text}"
    );
}

/// A run resumed to a longer max_iters is told, in `compare`, from one trained to it
/// from the start: their config.toml files are the same, but the resume wrote what it
/// changed into metrics.jsonl.
#[test]
fn compare_tells_a_resumed_longer_run_from_a_fresh_one() {
    let dir = setup();
    succeeds(dir.path(), &train_args(&[], &["run.name=grown"]));
    succeeds(
        dir.path(),
        &train_args(&["--resume"], &["run.name=grown", "train.max_iters=9"]),
    );
    succeeds(
        dir.path(),
        &train_args(&[], &["run.name=fresh", "train.max_iters=9"]),
    );
    let runs = ["checkpoints/grown", "checkpoints/fresh"];
    let out = succeeds(dir.path(), &[&["compare", "--json"][..], &runs].concat());
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let differs = |i: usize| rows[i]["differs"].clone();
    assert_eq!(
        differs(0),
        serde_json::json!(["resumed at 6: max_iters 6->9"]),
        "{rows}"
    );
    assert_eq!(differs(1), serde_json::json!([]), "{rows}");
    // The sequences a step holds count, not how a step is split: doubling the batch
    // says so; the same sequences in two passes of half the batch say nothing.
    succeeds(
        dir.path(),
        &train_args(
            &["--resume"],
            &["run.name=grown", "train.max_iters=12", "train.batch_size=8"],
        ),
    );
    succeeds(
        dir.path(),
        &train_args(
            &["--resume"],
            &[
                "run.name=grown",
                "train.max_iters=15",
                "train.batch_size=4",
                "train.grad_accum=2",
            ],
        ),
    );
    let out = succeeds(dir.path(), &["compare", "--json", "checkpoints/grown"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        rows[0]["differs"],
        serde_json::json!([
            "resumed at 6: max_iters 6->9",
            "resumed at 9: max_iters 9->12, sequences_per_step 4->8",
            "resumed at 12: max_iters 12->15"
        ]),
        "{rows}"
    );
    // What it trains on too: another corpus and seed, then that corpus edited (its
    // config.toml keeps only the last corpus).
    let text = std::fs::read_to_string(dir.path().join("corpus.txt")).unwrap();
    std::fs::write(dir.path().join("other.txt"), &text).unwrap();
    let other = ["run.name=grown", "data.corpus=other.txt", "run.seed=7"];
    succeeds(
        dir.path(),
        &train_args(
            &["--resume"],
            &[&other[..], &["train.max_iters=18"]].concat(),
        ),
    );
    std::fs::write(
        dir.path().join("other.txt"),
        text.replace("question", "suoitqen"),
    )
    .unwrap();
    succeeds(
        dir.path(),
        &train_args(
            &["--resume"],
            &[&other[..], &["train.max_iters=21"]].concat(),
        ),
    );
    let out = succeeds(dir.path(), &["compare", "--json", "checkpoints/grown"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let differs = rows[0]["differs"].as_array().unwrap();
    assert_eq!(
        differs[3..],
        [
            "resumed at 15: corpus corpus.txt->other.txt, seed 1337->7, max_iters 15->18, sequences_per_step 8->4",
            "resumed at 18: corpus other.txt->other.txt (edited), max_iters 18->21"
        ],
        "{rows}"
    );
    // The table shows it too.
    let out = succeeds(dir.path(), &[&["compare"][..], &runs].concat());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("resumed at 6: max_iters 6->9"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// `compare` puts its picture where it was asked, or beside the runs, never into the
/// working folder; `--json` prints JSON and writes nothing; files a shell glob brings
/// (the pictures beside the runs) are passed over.
#[test]
fn compare_writes_beside_the_runs_and_json_alone() {
    let dir = setup();
    for name in ["a", "b"] {
        let run = format!("run.name={name}");
        succeeds(dir.path(), &train_args(&[], &[&run]));
    }
    let out = succeeds(dir.path(), &["compare", "checkpoints/a", "checkpoints/b"]);
    assert!(
        stderr(&out).contains("wrote checkpoints/compare.png"),
        "{}",
        stderr(&out)
    );
    assert!(dir.path().join("checkpoints/compare.png").is_file());
    assert!(
        !dir.path().join("compare.png").exists(),
        "nothing in the working folder"
    );

    // What `compare checkpoints/*` gives a program: the picture among the runs.
    std::fs::remove_file(dir.path().join("checkpoints/compare.png")).unwrap();
    std::fs::write(dir.path().join("checkpoints/sweep.png"), b"png").unwrap();
    let glob = [
        "compare",
        "--json",
        "checkpoints/a",
        "checkpoints/b",
        "checkpoints/sweep.png",
    ];
    let out = succeeds(dir.path(), &glob);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON alone");
    assert_eq!(rows.as_array().unwrap().len(), 2);
    assert!(
        stderr(&out).contains("skipped checkpoints/sweep.png"),
        "{}",
        stderr(&out)
    );
    assert!(
        !dir.path().join("checkpoints/compare.png").exists(),
        "--json writes no picture"
    );
    assert!(!dir.path().join("compare.png").exists());

    // Asked for: written there, with --json too.
    let asked = [
        "compare",
        "--json",
        "--out",
        "mine.png",
        "checkpoints/a",
        "checkpoints/b",
    ];
    succeeds(dir.path(), &asked);
    assert!(dir.path().join("mine.png").is_file());
}

/// A prompt longer than the context is cropped to its last block_size tokens when asked
/// (and refused otherwise: tests/mistakes.rs); samples count from 1 in JSON as on stderr.
#[test]
fn long_prompts_are_cropped_when_asked_and_samples_count_from_one() {
    let dir = setup();
    succeeds(dir.path(), &["train", "--config", "exp.toml"]);
    let long = "To be, or not to be, ".repeat(4); // 84 characters, context 16
    let args = [
        "generate",
        "--checkpoint",
        "checkpoints/exp",
        "--prompt",
        &long,
        "--crop",
        "--max-new-tokens",
        "4",
        "--seed",
        "1",
    ];
    let out = succeeds(dir.path(), &args);
    assert!(
        stderr(&out).contains("the prompt is 84 tokens; the model reads its last 16"),
        "{}",
        stderr(&out)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(&long));

    let args = [
        "generate",
        "--checkpoint",
        "checkpoints/exp",
        "--prompt",
        "To be",
        "--json",
        "--num-samples",
        "2",
        "--max-new-tokens",
        "3",
        "--seed",
        "1",
    ];
    let out = succeeds(dir.path(), &args);
    let samples: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let numbers: Vec<i64> = samples
        .iter()
        .map(|s| s["sample"].as_i64().unwrap())
        .collect();
    assert_eq!(numbers, [1, 2]);
}

/// `info` and `export` in plain words; `train` says at its start that a model will not
/// export, naming what would make it; an evaluation line logs the rate of the update
/// before it (as that step's training line does).
#[test]
fn info_export_and_train_speak_plainly() {
    let dir = setup();
    let out = succeeds(dir.path(), &train_args(&[], &["train.log_interval=1"]));
    assert!(!stderr(&out).contains("will refuse"), "{}", stderr(&out));
    let info = tinygpt(dir.path(), &["info", "--checkpoint", "checkpoints/exp"]);
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(
        text.contains("model       1 layer, 2 heads (2 K/V)"),
        "{text}"
    );
    assert!(text.contains("learned positions, no biases"), "{text}");
    let out = succeeds(
        dir.path(),
        &["export", "--checkpoint", "checkpoints/exp", "--out", "hf"],
    );
    assert!(stderr(&out).contains("(GPT-2 layout)"), "{}", stderr(&out));
    // Over an earlier export: written again (only other files are refused).
    succeeds(
        dir.path(),
        &["export", "--checkpoint", "checkpoints/exp", "--out", "hf"],
    );
    // Another model's folder of the same file names (transformers' own
    // tokenizer_config.json): not replaced.
    let theirs = dir.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    for name in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(dir.path().join("hf").join(name), theirs.join(name)).unwrap();
    }
    std::fs::write(
        theirs.join("tokenizer_config.json"),
        r#"{"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024, "bos_token": "<|endoftext|>"}"#,
    )
    .unwrap();
    let before = std::fs::read(theirs.join("model.safetensors")).unwrap();
    let out = tinygpt(
        dir.path(),
        &[
            "export",
            "--checkpoint",
            "checkpoints/exp",
            "--out",
            "theirs",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("not an earlier export"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        std::fs::read(theirs.join("model.safetensors")).unwrap(),
        before
    );
    // Imported, the model has no corpus of ours, and info says so.
    let imported = ["--from", "hf", "--out", "checkpoints/imported"];
    succeeds(dir.path(), &[&["import"][..], &imported].concat());
    let info = succeeds(
        dir.path(),
        &["info", "--checkpoint", "checkpoints/imported"],
    );
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(
        text.contains("corpus      none: imported (tinygpt import), not trained here"),
        "{text}"
    );
    // Nor any losses to draw.
    let out = tinygpt(
        dir.path(),
        &["plot", "--checkpoint", "checkpoints/imported"],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("holds weights not trained here (imported, or saved before a first step), so it has no losses to draw"),
        "{}",
        stderr(&out)
    );

    let metrics =
        std::fs::read_to_string(dir.path().join("checkpoints/exp/metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let lr_of = |key: &str, step: i64| {
        lines
            .iter()
            .find(|l| l["step"] == step && l.get(key).is_some())
            .map(|l| l["lr"].as_f64().unwrap())
            .unwrap()
    };
    for step in [3, 6] {
        assert_eq!(lr_of("val_loss", step), lr_of("loss", step), "step {step}");
    }

    let sinusoidal = train_args(
        &[],
        &[
            "run.name=sin",
            "model.positions=sinusoidal",
            "train.max_iters=1",
        ],
    );
    let out = succeeds(dir.path(), &sinusoidal);
    let log = stderr(&out);
    let note = log
        .lines()
        .position(|l| l.starts_with("note: `tinygpt export` will refuse"));
    let first_eval = log.lines().position(|l| l.starts_with("step"));
    assert!(
        note.is_some() && note < first_eval,
        "said before training: {log}"
    );
    let out = tinygpt(
        dir.path(),
        &["export", "--checkpoint", "checkpoints/sin", "--out", "hf2"],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("train one with them to export it"),
        "{}",
        stderr(&out)
    );
}

/// `eval --text` reads what training reads: a byte-order mark is dropped, a .jsonl's
/// documents (or a folder's) are scored separated as in training, a compressed file is
/// named as such. One document in a .jsonl is the text file itself, token for token.
#[test]
fn eval_reads_what_train_reads() {
    let dir = setup();
    let d = dir.path();
    succeeds(d, &train_args(&[], &[]));
    let text = std::fs::read_to_string(d.join("corpus.txt")).unwrap();
    let eval = |file: &str| {
        let args = [
            "eval",
            "--checkpoint",
            "checkpoints/exp",
            "--text",
            file,
            "--json",
        ];
        let r: serde_json::Value = serde_json::from_slice(&succeeds(d, &args).stdout).unwrap();
        (
            r["tokens"].as_u64().unwrap(),
            r["bytes"].as_u64().unwrap(),
            r["loss"].as_f64().unwrap(),
        )
    };
    let plain = eval("corpus.txt");
    std::fs::write(d.join("bom.txt"), format!("\u{feff}{text}")).unwrap();
    assert_eq!(eval("bom.txt"), plain);
    let line = |t: &str| format!("{}\n", serde_json::json!({ "text": t }));
    std::fs::create_dir(d.join("val")).unwrap();
    std::fs::write(d.join("val/one.jsonl"), line(&text)).unwrap();
    assert_eq!(eval("val/one.jsonl"), plain);
    assert_eq!(eval("val"), plain, "a folder of it");
    // Two documents: the same text with one separator (a newline in a char vocabulary)
    // between, which is predicted but is not the documents' text.
    let half = text.len() / 2;
    std::fs::write(
        d.join("two.jsonl"),
        line(&text[..half]) + &line(&text[half..]),
    )
    .unwrap();
    let (tokens, bytes, loss) = eval("two.jsonl");
    assert_eq!((tokens, bytes), (plain.0 + 1, plain.1), "{loss}");
    assert!(loss.is_finite() && loss != plain.2);

    std::fs::write(d.join("corpus.txt.gz"), b"\x1f\x8b\x08\x00rest").unwrap();
    let out = tinygpt(
        d,
        &[
            "eval",
            "--checkpoint",
            "checkpoints/exp",
            "--text",
            "corpus.txt.gz",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("corpus.txt.gz is gzip-compressed; decompress it first (gzip -dc corpus.txt.gz > corpus.txt)"),
        "{}",
        stderr(&out)
    );
}

/// A vocabulary size set for a char tokenizer, which has the corpus's characters
/// whatever is asked, is named as unused (it was dropped without a word).
#[test]
fn a_vocabulary_size_a_char_tokenizer_does_not_use_is_named() {
    let dir = setup();
    let out = succeeds(dir.path(), &train_args(&[], &["tokenizer.vocab_size=100"]));
    let chars = std::fs::read_to_string(dir.path().join("corpus.txt"))
        .unwrap()
        .chars()
        .collect::<std::collections::BTreeSet<char>>()
        .len();
    let note = format!(
        "note: tokenizer.vocab_size = 100 is not used: a char tokenizer's vocabulary is the corpus's characters ({chars} here;"
    );
    assert!(stderr(&out).contains(&note), "{}", stderr(&out));
    let out = succeeds(dir.path(), &train_args(&[], &["run.name=plain"]));
    assert!(!stderr(&out).contains("is not used"), "{}", stderr(&out));
}

/// `--version` names the features the binary was built with: which build is the MPI
/// one is otherwise known only by launching it under mpirun.
#[test]
fn the_version_names_the_build_features() {
    let out = succeeds(Path::new("."), &["--version"]);
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        said.starts_with("tinygpt ") && said.contains(" (features: "),
        "{said}"
    );
    for (feature, built) in [
        ("mpi", cfg!(feature = "mpi")),
        ("cuda-emulator", cfg!(feature = "cuda-emulator")),
    ] {
        assert_eq!(said.contains(feature), built, "{feature}: {said}");
    }
}

/// A sinusoidal run records its table's amplitude (1/sqrt(n_embd)); a checkpoint from
/// before the table was scaled records none and is read, evaluated and resumed with the
/// table it learned (amplitude 1), exactly as one that says `sinusoidal_scale = 1.0`.
#[test]
fn sinusoidal_checkpoints_from_before_the_scale_keep_their_table() {
    let dir = setup();
    let sets = ["run.name=sin", "model.positions=sinusoidal"];
    succeeds(dir.path(), &train_args(&[], &sets));
    let run = dir.path().join("checkpoints/sin");
    let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
    let recorded: toml::Table = toml::from_str(&config).unwrap();
    assert_eq!(
        recorded["model"]["sinusoidal_scale"].as_float(),
        Some(1.0 / 16f64.sqrt()),
        "{config}"
    );
    let loss = || {
        let eval = [
            "eval",
            "--checkpoint",
            "checkpoints/sin",
            "--text",
            "corpus.txt",
            "--json",
        ];
        let out = succeeds(dir.path(), &eval);
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        r["loss"].as_f64().unwrap()
    };
    // The run's config.toml rewritten, its digest in state.json with it.
    let rewrite = |text: &str| {
        std::fs::write(run.join("config.toml"), text).unwrap();
        let path = run.join("state.json");
        let mut state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        state["files"]["config.toml"] = serde_json::json!({
            "size": text.len(),
            "sha256": tinygpt::util::sha256_hex(text.as_bytes()),
        });
        std::fs::write(&path, serde_json::to_vec(&state).unwrap()).unwrap();
    };
    let scaled = loss();
    let without: String = config
        .lines()
        .filter(|l| !l.starts_with("sinusoidal_scale"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(without, config);
    rewrite(&without.replace("[model]\n", "[model]\nsinusoidal_scale = 1.0\n"));
    let unit = loss();
    rewrite(&without);
    let old = loss();
    assert_eq!(
        old, unit,
        "a checkpoint without the record is read with amplitude 1"
    );
    assert_ne!(old, scaled, "the amplitude reaches the model");

    // Resumed, it trains on with the table it learned and now records it.
    let out = succeeds(
        dir.path(),
        &train_args(&["--resume"], &[&sets[..], &["train.max_iters=9"]].concat()),
    );
    assert!(
        stderr(&out).contains("resuming at step 6"),
        "{}",
        stderr(&out)
    );
    let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(config.contains("sinusoidal_scale = 1.0"), "{config}");
}

/// Every config shipped in configs/ trains (a few steps, on a small corpus), samples and
/// exports to Hugging Face.
#[test]
fn every_shipped_config_trains_samples_and_exports() {
    let dir = tempfile::tempdir().unwrap();
    let words = [
        "thou",
        "art",
        "more",
        "lovely",
        "and",
        "temperate",
        "rough",
        "winds",
        "do",
        "shake",
        "the",
        "darling",
        "buds",
        "of",
        "may",
        "summer's",
        "lease",
    ];
    let mut state = 7u64;
    let text: String = (0..12_000)
        .map(|i| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let word = words[(state >> 33) as usize % words.len()];
            if i % 9 == 8 {
                format!("{word}\n")
            } else {
                format!("{word} ")
            }
        })
        .collect();
    std::fs::write(dir.path().join("corpus.txt"), text).unwrap();
    let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut names: Vec<_> = std::fs::read_dir(&configs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    names.sort();
    assert!(names.len() >= 3, "{names:?}");
    for config in &names {
        let name = config.file_stem().unwrap().to_string_lossy().into_owned();
        let sets = [
            "data.corpus=corpus.txt",
            "train.max_iters=2",
            "train.eval_interval=2",
            "train.eval_iters=1",
            "tokenizer.vocab_size=300",
        ];
        let mut args = vec!["train", "--config", config.to_str().unwrap()];
        for set in &sets {
            args.extend(["--set", set]);
        }
        let out = tinygpt(dir.path(), &args);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        assert!(
            !stderr(&out).contains("will refuse"),
            "{name}: {}",
            stderr(&out)
        );
        let run = format!("checkpoints/{name}");
        let sample = [
            "generate",
            "--checkpoint",
            &run,
            "--max-new-tokens",
            "5",
            "--seed",
            "3",
        ];
        let out = tinygpt(dir.path(), &sample);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        let hf = format!("hf-{name}");
        let out = tinygpt(dir.path(), &["export", "--checkpoint", &run, "--out", &hf]);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        assert!(dir.path().join(&hf).join("model.safetensors").is_file());
    }
}

/// Completions for every shell clap knows, that bash loads; manual pages that `man`
/// renders.
#[test]
fn completions_and_manual_pages() {
    let dir = tempfile::tempdir().unwrap();
    for shell in ["bash", "zsh", "fish", "powershell", "elvish"] {
        let out = tinygpt(dir.path(), &["completions", shell]);
        assert!(out.status.success(), "{shell}: {}", stderr(&out));
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(
            script.contains("generate") && script.contains("checkpoint"),
            "{shell}"
        );
    }
    let bash = format!(
        "source <({:?} completions bash) && complete -p tinygpt",
        env!("CARGO_BIN_EXE_tinygpt")
    );
    match Command::new("bash").args(["-c", &bash]).output() {
        Ok(out) => assert!(
            String::from_utf8_lossy(&out.stdout).contains("tinygpt"),
            "bash did not register the completion: {}",
            stderr(&out)
        ),
        Err(_) => eprintln!("SKIPPED loading the completion into bash: no bash"),
    }

    let out = tinygpt(dir.path(), &["man"]);
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(
        page.contains(".TH tinygpt 1") && page.contains("train"),
        "{page}"
    );
    succeeds(dir.path(), &["man", "--out", "man1"]);
    let train = dir.path().join("man1/tinygpt-train.1");
    assert!(dir.path().join("man1/tinygpt.1").is_file() && train.is_file());
    match Command::new("man")
        .arg("-l")
        .arg(&train)
        .env("MANWIDTH", "100")
        .output()
    {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                text.contains("--init-from") && text.contains("--resume"),
                "{text}"
            );
        }
        _ => eprintln!("SKIPPED rendering the page with man: no man here"),
    }
}

/// `tinygpt cache` on a temp folder of runs: what each cache file is used by; `prune`
/// lists (and with --yes deletes) exactly what no run uses, the ids old runs keep, and
/// with --older-than what nobody read lately; every checkpoint stays as it was, and the
/// runs still resume.
#[test]
fn the_cache_is_listed_and_pruned_by_use() {
    let dir = setup();
    let d = dir.path();
    let other = "Another corpus entirely, with other words in it.\n".repeat(60);
    std::fs::write(d.join("other.txt"), other).unwrap();
    let train = |name: &str, sets: &[&str]| {
        let run = format!("run.name={name}");
        let mut args = train_args(&[], &[&run]);
        for set in sets {
            args.extend(["--set", set]);
        }
        let out = tinygpt(d, &args);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
    };
    train("char", &[]);
    train("bpe", &["tokenizer.kind=bpe", "tokenizer.vocab_size=300"]);
    train("gone", &["tokenizer.kind=bpe", "tokenizer.vocab_size=280"]);
    train("elsewhere", &["data.corpus=other.txt"]);
    std::fs::remove_dir_all(d.join("checkpoints/gone")).unwrap();
    std::fs::remove_dir_all(d.join("checkpoints/elsewhere")).unwrap();
    // A run from before the shared cache: its ids in its own folder.
    std::fs::write(d.join("checkpoints/char/tokens.bin"), [7u8; 1000]).unwrap();
    std::fs::write(d.join("checkpoints/char/tokens.json"), "{}").unwrap();

    let out = succeeds(d, &["cache", "--json"]);
    let inv: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let caches = inv["caches"].as_array().unwrap();
    assert_eq!(caches.len(), 2, "one folder per corpus: {inv:#}");
    let users = |file: &str| -> Vec<String> {
        caches
            .iter()
            .flat_map(|c| c["files"].as_array().unwrap())
            .filter(|f| f["path"].as_str().unwrap().ends_with(file))
            .flat_map(|f| f["used_by"].as_array().unwrap().clone())
            .map(|r| r.as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(users("tokenizer-char.json"), ["checkpoints/char"]);
    assert_eq!(
        users("tokenizer-bpe-300-32000000.json"),
        ["checkpoints/bpe"]
    );
    assert!(users("tokenizer-bpe-280-32000000.json").is_empty());
    assert_eq!(inv["legacy"].as_array().unwrap().len(), 2);
    let listed = String::from_utf8_lossy(&tinygpt(d, &["cache"]).stdout).into_owned();
    assert!(
        listed.contains("used by checkpoints/char") && listed.contains("unused"),
        "{listed}"
    );

    let checkpoints = |d: &Path| -> Vec<(String, Vec<u8>)> {
        let mut files = Vec::new();
        for run in ["char", "bpe"] {
            for name in [
                "model.safetensors",
                "optimizer.safetensors",
                "state.json",
                "tokenizer.json",
            ] {
                let path = d.join("checkpoints").join(run).join(name);
                files.push((path.display().to_string(), std::fs::read(&path).unwrap()));
            }
        }
        files
    };
    let before = checkpoints(d);

    // From a folder with no checkpoints folder, no run's use is known: refused, not
    // every cache offered for deletion.
    let elsewhere = d.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let cache_arg = d.join("cache").display().to_string();
    let out = tinygpt(&elsewhere, &["cache", "prune", "--cache", &cache_arg]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--runs DIR"), "{}", stderr(&out));

    // A dry run says what and why, and deletes nothing.
    let out = succeeds(d, &["cache", "prune"]);
    let plan = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        plan.contains("other-") && plan.contains("no run uses it"),
        "{plan}"
    );
    assert!(
        plan.contains("tokenizer-bpe-280") && plan.contains("checkpoints/char/tokens.bin"),
        "{plan}"
    );
    assert!(
        !plan.contains("tokenizer-char.json") && !plan.contains("tokenizer-bpe-300"),
        "{plan}"
    );
    assert!(stderr(&out).contains("would delete") && stderr(&out).contains("--yes"));
    assert!(d.join("checkpoints/char/tokens.bin").exists());

    succeeds(d, &["cache", "prune", "--yes"]);
    assert!(!d.join("checkpoints/char/tokens.bin").exists());
    assert_eq!(checkpoints(d), before, "no checkpoint touched");
    let out = tinygpt(d, &["cache", "prune", "--json"]);
    let left: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(left["removals"].as_array().unwrap().len(), 0, "{left:#}");

    // The temporary file of a write a killed trainer never finished (kill -9 while it
    // encoded: as big as the ids) is pruned, and the next run on the folder removes it
    // (it was left for ever).
    let char_cache = std::fs::read_dir(d.join("cache"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("tokenizer-char.json").exists())
        .unwrap();
    let unfinished = char_cache.join(".tokens-0123456789abcdef.bin.tmp4000000");
    std::fs::write(&unfinished, [0u8; 4096]).unwrap();
    let plan = String::from_utf8_lossy(&succeeds(d, &["cache", "prune"]).stdout).into_owned();
    assert!(
        plan.contains(".tokens-0123456789abcdef.bin.tmp4000000")
            && plan.contains("a write its process never finished"),
        "{plan}"
    );
    succeeds(d, &train_args(&[], &["run.name=fresh"]));
    assert!(!unfinished.exists(), "the next run removed it");

    // Read long ago: --older-than takes it, used or not; training makes it again.
    let cache = d.join("cache");
    let folder = std::fs::read_dir(&cache)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::write(folder.join("used"), "1000").unwrap();
    // Unless a process holds it (as a trainer does while it prepares or reads the
    // folder, before its run folder says which cache it uses): left alone, whole.
    let held = std::fs::File::open(folder.join("in-use.lock")).expect("trainers hold it");
    held.lock_shared().unwrap();
    let listed = String::from_utf8_lossy(&succeeds(d, &["cache"]).stdout).into_owned();
    assert!(listed.contains("in use now"), "{listed}");
    succeeds(d, &["cache", "prune", "--older-than", "30d", "--yes"]);
    assert!(folder.join("corpus.json").exists());
    drop(held);
    succeeds(d, &["cache", "prune", "--older-than", "30d", "--yes"]);
    assert!(!folder.exists());
    assert_eq!(checkpoints(d), before);
    let more = train_args(&["--resume"], &["run.name=char", "train.max_iters=8"]);
    succeeds(d, &more);
}

/// A run stopped, then resumed under other thread counts (RAYON_NUM_THREADS 1, then 3),
/// ends with the bits of the run that went straight through on 2, in f32 and in bf16:
/// no sum's order follows the threads. The shapes are past where the passes split: a
/// norm's gain gradient over 768 rows of 128 and, in bf16, the weight gradients of
/// 128 x 128 over 768 tokens (a long sum, cut by k).
#[test]
fn a_run_resumed_on_other_thread_counts_ends_with_the_same_bits() {
    let text =
        "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
            .repeat(60);
    let dir = common::char_experiment(
        &text,
        "n_layer = 2\nn_head = 4\nn_embd = 128\nblock_size = 64",
        "batch_size = 12\nmax_iters = 6\nlr_decay_iters = 6\nwarmup_iters = 1\neval_interval = 100\neval_iters = 1\ncheckpoint_interval = 100",
    );
    let train = |threads: &str, name: &str, dtype: &str, steps: u32, resume: bool| {
        let (name, dtype, steps) = (
            format!("run.name={name}"),
            format!("train.dtype={dtype}"),
            format!("train.max_iters={steps}"),
        );
        let flags: &[&str] = if resume { &["--resume"] } else { &[] };
        let out = Command::new(env!("CARGO_BIN_EXE_tinygpt"))
            .args(train_args(flags, &[&name, &dtype, &steps]))
            .env("RAYON_NUM_THREADS", threads)
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    };
    let read = |name: &str, file: &str| {
        std::fs::read(dir.path().join("checkpoints").join(name).join(file)).unwrap()
    };
    for dtype in ["f32", "bf16"] {
        let (straight, resumed) = (format!("straight-{dtype}"), format!("resumed-{dtype}"));
        train("2", &straight, dtype, 6, false);
        train("1", &resumed, dtype, 3, false);
        train("3", &resumed, dtype, 6, true);
        for file in ["model.safetensors", "optimizer.safetensors"] {
            assert!(
                read(&straight, file) == read(&resumed, file),
                "{dtype}: {file} differs between the straight run (2 threads) and the one resumed on 1 then 3"
            );
        }
    }
}

/// Ids damaged in the token cache after it was written (a bit flip, a stray write)
/// stop the run with one line naming the folder to delete, where an engine would
/// index past its embedding (a panic); deleted, the cache is made anew and the run
/// trains.
#[test]
fn damaged_ids_in_the_token_cache_are_named() {
    let dir = setup();
    let d = dir.path();
    succeeds(d, &train_args(&[], &["run.name=first"]));
    let ids = std::fs::read_dir(d.join("cache"))
        .unwrap()
        .flat_map(|folder| std::fs::read_dir(folder.unwrap().path()).unwrap())
        .map(|f| f.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "bin"))
        .expect("the ids in the cache");
    let mut bytes = std::fs::read(&ids).unwrap();
    for pair in bytes.chunks_exact_mut(2) {
        pair.copy_from_slice(&0xFFFFu16.to_le_bytes());
    }
    std::fs::write(&ids, bytes).unwrap();
    let out = tinygpt(d, &train_args(&[], &["run.name=second"]));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("holds id 65535, outside the model's vocabulary")
            && stderr(&out).contains("delete that folder"),
        "{}",
        stderr(&out)
    );
    std::fs::remove_dir_all(ids.parent().unwrap()).unwrap();
    succeeds(d, &train_args(&[], &["run.name=second"]));
}

/// A run folder whose state.json is gone still holds weights: neither a new run nor a
/// resume writes over them; the message says what is missing and what to do.
#[test]
fn weights_without_their_state_are_not_overwritten() {
    let dir = setup();
    let d = dir.path();
    succeeds(d, &train_args(&[], &["run.name=kept"]));
    let run = d.join("checkpoints/kept");
    std::fs::remove_file(run.join("state.json")).unwrap();
    let weights = std::fs::read(run.join("model.safetensors")).unwrap();
    for flags in [&[][..], &["--resume"][..]] {
        let out = tinygpt(d, &train_args(flags, &["run.name=kept", "run.seed=7"]));
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {}", stderr(&out));
        assert!(
            stderr(&out)
                .contains("holds model.safetensors and optimizer.safetensors but no state.json"),
            "{}",
            stderr(&out)
        );
        assert_eq!(
            std::fs::read(run.join("model.safetensors")).unwrap(),
            weights
        );
    }
}

/// A resume that stretches the cosine schedule says the rate rises again; one still in
/// its warmup (which rises by itself) says nothing of it.
#[test]
fn a_resume_names_a_rising_rate_only_when_the_schedule_changed() {
    let dir = setup();
    let d = dir.path();
    let rising = "the rate rises again";
    succeeds(
        d,
        &train_args(
            &[],
            &[
                "run.name=warm",
                "train.warmup_iters=10",
                "train.max_iters=3",
            ],
        ),
    );
    let out = succeeds(
        d,
        &train_args(
            &["--resume"],
            &[
                "run.name=warm",
                "train.warmup_iters=10",
                "train.max_iters=5",
            ],
        ),
    );
    assert!(!stderr(&out).contains(rising), "{}", stderr(&out));
    succeeds(d, &train_args(&[], &["run.name=decayed"]));
    let out = succeeds(
        d,
        &train_args(&["--resume"], &["run.name=decayed", "train.max_iters=40"]),
    );
    assert!(stderr(&out).contains(rising), "{}", stderr(&out));
}

/// A resume under another seed, split or corpus goes on, saying what it changed; an
/// unchanged one says nothing of it.
#[test]
fn a_resume_names_changes_to_its_data_and_seed() {
    let dir = setup();
    let d = dir.path();
    succeeds(d, &train_args(&[], &["run.name=moved"]));
    let out = succeeds(
        d,
        &train_args(&["--resume"], &["run.name=moved", "train.max_iters=8"]),
    );
    assert!(
        !stderr(&out).contains("the checkpoint's"),
        "{}",
        stderr(&out)
    );
    std::fs::copy(d.join("corpus.txt"), d.join("other.txt")).unwrap();
    let out = succeeds(
        d,
        &train_args(
            &["--resume"],
            &[
                "run.name=moved",
                "train.max_iters=10",
                "run.seed=7",
                "data.val_fraction=0.2",
                "data.corpus=other.txt",
            ],
        ),
    );
    let said = stderr(&out);
    for note in [
        "note: run.seed is 7 (the checkpoint's 1337)",
        "note: data.val_fraction is 0.2 (the checkpoint's 0.1)",
        "note: the corpus is not the checkpoint's",
    ] {
        assert!(said.contains(note), "{note}: {said}");
    }
    assert!(!said.contains("changed since"), "{said}");
    // The same path, edited in place (the same characters: the vocabulary holds).
    let text = std::fs::read_to_string(d.join("other.txt")).unwrap();
    std::fs::write(d.join("other.txt"), text.replace("question", "nobler")).unwrap();
    let out = succeeds(
        d,
        &train_args(
            &["--resume"],
            &[
                "run.name=moved",
                "train.max_iters=12",
                "run.seed=7",
                "data.val_fraction=0.2",
                "data.corpus=other.txt",
            ],
        ),
    );
    let said = stderr(&out);
    assert!(
        said.contains("note: corpus other.txt changed since the checkpoint was written"),
        "{said}"
    );
    assert!(
        !said.contains("the checkpoint's"),
        "only the edit is new: {said}"
    );
}

/// Where stderr is a log (a pipe here), long data preparation writes its bar as a plain
/// line every TINYGPT_PROGRESS_SECONDS and its closing line; shorter work writes nothing.
#[test]
fn data_preparation_speaks_in_a_log_when_it_lasts() {
    let text = common::random_words(3, 600_000, 8);
    let dir = common::char_experiment(
        &text,
        "n_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16",
        "batch_size = 2\nmax_iters = 1\neval_iters = 1",
    );
    let run = |seconds: &str, name: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tinygpt"))
            .args(train_args(
                &[],
                &[
                    &format!("run.name={name}"),
                    &format!("data.cache_dir={name}-cache"),
                ],
            ))
            .env("TINYGPT_PROGRESS_SECONDS", seconds)
            .current_dir(dir.path())
            .output()
            .unwrap();
        stderr(&common::succeeded(out))
    };
    let quiet = run("30", "quiet");
    assert!(!quiet.contains("encoding"), "{quiet}");
    let told = run("0.001", "told");
    let progress: Vec<&str> = told
        .lines()
        .filter(|l| l.starts_with("encoding") && l.contains('/'))
        .collect();
    assert!(!progress.is_empty(), "no progress line: {told}");
    assert!(
        !told.contains('\r') && !told.contains('\u{1b}'),
        "no terminal codes in a log: {told:?}"
    );
    assert!(
        told.contains("\nencoded 5.7 MB into"),
        "the closing line: {told}"
    );
}

/// A corpus folder's files are read whatever the case of their extension; what it
/// holds that is not read is named in a note (a .csv or a subfolder would go unseen).
#[test]
fn a_corpus_folder_names_what_it_does_not_read() {
    let dir = setup();
    let d = dir.path();
    let corpus = d.join("folder");
    std::fs::create_dir_all(corpus.join("more")).unwrap();
    let text = std::fs::read_to_string(d.join("corpus.txt")).unwrap();
    std::fs::write(corpus.join("a.txt"), &text).unwrap();
    std::fs::write(corpus.join("B.TXT"), &text).unwrap();
    std::fs::write(corpus.join("notes.csv"), "x").unwrap();
    std::fs::write(corpus.join(".hidden"), "x").unwrap();
    let out = succeeds(
        d,
        &train_args(&[], &["data.corpus=folder", "run.name=folder"]),
    );
    let said = stderr(&out);
    assert!(
        said.contains("note: corpus folder folder also holds 2 entries not read")
            && said.contains("more/, notes.csv"),
        "{said}"
    );
    assert!(!said.contains(".hidden"), "{said}");
    // Both texts read: twice the tokens of one (and the newline between documents).
    let one = text.chars().count();
    let found = corpus_tokens(&said);
    assert_eq!(found, 2 * one + 1, "{said}");

    // A table named as the corpus is read as text, and said to be.
    std::fs::write(d.join("table.csv"), format!("text\n\"{text}\"\n")).unwrap();
    let out = succeeds(
        d,
        &train_args(&[], &["data.corpus=table.csv", "run.name=table"]),
    );
    assert!(
        stderr(&out).contains(
            "note: corpus table.csv is read as plain text, its header, separators and quotes included; to train on one column, write it as .jsonl"
        ),
        "{}",
        stderr(&out)
    );
    assert!(
        !stderr(&out).contains("Windows line ends"),
        "{}",
        stderr(&out)
    );

    // Windows line ends become a character of a char vocabulary, and are said to.
    std::fs::write(d.join("crlf.txt"), text.replace('\n', "\r\n")).unwrap();
    let out = succeeds(
        d,
        &train_args(&[], &["data.corpus=crlf.txt", "run.name=crlf"]),
    );
    assert!(
        stderr(&out)
            .contains("note: the char vocabulary holds '\\r': the corpus has Windows line ends"),
        "{}",
        stderr(&out)
    );
}

/// The train + val token count of `train`'s first line.
fn corpus_tokens(said: &str) -> usize {
    let line = said.lines().find(|l| l.starts_with("run ")).unwrap();
    let numbers: Vec<usize> = line
        .split(", ")
        .find(|part| part.ends_with(" val tokens"))
        .unwrap()
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    numbers.iter().sum()
}

/// A tokenizer.json that turns what it cannot spell into one unknown token (WordPiece
/// here): much of the corpus so is refused, a little is named in a note (both went
/// unsaid, and a model learned `[UNK]`).
#[test]
fn a_tokenizer_that_cannot_spell_the_corpus_is_told() {
    let words = ["[UNK]", "to", "be", "or", "not"];
    let vocab: serde_json::Map<String, serde_json::Value> = words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), i.into()))
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": vocab},
    });
    let run = |line: &str, name: &str| {
        let dir = common::char_experiment(
            &line.repeat(200),
            "n_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16",
            "batch_size = 2\nmax_iters = 1\neval_iters = 1",
        );
        std::fs::write(dir.path().join("wp.json"), tokenizer.to_string()).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tinygpt"))
            .args(train_args(
                &[],
                &[
                    "tokenizer.kind=bpe",
                    "tokenizer.path=wp.json",
                    &format!("run.name={name}"),
                ],
            ))
            .current_dir(dir.path())
            .output()
            .unwrap();
        (out.status.code(), stderr(&out))
    };
    // 1 in 7 tokens unknown: refused.
    let (code, said) = run("to be or not to be zz\n", "much");
    assert_eq!(code, Some(2), "{said}");
    assert!(
        said.contains("14% of the corpus's tokens (200 of 1400) are the unknown token \"[UNK]\""),
        "{said}"
    );
    // 1 in 41: trained, with a note.
    let (code, said) = run(&format!("{}zz\n", "to be or not ".repeat(10)), "little");
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains(
            "note: 200 of the corpus's 8200 tokens (2.44%) are the unknown token \"[UNK]\""
        ),
        "{said}"
    );
}

/// A corpus touched (or copied without -p) is read and encoded again into a cache
/// folder of its own: said, with the old folder left for `cache prune` (it was silent,
/// a gigabyte corpus's work and disk doubled unseen).
#[test]
fn a_corpus_read_again_says_why_and_what_stays() {
    let dir = setup();
    let d = dir.path();
    let first = succeeds(d, &train_args(&[], &["run.name=first"]));
    assert!(
        !stderr(&first).contains("is not what its cache"),
        "{}",
        stderr(&first)
    );
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
    let file = std::fs::File::options()
        .write(true)
        .open(d.join("corpus.txt"))
        .unwrap();
    file.set_modified(later).unwrap();
    let again = succeeds(d, &train_args(&[], &["run.name=again"]));
    let said = stderr(&again);
    assert!(
        said.contains("note: corpus corpus.txt is not what its cache cache/corpus-")
            && said.contains("the cache made before stays")
            && said.contains("until `tinygpt cache prune`"),
        "{said}"
    );
}
