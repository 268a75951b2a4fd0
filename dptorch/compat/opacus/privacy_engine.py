"""``opacus.privacy_engine``: PrivacyEngine (see dptorch.compat.opacus)."""

from dptorch.compat.opacus import PrivacyEngine

__all__ = ["PrivacyEngine"]
