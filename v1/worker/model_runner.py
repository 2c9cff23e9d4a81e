"""Runs one scheduled step: update the persistent batch, prepare the inputs and the step's
plan, forward, then pool or sample (verifying drafts), and the disk tier's loads and stores.

`execute_model` is that sequence of named calls, each returning a small typed value
(`StepInputs`, hidden states, `StepTokens`, `ModelRunnerOutput`). The step's plan
(`v1.models.step_plan.StepPlan`) is built here once per step from settings read once, when the
runner is built, and passed to the model; `StepPlan.path` says which paths ran (DEBUG log).

Only the last token of a request whose known tokens are all computed after this step is
sampled; a request with k drafts has its last k + 1 rows sampled and verified, and keeps
`num_computed_tokens` past its accepted tokens only. The input formulas, prompt logprobs,
drafts and the disk tier's order of work: docs/design.md, "The model runner's step".
"""

import contextlib
import ctypes
import ctypes.util
import logging
import sys
import time
from pathlib import Path
from typing import NamedTuple, cast

import numpy as np
import torch

from v1 import envs
from v1.attention.backends.abstract import AttentionImpl, AttentionMetadata, kv_cache_shape
from v1.config import CacheConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from v1.lora.worker_manager import LoRAWorkerManager
from v1.models.decoder import head_dim_of, num_kv_heads_of
from v1.models.loader import LoadedModel
from v1.models.pooler import Pooler
from v1.models.step_plan import PlanOptions, StepPlan, StepPlanner
from v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, TokenLogprobs
from v1.sample.logits_processor import BatchLogits, BatchUpdateBuilder, LogitsProcessors
from v1.sampling_params import SamplingParams
from v1.worker.input_batch import InputBatch
from v1.worker.kv_disk_store import DiskKVStore, cache_key_facts
from v1.worker.pooling import RunnerPooling
from v1.worker.sampler import (
    NUMPY_FLOATS,
    BadWords,
    Sampler,
    SamplingMetadata,
    StepTokens,
    TokenCounts,
    gather_logprobs,
)
from v1.worker.spec_decode.drafter import Drafter, StepDrafts, Verification
from v1.worker.spec_decode.step_cost import MeasuredStepCosts

logger = logging.getLogger("v1")

_DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def tune_cpu_malloc() -> bool:
    """Keep freed activation memory in the process (glibc malloc) instead of returning it to
    the OS after every step: raises the mmap and trim thresholds so blocks under 64 MiB come
    from, and go back to, the heap (the KV cache is still mapped). Returns whether applied.
    Why: docs/benchmarks.md, "Model runner: malloc and grammar masks"."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 64 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def apply_grammar_bitmask(
    logits: torch.Tensor, bitmask: np.ndarray, logit_rows: list[int]
) -> None:
    """Set to -inf the logits of tokens the grammar forbids: bitmask row i (32 tokens per
    int32 word, bit set: allowed) masks logits row `logit_rows[i]`, in place, before any
    sampling. On CPU numpy unpacks the words (little-endian: byte b's bit j is token 8b + j),
    the fastest of the ways measured (docs/benchmarks.md); elsewhere torch unpacks them on the
    device."""
    vocab_size = logits.shape[1]
    if logits.device.type == "cpu" and logits.dtype in NUMPY_FLOATS and _LITTLE_ENDIAN:
        forbidden = np.unpackbits(
            np.invert(bitmask).view(np.uint8), axis=1, count=vocab_size, bitorder="little"
        ).view(np.bool_)
        values = logits.numpy()
        for mask, row in zip(forbidden, logit_rows):
            np.copyto(values[row], -np.inf, where=mask)
        return
    words = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
    index = torch.tensor(logit_rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


_LITTLE_ENDIAN = sys.byteorder == "little"


class StepInputs(NamedTuple):
    """One step's inputs, per request in the scheduler's order (host arrays) and per token."""

    req_ids: list[str]
    rows: np.ndarray  # each request's batch row
    num_scheduled: np.ndarray
    num_computed: np.ndarray  # before this step
    query_start_loc: np.ndarray
    seq_lens: np.ndarray  # after this step
    drafts: StepDrafts
    # The requests that sample: every known token is computed after this step; each samples
    # its last 1 + k rows (k drafts).
    sample_idx: np.ndarray
    every_row: bool  # every row is sampled (each request's rows are its 1 + k)
    input_ids: np.ndarray  # per token
    positions: np.ndarray
    plan: StepPlan


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On the CPU from calloc, whose fresh pages the kernel zeroes when
    first touched: a 2 GiB KV cache costs no second of memset at start, and is resident only
    as far as it is used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64  # 64-byte aligned, as torch's own allocations
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


def attention_impl_for(device: torch.device) -> type[AttentionImpl]:
    if device.type == "cuda":
        from v1.attention.backends.triton_attn import TritonAttentionImpl

        return TritonAttentionImpl
    from v1.attention.backends.torch_attn import TorchAttentionImpl

    return TorchAttentionImpl


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        device: torch.device,
        dtype: torch.dtype,
        speculative_config: SpeculativeConfig | None = None,
        lora_config: LoRAConfig | None = None,
        pooler: Pooler | None = None,
        plan_options: PlanOptions | None = None,
        logitsprocs: LogitsProcessors | None = None,
    ) -> None:
        """`plan_options`: how steps are planned (None: from the environment, read here);
        `logitsprocs`: the custom logits processors (v1.sample.logits_processor), if any."""
        self.device = device
        self.drafter = (Drafter(speculative_config, MeasuredStepCosts())
                        if speculative_config is not None else None)
        self.dtype = dtype
        if device.type == "cpu":
            tune_cpu_malloc()
        self.block_size = cache_config.block_size
        # What the cache stores; attention converts K/V to it once, on the write, and reads
        # it back in the model's dtype (a 16-bit cache under fp32 holds twice the tokens).
        cache_dtype = cache_config.cache_dtype
        self.kv_cache_dtype: torch.dtype = (
            dtype if cache_dtype == "auto" else getattr(torch, cache_dtype)
        )
        self.loaded = loaded
        self.model = loaded.model
        self.hf_config = self.loaded.hf_config
        self.vocab_size = int(self.hf_config.vocab_size)
        self.max_model_len = scheduler_config.max_model_len
        self.logitsprocs = logitsprocs or None
        self.input_batch = InputBatch(
            scheduler_config.max_num_seqs, self.max_model_len, self.block_size, self.vocab_size,
            device, BatchUpdateBuilder() if self.logitsprocs else None,
        )
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self._sampling_metadata: SamplingMetadata | None = None
        self._sampling_key: tuple[int, bytes] = (-1, b"")
        self._preempted: dict[str, tuple[SamplingParams, int, torch.Generator | None]] = {}
        # Requests owed prompt logprobs -> those of the chunks computed so far.
        self.in_progress_prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        self.kv_disk: DiskKVStore | None = None
        # LoRA (v1.lora): wraps the model's linear layers; None: off, nothing here costs.
        self.lora = (
            LoRAWorkerManager(self.model, lora_config, dtype) if lora_config is not None
            else None
        )
        # A pooling engine (runner="pooling", v1.worker.pooling): it pools, never samples.
        self.pooling = RunnerPooling(pooler, self.model) if pooler is not None else None
        if plan_options is None:
            plan_options = PlanOptions.from_env(envs.read())
        self.planner = StepPlanner(self.model, dtype, device, plan_options)

    # -- KV cache ---------------------------------------------------------------------

    def kv_cache_block_bytes(self) -> int:
        cfg = self.hf_config
        head_dim = head_dim_of(self.hf_config)
        elem = self.kv_cache_dtype.itemsize
        per_token = 2 * cfg.num_hidden_layers * num_kv_heads_of(cfg) * head_dim * elem
        return per_token * self.block_size

    def determine_num_blocks(self, cache_config: CacheConfig) -> int:
        if cache_config.num_gpu_blocks is not None:
            return cache_config.num_gpu_blocks
        budget = cache_config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                # The weights are loaded by now: they count in what is not free.
                free, total = torch.cuda.mem_get_info(self.device)
                utilization = cache_config.gpu_memory_utilization
                budget = (
                    int(free * 0.85) if utilization is None
                    else int(total * utilization) - (total - free)
                )
            else:
                budget = _DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // self.kv_cache_block_bytes()
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory of {budget} bytes is less than one KV block "
                f"({self.kv_cache_block_bytes()} bytes)"
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        cfg = self.hf_config
        shape = kv_cache_shape(
            num_blocks, self.block_size, num_kv_heads_of(cfg), head_dim_of(cfg)
        )
        self.kv_caches = [
            _zeros(shape, self.kv_cache_dtype, self.device) for _ in range(cfg.num_hidden_layers)
        ]
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens, %s)", num_blocks,
            self.block_size, num_blocks * self.kv_cache_block_bytes() / 2**20,
            num_blocks * self.block_size, str(self.kv_cache_dtype).removeprefix("torch."),
        )

    def open_kv_disk(self, root: Path) -> DiskKVStore:
        """The disk tier's store for this model and KV setting, under `root`."""
        cfg = self.hf_config
        head_size = head_dim_of(cfg)
        facts = cache_key_facts(
            self.loaded.model_path, cfg, head_size, self.dtype, self.kv_cache_dtype,
            self.loaded.quantization, self.block_size,
        )
        shape = (cfg.num_hidden_layers, 2, self.block_size, num_kv_heads_of(cfg), head_size)
        self.kv_disk = DiskKVStore(root, facts, shape, self.kv_cache_dtype)
        return self.kv_disk

    def _disk_io_after_forward(
        self, out: SchedulerOutput, result: ModelRunnerOutput, kv_loaded: dict[str, int] | None
    ) -> ModelRunnerOutput:
        kv_disk = self.kv_disk
        assert kv_disk is not None
        if out.kv_stores:
            kv_disk.save(self.kv_caches, out.kv_stores)
        if out.kv_deletes:
            kv_disk.delete(out.kv_deletes)
        result.kv_loaded = kv_loaded
        result.kv_stored = kv_disk.take_stored()
        return result

    # -- one step ---------------------------------------------------------------------

    def _update_states(self, out: SchedulerOutput) -> None:
        """The persistent batch brought to the step: finished and preempted requests out,
        new and resumed ones in (into the rows freed first), the others' new blocks appended,
        then the rows condensed; custom logits processors are told what changed."""
        for req_id in out.finished_req_ids:
            self._finish_request(req_id)
        for req_id in out.preempted_req_ids:
            self._preempt_request(req_id)
        for new in out.scheduled_new_reqs:
            self._add_request(new)
        self._update_cached(out.scheduled_cached_reqs)
        # After the adds: a row is then only ever moved from a live request, never from one
        # added this step, as a BatchUpdate's order (removed, added, moved) requires.
        self.input_batch.condense()
        if self.logitsprocs:
            builder = self.input_batch.batch_update_builder
            assert builder is not None
            self.logitsprocs.update_state(builder.get_and_reset(self.input_batch.num_reqs))

    def _finish_request(self, req_id: str) -> None:
        batch = self.input_batch
        if self.drafter is not None and (
            req_id in batch.req_id_to_index or req_id in self._preempted
        ):
            self.drafter.finish(req_id)
        batch.remove_request(req_id)
        self._preempted.pop(req_id, None)
        self.in_progress_prompt_logprobs.pop(req_id, None)
        if self.lora is not None:
            self.lora.finish_request(req_id)
        if self.pooling is not None:
            self.pooling.finish(req_id)

    def _preempt_request(self, req_id: str) -> None:
        """Out of the batch until resumed; its params and seeded generator wait here."""
        batch = self.input_batch
        row = batch.req_id_to_index[req_id]
        params = batch.sampling_params[row]
        assert params is not None
        self._preempted[req_id] = (
            params, int(batch.num_prompt_tokens[row]), batch.generators.get(req_id)
        )
        batch.remove_request(req_id)
        if self.drafter is not None:
            self.drafter.finish(req_id, preempted=True)
        if req_id in self.in_progress_prompt_logprobs:  # it resumes from its first token
            self.in_progress_prompt_logprobs[req_id] = []
        if self.pooling is not None:
            self.pooling.preempt(req_id)

    def _add_request(self, new: NewRequestData) -> None:
        params = new.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        self.input_batch.add_request(
            new.req_id, new.prompt_token_ids, len(new.prompt_token_ids),
            new.num_computed_tokens, new.block_ids, params, generator,
        )
        if params.prompt_logprobs is not None:
            self.in_progress_prompt_logprobs[new.req_id] = []
        if self.drafter is not None:
            # Drafts from its own tenant's answers only, as its prefix-cache hits are.
            lora = new.lora_request
            self.drafter.proposer.start(
                new.req_id, (new.cache_salt, None if lora is None else lora.lora_int_id)
            )
        if self.lora is not None:
            self.lora.add_request(new.req_id, new.lora_request)
        if self.pooling is not None:
            self.pooling.add(new.req_id, new.pooling_params)

    def _update_cached(self, cached: CachedRequestData) -> None:
        batch = self.input_batch
        for i, req_id in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:
                tokens = cached.resumed_token_ids[i]
                assert tokens is not None
                params, num_prompt, generator = self._preempted.pop(req_id)
                batch.add_request(
                    req_id, tokens, num_prompt, cached.num_computed_tokens[i],
                    cached.new_block_ids[i], params, generator,
                )
            else:
                row = batch.req_id_to_index[req_id]
                batch.block_table.append_row(row, cached.new_block_ids[i])
                if self.drafter is None:
                    batch.num_computed_tokens[row] = cached.num_computed_tokens[i]
                # else ours is right: under async the scheduler's counts drafts still in
                # flight as accepted (it rolls them back when their output comes)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(out)
        kv_loaded = self._load_from_disk(out)
        if out.total_num_scheduled_tokens == 0:
            if self.kv_disk is None:
                return EMPTY_MODEL_RUNNER_OUTPUT
            return self._disk_io_after_forward(out, ModelRunnerOutput([], []), kv_loaded)
        start = time.perf_counter()
        step = self._prepare_inputs(out)
        hidden = self._forward(step)
        if self.pooling is not None:  # pooled vectors instead of sampled tokens
            return self._pool(step, hidden)
        result = self._generate(out, step, hidden)
        if self.lora is not None:
            result.nonfinite_req_ids = self.lora.nonfinite_requests(
                step.req_ids, step.num_scheduled, hidden
            )
        if self.drafter is not None:  # drafts are priced on timed steps
            self.drafter.record_step(len(step.req_ids), out.total_num_scheduled_tokens,
                                     int(step.drafts.num.sum()), time.perf_counter() - start)
        if self.kv_disk is not None:
            return self._disk_io_after_forward(out, result, kv_loaded)
        return result

    def _load_from_disk(self, out: SchedulerOutput) -> dict[str, int] | None:
        """Begins the step's disk-tier loads and goes on with earlier ones (a bounded read
        per step); blocks loaded per request whose load finished."""
        if self.kv_disk is None:
            return None
        return self.kv_disk.load(self.kv_caches, out.kv_loads)

    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """The step's token rows (module docstring), its attention metadata and its plan."""
        batch = self.input_batch
        req_ids = list(out.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), np.int64, len(req_ids))
        num_scheduled = np.fromiter(out.num_scheduled_tokens.values(), np.int32, len(req_ids))
        num_computed = batch.num_computed_tokens[rows]
        drafts = StepDrafts(np.zeros(len(req_ids), dtype=np.int32), {})
        if out.scheduled_spec_decode_tokens:
            assert self.drafter is not None
            drafts = self.drafter.write_drafts(batch, out.scheduled_spec_decode_tokens, req_ids)
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        token_req = np.repeat(np.arange(len(req_ids)), num_scheduled)
        positions = (
            np.arange(int(query_start_loc[-1]), dtype=np.int64)
            - query_start_loc[:-1][token_req]
            + num_computed[token_req]
        )
        token_rows = rows[token_req]
        seq_lens = num_computed + num_scheduled
        metadata = self._attention_metadata(rows, token_rows, positions, query_start_loc,
                                            seq_lens, num_scheduled, num_computed)
        # Quantized weights: prompt tokens' rows may take their own matmul path (the plan's
        # rows, `MatmulPolicy`); the LM head is outside.
        is_prompt = (
            positions < batch.num_prompt_tokens[token_rows]
            if self.loaded.quantization is not None else None
        )
        sample_idx = np.flatnonzero(seq_lens - drafts.num >= batch.num_tokens[rows])
        every_row = len(sample_idx) == len(req_ids) and out.total_num_scheduled_tokens == (
            len(req_ids) + (int(drafts.num.sum()) if drafts.by_index else 0))
        # Only then may the plan run the LM head in the step (a prompt chunk's rows would be
        # computed for nothing).
        return StepInputs(
            req_ids, rows, num_scheduled, num_computed, query_start_loc, seq_lens, drafts,
            sample_idx, every_row, batch.token_ids[token_rows, positions], positions,
            self.planner.plan(metadata, self.kv_caches, is_prompt,
                              every_row and self.pooling is None),
        )

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the runner's device (on the CPU: the array's memory;
        a `.to` that changes nothing still costs a dispatch, several per step)."""
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def _attention_metadata(
        self, rows: np.ndarray, token_rows: np.ndarray, positions: np.ndarray,
        query_start_loc: np.ndarray, seq_lens: np.ndarray, num_scheduled: np.ndarray,
        num_computed: np.ndarray,
    ) -> AttentionMetadata:
        batch = self.input_batch
        slot_mapping = batch.block_table.slot_mapping(token_rows, positions)
        max_blocks = int(batch.block_table.num_blocks[rows].max())
        block_table = batch.block_table.table[rows, :max_blocks]
        return AttentionMetadata(
            num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=self._to_device(query_start_loc),
            seq_lens=self._to_device(seq_lens),
            block_table=self._to_device(block_table),
            slot_mapping=self._to_device(slot_mapping),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            generated_cpu=num_computed >= batch.num_prompt_tokens[rows],
        )

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The model over the step's tokens (LoRA's rows set for it): hidden states [T, H]."""
        dev = self.device
        lora_rows = (
            self.lora.step_rows(step.req_ids, step.num_scheduled, dev)
            if self.lora is not None else contextlib.nullcontext()
        )
        with lora_rows:
            return self.model(
                self._to_device(step.input_ids), self._to_device(step.positions),
                self.kv_caches, step.plan.metadata, step.plan,
            )

    def _pool(self, step: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        assert self.pooling is not None
        batch = self.input_batch
        batch.num_computed_tokens[step.rows] = step.seq_lens
        return ModelRunnerOutput(
            step.req_ids, [[] for _ in step.req_ids], pooler_output=self.pooling.step(
                hidden, step.req_ids, step.query_start_loc, step.num_computed,
                batch.num_prompt_tokens[step.rows],
            ),
        )

    def _generate(
        self, out: SchedulerOutput, step: StepInputs, hidden: torch.Tensor
    ) -> ModelRunnerOutput:
        """Prompt logprobs, sampling, drafts verified and proposed: the step's output."""
        batch = self.input_batch
        prompt_logprobs = (
            self._get_prompt_logprobs_dict(hidden, step.req_ids, step.num_computed,
                                           step.num_scheduled)
            if self.in_progress_prompt_logprobs else {}
        )
        sample_idx = step.sample_idx
        tokens = (self._sample(out, step, hidden, sample_idx) if len(sample_idx)
                  else StepTokens.empty(len(step.req_ids)))
        batch.num_computed_tokens[step.rows] = step.seq_lens - tokens.num_rejected
        spec_token_ids = None
        if self.drafter is not None:
            spec_token_ids = self.drafter.propose_all(batch, step.req_ids, step.rows,
                                                      sample_idx, step.drafts)
        unfilled = {step.req_ids[i]: n for i, drafts in step.drafts.by_index.items()
                    if (n := drafts.count(-1))}
        return ModelRunnerOutput(step.req_ids, tokens.sampled, tokens.logprobs,
                                 prompt_logprobs, spec_token_ids, unfilled)

    def _sample(
        self, out: SchedulerOutput, step: StepInputs, hidden: torch.Tensor,
        sample_idx: np.ndarray,
    ) -> StepTokens:
        """Samples the last 1 + k rows of each request in `sample_idx` and stores its new
        tokens (drafted requests: those that `Drafter.accept` keeps)."""
        batch, req_ids = self.input_batch, step.req_ids
        if step.drafts.by_index:
            num_logit_rows = 1 + step.drafts.num[sample_idx]
            logit_req = np.repeat(sample_idx, num_logit_rows)  # request index per logits row
            first_logit_row = np.zeros(len(sample_idx) + 1, dtype=np.int64)
            np.cumsum(num_logit_rows, out=first_logit_row[1:])
            # Logits row j of request i reads query row end_i - (1 + k_i) + j.
            logits_idx = np.repeat(
                step.query_start_loc[1:][sample_idx] - num_logit_rows - first_logit_row[:-1],
                num_logit_rows,
            ) + np.arange(len(logit_req))
        else:  # no drafts: each request's last query row
            logit_req = sample_idx
            logits_idx = step.query_start_loc[1:][sample_idx] - 1
        if step.plan.logits is not None:  # the fused step ran the head: every row samples
            logits = step.plan.logits
        else:
            sampled_hidden = hidden if step.every_row else hidden[self._to_device(logits_idx)]
            logits = self.model.compute_logits(sampled_hidden, self.planner.head_rows)
        if out.grammar_bitmask is not None:
            # Structured requests are never drafted: one logits row each.
            sample_pos = {req_ids[j]: i for i, j in enumerate(logit_req.tolist())}
            apply_grammar_bitmask(logits, out.grammar_bitmask,
                                  [sample_pos[r] for r in out.structured_output_request_ids])
        generator_states: dict[int, torch.Tensor] = {}
        if step.drafts.by_index:
            assert self.drafter is not None
            generator_states = self.drafter.generator_states(batch, req_ids, step.drafts)
        token_ids, token_logprobs = self._run_sampler(logits, req_ids, step.rows, logit_req)
        if not step.drafts.by_index:
            return self._store_sampled(step.rows, sample_idx, token_ids, token_logprobs)
        assert self.drafter is not None
        return self.drafter.accept(batch, Verification(
            req_ids, step.rows, sample_idx, first_logit_row, token_ids, token_logprobs,
            step.drafts, generator_states,
        ))

    def _run_sampler(
        self, logits: torch.Tensor, req_ids: list[str], rows: np.ndarray, logit_req: np.ndarray
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """The sampler over the logits rows (bans, penalties' counts): tokens, logprobs."""
        batch = self.input_batch
        sample_rows = rows[logit_req]
        metadata = self._get_sampling_metadata(req_ids, rows, logit_req)
        banned = self._min_tokens_stop_ids(sample_rows)
        if metadata.bad_words is not None:
            self._add_bad_word_bans(banned, metadata.bad_words, sample_rows)
        sampler_out = self.sampler(logits, metadata, banned)
        if (penalties := metadata.penalties) is not None:
            sampled = sampler_out.sampled_token_ids[penalties.sample_idx]
            batch.count_sampled(penalties.counts.rows, sampled)
        token_logprobs = None
        if sampler_out.logprobs_tensors is not None:
            num_lp = [batch.sampling_params[r].logprobs for r in sample_rows.tolist()]
            token_logprobs = sampler_out.logprobs_tensors.to_token_logprobs(num_lp)
        return sampler_out.sampled_token_ids.tolist(), token_logprobs

    def _store_sampled(
        self, rows: np.ndarray, sample_idx: np.ndarray, token_ids: list[int],
        token_logprobs: list[TokenLogprobs | None] | None,
    ) -> StepTokens:
        """Stores one sampled token per sampling request now: the next step's inputs come
        from here."""
        batch = self.input_batch
        tokens = StepTokens.empty(len(rows), token_logprobs is not None)
        sample_rows = rows[sample_idx]
        batch.token_ids[sample_rows, batch.num_tokens[sample_rows]] = token_ids
        batch.num_tokens[sample_rows] += 1
        for i, tok in zip(sample_idx.tolist(), token_ids):
            tokens.sampled[i] = [tok]
        if (builder := batch.batch_update_builder) is not None:
            req_ids = batch.req_ids
            for row, tok in zip(sample_rows.tolist(), token_ids):
                builder.output_token_ids[req_ids[row]].append(tok)
        if token_logprobs is not None and tokens.logprobs is not None:
            for i, lp in zip(sample_idx.tolist(), token_logprobs):
                tokens.logprobs[i] = None if lp is None else [lp]
        return tokens

    def _get_prompt_logprobs_dict(
        self,
        hidden: torch.Tensor,
        req_ids: list[str],
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
    ) -> dict[str, list[TokenLogprobs]]:
        """Collects this step's chunk of each request owed prompt logprobs; returns those of
        the requests whose prompt this step finishes. Raw logprobs, as for sampled tokens."""
        batch = self.input_batch
        completed: dict[str, list[TokenLogprobs]] = {}
        token_start = 0  # the request's first token in `hidden`
        for req_id, start, num in zip(req_ids, num_computed.tolist(), num_scheduled.tolist()):
            collected = self.in_progress_prompt_logprobs.get(req_id)
            if collected is not None:
                row = batch.req_id_to_index[req_id]
                num_prompt = int(batch.num_prompt_tokens[row])
                # Position p's logits give the logprob of prompt token p + 1.
                end = min(start + num, num_prompt - 1)
                if end > start:
                    params = batch.sampling_params[row]
                    assert params is not None and params.prompt_logprobs is not None
                    k = params.prompt_logprobs
                    chunk = hidden[token_start : token_start + end - start]
                    logits = self.model.compute_logits(chunk, self.planner.head_rows)
                    next_ids = torch.from_numpy(batch.token_ids[row, start + 1 : end + 1])
                    logprobs = gather_logprobs(
                        logits.log_softmax(dim=-1), next_ids.to(self.device), k
                    )
                    # Every position asks for k, so none is None.
                    collected += cast(
                        list[TokenLogprobs], logprobs.to_token_logprobs([k] * (end - start))
                    )
                if start + num >= num_prompt:
                    completed[req_id] = self.in_progress_prompt_logprobs.pop(req_id)
            token_start += num
        return completed

    def _get_sampling_metadata(
        self, req_ids: list[str], rows: np.ndarray, sample_idx: np.ndarray
    ) -> SamplingMetadata:
        """Rebuilt only when the sampling rows or the batch's rows change (seldom, in decode).

        The batch version is in the key because a request id is not: a finished id may come
        back with other params (and a new generator) in the same row.
        """
        key = (self.input_batch.version, rows[sample_idx].tobytes())
        if key != self._sampling_key or self._sampling_metadata is None:
            batch = self.input_batch
            sample_rows = rows[sample_idx].tolist()
            params = [batch.sampling_params[r] for r in sample_rows]
            generators = {
                i: batch.generators[req_ids[j]]
                for i, j in enumerate(sample_idx.tolist())
                if req_ids[j] in batch.generators
            }
            token_counts = None
            if batch.prompt_token_mask is not None and batch.output_token_counts is not None:
                token_counts = TokenCounts(
                    batch.prompt_token_mask,
                    batch.output_token_counts,
                    torch.tensor(sample_rows, dtype=torch.int64, device=self.device),
                )
            logitsprocs = None
            if self.logitsprocs:
                dense = sample_rows == list(range(batch.num_reqs))
                logitsprocs = BatchLogits(
                    self.logitsprocs,
                    None if dense else torch.tensor(sample_rows, device=self.device),
                    batch.num_reqs,
                )
            self._sampling_metadata = SamplingMetadata.from_params(
                params, generators, self.device, self.vocab_size, token_counts, logitsprocs
            )
            self._sampling_key = key
        return self._sampling_metadata

    def _add_bad_word_bans(
        self, banned: dict[int, list[int]], bad_words: BadWords, sample_rows: np.ndarray
    ) -> None:
        """Adds to `banned` the tokens that would complete a bad word now."""
        batch = self.input_batch
        num_tokens = batch.num_tokens[sample_rows].astype(np.int64)
        num_output = num_tokens - batch.num_prompt_tokens[sample_rows]
        # Only the tail a prefix can reach is read, not the rows' whole token history.
        width = bad_words.prefixes.shape[1]
        columns = (num_tokens[:, None] - width + np.arange(width)).clip(min=0)
        tails = batch.token_ids[sample_rows[:, None], columns]
        rows, token_ids = bad_words.banned(tails, num_output)
        for row, token_id in zip(rows.tolist(), token_ids.tolist(), strict=True):
            banned.setdefault(row, []).append(token_id)

    def _min_tokens_stop_ids(self, sample_rows: np.ndarray) -> dict[int, list[int]]:
        """Sampling index -> the stop tokens it may not sample yet: until a request has
        `min_tokens` outputs, its stop tokens are masked (by the sampler, after logprobs)."""
        batch = self.input_batch
        stop_ids_by_index: dict[int, list[int]] = {}
        for i, row in enumerate(sample_rows.tolist()):
            params = batch.sampling_params[row]
            if not params.min_tokens:
                continue
            num_output = batch.num_tokens[row] - batch.num_prompt_tokens[row]
            if num_output < params.min_tokens:
                stop_ids = set(params.all_stop_token_ids)
                if not params.ignore_eos and self.loaded.eos_token_id is not None:
                    stop_ids.add(self.loaded.eos_token_id)
                stop_ids_by_index[i] = [t for t in stop_ids if t < self.vocab_size]
        return stop_ids_by_index
