#!/bin/bash
# Where a GPU training step's time goes, on a machine with an NVIDIA GPU, from the
# repository root after `tools/gpu-pack.sh` packed .gpu/ (tools/gpu-check.sh runs it
# first; it also runs alone, in about 3 minutes):
#
#   bash tools/gpu-profile.sh [OUT.md | DIR]   # default: gpu-profile-<GPU>.md (in DIR)
#
# 1. `tinygpt bench --profile` at the GPT-2 shape (12L/12H/768, T1024, B8, vocab 50,304):
#    f32, bf16, and bf16 with TINYGPT_CUDA_BF16_OPERANDS=0 (products rounding f32 data on
#    the fly, as before bf16 operand copies), and GPT-2's MLP (tanh GELU, biases) with its
#    GELU in the products' cuBLASLt epilogues and, TINYGPT_CUDA_EPILOGUES=0, in kernels:
#    per phase and group the time a step from CUDA events, TFLOP/s or GB/s, the floor on
#    the GPU's peak, gaps, MFU.
#    Then training tokens/s with the passes replayed as CUDA graphs and launched one by
#    one (TINYGPT_CUDA_GRAPHS=0), GPT-2 bf16 and the baby shape, interleaved twice.
# 2. Nsight Systems' kernel table (cuda_gpu_kern_sum) of the bf16 step and of
#    torch_gpt.py --bf16 at the same shape, where nsys is on the machine (CUDA toolkits
#    ship it; the GPU machine has no network to fetch it).
# 3. Nsight Compute's speed-of-light section on the bf16 step's heaviest kernels, where
#    ncu is on the machine.
# Commit what it writes as docs/gpu-profile-<GPU>.md: later work starts from it.
set -u
cd "$(dirname "$0")/.."
. tools/gpu-env.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9\n' '-' | sed 's/-*$//')
out=${1:-.}
[ -d "$out" ] && out="$out/gpu-profile-${gpu:-GPU}.md"

# A model shape for bench, on random tokens (bench reads no corpus but the config
# names one): shape FILE N_LAYER N_HEAD N_EMBD BLOCK_SIZE VOCAB_SIZE BATCH_SIZE.
printf 'To be, or not to be.\n' > /tmp/tg/corpus.txt
shape() {
  cat > "$1" <<TOML
[data]
corpus = "/tmp/tg/corpus.txt"
[tokenizer]
kind = "char"
[model]
n_layer = $2
n_head = $3
n_embd = $4
block_size = $5
vocab_size = $6
positions = "learned"
bias = false
[train]
batch_size = $7
TOML
}
shape /tmp/tg/gpt2.toml 12 12 768 1024 50304 8
bench=("$B" bench --config /tmp/tg/gpt2.toml --device cuda --warmup 3 --decode-tokens 16 --prompt-tokens 16)

{
  echo "# GPU profile, $(date -u +%F): ${gpu:-unknown GPU}"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  git log -1 --format='tinygpt %h %s' 2>/dev/null | cut -c1-100
  echo '```'
  echo
  echo "## bench --profile, GPT-2 124M (12L/768, T1024, B8, vocab 50,304)"
} > "$out"
for run in "f32|train.dtype=f32|" "f32, TF32 products|train.tf32=true|" "bf16|train.dtype=bf16|" "bf16, f32 operands rounded by cuBLAS|train.dtype=bf16|TINYGPT_CUDA_BF16_OPERANDS=0" "bf16, attention through products|train.dtype=bf16|TINYGPT_CUDA_ATTENTION=products" "bf16, GPT-2's MLP (tanh GELU, biases): GELU in the products' epilogues|train.dtype=bf16 model.mlp=gelu_tanh model.bias=true|" "bf16, GPT-2's MLP, GELU in its kernels|train.dtype=bf16 model.mlp=gelu_tanh model.bias=true|TINYGPT_CUDA_EPILOGUES=0"; do
  IFS='|' read -r label set env <<<"$run"
  {
    echo
    echo "### $label"
    echo
    echo '```'
    # shellcheck disable=SC2046 # one --set per word of $set
    env $env timeout 300 "${bench[@]}" --steps 10 --profile $(printf -- '--set %s ' $set) 2>&1 | grep -v '^decode'
    echo '```'
  } >> "$out"
done

# The passes replayed as CUDA graphs against launched one by one (a profile launches
# them one by one, so these run without it): GPT-2 bf16, and the baby shape (4L/128,
# T64, B12), where launching is most of a step.
shape /tmp/tg/baby.toml 4 4 128 64 65 12
{
  echo
  echo "## Passes as CUDA graphs (TINYGPT_CUDA_GRAPHS=1) and launched (=0), no profile"
  echo
  echo '```'
  for shape in "GPT-2 bf16|/tmp/tg/gpt2.toml|train.dtype=bf16" "baby f32|/tmp/tg/baby.toml|train.dtype=f32" "baby bf16|/tmp/tg/baby.toml|train.dtype=bf16"; do
    IFS='|' read -r label config set <<<"$shape"
    for graphs in 1 0 1 0; do
      TINYGPT_CUDA_GRAPHS=$graphs timeout 300 "$B" bench --config "$config" --device cuda --warmup 3 \
        --steps 20 --decode-tokens 16 --prompt-tokens 16 --set "$set" 2>&1 |
        grep -E '^train' | sed "s/^/$label, graphs=$graphs: /"
    done
  done
  echo '```'
} >> "$out"

{
  echo
  echo "## Nsight Systems: kernels of 5 bf16 steps"
} >> "$out"
nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
if [ -z "$nsys" ]; then
  echo "skipped: no nsys on this machine" >> "$out"
else
  kernels() { # LABEL COMMAND...
    local label=$1; shift
    timeout 300 "$nsys" profile -o "/tmp/tg/nsys-$label" --force-overwrite true -t cuda "$@" > /dev/null 2>&1
    { echo; echo "### $label"; echo; echo '```'
      "$nsys" stats -q --report cuda_gpu_kern_sum "/tmp/tg/nsys-$label.nsys-rep" 2>&1 | head -40
      echo '```'; } >> "$out"
  }
  kernels tinygpt "${bench[@]}" --steps 5 --set train.dtype=bf16
  if [ -f "$D/torch_gpt.py" ]; then
    kernels pytorch python3 "$D/torch_gpt.py" train --corpus /tmp/tg/corpus.txt --device cuda \
      --iters 5 --warmup 2 --n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --batch-size 8 \
      --vocab-size 50304 --bf16
  fi
fi

{
  echo
  echo "## Nsight Compute: speed of light of the heaviest kernels (bf16 step)"
  echo
} >> "$out"
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute*/ncu 2>/dev/null | head -1)
if [ -z "$ncu" ]; then
  echo "skipped: no ncu on this machine" >> "$out"
else
  echo '```' >> "$out"
  timeout 400 "$ncu" --section SpeedOfLight -k 'regex:flash|norm|activation|adamw|softmax|residual|to_bf16|split|merge' \
    -c 12 "${bench[@]}" --steps 1 --warmup 1 --set train.dtype=bf16 2>&1 |
    grep -E '^  [a-z_]+|Duration|Memory Throughput|Compute \(SM\) Throughput|DRAM Throughput' | head -80 >> "$out"
  echo '```' >> "$out"
fi
echo "wrote $out" >&2
