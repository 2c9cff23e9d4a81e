"""Hostile adapter folders and loads: tensors that cannot be a LoRA (0-d, rank 0, integer, fp4),
a NaN `lora_alpha` and corrupt files are a ValueError naming the problem, through
`add_lora` and through a request that names the adapter directly, and the engine core
(a separate process) serves on; a bad adapter named like a good one still raises in
`generate`; two concurrent server loads of one name: the second is refused;
a LoRARequest's field types are checked where it is made."""

import asyncio
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from tests.lora.conftest import LoRAFixture
from tests.lora.test_lora import PARAMS, PROMPTS, N, _llm
from v1.entrypoints.openai.serving_models import LoadLoRAAdapterRequest, OpenAIServingModels
from v1.lora.request import LoRARequest

WEIGHTS = "adapter_model.safetensors"


def _rank0(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v[:0] if "lora_A" in k else v[:, :0]).contiguous() for k, v in t.items()}


def _scalar(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(1.0) if i == 0 else v for i, (k, v) in enumerate(t.items())}


def _ints(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v * 100).to(torch.int32) for k, v in t.items()}


def _fp4(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp4 (torch cannot cast it to fp32: a NotImplementedError otherwise)."""
    return {
        k: torch.zeros(v.shape, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        for k, v in t.items()
    }


def _copy(src: Path, dst: Path, change: Callable[[dict], dict]) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    save_file(change(load_file(dst / WEIGHTS)), dst / WEIGHTS)
    return dst


def _bad_adapters(fx: LoRAFixture, root: Path) -> list[tuple[str, str]]:
    """(adapter path, the error's pattern) for folders and paths no adapter can be read
    from."""
    src = fx.adapter_dirs[0]
    nan = root / "nan"
    shutil.copytree(src, nan)
    config = json.loads((nan / "adapter_config.json").read_text())
    config["lora_alpha"] = float("nan")
    (nan / "adapter_config.json").write_text(json.dumps(config))  # NaN, as json writes it
    truncated = root / "truncated"
    shutil.copytree(src, truncated)
    data = (src / WEIGHTS).read_bytes()
    (truncated / WEIGHTS).write_bytes(data[: len(data) // 2])
    return [
        (str(_copy(src, root / "rank0", _rank0)), r"with r >= 1"),
        (str(_copy(src, root / "scalar", _scalar)), r"do not pair up"),
        (str(_copy(src, root / "ints", _ints)), r"is I32 and lora_B I32; adapter weights must be"),
        (str(_copy(src, root / "fp4", _fp4)), r"is F4 and lora_B F4; adapter weights must be"),
        (str(nan), r"lora_alpha must be a positive finite number, got nan"),
        (str(truncated), r"is not readable"),
        # Paths the OS cannot look at: an OSError / RuntimeError out of pathlib otherwise.
        ("/" + "a" * 300, r"the path cannot be read \(.*too long"),
        ("~no-such-user-v1/adapter", r"the path cannot be read"),
    ]


def test_bad_tensors_are_refused_and_the_engine_core_serves_on(lora_fixture, tmp_path):
    fx = lora_fixture
    bad = _bad_adapters(fx, tmp_path)
    with _llm(fx, multiprocess=True) as llm:
        engine = llm.llm_engine
        for i, (path, message) in enumerate(bad):
            with pytest.raises(ValueError, match=message):
                engine.add_lora(LoRARequest(f"bad{i}", 10 + i, path))
            # Named by a request without add_lora first: the core refuses the request (it
            # finishes at once with the error), never dies of it.
            lora = LoRARequest(f"bad{i}-direct", 30 + i, path)
            engine.add_request(f"direct-{i}", PROMPTS[0], PARAMS, lora_request=lora)
            outs = []
            while engine.has_unfinished_requests():
                outs += engine.step()
            assert outs[-1].finished and outs[-1].outputs[0].token_ids == []
        good = LoRARequest("adapter1", 1, str(fx.adapter_dirs[0]))
        out = llm.generate([PROMPTS[1]], PARAMS, lora_request=good, use_tqdm=False)
        assert out[0].outputs[0].token_ids == fx.greedy(0, PROMPTS[1], N)
        assert engine.list_loras() == {1}


class _SlowEngine:
    """An engine whose first add_lora waits for `release`, so a second load overlaps it
    (later ones return at once)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.added: list[LoRARequest] = []

    async def add_lora(self, lora: LoRARequest) -> bool:
        self.added.append(lora)
        if len(self.added) == 1:
            await self.release.wait()
        return True


def test_concurrent_loads_of_one_name_load_it_once(tmp_path):
    async def scenario() -> None:
        engine = _SlowEngine()
        models = OpenAIServingModels(engine, ["base"], "base")  # type: ignore[arg-type]
        await models.init_static_loras([], [str(tmp_path)])  # runtime loads read from there
        first = asyncio.create_task(models.load_lora_adapter(
            LoadLoRAAdapterRequest(lora_name="a", lora_path=str(tmp_path / "p1"))
        ))
        await asyncio.sleep(0)  # the first load now awaits the engine
        with pytest.raises(ValueError, match="has already been loaded"):
            await models.load_lora_adapter(
                LoadLoRAAdapterRequest(lora_name="a", lora_path=str(tmp_path / "p2"))
            )
        engine.release.set()
        await first
        assert [lora.lora_path for lora in engine.added] == [os.path.realpath(tmp_path / "p1")]
        assert models.lora_requests["a"] is engine.added[0]

    asyncio.run(scenario())


def test_a_bad_adapter_sharing_a_good_ones_name_raises_before_running(lora_fixture, tmp_path):
    """LoRARequests are equal by name (vLLM's): `generate` still checks each adapter, so
    the bad one raises rather than its prompt coming back aborted and empty."""
    fx = lora_fixture
    good = LoRARequest("x", 1, str(fx.adapter_dirs[0]))
    bad = LoRARequest("x", 2, str(tmp_path / "nowhere"))
    with _llm(fx, multiprocess=True) as llm:
        with pytest.raises(ValueError, match="no adapter_config.json"):
            llm.generate(PROMPTS[:2], PARAMS, lora_request=[good, bad], use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()


def test_lora_request_field_types():
    """A `Path` path is taken as its text (it reaches an engine-core process: msgpack has
    no Path); a name or path of another type is a ValueError where it is made."""
    lora = LoRARequest("p", 1, Path("/adapters/p"))  # type: ignore[arg-type]
    assert lora.lora_path == "/adapters/p"
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(lora), type=LoRARequest) == lora
    for args, field in (((5, 1, "/x"), "lora_name"), (("a", 1, 7), "lora_path"),
                        (("a", 1, "/x", 3), "base_model_name")):
        with pytest.raises(ValueError, match=f"LoRARequest {field} must be a str"):
            LoRARequest(*args)  # type: ignore[arg-type]


def _with_header(src: Path, dst: Path, change: Callable[[dict], None], pad: int = 0) -> Path:
    """A copy of `src` whose safetensors header `change` edits in place (the tensor bytes
    as they were, plus `pad` zero bytes)."""
    import struct

    shutil.copytree(src, dst)
    data = (dst / WEIGHTS).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    change(header)
    raw = json.dumps(header).encode()
    (dst / WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :] + b"\0" * pad)
    return dst


def _first(header: dict, part: str) -> dict:
    return header[next(k for k in sorted(header) if part in k)]


def test_headers_are_checked_before_any_tensor_is_read(lora_fixture, tmp_path, monkeypatch):
    """Shapes the model or max_lora_rank cannot take, and offsets the file does not hold,
    are refused from the safetensors header: no tensor is deserialized. A FIFO where a file
    should be is refused without waiting on it (on main too: `is_file()` is False)."""

    import safetensors.torch

    fx = lora_fixture
    src = fx.adapter_dirs[0]

    def rank9(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # max_lora_rank is 8
        return {
            k: torch.cat([v, v[:1]]) if "lora_A" in k else torch.cat([v, v[:, :1]], 1)
            for k, v in t.items()
        }

    def other_model(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: torch.cat([v, v]) if "down_proj.lora_B" in k else v for k, v in t.items()}

    def past_the_end(header: dict) -> None:
        _first(header, "layers.1.mlp.up_proj.lora_B")["data_offsets"][1] += 1 << 40

    fifo = tmp_path / "fifo"
    shutil.copytree(src, fifo)
    (fifo / WEIGHTS).unlink()
    os.mkfifo(fifo / WEIGHTS)
    cases = [
        (_copy(src, tmp_path / "rank", rank9), r"rank 9 exceeds max_lora_rank 8"),
        (_copy(src, tmp_path / "other", other_model), r"an adapter of another model\?"),
        (_with_header(src, tmp_path / "end", past_the_end), r"is not readable"),
        (_with_header(src, tmp_path / "pad", lambda h: None, pad=1 << 20), r"is not readable"),
        (fifo, r"adapter_model.safetensors"),
    ]
    read: list[str] = []
    for name in ("load", "load_file"):
        real = getattr(safetensors.torch, name)
        monkeypatch.setattr(
            safetensors.torch, name, lambda *a, _real=real, **k: read.append(a) or _real(*a, **k)
        )
    with _llm(fx) as llm:
        for i, (path, message) in enumerate(cases):
            with pytest.raises(ValueError, match=message):
                llm.llm_engine.add_lora(LoRARequest(f"bad{i}", 10 + i, str(path)))
        assert read == []
        good = LoRARequest("adapter1", 1, str(src))
        out = llm.generate([PROMPTS[1]], PARAMS, lora_request=good, use_tqdm=False)
        assert out[0].outputs[0].token_ids == fx.greedy(0, PROMPTS[1], N)
        assert len(read) == 1  # the good adapter's tensors, once its header passed
