"""The data-parallel router keys prefixes by LoRA adapter as the cores' KV caches do: the
same prompt under another adapter (or the base) is a new prefix, not a cached one."""

from tests.engine.test_data_parallel_router import BLOCK, NO_GUARD, tokens
from v1.core.kv_cache_utils import make_block_hasher
from v1.engine.dp_router import DPRouter
from v1.lora.request import LoRARequest
from v1.request import Request
from v1.sampling_params import SamplingParams


def test_router_hashes_are_the_kv_caches_per_adapter() -> None:
    router = DPRouter(2, BLOCK)
    prompt = tokens(1, 3 * BLOCK + 5)
    for lora_id, salt in ((None, None), (1, None), (2, "tenant")):
        lora = None if lora_id is None else LoRARequest(f"l{lora_id}", lora_id, "/x")
        request = Request("r", prompt, SamplingParams(), cache_salt=salt,
                          block_hasher=make_block_hasher(BLOCK), lora_request=lora)
        assert router.block_hashes(prompt, salt, lora_id) == request.block_hashes
    assert router.block_hashes(prompt, None, 1)[0] != router.block_hashes(prompt)[0]


def test_adapter_separates_affinity() -> None:
    """Another adapter (or the base) finds no cached prefix: a new prefix, given a home."""
    router = DPRouter(2, BLOCK, guard=NO_GUARD)
    prompt = tokens(3, 4 * BLOCK)
    router.route(prompt, data_parallel_rank=0, lora_int_id=1)
    assert router.route(prompt, lora_int_id=1).reason == "affinity"
    assert router.route(prompt, lora_int_id=2).reason == "home"
    assert router.route(prompt).reason == "home"
