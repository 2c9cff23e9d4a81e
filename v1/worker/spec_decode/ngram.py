"""Prompt-lookup drafting (vLLM's "ngram" method): the request's last n tokens, for n from
`prompt_lookup_max` down to `prompt_lookup_min`, are looked up earlier in its own tokens;
the tokens that followed the most recent earlier occurrence are the draft.

The most recent occurrence, because what a request repeats (code it is editing, a list it
continues) is most often what it wrote last. Stateless: nothing to forget per request.
"""

from collections.abc import Hashable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                f"({prompt_lookup_max})"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, req_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids)
        num_tokens = len(tokens)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. num_tokens - n - 1: each has at least one token after it.
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start : start + k].tolist()
        return []

    def start(self, req_id: str, scope: Hashable) -> None:
        pass  # a request drafts from its own tokens only: no scope to keep apart

    def finish(self, req_id: str) -> None:
        pass

    def drop(self, req_id: str) -> None:
        pass
