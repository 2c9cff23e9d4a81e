"""Structured output with xgrammar: compile grammars off the step loop, fill token bitmasks.

xgrammar over llguidance, by `bench/bench_grammar.py` (the default model's 49152-token
vocabulary, a small JSON schema): xgrammar compiles in ~5 ms and fills a mask in ~10 us per
token; llguidance compiles in ~1 ms but fills a mask in ~75 us. The mask is filled every step
for every structured request, so it is what counts.

The scheduler sees this manager through `StructuredOutputManagerProtocol` (torch-free): it
calls `grammar_init` when a request arrives (the request waits in WAITING_FOR_FSM until its
`grammar_future` is done) and `grammar_bitmask` for the step's structured rows.
"""

import json
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import numpy.typing as npt
import xgrammar as xgr

from v1.request import Request, StructuredOutputGrammar
from v1.sampling_params import StructuredOutputsParams

# (kind, spec text): what a compiled grammar is cached by.
GrammarKey = tuple[str, str]
GRAMMAR_CACHE_SIZE = 128


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string literals are valid EBNF string literals (same escapes), but not JSON's
    # surrogate-pair escapes: keep non-ASCII characters as they are.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    if params.json is not None:
        spec = params.json
        # Not sorted: the output lists the properties in the schema's order.
        return "json", spec if isinstance(spec, str) else json.dumps(spec)
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "grammar", _choice_ebnf(params.choice)
    if params.grammar is not None:
        return "grammar", params.grammar
    if params.structural_tag is not None:
        return "structural_tag", params.structural_tag
    return "json_object", ""


def validate_structured_output_params(params: StructuredOutputsParams) -> None:
    """Parse the spec without a tokenizer (cheap), so a bad one is the caller's ValueError
    before the request reaches the engine core."""
    kind, spec = grammar_key(params)
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec)
    except Exception as exc:  # xgrammar raises RuntimeError (C++) or ValueError
        raise ValueError(f"invalid structured_outputs {kind}: {exc}") from exc


class XgrammarGrammar:
    """One request's matcher: advanced only by accepted tokens, so it survives preemption."""

    __slots__ = ("matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if len(token_ids) == 1:  # every step's case, without a generator
            return self.matcher.accept_token(token_ids[0])
        return all(self.matcher.accept_token(t) for t in token_ids)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: npt.NDArray[np.int32], row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        # One thread: compilations queue behind each other, never behind the step loop.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="v1-grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        # LRU: a large schema compiles to megabytes.
        self._cache: OrderedDict[GrammarKey, Future[xgr.CompiledGrammar]] = OrderedDict()

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        if self._compiler is None:  # built on first use: costs ~0.1 s, off the step loop
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        kind, spec = key
        if kind == "json":
            return self._compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "regex":
            return self._compiler.compile_regex(spec)
        if kind == "grammar":
            return self._compiler.compile_grammar(spec)
        if kind == "structural_tag":
            return self._compiler.compile_structural_tag(spec)
        return self._compiler.compile_builtin_json_grammar()

    def grammar_init(self, request: Request) -> None:
        """Start compiling (or reuse the cached compilation of) the request's grammar; its
        `grammar_future` completes with a fresh matcher, or with the compile error."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        key = grammar_key(params)
        # Called from the scheduler's thread only: the cache needs no lock.
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._cache[key] = self.executor.submit(self._compile, key)
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        future: Future[StructuredOutputGrammar] = Future()

        def make_matcher(done: Future[xgr.CompiledGrammar]) -> None:
            exc = done.exception()
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(XgrammarGrammar(done.result()))

        compiled.add_done_callback(make_matcher)
        request.grammar_future = future

    def grammar_bitmask(self, requests: list[Request]) -> npt.NDArray[np.int32]:
        """One row per request, 32 tokens per int32 word (bit set: allowed). Fresh each
        step: under async scheduling the runner may still read the previous one."""
        bitmask = np.empty((len(requests), (self.vocab_size + 31) // 32), dtype=np.int32)
        for row, request in enumerate(requests):
            assert request.grammar is not None
            request.grammar.fill_bitmask(bitmask, row)
        return bitmask

    def wait_for_compilation(self, timeout: float) -> None:
        """Block until a compilation in flight ends, or `timeout` seconds: when nothing else
        can run, the engine waits here instead of stepping empty batches."""
        pending = [f for f in self._cache.values() if not f.done()]
        if pending:
            wait(pending, timeout, FIRST_COMPLETED)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
