"""PEFT adapter folders: `adapter_config.json` beside `adapter_model.safetensors`, as
`peft`'s `save_pretrained` writes them.

Read: `r`, `lora_alpha`, `use_rslora` (alpha / sqrt(r)) and the A/B tensors of
`TARGET_MODULES`, a module's rank being its A's rows (so `rank_pattern` works). What this engine
cannot apply is a ValueError naming it (DoRA, trained biases, `modules_to_save`,
`alpha_pattern`, embedding or LM-head adapters, non-finite weights), rather than served wrong.

Files are opened without blocking (a FIFO is refused, never waited on) and must be regular;
the config's size is bounded, and the weights' safetensors header (its keys, dtypes and
shapes against the model's projections, data offsets against the file's size) is checked
before any tensor byte is read, so a load reads at most what `max_lora_rank` admits.
"""

import json
import math
import os
import re
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from v1.lora.request import LoRARequest

# The HF projections an adapter may target (vLLM's packed modules: q/k/v and gate/up run as
# one fused matmul each here; an adapter may target any subset of them).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# What a trained adapter's weights are stored in (safetensors' names); others (integers,
# fp8 / fp4 that torch may not even convert) are refused rather than cast.
WEIGHT_DTYPES = {
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64
}
# adapter_config.json is a few hundred bytes; a safetensors header a few hundred per tensor.
MAX_CONFIG_BYTES = 1 << 20
_HEADER_BYTES_PER_TENSOR = 512

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.("
    + "|".join(TARGET_MODULES)
    + r")\.lora_([AB])\.weight$"
)

# (layer index, HF projection) -> (in_features, out_features) of the model's projection.
Targets = Mapping[tuple[int, str], tuple[int, int]]


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapted projection: delta(x) = scale * (x @ lora_a.T) @ lora_b.T."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scale: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True, slots=True)
class LoRAModel:
    """A loaded adapter: (layer index, HF projection name) -> its module. `rank`: the
    largest module rank."""

    lora_int_id: int
    lora_name: str
    rank: int
    modules: dict[tuple[int, str], LoRAModule]

    @property
    def nbytes(self) -> int:
        return sum(
            m.lora_a.numel() * m.lora_a.element_size() + m.lora_b.numel() * m.lora_b.element_size()
            for m in self.modules.values()
        )


