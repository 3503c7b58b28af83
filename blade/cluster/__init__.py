"""Clustering: the lowering table, the partitioner and the splice (TorchScript-specific)."""
