"""The built-in layer families, one file each holding all of that layer's math: grad sampler and,
where the layer has them, norm sampler, clipped sum and linear form (linear, embedding, hf_conv1d,
conv, norms, and the expert banks of mixture-of-experts models: experts). Importing this package registers
them; the package ``dptorch.grad_sample`` imports it.
"""

from dptorch.grad_sample.layers import conv, embedding, experts, hf_conv1d, linear, norms  # noqa: F401  (import registers)
