"""Runnable examples: ``dptorch example <name>`` or ``python -m dptorch.cli.examples.<name>``."""
