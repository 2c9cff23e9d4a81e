"""Models named by hub id, found in a local Hugging Face cache, and generation_config.json's
sampling defaults (vLLM's `generation_config="auto"` / `"vllm"`), offline and over HTTP.

The cache is a temporary one in the hub's own layout, `models--org--name/` with `blobs/`
(files named by their hash), `snapshots/<commit>/` (links into blobs) and `refs/` (a branch
or tag's commit), holding two revisions of a small random Llama: `main` and the tag `v2`,
with different weights and different generation_config.json files.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from v1 import LLM, SamplingParams
from v1.engine.launch import engine_start_method
from v1.hub import hub_cache_dir
from v1.models.model_files import resolve_model

REPO = "tiny-org/tiny-llama"
COMMIT_MAIN, COMMIT_V2 = "a" * 40, "b" * 40
# Greedy, so that outputs can be checked against transformers; max_new_tokens differs from
# vLLM's default of 16 (and between the revisions), so each test sees which defaults ran.
GEN_MAIN = {"temperature": 0.0, "max_new_tokens": 5, "top_p": 0.9, "top_k": 20}
GEN_V2 = {"temperature": 0.0, "max_new_tokens": 3}
PROMPT = [5, 17, 42, 9, 100, 7]
VOCAB = 256


def _tokenizer(out_dir: Path) -> None:
    """A word-level tokenizer ("w0" .. "w255", no EOS) with a chat template, for chat
    requests."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out_dir)


