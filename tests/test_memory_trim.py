"""Freed memory goes back to the OS (`v1.memory_trim`), and the server's frontend does it when idle.

The figures are this process's resident memory, compared with generous margins: a large
request's allocations are simulated by ~100 MB of 1 KB blocks on a worker thread (its own malloc
arena, as the input pool's tokenizing), one block in 64 kept, so that the freed ones are holes
malloc does not give back on its own (they are not at the top of a heap)."""

import asyncio
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from v1 import memory_trim

MB = 1 << 20
CHURN_BYTES = 100 * MB
TIMEOUT_S = 60  # a trim takes well under a second


def churn_on_a_thread() -> list[bytearray]:
    """Allocate CHURN_BYTES in 1 KB blocks on a fresh thread and free all but one in 64."""
    kept: list[bytearray] = []

    def run() -> None:
        blocks = [bytearray(1024) for _ in range(CHURN_BYTES // 1024)]
        kept.extend(blocks[::64])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return kept


@pytest.fixture
def glibc() -> None:
    if not memory_trim.trim():
        pytest.skip("no malloc_trim in this C library")


def test_trim_gives_freed_holes_back(glibc: None) -> None:
    start = memory_trim.rss_bytes()
    kept = churn_on_a_thread()
    held = memory_trim.rss_bytes() - start
    assert held > CHURN_BYTES // 2  # malloc keeps the freed blocks: what this is about
    assert memory_trim.trim()
    assert memory_trim.rss_bytes() - start < held // 4
    del kept


def test_idle_trim_waits_for_growth_beyond_its_slack(glibc: None) -> None:
    lenient = memory_trim.IdleTrim(slack_bytes=4 * CHURN_BYTES)
    strict = memory_trim.IdleTrim(slack_bytes=CHURN_BYTES // 4)
    start = memory_trim.rss_bytes()
    kept = churn_on_a_thread()
    assert not lenient.on_idle()  # within its slack: ordinary traffic pays nothing
    assert memory_trim.rss_bytes() - start > CHURN_BYTES // 2
    assert strict.on_idle()
    assert memory_trim.rss_bytes() - start < CHURN_BYTES // 4
    assert not strict.on_idle()  # nothing grew since
    del kept


def test_the_frontend_trims_once_idle(glibc: None) -> None:
    """The server's middleware (`_TrimWhenIdle`): after a request that churned, resident
    memory drops back without another request coming."""
    from v1.entrypoints.openai.api_server import _TrimWhenIdle

    kept: list[list[bytearray]] = []
    held: list[int] = []  # the request's growth, measured before it ends (then a trim may run)

    async def large(request: object) -> PlainTextResponse:
        start = memory_trim.rss_bytes()
        kept.append(await asyncio.to_thread(churn_on_a_thread))
        held.append(memory_trim.rss_bytes() - start)
        return PlainTextResponse("done")

    app = _TrimWhenIdle(Starlette(routes=[Route("/large", large)]))

    async def scenario() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            start = memory_trim.rss_bytes()
            assert (await client.get("/large")).text == "done"
            deadline = time.monotonic() + TIMEOUT_S
            while memory_trim.rss_bytes() - start > held[0] // 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return start, memory_trim.rss_bytes()

    start, end = asyncio.run(scenario())
    assert held[0] > CHURN_BYTES // 2
    assert end - start < held[0] // 4


def test_the_frontend_trims_again_when_idle_again_during_a_trim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request that ends while the previous idle moment's trim still runs gets its own trim
    after it: else what it freed would stay until some later request."""
    from v1.entrypoints.openai.api_server import _TrimWhenIdle

    release, calls = threading.Event(), []

    def slow_trim() -> bool:
        calls.append(time.monotonic())
        if len(calls) == 1:
            assert release.wait(TIMEOUT_S)
        return True

    monkeypatch.setattr(memory_trim, "trim", slow_trim)

    async def ok(request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = _TrimWhenIdle(Starlette(routes=[Route("/", ok)]))

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            async def calls_reach(n: int) -> None:
                deadline = time.monotonic() + TIMEOUT_S
                while len(calls) < n and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)

            await client.get("/")  # idle: the first trim starts, and hangs
            await calls_reach(1)
            await client.get("/")  # idle again meanwhile
            assert len(calls) == 1
            release.set()
            await calls_reach(2)

    asyncio.run(scenario())
    assert len(calls) == 2
