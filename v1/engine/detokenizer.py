"""Incremental detokenization and stop strings for one request's output."""

from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from v1.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How many prompt tokens may prime the stream, and how many decoded ids to keep as context
# for the final flush (see `_decode_in_context`).
_MIN_PRIME, _MAX_PRIME = 4, 24
_CONTEXT = 8
_REPLACEMENT = "\ufffd"  # what lossy UTF-8 decoding puts for an incomplete byte sequence


def get_backend_tokenizer(tokenizer: "PreTrainedTokenizerBase | Tokenizer") -> Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind a HF fast tokenizer (or the argument itself)."""
    backend: Any = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(backend, Tokenizer):
        raise ValueError(f"need a fast (Rust-backed) tokenizer, got {type(tokenizer).__name__}")
    return backend


class IncrementalDetokenizer:
    """Turns a request's output ids into text as they arrive, and cuts it at stop strings.

    `tokenizers.decoders.DecodeStream` does the incremental part: each step decodes a small
    window of ids and returns only new, complete text (None while the bytes so far end in an
    incomplete UTF-8 character). The stream is primed with a short prompt suffix, so that the
    first output token decodes as it would after the prompt (e.g. a SentencePiece "▁word"
    keeps its leading space).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stop: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Text that may still turn out to start a stop string is held back from the user;
        # when the stop string is kept in the output, nothing already shown is ever cut.
        self._holdback = 0
        if self._stop and not self._include_stop:
            self._holdback = max(len(s) for s in self._stop) - 1

        self._context = self._prompt_suffix(prompt_token_ids)  # ids whose text is complete
        self._pending: list[int] = []  # ids stepped whose text the stream still holds back
        self._stream = DecodeStream(self._context, skip_special_tokens=self._skip_special)
        self._num_tokens = 0
        self._num_chars_sent = 0  # of output_text, for delta outputs
        self.output_text = ""

    def update(
        self, new_token_ids: list[int], stop_terminated: bool, finished: bool
    ) -> tuple[str, int] | None:
        """Adds a step's tokens; when a stop string ended the text, returns it and how many of
        the step's tokens the output keeps: up to the one whose text completes it (a verified
        step of speculative decoding may bring tokens past it).

        With stop strings the tokens are added one at a time, as steps of one token each add
        them, so the text, the match and the cut do not depend on how many tokens a step
        brings. `stop_terminated`: the core stopped on EOS or a stop token id, which is the
        last of `new_token_ids`; like vLLM, its text is left out unless
        include_stop_str_in_output.
        """
        text_ids = new_token_ids
        if stop_terminated and not self._include_stop:
            text_ids = new_token_ids[:-1]
        if not self._stop:
            self._num_tokens += len(new_token_ids)
            self._add_text(text_ids, finished)
            return None
        for i in range(len(new_token_ids)):
            self._num_tokens += 1
            offset = len(self.output_text)
            self._add_text(text_ids[i : i + 1], finished and i == len(new_token_ids) - 1)
            if self._num_tokens <= self._min_tokens:  # as vLLM: not in the first min_tokens
                continue
            match = find_stop_string(self.output_text, len(self.output_text) - offset, self._stop)
            if match is not None:
                stop, start = match
                end = start + len(stop) if self._include_stop else start
                self.output_text = self.output_text[:end]
                return stop, i + 1
        return None

    def _add_text(self, token_ids: list[int], finished: bool) -> None:
        self.output_text += self._step(token_ids)
        if finished and self._pending:
            # The output ends inside a character: show what tokenizer.decode shows (U+FFFD).
            self.output_text += self._decode_in_context([])

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now: all of it, or only what was not shown before (delta)."""
        end = len(self.output_text) if finished else len(self.output_text) - self._holdback
        end = max(end, self._num_chars_sent)  # never take back text already shown
        if not delta:
            return self.output_text[:end]
        text = self.output_text[self._num_chars_sent : end]
        self._num_chars_sent = end
        return text

    def _prompt_suffix(self, prompt_token_ids: list[int]) -> list[int]:
        """The shortest prompt suffix of at least _MIN_PRIME ids that decodes cleanly.

        DecodeStream takes the primed ids' text as the prefix to strip only when it does not
        end in an incomplete character; otherwise the prompt's text would leak into the output.
        A suffix that starts inside a character is refused as well, to be safe.
        """
        num = len(prompt_token_ids)
        for length in range(min(_MIN_PRIME, num), min(_MAX_PRIME, num) + 1):
            suffix = prompt_token_ids[num - length :]
            if _REPLACEMENT not in self._decode(suffix):
                return suffix
        return []

    def _step(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        try:
            text = self._stream.step(self._tokenizer, token_ids)
        except Exception:
            # The stream raises when a decoder rewrites earlier text ("invalid prefix");
            # fall back to decoding against the context and restart the stream from there.
            return self._decode_in_context(token_ids)
        if text is None:
            self._pending += token_ids
            return ""
        self._context = (self._context + self._pending + token_ids)[-_CONTEXT:]
        self._pending = []
        return text

    def _decode_in_context(self, token_ids: list[int]) -> str:
        """Text of pending + token_ids as it reads after the context ids, decoded in one go."""
        ids = self._pending + token_ids
        before = self._decode(self._context)
        after = self._decode(self._context + ids)
        text = after[len(before) :] if after.startswith(before) else self._decode(ids)
        self._context = (self._context + ids)[-_CONTEXT:]
        self._pending = []
        self._stream = DecodeStream(self._context, skip_special_tokens=self._skip_special)
        return text

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)


class TokenTexts:
    """Each token's text on its own, special tokens shown (vLLM's `decoded_token` of a
    logprob). Cached: the same few thousand tokens come up again and again."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_ids: list[int]) -> list[str]:
        missing = [t for t in token_ids if t not in self._cache]
        if missing:
            texts = self._tokenizer.decode_batch([[t] for t in missing], skip_special_tokens=False)
            self._cache.update(zip(missing, texts, strict=True))
        return [self._cache[t] for t in token_ids]


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The stop string that completes first in `text`, and where it starts.

    Only matches ending in the last `num_new_chars` characters are new: earlier text was
    searched before. "Completes first" (earliest end, then earliest start) is what a
    character-by-character stream would hit, so the result does not depend on how the text
    was split into tokens or steps.
    """
    if num_new_chars <= 0:
        return None
    best: tuple[str, int] | None = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if start < 0:
            continue
        if best is None or (start + len(stop), start) < (best[1] + len(best[0]), best[1]):
            best = (stop, start)
    return best
