"""blade's engine compiler: ONNX cluster -> generated C++ -> g++ -> engine .so + manifest.

Contract (DESIGN.md #2): nothing under blade/engine imports torch. It reads an ONNX file and options
and writes a shared object and a JSON manifest; it can be tested alone against numpy.
"""
