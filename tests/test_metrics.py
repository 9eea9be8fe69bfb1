"""The allocation-vs-arrived curve (sim/metrics.py), checked against hand-computed values of the reference's rule."""

from __future__ import annotations

import numpy as np
import pytest

from sharegpu.placement.reasons import ReasonKind
from sharegpu.sim.metrics import CURVE_MAX, RunLog, allocation_curve, percentile

# With 100 GPUs (100,000 milli) one percent of capacity is exactly 1000 milli, which keeps the hand arithmetic easy.
GPUS_100 = 100_000


def test_curve_has_a_value_slot_for_every_level() -> None:
    curve = allocation_curve([0, 1000], [0, 1000], GPUS_100)
    assert CURVE_MAX == 130
    assert len(curve) == 131


def test_arrived_is_rounded_half_to_even_and_a_level_is_the_mean_of_its_samples() -> None:
    # arrived %:   0, 0.5, 1, 1.5, 2, 2.5  → rounded half to even: 0, 0, 1, 2, 2, 2
    # allocated %: 0, 0.5, 1, 1,   2, 2.4
    arrived = [0, 500, 1000, 1500, 2000, 2500]
    allocated = [0, 500, 1000, 1000, 2000, 2400]
    curve = allocation_curve(arrived, allocated, GPUS_100)
    assert curve[0] == 0.25  # mean(0, 0.5): 0.5 rounds down to 0
    assert curve[1] == 1.0  # only the sample at exactly 1
    assert curve[2] == pytest.approx(1.8)  # mean(1, 2, 2.4): 1.5 rounds up to 2, 2.5 down to 2
    assert curve[3] == pytest.approx(1.8)  # no sample at 3: samples within ±1 (all at 2)
    assert curve[4] is None  # no sample within ±1 and beyond the last sample
    assert all(v is None for v in curve[4:])


def test_plus_minus_one_fallback_takes_both_neighbours() -> None:
    # Samples at 0, 2 and 4 %; levels 1 and 3 have none and take the mean of their neighbours.
    curve = allocation_curve([0, 2000, 4000], [0, 2000, 3000], GPUS_100)
    assert curve[0] == 0.0
    assert curve[1] == 1.0  # mean(0, 2)
    assert curve[2] == 2.0
    assert curve[3] == 2.5  # mean(2, 3)
    assert curve[4] == 3.0
    assert curve[5] == 3.0  # ±1 reaches the sample at 4
    assert curve[6] is None


def test_fallback_is_used_only_when_the_level_is_empty() -> None:
    # Level 2 has its own sample; its neighbours at 1 and 3 must not be averaged in.
    curve = allocation_curve([0, 1000, 2000, 3000], [0, 500, 2000, 2900], GPUS_100)
    assert curve[2] == 2.0
    assert curve[1] == 0.5
    assert curve[3] == 2.9


def test_allocation_is_rounded_to_two_decimals_before_the_mean() -> None:
    # 1000 GPUs: 51 milli is 0.0051 % → 0.01, 45 milli is 0.0045 % → 0.0. Rounded first, the mean of
    # (0.01, 0.01, 0.0) is 0.00667 → 0.01; the mean of the unrounded values (0.0049) would give 0.0.
    curve = allocation_curve([0, 0, 0], [51, 51, 45], 1_000_000)
    assert curve[0] == 0.01
    # 3 GPUs: 1000 milli arrived is 33.33 % (level 33) and 1000 milli allocated is 33.33 %.
    curve = allocation_curve([0, 1000], [0, 1000], 3000)
    assert curve[33] == 33.33
    assert curve[34] == 33.33  # ±1
    assert curve[35] is None


def test_step_fallback_for_a_small_cluster() -> None:
    # 2 GPUs: each whole GPU arrived is a 50 % jump, so most levels have no sample within ±1.
    curve = allocation_curve([0, 1000, 2000, 2500], [0, 1000, 1000, 2000], 2000)
    # arrived %: 0, 50, 100, 125; allocated %: 0, 50, 50, 100
    assert curve[0] == 0.0
    assert curve[1] == 0.0  # ±1 reaches 0
    assert curve[2] == 0.0  # step: the last sample at or below 2 %
    assert curve[48] == 0.0
    assert curve[49] == 50.0  # ±1 reaches 50
    assert curve[50] == 50.0
    assert curve[75] == 50.0  # step
    assert curve[99] == 50.0
    assert curve[100] == 50.0
    assert curve[110] == 50.0  # step from the sample at 100
    assert curve[124] == 100.0  # ±1 reaches 125
    assert curve[125] == 100.0
    assert curve[126] == 100.0
    assert curve[127] is None  # beyond the last sample
    assert curve[130] is None


def test_step_fallback_takes_the_last_sample_not_the_largest() -> None:
    # Two samples at the same rounded level below a gap: the step takes the later one.
    curve = allocation_curve([0, 10_000, 10_000, 20_000], [0, 9000, 7000, 20_000], GPUS_100)
    assert curve[10] == 8.0  # mean(9, 7)
    assert curve[15] == 7.0  # the last sample at or below 15 %, not the mean and not the max


def test_none_beyond_the_last_sample_rather_than_a_step() -> None:
    curve = allocation_curve([0, 50_000], [0, 40_000], GPUS_100)
    assert curve[49] == 40.0  # ±1
    assert curve[50] == 40.0
    assert curve[51] == 40.0  # ±1
    assert curve[52] is None  # beyond the last sample: no step value
    assert curve[25] == 0.0  # a step inside the samples' range does carry the value below


def test_a_run_that_stops_below_130_reports_nothing_at_130() -> None:
    curve = allocation_curve([0, 100_000], [0, 95_000], GPUS_100)
    assert curve[100] == 95.0
    assert curve[101] == 95.0
    assert curve[102] is None
    assert curve[130] is None


def test_accepts_numpy_arrays_and_lists_alike() -> None:
    a = allocation_curve([0, 1000, 2000], [0, 1000, 1500], GPUS_100)
    b = allocation_curve(np.array([0, 1000, 2000]), np.array([0, 1000, 1500]), GPUS_100)
    assert a == b


def test_runlog_records_samples_and_failures() -> None:
    log = RunLog(total_milli=4000)
    assert log.arrived == [0] and log.allocated == [0]  # the curve starts at the origin
    log.record(1000, 1000)
    log.record(2000, 1000)
    log.fail(ReasonKind.CPU)
    log.fail(ReasonKind.CPU)
    log.fail(ReasonKind.NO_GPUS)
    assert log.arrived == [0, 1000, 2000]
    assert log.allocated == [0, 1000, 1000]
    assert log.failed == 3
    assert log.failures == {ReasonKind.CPU: 2, ReasonKind.NO_GPUS: 1}
    # Two RunLogs do not share their lists.
    assert RunLog(1).arrived == [0]


def test_percentile() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(i) for i in range(101)], 99) == 99.0
