"""lm-evaluation-harness against `tinygpt serve`: a multiple-choice task of our own (a
local JSON file; CI has no network for Hugging Face's datasets) run through its
`local-completions` model, which finds the server's tokenizer (/tokenizer_info,
/tokenize) and scores each context + continuation with echo and logprobs. Every
log-likelihood it reports must be what `tinygpt eval` computes for the same text (the
training engine's forward, not the server's decoder): minus the difference of eval's
summed losses over context + continuation and over the context alone. Requests of one
prompt (batch 1) and of a list (batch 4) must agree.

    python tests/clients/lm_eval_client.py http://127.0.0.1:PORT MODEL_ID TINYGPT CHECKPOINT CONTEXT
"""
import functools
import glob
import json
import os
import subprocess
import sys
import tempfile

base, model, binary, checkpoint, context = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
lm_eval = os.path.join(os.path.dirname(sys.executable), "lm_eval")
work = tempfile.mkdtemp()

# Contexts and continuations short enough for the context (nothing left-truncated),
# in the characters of the char model's corpus.
rows = [
    ("To be, or not to", ["be", "go"]),
    ("that is the", ["question", "answer"]),
    ("Whether 'tis nobler", ["in", "of"]),
    ("The slings and", ["arrows", "sorrow"]),
    ("User: Who is", ["there?", "here"]),
]
with open(os.path.join(work, "data.jsonl"), "w") as f:
    for ctx, choices in rows:
        f.write(json.dumps({"context": ctx, "choices": choices, "answer": 0}) + "\n")
with open(os.path.join(work, "tinygpt_choice.yaml"), "w") as f:
    f.write(f"""task: tinygpt_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {work}/data.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")


def run(batch):
    """lm_eval's log-likelihood per (context, continuation), and its accuracy."""
    out = os.path.join(work, f"out{batch}")
    subprocess.run(
        [lm_eval, "--model", "local-completions",
         "--model_args", f"base_url={base}/v1/completions,model={model},max_length={context}",
         "--tasks", "tinygpt_choice", "--include_path", work, "--batch_size", str(batch),
         "--log_samples", "--output_path", out],
        check=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    scores = {}
    for line in open(glob.glob(f"{out}/*/samples_tinygpt_choice_*.jsonl")[0]):
        sample = json.loads(line)
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            scores[(args["arg_0"], args["arg_1"])] = float(resp[0][0])
    results = json.load(open(glob.glob(f"{out}/*/results_*.json")[0]))
    return scores, results["results"]["tinygpt_choice"]["acc,none"]


@functools.cache
def eval_total(text):
    """`tinygpt eval`'s summed next-token losses over `text` (nats)."""
    path = os.path.join(work, "text.txt")
    open(path, "w").write(text)
    out = subprocess.run([binary, "eval", "--checkpoint", checkpoint, "--text", path, "--json"],
                         check=True, capture_output=True, text=True)
    result = json.loads(out.stdout)
    return result["loss"] * result["predictions"]


one, accuracy = run(1)
four, _ = run(4)
assert len(one) == 2 * len(rows), one
worst = 0.0
for (ctx, continuation), loglikelihood in one.items():
    want = -(eval_total(ctx + continuation) - eval_total(ctx))
    worst = max(worst, abs(loglikelihood - want))
    assert abs(loglikelihood - want) <= 1e-4 * max(1.0, abs(want)), (ctx, continuation, loglikelihood, want)
    assert abs(four[(ctx, continuation)] - loglikelihood) <= 1e-5 * max(1.0, abs(loglikelihood)), "batch 4 vs 1"
version = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('lm_eval'))"],
                         capture_output=True, text=True).stdout.strip()
print(f"lm-evaluation-harness {version}: {len(one)} log-likelihoods equal tinygpt eval's "
      f"(largest difference {worst:.1e} nats), batch 4 = batch 1, accuracy {accuracy}: ok")
