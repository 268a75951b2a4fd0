"""``opacus.grad_sample.linear``: ``compute_linear_grad_sample``, dptorch's grad sampler of ``nn.Linear``
(``(module, activations, backprops) -> {param: per-sample gradient}``, Opacus' signature)."""

from dptorch.grad_sample.layers.linear import linear_grad_sampler as compute_linear_grad_sample

__all__ = ["compute_linear_grad_sample"]
