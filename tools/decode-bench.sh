#!/usr/bin/env bash
# CPU decoding of a GPT-2-124M-shaped model in f32, bf16, int8 and int4, one process each (so
# each peak RSS is its own): load time, time to first token at 1/16/128/512 prompt
# tokens, decode tokens/s, peak RSS. Prints a Markdown table (docs/PERFORMANCE.md's).
#
#   tools/decode-bench.sh                 # makes the model once (one training step, ~1 min)
#   tools/decode-bench.sh RUN_FOLDER      # any trained run instead
#   LLAMACPP=1 tools/decode-bench.sh      # then llama.cpp side by side, one stream each
#   LLAMACPP=1 SERVE=1 tools/decode-bench.sh   # and 16 clients of each server
#
# With LLAMACPP=1, llama.cpp is built once from the llama-cpp-python source package on
# PyPI (it vendors llama.cpp) into $LLAMACPP_DIR (default ~/.cache/tinygpt-llamacpp,
# outside the repository), for this CPU's AVX-512 / VNNI / AVX512_BF16 where it has
# them (its AMX path off: a VM that grants no AMX tile state kills it), and the model
# is exported to GGUF in f32, f16, q8_0 and q4_0. Each pair then runs interleaved,
# ROUNDS times (default 2): `tinygpt bench --decode-tokens 160` (16-token prompt)
# against llama-completion's eval rate (-t threads, --temp 0, 128 tokens after a
# 20-token prompt), and its prompt rate beside our first token of 16.
#
# With SERVE=1 too, llama-server is built beside it, and each pair of servers (`tinygpt
# serve --parallel 16 --dtype D` and `llama-server -np 16 -c 4096 -t threads` on the
# matching GGUF) takes the same load in turn, ROUNDS times: `tools/serve-load.py
# --clients 16 --max-tokens 64 --concurrent-only`, 20-token prompts, its aggregate
# tokens/s and first-token p50 (httpx from tools/serve-clients.sh's venv where it is
# made, else a venv of its own under $LLAMACPP_DIR).
#
# The model: 12 layers, 12 heads, 768 wide, context 1024, vocabulary 50304 (GPT-2's,
# padded), trained one step on the repository's corpus so it is a real checkpoint.
# Threads: RAYON_NUM_THREADS (default: every core). DTYPES="f32 int8" runs only those
# formats (and their llama.cpp pairs) in every table.
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
for dtype in ${DTYPES:-f32 bf16 int8 int4}; do
  "$bin" bench --checkpoint "$run" --decode-dtype "$dtype" --decode-tokens 256 --json |
    python3 -c '
import json, sys
r = json.load(sys.stdin)
ttft = " / ".join("%.0f" % ms for _, ms in r["ttft_ms"])
print("| %s (%.0f MiB) | %.0f ms | %s ms | %.1f tokens/s | %.0f MiB |" % (
    r["dtype"], r["weights_mb"], r["load_ms"], ttft, r["decode_tokens_per_s"], r["peak_rss_mb"]))
'
done
# Not `| head -1`: under pipefail the bench's SIGPIPE would end the script here.
report=$("$bin" bench --checkpoint "$run" --prompts 1 --decode-tokens 1)
echo "machine: $(echo "${report%%$'\n'*}" | sed 's/^cpu *//')"

