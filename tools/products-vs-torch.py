#!/usr/bin/env python3
"""The 6L/384 training step's matrix products, ours against PyTorch's `a @ b` at the same
shapes and layouts, interleaved round by round so a VM's drifting speed hits both alike.
Prints a Markdown table (docs/PERFORMANCE.md's) and the median ratio.

    python3 tools/products-vs-torch.py [--threads 2] [--rounds 3] [--bf16]

Ours: `examples/gemm_probe.rs` (the dispatched f32 GEMM, best of six timings of repeated
products). PyTorch: the same six products, timed the same way, in the virtual environment
`tools/train-vs-torch.py` makes (~/.cache/tinygpt-torch). The forward's weights are read
transposed, as `nn.Linear` reads them; the weight gradients read the activations
transposed. `--bf16`: bf16 training's products on both sides, f32 operands in: ours
(`PROBE_PRECISION=bf16`) round them to bf16 and sum in f32; PyTorch's `a @ b` runs under
CPU autocast, as its bf16 training step does (the casts counted, as our rounding is).
"""
import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name, (m, n, k), A read down its columns, B read down its columns: gemm_probe's first six.
SHAPES = [
    ("qkv forward", (4096, 1152, 384), False, True),
    ("mlp down forward", (4096, 384, 1536), False, True),
    ("mlp up dW", (1536, 384, 4096), True, False),
    ("mlp up dX", (4096, 384, 1536), False, False),
    ("qkv dW", (1152, 384, 4096), True, False),
    ("mlp down dW", (384, 1536, 4096), True, False),
]

TORCH = """
import contextlib, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
bf16 = sys.argv[3] == "bf16"
for m, n, k, at, bt in eval(sys.argv[2]):
    a = torch.randn(k, m).t() if at else torch.randn(m, k)
    b = torch.randn(n, k).t() if bt else torch.randn(k, n)
    reps = max(20, int(1e9 / (2 * m * n * k)))
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            for _ in range(reps):
                a @ b
        best = min(best, time.perf_counter() - start)
    print(2 * m * n * k * reps / best / 1e9)
"""


def torch_python():
    spec = importlib.util.spec_from_file_location("train_vs_torch", ROOT / "tools" / "train-vs-torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.torch_python()


def ours(probe, threads, precision):
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "PROBE_PRECISION": precision}
    out = subprocess.run([str(probe)], check=True, capture_output=True, text=True, env=env).stdout
    rates = [float(m) for m in re.findall(r"ours\s+([0-9.]+)", out)]
    return rates[: len(SHAPES)]


def theirs(python, threads, precision):
    shapes = [(m, n, k, at, bt) for _, (m, n, k), at, bt in SHAPES]
    out = subprocess.run([python, "-c", TORCH, str(threads), repr(shapes), precision],
                         check=True, capture_output=True, text=True).stdout
    return [float(line) for line in out.split()]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bf16", action="store_true", help="bf16 products (PyTorch: CPU autocast)")
    a = p.parse_args()
    precision = "bf16" if a.bf16 else "f32"
    subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "gemm_probe"], cwd=ROOT, check=True)
    probe = ROOT / "target" / "release" / "examples" / "gemm_probe"
    python = torch_python()
    pairs = [[] for _ in SHAPES]
    for round in range(a.rounds):
        rates = zip(ours(probe, a.threads, precision), theirs(python, a.threads, precision))
        for i, (o, t) in enumerate(rates):
            pairs[i].append((o, t))
        print(f"round {round + 1} done", file=sys.stderr)
    print(f"\n{precision}, {a.threads} threads, {a.rounds} rounds (GFLOP/s, ours / PyTorch)\n")
    print("| product (m x n x k) | ours / PyTorch, each round |")
    print("|---|---|")
    ratios = []
    for (name, (m, n, k), _, _), rounds in zip(SHAPES, pairs):
        cells = ", ".join(f"{o:.0f} / {t:.0f} ({o / t:.2f}x)" for o, t in rounds)
        print(f"| {name} ({m} x {n} x {k}) | {cells} |")
        ratios += [o / t for o, t in rounds]
    print(f"\nmedian of {len(ratios)} pairs: {statistics.median(ratios):.2f}x "
          f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
