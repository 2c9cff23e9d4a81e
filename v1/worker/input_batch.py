"""The persistent batch: per-request state in numpy rows that live across steps.

Requests are added when first scheduled and removed when finished or preempted; between, steps
send only deltas. Rows stay dense (`condense()`), so the first `num_reqs` rows are the batch,
and `version` changes with every add, remove or move. Sampled tokens are written here at once,
so the runner never waits for the scheduler to echo them. Penalty token counts live here too,
on the model's device, only while a request with penalties exists. With custom logits
processors, `batch_update_builder` records every add, remove and move for them.
"""

import numpy as np
import torch

from v1.sample.logits_processor import BatchUpdateBuilder
from v1.sampling_params import SamplingParams
from v1.worker.block_table import BlockTable


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
        batch_update_builder: BatchUpdateBuilder | None = None,
    ):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = device
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        # One extra column: the token sampled at the last position is stored, never computed.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)  # known: prompt + sampled
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        max_blocks = -(-(max_model_len + 1) // block_size)
        self.block_table = BlockTable(max_num_reqs, max_blocks, block_size)
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        self.generators: dict[str, torch.Generator] = {}
        self.prompt_token_mask: torch.Tensor | None = None  # bool [max_num_reqs, vocab]
        self.output_token_counts: torch.Tensor | None = None  # int32 [max_num_reqs, vocab]
        self._holes: list[int] = []
        self.num_reqs = 0
        # Bumped whenever a row changes request (or params): a request id alone is not
        # enough, since a finished id may come back with other params.
        self.version = 0
        self.batch_update_builder = batch_update_builder

    def add_request(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        num_computed_tokens: int,
        block_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> int:
        row = self._holes.pop() if self._holes else self.num_reqs
        self.num_reqs += 1
        self.version += 1
        self.req_ids[row] = req_id
        self.req_id_to_index[req_id] = row
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.block_table.set_row(row, block_ids)
        self.sampling_params[row] = params
        if generator is not None:
            self.generators[req_id] = generator
        if params.has_penalties:
            self._fill_token_counts(row, token_ids, num_prompt_tokens)
        if self.batch_update_builder is not None:
            self.batch_update_builder.add(row, req_id, params, token_ids, num_prompt_tokens)
        return row

    def _fill_token_counts(self, row: int, token_ids: list[int], num_prompt_tokens: int) -> None:
        if self.prompt_token_mask is None or self.output_token_counts is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self.prompt_token_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self.output_token_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        tokens = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        self.prompt_token_mask[row] = False
        self.prompt_token_mask[row, tokens[:num_prompt_tokens]] = True
        counts = tokens[num_prompt_tokens:].bincount(minlength=self.vocab_size)
        self.output_token_counts[row] = counts

    def count_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Adds one sampled token to each row's output counts (rows and ids on the device)."""
        assert self.output_token_counts is not None
        ones = torch.ones_like(token_ids, dtype=torch.int32)
        self.output_token_counts.index_put_((rows, token_ids), ones, accumulate=True)

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        self.req_ids[row] = None
        self.sampling_params[row] = None
        self.generators.pop(req_id, None)
        self._holes.append(row)
        self.num_reqs -= 1
        self.version += 1
        if self.batch_update_builder is not None:
            self.batch_update_builder.remove(row, req_id)

    def condense(self) -> None:
        """Fill holes with the last rows so rows [0, num_reqs) are exactly the live ones."""
        last = self.num_reqs + len(self._holes) - 1  # highest row that may be live
        holes = sorted(h for h in self._holes if h < self.num_reqs)
        self._holes.clear()
        for hole in holes:
            while self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move_row(last, hole)
            last -= 1

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens):
            arr[dst] = arr[src]
        self.block_table.move_row(src, dst)
        params = self.sampling_params[dst] = self.sampling_params[src]
        assert params is not None
        if params.has_penalties:
            assert self.prompt_token_mask is not None and self.output_token_counts is not None
            self.prompt_token_mask[dst] = self.prompt_token_mask[src]
            self.output_token_counts[dst] = self.output_token_counts[src]
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.sampling_params[src] = None
        self.req_id_to_index[req_id] = dst
        self.version += 1
        if self.batch_update_builder is not None:
            self.batch_update_builder.move(src, dst)
