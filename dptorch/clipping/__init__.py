"""Clipping: the rules that turn per-unit gradient norms into clip factors.

* ``factors``: pure functions from norms to factors (flat, per-layer, automatic), non-finite units,
  the bound on a clipped contribution;
* ``adaptive``: the settings of adaptive clipping (Andrew et al. 2021) and the split of the noise
  between the gradient and the count of unclipped units;
* ``checks``: the clipping arguments refused before anything is attached.
"""

from dptorch.clipping.adaptive import AdaptiveClipping
from dptorch.clipping.checks import check_clipping
from dptorch.clipping.factors import CLIPPING_MODES, NonFiniteGradientWarning, clip_factors

__all__ = ["AdaptiveClipping", "CLIPPING_MODES", "NonFiniteGradientWarning", "check_clipping", "clip_factors"]
