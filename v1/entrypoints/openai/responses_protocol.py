"""Request, response and stream-event models of OpenAI's Responses API (POST /v1/responses): the
stateless text-in, text-out subset, as vLLM serves it by default.

Input is a string or message items (user, system, developer, assistant; string content or
`input_text` / `output_text` parts), `instructions` a system message before them. Other item
kinds, tools and fields needing stored responses get a 400 naming them; `store: true` is
accepted and not honoured (the response says `"store": false`).
"""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator

from v1.config.limits import DEFAULT_LIMITS, InputLimits, check_json_spec
from v1.entrypoints.openai.protocol import (
    EngineRequest,
    Int64,
    Items,
    OpenAIBaseModel,
    Unsupported,
    token_id_biases,
)
from v1.sampling_params import SamplingParams, StructuredOutputsParams

# OpenAI's bounds on `metadata`: what a client may attach to a response, echoed back.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_LEN = 64
MAX_METADATA_VALUE_LEN = 512

# A response's status, and its message's: OpenAI's, less those of stored responses
# ("queued", "cancelled") and of "failed" ones (an error is an HTTP error, or in-band).
ResponseStatus = Literal["in_progress", "completed", "incomplete"]


class ResponseTextPart(OpenAIBaseModel):
    """A message's text: `input_text`, or `output_text` (an earlier answer sent back, its
    annotations and logprobs ignored)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ResponseInputMessage(OpenAIBaseModel):
    """A message item: OpenAI's EasyInputMessage (no `type` needed) or Message, or an
    earlier output message sent back (with its `id` and `status`)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Items[ResponseTextPart]  # a string is one input_text part
    id: str | None = None
    status: ResponseStatus | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _string_is_one_part(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "input_text", "text": value}]
        if not isinstance(value, list):
            raise ValueError(
                f"content must be a string or a list of input_text / output_text parts, "
                f"got {type(value).__name__}"
            )
        return value

    def to_template_dict(self) -> dict[str, Any]:
        # Parts' texts joined by newlines, as chat's (and vLLM's, for both).
        return {"role": self.role, "content": "\n".join(part.text for part in self.content)}


class TextFormatText(OpenAIBaseModel):
    type: Literal["text"]


class TextFormatJSONObject(OpenAIBaseModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(OpenAIBaseModel):
    """The Responses API's json_schema format: flat, unlike chat's `response_format`."""

    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")
]


class ResponseTextConfig(OpenAIBaseModel):
    format: TextFormat = TextFormatText(type="text")
    verbosity: Unsupported[Literal["low", "medium", "high"] | None] = None


