import os
import sys

import pytest

# The e2e helpers (blade_testing: assert_close, Capture) serve these tests too.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "e2e"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from scratch: no graph of another test is reused or recompiled."""
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