[ "${LLAMACPP:-0}" = 1 ] || exit 0
dir=${LLAMACPP_DIR:-$HOME/.cache/tinygpt-llamacpp}
has() { grep -qw "$1" /proc/cpuinfo; }
flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
build=$dir/build-portable
if has avx512f && has avx512bw; then
  build=$dir/build-avx512
  flags+=(-DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  has avx512_vnni && flags+=(-DGGML_AVX512_VNNI=ON)
  has avx512_bf16 && flags+=(-DGGML_AVX512_BF16=ON)
fi
targets=(llama-completion)
[ "${SERVE:-0}" = 1 ] && targets+=(llama-server)
missing=0
for t in "${targets[@]}"; do [ -x "$build/bin/$t" ] || missing=1; done
if [ "$missing" = 1 ]; then
  echo "building llama.cpp from the llama-cpp-python sdist into $build (once; minutes)" >&2
  if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
    # Its build needs CMake and a C++ compiler; a Debian or Ubuntu machine gets them here.
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      apt-get install -y -q cmake g++ >/dev/null
    else
      echo "error: building llama.cpp needs cmake and a C++ compiler: install them (e.g. apt-get install cmake g++) and run again" >&2
      exit 2
    fi
  fi
  mkdir -p "$dir"
  ls "$dir"/sdist/llama_cpp_python-*.tar.gz >/dev/null 2>&1 ||
    # The source package only: `--no-binary :all:` would also build its build
    # requirements (CMake itself) from source to read its metadata, half an hour.
    python3 -m pip download -q --no-deps --no-binary llama-cpp-python llama-cpp-python -d "$dir/sdist"
  # (`|| true`: under pipefail a first run's failing `ls` would end the script here.)
  src=$(ls -d "$dir"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -1 || true)
  if [ -z "$src" ]; then
    tar -xzf "$dir"/sdist/llama_cpp_python-*.tar.gz -C "$dir"
    src=$(ls -d "$dir"/llama_cpp_python-*/vendor/llama.cpp | head -1)
  fi
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF "${flags[@]}" >/dev/null
  cmake --build "$build" -j"$(nproc)" --target "${targets[@]}" >/dev/null
fi
threads=${RAYON_NUM_THREADS:-$(nproc)}
ggufs=$(dirname "$run")/gguf
mkdir -p "$ggufs"
for g in f32 f16 q8_0 q4_0; do
  [ -f "$ggufs/$g.gguf" ] || "$bin" export --checkpoint "$run" --format gguf --dtype "$g" --out "$ggufs/$g.gguf" >&2
done
prompt="Now is the winter of"
# Each of our formats (DTYPES) beside llama.cpp's matching one.
declare -A gguf_of=([f32]=f32 [bf16]=f16 [int8]=q8_0 [int4]=q4_0)
pairs=()
for dtype in ${DTYPES:-f32 bf16 int8 int4}; do pairs+=("$dtype ${gguf_of[$dtype]}"); done
echo
echo "| one stream, $threads threads | tinygpt decode | llama.cpp eval | ratio | tinygpt first token (16) | llama.cpp prompt eval |"
echo "|---|---|---|---|---|---|"
for _ in $(seq "${ROUNDS:-2}"); do
  for pair in "${pairs[@]}"; do
    set -- $pair
    ours=$("$bin" bench --checkpoint "$run" --decode-dtype "$1" --prompts 16,16,16 --decode-tokens 160 --json)
    theirs=$("$build/bin/llama-completion" -m "$ggufs/$2.gguf" -t "$threads" --temp 0 -n 128 \
      -p "$prompt" -no-cnv 2>&1 >/dev/null | grep -E "(prompt eval|  eval) time")
    OURS=$ours THEIRS=$theirs python3 -c '
import json, os, re, sys
r = json.loads(os.environ["OURS"])
found = re.findall(r"(prompt eval|  eval) time =\s*([0-9.]+) ms /\s*(\d+)", os.environ["THEIRS"])
rates = {k.strip(): (float(ms), int(n)) for k, ms, n in found}
ms, n = rates["eval"]
theirs = n / ms * 1e3
pms, pn = rates["prompt eval"]
ours = r["decode_tokens_per_s"]
first = min(t for p, t in r["ttft_ms"] if p == 16)
print("| %s / %s | %.1f tokens/s | %.1f tokens/s | %.2fx | %.0f ms | %.0f ms for %d tokens |" % (
    sys.argv[1], sys.argv[2], ours, theirs, ours / theirs, first, pms, pn))
' "$1" "$2"
  done
done

[ "${SERVE:-0}" = 1 ] || exit 0
python=target/clients-venv/bin/python
if ! "$python" -c "import httpx" 2>/dev/null; then
  python=$dir/venv/bin/python
  if ! "$python" -c "import httpx" 2>/dev/null; then
    echo "installing httpx into $dir/venv (pip, once)" >&2
    python3 -m venv "$dir/venv" && "$dir/venv/bin/pip" install -q httpx >&2
  fi
fi
# A free loopback port: the kernel's pick, given back before the server takes it.
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# The aggregate tokens/s and first-token p50 of 16 clients against the server on $1.
load16() {
  "$python" tools/serve-load.py "http://127.0.0.1:$1" --clients 16 --max-tokens 64 \
    --concurrent-only --prompt "$prompt" --json |
    python3 -c 'import json, sys; r = json.load(sys.stdin)["batched"]; print("%.0f %.0f" % (r["tokens_per_s"], r["first_token_ms_p50"]))'
}
# Runs "$@" (a server on port $port) until it answers, loads it, stops it.
serve_and_load() {
  "$@" >"$out_log" 2>&1 &
  local pid=$! up=0
  for _ in $(seq 240); do
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then up=1; break; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  if [ "$up" = 1 ]; then load16 "$port"; else echo "error: $1 did not answer on port $port; its log: $out_log" >&2; echo "- -"; fi
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
out_log=${TMPDIR:-/tmp}/decode-bench-server.log
echo
echo "| 16 clients, $threads threads | tinygpt serve | llama-server | ratio | first token p50: tinygpt / llama-server |"
echo "|---|---|---|---|---|"
for _ in $(seq "${ROUNDS:-2}"); do
  for pair in "${pairs[@]}"; do
    set -- $pair
    port=$(free_port)
    read -r ours ours_first < <(serve_and_load "$bin" serve --checkpoint "$run" --parallel 16 --dtype "$1" --port "$port")
    port=$(free_port)
    read -r theirs theirs_first < <(serve_and_load "$build/bin/llama-server" -m "$ggufs/$2.gguf" -np 16 -c 4096 -t "$threads" --port "$port")
    ratio=$(python3 -c 'import sys; a, b = sys.argv[1:]; print("%.2fx" % (float(a) / float(b)) if "-" not in (a, b) else "-")' "$ours" "$theirs")
    echo "| $1 / $2 | $ours tokens/s | $theirs tokens/s | $ratio | $ours_first ms / $theirs_first ms |"
  done
done
