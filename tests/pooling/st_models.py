"""Tiny random-weight models saved as sentence-transformers folders, the references the pooling
tests compare v1 against (`SentenceTransformer(folder).encode`, `CrossEncoder(folder)`).

The tokenizer is a word-level one over "w0".."w199" (any text of those words tokenizes to
one id per word), wrapped by transformers and saved with the model: no download, and the
prompts' lengths are exact.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

NUM_WORDS = 200
VOCAB = 256
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<eos>"]


def word_tokenizer(template: str, pair_template: str | None = None) -> Any:
    """A fast tokenizer over the specials and w0..w199; `template` is the post-processor's
    single-text template ("$A <eos>", "[CLS] $A [SEP]")."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(NUM_WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=template, pair=pair_template,
        special_tokens=[(t, vocab[t]) for t in SPECIALS if t in template + (pair_template or "")],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="<eos>",
        cls_token="[CLS]", sep_token="[SEP]", model_max_length=512,
        # As BERT's tokenizers: a pair's second text gets token type 1.
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def random_text(rng: torch.Generator, num_words: int) -> str:
    ids = torch.randint(0, NUM_WORDS, (num_words,), generator=rng).tolist()
    return " ".join(f"w{i}" for i in ids)


def save_sentence_transformer(
    folder: Path,
    build_model: Callable[[], Any],
    tokenizer: Any,
    pooling_mode: str,
    normalize: bool,
    seed: int = 0,
) -> Path:
    """Build the transformers model (random weights, drawn wide: std 0.2), save it with the
    tokenizer, and save a SentenceTransformer of it (Transformer, Pooling, [Normalize])."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    hf_dir = save_hf_model(folder.parent / f"{folder.name}-hf", build_model, tokenizer, seed)
    transformer = Transformer(str(hf_dir))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def save_hf_model(
    folder: Path, build_model: Callable[[], Any], tokenizer: Any, seed: int = 0
) -> Path:
    """The transformers model with random weights drawn wide (std 0.2; norms around 1), so
    that outputs differ clearly between inputs, saved with the tokenizer."""
    torch.manual_seed(seed)
    model = build_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def qwen3_config(**overrides: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "pad_token_id": 0, **overrides,
    })


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "pad_token_id": 0,
        **overrides,
    })


def bert_config(**overrides: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256,
        "type_vocab_size": 2, "pad_token_id": 0, **overrides,
    })


def xlm_roberta_config(**overrides: Any) -> Any:
    from transformers import XLMRobertaConfig

    return XLMRobertaConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 258,
        "type_vocab_size": 1, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 3,
        **overrides,
    })
