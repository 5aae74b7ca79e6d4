#!/bin/bash
# Builds tinygpt and its GPU tests with `--features cuda` on this machine (no GPU needed)
# and packs them into .gpu/ (git-ignored, < 64 MiB) for a machine that has one:
#
#   tools/gpu-pack.sh                # build + pack: the binary, and the tests that use the GPU
#   bash .gpu/run.sh tests           # on the GPU machine, from the repository root
#   bash .gpu/run.sh sanity baby char gpt2   # the side-by-side bench (needs torch there)
#
# The CUDA build toolkit comes from tools/cuda-toolkit.sh unless nvcc is on PATH. The test
# executables (the unit tests, among them the kernels against math on the GPU; engines,
# cuda_decode, train, gpu_memory) call the library (no paths of this machine baked in;
# the two unit tests that read the source tree read the working directory's), are stripped and xz-compressed (~8 MB each: candle embeds its PTX). run.sh, torch_gpt.py and the corpus
# come from ../shared/gpu when that folder exists beside the checkout (the team's
# workspace); without it only the tests are packed, with a run.sh that runs them.
#
# CUDA_COMPUTE_CAP picks the PTX target of our kernels and candle's (default 90: H100,
# H200; 80 for an A100, 89 for an RTX 4090).
set -euo pipefail
cd "$(dirname "$0")/.."
# TINYGPT_GPU_NCCL=1 builds with the nccl feature: the CUDA ranks' NCCL path, which
# tests/engines.rs runs at world size 1 on one GPU. The binaries then need libnccl.so.2
# where they run (PyTorch's CUDA wheels bring it).
features=cuda
if [ "${TINYGPT_GPU_NCCL:-0}" = 1 ]; then
  features=cuda,nccl
  export TINYGPT_TOOLKIT_NCCL=1
fi
if ! command -v nvcc >/dev/null || [ "${TINYGPT_GPU_NCCL:-0}" = 1 ]; then
  eval "$(tools/cuda-toolkit.sh)"
fi
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
TESTS=(engines cuda_decode train gpu_memory)

cargo build --release --features "$features"
mapfile -t executables < <(
  cargo test --release --features "$features" --no-run --message-format=json --lib "${TESTS[@]/#/--test=}" 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        kind = m["target"]["kind"]
        name = "lib" if kind != ["test"] else m["target"]["name"]  # the unit tests: the kernels on the GPU
        print(name, m["executable"])
')

rm -rf .gpu && mkdir -p .gpu/tests
pack() { # BINARY OUT.xz
  strip -o .gpu/pack.tmp "$1" && xz -T2 -6 -c .gpu/pack.tmp > "$2" && rm -f .gpu/pack.tmp; }
pack "$CARGO_TARGET_DIR/release/tinygpt" .gpu/tinygpt.xz
for entry in "${executables[@]}"; do
  read -r name path <<<"$entry"
  pack "$path" ".gpu/tests/$name.xz"
done
shared=../shared
if [ -f "$shared/gpu/run.sh" ]; then
  cp "$shared/gpu/run.sh" "$shared/peers/torch_gpt.py" "$shared/data/tinyshakespeare.txt" .gpu/
else
  echo "no ../shared/gpu beside the checkout: packing the tests only" >&2
  cat > .gpu/run.sh <<'RUN'
#!/bin/bash
# Runs every packed test executable (bash .gpu/run.sh tests), from the repository root.
set -u
D=$(cd "$(dirname "$0")" && pwd)
libdirs=$(find /usr /opt -maxdepth 9 \( -name 'libcublas.so.1[2-9]*' -o -name 'libcuda.so.1' \
  -o -name 'libcurand.so.10*' -o -name 'libnvrtc.so.1[2-9]*' -o -name 'libcublasLt.so.1[2-9]*' \
  -o -name 'libnccl.so.2*' \) \
  2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
mkdir -p /tmp/tg/tests
for t in "$D"/tests/*.xz; do
  n=$(basename "${t%.xz}")
  xz -dc "$t" > "/tmp/tg/tests/$n" && chmod +x "/tmp/tg/tests/$n"
  echo "--- $n"; "/tmp/tg/tests/$n" --test-threads=1 2>&1 | tail -25
done
RUN
fi
du -sh .gpu
ls -la .gpu .gpu/tests
