"""``opacus.privacy_engine``: PrivacyEngine (see dptorch.opacus_compat)."""

from dptorch.opacus_compat import PrivacyEngine

__all__ = ["PrivacyEngine"]
