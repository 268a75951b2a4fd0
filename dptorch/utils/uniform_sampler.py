"""``opacus.utils.uniform_sampler``: the Poisson samplers under Opacus' names (see dptorch.opacus_compat)."""

from dptorch.opacus_compat import DistributedUniformWithReplacementSampler, UniformWithReplacementSampler

__all__ = ["DistributedUniformWithReplacementSampler", "UniformWithReplacementSampler"]
