"""AsyncLLM over an engine core process: streaming deltas, concurrency, n > 1, cancellation
and abort freeing the core's blocks, validation, utilities, and a killed engine."""

import asyncio
import dataclasses
import multiprocessing
import os
import signal

import pytest

from tests.engine.mp_utils import (
    PROMPTLY_S,
    PROMPTS,
    SMALL_ENGINE,
    assert_greedy_match,
    assert_raises_at_once,
    child_pids,
)
from v1 import LLM, SamplingParams
from v1.config import EngineArgs
from v1.engine.async_llm import AsyncLLM
from v1.engine.exceptions import EngineDeadError
from v1.outputs import RequestOutput, SchedulerStats
from v1.sampling_params import RequestOutputKind

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def shut_down(engine: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
    """Shut the engine down and wait for its output handler to see the end."""
    engine.shutdown()
    if engine._output_handler is not None:
        loop.run_until_complete(asyncio.wait_for(engine._output_handler, PROMPTLY_S))


@pytest.fixture(scope="module")
def engine(loop, default_model_path):
    engine = AsyncLLM.from_engine_args(EngineArgs(**SMALL_ENGINE))
    yield engine
    shut_down(engine, loop)


@pytest.fixture(scope="module")
def inproc_llm(gguf_model):
    llm = LLM(loaded_model=gguf_model, **SMALL_ENGINE)
    yield llm
    llm.shutdown()


async def collect(engine: AsyncLLM, prompt, params, request_id: str) -> list[RequestOutput]:
    """The request's DELTA outputs."""
    delta = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    return [out async for out in engine.generate(prompt, delta, request_id)]


def joined_tokens(deltas: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for d in deltas for c in d.outputs if c.index == index for t in c.token_ids]


async def wait_idle(engine: AsyncLLM) -> SchedulerStats:
    """The core's stats once nothing runs or waits (aborts arrive asynchronously)."""
    for _ in range(200):
        stats = await engine.get_stats()
        if stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0:
            await engine.client.call_utility_async("check_integrity")
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine core is still busy: {stats}")


def test_streaming_deltas_add_up_to_the_final_output(engine, loop, inproc_llm):
    stop = SamplingParams(temperature=0.0, max_tokens=24, stop=[" 9"])
    for i, (prompt, params) in enumerate([(PROMPTS[0], GREEDY), (PROMPTS[1], stop)]):
        deltas = loop.run_until_complete(collect(engine, prompt, params, f"s{i}"))
        (final,) = inproc_llm.generate([prompt], params, use_tqdm=False)
        assert len(deltas) > 1
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert all(d.request_id == f"s{i}" for d in deltas)
        assert "".join(d.outputs[0].text for d in deltas) == final.outputs[0].text
        assert joined_tokens(deltas) == final.outputs[0].token_ids
        assert deltas[-1].outputs[0].finish_reason == final.outputs[0].finish_reason
    assert final.outputs[0].stop_reason == " 9"


def test_concurrent_requests_and_n(engine, loop, inproc_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5)
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)

    async def main() -> list[list[RequestOutput]]:
        streams = [collect(engine, p, greedy, f"c{i}") for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*streams, collect(engine, "Name a fruit:", sampled, "n3"))

    *streams, n3 = loop.run_until_complete(main())
    expected = inproc_llm.generate(PROMPTS, greedy, use_tqdm=False)
    for deltas, ref in zip(streams, expected, strict=True):
        tops = [top for d in deltas for top in d.outputs[0].logprobs]
        assert_greedy_match(joined_tokens(deltas), tops, ref.outputs[0].token_ids,
                            ref.outputs[0].logprobs)
    # Seeded sampling does not depend on the batch: equal, token for token.
    (ref,) = inproc_llm.generate(["Name a fruit:"], sampled, use_tqdm=False)
    assert n3[-1].finished and not any(d.finished for d in n3[:-1])
    assert [joined_tokens(n3, i) for i in range(3)] == [c.token_ids for c in ref.outputs]
    loop.run_until_complete(wait_idle(engine))


