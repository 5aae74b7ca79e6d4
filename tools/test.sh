#!/usr/bin/env bash
# The test command (README; .ci/run runs exactly this): the test suite on the CPU, with
# the fused CUDA engine run under its CPU emulator (feature cuda-emulator: our kernels
# compiled as C++20, so a C++ compiler is needed; without one that part is skipped,
# loudly) and data-parallel training under mpirun (feature mpi: Open MPI installed
# with apt-get where it is missing; skipped loudly where it cannot be), then a compile check of the CUDA feature as CI keeps it: clippy with
# -D warnings over every target, our kernels and candle's compiled by nvcc, nothing
# linked or run (no GPU needed). Between the two: `tinygpt serve` against the official
# openai Python client and its page in headless Chromium (tools/serve-clients.sh),
# and the other platforms (tools/cross-check.sh: macOS and Windows compiled, the CPU
# tests run as ARM code under qemu).
#
#   tools/test.sh                             # both; the CUDA check installs its toolkit once
#   TINYGPT_SKIP_CUDA_CHECK=1 tools/test.sh   # without the CUDA compile check
#   TINYGPT_SKIP_CROSS_CHECK=1 tools/test.sh  # without the other platforms
set -euo pipefail
cd "$(dirname "$0")/.."
# CI builds from nothing every time: incremental compilation's bookkeeping only costs
# there (our crate's library, dev profile: 105 s -> 93 s on 2 cores of a Xeon), and so
# do the dev profile's line tables (a failing test still names its file and line: that
# is compiled into the panic; only a backtrace's lines go). Both off, the ARM build of
# tools/cross-check.sh took 10.6 minutes instead of 15.1 (the whole ARM part 15.0 instead of 19.5). Every build below (the cross
# and CUDA checks' included) inherits these.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-0}"

# Data-parallel training (feature mpi) is tested under a real mpirun: Open MPI, and
# libclang for the MPI bindings, installed here where missing (Debian's packages; as
# root, or through sudo without a password).
# (grep reads all of ldconfig's output: `grep -q` may exit first, and under pipefail
# ldconfig's broken pipe would then fail the probe at random.)
have_mpi() { command -v mpicc >/dev/null && command -v mpirun >/dev/null && ldconfig -p | grep 'libclang[-.0-9]*\.so' >/dev/null; }
if ! have_mpi && command -v apt-get >/dev/null; then
  as_root=""
  [ "$(id -u)" = 0 ] || as_root="sudo -n"
  echo "installing Open MPI and libclang (apt-get) for the data-parallel tests" >&2
  { $as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq \
      openmpi-bin libopenmpi-dev libclang-dev >/dev/null; } || true
fi
features=()
if command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null; then
  features+=(cuda-emulator)
else
  echo "SKIPPED: the fused CUDA engine under the emulator (no C++ compiler: install g++)" >&2
fi
if have_mpi; then
  features+=(mpi)
else
  echo "SKIPPED: data-parallel training under mpirun (no MPI: apt install openmpi-bin libopenmpi-dev libclang-dev)" >&2
fi
# The openai client's venv and chromium first: the README test runs its Python example.
tools/serve-clients.sh --install || echo "the serve clients could not be installed (see above)" >&2
cargo test --features "$(IFS=,; echo "${features[*]}")"
if [[ " ${features[*]} " == *" mpi "* ]]; then
  # The launcher guard lives in builds without MPI: one more build of our crate.
  cargo test --test parallel
fi
# The server against real clients: the openai Python client, the page in headless
# Chromium (installs a venv and chromium where missing), with the binary the tests built.
tools/serve-clients.sh target/debug/tinygpt

# The other platforms: macOS (Metal, Accelerate) and Windows compiled with clippy clean,
# the CPU's numeric core run as ARM code under qemu-aarch64 (tools/cross-check.sh).
if [ "${TINYGPT_SKIP_CROSS_CHECK:-0}" = 1 ]; then
  echo "SKIPPED: the macOS, Windows and ARM checks (TINYGPT_SKIP_CROSS_CHECK=1)" >&2
else
  tools/cross-check.sh
fi

if [ "${TINYGPT_SKIP_CUDA_CHECK:-0}" = 1 ]; then
  echo "SKIPPED: the CUDA compile check (TINYGPT_SKIP_CUDA_CHECK=1)" >&2
  exit 0
fi
if ! toolkit_env=$(tools/cuda-toolkit.sh); then
  echo "SKIPPED: the CUDA compile check: tools/cuda-toolkit.sh could not install the CUDA build toolkit (see above)" >&2
  exit 0
fi
eval "$toolkit_env"
# Its own target folder: the CUDA build does not evict the CPU one.
if cargo clippy --version >/dev/null 2>&1; then
  CARGO_TARGET_DIR=target-cuda cargo clippy --features "cuda,cuda-emulator,nccl$(have_mpi && echo ,mpi)" --all-targets -- -D warnings
  # And as a GPU machine builds it (tools/gpu-pack.sh): without the emulator, code the
  # emulator alone uses is dead, and code behind it missing. (The same features
  # otherwise, so the dependencies' builds are shared: only our crate builds again.)
  CARGO_TARGET_DIR=target-cuda cargo clippy --features "cuda,nccl$(have_mpi && echo ,mpi)" --all-targets -- -D warnings
else
  echo "clippy is not installed (rustup component add clippy): type-checking only" >&2
  CARGO_TARGET_DIR=target-cuda cargo check --features "cuda,cuda-emulator,nccl$(have_mpi && echo ,mpi)" --all-targets
fi
# The kernels assembled to machine code (nvcc -cubin runs ptxas) for the oldest and the
# newest architecture the engine is built for: the PTX build above passes inline PTX
# (flash.cu's mma.sync) through unread, and only the driver's JIT would reject it.
cubins=$(mktemp -d)
for arch in sm_80 sm_90; do
  for kernel in src/cuda/kernels/*.cu; do
    nvcc -cubin -O3 -std=c++17 -arch=$arch -I src/cuda/kernels "$kernel" -o "$cubins/$(basename "$kernel" .cu).cubin"
  done
done
rm -rf "$cubins"
echo "CUDA compile check: clean" >&2
