"""A tiny random Llama saved as an HF folder and two random PEFT adapters of it (non-zero B),
with transformers + peft's merged models as the reference (built once per session)."""

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

VOCAB = 128


@dataclass
class LoRAFixture:
    base_dir: Path
    adapter_dirs: list[Path]
    hf_base: torch.nn.Module
    hf_merged: list[torch.nn.Module]  # one per adapter: PEFT's merge_and_unload

    def greedy(self, which: int | None, prompt: list[int], n: int) -> list[int]:
        """transformers' greedy tokens of the base (None) or merged adapter `which`."""
        model = self.hf_base if which is None else self.hf_merged[which]
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0,
            )
        return out[0, len(prompt):].tolist()


def _tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out_dir)


def _adapter(base, out_dir: Path, seed: int, **lora_kwargs) -> torch.nn.Module:
    """A random PEFT LoRA of `base` saved to `out_dir`; returns PEFT's merged model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**lora_kwargs))
    with torch.no_grad():  # B non-zero (PEFT starts it at 0): the adapter changes tokens
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    peft_model.save_pretrained(out_dir)
    return peft_model.merge_and_unload().eval()


@pytest.fixture(scope="session")
def lora_fixture(tmp_path_factory) -> LoRAFixture:
    pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora")
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # peaked logits: greedy is not decided by near-ties
        for p in base.parameters():
            p.normal_(0.0, 0.2)
    base_dir = root / "base"
    base.save_pretrained(base_dir)
    _tokenizer(base_dir)
    (base_dir / "generation_config.json").unlink(missing_ok=True)
    all_linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = [
        (root / "adapter1", dict(r=8, lora_alpha=16, target_modules=all_linear)),
        # Another rank, a subset of the projections, rsLoRA's scale.
        (root / "adapter2", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                  "down_proj"],
                                 use_rslora=True)),
    ]
    merged = [_adapter(base, d, 10 + i, **kw) for i, (d, kw) in enumerate(adapters)]
    return LoRAFixture(base_dir, [d for d, _ in adapters], base, merged)


def write_adapter_config(folder: Path, **changes) -> None:
    """Rewrite keys of a saved adapter's adapter_config.json."""
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
