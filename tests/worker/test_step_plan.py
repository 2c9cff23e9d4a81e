"""The step plan (v1.models.step_plan): the path it names for a step is the path the step
took, checked against the C entry points each path calls, on the default GGUF model; and the
runner reads the settings once, when it is built."""

import logging

import numpy as np
import pytest
import torch

from tests.worker.test_fused_decode import TABLES, gguf_model, prefilled  # noqa: F401
from tests.worker.test_model import Chunk, new_kv_caches, step_inputs
from tests.worker.test_model_runner import PROMPT, make_runner, prefill
from v1.kernels import attention as kernels_attention
from v1.kernels import block_matmul as kernels_block_matmul
from v1.kernels import fused_step as kernels_fused_step
from v1.kernels.library import library
from v1.lora.layers import LinearWithLoRA, LoRABatch
from v1.models.layers.quantized import DEFAULT_POLICY, MatmulPolicy
from v1.models.step_plan import PlanOptions, StepPath, StepPlanner, _rows_path
from v1.sampling_params import SamplingParams

pytestmark = pytest.mark.model


class Calls:
    """What the step called: fused C steps (their int8 flags), C attention kernel calls,
    C block matmuls (their int8 flags)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fused: list[bool] = []
        self.attention = 0
        self.matmul: list[bool] = []
        fused_call = kernels_fused_step.FusedDecoder.__call__
        attention_call = kernels_attention.PagedDecodeKernel.__call__
        linear = kernels_block_matmul.QuantKernels.linear

        def fused(this, *args, **kwargs):
            self.fused.append(bool(args[-1]))
            return fused_call(this, *args, **kwargs)

        def attention(this, *args, **kwargs):
            self.attention += 1
            return attention_call(this, *args, **kwargs)

        def matmul(this, w, x, bias, int8=False):
            self.matmul.append(bool(int8))
            return linear(this, w, x, bias, int8)

        monkeypatch.setattr(kernels_fused_step.FusedDecoder, "__call__", fused)
        monkeypatch.setattr(kernels_attention.PagedDecodeKernel, "__call__", attention)
        monkeypatch.setattr(kernels_block_matmul.QuantKernels, "linear", matmul)


def run(model, kv_caches, chunks, options: PlanOptions, is_prompt=None) -> StepPath:
    """Plans and runs one step as the runner does; the path its plan named."""
    input_ids, positions, metadata = step_inputs(chunks)
    planner = StepPlanner(model, torch.float32, torch.device("cpu"), options)
    with torch.inference_mode():
        step = planner.plan(metadata, kv_caches, is_prompt)
        model(input_ids, positions, kv_caches, metadata, step)
    return step.path


LAYERS = 30
DECODE = [Chunk([5], 20, TABLES[0])]


def test_a_batch1_decode_is_fused_kernel_int8(gguf_model, monkeypatch):  # noqa: F811
    kv_caches = prefilled(gguf_model, [list(range(100, 120))])
    calls = Calls(monkeypatch)
    assert run(gguf_model, kv_caches, DECODE, PlanOptions()) == StepPath(
        "fused", "kernel", "int8", "native")
    assert calls.fused == [True] and not calls.attention and not calls.matmul
    # V1_FUSED_DECODE=0: the same step per op, each layer's attention the C kernel's.
    assert run(gguf_model, kv_caches, DECODE, PlanOptions(fused_decode=False)) == StepPath(
        "per-op", "kernel", "int8", "native")
    assert calls.fused == [True] and calls.attention == LAYERS
    assert calls.matmul == [True] * 4 * LAYERS


def test_a_long_prompt_chunk_is_per_op_sdpa(gguf_model, monkeypatch):  # noqa: F811
    calls = Calls(monkeypatch)
    chunk = [Chunk(list(range(300)), 0, list(range(19)))]
    path = run(gguf_model, new_kv_caches(gguf_model, 40), chunk, PlanOptions(),
               np.ones(300, dtype=bool))
    assert path == StepPath("per-op", "sdpa", "int8", "native")
    assert not calls.fused and not calls.attention
    assert calls.matmul == [True] * 4 * LAYERS


def test_without_all_int8_a_decode_is_fp32_rows(gguf_model, monkeypatch):  # noqa: F811
    kv_caches = prefilled(gguf_model, [list(range(100, 120))])
    calls = Calls(monkeypatch)
    by_kind = MatmulPolicy(all_int8=False)
    generated = np.zeros(1, dtype=bool)
    assert run(gguf_model, kv_caches, DECODE, PlanOptions(matmul=by_kind), generated) == (
        StepPath("fused", "kernel", "fp32", "native"))
    assert calls.fused == [False]
    assert run(gguf_model, kv_caches, DECODE, PlanOptions(False, by_kind), generated) == (
        StepPath("per-op", "kernel", "fp32", "native"))
    assert calls.matmul == [False] * 4 * LAYERS
    # A prompt token beside a generated one: the rows split, int8 and fp32, per op.
    chunk = [Chunk([6, 7], 20, TABLES[0])]
    calls.matmul.clear()
    assert run(gguf_model, kv_caches, chunk, PlanOptions(matmul=by_kind),
               np.array([True, False])) == StepPath("per-op", "kernel", "int8+fp32", "native")
    assert calls.fused == [False] and calls.matmul == [True, False] * 4 * LAYERS


def test_without_kernels_sdpa_and_torch(gguf_model, monkeypatch):  # noqa: F811
    kv_caches = prefilled(gguf_model, [list(range(100, 120))])
    calls = Calls(monkeypatch)
    path = run(gguf_model, kv_caches, DECODE, PlanOptions(cpu_kernels="0"))
    assert path.decoder == "per-op" and path.attention == "sdpa" and path.matmul == "torch"
    assert path.ops in ("torch", "torch-serial")
    assert not calls.fused and not calls.attention and not calls.matmul


def test_the_runner_reads_the_settings_once_and_logs_each_step(default_model, monkeypatch,
                                                               caplog):
    monkeypatch.setenv("V1_FUSED_DECODE", "0")
    monkeypatch.setenv("V1_QUANT_ALL_INT8", "0")
    runner = make_runner(default_model)
    monkeypatch.setenv("V1_FUSED_DECODE", "1")  # after the build: not read again
    # (cpu_kernels "": V1_CPU_KERNELS unset, read with the rest.)
    assert runner.planner.options == PlanOptions(False, MatmulPolicy(all_int8=False), "")
    assert make_runner(default_model).planner.options == PlanOptions(True, MatmulPolicy(
        all_int8=False), "")
    monkeypatch.delenv("V1_QUANT_ALL_INT8")
    assert make_runner(default_model).planner.options == PlanOptions(True, DEFAULT_POLICY, "")
    with caplog.at_level(logging.DEBUG, logger="v1"):
        prefill(runner, "a", SamplingParams(temperature=0.0), block_id=0)
    # fp32 weights (no GGUF blocks): no matmul path to choose.
    expected = str(StepPath("per-op", "kernel", "none", "native"))
    assert [r.getMessage() for r in caplog.records if "step of" in r.getMessage()] == [
        f"step of {len(PROMPT)} tokens: {expected}"]


def test_the_runner_takes_the_kernel_library_once(default_model, monkeypatch):
    monkeypatch.setenv("V1_CPU_KERNELS", "0")
    runner = make_runner(default_model)
    monkeypatch.delenv("V1_CPU_KERNELS")  # after the build: not looked up again
    assert runner.planner.options.cpu_kernels == "0"
    assert runner.planner.lib is None and runner.planner.native_ops is None
    assert make_runner(default_model).planner.lib is not None


def test_a_planner_without_a_runner_takes_the_environments_library(
        gguf_model, monkeypatch):  # noqa: F811
    # The weights are laid out, and the fused layers bound, for the environment's library;
    # a planner made without options (a model called without a runner) plans its steps on
    # that one too, not on the best.
    monkeypatch.setenv("V1_CPU_KERNELS", "portable")
    assert gguf_model.default_planner().lib is library() is library("portable")
    monkeypatch.setenv("V1_CPU_KERNELS", "0")
    assert gguf_model.default_planner().lib is None


def test_the_runner_runs_the_head_in_the_step_only_where_every_row_samples(
    default_model_path, monkeypatch
):
    """A prompt chunk short enough for the fused step runs it without the LM head (only its
    last row is sampled; a middle chunk none); the decode step after it runs the head in the
    same call, and its token is the per-op step's."""
    from v1.attention.backends.torch_attn import TorchAttentionImpl
    from v1.core.sched.output import CachedRequestData, SchedulerOutput
    from v1.models.loader import load_model

    loaded = load_model(str(default_model_path), torch.float32, torch.device("cpu"),
                        TorchAttentionImpl, quantization="gguf")
    paths: list[str] = []
    plan = StepPlanner.plan

    def spy(self, *args, **kwargs):
        step = plan(self, *args, **kwargs)
        paths.append(step.path.decoder)
        return step

    monkeypatch.setattr(StepPlanner, "plan", spy)
    tokens = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("V1_FUSED_DECODE", fused)  # read when the runner is built
        runner = make_runner(loaded)
        first = prefill(runner, "a", SamplingParams(temperature=0.0), block_id=0)
        cached = CachedRequestData(["a"], [False], [None], [[]], [len(PROMPT)])
        second = runner.execute_model(SchedulerOutput([], cached, {"a": 1}, 1, set(), set()))
        tokens[fused] = first.sampled_token_ids + second.sampled_token_ids
    assert paths == ["fused", "fused+head", "per-op", "per-op"]
    assert tokens["1"] == tokens["0"]


