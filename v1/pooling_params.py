"""Pooling parameters (embeddings, classification, scores), validated like vLLM's, and what a
frontend knows of a pooling model's pooler. A pooling request prefills its prompt once and
returns one vector pooled from its final hidden states; `PoolingParams` says what to do with
it, `PoolerInfo` is the engine's pooler as the frontend checks requests against it
(resolved by the engine core, `v1.models.pooler`).
"""

from dataclasses import dataclass

import msgspec

# The tasks a pooling request may ask for (vLLM's names): "embed" (a sentence embedding:
# pooled, then normalized and Matryoshka-truncated), "encode" (the pooled vector as it is),
# "classify" (a classification head's class probabilities), "score" (a cross-encoder's
# relevance of a text pair: its head's one logit, through a sigmoid).
POOLING_TASKS = ("embed", "encode", "classify", "score")
# How a sequence's hidden states become one vector (vLLM's PoolingType names).
POOLING_TYPES = ("LAST", "CLS", "MEAN")


class PoolerInfo(msgspec.Struct, array_like=True, omit_defaults=True):
    """A pooling engine's pooler, resolved from the model (`v1.models.pooler`).

    `pooling_type` and `normalize` are the model's defaults (sentence-transformers' config,
    else vLLM's: LAST + normalize for decoder-only models, CLS + normalize for encoders);
    `causal` is False for bidirectional encoders (BERT family); `num_labels` is the size of a
    classification head (None: the model has none, so no "classify" or cross-encoder
    "score"). `matryoshka_dimensions` lists the sizes a Matryoshka model was trained for
    (empty: any size from 1 to hidden_size, as config.json's `is_matryoshka` says; None: the
    model is not Matryoshka, and `dimensions` is refused, as vLLM refuses it). `labels` names
    a classification head's classes (config.json's `id2label`; None: unnamed)."""

    pooling_type: str
    normalize: bool
    hidden_size: int
    causal: bool = True
    num_labels: int | None = None
    matryoshka_dimensions: list[int] | None = None
    labels: list[str] | None = None

    @property
    def tasks(self) -> tuple[str, ...]:
        """What this engine's requests may ask for."""
        if self.num_labels is None:
            return ("embed", "encode")
        return ("classify", "score", "encode")

    @property
    def default_task(self) -> str:
        return "embed" if self.num_labels is None else "classify"


@dataclass(slots=True)
class PoolingParams:
    """vLLM's `PoolingParams`.

    - truncate_prompt_tokens: keep only the prompt's last k tokens (-1: the last
      max_model_len; None: no truncation, and a longer prompt is refused);
    - dimensions: Matryoshka truncation of an embedding to its first `dimensions` values
      (renormalized when `normalize`); only for models whose config says they are
      Matryoshka;
    - normalize: L2-normalize the embedding (None: the model's default, `PoolerInfo`);
    - use_activation: classification / score through softmax / sigmoid (None: yes);
    - task: one of POOLING_TASKS (None: the call's, e.g. "embed" for `LLM.embed`).

    Invariant after `verify`: `task` is set and every field suits it and the pooler.
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < -1 or t == 0):
            raise ValueError(
                f"truncate_prompt_tokens must be -1 or an integer >= 1, got {t!r}"
            )
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {d!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(
                f"pooling task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}"
            )

    def verify(self, task: str, pooler: PoolerInfo, model_name: str = "the model") -> None:
        """Set `task` (the call's unless given) and the model's defaults; ValueError for a
        task the model cannot do or a parameter the task does not take."""
        if self.task is None:
            self.task = task
        elif self.task != task and not (task == "encode" and self.task in pooler.tasks):
            raise ValueError(f"pooling params ask for task {self.task!r}, this call does {task!r}")
        if self.task not in pooler.tasks:
            raise ValueError(
                f"{model_name} does not support pooling task {self.task!r} "
                f"(supported: {', '.join(pooler.tasks)})"
            )
        if self.task in ("classify", "score"):
            if self.dimensions is not None or self.normalize is not None:
                raise ValueError(
                    f"dimensions and normalize are for embeddings, not task {self.task!r}"
                )
            if self.use_activation is None:
                self.use_activation = True
            return
        if self.use_activation is not None:
            raise ValueError(f"use_activation is for classify and score, not task {self.task!r}")
        if self.normalize is None:
            self.normalize = pooler.normalize if self.task == "embed" else False
        if self.dimensions is not None:
            sizes = pooler.matryoshka_dimensions
            if sizes is None:
                raise ValueError(
                    f"{model_name} does not support matryoshka representation, changing "
                    "output dimensions will lead to poor results."
                )
            if sizes and self.dimensions not in sizes:
                raise ValueError(
                    f"{model_name} only supports {sizes} matryoshka dimensions, "
                    f"use other output dimensions will lead to poor results."
                )
            if self.dimensions > pooler.hidden_size:
                raise ValueError(
                    f"dimensions {self.dimensions} exceeds the model's hidden size "
                    f"{pooler.hidden_size}"
                )
