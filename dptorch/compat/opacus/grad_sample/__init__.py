"""``opacus.grad_sample``'s submodules that dptorch serves (``grad_sample_module``, ``utils``); the package
itself is :mod:`dptorch.grad_sample`."""
