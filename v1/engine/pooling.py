"""Setting up a pooling engine (runner="pooling"): the runner and pooler resolved from the
model, and the scheduler and cache settings pooling needs.

- "auto" pools checkpoints without an LM head (`registry.is_pooling_only`); "generate"
  refuses them.
- Prefix caching only for causal models pooled by their last token (a hit skips the hidden
  states MEAN and CLS read, and a bidirectional prefix's K/V depends on what follows).
- Bidirectional models see the whole prompt in one forward: no chunked prefill (the token
  budget is raised to max_model_len if need be); no async scheduling, drafts or disk tier.
"""

import logging
from typing import Any

from v1.config import CacheConfig, EngineArgs, SchedulerConfig
from v1.models.loader import LoadedModel
from v1.models.pooler import Pooler, resolve_pooler_info
from v1.models.registry import is_pooling_only

logger = logging.getLogger("v1")


def resolve_runner(runner: str, hf_config: Any) -> str:
    """"generate" or "pooling" for `EngineArgs.runner` and this checkpoint."""
    if runner == "auto":
        return "pooling" if is_pooling_only(hf_config) else "generate"
    return runner


def configure_pooling(
    args: EngineArgs,
    loaded: LoadedModel,
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
) -> Pooler | None:
    """The pooler of a pooling engine (None: the engine generates), adjusting the configs as
    the module docstring says; ValueError for options pooling cannot have."""
    model = loaded.model
    if resolve_runner(args.runner, loaded.hf_config) == "generate":
        if not model.has_lm_head:
            raise ValueError(
                f"model {loaded.model_name!r} ({type(model).__name__}) has no LM head to "
                "generate with: start it with runner='pooling' (--runner pooling)"
            )
        return None
    for name, value in (
        ("async_scheduling", args.async_scheduling),
        ("speculative_config", args.speculative_config),
        ("kv_cache_dir", args.kv_cache_dir),
    ):
        if value:
            raise ValueError(f"{name} is for generation: a pooling engine cannot have it")
    info = resolve_pooler_info(
        loaded.model_dir, loaded.hf_config, model.is_causal, model.num_labels,
        args.pooler_config,  # type: ignore[arg-type]  (a PoolerConfig after __post_init__)
    )
    if cache_config.enable_prefix_caching and not (info.causal and info.pooling_type == "LAST"):
        logger.info("pooling %s with %s attention: prefix caching off (cached tokens' hidden "
                    "states are not computed)", info.pooling_type,
                    "causal" if info.causal else "bidirectional")
        cache_config.enable_prefix_caching = False
    if not info.causal:
        scheduler_config.enable_chunked_prefill = False
        scheduler_config.long_prefill_token_threshold = 0
        scheduler_config.max_num_batched_tokens = max(
            scheduler_config.max_num_batched_tokens, scheduler_config.max_model_len
        )
    logger.info("pooling engine: %s pooling, normalize %s, %s attention", info.pooling_type,
                info.normalize, "causal" if info.causal else "bidirectional")
    return Pooler(info)
