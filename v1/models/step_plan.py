"""The plan of one step: which path each part of its forward takes, decided once before the
forward and passed down to every layer (no thread-local or environment read on the step path).

`StepPlanner` is made once per model runner (`PlanOptions.from_env`); for GGUF blocks on
the C kernels it settles then, by the machine's calibration (v1.models.calibration), from
which chunk size prompt rows take "dense". `plan(metadata, kv_caches, is_prompt, logits)`
gives the `StepPlan`: op set, each matmul row's path, attention plans (in `metadata.plans`),
fused or not, the LM head in the fused call or not. `StepPlan.path` names the paths taken
(tests, DEBUG log).
"""

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from v1.attention.backends.abstract import AttentionMetadata, AttentionType
from v1.attention.backends.torch_attn import TorchAttentionImpl
from v1.attention.backends.torch_plan import AttentionPlan
from v1.envs import Environment
from v1.kernels.block_matmul import kernels
from v1.kernels.elementwise import NativeOps, native_ops
from v1.kernels.fused_step import fused_decoder
from v1.kernels.library import library
from v1.models import calibration
from v1.models.fused_decode import FusedDecode, FusedStep
from v1.models.layers.linear import VocabEmbedding
from v1.models.layers.ops import StepOps, TorchOps, ops_for_step
from v1.models.layers.quantized import (
    DEFAULT_POLICY,
    MatmulPolicy,
    MatmulRows,
    QuantizedWeight,
    block_weights,
)

logger = logging.getLogger("v1")


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """The settings steps are planned by (V1_FUSED_DECODE, V1_QUANT_*, V1_CPU_KERNELS,
    V1_MATMUL_CALIBRATION), read once. `calibration_dir`: where the matmul calibration is
    cached (None: none runs, `matmul` as given)."""

    fused_decode: bool = True
    matmul: MatmulPolicy = DEFAULT_POLICY
    # A V1_CPU_KERNELS value ("": the best library for this CPU); None: the environment's at
    # the planner's making, the library this process's weights were laid out for.
    cpu_kernels: str | None = None
    calibration_dir: Path | None = None

    @classmethod
    def from_env(cls, env: Environment) -> "PlanOptions":
        """The environment's settings; the calibration runs unless switched off or the
        matmul paths are set explicitly (V1_QUANT_ALL_INT8, V1_QUANT_INT8_MIN_ROWS)."""
        calibrate = env.matmul_calibration and not (
            env.explicit & {"V1_QUANT_ALL_INT8", "V1_QUANT_INT8_MIN_ROWS"})
        return cls(env.fused_decode, MatmulPolicy.from_env(env), env.cpu_kernels,
                   env.cache_dir / "calibration" if calibrate else None)


class StepPath(NamedTuple):
    """Which path a step's forward took, by part."""

    decoder: str  # "fused" (one C call for every layer), "fused+head" (the LM head in it too)
    # or "per-op"
    attention: str  # "kernel" (the C decode kernel), "sdpa", "kernel+sdpa", or "backend"
    matmul: str  # GGUF rows: "int8", "fp32", "dense", "<prompt rows' path>+<the others'>"
    # (prompt rows split out), "torch" (no kernels), or "none" (no block weights); kinds on
    # different paths: "<kind>/<kind>: <path>, <kind>: <path>"
    ops: str  # "native", "torch" or "torch-serial"


@dataclass(slots=True)
class StepPlan:
    """What every layer of one step reads: `metadata` (with its attention plans), `ops`, the
    matmul `rows`, and the fused step's attention entries where the step runs fused; after
    the forward, `logits` where the fused step ran the LM head (`fused.head`)."""

    metadata: AttentionMetadata
    ops: StepOps
    rows: MatmulRows
    path: StepPath
    fused: FusedStep | None = None  # None: the layers run one by one
    logits: torch.Tensor | None = None  # fp32 [T, vocab]: every row's, by the LM head


