#!/usr/bin/env bash
# CPU decoding of a GPT-2-124M-shaped model in f32, bf16, int8 and int4, one process each (so
# each peak RSS is its own): load time, time to first token at 1/16/128/512 prompt
# tokens, decode tokens/s, peak RSS. Prints a Markdown table (docs/PERFORMANCE.md's).
#
#   tools/decode-bench.sh                 # makes the model once (one training step, ~1 min)
#   tools/decode-bench.sh RUN_FOLDER      # any trained run instead
#
# The model: 12 layers, 12 heads, 768 wide, context 1024, vocabulary 50304 (GPT-2's,
# padded), trained one step on the repository's corpus so it is a real checkpoint.
# Threads: RAYON_NUM_THREADS (default: every core).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=target/release/tinygpt
run=${1:-}
if [ -z "$run" ]; then
  out=${TMPDIR:-/tmp}/tinygpt-decode-bench
  run=$out/gpt2-124m
  if [ ! -f "$run/state.json" ]; then
    corpus=data/shakespeare.txt
    if [ ! -f "$corpus" ]; then
      # Any text serves: the weights are timed, not read.
      mkdir -p "$out"
      corpus=$out/corpus.txt
      for _ in $(seq 2000); do echo "Now is the winter of our discontent made glorious summer."; done >"$corpus"
    fi
    echo "making a GPT-2-124M-shaped checkpoint in $run (one training step)" >&2
    "$bin" train --config configs/shakespeare-char.toml \
      --set run.name=gpt2-124m --set "run.out_dir=\"$out\"" --set "data.corpus=\"$corpus\"" \
      --set model.n_layer=12 --set model.n_head=12 --set model.n_embd=768 \
      --set model.block_size=1024 --set model.vocab_size=50304 \
      --set train.batch_size=1 --set train.max_iters=1 --set train.eval_iters=1 >&2
  fi
fi
# The first open hashes the weights and notes it (.verified); every row below then
# shows the load as generate sees it from the second run on.
"$bin" bench --checkpoint "$run" --prompts 1 --decode-tokens 1 >/dev/null
echo "| weights | load | first token: 1 / 16 / 128 / 512 tokens | decode | peak RSS |"
echo "|---|---|---|---|---|"
for dtype in f32 bf16 int8 int4; do
  "$bin" bench --checkpoint "$run" --decode-dtype "$dtype" --decode-tokens 256 --json |
    python3 -c '
import json, sys
r = json.load(sys.stdin)
ttft = " / ".join("%.0f" % ms for _, ms in r["ttft_ms"])
print("| %s (%.0f MiB) | %.0f ms | %s ms | %.1f tokens/s | %.0f MiB |" % (
    r["dtype"], r["weights_mb"], r["load_ms"], ttft, r["decode_tokens_per_s"], r["peak_rss_mb"]))
'
done
"$bin" bench --checkpoint "$run" --prompts 1 --decode-tokens 1 | head -1 | sed 's/^cpu */machine: /'
