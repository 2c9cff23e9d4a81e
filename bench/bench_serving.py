"""Online serving: Poisson arrivals against `python -m v1 serve`, streamed over HTTP.

The workload is bench_prefix_cache.py's (fixed seed): `--groups` system prompts of about
`--system-len` tokens, each followed by user questions of `--question-len` tokens, through the
model's chat template, the groups round robin; `--num-prompts` requests in all. Each one is a
streamed /v1/completions request whose prompt is the token ids, generating exactly
`--output-len` tokens (greedy, ignore_eos). Requests start at Poisson arrival times: gaps drawn
from an exponential distribution of mean 1/`--request-rate` s (seeded; `inf`: all at once).
One short, untimed request warms the server up first.

The script starts the server itself on a free port (the engine options below pass through,
`--server-args="..."` passes any other) and stops it at the end, even on Ctrl-C or SIGTERM.
`--base-url` targets a running server instead, any OpenAI-compatible one that takes token ids
as the prompt and `ignore_eos` (bench_llamacpp.py points it at `llama-server`); `--model` must
then name its model, for the tokenizer; its prefix cache may still hold an earlier run's
prompts; missing cached-token counts or /metrics read as none.

Per request, on the client's clock (send: just before the POST; chunk: an SSE event with text):

    TTFT    = first chunk - send            latency = end of the stream - send
    ITL     = the gaps between successive chunks
    TPOT    = (latency - TTFT) / (output tokens - 1)   (requests with > 1 output token)

Over the run (duration: first send to last end; tokens as the usage blocks count them):

    req_s = completed / duration       out_tok_s = output tokens / duration
    total_tok_s = (prompt + output tokens) / duration
    hit_rate = sum(usage.prompt_tokens_details.cached_tokens) / sum(usage.prompt_tokens)

metrics_hit_rate is the same ratio from the /metrics prefix-cache counters (their deltas over
the run); ideal_hit_rate is the best a prefix cache can do in this submission order.

Prints a table, then one JSON line (ttft_ms_{mean,p50,p99}, tpot_ms_*, itl_ms_*, req_s, ...).
`--out DIR` also writes serving.json and serving.png (TTFT per request over the run; the
latency percentiles). The defaults take about two minutes on a 2-core CPU (a 75 s run). The
server there keeps up with 1 req/s once the groups' system prompts are cached, but the first
request of each group prefills its ~1000 tokens, so requests in the first seconds queue:
the TTFT tail (p99, mean) comes from them, the median from the steady state.

    .venv/bin/python bench/bench_serving.py
    .venv/bin/python bench/bench_serving.py --request-rate inf --no-enable-prefix-caching
    .venv/bin/python bench/bench_serving.py --base-url http://127.0.0.1:8000
"""

import argparse
import asyncio
import json
import math
import random
import shlex
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from bench_prefix_cache import add_workload_args, ideal_hit_tokens, make_workload
from common import environment, print_table, write_outputs
from prometheus_client.parser import text_string_to_metric_families
from served import served

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Request:
    send: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival times of chunks with text
    end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def send(client: httpx.AsyncClient, url: str, prompt: list[int] | str, output_len: int,
               req: Request) -> None:
    payload = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    req.send = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise ValueError(f"HTTP {resp.status_code}: {resp.text[:300]}")
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    req.error = chunk["error"]["message"]
                elif any(c.get("text") for c in chunk["choices"]):
                    req.chunks.append(now)
                if usage := chunk.get("usage"):
                    req.prompt_tokens = usage["prompt_tokens"]
                    req.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}  # optional in OpenAI's
                    req.cached_tokens = details.get("cached_tokens", 0)
    except (httpx.HTTPError, ValueError) as e:  # ValueError: JSON too
        req.error = f"{type(e).__name__}: {e}"
    req.end = time.perf_counter()
    req.output_tokens = req.output_tokens or len(req.chunks)
    if req.error is None and not req.chunks:
        req.error = "no output"


async def get_metrics(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    try:
        resp = await client.get(f"{base}/metrics")
    except httpx.HTTPError:  # the server died: no /metrics figures
        return {}
    if resp.status_code != 200:  # another server (--base-url) without a /metrics endpoint
        return {}
    # One model per server, so a sample's name (labels aside) is enough for the counters here.
    families = text_string_to_metric_families(resp.text)
    return {sample.name: sample.value for family in families for sample in family.samples}


async def run(base: str, prompts: list[list[int]], args: argparse.Namespace
              ) -> tuple[list[Request], float | None]:
    """The requests, and the prefix-cache hit rate from /metrics over the run."""
    url = f"{base}/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        warm = Request()
        await send(client, url, "Hello, how are you?", 4, warm)
        if warm.error:
            raise SystemExit(f"the warm-up request failed: {warm.error}")
        before = await get_metrics(client, base)
        print(f"server ready; sending at {args.request_rate} req/s", file=sys.stderr)
        rng = random.Random(args.seed)
        reqs = [Request() for _ in prompts]
        tasks = []
        start, at = time.perf_counter(), 0.0
        for prompt, req in zip(prompts, reqs):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(send(client, url, prompt, args.output_len, req)))
            at += rng.expovariate(args.request_rate) if math.isfinite(args.request_rate) else 0
        await asyncio.gather(*tasks)
        after = await get_metrics(client, base)
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    hits, queries = (after.get(name, math.nan) - before.get(name, math.nan) for name in names)
    return reqs, hits / queries if queries > 0 else None


