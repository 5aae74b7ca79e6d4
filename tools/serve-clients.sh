#!/usr/bin/env bash
# Real clients against the real server (issue 27): the official openai Python client
# (completions, chat, streaming), lm-evaluation-harness scoring a multiple-choice task
# (its log-likelihoods held to `tinygpt eval`'s), and the page in headless Chromium driven by Playwright
# (the playground streams, the dashboard's loss curve grows while a real `tinygpt
# train` logs in another process, /#runs opens the runs tab and a reload keeps it, the
# header fits a 400 px window, no console errors). Installs what it needs where
# missing: a venv with openai, playwright and lm-eval (PyPI), Debian's chromium (apt-get).
# Screenshots go to target/screenshots/ (not committed).
#
#   tools/serve-clients.sh [BINARY]      # default: target/debug/tinygpt
#   tools/serve-clients.sh --install     # only the venv and chromium (the README test
#                                        # runs its openai example with that venv)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=$root/target/clients-venv
shots=$root/target/screenshots

if ! "$venv/bin/python" -c "import openai, playwright, httpx, lm_eval" 2>/dev/null; then
  echo "installing the openai client, playwright and lm-evaluation-harness into $venv (pip)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check openai playwright httpx "lm-eval[api]==0.4.13"
fi
chromium=${CHROMIUM:-$(command -v chromium || true)}
if [ -z "$chromium" ] && command -v apt-get >/dev/null; then
  as_root=""
  [ "$(id -u)" = 0 ] || as_root="sudo -n"
  echo "installing Debian's chromium (apt-get) for the page test" >&2
  { $as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq chromium >/dev/null; } || true
  chromium=$(command -v chromium || true)
fi
[ "${1:-}" = --install ] && exit 0
bin=$(realpath "${1:-target/debug/tinygpt}")

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
cd "$work"
"$venv/bin/python" - <<'PY'
line = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
        "The slings and arrows of outrageous fortune,\nUser: Who is there?\n\nAssistant: Nay, answer me.\n\n")
open("corpus.txt", "w").write(line * 60)
PY
model="[data]
corpus = \"corpus.txt\"
[tokenizer]
kind = \"char\"
[model]
n_layer = 2
n_head = 2
n_embd = 32
block_size = 32"
printf '%s\n[train]\nbatch_size = 8\nmax_iters = 40\nwarmup_iters = 2\neval_interval = 20\neval_iters = 1\ncheckpoint_interval = 20\n' "$model" > exp.toml
printf '%s\n[train]\nbatch_size = 8\nmax_iters = 1000000\nwarmup_iters = 2\nlog_interval = 10\neval_interval = 50\neval_iters = 1\ncheckpoint_interval = 100\n' "$model" > live.toml
"$bin" train --config exp.toml >/dev/null 2>&1

"$bin" serve --checkpoint checkpoints/exp --port 0 --runs checkpoints --parallel 4 2> serve.log &
server=$!
pids+=("$server")
for _ in $(seq 1 300); do
  grep -q "at http://" serve.log && break
  sleep 0.1
done
base=$(grep -o "http://[0-9.:]*" serve.log | head -1)
[ -n "$base" ] || { cat serve.log >&2; echo "the server did not start" >&2; exit 1; }

"$venv/bin/python" "$root/tests/clients/openai_client.py" "$base" exp
"$venv/bin/python" "$root/tests/clients/lm_eval_client.py" "$base" exp "$bin" checkpoints/exp 32

if [ -n "$chromium" ]; then
  # A run that logs while the page watches.
  "$bin" train --config live.toml >/dev/null 2>&1 &
  pids+=("$!")
  CHROMIUM=$chromium "$venv/bin/python" "$root/tests/clients/page.py" "$base" "$shots"
else
  echo "SKIPPED: the page in headless Chromium (no chromium: apt install chromium)" >&2
fi

kill -TERM "$server"
status=0
wait "$server" || status=$?
[ "$status" = 143 ] || { cat serve.log >&2; echo "serve exited $status after SIGTERM, not 143" >&2; exit 1; }
echo "serve clients: ok" >&2
