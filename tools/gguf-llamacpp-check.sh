#!/usr/bin/env bash
# GGUF export against llama.cpp itself (issue 39 part 4; too slow for every CI run):
# builds llama.cpp once from the llama-cpp-python source package on PyPI (it vendors
# llama.cpp) into $LLAMACPP_DIR (default ~/.cache/tinygpt-llamacpp, outside the
# repository), then for each run folder given (default: the quick start's char model
# and the BPE model, trained by the configs in configs/ if missing):
#   - exports f32 and q8_0 GGUF,
#   - compares llama-cli's greedy continuation of a prompt with
#     `tinygpt generate --temperature 0` (f32: must be equal),
#   - asks llama-server to apply the chat template the export carries, which must build
#     the prompt `tinygpt serve` builds for the same messages,
#   - prints llama-perplexity's figure next to `tinygpt eval`'s on the validation text
#     (llama-perplexity scores the second half of each context-long chunk, so its
#     figure is compared by eye / to ~1e-3, not asserted).
# Char models have no end-of-text token of their own (export names a row past the
# characters, so llama.cpp does not take its default, token 11, a character), and
# llama-completion runs with --ignore-eos, which bans that row.
#
#   tools/gguf-llamacpp-check.sh [BINARY] [RUN...]    # BINARY default target/release/tinygpt
#   LLAMACPP_BUILD=~/.cache/tinygpt-llamacpp/build-avx512 tools/gguf-llamacpp-check.sh ...
#                                    # a build made already (tools/decode-bench.sh's)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(realpath "${1:-target/release/tinygpt}")
shift || true
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(checkpoints/shakespeare-char checkpoints/shakespeare-bpe)
dir=${LLAMACPP_DIR:-$HOME/.cache/tinygpt-llamacpp}
prompt=${PROMPT:-ROMEO:}
n=${TOKENS:-50}  # prompt + new tokens within the quick start's context of 64: llama.cpp's
                 # gpt2 does not slide its window past the learned positions

build=${LLAMACPP_BUILD:-$dir/build}
if [ ! -x "$build/bin/llama-completion" ]; then
  build=$dir/build
  echo "building llama.cpp from the llama-cpp-python sdist into $dir (once; minutes)" >&2
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python -d "$dir/sdist"
  tar -xzf "$dir"/sdist/llama_cpp_python-*.tar.gz -C "$dir"
  src=$(ls -d "$dir"/llama_cpp_python-*/vendor/llama.cpp | head -1)
  # Not -march=native: on a CPU with AMX, a VM that grants no AMX tile state kills
  # llama.cpp's native q8_0 kernels with SIGILL (seen on a Sapphire Rapids VM).
  cmake -S "$src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON >/dev/null
fi
for target in llama-completion llama-perplexity llama-server; do
  [ -x "$build/bin/$target" ] || cmake --build "$build" -j"$(nproc)" --target "$target" >/dev/null
done
export LD_LIBRARY_PATH="$build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# llama-cli is a chat now; llama-completion continues a prompt.
cli=$build/bin/llama-completion
ppl=$build/bin/llama-perplexity
server=$build/bin/llama-server

for run in "${runs[@]}"; do
  if [ ! -d "$run" ]; then
    config=configs/$(basename "$run").toml
    echo "training $run ($config)" >&2
    "$bin" train --config "$config"
  fi
  work=$(mktemp -d)
  ours=$("$bin" generate --checkpoint "$run" --prompt "$prompt" --temperature 0 --max-new-tokens "$n")
  for dtype in f32 q8_0; do
    "$bin" export --format gguf --dtype "$dtype" --checkpoint "$run" --out "$work/$dtype.gguf"
    theirs=$("$cli" -m "$work/$dtype.gguf" -p "$prompt" -n "$n" --temp 0 --ignore-eos \
      -no-cnv --no-display-prompt 2>/dev/null || true)
    if [ "$prompt$theirs" = "$ours" ] || [ "$theirs" = "$ours" ]; then
      echo "$run $dtype: greedy text equal ($n tokens)"
    else
      echo "$run $dtype: greedy text DIFFERS"
      echo "  tinygpt:   ${ours:0:200}"
      echo "  llama.cpp: ${theirs:0:200}"
      [ "$dtype" = f32 ] && status=1
    fi
  done
  # The chat template the export carries, applied by llama-server: the prompt
  # `tinygpt serve` builds from the same messages (src/serve/chat.rs).
  port=$((20000 + RANDOM % 20000))
  "$server" -m "$work/f32.gguf" --port "$port" -t 2 >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 200); do curl -sf "localhost:$port/health" >/dev/null && break; sleep 0.1; done
  messages='[{"role":"system","content":"Be brief."},{"role":"user","content":"Who is there?"},{"role":"assistant","content":"Nay, answer me."},{"role":"user","content":"Stand!"}]'
  got=$(curl -s "localhost:$port/apply-template" -H 'content-type: application/json' \
    -d "{\"messages\": $messages}" | python3 -c 'import json,sys; print(repr(json.load(sys.stdin)["prompt"]))' || true)
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true
  want="'Be brief.\\n\\nUser: Who is there?\\n\\nAssistant: Nay, answer me.\\n\\nUser: Stand!\\n\\nAssistant:'"
  if [ "$got" = "$want" ]; then
    echo "$run chat template: llama-server builds tinygpt serve's prompt"
  else
    echo "$run chat template DIFFERS: llama-server $got, tinygpt serve $want"
    status=1
  fi
  val=${VAL_TEXT:-}
  if [ -n "$val" ]; then
    echo "$run tinygpt eval:"; "$bin" eval --checkpoint "$run" --text "$val" | tail -3
    ctx=$("$bin" info --checkpoint "$run" | awk '/context/ {print $2; exit}')
    for dtype in f32 q8_0; do
      echo "$run llama-perplexity $dtype:"
      "$ppl" -m "$work/$dtype.gguf" -f "$val" -c "${ctx:-64}" 2>&1 | grep -E "Final estimate" || true
    done
  fi
  rm -rf "$work"
done
exit "${status:-0}"
