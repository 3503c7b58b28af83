"""Partitioning: convex clusters (no cycles), min size, exclusions, big graphs, parallel compiles."""
import time

import torch
import torch.fx

from blade.cluster.partition import partition
from blade.frontend import to_torchscript
from blade_testing import Capture, assert_close


def typed_graph(fn, *inputs):
    return to_torchscript(torch.fx.symbolic_trace(fn), list(inputs))


def _users(node):
    return [use.user for value in node.outputs() for use in value.uses()]


def assert_convex(parts):
    """No path leaves a cluster and comes back into it: walk forward from everything just
    outside each cluster and never reach the cluster again."""
    for cluster in parts.clusters:
        members = set(cluster.nodes)
        frontier = [u for n in cluster.nodes for u in _users(n) if u not in members]
        seen = set(frontier)
        while frontier:
            node = frontier.pop()
            assert node not in members, f"cluster {cluster.index} is not convex (re-entered at {node.kind()})"
            for user in _users(node):
                if user not in seen:
                    seen.add(user)
                    frontier.append(user)


# cumprod is excluded by config in these tests: a deterministic "unsupported" node
BARRIER = ("aten::cumprod",)


def diamond(x):
    a = x * 2              # supported
    u = torch.cumprod(a, 0)  # excluded: stays in TorchScript, between a and b
    b = u + 1
    c = a.relu()
    return b * c


def test_no_cycle_through_an_unsupported_node():
    front = typed_graph(diamond, torch.randn(4, 5))
    parts = partition(front.graph, min_cluster_size=1, excluded_ops=BARRIER)
    assert_convex(parts)
    assert len(parts.clusters) == 2  # {mul, relu} and {add, mul}: merging all would form a cycle
    kinds = [sorted(n.kind() for n in c.nodes) for c in parts.clusters]
    assert ["aten::mul", "aten::relu"] in kinds and ["aten::add", "aten::mul"] in kinds


def test_cycle_free_result_runs():
    capture = Capture(min_cluster_size=1, excluded_ops=BARRIER)
    x = torch.randn(4, 5)
    with torch.no_grad():
        assert_close(torch.compile(diamond, backend=capture)(x), diamond(x))
    assert capture.engine_calls() == 2


def test_min_cluster_size_and_reasons():
    front = typed_graph(diamond, torch.randn(4, 5))
    parts = partition(front.graph, min_cluster_size=3, excluded_ops=BARRIER)
    assert parts.clusters == []
    reasons = {n.kind(): r for n, r in parts.reasons.items()}
    assert "below min_cluster_size=3" in reasons["aten::relu"]
    assert reasons["aten::cumprod"] == "excluded by config (excluded_ops)"


def long_chain(x):
    for i in range(1500):
        x = x * 1.0001 + 0.5 if i % 50 else torch.cumprod(x, 0)
    return x


def test_thousands_of_nodes():
    front = typed_graph(long_chain, torch.randn(3, 4))
    started = time.perf_counter()
    parts = partition(front.graph, min_cluster_size=2, excluded_ops=BARRIER)
    elapsed = time.perf_counter() - started
    print(f"\npartitioned {len(parts.ops)} ops into {len(parts.clusters)} clusters in {elapsed:.2f}s")
    assert len(parts.ops) > 2900
    assert len(parts.clusters) == 30  # the runs between the 30 cumprods
    assert all(c.op_count == 98 for c in parts.clusters[1:])
    assert_convex(parts)


def two_clusters(x):
    y = torch.tanh(x @ x.t()) * 2 + 1
    y = torch.cumprod(y, 1)  # splits the graph
    return torch.sigmoid(y @ y) - 0.5


def test_clusters_compile_concurrently():
    capture = Capture(compile_parallelism=2, use_cache=False, min_cluster_size=1, excluded_ops=BARRIER)
    x = torch.randn(16, 16)
    with torch.no_grad():
        assert_close(torch.compile(two_clusters, backend=capture)(x), two_clusters(x))
    report = capture.report
    assert [c.status for c in report.clusters] == ["compiled", "compiled"]
    first, second = report.clusters
    for c in report.clusters:
        print(f"\n{c.name}: {c.seconds:.2f}s")
    print(f"compile wall time {report.compile_wall_s:.2f}s")
    assert first.started < second.finished and second.started < first.finished  # the jobs overlapped
