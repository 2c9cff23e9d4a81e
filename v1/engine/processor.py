"""Frontend input processing: prompts in, validated `EngineCoreRequest`s out.

Every check that can fail on user input happens here, with a ValueError that names the
value and the limit, before the engine core sees the request: `v1.config.limits`' among them, each
before the work it bounds. Text becomes token ids only through `encode`, which refuses text
that is not valid Unicode and a text too long for max_model_len before tokenizing it. It
also gives each request its internal id (see `EngineCoreRequest`).
"""

import copy
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jinja2

from v1.config.limits import (
    DEFAULT_LIMITS,
    INT64_MAX,
    INT64_MIN,
    InputLimits,
    check_text,
    check_token_id_lists,
    max_chars_per_token,
)
from v1.engine.structured_output import validate_structured_output_params
from v1.inputs import PromptType
from v1.lora.request import LoRARequest
from v1.openmp import load_torch_passively
from v1.pooling_params import PoolerInfo, PoolingParams
from v1.request import POOLING_SAMPLING_PARAMS, EngineCoreRequest
from v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from v1.sample.logits_processor import LogitsProcessor


def logits_processor_classes(specs: Sequence[Any] | None) -> list[type["LogitsProcessor"]]:
    """vLLM's `logits_processors` option as classes (`load_logits_processors`); their module
    imports torch, so only where one is given (a frontend otherwise never loads torch)."""
    if not specs:
        return []
    load_torch_passively()  # v1/openmp.py
    from v1.sample.logits_processor import load_logits_processors

    return load_logits_processors(specs)


def check_token_ids(token_ids: Any, vocab_size: int) -> list[int]:
    """Token ids as a list, each an int (not a bool) in the vocabulary; ValueError if not."""
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, str):
        raise ValueError(f"prompt_token_ids must be a list of ints, got {token_ids!r}")
    ids = list(token_ids)
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(
                f"token id {t!r} is out of vocabulary (valid: 0 to {vocab_size - 1})"
            )
    return ids


def _checked_cache_salt(prompt: PromptType, cache_salt: str | None = None) -> str | None:
    """A prompt dict's "cache_salt" (vLLM's prompt dicts carry it), else `cache_salt`: valid
    text or None, else ValueError."""
    if isinstance(prompt, Mapping):
        cache_salt = prompt.get("cache_salt", cache_salt)
    if cache_salt is not None:
        if not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        check_text(cache_salt, "cache_salt")
    return cache_salt


def prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """`prompts` as a list: one prompt (text, a dict or token ids) becomes a list of it."""
    if isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)


class PromptTooLongError(ValueError):
    """A text with more characters than max_model_len tokens can cover: refused untokenized.
    Its own class so that a caller that can shorten the text (the Responses API's
    `truncation: "auto"`) tells it from other bad input."""


