import os
import tempfile

# One engine cache per test session: tests share compiled engines but never touch ~/.cache. The
# process that makes it (pytest's controller, whose environment xdist's workers inherit) holds it
# here, and tempfile removes it when that process exits, so runs leave nothing behind.
if "BLADE_CACHE_DIR" not in os.environ:
    SESSION_CACHE = tempfile.TemporaryDirectory(prefix="blade-test-cache-")
    os.environ["BLADE_CACHE_DIR"] = SESSION_CACHE.name
