"""Built-in grad samplers, one file per layer family. Importing this package registers them."""

from dptorch.grad_sample.layers import conv, embedding, hf_conv1d, linear, norms  # noqa: F401  (import registers)
