"""Grammar libraries for structured output, side by side on the default model's tokenizer:
tokenizer setup, compiling a JSON schema, and filling the next-token bitmask (per token, over
a valid JSON text, accepting each token after its mask). The engine fills one mask per step
for every structured request, so the mask figure is the one that matters most; v1 uses
xgrammar (v1/engine/structured_output.py). llguidance is measured when it is installed
(`pip install llguidance`; not a dependency of v1).

    .venv/bin/python bench/bench_grammar.py
"""

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from common import environment, print_table
from transformers import AutoTokenizer

from v1.models.model_files import resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age"],
}
TEXT = '{"name": "Bob", "age": 42, "tags": ["a", "b"]}'


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def measure_xgrammar(tokenizer: Any, vocab_size: int, token_ids: list[int]) -> list[float]:
    import xgrammar as xgr

    info, setup_s = timed(
        lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def walk() -> None:
        for token in token_ids:
            matcher.fill_next_token_bitmask(bitmask, 0)
            assert matcher.accept_token(token)

    _, mask_s = timed(walk)
    return [setup_s, compile_s, mask_s / len(token_ids)]


def measure_llguidance(tokenizer: Any, vocab_size: int, token_ids: list[int]) -> list[float]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    lltok, setup_s = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size))

    def compile_schema() -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
        return llguidance.LLMatcher(lltok, grammar)

    matcher, compile_s = timed(compile_schema)
    bitmask = llguidance.numpy.allocate_token_bitmask(1, lltok.vocab_size)

    def walk() -> None:
        for token in token_ids:
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(token), matcher.get_error()

    _, mask_s = timed(walk)
    return [setup_s, compile_s, mask_s / len(token_ids)]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    path = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    vocab_size = len(tokenizer)
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    libraries = {"xgrammar": measure_xgrammar, "llguidance": measure_llguidance}
    result: dict[str, Any] = {"bench": "grammar", "vocab_size": vocab_size}
    rows = []
    for name, measure in libraries.items():
        try:
            setup_s, compile_s, mask_s = measure(tokenizer, vocab_size, token_ids)
        except ImportError:
            rows.append([name, "not installed", "", ""])
            continue
        result[name] = {"setup_ms": setup_s * 1e3, "compile_ms": compile_s * 1e3,
                        "mask_us_per_token": mask_s * 1e6}
        rows.append([name, f"{setup_s * 1e3:.0f}", f"{compile_s * 1e3:.1f}", f"{mask_s * 1e6:.0f}"])
    print_table(["library", "tokenizer setup ms", "compile ms", "mask us/token"], rows)
    print(json.dumps({**result, **environment()}))


if __name__ == "__main__":
    main()
