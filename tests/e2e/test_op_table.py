"""One line per op and variant: tt_infer vs eager on a graph of that op (min_cluster_size=1)."""
import pytest
import torch
import torch.nn.functional as F

from blade_testing import compile_and_check


def f32(*shape):
    return lambda: torch.randn(shape)


def pos(*shape):
    return lambda: torch.rand(shape) + 0.1


def i64(*shape, high=10):
    return lambda: torch.randint(-high, high, shape)


def boolean(*shape):
    return lambda: torch.rand(shape) > 0.5


W = torch.randn(32, 16)   # weights shared by the linear-algebra cases
B = torch.randn(32)

CASES = {
    # arithmetic: tensor/scalar, broadcasting, alpha, type promotion
    "add": (lambda x, y: x + y, [f32(4, 8), f32(8)]),
    "add_alpha": (lambda x, y: torch.add(x, y, alpha=2.5), [f32(4, 8), f32(4, 8)]),
    "add_scalar": (lambda x: x + 3, [f32(4, 8)]),
    "add_int_float_promote": (lambda x, y: x + y, [i64(4, 8), f32(4, 8)]),
    "sub_broadcast": (lambda x, y: x - y, [f32(4, 1, 8), f32(3, 1)]),
    "rsub": (lambda x: 1.0 - x, [f32(5, 7)]),
    "mul_scalar": (lambda x: x * 0.5, [f32(5, 7)]),
    "mul_int": (lambda x, y: x * y, [i64(6), i64(6)]),
    "div": (lambda x, y: x / y, [f32(4, 8), pos(4, 8)]),
    "div_int_true": (lambda x: x / 4, [i64(4, 8)]),
    "div_floor": (lambda x, y: torch.div(x, y, rounding_mode="floor"), [f32(4, 8), pos(4, 8)]),
    "div_trunc_int": (lambda x: torch.div(x, 3, rounding_mode="trunc"), [i64(4, 8)]),
    "neg": (lambda x: -x, [f32(3, 5)]),
    "abs": (lambda x: x.abs(), [f32(3, 5)]),
    "relu": (F.relu, [f32(3, 5)]),
    "gelu": (F.gelu, [f32(4, 33)]),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), [f32(4, 33)]),
    "sigmoid": (torch.sigmoid, [f32(4, 33)]),
    "tanh": (torch.tanh, [f32(4, 33)]),
    "exp": (torch.exp, [f32(4, 33)]),
    "log": (torch.log, [pos(4, 33)]),
    "sqrt": (torch.sqrt, [pos(4, 33)]),
    "rsqrt": (torch.rsqrt, [pos(4, 33)]),
    "pow_scalar": (lambda x: x ** 3, [f32(4, 9)]),
    "pow_square": (lambda x: x.pow(2), [f32(4, 9)]),
    "pow_tensor": (lambda x, y: torch.pow(x, y), [pos(4, 9), f32(9)]),
    "erf": (torch.erf, [f32(4, 33)]),
    "silu": (F.silu, [f32(4, 33)]),
    "clamp": (lambda x: x.clamp(-0.5, 0.7), [f32(4, 9)]),
    "clamp_min": (lambda x: x.clamp(min=0.1), [f32(4, 9)]),
    "clamp_int": (lambda x: x.clamp(max=3), [i64(4, 9)]),
    # selection and comparison
    "where": (lambda c, x, y: torch.where(c, x, y), [boolean(4, 8), f32(4, 8), f32(8)]),
    "where_scalar": (lambda x: torch.where(x > 0, x, 0.0), [f32(4, 8)]),
    "masked_fill": (lambda x, m: x.masked_fill(m, -1e9), [f32(2, 4, 8), boolean(2, 1, 8)]),
    "eq_int": (lambda x, y: x == y, [i64(4, 8, high=3), i64(4, 8, high=3)]),
    "ne_scalar": (lambda x: x != 0, [i64(4, 8, high=2)]),
    "lt_mixed": (lambda x, y: x < y, [i64(4, 8), f32(4, 8)]),
    "ge": (lambda x, y: x >= y, [f32(4, 8), f32(1, 8)]),
    "logical_and": (lambda a, b: a & b, [boolean(4, 8), boolean(4, 8)]),
    "logical_not": (lambda a: ~a, [boolean(4, 8)]),
    # casts
    "to_float": (lambda x: x.to(torch.float32) * 2, [i64(4, 8)]),
    "to_long": (lambda x: x.long() + 1, [f32(4, 8)]),
    "to_bool": (lambda x: x.bool() & (x > 0), [i64(4, 8)]),
    # reductions and normalizations
    "sum_all": (lambda x: x.sum(), [f32(4, 8, 5)]),
    "sum_dims_keepdim": (lambda x: x.sum(dim=(0, 2), keepdim=True), [f32(4, 8, 5)]),
    "sum_int": (lambda x: x.sum(-1), [i64(4, 8)]),
    "mean_neg_dim": (lambda x: x.mean(-1), [f32(4, 8, 5)]),
    "amax": (lambda x: x.amax(dim=1), [f32(4, 8, 5)]),
    "softmax": (lambda x: torch.softmax(x, -1), [f32(4, 33)]),
    "softmax_dim0": (lambda x: torch.softmax(x, 0), [f32(4, 33)]),
    "log_softmax": (lambda x: F.log_softmax(x, dim=1), [f32(4, 33)]),
    "layer_norm": (lambda x: F.layer_norm(x, (16,), W[0, :16], B[:16]), [f32(3, 5, 16)]),
    "layer_norm_2d_noaffine": (lambda x: F.layer_norm(x, (5, 16)), [f32(3, 5, 16)]),
    # linear algebra
    "linear": (lambda x: F.linear(x, W, B), [f32(3, 7, 16)]),
    "linear_nobias": (lambda x: F.linear(x, W), [f32(7, 16)]),
    "matmul_2d": (lambda x, y: x @ y, [f32(7, 16), f32(16, 9)]),
    "matmul_batched_broadcast": (lambda x, y: x @ y, [f32(2, 3, 7, 16), f32(16, 9)]),
    "matmul_vec": (lambda x, y: x @ y, [f32(7, 16), f32(16)]),
    "bmm_transposed": (lambda x, y: torch.bmm(x, y.transpose(1, 2)), [f32(3, 7, 16), f32(3, 9, 16)]),
    "addmm": (lambda b, x, y: torch.addmm(b, x, y), [f32(9), f32(7, 16), f32(16, 9)]),
    "addmm_scaled": (lambda b, x, y: torch.addmm(b, x, y, beta=0.5, alpha=2.0), [f32(7, 9), f32(7, 16), f32(16, 9)]),
    "baddbmm": (lambda b, x, y: torch.baddbmm(b, x, y), [f32(3, 7, 9), f32(3, 7, 16), f32(3, 16, 9)]),
    "sdpa_causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    [f32(1, 2, 8, 16), f32(1, 2, 8, 16), f32(1, 2, 8, 16)]),
    "sdpa_bool_mask": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                       [f32(1, 2, 8, 16), f32(1, 2, 8, 16), f32(1, 2, 8, 16), lambda: torch.tril(torch.ones(8, 8, dtype=torch.bool))]),
    # shapes and data movement
    "view": (lambda x: (x * 2).view(4, -1), [f32(4, 3, 5)]),
    "reshape_transposed": (lambda x: x.transpose(0, 1).reshape(-1) + 1, [f32(4, 3)]),
    "flatten": (lambda x: torch.flatten(x + 1, 1), [f32(2, 3, 4)]),
    "permute": (lambda x: x.permute(2, 0, 1) * 2, [f32(2, 3, 4)]),
    "transpose_neg": (lambda x: x.transpose(-1, -2) + 1, [f32(2, 3, 4)]),
    "t": (lambda x: x.t() * 3, [f32(3, 4)]),
    "unsqueeze_squeeze": (lambda x: (x.unsqueeze(1) + 1).squeeze(1), [f32(3, 4)]),
    "squeeze_all": (lambda x: (x + 1).squeeze(), [f32(3, 1, 4, 1)]),
    "expand": (lambda x: x.expand(3, 4, 5) + 0, [f32(4, 1)]),
    "contiguous": (lambda x: x.transpose(0, 1).contiguous() * 2, [f32(3, 4)]),
    "slice": (lambda x: x[:, 1:7:2] * 2, [f32(3, 9)]),
    "slice_neg": (lambda x: x[..., -3:] + 1, [f32(3, 9)]),
    "select": (lambda x: x[:, 2] * 2, [f32(3, 9)]),
    "narrow": (lambda x: x.narrow(1, 2, 4) * 2, [f32(3, 9)]),
    "cat": (lambda x, y: torch.cat([x * 2, y], dim=1), [f32(3, 4), f32(3, 5)]),
    "split": (lambda x: [t * 2 for t in x.split(3, dim=1)], [f32(2, 8)]),
    "chunk": (lambda x: [t + 1 for t in x.chunk(3, dim=-1)], [f32(2, 7)]),
    "embedding": (lambda ids: F.embedding(ids, W) * 2, [lambda: torch.randint(0, 32, (2, 5))]),
    "dropout_eval": (lambda x: F.dropout(x, 0.5, training=False) * 2, [f32(4, 8)]),
    "zero_size_dim": (lambda x: (x * 2).sum(0), [f32(0, 8)]),
    "scalar_tensor": (lambda x, y: x * y + 1, [f32(), f32(4)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op(name):
    fn, makers = CASES[name]
    torch.manual_seed(0)
    compile_and_check(fn, [make() for make in makers], min_cluster_size=1)
