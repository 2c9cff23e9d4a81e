"""The wire protocol between an engine core process and its clients (msgspec over ZMQ).

A core at ADDRESS (`ipc://PATH` or `tcp://HOST:PORT`) binds a PULL socket there for input and
a ROUTER at `output_address(ADDRESS)` for output; client i connects a DEALER with routing id
`client_routing_id(i)` and receives only its own messages. Every message is two frames,
[type, msgpack]:

    in:  HELLO -> READY; ADD -> OUTPUTS, step by step; ABORT (no answer);
         UTILITY -> UTILITY_RESULT (an error there is the caller's; the core serves on)
    out: OUTPUTS carry `scheduler_stats`; with `engine_error` set, the last message

Request ids are the frontends' internal ids, unique per engine for its life (a duplicate is
refused); a client's requests are aborted when its DEALER disconnects. Each message in full:
docs/serving.md, "The wire protocol".
"""

import enum
import os
from typing import Any

import msgspec

from v1.outputs import SchedulerStats
from v1.pooling_params import PoolerInfo


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of a client -> core message."""

    HELLO = b"\x00"
    ADD = b"\x01"
    ABORT = b"\x02"
    UTILITY = b"\x03"


class EngineCoreOutputType(bytes, enum.Enum):
    """First frame of a core -> client message."""

    READY = b"\x00"
    OUTPUTS = b"\x01"
    UTILITY_RESULT = b"\x02"


class UtilityRequest(msgspec.Struct, array_like=True):
    client_index: int
    call_id: int
    method: str
    args: tuple[Any, ...] = ()


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack-encoded; the caller knows the type
    error: tuple[str, str] | None = None  # (exception type name, message)


# The decoded type of each utility's result (others: plain msgpack values).
UTILITY_RESULT_TYPES: dict[str, Any] = {
    "get_stats": SchedulerStats, "reset_prefix_cache": bool, "add_lora": bool,
    "remove_lora": bool, "list_loras": set[int], "is_scheduler_paused": bool,
}


class EngineCoreReady(msgspec.Struct, array_like=True):
    """What a frontend needs to know of the model, from the core that loaded it."""

    model_name: str
    model_dir: str  # HF-format directory holding the tokenizer files
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]
    # The KV cache (defaults: a core that predates these fields).
    block_size: int = 16
    num_gpu_blocks: int = 0
    enable_prefix_caching: bool = True
    # "fcfs" or "priority": a frontend refuses a request's priority under fcfs.
    scheduling_policy: str = "fcfs"
    # A pooling engine's pooler (runner="pooling"); None: the engine generates.
    pooler: PoolerInfo | None = None


def output_address(address: str) -> str:
    """The output socket's address, derived from the engine's (input) address."""
    if address.startswith("ipc://"):
        return address + "-out"
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if port.isdigit() and int(port) > 0:
            return f"tcp://{host}:{int(port) + 1}"
    raise ValueError(
        f"engine address {address!r} must be ipc://PATH or tcp://HOST:PORT (PORT > 0; the "
        "output socket takes PORT + 1)"
    )


# The directories clients make for their engines' ipc sockets (`tempfile.mkdtemp` prefixes).
ENGINE_SOCKET_DIR_PREFIX = "v1-engine-"
DP_SOCKET_DIR_PREFIX = "v1-dp-"


def remove_socket_files(address: str) -> None:
    """Remove an ipc:// engine address's two socket files, which ZMQ leaves behind (an
    engine that was killed could not remove them itself)."""
    if not address.startswith("ipc://"):
        return
    for addr in (address, output_address(address)):
        try:
            os.unlink(addr[len("ipc://"):])
        except OSError:  # already gone (or not ours): nothing to tidy
            pass


def remove_engine_sockets(address: str) -> None:
    """What an engine leaves of its ipc:// address: its socket files, then their directory if
    a client made it for engine sockets and it is empty (the last engine to leave removes it,
    which its client cannot do when it was killed)."""
    remove_socket_files(address)
    directory = os.path.dirname(address.removeprefix("ipc://"))
    if address.startswith("ipc://") and os.path.basename(directory).startswith(
        (ENGINE_SOCKET_DIR_PREFIX, DP_SOCKET_DIR_PREFIX)
    ):
        try:
            os.rmdir(directory)
        except OSError:  # another engine's sockets are still there (or it is gone already)
            pass


def client_routing_id(client_index: int) -> bytes:
    return b"client-%d" % client_index
