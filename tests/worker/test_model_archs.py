"""Every supported architecture against transformers, on a small random-weight model of its
real structure (GQA, explicit head_dim where the architecture has one, biases, q/k norms,
Gemma's four norms, sliding windows shorter than the prompts, a RoPE scaling type each).

Per architecture, one model (module-scoped) is built with transformers, saved as safetensors,
loaded by v1 from that directory and held to docs/design.md's correctness bar: greedy outputs equal
to transformers' token for token (fp32 on CPU: exact), in the default configuration, with
chunked prefill (budget 16), on a second pass that hits the prefix cache, and under
preemption in a tiny KV pool. Weights are drawn wide (std 0.2, norms included) so that the
logits are peaked and greedy is never decided by a near-tie.

Then the loader: bf16 / fp16 checkpoints, sharded checkpoints, unknown architectures, and
GGUF files of each architecture written with the `gguf` package's writer.
"""

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from tests.entrypoints.conftest import Reference
from tests.entrypoints.test_llm import MAX_TOKENS, assert_matches_hf, check_idle
from tests.worker.test_model import (
    Chunk,
    assert_close_logits,
    hf_logits,
    new_kv_caches,
    prefill,
    run_step,
)
from v1 import LLM, SamplingParams
from v1.attention.backends.torch_attn import TorchAttentionImpl
from v1.models.loader import LoadedModel, load_model
from v1.models.registry import supported_architectures

VOCAB = 384
WINDOW = 12  # every windowed layer's window: well under the prompts' 40-70 tokens
CPU = torch.device("cpu")

# ---- the architectures, as small configs of their real structure ----------------------------


def _common(**overrides: Any) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,  # nothing stops early: every output is MAX_TOKENS long
        "pad_token_id": None,
        **overrides,
    }


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_common(
        attention_bias=True,  # on q, k, v and o
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ))


def mistral_config() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_common(
        sliding_window=WINDOW,  # in every layer
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ))


def qwen2_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_common(
        tie_word_embeddings=True,
        # The window applies from layer max_window_layers on (layers 1 and 2).
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ))


def qwen3_config() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**_common(
        head_dim=24,  # 4 heads of 24 in a 64-wide model: not hidden / heads
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    ))


def gemma3_config() -> Any:
    from transformers import Gemma3TextConfig

    # Untied: with its embeddings tied (and scaled by sqrt(hidden)), a random Gemma repeats
    # one token forever, which would test little. Qwen2's case ties them.
    return Gemma3TextConfig(**_common(
        head_dim=32,
        query_pre_attn_scalar=20,  # scores scaled by 20 ** -0.5, not head_dim ** -0.5
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 4.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    ))


def phi3_config() -> Any:
    from transformers import Phi3Config

    return Phi3Config(**_common(sliding_window=WINDOW, original_max_position_embeddings=256))


@dataclass(frozen=True)
class Case:
    make_config: Callable[[], Any]
    windows: list[int | None]  # each layer's window, as transformers applies it


CASES: dict[str, Case] = {
    "llama": Case(llama_config, [None, None, None]),
    "mistral": Case(mistral_config, [WINDOW, WINDOW, WINDOW]),
    "qwen2": Case(qwen2_config, [None, WINDOW, WINDOW]),
    "qwen3": Case(qwen3_config, [None, None, WINDOW]),
    "gemma3": Case(gemma3_config, [WINDOW, None, WINDOW]),
    "phi3": Case(phi3_config, [WINDOW, WINDOW, WINDOW]),
}


