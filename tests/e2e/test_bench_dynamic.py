"""bench/dynamic.py's dyn/static column: timed paired, so a slow window on one side cannot read as a
miss. A fake clock stands for time (no timing is asserted; speed lives in bench/)."""
import importlib.util
import sys
from pathlib import Path

import pytest

DYNAMIC_PATH = Path(__file__).resolve().parents[2] / "bench" / "dynamic.py"
_spec = importlib.util.spec_from_file_location("bench_dynamic", DYNAMIC_PATH)
bench_dynamic = sys.modules["bench_dynamic"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_dynamic)


class FakeMachine:
    """A clock and two modules whose calls take `cost` seconds each, times `slowdown` while a slow
    window (calls number `window` of the machine's calls) is open."""

    def __init__(self, window=range(0), slowdown=3.0):
        self.now, self.calls, self.window, self.slowdown = 0.0, [], window, slowdown

    def clock(self):
        return self.now

    def module(self, name, cost):
        def call(*inputs):
            self.now += cost * (self.slowdown if len(self.calls) in self.window else 1.0)
            self.calls.append(name)
        return call


def test_pairs_alternate_which_side_goes_first():
    machine = FakeMachine()
    bench_dynamic.paired_ratios(machine.module("dyn", 1.0), machine.module("static", 1.0), (), 4,
                                clock=machine.clock)
    assert machine.calls == ["dyn", "static", "static", "dyn", "dyn", "static", "static", "dyn"]


@pytest.mark.parametrize("window", [range(2, 6), range(0, 3), range(9, 14)])
def test_a_slow_window_does_not_move_the_median_ratio(window):
    # dynamic 5% slower than static; a window 3x slower covering a few calls (on one side's calls or
    # both) leaves the median of the pairs' ratios at 1.05
    machine = FakeMachine(window)
    ratios = bench_dynamic.paired_ratios(machine.module("dyn", 1.05), machine.module("static", 1.0), (), 10,
                                         clock=machine.clock)
    assert len(ratios) == 10
    assert sorted(ratios)[4:6] == [pytest.approx(1.05), pytest.approx(1.05)]


def test_the_ratio_cell_gives_median_and_quartiles():
    assert bench_dynamic.ratio_cell([1.0, 1.1, 0.9, 1.2, 1.05]) == "1.05 (0.95-1.15)"
    assert bench_dynamic.ratio_cell([1.02]) == "1.02 (1.02-1.02)"
