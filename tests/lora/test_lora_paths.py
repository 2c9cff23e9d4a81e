"""Runtime loads (`/v1/load_lora_adapter`) reach only the operator's folders: a client's path
must resolve, with the adapter files in it, inside a `--lora-root` or a `--lora-modules`
folder (symlinks out of them refused, the same answer for a path that exists or not), and
the engine is handed the resolved folder; the registry is bounded in adapters and name
length. The engine here records what it is asked to load."""

import asyncio
import os
from pathlib import Path

import pytest

from v1.entrypoints.openai import serving_models
from v1.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    LoRAModulePath,
    OpenAIServingModels,
)
from v1.lora.request import LoRARequest


class _Engine:
    max_model_len = 64

    def __init__(self) -> None:
        self.added: list[LoRARequest] = []

    async def add_lora(self, lora: LoRARequest) -> bool:
        self.added.append(lora)
        return True


def _adapter(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def _models(tmp_path: Path) -> tuple[OpenAIServingModels, _Engine, Path]:
    engine = _Engine()
    models = OpenAIServingModels(engine, ["base"], "base")  # type: ignore[arg-type]
    root = tmp_path / "root"
    static = _adapter(tmp_path / "static")
    asyncio.run(models.init_static_loras([LoRAModulePath("s", str(static))], [str(root)]))
    return models, engine, root


def _load(models: OpenAIServingModels, name: str, path: str) -> str:
    return asyncio.run(models.load_lora_adapter(
        LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
    ))


def test_paths_resolve_inside_the_roots_only(tmp_path):
    models, engine, root = _models(tmp_path)
    outside = _adapter(tmp_path / "outside")
    good = _adapter(root / "good")
    (root / "link-out").symlink_to(outside)  # a folder symlinked out of the root
    files_out = root / "files-out"
    files_out.mkdir()
    (files_out / "adapter_config.json").write_text("{}")
    (files_out / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    (root / "link-in").symlink_to(good)  # a symlink inside the root to a folder inside it
    refused = [
        str(outside), str(root / ".." / "outside"), str(root / "link-out"), str(files_out),
        "good",  # relative
        "~/x", str(tmp_path / "nowhere"), "/etc", "/" + "a" * 5000, str(root) + "/\0x",
        str(root) + "/a" * 10**6,  # refused unresolved (a stat per component otherwise)
    ]
    for i, path in enumerate(refused):
        with pytest.raises(ValueError, match="inside the server's LoRA folders"):
            _load(models, f"bad{i}", path)
    assert [lora.lora_name for lora in engine.added] == ["s"]
    _load(models, "good", str(good))
    _load(models, "link-in", str(root / "link-in"))
    _load(models, "static-again", str(tmp_path / "static"))  # a --lora-modules folder
    paths = {lora.lora_name: lora.lora_path for lora in engine.added}
    assert paths["good"] == paths["link-in"] == os.path.realpath(good)
    assert paths["static-again"] == os.path.realpath(tmp_path / "static")


def test_without_roots_every_runtime_load_is_refused(tmp_path):
    engine = _Engine()
    models = OpenAIServingModels(engine, ["base"], "base")  # type: ignore[arg-type]
    asyncio.run(models.init_static_loras([]))
    with pytest.raises(ValueError, match="inside the server's LoRA folders"):
        _load(models, "a", str(_adapter(tmp_path / "a")))
    assert engine.added == []


def test_the_registry_is_bounded(tmp_path, monkeypatch):
    models, engine, root = _models(tmp_path)
    good = str(_adapter(root / "good"))
    name = "n" * serving_models.MAX_LORA_NAME_LENGTH
    _load(models, name, good)
    with pytest.raises(ValueError, match=r"lora_name has 257 characters, over the limit of 256"):
        _load(models, name + "n", good)
    monkeypatch.setattr(serving_models, "MAX_LORA_ADAPTERS", 3)
    _load(models, "third", good)
    with pytest.raises(ValueError, match=r"3 LoRA adapters are registered, the limit"):
        _load(models, "fourth", good)
    assert len(models.models().data) == 1 + 3  # the base and the three adapters
