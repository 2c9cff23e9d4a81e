"""Quantized weights run as stored, and one copy of each weight (no fp32 copy beside blocks).

- quantization="gguf": a small random Llama written as a GGUF with Q4_1 projections and a Q8_0
  tied embedding (the default model's layout) runs those blocks as they are: every matrix is
  held as blocks only, whose values are exactly the fp32 load's (the q/k un-permutation of
  rows of blocks included), and the logits are the fp32 model's up to summation order;
  block types the kernels lack (Q5_0 here) are dequantized to fp32;
- quantization="int8": a float checkpoint's matrices become Q8_0 at load, under half the fp32
  weight memory, with logits close to fp32's;
- fp32: each matrix is held once (oneDNN-packed), not beside a plain copy;
- bad options raise ValueError naming the value and the choices.
"""

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.engine.mp_utils import assert_greedy_match
from tests.worker.test_model import prefill
from tests.worker.test_model_archs import (
    build_hf_model,
    gguf_case_config,
    prompts,
    quantized,
    write_gguf,
)
from tests.worker.test_quant_kernels import fp32_kernel_calls  # noqa: F401 (fixture)
from v1 import LLM, SamplingParams
from v1.attention.backends.torch_attn import TorchAttentionImpl
from v1.config import EngineArgs
from v1.kernels.block_matmul import GGUF_KINDS, QuantKernels
from v1.models import loader as loader_module
from v1.models import model_files
from v1.models.layers.linear import Linear
from v1.models.layers.quantized import MatmulPolicy, QuantizedWeight
from v1.models.loader import LoadedModel, gguf_block_kinds, load_model, resolve_quantization

CPU = torch.device("cpu")
BLOCK = [3, 1, 0, 2, 5, 4]  # enough 16-token blocks for the longest prompt (66 tokens)


def load(path: Path, quantization: str | None = None) -> LoadedModel:
    return load_model(str(path), torch.float32, CPU, TorchAttentionImpl,
                      quantization=quantization)


def matrices(loaded: LoadedModel) -> dict[str, Linear]:
    return {name: m for name, m in loaded.model.named_modules() if isinstance(m, Linear)}


def weight_bytes(loaded: LoadedModel) -> int:
    return sum(m.weight_nbytes for m in matrices(loaded).values())


