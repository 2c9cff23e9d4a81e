"""Errors a frontend sees from the engine core."""

import builtins


class EngineDeadError(RuntimeError):
    """The engine core is gone (its process died, or its busy loop failed) and cannot serve
    any request again. Every caller waiting on it gets this, and every later call raises it
    at once; the message says why, when the engine could tell."""


def error_from_remote(type_name: str, message: str) -> Exception:
    """An exception the engine process reported by (type name, message), raised again here:
    a builtin type comes back as itself (a ValueError stays a ValueError), anything else as
    a RuntimeError that names it."""
    cls = getattr(builtins, type_name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return RuntimeError(f"{type_name}: {message}")


class EngineCoreDeadError(EngineDeadError):
    """One engine core of several (data parallelism) died. The requests it held fail with
    this (`request_ids`: the engine's internal ids); the other cores serve on."""

    def __init__(self, message: str, engine_index: int, request_ids: list[str]) -> None:
        super().__init__(message)
        self.engine_index = engine_index
        self.request_ids = request_ids
