import os
import sys
import tempfile

import pytest

# One engine cache per test session: tests share compiled engines but never touch ~/.cache.
os.environ.setdefault("BLADE_CACHE_DIR", tempfile.mkdtemp(prefix="blade-test-cache-"))
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _reset_dynamo():
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
