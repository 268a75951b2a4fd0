"""``opacus.utils.fast_gradient_clipping_utils``: DPLossFastGradientClipping (see dptorch.compat.opacus).

Opacus' loss returns a ``DPTensorFastGradientClipping`` whose ``backward()`` runs two passes; dptorch's
returns an ordinary loss tensor (one backward pass in every mode), so that class is refused when built.
"""

from typing import Any

from dptorch.compat.opacus import DPLossFastGradientClipping, OpacusCompatibilityError


class DPTensorFastGradientClipping:
    """Opacus' two-pass loss tensor: refused when built (dptorch's loss is an ordinary tensor)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise OpacusCompatibilityError(
            "opacus.utils.fast_gradient_clipping_utils.DPTensorFastGradientClipping has no dptorch counterpart: "
            "DPLossFastGradientClipping(module, optimizer, criterion)(output, target) returns an ordinary loss "
            "tensor, and loss.backward() is one pass in every mode (see docs/migrating-from-opacus.md)"
        )


__all__ = ["DPLossFastGradientClipping", "DPTensorFastGradientClipping"]
