"""The runtime's answer to an oversubscribed machine (cpp/oversubscription.h): a parallel region
whose threads waited milliseconds for one without a core switches engine calls to the calling
thread for a while, and results are the same either way."""
import contextlib

import pytest
import torch

import blade
import blade._C as _C
from runtime_testing import PANELS_USABLE, torch_threads

_testing = _C._testing


@contextlib.contextmanager
def serial_for(ms: int):
    _testing.force_serial_for(ms)
    try:
        yield
    finally:
        _testing.force_serial_for(0)


def two_threads():
    return torch_threads(2)


def test_long_waits_after_short_work_are_stalls_and_two_start_a_serial_window():
    with serial_for(0):
        stalls = _C.thread_stalls()
        assert not _testing.note_region(worked_ns=50_000, waited_ns=80_000)      # a worker waking up
        assert not _testing.note_region(worked_ns=2_000_000, waited_ns=3_000_000)  # uneven chunks
        assert not _testing.serial_now() and _C.thread_stalls() == stalls
        assert _testing.note_region(worked_ns=100_000, waited_ns=4_000_000)    # no core for a slice
        assert not _testing.serial_now() and _C.thread_stalls() == stalls + 1  # once may be a passing job
        assert _testing.note_region(worked_ns=100_000, waited_ns=4_000_000)    # again soon after: lasting
        assert _testing.serial_now() and _C.thread_stalls() == stalls + 2
    assert not _testing.serial_now()


def test_a_hosts_short_stalls_now_and_then_start_no_serial_window():
    """A VM's host took a core for 1.3-5.4 ms about 4 times a second on a quiet machine, sometimes
    14 ms apart: under 1% of the time, so serial mode (twice a parallel call's time) must not start
    (it did at the second stall within 100 ms).
    Stalls that keep coming and wait much of the time still start it."""
    import time
    with serial_for(0):
        for _ in range(4):
            time.sleep(0.017)   # 14 ms of calm, then a region that waited 3 ms: 18% of the time stalled
            assert _testing.note_region(worked_ns=200_000, waited_ns=3_000_000)
            assert not _testing.serial_now()
        for _ in range(2):  # then back to back: no core to be had
            assert _testing.note_region(worked_ns=200_000, waited_ns=4_000_000)
        assert _testing.serial_now()
    assert not _testing.serial_now()


def test_stalls_longer_than_the_confirm_window_confirm_each_other():
    """Calls of 430 ms each at load ~3 counted one stall and never went serial: each stall ended more
    than 100 ms after the previous one, because the waiting itself took that long. The calm between
    them (previous stall's end to this region's start) is what counts."""
    import time
    with serial_for(0):
        assert _testing.note_region(worked_ns=100_000, waited_ns=200_000_000)
        time.sleep(0.15)  # the next region started before the previous stall ended, and waited 200 ms
        assert _testing.note_region(worked_ns=100_000, waited_ns=200_000_000)
        assert _testing.serial_now()
        _testing.force_serial_for(0)
        assert _testing.note_region(worked_ns=100_000, waited_ns=4_000_000)
        time.sleep(0.15)  # a stall after 150 ms of calm: a passing job, not a lasting load
        assert _testing.note_region(worked_ns=100_000, waited_ns=4_000_000)
        assert not _testing.serial_now()
    assert not _testing.serial_now()


def test_serial_mode_runs_the_runtime_loops_inline_and_ends():
    with two_threads():
        with serial_for(10_000):
            assert _testing.parallel_for_chunks(0, 100, 10) == [(0, 100)]
        # (a real stall, on a loaded machine, could start serial mode again: end it before looking)
        _testing.force_serial_for(0)
        assert len(_testing.parallel_for_chunks(0, 100, 10)) > 1


def test_serial_mode_restores_the_callers_thread_counts(add_engine):
    with two_threads(), serial_for(10_000):
        add_engine.execute([torch.randn(64, 128), torch.randn(64, 128)])
        assert torch.get_num_threads() == 2


def test_engines_compute_the_same_serially(add_engine, add_bias, matmul_engine):
    x, y = torch.randn(64, 128), torch.randn(64, 128)
    engine, weight = matmul_engine
    a = torch.randn(2, 8, 16)
    with two_threads():
        parallel = add_engine.execute([x, y]) + engine.execute([a])
        with serial_for(10_000):
            serial = add_engine.execute([x, y]) + engine.execute([a])
    for got, want in zip(serial, parallel):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(serial[2], a @ weight)


class ConvMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 32, 3, padding=1)
        self.depthwise = torch.nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.fc = torch.nn.Linear(32, 64)

    def forward(self, x):
        y = torch.relu(self.depthwise(torch.relu(self.conv(x))))
        return self.fc(y.mean(dim=(2, 3))).softmax(-1)


def test_a_compiled_model_matches_eager_in_serial_mode():
    torch.manual_seed(0)
    model, x = ConvMlp().eval(), torch.randn(4, 8, 20, 20)
    with torch.no_grad(), two_threads():
        want = model(x)
        compiled = torch.compile(model, backend="tt_infer")
        compiled(x)
        with serial_for(10_000):
            got = compiled(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("ms", [0, -5])
def test_ending_serial_mode(ms):
    _testing.force_serial_for(10_000)
    _testing.force_serial_for(ms)
    assert not _testing.serial_now()


# (kernel, x shape, weight shape, groups, pads): each big enough for a team of 2 threads
TEAM_CONVS = [
    ("depthwise", (1, 96, 40, 40), (96, 1, 3, 3), 96, [1] * 4),
    ("patch", (1, 24, 40, 40), (144, 24, 1, 1), 1, [0] * 4),
    ("winograd", (1, 64, 16, 16), (64, 64, 3, 3), 1, [1] * 4),
]


@pytest.mark.parametrize("case", TEAM_CONVS, ids=[c[0] for c in TEAM_CONVS])
def test_the_conv_kernels_parallel_regions_are_timed(case):
    """An engine of convolutions only (MobileNetV2's) has no other parallel region: its kernels'
    regions must report their times, or stalls there never start serial mode."""
    kernel, x_shape, w_shape, groups, pads = case
    x = torch.randn(x_shape).contiguous(memory_format=torch.channels_last)
    weight, bias = torch.randn(w_shape), torch.randn(w_shape[0])
    h = x_shape[2] + pads[0] + pads[2] - w_shape[2] + 1
    out = torch.empty(1, w_shape[0], h, h).contiguous(memory_format=torch.channels_last)
    with two_threads():
        _testing.force_serial_for(0)  # a real stall on a loaded machine would run them inline
        calls, regions = _testing.conv_kernel_calls(kernel), _testing.noted_region_count()
        _testing.conv(x, weight, bias, [1, 1], pads, [1, 1], groups, out, 3, True)
        assert _testing.conv_kernel_calls(kernel) == calls + 1
        assert _testing.noted_region_count() > regions
    want = torch.conv2d(x, weight, bias, padding=pads[:2], groups=groups)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


# (kernel, batch, m, n, k, B constant): each big enough for a team of 2 threads. A constant B is
# shared by the batch (batch stride 0), a computed one is per batch entry (attention's heads).
TEAM_GEMMS = [
    ("panels", 1, 96, 256, 256, True),   # a weight, packed once: packed_gemm
    ("panels", 4, 64, 128, 64, False),   # a computed B, packed per call: per_call_gemm
    ("mkl", 1, 8, 1024, 256, True),      # few rows: column blocks, one per thread
    ("mkl", 4, 64, 64, 64, False),       # several heads: one GEMM per task
]


def _sgemm(batch, m, n, k, b_constant, repeat=1):
    a = torch.randn(batch, m, k)
    b = torch.randn(1 if b_constant else batch, k, n)
    c = torch.full((batch, m, n), float("nan"))
    _testing.sgemm(batch, m, n, k, 1.0, a, k, m * k, False, b, n, 0 if b_constant else k * n, False, 0.0,
                   c, n, m * n, pack=b_constant, repeat=repeat)
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", TEAM_GEMMS, ids=[f"{c[0]}-{'constant' if c[5] else 'computed'}" for c in TEAM_GEMMS])
def test_the_gemm_kernels_parallel_regions_are_timed(case):
    """A GEMM-only engine (the MLP block) had no timed region: at load 4-5 it ran 24 ms a call at 2
    threads, 0 stalls counted, against 0.13-0.16 ms serially."""
    kernel, *shape = case
    if kernel == "panels" and not PANELS_USABLE:
        pytest.skip("the panels kernel needs AVX2 and FMA")
    with two_threads():
        _testing.force_serial_for(0)  # a real stall on a loaded machine would run them inline
        _testing.set_gemm_backend(kernel)
        try:
            calls, regions = _testing.gemm_kernel_calls(kernel), _testing.noted_region_count()
            _sgemm(*shape)
            assert _testing.gemm_kernel_calls(kernel) == calls + 1
            assert _testing.noted_region_count() > regions
        finally:
            _testing.set_gemm_backend("")


def test_serial_mode_reaches_the_gemms_of_a_call_under_way():
    """Engine::execute decides serial mode once per call; a stall within the call starts it for the
    rest: its GEMMs (MKL's own threads included) then run on one thread too. A T5 b8 call that
    started parallel took ~1 s under load instead of ~150 ms serially."""
    m, n, k = 104, 200, 168  # a shape no other test uses (and not tiny): its GEMM choice is made here
    with two_threads():
        _testing.set_gemm_backend("")  # forget the choices so far
        with serial_for(10_000):
            # a choice is listed once sampled: each candidate's first call at the shape is cold (no
            # sample), and where oneDNN runs there are 4 candidates, 2 of them only from the second call
            _sgemm(1, m, n, k, True, repeat=12)
            assert torch.get_num_threads() == 2
    shapes = [row["shape"] for row in blade._C.gemm_choices() if row["shape"].startswith(f"[{m}, {k}] @ [{k}, {n}]")]
    assert shapes and all(", 1 thread" in shape for shape in shapes), shapes


def test_in_a_serial_window_an_engine_runs_the_mode_its_calls_measured_faster():
    """Stalls alone kept MobileNetV2 b1 serial at 20% of a core taken by a neighbour, 1.7x slower than
    its parallel calls there; each engine now picks by its own calls' times (per input element),
    trying the other mode at the 16th call of the window, then 32 calls later, 64, ..."""
    untimed = _testing.call_mode_choices([], 3)
    assert untimed[0]  # serial not timed yet: tried first
    assert _testing.call_mode_choices([(False, 2_000_000, 1000)], 1) == [True]
    tries = [16, 48, 112]
    parallel_faster = _testing.call_mode_choices([(False, 2_000_000, 1000), (True, 4_000_000, 1000)], 200)
    assert [i for i, serial in enumerate(parallel_faster) if serial] == tries
    serial_faster = _testing.call_mode_choices([(False, 6_000_000, 1000), (True, 4_000_000, 1000)], 200)
    assert [i for i, serial in enumerate(serial_faster) if not serial] == tries
    # a larger input's serial call is cheaper per element than a smaller one's parallel call
    assert _testing.call_mode_choices([(False, 2_000_000, 1000), (True, 4_000_000, 4000)], 1) == [True]
    # the chosen mode's average follows its recent calls: parallel calls that became slow lose
    drifting = [(False, 2_000_000, 1000), (True, 4_000_000, 1000)] + [(False, 9_000_000, 1000)] * 12
    assert _testing.call_mode_choices(drifting, 1) == [True]


def test_one_try_at_the_other_mode_shows_a_lighter_load():
    """Parallel calls averaged 100 ms under a heavy load, serial ones 8 ms; then the load eases
    (parallel 3 ms, serial 5 ms). The first try at parallel calls (the 16th) replaces their average,
    and from then on the engine runs parallel, trying serial again 16 calls later."""
    heavy = [(False, 100_000_000, 1024), (True, 8_000_000, 1024)]
    choices = _testing.call_mode_choices(heavy, 60, serial_ns=5_000_000, parallel_ns=3_000_000)
    assert all(choices[:16]) and not choices[16]
    assert [i for i, serial in enumerate(choices) if serial and i > 16] == [33]
    # and back: the load returns (parallel calls 100 ms, serial 8): one slow parallel call lifts the
    # parallel average past the serial one; the try at parallel calls 16 calls later confirms it
    light = [(False, 3_000_000, 1024), (True, 5_000_000, 1024)]
    choices = _testing.call_mode_choices(light, 40, serial_ns=8_000_000, parallel_ns=100_000_000)
    assert [i for i, serial in enumerate(choices) if not serial] == [0, 17]


def test_serial_windows_can_be_turned_off_for_measurements():
    with serial_for(10_000):
        assert _testing.serial_now()
        _testing.set_serial_windows(False)
        try:
            assert not _testing.serial_now()
        finally:
            _testing.set_serial_windows(True)
        assert _testing.serial_now()
