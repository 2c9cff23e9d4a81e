"""ModelRunner driven by hand-made SchedulerOutputs on the real default model."""

import torch

from tests.worker.step_costs import cheap_rows
from v1.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from v1.models.loader import LoadedModel
from v1.outputs import ModelRunnerOutput, TokenLogprobs
from v1.sampling_params import SamplingParams
from v1.worker.model_runner import ModelRunner

BLOCK_SIZE = 16
NUM_BLOCKS = 4
PROMPT = [504, 3575, 282, 4649, 314]  # any token ids will do


def make_runner(
    loaded: LoadedModel, speculative_config: SpeculativeConfig | None = None
) -> ModelRunner:
    runner = ModelRunner(
        loaded,
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS),
        torch.device("cpu"),
        torch.float32,
        speculative_config,
    )
    runner.initialize_kv_cache(NUM_BLOCKS)
    return runner


def prefill(
    runner: ModelRunner,
    req_id: str,
    params: SamplingParams,
    block_id: int,
    finished: frozenset[str] = frozenset(),
) -> ModelRunnerOutput:
    """One step that prefills PROMPT for a new request (after dropping `finished` ones)."""
    new = NewRequestData(req_id, PROMPT, params, [block_id], num_computed_tokens=0)
    out = SchedulerOutput(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={req_id: len(PROMPT)},
        total_num_scheduled_tokens=len(PROMPT),
        finished_req_ids=set(finished),
        preempted_req_ids=set(),
    )
    return runner.execute_model(out)


def only_logprobs(out: ModelRunnerOutput) -> TokenLogprobs:
    assert out.logprobs is not None and out.logprobs[0] is not None
    (lp,) = out.logprobs[0]
    return lp


def test_reused_req_id_is_sampled_with_its_new_params(default_model):
    seeded = SamplingParams(temperature=2.0, seed=1, logprobs=5)
    expected = prefill(make_runner(default_model), "a", seeded, block_id=0)

    runner = make_runner(default_model)
    greedy = prefill(runner, "a", SamplingParams(temperature=0.0), block_id=0)
    # The seeded draw must differ from greedy, or this test could not see a stale greedy row.
    assert greedy.sampled_token_ids != expected.sampled_token_ids
    # "a" finished; a new request reuses its id (and its batch row) with other params.
    reused = prefill(runner, "a", seeded, block_id=1, finished=frozenset({"a"}))
    assert reused.sampled_token_ids == expected.sampled_token_ids
    assert only_logprobs(reused) == only_logprobs(expected)


def test_logprobs_are_raw_before_min_tokens_masking(default_model):
    runner = make_runner(default_model)
    raw = only_logprobs(prefill(runner, "a", SamplingParams(temperature=0.0, logprobs=5), 0))
    top_id = raw.token_ids[1]
    # The most likely token is a stop token that min_tokens forbids sampling now.
    params = SamplingParams(temperature=0.0, logprobs=5, min_tokens=1, stop_token_ids=[top_id])
    masked = only_logprobs(prefill(runner, "b", params, 1, finished=frozenset({"a"})))
    # The runner-up is sampled, but reported with its rank and logprob in the raw logits...
    assert masked.token_ids[0] == raw.token_ids[2]
    assert masked.sampled_rank == 2
    # ...and the top-5 still holds the stop token with its raw (finite) logprob.
    assert masked.token_ids[1:] == raw.token_ids[1:]
    assert masked.logprobs == [raw.logprobs[2], *raw.logprobs[1:]]


def test_suffix_drafts_are_scoped_by_salt_until_finished_even_when_preempted(default_model):
    """The runner gives the proposer each request's scope (cache_salt, adapter id) when it
    joins; a preemption keeps it (the request comes back), a finish, even while preempted,
    drops it."""
    runner = make_runner(default_model, SpeculativeConfig("suffix", num_speculative_tokens=2))
    runner.drafter.costs = cheap_rows()  # drafts priced to pay: the proposer is asked
    new = NewRequestData("a", PROMPT, SamplingParams(temperature=0.0), [0], 0,
                         cache_salt="tenant-a")
    runner.execute_model(SchedulerOutput([new], CachedRequestData(), {"a": len(PROMPT)},
                                         len(PROMPT), set(), set()))
    proposer = runner.drafter.proposer
    assert proposer._scopes == {"a": ("tenant-a", None)}
    assert proposer._requests["a"].scope == ("tenant-a", None)
    runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, set(), {"a"}))
    assert proposer._scopes == {"a": ("tenant-a", None)} and "a" not in proposer._requests
    runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, {"a"}, set()))
    assert proposer._scopes == {} and not proposer._cached  # a preempted one publishes nothing
