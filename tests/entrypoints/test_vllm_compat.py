"""vLLM's usage patterns (its example scripts', written anew here), one test per pattern: the
argparse script, the `LLMEngine` loop, `AsyncLLM` streaming with each output kind, metrics
through `get_metrics()`, `del llm` + `cleanup_dist_env_and_memory()`, the options vLLM's
scripts pass, the prompt types, custom logits processors, and the `v1` console command."""

import asyncio
import dataclasses
import importlib
import importlib.metadata
import logging
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from v1.v1.sample.logits_processor import AdapterLogitsProcessor, BatchUpdate, LogitsProcessor
from v1.v1.sample.logits_processor.builtin import process_dict_updates

from tests.engine.mp_utils import SMALL_ENGINE, wait_until
from v1 import (
    EngineArgs,
    LLMEngine,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    TextPrompt,
    TokensPrompt,
)
from v1.config.ignored_options import IGNORED_OPTIONS
from v1.distributed import cleanup_dist_env_and_memory
from v1.engine.arg_utils import AsyncEngineArgs
from v1.engine.async_llm import AsyncLLM
from v1.entrypoints.llm import LLM
from v1.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from v1.metrics.reader import Counter, Gauge, Histogram, Vector, get_metrics_snapshot
from v1.platforms import current_platform
from v1.utils import random_uuid
from v1.utils.argparse_utils import FlexibleArgumentParser
from v1.utils.network_utils import get_open_port

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def reference(gguf_model) -> dict[str, tuple[list[int], str]]:
    """Each prompt's greedy tokens and text from an in-process LLM."""
    with LLM(loaded_model=gguf_model, **SMALL_ENGINE) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return {o.prompt: (o.outputs[0].token_ids, o.outputs[0].text) for o in outputs}


@pytest.mark.model
def test_argparse_script_then_del_and_cleanup(reference) -> None:
    """generate.py / chat.py: engine flags from EngineArgs.add_cli_args on vLLM's flexible
    parser, a sampling group of the script's own, `LLM(**vars(args))`; then prefix_caching.py's
    `del llm; cleanup_dist_env_and_memory()`, which ends the engine-core process."""
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    sampling = parser.add_argument_group("Sampling parameters")
    sampling.add_argument("--max-tokens", type=int)
    sampling.add_argument("--temperature", type=float)
    args = vars(parser.parse_args([
        "--max_model_len=1024", "--num-gpu-blocks", "256",
        "--enforce-eager", "--trust-remote-code", "--max-tokens", str(MAX_TOKENS),
        "--temperature", "0",
    ]))
    max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
    llm = LLM(**args)
    params = llm.get_default_sampling_params()
    params.max_tokens, params.temperature = max_tokens, temperature
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert {o.prompt: (o.outputs[0].token_ids, o.outputs[0].text) for o in outputs} == reference
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
    assert chat.outputs[0].token_ids

    proc = llm.llm_engine.client._res.proc
    assert proc.is_alive()
    del llm, outputs, chat
    cleanup_dist_env_and_memory()
    wait_until(lambda: not proc.is_alive())


