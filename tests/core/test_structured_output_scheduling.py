"""The scheduler's side of structured output, with a fake grammar manager (no torch)."""

from tests.core.utils import (
    FakeGrammar,
    FakeManager,
    fake_model_output,
    make_request,
    make_scheduler,
    run_step,
)
from v1.request import RequestStatus
from v1.sampling_params import StructuredOutputsParams

CHOICE = StructuredOutputsParams(choice=["a", "b"])


def make(**kwargs):
    manager = FakeManager()
    scheduler = make_scheduler(**kwargs)
    scheduler.structured_output_manager = manager
    return scheduler, manager


def test_compiling_request_waits_without_blocking_others():
    scheduler, manager = make()
    structured = make_request(6, structured_outputs=CHOICE)
    plain = make_request(6)
    scheduler.add_request(structured)
    scheduler.add_request(plain)
    assert structured.status == RequestStatus.WAITING_FOR_FSM
    out, _ = run_step(scheduler)
    assert list(out.num_scheduled_tokens) == [plain.request_id]  # FCFS did not stall
    assert out.grammar_bitmask is None
    scheduler.check_integrity()
    manager.futures[structured.request_id].set_result(FakeGrammar())
    out, _ = run_step(scheduler)
    assert structured.request_id in out.num_scheduled_tokens
    assert out.structured_output_request_ids == [structured.request_id]
    assert structured.grammar is not None and structured.grammar.accepted == [7]


def test_bitmask_rows_only_for_requests_that_sample():
    """Chunked prefill: a chunk short of the prompt's end samples nothing, gets no row."""
    scheduler, manager = make(max_num_batched_tokens=8)
    request = make_request(12, structured_outputs=CHOICE)
    scheduler.add_request(request)
    manager.futures[request.request_id].set_result(FakeGrammar())
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens[request.request_id] == 8
    assert out.structured_output_request_ids == [] and out.grammar_bitmask is None
    out, _ = run_step(scheduler)
    assert out.structured_output_request_ids == [request.request_id]
    assert out.grammar_bitmask == [0]
    out, _ = run_step(scheduler)
    assert out.grammar_bitmask == [1]  # the mask follows the accepted tokens


def test_compile_error_and_rejected_token_finish_with_reason():
    scheduler, manager = make()
    bad = make_request(4, structured_outputs=CHOICE)
    rejecting = make_request(4, structured_outputs=CHOICE)
    scheduler.add_request(bad)
    scheduler.add_request(rejecting)
    manager.futures[bad.request_id].set_exception(RuntimeError("no such rule"))
    manager.futures[rejecting.request_id].set_result(FakeGrammar())
    out, outputs = run_step(scheduler, token=9)
    finished = {o.request_id: o for o in outputs[0].outputs}
    assert "no such rule" in finished[bad.request_id].stop_reason
    assert finished[rejecting.request_id].finish_reason == "abort"
    assert "rejected" in finished[rejecting.request_id].stop_reason
    # The refused token is not output (its mask allowed nothing: a grammar no text matches
    # sampled from all-masked logits, and its text reached the client).
    assert finished[rejecting.request_id].new_token_ids == []
    assert scheduler.make_stats().num_generation_tokens == 0  # nor counted as generated
    assert not scheduler.has_requests()
    scheduler.check_integrity()


def test_terminated_grammar_stops_the_request():
    scheduler, manager = make()
    request = make_request(4, structured_outputs=CHOICE)
    scheduler.add_request(request)
    manager.futures[request.request_id].set_result(FakeGrammar(length=2))
    run_step(scheduler)
    _, outputs = run_step(scheduler)
    assert outputs[0].outputs[0].finish_reason == "stop"
    assert request.output_token_ids == [7, 7]


def test_async_does_not_schedule_a_structured_request_ahead_of_its_token():
    scheduler, manager = make(async_scheduling=True)
    structured = make_request(4, structured_outputs=CHOICE)
    plain = make_request(4)
    scheduler.add_request(structured)
    scheduler.add_request(plain)
    manager.futures[structured.request_id].set_result(FakeGrammar())
    first = scheduler.schedule()
    second = scheduler.schedule()  # the first step's tokens are still in flight
    assert structured.request_id not in second.num_scheduled_tokens
    assert plain.request_id in second.num_scheduled_tokens
    scheduler.update_from_output(first, fake_model_output(scheduler, first))
    third = scheduler.schedule()
    assert third.structured_output_request_ids == [structured.request_id]
    assert third.grammar_bitmask == [1]


def test_a_request_that_leaves_while_its_grammar_compiles_tells_the_manager():
    """An abort (the client disconnected) of a request still waiting for its grammar lets
    the manager drop a compilation nobody waits for; one with its grammar does not."""
    scheduler, manager = make()
    waiting = make_request(4, structured_outputs=CHOICE)
    ready = make_request(4, structured_outputs=CHOICE)
    scheduler.add_request(waiting)
    scheduler.add_request(ready)
    manager.futures[ready.request_id].set_result(FakeGrammar())
    run_step(scheduler)
    scheduler.finish_requests([waiting.request_id, ready.request_id])
    assert manager.aborted == [waiting.request_id]
    scheduler.check_integrity()
