"""``opacus.data_loader``: DPDataLoader (implementation: dptorch.data)."""

from dptorch.compat.opacus import DPDataLoader

__all__ = ["DPDataLoader"]
