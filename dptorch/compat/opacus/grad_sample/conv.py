"""``opacus.grad_sample.conv``: dptorch's grad sampler of the convolutions, under Opacus' names.

``compute_conv_grad_sample`` and ``convolution2d_backward_as_a_convolution`` (Opacus' second algorithm
for ``nn.Conv2d``) are both dptorch's ``conv_grad_sampler``: the same per-sample gradients, one method.
"""

from dptorch.grad_sample.layers.conv import conv_grad_sampler as compute_conv_grad_sample

convolution2d_backward_as_a_convolution = compute_conv_grad_sample

__all__ = ["compute_conv_grad_sample", "convolution2d_backward_as_a_convolution"]
