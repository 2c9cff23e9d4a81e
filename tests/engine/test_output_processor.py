"""OutputProcessor with the default model's real tokenizer and hand-made core outputs."""

import random
from typing import Any

import pytest

from v1.engine.detokenizer import find_stop_string
from v1.engine.output_processor import (
    IterationStats,
    OutputProcessor,
    OutputProcessorOutput,
    ParentRequest,
)
from v1.outputs import CompletionOutput, EngineCoreOutput, Logprob, RequestOutput
from v1.request import EngineCoreRequest
from v1.sampling_params import RequestOutputKind, SamplingParams

EOS = 2  # <|im_end|>
# The tests' short names of the output kinds.
KINDS = {
    "final": RequestOutputKind.FINAL_ONLY,
    "cumulative": RequestOutputKind.CUMULATIVE,
    "delta": RequestOutputKind.DELTA,
}
PROMPT = "Tell me something."


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def core_request(request_id: str, prompt_token_ids: list[int], **params: Any) -> EngineCoreRequest:
    """A request as the processor makes it, with the caller's id as its internal one too."""
    return EngineCoreRequest(
        request_id, prompt_token_ids, SamplingParams(**params), external_req_id=request_id
    )


def add(
    processor: OutputProcessor,
    tokenizer,
    request_id: str = "r",
    kind: str = "final",
    **params: Any,
) -> list[EngineCoreRequest]:
    return processor.add_request(
        core_request(
            request_id, encode(tokenizer, PROMPT), output_kind=KINDS.get(kind, kind), **params
        ),
        PROMPT,
    )


def feed(
    processor: OutputProcessor,
    request_id: str,
    token_ids: list[int],
    chunks: list[int] | None = None,
    finish_reason: str | None = "length",
    stop_reason: int | str | None = None,
) -> list[OutputProcessorOutput]:
    """Sends the tokens as a sequence of core outputs (one token per step unless `chunks`
    gives the step sizes); the last step carries the finish reason."""
    sizes = chunks or [1] * len(token_ids)
    assert sum(sizes) == len(token_ids)
    results, start = [], 0
    for i, size in enumerate(sizes):
        last = i == len(sizes) - 1
        output = EngineCoreOutput(
            request_id,
            token_ids[start : start + size],
            finish_reason=finish_reason if last else None,
            stop_reason=stop_reason if last else None,
        )
        results.append(processor.process_outputs([output]))
        start += size
    return results


def request_outputs(results: list[OutputProcessorOutput]) -> list[RequestOutput]:
    return [ro for result in results for ro in result.request_outputs]


def only_output(results: list[OutputProcessorOutput]) -> CompletionOutput:
    (ro,) = request_outputs(results)
    assert ro.finished
    (completion,) = ro.outputs
    return completion


def random_chunks(rng: random.Random, total: int) -> list[int]:
    sizes = []
    while total:
        sizes.append(min(total, rng.randint(1, 3)))
        total -= sizes[-1]
    return sizes


# ---- detokenization ---------------------------------------------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_tokens_decode_like_the_tokenizer(tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    partial = encode(tokenizer, "你")[0]  # the first bytes of a character only
    assert tokenizer.decode([partial]) == "\ufffd"
    for trial in range(4):
        ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
        ids[rng.randrange(300)] = EOS  # a special token inside the text
        if trial % 2:
            ids.append(partial)  # the output ends inside a character
        processor = OutputProcessor(tokenizer)
        add(processor, tokenizer, skip_special_tokens=skip_special_tokens)
        results = feed(processor, "r", ids, chunks=random_chunks(rng, len(ids)))
        completion = only_output(results)
        assert completion.token_ids == ids
        assert completion.text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_multibyte_text_streams_exactly(tokenizer) -> None:
    text = " Hello, world! 你好，世界。Emoji: 😀🎉👍 café naïve — 日本語のテキスト done."
    ids = encode(tokenizer, text)
    # The test is only worth something if characters really are split across tokens.
    assert sum("\ufffd" in tokenizer.decode([i]) for i in ids) >= 4
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, kind="delta")
    outputs = request_outputs(feed(processor, "r", ids))
    deltas = [ro.outputs[0].text for ro in outputs]
    assert len(outputs) == len(ids)  # one per step, even when its text is still held
    assert "" in deltas
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert [t for ro in outputs for t in ro.outputs[0].token_ids] == ids


