"""The scheduler's group: the step's budget, chunked prefill, the admission policies."""

from dataclasses import dataclass

from v1.config.checks import check_choice, check_int, check_ints

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class SchedulerConfig:
    """One step's budget (`max_num_batched_tokens` tokens, `max_num_seqs` requests) and how
    waiting requests are admitted. Every value is checked when the config is made."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # Caps one request's prefill chunk per step (0: no cap) so several prompts progress;
    # a request alone in the scheduler is exempt (vLLM's rule) unless `cap_lone_prefill`
    # (on CPU: a prompt alone in 2048-token steps held a request arriving meanwhile for a
    # whole step, seconds at long contexts, and prefilled no faster: EngineArgs).
    long_prefill_token_threshold: int = 0
    cap_lone_prefill: bool = False
    policy: str = "fcfs"  # EngineArgs' scheduling_policy: one of SCHEDULING_POLICIES
    async_scheduling: bool = False
    # Prefix-aware admission (v1/core/sched/prefix_aware.py; SGLang's cache-aware policy,
    # bounded): among the first `prefix_aware_window` waiting requests, those with the
    # longest prefix cached or being computed go first, and one whose next uncached block a
    # running request is computing waits for it. A request passed over (or deferred) in
    # `prefix_aware_max_skips` steps makes admission FCFS until it is admitted. Under the
    # priority policy only requests tied with the head's priority are reordered. Needs
    # prefix caching (a no-op without it).
    enable_prefix_aware_scheduling: bool = True
    prefix_aware_window: int = 32
    prefix_aware_max_skips: int = 16
    # LoRA (EngineArgs.enable_lora): at most this many distinct adapters in one step (a
    # waiting request of another adapter waits; passed over in `prefix_aware_max_skips`
    # steps, it holds the step for its adapter); 0: LoRA off.
    max_loras: int = 0

    def __post_init__(self) -> None:
        check_ints(
            self,
            ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "prefix_aware_window",
             "prefix_aware_max_skips"),
        )
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, low=0)
        check_choice("scheduling_policy", self.policy, SCHEDULING_POLICIES)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is off, "
                "or the longest prompt could never be scheduled"
            )
