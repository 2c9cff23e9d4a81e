"""Hostile and careless inputs against `python -m v1 serve --api-key K`, with a bystander.

Issue 20's table, as a script: beside the attacks, a second user streams 16-token completions
back to back, and `/health` is polled every 0.1 s. The attacks run one at a time, each a row:

    deep schemas (depth 300) as structured_outputs.json, response_format and a tool's
    parameters; /tokenize with a 5 MB prompt (no key); 10,000 bad_words; n = 1000, and
    n = 10000 with a short client time-out; seed 2^70, priority 2^80, top_k 2^70; a lone
    surrogate in a prompt, a chat message, bad_words and /tokenize; a chat of 30,000 messages
    (the Jinja template's time); chat_template_kwargs {"messages": 5}; priority under the
    fcfs policy; a prompt of 6000 tokens (not hostile: its steps' time); then for memory 10
    distinct large prompts, 20 distinct large grammars (choice lists) and three distinct
    100k-entry choice lists. Then limits that multiply and
    the server's files: /v1/load_lora_adapter with an adapter folder outside the LoRA roots
    and a symlink out of one (404 unless the server opts in, `--runtime-lora`); 513 prompts
    x n=2; prompt_logprobs=20 over 100 prompts of 200 tokens; 150,000 allowed_token_ids x n=2;
    24 parallel 15 MB prompts (max_body_bytes_in_flight); one 15 MB body of token ids (parsed
    and validated whole); a prompt of 1M floats, 1M unknown fields and a string left open
    after 1M commas (bodies whose cost was per value); 1025 /score pairs and a 15 MB
    /v1/embeddings input (a pooling server's limits: the default server generates, so these
    two meet the routes' refusal); last, a grammar at the size limits (one compilation's
    time), distinct ones whose clients leave after a second, then a small grammar (its time
    is the compilations it waited for: at most the one running when they left, the others'
    are not started).

Per row: the HTTP status (with the error message's first words; "timeout" past the client
time-out), the attack's time, the bystander's longest wait for progress while the attack ran
(the gap between two of its chunks, or between a chunk and the next request's first one),
the slowest `/health` answer of the polls that overlapped it, and the frontend's and the engine
core's resident memory once it is over. A row's window lasts at least a second, so that an
attack answered at once still shows the stream's ordinary gaps (the `idle` row: no attack).
The next row starts once the bystander moved on and the frontend is idle again (a request
whose client timed out may still be at work there). The frontend is the process listening on
the server's port and the engine core its largest descendant, found in /proc: RSS columns are
"-" for a server on another machine.

The script starts the server (the branch's `v1`, on a free loopback port, with `--api-key`) and
stops it at the end; `--base-url` targets a running one instead; `--runtime-lora` starts it with
runtime LoRA loading on (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, `--enable-lora`, a `--lora-root`
of its own). It takes a few minutes: every request has a client time-out (`--timeout`).

    .venv/bin/python bench/bench_hostile.py
    .venv/bin/python bench/bench_hostile.py --runtime-lora --only idle,lora_outside_roots
    .venv/bin/python bench/bench_hostile.py --base-url http://127.0.0.1:8000 --only idle,n_1000
"""

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
from bench_serving import server
from common import engine_core_pid, environment, print_table, rss_mb, write_outputs

from v1.config.limits import DEFAULT_LIMITS

DEFAULT_API_KEY = "K"
STREAM_PROMPT = "The capital of France is"
HEALTH_EVERY_S = 0.1
MIN_WINDOW_S = 1.0
SETTLE_S = 120.0  # how long a row waits for the server to recover before the next one
# The frontend is idle again (no attack's work left in it) below this CPU use, in cores.
IDLE_CPU = 0.5
LONE_SURROGATE = "\ud800"
LARGE_BODY_BYTES = 15_000_000  # under the default max_request_body_bytes (16 MiB)


@dataclass
class Call:
    """One HTTP request of an attack; `body` is serialized before the row's window opens, so
    that the client's own JSON encoding of megabytes does not count as the server's stall."""

    path: str
    body: dict[str, Any] | bytes  # bytes: sent as they are (not JSON)
    timeout: float | None = None  # None: --timeout
    auth: bool = True  # /tokenize needs no key (as vLLM's)


# A row's requests run one after another; a list among them is sent at once (the same Call
# listed k times: k requests of one body, serialized once).
Step = Call | list[Call]


