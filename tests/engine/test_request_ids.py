"""Request identity: the caller's id is the external one; the frontend gives every request an
internal id unique for the engine's life, which is all the engine core ever sees. So an id
aborted and reused at once (while a step is in flight, or while outputs of the old request
are still on their way) never mixes two requests."""

import pytest

from tests.engine.mp_utils import PROMPTS, SMALL_ENGINE
from v1 import LLM, SamplingParams
from v1.engine.llm_engine import LLMEngine
from v1.engine.output_processor import OutputProcessor
from v1.engine.processor import Processor
from v1.outputs import EngineCoreOutput, RequestOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)


def test_processor_keeps_the_callers_id_as_the_external_one() -> None:
    processor = Processor(None, max_model_len=64, vocab_size=100, eos_token_id=None)
    first, _ = processor.process_inputs("x", [1, 2, 3], GREEDY)
    again, _ = processor.process_inputs("x", [1, 2, 3], GREEDY)
    assert first.external_req_id == again.external_req_id == "x"
    assert first.request_id.startswith("x-") and again.request_id.startswith("x-")
    assert first.request_id != again.request_id


def test_late_outputs_of_an_aborted_request_skip_its_successor(tokenizer) -> None:
    """The core may still send outputs of a request the frontend has aborted: they must not
    land in a new request that the caller has added under the same id meanwhile."""
    processor = Processor(tokenizer, 1024, len(tokenizer), tokenizer.eos_token_id)
    outputs = OutputProcessor(tokenizer)
    old, _ = processor.process_inputs("x", "Hello", GREEDY)
    (old_core,) = outputs.add_request(old, "Hello")
    assert outputs.abort_requests(["x"]) == [old_core.request_id]
    new, _ = processor.process_inputs("x", "Bye", GREEDY)
    (new_core,) = outputs.add_request(new, "Bye")

    late = outputs.process_outputs([EngineCoreOutput(old_core.request_id, [11])])
    assert late.request_outputs == []
    (ro,) = outputs.process_outputs([EngineCoreOutput(new_core.request_id, [22])]).request_outputs
    assert ro.request_id == "x" and ro.prompt == "Bye"
    assert ro.outputs[0].token_ids == [22]
    assert outputs.abort_requests(["x"]) == [new_core.request_id]


@pytest.fixture(scope="module")
def llm(gguf_model):
    llm = LLM(loaded_model=gguf_model, async_scheduling=True, **SMALL_ENGINE)
    yield llm
    llm.shutdown()


def run_to_completion(engine: LLMEngine) -> list[RequestOutput]:
    finished: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    engine.client.call_utility("check_integrity")
    return finished


@pytest.mark.model
def test_abort_and_reuse_of_an_id_while_a_step_is_in_flight(llm) -> None:
    engine = llm.llm_engine
    core = engine.client.engine_core
    engine.add_request("x", PROMPTS[3], LONG)
    engine.step()  # returns step 1's outputs once step 2 is scheduled
    assert core.batch_queue, "a step of the old 'x' is in flight"
    engine.abort_requests(["x"])
    engine.add_request("x", PROMPTS[1], GREEDY)
    (out,) = run_to_completion(engine)
    (alone,) = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)
    assert out.request_id == "x" and out.prompt == PROMPTS[1]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.model
def test_outputs_carry_the_callers_id_and_abort_by_it(llm) -> None:
    engine = llm.llm_engine
    core = engine.client.engine_core
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=1000, ignore_eos=True)
    assert engine.add_request("p", PROMPTS[0], sampled) == "p"
    core_ids = list(core.scheduler.requests)
    assert len(core_ids) == 2 and not {"p", "0_p", "1_p"} & set(core_ids)
    for params in (GREEDY, sampled):  # "p" is live: refused whatever its n
        with pytest.raises(ValueError, match="'p' is already in use"):
            engine.add_request("p", PROMPTS[1], params)
    engine.abort_requests(["p"])
    assert not engine.has_unfinished_requests() and not core.scheduler.requests

    engine.add_request("p", PROMPTS[0], SamplingParams(n=2, temperature=0.0, max_tokens=4))
    (out,) = run_to_completion(engine)
    assert out.request_id == "p" and [c.index for c in out.outputs] == [0, 1]
