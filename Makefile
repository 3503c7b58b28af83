# blade's two entry points. Both create .venv (torch 2.13.0 CPU wheel, onnx, numpy, pybind11),
# build blade's C++ runtime into it, then run.
#   make demo   compile a transformers BERT with tt_infer, compare with eager, time it, export it,
#               and run the exported artifact in a fresh process
#   make test   the test suite (without the tests marked slow: pytest -m slow tests runs those)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Pinned so that a fresh machine gets exactly what CI tested. ml_dtypes (onnx's dependency, imported
# by every engine-compile subprocess through `import onnx`): 0.7.0 takes 1.6 s of CPU to import
# where 0.6.0 takes 0.2 s, which made the test suite 21 min instead of 12 on 2 cores.
DEPS := torch==2.13.0 onnx==1.23.2 ml_dtypes==0.6.0 numpy==2.4.6 pybind11==3.1.0 ninja==1.13.2 setuptools wheel
# torch's OpInfo database (tests/conformance) imports expecttest
CONFORMANCE_DEPS := expecttest==0.3.0
TEST_DEPS := pytest==9.2.0 pytest-xdist==3.8.0 transformers==5.23.0 $(CONFORMANCE_DEPS)
export MAX_JOBS ?= 2

.PHONY: demo test setup clean bench conformance
demo: $(VENV)/.built
	$(PY) examples/demo.py

test: $(VENV)/.built
	$(PY) -m pip install -q $(CONFORMANCE_DEPS)   # a .venv made before tests/conformance lacks it
	$(PY) -m pytest -q -n 2 -p no:cacheprovider -m "not slow" tests

setup: $(VENV)/.built

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(DEPS) $(TEST_DEPS)
	touch $@

# Rebuild the extension whenever the C++ sources or the build script change.
$(VENV)/.built: $(VENV)/.deps setup.py $(wildcard cpp/*.h cpp/*.cpp)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

clean:
	rm -rf $(VENV) build blade/*.so blade.egg-info

# Speed lives here, not in tests: eager / TorchScript / Inductor (default, frozen) / ONNX Runtime /
# tt_infer on the models (bench/RESULTS.md), then every elementwise/reduction op (bench/OPS.md).
bench: $(VENV)/.built
	$(PY) -m pip install -q onnxruntime==1.31.1 onnxscript==0.7.2
	$(PY) bench/run.py
	$(PY) bench/ops.py

# The whole OpInfo differential sweep (tests/conformance): every op of torch's OpInfo database,
# 2 samples per op and dtype, through tt_infer with engines forced on, vs eager. Writes the
# summary table to bench/CONFORMANCE.md (per-case results in bench/CONFORMANCE.jsonl). Exits
# non-zero on a FAIL or XPASS group.
conformance: $(VENV)/.built
	$(PY) -m pip install -q $(CONFORMANCE_DEPS)
	COMPILE_PARALLELISM=1 $(PY) -m tests.conformance.opinfo_sweep --samples 2 --out bench/CONFORMANCE.md
