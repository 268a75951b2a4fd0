"""Poisson-subsampled data loading and physical batching for DP-SGD."""

from dptorch.data.memory_manager import BatchMemoryManager, PhysicalBatchLoader
from dptorch.data.poisson import DPDataLoader, EmptyBatchCollate, PoissonBatchSampler, empty_batch_like
from dptorch.data.cyclic_poisson import CyclicPoissonBatchSampler, CyclicPoissonDataLoader

__all__ = [
    "BatchMemoryManager",
    "CyclicPoissonBatchSampler",
    "CyclicPoissonDataLoader",
    "DPDataLoader",
    "EmptyBatchCollate",
    "PhysicalBatchLoader",
    "PoissonBatchSampler",
    "empty_batch_like",
]
