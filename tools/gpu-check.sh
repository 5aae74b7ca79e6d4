#!/bin/bash
# The GPU check, in one command, on a machine with an NVIDIA GPU (from the repository
# root, after `tools/gpu-pack.sh` on the build machine packed .gpu/):
#
#   bash tools/gpu-check.sh [OUT.md]       # default: gpu-check.md (git-ignored)
#
# 0. The profile first (tools/gpu-profile.sh; PROFILE=0 skips it): `bench --profile` of
#    the GPT-2 shape in f32 and bf16, Nsight tables of tinygpt and PyTorch where Nsight is
#    there, written beside OUT.md as gpu-profile-<GPU>.md (commit it under docs/).
# 1. `tinygpt doctor`: the GPU, its driver and compute capability; the kernels, the
#    fused engine against the reference engine, the decoder against the CPU decoder,
#    graph replay (exit 1 names what failed).
# 2. The packed GPU test executables (the kernels against math, engines, cuda_decode,
#    train, gpu_memory).
# 3. Those tests again under compute-sanitizer (memcheck, racecheck, synccheck,
#    initcheck), where the machine has it (CUDA toolkits ship it; it cannot be fetched
#    there: the GPU machine has no network).
# 4. The side-by-side bench against PyTorch (eager, bf16, compile) at the baby, char and
#    GPT-2 shapes plus decoding, where .gpu/ holds the team's run.sh and torch_gpt.py.
#
# Everything goes into one Markdown file: the doctor table, pass/fail per test binary
# and sanitizer tool, and the bench as a table (tokens/s and ratios).
# SANITIZE=0 skips step 3; BENCH="baby gpt2" picks the bench phases (default all four).
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-check.md}
mkdir -p "$(dirname "$out")"
. tools/gpu-env.sh
if [ "${PROFILE:-1}" != 0 ]; then
  bash tools/gpu-profile.sh "$(dirname "$out")"
fi

"$B" doctor > /tmp/tg/doctor.txt 2>&1
doctor_rc=$?
{
  echo "# GPU check, $(date -u +%F)"
  echo
  echo "## tinygpt doctor (exit $doctor_rc)"
  echo
  echo '```'
  cat /tmp/tg/doctor.txt
  echo '```'
} > "$out"

{
  echo
  echo '## GPU tests'
  echo
  echo '| test binary | result | tail |'
  echo '|---|---|---|'
} >> "$out"
tests=()
for t in "$D"/tests/*.xz; do
  n=$(basename "${t%.xz}")
  unxz_to "$t" "/tmp/tg/tests/$n"
  tests+=("$n")
  log=/tmp/tg/tests/$n.log
  "/tmp/tg/tests/$n" --test-threads=1 > "$log" 2>&1
  rc=$?
  summary=$(grep -E '^test result' "$log" | tail -1)
  echo "| $n | $([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc)") | ${summary:-see $log} |" >> "$out"
  cp "$log" "$(dirname "$out")/" 2>/dev/null
done

sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ "${SANITIZE:-1}" = 0 ] && sanitizer=""
{
  echo
  echo '## compute-sanitizer'
  echo
} >> "$out"
if [ -z "$sanitizer" ]; then
  echo "skipped (SANITIZE=0, or none on this machine: the CUDA toolkit's compute-sanitizer)" >> "$out"
else
  echo '| test binary | tool | result |' >> "$out"
  echo '|---|---|---|' >> "$out"
  for n in lib cuda_decode; do
    [ -x "/tmp/tg/tests/$n" ] || continue
    for tool in memcheck racecheck synccheck initcheck; do
      log=/tmp/tg/tests/$n.$tool.log
      "$sanitizer" --tool "$tool" --error-exitcode 99 "/tmp/tg/tests/$n" --test-threads=1 > "$log" 2>&1
      rc=$?
      errors=$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log")
      echo "| $n | $tool | $([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc)") ${errors} |" >> "$out"
    done
  done
fi

{
  echo
  echo '## Against PyTorch, same GPU'
  echo
} >> "$out"
if [ -f "$D/run.sh" ] && [ -f "$D/torch_gpt.py" ]; then
  # shellcheck disable=SC2086
  bash "$D/run.sh" ${BENCH:-baby char gpt2 decode} > /tmp/tg/bench.log 2>&1
  python3 - /tmp/tg/bench.log >> "$out" <<'PY'
import json, re, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"(TINYGPT|TORCH) (\S+) rc=(\d+) wall_ms=\d+ (.*)", line.strip())
    if not m:
        continue
    who, label, rc, rest = m.groups()
    try:
        tps = json.loads(rest).get("train_tokens_per_s") or json.loads(rest).get("tokens_per_s")
    except ValueError:
        tps = None
    rows.setdefault(label, {})[who] = (int(rc), tps)
print("| shape, dtype | tinygpt tokens/s | PyTorch tokens/s | ratio |")
print("|---|---|---|---|")
for label, r in rows.items():
    t, p = r.get("TINYGPT", (None, None))[1], r.get("TORCH", (None, None))[1]
    ratio = f"{t / p:.2f}" if t and p else "-"
    fmt = lambda v: f"{v:,.0f}" if v else "-"
    print(f"| {label} | {fmt(t)} | {fmt(p)} | {ratio} |")
PY
  echo >> "$out"
  echo "(raw lines: /tmp/tg/bench.log)" >> "$out"
  cp /tmp/tg/bench.log "$(dirname "$out")/bench.log" 2>/dev/null
else
  echo "no run.sh / torch_gpt.py in .gpu/ (packed only where ../shared/gpu exists): skipped" >> "$out"
fi
echo "wrote $out" >&2
