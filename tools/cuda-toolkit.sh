#!/bin/bash
# Installs a CUDA 13.0 build toolkit from PyPI wheels (no GPU, no driver, no root needed) and
# prints the environment `cargo build --features cuda` needs. For machines without a system
# CUDA: laptops, CI, a build box for a rented GPU.
#
#   eval "$(tools/cuda-toolkit.sh)"                       # once per shell; first run ~1.2 GB, ~35 s
#   CARGO_TARGET_DIR=target-cuda cargo build --release --features cuda
#
# With a system CUDA toolkit (nvcc on PATH, CUDA_ROOT set) none of this is needed.
# CUDA_TOOLKIT_DIR (default ~/.cache/tinygpt-cuda13) is where it goes; TINYGPT_TOOLKIT_NCCL=1
# adds NCCL (for --features nccl); CUDA_COMPUTE_CAP
# (default 90: H100/H200; 80: A100, 89: L4/RTX 40xx, 86: RTX 30xx) is the one architecture
# candle's kernels are compiled for. Verified: the binary built this way ran on an H100
# (driver 580, CUDA 13.0).
set -euo pipefail
DIR=${CUDA_TOOLKIT_DIR:-$HOME/.cache/tinygpt-cuda13}
if [ ! -x "$DIR/root/bin/nvcc" ]; then
  python3 -m venv "$DIR/venv" >&2
  # nvvm and crt must match nvcc exactly: a newer nvvm writes PTX that ptxas 13.0 rejects.
  "$DIR/venv/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 \
    nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-cccl==13.0.85 >&2
  N=$(ls -d "$DIR"/venv/lib/python3*/site-packages/nvidia/cu13)
  mkdir -p "$DIR/root/lib64"
  for d in bin include nvvm; do ln -sfn "$N/$d" "$DIR/root/$d"; done
  for f in "$N"/lib/*.so.*; do
    b=$(basename "$f"); ln -sf "$f" "$DIR/root/lib64/$b"; ln -sf "$f" "$DIR/root/lib64/${b%%.so.*}.so"
  done
  # libcuda comes with the driver, which a build machine may lack: link against a stub that
  # defines every driver entry point cudarc declares (the real libcuda.so.1 is loaded at run time).
  SYS=$(ls -d "$HOME"/.cargo/registry/src/*/cudarc-*/src/driver/sys/mod.rs 2>/dev/null | tail -1 || true)
  if [ -z "$SYS" ]; then
    cargo fetch --quiet >&2 || true
    SYS=$(ls -d "$HOME"/.cargo/registry/src/*/cudarc-*/src/driver/sys/mod.rs 2>/dev/null | tail -1 || true)
  fi
  if [ -z "$SYS" ]; then echo "error: cudarc's source is not in cargo's registry; run 'cargo fetch' in the project first" >&2; exit 1; fi
  grep -o "fn cu[A-Za-z0-9_]*" "$SYS" | sed 's/fn //' | sort -u | sed 's/.*/int &(void){return 999;}/' > "$DIR/stub.c"
  gcc -shared -o "$DIR/root/lib64/libcuda.so" -Wl,-soname,libcuda.so.1 "$DIR/stub.c"
fi
# NCCL for builds with the `nccl` feature (the CUDA ranks' collectives), on request:
# TINYGPT_TOOLKIT_NCCL=1 (a ~300 MB wheel; compile checks need none of it).
if [ "${TINYGPT_TOOLKIT_NCCL:-0}" = 1 ] && [ ! -e "$DIR/root/lib64/libnccl.so" ]; then
  "$DIR/venv/bin/pip" install -q nvidia-nccl-cu13==2.28.9 >&2
  NCCL=$(ls "$DIR"/venv/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.* | head -1)
  ln -sf "$NCCL" "$DIR/root/lib64/libnccl.so"
fi
R=$DIR/root
echo "export CUDA_ROOT=$R CUDA_PATH=$R PATH=$R/bin:\$PATH LIBRARY_PATH=$R/lib64\${LIBRARY_PATH:+:\$LIBRARY_PATH} CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}"
