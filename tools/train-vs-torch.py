#!/usr/bin/env python3
"""CPU training side by side with PyTorch: `tinygpt bench` against the team's PyTorch peer
(`torch_gpt.py`: nanoGPT's model and AdamW) at the same shapes, interleaved, so a VM's
drifting speed hits both alike. Prints a Markdown table (docs/PERFORMANCE.md's).

    python3 tools/train-vs-torch.py [--rounds 3] [--peer ../shared/peers/torch_gpt.py]

Makes a virtual environment with torch and numpy under ~/.cache/tinygpt-torch the first
time (a ~2 GB download from PyPI), outside the repository. Cases: the baby shape and
6L/384 in f32, 6L/384 in bf16 (PyTorch: CPU autocast) where the CPU has AVX512_BF16,
and both f32 shapes capped to AVX2 on each side (TINYGPT_CPU_ISA=avx2; ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS for PyTorch) where the CPU has more than
AVX2 (on an AVX2-only CPU they would be the native cases again, so they are left out);
6L/384 in bf16 capped too, but only when named (`--only "bf16, AVX2"`: PyTorch's
autocast there takes half a minute a step).
PyTorch runs at one and two threads in every round and its faster count that round is
the one compared: on a VM whose second core is shared, the faster count changes from
minute to minute. Each ratio is taken pair by pair (tinygpt's tokens/s over PyTorch's
in the same round); the table gives the median.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path.home() / ".cache" / "tinygpt-torch" / "venv"

BABY = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12)
LARGE = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=16)
AVX2_ENV = {
    "TINYGPT_CPU_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def torch_python():
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"making {VENV} with torch and numpy (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "torch", "numpy"], check=True)
    return str(python)


def cpu_line():
    model, flags = platform.processor(), []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                have = line.split(":", 1)[1].split()
                wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
                flags = [f for f in wanted if f in have]
                break
    except OSError:
        pass
    return f"{model} [{' '.join(flags)}], {os.cpu_count()} CPUs"


def tinygpt(shape, steps, dtype, env):
    cmd = [str(ROOT / "target" / "release" / "tinygpt"), "bench", "--config", str(ROOT / "configs" / "shakespeare-char.toml"),
           "--steps", str(steps), "--json", "--decode-tokens", "1", "--prompt-tokens", "1"]
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        cmd += ["--set", f"model.{key}={shape[key]}"]
    cmd += ["--set", f"train.batch_size={shape['batch_size']}", "--set", f'train.dtype="{dtype}"']
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, **env}).stdout
    return json.loads(out)["train_tokens_per_s"]


def torch(python, peer, corpus, shape, steps, bf16, threads, env):
    cmd = [python, peer, "train", "--corpus", corpus, "--iters", str(steps), "--threads", str(threads)]
    for key, value in shape.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    if bf16:
        cmd.append("--bf16")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, **env}).stdout
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peer", default=str(ROOT.parent / "shared" / "peers" / "torch_gpt.py"))
    p.add_argument("--corpus", default=str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
    p.add_argument("--only", help="run the cases whose name contains this")
    a = p.parse_args()
    for path, what in ((a.peer, "--peer (torch_gpt.py)"), (a.corpus, "--corpus")):
        if not Path(path).exists():
            sys.exit(f"error: {what} {path} does not exist: pass its path")
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    python = torch_python()
    cpuinfo = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    bf16 = "avx512_bf16" in cpuinfo
    # Capping to AVX2 only means something where the CPU has more than AVX2.
    beyond_avx2 = "avx512f" in cpuinfo
    cases = [
        ("baby f32", BABY, 40, "f32", {}),
        ("6L/384 f32", LARGE, 6, "f32", {}),
        ("6L/384 bf16", LARGE, 6, "bf16", {}) if bf16 else None,
        ("baby f32, AVX2", BABY, 40, "f32", AVX2_ENV) if beyond_avx2 else None,
        ("6L/384 f32, AVX2", LARGE, 6, "f32", AVX2_ENV) if beyond_avx2 else None,
        # A laptop's bf16: no vdpbf16ps on either side (ours widens the pairs to f32).
        # Only when named (--only "bf16, AVX2"): a round of PyTorch there takes 14 minutes.
        ("6L/384 bf16, AVX2", LARGE, 6, "bf16", AVX2_ENV)
        if beyond_avx2 and a.only and "bf16, AVX2" in a.only
        else None,
    ]
    cases = [c for c in cases if c and (not a.only or a.only in c[0])]
    print(f"machine: {cpu_line()}", file=sys.stderr)
    if not beyond_avx2:
        print("no AVX-512 here: the AVX2-capped cases are the native ones, not run twice", file=sys.stderr)
    results = {name: ([], [], [], []) for name, *_ in cases}
    for round in range(a.rounds):
        for name, shape, steps, dtype, env in cases:
            ours_list, theirs_list, ratios, threads_list = results[name]
            by_threads = {t: torch(python, a.peer, a.corpus, shape, steps, dtype == "bf16", t, env) for t in (1, 2)}
            best = max(by_threads, key=by_threads.get)
            theirs = by_threads[best]
            ours = tinygpt(shape, steps, dtype, env)
            ours_list.append(ours)
            theirs_list.append(theirs)
            ratios.append(ours / theirs)
            threads_list.append(best)
            print(f"round {round + 1} {name}: tinygpt {ours:,.0f}, PyTorch {by_threads[1]:,.0f} (1 thread) / "
                  f"{by_threads[2]:,.0f} (2) tokens/s: {ours / theirs:.2f}x", file=sys.stderr)
    print(f"\n{cpu_line()}; {a.rounds} rounds, medians\n")
    print("| case | tinygpt tokens/s | PyTorch tokens/s (its faster thread count, each round) | ratio (pairwise median, range) |")
    print("|---|---|---|---|")
    for name, *_ in cases:
        ours, theirs, ratios, threads_list = results[name]
        counts = "/".join(str(t) for t in threads_list)
        print(f"| {name} | {statistics.median(ours):,.0f} | {statistics.median(theirs):,.0f} ({counts}) | "
              f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
