"""Poisson-subsampled data loading and physical batching for DP-SGD; static-shape batch selections
(truncated Poisson padded to a fixed maximum, fixed-size sampling without replacement)."""

from dptorch.data.memory_manager import BatchMemoryManager, PhysicalBatchLoader
from dptorch.data.poisson import DPDataLoader, EmptyBatchCollate, PoissonBatchSampler, empty_batch_like
from dptorch.data.cyclic_poisson import CyclicPoissonBatchSampler, CyclicPoissonDataLoader
from dptorch.data.fixed_size import FixedSizeBatchSampler, FixedSizeDataLoader
from dptorch.data.truncated_poisson import TruncatedPoissonBatchSampler, TruncatedPoissonDataLoader

__all__ = [
    "BatchMemoryManager",
    "CyclicPoissonBatchSampler",
    "CyclicPoissonDataLoader",
    "DPDataLoader",
    "EmptyBatchCollate",
    "FixedSizeBatchSampler",
    "FixedSizeDataLoader",
    "PhysicalBatchLoader",
    "PoissonBatchSampler",
    "TruncatedPoissonBatchSampler",
    "TruncatedPoissonDataLoader",
    "empty_batch_like",
]
