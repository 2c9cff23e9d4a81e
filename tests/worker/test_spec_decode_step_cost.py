"""Decode step costs learnt from the steps recorded (`MeasuredStepCosts`), fed made-up times:
per bucket of rows, smoothed, the curve between buckets, and buckets that age out."""

import logging

import pytest

from v1.worker.spec_decode.step_cost import (
    LOG_EVERY,
    MEASURE_SHARE,
    MIN_SAMPLES,
    SMOOTHING,
    MeasuredStepCosts,
)


def test_step_costs_are_learnt_per_bucket_and_smoothed():
    costs = MeasuredStepCosts()
    for _ in range(MIN_SAMPLES):
        costs.record(1, 0.010)
    costs.record(5, 0.020)
    assert not costs.learnt(1)  # one bucket, and one step of another
    costs.record(6, 0.050)  # an outlier among the first steps: the median wins
    costs.record(7, 0.020)
    assert costs.learnt(6) and not costs.learnt(7)  # up to the largest bucket's rows
    assert costs.cost(1) == pytest.approx(0.010)
    assert costs.cost(6) == pytest.approx(0.020)  # the bucket's mean size, its median time
    assert costs.cost(3.5) == pytest.approx(0.015)  # the line between the two
    assert costs.cost(11) == pytest.approx(0.030)  # beyond: the line goes on
    costs.record(8, 1.0)  # one slow step moves the bucket by SMOOTHING of twice its time
    assert costs.cost(6 + SMOOTHING * 2) == pytest.approx(0.020 * (1 + SMOOTHING))
    for _ in range(MIN_SAMPLES):
        costs.record(16, 0.015)  # measured cheaper than fewer rows: no cheaper than those
    assert costs.cost(16) == costs.cost(12) == pytest.approx(0.022)


def test_step_cost_curve_is_logged(caplog):
    costs = MeasuredStepCosts()
    with caplog.at_level(logging.DEBUG, logger="v1"):
        for i in range(LOG_EVERY):
            costs.record(1 + i % 2, 0.01)
    assert "decode step cost (rows: ms): 1.0: 10.00, 2.0: 10.00" in caplog.text


def test_a_busy_period_is_forgotten():
    costs = MeasuredStepCosts()
    for _ in range(MIN_SAMPLES):  # measured while another process had the cores
        costs.record(1, 0.020)
        costs.record(5, 0.060)
    for _ in range(30):  # quiet again, where steps are still taken: the bucket follows
        costs.record(1, 0.010)
    assert costs.cost(1) == pytest.approx(0.010, rel=0.05)
    assert costs.learnt(5) and costs.cost(5) == pytest.approx(0.060)
    # A bucket no step refreshes (its size no longer drafted) counts for MIN_SAMPLES x its
    # time / MEASURE_SHARE of steps: 18 s here, 1800 steps of 10 ms (30 of them above).
    lifetime = MIN_SAMPLES * 0.060 / MEASURE_SHARE
    for _ in range(round(lifetime / 0.010) - 40):
        costs.record(1, 0.010)
    assert costs.learnt(5)
    for _ in range(20):
        costs.record(1, 0.010)
    assert not costs.learnt(5) and not costs.learnt(1)  # one fresh bucket: no curve
    # Measured afresh from its first steps, the busy time not blended in.
    for _ in range(MIN_SAMPLES - 1):
        costs.record(5, 0.014)
    assert not costs.learnt(5)
    costs.record(5, 0.014)
    assert costs.learnt(5) and costs.cost(5) == pytest.approx(0.014)
    assert costs.cost(1) == pytest.approx(0.010, rel=0.05)  # refreshed all along: kept


def test_a_bucket_refreshed_by_its_steps_does_not_age():
    costs = MeasuredStepCosts()
    for _ in range(2000):  # 20 s of steps, each bucket's lifetime 3 s
        costs.record(1, 0.010)
        costs.record(2, 0.010)
    assert costs.learnt(2) and costs.cost(2) == pytest.approx(0.010)
