"""`prompt_logprobs` (vLLM's): every prompt token but the first gets its raw logprob, its rank
and the top-k, against transformers' log-softmax of the same prompt."""

import pytest
import torch

from v1 import LLM, SamplingParams
from v1.core.sched.output import SchedulerOutput
from v1.outputs import ModelRunnerOutput, PromptLogprobs

PROMPT = (
    "Write a short poem about the sea, the wind and the sky. Make every line rhyme, and keep "
    "it cheerful: it is for a child's birthday card, so no storms or shipwrecks, please."
)
TOP_K = 3
# fp32 on CPU, but other kernels than HF's (packed head, paged attention): sums differ in order.
ATOL = 1e-3


def make_llm(default_model, **kwargs) -> LLM:
    kwargs = {"num_gpu_blocks": 64, "max_model_len": 256, **kwargs}
    return LLM(loaded_model=default_model, **kwargs)


@pytest.fixture(scope="module")
def llm(default_model):
    llm = make_llm(default_model)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf_logprobs(hf_model):
    """transformers' log-softmax at every position of a prompt: [len(prompt), vocab]."""

    def run(prompt_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt_ids])).logits[0]
        return logits.float().log_softmax(dim=-1)

    return run


def assert_matches_hf(prompt_ids: list[int], got: PromptLogprobs | None, ref: torch.Tensor, k: int):
    assert got is not None and len(got) == len(prompt_ids)
    assert got[0] is None  # the first token has nothing before it
    for pos in range(1, len(prompt_ids)):
        entry, row, token = got[pos], ref[pos - 1], prompt_ids[pos]
        assert entry is not None
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=ATOL), pos
        # The prompt token keeps its own rank unless it is among the top k (then ranked there).
        top_ids = row.topk(k).indices.tolist()
        expected_rank = top_ids.index(token) + 1 if token in top_ids else (
            int((row > row[token]).sum()) + 1
        )
        assert entry[token].rank == expected_rank, pos
        assert set(entry) == {token, *top_ids}, pos
        for rank, tid in enumerate(top_ids, 1):
            assert entry[tid].logprob == pytest.approx(row[tid].item(), abs=ATOL)
            assert entry[tid].rank == rank
        assert all(lp.decoded_token is not None for lp in entry.values())


def test_prompt_logprobs_match_hf(llm, hf_logprobs) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=TOP_K))[0]
    assert_matches_hf(out.prompt_token_ids, out.prompt_logprobs, hf_logprobs(out.prompt_token_ids),
                      TOP_K)


def test_prompt_logprobs_zero_gives_the_prompt_token_only(llm, hf_logprobs) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ref = hf_logprobs(out.prompt_token_ids)
    assert out.prompt_logprobs is not None
    for pos, entry in enumerate(out.prompt_logprobs[1:], 1):
        token = out.prompt_token_ids[pos]
        assert entry is not None and list(entry) == [token]
        assert entry[token].rank == int((ref[pos - 1] > ref[pos - 1, token]).sum()) + 1


def test_chunked_prefill_and_a_batch_give_the_same_values(default_model, hf_logprobs) -> None:
    # Chunks of 7 tokens, cut across blocks; beside a request that asks for none and one that
    # asks for more.
    llm = make_llm(default_model, max_num_batched_tokens=16, long_prefill_token_threshold=7)
    outs = llm.generate(
        [PROMPT, "The capital of France is", PROMPT],
        [
            SamplingParams(max_tokens=3, prompt_logprobs=TOP_K),
            SamplingParams(max_tokens=3),
            SamplingParams(max_tokens=3, prompt_logprobs=TOP_K + 2),
        ],
    )
    ref = hf_logprobs(outs[0].prompt_token_ids)
    assert_matches_hf(outs[0].prompt_token_ids, outs[0].prompt_logprobs, ref, TOP_K)
    assert outs[1].prompt_logprobs is None
    assert_matches_hf(outs[2].prompt_token_ids, outs[2].prompt_logprobs, ref, TOP_K + 2)
    llm.shutdown()


def test_a_would_be_prefix_hit_still_gets_every_prompt_logprob(llm, hf_logprobs) -> None:
    plain = SamplingParams(max_tokens=1)
    asking = SamplingParams(max_tokens=1, prompt_logprobs=1)
    llm.generate(PROMPT, plain)
    assert llm.generate(PROMPT, plain)[0].num_cached_tokens > 0  # the prompt is cached
    out = llm.generate(PROMPT, asking)[0]
    assert out.num_cached_tokens == 0  # computed again, as vLLM
    assert_matches_hf(out.prompt_token_ids, out.prompt_logprobs, hf_logprobs(out.prompt_token_ids),
                      1)


def test_runner_returns_nothing_extra_when_no_request_asks(llm, monkeypatch) -> None:
    runner = llm.llm_engine.client.engine_core.model_runner
    execute = runner.execute_model
    outputs: list[ModelRunnerOutput] = []

    def record(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        outputs.append(execute(scheduler_output))
        return outputs[-1]

    monkeypatch.setattr(runner, "execute_model", record)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2))[0]
    assert out.prompt_logprobs is None
    assert outputs and all(not o.prompt_logprobs_dict for o in outputs)
    llm.generate(PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert sum(bool(o.prompt_logprobs_dict) for o in outputs) == 1


@pytest.mark.parametrize("k", [-1, 21, 1.5])
def test_prompt_logprobs_out_of_range_is_refused(llm, k) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate(PROMPT, SamplingParams(prompt_logprobs=k))


def test_preempted_requests_report_their_prompt_logprobs_once(default_model, llm) -> None:
    # 8 blocks of 16 tokens for 4 requests of ~60 tokens each, prefilled in chunks of 16:
    # requests are preempted mid-prompt and mid-output, and recompute from their first token.
    prompts = [f"{i}. {PROMPT}" for i in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    tiny = make_llm(default_model, num_gpu_blocks=8, max_model_len=128, max_num_batched_tokens=16)
    outs = tiny.generate(prompts, params)
    assert tiny.get_stats().num_preemptions > 0
    tiny.shutdown()
    for out, ref in zip(outs, llm.generate(prompts, params), strict=True):
        assert out.prompt_logprobs is not None and ref.prompt_logprobs is not None
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs)
        for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
            assert got is not None and want is not None and got.keys() == want.keys()
            for tid, lp in got.items():
                assert lp.logprob == pytest.approx(want[tid].logprob, abs=ATOL)
