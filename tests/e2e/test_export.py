"""blade.export / blade.load: one archive, loaded in a fresh process that cannot compile; stamps."""
from __future__ import annotations

import hashlib
import importlib
import json
import zipfile

import pytest
import torch

import blade
from blade.aot import IncompatibleArtifact
from blade.export import METADATA_FILE, RECORDS_FILE, ExportError, read_stamps
from aot_testing import make_model_and_inputs, run_python, save_reference, serve_in_fresh_process, tripwire_compiler_env

ENGINE_CALL = 'prim::CallMethod[name="execute"]'


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The Block model exported once; its inputs and the exporting process's outputs beside it."""
    root = tmp_path_factory.mktemp("export")
    model, inputs = make_model_and_inputs()
    compiled = blade.export(model, inputs, str(root / "block.blade.pt"))
    save_reference(root, compiled.module, model, inputs)
    return root, compiled


def test_export_archive_is_stamped_and_has_engines(exported):
    root, compiled = exported
    assert ENGINE_CALL in str(compiled.module.graph)
    stamps = read_stamps(str(root / "block.blade.pt"))
    assert stamps["torch_version"] == torch.__version__
    assert stamps["abi_version"] == blade._C.abi_version()
    assert stamps["engines"] >= 1 and stamps["isa"] and all(blade._C.isa_supported(i) for i in stamps["isa"])
    assert not list(root.glob(".blade-export-*")), "the temp file of the atomic save is left behind"


def test_load_in_fresh_process_is_bit_exact_and_never_compiles(exported, tmp_path):
    root, _ = exported
    env, compiler_mark = tripwire_compiler_env(tmp_path)
    out = run_python(f"""
        import torch, blade
        io = torch.load({str(root / 'io.pt')!r})
        for load in (blade.load, torch.jit.load):
            m = load({str(root / 'block.blade.pt')!r})
            assert {ENGINE_CALL!r} in str(m.graph)
            with torch.no_grad():
                got = m(*io["inputs"])
            assert len(got) == len(io["outputs"])
            for g, want in zip(got, io["outputs"]):
                assert torch.equal(g, want), (g - want).abs().max()
        print("ok")
    """, env=env)
    assert "ok" in out
    assert not compiler_mark.exists(), f"a C++ compiler ran at load: {compiler_mark.read_text()}"


def _restamp(src, dst, **changes):
    """A copy of the archive at src whose blade_metadata.json has these fields changed, with its
    hash in blade_records.txt changed to match (as an archive stamped so at export would be)."""
    with zipfile.ZipFile(src) as zin:
        items = [(item, zin.read(item)) for item in zin.infolist()]
    (old,) = [data for item, data in items if item.filename.endswith(f"/extra/{METADATA_FILE}")]
    stamps = json.dumps({**json.loads(old), **changes}).encode()
    replaced = {f"/extra/{METADATA_FILE}": lambda data: stamps,
                f"/extra/{RECORDS_FILE}": lambda data: data.replace(hashlib.sha256(old).hexdigest().encode(),
                                                                    hashlib.sha256(stamps).hexdigest().encode())}
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for item, data in items:
            change = next((f for suffix, f in replaced.items() if item.filename.endswith(suffix)), None)
            zout.writestr(item, change(data) if change else data)
    return str(dst)


@pytest.mark.parametrize("changes, message", [
    ({"isa": ["x86-64-v9"]}, r"engines need ISA x86-64-v9, this CPU supports up to x86-64"),
    ({"torch_version": "1.13.1"}, r"saved with torch 1\.13\.1, this is torch " + torch.__version__.split("+")[0]),
    ({"abi_version": 999}, r"blade ABI 999"),
    ({"archive_format": 99}, r"archive format 99"),
])
def test_load_refuses_an_incompatible_archive_clearly(exported, tmp_path, changes, message):
    root, _ = exported
    path = _restamp(root / "block.blade.pt", tmp_path / "restamped.pt", **changes)
    with pytest.raises(IncompatibleArtifact, match=message):
        blade.load(path)


def test_missing_isa_only_warns_when_engines_carry_fallback(exported, tmp_path):
    """An archive exported with fallback may run where its engines cannot: the Engine runs the
    TorchScript subgraph. The stamp check must not stand in its way (version mismatches still do)."""
    root, _ = exported
    path = _restamp(root / "block.blade.pt", tmp_path / "fallback.pt", isa=["x86-64-v9"], fallback="fallback")
    with pytest.warns(UserWarning, match="x86-64-v9.*fall back"):
        m = blade.load(path)
    io = torch.load(root / "io.pt")
    with torch.no_grad():
        assert all(torch.equal(g, w) for g, w in zip(m(*io["inputs"]), io["outputs"]))
    wrong_torch = _restamp(path, tmp_path / "old_torch.pt", torch_version="1.13.1")
    with pytest.raises(IncompatibleArtifact, match="torch 1.13.1"):
        blade.load(wrong_torch)


