"""``opacus.utils.batch_memory_manager``: BatchMemoryManager, wrap_data_loader (see dptorch.opacus_compat)."""

from dptorch.opacus_compat import BatchMemoryManager, wrap_data_loader

__all__ = ["BatchMemoryManager", "wrap_data_loader"]