def test_cumulative_outputs_carry_everything(tokenizer) -> None:
    ids = encode(tokenizer, " One, two, three. 四五六")
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, kind="cumulative")
    shown = ""
    for step, ro in enumerate(request_outputs(feed(processor, "r", ids)), start=1):
        assert ro.outputs[0].token_ids == ids[:step]
        expected = tokenizer.decode(ids[:step])
        if expected.endswith("\ufffd"):
            # A token ending inside a character waits whole (with its leading space).
            assert ro.outputs[0].text == shown
        else:
            assert ro.outputs[0].text == expected
        shown = ro.outputs[0].text
        assert ro.finished == (step == len(ids))
        assert ro.prompt == PROMPT and ro.request_id == "r"


def test_prompt_primes_the_stream_without_leaking(tokenizer) -> None:
    # A prompt that ends inside a character: DecodeStream would print the prompt's text if
    # it were primed with the whole prompt, so the detokenizer must pick a clean suffix.
    partial = encode(tokenizer, "你")[0]
    processor = OutputProcessor(tokenizer)
    prompt_ids = [*encode(tokenizer, "Say hello"), partial]
    processor.add_request(
        core_request("r", prompt_ids, output_kind=RequestOutputKind.FINAL_ONLY), None
    )
    ids = encode(tokenizer, " hello there")
    completion = only_output(feed(processor, "r", ids))
    assert completion.text == " hello there"


# ---- stop strings ---------------------------------------------------------------------------


def test_stop_string_cuts_text_and_aborts(tokenizer) -> None:
    ids = encode(tokenizer, " The answer is 42. Done here, more text.")
    for include, expected in ((False, " The answer is 42. "), (True, " The answer is 42. Done")):
        processor = OutputProcessor(tokenizer)
        add(processor, tokenizer, stop=["Done"], include_stop_str_in_output=include)
        results = feed(processor, "r", ids, finish_reason=None)
        completion = only_output(results)
        assert completion.text == expected
        assert (completion.finish_reason, completion.stop_reason) == ("stop", "Done")
        aborted = [r for result in results for r in result.reqs_to_abort]
        assert aborted == ["r"]
        # Tokens after the stop string (still in flight in the core) are ignored.
        assert completion.token_ids == ids[: len(completion.token_ids)]
        assert len(completion.token_ids) < len(ids)
        assert not processor.has_unfinished_requests()


def test_queue_time_of_a_request_a_stop_string_ends(tokenizer) -> None:
    """The core sends the queue time with the first tokens; a stop string then ends the
    request in the frontend, with no finishing output from the core: its stats keep it."""
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, stop=["Done"])
    first, *rest = encode(tokenizer, " Yes. Done here.")
    stats = IterationStats()
    processor.process_outputs([EngineCoreOutput("r", [first], queue_time=0.25)], stats)
    for token in rest:
        processor.process_outputs([EngineCoreOutput("r", [token])], stats)
    (finished,) = stats.finished_requests
    assert (finished.finish_reason, finished.queue_time) == ("stop", 0.25)


def test_stop_string_spanning_two_tokens(tokenizer) -> None:
    ids = encode(tokenizer, " hello world again")
    assert tokenizer.decode(ids[:2]) == " hello world"
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, kind="delta", stop=["lo wor"])
    results = feed(processor, "r", ids, finish_reason=None)
    outputs = request_outputs(results)
    assert len(outputs) == 2  # found when the second token arrived
    assert outputs[-1].finished and outputs[-1].outputs[0].stop_reason == "lo wor"
    assert "".join(ro.outputs[0].text for ro in outputs) == " hel"
    assert results[1].reqs_to_abort == ["r"]


