"""Request and response models of the pooling endpoints (a server started with
--runner pooling), in OpenAI's and vLLM's shapes: /v1/embeddings, /pooling, /classify,
/score (and /v1/score), /rerank (and /v1/rerank, /v2/rerank).

Same rules as `protocol.py`: strict types, null is "not given", value ranges checked by
`PoolingParams` and the processor (a 400 naming the value), vLLM's fields that would change
the answer but are not implemented `Unsupported` (a 400 naming them), unknown fields ignored
with a warning.
"""

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from v1.entrypoints.openai.protocol import (
    ChatMessage,
    Int64,
    Items,
    OpenAIBaseModel,
    PromptInput,
    Unsupported,
)
from v1.utils.serial_utils import EmbedDType, EncodingFormat, Endianness


class PoolingBaseRequest(OpenAIBaseModel):
    """What every pooling request shares (vLLM's extra fields included)."""

    model: str | None = None  # None: the first served model name
    truncate_prompt_tokens: Int64 | None = None
    # The prompt's last tokens are the ones kept ("left"): the other side is not implemented.
    truncation_side: Literal["left"] | None = None
    padding: Literal["do_not_pad"] | None = None  # "max_length" is not implemented
    priority: Int64 = 0
    user: str | None = None  # OpenAI's: does not change the output
    # vLLM's extras that change the answer (its id, a multimodal input), not implemented.
    request_id: Unsupported[str | None] = None
    mm_processor_kwargs: Unsupported[dict[str, Any] | None] = None


class InputOrMessagesRequest(PoolingBaseRequest):
    """A pooling request's prompts: OpenAI's `input`, or vLLM's chat-style `messages`
    (one conversation, rendered with the chat template: by default without the generation
    prompt, as vLLM's pooling requests)."""

    input: PromptInput | None = None  # as OpenAI's embeddings API takes it
    add_special_tokens: Unsupported[bool] = True  # `input`'s texts get them (BOS)
    messages: Items[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # A request's own template: refused, as for chat completions.
    chat_template: Unsupported[str | None] = None

    @model_validator(mode="after")
    def _input_or_messages(self) -> "InputOrMessagesRequest":
        if (self.input is None) == (self.messages is None):
            raise ValueError("give either input or messages")
        if self.messages is None and self.model_fields_set & {
            "add_generation_prompt", "continue_final_message", "chat_template_kwargs"
        }:
            raise ValueError("add_generation_prompt, continue_final_message and "
                             "chat_template_kwargs are for messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(  # vLLM's words
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return self


class EncodingRequest(InputOrMessagesRequest):
    """How the vectors travel (vLLM's fields): JSON floats, or each vector rounded to
    `embed_dtype` in `endianness` byte order, base64'd ("base64") or raw ("bytes", with a
    `metadata` header describing them; "bytes_only" without it)."""

    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"


class EmbeddingRequest(EncodingRequest):
    dimensions: Int64 | None = None
    normalize: bool | None = None  # vLLM's older name for use_activation: None is the model's
    use_activation: bool | None = None  # vLLM's: for embeddings, whether to normalize

    @model_validator(mode="after")
    def _one_normalize(self) -> "EmbeddingRequest":
        if None not in (self.normalize, self.use_activation) and (
            self.normalize != self.use_activation
        ):
            raise ValueError("normalize and use_activation disagree: give one of them")
        return self

    @property
    def normalize_embedding(self) -> bool | None:
        return self.use_activation if self.normalize is None else self.normalize


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the pooled vectors as the model's pooler gives them, or as `task`
    asks ("embed": normalized embeddings; "classify": class probabilities)."""

    task: Literal["embed", "encode", "classify"] | None = None


class ClassificationRequest(InputOrMessagesRequest):
    """vLLM's /classify: each prompt's class probabilities (a classification model's)."""

    use_activation: bool | None = None  # False: the head's logits, not their softmax


class ScoringRequest(PoolingBaseRequest):
    """What /score and /rerank share: vLLM's scoring fields."""

    use_activation: bool | None = None  # a cross-encoder's: False, its logit (no sigmoid)
    # Per-text truncation and score templates (instruction), not implemented.
    max_tokens_per_query: Unsupported[int] = 0
    max_tokens_per_doc: Unsupported[int] = 0
    instruction: Unsupported[str | None] = None
    chat_template_kwargs: Unsupported[dict[str, Any] | None] = None


# The names vLLM's /score takes its two sides by, in the order it tries them.
SCORE_FIELD_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                     ("text_1", "text_2"))


class ScoreRequest(ScoringRequest):
    """vLLM's /score: one side against each of the other (1 -> N), or pairwise (N -> N). The
    sides are `queries` and `documents` (or `items`), `data_1` and `data_2`, or `text_1` and
    `text_2`, as vLLM names them."""

    queries: str | Items[str] | None = None
    documents: str | Items[str] | None = None
    items: str | Items[str] | None = None
    data_1: str | Items[str] | None = None
    data_2: str | Items[str] | None = None
    text_1: str | Items[str] | None = None
    text_2: str | Items[str] | None = None

    def _given_pairs(self) -> list[tuple[str, str]]:
        return [pair for pair in SCORE_FIELD_PAIRS
                if getattr(self, pair[0]) is not None and getattr(self, pair[1]) is not None]

    @model_validator(mode="after")
    def _one_pair_of_sides(self) -> "ScoreRequest":
        if len(self._given_pairs()) != 1:
            names = " or ".join(f"{a} and {b}" for a, b in SCORE_FIELD_PAIRS)
            raise ValueError(f"give the two sides to score as {names}")
        return self

    @property
    def sides(self) -> tuple[str | list[str], str | list[str]]:
        first, second = self._given_pairs()[0]
        return getattr(self, first), getattr(self, second)


class RerankRequest(ScoringRequest):
    """vLLM's (and Jina's / Cohere's) /rerank: the documents by relevance to the query."""

    query: str
    documents: str | Items[str]
    top_n: Int64 = Field(default=0, ge=0)  # 0: every document


# ---- responses ---------------------------------------------------------------------------


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponseData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of the vector in the asked dtype and order


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingResponseData]
    usage: PoolingUsage


class PoolingResponseData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingResponseData]
    usage: PoolingUsage


class ScoreResponseData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreResponseData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ClassificationData(BaseModel):
    index: int
    label: str | None  # the most probable class's name (config.json's id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
