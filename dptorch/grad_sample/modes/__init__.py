"""How each mode computes per-sample results from what the controller captured.

``names.py`` the modes and loss reductions; ``strategies.py`` the two strategies (instantiate
per-sample gradients: "hooks", "functorch", "ew"; book-keeping: "bk", "ghost"); ``functorch.py`` the
torch.func replay of a layer without a sampler; ``expanded_weights.py`` torch's own ("ew");
``linear_head.py`` the replay of a router-like layer; ``stacked_calls.py`` small calls of one layer
configuration sampled as one; ``buffers.py`` the CPU memory lent to per-sample gradients;
``auto.py`` ``grad_sample_mode="auto"``.
"""
