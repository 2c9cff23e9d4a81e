"""The fused decode step (v1.models.fused_decode, csrc/fused_decode_step.c): the same bits as the
per-op path on the real default model (GGUF blocks), the same greedy tokens through LLM,
the per-op path wherever a step does not qualify, and ValueError for bad arguments."""

import ctypes

import numpy as np
import pytest
import torch

from tests.worker.test_model import Chunk, new_kv_caches, step_inputs
from v1 import LLM, SamplingParams
from v1.attention.backends.torch_attn import TorchAttentionImpl
from v1.attention.backends.torch_plan import AttentionPlan
from v1.kernels import fused_step as kernels_fused_step
from v1.kernels.attention import paged_decode_kernel
from v1.kernels.fused_step import (
    DecoderLayers,
    LayerWeights,
    ModelEnds,
    Projection,
    fused_decoder,
)
from v1.lora.layers import LinearWithLoRA, LoRABatch
from v1.models.layers.quantized import DEFAULT_POLICY, MatmulPolicy
from v1.models.loader import load_model
from v1.models.step_plan import PlanOptions, StepPlanner

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def gguf_model(default_model_path):
    """The default model with its GGUF blocks (the LLM default), this module's own: the
    tests swap and restore its modules."""
    return load_model(str(default_model_path), torch.float32, torch.device("cpu"),
                      TorchAttentionImpl, quantization="gguf").model


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """Counts the fused C calls (one element per call)."""
    calls: list[int] = []
    call = kernels_fused_step.FusedDecoder.__call__

    def spy(self, *args, **kwargs):
        calls.append(1)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(kernels_fused_step.FusedDecoder, "__call__", spy)
    return calls


def forward(model, kv_caches, chunks, fused: bool, matmul: MatmulPolicy = DEFAULT_POLICY,
            is_prompt: np.ndarray | None = None) -> torch.Tensor:
    """One step planned as the runner plans it, with V1_FUSED_DECODE=`fused` and the rows'
    policy `matmul`; `is_prompt`: which rows are prompt tokens'."""
    input_ids, positions, metadata = step_inputs(chunks)
    planner = StepPlanner(model, torch.float32, torch.device("cpu"),
                          PlanOptions(fused_decode=fused, matmul=matmul))
    with torch.inference_mode():
        step = planner.plan(metadata, kv_caches, is_prompt)
        assert step.path.decoder == ("fused" if step.fused is not None else "per-op")
        return model(input_ids, positions, kv_caches, metadata, step)


TABLES = ([3, 1, 6], [0, 4], [7, 2, 5])


