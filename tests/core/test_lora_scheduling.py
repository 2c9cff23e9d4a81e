"""LoRA in the core: the block hash is keyed by the adapter, and a step never holds more
distinct adapters than max_loras (vLLM's rule: a waiting request of another adapter waits)."""

from tests.core.test_scheduler import drain
from tests.core.utils import fake_model_output, make_request, make_scheduler
from v1.core.kv_cache_utils import make_block_hasher
from v1.lora.request import LoRARequest
from v1.request import Request
from v1.sampling_params import SamplingParams

LORA1 = LoRARequest("a", 1, "/a")
LORA2 = LoRARequest("b", 2, "/b")


def _hashes(lora: LoRARequest | None, salt: str | None = None) -> list[bytes]:
    request = Request(
        "r", list(range(12)), SamplingParams(), cache_salt=salt,
        block_hasher=make_block_hasher(4), lora_request=lora,
    )
    return request.block_hashes


def test_block_hashes_differ_by_adapter():
    base, one, two = _hashes(None), _hashes(LORA1), _hashes(LORA2)
    assert len(base) == len(one) == len(two) == 3
    # Every block differs (the chain carries the first block's key), none shared.
    assert not set(base) & set(one) and not set(one) & set(two) and not set(base) & set(two)
    assert _hashes(LoRARequest("renamed", 1, "/a")) == one  # keyed by the id
    assert _hashes(LORA1, "salt") != one and _hashes(LORA1, "salt") != _hashes(None, "salt")


def test_a_removed_ids_next_adapter_hashes_anew():
    """The scheduler's `forget_lora` (remove_lora) bumps the id's generation: the id's
    blocks hash anew (its old ones are never hit), other ids' and the base's do not."""
    s = make_scheduler(max_loras=1)

    def hashes(lora: LoRARequest | None) -> list[bytes]:
        return Request("r", list(range(12)), SamplingParams(), block_hasher=s.block_hasher,
                       lora_request=lora).block_hashes

    before = {lora: hashes(lora) for lora in (LORA1, LORA2, None)}
    s.forget_lora(LORA1.lora_int_id)
    once = hashes(LORA1)
    assert not set(once) & set(before[LORA1])
    assert hashes(LORA2) == before[LORA2] and hashes(None) == before[None]
    s.forget_lora(LORA1.lora_int_id)
    assert len({*hashes(LORA1), *once, *before[LORA1]}) == 9


def _with_lora(prompt: int, lora: LoRARequest | None):
    request = make_request(prompt, max_tokens=3)
    request.lora_request = lora
    return request


def test_at_most_max_loras_adapters_per_step():
    s = make_scheduler(max_loras=1)
    a1, b2, c1, d0 = (_with_lora(6, LORA1), _with_lora(6, LORA2), _with_lora(6, LORA1),
                      _with_lora(6, None))
    for r in (a1, b2, c1, d0):
        s.add_request(r)
    out = s.schedule()
    # LORA2's request waits; the base request and LORA1's others go ahead of it.
    assert set(out.num_scheduled_tokens) == {a1.request_id, c1.request_id, d0.request_id}
    assert [r.lora_request for r in out.scheduled_new_reqs] == [LORA1, LORA1, None]
    s.update_from_output(out, fake_model_output(s, out))
    finished = drain(s)
    assert b2.request_id in finished
    s.check_integrity()


def test_without_lora_the_rule_is_off():
    s = make_scheduler()  # max_loras 0: LoRA off, no limit
    reqs = [_with_lora(6, lora) for lora in (LORA1, LORA2)]
    for r in reqs:
        s.add_request(r)
    assert set(s.schedule().num_scheduled_tokens) == {r.request_id for r in reqs}



def test_a_waiting_adapter_is_not_starved_by_one_kept_in_flight():
    """max_loras 1: a tenant adds another request of its adapter every step, so one of them
    always runs; the other adapter's request, queued behind the first, ages (passed over
    `prefix_aware_max_skips` steps) and then holds the step for its adapter until the
    tenant's running requests drain."""
    s = make_scheduler(max_loras=1)
    s.add_request(_with_lora(6, LORA1))
    waiting = _with_lora(6, LORA2)
    s.add_request(waiting)
    max_skips = s.admission.policy.max_skips
    steps = 0
    while True:
        s.add_request(_with_lora(6, LORA1))
        out = s.schedule()
        if waiting.request_id in out.num_scheduled_tokens:
            break
        assert {r.lora_request for r in s.running} == {LORA1}
        s.update_from_output(out, fake_model_output(s, out))
        steps += 1
        assert steps < 10 * max_skips, f"{waiting.request_id} never scheduled"
    assert steps >= max_skips  # it waited its turn first
    assert {r.lora_request for r in s.running} == {LORA2}
    s.update_from_output(out, fake_model_output(s, out))
    drain(s)
