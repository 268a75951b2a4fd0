"""``opacus.utils.batch_memory_manager``: BatchMemoryManager, wrap_data_loader (see dptorch.compat.opacus)."""

from dptorch.compat.opacus import BatchMemoryManager, wrap_data_loader

__all__ = ["BatchMemoryManager", "wrap_data_loader"]
