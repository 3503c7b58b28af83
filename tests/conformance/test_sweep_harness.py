"""The sweep's own bookkeeping: comparison, verdicts against the expected-failures table, crashes."""
import json
from types import SimpleNamespace

import pytest
import torch
from torch.testing._internal.opinfo.core import SampleInput

from . import expected_failures, opinfo_sweep
from .opinfo_sweep import CaseResult, classify, compare


def test_compare_is_exact_for_integers_and_matches_nan_positions():
    assert compare(torch.tensor([1.0, float("nan")]), torch.tensor([1.0 + 1e-6, float("nan")]), "out") is None
    assert compare(torch.tensor([1.0, float("nan")]), torch.tensor([float("nan"), 1.0]), "out") is not None
    assert compare(torch.tensor([1, 2]), torch.tensor([1, 3]), "out") is not None
    assert compare(torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.0 + 1e-6], dtype=torch.float64), "out")
    assert compare((torch.ones(2), 3), (torch.ones(2), 4), "out") is not None


def test_verdicts_follow_the_table(monkeypatch):
    monkeypatch.setitem(expected_failures.EXPECTED_FAILURES, ("listed", "f32"), "a known class")
    results = [CaseResult("listed", "f32", 0, "pass"), CaseResult("listed", "f32", 1, "pass"),
               CaseResult("plain", "f32", 0, "pass"), CaseResult("plain", "f32", 1, "mismatch"),
               CaseResult("listed", "i64", 0, "skip")]
    assert classify(results) == {("listed", "f32"): "XPASS", ("plain", "f32"): "FAIL", ("listed", "i64"): "SKIP"}
    results[1].status = "error"
    assert classify(results)[("listed", "f32")] == "XFAIL"


def test_a_case_that_started_without_a_result_becomes_a_crash(tmp_path):
    results = tmp_path / "results.jsonl"
    done = CaseResult("add", "f32", 0, "pass", engine=True)
    results.write_text(json.dumps(done.__dict__) + "\n" +
                       json.dumps({"op": "add", "dtype": "f32", "sample": 1, "status": "start"}) + "\n")
    opinfo_sweep._record_crash(results, "worker died", tmp_path / "worker.log")
    by_sample = {r.sample: r for r in opinfo_sweep.load_results(results)}
    assert by_sample[0].status == "pass" and by_sample[1].status == "crash"
    assert by_sample[1].failed


def test_a_worker_dying_before_its_first_case_shows_what_it_said(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("Traceback (most recent call last):\nModuleNotFoundError: No module named 'expecttest'\n")
    with pytest.raises(RuntimeError, match="expecttest"):
        opinfo_sweep._record_crash(tmp_path / "results.jsonl", "worker died", log)


def test_run_case_skips_what_eager_rejects_and_reports_the_engine():
    reshape = SimpleNamespace(name="reshape_probe", variant_test_name="", op=lambda x, shape: x.reshape(shape) * 2)
    rejected = opinfo_sweep.run_case(reshape, "f32", 0, SampleInput(torch.ones(2, 3), args=((7,),)))
    assert rejected.status == "skip" and "eager raises" in rejected.detail
    accepted = opinfo_sweep.run_case(reshape, "f32", 0, SampleInput(torch.ones(2, 3), args=((3, 2),)))
    assert accepted.status == "pass" and accepted.engine
