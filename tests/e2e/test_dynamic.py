"""A graph dynamo makes dynamic after a shape change still runs on static engines."""
import torch

from blade.dynamo import tt_infer
from blade.specialize import ShapeSpecialized
from blade_testing import assert_close


def test_new_shapes_get_their_own_engines():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
    produced = []

    def backend(gm, example_inputs):
        produced.append(tt_infer(gm, example_inputs))
        return produced[-1]

    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for batch in (2, 3, 5, 3):  # the second shape makes dynamo recompile with a symbolic size
            x = torch.randn(batch, 16)
            assert_close(compiled(x), model(x))
    dynamic = [p for p in produced if isinstance(p, ShapeSpecialized)]
    assert len(dynamic) == 1 and len(dynamic[0].variants) == 2  # batch 3 and 5, each compiled once
    for variant in dynamic[0].variants.values():
        assert 'prim::CallMethod[name="execute"]' in str(variant.module.graph)
