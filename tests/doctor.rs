//! `tinygpt doctor` through the real binary: every check passes on this machine (every
//! CPU level it has; the CUDA engine and decoder under the emulator in such builds),
//! and each check fails, alone, when its result is made wrong on purpose
//! (`TINYGPT_DOCTOR_FAULT`), with exit code 1 and the check named.

use std::process::Command;

fn doctor(fault: Option<&str>) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tinygpt"));
    cmd.args(["doctor", "--json"]);
    match fault {
        Some(f) => cmd.env("TINYGPT_DOCTOR_FAULT", f),
        None => cmd.env_remove("TINYGPT_DOCTOR_FAULT"),
    };
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn checks(stdout: &str) -> Vec<serde_json::Value> {
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    report["checks"].as_array().unwrap().clone()
}

#[test]
fn every_check_passes_here_and_fails_when_made_wrong() {
    let (code, stdout, stderr) = doctor(None);
    assert_eq!(code, 0, "doctor passes here: {stdout}\n{stderr}");
    let all = checks(&stdout);
    let names: std::collections::BTreeSet<String> = all
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect();
    let places: std::collections::BTreeSet<String> = all
        .iter()
        .map(|c| c["place"].as_str().unwrap().to_string())
        .collect();
    for level in tinygpt::cpu::isa::Isa::supported() {
        assert!(
            places.contains(&format!("cpu ({})", level.name())),
            "the kernels at {level:?} are checked: {places:?}"
        );
    }
    for name in [
        "kernels: f32 gemm",
        "kernels: bf16 gemm",
        "kernels: bf16 rows",
        "kernels: int8 products",
        "kernels: int4 products",
        "engine loss",
        "engine gradients",
        "engine weights after AdamW",
        "decoder logits",
    ] {
        assert!(names.contains(name), "{name} is checked: {names:?}");
    }
    if cfg!(feature = "cuda-emulator") {
        assert!(places.contains("cuda (emulated)"), "{places:?}");
        for name in ["graph replay", "engine bf16 loss", "engine bf16 gradients"] {
            assert!(names.contains(name), "{name} is checked: {names:?}");
        }
    }
    for c in &all {
        let (error, bound) = (c["error"].as_f64().unwrap(), c["bound"].as_f64().unwrap());
        assert!(error <= bound && c["passed"] == true, "{c}");
    }

    // Each check, broken alone, fails alone.
    for name in &names {
        let (code, stdout, stderr) = doctor(Some(name));
        assert_eq!(code, 1, "{name} broken: exit 1 ({stderr})");
        assert!(
            stderr.contains(name.as_str()),
            "the failure names {name}: {stderr}"
        );
        for c in checks(&stdout) {
            let broken = c["name"] == name.as_str();
            assert_eq!(c["passed"] == false, broken, "{name} broken: {c}");
        }
    }
}

/// A verdict is remembered: the second ask for the same key runs no check; another key
/// (another GPU, driver or binary) runs its own.
#[test]
fn a_first_use_verdict_is_remembered_per_key() {
    use tinygpt::doctor::{first_use_with, Check, FirstUse, Report};
    let dir = tempfile::tempdir().unwrap();
    let failing = || {
        Ok(Report {
            devices: Vec::new(),
            checks: vec![Check {
                place: "cuda:0".into(),
                name: "engine gradients".into(),
                error: 0.03,
                bound: 1e-4,
                passed: false,
            }],
        })
    };
    let first = first_use_with("gpu A", Some(dir.path()), failing).unwrap();
    let FirstUse::Failed(line) = &first else {
        panic!("{first:?}")
    };
    assert!(
        line.contains("engine gradients") && line.contains("tinygpt doctor"),
        "{line}"
    );
    let again = first_use_with("gpu A", Some(dir.path()), || panic!("checked again")).unwrap();
    assert_eq!(again, first);
    let passing = || {
        Ok(Report {
            devices: Vec::new(),
            checks: Vec::new(),
        })
    };
    let other = first_use_with("gpu B", Some(dir.path()), passing).unwrap();
    assert_eq!(other, FirstUse::Passed);
    // Nowhere to remember: checked every time.
    let mut runs = 0;
    for _ in 0..2 {
        first_use_with("gpu C", None, || {
            runs += 1;
            passing()
        })
        .unwrap();
    }
    assert_eq!(runs, 2);
}

/// Training on the fused CUDA code (here under the emulator) whose first-use check fails
/// (a wrong gradient injected): one line naming the check and `doctor`, and the run
/// trains on the reference engine instead, to the end.
#[cfg(feature = "cuda-emulator")]
#[test]
fn a_failed_first_use_check_trains_on_the_reference_engine() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, "the cat sat on the mat. ".repeat(80)).unwrap();
    let train = |fault: Option<&str>, name: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tinygpt"));
        let root = env!("CARGO_MANIFEST_DIR");
        cmd.args(["train", "--config", &format!("{root}/configs/tiny.toml")])
            .args([
                "--set",
                &format!("data.corpus={:?}", corpus.display().to_string()),
            ])
            .args([
                "--set",
                &format!(
                    "run.out_dir={:?}",
                    dir.path().join("runs").display().to_string()
                ),
            ])
            .args(["--set", &format!("run.name={name:?}")])
            .args([
                "--set",
                "train.max_iters=3",
                "--set",
                "train.eval_interval=3",
            ])
            .env("TINYGPT_EMULATE_CUDA", "1")
            .env("TINYGPT_CACHE_DIR", dir.path().join("verdicts"));
        match fault {
            Some(f) => cmd.env("TINYGPT_DOCTOR_FAULT", f),
            None => cmd.env_remove("TINYGPT_DOCTOR_FAULT"),
        };
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert!(out.status.success(), "{stderr}");
        stderr
    };
    let failed = train(Some("engine gradients"), "broken");
    assert!(
        failed.contains("failed its first-use check") && failed.contains("engine gradients"),
        "{failed}"
    );
    assert!(
        failed.contains("reference"),
        "the reference engine trains: {failed}"
    );
    let fine = train(None, "fine");
    assert!(!fine.contains("first-use"), "{fine}");
    assert!(
        !fine.contains("reference ("),
        "the fused CUDA code trains: {fine}"
    );
    let remembered = std::fs::read_dir(dir.path().join("verdicts"))
        .unwrap()
        .count();
    assert_eq!(
        remembered, 2,
        "one verdict per key (the injected fault is part of it)"
    );
}
