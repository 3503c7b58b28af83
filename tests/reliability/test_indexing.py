"""Indexing ops in engines read negative and out-of-range indices as eager does: wrap where eager
wraps, fail the call where eager raises (with an error of eager's type that names the op)."""

import pytest
import torch
import torch.nn.functional as F

import blade  # noqa: F401  (registers tt_infer)
from blade.dynamo import tt_infer
from blade.pipeline import CompiledModule

TABLE = torch.randn(10, 6)

# name -> (fn(index) computing the op on TABLE (plus an op so the cluster has some work),
#          a valid index, the op's extent along the indexed dim, aten kind named in the error)
OPS = {
    "embedding": (lambda i: F.embedding(i, TABLE) * 2, torch.tensor([[1, 9], [0, 3]]), 10, "aten::embedding"),
    "index_select": (lambda i: TABLE.index_select(1, i) * 2, torch.tensor([5, 0, 2]), 6, "aten::index_select"),
    "gather": (lambda i: torch.gather(TABLE, 1, i) * 2, torch.randint(0, 6, (10, 3)), 6, "aten::gather"),
    "gather_dim0": (lambda i: torch.gather(TABLE, 0, i) + 1, torch.randint(0, 10, (2, 6)), 10, "aten::gather"),
    "index": (lambda i: TABLE[i] * 2, torch.tensor([0, 9, 4]), 10, "aten::index"),
    # two index tensors: a bad column index must not land on a valid element of the flattened rows
    "index_2d": (lambda i: TABLE[i, i.flip(0)] * 2, torch.tensor([1, 2, 3]), 6, "aten::index"),
}

# which bad index, put in place of the first element of the valid index
BAD = {"negative": lambda n: -1, "high": lambda n: n, "low": lambda n: -n - 1}


class Capture:
    def __init__(self):
        self.compiled = []

    def __call__(self, gm, example_inputs):
        result = tt_infer(gm, example_inputs, options={"min_cluster_size": 1})
        assert isinstance(result, CompiledModule)
        self.compiled.append(result)
        return result



def _compiled(fn, valid):
    """fn compiled by tt_infer for the valid index, its engines checked to really run."""
    capture = Capture()
    compiled = torch.compile(fn, backend=capture, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(valid), fn(valid))
    graph = "\n".join(str(c.module.graph) for c in capture.compiled)
    assert 'prim::CallMethod[name="execute"]' in graph
    return compiled, capture


def _eager(fn, index):
    try:
        return fn(index), None
    except (IndexError, RuntimeError) as err:
        return None, err


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("op", sorted(OPS))
def test_bad_index_like_eager(op, bad):
    fn, valid, extent, kind = OPS[op]
    compiled, capture = _compiled(fn, valid)
    index = valid.clone()
    index.view(-1)[0] = BAD[bad](extent)
    expected, eager_error = _eager(fn, index)
    with torch.no_grad():
        if eager_error is None:
            torch.testing.assert_close(compiled(index), expected)
        else:
            with pytest.raises(type(eager_error), match=f"index is out of range(.|\n)*{kind}"):
                compiled(index)
    assert len(capture.compiled) == 1, "the bad index must reach the engine compiled for the valid one"

