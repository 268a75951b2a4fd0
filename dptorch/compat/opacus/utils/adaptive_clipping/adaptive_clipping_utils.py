"""``opacus.utils.adaptive_clipping.adaptive_clipping_utils``: ``PrivacyEngineAdaptiveClipping``, a
:class:`PrivacyEngine` whose ``make_private`` clips adaptively (``clipping="adaptive"``, dptorch's
AdaClip in every grad sample mode, ghost included) with Opacus' defaults for the bound's search."""

from __future__ import annotations

from typing import Any

from dptorch.compat.opacus import PrivacyEngine


class PrivacyEngineAdaptiveClipping(PrivacyEngine):
    """``make_private(target_unclipped_quantile=, min_clipbound=, max_clipbound=, clipbound_learning_rate=, ...)``
    is ``PrivacyEngine.make_private(clipping="adaptive", ...)``; ``max_grad_norm`` is the starting bound."""

    def make_private(self, *, target_unclipped_quantile: float = 0.5, min_clipbound: float = 1.0,
                     max_clipbound: float = 1e8, clipbound_learning_rate: float = 0.2, **kwargs: Any) -> Any:
        clipping = kwargs.pop("clipping", "adaptive")
        if clipping != "adaptive":
            raise ValueError(f"PrivacyEngineAdaptiveClipping clips adaptively; got clipping={clipping!r} "
                             "(use PrivacyEngine for other clipping modes)")
        return super().make_private(clipping="adaptive", target_unclipped_quantile=target_unclipped_quantile,
                                    min_clipbound=min_clipbound, max_clipbound=max_clipbound,
                                    clipbound_learning_rate=clipbound_learning_rate, **kwargs)


__all__ = ["PrivacyEngineAdaptiveClipping"]
