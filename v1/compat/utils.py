"""vLLM's small helpers (`vllm.utils`, `vllm.utils.argparse_utils`,
`vllm.utils.network_utils`): the engine options' parser, a free port, request ids."""

import argparse
import socket
import sys
import uuid
from collections.abc import Sequence


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser for engine options that also takes their flags spelled with
    underscores (`--max_model_len` for `--max-model-len`):
    `EngineArgs.add_cli_args(FlexibleArgumentParser())` is vLLM's scripts' command line.
    Only a flag's name is respelled, never its value (`--chat-template=a_b.jinja` keeps its
    underscore)."""

    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        # None: the command line's, as argparse's own (respelled too).
        args = [_dashed(arg) for arg in (sys.argv[1:] if args is None else args)]
        return super().parse_known_args(args, namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def get_open_port() -> int:
    """A TCP port free on this host now (the OS picks it; another process may take it
    before the caller binds it, as with vLLM's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def random_uuid() -> str:
    """A fresh random id (32 hex digits), e.g. for `AsyncLLM.generate`'s request_id."""
    return uuid.uuid4().hex
