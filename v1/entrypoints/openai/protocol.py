"""Request and response models of the OpenAI API subset this server implements.

Types are strict ("5" is not an integer) but for booleans, which take what vLLM's
(pydantic's lax mode) take ("true", "no", 1); every integer fits an int64; value ranges are
checked once, by `SamplingParams` and the processor, whose ValueErrors become 400s. Null means
"not given". Fields of OpenAI's and vLLM's APIs that change the output but are not implemented
are `Unsupported`: set to anything but their default, a 400 naming them. Unknown fields and
those that do not change the output (`user`, `store`, `metadata`, `service_tier`) are ignored
with a warning, as vLLM does.
"""

import heapq
import logging
from http import HTTPStatus
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from v1.config.limits import (
    DEFAULT_LIMITS,
    INT64_MAX,
    INT64_MIN,
    InputLimits,
    check_json_spec,
    check_token_id_lists,
)
from v1.engine.processor import template_message
from v1.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("v1.entrypoints.openai")

# Every integer a request gives: larger ones cannot reach the engine (its messages carry
# int64), so they are a 400 naming the field, not a failure to serialize.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]

T = TypeVar("T")
# A list a request gives: its validation stops at the first bad element (by default each of
# them made an error: a prompt of 1M floats built 1M, 3.9 s of the event loop in pydantic's
# errors(), and a 52 MB message).
Items = Annotated[list[T], Field(fail_fast=True)]


def _prompt_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    return "texts" if isinstance(first, str) else "batch" if isinstance(first, list) else "ids"


# A prompt input: a text, texts, token ids, or a batch of token-id lists. Which one is told
# by its first element, so a value is validated against one member: a plain union validates
# it against each in turn, and each member that fails builds one error per element (5M
# token ids took 2.7 s).
PromptInput = Annotated[
    Annotated[str, Tag("text")] | Annotated[Items[str], Tag("texts")]
    | Annotated[Items[Int64], Tag("ids")] | Annotated[Items[Items[Int64]], Tag("batch")],
    Discriminator(
        _prompt_kind, custom_error_type="prompt_type", custom_error_message=(
            "should be a string, a list of strings, a list of token ids or a list of lists of "
            "token ids"
        ),
    ),
]

# The request fields passed to SamplingParams unchanged (same names there).
_SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "allowed_token_ids",
    "bad_words",
}


class _UnsupportedMark:
    pass


_LAX_BOOL = TypeAdapter(bool)


def _lax_bool(value: Any) -> Any:
    """`value` as pydantic's lax mode reads a boolean; unchanged if it is none (the strict
    check then refuses it, naming the field)."""
    try:
        return _LAX_BOOL.validate_python(value)
    except ValidationError:
        return value


# A field this server does not implement (yet): only its default is accepted.
Unsupported = Annotated[T, _UnsupportedMark()]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @model_validator(mode="before")
    @classmethod
    def _lenient_bools(cls, data: Any) -> Any:
        # vLLM's models are pydantic's lax mode, whose booleans take "true", "no", 1 and the
        # like: clients send them. Other types stay strict ("5" is not an integer).
        if not isinstance(data, dict):
            return data
        bools = {name for name, field in cls.model_fields.items()
                 if field.annotation in (bool, bool | None)}
        return {k: _lax_bool(v) if k in bools else v for k, v in data.items()}

    @field_validator("*")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        # Runs for given fields only: a default is never validated.
        field = cls.model_fields[info.field_name]  # type: ignore[index]
        unsupported = any(isinstance(m, _UnsupportedMark) for m in field.metadata)
        if unsupported and value != field.default:
            default = "" if field.default is None else f" or set it to {field.default!r}"
            raise ValueError(f"not supported by this server: leave it out{default}")
        return value

    _UNKNOWN_SHOWN: ClassVar[int] = 16  # unknown fields a request's warning names

    @model_validator(mode="after")
    def _warn_about_unknown_fields(self) -> "OpenAIBaseModel":
        # The first few names, each cut short, and a count: one line of the log stays
        # small whatever a body holds (1M unknown keys wrote 11.5 MB a request).
        if self.model_extra:
            names = [n if len(n) <= 64 else n[:64] + "..."
                     for n in heapq.nsmallest(self._UNKNOWN_SHOWN, self.model_extra)]
            more = len(self.model_extra) - len(names)
            logger.warning(
                "%s: ignoring fields this server does not use: %s%s",
                type(self).__name__, names, f" and {more} more" if more else "",
            )
        return self