def gguf_tensor_type(output_type: Any = None):
    """The default model's layout: norms F32, projections Q4_1, the embedding Q8_0; an
    untied LM head (`output.weight`) as `output_type`."""
    import gguf

    def kind(name: str) -> Any:
        if name == "output.weight":
            return output_type
        if name == "token_embd.weight":
            return gguf.GGMLQuantizationType.Q8_0
        if name.endswith(".weight") and "norm" not in name:
            return gguf.GGMLQuantizationType.Q4_1
        return None

    return kind


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory) -> Path:
    """A random Llama with tied embeddings as a Q4_1 / Q8_0 GGUF."""
    config = gguf_case_config("llama")
    config.tie_word_embeddings = True
    config.attention_bias = False  # llama.cpp's Llama blocks have none
    path = tmp_path_factory.mktemp("gguf") / "tied.gguf"
    write_gguf(build_hf_model(config, seed=5), path, "llama", tensor_type=gguf_tensor_type())
    return path


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("V1_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "v1-cache"))


def logits_of(loaded: LoadedModel) -> list[torch.Tensor]:
    """Prefill logits of the prompts, block matrices through the fp32 path (as
    V1_QUANT_ALL_INT8=0 outside a forward's prompt rows): the weights' own error, without
    int8 activations' rounding."""
    by_count = MatmulPolicy(all_int8=False)
    return [prefill(loaded.model, tokens, BLOCK, by_count) for tokens in prompts()]


def assert_close(
    got: list[torch.Tensor], ref: list[torch.Tensor], rel: float, agree: float = 1.0
) -> None:
    """Each prompt's logits within `rel` of the reference's (relative L2 error), and the
    greedy token the reference's at a share >= `agree` of the positions."""
    for g, r in zip(got, ref, strict=True):
        err = ((g - r).norm() / r.norm()).item()
        assert err <= rel, f"relative logit error {err:.2e} > {rel:.0e}"
        share = (g.argmax(-1) == r.argmax(-1)).float().mean().item()
        assert share >= agree, f"greedy token equal at {share:.1%} of positions"


# ---- gguf ------------------------------------------------------------------------------------


def test_gguf_mode_runs_the_files_blocks(tied_gguf):
    fp32, ours = load(tied_gguf), load(tied_gguf, "gguf")
    assert ours.quantization == "gguf"
    forms = {name: m.weight_form for name, m in matrices(ours).items()}
    assert forms.pop("model.embed_tokens") == "q8_0"  # also the LM head: tied
    assert set(forms.values()) == {"q4_1"}
    assert all(m.weight is None for m in matrices(ours).values())  # no fp32 copy beside
    # The blocks hold exactly the weights the fp32 load dequantized (q/k rows un-permuted
    # as whole rows of blocks, fused shards in place).
    for name, m in matrices(fp32).items():
        assert torch.equal(matrices(ours)[name].float_weight(), m.float_weight()), name
    # 4.5 / 32 bits per weight against 32.
    assert weight_bytes(ours) < 0.2 * weight_bytes(fp32)
    assert_close(logits_of(ours), logits_of(fp32), rel=1e-4)


def greedy_runs(path: Path, quantization: str | None, prompt_sets: list[list[list[int]]],
                **engine: Any) -> tuple[list[list[list[int]]], list[list[list[set[int]]]], Any]:
    """Greedy tokens (16 each) and each position's top-5 ids of every prompt of each set,
    one `generate` per set, on one in-process engine; and its loaded model."""
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5)
    llm = LLM(str(path), quantization=quantization, multiprocess=False, num_gpu_blocks=64,
              **engine)
    tokens, tops = [], []
    for prompt_set in prompt_sets:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_set], params)
        tokens.append([o.outputs[0].token_ids for o in outs])
        tops.append([[set(d) for d in o.outputs[0].logprobs] for o in outs])
    loaded = llm.llm_engine.client.engine_core.loaded
    llm.shutdown()
    return tokens, tops, loaded


def test_gguf_is_a_gguf_files_default(tied_gguf):
    """quantization unset on a .gguf file runs its blocks (vLLM's default); its greedy tokens
    agree with float weights' ("none") by the lossy modes' rule (prompt rows take int8
    activations): equal up to a first divergence where each side's token is in the other's
    top-5."""
    runs = {q: greedy_runs(tied_gguf, q, [prompts()]) for q in ("none", None)}
    assert runs["none"][2].quantization is None
    assert runs[None][2].quantization == "gguf"
    assert runs[None][2].model.model.layers[0].mlp.down_proj.weight_form == "q4_1"
    for i in range(len(prompts())):
        assert_greedy_match(runs["none"][0][0][i], runs["none"][1][0][i],
                            runs[None][0][0][i], runs[None][1][0][i])


def test_gguf_without_prompt_int8_is_fp32_exactly(tied_gguf, fp32_kernel_calls,  # noqa: F811
                                                   monkeypatch):
    """With every row on the fp32 path (V1_QUANT_ALL_INT8=0 V1_QUANT_PROMPT_INT8=0), gguf
    gives fp32's greedy tokens, and every block matrix ran the C fp32 kernel. The per-op
    path, whose calls the bindings count (the fused decode step calls the same kernel from
    C, the same bits: tests/worker/test_fused_decode.py)."""
    monkeypatch.setenv("V1_FUSED_DECODE", "0")
    monkeypatch.setenv("V1_QUANT_ALL_INT8", "0")
    monkeypatch.setenv("V1_QUANT_PROMPT_INT8", "0")
    fp32, _, _ = greedy_runs(tied_gguf, "none", [prompts()])
    fp32_kernel_calls.clear()
    gguf, _, loaded = greedy_runs(tied_gguf, "gguf", [prompts()])
    shapes = {(m.kernel.out_features, m.kernel.in_features) for m in matrices(loaded).values()}
    assert {(n, k) for n, k, _ in fp32_kernel_calls} == shapes
    assert gguf == fp32