def test_leaving_the_stream_early_aborts_the_request(engine, loop):
    async def break_out() -> int:
        seen = 0
        async for _ in engine.generate(PROMPTS[3], LONG, "brk"):
            seen += 1
            if seen == 3:
                break  # the dropped generator is closed, which aborts the request
        return seen

    async def cancel_task() -> None:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate(PROMPTS[3], LONG, "cnl"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    for scenario in (break_out, cancel_task):
        loop.run_until_complete(scenario())
        stats = loop.run_until_complete(wait_idle(engine))
        assert stats.kv_cache_usage == 0


def test_abort_ends_the_stream(engine, loop):
    async def main() -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        async for out in engine.generate(PROMPTS[3], LONG, "abt"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("abt")
        return outs

    outs = loop.run_until_complete(asyncio.wait_for(main(), 30))
    assert len(outs) >= 2 and not outs[-1].finished
    assert loop.run_until_complete(wait_idle(engine)).kv_cache_usage == 0


def test_an_aborted_id_is_free_at_once(engine, loop, inproc_llm):
    """The caller's id may name a new request right after abort(), while the old stream is
    still open: each stream gets its own request's outputs, and closing the old stream
    leaves the new request alone."""

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        old = engine.generate(PROMPTS[3], LONG, "again")
        await anext(old)
        await engine.abort("again")
        new = await collect(engine, PROMPTS[1], GREEDY, "again")
        return new, [out async for out in old]

    new, rest = loop.run_until_complete(asyncio.wait_for(main(), 60))
    (ref,) = inproc_llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)
    assert new[-1].finished and all(d.request_id == "again" for d in new)
    assert joined_tokens(new) == ref.outputs[0].token_ids
    assert not any(d.finished for d in rest)
    assert loop.run_until_complete(wait_idle(engine)).kv_cache_usage == 0


def test_bad_input_raises_before_anything_is_sent(engine, loop):
    async def main() -> None:
        before = (await engine.get_stats()).num_prompt_tokens
        for prompt, params, match in [
            ("", GREEDY, "empty"),
            ("x " * 3000, GREEDY, "max_model_len"),
            ([1, 10**6], GREEDY, "1000000"),
        ]:
            with pytest.raises(ValueError, match=match):
                await anext(engine.generate(prompt, params, "bad"))
        assert (await engine.get_stats()).num_prompt_tokens == before
        running = engine.generate(PROMPTS[3], LONG, "dup")
        await anext(running)
        with pytest.raises(ValueError, match="already in use"):
            await anext(engine.generate(PROMPTS[0], GREEDY, "dup"))
        await running.aclose()
        await wait_idle(engine)

    loop.run_until_complete(main())


def test_properties_and_utilities(engine, loop):
    assert engine.max_model_len == 1024 and engine.model_name.startswith("SmolLM2")
    assert engine.tokenizer.encode("hello")
    assert "user" in engine.processor.apply_chat_template([{"role": "user", "content": "hi"}])
    assert not engine.errored

    async def main() -> None:
        await engine.check_health()
        assert isinstance(await engine.get_stats(), SchedulerStats)
        assert await engine.reset_prefix_cache() is True

    loop.run_until_complete(main())


def test_sigkill_fails_streams_and_later_calls(default_model_path):
    loop = asyncio.new_event_loop()
    engine = AsyncLLM.from_engine_args(EngineArgs(**SMALL_ENGINE))
    proc = engine.client._res.proc

    async def main() -> None:
        started = asyncio.Event()

        async def consume(request_id: str) -> None:
            async for _ in engine.generate(PROMPTS[3], LONG, request_id):
                started.set()

        tasks = [asyncio.create_task(consume(f"k{i}")) for i in range(3)]
        await started.wait()
        os.kill(proc.pid, signal.SIGKILL)
        results = await asyncio.wait_for(
            asyncio.gather(*tasks, return_exceptions=True), PROMPTLY_S
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "killed by signal 9" in str(results[0])
        assert engine.errored
        # At once: each raises on its first step, before it could send or await anything.
        for call in (
            engine.check_health(),
            anext(engine.generate(PROMPTS[0], GREEDY, "after")),
            engine.get_stats(),
        ):
            assert_raises_at_once(call, EngineDeadError)

    try:
        loop.run_until_complete(main())
    finally:
        shut_down(engine, loop)
        loop.close()
    assert proc not in multiprocessing.active_children()
    assert proc.pid not in child_pids()
