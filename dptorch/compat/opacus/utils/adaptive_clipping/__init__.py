"""``opacus.utils.adaptive_clipping``: Opacus' adaptive-clipping engine (``adaptive_clipping_utils``)."""
