"""Embeddings per second: v1's pooling engine against sentence-transformers, same model, same
weights (fp32), same threads, in one run.

Workload: `--num-texts` texts (default 256) of `--min-tokens`..`--max-tokens` tokens (default
64-256, uniform, fixed seed), windows of words from bench/data/perplexity.txt grown until
the model's tokenizer gives the drawn length.

Models:
- `--model` (default: the default model, SmolLM2-135M-Instruct, its float weights from the
  GGUF's converted copy) as a decoder-only embedder: last-token pooling, normalized (vLLM's
  defaults for a decoder; sentence-transformers built with Pooling("lasttoken") + Normalize
  on the same directory);
- with `--encoder`, also a BERT-base-sized encoder (12 layers, hidden 768, random weights,
  the same tokenizer), saved as a sentence-transformers folder with mean pooling and
  Normalize: the encoder-only attention path.

Per model, `--repeat` rounds; each round times v1 (`LLM.embed`, the engine in this process)
and sentence-transformers (`encode`, batch `--st-batch-size`) on all texts, one after the
other (alternating which goes first), so both see the same phase of a shared machine.
Reported: the medians, embeddings per second, the ratio v1 / sentence-transformers of the
rates (`ratio`, wall time), the same ratio in CPU seconds of this process (`cpu_ratio`: the
work done, which other tenants of a shared machine disturb far less than the wall time),
and the lowest cosine between the two embeddings of a text (a check that both computed the
same thing).

    .venv/bin/python bench/bench_embed.py --threads 2 --encoder --out bench/results
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import add_model_args, environment, load, make_llm, print_table, setup_threads

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def make_texts(tokenizer: Any, num: int, low: int, high: int, seed: int) -> list[str]:
    """`num` texts of a drawn length each in [low, high] tokens (by `tokenizer`)."""
    words = TEXT.read_text().split()
    rng = random.Random(seed)
    texts = []
    for _ in range(num):
        target = rng.randint(low, high)
        start = rng.randrange(len(words))
        n = target // 2
        while True:
            chosen = [words[(start + i) % len(words)] for i in range(n)]
            text = " ".join(chosen)
            length = len(tokenizer(text)["input_ids"])
            if length >= target:
                break
            n += max(1, (target - length) // 2)
        texts.append(text)
    return texts


def st_decoder(model_dir: Path) -> Any:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    # Plain text, as v1 tokenizes a prompt: sentence-transformers would otherwise render each
    # text through the model's chat template (a conversation), other tokens than v1's.
    transformer = Transformer(
        str(model_dir),
        modality_config={"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        module_output_name="token_embeddings",
    )
    tokenizer = transformer.tokenizer
    if tokenizer.pad_token is None:  # a decoder's tokenizer may have none; batches need one
        tokenizer.pad_token = tokenizer.eos_token
    pooling = Pooling(transformer.get_embedding_dimension(), "lasttoken")
    return SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu")


def save_encoder(folder: Path, tokenizer_dir: Path) -> Path:
    """A BERT-base-sized encoder (random weights) as a sentence-transformers folder."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = None  # plain text (see st_decoder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512,
                        pad_token_id=tokenizer.pad_token_id)
    hf_dir = folder.parent / "encoder-hf"
    BertModel(config).save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    transformer = Transformer(str(hf_dir))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), "mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def measure(name: str, llm: Any, st: Any, texts: list[str], args: argparse.Namespace
            ) -> dict[str, Any]:
    times: dict[str, list[tuple[float, float]]] = {"v1": [], "st": []}
    outputs: dict[str, Any] = {}

    def run(which: str) -> None:
        if which == "v1":
            # Cold, as sentence-transformers is: the decoder's prefix cache (last-token
            # pooling keeps it) would otherwise serve the texts of the previous round.
            assert llm.reset_prefix_cache()
        wall, cpu = time.perf_counter(), time.process_time()
        if which == "v1":
            outs = llm.embed(texts, use_tqdm=False)
            outputs[which] = np.array([o.outputs.embedding for o in outs])
        else:
            outputs[which] = st.encode(texts, batch_size=args.st_batch_size,
                                       convert_to_numpy=True)
        times[which].append((time.perf_counter() - wall, time.process_time() - cpu))

    for i in range(args.repeat):
        for which in ("v1", "st") if i % 2 == 0 else ("st", "v1"):
            run(which)
    ours, ref = outputs["v1"], outputs["st"]
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    v1_t, st_t = (statistics.median(w for w, _ in times[k]) for k in ("v1", "st"))
    v1_cpu, st_cpu = (statistics.median(c for _, c in times[k]) for k in ("v1", "st"))
    return {
        "model": name, "texts": len(texts),
        "v1_s": [w for w, _ in times["v1"]], "st_s": [w for w, _ in times["st"]],
        "v1_cpu_s": [c for _, c in times["v1"]], "st_cpu_s": [c for _, c in times["st"]],
        "v1_emb_s": len(texts) / v1_t, "st_emb_s": len(texts) / st_t, "ratio": st_t / v1_t,
        "cpu_ratio": st_cpu / v1_cpu, "min_cosine": float(cos.min()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="rounds (medians reported)")
    parser.add_argument("--st-batch-size", type=int, default=32,
                        help="sentence-transformers' encode batch size (its default: 32)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--encoder", action="store_true",
                        help="also a BERT-base-sized encoder (random weights)")
    parser.add_argument("--out", default=None, help="directory for embed.json")
    args = parser.parse_args()
    setup_threads(args)

    from v1.models.gguf_cache import hf_checkpoint_dir

    loaded = load(args.model, "none")  # float weights: what sentence-transformers runs
    texts = make_texts(loaded.tokenizer, args.num_texts, args.min_tokens, args.max_tokens,
                       args.seed)
    num_tokens = sum(len(loaded.tokenizer(t)["input_ids"]) for t in texts)
    engine_kwargs: dict[str, Any] = {"runner": "pooling"}
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    results = []
    with make_llm(loaded, **engine_kwargs) as llm:
        results.append(measure(f"{loaded.model_name} (last token)", llm,
                               st_decoder(hf_checkpoint_dir(loaded.model_path)), texts, args))
    del loaded
    if args.encoder:
        from sentence_transformers import SentenceTransformer

        from v1 import LLM

        with tempfile.TemporaryDirectory() as tmp:
            folder = save_encoder(Path(tmp) / "encoder", load_model_dir(args.model))
            with LLM(str(folder), multiprocess=False, **engine_kwargs) as enc:
                results.append(measure("BERT-base size, random (mean)", enc,
                                       SentenceTransformer(str(folder), device="cpu"), texts,
                                       args))

    print_table(
        ["model", "v1 emb/s", "sentence-transformers emb/s", "ratio", "cpu ratio",
         "min cosine"],
        [[r["model"], r["v1_emb_s"], r["st_emb_s"], f"{r['ratio']:.2f}x",
          f"{r['cpu_ratio']:.2f}x", f"{r['min_cosine']:.5f}"] for r in results],
    )
    result = {"num_texts": len(texts), "num_tokens": num_tokens,
              "token_range": [args.min_tokens, args.max_tokens], "results": results,
              "environment": environment(), "argv": sys.argv[1:]}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "embed.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


def load_model_dir(model: str | None) -> Path:
    from v1.models.model_files import hf_dir_of, resolve_model

    return hf_dir_of(resolve_model(model))


if __name__ == "__main__":
    main()
