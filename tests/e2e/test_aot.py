"""Dynamo's AOT precompile with tt_infer: save in one process, load and run in a fresh one that
cannot compile; dynamo's guards are still checked there."""
from __future__ import annotations

import functools
import pickle

import pytest
import torch

import blade
from blade.aot import IncompatibleArtifact, PrecompiledModule, seal, unseal
from aot_testing import make_model_and_inputs, run_python, save_reference, tripwire_compiler_env

ENGINE_CALL = 'prim::CallMethod[name="execute"]'


@pytest.fixture(scope="module")
def precompiled(tmp_path_factory):
    """torch's own recipe, spelled out (blade.precompile is the same in one line)."""
    root = tmp_path_factory.mktemp("precompile")
    model, inputs = make_model_and_inputs()
    with torch.no_grad():
        fn = torch.compile(model.forward, backend="tt_infer", fullgraph=True).aot_compile((inputs, {}))
        fn.save_compiled_function(str(root / "block.aot"), external_data={"model": model})
    # like the function it was made from, a method's precompiled function takes the module first
    save_reference(root, functools.partial(fn, model), model, inputs)
    return root, fn


def test_backend_result_is_serializable_and_has_engines(precompiled):
    _, fn = precompiled
    compiled = fn._artifacts.compiled_fn
    assert isinstance(compiled, PrecompiledModule)
    assert ENGINE_CALL in str(compiled.module.graph)
    assert compiled.stamps["engines"] >= 1


def test_load_in_fresh_process_is_bit_exact_guarded_and_never_compiles(precompiled, tmp_path):
    root, _ = precompiled
    env, compiler_mark = tripwire_compiler_env(tmp_path)
    out = run_python(f"""
        import torch, blade
        from aot_testing import make_model_and_inputs
        model, _ = make_model_and_inputs()
        io = torch.load({str(root / 'io.pt')!r})
        with open({str(root / 'block.aot')!r}, "rb") as f:
            fn = torch.compiler.load_compiled_function(f, external_data={{"model": model}})
        assert {ENGINE_CALL!r} in str(fn._artifacts.compiled_fn.module.graph)
        with torch.no_grad():
            got = fn(model, *io["inputs"])
            for g, want in zip(got, io["outputs"]):
                assert torch.equal(g, want), (g - want).abs().max()
            try:  # a shape the engines were not compiled for must be stopped by dynamo's guards
                fn(model, torch.randn(3, 8, 32), io["inputs"][1])
            except RuntimeError as err:
                assert "GuardManager check failed" in str(err), err
            else:
                raise AssertionError("guards were not checked")
        print("ok")
    """, env=env)
    assert "ok" in out
    assert not compiler_mark.exists(), f"a C++ compiler ran at load: {compiler_mark.read_text()}"


def test_one_line_helpers_round_trip(tmp_path):
    model, inputs = make_model_and_inputs(seed=1)
    fn = blade.precompile(model, inputs, str(tmp_path / "m.aot"))
    save_reference(tmp_path, fn, model, inputs)
    env, compiler_mark = tripwire_compiler_env(tmp_path)
    out = run_python(f"""
        import torch, blade
        from aot_testing import make_model_and_inputs
        model, _ = make_model_and_inputs(seed=1)
        io = torch.load({str(tmp_path / 'io.pt')!r})
        fn = blade.load_precompiled({str(tmp_path / 'm.aot')!r}, model)
        with torch.no_grad():
            got = fn(*io["inputs"])
        assert isinstance(got, tuple) and all(torch.equal(g, w) for g, w in zip(got, io["outputs"]))
        print("ok")
    """, env=env)
    assert "ok" in out and not compiler_mark.exists()


def test_incompatible_stamps_are_refused_at_load(precompiled):
    _, fn = precompiled
    data = PrecompiledModule.serialize_compile_artifacts(fn._artifacts.compiled_fn)
    state = pickle.loads(unseal(data, "test"))
    state["stamps"]["isa"] = ["x86-64-v9"]
    with pytest.raises(IncompatibleArtifact, match="engines need ISA x86-64-v9"):
        PrecompiledModule.deserialize_compile_artifacts(seal(pickle.dumps(state)))
    state["format"] = 99
    with pytest.raises(IncompatibleArtifact, match="format 99"):
        PrecompiledModule.deserialize_compile_artifacts(seal(pickle.dumps(state)))


def test_dynamic_graph_precompiles_once_and_serves_every_size_in_range(tmp_path):
    """Dynamo's precompile of a graph with symbolic batch and sequence dims: one compile, and a
    fresh process with no compiler serves sizes it never saw, size 1 included (min=1: dynamo
    would specialize sizes 0 and 1, blade.precompile traces with backed_size_oblivious and
    checks the graph at 1); a size outside the declared range is stopped by dynamo's guards."""
    model, _ = make_model_and_inputs(seed=2)
    x, mask = torch.randn(4, 8, 32), (torch.rand(4, 8, 1) > 0.3).float()
    for tensor in (x, mask):
        torch._dynamo.mark_dynamic(tensor, 0, min=1, max=16)
        torch._dynamo.mark_dynamic(tensor, 1, min=1, max=64)
    fn = blade.precompile(model, (x, mask), str(tmp_path / "dyn.aot"))
    report = fn.func._artifacts.compiled_fn.report
    assert report.size_symbols and report.engine_calls >= 1 and not report.symbolic_refusals, report
    env, compiler_mark = tripwire_compiler_env(tmp_path)
    out = run_python(f"""
        import torch, blade
        from aot_testing import make_model_and_inputs
        model, _ = make_model_and_inputs(seed=2)
        fn = blade.load_precompiled({str(tmp_path / 'dyn.aot')!r}, model)
        assert {ENGINE_CALL!r} in str(fn.func._artifacts.compiled_fn.module.graph)
        with torch.no_grad():
            for batch, seq in ((2, 2), (3, 17), (16, 64), (5, 8), (1, 1), (1, 9), (4, 1)):
                x, mask = torch.randn(batch, seq, 32), (torch.rand(batch, seq, 1) > 0.3).float()
                for got, want in zip(fn(x, mask), model(x, mask)):
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            try:
                fn(torch.randn(17, 8, 32), torch.ones(17, 8, 1))
            except RuntimeError as err:
                assert "GuardManager check failed" in str(err), err
            else:
                raise AssertionError("a batch outside [1, 16] was not stopped")
        print("ok")
    """, env=env)
    assert "ok" in out and not compiler_mark.exists()


class Branches(torch.nn.Module):
    def forward(self, x):
        return (x * 2 if x.shape[0] > 1 else x + 100).sin() + 1


def test_a_model_branching_on_a_dim_declared_from_1_refuses_size_1_by_its_guards(tmp_path):
    """min=1 on a dim the model branches on: the saved graph is the example's branch, and
    dynamo's guard on the branch refuses size 1 (an error, never the other branch's values)."""
    model, x = Branches().eval(), torch.randn(4, 8)
    torch._dynamo.mark_dynamic(x, 0, min=1, max=16)
    blade.precompile(model, (x,), str(tmp_path / "branches.aot"))
    fn = blade.load_precompiled(str(tmp_path / "branches.aot"), model)
    with torch.no_grad():
        x = torch.randn(3, 8)
        torch.testing.assert_close(fn(x)[0], model(x))
        with pytest.raises(RuntimeError, match="GuardManager check failed"):
            fn(torch.randn(1, 8))
