"""Request and response models of the pooling endpoints (a server started with
--runner pooling), in OpenAI's and vLLM's shapes: /v1/embeddings, /pooling, /score (and
/v1/score), /rerank (and /v1/rerank, /v2/rerank).

Same rules as `protocol.py`: strict types, null is "not given", value ranges checked by
`PoolingParams` and the processor (a 400 naming the value), unknown fields ignored with a
warning.
"""

from typing import Literal

from pydantic import BaseModel, Field

from v1.entrypoints.openai.protocol import Int64, OpenAIBaseModel, PromptInput


class PoolingBaseRequest(OpenAIBaseModel):
    """What every pooling request shares (vLLM's extra fields included)."""

    model: str | None = None  # None: the first served model name
    truncate_prompt_tokens: Int64 | None = None
    priority: Int64 = 0
    user: str | None = None  # OpenAI's: does not change the output


class EmbeddingRequest(PoolingBaseRequest):
    input: PromptInput  # as OpenAI's embeddings API takes it
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    normalize: bool | None = None  # vLLM's: None is the model's default


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the pooled vectors as the model's pooler gives them."""


class ScoreRequest(PoolingBaseRequest):
    """vLLM's /score: `text_1` against each of `text_2` (1 -> N), or pairwise (N -> N)."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(PoolingBaseRequest):
    """vLLM's (and Jina's / Cohere's) /rerank: the documents by relevance to the query."""

    query: str
    documents: list[str]
    top_n: Int64 = Field(default=0, ge=0)  # 0: every document


# ---- responses ---------------------------------------------------------------------------


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponseData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32s


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
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