def build_hf_model(config: Any, seed: int = 0) -> Any:
    """transformers' model of `config` with wide random weights: projections and biases
    ~ N(0, 0.2), embedding and LM head ~ N(0, 1), norm scales ~ N(1, 0.2) (Gemma's, stored
    minus one, ~ N(0, 0.2)). Measured over the parity prompts' greedy steps: the top two
    logits differ by more than 0.07 at 95% of steps and by at least 2e-3 at every one, far
    above fp32 rounding (~1e-5 here), and most outputs hold 20-30 distinct tokens of 32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    unit_offset_norms = config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if unit_offset_norms else 1.0, 0.2)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.2)
    return model


def load(path: Path) -> LoadedModel:
    return load_model(str(path), torch.float32, CPU, TorchAttentionImpl)


@dataclass
class ArchModel:
    name: str
    hf: Any  # the transformers model
    loaded: LoadedModel  # ours, from the saved directory
    path: Path
    reference: Callable[[list[int], int], Reference]  # transformers' greedy, memoized


def hf_greedy_reference(hf: Any) -> Callable[[list[int], int], Reference]:
    """transformers' greedy continuation of a prompt: a full forward per token (no KV cache,
    so nothing but the model's own masks decides what each position sees)."""
    cache: dict[tuple[tuple[int, ...], int], Reference] = {}

    def run(prompt_ids: list[int], max_tokens: int) -> Reference:
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            ids = list(prompt_ids)
            top5: list[list[int]] = []
            for _ in range(max_tokens):
                logits = hf_logits(hf, ids)[-1]
                top5.append(logits.topk(5).indices.tolist())
                ids.append(top5[-1][0])
            cache[key] = Reference(ids[len(prompt_ids):], top5)
        return cache[key]

    return run


@pytest.fixture(scope="module", params=list(CASES))
def arch(request, tmp_path_factory) -> ArchModel:
    name = request.param
    hf = build_hf_model(CASES[name].make_config())
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return ArchModel(name, hf, load(path), path, hf_greedy_reference(hf))


def prompts() -> list[list[int]]:
    """Four prompts behind one shared 40-token prefix (two full blocks to hit) and two
    unrelated ones: 21 to 66 tokens, all longer than the window."""
    rng = np.random.default_rng(1)
    shared = rng.integers(0, VOCAB, 40).tolist()
    out = [shared + rng.integers(0, VOCAB, n).tolist() for n in (3, 9, 17, 26)]
    return out + [rng.integers(0, VOCAB, n).tolist() for n in (21, 58)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)


def generate(llm: LLM, prompt_ids: list[list[int]]) -> list:
    return llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False
    )


