"""Structured output end to end with the real default model: every output obeys its spec."""

import dataclasses
import json
import re

import jsonschema
import pytest

from tests.entrypoints.conftest import SYSTEM
from tests.entrypoints.test_llm import check_idle, make_llm  # noqa: F401 (fixture)
from v1 import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a person as JSON.",
    "Here is a user record in JSON format:",
    "Output a JSON object for a customer.",
]
CHOICES = ["Paris", "London", "Rome", "Berlin"]
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def json_params(**kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 80)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA), **kwargs)


def assert_valid(outputs) -> None:
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            record = json.loads(completion.text)
            jsonschema.validate(record, SCHEMA)
            assert list(record) == list(SCHEMA["properties"])  # in the schema's order


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_num_batched_tokens": 4, "async_scheduling": True},  # chunked prefill
        {"num_gpu_blocks": 6, "max_model_len": 96},  # preemption
    ],
    ids=["default", "chunked_async", "preemption"],
)
def test_json_schema_outputs_validate(make_llm, config):  # noqa: F811
    params = [json_params(), json_params(temperature=0.8, seed=3, n=2), json_params()]
    llm = make_llm(**config)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_valid(outputs)
    if "num_gpu_blocks" in config:
        assert llm.get_stats().num_preemptions > 0
    check_idle(llm)


def test_async_matches_sync(make_llm):  # noqa: F811
    params = [json_params(), json_params(temperature=0.8, seed=5)]
    sync = make_llm().generate(PROMPTS[:2], params, use_tqdm=False)
    llm = make_llm(async_scheduling=True)
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in sync]
    check_idle(llm)


def test_choice_regex_grammar_and_json_object(make_llm):  # noqa: F811
    def params(**spec) -> SamplingParams:
        return SamplingParams(
            temperature=0.7, seed=1, n=3, max_tokens=40,
            structured_outputs=StructuredOutputsParams(**spec),
        )

    llm = make_llm()
    choice, regex, grammar = llm.generate(
        ["The capital of Italy is", "Call us at", "Is the sky green? Answer:"],
        [params(choice=CHOICES), params(regex=PHONE),
         params(grammar='root ::= ("yes" | "no") "." [ a-z]*')],
        use_tqdm=False,
    )
    assert all(c.text in CHOICES for c in choice.outputs)
    assert all(re.fullmatch(PHONE, c.text) for c in regex.outputs)
    assert all(re.fullmatch(r"(yes|no)\.[ a-z]*", c.text) for c in grammar.outputs)
    obj = llm.generate(
        "Give me a JSON object:",
        SamplingParams(
            temperature=0.0, max_tokens=40,
            structured_outputs=StructuredOutputsParams(json_object=True),
        ),
        use_tqdm=False,
    )[0].outputs[0].text
    # Cut by max_tokens or not, it is the start of a JSON object.
    assert obj.startswith("{")
    check_idle(llm)


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"json": {"type": "nope"}}, "invalid structured_outputs json"),
        ({"regex": "(unclosed"}, "invalid structured_outputs regex"),
        ({"grammar": "root ::= undefined_rule"}, "invalid structured_outputs grammar"),
    ],
)
def test_bad_spec_raises_before_scheduling(make_llm, spec, match):  # noqa: F811
    llm = make_llm()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=match):
        llm.generate("Hi", params, use_tqdm=False)
    assert not llm.llm_engine.client.engine_core.scheduler.has_requests()


