"""The model runner's pooling side (runner="pooling"): per-request pooling state, and a step's
pooled vectors. Every step hands its final hidden states to the model's `Pooler`; on the step
that computes a request's last prompt token its vector goes through the request's task head
(embedding: Matryoshka truncation and normalization; classification: head and softmax; score:
one logit through a sigmoid) and back to the scheduler, which finishes the request.
"""

import numpy as np
import torch

from v1.models.pooler import Pooler, embedding_head
from v1.pooling_params import PoolingParams


class RunnerPooling:
    """The pooling requests the runner knows: their params, by request id, from their first
    step to their finish (a preempted one keeps them, and its pooler state starts over)."""

    def __init__(self, pooler: Pooler, model: torch.nn.Module) -> None:
        self.pooler = pooler
        self.model = model
        self.params: dict[str, PoolingParams] = {}

    def add(self, req_id: str, params: PoolingParams | None) -> None:
        if params is None:
            raise ValueError(f"request {req_id!r} has no pooling params, and this engine "
                             "pools (runner='pooling')")
        self.params[req_id] = params

    def finish(self, req_id: str) -> None:
        self.params.pop(req_id, None)
        self.pooler.forget(req_id)

    def preempt(self, req_id: str) -> None:
        self.pooler.forget(req_id)  # it computes its prompt again from the start

    def step(
        self,
        hidden: torch.Tensor,
        req_ids: list[str],
        query_start_loc: np.ndarray,
        num_computed: np.ndarray,
        num_prompt: np.ndarray,
    ) -> list[list[float] | None]:
        """Per request, its result if this step finished its prompt, else None."""
        pooled = self.pooler.pool(hidden, req_ids, query_start_loc, num_computed, num_prompt)
        return [
            None if vector is None else self._head(vector, self.params[req_id]).tolist()
            for req_id, vector in zip(req_ids, pooled, strict=True)
        ]

    def _head(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.task in ("embed", "encode"):
            return embedding_head(vector, params)
        logits = self.model.classify(vector.unsqueeze(0))[0].float()  # type: ignore[operator]
        if not params.use_activation:
            return logits
        if params.task == "score":
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1)
