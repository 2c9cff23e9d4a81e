"""vLLM's `FlexibleArgumentParser`: an ArgumentParser for engine options that also takes
their flags spelled with underscores (`--max_model_len` for `--max-model-len`)."""

import argparse
import sys
from collections.abc import Sequence


class FlexibleArgumentParser(argparse.ArgumentParser):
    """`EngineArgs.add_cli_args(FlexibleArgumentParser())` is vLLM's scripts' command line.
    Only a flag's name is respelled, never its value (`--chat-template=a_b.jinja` keeps
    its underscore)."""

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
