"""The pooler: a request's final hidden states -> one vector, and where its settings come from.

`resolve_pooler_info` reads them as vLLM does (docs/pooling.md); modes and modules not
implemented raise ValueError rather than pool differently. Pooling is incremental over prefill
chunks (CLS keeps the first state, MEAN a running sum, LAST nothing); the vector comes with
the step computing the last prompt token.
"""

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from v1.config import PoolerConfig
from v1.pooling_params import POOLING_TYPES, PoolerInfo, PoolingParams

# sentence-transformers' pooling modes -> ours; the rest are refused.
_ST_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_ST_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}


def _st_pooling_mode(config: dict[str, Any], where: Path) -> str:
    mode = config.get("pooling_mode")
    if mode is None:  # sentence-transformers < 3: one boolean per mode
        modes = [m for key, m in _ST_LEGACY_FLAGS.items() if config.get(key)]
        mode = modes[0] if len(modes) == 1 else tuple(modes) or "mean"
    if isinstance(mode, list | tuple):
        mode = mode[0] if len(mode) == 1 else tuple(mode)
    if mode not in _ST_MODES:
        raise ValueError(
            f"{where}: pooling mode {mode!r} is not supported "
            f"(supported: {', '.join(_ST_MODES)})"
        )
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{where}: include_prompt=false is not supported")
    return _ST_MODES[mode]


def read_sentence_transformers_pooling(model_dir: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) of a sentence-transformers folder; None without
    modules.json, or with no Pooling module in it (a CrossEncoder folder: its model pools
    itself). ValueError for a module or mode the pooler does not implement."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type: str | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rpartition(".")[2]
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            config_file = model_dir / module.get("path", "") / "config.json"
            pooling_type = _st_pooling_mode(json.loads(config_file.read_text()), config_file)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(
                f"{modules_file}: sentence-transformers module {module.get('type')!r} is not "
                "supported (supported: Transformer, Pooling, Normalize)"
            )
    if pooling_type is None:
        if normalize:
            raise ValueError(f"{modules_file}: Normalize without a Pooling module")
        return None
    return pooling_type, normalize


def matryoshka_dimensions(hf_config: Any) -> list[int] | None:
    """vLLM's reading: config.json's `matryoshka_dimensions` (the sizes it was trained for) or
    `is_matryoshka` (any size: []); None when it is not Matryoshka."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return [int(d) for d in dims]
    return [] if getattr(hf_config, "is_matryoshka", False) else None


def resolve_pooler_info(
    model_dir: Path,
    hf_config: Any,
    causal: bool,
    num_labels: int | None = None,
    override: PoolerConfig | None = None,
) -> PoolerInfo:
    """The pooler of a model: `override`'s fields, else the sentence-transformers folder's,
    else vLLM's defaults (LAST for causal models, CLS for encoders; normalized)."""
    from_st = read_sentence_transformers_pooling(model_dir)
    pooling_type, normalize = from_st or ("LAST" if causal else "CLS", True)
    if override is not None:
        pooling_type = override.pooling_type or pooling_type
        normalize = normalize if override.normalize is None else override.normalize
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                         f"got {pooling_type!r}")
    id2label = {int(k): str(v) for k, v in (getattr(hf_config, "id2label", None) or {}).items()}
    labels = None
    if num_labels is not None and sorted(id2label) == list(range(num_labels)):
        labels = [id2label[i] for i in range(num_labels)]
    return PoolerInfo(
        pooling_type, normalize, int(hf_config.hidden_size), causal, num_labels,
        matryoshka_dimensions(hf_config), labels,
    )


class Pooler:
    """Pools each request's prompt, chunk by chunk (see the module docstring).

    `pool` is called once per step with the step's hidden states; per request it keeps at
    most one [hidden] tensor between steps, dropped by `forget` when the request finishes,
    is preempted (it resumes from its first token) or is aborted.
    """

    def __init__(self, info: PoolerInfo) -> None:
        self.info = info
        self.partial: dict[str, torch.Tensor] = {}

    def forget(self, req_id: str) -> None:
        self.partial.pop(req_id, None)

    def pool(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the step's tokens, requests one after another
        req_ids: list[str],
        query_start_loc: np.ndarray,  # int [R + 1]
        num_computed: np.ndarray,  # int [R]: tokens computed before this step
        num_prompt: np.ndarray,  # int [R]
    ) -> list[torch.Tensor | None]:
        """Per request, its pooled (raw) vector if this step finishes its prompt, else None."""
        starts, ends = query_start_loc[:-1], query_start_loc[1:]
        seq_lens = num_computed + (ends - starts)
        done = seq_lens >= num_prompt
        kind = self.info.pooling_type
        partial = self.partial
        pooled: list[torch.Tensor | None] = [None] * len(req_ids)
        if kind == "LAST":
            idx = np.flatnonzero(done)
            if len(idx):
                rows = hidden[torch.from_numpy(ends[idx] - 1).to(hidden.device)]
                for i, row in zip(idx.tolist(), rows):
                    pooled[i] = row
            return pooled
        if kind == "CLS":
            for i in range(len(req_ids)):
                if num_computed[i] == 0:
                    first = hidden[int(starts[i])]
                    if done[i]:
                        pooled[i] = first
                    else:
                        partial[req_ids[i]] = first.clone()
                elif done[i]:
                    pooled[i] = partial.pop(req_ids[i])
            return pooled
        # MEAN: one segment sum over the whole step, in fp32.
        token_req = torch.from_numpy(
            np.repeat(np.arange(len(req_ids)), ends - starts)
        ).to(hidden.device)
        sums = torch.zeros(len(req_ids), hidden.shape[1], dtype=torch.float32,
                           device=hidden.device)
        sums.index_add_(0, token_req, hidden.float())
        for i, req_id in enumerate(req_ids):
            total = sums[i]
            if num_computed[i] > 0:
                total = total + partial.pop(req_id)
            if done[i]:
                pooled[i] = total / float(num_prompt[i])
            else:
                partial[req_id] = total
        return pooled


def embedding_head(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """An embedding's post-processing, in fp32: Matryoshka truncation to `dimensions`,
    then L2 normalization (so a truncated embedding is renormalized), as vLLM's."""
    vector = vector.float()
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, p=2.0, dim=-1)
    return vector
