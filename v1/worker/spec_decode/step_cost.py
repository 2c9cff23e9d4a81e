"""What a decode step costs, by its number of token rows: the prices the drafter weighs a
draft's rows against the steps it saves with.

`StepCosts` is what the drafter asks; `MeasuredStepCosts` learns it on this machine from the
steps the runner times. Steps are kept in buckets by token count (1, 2, 3-4, 5-8, ...); each
bucket holds a smoothed token count and wall time. A bucket counts once it has `MIN_SAMPLES`
steps (their median time starts it); after that a step moves it by `SMOOTHING` of the
difference, the step's time first clamped to [1/2, 2] x the bucket's, so no one slow step
(another process, a page fault) moves it far. A bucket no step has refreshed for
`MIN_SAMPLES` x its time / `MEASURE_SHARE` of stepping (the seconds of the steps recorded
since, not the clock's: an idle engine's do not age) no longer counts, and starts again from
new steps: the drafter stops making steps of a size it finds dear, so a size measured while
the machine was busy would otherwise keep that price; making them again to measure costs
about `MEASURE_SHARE` of the steps' time. Between buckets the cost is the straight line
through their points, beyond them the line of the nearest two; the points' times are made
non-decreasing in tokens (more rows never cost less), so a marginal cost is never negative.
"""

import bisect
import logging
import statistics
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger("v1")

MIN_SAMPLES = 3
SMOOTHING = 0.1
MEASURE_SHARE = 0.01
LOG_EVERY = 512  # steps between DEBUG lines of the learnt curve


class StepCosts(Protocol):
    def record(self, num_tokens: int, seconds: float) -> None:
        """A decode step of `num_tokens` rows took `seconds`."""
        ...

    def measured(self, num_tokens: int) -> bool:
        """Whether steps of `num_tokens` rows were measured lately (False: a step of the
        batch's own rows is not drafted, and so measured)."""
        ...

    def learnt(self, num_tokens: float) -> bool:
        """Whether `cost` is known up to `num_tokens` rows (False: a step that large is
        drafted, and so measured)."""
        ...

    def cost(self, num_tokens: float) -> float:
        """Seconds a decode step of `num_tokens` rows takes (only where `learnt`)."""
        ...


def _bucket(num_tokens: int) -> int:
    return (num_tokens - 1).bit_length()  # 1, 2, 3-4, 5-8, ...


@dataclass(slots=True)
class _Bucket:
    tokens: float = 0.0
    seconds: float = 0.0
    ready: bool = False
    refreshed: float = 0.0  # the recorded seconds at its last step
    first: list[tuple[int, float]] = field(default_factory=list)  # until ready

    def fresh(self, elapsed: float) -> bool:
        age = elapsed - self.refreshed
        return self.ready and age <= MIN_SAMPLES * self.seconds / MEASURE_SHARE

    def add(self, tokens: int, seconds: float, elapsed: float) -> None:
        if self.ready and not self.fresh(elapsed):
            self.ready = False  # measured long ago: start again from new steps
        self.refreshed = elapsed
        if self.ready:
            seconds = min(max(seconds, self.seconds / 2), self.seconds * 2)
            self.tokens += SMOOTHING * (tokens - self.tokens)
            self.seconds += SMOOTHING * (seconds - self.seconds)
            return
        self.first.append((tokens, seconds))
        if len(self.first) == MIN_SAMPLES:
            self.tokens = statistics.fmean(t for t, _ in self.first)
            self.seconds = statistics.median(s for _, s in self.first)
            self.ready = True
            self.first.clear()


class MeasuredStepCosts:
    """`StepCosts` learnt online from the steps recorded (module docstring)."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._tokens: list[float] = []  # the curve's points, ascending
        self._seconds: list[float] = []
        self._elapsed = 0.0  # seconds of all steps recorded: the buckets' clock
        self._recorded = 0

    def record(self, num_tokens: int, seconds: float) -> None:
        self._elapsed += seconds
        bucket = self._buckets.setdefault(_bucket(num_tokens), _Bucket())
        bucket.add(num_tokens, seconds, self._elapsed)
        points = [(b.tokens, b.seconds) for _, b in sorted(self._buckets.items())
                  if b.fresh(self._elapsed)]
        self._tokens = [t for t, _ in points]
        self._seconds = []
        for _, s in points:
            self._seconds.append(max(s, self._seconds[-1]) if self._seconds else s)
        self._recorded += 1
        if self._recorded % LOG_EVERY == 0 and logger.isEnabledFor(logging.DEBUG):
            logger.debug("decode step cost (rows: ms): %s", ", ".join(
                f"{t:.1f}: {1e3 * s:.2f}" for t, s in zip(self._tokens, self._seconds)))

    def measured(self, num_tokens: int) -> bool:
        """Its bucket is fresh."""
        bucket = self._buckets.get(_bucket(num_tokens))
        return bucket is not None and bucket.fresh(self._elapsed)

    def learnt(self, num_tokens: float) -> bool:
        """Two fresh step sizes to go on, up to `num_tokens` rows (a line drawn beyond the
        largest would guess, where a step of that size measures)."""
        return len(self._tokens) >= 2 and num_tokens <= self._tokens[-1]

    def cost(self, num_tokens: float) -> float:
        """Between the learnt sizes the line through them; beyond, the line of the largest
        two."""
        xs, ys = self._tokens, self._seconds
        assert len(xs) >= 2, "no step costs learnt yet"
        i = min(max(bisect.bisect_left(xs, num_tokens), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        # Buckets hold disjoint token ranges: x1 > x0.
        return max(y0 + (y1 - y0) / (x1 - x0) * (num_tokens - x0), 0.0)