@pytest.mark.parametrize("all_int8", [True, False])
def test_prompt_rows_take_int8_whatever_the_batch(tied_gguf, monkeypatch, all_int8):
    """Prompt tokens' rows run int8 activations, and so do generated tokens' (the default,
    MatmulPolicy.all_int8), else they take the fp32 path; since int8's rows do not depend on each
    other, a prompt's greedy tokens are the same alone, in a batch, in 7-token chunks and
    after a prefix-cache hit on its own prompt. The per-op path, whose calls the bindings
    count (the fused step takes the same paths from C: tests/worker/test_fused_decode.py)."""
    monkeypatch.setenv("V1_FUSED_DECODE", "0")
    monkeypatch.setenv("V1_QUANT_ALL_INT8", "1" if all_int8 else "0")
    calls: list[tuple[bool, int]] = []
    linear = QuantKernels.linear

    def counting(self, w, x, bias, int8=False):
        calls.append((int8, x.shape[0]))
        return linear(self, w, x, bias, int8)

    monkeypatch.setattr(QuantKernels, "linear", counting)
    batch = prompts()
    alone, _, _ = greedy_runs(tied_gguf, None, [[p] for p in batch] + [batch])
    assert (True, len(batch[0])) in calls  # the first prompt, cold, in one int8 call
    if all_int8:
        assert all(int8 for int8, _ in calls)
    else:
        assert max(m for int8, m in calls if not int8) < len(batch) * 2  # decode, LM head
    reference = [out[0] for out in alone[:-1]]
    assert alone[-1] == reference  # batched
    chunked, _, _ = greedy_runs(tied_gguf, None, [batch, batch], max_num_batched_tokens=7,
                                long_prefill_token_threshold=7)
    assert chunked == [reference, reference]  # chunks, then every prompt a prefix-cache hit


