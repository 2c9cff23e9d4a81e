"""The worker's adapters: which are loaded (an LRU of `max_cpu_loras` in memory), which run
in which of the `max_loras` slots, and each step's row -> slot mask (vLLM's
`LRUCacheWorkerLoRAManager` and punica wrapper, in one place).

Invariants: a slot holds at most one adapter and an adapter sits in at most one slot; every
adapter in a slot is loaded; a step's adapters are all in slots [0, k) with k the step's
`LoRABatch.num_slots` (a new adapter takes the lowest free slot, evicting the least recently
used adapter the step does not need), so a step pays for k slots, not `max_loras`. The
scheduler admits at most `max_loras` distinct adapters per step, so a step always fits.
An adapter that unfinished requests name (`in_use`, kept by the engine core's scheduler)
stays loaded beyond `max_cpu_loras`: adapters are read from disk only when added, never
inside a step, where a folder gone since would fail the step.
"""

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from v1.config import LoRAConfig
from v1.lora.layers import LinearWithLoRA, LoRABatch
from v1.lora.peft import LoRAModel, load_adapter
from v1.lora.request import LoRARequest
from v1.models.decoder import DecoderForCausalLM

# Where each adapted projection sits in a decoder layer: (module path, the HF projections
# its fused weight stacks, in order).
_TARGETS = (
    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn.o_proj", ("o_proj",)),
    ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp.down_proj", ("down_proj",)),
)


