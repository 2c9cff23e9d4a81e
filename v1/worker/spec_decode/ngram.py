"""Prompt-lookup drafting (vLLM's "ngram" method): the request's last n tokens, for n from
`prompt_lookup_max` down to `prompt_lookup_min`, are looked up earlier in its own tokens;
the tokens that followed the most recent earlier occurrence are the draft.

The most recent occurrence, because what a request repeats (code it is editing, a list it
continues) is most often what it wrote last. Stateless: nothing to forget per request.
"""

from collections.abc import Hashable, Sequence

import numpy as np


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
        # An n-gram match ends where the last token occurs earlier: on text that does not
        # repeat there are few such places (often none), so only they are compared.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if not len(ends):
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            fit = ends[ends >= n - 1]  # room for n tokens up to the end
            windows = tokens[fit[:, None] - np.arange(n - 1, -1, -1)]
            matches = fit[(windows == tokens[-n:]).all(axis=1)]
            if len(matches):
                start = int(matches[-1]) + 1
                return tokens[start : start + k].tolist()
        return []

    def start(self, req_id: str, scope: Hashable) -> None:
        pass  # a request drafts from its own tokens only: no scope to keep apart

    def finish(self, req_id: str) -> None:
        pass

    def drop(self, req_id: str) -> None:
        pass
