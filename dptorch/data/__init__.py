"""Poisson-subsampled data loading and physical batching for DP-SGD."""

from dptorch.data.memory_manager import BatchMemoryManager, PhysicalBatchLoader
from dptorch.data.poisson import DPDataLoader, EmptyBatchCollate, PoissonBatchSampler, empty_batch_like

__all__ = [
    "BatchMemoryManager",
    "DPDataLoader",
    "EmptyBatchCollate",
    "PhysicalBatchLoader",
    "PoissonBatchSampler",
    "empty_batch_like",
]
