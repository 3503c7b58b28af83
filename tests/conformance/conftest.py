import os
import tempfile

# One engine cache per test session: tests share compiled engines but never touch ~/.cache.
os.environ.setdefault("BLADE_CACHE_DIR", tempfile.mkdtemp(prefix="blade-test-cache-"))
