"""LoRA adapters that misbehave must not hurt other rows, requests or the engine core: an
adapter evicted while its requests run is never re-read in a step (its folder may be gone);
non-finite weights are refused at load; a non-finite adapter in one slot leaves the other
rows' tokens exact (rows are selected, not masked with 0); an id reused after `remove_lora`
never hits the removed adapter's cached blocks."""

import math
import shutil

import pytest
import torch

from tests.lora.conftest import LoRAFixture
from tests.lora.test_lora import PARAMS, PROMPTS, N, _llm, _tokens
from v1.lora.request import LoRARequest

WEIGHTS = "adapter_model.safetensors"


def _want(fx: LoRAFixture, which: int | None, prompt: list[int]) -> list[int]:
    return fx.greedy(which, prompt, N)


def test_an_adapter_in_use_is_never_evicted_and_reread(lora_fixture, tmp_path):
    """max_cpu_loras 1: loading adapter 2 would evict adapter 1 while its request waits;
    adapter 1's folder is gone by then, so a re-read in the step would kill the engine."""
    fx = lora_fixture
    folder = tmp_path / "adapter1"
    shutil.copytree(fx.adapter_dirs[0], folder)
    l1 = LoRARequest("a1", 1, str(folder))
    l2 = LoRARequest("a2", 2, str(fx.adapter_dirs[1]))
    with _llm(fx, max_loras=1, max_cpu_loras=1) as llm:
        engine = llm.llm_engine
        engine.add_request("r1", PROMPTS[0], PARAMS, lora_request=l1)
        shutil.rmtree(folder)
        engine.add_request("r2", PROMPTS[1], PARAMS, lora_request=l2)
        engine.add_request("r3", PROMPTS[2], PARAMS, lora_request=l1)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        got = {r: o.outputs[0].token_ids for r, o in done.items()}
        assert got == {
            "r1": _want(fx, 0, PROMPTS[0]), "r2": _want(fx, 1, PROMPTS[1]),
            "r3": _want(fx, 0, PROMPTS[2]),
        }
        core = engine.client.engine_core
        core.check_integrity()
        # Both stayed loaded while in use (over max_cpu_loras); the next load trims them.
        assert set(core.model_runner.lora.loaded) == {1, 2}
        l3 = LoRARequest("a3", 3, str(fx.adapter_dirs[1]))
        llm.generate([PROMPTS[0]], PARAMS, lora_request=l3, use_tqdm=False)
        assert set(core.model_runner.lora.loaded) == {3}
        # Adapter 1's folder is gone: a new request naming it is refused when it arrives.
        with pytest.raises(ValueError, match="no adapter_config.json"):
            llm.generate([PROMPTS[0]], PARAMS, lora_request=l1, use_tqdm=False)


def _poisoned(fx: LoRAFixture, dst, key_part: str, value: float, dtype=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(fx.adapter_dirs[0], dst)
    tensors = load_file(dst / WEIGHTS)
    key = next(k for k in sorted(tensors) if key_part in k)
    t = tensors[key] if dtype is None else tensors[key].to(dtype)
    t.view(-1)[3] = value
    tensors[key] = t
    save_file(tensors, dst / WEIGHTS)
    return key


@pytest.mark.parametrize("key_part, value, dtype", [
    ("layers.0.self_attn.q_proj.lora_A", math.nan, None),
    ("layers.1.mlp.down_proj.lora_B", math.inf, None),
    ("layers.1.self_attn.v_proj.lora_A", 1e300, torch.float64),  # inf once in fp32
], ids=["nan", "inf", "overflows-fp32"])
def test_non_finite_weights_are_refused_at_load(lora_fixture, tmp_path, key_part, value, dtype):
    fx = lora_fixture
    key = _poisoned(fx, tmp_path / "bad", key_part, value, dtype)
    with _llm(fx) as llm:
        with pytest.raises(ValueError, match=rf"'bad'.*tensor '{key}' has non-finite values"):
            llm.llm_engine.add_lora(LoRARequest("bad", 5, str(tmp_path / "bad")))
        assert llm.llm_engine.list_loras() == set()


def test_a_non_finite_slot_leaves_other_rows_exact(lora_fixture):
    """Adapter 2's weights made NaN in memory (past the load check): its rows are garbage,
    adapter 1's rows and the base rows in the same steps keep their exact tokens, the base
    blocks they cached serve a later base request with the same tokens, and the blocks the
    NaN rows wrote are never found in the prefix cache."""
    fx = lora_fixture
    l1 = LoRARequest("a1", 1, str(fx.adapter_dirs[0]))
    l2 = LoRARequest("a2", 2, str(fx.adapter_dirs[1]))
    with _llm(fx) as llm:
        engine = llm.llm_engine
        engine.add_lora(l1)
        engine.add_lora(l2)
        manager = engine.client.engine_core.model_runner.lora
        for module in manager.loaded[2].modules.values():
            module.lora_a.fill_(math.nan)
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
        loras = [l1, None, l2]
        got = _tokens(llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False))
        assert got[0] == _want(fx, 0, PROMPTS[0])
        assert got[1] == _want(fx, None, PROMPTS[1])
        before = llm.get_stats().prefix_cache_hits
        again = _tokens(llm.generate([PROMPTS[1]], PARAMS, use_tqdm=False))
        assert llm.get_stats().prefix_cache_hits > before  # the base blocks were hit
        assert again[0] == _want(fx, None, PROMPTS[1])
        # The NaN rows' blocks were never left in the prefix cache: none is hit again.
        before = llm.get_stats().prefix_cache_hits
        llm.generate([PROMPTS[2]], PARAMS, lora_request=l2, use_tqdm=False)
        assert llm.get_stats().prefix_cache_hits == before
        engine.client.engine_core.check_integrity()