@pytest.mark.model
@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_engine_loop_in_vllms_order(gguf_model, reference, kind) -> None:
    """llm_engine_example.py: EngineArgs.from_cli_args, LLMEngine.from_engine_args,
    add_request(request_id, prompt, params) and step() until nothing is unfinished; each
    output of the params' output_kind."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    engine_args = EngineArgs.from_cli_args(parser.parse_args(
        ["--max-model-len", "1024", "--num-gpu-blocks", "256"]
    ))
    engine = LLMEngine.from_engine_args(engine_args, loaded_model=gguf_model)
    try:
        params = dataclasses.replace(GREEDY, output_kind=kind)
        with pytest.raises(TypeError, match=r"\(request_id, prompt, params\)"):
            engine.add_request(PROMPTS[0], GREEDY)  # type: ignore[call-arg]
        pending = list(enumerate(PROMPTS))
        seen: dict[str, list[RequestOutput]] = {"0": [], "1": []}
        while pending or engine.has_unfinished_requests():  # one more request per step
            if pending:
                i, prompt = pending.pop(0)
                assert engine.add_request(str(i), prompt, params) == str(i)
            for out in engine.step():
                seen[out.request_id].append(out)
    finally:
        engine.shutdown()
    for request_id, outs in seen.items():
        assert_kind(outs, kind, reference[PROMPTS[int(request_id)]])


@pytest.mark.model
def test_engine_tokenizer_count_and_abort_request(gguf_model) -> None:
    """vLLM's LLMEngine.get_tokenizer(), get_num_unfinished_requests() (n > 1: each
    sequence) and abort_request(one id or several)."""
    engine = LLMEngine.from_engine_args(EngineArgs(**SMALL_ENGINE), loaded_model=gguf_model)
    try:
        tokenizer = engine.get_tokenizer()
        assert tokenizer is engine.tokenizer and tokenizer.encode(PROMPTS[0])
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50))
        engine.add_request("b", PROMPTS[1], SamplingParams(n=2, max_tokens=50))
        engine.add_request("c", PROMPTS[1], SamplingParams(max_tokens=50))
        assert engine.get_num_unfinished_requests() == 4
        engine.step()
        engine.abort_request("a")
        assert engine.get_num_unfinished_requests() == 3
        engine.abort_request(["b", "c"])
        assert engine.get_num_unfinished_requests() == 0
        assert not engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def assert_kind(
    outs: list[RequestOutput], kind: RequestOutputKind, expected: tuple[list[int], str]
) -> None:
    """vLLM's meaning of each kind, for a greedy request of MAX_TOKENS tokens whose whole
    output is `expected` (tokens, text)."""
    tokens, text = expected
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    ids = [o.outputs[0].token_ids for o in outs]
    texts = [o.outputs[0].text for o in outs]
    if kind is RequestOutputKind.FINAL_ONLY:  # one output, at the end
        assert ids == [tokens] and texts == [text]
    elif kind is RequestOutputKind.CUMULATIVE:  # everything so far, growing
        assert ids == [tokens[: i + 1] for i in range(MAX_TOKENS)] and texts[-1] == text
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    else:  # only what is new
        assert ids == [[t] for t in tokens] and "".join(texts) == text


@pytest.mark.model
def test_async_streaming_with_each_output_kind(default_model_path, reference) -> None:
    """async_llm_streaming.py: AsyncLLM.from_engine_args(AsyncEngineArgs(...)), generate()
    with SamplingParams(output_kind=...) for DELTA, CUMULATIVE and FINAL_ONLY at once."""
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(enforce_eager=True, **SMALL_ENGINE))

    async def stream(kind: RequestOutputKind, prompt: str) -> list[RequestOutput]:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, output_kind=kind)
        return [
            out async for out in engine.generate(
                prompt, params, request_id=kind.name, lora_request=None
            )
        ]

    async def aborted() -> list[RequestOutput]:
        """vLLM's abort takes several ids: the stream ends, unfinished."""
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        outs = []
        async for out in engine.generate(PROMPTS[1], params, "long"):
            outs.append(out)
            await engine.abort(["long"])
        return outs

    async def main() -> tuple[list[list[RequestOutput]], list[RequestOutput]]:
        streams = await asyncio.gather(*(stream(k, PROMPTS[0]) for k in RequestOutputKind))
        return streams, await aborted()

    try:
        results, (cut,) = asyncio.run(main())
        assert not cut.finished
        assert engine.get_tokenizer() is engine.tokenizer  # vLLM's, synchronous as now
        assert engine.get_tokenizer().decode(reference[PROMPTS[0]][0])
        assert engine.is_running and not engine.is_stopped
    finally:
        engine.shutdown()
    assert engine.is_stopped and not engine.is_running
    for kind, outs in zip(RequestOutputKind, results):
        assert_kind(outs, kind, reference[PROMPTS[0]])


