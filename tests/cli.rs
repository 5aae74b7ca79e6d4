//! The real binary, used as a user would: train from a config file, resume, generate,
//! eval, info. (Mistakes are in tests/mistakes.rs.)

use std::path::Path;
use std::process::{Command, Output};

fn tinygpt(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tinygpt"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let text =
        "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
            .repeat(40);
    std::fs::write(dir.path().join("corpus.txt"), text).unwrap();
    std::fs::write(
        dir.path().join("exp.toml"),
        "[data]\ncorpus = \"corpus.txt\"\n[tokenizer]\nkind = \"char\"\n\
         [model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n\
         [train]\nbatch_size = 4\nmax_iters = 6\nwarmup_iters = 1\neval_interval = 3\neval_iters = 1\ncheckpoint_interval = 3\n",
    )
    .unwrap();
    dir
}

#[test]
fn train_then_resume_from_the_command_line() {
    let dir = setup();
    let out = tinygpt(
        dir.path(),
        &[
            "train",
            "--config",
            "exp.toml",
            "--set",
            "tokenizer.kind=bpe",
            "--set",
            "tokenizer.vocab_size=300",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
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

    // Resume to more steps.
    let out = tinygpt(
        dir.path(),
        &[
            "train",
            "--config",
            "exp.toml",
            "--resume",
            "--set",
            "train.max_iters=9",
            "--set",
            "run.device=auto",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("resuming at step 6"),
        "{}",
        stderr(&out)
    );
    // `auto` says in the run's first line what it chose and why.
    assert!(stderr(&out).contains(" (auto: "), "{}", stderr(&out));
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["step"], 9);
}

#[test]
fn generate_eval_and_info_from_a_checkpoint() {
    let dir = setup();
    let out = tinygpt(dir.path(), &["train", "--config", "exp.toml"]);
    assert!(out.status.success(), "{}", stderr(&out));
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
    let out = tinygpt(dir.path(), &generate);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout.clone()).unwrap();
    assert!(text.starts_with("To be"), "{text}");
    assert!(stderr(&out).contains("decode") && stderr(&out).contains("tokens/s"));
    let again = tinygpt(dir.path(), &generate);
    assert_eq!(again.stdout, out.stdout, "same seed, same text");

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
    child.stdin.take().unwrap().write_all(b"Whether").unwrap();
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

    let out = tinygpt(
        dir.path(),
        &["eval", "--checkpoint", ck, "--text", "corpus.txt", "--json"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
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
    let out = tinygpt(dir.path(), &eval_auto);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("device auto: "), "{}", stderr(&out));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!((r["loss"].as_f64().unwrap() - loss).abs() <= 1e-4 * loss);

    // Pictures: the loss curve was drawn at the end of training; plot and attention draw
    // on demand; attention's JSON has one T x T matrix per head, rows summing to 1.
    assert!(dir.path().join(ck).join("loss.png").is_file());
    let out = tinygpt(
        dir.path(),
        &["plot", "--checkpoint", ck, "--out", "curve.png"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        &std::fs::read(dir.path().join("curve.png")).unwrap()[1..4],
        b"PNG"
    );
    let out = tinygpt(
        dir.path(),
        &[
            "attention",
            "--checkpoint",
            ck,
            "--prompt",
            "To be",
            "--out",
            "a.png",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(dir.path().join("a.png").is_file());
    let out = tinygpt(
        dir.path(),
        &[
            "attention",
            "--checkpoint",
            ck,
            "--prompt",
            "To be",
            "--layer",
            "0",
            "--json",
        ],
    );
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

    let out = tinygpt(dir.path(), &["info", "--checkpoint", ck, "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["step"], 6);
    assert_eq!(info["tokenizer"], "char");
    assert!(
        info["parameters"].as_u64().unwrap()
            > info["parameters_without_embeddings"].as_u64().unwrap()
    );
}

#[test]
fn padded_vocabulary_and_fine_tuning_runs() {
    let dir = setup();
    // A model vocabulary larger than the tokenizer's: sampling never picks a padding id.
    let out = tinygpt(
        dir.path(),
        &[
            "train",
            "--config",
            "exp.toml",
            "--set",
            "model.vocab_size=128",
            "--set",
            "run.name=padded",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let out = tinygpt(
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
    assert!(out.status.success(), "{}", stderr(&out));
    let sample: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let distinct_chars = 30; // fewer than the 128 model ids
    assert!(sample["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .all(|id| id.as_u64().unwrap() < distinct_chars + 10));

    // Fine-tune from it, then resume the fine-tuning run with the same command.
    let ft = [
        "train",
        "--config",
        "exp.toml",
        "--init-from",
        "checkpoints/padded",
        "--set",
        "run.name=ft",
        "--set",
        "model.n_layer=3",
    ];
    let out = tinygpt(dir.path(), &ft);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut resume = ft.to_vec();
    resume.extend(["--resume", "--set", "train.max_iters=8"]);
    let out = tinygpt(dir.path(), &resume);
    assert!(out.status.success(), "{}", stderr(&out));
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
        let out = tinygpt(dir.path(), &args);
        assert!(out.status.success(), "{}", stderr(&out));
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
