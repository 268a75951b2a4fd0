"""``opacus.optimizers``: the DP optimizer under Opacus' class names (implementation: dptorch.optim)."""

from dptorch.compat.opacus import (
    OPTIMIZERS_UNMAPPED,
    AdaClipDPOptimizer,
    DistributedDPOptimizer,
    DistributedDPOptimizerFastGradientClipping,
    DistributedPerLayerOptimizer,
    DPOptimizer,
    DPOptimizerFastGradientClipping,
    DPPerLayerOptimizer,
    SimpleDistributedPerLayerOptimizer,
    get_optimizer_class,
    unmapped_names,
)

__all__ = [
    "AdaClipDPOptimizer",
    "DPOptimizer",
    "DPOptimizerFastGradientClipping",
    "DPPerLayerOptimizer",
    "DistributedDPOptimizer",
    "DistributedDPOptimizerFastGradientClipping",
    "DistributedPerLayerOptimizer",
    "SimpleDistributedPerLayerOptimizer",
    "get_optimizer_class",
]
__getattr__ = unmapped_names(__name__, OPTIMIZERS_UNMAPPED)