class Processor:
    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        eos_token_id: int | None,
        extra_stop_token_ids: Sequence[int] = (),
        scheduling_policy: str = "fcfs",
        limits: InputLimits = DEFAULT_LIMITS,
        pooler: PoolerInfo | None = None,
        logits_processors: Sequence[type["LogitsProcessor"]] = (),
    ) -> None:
        """`logits_processors`: the engine's custom ones, whose `validate_params` check
        each request's parameters here."""
        self.tokenizer = tokenizer
        self.logits_processors = tuple(logits_processors)
        # A pooling engine's pooler: it takes PoolingParams only (None: SamplingParams only).
        self.pooler = pooler
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.extra_stop_token_ids = tuple(extra_stop_token_ids)
        self.scheduling_policy = scheduling_policy  # the engine core's: priority needs it
        self.limits = limits
        # A text longer than max_model_len times this is refused untokenized, and why.
        per_token = None if tokenizer is None else max_chars_per_token(tokenizer)
        if per_token is None:
            per_token = limits.max_chars_per_unbounded_token
            self._chars_bound = (
                f"max_chars_per_unbounded_token ({per_token}) characters each, as this "
                "model's vocabulary bounds none"
            )
        else:
            self._chars_bound = f"this model's tokens cover at most {per_token} characters each"
        self._max_chars_per_token = per_token

    def encode(self, text: str, what: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids. `what` names it in the ValueError for text that is not valid
        Unicode (the tokenizer would raise TypeError) or that has more characters than
        max_model_len tokens can cover, which is refused without tokenizing it (a prompt of
        megabytes costs seconds and hundreds of MB to tokenize)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        check_text(text, what)
        self._check_chars(len(text), what)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_chars(self, num_chars: int, what: str) -> None:
        if num_chars > self.max_model_len * self._max_chars_per_token:
            raise PromptTooLongError(
                f"{what} has {num_chars} characters, more than max_model_len "
                f"({self.max_model_len}) tokens can hold: {self._chars_bound}"
            )

    def encode_pair(self, text_1: str, text_2: str) -> list[int]:
        """The token ids of a text pair as one input (a cross-encoder's: the tokenizer's
        pair template, e.g. `[CLS] a [SEP] b [SEP]`), refused untokenized as `encode`
        refuses a text when the two together are too long."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        check_text(text_1, "the first text")
        check_text(text_2, "the second text")
        self._check_chars(len(text_1) + len(text_2), "the text pair")
        return list(self.tokenizer(text_1, text_2)["input_ids"])

    def encode_conversation(self, text: str) -> list[int]:
        """The token ids of a conversation as `apply_chat_template` rendered it: the template
        holds the special tokens already, so no second BOS (as vLLM)."""
        return self.encode(
            text, "the conversation (as the chat template renders it)", add_special_tokens=False
        )

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got {prompt!r}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.encode(prompt, "the prompt")
        if isinstance(prompt, Sequence):
            return None, self._check_ids(prompt)
        raise ValueError(f"a prompt must be a string, token ids or a dict, got {type(prompt)}")

    def check_prompt_len(self, token_ids: Sequence[int]) -> None:
        """A prompt has 1 to max_model_len tokens."""
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_model_len "
                f"({self.max_model_len})"
            )

    def prompt_token_ids(self, prompt: PromptType) -> list[int]:
        """The prompt's token ids, checked as `process_inputs` checks them (its cache salt
        too)."""
        token_ids = self.tokenize_prompt(prompt)[1]
        _checked_cache_salt(prompt)
        self.check_prompt_len(token_ids)
        return token_ids

    def _check_ids(self, token_ids: Any) -> list[int]:
        return check_token_ids(token_ids, self.vocab_size)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The conversation as the template renders it, as vLLM: `chat_template` replaces the
        model's, `continue_final_message` leaves the last message open for the model to
        go on with, and `chat_template_kwargs` reach the template as variables (overriding
        the two flags, as vLLM's do). `tools` (OpenAI's function definitions) reach the
        template as `tools`; a template that does not use them ignores them. Whatever the
        template raises is the caller's ValueError: what it renders is the request's."""
        if not messages:
            raise ValueError("messages is empty")
        messages = [template_message(m) for m in messages]
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: pass one")
        kwargs = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            **(chat_template_kwargs or {}),
        }
        # These two are the call's own: as template variables they would break it.
        reserved = {"tokenize", "chat_template", "tools"} & kwargs.keys()
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")
        if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=chat_template, tokenize=False,
                tools=None if tools is None else list(tools), **kwargs,
            )
        except jinja2.TemplateError as e:  # the template refused the conversation
            raise ValueError(f"the chat template failed: {e}") from e
        except Exception as e:  # e.g. a kwarg that clashes with the template's own variables
            raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from e

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each word's tokens alone and after a space (as vLLM): a word mid-text usually
        tokenizes with its leading space."""
        if bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer: this model has none")
        token_ids: list[list[int]] = []
        for word in bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.encode(text, "a bad word", add_special_tokens=False)
                if ids and ids not in token_ids:
                    token_ids.append(ids)
        return token_ids

    def _check_limits(self, params: SamplingParams) -> None:
        """`InputLimits`' bounds on what one request's parameters may cost, checked before
        any of that cost (tokenizing, parsing a grammar) is paid."""
        limits = self.limits

        def refuse(what: str, limit_name: str) -> ValueError:
            return ValueError(f"{what}, more than {limit_name} ({getattr(limits, limit_name)})")

        if params.n > limits.max_n_sequences:
            raise refuse(f"n is {params.n}", "max_n_sequences")
        check_token_id_lists(params.n, {
            "stop_token_ids": params.stop_token_ids,
            "allowed_token_ids": params.allowed_token_ids,
            "logit_bias": params.logit_bias,
        }, limits, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limits.max_logprobs:
                raise refuse(f"{name} is {value}", "max_logprobs")
        for name, strings, max_count, max_len in (
            ("stop", params.stop or [], "max_stop_strings", "max_stop_string_len"),
            ("bad_words", params.bad_words or [], "max_num_bad_words", "max_bad_word_len"),
        ):
            if len(strings) > getattr(limits, max_count):
                raise refuse(f"{name} has {len(strings)} strings", max_count)
            longest = max(map(len, strings), default=0)
            if longest > getattr(limits, max_len):
                raise refuse(f"{name} has a string of {longest} characters", max_len)
        if params.structured_outputs is not None:
            params.structured_outputs.check_limits(limits)

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("LoRA adapters are for generation, not pooling requests")
            return self._process_pooling(request_id, prompt, params, arrival_time, priority)
        if self.pooler is not None:
            raise ValueError("this is a pooling model (runner='pooling'): it takes "
                             "PoolingParams (LLM.embed, encode, classify, score), not generation")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params)}")
        self._check_priority(priority)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request)}")
        self._check_limits(params)
        for processor in self.logits_processors:
            processor.validate_params(params)
        text, token_ids = self.tokenize_prompt(prompt)
        cache_salt = _checked_cache_salt(prompt, cache_salt)
        self.check_prompt_len(token_ids)
        params = copy.copy(params)  # the core's copy: the caller may reuse theirs
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is None:
            params.max_tokens = max(room, 1)
        params.all_stop_token_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:  # the generation config's further end-of-text ids
            params.all_stop_token_ids.update(self.extra_stop_token_ids)
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids),
        ):
            if ids and max(ids) >= self.vocab_size:
                raise ValueError(
                    f"{name} {getattr(params, name)} has an id outside the vocabulary "
                    f"(valid: 0 to {self.vocab_size - 1})"
                )
        params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words or [])
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer: this model has none")
            validate_structured_output_params(params.structured_outputs)
            if params.min_tokens:
                # The grammar may allow only EOS before min_tokens, which min_tokens bans.
                raise ValueError(
                    f"min_tokens ({params.min_tokens}) cannot be combined with "
                    "structured_outputs: leave it at 0"
                )
        request = EngineCoreRequest(
            # A uuid, not a counter: unique across the frontend processes sharing a core, and
            # a reused caller id never meets its predecessor's steps still in flight there.
            request_id=f"{request_id}-{uuid.uuid4().hex}",
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            external_req_id=request_id,
            lora_request=lora_request,
        )
        return request, text

    def _check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be an int64 (from -2**63 to 2**63 - 1), "
                             f"got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            # vLLM's words: clients match them to retry without priority.
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")

    def require_pooler(self) -> PoolerInfo:
        """The pooler of a pooling engine; ValueError for an engine that generates (what
        `LLM.embed` and the pooling endpoints say, as the processor does)."""
        if self.pooler is None:
            raise ValueError("pooling (encode, embed, classify, score) needs a pooling model: "
                             "start the engine with runner='pooling' (--runner pooling)")
        return self.pooler

    def _process_pooling(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None,
        priority: int,
    ) -> tuple[EngineCoreRequest, str | None]:
        """A pooling request: its params checked against the pooler (`params.task` set by
        the caller, e.g. `LLM.embed`), its prompt truncated to `truncate_prompt_tokens`."""
        pooler = self.require_pooler()
        params = copy.copy(params)  # the core's copy: the caller may reuse theirs
        params.verify(params.task or pooler.default_task, pooler)
        self._check_priority(priority)
        text, token_ids = self.tokenize_prompt(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None:
            if keep > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens ({keep}) exceeds max_model_len "
                                 f"({self.max_model_len})")
            token_ids = token_ids[-(self.max_model_len if keep == -1 else keep):]
        self.check_prompt_len(token_ids)
        request = EngineCoreRequest(
            request_id=f"{request_id}-{uuid.uuid4().hex}",
            prompt_token_ids=token_ids,
            sampling_params=POOLING_SAMPLING_PARAMS,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            external_req_id=request_id,
            pooling_params=params,
        )
        return request, text


def template_message(message: Any) -> dict[str, Any]:
    """A chat message as templates read it, as vLLM's message parsing gives it: its content
    text (text parts joined by newlines; none or null: ""), its tool calls' arguments as
    objects (templates write them with `tojson`; OpenAI sends JSON text); other keys kept."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"each message needs a 'role', got {message!r}")
    result = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, Mapping) and part.get("type") == "text"
                   and isinstance(part.get("text"), str) for part in content):
            raise ValueError(
                f"content parts must be {{'type': 'text', 'text': str}} (text only), got "
                f"{content!r:.200}"
            )
        content = "\n".join(part["text"] for part in content)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"content must be a string or a list of text parts, got {content!r:.200}")
    result["content"] = content or ""
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ValueError(f"tool_calls must be a list, got {calls!r:.200}")
        result["tool_calls"] = [_with_object_arguments(call) for call in calls]
    return result


def _with_object_arguments(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise ValueError(f"a tool call needs a 'function', got {call!r:.200}")
    arguments = function.get("arguments") or "{}"  # none: {}, as vLLM
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError) as e:  # (nested past the parser's depth)
            raise ValueError(
                f"tool call arguments must be a JSON object, got {arguments!r:.200}: {e}"
            ) from e
    if not isinstance(arguments, Mapping):
        raise ValueError(f"tool call arguments must be a JSON object, got {arguments!r:.200}")
    return {**call, "function": {**function, "arguments": arguments}}