@pytest.fixture
def make_llm(arch: ArchModel):
    made: list[LLM] = []

    def make(**kwargs: Any) -> LLM:
        kwargs.setdefault("num_gpu_blocks", 128)
        kwargs.setdefault("max_model_len", 256)
        llm = LLM(loaded_model=arch.loaded, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


# ---- structure, then logits, then greedy parity in each engine configuration ------------------


def test_registry_picks_the_class_and_each_layer_gets_its_window(arch: ArchModel):
    config = json.loads((arch.path / "config.json").read_text())
    assert type(arch.loaded.model).__name__ == config["architectures"][0]
    windows = [layer.self_attn.attn.sliding_window for layer in arch.loaded.model.model.layers]
    assert windows == CASES[arch.name].windows


def test_prefill_and_decode_logits_match_hf(arch: ArchModel):
    model = arch.loaded.model
    tokens = prompts()[-1]  # 58 tokens, blocks in a scrambled order
    table = [3, 1, 0, 2]
    ref = hf_logits(arch.hf, tokens)
    assert_close_logits(prefill(model, tokens, table), ref, atol=1e-4)
    # The last three tokens one at a time through the cache (windows slide past block edges).
    kv_caches = new_kv_caches(model, 4)
    pieces = run_step(model, kv_caches, [Chunk(tokens[:-3], 0, table)])
    for pos in range(len(tokens) - 3, len(tokens)):
        pieces += run_step(model, kv_caches, [Chunk([tokens[pos]], pos, table)])
    assert_close_logits(torch.cat(pieces), ref, atol=1e-4)


def test_default_config_matches_hf(arch: ArchModel, make_llm):
    llm = make_llm()
    outputs = generate(llm, prompts())
    assert_matches_hf(llm, outputs, arch.reference)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    check_idle(llm)


def test_chunked_prefill_budget_16(arch: ArchModel, make_llm):
    llm = make_llm(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    assert_matches_hf(llm, generate(llm, prompts()), arch.reference)
    check_idle(llm)


def test_second_pass_hits_prefix_cache(arch: ArchModel, make_llm):
    llm = make_llm()
    generate(llm, prompts())
    outputs = generate(llm, prompts())
    assert_matches_hf(llm, outputs, arch.reference)
    assert all(o.num_cached_tokens > 0 for o in outputs if len(o.prompt_token_ids) > 16)
    check_idle(llm)


def test_preemption_under_tiny_kv_pool(arch: ArchModel, make_llm):
    # 10 blocks of 16 = 160 tokens for 6 requests of 21-66 prompt tokens + 32 outputs each.
    llm = make_llm(num_gpu_blocks=10, max_model_len=160)
    outputs = generate(llm, prompts())
    assert llm.get_stats().num_preemptions > 0
    assert_matches_hf(llm, outputs, arch.reference)
    check_idle(llm)



# Checkpoint config.json structures the parity cases above do not spell out (small shapes, the
# real keys): read through AutoConfig as a download's config.json is, windows as transformers
# applies them, and prefill logits equal to transformers'.
_JSON_COMMON = _common(torch_dtype="bfloat16")
_GEMMA3_JSON = _JSON_COMMON | {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 7,
    "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 32,
    "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "sliding_window": WINDOW,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}
REAL_CONFIGS: dict[str, tuple[dict[str, Any], list[int | None]]] = {
    # Qwen2.5: a window and max_window_layers set, but use_sliding_window false: no window.
    "qwen2.5": (_JSON_COMMON | {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_window_layers": 1,
        "sliding_window": WINDOW, "use_sliding_window": False, "rope_scaling": None,
        "rope_theta": 1_000_000.0, "tie_word_embeddings": True,
    }, [None, None, None]),
    # Qwen3-0.6B: tied, explicit head_dim, no biases, yarn as its long-context card sets it.
    "qwen3-tied": (_JSON_COMMON | {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 24,
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 64},
    }, [None, None, None]),
    # Mistral v0.2+: sliding_window null.
    "mistral-no-window": (_JSON_COMMON | {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "head_dim": 24,
        "sliding_window": None, "rope_theta": 1_000_000.0,
    }, [None, None, None]),
    # Llama 3.2: tied, llama3 rope_scaling, mlp_bias.
    "llama3.2": (_JSON_COMMON | {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": True,
        "tie_word_embeddings": True, "rope_theta": 500_000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }, [None, None, None]),
    # gemma-3-1b: no layer_types (every 6th layer global), rope_scaling null, tied.
    "gemma3-1b": (_GEMMA3_JSON | {
        "sliding_window_pattern": 6, "rope_scaling": None, "tie_word_embeddings": True,
    }, [WINDOW] * 5 + [None, WINDOW]),
    # gemma-3-4b's text config: linear rope_scaling on the global layers only.
    "gemma3-4b-text": (_GEMMA3_JSON | {
        "sliding_window_pattern": 6, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }, [WINDOW] * 5 + [None, WINDOW]),
}


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_checkpoint_config_structures_match_hf(tmp_path, name):
    from transformers import AutoConfig

    config_json, windows = REAL_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    hf = build_hf_model(AutoConfig.from_pretrained(tmp_path))
    hf.save_pretrained(tmp_path)
    model = load(tmp_path).model
    assert [s.sliding_window for s in model.layer_specs] == windows
    tokens = prompts()[-1]
    # Logits reach ~40 here: 2e-4 is 5e-6 of that; the kernel libraries' fp32 rounding alone
    # reads 0.8-1.0e-4 on qwen2.5 (Zen 5: portable 7.7e-5, x86_64_v3 9.7e-5, v4 1.01e-4).
    assert_close_logits(prefill(model, tokens, [3, 1, 0, 2]), hf_logits(hf, tokens), atol=2e-4)


# ---- shared layers -----------------------------------------------------------------------------


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 500000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0, "beta_fast": 16,
     "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5, "original_max_position_embeddings": 32},
], ids=lambda rope: rope["rope_type"])
def test_rope_frequencies_equal_transformers(rope):
    """Each rope type's frequencies and cos/sin scale, bit for bit transformers' own."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from v1.models.layers.rotary import rope_inv_freq, rope_parameters

    config = LlamaConfig(**_common(head_dim=32, rope_parameters=dict(rope)))
    hf = LlamaRotaryEmbedding(config)
    inv_freq, scaling = rope_inv_freq(rope_parameters(config), 32, 256)
    assert torch.equal(inv_freq, hf.inv_freq)
    assert scaling == hf.attention_scaling


def test_longrope_is_refused():
    from v1.models.layers.rotary import rope_inv_freq

    with pytest.raises(ValueError, match="longrope"):
        rope_inv_freq({"rope_type": "longrope", "rope_theta": 1e4}, 32, 256)


# ---- loading ----------------------------------------------------------------------------------


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    build_hf_model(llama_config()).save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["FalconForCausalLM"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FalconForCausalLM") as e:
        load(tmp_path)
    assert all(arch in str(e.value) for arch in supported_architectures())


def test_gemma3_attention_softcapping_is_refused(tmp_path):
    config = gemma3_config()
    config.attn_logit_softcapping = 50.0
    build_hf_model(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        load(tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_checkpoint_loads_upcast(tmp_path, dtype):
    """A 16-bit checkpoint runs in fp32 on CPU, equal to transformers' fp32 load of it."""
    from transformers import AutoModelForCausalLM

    build_hf_model(qwen2_config()).to(dtype).save_pretrained(tmp_path)
    loaded = load(tmp_path)
    assert loaded.model.model.embed_tokens.weight.dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = prompts()[0]
    assert_close_logits(prefill(loaded.model, tokens, [0, 1, 2]), hf_logits(hf, tokens), 1e-4)


