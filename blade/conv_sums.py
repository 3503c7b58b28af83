"""Sums of convolutions over one input become one convolution (a frozen graph's rewrite).

Re-parameterizable blocks (RepVGG, ACNet, FAST's TextNet, MobileOne) compute a 3x3, a 3x1 and a
1x3 convolution of the same input, each batch-normed, plus a batch norm of the input itself, and
add them up. With the weights frozen that sum is one convolution: each term's kernel placed in the
widest term's window (zero taps elsewhere), the identity as the centre tap of each channel, the
biases added. One 3x3 convolution then reads the input once where four passes read it four times
(TextNet's 64-channel stage at 112x112: 3x3 3.1 ms, 3x1 1.5, 1x3 1.3, then the sums). The result
differs from the separate terms by rounding only, as torch's own conv/batch-norm fold does; the
merged kernel's zero taps lie in the widest term's window, which that term reads too, so outputs
are non-finite where the terms' sum is (an infinity there may come out NaN: 0 * inf)."""
import torch

CONVOLUTIONS = ("aten::conv1d", "aten::conv2d", "aten::conv3d")


class _Term:
    """One addend as a convolution of `x`: its weight [out, in / groups, *kernel] and bias (or
    None), with its stride, padding, dilation and groups; `node` computes it."""

    def __init__(self, node, x, weight, bias, stride, padding, dilation, groups):
        self.node, self.x, self.weight, self.bias = node, x, weight, bias
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups

    def reach(self, dim: int) -> int:
        """2 * pad - dilation * (kernel - 1): terms with the same reach in every dim (and stride)
        write the same output extent at any input size, their windows centred alike."""
        return 2 * self.padding[dim] - self.dilation[dim] * (self.weight.shape[2 + dim] - 1)


def merge_conv_sums(graph: torch.Graph) -> int:
    """Rewrites each `aten::add(a, b)` (alpha 1) whose addends are convolutions of one input with
    constant weights (or an inference batch norm of that input), each read by the add alone, into
    one convolution; a chain of adds merges term by term. Returns how many adds it merged."""
    merged = 0
    for add in [node for node in graph.nodes() if node.kind() == "aten::add"]:
        if len(list(add.inputs())) != 3:
            continue  # aten::add(int, int), size arithmetic
        a, b, alpha = add.inputs()
        if _constant(alpha) != 1:
            continue
        terms = [_conv_term(a), _conv_term(b)]
        if terms.count(None) == 1:   # a convolution beside an input's batch norm
            missing = terms.index(None)
            terms[missing] = _identity_term((a, b)[missing])
        if None in terms or terms[0].x.unique() != terms[1].x.unique():
            continue
        terms = _as_convolutions(terms)
        if terms is not None and _merge(graph, add, terms):
            merged += 1
    return merged


def _conv_term(value: torch.Value):
    node = value.node()
    if node.kind() not in CONVOLUTIONS or len(value.uses()) != 1:
        return None
    x, weight, bias, stride, padding, dilation, groups = node.inputs()
    w, b = _constant(weight), _constant(bias)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or (b is not None and not isinstance(b, torch.Tensor)):
        return None
    stride, padding, dilation, groups = (v.toIValue() for v in (stride, padding, dilation, groups))
    spatial = w.dim() - 2
    if not isinstance(groups, int) or not all(isinstance(v, list) and len(v) == spatial for v in (stride, padding, dilation)):
        return None  # padding="same"/"valid" (a string) or an unexpanded single value: left alone
    return _Term(node, x, w, b, stride, padding, dilation, groups)


