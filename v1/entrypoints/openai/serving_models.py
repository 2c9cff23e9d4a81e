"""The models a server answers to (vLLM's `serving_models.py`): the base model's served
names, and LoRA adapters by name, from `--lora-modules` at start-up or loaded and unloaded
at run time through `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (with
`--enable-lora`). A request's `model` picks one: a base name runs the base model, an adapter's
name runs that adapter. Each adapter gets its own `lora_int_id` (from 1 up, never reused, so
the engine's id-keyed caches never mix two adapters).

A client loads adapters only from inside the operator's folders (`--lora-root`s and the
`--lora-modules` folders): a path is resolved (symlinks followed) and its folder and adapter
files must resolve inside one of them; the engine reads the resolved folder. At most
`MAX_LORA_ADAPTERS` adapters are registered, each named in at most `MAX_LORA_NAME_LENGTH`
characters, which bounds `/v1/models` too."""

import itertools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from v1.engine.async_llm import AsyncLLM
from v1.entrypoints.openai.protocol import ModelCard, ModelList
from v1.lora.peft import CONFIG_NAME, WEIGHTS_NAME
from v1.lora.request import LoRARequest

MAX_LORA_ADAPTERS = 1024
MAX_LORA_NAME_LENGTH = 256


class ModelNotFoundError(Exception):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/unload_lora_adapter (lora_int_id, if given, must match)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_int_id: int | None = None


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LoRAModulePath":
        if text.lstrip().startswith("{"):
            try:
                spec = json.loads(text)
                return cls(spec["name"], spec["path"], spec.get("base_model_name"))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"--lora-modules {text!r}: expected JSON with \"name\" and \"path\" ({e})"
                ) from None
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r}: expected name=path")
        return cls(name, path)


class OpenAIServingModels:
    def __init__(self, engine: AsyncLLM, base_model_names: list[str], model_path: str) -> None:
        self.engine = engine
        self.base_model_names = base_model_names
        self.model_path = model_path
        self.lora_requests: dict[str, LoRARequest] = {}
        # Names whose load awaits the engine: taken already, so a second load of the name
        # meanwhile is refused rather than both loading and one id orphaned in the engine.
        self._loading: set[str] = set()
        self._ids = itertools.count(1)
        # Real paths of the folders runtime loads may read from (none: every one refused).
        self.lora_roots: list[Path] = []

    async def init_static_loras(
        self, modules: list[LoRAModulePath], lora_roots: Sequence[str] = ()
    ) -> None:
        """Load the `--lora-modules` (a ValueError ends start-up for a bad one); their
        folders and `lora_roots` (`--lora-root`) are where runtime loads may read from."""
        for module in modules:
            await self.load_lora_adapter(
                LoadLoRAAdapterRequest(lora_name=module.name, lora_path=module.path),
                module.base_model_name, trusted=True,
            )
        roots = [*lora_roots, *(module.path for module in modules)]
        self.lora_roots = [Path(os.path.realpath(os.path.expanduser(r))) for r in roots]

    def resolve_lora_path(self, lora_path: str) -> str:
        """The real path of a client's adapter folder; a ValueError unless the folder, and
        the adapter files in it, resolve inside a root (the same message whether or not the
        path exists: a client learns nothing of the disk outside the roots)."""
        refused = ValueError(
            f"lora_path {lora_path!r} is not an absolute path inside the server's LoRA "
            "folders (--lora-root, --lora-modules)"
        )
        # Longer than Linux's PATH_MAX: no file has it, and resolving a body-sized path
        # (a stat per component) would hold the event loop.
        if len(lora_path) > 4096 or not os.path.isabs(lora_path):
            raise refused
        try:
            folder = Path(os.path.realpath(lora_path))
            files = [Path(os.path.realpath(folder / name)) for name in (CONFIG_NAME,
                                                                       WEIGHTS_NAME)]
        except (OSError, ValueError):  # too long, a NUL byte
            raise refused from None
        for path in (folder, *files):
            if not any(path.is_relative_to(root) for root in self.lora_roots):
                raise refused
        return str(folder)

    def models(self) -> ModelList:
        created = int(time.time())
        max_len = self.engine.max_model_len
        cards = [
            ModelCard(id=name, created=created, max_model_len=max_len, root=self.model_path)
            for name in self.base_model_names
        ]
        cards += [
            ModelCard(
                id=lora.lora_name, created=created, max_model_len=max_len, root=lora.lora_path,
                parent=lora.base_model_name or self.base_model_names[0],
            )
            for lora in self.lora_requests.values()
        ]
        return ModelList(data=cards)

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None for a base model's name or no name); a
        ModelNotFoundError (404) for a name the server does not serve."""
        if model is None or model in self.base_model_names:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise ModelNotFoundError(model)
        return lora

    async def load_lora_adapter(
        self, request: LoadLoRAAdapterRequest, base_model_name: str | None = None,
        trusted: bool = False,
    ) -> str:
        """Register and load an adapter; a ValueError (400) if it cannot be. `trusted`: the
        operator's (`--lora-modules`), read where it is; else a client's, confined to the
        roots (`resolve_lora_path`)."""
        name = request.lora_name
        if not name or not request.lora_path:
            raise ValueError("both 'lora_name' and 'lora_path' must be given")
        if len(name) > MAX_LORA_NAME_LENGTH:
            raise ValueError(
                f"lora_name has {len(name)} characters, over the limit of "
                f"{MAX_LORA_NAME_LENGTH} (MAX_LORA_NAME_LENGTH)"
            )
        if name in self.lora_requests or name in self.base_model_names or name in self._loading:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        if len(self.lora_requests) + len(self._loading) >= MAX_LORA_ADAPTERS:
            raise ValueError(
                f"{MAX_LORA_ADAPTERS} LoRA adapters are registered, the limit "
                "(MAX_LORA_ADAPTERS): unload one first"
            )
        path = request.lora_path if trusted else self.resolve_lora_path(request.lora_path)
        lora = LoRARequest(name, next(self._ids), path, base_model_name)
        self._loading.add(name)
        try:
            await self.engine.add_lora(lora)  # a ValueError (400) if it cannot be served
        finally:
            self._loading.discard(name)
        self.lora_requests[name] = lora
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        name = request.lora_name
        lora = self.lora_requests.get(name)
        if lora is None:
            raise ModelNotFoundError(name)
        if request.lora_int_id is not None and request.lora_int_id != lora.lora_int_id:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is not that of '{name}' ({lora.lora_int_id})"
            )
        await self.engine.remove_lora(lora.lora_int_id)  # a ValueError (400) while in use
        del self.lora_requests[name]
        return f"Success: LoRA adapter '{name}' removed successfully."