def test_sharded_checkpoint_loads(tmp_path):
    """Shards listed in model.safetensors.index.json load; a stray consolidated.safetensors
    (Mistral repos ship one, in another naming) beside them is not read."""
    from safetensors.torch import save_file

    hf = build_hf_model(gemma3_config())
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    hf.save_pretrained(single)
    hf.save_pretrained(sharded, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, sharded / "consolidated.safetensors")

    a, b = load(single).model, load(sharded).model
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name


# ---- GGUF files of each architecture ----------------------------------------------------------


def gguf_case_config(name: str) -> Any:
    """The parity case's config, restricted to what a GGUF file can say (llama.cpp assumes
    Gemma 3's query_pre_attn_scalar is head_dim, has no final softcap for it, and keeps no
    sliding window for Qwen)."""
    config = CASES[name].make_config()
    # GGUF keeps only linear rope scaling (Llama 3.1's as a tensor, which we refuse).
    if name == "gemma3":
        config.query_pre_attn_scalar = config.head_dim
        config.final_logit_softcapping = None
    elif name in ("qwen2", "qwen3"):
        config.use_sliding_window = False
        config.sliding_window = None
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    elif name == "llama":
        config.rope_parameters = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    return config


# Where a K-quant block keeps its fp16 scales: (d, dmin) first, or Q6_K's d last.
_K_SCALES = {"Q4_K": ((0, 3e-4), (2, 3e-4)), "Q5_K": ((0, 2e-4), (2, 2e-4)),
             "Q6_K": ((208, 5e-5),)}


def quantized(data: np.ndarray, kind: Any, seed: int = 0) -> np.ndarray:
    """`data` [out, in] as `kind`'s GGUF blocks: gguf's quantizer where it has one, else (the
    K-quants, which it cannot make) random blocks of the same shape whose fp16 scales are
    small enough to keep the values within about +-0.3 (the weights are then not `data`'s:
    compare such a file with its own fp32 load)."""
    import gguf

    if kind.name not in _K_SCALES:
        return gguf.quants.quantize(data, kind)
    values, nbytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    out, n = data.shape[0], data.shape[1] // values
    blocks = rng.integers(0, 256, (out, n, nbytes), dtype=np.uint8)
    for offset, high in _K_SCALES[kind.name]:
        scale = rng.uniform(high / 3, high, (out, n, 1)).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8)
    return blocks.reshape(out, n * nbytes)