class LoRAWorkerManager:
    def __init__(
        self, model: DecoderForCausalLM, config: LoRAConfig, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.batch = LoRABatch()
        # (layer index, HF projection) -> (in, out): what an adapter's A and B must fit.
        self.dims: dict[tuple[int, str], tuple[int, int]] = {}
        self.wrapped: list[tuple[LinearWithLoRA, tuple[str, ...], int]] = []
        layers = model.get_submodule("model.layers")
        for index, layer in enumerate(layers):
            for path, projections in _TARGETS:
                parent_path, _, attr = path.rpartition(".")
                parent = layer.get_submodule(parent_path)
                base = getattr(parent, attr)
                if isinstance(base, LinearWithLoRA):
                    raise ValueError("this model already serves LoRA in another engine")
                sizes = self._sub_sizes(base.out_features, projections, parent)
                wrapped = LinearWithLoRA(
                    base, sizes, self.batch, config.max_loras, config.max_lora_rank
                )
                setattr(parent, attr, wrapped)
                self.wrapped.append((wrapped, projections, index))
                for proj, size in zip(projections, sizes, strict=True):
                    self.dims[(index, proj)] = (base.in_features, size)
        model.replan()  # wrapped projections: the fused decode step no longer applies
        self.loaded: OrderedDict[int, LoRAModel] = OrderedDict()  # LRU, oldest first
        self.slots: list[int | None] = [None] * config.max_loras  # slot -> lora id
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU order
        self.requests: dict[int, LoRARequest] = {}  # lora id -> the request that named it
        self.req_lora: dict[str, int] = {}  # request id -> its adapter's id
        # lora id -> how many unfinished requests name it (the engine core's scheduler
        # keeps it): those adapters are never unloaded.
        self.in_use: Mapping[int, int] = {}
        # Under async scheduling the step runs on the runner's thread while the engine core
        # adds adapters on its own: a step holds this, so no slot changes under a forward.
        self._lock = threading.RLock()

    @staticmethod
    def _sub_sizes(out: int, projections: tuple[str, ...], parent: nn.Module) -> tuple[int, ...]:
        if projections == ("q_proj", "k_proj", "v_proj"):
            return (parent.q_size, parent.kv_size, parent.kv_size)
        return (out // len(projections),) * len(projections)

    # -- adapters -------------------------------------------------------------------------

    def add_adapter(self, request: LoRARequest) -> bool:
        """Load an adapter into memory (checked against the model); False if it was loaded
        already. A ValueError, and nothing changed, if it cannot be served. The least
        recently used adapter in no slot is dropped beyond `max_cpu_loras`."""
        with self._lock:
            return self._add_adapter(request)

    def _add_adapter(self, request: LoRARequest) -> bool:
        known = self.requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} already names {known.lora_name!r} at "
                f"{known.lora_path}: one id must mean one adapter"
            )
        if request.lora_int_id in self.loaded:
            self.loaded.move_to_end(request.lora_int_id)
            return False
        lora = load_adapter(request, self.config.max_lora_rank, self.dims, self.dtype)
        self._make_room(self.config.max_cpu_loras - 1)
        self.loaded[request.lora_int_id] = lora
        self.requests[request.lora_int_id] = request
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (and free its slot); False if it was not known. The engine core
        refuses this while a request uses it."""
        with self._lock:
            if self.requests.pop(lora_int_id, None) is None:
                return False
            self._unload(lora_int_id)
            return True

    def list_adapters(self) -> set[int]:
        """The ids of the adapters known (loaded, or reloaded when a request names them)."""
        with self._lock:
            return set(self.requests)

    def _unload(self, lora_int_id: int) -> None:
        """Out of memory and out of its slot; its request stays known, so the next request
        naming it loads it again when the engine core takes that request."""
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.slots[slot] = None
            for wrapped, _, _ in self.wrapped:
                wrapped.clear_slot(slot)
        self.loaded.pop(lora_int_id, None)

    def _make_room(self, limit: int) -> None:
        """Unload least recently used adapters no request uses until at most `limit` are
        loaded (or none is left to unload): first those in no slot, then slotted ones."""
        idle = [i for i in self.loaded if not self.in_use.get(i)]
        for candidates in (
            [i for i in idle if i not in self.slot_of], [i for i in idle if i in self.slot_of]
        ):
            for lora_id in candidates:
                if len(self.loaded) <= limit:
                    return
                self._unload(lora_id)

    # -- requests and steps ------------------------------------------------------------------

    def add_request(self, req_id: str, request: LoRARequest | None) -> None:
        """A request scheduled for the first time: its adapter was loaded when the engine
        core took it, and stays loaded while it is unfinished (`in_use`)."""
        if request is not None:
            self.req_lora[req_id] = request.lora_int_id

    def finish_request(self, req_id: str) -> None:
        self.req_lora.pop(req_id, None)

    @contextlib.contextmanager
    def step_rows(
        self, req_ids: Sequence[str], num_scheduled: np.ndarray, device: torch.device
    ) -> Iterator[None]:
        """For the forward inside: the step's adapters in slots and each slot's rows
        (rows in `req_ids` order, `num_scheduled[i]` rows each). Cleared after, so the
        wrapped model runs as the base model outside a step."""
        with self._lock:
            self._prepare(req_ids, num_scheduled, device)
            try:
                yield
            finally:
                self.batch.num_slots, self.batch.rows = 0, None

    def _prepare(
        self, req_ids: Sequence[str], num_scheduled: np.ndarray, device: torch.device
    ) -> None:
        req_lora = self.req_lora
        if not req_lora:
            return
        ids = [req_lora.get(r, 0) for r in req_ids]
        active = sorted(set(ids) - {0})
        if not active:
            return
        if len(active) > len(self.slots):
            raise RuntimeError(
                f"{len(active)} adapters in one step, more than max_loras {len(self.slots)}"
            )
        slot_by_id = {lora_id: self._activate(lora_id, active) for lora_id in active}
        k = max(slot_by_id.values()) + 1
        self.batch.num_slots = k
        if k == 1 and 0 not in ids:  # every row runs slot 0's adapter: no selection
            return
        row_slot = np.fromiter((slot_by_id.get(i, -1) for i in ids), np.int64, len(ids))
        token_slot = np.repeat(row_slot, num_scheduled)
        self.batch.rows = [
            (slot, torch.from_numpy(np.flatnonzero(token_slot == slot)).to(device))
            for slot in sorted(slot_by_id.values())
        ]

    def nonfinite_requests(
        self, req_ids: Sequence[str], num_scheduled: np.ndarray, hidden: torch.Tensor
    ) -> list[str]:
        """The adapter requests among the step's (rows as in `step_rows`) with a non-finite
        row in `hidden`, the step's last hidden states: an overflow anywhere in a row's
        layers ends there, as does any K/V of it that is not finite. Base rows are left out
        (no adapter touches them)."""
        req_lora = self.req_lora
        if not req_lora or not any(r in req_lora for r in req_ids):
            return []
        finite = torch.isfinite(hidden).all(dim=1)
        if bool(finite.all()):
            return []
        bad = np.logical_not(finite.cpu().numpy())
        starts = np.concatenate(([0], np.cumsum(num_scheduled)[:-1]))
        return [
            r for r, start, n in zip(req_ids, starts, num_scheduled, strict=True)
            if r in req_lora and bad[start : start + n].any()
        ]

    def _activate(self, lora_id: int, step_ids: Sequence[int]) -> int:
        """The slot of `lora_id`, loading it into the lowest free slot (or the least
        recently used one no adapter of this step holds) if it has none."""
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        free = [s for s, held in enumerate(self.slots) if held is None]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slot_of if i not in step_ids)
            slot = self.slot_of.pop(victim)
        lora = self.loaded[lora_id]
        for wrapped, projections, layer in self.wrapped:
            modules = []
            for proj in projections:
                module = lora.modules.get((layer, proj))
                modules.append(
                    None if module is None else (module.lora_a, module.lora_b, module.scale)
                )
            wrapped.set_slot(slot, modules)
        self.slots[slot] = lora_id
        self.slot_of[lora_id] = slot
        self.loaded.move_to_end(lora_id)
        return slot
