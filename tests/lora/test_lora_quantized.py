"""LoRA over a quantized base: the adapter's delta (fp32) adds to the output of the GGUF
blocks' matmul, which stay blocks. The quantized base is lossy, so the comparison with the
fp32 base + adapter (itself equal to peft's merged model, tests/lora/test_lora.py) is vLLM's
rule: at the first divergence each token is in the other's top-5."""

import pytest

from tests.lora.conftest import LoRAFixture
from tests.lora.test_lora import PROMPTS, N
from tests.worker.test_model_archs import write_gguf
from tests.worker.test_quantization import gguf_tensor_type
from v1 import LLM, SamplingParams
from v1.lora.layers import LinearWithLoRA
from v1.lora.request import LoRARequest

PARAMS = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=5)


def _run(path: str, quantization: str, loras: list[LoRARequest | None]):
    with LLM(path, quantization=quantization, enable_lora=True, max_loras=2, max_lora_rank=8,
             multiprocess=False, num_gpu_blocks=64, block_size=4) as llm:
        outs = llm.generate(PROMPTS, PARAMS, lora_request=loras, use_tqdm=False)
        model = llm.llm_engine.client.engine_core.loaded.model
        forms = {m.base_layer.weight_form for m in model.modules()
                 if isinstance(m, LinearWithLoRA)}
    return [o.outputs[0] for o in outs], forms


def test_adapters_on_gguf_blocks(lora_fixture: LoRAFixture, tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    monkeypatch.setenv("V1_CACHE_DIR", str(tmp_path / "cache"))  # not the user's: a new file a run
    fx = lora_fixture
    path = tmp_path / "base.gguf"
    write_gguf(fx.hf_base, path, "llama", tensor_type=gguf_tensor_type())
    l1 = LoRARequest("adapter1", 1, str(fx.adapter_dirs[0]))
    l2 = LoRARequest("adapter2", 2, str(fx.adapter_dirs[1]))
    loras = [l1, l2, None]
    quantized, forms = _run(str(path), "gguf", loras)
    assert forms == {"q4_1"}  # the blocks run as stored: the adapter wraps, not replaces
    reference, _ = _run(str(path), "none", loras)  # the same weights in fp32
    base, _ = _run(str(path), "gguf", [None] * len(PROMPTS))
    for q, r in zip(quantized, reference, strict=True):
        for i, (qt, rt) in enumerate(zip(q.token_ids, r.token_ids)):
            if qt != rt:
                assert qt in r.logprobs[i] and rt in q.logprobs[i], (q.token_ids, r.token_ids)
                break
    # The adapters change the quantized model's tokens.
    assert quantized[0].token_ids != base[0].token_ids
    assert quantized[1].token_ids != base[1].token_ids
    assert quantized[2].token_ids == base[2].token_ids