@contextmanager
def server(args: argparse.Namespace) -> Iterator[str]:
    """The base URL of `--base-url`, or of a server started here and stopped on the way out."""
    if args.base_url:
        yield args.base_url.rstrip("/")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "v1", "serve", "--port", str(port),
           "--uvicorn-log-level", "warning", "--max-num-seqs", str(args.max_num_seqs),
           "--block-size", str(args.block_size),
           f"--{'' if args.enable_prefix_caching else 'no-'}enable-prefix-caching"]
    if args.model:
        cmd += ["--model", args.model]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    cmd += shlex.split(args.server_args)
    # SIGINT: uvicorn's graceful shutdown, the engine's too.
    with served(cmd, port, 300, stop_signal=signal.SIGINT, cwd=ROOT) as base:
        yield base


def summary(name: str, seconds: list[float]) -> dict[str, float | None]:
    ms = np.array(seconds) * 1000
    return {f"{name}_ms_{stat}": round(float(fn(ms)), 2) if len(ms) else None
            for stat, fn in (("mean", np.mean), ("p50", np.median),
                             ("p99", lambda a: np.percentile(a, 99)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=1.0,
                        help="Poisson arrival rate in requests/s (inf: all at once)")
    add_workload_args(parser, groups=4, output_len=32, interleave=True)
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    parser.add_argument("--model", default=None,
                        help="a .gguf file or HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--base-url", default=None,
                        help="a running server (http://host:port); default: start one here")
    server_opts = parser.add_argument_group("server options (when the script starts it)")
    server_opts.add_argument("--max-num-seqs", type=int, default=256)
    server_opts.add_argument("--max-num-batched-tokens", type=int, default=None)
    server_opts.add_argument("--block-size", type=int, default=16)
    server_opts.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                             default=True)
    server_opts.add_argument("--server-args", default="",
                             help='other `python -m v1 serve` options, one string: '
                             '--server-args="--async-scheduling"')
    parser.add_argument("--out", default=None, help="directory for the JSON result and a PNG plot")
    args = parser.parse_args()
    # SIGTERM as an exception too, so the server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from v1.models.model_files import hf_dir_of, load_tokenizer, resolve_model

    tokenizer = load_tokenizer(hf_dir_of(resolve_model(args.model)))
    args.prompts_per_group = -(-args.num_prompts // args.groups)
    prompts = make_workload(args, tokenizer)[: args.num_prompts]
    ideal = sum(ideal_hit_tokens(prompts, args.block_size)) / sum(map(len, prompts))
    print(f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"ideal hit rate {ideal:.3f}", file=sys.stderr)
    with server(args) as base:
        reqs, metrics_hit_rate = asyncio.run(run(base, prompts, args))

    done = [r for r in reqs if r.error is None]
    for r in reqs:
        if r.error:
            print(f"failed: {r.error}", file=sys.stderr)
    duration = max(r.end for r in reqs) - min(r.send for r in reqs)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    out_tokens = sum(r.output_tokens for r in done)
    ttft = [r.chunks[0] - r.send for r in done]
    tpot = [(r.end - r.chunks[0]) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = [b - a for r in done for a, b in zip(r.chunks, r.chunks[1:])]
    result: dict[str, Any] = {
        "bench": "serving",
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "num_prompts": len(prompts), "completed": len(done), "failed": len(reqs) - len(done),
        "groups": args.groups, "system_len": args.system_len, "output_len": args.output_len,
        "prefix_caching": args.enable_prefix_caching if not args.base_url else None,
        "duration_s": round(duration, 3),
        "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "req_s": round(len(done) / duration, 3),
        "out_tok_s": round(out_tokens / duration, 1),
        "total_tok_s": round((prompt_tokens + out_tokens) / duration, 1),
        **summary("ttft", ttft), **summary("tpot", tpot), **summary("itl", itl),
        "hit_rate": round(sum(r.cached_tokens for r in done) / max(1, prompt_tokens), 4),
        "hit_rate_source": "usage.prompt_tokens_details.cached_tokens",
        "metrics_hit_rate": None if metrics_hit_rate is None else round(metrics_hit_rate, 4),
        "ideal_hit_rate": round(ideal, 4),
        **environment(kernels=args.base_url is None),  # --base-url: another server's
    }

    print_table(["ms", "mean", "p50", "p99"],
                [[name.upper()] + [result[f"{name}_ms_{s}"] for s in ("mean", "p50", "p99")]
                 for name in ("ttft", "tpot", "itl")])
    print(f"{len(done)}/{len(reqs)} requests at {args.request_rate} req/s in {duration:.1f} s: "
          f"{result['req_s']} req/s, {result['out_tok_s']} out tok/s, "
          f"{result['total_tok_s']} total tok/s; hit rate {result['hit_rate']} "
          f"(/metrics {result['metrics_hit_rate']}, ideal {result['ideal_hit_rate']})")

    def plot(fig: Any) -> None:
        t0 = min(r.send for r in reqs)
        ax = fig.add_subplot(1, 2, 1)
        ax.scatter([r.send - t0 for r in done], [t * 1000 for t in ttft], s=12)
        ax.set_xlabel("request sent at (s)")
        ax.set_ylabel("TTFT (ms)")
        rate = (f"{args.request_rate:g} req/s Poisson" if math.isfinite(args.request_rate)
                else "all at once")
        ax.set_title(f"TTFT over the run, {rate}")
        ax = fig.add_subplot(1, 2, 2)
        names = ["ttft", "tpot", "itl"]
        for i, stat in enumerate(("mean", "p50", "p99")):
            ax.bar(np.arange(3) + (i - 1) * 0.27, [result[f"{n}_ms_{stat}"] or 0 for n in names],
                   0.27, label=stat)
        ax.set_xticks(range(3), [n.upper() for n in names])
        ax.set_yscale("log")
        ax.set_ylabel("ms (log scale)")
        ax.set_title(f"latencies, {len(done)} requests")
        ax.legend()

    write_outputs(args.out, "serving", result, plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
