"""Runnable examples: python -m dptorch.examples.<name>."""
