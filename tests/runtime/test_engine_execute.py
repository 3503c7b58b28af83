"""Engine.execute: results against torch, the checks at the engine's door, errors from the engine,
and concurrent calls on one engine."""
import pytest
import torch

from runtime_testing import run_in_threads


def add_reference(x, y, bias):
    return [x + y + bias, x * y]


def test_execute_matches_torch(add_engine, add_bias):
    x, y = torch.randn(64, 128), torch.randn(64, 128)
    outputs = add_engine.execute([x, y])
    assert len(outputs) == 2
    for got, want in zip(outputs, add_reference(x, y, add_bias)):
        torch.testing.assert_close(got, want)


def test_outputs_are_fresh_tensors_owned_by_torch(add_engine):
    x, y = torch.randn(64, 128), torch.randn(64, 128)
    first, second = add_engine.execute([x, y]), add_engine.execute([x, y])
    assert first[0].data_ptr() != second[0].data_ptr()
    first[0].add_(1)  # writable, and independent of the next call's outputs
    torch.testing.assert_close(first[0] - 1, second[0])


def test_execute_with_sgemm_and_shared_weight(matmul_engine):
    engine, weight = matmul_engine
    x = torch.randn(2, 8, 16)
    (out,) = engine.execute([x])
    torch.testing.assert_close(out, x @ weight)


def test_non_contiguous_inputs_are_accepted(add_engine, add_bias):
    x = torch.randn(128, 64).t()          # transposed view
    y = torch.randn(64, 256)[:, ::2]      # strided view
    assert not x.is_contiguous() and not y.is_contiguous()
    for got, want in zip(add_engine.execute([x, y]), add_reference(x, y, add_bias)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "inputs, expected_parts",
    [
        ([torch.randn(64, 128)], ["expected 2 inputs, got 1"]),
        ([torch.randn(64, 128)] * 3, ["expected 2 inputs, got 3"]),
        ([torch.randn(64, 128), torch.ones(64, 128, dtype=torch.int64)],
         ["input 1 ('y')", "expected float32[64, 128] on cpu", "got int64[64, 128] on cpu"]),
        ([torch.randn(64, 127), torch.randn(64, 128)],
         ["input 0 ('x')", "expected float32[64, 128] on cpu", "got float32[64, 127] on cpu"]),
        ([torch.randn(64, 128), torch.randn(1, 64, 128)],
         ["input 1 ('y')", "got float32[1, 64, 128] on cpu"]),
        ([torch.randn(64, 128, dtype=torch.float64), torch.randn(64, 128)],
         ["input 0 ('x')", "got float64[64, 128] on cpu"]),
        ([torch.randn(64, 128), torch.empty(64, 128, device="meta")],
         ["input 1 ('y')", "got float32[64, 128] on meta"]),
        ([torch.randn(64, 128).to_sparse(), torch.randn(64, 128)],
         ["input 0 ('x')", "layout Sparse"]),
    ],
    ids=["too-few", "too-many", "dtype", "shape", "rank", "float64", "device", "layout"],
)
def test_input_mismatch_names_engine_input_and_both_sides(add_engine, inputs, expected_parts):
    with pytest.raises(RuntimeError) as error:
        add_engine.execute(inputs)
    message = str(error.value)
    assert "blade engine 'cluster_add'" in message
    for part in expected_parts:
        assert part in message


def test_engine_error_code_becomes_clear_runtime_error(embedding_engine):
    engine, table = embedding_engine
    ids = torch.tensor([0, 9, 3, 3])
    (out,) = engine.execute([ids])
    torch.testing.assert_close(out, table[ids])
    with pytest.raises(RuntimeError, match=r"blade engine 'cluster_embedding'.*index out of range in a gather/embedding"):
        engine.execute([torch.tensor([0, 10, 3, 3])])


def test_concurrent_execute_on_one_engine(add_engine, add_bias):
    """Servers call one module from several threads: every call needs its own scratch and outputs."""
    failures = []

    def worker(seed):
        generator = torch.Generator().manual_seed(seed)
        for _ in range(50):
            x = torch.randn(64, 128, generator=generator)
            y = torch.randn(64, 128, generator=generator)
            got = add_engine.execute([x, y])
            for g, w in zip(got, add_reference(x, y, add_bias)):
                if not torch.allclose(g, w):
                    failures.append(seed)
                    return

    run_in_threads(worker)
    assert failures == []


def test_name_and_info(add_engine):
    assert add_engine.name() == "cluster_add"
    assert add_engine.info() == '{"source": "engines/add.cpp"}'
