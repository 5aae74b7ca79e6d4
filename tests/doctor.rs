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
        "kernels: bf16 rows",
        "kernels: int8 products",
        "engine loss",
        "engine gradients",
        "engine weights after AdamW",
        "decoder logits",
    ] {
        assert!(names.contains(name), "{name} is checked: {names:?}");
    }
    if cfg!(feature = "cuda-emulator") {
        assert!(places.contains("cuda (emulated)"), "{places:?}");
        assert!(names.contains("graph replay"));
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
