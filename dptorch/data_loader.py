"""``opacus.data_loader``: DPDataLoader (implementation: dptorch.data)."""

from dptorch.opacus_compat import DPDataLoader

__all__ = ["DPDataLoader"]