def test_a_gguf_load_imports_neither_transformers_nor_sympy():
    """What a converted GGUF file's load leaves out of a start (`python -X importtime` gives
    each one's cost): transformers (~1 s: its config and EOS are read as the conversion
    recorded them, the tokenizer loads at first use), sympy (torch's meta tensors import it)
    and the gguf package (its tables' set-up) where every tensor is kept as blocks or is F32.
    The tokenizer's load then takes transformers' generic fast tokenizer: no config class
    (importing one pulls in torch.distributed), no first touch of `transformers.models` (it
    reads every model's module)."""
    model_files.hf_dir_of(model_files.default_model_path())  # converted, if it was not
    code = (
        "import sys, torch\n"
        "from v1.attention.backends.torch_attn import TorchAttentionImpl\n"
        "from v1.models.loader import load_model\n"
        "loaded = load_model(None, torch.float32, 'cpu', TorchAttentionImpl, "
        "quantization='gguf')\n"
        "assert loaded.hf_config.model_type == 'llama'\n"
        "print([m for m in ('transformers', 'sympy', 'gguf') if m in sys.modules])\n"
        "assert loaded.tokenizer('Hello')['input_ids']\n"
        "assert loaded.eos_token_id == loaded.tokenizer.eos_token_id\n"
        "print([m for m in ('transformers.models', 'torch.distributed.tensor') "
        "if m in sys.modules])\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert run.stdout.splitlines()[-2:] == ["[]", "[]"], run.stdout


def test_unset_quantization_resolves_as_vllm(tmp_path, tied_gguf, monkeypatch):
    """Unset: "gguf" for a .gguf file on CPU in float32, float weights for anything else (an
    HF directory, a GPU, bf16, or no native kernels to run blocks with); "none" forces float
    weights; a method given is kept."""
    build_hf_model(gguf_case_config("llama")).save_pretrained(tmp_path)
    assert resolve_quantization(None, tied_gguf, CPU, torch.float32) == "gguf"
    assert resolve_quantization("none", tied_gguf, CPU, torch.float32) is None
    assert resolve_quantization("int8", tied_gguf, CPU, torch.float32) == "int8"
    assert resolve_quantization(None, tmp_path, CPU, torch.float32) is None
    assert resolve_quantization(None, tied_gguf, torch.device("cuda"), torch.float32) is None
    assert resolve_quantization(None, tied_gguf, CPU, torch.bfloat16) is None
    monkeypatch.setattr(loader_module, "quant_kernels", lambda: None)
    assert resolve_quantization(None, tied_gguf, CPU, torch.float32) is None


def test_gguf_mode_dequantizes_block_types_it_lacks(tmp_path, caplog, monkeypatch):
    """An untied LM head in a type the kernels do not run (Q5_0 here, as for a library with
    only Q4_1 and Q8_0 kernels) is loaded as fp32, said in one line with what it costs;
    everything else stays blocks."""
    import gguf

    monkeypatch.setattr(loader_module, "gguf_block_kinds", lambda: frozenset({"q4_1", "q8_0"}))
    config = gguf_case_config("llama")
    config.attention_bias = False
    path = tmp_path / "untied.gguf"
    write_gguf(build_hf_model(config, seed=6), path, "llama",
               tensor_type=gguf_tensor_type(gguf.GGMLQuantizationType.Q5_0))
    fp32 = load(path)
    with caplog.at_level("INFO", logger="v1"):
        ours = load(path, "gguf")
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert lines == ["untied.gguf: 1 Q5_0 tensor(s) dequantized to fp32: 0.10 MB instead of "
                     "0.02 MB stored (this kernel library has no q5_0 kernels)"]
    assert matrices(ours)["lm_head"].weight_form == "packed"
    assert matrices(ours)["model.embed_tokens"].weight_form == "q8_0"
    assert torch.equal(matrices(ours)["lm_head"].float_weight(),
                       matrices(fp32)["lm_head"].float_weight())
    assert_close(logits_of(ours), logits_of(fp32), rel=1e-4)


@pytest.mark.parametrize("shard, kind", [
    ("attn_q", "F16"),  # float rows before block rows
    ("attn_v", "F16"),  # float rows after block rows
    ("attn_v", "Q5_0"),  # another block type, after block rows
    ("attn_k", "Q8_0"),  # two block kinds
])
def test_fused_shards_of_mixed_types_keep_the_files_values(tmp_path, shard, kind):
    """A fused weight whose shards differ in type (llama.cpp's K-quant mixes write such
    files) keeps each shard's blocks (`QuantizedShards`) where this library runs every
    shard's type, else is held fp32 as a whole; either way with exactly the file's values
    (not rows of uninitialised memory); the other matrices stay blocks."""
    import gguf

    config = gguf_case_config("llama")
    config.attention_bias = False
    q4_1 = gguf_tensor_type()
    path = tmp_path / "mixed.gguf"
    odd = f"blk.0.{shard}.weight"

    def mixed(name: str) -> Any:
        return gguf.GGMLQuantizationType[kind] if name == odd else q4_1(name)

    write_gguf(build_hf_model(config), path, "llama", tensor_type=mixed)
    fp32, ours = load(path), load(path, "gguf")
    qkv = "model.layers.0.self_attn.qkv_proj"
    types = {"attn_q": "q4_1", "attn_k": "q4_1", "attn_v": "q4_1", shard: kind.lower()}
    runs = set(types.values()) <= gguf_block_kinds()
    assert matrices(ours)[qkv].weight_form == ("+".join(types.values()) if runs else "packed")
    assert matrices(ours)["model.layers.1.self_attn.qkv_proj"].weight_form == "q4_1"
    assert torch.equal(matrices(ours)[qkv].float_weight(), matrices(fp32)[qkv].float_weight())
    assert_close(logits_of(ours), logits_of(fp32), rel=1e-4)


# Every type of a llama.cpp file in one small Llama (K-quants need in_features of 256): layer
# 0's q | k | v in three types (a K-quant mix), its MLP in three more, layer 1 in the rest.
_MANY_TYPES = {
    "blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q5_K", "blk.0.attn_v": "Q6_K",
    "blk.0.attn_output": "Q4_0", "blk.0.ffn_gate": "Q5_0", "blk.0.ffn_up": "Q5_1",
    "blk.0.ffn_down": "Q6_K", "blk.1.attn_q": "Q4_K", "blk.1.attn_k": "Q4_K",
    "blk.1.attn_v": "Q4_K", "blk.1.attn_output": "BF16", "blk.1.ffn_gate": "Q8_0",
    "blk.1.ffn_up": "Q8_0", "blk.1.ffn_down": "Q4_1", "token_embd": "F16", "output": "Q6_K",
}


@pytest.fixture(scope="module")
def many_types_gguf(tmp_path_factory) -> Path:
    import gguf

    config = gguf_case_config("llama")
    config.attention_bias = False
    config.tie_word_embeddings = False
    config.num_hidden_layers = 2
    config.hidden_size = config.intermediate_size = 256
    config.head_dim = 64

    def kind(name: str) -> Any:
        stored = _MANY_TYPES.get(name.removesuffix(".weight"))
        return None if stored is None else gguf.GGMLQuantizationType[stored]

    path = tmp_path_factory.mktemp("gguf") / "many.gguf"
    write_gguf(build_hf_model(config, seed=4), path, "llama", tensor_type=kind)
    return path


def test_gguf_blocks_are_the_files_mapping(many_types_gguf, tmp_path):
    """The file mapped by its tensor index (what a load reads) gives the tensors gguf's reader
    gives. Every weight matrix comes as blocks of its stored type whose memory is the file's
    map itself (no copy), except q/k, whose rows of K-quant blocks are un-permuted into a new
    tensor; each holds exactly the fp32 conversion's values (the un-permutation included)."""
    from v1.models import gguf_conversion

    parsed = gguf_conversion.read_gguf(many_types_gguf)
    gguf_conversion.write_index(parsed, tmp_path / "index.json", None)
    opened = gguf_conversion.open_indexed(many_types_gguf, tmp_path / "index.json",
                                          parsed.config)
    assert (opened.arch, opened.has_tokenizer) == (parsed.arch, parsed.has_tokenizer)
    for a, b in zip(opened.tensors, parsed.tensors, strict=True):
        assert (a.name, a.type_name, a.shape, a.offset) == (b.name, b.type_name, b.shape,
                                                              b.offset)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    mapped = opened.mapped
    start = mapped.ctypes.data
    end = start + mapped.nbytes
    fp32 = dict(gguf_conversion.iter_hf_tensors(opened))
    blocks = {name: w for name, w in gguf_conversion.iter_hf_tensors(opened, GGUF_KINDS)
              if not name.endswith("norm.weight")}  # norms: F32, copied
    assert all(isinstance(w, QuantizedWeight) for w in blocks.values())
    assert {w.kind for w in blocks.values()} == {k.lower() for k in _MANY_TYPES.values()}
    assert len(blocks) == len(_MANY_TYPES)
    assert (blocks["model.embed_tokens.weight"].kind, blocks["lm_head.weight"].kind) == (
        "f16", "q6_k")
    for name, w in blocks.items():
        inside = start <= w.blocks.data_ptr() < end
        assert inside != name.endswith(("q_proj.weight", "k_proj.weight")), name
        assert torch.equal(w.dequantize(), fp32[name]), name


def test_a_layers_pages_are_released_after_each_of_its_tensors(tied_gguf, monkeypatch):
    """After each tensor is taken, the map's pages from its layer's first tensor to its own end
    are dropped (a fused projection's shards, read again when joined at its last one, with
    them), then the whole map's once all are taken."""
    from v1.models import gguf_conversion

    opened = gguf_conversion.read_gguf(tied_gguf)
    base = opened.mapped.ctypes.data
    released: list[tuple[int, int]] = []
    monkeypatch.setattr(gguf_conversion, "_release_pages", lambda mapped, data: released.append(
        (data.ctypes.data - base, data.ctypes.data - base + data.nbytes)))
    list(gguf_conversion.iter_hf_tensors(opened, GGUF_KINDS))
    assert released[-1] == (0, opened.mapped.nbytes)
    first: dict[str, int] = {}
    for tensor, span in zip(opened.tensors, released, strict=False):
        layer = tensor.name.split(".")[1] if tensor.name.startswith("blk.") else tensor.name
        start = first.setdefault(layer, tensor.offset)
        assert span == (start, tensor.offset + tensor.data.nbytes), tensor.name
    assert len(released) == len(opened.tensors) + 1 and len(first) < len(opened.tensors)


def test_gguf_mode_runs_every_type(many_types_gguf, tmp_path, monkeypatch):
    """quantization="gguf" on a file of every type, each kept as its blocks (on the kernels
    where this library has them, else the torch reference): the logits are the fp32
    conversion's (q/k rows of K-quant blocks un-permuted), and the cache holds the config
    and tokenizer only, no fp32 checkpoint (that is written for the float load alone)."""
    monkeypatch.setenv("V1_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(loader_module, "gguf_block_kinds", lambda: GGUF_KINDS)
    ours = load(many_types_gguf, "gguf")
    forms = {name: m.weight_form for name, m in matrices(ours).items()}
    assert forms["model.layers.0.self_attn.qkv_proj"] == "q4_k+q5_k+q6_k"
    assert forms["model.layers.1.self_attn.qkv_proj"] == "q4_k"
    assert forms["model.embed_tokens"] == "f16" and forms["lm_head"] == "q6_k"
    assert all(m.weight is None for m in matrices(ours).values())
    files = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert files == {"config.json", "gguf_tensors.json", "source.json"}  # no tokenizer here
    fp32 = load(many_types_gguf)
    assert "model.safetensors" in {p.name for p in tmp_path.rglob("*")}
    for name, m in matrices(fp32).items():
        assert torch.equal(matrices(ours)[name].float_weight(), m.float_weight()), name
    assert_close(logits_of(ours), logits_of(fp32), rel=1e-4)


@pytest.mark.parametrize("kind", sorted(GGUF_KINDS))
def test_embedding_rows_of_every_type(kind):
    """A lookup in an embedding of any type gives gguf's own dequantization of those rows."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind.upper()]
    rng = np.random.default_rng(0)
    blocks = quantized(rng.standard_normal((9, 512)).astype(np.float32), qtype).view(np.uint8)
    weight = QuantizedWeight(kind, torch.from_numpy(blocks), 9, 512)
    ids = torch.tensor([[8, 0], [3, 3]])
    expected = gguf.quants.dequantize(blocks, qtype)[ids.numpy()]
    assert np.array_equal(weight.embedding(ids).numpy(), expected)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_quantized_embedding_rows_at_the_edges(kind):
    """A lookup dequantizes exactly the rows asked for: the first and last ids, any index
    shape, and no ids at all (as F.embedding gives [0, hidden])."""
    torch.manual_seed(0)
    weight = QuantizedWeight.quantize(torch.randn(50, 96), kind)
    dense = weight.dequantize()
    for ids in (torch.tensor([0, 49, 0]), torch.tensor([[49, 1], [0, 2]], dtype=torch.int32),
                torch.tensor([], dtype=torch.long)):
        assert torch.equal(weight.embedding(ids), torch.nn.functional.embedding(ids, dense))


# ---- int8 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_int8_quantizes_every_matrix_at_load(tmp_path, tied):
    config = gguf_case_config("llama")
    config.tie_word_embeddings = tied
    build_hf_model(config, seed=7).save_pretrained(tmp_path)
    fp32, ours = load(tmp_path), load(tmp_path, "int8")
    assert {m.weight_form for m in matrices(ours).values()} == {"q8_0"}
    assert all(m.weight is None for m in matrices(ours).values())
    # 8.5 bits per weight: well under half of fp32.
    assert weight_bytes(ours) < 0.5 * weight_bytes(fp32)
    for name, m in matrices(fp32).items():
        w, q = m.float_weight(), matrices(ours)[name].float_weight()
        # Q8_0: each value within half a step (step = max |w| of its 32 / 127) of the
        # original, plus the step's own fp16 rounding (2^-11 relative) times up to 127.
        step = w.abs().reshape(w.shape[0], -1, 32).amax(-1, keepdim=True) / 127
        bound = step * (0.5 + 127 / 2048)
        assert ((q - w).abs().reshape(step.shape[0], -1, 32) <= bound).all(), name
    # Measured: 3-5% relative error, greedy equal at 90-95% of positions (these random
    # models' wide weights amplify rounding far more than a trained model's).
    assert_close(logits_of(ours), logits_of(fp32), rel=0.1, agree=0.85)


def test_int8_keeps_matrices_of_partial_blocks_fp32(tmp_path):
    """in_features not a multiple of 32 (down_proj's 72 here) has no Q8_0 form: that matrix
    stays fp32 (packed), the others are quantized, and the model runs."""
    config = gguf_case_config("llama")
    config.intermediate_size = 72
    build_hf_model(config, seed=9).save_pretrained(tmp_path)
    fp32, ours = load(tmp_path), load(tmp_path, "int8")
    forms = {name: m.weight_form for name, m in matrices(ours).items()}
    assert {f for name, f in forms.items() if name.endswith("down_proj")} == {"packed"}
    assert {f for name, f in forms.items() if not name.endswith("down_proj")} == {"q8_0"}
    assert_close(logits_of(ours), logits_of(fp32), rel=0.1, agree=0.8)


# ---- fp32: one copy --------------------------------------------------------------------------


def test_fp32_keeps_one_copy_of_each_matrix(tmp_path):
    """Each projection is held packed for oneDNN and nothing else; the vocabulary matrix
    (tied: also the LM head) stays plain, as lookups read its rows."""
    config = gguf_case_config("llama")
    config.tie_word_embeddings = True
    hf = build_hf_model(config, seed=8)
    hf.save_pretrained(tmp_path)
    loaded = load(tmp_path)
    forms = {name: m.weight_form for name, m in matrices(loaded).items()}
    assert forms.pop("model.embed_tokens") == "fp32"
    assert set(forms.values()) == {"packed"}
    params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    held = params + sum(
        m.kernel.nbytes for m in matrices(loaded).values() if m.kernel is not None
    )
    hf_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    assert held == hf_bytes  # every weight once (HF's tied matrix is one parameter too)


# ---- options ---------------------------------------------------------------------------------


def test_bad_quantization_options_raise(tmp_path, tied_gguf):
    with pytest.raises(ValueError, match=r"quantization must be one of gguf, int8, 'none'.*'fp4'"):
        EngineArgs(quantization="fp4")
    with pytest.raises(ValueError, match=r"quantization must be one of gguf, int8.*'fp4'"):
        load(tied_gguf, "fp4")
    build_hf_model(gguf_case_config("llama")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'gguf' needs a .gguf model file.*" + tmp_path.name):
        load(tmp_path, "gguf")
    with pytest.raises(ValueError, match="runs on CPU only, not on cuda"):
        load_model(str(tied_gguf), torch.float32, torch.device("cuda"), TorchAttentionImpl,
                   quantization="gguf")
    with pytest.raises(ValueError, match="computes in float32, got dtype torch.bfloat16"):
        load_model(str(tied_gguf), torch.bfloat16, CPU, TorchAttentionImpl,
                   quantization="int8")


def test_quantization_cli_flag():
    from v1.entrypoints.openai.api_server import engine_args_from, make_parser

    parser = make_parser()
    for value in ("gguf", "none"):
        args = engine_args_from(parser, parser.parse_args(["--quantization", value]))
        assert dataclasses.asdict(args)["quantization"] == value
