"""The compiled-grammar cache is bounded by bytes (vLLM's VLLM_XGRAMMAR_CACHE_MB), not count."""

from concurrent.futures import Future

import pytest

from v1 import envs
from v1.engine.structured_output import StructuredOutputManager
from v1.request import Request
from v1.sampling_params import SamplingParams, StructuredOutputsParams

TIMEOUT = 120  # s: one small grammar compiles in ~0.1 s


def choice_params(tag: int, n: int) -> SamplingParams:
    """A grammar of `n` distinct choices, ~0.2 KB per choice compiled (a distinct one per tag)."""
    choices = [f"option {tag} {i}" for i in range(n)]
    return SamplingParams(structured_outputs=StructuredOutputsParams(choice=choices))


def init(manager: StructuredOutputManager, params: SamplingParams) -> None:
    """A request through `grammar_init`, waited on until its matcher is ready."""
    request = Request("r", [1, 2], params)
    manager.grammar_init(request)
    assert request.grammar_future is not None
    request.grammar_future.result(TIMEOUT)


@pytest.fixture
def manager(tokenizer):
    made: list[StructuredOutputManager] = []

    def make(limit_bytes: int) -> StructuredOutputManager:
        made.append(StructuredOutputManager(lambda: tokenizer, len(tokenizer), [2], limit_bytes))
        return made[-1]

    yield make
    for m in made:
        m.shutdown()


def test_cache_stays_within_its_byte_limit(manager):
    # Measure one grammar, then allow about two and a half of them.
    probe = manager(1 << 30)
    init(probe, choice_params(0, 300))
    one = probe.cache.size_bytes
    assert one > 20_000, one  # compiled grammars are big: what the bound is about
    m = manager(one * 5 // 2)
    compiled: list[tuple[str, str]] = []
    compile_ = m._compile

    def counting(key):
        compiled.append(key)
        return compile_(key)

    m._compile = counting
    for tag in range(6):
        init(m, choice_params(tag, 300))
        assert m.cache.size_bytes <= m.cache.limit_bytes
    assert len(m.cache) == 2  # the last two: the others were evicted, oldest first
    init(m, choice_params(5, 300))
    init(m, choice_params(0, 300))
    assert len(compiled) == 7  # the newest was still cached, the first was not


def test_a_grammar_larger_than_the_limit_is_not_kept(manager):
    m = manager(1000)
    params = choice_params(0, 300)
    init(m, params)  # it still serves its request
    assert (len(m.cache), m.cache.size_bytes) == (0, 0)
    m0 = manager(0)  # VLLM_XGRAMMAR_CACHE_MB=0: nothing kept
    init(m0, params)
    assert len(m0.cache) == 0


def test_a_compilation_in_flight_is_reused_and_never_evicted(manager):
    m = manager(0)
    params = choice_params(0, 300)
    gate: Future[None] = Future()
    compile_ = m._compile
    m._compile = lambda key: (gate.result(TIMEOUT), compile_(key))[1]
    first, second = Request("a", [1], params), Request("b", [1], params)
    m.grammar_init(first)
    m.grammar_init(second)  # the same key: it waits on the first one's compilation
    assert len(m.cache) == 1 and len(m.cache.pending()) == 1
    gate.set_result(None)
    for request in (first, second):
        assert request.grammar_future is not None
        request.grammar_future.result(TIMEOUT)
    assert len(m.cache) == 0  # weighed once done: over the limit, dropped


def test_a_compilation_nobody_waits_for_is_never_started(manager):
    """A request that leaves (its client disconnected: the scheduler aborts it) while its
    grammar waits behind another's compilation takes that compilation off the queue, unless
    another request waits for the same grammar; one already running cannot be stopped
    (xgrammar's compile is one native call): it ends and is cached for the next request."""
    m = manager(1 << 30)
    gate: Future[None] = Future()
    compiled: list[str] = []
    compile_ = m._compile

    def gated(key):
        compiled.append(key[1])
        gate.result(TIMEOUT)
        return compile_(key)

    m._compile = gated
    running, shared = choice_params(0, 10), choice_params(1, 10)
    a = Request("a", [1], running)
    b, c = Request("b", [1], shared), Request("c", [1], shared)
    d = Request("d", [1], choice_params(2, 10))
    for request in (a, b, c, d):
        m.grammar_init(request)
    m.grammar_abort(b)  # c still waits for that grammar: it stays queued
    m.grammar_abort(d)  # nobody else waits: never compiled, not cached
    m.grammar_abort(a)  # already running: it ends and is cached
    assert len(m.cache.pending()) == 2
    gate.set_result(None)
    assert c.grammar_future is not None
    c.grammar_future.result(TIMEOUT)
    m.executor.submit(lambda: None).result(TIMEOUT)  # the queue has drained
    assert [key for key in compiled if "option 2" in key] == []
    assert len(compiled) == 2 and len(m.cache) == 2
    again = Request("e", [1], choice_params(2, 10))  # d's grammar, asked for again
    m.grammar_init(again)
    assert again.grammar_future is not None
    again.grammar_future.result(TIMEOUT)
    assert len(compiled) == 3 and len(m.cache) == 3


CACHE_MB_ENV = "VLLM_XGRAMMAR_CACHE_MB"


def test_limit_from_the_environment(monkeypatch):
    monkeypatch.delenv(CACHE_MB_ENV, raising=False)
    assert envs.read().xgrammar_cache_mb == 512  # vLLM's default
    monkeypatch.setenv(CACHE_MB_ENV, "3")
    assert envs.read().xgrammar_cache_mb == 3
    for bad in ("-1", "1.5", "lots"):
        monkeypatch.setenv(CACHE_MB_ENV, bad)
        with pytest.raises(ValueError, match=CACHE_MB_ENV):
            envs.read()
