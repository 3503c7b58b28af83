"""The first call at a larger shape than any before costs no page faults in the engine's scratch
(issue 12): an engine with run-time sizes plans its scratch arena at the size symbols' maxima, and
the runtime makes that arena resident when the engine is loaded (cpp/scratch_pool.h), so a served
archive's call at a new largest shape touches no fresh scratch pages. Counted, not timed: the
minor page faults (getrusage) of that call in a fresh process."""
from __future__ import annotations

import pytest
import torch

import blade
from aot_testing import run_python

ROWS_MAX, HIDDEN = 4096, 2048  # the arena holds relu(up(x)): [4096, 2048] float32 = 32 MiB


class Wide(torch.nn.Module):
    """A wide intermediate and a narrow output: the scratch is nearly all of a call's memory."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, HIDDEN), torch.nn.Linear(HIDDEN, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


# Served in a fresh process: a call at 8 rows, then the faults of the first call at 4096 rows.
SCRIPT = """
import resource, torch, blade
torch.set_num_threads(1)
served = blade.load({path!r})
small, large = torch.randn(8, 64), torch.randn({rows}, 64)
with torch.no_grad():
    served(small)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    served(large)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("wide") / "wide.blade.pt"
    rows = torch.export.Dim("rows", min=1, max=ROWS_MAX)
    blade.export(Wide().eval(), (torch.randn(16, 64),), str(path), dynamic_shapes={"x": {0: rows}})
    return path


def test_first_call_at_the_largest_shape_faults_in_no_scratch(archive):
    faults = int(run_python(SCRIPT.format(path=str(archive), rows=ROWS_MAX)).strip().splitlines()[-1])
    scratch_pages = ROWS_MAX * HIDDEN * 4 // 4096  # 8192 pages: what the call faulted in before
    # What is left: the output ([4096, 8]: 32 pages) and the runtime's own per-shape buffers.
    assert faults < scratch_pages // 8, f"{faults} page faults in the first call at {ROWS_MAX} rows"
