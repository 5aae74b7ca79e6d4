//! With the `cuda` feature: compiles the fused CUDA engine's kernels
//! (`src/cuda/kernels/*.cu`) to PTX with nvcc, into OUT_DIR, where `src/cuda/gpu.rs`
//! includes them. With `cuda-emulator`: compiles the same kernels as C++ for the CPU
//! (`src/cuda/emulator/`). Without either: nothing (the CPU build needs no CUDA
//! toolkit and no C++ compiler).
//!
//! nvcc is `$NVCC`, else `nvcc` on PATH, else `$CUDA_HOME/bin/nvcc`. The PTX targets
//! `compute_$CUDA_COMPUTE_CAP` (as candle's kernels do; default 80, which every GPU from
//! the A100 on runs, the driver compiling it for the GPU at load).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const KERNELS: &str = "src/cuda/kernels";

fn main() {
    println!("cargo:rerun-if-changed={KERNELS}");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-changed=src/cuda/emulator");
    // `tinygpt --version` names the features this binary has (is it the MPI build?).
    let features: Vec<&str> = [
        "cuda",
        "cuda-emulator",
        "nccl",
        "metal",
        "accelerate",
        "mpi",
    ]
    .into_iter()
    .filter(|f| {
        let var = format!("CARGO_FEATURE_{}", f.to_uppercase().replace('-', "_"));
        env::var_os(var).is_some()
    })
    .collect();
    let features = match features.is_empty() {
        true => "none".to_string(),
        false => features.join(", "),
    };
    println!("cargo:rustc-env=TINYGPT_FEATURES={features}");
    if env::var_os("CARGO_FEATURE_CUDA_EMULATOR").is_some() {
        cc::Build::new()
            .cpp(true)
            .std("c++20")
            .file("src/cuda/emulator/emulator.cpp")
            .include("src/cuda/emulator")
            .include(KERNELS)
            .opt_level(2)
            .warnings(false)
            .compile("tinygpt_cuda_emulator");
    }
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = nvcc();
    let cap = env::var("CUDA_COMPUTE_CAP")
        .ok()
        .map(|c| c.trim().replace('.', ""))
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "80".to_string());
    let mut sources: Vec<PathBuf> = std::fs::read_dir(KERNELS)
        .unwrap_or_else(|e| panic!("reading {KERNELS}: {e}"))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    for source in &sources {
        compile(&nvcc, &cap, source, &out);
    }
    // The architecture the PTX targets, for the engine's choices (flash attention needs
    // sm_80's bf16 tensor cores): digits only, as nvcc took it ("90a" -> 90).
    let digits: String = cap.chars().take_while(char::is_ascii_digit).collect();
    println!("cargo:rustc-env=TINYGPT_PTX_ARCH={digits}");
    // The toolkit's CUDA version ("13.0"), for the message a too-old driver gets.
    let version = Command::new(&nvcc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|text| {
            let release = text.split("release ").nth(1)?;
            Some(release.split(',').next()?.trim().to_string())
        })
        .unwrap_or_default();
    println!("cargo:rustc-env=TINYGPT_NVCC_VERSION={version}");
}

fn nvcc() -> PathBuf {
    if let Some(nvcc) = env::var_os("NVCC") {
        return PathBuf::from(nvcc);
    }
    let on_path = Command::new("nvcc").arg("--version").output();
    if on_path.is_ok_and(|o| o.status.success()) {
        return PathBuf::from("nvcc");
    }
    if let Some(home) = env::var_os("CUDA_HOME") {
        return Path::new(&home).join("bin/nvcc");
    }
    panic!(
        "the cuda feature needs nvcc (a CUDA toolkit): put it on PATH, set NVCC or CUDA_HOME, \
         or run `eval \"$(tools/cuda-toolkit.sh)\"`"
    );
}

fn compile(nvcc: &Path, cap: &str, source: &Path, out: &Path) {
    let stem = source.file_stem().expect("a file name").to_string_lossy();
    let ptx = out.join(format!("{stem}.ptx"));
    let status = Command::new(nvcc)
        .args(["--ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-I")
        .arg(KERNELS)
        .arg(source)
        .arg("-o")
        .arg(&ptx)
        .status()
        .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
    assert!(
        status.success(),
        "nvcc failed on {} ({status})",
        source.display()
    );
}