def test_plain_torchscript_file_is_not_a_blade_archive(tmp_path):
    torch.jit.save(torch.jit.script(torch.nn.ReLU()), tmp_path / "relu.pt")
    with pytest.raises(ValueError, match="not a blade archive"):
        blade.load(str(tmp_path / "relu.pt"))


class _Breaks(torch.nn.Module):
    def forward(self, x):
        y = x.relu()
        print("side effect")  # a graph break: dynamo cannot trace print
        return y + 1


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "declared-dims"])
def test_export_names_the_graph_break(tmp_path, dynamic):
    shapes = {"x": {0: torch.export.Dim("n", min=2, max=64)}} if dynamic else None
    with pytest.raises(ExportError, match=r"(?s)one graph.*print.*test_export\.py"):
        blade.export(_Breaks(), (torch.randn(3),), str(tmp_path / "never.pt"), dynamic_shapes=shapes)
    assert not list(tmp_path.iterdir())


class _DictInput(torch.nn.Module):
    def forward(self, x, inputs, scale=None):
        return {"out": x * inputs["ids"].sum() + scale, "ids": inputs["ids"] + 1}


def test_a_capture_with_declared_dims_is_the_graph_a_static_one_is():
    """The capture with declared dims (torch.export's way, export._symbolic_capture) gives the graph
    interface the static one (torch._dynamo.export) does: inputs named after the model's arguments
    (the names blade's messages use), the flat outputs as a list, the same pytree structures."""
    from blade.guards import placeholder_names
    capture_graph = importlib.import_module("blade.export").capture_graph   # (blade.export is also the function)
    n = torch.export.Dim("n", min=2, max=64)
    args, kwargs = (torch.randn(5, 3), {"ids": torch.ones(5, 2, dtype=torch.int64)}), {"scale": torch.randn(3)}
    static = capture_graph(_DictInput(), args, kwargs)
    dynamic = capture_graph(_DictInput(), args, kwargs, {"x": {0: n}, "inputs": {"ids": {0: n}}, "scale": None})
    assert placeholder_names(dynamic) == placeholder_names(static) == ["l_x_", "l_inputs_ids_", "l_scale_"]
    assert static.meta["pytree_info"].in_spec == dynamic.meta["pytree_info"].in_spec
    assert static.meta["pytree_info"].out_spec == dynamic.meta["pytree_info"].out_spec
    for gm in (static, dynamic):
        assert isinstance(next(n for n in gm.graph.nodes if n.op == "output").args[0], list)
    for size in (2, 7):
        flat = [torch.randn(size, 3), torch.arange(2 * size).reshape(size, 2), kwargs["scale"]]
        for got, want in zip(dynamic(*flat), _DictInput()(flat[0], {"ids": flat[1]}, scale=flat[2]).values()):
            torch.testing.assert_close(got, want)


class _Nested(torch.nn.Module):
    """Nested inputs (a dict, a keyword argument, an int the graph is specialized to) and a dict
    of tuple outputs."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, parts, repeat, *, scale):
        h = torch.relu(self.proj(x)) * repeat
        return {"hidden": h, "pair": (torch.sigmoid(parts["a"] + 1.0), parts["b"] * scale)}


def test_loaded_archive_is_called_like_the_model(tmp_path):
    """blade.load's module takes the model's own (args, kwargs) and returns its output structure;
    a call with another structure, or another value of a specialized int, is refused clearly."""
    torch.manual_seed(0)
    model = _Nested().eval()
    args = (torch.randn(4, 8), {"a": torch.randn(3), "b": torch.randn(3)}, 3)
    kwargs = {"scale": torch.randn(3)}
    path = str(tmp_path / "nested.blade.pt")
    blade.export(model, args, path, kwargs=kwargs)
    loaded = blade.load(path)
    with torch.no_grad():
        got, want = loaded(*args, **kwargs), model(*args, **kwargs)
    assert isinstance(got, dict) and list(got) == ["hidden", "pair"] and isinstance(got["pair"], tuple)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(loaded.script(args[0], args[1]["a"], args[1]["b"], kwargs["scale"])) == 3  # flat for C++
    with pytest.raises(TypeError, match=r"exported for inputs structured as .*dict, \['scale'\]"):
        loaded(*args)
    with pytest.raises(ValueError, match=r"non-tensor input #3 = 3 .* this call passes 5"):
        loaded(args[0], args[1], 5, **kwargs)


class _FillsACache(torch.nn.Module):
    """A model that fills a cache and notes what it last saw while it runs (transformers' LeViT
    caches its attention biases per device in eval)."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.linspace(-1, 1, 8))
        self.cache, self.seen = {}, []

    def forward(self, x):
        if "cpu" not in self.cache:
            self.cache["cpu"] = self.bias.exp() * 2
        self.seen.append(x.shape[0])
        self.last_input = x
        return (x + self.cache["cpu"]).relu()