def test_earliest_stop_string_wins(tokenizer) -> None:
    ids = encode(tokenizer, " alpha beta gamma delta")
    for chunks in (None, [len(ids)]):  # token by token, and all in one step
        processor = OutputProcessor(tokenizer)
        add(processor, tokenizer, stop=["delta", "gamma", "beta gam"])
        completion = only_output(feed(processor, "r", ids, chunks, finish_reason=None))
        assert (completion.text, completion.stop_reason) == (" alpha ", "beta gam")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_inside_a_multi_token_step(tokenizer, include: bool) -> None:
    """Steps of several tokens (verified drafts) end the output where steps of one token do:
    token ids, logprobs, cumulative logprob and text up to the token that completes the stop
    string, the tokens after it in the same step dropped; with min_tokens too."""
    ids = encode(tokenizer, " x y, beta gamma delta. beta gam more words here")
    logprobs = [([t, 7], [-0.1 * (i + 1), -0.5], 2) for i, t in enumerate(ids)]
    rng = random.Random(0)

    def run(chunks: list[int]) -> CompletionOutput:
        processor = OutputProcessor(tokenizer)
        add(processor, tokenizer, stop=["delta", "beta gam"], logprobs=1, min_tokens=5,
            include_stop_str_in_output=include)
        results, start = [], 0
        for size in chunks:
            step = slice(start, start + size)
            output = EngineCoreOutput("r", ids[step], logprobs[step])
            results.append(processor.process_outputs([output]))
            start += size
            if results[-1].reqs_to_abort:
                break
        return only_output(results)

    ref = run([1] * len(ids))
    # " beta gamma" completes "beta gam" at the 5th token, within min_tokens: " delta" ends it.
    assert ref.stop_reason == "delta" and len(ref.token_ids) == 6
    for chunks in ([len(ids)], [3, 9, len(ids) - 12], random_chunks(rng, len(ids))):
        got = run(chunks)
        assert (got.token_ids, got.text, got.stop_reason) == (
            ref.token_ids, ref.text, ref.stop_reason
        )
        assert got.logprobs == ref.logprobs
        assert got.cumulative_logprob == pytest.approx(ref.cumulative_logprob)


def test_find_stop_string() -> None:
    # The stop string that completes first wins, even if another one starts earlier.
    assert find_stop_string("xyz", 3, ["xyz", "y"]) == ("y", 1)
    assert find_stop_string("xyz", 3, ["yz", "xyz"]) == ("xyz", 0)
    # Only matches ending in the new characters count: older text was searched before.
    assert find_stop_string("stop and more", 4, ["stop"]) is None
    assert find_stop_string("abc sto", 1, ["stop"]) is None
    assert find_stop_string("abc stop", 1, ["stop"]) == ("stop", 4)


def test_stop_string_found_on_the_cores_last_step(tokenizer) -> None:
    ids = encode(tokenizer, " first. END")
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, stop=["END"])
    results = feed(processor, "r", ids, finish_reason="length")
    completion = only_output(results)
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (
        " first. ",
        "stop",
        "END",
    )
    assert not any(result.reqs_to_abort for result in results)  # the core is done already


def test_stop_strings_wait_for_min_tokens(tokenizer) -> None:
    # As vLLM: no stop string is looked for in the first min_tokens tokens' text (as no stop
    # token id can be sampled there).
    ids = encode(tokenizer, " x y x y x")
    for min_tokens, text in ((2, " x y x"), (3, " x y x y x")):
        processor = OutputProcessor(tokenizer)
        add(processor, tokenizer, stop=[" x"], min_tokens=min_tokens,
            include_stop_str_in_output=True)
        completion = only_output(feed(processor, "r", ids, finish_reason=None))
        assert completion.text == text


def test_delta_streaming_holds_back_possible_stop_strings(tokenizer) -> None:
    text = " Go ST go STO then STOP now"
    ids = encode(tokenizer, text)
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, kind="delta", stop=["STOP"])
    shown = ""
    for step in range(1, len(ids) + 1):
        (result,) = feed(processor, "r", ids[step - 1 : step], finish_reason=None)
        if not result.request_outputs:
            break
        (ro,) = result.request_outputs
        shown += ro.outputs[0].text
        so_far = tokenizer.decode(ids[:step])
        assert so_far.startswith(shown)
        if not ro.finished:
            # Up to len("STOP") - 1 characters are held back until they cannot start "STOP".
            assert len(shown) == max(len(so_far) - 3, 0)
    assert ro.finished and shown == " Go ST go STO then "