def _identity_term(value: torch.Value):
    """An inference batch norm of x with constant statistics, as a term whose weight is still to
    be made (_as_convolutions: its shape follows the convolution it is added to)."""
    node = value.node()
    if node.kind() != "aten::batch_norm" or len(value.uses()) != 1:
        return None
    x, weight, bias, mean, var, training, _, eps, _ = node.inputs()
    stats = [_constant(v) for v in (weight, bias, mean, var)]
    if _constant(training) is not False or not isinstance(_constant(eps), float) or \
            not all(s is None or isinstance(s, torch.Tensor) for s in stats) or stats[2] is None or stats[3] is None:
        return None
    w, b, mean, var = stats
    scale = torch.rsqrt(var.double() + _constant(eps)) * (w.double() if w is not None else 1)
    shift = (b.double() if b is not None else 0) - mean.double() * scale
    return _Term(node, x, (scale, shift), None, None, None, None, None)


def _as_convolutions(terms: list):
    """The terms, a batch norm among them turned into the 1x1 convolution it is (per channel, of
    the other term's groups); None when it cannot be (the convolution changes the channel count
    or strides)."""
    conv = next(t for t in terms if t.node.kind() in CONVOLUTIONS)
    result = []
    for term in terms:
        if term.node.kind() in CONVOLUTIONS:
            result.append(term)
            continue
        scale, shift = term.weight
        out_channels, per_group = conv.weight.shape[:2]
        if any(s != 1 for s in conv.stride) or out_channels != scale.numel() or out_channels != per_group * conv.groups:
            return None
        spatial = conv.weight.dim() - 2
        weight = torch.zeros(out_channels, per_group, *([1] * spatial), dtype=torch.float64)
        channels = torch.arange(out_channels)
        weight[channels, channels % per_group] = scale.reshape(-1, *([1] * spatial))
        result.append(_Term(term.node, term.x, weight.to(conv.weight.dtype), shift.to(conv.weight.dtype),
                            list(conv.stride), [0] * spatial, list(conv.dilation), conv.groups))
    return result


def _merge(graph: torch.Graph, add: torch.Node, terms: list) -> bool:
    first, second = terms
    spatial = first.weight.dim() - 2
    if (first.stride != second.stride or first.groups != second.groups or first.weight.dtype != second.weight.dtype
            or first.weight.shape[:2] != second.weight.shape[:2]
            or any(first.reach(d) != second.reach(d) for d in range(spatial))):
        return False
    # the dilation of a 1-tap dim never matters (an identity's); otherwise they must agree
    dilation = [max(first.dilation[d], second.dilation[d]) for d in range(spatial)]
    padding = [max(first.padding[d], second.padding[d]) for d in range(spatial)]
    offsets = []
    for term in terms:
        offset = []
        for d in range(spatial):
            taps, gap = term.weight.shape[2 + d], padding[d] - term.padding[d]
            if (taps > 1 and term.dilation[d] != dilation[d]) or gap % dilation[d]:
                return False
            offset.append(gap // dilation[d])
        offsets.append(offset)
    kernel = [(2 * padding[d] - first.reach(d)) // dilation[d] + 1 for d in range(spatial)]
    weight = torch.zeros(*first.weight.shape[:2], *kernel, dtype=torch.float64)
    for term, offset in zip(terms, offsets):
        window = tuple(slice(o, o + n) for o, n in zip(offset, term.weight.shape[2:]))
        weight[(slice(None), slice(None)) + window] += term.weight.double()
    biases = [t.bias.double() for t in terms if t.bias is not None]
    bias = sum(biases).to(first.weight.dtype) if biases else None
    with graph.insert_point_guard(add):
        conv = graph.create(CONVOLUTIONS[spatial - 1], [
            first.x, graph.insertConstant(weight.to(first.weight.dtype)), graph.insertConstant(bias),
            graph.insertConstant(first.stride), graph.insertConstant(padding), graph.insertConstant(dilation),
            graph.insertConstant(first.groups)])
        conv.insertBefore(add)
    conv.output().setType(add.output().type())
    add.output().replaceAllUsesWith(conv.output())
    add.destroy()
    for term in terms:
        term.node.destroy()
    return True


_NOT_CONSTANT = object()


def _constant(value: torch.Value):
    """A prim::Constant's value (None for a None constant), else _NOT_CONSTANT."""
    return value.toIValue() if value.node().kind() == "prim::Constant" else _NOT_CONSTANT
