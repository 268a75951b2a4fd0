"""``opacus.distributed``: DifferentiallyPrivateDistributedDataParallel (see dptorch.opacus_compat)."""

from dptorch.opacus_compat import DifferentiallyPrivateDistributedDataParallel

__all__ = ["DifferentiallyPrivateDistributedDataParallel"]