def test_an_id_reused_after_remove_lora_never_hits_the_removed_adapters_blocks(lora_fixture):
    fx = lora_fixture
    prompt = PROMPTS[2]
    first = LoRARequest("first", 1, str(fx.adapter_dirs[0]))
    second = LoRARequest("second", 1, str(fx.adapter_dirs[1]))  # the same id, another adapter
    with _llm(fx) as llm:
        engine = llm.llm_engine
        got = _tokens(llm.generate([prompt], PARAMS, lora_request=first, use_tqdm=False))
        assert got[0] == _want(fx, 0, prompt)
        assert engine.remove_lora(1)
        before = llm.get_stats().prefix_cache_hits
        got = _tokens(llm.generate([prompt], PARAMS, lora_request=second, use_tqdm=False))
        assert llm.get_stats().prefix_cache_hits == before
        assert got[0] == _want(fx, 1, prompt)
        # The id's new adapter caches and hits its own blocks.
        got = _tokens(llm.generate([prompt], PARAMS, lora_request=second, use_tqdm=False))
        assert llm.get_stats().prefix_cache_hits > before and got[0] == _want(fx, 1, prompt)
        engine.client.engine_core.check_integrity()


@pytest.mark.slow
def test_eviction_under_a_deleted_folder_on_the_default_model(
    default_model_path, hf_model, tmp_path
):
    """SmolLM2 (the default GGUF model) with two PEFT adapters of it: with one adapter kept
    in memory, adapter a's folder deleted after its request arrived, and adapter b loaded
    behind it, the engine serves all three requests, with the tokens of a run that kept
    both adapters in memory."""
    from tests.lora.conftest import _adapter
    from v1 import LLM

    all_linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    dirs = [tmp_path / "a", tmp_path / "b"]
    for seed, folder in enumerate(dirs):
        _adapter(hf_model, folder, 20 + seed, r=8, lora_alpha=16, target_modules=all_linear)
    a = LoRARequest("a", 1, str(dirs[0]))
    b = LoRARequest("b", 2, str(dirs[1]))
    prompts = [[1, 504, 3458, 314, 260, 3575, 282, 4649, 47], [1, 2683, 359, 346, 47]]
    args = dict(enable_lora=True, max_loras=1, max_lora_rank=8, multiprocess=False,
                num_gpu_blocks=64, block_size=16, max_model_len=1024)
    with LLM(str(default_model_path), max_cpu_loras=2, **args) as llm:
        want = _tokens(llm.generate([prompts[0], prompts[1], prompts[1]], PARAMS,
                                    lora_request=[a, b, a], use_tqdm=False))
        base = _tokens(llm.generate([prompts[0]], PARAMS, use_tqdm=False))
    assert want[0] != base[0]  # the adapter changes the tokens
    with LLM(str(default_model_path), max_cpu_loras=1, **args) as llm:
        engine = llm.llm_engine
        engine.add_request("r0", prompts[0], PARAMS, lora_request=a)
        shutil.rmtree(dirs[0])
        engine.add_request("r1", prompts[1], PARAMS, lora_request=b)
        engine.add_request("r2", prompts[1], PARAMS, lora_request=a)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step()
                         if o.finished})
        engine.client.engine_core.check_integrity()
    assert [done["r0"], done["r1"], done["r2"]] == want