def test_delta_without_stop_strings_holds_nothing_back(tokenizer) -> None:
    ids = encode(tokenizer, " plain text here")
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, kind="delta")
    outputs = request_outputs(feed(processor, "r", ids, finish_reason=None))
    assert [ro.outputs[0].text for ro in outputs] == [tokenizer.decode([i]) for i in ids]


def test_delta_with_included_stop_string(tokenizer) -> None:
    ids = encode(tokenizer, " keep going until the end. After")
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, kind="delta", stop=["end."], include_stop_str_in_output=True)
    outputs = request_outputs(feed(processor, "r", ids, finish_reason=None))
    assert "".join(ro.outputs[0].text for ro in outputs) == " keep going until the end."


# ---- finish reasons -------------------------------------------------------------------------


def test_eos_and_stop_token_finish_reasons(tokenizer) -> None:
    hi = encode(tokenizer, " Hi")
    cases: list[tuple[dict[str, Any], tuple[str, int | None], str]] = [
        # (params, core's finish, expected text)
        ({"skip_special_tokens": False}, ("stop", EOS), " Hi"),  # EOS text is left out
        (
            {"skip_special_tokens": False, "include_stop_str_in_output": True},
            ("stop", EOS),
            " Hi<|im_end|>",
        ),
        ({}, ("length", None), " Hi"),
        ({}, ("abort", None), " Hi"),
    ]
    for params, (finish_reason, stop_reason), expected in cases:
        processor = OutputProcessor(tokenizer)
        add(processor, tokenizer, **params)
        results = feed(processor, "r", [*hi, EOS], None, finish_reason, stop_reason)
        completion = only_output(results)
        assert completion.text == expected
        assert completion.token_ids == [*hi, EOS]
        assert (completion.finish_reason, completion.stop_reason) == (finish_reason, stop_reason)
        assert not any(result.reqs_to_abort for result in results)

    # A stop token id that is an ordinary token: its text is not part of the output.
    ids = encode(tokenizer, " Hi.")
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, stop_token_ids=[ids[-1]])
    completion = only_output(feed(processor, "r", ids, None, "stop", ids[-1]))
    assert (completion.text, completion.stop_reason) == (" Hi", ids[-1])


# ---- n > 1 ------------------------------------------------------------------------------------


def test_parent_makes_child_requests(tokenizer) -> None:
    params = SamplingParams(n=3, seed=10, stop_token_ids=[7])
    params.all_stop_token_ids.add(EOS)
    request = EngineCoreRequest("p", [1, 2], params, arrival_time=5.0, external_req_id="p")
    parent = ParentRequest(request, None)
    children = parent.make_child_requests()
    assert [c.request_id for c in children] == ["0_p", "1_p", "2_p"]
    assert [c.sampling_params.seed for c in children] == [10, 11, 12]
    assert all(c.sampling_params.n == 1 for c in children)
    assert all(c.sampling_params.all_stop_token_ids == {7, EOS} for c in children)
    assert all(c.prompt_token_ids == [1, 2] and c.arrival_time == 5.0 for c in children)
    assert (params.n, params.seed) == (3, 10)  # the parent's params are left alone
    unseeded = ParentRequest(core_request("q", [1], n=2), None)
    assert [c.sampling_params.seed for c in unseeded.make_child_requests()] == [None, None]
    # The prompt is shared: only the first child computes its logprobs.
    with_prompt_logprobs = ParentRequest(core_request("s", [1], n=3, prompt_logprobs=2), None)
    assert [c.sampling_params.prompt_logprobs for c in with_prompt_logprobs.make_child_requests()
            ] == [2, None, None]