class StepPlanner:
    """Plans the steps of one model (see the module docstring). `model`: a decoder
    (`layers`, with `fused_decode`) or any model whose attention plans itself. `options`
    holds, once built, the matmul policy the steps take (the calibration's threshold in
    it)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device,
                 options: PlanOptions = PlanOptions()) -> None:
        self.dtype, self.device = dtype, device
        # The kernel library, once: nothing on a step's path looks it up again.
        self.lib = library(options.cpu_kernels)
        self.native_ops = native_ops(self.lib) if self.lib is not None else None
        self.block_kernels = kernels(self.lib) if self.lib is not None else None
        self.fused_decoder = fused_decoder(self.lib) if self.lib is not None else None
        self._fused: FusedDecode | None = next(
            (m.fused_decode for m in model.modules() if isinstance(
                getattr(m, "fused_decode", None), FusedDecode)), None)
        impls = [m.attn for m in model.modules() if hasattr(m, "attn")
                 and isinstance(m.attn, TorchAttentionImpl)
                 and m.attn.attn_type == AttentionType.DECODER]
        # The distinct (heads, window) of the layers the torch backend plans for.
        self._layouts = sorted({(i.num_heads, i.sliding_window) for i in impls}, key=repr)
        has_blocks = any(block_weights(getattr(m, "kernel", None)) for m in model.modules())
        self._blocks = ("none" if not has_blocks
                        else "torch" if self.block_kernels is None or dtype != torch.float32
                        or device.type != "cpu" else "")
        weights = _layer_weights(model)
        self._kinds = sorted({w.kind for w, _ in weights})  # the layers' block kinds
        if options.calibration_dir is not None and self._blocks == "" and weights:
            assert self.lib is not None and self.block_kernels is not None
            rows = calibration.prompt_dense_min_rows(
                self.block_kernels, calibration.library_id(self.lib), weights,
                options.calibration_dir)
            options = replace(options, matmul=replace(options.matmul,
                                                      prompt_dense_min_rows=rows))
        self.options = options
        self.head_rows = MatmulRows(options.matmul, self.block_kernels)  # by count alone

    def plan(self, metadata: AttentionMetadata, kv_caches: list[torch.Tensor],
             is_prompt: np.ndarray | None = None, logits: bool = False) -> StepPlan:
        """The step's plan; `is_prompt[t]`: whether token t is a prompt token (None: no
        token's kind matters); `logits`: whether the caller takes every row's logits (a
        fused step then runs the LM head, on the path `compute_logits` would take)."""
        num_tokens = metadata.num_actual_tokens
        ops = ops_for_step(self.device, self.dtype, num_tokens, self.native_ops)
        rows = self.options.matmul.rows(is_prompt, self.block_kernels)
        plans = [AttentionPlan.for_step(metadata, kv_caches[0], heads, window, self.dtype,
                                        self.lib) for heads, window in self._layouts]
        native = (plans[0].native_only() if plans and all(p is plans[0] for p in plans)
                  else None)
        matmul = self._blocks or _rows_path(rows, num_tokens, self._kinds)
        fused = None
        fd = self._fused
        if (
            self.options.fused_decode and fd is not None and native is not None
            and self.fused_decoder is not None and isinstance(ops, NativeOps)
            and matmul in ("fp32", "int8") and fd.layers is not None
        ):
            head = self.head_rows.policy.path_for(num_tokens)
            fused = FusedStep(self.fused_decoder, native.kernel, native.bound(kv_caches[0]),
                              matmul == "int8", head if logits and fd.layers.vocab
                              and head in ("int8", "fp32") else None)
        path = StepPath(
            "per-op" if fused is None else "fused+head" if fused.head else "fused",
            _attention_path(plans), matmul,
            "native" if isinstance(ops, NativeOps)
            else "torch-serial" if isinstance(ops, TorchOps) and ops.serial else "torch",
        )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step of %d tokens: %s", num_tokens, path)
        return StepPlan(metadata, ops, rows, path, fused)


def _layer_weights(model: nn.Module) -> list[tuple[QuantizedWeight, int]]:
    """One block weight per (kind, shape) the layers multiply by (not the LM head's, whose
    rows go by count), with how many weights share it."""
    head = getattr(model, "lm_head", None)
    shapes: dict[tuple[str, int, int], tuple[QuantizedWeight, int]] = {}
    for m in model.modules():
        if m is head or isinstance(m, VocabEmbedding):
            continue
        for w in block_weights(getattr(m, "kernel", None)):
            key = (w.kind, w.out_features, w.in_features)
            first, count = shapes.get(key, (w, 0))
            shapes[key] = (first, count + 1)
    return list(shapes.values())


def _rows_path(rows: MatmulRows, num_tokens: int, kinds: list[str]) -> str:
    """`StepPath.matmul` of a forward by weights of `kinds`."""
    def of(kind: str | None) -> str:
        path = rows.path(num_tokens, kind)
        if path is not None:
            return path
        assert rows.other is not None
        return f"{rows.prompt_path(kind)}+{rows.policy.path_for(len(rows.other))}"

    by_path: dict[str, list[str]] = {}
    for kind in kinds or [None]:
        by_path.setdefault(of(kind), []).append(str(kind))
    if len(by_path) == 1:
        return next(iter(by_path))
    return ", ".join(f"{'/'.join(k)}: {path}" for path, k in by_path.items())


def _attention_path(plans: list[AttentionPlan]) -> str:
    if not plans:
        return "backend"
    kernel = [p.native is not None for p in plans]
    sdpa = [bool(p.decodes or p.prefills or p.groups) for p in plans]
    if all(kernel) and not any(sdpa):
        return "kernel"
    return "kernel+sdpa" if any(kernel) else "sdpa"
