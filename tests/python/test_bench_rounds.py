"""bench/cuda/rounds.py: variants timed in interleaved rounds (the GPU benchmarks' timing helper),
checked on the CPU with a timer whose clock drifts as a GPU's does when its clocks are not locked."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "cuda"))
import rounds  # noqa: E402


class DriftingTimer:
    """A variant's true time times a slowdown that grows by `drift` with every timing."""

    def __init__(self, drift):
        self.drift = drift
        self.calls = 0

    def __call__(self, true_ms):
        t = true_ms * (1.0 + self.drift * self.calls)
        self.calls += 1
        return t


def sequential(variants, rounds_, time_one):  # the old way: every timing of a variant in a row
    return {name: [time_one(v) for _ in range(rounds_)] for name, v in variants}


def test_drift_falls_on_every_variant_alike():
    # Two identical kernels and a third 10% faster; the clock slows 1% a timing.
    variants = [("cudnn", 1.0), ("same", 1.0), ("faster", 1.0 / 1.1)]
    seq = rounds.summarise(sequential(variants, 9, DriftingTimer(0.01)), "cudnn")
    inter = rounds.summarise(rounds.interleaved(variants, 9, DriftingTimer(0.01)), "cudnn")
    # In a row, the later variants look slower by the drift of the rounds between them (9%+).
    assert seq["same"]["speed"] < 0.93
    # Interleaved, each ratio is within a round: off by at most the drift of one or two timings.
    assert inter["same"]["speed"] == pytest.approx(1.0, abs=0.021)
    assert inter["faster"]["speed"] == pytest.approx(1.1, abs=0.025)
    assert inter["cudnn"]["speed"] == 1.0
    assert inter["same"]["speed_min"] <= inter["same"]["speed"] <= inter["same"]["speed_max"]


def test_rotation_and_counts():
    order = []
    times = rounds.interleaved([("a", "a"), ("b", "b"), ("c", "c")], 4, lambda v: order.append(v) or 1.0)
    assert order == list("abc" "bca" "cab" "abc")
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}


def test_summary_and_table():
    times = {"base": [2.0, 2.0, 4.0], "x": [1.0, 2.0, 2.0]}
    s = rounds.summarise(times, "base")
    assert s["x"]["ms"] == 2.0 and s["x"]["ms_min"] == 1.0 and s["x"]["ms_max"] == 2.0
    assert s["x"]["speed"] == 2.0 and s["x"]["speed_min"] == 1.0 and s["x"]["speed_max"] == 2.0
    lines = rounds.table(s, "base", "title")
    assert lines[0] == "title" and len(lines) == 4 and "2.000x" in lines[3]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="names must be unique"):
        rounds.interleaved([("a", 1), ("a", 2)], 2, lambda v: 1.0)
    with pytest.raises(ValueError, match="rounds"):
        rounds.interleaved([("a", 1)], 0, lambda v: 1.0)
    with pytest.raises(ValueError, match="base"):
        rounds.summarise({"a": [1.0]}, "cudnn")
    with pytest.raises(ValueError, match=r"times\['b'\]"):
        rounds.summarise({"a": [1.0, 1.0], "b": [1.0]}, "a")