def _refuse(request: LoRARequest, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {why}")


def _open(request: LoRARequest, name: str) -> tuple[int, int] | None:
    """(descriptor, size) of the folder's regular file `name`, None if there is none. Opened
    with O_NONBLOCK (a FIFO planted there is refused, never waited on). A path that cannot be
    looked at (too long, `~user` of no user, no permission) is a ValueError like a missing
    one, never an OSError out of the engine core."""
    try:
        path = Path(request.lora_path).expanduser() / name
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, RuntimeError) as e:
        raise _refuse(request, f"the path cannot be read ({e})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        if stat.S_ISDIR(info.st_mode):
            return None
        raise _refuse(request, f"{name} is not a regular file")
    return fd, info.st_size


def _read(request: LoRARequest, name: str, fd: int, size: int) -> bytes:
    """Exactly `size` bytes from `fd`'s position; a file that shrank is refused."""
    try:
        data = os.read(fd, size) if size else b""
        while len(data) < size:
            more = os.read(fd, size - len(data))
            if not more:
                raise OSError(f"{name} ended after {len(data)} of {size} bytes")
            data += more
    except OSError as e:
        raise _refuse(request, f"{name} is not readable ({e})") from None
    return data


def read_adapter_config(request: LoRARequest) -> dict[str, Any]:
    """The folder's adapter_config.json, checked for what this engine can apply."""
    opened = _open(request, CONFIG_NAME)
    if opened is None:
        raise _refuse(request, f"no {CONFIG_NAME} there (not a PEFT adapter folder)")
    fd, size = opened
    try:
        if size > MAX_CONFIG_BYTES:
            raise _refuse(request, f"{CONFIG_NAME} has {size} bytes, over {MAX_CONFIG_BYTES}")
        data = _read(request, CONFIG_NAME, fd, size)
    finally:
        os.close(fd)
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(request, f"{CONFIG_NAME} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise _refuse(request, f"{CONFIG_NAME} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _refuse(request, f"peft_type {peft_type!r} is not LORA")
    r, alpha = config.get("r"), config.get("lora_alpha")
    for name, value in (("r", r), ("lora_alpha", alpha)):
        if (
            not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0
        ):
            raise _refuse(request, f"{name} must be a positive finite number, got {value!r}")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "bias": config.get("bias", "none") not in (None, "none"),
    }
    refused = [name for name, present in unsupported.items() if present]
    if refused:
        raise _refuse(request, f"{', '.join(refused)} is not supported")
    return config


def _check_header(
    request: LoRARequest, header: Any, data_size: int, max_lora_rank: int, targets: Targets
) -> None:
    """The safetensors header against what the model and `max_lora_rank` admit: every key a
    LoRA A/B of a projection the model has, float dtypes, A [r, in] and B [out, r] with
    1 <= r <= max_lora_rank, data offsets that tile the `data_size` bytes after it."""
    if not isinstance(header, dict):
        raise _refuse(request, f"{WEIGHTS_NAME} is not readable (its header is no object)")
    header.pop("__metadata__", None)
    pairs: dict[tuple[int, str], dict[str, dict]] = {}
    spans = []
    for key, info in header.items():
        m = _KEY.match(key)
        if m is None:
            raise _refuse(
                request, f"tensor {key!r} is not a LoRA A/B weight of "
                f"{', '.join(TARGET_MODULES)} (only those projections can be adapted)",
            )
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if isinstance(
            info, dict) else (None, None)
        if not (
            isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
            and isinstance(offsets, list) and len(offsets) == 2
            and all(type(n) is int for n in offsets)
        ):
            raise _refuse(request, f"{WEIGHTS_NAME} is not readable (tensor {key!r}'s entry)")
        pairs.setdefault((int(m[1]), m[2]), {})[m[3]] = info
        spans.append((offsets[0], offsets[1], key))
    if not pairs:
        raise _refuse(request, f"{WEIGHTS_NAME} holds no LoRA weights")
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise _refuse(request, f"layer {layer} {proj} has lora_A or lora_B missing")
        a, b = ab["A"], ab["B"]
        if a.get("dtype") not in WEIGHT_DTYPES or b.get("dtype") not in WEIGHT_DTYPES:
            raise _refuse(
                request, f"layer {layer} {proj}: lora_A is {a.get('dtype')} and lora_B "
                f"{b.get('dtype')}; adapter weights must be one of {', '.join(WEIGHT_DTYPES)}",
            )
        a_shape, b_shape = a["shape"], b["shape"]
        # Shapes before the rank is read: a 0-d or rank-0 pair is refused, never divided by.
        if (
            len(a_shape) != 2 or len(b_shape) != 2 or b_shape[1] != a_shape[0]
            or a_shape[0] == 0
        ):
            raise _refuse(
                request, f"layer {layer} {proj}: lora_A {tuple(a_shape)} and lora_B "
                f"{tuple(b_shape)} do not pair up as [r, in] and [out, r] with r >= 1",
            )
        rank = a_shape[0]
        if rank > max_lora_rank:
            raise _refuse(request, f"rank {rank} exceeds max_lora_rank {max_lora_rank}")
        target = targets.get((layer, proj))
        if target is None:
            raise _refuse(
                request, f"adapts layer {layer} {proj}, which this model does not have "
                f"({len({t[0] for t in targets})} layers)",
            )
        in_features, out_features = target
        if a_shape[1] != in_features or b_shape[0] != out_features:
            raise _refuse(
                request, f"layer {layer} {proj} has A {tuple(a_shape)} and B "
                f"{tuple(b_shape)}, but the model's {proj} maps {in_features} -> "
                f"{out_features} (an adapter of another model?)",
            )
        for key, info in (("A", a), ("B", b)):
            begin, end = info["data_offsets"]
            nbytes = math.prod(info["shape"]) * WEIGHT_DTYPES[info["dtype"]].itemsize
            if end - begin != nbytes:
                raise _refuse(
                    request, f"{WEIGHTS_NAME} is not readable (layer {layer} {proj} lora_{key}"
                    f" spans {end - begin} bytes, its shape {nbytes})",
                )
    position = 0
    for begin, end, key in sorted(spans):
        if begin != position:
            raise _refuse(request, f"{WEIGHTS_NAME} is not readable (tensor {key!r} starts "
                          f"at byte {begin}, not {position})")
        position = end
    if position != data_size:
        raise _refuse(request, f"{WEIGHTS_NAME} is not readable (its tensors take {position} "
                      f"bytes, the file has {data_size} after the header)")


def _read_weights(
    request: LoRARequest, max_lora_rank: int, targets: Targets
) -> dict[str, torch.Tensor]:
    """The weights file's tensors, read once the header is checked (`_check_header`)."""
    opened = _open(request, WEIGHTS_NAME)
    if opened is None:
        raise _refuse(request, f"no {WEIGHTS_NAME} there (only safetensors are read)")
    fd, size = opened
    try:
        max_header = 4096 + _HEADER_BYTES_PER_TENSOR * 2 * len(targets)
        if size < 8:
            raise _refuse(request, f"{WEIGHTS_NAME} is not readable ({size} bytes)")
        (header_size,) = struct.unpack("<Q", _read(request, WEIGHTS_NAME, fd, 8))
        if header_size > min(max_header, size - 8):
            raise _refuse(
                request, f"{WEIGHTS_NAME} is not readable (a header of {header_size} bytes, "
                f"the file has {size}, at most {max_header} for this model)",
            )
        header_bytes = _read(request, WEIGHTS_NAME, fd, header_size)
        try:
            header = json.loads(header_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _refuse(request, f"{WEIGHTS_NAME} is not readable ({e})") from None
        _check_header(request, header, size - 8 - header_size, max_lora_rank, targets)
        os.lseek(fd, 0, os.SEEK_SET)
        data = _read(request, WEIGHTS_NAME, fd, size)  # the whole file: one buffer to parse
    finally:
        os.close(fd)
    if data[8 : 8 + header_size] != header_bytes:
        raise _refuse(request, f"{WEIGHTS_NAME} changed while it was read")
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except SafetensorError as e:
        raise _refuse(request, f"{WEIGHTS_NAME} is not readable ({e})") from None


def load_adapter(
    request: LoRARequest, max_lora_rank: int, targets: Targets,
    dtype: torch.dtype = torch.float32,
) -> LoRAModel:
    """Read and check a PEFT folder against the model's projections `targets`: a ValueError
    naming the problem (missing files, a key this engine cannot apply, a rank above
    `max_lora_rank`, A and B that do not pair up or do not fit the model, a non-finite
    weight: it would turn every row it touches into NaN)."""
    config = read_adapter_config(request)
    tensors = _read_weights(request, max_lora_rank, targets)
    alpha = float(config["lora_alpha"])
    use_rslora = bool(config.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        assert m is not None, "checked in the header"
        pairs.setdefault((int(m[1]), m[2]), {})[m[3]] = (key, tensor.to(dtype))
    modules: dict[tuple[int, str], LoRAModule] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        (a_key, a), (b_key, b) = ab["A"], ab["B"]
        rank = a.shape[0]
        scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        # As the slots hold them: in the engine's dtype (a cast may overflow), B scaled.
        for key, weight in ((a_key, a), (b_key, b * scale)):
            if not torch.isfinite(weight).all():
                raise _refuse(
                    request, f"tensor {key!r} has non-finite values (in {dtype}"
                    + (f", times the scale {scale:g})" if key == b_key else ")"),
                )
        modules[(layer, proj)] = LoRAModule(a, b, scale)
    return LoRAModel(
        request.lora_int_id, request.lora_name, max(m.rank for m in modules.values()), modules
    )
