"""``opacus.layers``' submodules that dptorch serves (``dp_rnn``, ``dp_multihead_attention``); the package
itself is :mod:`dptorch.layers`."""
