"""Fixed step-cost tables for tests that assert what is drafted: priced on measured step times
(the runner's `MeasuredStepCosts`), drafting would depend on how busy the machine is."""

from collections.abc import Callable


class FixedStepCosts:
    """`StepCosts` from a table: a step of n rows costs `cost_ms(n)` milliseconds, whatever
    the steps recorded took (they are kept in `recorded`, rows and seconds)."""

    def __init__(self, cost_ms: Callable[[float], float]) -> None:
        self.cost_ms = cost_ms
        self.recorded: list[tuple[int, float]] = []

    def record(self, num_tokens: int, seconds: float) -> None:
        self.recorded.append((num_tokens, seconds))

    def measured(self, num_tokens: int) -> bool:
        return True

    def learnt(self, num_tokens: float) -> bool:
        return True

    def cost(self, num_tokens: float) -> float:
        return self.cost_ms(num_tokens) / 1e3


def cheap_rows() -> FixedStepCosts:
    """Draft rows nearly free (a step 10 ms, each row 1 us more): drafting pays at all but
    the lowest acceptance."""
    return FixedStepCosts(lambda n: 10.0 + 0.001 * n)
