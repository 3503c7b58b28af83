"""The sweep's own bookkeeping: comparison, verdicts against the expected-failures table, crashes."""
import json
from types import SimpleNamespace

import pytest
import torch
from torch.testing._internal.opinfo.core import SampleInput

from . import expected_failures, opinfo_sweep
from .composite_cases import COMPOSITE_CASES, Composite
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
    results[1].status = "refused"
    assert classify(results)[("listed", "f32")] == "XFAIL"
    for unexcused in ("mismatch", "mutation", "error", "crash"):   # the table excuses refusals only
        results[1].status = unexcused
        assert classify(results)[("listed", "f32")] == "FAIL"


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


def test_the_probe_runs_float32_or_every_dtype_an_op_without_it_supports():
    float_op = SimpleNamespace(supported_dtypes=lambda device: {torch.float32, torch.int64})
    int_op = SimpleNamespace(supported_dtypes=lambda device: {torch.int32, torch.bool})
    assert opinfo_sweep.probe_dtypes(float_op, list(opinfo_sweep.DTYPES)) == ["f32"]
    assert opinfo_sweep.probe_dtypes(int_op, list(opinfo_sweep.DTYPES)) == ["i32", "bool"]


def test_composite_cases_name_table_kinds_and_eager_accepts_every_sample():
    kinds = opinfo_sweep.lowering_kinds()
    names = [opinfo_sweep.op_name(case) for case in COMPOSITE_CASES]
    assert len(names) == len(set(names))
    for case in COMPOSITE_CASES:
        assert case.kind in kinds, f"{case.kind} is not in the lowering table"
        for dtype in case.dtypes:
            samples = opinfo_sweep.samples_of(case, opinfo_sweep.DTYPES[dtype], None)
            assert samples, f"{opinfo_sweep.op_name(case)} has no {dtype} samples"
            for sample in samples:   # a sample eager rejects would be a skip: an edge never tested
                fn, tensors = opinfo_sweep.as_graph_function(case, sample)
                fn(*tensors)


def test_a_composite_case_whose_kind_no_engine_computed_is_refused_with_the_reason():
    sample = lambda dt: [(torch.ones(3, dtype=dt), torch.ones(3, dtype=dt))]   # noqa: E731
    computed = Composite("aten::add", lambda x, y: x + y, sample, ("f32",))
    assert opinfo_sweep.run_case(computed, "f32", 0, computed.sample_inputs("cpu", torch.float32)[0]).status == "pass"
    elsewhere = Composite("aten::mul", lambda x, y: x + y, sample, ("f32",))
    result = opinfo_sweep.run_case(elsewhere, "f32", 0, elsewhere.sample_inputs("cpu", torch.float32)[0])
    assert result.status == "refused" and result.failed and result.engine and result.kind == "aten::mul"
    assert "aten::mul is not in the graph" in result.detail
    refused = Composite("aten::max", lambda x: torch.max(x, 0).values, lambda dt: [(torch.ones(3, 2, dtype=dt),)],
                        ("bool",))
    result = opinfo_sweep.run_case(refused, "bool", 0, refused.sample_inputs("cpu", torch.bool)[0])
    assert result.status == "refused" and "aten::max along a dim of a bool tensor" in result.detail, result


def test_a_non_contiguous_input_reaches_the_graph_with_its_strides():
    seen = []
    strided = SimpleNamespace(name="strided_probe", variant_test_name="", op=lambda x: seen.append(x.stride()) or x * 2)
    x = torch.arange(12.0).reshape(3, 4).t()
    assert opinfo_sweep.run_case(strided, "f32", 0, SampleInput(x)).status == "pass"
    assert seen[0] == x.stride()
    sparse = torch.eye(3).to_sparse()   # no storage to copy: cloned
    assert [c.layout for c in opinfo_sweep._clones([x, sparse])] == [torch.strided, torch.sparse_coo]