def test_export_leaves_the_model_as_it_was(tmp_path):
    """torch._dynamo.export leaves what the model wrote while traced holding its fake tensors (the
    cache filled with a FakeTensor, the attribute bound to one): after blade.export the user's
    model is as it was before, and its eager calls compute what they did (LeViT: 240 ms a call and a
    SymFloat for an answer after blade.export)."""
    model, x = _FillsACache().eval(), torch.randn(4, 8)
    path = str(tmp_path / "cache.blade.pt")
    blade.export(model, (x,), path)
    assert model.cache == {} and model.seen == [] and not hasattr(model, "last_input")
    with torch.no_grad():
        want = (x + model.bias.exp() * 2).relu()
        torch.testing.assert_close(model(x), want)
        assert type(model.cache["cpu"]) is torch.Tensor and model.seen == [4]
        torch.testing.assert_close(blade.load(path)(x), want)


def test_transformers_output_class_is_rebuilt_in_a_fresh_process(tmp_path):
    """A transformers model's ModelOutput comes back as that class in a process that never
    imported transformers itself (blade.load imports the class's module by its registered name)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids, mask = torch.randint(0, 100, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    path = str(tmp_path / "bert.blade.pt")
    blade.export(model, (ids,), path, kwargs={"attention_mask": mask})
    with torch.no_grad():
        want = model(ids, attention_mask=mask)
    torch.save({"ids": ids, "mask": mask, "hidden": want.last_hidden_state, "pooled": want.pooler_output},
               tmp_path / "io.pt")
    out = run_python(f"""
        import sys, torch, blade
        assert "transformers" not in sys.modules
        io = torch.load({str(tmp_path / 'io.pt')!r})
        with torch.no_grad():
            out = blade.load({path!r})(io["ids"], attention_mask=io["mask"])
        print(type(out).__name__)
        torch.testing.assert_close(out.last_hidden_state, io["hidden"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out["pooler_output"], io["pooled"], rtol=1e-4, atol=1e-4)
    """)
    assert out.strip() == "BaseModelOutputWithPoolingAndCrossAttentions"


def test_dynamic_shapes_export_serves_every_size_in_a_fresh_process(tmp_path):
    """blade.export(dynamic_shapes=...) with torch.export's Dims: one compile whose engines take
    batch (from 1) and sequence at run time; a fresh process without a C++ compiler serves sizes
    the export never saw, batch 1 included, and names the range of a size outside it."""
    from aot_testing import Block
    torch.manual_seed(0)
    model = Block().eval()
    x, mask = torch.randn(2, 8, 32), (torch.rand(2, 8, 1) > 0.3).float()
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=64)
    path = str(tmp_path / "dynamic.blade.pt")
    compiled = blade.export(model, (x, mask), path, dynamic_shapes={"x": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}})
    assert compiled.report.size_symbols and all(c.status == "compiled" for c in compiled.report.clusters)
    points = []
    for b, s in ((1, 5), (3, 64), (8, 2), (1, 2)):
        inputs = (torch.randn(b, s, 32), (torch.rand(b, s, 1) > 0.3).float())
        with torch.no_grad():
            points.append({"inputs": inputs, "expected": model(*inputs)})
    out = serve_in_fresh_process(tmp_path, path, points, """
        for p in points:
            got = m(*p["inputs"])
            for g, want in zip(got, p["expected"]):
                torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5)
        try:
            m(torch.randn(9, 4, 32), torch.ones(9, 4, 1))
        except RuntimeError as err:
            print("refused:", str(err).splitlines()[-1])
    """)
    assert "refused:" in out and "9" in out and "8" in out, out


def test_positional_tensor_calls_pick_the_same_inputs_and_refuse_the_same_calls():
    """A signature of positional tensors takes a shortcut past pytree for calls of plain tensors:
    it picks the inputs pytree would, and every other call (a keyword, a Parameter, another count,
    a non-tensor) still gets pytree's answer or refusal."""
    from blade.signature import Signature
    import torch.utils._pytree as pytree
    a, b, c = torch.randn(2), torch.randn(3), torch.randn(4)
    _, in_spec = pytree.tree_flatten(((a, b, c), {}))
    signature = Signature.of(in_spec, None, [a, b, c], [2, 0])  # b unused by the graph
    assert signature._positional == 3
    picked = signature.flat_inputs((a, b, c), {}, "m")
    assert len(picked) == 2 and picked[0] is c and picked[1] is a
    p = torch.nn.Parameter(torch.randn(2))
    picked = signature.flat_inputs((p, b, c), {}, "m")
    assert picked[1] is p
    for args, kwargs in (((a, b), {}), ((a, b, c, c), {}), ((a, b), {"c": c}), ((a, (b,), c), {})):
        with pytest.raises(TypeError, match="exported for inputs structured as"):
            signature.flat_inputs(args, kwargs, "m")
    # a specialized non-tensor input keeps the pytree path and its check
    _, spec_with_int = pytree.tree_flatten(((a, 3), {}))
    with_int = Signature.of(spec_with_int, None, [a, 3], [0])
    assert with_int._positional is None
    assert with_int.flat_inputs((a, 3), {}, "m")[0] is a
    with pytest.raises(ValueError, match="non-tensor input #1 = 3"):
        with_int.flat_inputs((a, 4), {}, "m")
    with pytest.raises(ValueError, match="non-tensor input #1 = 3"):
        with_int.flat_inputs((a, b), {}, "m")
