"""The engine options' command line, built from `EngineArgs`' fields: the one source of the
options and their help, for `EngineArgs.add_cli_args` (vLLM's scripts), `v1 serve` and
anything else that parses engine options.

Each field `max_model_len` is the flag `--max-model-len`, typed by the field's annotation: a
bool is `--flag` / `--no-flag`, a dict is a JSON object (as vLLM's `--speculative-config`),
`X | None` parses as X, a list as one or more values. The request limits (`InputLimits`'
fields) get a group of their own.
"""

import argparse
import json
import typing
from dataclasses import fields
from typing import Any

from v1.config.limits import InputLimits

ENGINE_GROUP = "engine options"
LIMITS_GROUP = "request limits"


def add_engine_args(parser: argparse.ArgumentParser, cls: type) -> argparse.ArgumentParser:
    """Adds a flag for each field of the dataclass `cls` (EngineArgs), with the field's
    default and `help` metadata; returns the parser."""
    group = parser.add_argument_group(ENGINE_GROUP)
    limits = parser.add_argument_group(
        LIMITS_GROUP, "a request over one gets a ValueError (a 400 on the server) naming the "
        "field and the limit",
    )
    limit_help = {f.name: f.metadata["help"] for f in fields(InputLimits)}
    hints = typing.get_type_hints(cls)
    for field in fields(cls):
        flag, hint = "--" + field.name.replace("_", "-"), hints[field.name]
        if field.name in limit_help:
            limits.add_argument(flag, type=int, default=field.default,
                                help=limit_help[field.name])
        elif hint is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction,
                               default=field.default, help=field.metadata["help"])
        else:
            scalar = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
            nargs = None
            if typing.get_origin(scalar) is dict:
                scalar = _json_object
            elif typing.get_origin(scalar) is list:
                scalar, nargs = str, "+"
            group.add_argument(flag, type=scalar, nargs=nargs, default=field.default,
                               help=field.metadata["help"])
    return parser


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object option (argparse reports the ValueError as a usage error)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


_json_object.__name__ = "JSON object"  # what argparse names in its error
