"""blade: a TorchScript clustering compiler for CPU inference (placeholder during bootstrap)."""
