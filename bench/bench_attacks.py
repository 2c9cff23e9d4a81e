"""Hostile or careless requests (issue 20's table) against a running `python -m v1 serve`,
while another user streams 16-token completions back to back: per request, the status it
got, how long it took, and the longest gap between the other user's streamed chunks while it
ran (the event loop's stall). Run it against two servers to compare them, e.g. one without
the request limits and one with:

    .venv/bin/python -m v1 serve --port 8000 --api-key K &
    .venv/bin/python bench/bench_attacks.py --base-url http://127.0.0.1:8000 --api-key K
"""

import argparse
import json
import threading
import time
from typing import Any

import httpx
from common import print_table


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HI = {"prompt": "Hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
# name -> (endpoint, body)
ATTACKS: dict[str, tuple[str, dict[str, Any]]] = {
    "structured_outputs.json 300 deep": (
        "v1/completions", {**HI, "structured_outputs": {"json": nested_schema(300)}}),
    "/tokenize 5 MB": ("tokenize", {"prompt": "hello " * 900_000}),
    "bad_words x 10,000": (
        "v1/completions", {**HI, "bad_words": [f"w{i}" for i in range(10_000)]}),
    "enum x 100,000": (
        "v1/completions",
        {**HI, "structured_outputs": {"json": {"enum": [f"e{i}" for i in range(100_000)]}}}),
    "choice x 100,000": (
        "v1/completions",
        {**HI, "structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}}),
    "n = 1000": ("v1/completions", {**HI, "max_tokens": 16, "n": 1000}),
    "seed 2**70": ("v1/completions", {**HI, "seed": 2**70}),
    "priority 2**80": ("v1/completions", {**HI, "priority": 2**80}),
    "top_k 2**70": ("v1/completions", {**HI, "top_k": 2**70}),
    "lone surrogate, prompt": ("v1/completions", {**HI, "prompt": "Hi \ud800"}),
    "lone surrogate, message": (
        "v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}),
    "lone surrogate, bad_words": ("v1/completions", {**HI, "bad_words": ["\ud800"]}),
    "lone surrogate, /tokenize": ("tokenize", {"prompt": "\ud800"}),
    "chat_template_kwargs messages": (
        "v1/chat/completions", {**CHAT, "chat_template_kwargs": {"messages": 5}}),
    "priority 1 under fcfs": ("v1/completions", {**HI, "priority": 1}),
}


class Streamer:
    """The other user: streamed 16-token completions, back to back; every chunk's arrival
    time and the gap since the one before."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.gaps: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, headers), daemon=True)
        self._thread.start()

    def _run(self, url: str, headers: dict[str, str]) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 16, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=600) as client:
            while not self._stop.is_set():
                last = time.perf_counter()
                with client.stream("POST", f"{url}/v1/completions", headers=headers,
                                   json=body) as response:
                    for _ in response.iter_lines():
                        now = time.perf_counter()
                        self.gaps.append((now, now - last))
                        last = now

    def longest_gap(self, start: float, end: float) -> float:
        return max((gap for at, gap in self.gaps if start <= at <= end), default=0.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    headers = {} if args.api_key is None else {"Authorization": f"Bearer {args.api_key}"}
    streamer = Streamer(args.base_url, headers)
    time.sleep(3)  # the stream's gaps settle
    rows = []
    for name, (endpoint, body) in ATTACKS.items():
        # json.dumps writes a lone surrogate as its "\ud800" escape, as a client's JSON would.
        content = json.dumps(body).encode()
        start = time.perf_counter()
        response = httpx.post(
            f"{args.base_url}/{endpoint}", content=content, timeout=600,
            headers={**headers, "content-type": "application/json"},
        )
        took = time.perf_counter() - start
        time.sleep(1)  # a stall may end just after the response
        gap = streamer.longest_gap(start, start + took + 1)
        rows.append((name, response.status_code, f"{took:.2f}", f"{gap:.2f}"))
        print(*rows[-1], sep="\t", flush=True)
    streamer.stop()
    print_table(("request", "status", "seconds", "longest gap of the other stream (s)"), rows)


if __name__ == "__main__":
    main()