def prefilled(
    model, prompts: list[list[int]], kv_dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    kv_caches = [c.to(kv_dtype) for c in new_kv_caches(model, 8)]
    chunks = [Chunk(p, 0, t) for p, t in zip(prompts, TABLES)]
    forward(model, kv_caches, chunks, False)
    return kv_caches


BATCH3 = [(1, 20), (1, 9), (1, 30)]


@pytest.mark.parametrize(
    "step, kv_dtype",
    [
        ([(1, 20)], torch.float32),  # batch 1
        (BATCH3, torch.float32),  # a few decodes
        ([(4, 20)], torch.float32),  # one request's token and 3 drafts (speculative decoding)
        ([(3, 20), (1, 9)], torch.float32),
        (BATCH3, torch.bfloat16),
        (BATCH3, torch.float16),
    ],
    ids=["batch1", "batch3", "drafts", "drafts-and-decode", "batch3-bf16", "batch3-fp16"],
)
def test_fused_step_is_the_per_op_step(gguf_model, fused_calls, step, kv_dtype):
    """Hidden states and the K/V written: the same bits either way, for each cache dtype."""
    prompts = [[(7 * i + 3 * r) % 5000 + 10 for i in range(n)] for r, (_, n) in enumerate(step)]
    kv_caches = prefilled(gguf_model, prompts, kv_dtype)
    if paged_decode_kernel(kv_caches[0], 9) is None:
        pytest.skip(f"this library has no {kv_dtype} decode kernel (portable: no fp16)")
    chunks = [Chunk([11 + r] * q, n, t) for r, ((q, n), t) in enumerate(zip(step, TABLES))]
    caches_a = [c.clone() for c in kv_caches]
    fused_calls.clear()
    fused = forward(gguf_model, caches_a, chunks, True)
    assert len(fused_calls) == 1
    per_op = forward(gguf_model, kv_caches, chunks, False)
    assert len(fused_calls) == 1
    assert torch.equal(fused, per_op)
    assert all(torch.equal(a, b) for a, b in zip(caches_a, kv_caches))


@pytest.mark.parametrize("matmul", [DEFAULT_POLICY, MatmulPolicy(all_int8=False)],
                         ids=["int8", "fp32"])
@pytest.mark.parametrize("step", [[(1, 20)], BATCH3], ids=["batch1", "batch3"])
def test_the_fused_head_is_compute_logits(gguf_model, fused_calls, step, matmul):
    """A step planned for every row's logits runs the embedding lookup, the final norm and
    the LM head in the fused call: the hidden states and logits of the per-op step and
    `compute_logits` on the head's own path, bit for bit; planned without, no logits."""
    prompts = [[(5 * i + 7 * r) % 4000 + 20 for i in range(n)] for r, (_, n) in enumerate(step)]
    kv_caches = prefilled(gguf_model, prompts)
    chunks = [Chunk([40 + r], n, t) for r, ((_, n), t) in enumerate(zip(step, TABLES))]
    input_ids, positions, metadata = step_inputs(chunks)
    planner = StepPlanner(gguf_model, torch.float32, torch.device("cpu"),
                          PlanOptions(matmul=matmul))
    with torch.inference_mode():
        plans = [planner.plan(metadata, kv_caches, None, logits) for logits in (True, False)]
        assert [p.path.decoder for p in plans] == ["fused+head", "fused"]
        hidden = [gguf_model(input_ids, positions, [c.clone() for c in kv_caches], metadata, p)
                  for p in plans]
        per_op = forward(gguf_model, kv_caches, chunks, False, matmul)
        expected = gguf_model.compute_logits(per_op, planner.head_rows)
    assert len(fused_calls) == 2
    assert torch.equal(hidden[0], per_op) and torch.equal(hidden[1], per_op)
    assert plans[1].logits is None
    assert plans[0].logits is not None and torch.equal(plans[0].logits, expected)


def test_steps_that_do_not_qualify_run_per_op(gguf_model, fused_calls):
    prompt = list(range(100, 120))
    kv_caches = prefilled(gguf_model, [prompt])
    decode = [Chunk([5], 20, TABLES[0])]
    # Prompt rows beside generated ones where they take different matmul paths
    # (V1_QUANT_ALL_INT8=0): per op, as without the mark it is fused.
    chunk = [Chunk([6, 7], 20, TABLES[0])]
    by_kind = MatmulPolicy(all_int8=False)
    forward(gguf_model, kv_caches, chunk, True, by_kind, np.array([True, False]))
    assert not fused_calls
    forward(gguf_model, kv_caches, chunk, True, by_kind)
    assert len(fused_calls) == 1
    # Under the default every row takes int8, prompt rows too: fused, the per-op bits.
    caches_a = [c.clone() for c in kv_caches]
    prompt = np.array([True, True])
    fused = forward(gguf_model, caches_a, chunk, True, is_prompt=prompt)
    assert len(fused_calls) == 2
    per_op = forward(gguf_model, kv_caches, chunk, False, is_prompt=prompt)
    assert torch.equal(fused, per_op)
    # A prefill that SDPA attends (no native plan), then the switch off.
    fused_calls.clear()
    forward(gguf_model, new_kv_caches(gguf_model, 40), [Chunk(list(range(300)), 0,
                                                               list(range(19)))],
            True)
    forward(gguf_model, kv_caches, decode, False)
    assert not fused_calls
    # LoRA's wrapper around a projection (and the re-plan its manager calls): per op until
    # it is taken off again (and the model re-planned).
    attn = gguf_model.model.layers[3].self_attn
    base = attn.qkv_proj
    attn.qkv_proj = LinearWithLoRA(base, (576, 192, 192), LoRABatch(), 1, 8)
    try:
        gguf_model.replan()
        forward(gguf_model, kv_caches, decode, True)
        assert not fused_calls
    finally:
        attn.qkv_proj = base
        gguf_model.replan()
    forward(gguf_model, kv_caches, decode, True)
    assert len(fused_calls) == 1


@pytest.mark.parametrize("rows", [1, 3])
def test_the_int8_rule_is_followed(gguf_model, fused_calls, rows):
    """Whichever path the rule gives decode rows (int8 by default, fp32 under
    V1_QUANT_ALL_INT8=0), the fused and per-op steps both take it: the same bits, and not
    the other path's."""
    kv_caches = prefilled(gguf_model, [list(range(300, 316))])
    chunks = [Chunk([8] * rows, 16, TABLES[0])]
    caches = [[c.clone() for c in kv_caches] for _ in range(2)]
    fp32 = forward(gguf_model, caches[0], chunks, True, MatmulPolicy(all_int8=False))
    fused = forward(gguf_model, caches[1], chunks, True)
    per_op = forward(gguf_model, kv_caches, chunks, False)
    assert len(fused_calls) == 2
    assert torch.equal(fused, per_op) and not torch.equal(fused, fp32)


def test_new_weights_are_read(gguf_model, fused_calls):
    """A norm's weight replaced, and the model re-planned: the descriptors are made again,
    the step still equal."""
    norm = gguf_model.model.layers[5].post_attention_layernorm
    old = norm.weight
    norm.weight = torch.nn.Parameter(old.detach() * 1.5, requires_grad=False)
    gguf_model.replan()
    try:
        kv_caches = prefilled(gguf_model, [list(range(200, 212))])
        chunks = [Chunk([9], 12, TABLES[0])]
        caches_a = [c.clone() for c in kv_caches]
        fused = forward(gguf_model, caches_a, chunks, True)
        per_op = forward(gguf_model, kv_caches, chunks, False)
        assert len(fused_calls) == 1
        assert torch.equal(fused, per_op)
    finally:
        norm.weight = old
        gguf_model.replan()


def test_a_weight_replaced_without_replan_is_not_seen_and_not_freed(gguf_model, fused_calls):
    """The descriptors hold what they were planned with: a norm's weight replaced in place of
    its old tensor (`.data =`, the old one dropped) is not read until the model is re-planned
    (no per-step check of the weights), and the old memory stays theirs meanwhile: the step
    is the same bits as before, whatever is allocated in between."""
    kv_caches = prefilled(gguf_model, [list(range(200, 212))])
    chunks = [Chunk([9], 12, TABLES[0])]
    before = forward(gguf_model, [c.clone() for c in kv_caches], chunks, True)
    weight = gguf_model.model.layers[5].post_attention_layernorm.weight
    old = weight.data
    saved = old.clone()
    weight.data = old * 1.5
    del old
    try:
        litter = [torch.full((576,), float("nan")) for _ in range(64)]  # reuse freed memory
        unseen = forward(gguf_model, [c.clone() for c in kv_caches], chunks, True)
        assert torch.equal(unseen, before)
        del litter
        gguf_model.replan()
        fused = forward(gguf_model, [c.clone() for c in kv_caches], chunks, True)
        per_op = forward(gguf_model, [c.clone() for c in kv_caches], chunks, False)
        assert len(fused_calls) == 3
        assert torch.equal(fused, per_op) and not torch.equal(fused, before)
    finally:
        weight.data = saved
        gguf_model.replan()


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 3, "prompt_lookup_min": 1}])
def test_greedy_tokens_equal_through_llm(default_model_path, fused_calls, monkeypatch, spec):
    """Tokens and their logprobs (the LM head's logits, in the fused call or not)."""
    prompts = ["The capital of France is", "1, 2, 3, 4, 5,", "Write a haiku about the sea:"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    outputs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("V1_FUSED_DECODE", flag)  # read when the engine is built
        with LLM(str(default_model_path), multiprocess=False, num_gpu_blocks=64,
                 max_model_len=256, speculative_config=spec) as llm:
            fused_calls.clear()
            outs = llm.generate(prompts, params, use_tqdm=False)
            outputs[flag] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
            assert bool(fused_calls) == (flag == "1")
    assert outputs["1"] == outputs["0"]


def test_shards_of_several_types_run_fused(tmp_path, monkeypatch, fused_calls):
    """Fused projections stored in several types (llama.cpp's K-quant mixes: here a Q8_0 k
    beside Q4_1 q and v, a Q8_0 gate beside a Q4_1 up) run in the fused step, each shard by
    its own type's kernel into its columns: the per-op path's bits."""
    import gguf

    from tests.worker.test_model_archs import build_hf_model, gguf_case_config, write_gguf
    from tests.worker.test_quantization import gguf_tensor_type

    monkeypatch.setenv("V1_CACHE_DIR", str(tmp_path / "cache"))
    config = gguf_case_config("llama")
    config.attention_bias = False
    q4_1 = gguf_tensor_type()

    def mixed(name: str):
        if name.endswith(("attn_k.weight", "ffn_gate.weight")):
            return gguf.GGMLQuantizationType.Q8_0
        return q4_1(name)

    write_gguf(build_hf_model(config), tmp_path / "mixed.gguf", "llama", tensor_type=mixed)
    model = load_model(str(tmp_path / "mixed.gguf"), torch.float32, torch.device("cpu"),
                       TorchAttentionImpl, quantization="gguf").model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight_form == "q4_1+q8_0+q4_1"
    assert layer.mlp.gate_up_proj.weight_form == "q8_0+q4_1"
    kv_caches = new_kv_caches(model, 8)
    forward(model, kv_caches, [Chunk([5, 9, 2, 7], 0, TABLES[0]), Chunk([3, 1], 0, TABLES[1])],
            False)
    chunks = [Chunk([11], 4, TABLES[0]), Chunk([12], 2, TABLES[1])]
    for matmul in (DEFAULT_POLICY, MatmulPolicy(all_int8=False)):
        caches = [c.clone() for c in kv_caches]
        fused_calls.clear()
        fused = forward(model, caches, chunks, True, matmul)
        assert len(fused_calls) == 1
        per_op = forward(model, [c.clone() for c in kv_caches], chunks, False, matmul)
        assert torch.equal(fused, per_op)


def test_an_untied_head_runs_fused(tmp_path, monkeypatch, fused_calls):
    """A model with its own LM head (not the embedding's) runs the fused step with that head
    too: the per-op step's hidden states and `compute_logits`' logits, bit for bit."""
    import gguf

    from tests.worker.test_model_archs import build_hf_model, gguf_case_config, write_gguf
    from tests.worker.test_quantization import gguf_tensor_type

    monkeypatch.setenv("V1_CACHE_DIR", str(tmp_path / "cache"))
    config = gguf_case_config("llama")
    config.attention_bias = False
    assert not config.tie_word_embeddings
    write_gguf(build_hf_model(config), tmp_path / "untied.gguf", "llama",
               tensor_type=gguf_tensor_type(gguf.GGMLQuantizationType.Q8_0))
    model = load_model(str(tmp_path / "untied.gguf"), torch.float32, torch.device("cpu"),
                       TorchAttentionImpl, quantization="gguf").model
    layers = model.model.fused_decode.layers
    assert layers is not None and layers.embeds and layers.vocab == config.vocab_size
    kv_caches = new_kv_caches(model, 8)
    forward(model, kv_caches, [Chunk([5, 9, 2, 7], 0, TABLES[0])], False)
    input_ids, positions, metadata = step_inputs([Chunk([11], 4, TABLES[0])])
    planner = StepPlanner(model, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        plan = planner.plan(metadata, kv_caches, None, logits=True)
        assert plan.path.decoder == "fused+head"
        hidden = model(input_ids, positions, [c.clone() for c in kv_caches], metadata, plan)
        per_op = forward(model, kv_caches, [Chunk([11], 4, TABLES[0])], False)
        expected = model.compute_logits(per_op, planner.head_rows)
    assert len(fused_calls) == 1
    assert torch.equal(hidden, per_op) and torch.equal(plan.logits, expected)


# ---- the binding's checks -------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_layer(gguf_model):
    layer = gguf_model.model.layers[0]
    return layer.fused_weights()


ROPE = (torch.zeros(10, 1, 64), torch.zeros(10, 1, 64))  # 10 positions


def _layers(weights: LayerWeights) -> DecoderLayers:
    return DecoderLayers([weights], 9, 3, 64, ROPE)


def test_bad_layers_raise(one_layer):
    bad_norm = LayerWeights(**{**_fields(one_layer), "input_norm": torch.ones(575)})
    with pytest.raises(ValueError, match=r"layers\[0\].input_norm"):
        _layers(bad_norm)
    qkv = Projection(one_layer.qkv.shards, torch.ones(960, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"layers\[0\].qkv.bias"):
        _layers(LayerWeights(**{**_fields(one_layer), "qkv": qkv}))
    for shards, match in [(one_layer.qkv.shards * 4, "4 shards, expected 1 to 3"),
                          (one_layer.qkv.shards * 2, "weight of 1920 rows, expected")]:
        qkv = Projection(shards, None)
        with pytest.raises(ValueError, match=r"layers\[0\].qkv: " + match):
            _layers(LayerWeights(**{**_fields(one_layer), "qkv": qkv}))
    swapped = LayerWeights(**{**_fields(one_layer), "o": one_layer.down})
    with pytest.raises(ValueError, match=r"layers\[0\].o"):
        _layers(swapped)
    with pytest.raises(ValueError, match="heads"):
        DecoderLayers([one_layer], 9, 2, 64, ROPE)
    for rope in [(ROPE[0], torch.zeros(9, 1, 64)), (torch.zeros(10, 1, 32),) * 2,
                 (ROPE[0].double(), ROPE[1]), (torch.zeros(10, 64), ROPE[1]),
                 (torch.zeros(0, 1, 64),) * 2]:
        with pytest.raises(ValueError, match="rope"):
            DecoderLayers([one_layer], 9, 3, 64, rope)


def _fields(w: LayerWeights) -> dict:
    return {name: getattr(w, name) for name in LayerWeights.__slots__}


def test_bad_step_arguments_raise(gguf_model, one_layer):
    fused = fused_decoder()
    assert fused is not None
    layers = _layers(one_layer)
    kv_caches = prefilled(gguf_model, [[1, 2, 3]])[:1]
    _, _, metadata = step_inputs([Chunk([4], 3, TABLES[0])])
    native = AttentionPlan.for_step(metadata, kv_caches[0], 9).native_only()
    step = native.bound(kv_caches[0])
    hidden = torch.zeros(1, 576)
    good = dict(layers=layers, hidden=hidden, positions=torch.tensor([9]), step=step,
                kernel=native.kernel, kv_caches=kv_caches, int8=False)
    fused(**good)  # these are fine
    before = kv_caches[0].clone()
    for name, value, match in [
        ("hidden", hidden.double(), "hidden"),
        ("hidden", torch.zeros(1, 577), "hidden"),
        ("hidden", torch.zeros(4, 576)[::2], "hidden"),
        ("positions", torch.tensor([10]), "positions: 10 is outside the RoPE tables' 10"),
        ("positions", torch.tensor([-1]), "positions: -1 is outside"),
        ("positions", torch.tensor([1, 2]), "positions must"),
        ("positions", torch.tensor([1], dtype=torch.int32), "positions must"),
        ("kv_caches", kv_caches * 2, "kv_caches"),
        ("kv_caches", [kv_caches[0].to(torch.bfloat16)], "kv_cache"),
        ("kv_caches", [kv_caches[0][:, :4].clone()], "kv_cache"),
        ("hidden", torch.zeros(0, 576), "hidden"),
    ]:
        with pytest.raises(ValueError, match=match):
            fused(**{**good, name: value})
    assert torch.equal(kv_caches[0], before)  # refused before anything ran
    # A step bound for another head layout, or reading rows the hidden states lack.
    _, _, wide = step_inputs([Chunk([4, 5, 6], 3, TABLES[0])])
    wide_step = AttentionPlan.for_step(wide, kv_caches[0], 9).native_only().bound(kv_caches[0])
    with pytest.raises(ValueError, match="step"):
        fused(**{**good, "step": wide_step})
    assert isinstance(layers.array, ctypes.Array)


def test_bad_ends_raise(gguf_model, one_layer):
    """The ends' checks, at build and per call; an id outside the vocabulary is refused
    before anything is computed (the caches as they were)."""
    fused = fused_decoder()
    assert fused is not None
    decoder = gguf_model.model
    blocks = decoder.embed_tokens.kernel.kernel_blocks()
    norm = decoder.norm
    ends = ModelEnds(norm.weight, norm.eps, blocks, blocks)
    layers = DecoderLayers([one_layer], 9, 3, 64, ROPE, ends=ends)
    assert layers.embeds and layers.vocab == 49152
    down = one_layer.down.shards[0]
    for bad, match in [(ModelEnds(torch.ones(575), 1e-5, blocks, blocks), "final_norm"),
                       (ModelEnds(norm.weight, 1e-5, down, blocks), "embedding"),
                       (ModelEnds(norm.weight, 1e-5, blocks, down), "head")]:
        with pytest.raises(ValueError, match=match):
            DecoderLayers([one_layer], 9, 3, 64, ROPE, ends=bad)
    kv_caches = prefilled(gguf_model, [[1, 2, 3]])[:1]
    _, _, metadata = step_inputs([Chunk([4], 3, TABLES[0])])
    native = AttentionPlan.for_step(metadata, kv_caches[0], 9).native_only()
    good = dict(layers=layers, hidden=None, positions=torch.tensor([3]),
                step=native.bound(kv_caches[0]), kernel=native.kernel, kv_caches=kv_caches,
                int8=True, ids=torch.tensor([4]), logits=torch.empty(1, 49152), head_int8=True)
    fused(**good)  # these are fine
    before = kv_caches[0].clone()
    for name, value, match in [
        ("ids", torch.tensor([49152]), r"token id 49152 is outside the vocabulary \[0, 49152\)"),
        ("ids", torch.tensor([-1]), "token id -1"),
        ("ids", torch.tensor([4], dtype=torch.int32), "ids must"),
        ("ids", torch.tensor([[4]]), "ids must"),
        ("ids", None, "hidden, ids: one of the two"),
        ("logits", torch.empty(1, 49151), "logits must"),
        ("logits", torch.empty(1, 49152, dtype=torch.float64), "logits must"),
    ]:
        with pytest.raises(ValueError, match=match):
            fused(**{**good, name: value})
    assert torch.equal(kv_caches[0], before)
    with pytest.raises(ValueError, match="hidden, ids: one of the two"):
        fused(**{**good, "hidden": torch.zeros(1, 576)})
    no_embedding = DecoderLayers([one_layer], 9, 3, 64, ROPE,
                                 ends=ModelEnds(norm.weight, norm.eps, None, blocks))
    with pytest.raises(ValueError, match="ids only for layers that embed them"):
        fused(**{**good, "layers": no_embedding})
    plain = _layers(one_layer)
    with pytest.raises(ValueError, match="run no embedding or LM head"):
        fused(**{**good, "layers": plain, "hidden": torch.zeros(1, 576)})