def _model(out_dir: Path, seed: int, generation_config: dict | None):
    """A small random Llama (no EOS: outputs run to max_tokens) saved as safetensors, with
    tokenizer files and `generation_config` as its generation_config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # peaked logits: greedy is not decided by near-ties
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    hf.save_pretrained(out_dir)
    _tokenizer(out_dir)
    gen_file = out_dir / "generation_config.json"
    gen_file.unlink(missing_ok=True)  # transformers writes its own
    if generation_config is not None:
        gen_file.write_text(json.dumps(generation_config))
    return hf


def _greedy(hf, n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(PROMPT):].tolist()


def add_snapshot(cache: Path, repo_id: str, commit: str, files: Path, refs: list[str]) -> Path:
    """`files` as the snapshot `commit` of `repo_id` in the hub cache `cache`, as
    `hf download` leaves it: content in blobs/, links in snapshots/<commit>/, each ref in
    refs/ naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(files.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


class Models:
    def __init__(self, root: Path) -> None:
        self.main_dir, self.v2_dir = root / "main", root / "v2"
        hf_main = _model(self.main_dir, 0, GEN_MAIN)
        hf_v2 = _model(self.v2_dir, 1, GEN_V2)
        self.greedy_main = _greedy(hf_main, 16)
        self.greedy_v2 = _greedy(hf_v2, 16)
        assert self.greedy_main[:3] != self.greedy_v2[:3]  # the revisions are told apart
        self.cache = root / "hub"
        add_snapshot(self.cache, REPO, COMMIT_MAIN, self.main_dir, ["main"])
        add_snapshot(self.cache, REPO, COMMIT_V2, self.v2_dir, ["v2"])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return Models(tmp_path_factory.mktemp("hub_models"))


@pytest.fixture
def hub_cache(models: Models, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary cache as $HF_HUB_CACHE (engine processes inherit the environment)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(models.cache))
    return models.cache


def _tokens(llm: LLM, params: SamplingParams | None = None) -> list[int]:
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


# ---- hub ids ---------------------------------------------------------------------------------


def test_hub_id_loads_from_the_local_cache(models: Models, hub_cache: Path) -> None:
    """`LLM("org/name")` loads the cached snapshot of main, in an engine process, and goes by
    the id; its generation_config.json applies (5 greedy tokens)."""
    assert engine_start_method().name == "fork"  # the engine process sees HF_HUB_CACHE
    assert resolve_model(REPO) == (
        hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT_MAIN
    ).resolve()
    with LLM(REPO, max_model_len=64, num_gpu_blocks=16) as llm:
        assert llm.llm_engine.model_name == REPO
        assert _tokens(llm) == models.greedy_main[:5]


def test_revision_picks_the_snapshot(models: Models, hub_cache: Path) -> None:
    """`revision` as vLLM's: a tag or a commit; its snapshot's weights and defaults load."""
    llm = LLM(REPO, revision="v2", multiprocess=False, max_model_len=64, num_gpu_blocks=16)
    assert _tokens(llm) == models.greedy_v2[:3]
    llm = LLM(REPO, revision=COMMIT_MAIN, multiprocess=False, max_model_len=64,
              num_gpu_blocks=16)
    assert _tokens(llm) == models.greedy_main[:5]
    with pytest.raises(ValueError, match="at revision 'no-such-tag'") as e:
        resolve_model(REPO, revision="no-such-tag")
    assert f"hf download {REPO} --revision no-such-tag" in str(e.value)


def test_uncached_id_fails_at_once_saying_where_it_looked(
    models: Models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An id not in the cache: a ValueError naming the cache and the command that fetches
    it. HF_HOME counts when HF_HUB_CACHE is not set (its hub/ is the cache)."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert hub_cache_dir() == tmp_path / "hub"
    with pytest.raises(ValueError) as e:
        LLM("tiny-org/not-cached")
    message = str(e.value)
    assert str(tmp_path / "hub") in message
    assert "hf download tiny-org/not-cached" in message and "not a local path" in message

    # Under HF_HOME, the same layout is found.
    add_snapshot(tmp_path / "hub", REPO, COMMIT_MAIN, models.main_dir, ["main"])
    assert resolve_model(REPO).parent.name == "snapshots"

    # What is neither a path nor an "org/name" id keeps its error.
    with pytest.raises(ValueError, match=r"not found \(expected a .gguf file or an HF dir"):
        resolve_model("no/such/model/dir")


def test_serve_cli_resolves_hub_ids(hub_cache: Path, capsys: pytest.CaptureFixture) -> None:
    """`python -m v1 serve org/name --revision R --generation-config vllm`: the command line's
    model is resolved as it is parsed (the same function `main` calls), and an uncached one
    ends the command with the message (exit status 2) before anything starts."""
    from v1.entrypoints.openai.api_server import engine_args_from, make_parser

    parser = make_parser()
    args = parser.parse_args([REPO, "--revision", "v2", "--generation-config", "vllm"])
    engine_args = engine_args_from(parser, args)
    assert (engine_args.model, engine_args.revision) == (REPO, "v2")
    assert engine_args.generation_config == "vllm"

    with pytest.raises(SystemExit) as e:
        engine_args_from(parser, parser.parse_args(["tiny-org/not-cached"]))
    assert e.value.code == 2
    assert "hf download tiny-org/not-cached" in capsys.readouterr().err


# ---- generation_config.json defaults ---------------------------------------------------------


def test_generation_config_defaults_for_llm(
    models: Models, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`generate` without SamplingParams uses generation_config.json's defaults (greedy, 5
    tokens), and logs them; given SamplingParams are used as they are; "vllm" turns the
    defaults off (16 tokens, vLLM's default); a directory may hold the defaults instead."""
    opts = {"multiprocess": False, "max_model_len": 64, "num_gpu_blocks": 16}
    with caplog.at_level("INFO", logger="v1"):
        llm = LLM(str(models.main_dir), **opts)
    assert "default sampling parameters" in caplog.text and "'max_tokens': 5" in caplog.text
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (
        0.0, 0.9, 20, 5,
    )
    assert _tokens(llm) == models.greedy_main[:5]
    assert len(_tokens(llm, SamplingParams(temperature=0.0, max_tokens=7))) == 7
    chat = llm.chat([{"role": "user", "content": "w5 w17 w42"}], use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) == 5

    llm = LLM(str(models.main_dir), generation_config="vllm", **opts)
    assert llm.get_default_sampling_params() == SamplingParams()
    assert len(_tokens(llm)) == 16

    elsewhere = tmp_path / "gen"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps(GEN_V2))
    llm = LLM(str(models.main_dir), generation_config=str(elsewhere), **opts)
    assert _tokens(llm) == models.greedy_main[:3]
    with pytest.raises(ValueError, match="generation_config must be"):
        LLM(str(models.main_dir), generation_config="no-such-dir", **opts)

    # vLLM's override_generation_config: its keys over the file's, or alone under "vllm".
    llm = LLM(str(models.main_dir), override_generation_config={"max_new_tokens": 4}, **opts)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 4)
    assert _tokens(llm) == models.greedy_main[:4]
    llm = LLM(str(models.main_dir), generation_config="vllm",
              override_generation_config={"top_k": 3}, **opts)
    assert llm.get_default_sampling_params() == SamplingParams(top_k=3)
    with pytest.raises(ValueError, match="override_generation_config must be a dict of"):
        LLM(str(models.main_dir), override_generation_config={"max_tokens": 4}, **opts)
    # A bad value fails the start, not every request that leaves the field out.
    with pytest.raises(ValueError, match=r"are not valid: temperature must be"):
        LLM(str(models.main_dir), override_generation_config={"temperature": "hot"}, **opts)


@pytest.mark.slow
def test_served_hub_id_with_generation_defaults(models: Models, tmp_path: Path) -> None:
    """`python -m v1 serve org/name`: served under its id; a request that leaves out
    max_tokens and temperature gets generation_config's (5 greedy tokens), one that sets
    max_tokens gets its own, for completions and chat alike. The defaults merge field by
    field: one that sets only max_tokens keeps the file's temperature (greedy; a sample at
    temperature 1 would be transformers' greedy tokens with odds of ~1e-17), one that sets
    only temperature keeps its max_tokens."""
    from tests.entrypoints.test_openai_server import free_port, wait_healthy

    port = free_port()
    log = tmp_path / "server.log"
    env = {**os.environ, "HF_HUB_CACHE": str(models.cache)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "v1", "serve", REPO, "--port", str(port),
             "--max-model-len", "64", "--num-gpu-blocks", "16", "--uvicorn-log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [REPO]

        def complete(**fields) -> dict:
            body = {"model": REPO, "prompt": PROMPT, **fields}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()

        def greedy_words(n: int) -> list[str]:
            return [f"w{t}" for t in models.greedy_main[:n]]

        default = complete()
        assert default["usage"]["completion_tokens"] == 5
        # Greedy (temperature 0 from generation_config): transformers' tokens.
        assert default["choices"][0]["text"].split() == greedy_words(5)
        longer = complete(max_tokens=8)
        assert longer["usage"]["completion_tokens"] == 8
        assert longer["choices"][0]["text"].split() == greedy_words(8)
        assert complete(max_tokens=2)["usage"]["completion_tokens"] == 2
        assert complete(temperature=0.0)["usage"]["completion_tokens"] == 5

        chat = httpx.post(
            f"{url}/v1/chat/completions", timeout=60,
            json={"model": REPO, "messages": [{"role": "user", "content": "w5 w17 w42"}]},
        ).json()
        assert chat["usage"]["completion_tokens"] == 5, chat
        assert chat["choices"][0]["finish_reason"] == "length"
    finally:
        proc.kill()
        proc.wait()
    assert not re.search(r"Traceback", log.read_text()), log.read_text()
