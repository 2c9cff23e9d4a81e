"""The models a server answers to (vLLM's `serving_models.py`): the base model's served
names, and LoRA adapters by name, from `--lora-modules` at start-up or loaded and unloaded
at run time through `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (with
`--enable-lora`). A request's `model` picks one: a base name runs the base model, an adapter's
name runs that adapter. Each adapter gets its own `lora_int_id` (from 1 up, never reused, so
the engine's id-keyed caches never mix two adapters)."""

import itertools
import json
import time
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from v1.engine.async_llm import AsyncLLM
from v1.entrypoints.openai.protocol import ModelCard, ModelList
from v1.lora.request import LoRARequest


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

    async def init_static_loras(self, modules: list[LoRAModulePath]) -> None:
        """Load the `--lora-modules` (a ValueError ends start-up for a bad one)."""
        for module in modules:
            await self.load_lora_adapter(
                LoadLoRAAdapterRequest(lora_name=module.name, lora_path=module.path),
                module.base_model_name,
            )

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
        self, request: LoadLoRAAdapterRequest, base_model_name: str | None = None
    ) -> str:
        name = request.lora_name
        if not name or not request.lora_path:
            raise ValueError("both 'lora_name' and 'lora_path' must be given")
        if name in self.lora_requests or name in self.base_model_names or name in self._loading:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        lora = LoRARequest(name, next(self._ids), request.lora_path, base_model_name)
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
