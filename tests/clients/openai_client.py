"""The official openai Python client against `tinygpt serve`: completions and chat,
streamed and not, n, stop, seed, usage, and errors raised as the client's own.

    python tests/clients/openai_client.py http://127.0.0.1:PORT MODEL_ID
"""
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

# Models.
ids = [m.id for m in client.models.list().data]
assert ids == [model], ids

# Completions, whole: two choices, seeded, usage counted.
whole = client.completions.create(model=model, prompt="To be", max_tokens=30, n=2, seed=5, temperature=0.9)
assert len(whole.choices) == 2, whole
assert all(c.finish_reason == "length" for c in whole.choices), whole
assert whole.usage.completion_tokens == 60 and whole.usage.prompt_tokens == 5, whole.usage
again = client.completions.create(model=model, prompt="To be", max_tokens=30, n=2, seed=5, temperature=0.9)
assert [c.text for c in again.choices] == [c.text for c in whole.choices], "same seed, same text"

# Completions, streamed: the chunks add up to the whole text; usage comes last.
texts = ["", ""]
finishes = [None, None]
usage = None
for chunk in client.completions.create(
    model=model, prompt="To be", max_tokens=30, n=2, seed=5, temperature=0.9,
    stream=True, stream_options={"include_usage": True},
):
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        texts[c.index] += c.text
        if c.finish_reason:
            finishes[c.index] = c.finish_reason
assert texts == [c.text for c in whole.choices], (texts, whole.choices)
assert finishes == ["length", "length"], finishes
assert usage is not None and usage.completion_tokens == 60, usage

# A stop string across tokens.
text = whole.choices[0].text
stop = text[10:13]
cut = client.completions.create(model=model, prompt="To be", max_tokens=30, seed=5, temperature=0.9, stop=[stop])
assert cut.choices[0].text == text[: text.find(stop)], (cut.choices[0].text, stop)
assert cut.choices[0].finish_reason == "stop"

# A list of prompts, and prompts scored as evaluation harnesses score them (echo with
# logprobs; max_tokens 0 draws nothing): choice i continues prompt i / n.
listed = client.completions.create(model=model, prompt=["To be", "Whether"], max_tokens=5, n=2, seed=5)
assert [c.index for c in listed.choices] == [0, 1, 2, 3], listed
assert listed.usage.prompt_tokens == 12, listed.usage
scored = client.completions.create(model=model, prompt=["To be", "Whether"], max_tokens=0, echo=True, logprobs=1)
assert [c.text for c in scored.choices] == ["To be", "Whether"], scored
for c, length in zip(scored.choices, [5, 7]):
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.token_logprobs) == length, c.logprobs
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs[1:]), c.logprobs

# Chat, whole and streamed.
messages = [{"role": "user", "content": "Who is there?"}]
reply = client.chat.completions.create(model=model, messages=messages, max_tokens=20, seed=2)
assert reply.object == "chat.completion"
assert reply.choices[0].message.role == "assistant"
content = reply.choices[0].message.content
streamed = ""
roles = []
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=20, seed=2, stream=True):
    assert chunk.object == "chat.completion.chunk"
    for c in chunk.choices:
        if c.delta.role:
            roles.append(c.delta.role)
        streamed += c.delta.content or ""
assert roles == ["assistant"], roles
assert streamed == content, (streamed, content)

# Chat logprobs: each drawn token's, with its two most likely alternatives; the tokens'
# bytes spell the reply (the leading whitespace the template's "Assistant:" leaves is
# trimmed from both; a stop string's tokens may follow it).
scored = client.chat.completions.create(model=model, messages=messages, max_tokens=20, seed=2, logprobs=True, top_logprobs=2)
entries = scored.choices[0].logprobs.content
spelled = b"".join(bytes(e.bytes) for e in entries).decode()
assert spelled.startswith(scored.choices[0].message.content), (spelled, scored.choices[0].message.content)
if scored.choices[0].finish_reason == "length":
    assert spelled == scored.choices[0].message.content, (spelled, scored.choices[0].message.content)
for e in entries:
    assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6, e
    assert bytes(e.bytes).decode() == e.token, e
streamed_entries = []
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=20, seed=2, logprobs=True, top_logprobs=2, stream=True):
    for c in chunk.choices:
        if c.logprobs and c.logprobs.content:
            streamed_entries += c.logprobs.content
assert [(e.token, e.logprob) for e in streamed_entries] == [(e.token, e.logprob) for e in entries], "streamed = whole"

# Errors: the client raises its own exceptions with the server's message.
try:
    client.completions.create(model=model, prompt="To be", max_tokens=0)
    raise AssertionError("max_tokens 0 was accepted")
except openai.BadRequestError as e:
    assert "max_tokens" in str(e), e
try:
    client.completions.create(model="gpt-4", prompt="To be", max_tokens=3)
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert "gpt-4" in str(e), e

print(f"openai client {openai.__version__}: completions, chat, streaming, n, stop, seed, usage, prompt lists, scored prompts, chat logprobs, errors: ok")