def token_id_biases(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """A request's `logit_bias` for SamplingParams: keys as token ids, biases clamped to
    [-100, 100] (as vLLM and OpenAI)."""
    if logit_bias is None:
        return None
    bias: dict[int, float] = {}
    for key, value in logit_bias.items():
        if not key.isdigit():
            raise ValueError(f"logit_bias keys must be token ids (digits), got {key!r}")
        bias[int(key)] = min(100.0, max(-100.0, value))
    return bias


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False  # a last chunk with the whole request's usage
    # vLLM's: with include_usage, every chunk carries its choice's usage so far too.
    continuous_usage_stats: bool = False


class EngineRequest(OpenAIBaseModel):
    """What every generating endpoint's request shares: the model, how the engine runs it
    (priority, data-parallel rank, prefix-cache salt) and whether it is streamed."""

    # The request's own names for SamplingParams.max_tokens (its `sampling_fields_set`).
    max_tokens_fields: ClassVar[frozenset[str]] = frozenset({"max_tokens"})

    model: str | None = None  # None: the first served model name
    # Lower runs first; under --scheduling-policy fcfs (the default) only 0 is accepted.
    priority: Int64 = 0
    # vLLM's: with --data-parallel-size N, run the request on engine core i (0 <= i < N)
    # instead of routing it.
    data_parallel_rank: Int64 | None = None
    stream: bool = False
    # vLLM's: requests with different salts never share prefix-cache blocks.
    cache_salt: str | None = None

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt_not_empty(cls, value: str) -> str:
        if not value:
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return value

    @property
    def sampling_fields_set(self) -> set[str]:
        """The fields this request set, a max_tokens under SamplingParams' name: the model's
        default sampling parameters apply to the others."""
        given = set(self.model_fields_set)
        if given & self.max_tokens_fields:
            given.add("max_tokens")
        return given


class SamplingRequest(EngineRequest):
    """What the completion endpoints share: the sampling options (vLLM's extra ones
    included) and the stream's options."""

    n: Int64 = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int64 = 0
    min_p: float = 0.0
    seed: Int64 | None = None
    stop: str | Items[str] | None = None
    stop_token_ids: Items[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (a string, JSON's keys) -> bias
    repetition_penalty: float = 1.0  # vLLM's, as the three below
    allowed_token_ids: Items[Int64] | None = None
    bad_words: Items[str] | None = None
    # vLLM's: this many top tokens per prompt position (completions: in each choice; chat:
    # in the response). Not streamed, as in vLLM.
    prompt_logprobs: NonNegativeInt64 | None = None
    stream_options: StreamOptions | None = None
    # vLLM's: SamplingParams.extra_args, the arguments of the engine's custom logits
    # processors (--logits-processors).
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None

    # Structured output: OpenAI's `response_format` ({"type": "text" | "json_object" |
    # "json_schema"}) or vLLM's `structured_outputs` (StructuredOutputsParams' fields).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # Only best_of == n (which changes nothing), as vLLM's own benchmark clients send it: the
    # best of more candidates is not implemented.
    best_of: int | None = None
    # vLLM's sampling and structured-output extras we do not implement.
    use_beam_search: Unsupported[bool] = False
    length_penalty: Unsupported[float] = 1.0
    spaces_between_special_tokens: Unsupported[bool] = True
    truncate_prompt_tokens: Unsupported[int | None] = None
    guided_json: Unsupported[str | dict[str, Any] | None] = None
    guided_regex: Unsupported[str | None] = None
    guided_choice: Unsupported[list[str] | None] = None
    guided_grammar: Unsupported[str | None] = None
    guided_decoding_backend: Unsupported[str | None] = None
    guided_whitespace_pattern: Unsupported[str | None] = None
    logits_processors: Unsupported[list[Any] | None] = None
    return_tokens_as_token_ids: Unsupported[bool] = False
    return_token_ids: Unsupported[bool] = False
    request_id: Unsupported[str | None] = None
    kv_transfer_params: Unsupported[dict[str, Any] | None] = None
    # vLLM's newer extras that change the answer, not implemented either: logprobs of chosen
    # tokens, early ends on repetition, watermarks, reasoning budgets, extra response fields.
    logprob_token_ids: Unsupported[list[int] | None] = None
    repetition_detection: Unsupported[dict[str, Any] | None] = None
    watermarking: Unsupported[bool] = False
    thinking_token_budget: Unsupported[int | None] = None
    return_weight_versions: Unsupported[bool] = False
    return_token_offsets: Unsupported[bool] = False
    ec_transfer_params: Unsupported[dict[str, Any] | None] = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int, info: ValidationInfo) -> int:
        n = info.data.get("n", 1)  # validated before (declared first)
        if value != n:
            raise ValueError(f"not supported by this server: leave it out or set it to n ({n})")
        return value

    @model_validator(mode="after")
    def _stream_fields(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")  # vLLM's
        return self

    def token_id_lists(self) -> dict[str, Any]:
        """The request's token id lists by field name (None: not given)."""
        return {
            "stop_token_ids": self.stop_token_ids, "allowed_token_ids": self.allowed_token_ids,
            "logit_bias": self.logit_bias,
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """As vLLM: continuous_usage_stats counts only with include_usage."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
        limits: InputLimits,
    ) -> SamplingParams:
        # Their lengths first: SamplingParams checks every element (millions, on the event loop).
        check_token_id_lists(self.n, self.token_id_lists(), limits)
        return SamplingParams(
            **self.model_dump(include=_SAMPLING_FIELDS), max_tokens=max_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=token_id_biases(self.logit_bias),
            structured_outputs=self._structured_outputs(limits), extra_args=self.vllm_xargs,
        )

    def _structured_outputs(self, limits: InputLimits) -> StructuredOutputsParams | None:
        """`limits` are checked here for a response_format's schema, to name it: the
        processor checks every spec again, as `structured_outputs` (which is what it is)."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        if self.structured_outputs is not None:
            try:
                return StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown key
                raise ValueError(f"structured_outputs: {e}") from e
        kind = (self.response_format or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = (self.response_format or {}).get("json_schema", {}).get("schema")
        if kind == "json_schema" and isinstance(schema, dict):
            check_json_spec(schema, "response_format.json_schema.schema", limits)
            return StructuredOutputsParams(json=schema)
        raise ValueError(
            f"response_format must be {{'type': 'text' | 'json_object'}} or "
            f"{{'type': 'json_schema', 'json_schema': {{'schema': {{...}}}}}}, "
            f"got {self.response_format!r}"
        )


class CompletionRequest(SamplingRequest):
    # Text, token ids, or a batch of either: each prompt gets n choices, as in vLLM.
    prompt: PromptInput
    max_tokens: Int64 = 16  # OpenAI's default for completions
    logprobs: NonNegativeInt64 | None = None
    # The prompt's text before the completion's (and, with logprobs, its tokens' logprobs).
    echo: bool = False
    suffix: Unsupported[str | None] = None
    add_special_tokens: Unsupported[bool] = True  # the prompt gets them (BOS)
    prompt_embeds: Unsupported[str | list[str] | None] = None
    # vLLM's: the n best sequences by beam search (`v1.beam_search`), ranked with
    # length_penalty (which, as in vLLM, does nothing without it), instead of n samples.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def engine_prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return prompt  # type: ignore[return-value]
        return [prompt]  # type: ignore[list-item]

    def to_sampling_params(self, limits: InputLimits = DEFAULT_LIMITS) -> SamplingParams:
        # As vLLM: echoed prompt tokens get logprobs like the generated ones.
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs, limits)


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | Items[TextPart] = ""  # null (an assistant's tool calls only) is ""
    # The participant's name (LangChain, AutoGen send it): the chat template gets it, as in
    # vLLM, and decides what it means (most ignore it).
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls is for assistant messages, not {self.role!r} ones")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages, and only they, need a tool_call_id")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (`template_message`: text parts joined by
        newlines, tool calls' arguments as objects), its unknown fields left out."""
        return template_message(self.model_dump(
            include={"role", "content", "name", "tool_calls", "tool_call_id"}, exclude_none=True
        ))


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    # OpenAI's schema adherence: named and required choices always constrain the output to
    # the schema; under "auto", strict functions' calls are (`hermes_structural_tag`).
    strict: bool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"  # as vLLM: may be left out
    function: FunctionDefinition


class FunctionName(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatTemplateRequest(OpenAIBaseModel):
    """A conversation and how the chat template renders it (vLLM's fields)."""

    messages: Items[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message is left open, to be continued
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    # A request's own template: vLLM, too, refuses it unless told to trust requests.
    chat_template: Unsupported[str | None] = None
    add_special_tokens: Unsupported[bool] = False  # the chat template holds them
    tools: Items[ChatCompletionTool] | None = None  # the template shows them to the model

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (JSON-schema style dicts)."""
        if self.tools is None:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


class ChatCompletionRequest(SamplingRequest, ChatTemplateRequest):
    max_tokens_fields: ClassVar[frozenset[str]] = frozenset({"max_tokens", "max_completion_tokens"})

    max_completion_tokens: Int64 | None = None
    max_tokens: Int64 | None = None  # deprecated by OpenAI for max_completion_tokens
    logprobs: bool = False
    top_logprobs: NonNegativeInt64 | None = None
    # Not given: "auto" with tools, else "none" (as OpenAI and vLLM).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # False: at most one call
    # OpenAI's fields we do not implement.
    functions: Unsupported[list[dict[str, Any]] | None] = None  # deprecated for tools
    function_call: Unsupported[str | dict[str, Any] | None] = None  # deprecated
    reasoning_effort: Unsupported[str | None] = None
    modalities: Unsupported[list[str] | None] = None
    audio: Unsupported[dict[str, Any] | None] = None
    prediction: Unsupported[dict[str, Any] | None] = None
    web_search_options: Unsupported[dict[str, Any] | None] = None
    # vLLM's: False leaves the reasoning (with --reasoning-parser) out of the reply.
    include_reasoning: bool = True
    # vLLM's chat extras we do not implement.
    documents: Unsupported[list[dict[str, str]] | None] = None
    # vLLM's: the reply starts with the last message's content when that is the assistant's
    # (a message being continued).
    echo: bool = False
    mm_processor_kwargs: Unsupported[dict[str, Any] | None] = None
    media_io_kwargs: Unsupported[dict[str, Any] | None] = None
    return_prompt_text: Unsupported[bool] = False

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        if choice is not None and choice != "none" and self.tools is None:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        names = [tool.function.name for tool in self.tools or []]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names {choice.function.name!r}, which is not in tools {names}"
            )
        return self

    def echoed_content(self) -> str:
        """What `echo` puts before the reply: the last message's text if it is the assistant's
        (the reply's role), else nothing (as vLLM)."""
        last = self.messages[-1].to_template_dict() if self.messages else {}
        return last.get("content") or "" if self.echo and last.get("role") == "assistant" else ""

    @property
    def effective_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice:
        if not self.tools:  # "required" with an empty list means none, as vLLM
            return "none"
        return "auto" if self.tool_choice is None else self.tool_choice

    def to_sampling_params(self, limits: InputLimits = DEFAULT_LIMITS) -> SamplingParams:
        """`limits` bound the tools' schemas too (all of them, as the template shows them
        all), checked here to name the one over a limit."""
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        for i, tool in enumerate(self.tools or []):
            if tool.function.parameters is not None:
                check_json_spec(tool.function.parameters, f"tools[{i}].function.parameters",
                                limits)
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens  # None: up to max_model_len
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self._sampling_params(max_tokens, logprobs, self.prompt_logprobs, limits)
        choice = self.effective_tool_choice
        if choice == "auto":
            params.skip_special_tokens = False  # the tool-call tags may be special tokens
        elif choice != "none":
            if params.structured_outputs is not None:
                raise ValueError(
                    f"tool_choice {choice if isinstance(choice, str) else 'with a function'} "
                    "constrains the output: it cannot be combined with response_format or "
                    "structured_outputs"
                )
            params.structured_outputs = StructuredOutputsParams(json=self._tool_call_schema())
        return params

    def _tool_call_schema(self) -> dict[str, Any]:
        """What a named or required choice constrains the output to: the function's arguments,
        or a non-empty array of calls, each `{"name": one tool, "parameters": its schema}`."""
        def parameters(tool: ChatCompletionTool) -> dict[str, Any]:
            return tool.function.parameters or {"type": "object", "properties": {}}

        tools = self.tools or []
        choice = self.effective_tool_choice
        if isinstance(choice, NamedToolChoice):
            return parameters(next(t for t in tools if t.function.name == choice.function.name))
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters(tool),
                },
                "required": ["name", "parameters"],
            }
            for tool in tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return schema


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/batch: `messages` is a list of conversations, each
    answered as a chat completion of its own with the request's other fields; choice i
    answers conversation i. As vLLM's: one choice each (n=1), no beam search, not streamed;
    tools are refused too (vLLM's batch model has none)."""

    messages: Items[  # type: ignore[assignment]
        Annotated[Items[ChatMessage], Field(min_length=1)]
    ] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_answer_per_conversation(self) -> "BatchChatCompletionRequest":
        for name, allowed in (("n", 1), ("stream", False), ("tools", None),
                              ("prompt_logprobs", None)):
            value = getattr(self, name)
            if value != allowed:
                raise ValueError(f"batch chat completions do not support {name}={value!r}")
        return self

    def conversations(self) -> list[ChatCompletionRequest]:
        """One chat completion request per conversation (the fields this one set, set)."""
        fields = self.model_dump(exclude={"messages"}, exclude_unset=True)
        return [
            ChatCompletionRequest.model_validate(
                {**fields, "messages": [m.model_dump(exclude_unset=True) for m in conversation]}
            )
            for conversation in self.messages
        ]


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: Unsupported[bool] = True  # as a completion's prompt gets them


class TokenizeChatRequest(ChatTemplateRequest):
    model: str | None = None


# vLLM's /tokenize takes a prompt, or messages to render with the chat template.
TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: Items[Int64]


# ---- responses ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: per generated token its text, logprob, the top
    alternatives and where it starts in the choice's text."""

    tokens: list[str] = []
    # None for an echoed prompt's first token, which has nothing before it.
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


def clamp_logprob(logprob: float) -> float:
    """-inf (a token that structured output or a bias ruled out) as -9999.0, as vLLM's
    clamp_prompt_logprobs: JSON has no infinity, and null is not a number to OpenAI's
    clients."""
    return max(logprob, -9999.0)


class PromptLogprob(BaseModel):
    """vLLM's `Logprob`, as its `prompt_logprobs` show it (made from ours, `v1.outputs.Logprob`)."""

    model_config = ConfigDict(from_attributes=True)

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None

    @field_validator("logprob")
    @classmethod
    def _clamped(cls, logprob: float) -> float:
        return clamp_logprob(logprob)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
    # vLLM's: per prompt token, token id -> its logprob (None for the first token).
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed one (OpenAI uses the same shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed call's piece: the first has its id, type and name; the rest add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: only tool calls
    tool_calls: list[ToolCall] = []
    # With --reasoning-parser: the model's reasoning, under vLLM's name and its older one.
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    # With --reasoning-parser: the model's reasoning, under vLLM's name and its older one.
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "v1"
    max_model_len: int
    # As vLLM's: the base model's path (an adapter's folder), and an adapter's base model.
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo

    @classmethod
    def make(cls, status: int, message: str, param: str | None = None) -> "ErrorResponse":
        """OpenAI's error body; its type is named after the status (400: BadRequestError)."""
        name = HTTPStatus(status).phrase.replace(" ", "")
        name = name if name.endswith("Error") else name + "Error"
        return cls(error=ErrorInfo(message=message, type=name, param=param, code=status))
