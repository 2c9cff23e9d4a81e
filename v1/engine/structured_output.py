"""Structured output with xgrammar: compile grammars off the step loop, fill token bitmasks.

The scheduler sees this manager through `StructuredOutputManagerProtocol` (torch-free):
`grammar_init` when a request arrives (it waits in WAITING_FOR_FSM until its `grammar_future`
is done), `grammar_abort` when one leaves before that (a compilation nobody waits for is
not started), and `grammar_bitmask` for the step's structured rows. Compiled grammars are kept in
our own byte-bounded LRU (`VLLM_XGRAMMAR_CACHE_MB`), answered on the scheduler's thread. Why
xgrammar, and why not its own cache: docs/serving.md, "Structured output".
"""

import json
import sys
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from v1.openmp import load_torch_passively
from v1.request import Request, StructuredOutputGrammar
from v1.sampling_params import StructuredOutputsParams

# xgrammar is imported where a grammar is first used (by name below, for the annotations):
# importing it costs every engine start ~0.15 s, most of them serving no grammar.
if TYPE_CHECKING:
    import xgrammar as xgr

# (kind, spec text): what a compiled grammar is cached by.
GrammarKey = tuple[str, str]
# The kind of a JSON schema compiled with any whitespace allowed between its tokens.
_JSON_ANY_WHITESPACE = "json, any whitespace"
def _choice_ebnf(choices: list[str]) -> str:
    # JSON string literals are valid EBNF string literals (same escapes), but not JSON's
    # surrogate-pair escapes: keep non-ASCII characters as they are.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    if params.json is not None:
        spec = params.json
        # Not sorted: the output lists the properties in the schema's order.
        kind = "json" if params.disable_any_whitespace else _JSON_ANY_WHITESPACE
        return kind, spec if isinstance(spec, str) else json.dumps(spec)
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
    before the request reaches the engine core. xgrammar imports torch: in a frontend, the
    first grammar loads it (passively, as an engine would)."""
    load_torch_passively()
    import xgrammar as xgr

    kind, spec = grammar_key(params)
    try:
        if kind in ("json", _JSON_ANY_WHITESPACE):
            xgr.Grammar.from_json_schema(spec, any_whitespace=kind == _JSON_ANY_WHITESPACE)
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

    def __init__(self, compiled: "xgr.CompiledGrammar") -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if len(token_ids) == 1:  # every step's case, without a generator
            return self.matcher.accept_token(token_ids[0])
        return all(self.matcher.accept_token(t) for t in token_ids)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: npt.NDArray[np.int32], row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarCache:
    """Compilations by key, least recently used first, bounded by bytes (a 20,000-entry enum
    compiles to ~50 MB). A finished one weighs its compiled grammar (xgrammar's
    `memory_size_bytes`) plus its key's text; one still compiling weighs nothing yet and is
    never evicted (requests wait on it). When one finishes, the oldest finished ones go until
    the total is within `limit_bytes`, the new one too if it alone exceeds it: evicting only
    drops the cache's reference, the requests using a grammar keep theirs.

    Used from one thread (the scheduler's), so it needs no lock: a compilation that finished
    on the grammar thread is weighed at the next call."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[GrammarKey, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._pending: dict[GrammarKey, Future[xgr.CompiledGrammar]] = {}  # not weighed yet
        self._sizes: dict[GrammarKey, int] = {}  # the weighed (finished) entries' weights
        self._size_bytes = 0

    def __len__(self) -> int:
        self._weigh_finished()
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        """The finished entries' total weight (always within `limit_bytes`)."""
        self._weigh_finished()
        return self._size_bytes

    def get(self, key: GrammarKey) -> "Future[xgr.CompiledGrammar] | None":
        self._weigh_finished()
        compiled = self._entries.get(key)
        if compiled is not None:
            self._entries.move_to_end(key)
        return compiled

    def put(self, key: GrammarKey, compiled: "Future[xgr.CompiledGrammar]") -> None:
        assert key not in self._entries
        self._entries[key] = self._pending[key] = compiled
        self._weigh_finished()

    def discard(self, key: GrammarKey) -> None:
        """Forget a compilation that was cancelled before it started."""
        del self._entries[key], self._pending[key]

    def pending(self) -> "list[Future[xgr.CompiledGrammar]]":
        self._weigh_finished()
        return list(self._pending.values())

    def _weigh_finished(self) -> None:
        finished = [key for key, compiled in self._pending.items() if compiled.done()]
        if not finished:
            return
        for key in finished:
            compiled = self._pending.pop(key)
            failed = compiled.cancelled() or compiled.exception() is not None
            size = sys.getsizeof(key[1]) + (0 if failed else compiled.result().memory_size_bytes)
            self._sizes[key] = size
            self._size_bytes += size
        weighed = (key for key in list(self._entries) if key in self._sizes)  # oldest first
        while self._size_bytes > self.limit_bytes:
            key = next(weighed)
            del self._entries[key]
            self._size_bytes -= self._sizes.pop(key)


class StructuredOutputManager:
    def __init__(
        self, tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int],
        cache_limit_bytes: int,
    ) -> None:
        """`tokenizer`: gives the model's tokenizer, called at the first compilation (an
        engine that serves no grammar loads none). `cache_limit_bytes`: the compiled grammars
        kept for reuse, in bytes (0: none)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        # One thread: compilations queue behind each other, never behind the step loop.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="v1-grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        self.cache = GrammarCache(cache_limit_bytes)
        # Per compilation not finished, the ids of the requests waiting for it.
        self._waiting: dict[GrammarKey, tuple[Future[xgr.CompiledGrammar], set[str]]] = {}

    def _compile(self, key: GrammarKey) -> "xgr.CompiledGrammar":
        if self._compiler is None:  # built on first use, off the step loop: ~0.1 s, and
            import xgrammar as xgr  # the tokenizer's load where none was loaded (~0.3 s)

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        kind, spec = key
        if kind in ("json", _JSON_ANY_WHITESPACE):
            return self._compiler.compile_json_schema(
                spec, any_whitespace=kind == _JSON_ANY_WHITESPACE
            )
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
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self.executor.submit(self._compile, key)
            self.cache.put(key, compiled)
        self._waiting = {k: w for k, w in self._waiting.items() if not w[0].done()}
        if not compiled.done():
            self._waiting.setdefault(key, (compiled, set()))[1].add(request.request_id)
        future: Future[StructuredOutputGrammar] = Future()

        def make_matcher(done: "Future[xgr.CompiledGrammar]") -> None:
            if done.cancelled():  # `grammar_abort`: nobody waits for it
                future.cancel()
                return
            exc = done.exception()
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(XgrammarGrammar(done.result()))

        compiled.add_done_callback(make_matcher)
        request.grammar_future = future

    def grammar_abort(self, request: Request) -> None:
        """`request` left (aborted: its client disconnected) while its grammar compiled: a
        compilation no other request waits for is taken off the queue, so that requests
        gone do not hold up the live ones' grammars. One already running goes on (xgrammar's
        compile is one native call, which cannot be interrupted) and is cached as usual."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        key = grammar_key(params)
        compiled, waiting = self._waiting.get(key, (None, set()))
        waiting.discard(request.request_id)
        if compiled is None or waiting:
            return
        del self._waiting[key]
        if compiled.cancel():
            self.cache.discard(key)

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
        pending = self.cache.pending()
        if pending:
            wait(pending, timeout, FIRST_COMPLETED)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
