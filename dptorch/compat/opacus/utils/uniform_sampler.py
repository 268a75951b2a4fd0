"""``opacus.utils.uniform_sampler``: the Poisson samplers under Opacus' names (see dptorch.compat.opacus)."""

from dptorch.compat.opacus import DistributedUniformWithReplacementSampler, UniformWithReplacementSampler

__all__ = ["DistributedUniformWithReplacementSampler", "UniformWithReplacementSampler"]
