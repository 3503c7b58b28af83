"""bench/run.py's close calls: where a blade column is not clearly ahead of the best peer after the
rounds, it and the peers close to the best one get the same extra rounds; no other column does.
The rounds are faked (no timing is asserted; speed lives in bench/)."""
import importlib.util
import sys
from pathlib import Path

import pytest

RUN_PATH = Path(__file__).resolve().parents[2] / "bench" / "run.py"
_spec = importlib.util.spec_from_file_location("bench_run", RUN_PATH)
bench_run = sys.modules["bench_run"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_run)


def rounds_of(best: dict, count: int = 7) -> tuple:
    """Every backend's rounds, its best one `best[backend]`, all clean."""
    per_round = {b: [t * 1.1] * (count - 1) + [t] for b, t in best.items()}
    return per_round, {b: [0.0] * count for b in best}


@pytest.mark.parametrize("best, extended", [
    # the archive 4% ahead of ONNX Runtime, Inductor 3% behind it: those three
    ({"eager": 10.0, "Inductor": 2.06, "ONNX Runtime": 2.0, "tt_infer": 1.7, "tt_infer AOT": 1.92},
     ["Inductor", "ONNX Runtime", "tt_infer AOT"]),
    # both blade columns behind, the other peers far: ONNX Runtime and both
    ({"eager": 10.0, "Inductor": 5.0, "ONNX Runtime": 2.0, "tt_infer": 2.5, "tt_infer AOT": 2.1},
     ["ONNX Runtime", "tt_infer", "tt_infer AOT"]),
    # both blade columns 10% ahead: none
    ({"eager": 10.0, "ONNX Runtime": 2.0, "tt_infer": 1.8, "tt_infer AOT": 1.8}, []),
])
def test_close_calls_extend_the_close_columns_only(monkeypatch, best, extended):
    per_round, foreign = rounds_of(best)
    measured = []

    def fake_measure(runners, inputs, rounds, calls, loads, threads):
        measured.append(sorted(runners))
        return ({b: [best[b] * 0.9] * rounds for b in runners}, {b: [0.0] * rounds for b in runners})

    monkeypatch.setattr(bench_run, "measure", fake_measure)
    runners = {b: None for b in best}
    close = bench_run.close_calls(runners, (), 5, per_round, foreign, [], {})
    assert sorted(close) == sorted(extended)
    assert measured == ([sorted(extended)] if extended else [])
    for b in best:
        added = bench_run.CLOSE_CALL_ROUNDS if b in extended else 0
        assert len(per_round[b]) == len(foreign[b]) == 7 + added
    best_now = bench_run.best_ms(per_round, foreign)
    assert all(best_now[b] == pytest.approx(best[b] * (0.9 if b in extended else 1.0)) for b in best)