@pytest.mark.parametrize("kind", ["final", "cumulative", "delta"])
def test_n2_children_aggregate_into_one_output(tokenizer, kind: str) -> None:
    processor = OutputProcessor(tokenizer)
    children = add(processor, tokenizer, "p", kind, n=2)
    assert [c.request_id for c in children] == ["0_p", "1_p"]
    assert processor.get_num_unfinished_requests() == 2
    a, b = encode(tokenizer, " apples and pears"), encode(tokenizer, " no")
    texts: dict[int, str] = {0: "", 1: ""}
    finals = []
    for step in range(len(a)):
        outputs = [EngineCoreOutput("0_p", [a[step]])]
        if step < len(b):
            outputs.append(EngineCoreOutput("1_p", [b[step]], finish_reason="length"))
        if step == len(a) - 1:
            outputs[0].finish_reason = "length"
        result = processor.process_outputs(outputs)
        if kind == "final" and step < len(a) - 1:
            assert result.request_outputs == []
            continue
        (ro,) = result.request_outputs  # one output for the parent, never one per child
        assert ro.request_id == "p" and ro.prompt == PROMPT
        if kind == "delta":
            assert [c.index for c in ro.outputs] == ([0, 1] if step < len(b) else [0])
            for c in ro.outputs:
                texts[c.index] += c.text
        else:
            assert [c.index for c in ro.outputs] == [0, 1]
            texts = {c.index: c.text for c in ro.outputs}
        finals.append(ro.finished)
    assert texts == {0: " apples and pears", 1: " no"}
    assert finals[-1] and not any(finals[:-1])
    assert not processor.has_unfinished_requests() and not processor.parent_requests


def test_abort_parent_aborts_unfinished_children(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, "p", "delta", n=3)
    add(processor, tokenizer, "solo")
    processor.process_outputs([EngineCoreOutput("1_p", [17], finish_reason="length")])
    assert processor.get_num_unfinished_requests() == 3
    assert processor.abort_requests(["p", "unknown"]) == ["0_p", "2_p"]
    assert processor.process_outputs([EngineCoreOutput("0_p", [17])]).request_outputs == []
    assert processor.abort_requests(["solo", "solo"]) == ["solo"]
    assert not processor.has_unfinished_requests()


# ---- logprobs and metadata ------------------------------------------------------------------


def test_logprobs_conversion(tokenizer) -> None:
    hello, world, comma = encode(tokenizer, "Hello world,")
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, kind="delta", logprobs=2)
    steps = [
        # sampled first, then the top 2; "world" was sampled at rank 3
        EngineCoreOutput("r", [world], [([world, hello, comma], [-2.0, -0.5, -1.0], 3)]),
        # the sampled token is also the top one: one entry, ranked 1
        EngineCoreOutput("r", [comma], [([comma, comma, hello], [-0.1, -0.1, -3.0], 1)], "length"),
    ]
    first = processor.process_outputs(steps[:1]).request_outputs[0].outputs[0]
    assert first.logprobs == [
        {
            world: Logprob(-2.0, 3, " world"),
            hello: Logprob(-0.5, 1, "Hello"),
            comma: Logprob(-1.0, 2, ","),
        }
    ]
    assert first.cumulative_logprob == -2.0
    second = processor.process_outputs(steps[1:]).request_outputs[0].outputs[0]
    assert second.logprobs == [{comma: Logprob(-0.1, 1, ","), hello: Logprob(-3.0, 2, "Hello")}]
    assert second.cumulative_logprob == pytest.approx(-2.1)

    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer)  # no logprobs asked
    completion = only_output(feed(processor, "r", [world]))
    assert completion.logprobs is None and completion.cumulative_logprob is None


def test_metrics_and_cached_tokens(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, kind="cumulative")
    first = processor.process_outputs([EngineCoreOutput("r", [17], num_cached_tokens=16)])
    (ro,) = first.request_outputs
    assert ro.num_cached_tokens == 16 and ro.metrics is not None
    assert ro.metrics.first_token_time is not None and ro.metrics.finished_time is None
    assert ro.metrics.arrival_time <= ro.metrics.first_token_time
    (ro,) = processor.process_outputs([EngineCoreOutput("r", [18], finish_reason="length")])[0]
    assert ro.num_cached_tokens == 16 and ro.metrics is not None
    assert ro.metrics.finished_time is not None
    assert ro.metrics.finished_time >= ro.metrics.first_token_time  # type: ignore[operator]


def test_bad_requests_are_refused(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer)
    with pytest.raises(ValueError, match="already in use"):
        add(processor, tokenizer)
    with pytest.raises(ValueError):
        add(processor, tokenizer, "x", kind="sometimes")
    with pytest.raises(ValueError, match="tokenizer"):
        OutputProcessor(None).add_request(core_request("s", [1], stop=["x"]), None)
