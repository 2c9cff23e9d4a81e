"""The value checks the configuration groups share. Each raises ValueError naming the option,
the bound and the value given, the wording tests and users match on."""

from typing import Any


def check_int(name: str, value: Any, low: int = 1, high: int | None = None) -> None:
    """`value` is an integer (not a bool) >= `low`, and <= `high` when given."""
    if (
        not isinstance(value, int) or isinstance(value, bool) or value < low
        or (high is not None and value > high)
    ):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def check_ints(options: Any, names: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """`check_int` on each attribute of `options` in `names`, and on each in `optional`
    that is not None."""
    for name in names + optional:
        value = getattr(options, name)
        if value is not None or name not in optional:
            check_int(name, value)


def check_fraction(name: str, value: Any) -> None:
    """`value` is a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