@dataclass
class Row:
    attack: str
    status: str = ""
    message: str = ""
    seconds: float = 0.0
    user_max_gap_s: float | None = None
    health_max_s: float | None = None
    frontend_rss_mb: float | None = None
    engine_rss_mb: float | None = None
    # SETTLE_S after it, the bystander or /health had not recovered, or the frontend was
    # still busy (a request whose client timed out goes on to the end of its input work).
    unsettled: bool = False


def deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def big_text(n_bytes: int, tag: str) -> str:
    """About `n_bytes` of ordinary words, distinct per `tag` (no tokenizer cache helps)."""
    words = [f"{tag}{i % 997} lorem ipsum dolor sit amet" for i in range(n_bytes // 32 + 1)]
    return " ".join(words)[:n_bytes]


def choices(n: int, tag: str) -> list[str]:
    return [f"{tag}-option-{i}" for i in range(n)]


def long_choices(tag: str) -> list[str]:
    """As many distinct strings as a `choice` may list by default, together about as long as
    a spec may be (max_structured_output_choices, max_structured_output_len)."""
    count = DEFAULT_LIMITS.max_structured_output_choices
    size = DEFAULT_LIMITS.max_structured_output_len // count - 16
    return [f"{tag}-{i}-{big_text(size, f'{tag}w{i}')}" for i in range(count)]


def lora_folders(root: Path) -> tuple[Path, Path]:
    """An adapter folder outside `root` (a PEFT adapter's file names) and a symlink inside
    `root` to it: what a client asks the server to load."""
    outside = root.parent / "outside"
    outside.mkdir(exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (outside / name).write_text("{}")
    link = root / "link-out"
    if not link.is_symlink():
        link.symlink_to(outside)
    return outside, link


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hi", "max_tokens": 4, **fields}


def chat(content: str = "Hi", **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def attacks(args: argparse.Namespace) -> dict[str, list[Step]]:
    """Each row's requests, in the order they run."""
    schema = deep_schema(args.depth)
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    outside, link_out = lora_folders(args.lora_root)
    large_prompt = Call("/v1/completions", completion(prompt=big_text(LARGE_BODY_BYTES, "b")))
    return {
        "idle": [],
        "json_depth": [Call("/v1/completions", completion(structured_outputs={"json": schema}))],
        "response_format_depth": [Call("/v1/chat/completions", chat(response_format={
            "type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}))],
        "tool_parameters_depth": [Call("/v1/chat/completions", chat(
            tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}))],
        "tokenize_5mb": [Call("/tokenize", {"prompt": big_text(5_000_000, "t")}, auth=False)],
        "bad_words_10000": [Call("/v1/completions", completion(
            bad_words=[f"badword{i}" for i in range(10_000)]))],
        "n_1000": [Call("/v1/completions", completion(n=1000))],
        "n_10000": [Call("/v1/completions", completion(n=10_000), timeout=args.short_timeout)],
        "seed_2^70": [Call("/v1/completions", completion(seed=2**70))],
        "priority_2^80": [Call("/v1/completions", completion(priority=2**80))],
        "top_k_2^70": [Call("/v1/completions", completion(top_k=2**70))],
        "surrogate_prompt": [Call("/v1/completions", completion(prompt=f"a{LONE_SURROGATE}b"))],
        "surrogate_chat": [Call("/v1/chat/completions", chat(f"a{LONE_SURROGATE}b"))],
        "surrogate_bad_words": [Call("/v1/completions", completion(bad_words=[LONE_SURROGATE]))],
        "surrogate_tokenize": [Call("/tokenize", {"prompt": LONE_SURROGATE}, auth=False)],
        # Jinja holds the GIL: is a thread enough to keep it from stalling the loop?
        "chat_template_30k_messages": [Call("/v1/chat/completions", {
            "messages": [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"}
                         for i in range(30_000)], "max_tokens": 4})],
        "template_kwargs_messages": [Call("/v1/chat/completions", chat(
            chat_template_kwargs={"messages": 5}))],
        "priority_under_fcfs": [Call("/v1/completions", completion(priority=1))],
        # Not hostile, only long: its prompt's steps are the bystander's longest waits.
        "prompt_6000_tokens": [Call("/v1/completions", completion(prompt="y " * 6000))],
        # Memory: what the frontend keeps after large prompts, the engine after grammars.
        "prompts_10x1mb": [
            Call("/v1/completions", completion(prompt=big_text(1_000_000, f"p{i}")))
            for i in range(10)
        ],
        "grammars_20": [
            Call("/v1/completions", completion(
                structured_outputs={"choice": choices(args.grammar_entries, f"g{i}")}))
            for i in range(20)
        ],
        **{
            f"choice_100k_{i}": [Call("/v1/completions", completion(
                structured_outputs={"choice": choices(args.choice_entries, f"c{i}")}))]
            for i in range(1, 4)
        },
        # The LoRA routes: off unless the operator opts in, then confined to the roots.
        "lora_outside_roots": [Call("/v1/load_lora_adapter", {
            "lora_name": "outside", "lora_path": str(outside)})],
        "lora_symlink_out": [Call("/v1/load_lora_adapter", {
            "lora_name": "link-out", "lora_path": str(link_out)})],
        # Limits that multiply: each factor within its own limit, the product not.
        "prompts_513_x_n2": [Call("/v1/completions", completion(
            prompt=[[1]] * 513, n=2, max_tokens=1))],
        "prompt_logprobs_20_x_100x200": [Call("/v1/completions", completion(
            prompt=[[1] * 200] * 100, prompt_logprobs=20, max_tokens=1))],
        "allowed_ids_150k_x_n2": [Call("/v1/completions", completion(
            n=2, max_tokens=1, allowed_token_ids=[1] * 150_000))],
        "bodies_24x15mb": [[large_prompt] * 24],
        "token_ids_15mb": [Call("/v1/completions", completion(
            prompt=[1] * (LARGE_BODY_BYTES // 3)))],  # "1, " each
        # Bodies whose cost was per value or per quote, on the event loop: a million bad
        # values (one error each), a million unknown fields (each named in the log), a string
        # left open after a million commas and 40,000 escaped quotes (the comma count's
        # pattern rescanned to the end from every quote).
        "bad_values_1m": [Call("/v1/completions", completion(prompt=[1.5] * 1_000_000))],
        "unknown_fields_1m": [Call("/v1/completions", completion(
            **{f"x{i}": 1 for i in range(1_000_000)}))],
        "unclosed_string": [Call("/v1/completions", b"," * 1_048_576 + b'"' + b'\\"' * 40_000)],
        "score_1025_pairs": [Call("/score", {"text_1": "a", "text_2": ["b"] * 1025})],
        "embeddings_15mb": [Call("/v1/embeddings", {"input": big_text(LARGE_BODY_BYTES, "e")})],
        # One compilation's time at the size limits (the client waits for it); then clients
        # that leave while their grammars wait for the one grammar thread.
        "grammar_at_limits": [Call("/v1/completions", completion(structured_outputs={
            "choice": long_choices("limits")}), timeout=SETTLE_S)],
        f"grammar_orphans_{args.orphan_grammars}": [[
            Call("/v1/completions", completion(structured_outputs={
                "choice": long_choices(f"o{i}")}), timeout=1.0)
            for i in range(args.orphan_grammars)
        ]],
        "grammar_after_orphans": [Call("/v1/completions", completion(
            structured_outputs={"choice": ["after-orphans-a", "after-orphans-b"]}),
            timeout=SETTLE_S)],
    }


class Bystander:
    """The second user (streamed completions back to back) and the `/health` poller; both
    keep timestamps, on the monotonic clock, of the progress they saw."""

    def __init__(self, base: str, headers: dict[str, str]) -> None:
        self.base, self.headers = base, headers
        self.progress: list[float] = []  # when a chunk with text arrived
        self.polls: list[list[float]] = []  # [sent, answered (0 while pending)]
        self.errors: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._stream()), asyncio.create_task(self._poll())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _stream(self) -> None:
        payload = {"prompt": STREAM_PROMPT, "max_tokens": 16, "temperature": 0,
                   "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=None, headers=self.headers) as client:
            while True:
                try:
                    async with client.stream("POST", f"{self.base}/v1/completions",
                                             json=payload) as resp:
                        async for line in resp.aiter_lines():
                            if line.startswith("data: {") and '"text":""' not in line:
                                self.progress.append(time.monotonic())
                except httpx.HTTPError as e:
                    self.errors.append(f"stream: {e!r}")
                    await asyncio.sleep(0.5)

    async def _poll(self) -> None:
        async with httpx.AsyncClient(timeout=None) as client:
            while True:
                poll = [time.monotonic(), 0.0]
                self.polls.append(poll)
                try:
                    await client.get(f"{self.base}/health")
                except httpx.HTTPError as e:
                    self.errors.append(f"health: {e!r}")
                poll[1] = time.monotonic()
                await asyncio.sleep(max(0.0, poll[0] + HEALTH_EVERY_S - time.monotonic()))

    def recovered(self, end: float) -> bool:
        """The stream moved on after `end` and no poll sent before it is pending."""
        pending = any(sent < end and not answered for sent, answered in self.polls)
        return bool(self.progress) and self.progress[-1] > end and not pending

    def max_gap(self, start: float, end: float) -> float:
        """The longest wait for stream progress overlapping [start, end] (still open: until
        now)."""
        times = [*self.progress, time.monotonic()]
        return max(
            (b - a for a, b in zip(times, times[1:]) if b > start and a < end), default=0.0
        )

    def max_health(self, start: float, end: float) -> float:
        now = time.monotonic()
        return max(
            ((answered or now) - sent for sent, answered in self.polls
             if sent < end and (answered == 0 or answered > start)),
            default=0.0,
        )


def cpu_s(pid: int) -> float:
    """The process's CPU time so far (user + system, all threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def idle(pid: int | None) -> bool:
    """Whether the process used less than IDLE_CPU cores over the next half second."""
    if pid is None:
        return True
    before = cpu_s(pid)
    await asyncio.sleep(0.5)
    return cpu_s(pid) - before < IDLE_CPU * 0.5


def listening_pid(port: int) -> int | None:
    """The local process listening on TCP `port` (by the socket's inode in /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if str(fd.readlink()) in inodes:
                    return int(fd_dir.parent.name)
        except OSError:  # gone, or not ours to read
            continue
    return None


def describe(resp: httpx.Response) -> str:
    """An error's message (OpenAI's JSON body, or the raw text), or a success's size."""
    if resp.status_code == 200:
        return f"{len(resp.content)} bytes"
    try:
        message = str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = resp.text
    return message.replace("\n", " ")[:70]


async def run_row(client: httpx.AsyncClient, bystander: Bystander, name: str, steps: list[Step],
                  args: argparse.Namespace, pids: Callable[[], tuple[int | None, int | None]]
                  ) -> Row:
    groups = [step if isinstance(step, list) else [step] for step in steps]
    bodies = {
        id(call): call.body if isinstance(call.body, bytes) else json.dumps(call.body).encode()
        for group in groups for call in group
    }
    row = Row(name)
    statuses: dict[str, int] = {}

    async def send(call: Call) -> None:
        headers = {"content-type": "application/json"}
        if call.auth:
            headers["authorization"] = f"Bearer {args.api_key}"
        try:
            resp = await client.post(call.path, content=bodies[id(call)], headers=headers,
                                     timeout=call.timeout or args.timeout)
            status = str(resp.status_code)
            row.message = row.message or ("" if status == "200" else describe(resp))
        except httpx.TimeoutException:
            status = "timeout"
        except httpx.HTTPError as e:
            status, row.message = "error", row.message or repr(e)[:70]
        statuses[status] = statuses.get(status, 0) + 1

    start = time.monotonic()
    for group in groups:
        await asyncio.gather(*map(send, group))
    end = time.monotonic()
    row.seconds = round(end - start, 2)
    row.status = ", ".join(f"{s} x{k}" if k > 1 else s for s, k in statuses.items()) or "-"
    await asyncio.sleep(max(0.0, start + MIN_WINDOW_S - time.monotonic()))
    window_end = max(end, start + MIN_WINDOW_S)
    frontend, engine = pids()
    deadline = time.monotonic() + SETTLE_S
    while not bystander.recovered(window_end) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    row.user_max_gap_s = round(bystander.max_gap(start, window_end), 2)
    row.health_max_s = round(bystander.max_health(start, window_end), 2)
    settled = bystander.recovered(window_end)
    while settled and not await idle(frontend):
        settled = time.monotonic() < deadline
    row.unsettled = not settled
    row.frontend_rss_mb = None if frontend is None else rss_mb(frontend)
    row.engine_rss_mb = None if engine is None else rss_mb(engine)
    return row


async def run(base: str, args: argparse.Namespace) -> list[Row]:
    port = urlparse(base).port
    frontend = listening_pid(port) if port and urlparse(base).hostname in (
        "127.0.0.1", "localhost") else None
    engine = None if frontend is None else engine_core_pid(frontend)

    def pids() -> tuple[int | None, int | None]:
        return frontend, engine

    rows_to_run = attacks(args)
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - rows_to_run.keys()
        if unknown:
            raise SystemExit(f"unknown attacks {sorted(unknown)}; known: {list(rows_to_run)}")
        rows_to_run = {name: rows_to_run[name] for name in wanted}
    headers = {"authorization": f"Bearer {args.api_key}"}
    bystander = Bystander(base, headers)
    bystander.start()
    rows = []
    try:
        async with httpx.AsyncClient(base_url=base) as client:
            while not bystander.progress:  # the stream has started: the engine is warm
                await asyncio.sleep(0.1)
            for name, steps in rows_to_run.items():
                row = await run_row(client, bystander, name, steps, args, pids)
                print(f"{row.attack}: {row.status} {row.message[:40]!r} gap "
                      f"{row.user_max_gap_s}s health {row.health_max_s}s", file=sys.stderr)
                rows.append(row)
    finally:
        await bystander.stop()
    for error in bystander.errors[:10]:
        print(f"bystander: {error}", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", "--url", default=None,
                        help="a running server (http://host:port, started with --api-key "
                        "API_KEY); default: start one here")
    parser.add_argument("--api-key", default=DEFAULT_API_KEY, help="the server's --api-key")
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="client time-out of each attack request, s")
    parser.add_argument("--short-timeout", type=float, default=5.0,
                        help="client time-out of the n=10000 request, s")
    parser.add_argument("--depth", type=int, default=300, help="the deep schemas' depth")
    parser.add_argument("--grammar-entries", type=int, default=5000,
                        help="entries of each of the 20 distinct choice grammars")
    parser.add_argument("--choice-entries", type=int, default=100_000,
                        help="entries of each of the three large choice lists")
    parser.add_argument("--orphan-grammars", type=int, default=6,
                        help="distinct grammars at the size limits whose clients leave after 1 s")
    parser.add_argument("--runtime-lora", action="store_true",
                        help="start the server with runtime LoRA loading on (a --lora-root of "
                        "its own): the LoRA rows meet the path checks, not a 404")
    parser.add_argument("--only", default=None,
                        help="comma-separated attack names to run (default: all, in order)")
    parser.add_argument("--model", default=None,
                        help="a .gguf file or HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--server-args", default="",
                        help='other `python -m v1 serve` options, one string')
    parser.add_argument("--out", default=None, help="directory for hostile.json and a PNG plot")
    # bench_serving.server's engine options, at the server's defaults.
    parser.set_defaults(max_num_seqs=256, max_num_batched_tokens=None, block_size=16,
                        enable_prefix_caching=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops the server on the way out
    args.server_args = f"--api-key {args.api_key} {args.server_args}"
    with tempfile.TemporaryDirectory() as tmp:
        args.lora_root = Path(tmp) / "lora-root"
        args.lora_root.mkdir()
        if args.runtime_lora:  # the server inherits the environment
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
            args.server_args += f" --enable-lora --lora-root {args.lora_root}"
        with server(args) as base:
            rows = asyncio.run(run(base, args))

    header = ["attack", "status", "message", "s", "user gap s", "health s", "front MB",
              "engine MB"]
    print_table(header, [
        [r.attack, r.status + (" (unsettled)" if r.unsettled else ""), r.message[:40] or "-",
         r.seconds, r.user_max_gap_s, r.health_max_s,
         "-" if r.frontend_rss_mb is None else r.frontend_rss_mb,
         "-" if r.engine_rss_mb is None else r.engine_rss_mb]
        for r in rows
    ])
    result = {"bench": "hostile", "rows": [asdict(r) for r in rows], **environment()}

    def plot(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r.user_max_gap_s or 0 for r in rows], 0.4,
               label="bystander's max gap")
        ax.bar([i + 0.2 for i in x], [r.health_max_s or 0 for r in rows], 0.4,
               label="max /health latency")
        ax.set_xticks(list(x), [r.attack for r in rows], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("s")
        ax.set_title("stalls per attack")
        ax.legend()

    write_outputs(args.out, "hostile", result, plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