def test_the_fused_decision_is_logged_with_its_reason(gguf_model, default_model,  # noqa: F811
                                                      caplog):
    attn = gguf_model.model.layers[3].self_attn
    base = attn.qkv_proj
    with caplog.at_level(logging.INFO, logger="v1"):
        gguf_model.replan()
        attn.qkv_proj = LinearWithLoRA(base, (576, 192, 192), LoRABatch(), 1, 8)
        try:
            gguf_model.replan()
        finally:
            attn.qkv_proj = base
            gguf_model.replan()
        default_model.model.replan()
    assert [r.getMessage() for r in caplog.records if "fused decode" in r.getMessage()] == [
        f"fused decode step: on ({LAYERS} layers, embedding, LM head)",
        "fused decode step: off (layer 3 (PreNormDecoderLayer): its projections are not GGUF "
        "blocks in plain Linears (float weights, LoRA))",
        f"fused decode step: on ({LAYERS} layers, embedding, LM head)",
        "fused decode step: off (layer 0 (PreNormDecoderLayer): its projections are not GGUF "
        "blocks in plain Linears (float weights, LoRA))",
    ]


def test_prompt_logprobs_take_the_runners_head_rows(default_model, monkeypatch):
    """The LM head's rows follow the runner's settings for prompt logprobs as for sampling."""
    runner = make_runner(default_model)
    seen = []
    compute_logits = runner.model.compute_logits

    def spy(hidden, rows=None):
        seen.append(rows)
        return compute_logits(hidden, rows)

    monkeypatch.setattr(runner.model, "compute_logits", spy)
    out = prefill(runner, "a", SamplingParams(temperature=0.0, prompt_logprobs=1), block_id=0)
    assert out.prompt_logprobs_dict["a"]
    assert len(seen) == 2 and all(rows is runner.planner.head_rows for rows in seen)


def test_the_step_path_names_the_kinds_on_different_paths():
    """With the calibration per kind, a prompt chunk's kinds can take different paths: the
    step's path says which took which (one path: just its name)."""
    policy = MatmulPolicy(prompt_dense_min_rows=(("q6_kx8", 4),))
    prompt = np.ones(8, dtype=bool)
    kinds = ["q4_kx8", "q6_kx8"]
    assert _rows_path(policy.rows(prompt, None), 8, kinds) == "q4_kx8: int8, q6_kx8: dense"
    assert _rows_path(policy.rows(prompt, None), 8, ["q6_kx8"]) == "dense"
    mixed = prompt.copy()
    mixed[0] = False  # a generated token's row beside: split out for the dense kind only
    assert _rows_path(policy.rows(mixed, None), 8, kinds) == "q4_kx8: int8, q6_kx8: dense+int8"
    assert _rows_path(policy.rows(prompt[:3], None), 3, kinds) == "int8"  # below its count
