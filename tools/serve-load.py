#!/usr/bin/env python3
"""A bounded load on `tinygpt serve` over loopback: N concurrent streaming clients,
then the same requests one at a time; every stream must complete. Prints total
tokens/s, time to first token and time per token (p50 / p99), and the batching gain.

Run it with the clients venv that tools/serve-clients.sh makes (httpx comes with openai):

    target/clients-venv/bin/python tools/serve-load.py http://127.0.0.1:8080 \
        --clients 64 --max-tokens 128 [--json]
"""
import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx


def percentile(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


async def one(client, base, seed, max_tokens, prompt):
    """One streamed completion: (tokens, seconds to the first token, gaps between tokens)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "seed": seed, "temperature": 1.0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    arrivals, usage, finish, done = [], None, None, False
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                if choice.get("text"):
                    arrivals.append(time.perf_counter())
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
    if not done or finish is None or usage is None:
        raise RuntimeError(f"stream {seed} incomplete: done={done} finish={finish} usage={usage}")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    first = arrivals[0] - started if arrivals else float("nan")
    return usage["completion_tokens"], first, gaps


async def phase(base, clients, concurrent, max_tokens, prompt, deadline):
    limits = httpx.Limits(max_connections=max(concurrent, 1), max_keepalive_connections=max(concurrent, 1))
    timeout = httpx.Timeout(max(deadline - time.time(), 1.0))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        started = time.perf_counter()
        if concurrent > 1:
            results = await asyncio.gather(*(one(client, base, s, max_tokens, prompt) for s in range(clients)))
        else:
            results = [await one(client, base, s, max_tokens, prompt) for s in range(clients)]
        wall = time.perf_counter() - started
    tokens = sum(r[0] for r in results)
    firsts = [r[1] for r in results]
    gaps = [g for r in results for g in r[2]]
    return {
        "requests": len(results),
        "complete": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "first_token_ms_p50": 1e3 * percentile(firsts, 50),
        "first_token_ms_p99": 1e3 * percentile(firsts, 99),
        "per_token_ms_p50": 1e3 * percentile(gaps, 50),
        "per_token_ms_p99": 1e3 * percentile(gaps, 99),
    }


async def stall(base, streams, max_tokens, long_prompt):
    """Streams run; a request with a long prompt joins. How long the running streams
    wait for a token while it is prefilled, against their usual wait."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 2), timeout=120) as client:
        running = [asyncio.create_task(timed(client, base, s, max_tokens, "ROMEO:")) for s in range(streams)]
        await asyncio.sleep(1.0)
        joined = time.perf_counter()
        tokens, first, _ = await one(client, base, 999, 1, long_prompt)
        answered = joined + first
        arrivals = await asyncio.gather(*running)
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:])]
    during = [b - a for times in arrivals for a, b in zip(times, times[1:]) if b >= joined and a <= answered]
    return {"usual_gap_ms_p50": 1e3 * percentile(gaps, 50), "worst_gap_while_prefilling_ms": 1e3 * max(during or [0]),
            "long_prompt_first_token_ms": 1e3 * first}


async def timed(client, base, seed, max_tokens, prompt):
    body = {"prompt": prompt, "max_tokens": max_tokens, "seed": seed, "stream": True}
    times = []
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt", default="ROMEO:")
    ap.add_argument("--time-limit", type=float, default=300, help="seconds for both phases together")
    ap.add_argument("--concurrent-only", action="store_true", help="skip the one-at-a-time phase")
    ap.add_argument("--stall", type=int, metavar="CHARS", help="instead: streams run while a prompt of CHARS characters joins; report their longest wait")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    deadline = time.time() + args.time_limit
    if args.stall:
        prompt = ("ROMEO: " * args.stall)[: args.stall]
        r = asyncio.run(stall(args.base, args.clients, args.max_tokens, prompt))
        print(f"{args.clients} streams, a {args.stall}-character prompt joins: their usual wait {r['usual_gap_ms_p50']:.1f} ms, "
              f"the longest while it was prefilled {r['worst_gap_while_prefilling_ms']:.1f} ms; its first token after {r['long_prompt_first_token_ms']:.1f} ms")
        return
    batched = asyncio.run(phase(args.base, args.clients, args.clients, args.max_tokens, args.prompt, deadline))
    if args.concurrent_only:
        r = batched
        if args.json:
            print(json.dumps({"clients": args.clients, "max_tokens": args.max_tokens, "batched": r}, indent=2))
        else:
            print(f"concurrent: {r['complete']}/{r['requests']} streams complete, {r['tokens_per_s']:.0f} tokens/s")
        return
    alone = asyncio.run(phase(args.base, args.clients, 1, args.max_tokens, args.prompt, deadline))
    report = {"clients": args.clients, "max_tokens": args.max_tokens, "batched": batched, "one_at_a_time": alone,
              "gain": batched["tokens_per_s"] / alone["tokens_per_s"]}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for name, r in (("concurrent", batched), ("one at a time", alone)):
        print(f"{name:>13}: {r['complete']}/{r['requests']} streams complete, {r['tokens']} tokens in {r['wall_s']:.2f} s = "
              f"{r['tokens_per_s']:.0f} tokens/s; first token p50 {r['first_token_ms_p50']:.1f} ms p99 {r['first_token_ms_p99']:.1f} ms; "
              f"per token p50 {r['per_token_ms_p50']:.2f} ms p99 {r['per_token_ms_p99']:.2f} ms")
    print(f"batching gain: {report['gain']:.1f}x the tokens/s of the same requests one at a time")


if __name__ == "__main__":
    sys.exit(main())
