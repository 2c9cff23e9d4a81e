"""The persistent batch: rows stay dense across add / remove / condense."""

import numpy as np
import torch

from v1.sample.logits_processor import BatchUpdateBuilder, process_dict_updates
from v1.sampling_params import SamplingParams
from v1.worker.input_batch import InputBatch


def add(batch: InputBatch, req_id: str, n: int) -> int:
    tokens = [int(req_id[1:]) * 100 + i for i in range(n)]
    return batch.add_request(req_id, tokens, n, 0, [int(req_id[1:])], SamplingParams(), None)


def test_condense_moves_last_rows_into_holes():
    batch = InputBatch(max_num_reqs=8, max_model_len=32, block_size=4, vocab_size=1000)
    for i in range(6):
        assert add(batch, f"r{i}", 3 + i) == i
    batch.remove_request("r1")
    batch.remove_request("r4")
    batch.remove_request("r5")
    batch.condense()
    assert batch.num_reqs == 3
    assert batch.req_ids[:3] == ["r0", "r3", "r2"]
    assert batch.req_ids[3:6] == [None, None, None]
    row = batch.req_id_to_index["r3"]
    assert row == 1
    assert batch.num_tokens[row] == 6
    assert list(batch.token_ids[row, :6]) == [300 + i for i in range(6)]
    assert batch.block_table.table[row, 0] == 3 and batch.block_table.num_blocks[row] == 1
    # New requests fill from the end of the dense rows.
    assert add(batch, "r7", 2) == 3


def test_remove_then_add_reuses_a_hole_without_condense():
    batch = InputBatch(max_num_reqs=4, max_model_len=16, block_size=4, vocab_size=1000)
    for i in range(3):
        add(batch, f"r{i}", 4)
    batch.remove_request("r1")
    assert add(batch, "r5", 4) == 1
    batch.condense()
    assert batch.req_ids[:3] == ["r0", "r5", "r2"]


def test_token_counts_follow_a_moved_row():
    batch = InputBatch(max_num_reqs=4, max_model_len=16, block_size=4, vocab_size=1000)
    add(batch, "r0", 2)
    params = SamplingParams(presence_penalty=1.0)
    batch.add_request("r1", [3, 4, 4, 9], 2, 0, [], params, None)  # outputs: 4, 9
    batch.remove_request("r0")
    batch.condense()
    assert batch.req_id_to_index["r1"] == 0
    assert batch.prompt_token_mask is not None and batch.output_token_counts is not None
    assert batch.prompt_token_mask[0].nonzero().flatten().tolist() == [3, 4]
    assert batch.output_token_counts[0, [4, 9]].tolist() == [1, 1]
    batch.count_sampled(torch.tensor([0]), torch.tensor([9]))
    assert batch.output_token_counts[0].sum() == 3 and batch.output_token_counts[0, 9] == 2


def test_slot_mapping_from_block_table():
    batch = InputBatch(max_num_reqs=2, max_model_len=16, block_size=4, vocab_size=1000)
    batch.add_request("a", [1] * 6, 6, 0, [7, 2], SamplingParams(), None)
    rows = np.zeros(6, dtype=np.int64)
    positions = np.arange(6)
    assert batch.block_table.slot_mapping(rows, positions).tolist() == [28, 29, 30, 31, 8, 9]


def test_batch_updates_replay_the_rows_changes():
    """What custom logits processors are told: replayed on a row -> request map (vLLM's
    process_dict_updates), each step's BatchUpdate gives the batch's rows as they are; an
    added request's output list is the one that grows as it samples."""
    builder = BatchUpdateBuilder()
    batch = InputBatch(max_num_reqs=4, max_model_len=16, block_size=4, vocab_size=1000,
                       batch_update_builder=builder)
    state: dict[int, str] = {}

    def step() -> None:
        update = builder.get_and_reset(batch.num_reqs)
        assert update is not None and update.batch_size == batch.num_reqs
        process_dict_updates(state, update, lambda params, prompt, out: params.extra_args["id"])
        assert state == {row: r for row, r in enumerate(batch.req_ids) if r is not None}

    def add_as(req_id: str) -> int:
        params = SamplingParams(extra_args={"id": req_id})
        return batch.add_request(req_id, [1, 2, 3], 2, 0, [0], params, None)

    for r in ("r0", "r1", "r2"):
        add_as(r)
    step()
    assert builder.output_token_ids["r1"] == [3]
    batch.remove_request("r0")
    batch.remove_request("r2")
    assert add_as("r3") == 2  # into a freed row, then moved by the condense
    batch.condense()
    step()
    assert batch.req_ids[:2] == ["r3", "r1"]
    assert builder.get_and_reset(batch.num_reqs) is None
