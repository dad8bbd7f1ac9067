"""`time_ms`: the one timer of gate calibration and the benchmarks."""

from __future__ import annotations

import pytest

from policyzoo.timing import time_ms


def test_calls_warmup_and_setup_are_counted_as_documented():
    log = []
    ms = time_ms(lambda: log.append("call"), calls=3, reps=2, warmup=1, setup=lambda: log.append("setup"), device="cpu")
    assert ms >= 0
    assert log == ["setup", "call"] + (["setup"] + ["call"] * 3) * 2


@pytest.mark.parametrize("kwargs", [{"calls": 0}, {"reps": 0}, {"warmup": -1}, {"calls": True}, {"reps": 1.5}])
def test_bad_counts_are_rejected(kwargs):
    with pytest.raises(ValueError, match="must be an int"):
        time_ms(lambda: None, device="cpu", **kwargs)