@pytest.mark.model
def test_metrics_through_get_metrics(gguf_model) -> None:
    """metrics.py: LLM(disable_log_stats=False), generate, then get_metrics()'s Counter,
    Gauge and Histogram objects under vLLM's names; off by default, as in vLLM."""
    with LLM(loaded_model=gguf_model, **SMALL_ENGINE) as quiet:
        with pytest.raises(ValueError, match="disable_log_stats=False"):
            quiet.get_metrics()
    with LLM(loaded_model=gguf_model, disable_log_stats=False, **SMALL_ENGINE) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        metrics = llm.get_metrics()
    by_name = {(m.name, tuple(sorted(m.labels.items()))): m for m in metrics}

    def one(name: str, cls: type, **labels: str):
        (metric,) = [
            m for (n, ls), m in by_name.items() if n == name and set(labels.items()) <= set(ls)
        ]
        assert isinstance(metric, cls)
        return metric

    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert one("vllm:generation_tokens", Counter).value == generated
    assert one("vllm:prompt_tokens", Counter).value == sum(
        len(o.prompt_token_ids) for o in outputs
    )
    assert one("vllm:request_success", Counter, finished_reason="length").value == len(PROMPTS)
    assert one("vllm:num_requests_running", Gauge).value == 0
    e2e = one("vllm:e2e_request_latency_seconds", Histogram)
    assert e2e.count == len(PROMPTS) and e2e.buckets["+Inf"] == len(PROMPTS) and e2e.sum > 0
    assert one("vllm:time_to_first_token_seconds", Histogram).count == len(PROMPTS)
    # Per finished request, its prompt and output lengths, in vLLM's 1-2-5 buckets.
    prompt_lens = one("vllm:request_prompt_tokens", Histogram)
    assert prompt_lens.sum == sum(len(o.prompt_token_ids) for o in outputs)
    assert list(prompt_lens.buckets)[:4] == ["1.0", "2.0", "5.0", "10.0"]
    assert list(prompt_lens.buckets)[-2:] == ["1000.0", "+Inf"]  # up to max_model_len
    generation_lens = one("vllm:request_generation_tokens", Histogram)
    assert generation_lens.sum == generated and generation_lens.count == len(PROMPTS)
    assert generation_lens.buckets["5.0"] == 0 and generation_lens.buckets["10.0"] == 2


def test_reader_makes_position_counters_a_vector() -> None:
    registry = CollectorRegistry()

    class Positions:
        def collect(self):
            family = CounterMetricFamily("vllm:per_pos", "", labels=["model_name", "position"])
            for pos, count in [(1, 3), (0, 5)]:
                family.add_metric(["m", str(pos)], count)
            yield family

    registry.register(Positions())
    assert get_metrics_snapshot(registry) == [Vector("vllm:per_pos", {"model_name": "m"}, [5, 3])]


