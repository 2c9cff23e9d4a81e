"""Draft proposers: what speculative decoding guesses, one request at a time.

A proposer sees a request's tokens (prompt + accepted output, newest last) and returns up
to k tokens it expects to follow; the model runner verifies them in the next step
(`v1.worker.spec_decode.drafter`). Proposers are model-free: "ngram" looks the request's
last tokens up in its own history, "suffix" in an index over recent requests.
"""

from collections.abc import Hashable, Sequence
from typing import Protocol

from v1.config import SpeculativeConfig


class DraftProposer(Protocol):
    def start(self, req_id: str, scope: Hashable) -> None:
        """A new request: `scope` (the runner's: its cache_salt and LoRA adapter) is whose
        tokens it may draft from; a proposer that keeps requests' tokens for others drafts a
        request only from those of its own scope. Kept until `finish`."""
        ...

    def propose(self, req_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `token_ids` (the request's prompt + its accepted output
        so far, newest last; a list, or the runner's numpy view of its token buffer, valid
        during the call only: copy what is kept); [] when it has none. Called once per request
        per step."""
        ...

    def finish(self, req_id: str) -> None:
        """The request left (finished or aborted): forget per-request state (an index over
        recent requests may keep its tokens)."""
        ...

    def drop(self, req_id: str) -> None:
        """The request was preempted: forget per-request state but its scope, keep nothing of
        it for others (it comes back later with the same tokens)."""
        ...


def make_proposer(config: SpeculativeConfig) -> DraftProposer:
    """The proposer of `config.method`, built from its keys."""
    if config.method == "ngram":
        from v1.worker.spec_decode.ngram import NgramProposer

        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        try:
            from v1.worker.spec_decode.suffix import SuffixProposer
        except ImportError as e:
            raise ValueError(f"speculative method 'suffix' is not available here: {e}") from e
        return SuffixProposer(
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
            max_cached_tokens=config.suffix_decoding_max_cached_tokens,
        )
    raise ValueError(f"unknown speculative method {config.method!r}")
