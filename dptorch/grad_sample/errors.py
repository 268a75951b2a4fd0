"""Errors raised by per-sample gradient capture; each message names the module and the fix."""


class PerSampleGradientError(RuntimeError):
    """Per-sample gradients cannot be computed exactly for some module or call."""


class UnsupportedModuleError(ValueError, NotImplementedError):
    """A module in the model is incompatible with per-sample gradient capture (also a ``NotImplementedError``,
    which Opacus raises there)."""