@pytest.mark.model
def test_vllms_options_are_accepted_or_refused(gguf_model, caplog) -> None:
    """The options vLLM's scripts pass (data_parallel.py's among them): those that mean
    nothing here run, one log line each; those we cannot honour are a ValueError."""
    options = {
        "enforce_eager": True, "trust_remote_code": True, "tensor_parallel_size": 1,
        "disable_log_stats": True, "swap_space": 8, "max_logprobs": 20,
        "compilation_config": {"level": 3}, "hf_token": "secret-token",
        "enable_expert_parallel": True, "tokenizer_mode": "auto",
        "distributed_executor_backend": "mp", "disable_custom_all_reduce": True,
        "max_seq_len_to_capture": 4096, "disable_log_requests": True, "task": "generate",
        "load_format": "safetensors", "logprobs_mode": "raw_logprobs",
    }
    with caplog.at_level(logging.INFO, logger="v1"):
        with LLM(loaded_model=gguf_model, **SMALL_ENGINE, **options) as llm:
            (out,) = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids
    ignored = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.message]
    changed = {"enforce_eager", "trust_remote_code", "swap_space", "compilation_config",
               "hf_token", "enable_expert_parallel", "distributed_executor_backend",
               "disable_custom_all_reduce", "max_seq_len_to_capture",
               "disable_log_requests", "task", "load_format"}  # others: defaults
    assert sorted(m.split()[0] for m in ignored) == sorted(changed)
    assert not any("secret-token" in r.getMessage() for r in caplog.records)
    for bad, match in [
        ({"tensor_parallel_size": 2}, r"tensor_parallel_size=2 .*data_parallel_size"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
        ({"tokenizer": "other/tokenizer"}, "tokenizer other than the model's"),
        ({"tokenizer_mode": "mistral"}, r"tokenizer_mode='mistral' .*accepted: 'auto'"),
        ({"task": "embed"}, r"task='embed' .*take runner='pooling'"),
        ({"runner": "draft"}, r"runner must be one of auto, generate, pooling"),
        ({"load_format": "dummy"}, r"load_format='dummy' is not supported"),
        ({"logprobs_mode": "processed_logits"}, r"logprobs_mode='processed_logits' is not"),
        ({"tokenizer_revision": "v2"}, "tokenizer revision other than the model's"),
        ({"skip_tokenizer_init": True}, "outputs always have their text"),
        ({"no_such_option": 1}, r"unknown engine options \['no_such_option'\]"),
        ({"hf_overrides": {"rms_norm_eps": 1e-3}}, "cannot change a model already loaded"),
        ({"logits_processors": ["no_colon"]}, "must be classes or 'module:Class' names"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(loaded_model=gguf_model, **bad)
    assert current_platform.device_type in ("cpu", "cuda")
    assert 0 < get_open_port() < 65536


def test_the_ignored_options_table_is_the_fields() -> None:
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    for name, option in IGNORED_OPTIONS.items():
        assert option.why in fields[name].metadata["help"]
        EngineArgs(**{name: fields[name].default})  # the default is accepted silently
    EngineArgs(revision="main", tokenizer_revision="main")  # the model's own: accepted


@pytest.mark.model
def test_prompt_types(gguf_model, reference) -> None:
    """vLLM's prompt types; `lora_request=None`, which scripts pass, is taken (anything but
    a LoRARequest is refused)."""
    with LLM(loaded_model=gguf_model, **SMALL_ENGINE) as llm:
        ids = llm.get_tokenizer().encode(PROMPTS[0])
        outputs = llm.generate(
            [TextPrompt(prompt=PROMPTS[0]), TokensPrompt(prompt_token_ids=ids)], GREEDY,
            use_tqdm=False, lora_request=None,
        )
        (chat,) = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False,
                           lora_request=[None])
        assert chat.outputs[0].token_ids
        for call, prompt in (
            (llm.generate, PROMPTS[0]), (llm.chat, [{"role": "user", "content": "Hi"}]),
        ):
            with pytest.raises(ValueError, match="lora_request must be"):
                call(prompt, GREEDY, lora_request=object())  # type: ignore[operator]
        with pytest.raises(ValueError, match="lora_request must be"):
            llm.llm_engine.add_request("x", PROMPTS[0], GREEDY, lora_request=object())
    assert [o.outputs[0].token_ids for o in outputs] == [reference[PROMPTS[0]][0]] * 2


def console_main():
    """The `v1` console script's function, as pyproject.toml declares it (and, when this
    checkout is the one installed, as the installed metadata does)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entry = importlib.metadata.EntryPoint("v1", scripts["v1"], "console_scripts")
    installed = importlib.metadata.entry_points(group="console_scripts", name="v1")
    dist = importlib.metadata.distribution("v1")
    if installed and Path(str(dist.locate_file(""))).resolve() == ROOT:
        assert [e.value for e in installed] == [entry.value]
    return entry.load()


def run_console(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        console_main()(argv)
    out = capsys.readouterr()
    return exit_info.value.code, out.out + out.err


def test_console_command_help_lists_each_option_once(capsys) -> None:
    code, text = run_console(capsys, ["--help"])
    assert code == 0 and "serve" in text and "demo" in text
    code, text = run_console(capsys, ["serve", "--help"])
    assert code == 0 and text.startswith("usage: v1 serve")
    options = re.findall(r"^\s{2}(--[a-z0-9-]+)", text, re.MULTILINE)
    assert len(options) == len(set(options))
    for field in dataclasses.fields(EngineArgs):
        flag = "--" + field.name.replace("_", "-")
        assert options.count(flag) == 1, flag
    for flag in ("--host", "--port", "--served-model-name", "--enforce-eager",
                 "--trust-remote-code", "--disable-log-stats", "--disable-log-requests"):
        assert flag in options
    code, text = run_console(capsys, ["nonsense"])
    assert code == 2 and "usage: v1" in text
    code, text = run_console(capsys, ["--version"])
    assert code == 0 and text.strip() == importlib.metadata.version("v1")


def test_serve_takes_the_model_as_vllm_serve_does(default_model_path) -> None:
    from v1.entrypoints.openai.api_server import engine_args_from, make_parser

    parser = make_parser()
    args = parser.parse_args([str(default_model_path), "--enforce-eager", "--trust-remote-code",
                              "--tensor-parallel-size", "1"])
    engine_args = engine_args_from(parser, args)
    assert engine_args.model == str(default_model_path) and engine_args.enforce_eager
    with pytest.raises(SystemExit):
        engine_args_from(parser, parser.parse_args(["--tensor-parallel-size", "2"]))


@pytest.mark.model
def test_serve_with_disable_log_stats_gathers_no_latencies(default_model_path) -> None:
    """`serve --disable-log-stats`: /metrics shows the engine core's counters, and no
    request latencies (with stats on, test_prometheus_metrics.py counts them)."""
    from fastapi.testclient import TestClient

    from v1.entrypoints.openai.api_server import DEFAULT_SERVED_MODEL_NAME, build_app

    args = EngineArgs(disable_log_stats=True, **SMALL_ENGINE)
    with TestClient(build_app(args)) as http:
        body = {"model": DEFAULT_SERVED_MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
        text = http.get("/metrics").text

    def value(name: str) -> float:
        (line,) = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
        return float(line.rsplit(" ", 1)[1])

    assert value("vllm:generation_tokens_total") == 2
    assert value("vllm:time_to_first_token_seconds_count") == 0


def test_engine_options_fail_before_the_model_loads() -> None:
    """vLLM's dtype spellings ("half", "float", a torch.dtype) are taken; a bad scheduler,
    cache, device or dtype option is a ValueError naming it, when EngineArgs is made (so
    `v1 serve` reports it as a usage error, not a traceback from the engine's start-up)."""
    assert EngineArgs(dtype="half").dtype == "float16"
    assert EngineArgs(dtype="float").dtype == "float32"
    assert EngineArgs(dtype=torch.bfloat16).dtype == "bfloat16"
    for bad, match in [
        ({"dtype": "float64"}, "dtype must be one of .*got 'float64'"),
        ({"device": "tpu"}, "device must be one of .*got 'tpu'"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of fcfs, priority"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
        ({"block_size": -1}, "block_size must be an integer >= 1, got -1"),
        ({"max_model_len": 0}, "max_model_len must be an integer >= 1, got 0"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override must be"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be"),
        ({"preload_max_fraction": 2.0}, r"preload_max_fraction must be in \(0, 1\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineArgs(**bad)


def test_serve_command_line_errors_and_underscores(capsys, monkeypatch) -> None:
    """`v1 serve`: vLLM's flexible spelling (`--max_model_len`); a bad engine option or port
    is a usage error (exit 2) naming it, before anything starts."""
    from v1.entrypoints.openai.api_server import engine_args_from, make_parser

    parser = make_parser()
    args = parser.parse_args(["--max_model_len", "64", "--port", "8001"])
    assert engine_args_from(parser, args).max_model_len == 64 and args.port == 8001
    for argv, message in [
        (["--dtype", "float64"], "dtype must be one of"),
        (["--scheduling-policy", "lifo"], "scheduling_policy must be one of"),
        (["--port", "99999"], r"argument --port: must be a TCP port \(1-65535\), got '99999'"),
        (["--port", "http"], "argument --port: must be a TCP port"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            engine_args_from(parser, parser.parse_args(argv))
        assert exit_info.value.code == 2
        assert re.search(message, capsys.readouterr().err), argv
    # A script's own parse_args() reads the command line, respelled as well.
    monkeypatch.setattr(sys, "argv", ["script.py", "--max_model_len=32", "--enforce_eager"])
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args()
    assert args.max_model_len == 32 and args.enforce_eager


def test_vllms_top_level_names_are_there() -> None:
    """`from vllm import ...` of vLLM's package names, with `vllm` replaced by `v1`."""
    import v1
    from v1 import outputs, pooling_params

    pooling = ["PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
               "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput",
               "ScoringOutput", "ScoringRequestOutput"]
    assert all(getattr(v1, name) is getattr(outputs, name) for name in pooling)
    assert v1.PoolingParams is pooling_params.PoolingParams
    assert set(pooling) | {"PoolingParams", "LLM", "SamplingParams"} <= set(v1.__all__)
    assert all(hasattr(v1, name) for name in v1.__all__)


def test_vllms_v1_module_paths_are_the_same_modules() -> None:
    """vLLM V1's scripts import from `vllm.v1.*` (`vllm.v1.engine.async_llm`,
    `vllm.v1.metrics.reader`) and older ones from `vllm.engine.async_llm_engine`: with
    `vllm` replaced by `v1`, the same modules and classes as v1's own."""
    from v1.v1.engine.async_llm import AsyncLLM as V1AsyncLLM
    from v1.v1.engine.core import EngineCore as V1EngineCore
    from v1.v1.engine.llm_engine import LLMEngine as V1LLMEngine
    from v1.v1.metrics.reader import Counter as V1Counter

    from v1.engine.async_llm_engine import AsyncLLMEngine
    from v1.engine.core import EngineCore

    assert V1AsyncLLM is AsyncLLM is AsyncLLMEngine
    assert V1EngineCore is EngineCore
    assert V1LLMEngine is LLMEngine and V1Counter is Counter
    assert sys.modules["v1.v1.engine.async_llm"] is sys.modules["v1.engine.async_llm"]
    # The real module keeps its own name and spec.
    assert sys.modules["v1.engine.async_llm"].__spec__.name == "v1.engine.async_llm"
    with pytest.raises(ModuleNotFoundError, match="v1.v1.no_such_module"):
        importlib.import_module("v1.v1.no_such_module")


class TargetTokenProcessor(LogitsProcessor):
    """logits_processor/custom.py's processor, written anew: a request whose `extra_args`
    name a `target_token` may sample only that token. Logs, per target, the length of the
    request's output list at each step (the list is the request's own, growing)."""

    seen: dict[int, list[int]] = {}

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        assert vllm_config.scheduler_config.max_num_seqs >= 1
        self.targets: dict[int, tuple[int, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = (sampling_params.extra_args or {}).get("target_token", 0)
        if not isinstance(target, int):
            raise ValueError(f"target_token must be a token id, got {target!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.targets, batch_update,
            lambda params, _, outputs: (
                (params.extra_args["target_token"], outputs)
                if params.extra_args and "target_token" in params.extra_args else None
            ),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (target, outputs) in self.targets.items():
            self.seen.setdefault(target, []).append(len(outputs))
            kept = logits[row, target].item()
            logits[row] = float("-inf")
            logits[row, target] = kept
        return logits


class FirstPromptTokenProcessor(AdapterLogitsProcessor):
    """logits_processor/custom_req.py's pattern, written anew: a per-request processor (here
    of the prompt, the output so far and the row) for requests whose `extra_args` ask: only
    the prompt's first token may be sampled."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("echo_first"):
            return None

        def keep_first(prompt_ids: list[int], output_ids: list[int], row: torch.Tensor):
            kept = torch.full_like(row, float("-inf"))
            kept[prompt_ids[0]] = row[prompt_ids[0]]
            return kept

        return keep_first


@pytest.mark.model
def test_custom_logits_processor_with_extra_args(gguf_model, reference) -> None:
    """logits_processor/custom.py, logits_processor_fqn.py and custom_req.py: `LLM(
    logits_processors=["module:Class", AdapterSubclass])`, some requests asking for a target
    token in `extra_args`, one for the adapter's per-request processor. Those
    sample only it; the others are the plain greedy outputs. Requests of different lengths
    finish at different steps, so a targeted request changes rows on the way. Parameters the
    processor's `validate_params` refuses are a ValueError."""
    TargetTokenProcessor.seen.clear()
    name = f"{__name__}:TargetTokenProcessor"
    processors = [name, FirstPromptTokenProcessor]
    with LLM(loaded_model=gguf_model, logits_processors=processors, **SMALL_ENGINE) as llm:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, extra_args=extra)
            for n, extra in [(MAX_TOKENS, {"target_token": 128}), (2, None), (MAX_TOKENS, None),
                             (MAX_TOKENS, {"target_token": 67}), (MAX_TOKENS, {"echo_first": 1})]
        ]
        outputs = llm.generate(PROMPTS * 2 + PROMPTS[:1], params, use_tqdm=False)
        bad = SamplingParams(extra_args={"target_token": "x"})
        with pytest.raises(ValueError, match="target_token must be a token id"):
            llm.generate(PROMPTS[0], bad, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == [128] * MAX_TOKENS
    assert outputs[3].outputs[0].token_ids == [67] * MAX_TOKENS
    assert outputs[1].outputs[0].token_ids == reference[PROMPTS[1]][0][:2]
    assert outputs[2].outputs[0].token_ids == reference[PROMPTS[0]][0]
    assert outputs[4].outputs[0].token_ids == [outputs[4].prompt_token_ids[0]] * MAX_TOKENS
    assert TargetTokenProcessor.seen == {t: list(range(MAX_TOKENS)) for t in (128, 67)}
    # The server's requests carry them as vLLM's `vllm_xargs` (the client's extra_body).
    for request in (ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                          vllm_xargs={"target_token": 128}),
                    CompletionRequest(prompt="hi", vllm_xargs={"target_token": 128})):
        assert request.to_sampling_params().extra_args == {"target_token": 128}
    with pytest.raises(ValueError, match="cannot be combined with speculative_config"):
        EngineArgs(logits_processors=[name],
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_sampling_params_clone_and_random_uuid() -> None:
    params = SamplingParams(stop=["a"], seed=3, output_kind=RequestOutputKind.DELTA)
    copy = params.clone()
    copy.stop.append("b")
    assert copy == SamplingParams(stop=["a", "b"], seed=3, output_kind=RequestOutputKind.DELTA)
    assert params.stop == ["a"]
    ids = {random_uuid() for _ in range(3)}
    assert len(ids) == 3 and all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)


def test_version_and_clear_errors_for_stop_lists() -> None:
    """`v1.__version__` (vLLM's `vllm.__version__`); a stop list of the wrong type is a
    ValueError naming it, not a TypeError from inside."""
    import v1

    assert v1.__version__ == importlib.metadata.version("v1")
    with pytest.raises(ValueError, match="stop must be a non-empty string or a list"):
        SamplingParams(stop=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop_token_ids must be a list of token ids"):
        SamplingParams(stop_token_ids=7)  # type: ignore[arg-type]
    assert SamplingParams(stop=("a",), stop_token_ids=(2,)).stop == ["a"]