def test_plain_and_structured_requests_in_one_step(make_llm, monkeypatch):  # noqa: F811
    """Plain requests ahead of structured ones in the batch, one of them mid chunked prefill
    (in the batch, not sampling): each grammar's bitmask row must reach its own request's
    logits row. Every structured output obeys its spec; every plain one is its solo run's."""
    llm = make_llm(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    json_spec, phone = json_params(), SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=PHONE)
    )
    # Compiled (and cached) beforehand, so the structured requests run from the first step.
    llm.generate(["Hi", "Hi"], [dataclasses.replace(p, max_tokens=1) for p in (json_spec, phone)],
                 use_tqdm=False)
    plain = [
        ("The capital of France is", SamplingParams(temperature=0.0, max_tokens=16)),
        (f"{SYSTEM}Question: Where can I print?", SamplingParams(temperature=0.0, max_tokens=8)),
    ]
    runner = llm.llm_engine.client.engine_core.model_runner
    execute, steps = runner.execute_model, []

    def record(scheduler_output):
        out = execute(scheduler_output)
        samples = [r for r, s in zip(out.req_ids, out.sampled_token_ids) if s]
        waits = [i for i, s in enumerate(out.sampled_token_ids) if not s]
        structured = scheduler_output.structured_output_request_ids
        if structured:
            steps.append(([samples.index(r) for r in structured],
                          bool(waits) and waits[0] < out.req_ids.index(structured[0])))
        return out

    monkeypatch.setattr(runner, "execute_model", record)
    *ours, person, number = llm.generate(
        [p for p, _ in plain] + [PROMPTS[0], "Call us at"],
        [s for _, s in plain] + [json_spec, phone], use_tqdm=False,
    )
    # The case at stake happened: a prefilling request before the structured rows, which are
    # not the first rows that sample.
    assert any(prefilling and rows != list(range(len(rows))) for rows, prefilling in steps)
    assert_valid([person])
    assert re.fullmatch(PHONE, number.outputs[0].text)
    solo = make_llm()
    for out, (prompt, params) in zip(ours, plain, strict=True):
        (alone,) = solo.generate(prompt, params, use_tqdm=False)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    check_idle(llm)


def test_non_ascii_choices(make_llm):  # noqa: F811
    choices = ["😀", "🙂", "été"]
    params = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    (output,) = make_llm().generate("My favourite emoji is", params, use_tqdm=False)
    assert output.outputs[0].text in choices
    assert output.outputs[0].finish_reason == "stop"


def test_min_tokens_with_a_grammar_is_refused(make_llm):  # noqa: F811
    # The grammar may allow only EOS while min_tokens bans it: refused up front.
    params = SamplingParams(
        min_tokens=2, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    with pytest.raises(ValueError, match="min_tokens"):
        make_llm().generate("Hi", params, use_tqdm=False)


def test_disable_any_whitespace(make_llm):  # noqa: F811
    # A newline pushed by logit_bias: refused between a schema's tokens by default (compact
    # JSON), let through with vLLM's default, disable_any_whitespace=False.
    llm = make_llm()
    newline = llm.get_tokenizer().encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    texts = []
    for disable in (True, False):
        spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=disable)
        params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=spec,
                                logit_bias={newline[0]: 100.0})
        (out,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
        texts.append(out.outputs[0].text)
    assert "\n" not in texts[0] and "\n" in texts[1]
    with pytest.raises(ValueError, match="disable_any_whitespace must be a bool"):
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace="yes")


def test_exactly_one_spec():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


def test_engine_process(default_model_path):
    with LLM(num_gpu_blocks=64, max_model_len=512) as llm:
        assert_valid(llm.generate(PROMPTS, json_params(), use_tqdm=False))


def test_compiled_grammar_cached_by_key(make_llm, monkeypatch):  # noqa: F811
    from v1.engine.structured_output import StructuredOutputManager

    compiled: list[tuple[str, str]] = []
    compile_ = StructuredOutputManager._compile

    def counting(self, key):
        compiled.append(key)
        return compile_(self, key)

    monkeypatch.setattr(StructuredOutputManager, "_compile", counting)
    llm = make_llm()
    # Four requests (n=2), one schema, then the same schema again: one compilation.
    llm.generate(PROMPTS, [json_params(), json_params(temperature=0.8, seed=3, n=2),
                           json_params()], use_tqdm=False)
    llm.generate("Hi", json_params(max_tokens=5), use_tqdm=False)
    assert len(compiled) == 1
    # Properties in another order are another grammar: the output follows their order.
    reordered = {**SCHEMA, "properties": dict(reversed(SCHEMA["properties"].items()))}
    llm.generate("Hi", SamplingParams(
        max_tokens=5, structured_outputs=StructuredOutputsParams(json=reordered)
    ), use_tqdm=False)
    assert len(compiled) == 2