def write_gguf(
    hf: Any, path: Path, name: str, rope_dims: int | None = None,
    tensor_type: Callable[[str], Any] | None = None,
) -> None:
    """What llama.cpp's converter writes for `hf` (no tokenizer): gguf's own HF -> GGUF
    tensor-name map, llama's q/k rows permuted, Gemma's norms stored as 1 + w, and (llama,
    phi3) how many dimensions of a head rotate: `rope_dims`, default head_dim. Tensors are F32,
    or the `gguf.GGMLQuantizationType` that `tensor_type(gguf tensor name)` gives (None: F32)."""
    import gguf

    config = hf.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
            "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3": gguf.MODEL_ARCH.GEMMA3,
            "phi3": gguf.MODEL_ARCH.PHI3}[name]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if name in ("llama", "phi3"):
        writer.add_rope_dimension_count(rope_dims or head_dim)
    rope = config.rope_parameters
    if name == "gemma3":
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern(
            [t == "sliding_attention" for t in config.layer_types]
        )
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        rope = rope["full_attention"]
    elif name == "phi3":
        writer.add_sliding_window(config.sliding_window)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])

    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, tensor in hf.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.float().numpy().copy()
        if name == "llama" and base.endswith(("q_proj", "k_proj")):
            n = heads if base.endswith("q_proj") else kv_heads
            data = data.reshape(n, 2, data.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(
                data.shape
            )
        if name == "gemma3" and base.endswith("norm"):
            data = data + np.float32(1.0)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        kind = tensor_type(gguf_name) if tensor_type else None
        if kind is not None:
            data = quantized(data, kind, seed=zlib.crc32(gguf_name.encode()))
        writer.add_tensor(gguf_name, np.ascontiguousarray(data), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3", "phi3"])
def test_gguf_loads_as_the_same_model(tmp_path, monkeypatch, name):
    """A GGUF of each architecture converts to the checkpoint it was written from: the same
    config where it matters and the same logits as loading those weights from safetensors."""
    monkeypatch.setenv("V1_CACHE_DIR", str(tmp_path / "cache"))
    hf = build_hf_model(gguf_case_config(name), seed=3)
    hf.save_pretrained(tmp_path / "hf")
    write_gguf(hf, tmp_path / f"{name}.gguf", name)

    ours = load(tmp_path / f"{name}.gguf")
    reference = load(tmp_path / "hf")
    assert type(ours.model) is type(reference.model)
    assert ours.tokenizer is None
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads",
                "tie_word_embeddings"):
        assert getattr(ours.hf_config, key) == getattr(hf.config, key), key
    # The converted config loads without transformers (`load_config`: as the conversion
    # recorded it), yet says all its class says, but for what AutoConfig adds on loading and
    # a field we never read.
    by_class = AutoConfig.from_pretrained(ours.model_dir)
    assert type(by_class) is not type(ours.hf_config)
    unread = ("_name_or_path", "use_cache")
    assert ({k: v for k, v in vars(ours.hf_config).items() if k not in unread}
            == {k: v for k, v in json.loads(by_class.to_json_string(use_diff=False)).items()
                if k not in unread})
    assert [s.sliding_window for s in ours.model.layer_specs] == [
        s.sliding_window for s in reference.model.layer_specs
    ]
    tokens = prompts()[-1]
    ref = prefill(reference.model, tokens, [3, 1, 0, 2])
    got = prefill(ours.model, tokens, [3, 1, 0, 2])
    assert torch.equal(got, ref), f"max abs diff {(got - ref).abs().max().item():.2e}"


def test_gguf_partial_rotary_is_refused(tmp_path, monkeypatch):
    """llama.cpp writes phi3's rope.dimension_count as head_dim * partial_rotary_factor
    (Phi-4-mini: 0.75); rotating the whole head instead would be silently wrong."""
    monkeypatch.setenv("V1_CACHE_DIR", str(tmp_path / "cache"))
    hf = build_hf_model(gguf_case_config("phi3"), seed=3)
    write_gguf(hf, tmp_path / "phi3.gguf", "phi3", rope_dims=12)  # of head_dim 16
    with pytest.raises(ValueError, match="partial rotary"):
        load(tmp_path / "phi3.gguf")