class ResponsesRequest(EngineRequest):
    """POST /v1/responses. `temperature`, `top_p` and `max_output_tokens` left out take the
    model's defaults (generation_config.json), as chat's do; `top_k` and `logit_bias` are
    vLLM's extras."""

    max_tokens_fields: ClassVar[frozenset[str]] = frozenset({"max_output_tokens"})

    input: Items[ResponseInputMessage]  # a string is one user message
    instructions: str | None = None  # a system message before the input
    max_output_tokens: Int64 | None = None  # None: up to max_model_len
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int64 = 0
    logit_bias: dict[str, float] | None = None  # vLLM's: token id (a string) -> bias
    text: ResponseTextConfig | None = None
    metadata: dict[str, str] | None = None  # echoed
    user: str | None = None  # echoed
    # Stateless: accepted, never stored (see the module's docstring).
    store: bool = True
    # "auto": input items are dropped from the start until the rest fits max_model_len.
    truncation: Literal["auto", "disabled"] = "disabled"
    # No tools: only the choices that mean "no tool calls" (echoed), as vLLM's without them.
    tool_choice: Literal["auto", "none"] = "auto"
    parallel_tool_calls: bool = True
    # What needs stored responses, tools, or output this server does not make.
    previous_response_id: Unsupported[str | None] = None
    conversation: Unsupported[str | dict[str, Any] | None] = None
    background: Unsupported[bool] = False
    tools: Unsupported[list[dict[str, Any]]] = []
    max_tool_calls: Unsupported[int | None] = None
    include: Unsupported[list[str] | None] = None
    top_logprobs: Unsupported[int] = 0
    reasoning: Unsupported[dict[str, Any] | None] = None
    prompt: Unsupported[dict[str, Any] | None] = None

    @field_validator("input", mode="before")
    @classmethod
    def _string_is_a_user_message(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if not isinstance(value, list):
            raise ValueError(
                f"input must be a string or a list of message items, got {type(value).__name__}"
            )
        if not value:
            raise ValueError("input is an empty list: give a string or at least one message")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_within_bounds(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(
                f"metadata has {len(value)} pairs, more than {MAX_METADATA_PAIRS}"
            )
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_LEN:
                raise ValueError(
                    f"metadata key {key[:16]!r}... is longer than {MAX_METADATA_KEY_LEN}"
                )
            if len(item) > MAX_METADATA_VALUE_LEN:
                raise ValueError(
                    f"metadata[{key!r}] is longer than {MAX_METADATA_VALUE_LEN} characters"
                )
        return value

    def messages(self, num_dropped: int = 0) -> list[dict[str, Any]]:
        """The conversation as chat templates take it: the instructions as a system message,
        then the input, less its first `num_dropped` items (truncation)."""
        head = [] if self.instructions is None else [
            {"role": "system", "content": self.instructions}
        ]
        return [*head, *(item.to_template_dict() for item in self.input[num_dropped:])]

    def to_sampling_params(self, limits: InputLimits = DEFAULT_LIMITS) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, logit_bias=token_id_biases(self.logit_bias),
            structured_outputs=self._structured_outputs(limits),
        )

    def _structured_outputs(self, limits: InputLimits) -> StructuredOutputsParams | None:
        text_format = TextFormatText(type="text") if self.text is None else self.text.format
        if isinstance(text_format, TextFormatJSONObject):
            return StructuredOutputsParams(json_object=True)
        if isinstance(text_format, TextFormatJSONSchema):
            check_json_spec(text_format.schema_, "text.format.schema", limits)
            return StructuredOutputsParams(json=text_format.schema_)
        return None

    def echoed_text(self) -> dict[str, Any]:
        """`text` as the response echoes it (OpenAI's default: plain text)."""
        config = self.text or ResponseTextConfig()
        return config.model_dump(by_alias=True, exclude_none=True)


# ---- responses ---------------------------------------------------------------------------


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ResponseOutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ResponseStatus
    content: list[ResponseOutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # no reasoning parser: none are told apart


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponsesResponse(BaseModel):
    """A response; while streamed (`response.created`, `response.in_progress`) with status
    in_progress, no output and no usage yet. The request's parameters are echoed, sampling
    ones as the engine got them (the model's defaults filled in), as vLLM's."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: None = None  # a failed response's: none is made (errors are HTTP errors)
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[ResponseOutputMessage]
    usage: ResponseUsage | None = None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str] | None
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str
    tools: list[Any] = []
    parallel_tool_calls: bool
    truncation: str
    user: str | None
    previous_response_id: None = None
    background: bool = False
    store: Literal[False] = False  # stateless: never stored, whatever the request asked


# ---- stream events -----------------------------------------------------------------------


class ResponseStreamEvent(BaseModel):
    """One server-sent event of a streamed response; `sequence_number` counts from 0."""

    type: str
    sequence_number: int


class ResponseLifecycleEvent(ResponseStreamEvent):
    """response.created / in_progress / completed / incomplete: the response so far."""

    response: ResponsesResponse


class ResponseOutputItemEvent(ResponseStreamEvent):
    """response.output_item.added / done."""

    output_index: int
    item: ResponseOutputMessage


class ResponseContentPartEvent(ResponseStreamEvent):
    """response.content_part.added / done."""

    item_id: str
    output_index: int
    content_index: int
    part: ResponseOutputText


class ResponseTextDeltaEvent(ResponseStreamEvent):
    """response.output_text.delta."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class ResponseTextDoneEvent(ResponseStreamEvent):
    """response.output_text.done: the whole text."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ResponseErrorEvent(ResponseStreamEvent):
    """error: what went wrong once the stream had begun (OpenAI's in-band error)."""

    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None = None
